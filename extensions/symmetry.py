"""Symmetry (Mittal et al. 2024), as rsl_rl 5.5.1's `rsl_rl/extensions/symmetry.py`: the task's
mirror function gives mirrored copies of observations and actions, which PPO uses in two ways, each
optional: data augmentation (the copies appended to every mini-batch) and a mirror loss (the actor's
mean on mirrored observations pulled toward the mirror image of its mean). With a mirror function,
the mirror loss is always logged (`symmetry_loss`), whether it trains or not.

ppo_ddp.py calls it in three places: `load_mirror` at start-up (a bad one fails there, on every
rank), `augment_batch` and `mirror_loss` in the update. Everything is local to each rank: the
mirrored copies are of the rank's own mini-batch, and the mirror loss's gradients ride in PPO's one
all_reduce per mini-batch. So N ranks x E envs still update as 1 process x N*E envs.

The mirror function has rsl_rl's signature, `mirror(env=..., obs=..., actions=...) -> (obs,
actions)`. `obs` maps each observation group the actor and critic read to its (B, dim) tensor ((B,
C, H, W) for an image group), in the container the env returns observations in (a dict; a
TensorDict, as rsl_rl passes, for Isaac Lab's mirror functions); `actions` is (B, num_actions).
Either may be None, and then so is what comes back for it. What comes back holds the originals
first, then k - 1 mirrored copies: (k B, ...). envs/mirrors.py has the built-in tasks' mirror
functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import envs
from arguments import SymmetryArgs


@dataclass
class Mirror:
    """A loaded mirror function and what it is called with: the env, and the observation groups it
    mirrors."""

    function: Callable[..., tuple[Any, Any]]
    env: Any
    groups: tuple[str, ...]  # every group the actor and the critic read
    shapes: dict[
        str, tuple[int, ...]
    ]  # group -> one row's shape: (width,), or (C, H, W) for an image
    container: (
        type | None
    )  # the env's TensorDict type, to hand the groups over as one; None: a dict

    def augment(self, mb: dict[str, Any]) -> dict[str, Any]:
        """`augment_batch(self, mb)`."""
        return augment_batch(self, mb)

    def loss(self, actor: nn.Module, mb: dict[str, Any], augmented: bool) -> torch.Tensor:
        """`mirror_loss(self, actor, mb, augmented)`."""
        return mirror_loss(self, actor, mb, augmented)


def load_mirror(
    args: SymmetryArgs,
    env: Any,
    obs: Mapping[str, torch.Tensor],
    actor: nn.Module,
    critic: nn.Module,
    num_actions: int,
) -> Mirror | None:
    """The mirror function `--symmetry` names, or None without one. It is tried once on `obs`, so
    that one that does not load or returns the wrong shapes is a ValueError of one line at start-up.
    Local."""
    if args.symmetry is None:
        if args.symmetry_augment or args.symmetry_mirror_loss:
            raise ValueError(
                "--symmetry-augment and --symmetry-mirror-loss need --symmetry module:function."
            )
        return None
    function = envs.load_function(args.symmetry, "mirror function (--symmetry)")
    try:
        inspect.signature(function).bind(env=env, obs=None, actions=None)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"--symmetry {args.symmetry}: cannot be called as f(env=, obs=, actions=): {error}; "
            "give it those keyword parameters, as envs/mirrors.py's functions have."
        ) from None
    groups = tuple(dict.fromkeys([*actor.inputs.shapes, *critic.inputs.shapes]))
    shapes = {group: tuple(obs[group].shape[1:]) for group in groups}
    container = (
        type(obs) if hasattr(obs, "batch_size") else None
    )  # rsl_rl's TensorDict has a batch size
    mirror = Mirror(function, env, groups, shapes, container)
    check_mirror(mirror, args.symmetry, obs, num_actions)
    return mirror


def check_mirror(
    mirror: Mirror, spec: str, obs: Mapping[str, torch.Tensor], num_actions: int
) -> None:
    """Call the mirror function as the update does, on the env's first observations and zero
    actions: with both (augmentation), observations alone and actions alone (mirror loss). A
    ValueError of one line unless each part comes back as (k rows, *shape), one k >= 2 for all.
    Local."""
    first = {group: obs[group] for group in mirror.groups}
    rows = next(iter(first.values())).shape[0]
    actions = torch.zeros(rows, num_actions, device=next(iter(first.values())).device)
    copies, fed = (
        None,
        ", ".join(
            f"{group} ({', '.join(map(str, shape))})" for group, shape in mirror.shapes.items()
        ),
    )
    for given in ("observations and actions", "observations", "actions"):
        try:
            out_obs, out_actions = mirror.function(
                env=mirror.env,
                obs=as_given(mirror, first) if given != "actions" else None,
                actions=actions if given != "observations" else None,
            )
        # a function written for another env: one line, before any collective
        except Exception as error:
            raise ValueError(
                f"--symmetry {spec} failed on this env's first observations, groups {fed}, and "
                f"{num_actions} action(s), given {given}: {type(error).__name__}: {error}. Pass a "
                "mirror function written for these groups and widths."
            ) from None
        found = (
            {group: shape_of(out_obs, group) for group in mirror.shapes}
            if given != "actions"
            else {}
        )
        found |= {"actions": shape_of(out_actions)} if given != "observations" else {}
        if copies is None:  # the copies the first call made, or 2 when it made too few to count
            copies = max(2, found["actions"][0] // rows) if found["actions"] else 2
        expected = {group: (copies * rows, *shape) for group, shape in mirror.shapes.items()}
        expected = {
            key: shape
            for key, shape in {**expected, "actions": (copies * rows, num_actions)}.items()
            if key in found
        }
        if found != expected:
            raise ValueError(
                f"--symmetry {spec}: given {given} of {rows} rows it returned shapes {found}; "
                f"expected {expected} (the originals first, then the mirrored copies): make it "
                "return those shapes."
            )


def shape_of(value: Any, group: str | None = None) -> tuple[int, ...] | None:
    """The shape of `value`, or of its `group`, if that is a tensor, else None: what `check_mirror`
    compares."""
    if group is not None:
        # a dict, a TensorDict
        value = value[group] if hasattr(value, "keys") and group in value.keys() else None
    return tuple(value.shape) if torch.is_tensor(value) else None


def as_given(mirror: Mirror, obs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The groups the mirror function mirrors, in the container the env returns observations in."""
    groups = {group: obs[group] for group in mirror.groups}
    if mirror.container is None:
        return groups
    return mirror.container(groups, batch_size=[next(iter(groups.values())).shape[0]])


