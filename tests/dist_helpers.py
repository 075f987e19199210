"""Run a function in N real processes joined by a gloo process group, as torchrun would."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import runpy
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import arguments
import bookkeeping
import common
import launch
import ppo_ddp
import speedups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, queue: Any, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        # the tests run on CPU (gloo), also on a machine with fewer GPUs than ranks
        CUDA_VISIBLE_DEVICES="",
    )
    torch.set_num_threads(1)  # torch was imported before the variable was set: 2 ranks, 2 cores
    try:
        queue.put((rank, True, pickle.dumps(fn(*args))))  # plain bytes: no shared-memory handles
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, False, traceback.format_exc()))


def chdir_rank_dir(root: str) -> None:
    """Work in `root/<RANK>`: the same relative --run-dir on every rank, a different place on
    disk."""
    os.makedirs(os.path.join(root, os.environ["RANK"]), exist_ok=True)
    os.chdir(os.path.join(root, os.environ["RANK"]))


# Ranks start as forks of one server process that imported torch and the scripts once: a fresh
# interpreter for each rank of each test spent most of the suite importing torch again.
_RANKS = mp.get_context("forkserver")
_RANKS.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "common",
        "arguments",
        "bookkeeping",
        "ppo_ddp",
        "ppo_amp_ddp",
        "distill_ddp",
        "ppo_rnn_ddp",
    ]
)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call `fn(*args)` in `world_size` new processes with torchrun's variables; results by rank."""
    ctx = _RANKS
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def _script_entry(root: str, script: str, argv: list[str]) -> tuple[int, str]:
    """Run `script` as `__main__` with `argv` in `root`, as torchrun starts a rank -> (exit code,
    everything the rank wrote to stdout and stderr, captured at the file descriptors)."""
    os.chdir(root)
    sys.argv = [script, *argv]
    output = os.path.join(root, f".output{os.environ['RANK']}.txt")
    saved = os.dup(1), os.dup(2)
    with open(output, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            runpy.run_path(
                script if os.path.isabs(script) else os.path.join(ROOT, script), run_name="__main__"
            )
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    with open(output) as f:
        text = f.read()
    os.remove(output)
    return code, text


def script_ranks(script: str, *args: str, cwd: Any, nproc: int = 2) -> tuple[list[int], str]:
    """`torchrun --nproc_per_node=nproc script args` in `cwd` without torchrun's launcher: each rank
    runs the script as `__main__` in a process of run_ranks -> (exit code of each rank, all output).
    """
    ranks = run_ranks(_script_entry, nproc, str(cwd), script, list(args), timeout=PROMPT_S)
    return [code for code, _ in ranks], "".join(text for _, text in ranks)


COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
)


