"""How a process joins its job, called in one line each: the store a job restarted by torchrun
meets in again, the start-up group, each rank's share of the cores, and how a worker that exits
with one line tells torchrun why.
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
# destroy_process_group, and gloo's threads can then abort the exit: so it is imported here, first.


def attempt_store(rank: int, world_size: int, timeout_s: float) -> dict[str, Any]:
    """torchrun keeps one store for every restart of a job, so a restarted group would read the
    addresses its dead predecessor published there (pytorch#135712): each attempt gets its own key
    prefix, counted by every rank (torchrun restarts all workers together; no elastic membership).
    {} outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    timeout = datetime.timedelta(seconds=timeout_s)
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    attempt = store.add(f"ddp_attempts/rank{rank}", 1)
    prefixed = dist.PrefixStore(f"ddp_attempt{attempt}", store)
    return {"store": prefixed, "rank": rank, "world_size": world_size}


def start_group(rank: int, start_timeout_s: float) -> Any:
    """A gloo group for the start-up agreement, with a timeout of its own: building envs may take
    minutes. Rank 0 gives up first and speaks for the job."""
    timeout = datetime.timedelta(seconds=start_timeout_s + 10 * (rank > 0))
    return dist.new_group(backend="gloo", timeout=timeout)


def share_cores(local_rank: int, pin: bool, cpu: bool) -> None:
    """On CPU, the processes of one machine share its cores rather than each taking all: with `pin`
    each binds to its own share, and torch's pool is sized to it, unless OMP_NUM_THREADS says."""
    # one inherited from a parent would size a pool for cores not ours
    os.environ.pop("RANK_CORES", None)
    if not cpu:
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    pinned = pin_to_cores(local_rank, local_world) if pin and local_world > 1 else set()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(pinned) or max(1, len(usable_cores()) // local_world))


def pin_to_cores(local_rank: int, local_world: int) -> set[int]:
    """Bind the calling thread, and every thread it starts from now on, to `local_rank`'s share of
    the cores (`rank_cores`). Called once the process group is up, so gloo's threads stay free to
    take any core. A rank that keeps its core keeps its caches. Returns the cores, also left in
    `RANK_CORES` for whoever sizes a thread pool (`envs.envpool`); empty where none is pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return set()
    cores = set(rank_cores(local_rank, local_world, usable_cores()))
    if not cores:
        return set()
    os.sched_setaffinity(0, cores)
    os.environ["RANK_CORES"] = ",".join(map(str, sorted(cores)))
    return cores


def usable_cores() -> list[int]:
    """The CPU ids this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def rank_cores(
    local_rank: int,
    local_world: int,
    cpus: Iterable[int],
    topology: str = "/sys/devices/system/cpu",
) -> list[int]:
    """`local_rank`'s share of `cpus`: `cores // local_world` whole cores, each with its threads,
    so that two ranks never share a core; with fewer cores than ranks, `cpus // local_world` single
    threads, first threads before second ones. Empty with fewer threads than ranks, or a
    `local_rank` outside `local_world`."""
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
    """`cpus` grouped by physical core, in the order of their lowest id (Linux usually numbers the
    second threads after all the first ones). An id without a topology entry is a core alone."""

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
    """Write `message` to this worker's torchrun error file (TORCHELASTIC_ERROR_FILE), as torch's
    `ErrorHandler.record_exception` would without a traceback, so that torchrun's report shows it
    as the worker's failure instead of `<N/A>`. Nothing outside torchrun or if it cannot write."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(data, f)
