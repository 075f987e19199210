"""The command line of the training scripts: each argument's range, on its field; the option
groups; parsing, with the settings a task brings. Local.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import tyro


@dataclass(frozen=True)
class Range:
    """The values an argument may take, on its field as `Annotated[type, Range(...)]`; every one of
    a tuple's values must be in it."""

    low: float = 0.0
    high: float = math.inf
    above: bool = False  # `low` itself is out: strictly above it

    def admits(self, value: Any) -> bool:
        if isinstance(value, tuple):
            return all(self.admits(v) for v in value)
        return (value > self.low if self.above else value >= self.low) and value <= self.high

    def __str__(self) -> str:
        if self.high < math.inf:
            return f"in [{self.low:g}, {self.high:g}]"
        if self.above:
            return f"above {self.low:g}"
        return f"at least {self.low:g}" if self.low else "0 or more"


Count = Annotated[int, Range(1)]  # at least 1
Widths = Annotated[tuple[int, ...], Range(1)]  # layer widths, each at least 1
Positive = Annotated[float, Range(0.0, above=True)]  # above 0
NonNegative = Annotated[float, Range(0.0)]  # 0 or more
Fraction = Annotated[float, Range(0.0, 1.0)]  # in [0, 1]


def out_of_range(args: Any) -> list[str]:
    """Every field of `args` (its groups' too) outside its `Range`, as `--flag value (must be
    ...)`."""
    bad = []
    for name, hint in typing.get_type_hints(type(args), include_extras=True).items():
        value = getattr(args, name)
        if dataclasses.is_dataclass(value):
            bad += out_of_range(value)
        for rule in getattr(hint, "__metadata__", ()):
            if isinstance(rule, Range) and not rule.admits(value):
                shown = " ".join(map(str, value)) if isinstance(value, tuple) else value
                bad.append(f"--{name.replace('_', '-')} {shown} (must be {rule})")
    return bad


def check_args(args: Any) -> None:
    """One ValueError naming every argument out of its range, a rollout that does not split into
    `--mini-batches`, or a logger whose package is missing."""
    bad = out_of_range(args)
    if bad:
        raise ValueError(f"bad argument{'s' * (len(bad) > 1)}: {'; '.join(bad)}.")
    mini_batches, rows = getattr(args, "mini_batches", 1), args.num_envs * args.steps_per_env
    if rows % mini_batches:
        raise ValueError(
            f"num_envs * steps_per_env = {rows} is not divisible by mini_batches = {mini_batches}; "
            "change --num-envs, --steps-per-env or --mini-batches."
        )
    logger = args.logger
    if logger in ("wandb", "neptune") and importlib.util.find_spec(logger) is None:
        raise ValueError(
            f"--logger {logger} needs its package: pip install {logger}, or pass --logger none."
        )


@dataclass
class RunArgs:
    """The run's checkpoints and logger project (`--run-dir`, `--resume`, `--logger`: above)."""

    save_interval: Count = 50
    """Checkpoint every this many iterations (and at the end)."""
    keep_checkpoints: Count = 5
    """How many of the newest checkpoints to keep."""
    logger_project: str | None = None
    """W&B project (default: the script's name) or Neptune project `workspace/name` (default:
    NEPTUNE_PROJECT)."""


@dataclass
class DistArgs:
    """The processes: their cores, timeouts and checks (`--device` comes first)."""

    pin_cores: bool = True
    """On CPU with several processes per machine, bind each one's training thread, and the threads
    it starts, to its own share of the cores. `--no-pin-cores`: the OS places them (shared
    machines)."""
    check_interval: Annotated[int, Range(0)] = 50
    """Every this many iterations, compare a hash of the trained state across ranks (0: never)."""
    dist_timeout_s: Positive = 60.0
    """Seconds a collective may wait for a lost rank before the job fails."""
    start_timeout_s: Positive = 1200.0
    """Seconds the ranks wait for each other at start-up (building envs: a simulator may take
    minutes)."""
    stop_grace_s: Positive = 25.0
    """Seconds a rank has, after SIGTERM or Ctrl-C, to end its iteration and save; past
    them (waiting for a rank that hangs) it exits with one line. torchrun, SLURM and Kubernetes
    kill 30 s after."""


# The extensions' options, here so that a run imports an extension only where its flag turns it
# on (extensions/).


@dataclass
class RndArgs:
    """RND, Random Network Distillation (extensions/rnd.py): an intrinsic reward for novel
    states."""

    rnd_weight: NonNegative = 0.0
    """Weight of RND's intrinsic reward (Random Network Distillation, Burda et al. 2018) per second
    of env time: as rsl_rl, it is multiplied by the env's step length `dt` when the env has one. 0:
    no RND."""
    rnd_obs: tuple[str, ...] = ("rnd_state",)
    """Observation groups the RND networks read (rsl_rl's `rnd_state`); the actor's when the env
    lacks one."""
    rnd_hidden: Widths = (64, 64)
    """Hidden layer widths of the RND target and predictor MLPs (ELU activations)."""
    rnd_outputs: Count = 16
    """Size of the embedding the predictor learns to match."""
    rnd_learning_rate: Positive = 1e-3
    """Adam learning rate of the RND predictor (fixed; its gradients are not clipped, as in rsl_rl).
    """
    rnd_normalize_states: bool = True
    """Normalize the RND input with running statistics merged across ranks."""
    rnd_normalize_rewards: bool = False
    """Divide the intrinsic reward by the running std of its discounted sum, merged across ranks."""
    rnd_schedule: Literal["constant", "step", "linear"] = "constant"
    """rsl_rl's weight schedule over env steps: `step` jumps to `--rnd-final-weight` at the
    second `--rnd-schedule-steps`, `linear` moves to it between the two."""
    rnd_final_weight: NonNegative = 0.0
    """The weight a `step` or `linear` schedule ends at (per second, as `--rnd-weight`)."""
    rnd_schedule_steps: tuple[int, int] = (0, 0)
    """Start and end of the schedule, in env steps per env (rollout steps since the start of
    training)."""


