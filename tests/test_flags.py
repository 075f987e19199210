"""Every flag a script offers is one it reads: each script trains a few short runs whose settings between them
touch every option (RND, symmetry, images, a GRU student, ...) with arguments that record which fields the
scripts' code reads. A field no run reads is a flag that does nothing: the test fails and names it."""

import dataclasses
import os
import sys

import pytest
import torch

import distill_ddp
import ppo_amp_ddp
import ppo_ddp
import ppo_rnn_ddp

# Read only where an optional service is on, which these runs do not start (tests/test_loggers.py does).
ELSEWHERE = {"logger_project": "--logger wandb or neptune"}
IMAGES = {"policy": torch.zeros(4, 1), "image": torch.zeros(4, 1, 16, 16)}


def recording(args_type: type, read: set[str]) -> type:
    """`args_type` whose instances add to `read` the name of every field the project's code reads; not the
    reads of `dataclasses` (asdict: the start-up agreement, checkpoints) nor of the range check, which read all."""
    names = {field.name for field in dataclasses.fields(args_type)}

    def __getattribute__(self, name: str):  # noqa: N807 - the attribute hook
        caller = sys._getframe(1).f_code
        if (
            name in names
            and os.path.basename(caller.co_filename) != "dataclasses.py"
            and caller.co_name != "out_of_range"
        ):
            read.add(name)
        return object.__getattribute__(self, name)

    return type(f"Recording{args_type.__name__}", (args_type,), {"__getattribute__": __getattribute__})


def unread(main, args_type: type, runs: list[dict], tmp_path, networks=None) -> set[str]:
    """The fields of `args_type` that no run of `main` with the settings `runs` reads (nor `networks`, a
    function called with recording arguments)."""
    read: set[str] = set()
    recorded = recording(args_type, read)
    small = {"num_envs": 8, "steps_per_env": 8, "iterations": 2, "logger": "none"}
    for i, overrides in enumerate(runs):
        main(recorded(**{**small, "run_dir": str(tmp_path / str(i)), **overrides}))
    if networks is not None:
        networks(recorded(**small))
    return {field.name for field in dataclasses.fields(args_type)} - read - set(ELSEWHERE)


def test_a_flag_no_code_reads_is_found(tmp_path):
    """The check itself: a field added to PPO's arguments and read nowhere is reported."""

    @dataclasses.dataclass
    class WithAnUnusedFlag(ppo_ddp.Args):
        layer_norm: bool = False

    assert "layer_norm" in unread(ppo_ddp.main, WithAnUnusedFlag, [{}], tmp_path)


def test_every_ppo_flag_is_read(tmp_path):
    extensions = {
        "rnd_weight": 1.0, "rnd_normalize_rewards": True, "rnd_schedule": "linear", "rnd_schedule_steps": (0, 64),
        "scale_rewards": True, "symmetry": "envs.mirrors:pendulum", "symmetry_augment": True,
        "symmetry_mirror_loss": 0.1, "schedule": "linear",
    }  # fmt: skip
    images = {"task": "pendulum_image", "actor_obs": ("policy", "image"), "critic_obs": ("policy", "image")}
    assert unread(ppo_ddp.main, ppo_ddp.Args, [{}, extensions, images], tmp_path) == set()


def test_every_recurrent_ppo_flag_is_read(tmp_path):
    assert unread(ppo_rnn_ddp.main, ppo_rnn_ddp.Args, [{}, {"scale_rewards": True}], tmp_path) == set()


def test_every_amp_flag_is_read(tmp_path):
    """AMP is PPO's training with its discriminator plugged in: PPO's flags, the extensions' and the image
    encoders' included (an AMP task with an image group builds the encoders as PPO does)."""
    runs = [{"disc_batch_size": 64}, {"rnd_weight": 1.0, "scale_rewards": True, "symmetry": "envs.mirrors:pendulum",
             "symmetry_augment": True, "disc_batch_size": 64, "compile": "eager"}]  # fmt: skip

    def networks(args: ppo_amp_ddp.Args) -> None:
        ppo_amp_ddp.AMP.make_networks(IMAGES, 1, dataclasses.replace(args, actor_obs=("policy", "image")))

    assert unread(ppo_amp_ddp.main, ppo_amp_ddp.Args, runs, tmp_path, networks) == set()


@pytest.mark.parametrize("student", ["gru"])
def test_every_distillation_flag_is_read(tmp_path, student):
    runs = [{"eval_envs": 4}, {"student": student, "eval_envs": 4}]
    assert unread(distill_ddp.main, distill_ddp.Args, runs, tmp_path) == set()


def test_amp_compiles_its_actor_and_critic_with_compile(tmp_path):
    """`ppo_amp_ddp.py --compile` compiles, as ppo_ddp.py's (torch.compile's `eager` backend: dynamo's graph capture,
    no C++ compiler needed)."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    args = ppo_amp_ddp.Args(num_envs=8, steps_per_env=8, iterations=1, logger="none", run_dir=str(tmp_path))
    ppo_amp_ddp.main(dataclasses.replace(args, disc_batch_size=64, compile="eager"))
    assert counters["stats"]["unique_graphs"] > before
