"""The distributed mechanism the scripts share: the process group and its device rule, the collectives
(broadcast, the flat gradient all_reduce), the guards that make every rank take the same decision, the
observation normalizer merged across ranks, and the state fingerprints that prove ranks identical; with them
the small pieces every script's networks and update use (argument ranges, `UpdateArgs`, the MLP, `Totals`,
network configs). No algorithm lives here (PPO is in ppo_ddp.py, AMP in ppo_amp_ddp.py, DAgger in
distill_ddp.py), no task (envs/), no run bookkeeping (run directory, logging: bookkeeping.py) and no checkpoint
files (checkpoints.py).

Every function that talks to other ranks says so in its docstring, and every rank must call it in
the same order: a collective that one rank skips is a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import importlib
import math
import os
import signal
import sys
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from torch import nn

import cuda_graphs

# --- Arguments every script shares: ranges written on the field, and how the update runs ---------


@dataclass(frozen=True)
class Range:
    """The values an argument may take, written on its field as `Annotated[type, Range(...)]` (the aliases below);
    `bookkeeping.check_args` holds every field of a script's `Args` to its own."""

    low: float = 0.0
    high: float = math.inf
    above: bool = False  # `low` itself is out: strictly above it

    def admits(self, value: float) -> bool:
        return (value > self.low if self.above else value >= self.low) and value <= self.high

    def __str__(self) -> str:
        if self.high < math.inf:
            return f"in [{self.low:g}, {self.high:g}]"
        return f"above {self.low:g}" if self.above else f"at least {self.low:g}" if self.low else "0 or more"


Count = Annotated[int, Range(1)]  # at least 1
Positive = Annotated[float, Range(0.0, above=True)]  # above 0
NonNegative = Annotated[float, Range(0.0)]  # 0 or more
Fraction = Annotated[float, Range(0.0, 1.0)]  # in [0, 1]


def out_of_range(args: Any) -> list[str]:
    """Every field of the dataclass `args` outside the `Range` its annotation gives, as `--flag value (must be ...)`."""
    bad = []
    for name, hint in typing.get_type_hints(type(args), include_extras=True).items():
        for rule in getattr(hint, "__metadata__", ()):
            value = getattr(args, name)
            if isinstance(rule, Range) and not rule.admits(value):
                bad.append(f"--{name.replace('_', '-')} {value} (must be {rule})")
    return bad


@dataclass
class UpdateArgs:
    """How an update runs, on every script that trains with gradients (`--cuda-graphs`, ...)."""

    grad_bucket_mb: Positive = 25.0
    """Largest flat buffer of gradients one all_reduce averages, in megabytes (rsl_rl 5.5's
    grad_reduce_bucket_mb); the networks here fit one, so each optimizer step is one collective."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """`bf16`: the update's forward passes and losses autocast to bfloat16, without a gradient scaler (rsl_rl
    5.5's use_mixed_precision); weights, gradients, optimizer and the rollout stay float32."""
    cuda_graphs: bool = False
    """Replay the policy step and every optimizer step from CUDA graphs, the all_reduce eager between two
    (docs/gpu.md). Needs a CUDA device; elsewhere a note, and the same steps run eagerly."""
    compile: Literal["inductor", "aot_eager", "eager"] | None = None
    """torch.compile backend of the policy step and the optimizer steps (cuda_graphs.compiled): `inductor`
    (needs a C++ compiler on CPU), or `aot_eager` and `eager`, which trace the same graphs without generating
    code (no compiler; slower than no --compile). The all_reduce stays eager between two compiled halves."""


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
        raise ValueError(
            f"device {device!r} asked for, but CUDA is not available here: pass --device cpu (or auto), or install "
            "a CUDA build of torch."
        )
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if world_size > 1 else 1
    if per_node > gpus:  # the same words on every rank of the node: one line for the job
        raise ValueError(
            f"{per_node} processes per node but this node has {gpus} GPU(s): no GPU for LOCAL_RANK {gpus} and up. "
            f"Start at most {gpus} per node, or pass --device cpu."
        )
    if resolved.index >= gpus:
        raise ValueError(
            f"no GPU cuda:{resolved.index}: this node has {gpus} GPU(s); pass --device cuda:0 to cuda:{gpus - 1}, or auto."
        )
    return resolved


