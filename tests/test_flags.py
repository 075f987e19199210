"""Every flag a script offers is one it reads: each script trains a few short runs whose settings
between them touch every option (RND, symmetry, images, a GRU student, ...) with arguments that
record which fields the scripts' code reads. A field no run reads is a flag that does nothing: the
test fails and names it."""

import dataclasses
import os
import sys

import pytest
import torch

import arguments
import distill_ddp
import ppo_amp_ddp
import ppo_ddp
import ppo_rnn_ddp
from dist_helpers import small_args

# Read only where an optional service is on, which these runs do not start (tests/test_loggers.py
# does).
ELSEWHERE = {
    "logger_project": "--logger wandb or neptune",
    "dist_timeout_s": "main, with several processes (tests/dist_helpers.py FAR_TIMEOUT)",
    "start_timeout_s": "main, with several processes (tests/test_bad_input.py)",
}


# Functions that read every field of an `Args` (and its groups), whatever the run does.
READ_ALL = {
    "out_of_range",
    "as_flags",
    "has_field",
    "get",
    "with_values",
    "fields_of",
    "small_args",
}


def recording(args_type: type, read: set[str]) -> type:
    """`args_type` whose instances add to `read` the name of every field the project's code reads;
    not the reads of `dataclasses` (asdict: the start-up agreement, checkpoints) nor those of
    READ_ALL."""
    names = {field.name for field in dataclasses.fields(args_type)}

    def __getattribute__(self, name: str):  # noqa: N807 - the attribute hook
        caller = sys._getframe(1).f_code
        if (
            name in names
            and os.path.basename(caller.co_filename) != "dataclasses.py"
            and caller.co_name not in READ_ALL
        ):
            read.add(name)
        return object.__getattribute__(self, name)

    return type(
        f"Recording{args_type.__name__}", (args_type,), {"__getattribute__": __getattribute__}
    )


def recorded_args(args_type: type, read: set[str], **values) -> object:
    """An `args_type` with `values` set whose groups (run, dist, speed, ...) record their reads
    too."""
    groups = {
        f.name: f.type
        for f in dataclasses.fields(args_type)
        if dataclasses.is_dataclass(getattr(args_type(), f.name))
    }
    plain = args_type()
    recorded = recording(args_type, read)(
        **{name: recording(type(getattr(plain, name)), read)() for name in groups}
    )
    return arguments.with_values(recorded, values)


def all_fields(args_type: type) -> set[str]:
    """Every flag of `args_type`: its own fields but its groups, and the fields of each group."""
    plain, names = args_type(), set()
    for field in dataclasses.fields(args_type):
        value = getattr(plain, field.name)
        names |= (
            {f.name for f in dataclasses.fields(value)}
            if dataclasses.is_dataclass(value)
            else {field.name}
        )
    return names


def unread(main, args_type: type, runs: list[dict], tmp_path) -> set[str]:
    """The flags of `args_type` that no run of `main` with the settings `runs` reads."""
    read: set[str] = set()
    small = {"num_envs": 8, "steps_per_env": 8, "iterations": 2, "logger": "none"}
    for i, overrides in enumerate(runs):
        main(
            recorded_args(
                args_type, read, **{**small, "run_dir": str(tmp_path / str(i)), **overrides}
            )
        )
    return all_fields(args_type) - read - set(ELSEWHERE)


def test_a_flag_no_code_reads_is_found(tmp_path):
    """The check itself: a field added to PPO's arguments and read nowhere is reported."""

    @dataclasses.dataclass
    class WithAnUnusedFlag(ppo_ddp.Args):
        layer_norm: bool = False

    assert "layer_norm" in unread(ppo_ddp.main, WithAnUnusedFlag, [{}], tmp_path)


def test_every_ppo_flag_is_read(tmp_path):
    extensions = {"rnd_weight": 1.0, "rnd_normalize_rewards": True, "rnd_schedule": "linear"}
    extensions |= {
        "rnd_schedule_steps": (0, 64),
        "scale_rewards": True,
        "symmetry": "envs.mirrors:pendulum",
    }
    extensions |= {"symmetry_augment": True, "symmetry_mirror_loss": 0.1, "schedule": "linear"}
    images = {
        "task": "pendulum_image",
        "actor_obs": ("policy", "image"),
        "critic_obs": ("policy", "image"),
    }
    assert unread(ppo_ddp.main, ppo_ddp.Args, [{}, extensions, images], tmp_path) == set()


def test_every_recurrent_ppo_flag_is_read(tmp_path):
    assert unread(ppo_rnn_ddp.main, ppo_rnn_ddp.Args, [{}], tmp_path) == set()


def test_every_amp_flag_is_read(tmp_path):
    runs = [{"disc_batch_size": 64}, {"disc_batch_size": 64, "compile": "eager"}]
    assert unread(ppo_amp_ddp.main, ppo_amp_ddp.Args, runs, tmp_path) == set()


@pytest.mark.parametrize("student", ["gru"])
def test_every_distillation_flag_is_read(tmp_path, student):
    runs = [{"eval_envs": 4}, {"student": student, "eval_envs": 4}]
    assert unread(distill_ddp.main, distill_ddp.Args, runs, tmp_path) == set()


def test_amp_compiles_its_actor_and_critic_with_compile(tmp_path):
    """`ppo_amp_ddp.py --compile` compiles, as ppo_ddp.py's (torch.compile's `eager` backend:
    dynamo's graph capture, no C++ compiler needed)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # a step compiled by an earlier test of this process would be reused
    before = counters["stats"]["unique_graphs"]
    small = {
        "num_envs": 8,
        "steps_per_env": 8,
        "iterations": 1,
        "logger": "none",
        "run_dir": str(tmp_path),
    }
    ppo_amp_ddp.main(small_args(ppo_amp_ddp.Args, **small, disc_batch_size=64, compile="eager"))
    assert counters["stats"]["unique_graphs"] > before
