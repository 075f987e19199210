"""PPO's extensions, kept apart as rsl_rl 5.5.1 keeps them in `rsl_rl/extensions/`: RND (rnd.py), symmetry
(symmetry.py) and reward scaling (reward_scaling.py). Each is a module of functions a script calls at its seams;
what plugs into the update is a `SideLoss`, and what a variant of PPO adds to its training a `Plugin` (AMP's
discriminator, ppo_amp_ddp.py), both defined here. No script is imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class SideLoss:
    """A loss trained on every PPO mini-batch beside PPO's, its gradients in the same all_reduce: of a
    network with its own optimizer (RND's predictor, AMP's discriminator), or, with `optimizer` None,
    of the actor itself, clipped and stepped with PPO's (symmetry's mirror loss)."""

    loss: Callable[[dict[str, Any]], tuple[torch.Tensor, dict[str, torch.Tensor]]]  # mini-batch -> (loss, stats)
    optimizer: torch.optim.Optimizer | None
    max_grad_norm: float  # math.inf: not clipped
    name: str  # of its network, as its logged gradient norm begins: `{name}_grad_norm`
    cause: str  # what else could produce NaN/Inf, for error messages
    # Draws the loss's random inputs for the next mini-batch into tensors the loss reads, before the
    # step: a CUDA graph of the step would freeze a Python bound such as the filled size of a buffer.
    draw: Callable[[], None] = lambda: None
    # Rewrites the mini-batch before any loss sees it (symmetry appends mirrored copies); most keep it.
    augment: Callable[[dict[str, Any]], dict[str, Any]] = lambda mb: mb


def with_optimizers(sides: tuple[SideLoss, ...]) -> tuple[list[SideLoss], list[list[torch.nn.Parameter]]]:
    """The side losses that train a network of their own, and the parameters each one's optimizer steps
    (the others train the actor: symmetry)."""
    own = [side for side in sides if side.optimizer is not None]
    return own, [[p for group in side.optimizer.param_groups for p in group["params"]] for side in own]


@dataclass
class Plugin:
    """What a variant adds to PPO's training beside its networks, at `ppo_ddp.train`'s seams (AMP: its discriminator).
    Its modules and optimizers are trained, broadcast, checkpointed and compared with the actor's and critic's."""

    modules: dict[str, nn.Module]
    optimizers: dict[str, torch.optim.Optimizer]
    groups: tuple[str, ...]  # the observation groups it reads: the rollout stores them with the networks'
    side_loss: SideLoss  # trained in every mini-batch step, before the extensions' losses
    # (rollout, next observations, iteration, the iteration's logs): after the rollout's NaN check
    after_rollout: Callable[[Any, Any, int, dict[str, torch.Tensor]], None]
    # (the env's rewards, the time-outs' bootstrap, RND's intrinsic rewards or None) -> the rewards GAE sees
    mix_rewards: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    normalizer_batches: Callable[[Any], list[tuple[nn.Module, torch.Tensor]]]  # rollout -> (normalizer, data)
    agreed: str = ""  # what every rank must hold alike (a hash of the reference motions)
    title: str = ""  # what the run's first line adds
