"""The parts every script's networks are built of: what a network sees, its observation groups ->
the features its MLP reads (`Inputs`), with the CNN encoders of image groups as rsl_rl 5.5.1's `CNN`
and `CNNModel` build them; the MLP; the constructor config a checkpoint rebuilds a network from.

A network reads the groups its config names (rsl_rl's obs_groups). A group of shape (num_envs, dim)
is flat, one of shape (num_envs, C, H, W) an image. The flat groups are set side by side, in order,
and normalized (the normalizer sees the flat part only); each image goes through an encoder of its
own: convolutions, each with an optional norm, the activation and an optional max pool, then an
optional global pool, flattened. The MLP reads the normalized flat part followed by the latents
(rsl_rl's order). The layer indices, and so the state-dict keys, are those of rsl_rl's `CNN`, and
its arguments map one to one:

    rsl_rl cnn_cfg        here
    output_channels       --cnn-channels
    kernel_size           --cnn-kernel-size   (one for all layers, or one per layer; as the next 4)
    stride                --cnn-stride
    dilation              --cnn-dilation
    norm                  --cnn-norm          (none or layer: batch norm's running statistics would
    max_pool              --cnn-max-pool       differ between ranks)
    padding               --cnn-padding
    global_pool           --cnn-global-pool
    activation            --activation        (the MLP's, as rsl_rl's model passes it)

Local: no communication. A network without image groups has no encoder and no state-dict key of one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

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


def _per_layer(values: Sequence[Any], layer: int, name: str, layers: int) -> Any:
    """One layer's value of an argument given once for all layers or once per layer."""
    if len(values) not in (1, layers):
        raise ValueError(
            f"--{name} has {len(values)} values for {layers} convolutions: give one, or one per "
            "layer."
        )
    return values[0] if len(values) == 1 else values[layer]


def _same_padding(
    size: tuple[int, int], kernel: int, stride: int, dilation: int
) -> tuple[int, int]:
    """rsl_rl's padding for an output of about size / stride."""
    return tuple(
        math.ceil((stride * (s // stride) - s - stride + dilation * (kernel - 1) + 1) / 2)
        for s in size
    )


def _out_size(
    size: tuple[int, int], kernel: int, stride: int, dilation: int, padding: tuple[int, int]
) -> tuple[int, int]:
    return tuple(
        (s + 2 * p - dilation * (kernel - 1) - 1) // stride + 1 for s, p in zip(size, padding)
    )


def make_cnn(shape: tuple[int, int, int], args: Any, activation: str = "elu") -> nn.Sequential:
    """One image group's encoder, (B, C, H, W) -> (B, latent), the layers of rsl_rl's `CNN` in its
    order (conv, norm, activation, max pool; then the global pool and the flatten). `args`: CnnArgs'
    fields, as attributes or as a checkpoint's dict. Its `shape` and `latent` are kept on it."""
    get = args.get if isinstance(args, Mapping) else lambda name: getattr(args, name)
    channels, (last, *size) = tuple(get("cnn_channels")), shape
    size, layers = tuple(size), []
    act = {"elu": nn.ELU, "tanh": nn.Tanh}[activation]
    for i, out in enumerate(channels):
        k, s, d = (
            _per_layer(get(f"cnn_{n}"), i, f"cnn-{n.replace('_', '-')}", len(channels))
            for n in ("kernel_size", "stride", "dilation")
        )
        padding = _same_padding(size, k, s, d) if get("cnn_padding") != "none" else (0, 0)
        mode = get("cnn_padding") if get("cnn_padding") != "none" else "zeros"
        layers.append(nn.Conv2d(last, out, k, s, padding, d, padding_mode=mode))
        size = _out_size(size, k, s, d, padding)
        if min(size) < 1:
            raise ValueError(
                f"an image of {shape} leaves nothing after convolution {i + 1} of --cnn-channels "
                f"{channels}: use smaller kernels or strides, fewer layers, or --cnn-padding zeros."
            )
        if _per_layer(get("cnn_norm"), i, "cnn-norm", len(channels)) == "layer":
            layers.append(nn.LayerNorm([out, *size]))
        layers.append(act())
        if _per_layer(get("cnn_max_pool"), i, "cnn-max-pool", len(channels)):
            layers.append(nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
            size = tuple(math.ceil(x / 2) for x in size)
        last = out
    if get("cnn_global_pool") != "none":
        layers.append(
            {"max": nn.AdaptiveMaxPool2d, "avg": nn.AdaptiveAvgPool2d}[get("cnn_global_pool")](
                (1, 1)
            )
        )
        size = (1, 1)
    encoder = nn.Sequential(*layers, nn.Flatten(start_dim=1))
    encoder.shape, encoder.latent = tuple(shape), last * size[0] * size[1]
    return encoder


def settings(args: Any, shapes: Mapping[str, Sequence[int]]) -> dict[str, Any] | None:
    """The `--cnn-*` arguments, as a network's config keeps them, when `shapes` hold an image; else
    None."""
    if not any(len(shape) == 3 for shape in shapes.values()):
        return None
    return {field.name: getattr(args, field.name) for field in dataclasses.fields(CnnArgs)}


class Inputs(nn.Module):
    """A network's observation groups -> the features its MLP reads, the one layout every network
    here uses: its flat groups side by side, in order, normalized with running statistics merged
    over ranks (`normalizer`: the flat part alone, as rsl_rl's), then each image group's latent from
    an encoder of its own (`cnns`, rsl_rl's CNN), in order. `shapes`: group -> one env's shape,
    (dim,) or (C, H, W), in the order the network reads them; `cnn`: `settings`, the encoders'
    arguments. Local."""

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        normalize: bool,
        cnn: Mapping[str, Any] | None = None,
        activation: str = "elu",
        until: float | None = None,
    ) -> None:
        super().__init__()
        # the groups it reads, in order
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
        self.cnns = nn.ModuleDict(
            {group: make_cnn(tuple(shapes[group]), cnn, activation) for group in self.images}
        )
        self.width = flat_width + sum(encoder.latent for encoder in self.cnns.values())

    def flat_part(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The flat groups side by side (..., flat width): what the normalizer sees, and learns
        from."""
        if len(self.flat) == 1:
            return obs[self.flat[0]]
        return torch.cat([obs[group] for group in self.flat], dim=-1)

    def forward(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Observation groups (..., *shape) -> features (..., width): the normalized flat part, then
        the latents."""
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
    """A plain multilayer perceptron: `activation` a module, `elu` (rsl_rl's, torch's default init)
    or `tanh` (CleanRL's: orthogonal weights of gain sqrt(2), `gain` for the output layer, zero
    biases)."""
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
    """A network's constructor arguments, from `locals()` at the top of its `__init__`: its
    checkpoint keeps them, and `Class(**config)` builds the same network again (tools/,
    distillation's teacher, a resume's check)."""
    return {
        name: value
        for name, value in constructor_locals.items()
        if name not in ("self", "__class__")
    }


def normalizer_batches(
    networks: Sequence[nn.Module], obs: Mapping[str, torch.Tensor]
) -> list[tuple[nn.Module, torch.Tensor]]:
    """Each network's input normalizer that is on, and the flat part of its groups in `obs` (a
    rollout's), for `common.update_normalizers`."""
    batches = [(net.inputs.normalizer, net.inputs.flat_part(obs)) for net in networks]
    return [
        (normalizer, x)
        for normalizer, x in batches
        if isinstance(normalizer, common.EmpiricalNormalizer)
    ]