@contextlib.contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """`with counting_collectives() as calls:` counts in `calls["n"]` the torch.distributed
    collectives called inside the block."""
    calls, originals = {"n": 0}, {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return original(*args, **kwargs)

        return counted

    try:
        for name, original in originals.items():
            setattr(dist, name, counting(original))
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


# A job that fails must end promptly, not when a collective gives up: the tests give collectives a
# timeout far above the time they allow the whole job, which even a loaded 2-core machine keeps.
PROMPT_S = 300.0
FAR_TIMEOUT = ("--dist-timeout-s", "1800")


def torchrun(
    script: str,
    *args: str,
    nproc: int = 2,
    cwd: str,
    timeout: float = 180.0,
    extra: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc script args` in `cwd`, output captured."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    cmd = torchrun_command(script, *args, nproc=nproc, extra=extra)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun_command(
    script: str, *args: str, nproc: int = 2, extra: tuple[str, ...] = ()
) -> list[str]:
    """The command line of `torchrun --standalone --nproc_per_node=nproc [extra] script args`."""
    torchrun_args = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *extra,
    ]
    return [sys.executable, *torchrun_args, os.path.join(ROOT, script), *args]


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")
OUR_FILES = tuple(
    os.path.join(ROOT, f)
    for f in (
        "common.py",
        "bookkeeping.py",
        "checkpoints.py",
        "speedups.py",
        "networks.py",
        "ppo_ddp.py",
        "ppo_amp_ddp.py",
        "distill_ddp.py",
        "ppo_rnn_ddp.py",
        *(f"envs/{e}" for e in os.listdir(os.path.join(ROOT, "envs"))),
        *(f"extensions/{e}" for e in os.listdir(os.path.join(ROOT, "extensions"))),
    )
)
TORCH_WRAPPERS = tuple(
    os.path.join(os.path.dirname(torch.__file__), p)
    for p in ("_dynamo", "_compile.py", "utils/_python_dispatch.py")
)
# Ops whose output shape depends on tensor values: on a GPU the host must wait for the count.
SHAPE_FROM_VALUES = (
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_consecutive",
)


class _ShapeFromValues(TorchDispatchMode):
    """Records the ops called from our files whose output shape the host must read back: `nonzero`,
    `masked_select`, and indexing with a boolean mask (`x[mask]`, `x[mask] = v`)."""

    def __init__(self, calls: list[str], files: tuple[str, ...]) -> None:
        super().__init__()
        self.calls, self.files = calls, files

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        name = str(func.overloadpacket)
        boolean_index = name in ("aten.index", "aten.index_put_", "aten.index_put") and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        frame = sys._getframe(1)
        # the wrappers torch puts around this mode
        while frame.f_code.co_filename.startswith(TORCH_WRAPPERS):
            frame = frame.f_back
        if (name in SHAPE_FROM_VALUES or boolean_index) and _called_from(frame, self.files):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _called_from(frame: Any, files: tuple[str, ...]) -> bool:
    return os.path.abspath(frame.f_code.co_filename) in files


def count_host_reads(fn: Callable[[], Any], files: tuple[str, ...] = OUR_FILES) -> int:
    """How many times our code makes the host wait for a tensor's value in `fn()`: reads (`.item()`,
    `bool()`, ...) and ops whose output shape depends on the values (`nonzero`, `x[mask]`). On a GPU
    each is a sync. Only calls made from `files` count (not those inside torch itself)."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name: str) -> Callable:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if _called_from(sys._getframe(1), files):
                calls.append(name)
            return originals[name](self, *args, **kwargs)

        return wrapper

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counting(name))
        with _ShapeFromValues(calls, files):
            fn()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return len(calls)


def small_args(args_type: type, **values: Any) -> Any:
    """`args_type()` with `values` set by field name, each in the group that holds it (`run_dir` in
    `run`, `rnd_weight` in `rnd`, ...), as the flags name them."""
    unknown = [name for name in values if not arguments.has_field(args_type(), name)]
    assert not unknown, f"{args_type.__name__} has no field {unknown}"
    return arguments.with_values(args_type(), values)


def rollout_batch(buf: Any) -> dict[str, Any]:
    """The update's rows of a rollout, as ppo_ddp.train makes them: every step of every env,
    views."""
    fields = ("actions", "log_probs", "means", "stds", "values", "advantages", "returns")
    batch = {name: getattr(buf, name).flatten(0, 1) for name in fields}
    batch["obs"] = {group: stored.flatten(0, 1) for group, stored in buf.obs.items()}
    return batch


def sequence_batch(buf: Any, start: tuple) -> dict[str, Any]:
    """The update's rows of a recurrent rollout, as ppo_rnn_ddp.train makes them: one per env, its
    whole rollout, with the memories (actor's, critic's) each env began it with."""
    fields = ("actions", "log_probs", "means", "stds", "values", "advantages", "returns", "dones")
    batch = {name: getattr(buf, name).transpose(0, 1) for name in fields}
    batch["obs"] = {group: stored.transpose(0, 1) for group, stored in buf.obs.items()}
    return batch | {"actor_memory": start[0], "critic_memory": start[1]}


def ppo_update(
    actor: Any,
    critic: Any,
    optimizer: Any,
    buf: Any,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    args: Any,
    ctx: Any,
    **extensions: Any,
) -> dict[str, float]:
    """ppo_ddp's update of `buf` with these advantages and returns, as `train` runs it."""
    buf.advantages.copy_(advantages)
    buf.returns.copy_(returns)
    return ppo_ddp.make_update(
        actor, critic, optimizer, rollout_batch(buf), args, ctx, **extensions
    )()


def cpu_dist(rank: int = 0, world_size: int = 1) -> common.Dist:
    """Where a process stands, for tests that call a script's pieces in one process (or in
    ranks)."""
    return common.Dist(rank, world_size, torch.device("cpu"), rank == 0)


def small_ppo(steps: int, envs: int, normalize: bool = True) -> tuple:
    """(actor, critic, their optimizer, a rollout of standard-normal data), both networks on the one
    `policy` group (3 wide) and 1 action: inputs for update tests."""
    shapes = {"policy": [3]}
    actor, critic = (
        ppo_ddp.Actor(shapes, 1, (8,), 1.0, normalize),
        ppo_ddp.Critic(shapes, (8,), normalize),
    )
    params = [*actor.parameters(), *critic.parameters()]
    optimizer = speedups.adam(params, 1e-3, speedups.SpeedArgs(), torch.device("cpu"))
    buf = ppo_ddp.make_rollout(steps, envs, shapes, 1, torch.device("cpu"))
    for tensor in (*buf.obs.values(), buf.actions, buf.means, buf.values):
        tensor.normal_()
    buf.stds.fill_(1.0)
    buf.log_probs.copy_(ppo_ddp.gaussian_log_prob(buf.actions, buf.means, buf.stds))
    return actor, critic, optimizer, buf


def expect_files(folder: Any, *names: str) -> None:
    """Assert that `folder` holds at least these files (optional packages may add others, such as
    TensorBoard's event files)."""
    missing = sorted(set(names) - set(os.listdir(folder)))
    assert not missing, f"{folder} lacks {missing}; it holds {sorted(os.listdir(folder))}"


def our_traceback(output: str) -> bool:
    """Whether `output` holds a Python traceback through our files (torchrun's own report does
    not)."""
    return (
        re.search(
            r'File ".*(common|bookkeeping|checkpoints|launch|speedups|networks|_ddp|'
            r'(envs|extensions)[/\\]\w+)\.py"',
            output,
        )
        is not None
    )


@contextlib.contextmanager
def process_group(
    device: str = "cpu", seed: int = 0, pin_cores: bool = False
) -> Iterator[common.Dist]:
    """What a script's `main` does around `train`, for tests that call `train` itself: join the
    group (gloo, with the start-up group), pick the device, share the cores, seed with seed + RANK;
    at the end a barrier, the signal handlers back, the group destroyed."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    start_group = None
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
        start_group = launch.start_group(rank, 1200.0)
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        resolved = common.resolve_device(device, local_rank, world_size)
        launch.share_cores(local_rank, pin_cores and world_size > 1, resolved.type == "cpu")
        torch.manual_seed(seed + rank)
        yield common.Dist(rank, world_size, resolved, rank == 0, start_group)
        if dist.is_initialized():
            dist.barrier()
    finally:
        bookkeeping.let_go()
        if dist.is_initialized():
            dist.destroy_process_group()


def write_row(run: bookkeeping.RunLog, it: int, values: dict, stop: bool = False) -> None:
    """What the scripts' rank-0 block does with an iteration's values: the row of metrics.jsonl,
    the console line, the logger's scalars."""
    row = bookkeeping.metrics_row(run, it, values)
    with open(os.path.join(run.dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(bookkeeping.console_line(run, row, stop), flush=True)
    if run.logger is not None:
        run.logger.write(bookkeeping.scalars(run, row), it)
