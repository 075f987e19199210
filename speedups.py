"""Speed-ups of a script's eager steps that never shape them (`--compile`, `--cuda-graphs`;
docs/gpu.md). A script writes each step once, as a plain function, and where the run `asked` for
one, takes the `compiled` step instead at the end of its setup, as LeanRL does.

`--compile` is torch.compile. `--cuda-graphs` is torch's own CUDA graphs through torch.compile: mode
`reduce-overhead` of inductor (with `--compile inductor`), else the `cudagraphs` backend, which
records the kernels of each compiled piece and replays them with one launch. The collective stays
out of every compiled graph (each script's `all_reduce_mean` is `torch.compiler.disable`d): a
mini-batch step runs as two compiled halves with the eager all_reduce between them, as captured
NCCL collectives have deadlocked elsewhere and no single GPU can test them.
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
    """torch.compile could not compile a step (no C++ compiler, an op its backend lacks): the run
    stops, alike on every rank; rank 0 says why."""


def asked(speed: SpeedArgs, device: torch.device) -> bool:
    """Whether the run compiles its steps: `--compile`, or `--cuda-graphs` on a CUDA device."""
    return speed.compile is not None or (speed.cuda_graphs and device.type == "cuda")


def compiled(
    step: Callable[..., Any], speed: SpeedArgs, device: torch.device
) -> Callable[..., Any]:
    """`step` compiled (`--compile`), or replayed from CUDA graphs (`--cuda-graphs` on a CUDA
    device), where `asked`. A compile that fails is one line naming the flag to drop."""
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
    """At start-up, on every rank: a ValueError of one line if `--compile inductor` cannot compile
    on this CPU (no working C++ compiler: `CXX`, else g++; on CUDA, Triton's C compiler is reported
    by the first compile); a note (where `speak`) that `--cuda-graphs` needs a CUDA device."""
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
    place without a host sync. float64 for the default CPU kernel, which reads it bit for bit as
    the Python float rsl_rl uses; float32 for the fused kernel (CUDA's, and the CPU's under
    --compile: `fused_adam`), as torch.compile drops an in-place change of a 0-dim float64 tensor
    in a graph that a break cuts short (torch 2.13)."""
    fused = True if device.type == "cuda" else fused_adam(speed, device)
    dtype = torch.float32 if fused else torch.float64
    return torch.optim.Adam(params, lr=torch.tensor(lr, dtype=dtype, device=device), fused=fused)


def fused_adam(speed: SpeedArgs, device: torch.device) -> bool | None:
    """Adam's `fused` for a run on `device`: True on CPU under --compile, where the fused kernel is
    one ready op for every parameter (compiling the default step instead adds about 6 s to each
    rank's first iteration, for a step no faster: benchmarks/README); None otherwise (torch's
    choice), so an eager CPU run keeps the default implementation's bits, rsl_rl's."""
    return True if speed.compile is not None and device.type == "cpu" else None


def same_kernels_on_every_x86() -> None:
    """Have inductor write its CPU kernels 256 bits wide (AVX2's) on every x86 CPU with AVX2,
    AVX-512 ones too. A kernel's vector width sets the order of its float sums: left to pick the
    widest, inductor gives a seed another run on an AVX-512 CPU; at 256 bits a seed gives the same
    run on all of them, as an eager run does (benchmarks/README). In inductor's config, so its cache
    keys on it."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        from torch._inductor import config

        config.cpp.simdlen = 256


def without_profiler_note(record: logging.LogRecord) -> bool:
    """Drop dynamo's warning that a profiler label (the one `Optimizer.step` puts around Adam) is
    left out of a graph: each rank printed it once, about a label only a profiler reads."""
    return not record.getMessage().startswith("Profiler record function")
