"""The distributed mechanism the training scripts share, in the order a run meets it: the device
rule, the start-up check (`agree`), the initial broadcast, the guards that make every rank take the
same decision, the normalizer merged across ranks, and the statistics rank 0 logs. Each script
joins the process group and runs its update's all_reduce itself. No algorithm, task or plumbing.

Every function that talks to other ranks says so, and every rank must call it in the same order: a
collective that one rank skips is a hang.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class Failure(Exception):
    """An expected failure every rank has been told of: one line, printed by rank `speaker` (-1: by
    none, the cause is printed already); the job exits 1. Other exceptions keep their traceback."""

    def __init__(self, message: str, speaker: int = 0) -> None:
        super().__init__(message)
        self.speaker = speaker


# --- Process group --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """Where this process stands in the job."""

    rank: int  # global rank: seeds and the rank-0 gate
    world_size: int
    device: torch.device
    is_main: bool  # rank 0: alone it prints, logs and writes files
    start_group: Any = None  # gloo, with the long start-up timeout: carries the start-up agreement


def resolve_device(
    device: str, local_rank: int, world_size: int = 1, gpus: int | None = None
) -> torch.device:
    """The device rule: with several processes each uses its own GPU, `cuda:{LOCAL_RANK}` (what
    `cuda` means); `auto` is that when there is a GPU, else `cpu`. `gpus`: this node's."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    try:
        resolved = torch.device(
            "cuda" if device == "auto" and gpus else "cpu" if device == "auto" else device
        )
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: pass auto, cpu, cuda or cuda:N.") from None
    if resolved.type != "cuda":
        return resolved
    resolved = torch.device("cuda", local_rank if resolved.index is None else resolved.index)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if world_size > 1 else 1
    # two ranks on one GPU: half speed, or a deadlock
    if world_size > 1 and resolved.index != local_rank:
        raise ValueError(
            f"device {device!r} is not cuda:LOCAL_RANK: with several processes each must use its "
            "own GPU. Pass --device auto (or cuda), or cuda:$LOCAL_RANK per process."
        )
    if not gpus:
        raise ValueError(
            f"device {device!r} asked for, but CUDA is not available here: pass --device cpu (or "
            "auto), or install a CUDA build of torch."
        )
    if per_node > gpus:  # the same words on every rank of the node: one line for the job
        raise ValueError(
            f"{per_node} processes per node but this node has {gpus} GPU(s): no GPU for LOCAL_RANK "
            f"{gpus} and up. Start at most {gpus} per node, or pass --device cpu."
        )
    if resolved.index >= gpus:
        raise ValueError(
            f"no GPU cuda:{resolved.index}: this node has {gpus} GPU(s); pass --device cuda:0 to "
            f"cuda:{gpus - 1}, or auto."
        )
    return resolved


# --- Start-up: every rank checks alone, then all agree, then rank 0's state is everyone's ---------


def device_or_problem(
    device: str, local_rank: int, world_size: int
) -> tuple[torch.device, ValueError | None]:
    """`resolve_device`'s device, or the CPU and its one-line error for every rank to hear."""
    try:
        return resolve_device(device, local_rank, world_size), None
    except ValueError as error:
        return torch.device("cpu"), error


