"""Plumbing the three scripts share: process group and device rule, sync primitives, CUDA graphs,
cross-rank guards, the observation normalizer merged across ranks, run bookkeeping and rank-0
logging, checkpoints, stop handling. No algorithm lives here (PPO is in ppo_ddp.py, AMP in
ppo_amp_ddp.py, DAgger in distill_ddp.py) and no task (envs/).

Every function that talks to other ranks says so in its docstring, and every rank must call it in
the same order: a collective that one rank skips is a hang.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import hashlib
import importlib
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import tyro
from torch import nn

import envs

# --- Process group --------------------------------------------------------------------------------


class Failure(Exception):
    """An expected failure every rank has been told of: bad input, a rank that failed or disagrees, NaN/Inf,
    a failed write. The job prints it once, as one line without traceback, on rank `speaker` (-1: on none,
    the cause is printed already), and exits 1 (`run`). Any other exception keeps its traceback."""

    def __init__(self, message: str, speaker: int = 0) -> None:
        super().__init__(message)
        self.speaker = speaker


@dataclass(frozen=True)
class Dist:
    """Where this process stands: global rank, rank on its node, world size, device; the start-up group."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    start_group: Any = None  # gloo, with the start-up timeout: carries the start-up agreement

    @property
    def is_main(self) -> bool:  # rank 0 alone prints, logs and writes files
        return self.rank == 0


def resolve_device(device: str, local_rank: int, world_size: int = 1, gpus: int | None = None) -> torch.device:
    """`auto` is `cuda:{LOCAL_RANK}` when there is a GPU, else `cpu`. With several processes each must use
    its own GPU, `cuda:{LOCAL_RANK}` (what `cuda` alone means); one process may use any. `gpus` is the
    node's GPU count (torch's when None; tests fake it)."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: pass auto, cpu, cuda or cuda:N.") from None
    if resolved.type != "cuda":
        return resolved
    if resolved.index is None:
        resolved = torch.device("cuda", local_rank)
    if world_size > 1 and resolved.index != local_rank:
        # Two ranks bound to one GPU train fine but twice as slowly, and NCCL may deadlock.
        raise ValueError(
            f"device {device!r} is not cuda:LOCAL_RANK: with several processes each must use its own GPU. "
            "Pass --device auto (or cuda), or cuda:$LOCAL_RANK per process."
        )
    if not gpus:
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here.")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if world_size > 1 else 1
    if per_node > gpus:  # the same words on every rank of the node: one line for the job
        raise ValueError(
            f"{per_node} processes per node but this node has {gpus} GPU(s): no GPU for LOCAL_RANK {gpus} and up. "
            f"Start at most {gpus} per node, or pass --device cpu."
        )
    if resolved.index >= gpus:
        raise ValueError(f"no GPU cuda:{resolved.index}: this node has {gpus} GPU(s).")
    return resolved


def setup_distributed(
    device: str = "auto", seed: int = 0, timeout_s: float = 60.0, start_timeout_s: float = 1200.0
) -> Dist:
    """Read WORLD_SIZE/RANK/LOCAL_RANK (set by torchrun), join the process group (NCCL on CUDA, gloo on
    CPU, a finite timeout so a lost rank ends the job) and a gloo group with the longer start-up timeout,
    resolve the device (all ranks agree, or fail together), seed with `seed + RANK` (the global rank)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    start_group = None
    if world_size > 1 and not dist.is_initialized():
        # torch._dynamo (imported by torch.optim on first use) imported after init_process_group keeps the
        # group alive past destroy_process_group, and gloo's threads can then abort the exit. Import it first.
        importlib.import_module("torch._dynamo")
        cuda = torch.cuda.is_available() and device.startswith(("auto", "cuda"))
        timeout = datetime.timedelta(seconds=timeout_s)
        where = _attempt_store(rank, world_size, start_timeout_s)  # {} : env://, torchrun's MASTER_ADDR/PORT
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, **where)
        # Rank 0 gives up waiting first and speaks for the job; the others stop with it.
        start_timeout = datetime.timedelta(seconds=start_timeout_s + 10 * (rank > 0))
        start_group = dist.new_group(backend="gloo", timeout=start_timeout)
    ctx = Dist(rank, local_rank, world_size, torch.device("cpu"), start_group)
    # SYNC: whether this rank's device exists is known on this rank only; one all_gather on the start-up
    # group lets every rank stop together, and the job print one line, if any rank has none.
    with start_together(ctx):
        resolved = resolve_device(device, local_rank, world_size)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    elif resolved.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N processes on one machine must share the cores, not each take all of them.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    torch.manual_seed(seed + rank)
    return dataclasses.replace(ctx, device=resolved)


