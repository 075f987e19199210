"""The parts every script's networks are built of: `Inputs` (a network's observation groups -> the
features its MLP reads), the MLP, and the constructor config a checkpoint rebuilds a network from.
Image groups' CNN encoders, rsl_rl 5.5.1's `CNN`, are in cnn.py. Local: no communication.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

import common


@dataclass
class CnnArgs:
    """The image groups' encoders, a group of ppo_ddp.py's `Args`; used only where a group is an
    image."""

    cnn_channels: tuple[int, ...] = (16, 32)
    """Output channels of each convolution (rsl_rl's cnn_cfg output_channels)."""
    cnn_kernel_size: tuple[int, ...] = (3,)
    """Kernel size: one for every layer, or one per layer (kernel_size)."""
    cnn_stride: tuple[int, ...] = (2,)
    """Stride: one, or one per layer (stride)."""
    cnn_dilation: tuple[int, ...] = (1,)
    """Dilation: one, or one per layer (dilation)."""
    cnn_norm: tuple[Literal["none", "layer"], ...] = ("none",)
    """Normalization after each convolution: one, or one per layer (norm; rsl_rl's `batch` is not
    offered: its running statistics would differ between ranks)."""
    cnn_max_pool: tuple[bool, ...] = (False,)
    """A 3 x 3, stride 2 max pool after the activation: one, or one per layer (max_pool)."""
    cnn_padding: Literal["none", "zeros", "reflect", "replicate", "circular"] = "none"
    """`none`, or pad each convolution so that its output is its input over the stride, with that
    padding mode (padding)."""
    cnn_global_pool: Literal["none", "max", "avg"] = "none"
    """Pool each channel to one value before flattening (global_pool)."""


def settings(args: Any, shapes: Mapping[str, Sequence[int]]) -> dict[str, Any] | None:
    """The `--cnn-*` arguments, as a network's config keeps them, if `shapes` hold an image."""
    if not any(len(shape) == 3 for shape in shapes.values()):
        return None
    return {field.name: getattr(args, field.name) for field in dataclasses.fields(CnnArgs)}


class Inputs(nn.Module):
    """Observation groups -> the features the MLP reads: the flat groups side by side, normalized
    (the flat part alone, as rsl_rl's), then each image group's latent from its own encoder, in
    order. `shapes`: group -> one env's shape, (dim,) or (C, H, W); `cnn`: `settings`."""

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        normalize: bool,
        cnn: Mapping[str, Any] | None = None,
        activation: str = "elu",
        until: float | None = None,
    ) -> None:
        super().__init__()
        self.shapes = {group: list(shape) for group, shape in shapes.items()}
        self.flat = [group for group, shape in shapes.items() if len(shape) == 1]
        self.images = [group for group, shape in shapes.items() if len(shape) != 1]
        if self.images and cnn is None:
            raise ValueError(
                f"observation group(s) {self.images} are images, but this network has no CNN "
                "encoder."
            )
        flat_width = sum(shapes[group][0] for group in self.flat)
        self.normalizer = (
            common.EmpiricalNormalizer(flat_width, until=until) if normalize else nn.Identity()
        )
        if self.images:
            from cnn import make_cnn  # image groups only: a flat run does not load it
        self.cnns = nn.ModuleDict(
            {group: make_cnn(tuple(shapes[group]), cnn, activation) for group in self.images}
        )
        self.width = flat_width + sum(encoder.latent for encoder in self.cnns.values())

    def flat_part(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The flat groups side by side (..., flat width): what the normalizer sees."""
        if len(self.flat) == 1:
            return obs[self.flat[0]]
        return torch.cat([obs[group] for group in self.flat], dim=-1)

    def forward(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        features = self.normalizer(self.flat_part(obs))
        if not self.cnns:
            return features
        latents = []
        for group, encoder in self.cnns.items():
            image = obs[group]
            lead = image.shape[:-3]
            latents.append(
                encoder(image.reshape(-1, *encoder.shape)).reshape(*lead, encoder.latent)
            )
        return torch.cat([features, *latents], dim=-1)


def mlp(
    in_dim: int,
    hidden: tuple[int, ...],
    out_dim: int,
    activation: type[nn.Module] | str = nn.ELU,
    gain: float = 1.0,
) -> nn.Sequential:
    """An MLP: `activation` a module, `elu` (rsl_rl's, torch's default init) or `tanh` (CleanRL's:
    orthogonal weights of gain sqrt(2), `gain` for the output layer, zero biases)."""
    layers: list[nn.Module] = []
    module = {"elu": nn.ELU, "tanh": nn.Tanh}.get(activation, activation)
    for width in hidden:
        layers += [nn.Linear(in_dim, width), module()]
        in_dim = width
    layers.append(nn.Linear(in_dim, out_dim))
    if activation == "tanh":  # CleanRL's layer_init, of every Linear layer
        for layer in layers:
            if isinstance(layer, nn.Linear):
                nn.init.orthogonal_(layer.weight, gain if layer is layers[-1] else math.sqrt(2))
                nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


def config_of(constructor_locals: dict[str, Any]) -> dict[str, Any]:
    """A network's constructor arguments, from `locals()` atop its `__init__`: `Class(**config)`
    builds it again (tools/, distillation's teacher, a resume's check)."""
    return {k: v for k, v in constructor_locals.items() if k not in ("self", "__class__")}


# --- The actor and the critic every PPO script trains (checkpoints rebuild them by config) -------


class Actor(nn.Module):
    """Gaussian policy: observation groups -> MLP -> mean, and a state-independent std."""

    def __init__(
        self,
        obs_shapes: dict[str, list[int]],
        num_actions: int,
        hidden: Sequence[int] = (64, 64),
        init_std: float = 1.0,
        normalize: bool = True,
        std_type: str = "log",
        activation: str = "elu",
        cnn: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = config_of(locals())  # in every checkpoint: Actor(**config) again
        self.inputs = Inputs(obs_shapes, normalize, cnn, activation)
        self.net = mlp(self.inputs.width, hidden, num_actions, activation, gain=0.01)
        std = torch.full((num_actions,), init_std if std_type == "scalar" else math.log(init_std))
        self.register_parameter("std" if std_type == "scalar" else "log_std", nn.Parameter(std))

    def forward(self, obs: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        mean = self.net(self.inputs(obs))
        std = self.std.clamp(1e-6, 1e6) if hasattr(self, "std") else self.log_std.exp()
        return mean, std.expand_as(mean)


class Critic(nn.Module):
    """State-value function: observation groups -> MLP -> V(s)."""

    def __init__(
        self,
        obs_shapes: dict[str, list[int]],
        hidden: Sequence[int] = (64, 64),
        normalize: bool = True,
        activation: str = "elu",
        cnn: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = config_of(locals())
        self.inputs = Inputs(obs_shapes, normalize, cnn, activation)
        self.net = mlp(self.inputs.width, hidden, 1, activation)

    def forward(self, obs: Mapping[str, Tensor]) -> Tensor:
        return self.net(self.inputs(obs)).squeeze(-1)
