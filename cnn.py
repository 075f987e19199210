"""CNN encoders for image observation groups, as rsl_rl 5.5.1's `CNN` and `CNNModel` build them.

A group of shape (num_envs, C, H, W) is an image. A network that reads images (PPO's actor and critic)
gets one encoder per image group: convolutions, each with an optional norm, the activation and an optional
max pool, then an optional global pool, flattened. Its input is `envs.concat`'s row: the flat groups first,
then each image flattened, in group order. `encode` splits it back: the normalizer sees the flat part only,
each encoder its image, and the MLP the normalized flat part followed by the latents (rsl_rl's order). The
layer indices, and so the state-dict keys, are those of rsl_rl's `CNN`, and its arguments map one to one:

    rsl_rl cnn_cfg        here
    output_channels       --cnn-channels
    kernel_size           --cnn-kernel-size       (one for every layer, or one per layer; so are the next four)
    stride                --cnn-stride
    dilation              --cnn-dilation
    norm                  --cnn-norm              (none or layer: batch norm's running statistics would
    max_pool              --cnn-max-pool           differ between ranks)
    padding               --cnn-padding
    global_pool           --cnn-global-pool
    activation            --activation            (the MLP's, as rsl_rl's model passes it)

Local: no communication. A network without image groups has no encoder and no state-dict key of one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn


@dataclass
class CnnArgs:
    """The image groups' encoders (cnn.py), inherited by the scripts' `Args`; used only where a group is an image."""

    cnn_channels: tuple[int, ...] = (16, 32)
    """Output channels of each convolution (rsl_rl's cnn_cfg output_channels)."""
    cnn_kernel_size: tuple[int, ...] = (3,)
    """Kernel size: one for every layer, or one per layer (kernel_size)."""
    cnn_stride: tuple[int, ...] = (2,)
    """Stride: one, or one per layer (stride)."""
    cnn_dilation: tuple[int, ...] = (1,)
    """Dilation: one, or one per layer (dilation)."""
    cnn_norm: tuple[Literal["none", "layer"], ...] = ("none",)
    """Normalization after each convolution: one, or one per layer (norm; rsl_rl's `batch` is not offered:
    its running statistics would differ between ranks)."""
    cnn_max_pool: tuple[bool, ...] = (False,)
    """A 3 x 3, stride 2 max pool after the activation: one, or one per layer (max_pool)."""
    cnn_padding: Literal["none", "zeros", "reflect", "replicate", "circular"] = "none"
    """`none`, or pad each convolution so that its output is its input over the stride, with that padding mode (padding)."""
    cnn_global_pool: Literal["none", "max", "avg"] = "none"
    """Pool each channel to one value before flattening (global_pool)."""


def _per_layer(values: Sequence[Any], layer: int, name: str, layers: int) -> Any:
    """One layer's value of an argument given once for all layers or once per layer."""
    if len(values) not in (1, layers):
        raise ValueError(f"--{name} has {len(values)} values for {layers} convolutions: give one, or one per layer.")
    return values[0] if len(values) == 1 else values[layer]


def _same_padding(size: tuple[int, int], kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """rsl_rl's padding for an output of about size / stride."""
    return tuple(math.ceil((stride * (s // stride) - s - stride + dilation * (kernel - 1) + 1) / 2) for s in size)


def _out_size(
    size: tuple[int, int], kernel: int, stride: int, dilation: int, padding: tuple[int, int]
) -> tuple[int, int]:
    return tuple((s + 2 * p - dilation * (kernel - 1) - 1) // stride + 1 for s, p in zip(size, padding))


def make_cnn(shape: tuple[int, int, int], args: Any, activation: str = "elu") -> nn.Sequential:
    """One image group's encoder, (B, C, H, W) -> (B, latent), the layers of rsl_rl's `CNN` in its order
    (conv, norm, activation, max pool; then the global pool and the flatten). `args`: CnnArgs' fields, as
    attributes or as a checkpoint's dict. Its `shape` and `latent` are kept on it."""
    get = args.get if isinstance(args, Mapping) else lambda name: getattr(args, name)
    channels, (last, *size) = tuple(get("cnn_channels")), shape
    size, layers = tuple(size), []
    act = {"elu": nn.ELU, "tanh": nn.Tanh}[activation]
    for i, out in enumerate(channels):
        k, s, d = (_per_layer(get(f"cnn_{n}"), i, f"cnn-{n.replace('_', '-')}", len(channels))
                   for n in ("kernel_size", "stride", "dilation"))  # fmt: skip
        padding = _same_padding(size, k, s, d) if get("cnn_padding") != "none" else (0, 0)
        mode = get("cnn_padding") if get("cnn_padding") != "none" else "zeros"
        layers.append(nn.Conv2d(last, out, k, s, padding, d, padding_mode=mode))
        size = _out_size(size, k, s, d, padding)
        if min(size) < 1:
            raise ValueError(
                f"an image of {shape} leaves nothing after convolution {i + 1} of --cnn-channels {channels}: use "
                "smaller kernels or strides, fewer layers, or --cnn-padding zeros."
            )
        if _per_layer(get("cnn_norm"), i, "cnn-norm", len(channels)) == "layer":
            layers.append(nn.LayerNorm([out, *size]))
        layers.append(act())
        if _per_layer(get("cnn_max_pool"), i, "cnn-max-pool", len(channels)):
            layers.append(nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
            size = tuple(math.ceil(x / 2) for x in size)
        last = out
    if get("cnn_global_pool") != "none":
        layers.append({"max": nn.AdaptiveMaxPool2d, "avg": nn.AdaptiveAvgPool2d}[get("cnn_global_pool")]((1, 1)))
        size = (1, 1)
    encoder = nn.Sequential(*layers, nn.Flatten(start_dim=1))
    encoder.shape, encoder.latent = tuple(shape), last * size[0] * size[1]
    return encoder


def image_shapes(obs: Mapping[str, torch.Tensor], *groups: Sequence[str]) -> dict[str, tuple[int, int, int]]:
    """The image groups among `groups` (each a network's; 4-D: num_envs, C, H, W) -> their (C, H, W), in order.
    A checkpoint keeps them (`images`), for tools/ to rebuild the encoders from."""
    return {group: tuple(obs[group].shape[1:]) for names in groups for group in names if obs[group].ndim == 4}


def encoders(shapes: Mapping[str, Sequence[int]], args: Any, activation: str = "elu") -> nn.ModuleDict:
    """An encoder per image group (empty without images: no state-dict keys)."""
    return nn.ModuleDict({group: make_cnn(tuple(shape), args, activation) for group, shape in shapes.items()})


def inputs(obs: Mapping[str, torch.Tensor], groups: Sequence[str], args: Any) -> tuple[int, nn.ModuleDict]:
    """What a network reading `groups` is built from: the width of its flat groups, and its image groups' encoders."""
    flat = sum(obs[group].shape[-1] for group in groups if obs[group].ndim == 2)
    return flat, encoders(image_shapes(obs, groups), args, args.activation)


def latent_width(cnns: nn.ModuleDict) -> int:
    """What the encoders add to the MLP's input."""
    return sum(encoder.latent for encoder in cnns.values())


def image_width(shapes: Iterable[Sequence[int]]) -> int:
    """The columns the images of these (C, H, W) shapes take at the end of an `envs.concat` row."""
    return sum(math.prod(shape) for shape in shapes)


def flat_part(obs: torch.Tensor, cnns: nn.ModuleDict | None) -> torch.Tensor:
    """The flat groups' columns of a network's rows (..., flat + images): what its normalizer sees."""
    return obs[..., : obs.shape[-1] - image_width(e.shape for e in cnns.values())] if cnns else obs


def encode(normalizer: nn.Module, cnns: nn.ModuleDict, obs: torch.Tensor) -> torch.Tensor:
    """A network's MLP input from its `envs.concat` row (..., flat + images): the flat part normalized, then
    each image's latent. Without encoders: the normalized row, as before images existed."""
    if len(cnns) == 0:
        return normalizer(obs)
    widths = [math.prod(encoder.shape) for encoder in cnns.values()]
    flat, *images = obs.split([obs.shape[-1] - sum(widths), *widths], dim=-1)
    lead = obs.shape[:-1]
    latents = [
        encoder(image.reshape(-1, *encoder.shape)).reshape(*lead, encoder.latent)
        for encoder, image in zip(cnns.values(), images)
    ]
    return torch.cat([normalizer(flat), *latents], dim=-1)
