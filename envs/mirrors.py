"""Mirror functions of the built-in tasks, for `--symmetry envs.mirrors:<task>`
(extensions/symmetry.py).

rsl_rl's signature: `mirror(env, obs, actions) -> (obs, actions)`, `obs` a mapping from observation
group to (B, dim), `actions` (B, num_actions); each comes back as (2 B, ...), the originals and then
their mirror images, None where None was given. Each task here has one mirror symmetry: its
dynamics, reward and start states are unchanged when states and actions are mirrored. The sign flips
are written as slices, so that a CUDA graph can capture them (no tensor is made from host data).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def with_mirror_images(x: torch.Tensor | None, negated: tuple[int, ...]) -> torch.Tensor | None:
    """(B, dim) -> (2 B, dim): `x`, then `x` with the columns `negated` sign-flipped; None stays
    None."""
    if x is None:
        return None
    mirrored = x.clone()
    for column in negated:
        mirrored[:, column] = -x[:, column]
    return torch.cat([x, mirrored])


def mirror_groups(
    obs: Mapping[str, torch.Tensor] | None, negated: dict[str, tuple[int, ...]], task: str
) -> dict[str, torch.Tensor] | None:
    """Every group of `obs` with its mirror images appended; a ValueError names a group the task
    lacks."""
    if obs is None:
        return None
    unknown = [group for group in obs.keys() if group not in negated]
    if unknown:
        raise ValueError(
            f"envs.mirrors:{task} mirrors the groups {sorted(negated)}, not {unknown}."
        )
    return {group: with_mirror_images(obs[group], negated[group]) for group in obs.keys()}


def pendulum(
    env: Any, obs: Mapping[str, torch.Tensor] | None = None, actions: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """Pendulum-v1 (and `pendulum_sparse`) mirrored through the vertical: angle θ -> -θ, so (cos θ,
    sin θ, θ̇) -> (cos θ, -sin θ, -θ̇) and torque -> -torque."""
    return mirror_groups(obs, {"policy": (1, 2)}, "pendulum"), with_mirror_images(actions, (0,))


def pendulum_image(
    env: Any, obs: Mapping[str, torch.Tensor] | None = None, actions: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """`pendulum_image` mirrored through the vertical: angular velocity -> -velocity, the frame
    flipped left to right (its pixel grid is symmetric about the pivot), torque -> -torque."""
    if obs is not None:
        unknown = [group for group in obs.keys() if group not in ("policy", "image")]
        if unknown:
            raise ValueError(
                "envs.mirrors:pendulum_image mirrors the groups ['image', 'policy'], not "
                f"{unknown}."
            )
        obs = {
            group: torch.cat([x, -x if group == "policy" else x.flip(-1)])
            for group, x in obs.items()
        }
    return obs, with_mirror_images(actions, (0,))


def pendulum_partial(
    env: Any, obs: Mapping[str, torch.Tensor] | None = None, actions: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """`pendulum_partial` mirrored as `pendulum`: the sines of its 4 frames and its last torque
    change sign (`policy`), and the sine and velocity of `teacher` (cos, sin, θ̇, mass, length)."""
    negated = {"policy": (1, 3, 5, 7, 8), "teacher": (1, 2)}
    return mirror_groups(obs, negated, "pendulum_partial"), with_mirror_images(actions, (0,))


def reacher(
    env: Any, obs: Mapping[str, torch.Tensor] | None = None, actions: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """The two-link arm mirrored across its x axis: both joint angles, velocities and torques change
    sign, and so do the y of target and fingertip-target vector. `policy` (10) = cos q (2), sin q
    (2), q̇ (2), target xy, fingertip - target xy; `critic` (12) adds the distance and |q̇|, which
    do not change."""
    negated = (2, 3, 4, 5, 7, 9)
    return mirror_groups(
        obs, {"policy": negated, "critic": negated}, "reacher"
    ), with_mirror_images(actions, (0, 1))