def _attempt_store(rank: int, world_size: int, timeout_s: float) -> dict[str, Any]:
    """torchrun keeps one store for every restart of a job (`--max-restarts`), so a restarted group would
    read the addresses its dead predecessor published there and fail to connect (pytorch#135712). Give
    each attempt its own key prefix: every rank counts its own starts, which agree because torchrun
    restarts all workers together (so the ranks must stay the same: elastic membership changes are not
    supported). Nothing (the usual env:// start) outside torchrun's shared store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = store.add(f"ddp_attempts/rank{rank}", 1)
    return {"store": dist.PrefixStore(f"ddp_attempt{attempt}", store), "rank": rank, "world_size": world_size}


@contextlib.contextmanager
def distributed(
    device: str = "auto", seed: int = 0, timeout_s: float = 60.0, start_timeout_s: float = 1200.0
) -> Iterator[Dist]:
    """`setup_distributed` as a context: on exit, error or not, the SIGTERM/SIGINT handlers are put back and
    the group destroyed, after one barrier on a normal exit. A `Failure` is printed here, on its speaker,
    before the group goes (torchrun stops the other ranks as soon as one exits)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        ctx = setup_distributed(device, seed, timeout_s, start_timeout_s)
        yield ctx
        if dist.is_initialized():
            # SYNC: no rank tears the group down while another may still be finishing its last collective.
            dist.barrier(device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    except Failure as failure:
        if failure.speaker == int(os.environ.get("RANK", "0")):
            print("error: " + str(failure).replace("\n", " "), file=sys.stderr, flush=True)
        raise
    finally:
        release_run_dir()  # rank 0's hold on its run directory, also after a failure
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if dist.is_initialized():
            dist.destroy_process_group()


def run(
    main: Callable[[Any], Any], args_type: type, task_defaults: Callable[[str], dict[str, Any]] | None = None
) -> None:
    """The scripts' entry point: parse the command line (rank 0 alone prints help, a usage error, and the
    settings the task brought: the command line is the same on every rank), run `main(args)`, exit
    with 1 on a `Failure`. `task_defaults`: see `parse_args`."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        with open(os.devnull, "w") as null, contextlib.ExitStack() as stack:
            if rank:
                stack.enter_context(contextlib.redirect_stdout(null))
                stack.enter_context(contextlib.redirect_stderr(null))
            args = parse_args(args_type, task_defaults)  # SystemExit on --help or a usage error
        main(args)
    except (Failure, SystemExit) as stop:
        code, speaker = (1, stop.speaker) if isinstance(stop, Failure) else (stop.code, 0)
        if code and rank != speaker and "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(5)  # torchrun stops every rank once one fails: let the one that speaks print first
        sys.exit(code)


def parse_args(
    args_type: type, task_defaults: Callable[[str], dict[str, Any]] | None = None, argv: list[str] | None = None
) -> Any:
    """The command line (`argv`, default sys.argv) as `args_type`. With `task_defaults(task)` (a field -> value
    map, envs.task_defaults), the task's family supplies defaults of its own, an argument given on the
    command line always wins, and one line says which settings the run took from the task."""
    args = tyro.cli(args_type, args=argv)
    fields = {field.name for field in dataclasses.fields(args_type)}
    brought = (task_defaults(args.task) if task_defaults else {}).items()
    brought = {k: tuple(v) if isinstance(v, list) else v for k, v in brought if k in fields}
    if not brought:
        return args
    plain = args_type()
    with_task = tyro.cli(args_type, args=argv, default=dataclasses.replace(plain, **brought))
    # Taken from the task: what the command line left at the script's default, and the task changes.
    taken = [k for k, v in brought.items() if getattr(args, k) == getattr(plain, k) != v == getattr(with_task, k)]
    if taken:
        flags = " ".join(cli_flag(k, getattr(with_task, k)) for k in taken)
        print(f"settings from {args.task}: {flags} (an argument on the command line overrides any)", flush=True)
    return with_task


def cli_flag(name: str, value: Any) -> str:
    """How `value` of field `name` is written on the command line: `--num-envs 64`, `--no-normalize-obs`."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, tuple) else value}"


# --- Cross-rank guards and sync primitives: every rank takes the same decision, none waits alone ---


def all_gather_ints(ctx: Dist, values: list[int], group: Any = None) -> list[list[int]]:
    """Every rank's list of integers, by rank (one all_gather; over `group` on the CPU when one is given)."""
    if ctx.world_size == 1:
        return [values]
    local = torch.tensor(values, dtype=torch.int64, device="cpu" if group is not None else ctx.device)
    gathered = [torch.zeros_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, local, group=group)
    return [g.tolist() for g in gathered]


def digest(value: str) -> int:
    """A 56-bit hash of `value` that fits an int64 tensor: what ranks compare instead of the string."""
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:7], "little")


def gather_at_start(ctx: Dist, values: list[int]) -> list[list[int]]:
    """`all_gather_ints` over the start-up group, whose timeout is --start-timeout-s; a timeout is a `Failure`."""
    try:
        return all_gather_ints(ctx, values, ctx.start_group)
    except RuntimeError as e:
        if "timed out" not in str(e).lower():
            raise
        slow = "not every rank finished start-up within --start-timeout-s"
        raise Failure(f"{slow}; raise it for a slow simulator, or find the rank that hangs.", ctx.rank) from None


@contextlib.contextmanager
def start_together(ctx: Dist, args: Any = None, what: str = "") -> Iterator[Callable[..., None]]:
    """`with start_together(ctx, args, what) as agree:` around what each rank does alone at start-up (check
    arguments, read files, build the env), ending with `agree(*values)`; `what` names the values. One
    all_gather over the start-up group, whose long timeout lets a simulator boot. Every rank raises a
    `Failure` if the block failed on any rank, or if ranks differ in `args` (the device by type only:
    `cuda:$LOCAL_RANK` is one rule) or in `values`. Bad input (ValueError, OSError) is printed as one
    line: by rank 0 if every rank failed alike, else as `rank k: ...`; any other error keeps its traceback."""
    fields = {**dataclasses.asdict(args), "device": ctx.device.type} if args is not None else {}
    values: list[Any] = []
    status, message, error = 0, "", None  # status 1: bad input, 2: unexpected error
    try:
        yield lambda *v: values.extend(v)
    except (Failure, ValueError, OSError) as e:
        status, message = 1, str(e)
    except Exception as e:  # noqa: BLE001 - the other ranks must hear of it before this one raises
        status, error = 2, e
    mine = [status, digest(message), digest(repr(values)), *(digest(repr(v)) for v in fields.values())]
    gathered = gather_at_start(ctx, mine)
    if error is not None:
        raise error
    failed = [r for r, g in enumerate(gathered) if g[0]]
    if status == 1:
        alike = [r for r in failed if gathered[r][:2] == mine[:2]]
        who = "" if len(alike) == ctx.world_size else f"rank{'s' * (len(alike) > 1)} {', '.join(map(str, alike))}: "
        raise Failure(who + message, speaker=alike[0]) from None
    if failed:
        raise Failure(f"rank(s) {failed} failed at start-up; stopping every rank.", speaker=-1)
    names = [what, *(f"--{name.replace('_', '-')}" for name in fields)]
    differ = [i for i in range(len(names)) if any(g[2 + i] != gathered[0][2 + i] for g in gathered)]
    if differ:
        ranks = [r for r, g in enumerate(gathered) if g[2:] != gathered[0][2:]]
        raise Failure(
            f"rank(s) {ranks} disagree with rank 0 on {', '.join(names[i] for i in differ)}; launch every rank with the same command line and environment."
        )


