"""Environments: the protocol every script trains on, the built-in tasks and the `module:function` loader.

Built-in tasks (pure torch, batched, on any device, seeded per rank), one file each:
    pendulum          Gymnasium's Pendulum-v1
    pendulum_partial  Pendulum-v1 with randomized physics, partially observed (distillation)
    reacher           a planar two-link arm (2 actions, a privileged critic group)
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from envs.pendulum import Pendulum
from envs.pendulum_partial import PendulumPartial
from envs.reacher import Reacher


class VecEnv(Protocol):
    """rsl_rl's vectorized environment protocol, which every script trains on.

    `get_observations()` -> {group: (num_envs, dim)}; `step(actions)` -> (obs, rewards (num_envs,),
    dones (num_envs,), extras) with `extras["time_outs"]` marking truncations and `extras["log"]`
    holding scalars to log.
    """

    num_envs: int
    num_actions: int
    max_episode_length: int
    episode_length_buf: torch.Tensor
    device: torch.device

    def get_observations(self) -> Mapping[str, torch.Tensor]: ...

    def step(self, actions: torch.Tensor) -> tuple[Mapping[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]: ...


TASKS: dict[str, Callable[..., VecEnv]] = {
    "pendulum": Pendulum,
    "pendulum_partial": PendulumPartial,
    "reacher": Reacher,
}


def make_env(task: str, num_envs: int, device: torch.device | str, seed: int) -> VecEnv:
    """Build a built-in task by name, or a user's environment from `module:function`.

    The function is called as `function(num_envs=..., device=..., seed=...)` and must return an
    object following the `VecEnv` protocol.
    """
    if ":" in task:
        module_name, _, function_name = task.partition(":")
        sys.path.insert(0, os.getcwd())  # torchrun does not put the working directory on the path.
        try:
            factory = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"cannot load environment {task!r}: {error}. Expected 'module:function' importable from {os.getcwd()}."
            ) from error
        return factory(num_envs=num_envs, device=device, seed=seed)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose one of {sorted(TASKS)} or give 'module:function'.")
    return TASKS[task](num_envs, device, seed)


def resolve_group(obs: Mapping[str, torch.Tensor], group: str, fallback: str | None = None) -> str:
    """`group` if the environment has it, else `fallback` (rsl_rl's rule: a missing `critic` group
    falls back to the policy's); a ValueError naming the groups there are when neither exists."""
    if group in obs:
        return group
    if fallback is not None and fallback in obs:
        return fallback
    raise ValueError(f"observation group {group!r} not found; the environment provides {sorted(obs.keys())}.")