def mirrored(
    mirror: Mirror, obs: Mapping[str, torch.Tensor], actions: torch.Tensor | None
) -> tuple[dict, Any]:
    """The mini-batch's observation groups and `actions`, each with its mirrored copies appended ->
    (groups (k B, *shape), actions (k B, num_actions) or None). Local."""
    out_obs, actions = mirror.function(env=mirror.env, obs=as_given(mirror, obs), actions=actions)
    return {group: out_obs[group] for group in mirror.groups}, actions


def augment_batch(mirror: Mirror, mb: dict[str, Any]) -> dict[str, Any]:
    """rsl_rl's data augmentation: observations and actions with their mirrored copies appended, the
    old log-probabilities, values, advantages and returns repeated for them (nothing recomputed).
    The old means and stds stay the originals': KL and entropy are of the originals only
    (ppo_ddp.ppo_loss)."""
    obs, actions = mirrored(mirror, mb["obs"], mb["actions"])
    copies = actions.shape[0] // mb["actions"].shape[0]
    repeated = {
        name: mb[name].repeat(copies) for name in ("log_probs", "values", "advantages", "returns")
    }
    return {**mb, "obs": {**mb["obs"], **obs}, "actions": actions, **repeated}


def mirror_loss(
    mirror: Mirror, actor: nn.Module, mb: dict[str, Any], augmented: bool
) -> torch.Tensor:
    """rsl_rl's mirror loss: MSE between the actor's means on the mirrored observations and the
    mirror images of its means on the originals, which are detached. `augmented`: `mb` holds the
    copies. Local."""
    rows = mb["means"].shape[0]  # the originals: augmentation never repeats the old means
    obs = mb["obs"] if augmented else mirrored(mirror, mb["obs"], None)[0]
    means = actor(obs)[0]
    mirrored_means = mirror.function(env=mirror.env, obs=None, actions=means[:rows].detach())[1]
    return nn.functional.mse_loss(means[rows:], mirrored_means[rows:])