def raise_if_nonfinite(ctx: Dist, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise on every rank if any rank holds NaN/Inf in `tensors`, naming rank and tensor. One all_reduce."""
    flags = torch.zeros(ctx.world_size, len(tensors), device=ctx.device)
    flags[ctx.rank] = torch.stack([~torch.isfinite(t).all() for t in tensors.values()]).float()
    reduced = all_reduce_sum(flags, ctx.world_size).tolist()  # one read back to the host
    bad = [(rank, j) for rank, row in enumerate(reduced) for j, flag in enumerate(row) if flag]
    if bad:
        names = list(tensors)
        found = ", ".join(f"{names[j]} on rank {i}" for i, j in bad)
        raise Failure(
            f"non-finite values (NaN/Inf) in {found} {where}; fix the environment or lower the learning rate. No checkpoint was written for this iteration."
        )


def nonfinite_flags(value: torch.Tensor, ctx: Dist) -> torch.Tensor:
    """(world_size,) zeros, 1 in this rank's slot if `value` is not finite: sent in the gradient all_reduce."""
    flags = torch.zeros(ctx.world_size, device=ctx.device)
    flags[ctx.rank] = (~torch.isfinite(value)).float()
    return flags


def first_flags(seen: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
    """The flags of the first flagged step: NaN spreads through the all_reduce, later flags blame all ranks."""
    return torch.where(seen.any(), seen, reduced)


def update_totals(count: int, ctx: Dist) -> dict[str, torch.Tensor]:
    """An update's running sums, which its optimizer steps add to in place (so a CUDA graph can replay
    them): `statistics` (count,) averaged over ranks, `flags` (which rank's loss went non-finite
    first), `grad_norm_ok`. `reset_totals` before each update, `read_update` after it."""
    return {
        "statistics": torch.zeros(count, device=ctx.device),
        "flags": torch.zeros(ctx.world_size, device=ctx.device),
        "grad_norm_ok": torch.ones((), dtype=torch.bool, device=ctx.device),
    }


def reset_totals(totals: dict[str, torch.Tensor]) -> None:
    """Statistics and flags back to 0, grad_norm_ok to True, in place."""
    for total in totals.values():
        total.fill_(total.dtype == torch.bool)


def read_update(statistics: torch.Tensor, totals: dict[str, torch.Tensor], loss: str, sources: str) -> list[float]:
    """After an update, read `statistics` (its totals, or a function of them) back to the host with the
    update's checks in the same read (one host sync), and raise if a rank's loss or the averaged
    gradient norm was not finite: both come out of the all_reduce, so every rank raises together,
    before any checkpoint."""
    values = torch.cat([statistics, totals["flags"], totals["grad_norm_ok"].reshape(1)]).tolist()
    ranks = [rank for rank, flag in enumerate(values[statistics.numel() : -1]) if flag]
    problem = f"non-finite {loss} on rank(s) {ranks}; {sources} produced NaN/Inf" if ranks else ""
    if problem or not values[-1]:
        problem = problem or f"non-finite gradient in the update of the {loss}; lower the learning rate"
        raise Failure(f"{problem}. No checkpoint was written.")
    return values[: statistics.numel()]


def check_ranks_agree(
    ctx: Dist, it: int, interval: int, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> None:
    """Every `interval` iterations (0: never), all ranks raise if one's trained state differs (1 all_gather)."""
    if not interval or it % interval:
        return
    gathered = all_gather_ints(ctx, [digest(state_fingerprint(trained_tensors(modules, optimizers)))])
    differing = [r for r, g in enumerate(gathered) if g != gathered[0]]
    if differing:
        raise Failure(
            f"rank(s) {differing} disagree with rank 0 on the trained state at iteration {it}; ranks drifted apart; report this as a bug."
        )


@torch.no_grad()
def broadcast_state(modules: list[nn.Module], world_size: int) -> None:
    """Copy rank 0's parameters *and* buffers (normalizer statistics) into every rank's modules."""
    if world_size == 1:
        return
    for module in modules:
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)


def flatten_gradients(params: list[nn.Parameter], extras: torch.Tensor | None = None) -> torch.Tensor:
    """The gradients of `params`, then `extras` (the KL, loss statistics), in one flat buffer: the layout
    every rank sends. A missing gradient counts as zeros. Local."""
    pieces = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params]
    if extras is not None:
        pieces.append(extras.reshape(-1).to(pieces[0].dtype))
    return torch.cat(pieces)


def all_reduce_mean(flat: torch.Tensor, world_size: int) -> None:
    """Average `flat` over ranks, in place: one all_reduce (a sum), divided by the world size."""
    if world_size > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= world_size


def unflatten_gradients(params: list[nn.Parameter], flat: torch.Tensor) -> torch.Tensor:
    """Copy the gradients in a `flatten_gradients` buffer back into `params` -> the rest (the extras). Local."""
    offset = 0
    for p in params:
        synced = flat[offset : offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = synced.clone()
        else:
            p.grad.copy_(synced)
        offset += p.numel()
    return flat[offset:]


def all_reduce_gradients(
    params: list[nn.Parameter], world_size: int, extras: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Average gradients over ranks with ONE all_reduce of a flat buffer; `extras` (the KL, loss statistics)
    ride along and come back averaged. The three pieces above, in a row."""
    flat = flatten_gradients(params, extras)
    all_reduce_mean(flat, world_size)
    rest = unflatten_gradients(params, flat)
    return rest if extras is not None else None


def use_cuda_graphs(wanted: bool, ctx: Dist, whole: bool = False) -> bool:
    """Whether to capture CUDA graphs: `wanted` (--cuda-graphs) on a CUDA device. Elsewhere rank 0
    says so in one line and the run goes on with the same steps, eagerly. `whole` (--cuda-graphs-full)
    without `wanted` is a ValueError."""
    if whole and not wanted:
        raise ValueError("--cuda-graphs-full changes what --cuda-graphs captures: pass both, or neither.")
    if wanted and ctx.device.type != "cuda" and ctx.rank == 0:
        print(
            f"note: --cuda-graphs needs a CUDA device (this run is on {ctx.device.type}): running eagerly.", flush=True
        )
    return wanted and ctx.device.type == "cuda"


def cuda_graph(
    fn: Callable[..., Any], on: bool, warmup: int = 3, deadline_s: float | None = None
) -> Callable[..., Any]:
    """`fn(*tensors)` replayed from a CUDA graph when `on`, else `fn` itself: for steps bound by launching
    kernels from Python (a PPO mini-batch launches hundreds) rather than by the GPU.

    The first `warmup` calls run `fn` eagerly on a side stream: they do their work and settle lazy
    set-up (cuBLAS handles, NCCL communicators, optimizer state, gradient tensors). The next call
    captures `fn` on copies of its arguments, then every call copies its tensors into those and
    replays all of `fn`'s kernels at once. So `fn` must keep its shapes, never wait for the host,
    write its results in place or return them (returned tensors are overwritten by the next call),
    read only its arguments and tensors that outlive the graph, and draw random numbers from the CUDA
    generator only (replays draw new ones). Python runs once, at capture: a Python value `fn` reads
    (a size, a float) is frozen there, so pass anything that changes as a tensor.

    `deadline_s`, for an `fn` with a collective inside: its capture and first replay must end within
    that many seconds, or the process does (`deadline`).
    """
    if not on:
        return fn
    side, calls, replay, inputs, outputs = torch.cuda.Stream(), 0, None, [], None

    def call(*args: torch.Tensor) -> Any:
        nonlocal calls, replay, outputs
        calls += 1
        if calls <= warmup:
            return on_side_stream(fn, args, side)
        first = replay is None and deadline_s is not None
        with deadline(deadline_s if first else None):
            if replay is None:
                inputs.extend(arg.clone() for arg in args)
                replay, outputs = capture(fn, inputs, collective=deadline_s is not None)
            for captured, arg in zip(inputs, args):
                captured.copy_(arg)
            replay()
            if first:
                torch.cuda.synchronize()  # the first replay's collective has met every other rank's
        return outputs

    return call


def synced_step(
    before: Callable[..., tuple[torch.Tensor, ...]], all_reduce: Callable[[torch.Tensor], None],
    after: Callable[[torch.Tensor], None], graphs: bool, ctx: Dist, whole: bool, timeout_s: float,
) -> Callable[..., tuple[torch.Tensor, ...]]:  # fmt: skip
    """A step in two halves around its one collective: `before(*inputs)` -> (flat buffer, *more), then
    `all_reduce(flat)` in place, then `after(flat)`; returns before's outputs. With `graphs`: one CUDA
    graph on one rank, or with `whole` (the collective captured, under a deadline of `timeout_s`);
    else two graphs and the collective eager between them (docs/gpu.md)."""
    split = graphs and ctx.world_size > 1 and not whole
    before, after = cuda_graph(before, split), cuda_graph(after, split)

    def step(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = before(*inputs)
        all_reduce(outputs[0])
        after(outputs[0])
        return outputs

    return cuda_graph(step, graphs and not split, deadline_s=timeout_s if ctx.world_size > 1 else None)


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """End the process (exit code 1, one `error:` line from rank 0) if the block, a CUDA graph capture with a
    collective inside, lasts more than `seconds` (None: no limit): the process group's timeout may not see it."""
    if seconds is None:
        yield
        return
    timer = threading.Timer(seconds, _capture_timed_out, (seconds,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _capture_timed_out(seconds: float) -> None:
    """The watchdog thread's end of a `deadline`: rank 0 says why, every rank exits with code 1."""
    if int(os.environ.get("RANK", "0")) == 0:
        hang = "a CUDA graph with its all_reduce inside (--cuda-graphs-full) did not finish its capture and first"
        hang += f" replay within --dist-timeout-s ({seconds:g} s); run without --cuda-graphs-full (docs/gpu.md)."
        print(f"error: {hang}", file=sys.stderr, flush=True)
    else:
        time.sleep(5)  # torchrun stops every rank once one exits: let rank 0 print first
    os._exit(1)  # the main thread is stuck in CUDA: no exception could reach it


def on_side_stream(fn: Callable[..., Any], args: tuple[torch.Tensor, ...], side: Any) -> Any:
    """`fn(*args)`, eagerly, on the CUDA stream `side`, after the current stream's work and before its next."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), warnings.catch_warnings():
        # Optimizers built for capture warn when they step uncaptured, which warm-up does by design.
        warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
        result = fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    return result


def capture(
    fn: Callable[..., Any], inputs: list[torch.Tensor], collective: bool = False
) -> tuple[Callable[[], None], Any]:
    """Record the kernels of `fn(*inputs)` in a CUDA graph, without running them -> (replay, fn's outputs).
    With a `collective` inside, in the `thread_local` capture mode: NCCL's own threads touch CUDA meanwhile."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local" if collective else "global"):
        outputs = fn(*inputs)
    return graph.replay, outputs


def all_reduce_sum(values: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum a small float64 vector over ranks (episode statistics, flags). One all_reduce."""
    values = values.to(torch.float64)
    if world_size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def state_fingerprint(tensors: list[torch.Tensor]) -> str:
    """SHA-256 of the exact bytes of the given tensors, in order: equal only if bitwise equal."""
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def trained_tensors(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every tensor that training changes: module states and optimizer states (step, moments, lr)."""
    tensors = [t for m in modules for t in m.state_dict().values()]
    for opt in optimizers:
        for state in opt.state_dict()["state"].values():
            tensors += [v if torch.is_tensor(v) else torch.tensor(float(v)) for v in state.values()]
        tensors += [torch.tensor(float(g["lr"]), dtype=torch.float64) for g in opt.param_groups]
    return tensors


def merge_moments(
    a: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan et al.'s parallel-variance merge of `(count, mean, M2)` triples."""
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    n = n_a + n_b
    delta = mean_b - mean_a
    safe_n = n.clamp(min=1)
    return n, mean_a + delta * n_b / safe_n, m2_a + m2_b + delta * delta * n_a * n_b / safe_n


class EmpiricalNormalizer(nn.Module):
    """Observation normalizer `(x - mean) / (std + eps)` whose statistics cover every rank's data."""

    def __init__(self, dim: int, eps: float = 1e-2, until: float | None = None) -> None:
        super().__init__()
        self.eps, self.until = eps, until  # `until`: stop learning once this many samples were seen (rsl_rl)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(dim, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize `x` (..., dim) with the current statistics."""
        return (x - self.mean.to(x.dtype)) / (self.var.sqrt().to(x.dtype) + self.eps)

    def update(self, x: torch.Tensor, world_size: int) -> None:
        """Fold every rank's batch of raw inputs `x` into the statistics (one all_gather)."""
        update_normalizers([(self, x)], world_size)


@torch.no_grad()
def update_normalizers(batches: list[tuple[EmpiricalNormalizer, torch.Tensor]], world_size: int) -> None:
    """Fold every rank's batch into each of several normalizers with ONE all_gather for all of them:
    each rank's (count, mean, M2) of each batch, merged in rank order, so every rank gets the same
    bits, of the union of the batches."""
    local = []
    for normalizer, x in batches:
        x = x.reshape(-1, normalizer.mean.numel()).to(torch.float64)
        count = torch.tensor([x.shape[0]], dtype=torch.float64, device=x.device)
        local += [count, x.mean(0), ((x - x.mean(0)) ** 2).sum(0)]
    if not local:
        return
    mine = torch.cat(local)
    gathered = [mine]
    if world_size > 1:
        gathered = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine)
    offset = 0
    for normalizer, _ in batches:
        dim = normalizer.mean.numel()
        if normalizer.until is not None and normalizer.count >= normalizer.until:  # the same on every rank
            offset += 1 + 2 * dim
            continue
        moments = (normalizer.count, normalizer.mean, normalizer.var * normalizer.count)
        for g in gathered:
            moments = merge_moments(
                moments, (g[offset], g[offset + 1 : offset + 1 + dim], g[offset + 1 + dim : offset + 1 + 2 * dim])
            )
        count, mean, m2 = moments
        normalizer.count.copy_(count)
        normalizer.mean.copy_(mean)
        normalizer.var.copy_(m2 / count.clamp(min=1))
        offset += 1 + 2 * dim


def make_adam(
    params: list[nn.Parameter], lr: float, device: torch.device, capturable: bool = False
) -> torch.optim.Optimizer:
    """Adam whose learning rate is a 0-dim tensor on `device`, so that the adaptive schedule changes it
    in place with no host sync. On CUDA the fused kernel reads it from the GPU (it wants float32);
    elsewhere the default implementation reads a float64 one, bit for bit what a Python float gives.
    `capturable`: its step may be captured in a CUDA graph (CUDA only)."""
    if device.type == "cuda":
        return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), fused=True, capturable=capturable)
    return torch.optim.Adam(params, lr=torch.tensor(lr, dtype=torch.float64, device=device))


def mlp(
    in_dim: int, hidden: tuple[int, ...], out_dim: int, activation: type[nn.Module] | str = nn.ELU, gain: float = 1.0
) -> nn.Sequential:
    """A plain multilayer perceptron: `activation` a module, `elu` (rsl_rl's, torch's default init) or `tanh`
    (CleanRL's: orthogonal weights of gain sqrt(2), `gain` for the output layer, zero biases)."""
    layers: list[nn.Module] = []
    module = {"elu": nn.ELU, "tanh": nn.Tanh}.get(activation, activation)
    for width in hidden:
        layers += [nn.Linear(in_dim, width), module()]
        in_dim = width
    layers.append(nn.Linear(in_dim, out_dim))
    if activation == "tanh":  # CleanRL's layer_init; every other layer is a Linear
        for layer in layers[::2]:
            nn.init.orthogonal_(layer.weight, gain if layer is layers[-1] else math.sqrt(2))
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


def reset_hidden(hidden: torch.Tensor, dones: torch.Tensor) -> torch.Tensor:
    """A recurrent network's memory (batch, size), blanked where `dones` (batch,) is set: the next step starts a new episode."""
    return hidden * (1.0 - dones.to(hidden.dtype)).unsqueeze(-1)


# --- Run arguments, bookkeeping, rank-0 logging, stop handling, checkpoints ------------------------


@dataclass
class RunArgs:
    """The arguments every script shares: task, sizes per process, seeds, device, run directory, checks."""

    task: str = "pendulum"
    """Built-in task or your own environment as `module:function`."""
    num_envs: int = 256
    """Environments per process; the global batch grows with the number of processes."""
    steps_per_env: int = 32
    """Rollout length per iteration (rsl_rl's num_steps_per_env)."""
    init_at_random_ep_len: bool = True
    """Start each env at a random point of its time limit, so rollouts mix all phases of an episode."""
    seed: int = 1
    """Base seed; rank r uses seed + r (moved on by the iteration when resuming)."""
    device: str = "auto"
    """`auto` (cuda:LOCAL_RANK if CUDA is there, else cpu), `cpu`, or `cuda`."""
    run_dir: str | None = None
    """Where rank 0 writes metrics and checkpoints; default runs/<script>_<task>/<time>, or the resumed run's."""
    save_interval: int = 50
    """Checkpoint every this many iterations (and at the end)."""
    keep_checkpoints: int = 5
    """How many of the newest checkpoints to keep."""
    resume: str | None = None
    """Checkpoint file or run directory to continue from; `auto`: the `--run-dir`'s newest checkpoint if it
    has one, else a fresh start (what a job restarted by `torchrun --max-restarts` needs)."""
    check_interval: int = 50
    """Every this many iterations, compare a hash of the trained state across ranks (0: never)."""
    dist_timeout_s: float = 60.0
    """Seconds a collective may wait for a lost rank before the job fails."""
    start_timeout_s: float = 1200.0
    """Seconds the ranks wait for each other at start-up (building envs: a simulator may take minutes)."""
    logger: Literal["tensorboard", "wandb", "neptune", "none"] = "tensorboard"
    """Where rank 0 logs besides metrics.jsonl (always written), under rsl_rl's metric names. W&B and
    Neptune take their other settings from the environment (WANDB_MODE=offline, NEPTUNE_MODE, ...)."""
    logger_project: str | None = None
    """W&B project (default: the script's name) or Neptune project `workspace/name` (default: NEPTUNE_PROJECT)."""


def check_args(
    args: RunArgs, counts: tuple[str, ...] = (), positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = (),
    fractions: tuple[str, ...] = (), mini_batches: int | None = None,
) -> None:  # fmt: skip
    """Raise one ValueError naming every argument out of its range, or an uneven mini-batch split. Local."""
    rules = [
        ("at least 1", 1, math.inf, ("num_envs", "steps_per_env", "save_interval", "keep_checkpoints", *counts)),
        ("above 0", 1e-300, math.inf, (*positive, "dist_timeout_s", "start_timeout_s")),
        ("0 or more", 0, math.inf, (*non_negative, "check_interval")),
        ("in [0, 1]", 0, 1, fractions),
    ]
    bad = []
    for w, lo, hi, ns in rules:  # what each must be, its bounds, the arguments
        bad += [f"--{n.replace('_', '-')} {v} (must be {w})" for n in ns if not lo <= (v := getattr(args, n)) <= hi]
    if bad:
        raise ValueError(f"bad argument{'s' * (len(bad) > 1)}: {'; '.join(bad)}.")
    if args.logger in ("wandb", "neptune") and importlib.util.find_spec(args.logger) is None:  # finds, not imports
        raise ValueError(f"--logger {args.logger} needs its package: pip install {args.logger}, or pass --logger none.")
    if mini_batches is not None and (args.num_envs * args.steps_per_env) % mini_batches:
        raise ValueError(
            f"num_envs * steps_per_env = {args.num_envs * args.steps_per_env} is not divisible by mini_batches = {mini_batches}; change one of them."
        )


@dataclass
class RunLog:
    """Bookkeeping of one training run: where rank 0 writes, the counters, the stop request."""

    dir: str
    first_iteration: int
    total_iterations: int
    env_steps: int  # over all ranks, since the first iteration of the first run
    steps_per_iteration: int  # over all ranks
    stop_requested: Callable[[], bool]
    logger: tuple[Callable[[dict[str, float], int], Any], Callable[[], Any]] | None = None  # (write, close), rank 0
    start_time: float = 0.0
    last_return: float | None = None  # over the latest iteration in which episodes finished
    last_length: float | None = None
    log_keys: list[str] = dataclasses.field(default_factory=list)  # the env log values seen so far, on any rank
    iteration: int = 0  # the last one completed
    last_checkpoint: str | None = None


def install_stop_handler() -> Callable[[], bool]:
    """Turn SIGTERM/SIGINT into a flag read at iteration boundaries; returns its reader. A second signal
    acts as usual, so a rank stuck in a collective can still be stopped."""
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        received.append(signum)
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return lambda: bool(received)


def start_run(ctx: Dist, args: RunArgs, script: str, title: str, total: int, checkpoint: dict | None) -> RunLog:
    """Rank 0 takes the run directory for this job (a resumed run's by default, else
    `runs/{script}_{task}/{time}`), checks it can write there and opens the logger; if not, every rank
    stops (one all_gather). Then rank 0 keeps only the metrics rows before the first iteration; SIGTERM
    and SIGINT become a stop request."""
    name = args.task.replace(":", "_").replace("/", "_").replace(".", "_")
    run_dir = args.run_dir or os.path.join("runs", f"{script}_{name}", time.strftime("%Y-%m-%d_%H-%M-%S"))
    if args.resume and not args.run_dir:
        run_dir = os.path.dirname(resolve_checkpoint(args.resume))
    first_iteration, env_steps = (checkpoint["iteration"] + 1, checkpoint["env_steps"]) if checkpoint else (1, 0)
    # What can stop the start, as (what, what to do); rank 0 alone knows which, and the details.
    problems = [
        (f"run directory {run_dir!r} is in use by another job", "wait for it to end, or pass another --run-dir"),
        (
            f"run directory {run_dir!r} holds checkpoints of another run",
            f"continue it with --resume {run_dir} (or --resume auto), or pass another --run-dir",
        ),
        (f"rank 0 cannot write the run directory {run_dir!r}", "pass a writable --run-dir"),
        (f"rank 0 cannot start --logger {args.logger}", "fix its settings or pass --logger none"),
    ]
    problem, detail, logger, stale_events = 0, "see rank 0", None, []  # problem: 1 + its index, 0 for none
    if ctx.is_main:
        created = not os.path.exists(run_dir)
        try:
            os.makedirs(run_dir, exist_ok=True)
            if holder := take_run_dir(run_dir):  # another job's
                problem, detail = 1, holder
            elif not checkpoint and (found := checkpoint_files(run_dir)):  # a fresh start's would mix with them
                problem, detail = 2, f"newest {os.path.basename(found[0])}"
            else:
                atomic_write(os.path.join(run_dir, ".write-test"), lambda f: f.write(b"ok"))
                os.remove(os.path.join(run_dir, ".write-test"))
        except OSError as e:
            problem, detail = 3, str(e)
        if not problem and first_iteration == 1:  # a fresh start's TensorBoard curves begin anew
            stale_events = [f for f in os.listdir(run_dir) if f.startswith("events.out.tfevents.")]
        try:
            logger = None if problem else open_logger(args, script, run_dir, first_iteration)
        except Exception as e:  # noqa: BLE001 - a service that cannot start must reach the other ranks
            plain = " ".join(re.sub(r"\x1b\[[0-9;]*m|-{3,}", " ", str(e)).split())  # one line, no colors
            problem, detail = 4, f"{type(e).__name__}: {plain if len(plain) < 200 else plain[:200] + ' ...'}"
        if problem > 1:  # the directory is ours: let go of it, and leave nothing behind in a new one
            release_run_dir(run_dir)
            if created:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(run_dir, ".lock"))
                    os.rmdir(run_dir)
    # Over the start-up group: opening a logger that talks to a service may take longer than --dist-timeout-s.
    problem = gather_at_start(ctx, [problem])[0][0]
    if problem:
        what, advice = problems[problem - 1]
        raise Failure(f"{what} ({detail}); {advice}.")
    steps = args.steps_per_env * args.num_envs * ctx.world_size
    run = RunLog(run_dir, first_iteration, total, env_steps, steps, install_stop_handler(), logger, time.time())
    if logger is not None:
        atexit.register(close_logger, run)  # also when the run ends in a failure
    if ctx.is_main:
        for stale in stale_events:  # an earlier attempt's curves: this run starts them again
            os.remove(os.path.join(run_dir, stale))
        metrics = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            # One row per iteration: drop the rows an earlier attempt logged from our first iteration on.
            with open(metrics) as f:
                kept = [line for line in f if json.loads(line)["iteration"] < first_iteration]
            atomic_write(metrics, lambda f: f.write("".join(kept).encode()))
        seeds = [envs.rank_seed(args.seed, rank, first_iteration) for rank in range(ctx.world_size)]
        where = f"{ctx.world_size} process(es) x {args.num_envs} envs on {ctx.device}, seeds {seeds}"
        print(f"{title}: {where}; run dir {run_dir}", flush=True)
        if first_iteration > total:
            reached = f"the run reached iteration {first_iteration - 1} of --iterations {total}"
            print(f"nothing to train: {reached}; pass a larger --iterations to continue.", flush=True)
    return run


_RUN_DIR_LOCKS: dict[str, Any] = {}  # run directory -> the open lock file that holds it for this process


def take_run_dir(run_dir: str) -> str:
    """Hold `run_dir` for this job until it ends: an exclusive lock on `run_dir/.lock`, which the OS
    releases when the process exits or dies, so a crash never leaves the directory taken. Returns ""
    or, when another job holds it, who that is (pid, host, since when). Rank 0 only."""
    import fcntl  # POSIX

    key = os.path.realpath(run_dir)
    release_run_dir(key)  # an earlier run of this same process (runs in one process follow each other)
    lock = open(os.path.join(run_dir, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "process not known"
        lock.close()
        return holder
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    _RUN_DIR_LOCKS[key] = lock
    return ""


def release_run_dir(run_dir: str | None = None) -> None:
    """Let go of `run_dir` (every run directory this process holds, when None)."""
    keys = list(_RUN_DIR_LOCKS) if run_dir is None else [os.path.realpath(run_dir)]
    for key in keys:
        lock = _RUN_DIR_LOCKS.pop(key, None)
        if lock is not None:
            lock.close()


# rsl_rl's names for the scalars it logs too, so that dashboards of both compare; env log scalars go
# to "Episode/<key>" unless the key has a "/" of its own; the rest keep their metrics.jsonl names.
RSL_RL_NAMES = {
    "episode_return": "Train/mean_reward", "episode_length": "Train/mean_episode_length",
    "learning_rate": "Loss/learning_rate", "surrogate_loss": "Loss/surrogate", "value_loss": "Loss/value",
    "entropy": "Loss/entropy", "rnd_loss": "Loss/rnd", "behavior_loss": "Loss/behavior", "rnd_weight": "Rnd/weight",
    "symmetry_loss": "Loss/symmetry",
    "intrinsic_reward": "Rnd/intrinsic_reward", "extrinsic_reward": "Rnd/extrinsic_reward",
    "fps": "Perf/total_fps", "collect_s": "Perf/collection_time", "update_s": "Perf/learning_time",
}  # fmt: skip


def dashboard_name(key: str, log_keys: list[str]) -> str:
    """The name a metrics.jsonl column gets in TensorBoard, W&B and Neptune."""
    if key in log_keys and key not in RSL_RL_NAMES:
        return key if "/" in key else f"Episode/{key}"
    return RSL_RL_NAMES.get(key, key)


def open_logger(
    args: RunArgs, script: str, run_dir: str, first_iteration: int
) -> tuple[Callable[[dict[str, float], int], Any], Callable[[], Any]] | None:
    """Rank 0's `--logger` as (write(scalars, iteration), close); None for `none`, or TensorBoard not installed."""
    if args.logger == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the default, and optional: metrics.jsonl has everything
            print("TensorBoard is not installed (pip install tensorboard): logging to metrics.jsonl only.")
            return None
        writer = SummaryWriter(run_dir, purge_step=first_iteration)
        return lambda scalars, it: [writer.add_scalar(k, v, it) for k, v in scalars.items()], writer.close
    config = dataclasses.asdict(args)
    if args.logger == "wandb":
        import wandb

        name = os.path.basename(os.path.normpath(run_dir))
        run = wandb.init(project=args.logger_project or script, dir=run_dir, name=name, config=config)
        return lambda scalars, it: run.log(scalars, step=it), run.finish
    if args.logger == "neptune":
        import neptune
        from neptune.utils import stringify_unsupported

        run = neptune.init_run(project=args.logger_project, name=run_dir, capture_hardware_metrics=False)
        run["config"] = stringify_unsupported(config)
        return lambda scalars, it: [run[k].append(v, step=it) for k, v in scalars.items()], run.stop
    return None


def end_iteration(
    ctx: Dist, run: RunLog, it: int, episodes: envs.Episodes, env_logs: dict[str, torch.Tensor],
    timings: dict[str, float], metrics: dict[str, float],
) -> bool:  # fmt: skip
    """Reduce the iteration's statistics over ranks, rank 0 logs them; returns whether to stop. One all_reduce
    carries episode sums, env log values and stop requests: all ranks leave at the same iteration. A log
    value is a mean (a scalar) or a (sum, count) pair (`envs.accumulate_logs`); each key is averaged over
    every rank's count of it. An all_gather of the keys, and the all_reduce again, when a key is new."""
    while True:
        pairs = [log_pair(env_logs.get(k), ctx.device) for k in run.log_keys]
        stop = float(run.stop_requested())
        new = float(bool(set(env_logs) - set(run.log_keys)))  # the layout must be the same on every rank
        reduced = all_reduce_sum(
            torch.cat([episodes.finished, *pairs, torch.tensor([stop, new], device=ctx.device)]), ctx.world_size
        ).tolist()
        if not reduced[-1]:
            break
        # An env may log a key on some ranks only, or only once an episode ends (mjlab): take the union.
        gathered = [sorted(env_logs)] * ctx.world_size
        if ctx.world_size > 1:
            dist.all_gather_object(gathered, sorted(env_logs))
        run.log_keys = sorted(set(run.log_keys).union(*gathered))
    episodes.finished.zero_()
    if reduced[2] > 0:
        run.last_return, run.last_length = reduced[0] / reduced[2], reduced[1] / reduced[2]
    run.env_steps += run.steps_per_iteration
    run.iteration = it
    if ctx.is_main:
        row = {
            "iteration": it,
            "env_steps": run.env_steps,
            "fps": run.steps_per_iteration / sum(timings.values()),
            "episode_return": run.last_return,
            "episode_length": run.last_length,
            "episodes_finished": int(reduced[2]),
            **metrics,
            **{k: reduced[3 + 2 * i] / n for i, k in enumerate(run.log_keys) if (n := reduced[4 + 2 * i])},
            **timings,
            "time_s": time.time() - run.start_time,
            "world_size": ctx.world_size,
            "first_iteration": run.first_iteration,
        }
        with open(os.path.join(run.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        if run.logger is not None:  # TensorBoard, W&B or Neptune
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "iteration"}
            try:
                run.logger[0]({dashboard_name(k, run.log_keys): v for k, v in scalars.items()}, it)
            except Exception as e:  # noqa: BLE001 - a logging service must not stop training; metrics.jsonl has it all
                print(f"warning: --logger failed ({type(e).__name__}: {e}); logging to metrics.jsonl only.", flush=True)
                close_logger(run)
        # One short console line; everything else is in metrics.jsonl and TensorBoard.
        eta = row["time_s"] / max(1, it - run.first_iteration + 1) * (run.total_iterations - it)
        ret = "-" if run.last_return is None else f"{run.last_return:.1f}"
        fps = row["fps"]
        print(
            f"it {it}/{run.total_iterations} | steps {run.env_steps:.3g} | fps {fps:.0f} | return {ret} | eta {eta:.0f}s"
        )
    if reduced[-2] > 0 and ctx.is_main:
        print(f"stop signal received: stopping after iteration {it}; resume with --resume {run.dir}", flush=True)
    return reduced[-2] > 0


def log_pair(value: torch.Tensor | float | None, device: torch.device) -> torch.Tensor:
    """A log value as (sum, count): a scalar is a mean of weight 1; None (not logged here) is (0, 0)."""
    if value is None:
        return torch.zeros(2, device=device)
    value = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1)
    return value if value.numel() == 2 else torch.cat([value, torch.ones(1, device=device)])


def close_logger(run: RunLog) -> None:
    """Close rank 0's logger once (flushing its last events): at the end, or at exit after a failure."""
    logger, run.logger = run.logger, None
    if logger is not None:
        try:
            logger[1]()
        except Exception as e:  # noqa: BLE001 - closing is best effort
            print(f"warning: closing --logger failed ({type(e).__name__}: {e}).", flush=True)


def finish_run(ctx: Dist, run: RunLog) -> None:
    """Rank 0 closes its logger and says what the run did and how to continue it."""
    close_logger(run)
    release_run_dir(run.dir)
    if ctx.is_main and run.iteration >= run.first_iteration:
        done = f"done: iteration {run.iteration}/{run.total_iterations}, {run.env_steps:.3g} env steps, return "
        done += f"{run.last_return and round(run.last_return, 1)}, {time.time() - run.start_time:.0f} s; last "
        done += f"checkpoint {run.last_checkpoint}"
        print(f"{done}; continue with --resume {run.dir} --iterations <more>", flush=True)


RESUME_KEYS = ("iteration", "env_steps", "fingerprint")  # what a resume needs besides the state dicts


def save_if_due(
    ctx: Dist, run: RunLog, it: int, stop: bool, args: RunArgs, kind: str, modules: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer], extra: dict[str, Any],
) -> None:  # fmt: skip
    """Every `--save-interval` iterations, at the last and when asked to stop, rank 0 writes all a resume
    needs (tensors, numbers, strings only: every module's and optimizer's state, `extra`, the args, the
    fingerprint of it all); all ranks learn whether that worked (one all_gather), and stop together if not."""
    if it % args.save_interval and it != run.total_iterations and not stop:
        return
    error = ""
    if ctx.is_main:
        try:
            state = {
                "kind": kind,
                "parts": [*modules, *optimizers],
                **{name: module.state_dict() for name, module in modules.items()},
                **{name: optimizer.state_dict() for name, optimizer in optimizers.items()},
                **{"iteration": it, "env_steps": run.env_steps, **extra, "args": dataclasses.asdict(args)},
                "fingerprint": state_fingerprint(trained_tensors([*modules.values()], [*optimizers.values()])),
            }
            save_checkpoint(run.dir, it, state, args.keep_checkpoints)
        except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
            error = f"{type(e).__name__}: {e}"
    run.last_checkpoint = os.path.join(run.dir, f"model_{it}.pt")
    if all_gather_ints(ctx, [int(bool(error))])[0][0]:
        raise Failure(
            f"rank 0 could not write the checkpoint of iteration {it} in {run.dir!r} ({error or 'see rank 0'}); the previous checkpoints are intact."
        )


IMPLEMENTATION = ("foreach", "fused", "capturable")  # optimizer settings that choose how it steps


def restore_checkpoint(
    checkpoint: dict[str, Any], path: str, modules: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]
) -> None:
    """Load what `save_if_due` saved into `modules` and `optimizers`; check the fingerprint. Local."""
    expected = sorted([*modules, *optimizers])
    saved = sorted(checkpoint.get("parts", [k for k in expected if k in checkpoint]))
    if saved != expected:
        raise ValueError(
            f"checkpoint {path!r} holds the state of {saved}, this run trains {expected}; resume with the options "
            "it was trained with (--rnd-weight above 0 or not, --scale-rewards or not)."
        )
    try:
        for name, module in modules.items():
            module.load_state_dict(checkpoint[name])
    except RuntimeError as error:
        raise ValueError(f"checkpoint {path!r} does not fit this task and network: {error}") from error
    for name, optimizer in optimizers.items():
        lrs = [group["lr"] for group in optimizer.param_groups]
        # How this run steps (fused, capturable for --cuda-graphs) is this machine's choice, not the
        # checkpoint's: keep it, and let the optimizer place its state for it.
        state = checkpoint[name]
        own = [{k: group[k] for k in IMPLEMENTATION if k in group} for group in optimizer.param_groups]
        groups = [{**group, **mine} for group, mine in zip(state["param_groups"], own)]
        optimizer.load_state_dict({**state, "param_groups": groups})
        for group, lr in zip(optimizer.param_groups, lrs):
            if torch.is_tensor(lr):  # keep a tensor lr a tensor, on its device and in its dtype
                group["lr"] = torch.tensor(float(group["lr"]), dtype=lr.dtype, device=lr.device)
    if state_fingerprint(trained_tensors([*modules.values()], [*optimizers.values()])) != checkpoint.get("fingerprint"):
        raise ValueError(f"checkpoint {path!r} does not reproduce the state it was saved from; it is damaged.")


def save_checkpoint(run_dir: str, iteration: int, state: dict[str, Any], keep: int = 5) -> None:
    """Write `model_{iteration}.pt` atomically, point `latest` at it, keep the newest `keep`."""
    for stale in (f for f in os.listdir(run_dir) if ".tmp-" in f):  # left by a killed run
        os.remove(os.path.join(run_dir, stale))
    name = f"model_{iteration}.pt"
    atomic_write(os.path.join(run_dir, name), lambda f: torch.save(state, f))
    atomic_write(os.path.join(run_dir, "latest"), lambda f: f.write(name.encode()))
    saved = sorted((f for f in os.listdir(run_dir) if re.fullmatch(r"model_\d+\.pt", f)), key=lambda f: int(f[6:-3]))
    for old in saved[: max(0, len(saved) - keep)]:
        os.remove(os.path.join(run_dir, old))


def atomic_write(path: str, write: Callable[[Any], Any]) -> None:
    """Write through a temporary file in the same directory, then rename over `path`."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint file, or a run directory / `latest` pointer naming the newest one."""
    if os.path.isdir(path):
        path = os.path.join(path, "latest")
    if os.path.basename(path) == "latest" and os.path.isfile(path):
        with open(path) as f:
            path = os.path.join(os.path.dirname(path), f.read().strip())
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"checkpoint {path!r} does not exist; pass a model_*.pt file or a run directory holding a 'latest' file."
        )
    return path


class UnreadableCheckpoint(ValueError):
    """A checkpoint file that `torch.load` cannot read: truncated, damaged, or not a checkpoint at all."""


def checkpoint_files(run_dir: str) -> list[str]:
    """The `model_<iteration>.pt` files in `run_dir`, newest (highest iteration) first."""
    names = [f for f in os.listdir(run_dir) if re.fullmatch(r"model_\d+\.pt", f)] if os.path.isdir(run_dir) else []
    return [os.path.join(run_dir, f) for f in sorted(names, key=lambda f: -int(f[6:-3]))]


def load_resume(
    args: RunArgs, kind: str, required: tuple[str, ...], speak: bool = True
) -> tuple[str | None, dict[str, Any] | None]:
    """The checkpoint to continue from -> (its path, its contents), or (None, None) for a fresh start.

    `--resume auto` takes the `--run-dir`'s newest readable checkpoint, skipping unreadable ones with a
    line each (`speak`: this rank prints), and starts fresh where there is none. An explicit `--resume`
    that cannot be read fails, naming the newest readable checkpoint beside it. Local."""
    if args.resume is None:
        return None, None
    if args.resume != "auto":
        try:
            return args.resume, load_checkpoint(args.resume, kind, required)
        except UnreadableCheckpoint as error:
            path = resolve_checkpoint(args.resume)
            readable = [
                f for f in checkpoint_files(os.path.dirname(path)) if f != path and _readable(f, kind, required)
            ]
            hint = f" The newest readable checkpoint there is {readable[0]!r}: pass it to --resume." if readable else ""
            raise UnreadableCheckpoint(f"{error}{hint}") from None
    if not args.run_dir:
        raise ValueError("--resume auto needs --run-dir: the directory a restarted job continues in.")
    skipped = []
    for path in checkpoint_files(args.run_dir):
        try:
            checkpoint = load_checkpoint(path, kind, required)
        except UnreadableCheckpoint as error:
            skipped.append(path)
            if speak:
                print(f"warning: {error} --resume auto skips it.", flush=True)
            continue
        return path, checkpoint
    if skipped:
        raise ValueError(
            f"--resume auto: no checkpoint in {args.run_dir!r} can be read ({len(skipped)} tried); move them away "
            "to start afresh there, or pass another --run-dir."
        )
    return None, None


def _readable(path: str, kind: str, required: tuple[str, ...]) -> bool:
    try:
        load_checkpoint(path, kind, required)
    except ValueError:
        return False
    return True


def load_checkpoint(path: str, kind: str | tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load a checkpoint without running code (`weights_only=True`); check its kind (or kinds) and `required` keys."""
    path = resolve_checkpoint(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file gets the same advice
        first_line = (str(error).splitlines() or [type(error).__name__])[0]  # torch's errors run to many lines
        raise UnreadableCheckpoint(
            f"cannot read checkpoint {path!r} ({first_line}); it is damaged or not a checkpoint of these scripts."
        ) from error
    kinds = (kind,) if isinstance(kind, str) else kind
    if not isinstance(state, dict) or state.get("kind") not in kinds:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"checkpoint {path!r} is not a {' or '.join(map(repr, kinds))} checkpoint (found {found!r}); pass one written by the matching script."
        )
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {missing}: it was not written by this script.")
    return state
