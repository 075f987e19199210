"""PPO's extensions, kept apart as rsl_rl 5.5.1 keeps them in `rsl_rl/extensions/`: RND (rnd.py) and
symmetry (symmetry.py). Each is a module of functions a script calls at its seams; what plugs into
the update is a `SideLoss`, defined here (AMP's discriminator plugs in the same way). No script is
imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class SideLoss:
    """A loss trained on every PPO mini-batch beside PPO's, its gradients in the same all_reduce: of a
    network with its own optimizer (RND's predictor, AMP's discriminator), or, with `optimizer` None,
    of the actor itself, clipped and stepped with PPO's (symmetry's mirror loss)."""

    loss: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]  # PPO mini-batch -> (loss, statistics)
    names: tuple[str, ...]  # of the statistics, as logged
    optimizer: torch.optim.Optimizer | None
    max_grad_norm: float  # math.inf: not clipped
    name: str  # of its network, as its logged gradient norm begins: `{name}_grad_norm`
    source: str  # what else could produce NaN/Inf, for error messages
    # Draws the loss's random inputs for the next mini-batch into tensors the loss reads, before the
    # step: a CUDA graph of the step would freeze a Python bound such as the filled size of a buffer.
    draw: Callable[[], None] = lambda: None
    # Rewrites the mini-batch before any loss sees it (symmetry appends mirrored copies); most keep it.
    augment: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda mb: mb


def with_optimizers(sides: tuple[SideLoss, ...]) -> tuple[list[SideLoss], list[list[torch.nn.Parameter]]]:
    """The side losses that train a network of their own, and the parameters each one's optimizer steps
    (the others train the actor: symmetry)."""
    own = [side for side in sides if side.optimizer is not None]
    return own, [[p for group in side.optimizer.param_groups for p in group["params"]] for side in own]