def agree(ctx: Dist, problem: BaseException | None, facts: Any = None, args: Any = None) -> None:
    """One all_gather of each rank's problem, `facts` and `args`: one `Failure` on every rank if a
    rank failed or ranks differ (not bad input: raised again, with its traceback, on its rank)."""
    expected = isinstance(problem, (Failure, ValueError, OSError))
    status = "" if problem is None else str(problem) if expected else "unexpected"
    mine = {"status": status, "said": isinstance(problem, Failure), "facts": repr(facts)}
    mine |= as_flags(args, ctx.device)
    everyone: list[Any] = [mine] * ctx.world_size
    try:  # over the start-up group, whose timeout is --start-timeout-s
        if ctx.world_size > 1:
            dist.all_gather_object(everyone, mine, group=ctx.start_group)
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        slow = "not every rank finished start-up within --start-timeout-s"
        hint = "raise it for a slow simulator, or find the rank that hangs"
        raise Failure(f"{slow}; {hint}.", ctx.rank) from None
    if problem is not None and not expected:
        raise problem
    if failed := [r for r, theirs in enumerate(everyone) if theirs["status"]]:
        first = everyone[failed[0]]
        if first["status"] == "unexpected":  # its rank raised it, with the traceback
            raise Failure(f"rank(s) {failed} failed; stopping every rank.", speaker=-1)
        alike = [r for r in failed if everyone[r]["status"] == first["status"]]
        whole = first["said"] or len(alike) == ctx.world_size
        who = "" if whole else f"rank{'s' * (len(alike) > 1)} {', '.join(map(str, alike))}: "
        raise Failure(who + first["status"], speaker=alike[0])
    if differ := [k for k in mine if any(theirs[k] != everyone[0][k] for theirs in everyone)]:
        ranks = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
        what = ", ".join("sizes or checkpoint" if key == "facts" else key for key in differ)
        same = "launch every rank with the same command line and environment"
        raise Failure(f"rank(s) {ranks} disagree with rank 0 on {what}; {same}.")


def as_flags(args: Any, device: torch.device) -> dict[str, str]:
    """Each argument of `args` (its groups' too) by flag, as text; the device by type (one rule)."""
    out = {}
    for field in dataclasses.fields(args) if args is not None else ():
        value = device.type if field.name == "device" else getattr(args, field.name)
        flag = f"--{field.name.replace('_', '-')}"
        out |= as_flags(value, device) if dataclasses.is_dataclass(value) else {flag: repr(value)}
    return out


@torch.no_grad()
def broadcast_state(parts: Iterable[Any], world_size: int) -> None:
    """Rank 0's parameters and buffers into `parts`' modules (optimizers, unstepped, are alike)."""
    if world_size == 1:
        return
    for module in parts:
        if isinstance(module, nn.Module):
            for tensor in module.state_dict().values():
                dist.broadcast(tensor, src=0)


# --- Collectives of the update and the guards ---------------------------------------------------


def all_reduce_sum(values: torch.Tensor, world_size: int) -> torch.Tensor:
    """A small vector summed over ranks, in float64 (episode statistics, flags). One all_reduce."""
    values = values.to(torch.float64)
    if world_size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def check_rollout(
    ctx: Dist, problem: str, obs: Mapping[str, torch.Tensor], more: dict[str, torch.Tensor], it: int
) -> None:
    """Raise on every rank if a rank's rollout stopped (`problem`, which that rank alone knows) or
    holds NaN/Inf in `obs` or `more`. One all_reduce, one read back."""
    tensors = {f"observation group {group!r}": x for group, x in obs.items()} | more
    flags = torch.zeros(ctx.world_size, 1 + len(tensors), device=ctx.device)
    nonfinite = [~torch.isfinite(t).all() for t in tensors.values()]
    flags[ctx.rank] = torch.stack(
        [torch.tensor(bool(problem), device=ctx.device), *nonfinite]
    ).float()
    reduced = all_reduce_sum(flags, ctx.world_size).tolist()
    stopped = [rank for rank, row in enumerate(reduced) if row[0]]
    if stopped:
        raise Failure(f"rank {stopped[0]}, iteration {it}: {problem}", speaker=stopped[0])
    names = list(tensors)
    bad = [
        f"{names[j]} on rank {r}"
        for r, row in enumerate(reduced)
        for j, flag in enumerate(row[1:])
        if flag
    ]
    if bad:
        raise Failure(
            f"non-finite values (NaN/Inf) in {', '.join(bad)} at iteration {it}; fix the "
            "environment or lower the learning rate. No checkpoint was written for this iteration."
        )


