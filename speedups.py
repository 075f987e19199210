"""Speed-ups of a script's eager steps that never shape them (`--compile`, `--cuda-graphs`;
docs/gpu.md): where the run `asked` for one, a script takes the `compiled` step at the end of its
setup, as LeanRL does. `--cuda-graphs` is torch.compile's `reduce-overhead` mode (with `--compile
inductor`), else its `cudagraphs` backend. The collective stays out of every compiled graph (each
script's `all_reduce_mean` is `torch.compiler.disable`d), as captured NCCL collectives have
deadlocked elsewhere and no single GPU can test them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from common import Failure


@dataclass
class SpeedArgs:
    """Speed-ups: each wraps the same eager steps (docs/gpu.md)."""

    compile: Literal["inductor", "aot_eager", "eager"] | None = None
    """torch.compile backend of the policy step and the optimizer steps: `inductor` (needs a C++
    compiler on CPU), or `aot_eager` and `eager`, which trace the same graphs without generating
    code (no compiler; slower than no --compile). The all_reduce stays eager between compiled
    halves."""
    cuda_graphs: bool = False
    """Replay the compiled steps from CUDA graphs, torch.compile's own (`reduce-overhead`), the
    all_reduce eager between two. Needs a CUDA device; elsewhere a note, and the steps run as
    without."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """`bf16`: the update's forward passes and losses autocast to bfloat16, without a gradient
    scaler (rsl_rl 5.5's use_mixed_precision); weights, gradients, optimizer and the rollout stay
    float32."""


class CompileFailed(Failure):
    """torch.compile could not compile a step: the run stops, alike on every rank."""


def asked(speed: SpeedArgs, device: torch.device) -> bool:
    """Whether the run compiles its steps: `--compile`, or `--cuda-graphs` on a CUDA device."""
    return speed.compile is not None or (speed.cuda_graphs and device.type == "cuda")


def compiled(
    step: Callable[..., Any], speed: SpeedArgs, device: torch.device
) -> Callable[..., Any]:
    """`step` compiled, or replayed from CUDA graphs; a compile that fails is one line."""
    graphs = speed.cuda_graphs and device.type == "cuda"
    if speed.compile == "inductor":
        same_kernels_on_every_x86()
    logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(without_profiler_note)
    if graphs:  # inductor's kernels replayed, or (`cudagraphs`) the traced ops' own
        inductor = speed.compile == "inductor"
        mode, backend = ("reduce-overhead", "inductor") if inductor else (None, "cudagraphs")
    else:
        mode, backend = None, speed.compile
    compiled = torch.compile(step, backend=backend, mode=mode)
    flag = f"--compile {speed.compile}" if speed.compile else "--cuda-graphs"

    def call(*args: Any) -> Any:
        try:
            return compiled(*args)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            inner = error.inner_exception
            raise CompileFailed(
                f"{flag} failed ({type(inner).__name__}: {str(inner).splitlines()[0][:200]}); run "
                "without it, or with --compile aot_eager where no C++ compiler is installed."
            ) from None

    return call


def check(speed: SpeedArgs, device: torch.device, speak: bool) -> None:
    """A ValueError if `--compile inductor` has no working C++ compiler on this CPU (on CUDA, the
    first compile reports Triton's); a note (where `speak`) that `--cuda-graphs` needs CUDA."""
    if speed.cuda_graphs and device.type != "cuda" and speak:
        print(f"note: --cuda-graphs needs a CUDA device (this run is on {device.type}): not used.")
    if speed.compile != "inductor" or device.type != "cpu":
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:  # a torch that names them otherwise: the first compile says what is missing
        return
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as error:  # none on PATH, or CXX names none that works
        raise ValueError(
            f"--compile inductor needs a C++ compiler ({str(error).splitlines()[0][:200]}): "
            "install g++, or pass --compile aot_eager, or leave --compile out."
        ) from None


def adam(
    params: list[torch.nn.Parameter], lr: float, speed: SpeedArgs, device: torch.device
) -> Any:
    """Adam whose learning rate is a 0-dim tensor on `device`, so that the KL rule changes it in
    place without a host sync. float64 for the default CPU kernel (the bits of rsl_rl's Python
    float); float32 for the fused kernel, as torch.compile drops an in-place change of a 0-dim
    float64 tensor in a graph that a break cuts short (torch 2.13)."""
    fused = True if device.type == "cuda" else fused_adam(speed, device)
    dtype = torch.float32 if fused else torch.float64
    return torch.optim.Adam(params, lr=torch.tensor(lr, dtype=dtype, device=device), fused=fused)


def fused_adam(speed: SpeedArgs, device: torch.device) -> bool | None:
    """Adam's `fused`: True on CPU under --compile (compiling the default step adds about 6 s to
    the first iteration, for a step no faster: benchmarks/README); else None (torch's choice), so
    that an eager CPU run keeps rsl_rl's bits."""
    return True if speed.compile is not None and device.type == "cpu" else None


def same_kernels_on_every_x86() -> None:
    """Inductor's CPU kernels 256 bits wide on every x86 CPU with AVX2, AVX-512 ones too: the
    vector width sets the order of float sums, so a seed gives the same run on all of them
    (benchmarks/README). In inductor's config, so that its cache keys on it."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        from torch._inductor import config

        config.cpp.simdlen = 256


def without_profiler_note(record: logging.LogRecord) -> bool:
    """Drop dynamo's warning that `Optimizer.step`'s profiler label is left out of a graph."""
    return not record.getMessage().startswith("Profiler record function")