def setup_distributed(
    device: str = "auto",
    seed: int = 0,
    timeout_s: float = 60.0,
    start_timeout_s: float = 1200.0,
    pin_cores: bool = False,
) -> Dist:
    """Read WORLD_SIZE/RANK/LOCAL_RANK (set by torchrun), join the process group (NCCL on CUDA, gloo on
    CPU, a finite timeout so a lost rank ends the job) and a gloo group with the longer start-up timeout,
    resolve the device (all ranks agree, or fail together), on CPU share the cores out (`pin_cores`:
    see `pin_to_cores`), seed with `seed + RANK` (the global rank)."""
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
    # A RANK_CORES inherited from a parent would size a pool for cores this rank has not got.
    os.environ.pop("RANK_CORES", None)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    elif resolved.type == "cpu":
        # N processes on one machine must share the cores, not each take all of them.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        pinned = pin_to_cores(local_rank, local_world) if pin_cores and world_size > 1 and local_world > 1 else set()
        if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it (to 1) when it starts several processes
            torch.set_num_threads(len(pinned) or max(1, len(usable_cores()) // local_world))
    torch.manual_seed(seed + rank)
    return dataclasses.replace(ctx, device=resolved)


def pin_to_cores(local_rank: int, local_world: int) -> set[int]:
    """Bind the calling thread, and every thread it starts from now on (torch's pool, the simulator's), to
    local rank `local_rank`'s own share of the cores this process may use (`rank_cores`). Called once the
    process group is up, so gloo's threads, already running, stay free to take any core. A rank that keeps
    its core keeps its caches and never queues behind the other rank's thread. Returns the cores, also left
    in `RANK_CORES` for whoever sizes a thread pool (`envs.envpool`); with fewer CPUs (hardware threads) than
    ranks, a local rank outside `local_world`, or where the OS has no affinity call, none is pinned (empty)."""
    if not hasattr(os, "sched_setaffinity"):
        return set()
    cores = set(rank_cores(local_rank, local_world, usable_cores()))
    if not cores:
        return set()
    os.sched_setaffinity(0, cores)
    os.environ["RANK_CORES"] = ",".join(map(str, sorted(cores)))
    return cores


def usable_cores() -> list[int]:
    """The CPU ids this process may run on (its affinity mask: a container's or `taskset`'s cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def rank_cores(
    local_rank: int, local_world: int, cpus: Iterable[int], topology: str = "/sys/devices/system/cpu"
) -> list[int]:
    """Local rank `local_rank`'s share of `cpus` among `local_world` ranks. With at least one physical core
    per rank, each rank takes `cores // local_world` whole cores, every hyperthread of each (what is left
    over idles); two ranks never share a core's two threads. With fewer cores than ranks, each takes
    `cpus // local_world` single threads, the first thread of every core handed out before any second one.
    Empty with fewer threads than ranks or `local_rank` outside `local_world`."""
    if not 0 <= local_rank < local_world:
        return []
    cores = physical_cores(cpus, topology)
    if len(cores) >= local_world:
        per_rank = len(cores) // local_world
        return sorted(cpu for core in cores[local_rank * per_rank : (local_rank + 1) * per_rank] for cpu in core)
    threads = [core[i] for i in range(max(map(len, cores), default=0)) for core in cores if i < len(core)]
    share = len(threads) // local_world
    return sorted(threads[local_rank * share : (local_rank + 1) * share])


def physical_cores(cpus: Iterable[int], topology: str = "/sys/devices/system/cpu") -> list[list[int]]:
    """`cpus` grouped by physical core, each core's hyperthreads together, cores in the order of their lowest
    id. Linux usually numbers the second threads after all the first ones (16 cores: CPU 0 and 16 share
    one). An id without a topology entry is a core of its own."""

    def first_sibling(cpu: int) -> int:  # "0,16" or "0-1" -> 0
        try:
            with open(f"{topology}/cpu{cpu}/topology/thread_siblings_list") as f:
                return int(f.read().replace("-", ",").split(",")[0])
        except (OSError, ValueError):
            return cpu

    cores: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault(first_sibling(cpu), []).append(cpu)
    return list(cores.values())


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
    device: str = "auto",
    seed: int = 0,
    timeout_s: float = 60.0,
    start_timeout_s: float = 1200.0,
    pin_cores: bool = False,
) -> Iterator[Dist]:
    """`setup_distributed` as a context: on exit, error or not, the SIGTERM/SIGINT handlers are put back and
    the group destroyed, after one barrier on a normal exit. A `Failure` is printed here, on its speaker,
    before the group goes (torchrun stops the other ranks as soon as one exits)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        ctx = setup_distributed(device, seed, timeout_s, start_timeout_s, pin_cores)
        yield ctx
        if dist.is_initialized():
            # SYNC: no rank tears the group down while another may still be finishing its last collective.
            dist.barrier(device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    except Failure as failure:
        if failure.speaker == int(os.environ.get("RANK", "0")):
            print("error: " + str(failure).replace("\n", " "), file=sys.stderr, flush=True)
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if dist.is_initialized():
            dist.destroy_process_group()


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


def check_ranks_agree(
    ctx: Dist, it: int, interval: int, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> None:
    """Every `interval` iterations (0: never), all ranks raise if one's trained state differs (1 all_gather)."""
    if not interval or it % interval:
        return
    gathered = all_gather_ints(ctx, [digest(fingerprint(modules, optimizers))])
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


def flatten_gradients(params: list[nn.Parameter], tail: torch.Tensor | None = None) -> torch.Tensor:
    """The gradients of `params`, then `tail` (the KL, loss statistics), in one flat buffer: the layout every
    rank sends. A missing gradient counts as zeros. Local."""
    pieces = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params]
    if tail is not None:
        pieces.append(tail.reshape(-1).to(pieces[0].dtype if pieces else tail.dtype))
    return torch.cat(pieces)


def all_reduce_mean(flat: torch.Tensor, world_size: int) -> None:
    """Average `flat` over ranks, in place: one all_reduce (a sum), divided by the world size. Under
    `--cuda-graphs` it runs outside the graphs, between the one before it and the one after it."""
    if world_size > 1:
        cuda_graphs.eager(_sum_then_divide, flat, world_size)


def _sum_then_divide(flat: torch.Tensor, world_size: int) -> None:
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size


def unflatten_gradients(params: list[nn.Parameter], flat: torch.Tensor) -> torch.Tensor:
    """Copy the gradients in a `flatten_gradients` buffer back into `params` -> the rest (the tail). Local."""
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
    params: list[nn.Parameter], world_size: int, tail: torch.Tensor | None = None, bucket_mb: float = math.inf
) -> torch.Tensor | None:
    """Average the gradients of `params` over ranks, `tail` (the KL, loss statistics) with them -> the averaged
    tail. In buckets of at most `bucket_mb` megabytes, as rsl_rl 5.5's `reduce_gradients_in_buckets`: whole
    gradients packed in order into flat buffers (the three pieces above), one all_reduce each, the tail in
    the last; a gradient larger than a bucket alone is averaged in place, in slices. When all fit (the
    networks here at rsl_rl's 25 MB): ONE all_reduce of one flat buffer."""
    limit, size = bucket_mb * 2**20, lambda p: p.numel() * p.element_size()  # noqa: E731 - a gradient's bytes
    packs, filled = [[]], 0
    for p in params:
        if packs[-1] and filled + size(p) > limit:
            packs.append([])
            filled = 0
        packs[-1].append(p)
        filled += size(p)
    rest = None
    for i, pack in enumerate(packs):
        with_tail = tail if i == len(packs) - 1 else None
        if len(pack) == 1 and size(pack[0]) > limit:  # alone larger than a bucket: averaged in place, in slices
            grad = pack[0].grad = pack[0].grad if pack[0].grad is not None else torch.zeros_like(pack[0])
            for piece in grad.view(-1).split(max(1, int(limit) // grad.element_size())):
                all_reduce_mean(piece, world_size)
            if with_tail is None:
                continue
            pack = []  # the tail, in a buffer of its own
        flat = flatten_gradients(pack, with_tail)
        all_reduce_mean(flat, world_size)
        rest = unflatten_gradients(pack, flat)
    return rest if tail is not None else None


def first_line(error: BaseException) -> str:
    """The first line of an error's message (torch's load errors run to many), or its type's name."""
    return (str(error).splitlines() or [type(error).__name__])[0]


@dataclass
class Totals:
    """Named statistics summed over an update's optimizer steps, on the device and in place (a CUDA graph replays
    the additions), read back to the host once. The first `add` names the columns; every later one must name the
    same, in the same order, or it is an error."""

    names: list[str] = dataclasses.field(default_factory=list)
    sums: torch.Tensor | None = None

    @torch.compiler.disable  # eager under --compile: its first call's branch would recompile the step once more
    def add(self, names: list[str], row: torch.Tensor) -> None:
        """Add one step's statistics `row`, one per name of `names`. Local, no host sync."""
        if self.sums is None:
            self.names, self.sums = list(names), torch.zeros_like(row)
        if list(names) != self.names or row.numel() != len(names):
            raise RuntimeError(f"statistics {list(names)} ({row.numel()} values) added to totals of {self.names}")
        self.sums.add_(row)

    def zero(self) -> None:
        if self.sums is not None:
            self.sums.zero_()

    def read(self, count: int, causes: str) -> dict[str, float]:
        """The sums over `count` steps -> their means by name. Raises if one is NaN/Inf: all come out of the
        all_reduce, so every rank raises together, before any checkpoint; `causes` says what could have made them so."""
        means = dict(zip(self.names, (self.sums / count).tolist(), strict=True))
        bad = [name for name, value in means.items() if not math.isfinite(value)]
        if bad:
            raise Failure(
                f"non-finite {', '.join(bad)} in the update: {causes} produced NaN/Inf. No checkpoint was written: "
                "check the environment's values, or lower --learning-rate and continue from the last checkpoint with "
                "--resume."
            )
        return means


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


def fingerprint(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> str:
    """`state_fingerprint` of everything training changes in `modules` and `optimizers` (`trained_tensors`)."""
    return state_fingerprint(trained_tensors(modules, optimizers))


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
    params: list[nn.Parameter], lr: float, device: torch.device, graphs: bool = False, backend: str | None = None
) -> torch.optim.Optimizer:
    """Adam whose learning rate is a 0-dim tensor on `device`, so that the adaptive schedule changes it
    in place with no host sync. On CUDA the fused kernel reads it from the GPU (it wants float32); on CPU
    a float64 one, which the default implementation reads bit for bit as a Python float (rsl_rl's bits),
    or under `--compile backend` the fused kernel (cuda_graphs.fused_adam). `graphs`: its step may be
    captured in a CUDA graph (CUDA only: `capturable`)."""
    if device.type == "cuda":
        return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), fused=True, capturable=graphs)
    lr_tensor = torch.tensor(lr, dtype=torch.float64, device=device)
    return torch.optim.Adam(params, lr=lr_tensor, fused=cuda_graphs.fused_adam(backend, device))


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The update's forward passes and losses: in bfloat16 with `--mixed-precision bf16` (rsl_rl 5.5's
    use_mixed_precision: torch.autocast, no gradient scaler; weights, gradients and the optimizer stay
    float32), as they are otherwise. Casts are not cached, so that a CUDA graph can capture the region."""
    return torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16", cache_enabled=False)


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


def take(batch: Mapping[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """The rows `index` of every tensor of `batch`, and of the dicts of tensors it holds (observation groups)."""
    return {k: take(v, index) if isinstance(v, Mapping) else v[index] for k, v in batch.items()}


def forget(memory: torch.Tensor, dones: torch.Tensor) -> torch.Tensor:
    """A recurrent network's memory (batch, size), blanked where `dones` (batch,) is set: the next step starts a
    new episode."""
    return memory * (1.0 - dones.to(memory.dtype)).unsqueeze(-1)


def constructor_config(local_variables: dict[str, Any]) -> dict[str, Any]:
    """A network's constructor arguments, from `locals()` at the top of its `__init__`: its checkpoint keeps them,
    and `Class(**config)` builds the same network again (tools/, distillation's teacher, a resume's check)."""
    return {name: value for name, value in local_variables.items() if name not in ("self", "__class__")}