def check_ranks_agree(ctx: Dist, it: int, interval: int, trained: Mapping[str, Any]) -> None:
    """Every `interval` iterations (0: never), all ranks raise if one's trained state differs from
    rank 0's. One all_gather of a hash."""
    if not interval or it % interval:
        return
    everyone = all_gather_ints(ctx, [digest(fingerprint(trained))])
    differing = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differing:
        raise Failure(
            f"rank(s) {differing} disagree with rank 0 on the trained state at iteration {it}; "
            "ranks drifted apart; report this as a bug."
        )


def all_gather_ints(ctx: Dist, values: list[int]) -> list[list[int]]:
    """Every rank's list of integers, by rank. One all_gather."""
    if ctx.world_size == 1:
        return [values]
    local = torch.tensor(values, dtype=torch.int64, device=ctx.device)
    everyone = [torch.zeros_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, local)
    return [theirs.tolist() for theirs in everyone]


def digest(value: str) -> int:
    """A 56-bit hash of `value` that fits an int64 tensor."""
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:7], "little")


def fingerprint(trained: Mapping[str, Any]) -> str:
    """SHA-256 of the exact bytes of everything training changes in `trained` (by name)."""
    kinds = (nn.Module, torch.optim.Optimizer)
    return state_fingerprint(
        {name: part.state_dict() for name, part in trained.items() if isinstance(part, kinds)}
    )


def state_fingerprint(states: Mapping[str, Mapping[str, Any]]) -> str:
    """`fingerprint` from state dicts (a checkpoint's): each module's tensors in order, then each
    optimizer's (those with `param_groups`) moments and learning rates."""
    sha = hashlib.sha256()
    optimizers = [name for name, state in states.items() if "param_groups" in state]
    for name in [*(name for name in states if name not in optimizers), *optimizers]:
        state = states[name]
        if name not in optimizers:
            tensors = list(state.values())
        else:
            tensors = [
                v if torch.is_tensor(v) else torch.tensor(float(v))
                for moments in state["state"].values()
                for v in moments.values()
            ]
            tensors += [
                torch.tensor(float(g["lr"]), dtype=torch.float64) for g in state["param_groups"]
            ]
        for t in tensors:
            sha.update(
                t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            )
    return sha.hexdigest()


# --- Observation normalizer: statistics of every rank's data -----------------------------------


class EmpiricalNormalizer(nn.Module):
    """`(x - mean) / (std + eps)`, with statistics of every rank's data (`update_normalizers`)."""

    def __init__(self, dim: int, eps: float = 1e-2, until: float | None = None) -> None:
        super().__init__()
        self.eps, self.until = eps, until  # `until`: stop learning after this many samples (rsl_rl)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(dim, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.dtype)) / (self.var.sqrt().to(x.dtype) + self.eps)


Moments = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (count, mean, M2: summed squares)


def merge_moments(a: Moments, b: Moments) -> Moments:
    """Chan et al.'s parallel-variance merge of two `(count, mean, M2)` triples."""
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    n = n_a + n_b
    delta = mean_b - mean_a
    safe_n = n.clamp(min=1)
    return n, mean_a + delta * n_b / safe_n, m2_a + m2_b + delta * delta * n_a * n_b / safe_n


def normalizer_batches(
    networks: Iterable[nn.Module], obs: Mapping[str, torch.Tensor]
) -> list[tuple[nn.Module, torch.Tensor]]:
    """Each network's normalizer that is on, with the flat part of `obs` it reads."""
    batches = [(net.inputs.normalizer, net.inputs.flat_part(obs)) for net in networks]
    return [(n, x) for n, x in batches if isinstance(n, EmpiricalNormalizer)]


