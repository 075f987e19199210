"""CUDA graphs and torch.compile around the scripts' eager steps (`--cuda-graphs`, `--compile`; docs/gpu.md).
Nothing here changes what a step computes: a script writes each step once, as a plain function, and
`cuda_graph(step, graphs)` or `compiled(step, backend)` wraps it.

A graph records the kernels of one call and replays all of them with one launch: for steps bound by
launching kernels from Python (a PPO mini-batch launches hundreds) rather than by the GPU. A collective
stays out of every graph: `eager(fn, tensor)`, which `common.all_reduce_mean` calls, cuts the recording
there, so that a replay runs the graph before it, then `fn` eagerly, then the graph after it (captured
NCCL collectives have deadlocked elsewhere, and no one GPU can test them).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

GRAPH: Any = torch.cuda.CUDAGraph  # what records and replays one graph; the CPU tests put a stand-in here
_cuts: list[Callable[[Callable[[], None]], None]] = []  # while a capture records: how to cut it at an `eager` call


def use_cuda_graphs(cuda_graphs: bool, device: torch.device, speak: bool) -> bool:
    """Whether to capture CUDA graphs (`graphs`, as the scripts call it): `--cuda-graphs` on a CUDA device. Elsewhere a note (printed
    where `speak`, rank 0) says so in one line and the run goes on with the same steps, eagerly."""
    if cuda_graphs and device.type != "cuda" and speak:
        print(f"note: --cuda-graphs needs a CUDA device (this run is on {device.type}): running eagerly.", flush=True)
    return cuda_graphs and device.type == "cuda"


def cuda_graph(fn: Callable[..., Any], graphs: bool, warmup: int = 3) -> Callable[..., Any]:
    """`fn(*args)` replayed from CUDA graphs when `graphs`, else `fn` itself; `args`: tensors, or dicts and tuples of them.

    The first `warmup` calls run `fn` eagerly on a side stream: they do their work and settle lazy set-up
    (cuBLAS handles, NCCL communicators, optimizer state, gradient tensors). The next call captures `fn` on
    copies of its arguments; from then on every call copies its tensors into those and replays. So `fn`
    must keep its shapes, never wait for the host, write its results in place or return them (returned
    tensors are overwritten by the next call), read only its arguments and tensors that outlive the
    graph, and draw random numbers from the CUDA generator only (replays draw new ones). Python runs once,
    at capture: a Python value `fn` reads (a size, a float) is frozen there, so pass what changes as a tensor.
    """
    if not graphs:
        return fn
    side, calls, inputs, plan, outputs = torch.cuda.Stream(), 0, [], [], None

    def call(*args: Any) -> Any:
        nonlocal calls, outputs
        calls += 1
        if calls <= warmup:
            return on_side_stream(fn, args, side)
        tensors, layout = pytree.tree_flatten(args)  # the tensors of the arguments, dicts of them included
        if not plan:
            inputs.extend(tensor.clone() for tensor in tensors)
            plan[:], outputs = capture(fn, pytree.tree_unflatten(inputs, layout), side)
        for captured, tensor in zip(inputs, tensors):
            captured.copy_(tensor)
        for replay_or_eager_call in plan:
            replay_or_eager_call()
        return outputs

    return call


@torch.compiler.disable  # torch.compile stops here too: the compiled step runs in two halves, `fn` between them
def eager(fn: Callable[..., None], *args: Any) -> None:
    """`fn(*args)`, which works in place and returns nothing (a collective), outside every CUDA graph and every
    torch.compile'd graph: while a capture records, the graph so far ends here, and every replay runs `fn`
    between it and the next."""
    if _cuts:
        _cuts[-1](lambda: fn(*args))
    else:
        fn(*args)


def compiled(fn: Callable[..., Any], backend: str | None) -> Callable[..., Any]:
    """`fn` compiled by torch.compile with `backend` (`--compile`: `inductor`, or `aot_eager` without a C++
    compiler), or `fn` itself for None. Its backward and optimizer step are compiled too (on CPU, Adam's fused
    kernel runs as it is: `fused_adam`; on x86, kernels 256 bits wide: `same_kernels_on_every_x86`), each
    function it calls as a graph of its own where dynamo cannot trace `fn` whole (PPO's step: `zero_grad`);
    `eager` calls (the collective) stay out. A compile that fails is one line naming the flag to drop. From
    the first call on, dynamo's note that it leaves a profiler label out of a graph no longer prints, in the
    whole process (`_without_profiler_note`)."""
    if backend is None:
        return fn
    if backend == "inductor":
        same_kernels_on_every_x86()
    logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(_without_profiler_note)
    step = torch.compile(fn, backend=backend)

    def call(*args: Any) -> Any:
        try:
            return step(*args)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            raise CompileFailed(
                f"--compile {backend} failed ({type(error.inner_exception).__name__}: "
                f"{str(error.inner_exception).splitlines()[0][:200]}); run without --compile, or with "
                "--compile aot_eager where no C++ compiler is installed."
            ) from None

    return call


def same_kernels_on_every_x86() -> None:
    """Have inductor write its CPU kernels 256 bits wide (AVX2's) on every x86 CPU with AVX2, AVX-512 ones too. A
    kernel's vector width sets the order of its float sums, so left to pick the widest, inductor gives a seed
    another run on an AVX-512 CPU; at 256 bits a seed gives the same run on all of them, as an eager run does, and
    at this project's sizes the step is no slower (benchmarks/README). In inductor's config, so its cache keys
    on it. Elsewhere (ARM, x86 without AVX2) inductor's own choice stands."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        from torch._inductor import config

        config.cpp.simdlen = 256


def check_backend(backend: str | None, device: torch.device) -> None:
    """Raise one ValueError if `--compile inductor` cannot compile on this CPU: no working C++ compiler (`CXX`,
    else g++), which inductor needs for its CPU kernels. On CUDA its Triton kernels need a C compiler instead;
    the first compile reports one that is missing (`compiled`). Local; at start-up, before anything is written."""
    if backend != "inductor" or device.type != "cpu":
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
            f"--compile inductor needs a C++ compiler ({str(error).splitlines()[0][:200]}): install g++, or "
            "pass --compile aot_eager, or leave --compile out."
        ) from None


def fused_adam(backend: str | None, device: torch.device) -> bool | None:
    """Adam's `fused` for a run with `--compile backend` on `device`: True on CPU under --compile, where the
    fused kernel is one ready op for every parameter (compiling the default foreach step instead adds about
    6 s to each rank's first iteration, for a step no faster: benchmarks/README); None otherwise (torch's
    choice), so that an eager CPU run keeps the default implementation's bits, rsl_rl's."""
    return True if backend is not None and device.type == "cpu" else None


def _without_profiler_note(record: logging.LogRecord) -> bool:
    """Drop dynamo's warning that a profiler label (the one `Optimizer.step` puts around Adam) is left out of
    a graph: each rank printed it once, about a label only a profiler reads. Any such label's, any function's."""
    return not record.getMessage().startswith("Profiler record function")


class CompileFailed(ValueError):
    """torch.compile could not compile a step (no C++ compiler, an op its backend lacks): the run stops."""


def capture(fn: Callable[..., Any], inputs: tuple[Any, ...], side: Any) -> tuple[list[Callable[[], None]], Any]:
    """Record the kernels of `fn(*inputs)` on the stream `side`, without running them, as a chain of graphs
    cut at every `eager` call -> (what a replay calls in order: each graph's replay and each eager call,
    `fn`'s outputs). The graphs share one memory pool, so a tensor one writes, the next can read."""
    plan: list[Callable[[], None]] = []
    graphs: list[Any] = []

    def begin() -> None:
        graphs.append(GRAPH())
        graphs[-1].capture_begin(pool=graphs[0].pool() if len(graphs) > 1 else None)

    def end() -> None:
        graphs[-1].capture_end()
        plan.append(graphs[-1].replay)

    def cut(eager_call: Callable[[], None]) -> None:
        end()
        plan.append(eager_call)
        begin()

    with torch.cuda.stream(side):
        begin()
        _cuts.append(cut)
        try:
            outputs = fn(*inputs)
        finally:
            _cuts.pop()
            end()
    return plan, outputs


def on_side_stream(fn: Callable[..., Any], args: tuple[Any, ...], side: Any) -> Any:
    """`fn(*args)`, eagerly, on the CUDA stream `side`, after the current stream's work and before its next."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), warnings.catch_warnings():
        # Optimizers built for capture warn when they step uncaptured, which warm-up does by design.
        warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
        result = fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    return result
