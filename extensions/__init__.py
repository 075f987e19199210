"""PPO's extensions, kept apart as rsl_rl 5.5.1 keeps them in `rsl_rl/extensions/`: RND (rnd.py), symmetry
(symmetry.py) and reward scaling (reward_scaling.py), and the seams of `ppo_ddp.train` they and PPO's variants plug
into, defined here: what joins the update is a `SideLoss`; a `Variant` of PPO (ppo_rnn_ddp.py, ppo_amp_ddp.py) is
the pieces `train` runs, some replaced, and what it adds to the training beside its networks a `Plugin` (AMP's
discriminator). Each extension is a module of functions a script calls at its seams. No script is imported here.
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


@dataclass
class Variant:
    """The pieces `ppo_ddp.train` runs, each a function; plain PPO's are `ppo_ddp.PPO`, and a variant is those with
    some replaced (`dataclasses.replace`), each by a function of its own script. A variant never copies `train`,
    so nothing can drift apart: ppo_rnn_ddp.py replaces the networks, the policy step, the batch, the loss and the
    last values (networks with memory, trained on whole env sequences); ppo_amp_ddp.py plugs a discriminator in."""

    script: str  # its checkpoints and run directories: `ppo`, `ppo_rnn`, `ppo_amp`
    title: Callable[[Any], str]  # args -> what the run is, for its first line
    make_networks: Callable[..., tuple[nn.Module, nn.Module]]  # (obs, num_actions, args) -> (actor, critic)
    act: Callable[..., tuple[torch.Tensor, ...]]  # the policy step: (actor, critic, obs, *memory) -> outputs
    make_batch: Callable[..., dict[str, Any]]  # (rollout, the memory it began with) -> the update's rows
    loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]  # (actor, critic, mini-batch, args)
    last_values: Callable[..., torch.Tensor]  # (critic, next observations, memory) -> V(s_T)
    plug_in: Callable[..., Plugin] | None = None  # (args, env, obs, ctx, graphs) -> AMP's parts
    check_args: Callable[[Any], None] = lambda args: None  # a rule of its own for the arguments