@dataclass
class SymmetryArgs:
    """Symmetry (extensions/symmetry.py): mirrored copies of observations and actions."""

    symmetry: str | None = None
    """Mirror function `module:function`, importable from the working directory, with rsl_rl's
    signature `f(env, obs, actions) -> (obs, actions)`, where obs maps each group the actor and
    critic read to its (B, dim) tensor, or (B, C, H, W) for an image (rsl_rl's TensorDict of groups,
    not the networks' concatenated inputs); it returns the originals first, then the mirrored
    copies. Built in: `envs.mirrors:pendulum`, `envs.mirrors:pendulum_partial`, the image task's
    mirror `envs.mirrors:pendulum_image`, and `envs.mirrors:reacher`, `envs.mirrors:go1`. Alone,
    it only logs `symmetry_loss` (extensions/symmetry.py)."""
    symmetry_augment: bool = False
    """Append the mirrored observations and actions to every PPO mini-batch (rsl_rl's data
    augmentation); the originals' old log-probabilities, values, advantages and returns are repeated
    for them."""
    symmetry_mirror_loss: NonNegative = 0.0
    """Weight of the mirror loss: MSE between the actor's mean on mirrored observations and the
    mirror image of its mean on the originals (detached), as rsl_rl's `mirror_loss_coeff`. 0: off.
    """


@dataclass
class ScalingArgs:
    """Reward scaling (extensions/reward_scaling.py), as CleanRL's MuJoCo PPO."""

    scale_rewards: bool = False
    """Divide the env's rewards by the running std of their discounted return (per env, restarted
    each episode), with statistics merged across ranks, then clip them at `--reward-clip` (CleanRL's
    NormalizeReward and clip; extensions/reward_scaling.py). Logged returns stay the env's own."""
    reward_clip: Positive = 10.0
    """Bound of the scaled rewards, with `--scale-rewards`."""


def options(kind: type) -> Any:
    """A group of options, `Annotated[RunArgs, Options] = options(RunArgs)`: its flags keep their
    own names (`--run-dir`, not `--run.run-dir`)."""
    return field(default_factory=kind)


Options = tyro.conf.OmitArgPrefixes


def parse_args(
    args_type: type,
    task_defaults: Callable[[str], tuple[dict[str, Any], str]] | None = None,
    argv: list[str] | None = None,
) -> Any:
    """The command line (`argv`, default sys.argv) as `args_type`, over the defaults the task
    brings (`task_defaults`: envs.task_defaults). `--help` opens with the script's docstring."""
    doc = sys.modules[args_type.__module__].__doc__ or ""
    launch = "\n\n" + doc[doc.index("Launch:") :] if "Launch:" in doc else ""
    description = doc.strip().split("\n\n")[0] + launch
    args = tyro.cli(args_type, args=argv, description=description)
    args = with_task_defaults(args, args_type, argv, description, task_defaults)
    try:
        check_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    return args


def with_task_defaults(
    args: Any,
    args_type: type,
    argv: list[str] | None,
    description: str,
    task_defaults: Callable[[str], tuple[dict[str, Any], str]] | None,
) -> Any:
    """`args` under the settings `task_defaults(args.task)` brings, where the command line left the
    script's default; one line says which it took."""
    brought, source = task_defaults(args.task) if task_defaults else ({}, "")
    plain = args_type()
    brought = {
        k: tuple(v) if isinstance(v, list) else v for k, v in brought.items() if has_field(plain, k)
    }
    if not brought:
        return args
    default = with_values(plain, brought)
    with_task = tyro.cli(args_type, args=argv, default=default, description=description)
    # Taken from the task: what the command line left at the script's default, and the task changes.
    taken = [
        k for k, v in brought.items() if get(args, k) == get(plain, k) != v == get(with_task, k)
    ]
    if taken:
        settings = " ".join(cli_flag(k, get(with_task, k)) for k in taken)
        print(
            f"settings from {args.task} ({source}): {settings} (an argument on the command line "
            "overrides any)"
        )
    return with_task


def has_field(args: Any, name: str) -> bool:
    """Whether `args`, or one of its groups, has the field `name`."""
    return any(f.name == name or has_field(getattr(args, f.name), name) for f in fields_of(args))


def get(args: Any, name: str) -> Any:
    """The value of field `name` in `args` or in the group that holds it."""
    for f in fields_of(args):
        value = getattr(args, f.name)
        if f.name == name:
            return value
        if dataclasses.is_dataclass(value) and has_field(value, name):
            return get(value, name)
    raise KeyError(name)


def with_values(args: Any, values: dict[str, Any]) -> Any:
    """A copy of `args` with `values` (field name -> value) set, each in the group that holds it."""
    changes = {}
    for f in fields_of(args):
        value = getattr(args, f.name)
        if f.name in values:
            changes[f.name] = values[f.name]
        elif dataclasses.is_dataclass(value):
            changes[f.name] = with_values(value, values)
    return dataclasses.replace(args, **changes)


def fields_of(args: Any) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(args) if dataclasses.is_dataclass(args) else ()


def cli_flag(name: str, value: Any) -> str:
    """`value` of field `name` on the command line: `--num-envs 64`, `--no-normalize-obs`."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, tuple) else value}"
