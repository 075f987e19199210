"""Environments: the protocol every script trains on, the built-in tasks, the `module:function`
loader, per-rank seeds and episode statistics.

Built-in tasks (`TASKS`, pure torch, batched, seeded per rank; and go1.py, on EnvPool), one file
each: docs/environments.md describes them. Adapters (optional packages), `<adapter>:<id>`: gym and
gym-async (Gymnasium), envpool, mjlab, isaaclab (untested here), each in its own file. Only the
module of the task a run asks for is imported.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class VecEnv(Protocol):
    """rsl_rl's vectorized environment protocol: `get_observations()` -> {group: (num_envs, dim)};
    `step(actions)` -> (obs, rewards (num_envs,), dones (num_envs,), extras) with
    `extras["time_outs"]` marking truncations and `extras["log"]` holding scalars to log."""

    num_envs: int
    num_actions: int
    max_episode_length: int
    episode_length_buf: torch.Tensor
    device: torch.device

    def get_observations(self) -> Mapping[str, torch.Tensor]: ...

    def step(
        self, actions: torch.Tensor
    ) -> tuple[Mapping[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]: ...


# Built-in task -> its module in envs/ and the class built as `Class(num_envs, device, seed)`.
TASKS: dict[str, tuple[str, str]] = {
    "pendulum": ("pendulum", "Pendulum"),
    "pendulum_partial": ("pendulum_partial", "PendulumPartial"),
    "pendulum_angle": ("pendulum_angle", "PendulumAngle"),
    "pendulum_sparse": ("pendulum_sparse", "PendulumSparse"),
    "pendulum_image": ("pendulum_image", "PendulumImage"),
    "reacher": ("reacher", "Reacher"),
}
ADAPTERS = ("gym", "gym-async", "envpool", "mjlab", "isaaclab")  # `<adapter>:<id>`


def rank_seed(seed: int, rank: int, first_iteration: int) -> int:
    """`seed + rank` for a fresh run; a resumed run moves on with the iteration, so that it does
    not replay the random numbers of the first run."""
    return seed + rank + 1_000_003 * (first_iteration - 1)


def make_env(
    task: str,
    num_envs: int,
    device: torch.device | str,
    seed: int,
    random_start: bool = False,
    steps_taken: int = 0,
) -> VecEnv:
    """A built-in task by name, or a user's `module:function`, called as `function(num_envs=...,
    device=..., seed=...)`. `random_start` puts each env at a random point of its time limit
    (torch's global generator), so that envs do not all reset at the same step. `steps_taken`:
    each env's steps in a resumed run, for an env with a curriculum on them (envs/go1.py)."""
    env = _build(task, num_envs, device, seed)
    if hasattr(env, "steps_taken"):
        env.steps_taken = steps_taken
    if random_start:
        env.episode_length_buf = torch.randint_like(
            env.episode_length_buf, high=int(env.max_episode_length)
        )
    return env


def _build(task: str, num_envs: int, device: torch.device | str, seed: int) -> VecEnv:
    if task.startswith(("gym:", "gym-async:")):
        from envs import gymnasium  # optional: imports Gymnasium

        kind, _, env_id = task.partition(":")
        return gymnasium.make(env_id, num_envs, device, seed, asynchronous=kind == "gym-async")
    if task.startswith("envpool:"):
        from envs import envpool  # optional: imports EnvPool

        return envpool.make(task.partition(":")[2], num_envs, device, seed)
    if task.startswith("mjlab:"):
        from envs import mjlab  # optional: imports mjlab, MuJoCo Warp

        return mjlab.make(task.partition(":")[2], num_envs, device, seed)
    if task.startswith("isaaclab:"):
        from envs import isaaclab  # optional: starts Isaac Sim

        return isaaclab.make(task.partition(":")[2], num_envs, device, seed)
    if ":" in task:
        function = load_function(task, "environment")
        try:
            inspect.signature(function).bind(num_envs=num_envs, device=device, seed=seed)
        except TypeError as error:
            raise ValueError(
                f"--task {task} cannot be called as {task.partition(':')[2]}(num_envs=..., "
                f"device=..., seed=...) ({error}): give it those three parameters."
            ) from None
        return function(num_envs=num_envs, device=device, seed=seed)
    if task == "go1":
        from envs import go1  # imports EnvPool and MuJoCo

        return go1.make(num_envs, device, seed)
    if task not in TASKS:
        raise ValueError(unknown_task(task))
    module, name = TASKS[task]
    return getattr(importlib.import_module(f"envs.{module}"), name)(num_envs, device, seed)


def unknown_task(task: str) -> str:
    """The one line for an unknown task name, with the nearest built-in name."""
    names = [*TASKS, "go1"]
    near = difflib.get_close_matches(task, names, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    forms = ", ".join([*(repr(name) for name in names), *(f"'{a}:<id>'" for a in ADAPTERS)])
    return f"unknown task {task!r}{hint}: choose one of {forms} or 'module:function'."


def task_defaults(task: str) -> tuple[dict[str, Any], str]:
    """The PPO settings a task's family brings, as `Args` field -> value, and where they come from
    (mjlab's registered rsl_rl config, docs/environments.md's for Gymnasium's MuJoCo tasks,
    Playground's rsl_rl config). ({}, "") for other tasks, and where the family's package is
    missing (building the env says what to install)."""
    if task == "pendulum_image":
        from envs import pendulum_image

        return dict(pendulum_image.SETTINGS), "envs/pendulum_image.py"
    if task == "go1":
        from envs import go1

        return dict(go1.SETTINGS), "envs/go1.py SETTINGS"
    family, _, name = task.partition(":")
    try:
        if family in ("gym", "gym-async"):
            from envs import gymnasium

            return gymnasium.defaults(name)
        if family == "mjlab":
            from envs import mjlab

            return mjlab.defaults(name)
        if family == "envpool":
            from envs import envpool

            return envpool.defaults(name)
    except ValueError:
        return {}, ""
    return {}, ""


def load_function(spec: str, what: str) -> Callable[..., Any]:
    """The function a `module:function` string names, imported from the working directory first; a
    ValueError of one line naming `what` if it cannot be loaded."""
    module_name, colon, function_name = spec.partition(":")
    sys.path.insert(0, os.getcwd())  # torchrun does not put the working directory on the path.
    try:
        function = getattr(importlib.import_module(module_name), function_name) if colon else None
    except (ImportError, AttributeError, ValueError) as error:  # ValueError: an empty module name
        raise ValueError(
            f"cannot load {what} {spec!r}: {error}. Expected 'module:function' importable from "
            f"{os.getcwd()}: check the names, run from the module's directory, and install what "
            "the module imports."
        ) from error
    if not callable(function):
        raise ValueError(
            f"cannot load {what} {spec!r}: expected 'module:function', a function importable from "
            f"{os.getcwd()}."
        )
    return function


def resolve_groups(
    obs: Mapping[str, torch.Tensor],
    groups: Sequence[str],
    fallback: Sequence[str] | None = None,
    flag: str = "",
    images: bool = False,
) -> tuple[str, ...]:
    """The groups one network reads: `groups` if the env has them all, else `fallback` (rsl_rl's
    rule: without a `critic` group the critic reads the policy's). Each must be `(num_envs, dim)`,
    or with `images` also `(num_envs, C, H, W)`; `flag` chose `groups`, for the message."""
    if fallback is not None and any(group not in obs for group in groups):
        groups = fallback
    missing = [group for group in groups if group not in obs]
    if missing:
        where = (
            f"pass groups it has to {flag}" if flag else "train on the task whose groups these are"
        )
        raise ValueError(
            f"observation group(s) {missing} not found; the environment provides "
            f"{sorted(obs.keys())}: {where}."
        )
    for group in groups:
        value = obs[group]
        if images and torch.is_tensor(value) and value.ndim == 4:
            continue
        if torch.is_tensor(value) and value.ndim == 4:
            raise ValueError(
                f"observation group {group!r} is an image {tuple(value.shape[1:])}: only PPO's "
                "actor and critic encode images (networks.py, as rsl_rl 5.5.1's CNNModel; AMP, "
                "recurrent PPO, RND and the distillation student take flat groups): leave it out "
                f"of {flag or 'the groups'}."
            )
        if not torch.is_tensor(value) or value.ndim != 2:
            found = (
                f"shape {tuple(value.shape)}"
                if torch.is_tensor(value)
                else f"a {type(value).__name__}"
            )
            raise ValueError(
                f"observation group {group!r} is {found}, not a flat (num_envs, dim) tensor; "
                "flatten it in the env or leave it out of the groups a network reads."
            )
    return tuple(groups)


def step_dt(env: VecEnv) -> float | None:
    """Seconds of simulated time per env step (`dt`, Isaac Lab's `step_dt`), or None."""
    for owner in (env, getattr(env, "unwrapped", None)):
        for name in ("dt", "step_dt"):
            if isinstance(value := getattr(owner, name, None), (int, float)):
                return float(value)
    return None


def group_shapes(obs: Mapping[str, torch.Tensor], groups: Sequence[str]) -> dict[str, list[int]]:
    """Each of `groups` and one env's shape of it: (dim,), or (C, H, W) for an image."""
    return {group: list(obs[group].shape[1:]) for group in groups}


# --- Episode statistics of a vectorized env (what Gymnasium's RecordEpisodeStatistics records) ----


@dataclass
class Episodes:
    """Every env's running return and length; sums of the whole episodes finished this iteration."""

    returns: torch.Tensor
    lengths: torch.Tensor
    whole: torch.Tensor  # 1.0 where the env's episode began at a reset, 0.0 at a random point
    finished: torch.Tensor  # [sum of returns, sum of lengths, count]


def make_episodes(
    num_envs: int, device: torch.device, started: torch.Tensor | None = None
) -> Episodes:
    """Zeroed episode statistics; `started`: the env's `episode_length_buf` before its first step,
    above 0 where `--init-at-random-ep-len` put an env inside its time limit."""
    zeros = torch.zeros(num_envs, device=device)
    whole = (
        (started == 0).to(device, zeros.dtype) if started is not None else torch.ones_like(zeros)
    )
    return Episodes(zeros, zeros.clone(), whole, torch.zeros(3, device=device))


def track_episodes(episodes: Episodes, rewards: torch.Tensor, dones: torch.Tensor) -> None:
    """Add one step to every env's return and length; fold the whole episodes that finished into
    `finished`. An episode cut short by a random start would read as if the policy had done better:
    it is not counted (rsl_rl's logger counts it)."""
    episodes.returns += rewards
    episodes.lengths += 1
    counted = dones * episodes.whole
    episodes.finished += torch.stack(
        [(episodes.returns * counted).sum(), (episodes.lengths * counted).sum(), counted.sum()]
    )
    episodes.whole.masked_fill_(dones.bool(), 1.0)  # the next episode begins at a reset
    episodes.returns *= 1 - dones
    episodes.lengths *= 1 - dones


def accumulate_logs(
    logs: dict[str, torch.Tensor], extras: Mapping[str, Any], device: torch.device
) -> None:
    """Add each scalar of a step's `extras["log"]` (or older wrappers' `extras["episode"]`) to its
    (sum, count) in `logs`: a mean over the steps that logged it (mjlab logs on resets alone)."""
    for key, value in extras.get("log", extras.get("episode", {})).items():
        mean = torch.as_tensor(value, dtype=torch.float32, device=device).mean()
        pair = torch.stack([mean, torch.ones((), device=device)])
        logs[key] = logs[key] + pair if key in logs else pair
