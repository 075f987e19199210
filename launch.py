"""Plumbing of how a process joins its job, which `common.setup_distributed` calls in one line each
and a reader of the algorithm never needs to open: the store a job restarted by torchrun meets in
again, the start-up group, and each rank's own share of the machine's cores; and how a worker that
exits with one line tells torchrun why (`record_error`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - before any process group (see below)
import torch.distributed as dist

# torch._dynamo imported after init_process_group (torch.optim does) keeps the group alive past
# destroy_process_group, and gloo's threads can then abort the exit: common imports this file, and
# with it torch._dynamo, before it starts a group.


def attempt_store(rank: int, world_size: int, timeout_s: float) -> dict[str, Any]:
    """torchrun keeps one store for every restart of a job (`--max-restarts`), so a restarted group
    would read the addresses its dead predecessor published there and fail to connect
    (pytorch#135712). Give each attempt its own key prefix: every rank counts its own starts, which
    agree because torchrun restarts all workers together (the ranks must stay the same: no elastic
    membership). Nothing (the usual env:// start) outside torchrun's shared store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    timeout = datetime.timedelta(seconds=timeout_s)
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    attempt = store.add(f"ddp_attempts/rank{rank}", 1)
    prefixed = dist.PrefixStore(f"ddp_attempt{attempt}", store)
    return {"store": prefixed, "rank": rank, "world_size": world_size}


def start_group(rank: int, start_timeout_s: float) -> Any:
    """A gloo group for the start-up agreement (`common.start_together`), with a timeout of its own:
    building envs may take minutes. Rank 0 gives up first and speaks for the job."""
    timeout = datetime.timedelta(seconds=start_timeout_s + 10 * (rank > 0))
    return dist.new_group(backend="gloo", timeout=timeout)


def share_cores(local_rank: int, pin: bool, cpu: bool) -> None:
    """On CPU (`cpu`), the N processes of one machine share its cores rather than each taking all of
    them: with `pin` (and several ranks) each binds to its own share (`pin_to_cores`), and torch's
    pool is sized to it, unless OMP_NUM_THREADS (torchrun sets 1) says otherwise."""
    # one inherited from a parent would size a pool for cores not ours
    os.environ.pop("RANK_CORES", None)
    if not cpu:
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    pinned = pin_to_cores(local_rank, local_world) if pin and local_world > 1 else set()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(pinned) or max(1, len(usable_cores()) // local_world))


def pin_to_cores(local_rank: int, local_world: int) -> set[int]:
    """Bind the calling thread, and every thread it starts from now on (torch's pool, the
    simulator's), to local rank `local_rank`'s own share of the cores this process may use
    (`rank_cores`). Called once the process group is up, so gloo's threads, already running, stay
    free to take any core. A rank that keeps its core keeps its caches and never queues behind the
    other rank's thread. Returns the cores, also left in `RANK_CORES` for whoever sizes a thread
    pool (`envs.envpool`); with fewer CPUs (hardware threads) than ranks, a local rank outside
    `local_world`, or where the OS has no affinity call, none is pinned (empty)."""
    if not hasattr(os, "sched_setaffinity"):
        return set()
    cores = set(rank_cores(local_rank, local_world, usable_cores()))
    if not cores:
        return set()
    os.sched_setaffinity(0, cores)
    os.environ["RANK_CORES"] = ",".join(map(str, sorted(cores)))
    return cores


def usable_cores() -> list[int]:
    """The CPU ids this process may run on (its affinity mask: a container's or `taskset`'s
    cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def rank_cores(
    local_rank: int,
    local_world: int,
    cpus: Iterable[int],
    topology: str = "/sys/devices/system/cpu",
) -> list[int]:
    """Local rank `local_rank`'s share of `cpus` among `local_world` ranks. With at least one
    physical core per rank, each rank takes `cores // local_world` whole cores, every hyperthread of
    each (what is left over idles); two ranks never share a core's two threads. With fewer cores
    than ranks, each takes `cpus // local_world` single threads, the first thread of every core
    handed out before any second one. Empty with fewer threads than ranks or `local_rank` outside
    `local_world`."""
    if not 0 <= local_rank < local_world:
        return []
    cores = physical_cores(cpus, topology)
    if len(cores) >= local_world:
        per_rank = len(cores) // local_world
        mine = cores[local_rank * per_rank : (local_rank + 1) * per_rank]
        return sorted(cpu for core in mine for cpu in core)
    most = max(map(len, cores), default=0)
    threads = [core[i] for i in range(most) for core in cores if i < len(core)]
    share = len(threads) // local_world
    return sorted(threads[local_rank * share : (local_rank + 1) * share])


def physical_cores(
    cpus: Iterable[int], topology: str = "/sys/devices/system/cpu"
) -> list[list[int]]:
    """`cpus` grouped by physical core, each core's hyperthreads together, cores in the order of
    their lowest id. Linux usually numbers the second threads after all the first ones (16 cores:
    CPU 0 and 16 share one). An id without a topology entry is a core of its own."""

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


def record_error(message: str) -> None:
    """Write `message` to this worker's torchrun error file (the path in TORCHELASTIC_ERROR_FILE),
    in the JSON that torch's `ErrorHandler.record_exception` writes but without a traceback, so that
    torchrun's `ChildFailedError` report shows `message` as the worker's failure (and as the root
    cause when this worker failed first) instead of `<N/A>`. Nothing outside torchrun (the variable
    unset), and nothing if the file cannot be written: the report then says `<N/A>` as before."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(data, f)
