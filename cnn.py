"""The CNN encoder of an image observation group, as rsl_rl 5.5.1's `CNN` builds it; imported by
`networks.Inputs` only where a network reads an image. Convolutions, each with an optional norm,
the activation and an optional max pool, then an optional global pool, flattened. The layer
indices, and so the state-dict keys, are those of rsl_rl's `CNN`, and its arguments map one to
one:

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

Local: no communication.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn


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