@torch.no_grad()
def update_normalizers(
    batches: list[tuple[EmpiricalNormalizer, torch.Tensor]], world_size: int
) -> None:
    """Every rank's batch into each normalizer: one all_gather of (count, mean, M2), merged in rank
    order, so that every rank gets the same bits."""
    local = []
    for normalizer, x in batches:
        x = x.reshape(-1, normalizer.mean.numel()).to(torch.float64)
        count = torch.tensor([x.shape[0]], dtype=torch.float64, device=x.device)
        local += [count, x.mean(0), ((x - x.mean(0)) ** 2).sum(0)]
    if not local:
        return
    everyone = [mine := torch.cat(local)]
    if world_size > 1:
        everyone = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
    offset = 0
    for n, _ in batches:
        dim = n.mean.numel()
        if n.until is None or n.count < n.until:  # alike on every rank
            moments = (n.count, n.mean, n.var * n.count)
            for theirs in everyone:  # (count, mean, M2) of each rank's batch of this normalizer
                piece = theirs[offset : offset + 1 + 2 * dim]
                moments = merge_moments(moments, (piece[0], piece[1 : 1 + dim], piece[1 + dim :]))
            n.count.copy_(moments[0])
            n.mean.copy_(moments[1])
            n.var.copy_(moments[2] / moments[0].clamp(min=1))
        offset += 1 + 2 * dim


# --- What rank 0 logs: every rank's episodes and env logs -----------------------------------------


def reduce_logs(
    ctx: Dist, finished: torch.Tensor, logs: dict[str, torch.Tensor], keys: list[str], stop: bool
) -> tuple[dict[str, float], bool]:
    """Every rank's episodes (`finished`: return sum, length sum, count; zeroed here) and logs ->
    (means, whether any rank must stop): one all_reduce; a key new on some rank first grows `keys`
    (1 all_gather), then the all_reduce runs again. A log value: a (sum, count) pair or a mean."""
    while True:
        pairs = [log_pair(logs.get(key), ctx.device) for key in keys]
        new = bool(set(logs) - set(keys))  # the layout must be the same on every rank
        flags = torch.tensor([float(stop), float(new)], device=ctx.device)
        reduced = all_reduce_sum(torch.cat([finished, *pairs, flags]), ctx.world_size).tolist()
        if not reduced[-1]:
            break
        everyone: list[list[str]] = [sorted(logs)] * ctx.world_size
        if ctx.world_size > 1:
            dist.all_gather_object(everyone, sorted(logs))
        keys[:] = sorted(set(keys).union(*everyone))
    finished.zero_()
    means = {key: reduced[3 + 2 * i] / n for i, key in enumerate(keys) if (n := reduced[4 + 2 * i])}
    if reduced[2] > 0:
        means.update(episode_return=reduced[0] / reduced[2], episode_length=reduced[1] / reduced[2])
    return {"episodes_finished": int(reduced[2]), **means}, reduced[-2] > 0


def log_pair(value: torch.Tensor | float | None, device: torch.device) -> torch.Tensor:
    """A log value as (sum, count): a scalar has weight 1; None is (0, 0)."""
    if value is None:
        return torch.zeros(2, device=device)
    value = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1)
    return value if value.numel() == 2 else torch.cat([value, torch.ones(1, device=device)])


def first_line(error: BaseException) -> str:
    """The first line of an error's message (torch's run to many), or its type's name."""
    return (str(error).splitlines() or [type(error).__name__])[0]


def check_update(means: dict[str, float], causes: str) -> None:
    """Raise if a mean of the update's statistics is NaN/Inf: from the all_reduce, so every rank
    raises together, before any checkpoint; `causes` says what could have made it so."""
    bad = [name for name, value in means.items() if not math.isfinite(value)]
    if bad:
        raise Failure(
            f"non-finite {', '.join(bad)} in the update: {causes} produced NaN/Inf. No checkpoint "
            "was written: check the environment's values, or start again with a lower "
            "--learning-rate (a resume keeps the checkpoint's)."
        )
