"""Shared pieces of the data-parallel scripts: process group, sync primitives, GAE, normalizers,
built-in environments, the PPO building blocks and hyperparameters (`PPOArgs`, on `RunArgs`),
logging and checkpoints.

Every function that talks to other ranks says so in its docstring, and every rank must call it in
the same order: a collective that one rank skips is a hang.
"""

from __future__ import annotations

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
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

# ---------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """Where this process stands: global rank, rank on its node, world size, device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints, logs and writes files."""
        return self.rank == 0


def resolve_device(device: str, local_rank: int) -> torch.device:
    """`auto` is `cuda:{LOCAL_RANK}` when CUDA is there, else `cpu`; a CUDA device must be ours."""
    if device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda":
        expected = torch.device(f"cuda:{local_rank}")
        if resolved.index is None:
            resolved = expected
        if resolved != expected:
            # Two ranks bound to one GPU train fine but twice as slowly, and NCCL may deadlock.
            raise ValueError(
                f"device {device!r} does not match this process's LOCAL_RANK={local_rank}: "
                f"each process must use its own GPU, cuda:{local_rank}. Pass --device auto "
                f"(or --device cuda) and let the launcher pick it."
            )
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here.")
    return resolved


def setup_distributed(device: str = "auto", seed: int = 0, timeout_s: float = 60.0) -> Dist:
    """Read WORLD_SIZE/RANK/LOCAL_RANK (set by torchrun), join the process group, seed by rank.

    NCCL on CUDA, gloo on CPU; a finite timeout so a lost rank ends the job instead of hanging it.
    Seeds are `seed + RANK`: the global rank, since local ranks repeat on every node.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = resolve_device(device, local_rank)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    elif resolved.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N processes on one machine must share the cores, not each take all of them.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world_size > 1 and not dist.is_initialized():
        # torch.optim imports torch._dynamo on first use. Imported after init_process_group, it keeps
        # the group alive past destroy_process_group: gloo's threads then outlive it and can abort the
        # process at exit ("terminate called without an active exception"). So import it first.
        importlib.import_module("torch._dynamo")
        dist.init_process_group(
            backend="nccl" if resolved.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=resolved if resolved.type == "cuda" else None,
        )
    torch.manual_seed(seed + rank)
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=resolved)


@contextlib.contextmanager
def distributed(device: str = "auto", seed: int = 0, timeout_s: float = 60.0) -> Iterator[Dist]:
    """`setup_distributed` as a context: on exit, error or not, the process group is destroyed and the
    SIGTERM/SIGINT handlers that training installs are put back. A normal exit first waits for every
    rank (one barrier)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield setup_distributed(device, seed, timeout_s)
        if dist.is_initialized():
            # SYNC: no rank tears the group down while another may still be finishing its last collective.
            dist.barrier()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if dist.is_initialized():
            dist.destroy_process_group()


def all_gather_ints(ctx: Dist, values: list[int]) -> list[list[int]]:
    """Every rank's list of integers, by rank (one all_gather; start-up checks only)."""
    local = torch.tensor(values, dtype=torch.int64, device=ctx.device)
    if ctx.world_size == 1:
        return [values]
    gathered = [torch.zeros_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, local)
    return [g.tolist() for g in gathered]


def digest(value: str) -> int:
    """A 56-bit hash of `value` that fits an int64 tensor: what ranks compare instead of the string."""
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:7], "little")


def check_same_on_all_ranks(
    ctx: Dist, what: str, value: str, advice: str = "launch every rank with the same command line and environment"
) -> None:
    """Raise on every rank if ranks disagree on `value` (arguments, sizes, trained state). One all_gather."""
    gathered = all_gather_ints(ctx, [digest(value)])
    differing = [r for r, g in enumerate(gathered) if g != gathered[0]]
    if differing:
        # Every rank sees the same gathered list, so every rank raises here together.
        raise RuntimeError(f"rank(s) {differing} disagree with rank 0 on {what}; {advice}.")


def start_together(ctx: Dist, prepare: Callable[[], Any], describe: Callable[[Any], str], what: str) -> Any:
    """Run this rank's local start-up, then agree with the others in one all_gather.

    `prepare()` is everything a rank does alone (check arguments, read a checkpoint, build the env).
    If it raises on any rank, every rank raises (the failing ones their own error), so no rank waits
    in a collective for a rank that already left; if the ranks' `describe(result)` differ (other
    arguments, sizes, or checkpoint contents), every rank raises too.
    """
    try:
        result, error = prepare(), None
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others have been told
        result, error = None, e
    gathered = all_gather_ints(ctx, [int(error is not None), 0 if error else digest(describe(result))])
    failed = [r for r, (flag, _) in enumerate(gathered) if flag]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"rank(s) {failed} failed at start-up (their error is above); stopping every rank.")
    differing = [r for r, (_, d) in enumerate(gathered) if d != gathered[0][1]]
    if differing:
        raise RuntimeError(
            f"rank(s) {differing} disagree with rank 0 on {what}; launch every rank with the same command line and environment."
        )
    return result


def raise_together(ctx: Dist, problem: str | None) -> None:
    """Raise on every rank if any rank has a `problem` (its message); one all_gather.

    For a condition only one rank can see: the others raise too instead of waiting for it.
    """
    failed = [r for r, (flag,) in enumerate(all_gather_ints(ctx, [int(problem is not None)])) if flag]
    if problem is not None:
        raise RuntimeError(f"rank {ctx.rank}: {problem}")
    if failed:
        raise RuntimeError(f"rank(s) {failed} cannot go on (their error is above); stopping every rank.")


def raise_if_nonfinite(ctx: Dist, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise on every rank if any rank holds NaN/Inf in `tensors`, naming rank and tensor. One all_reduce."""
    flags = torch.zeros(ctx.world_size, len(tensors), device=ctx.device)
    flags[ctx.rank] = torch.stack([~torch.isfinite(t).all() for t in tensors.values()]).float()
    bad = all_reduce_sum(flags, ctx.world_size).nonzero().tolist()
    if bad:
        names = list(tensors)
        found = ", ".join(f"{names[j]} on rank {i}" for i, j in bad)
        raise FloatingPointError(
            f"non-finite values (NaN/Inf) in {found} {where}; fix the environment or lower the learning rate. No checkpoint was written for this iteration."
        )


def prepare_run_dir(ctx: Dist, run_dir: str) -> None:
    """Rank 0 creates `run_dir` and checks it can write there; every rank raises if not. One all_gather."""
    error = ""
    if ctx.is_main:
        try:
            os.makedirs(run_dir, exist_ok=True)
            probe = os.path.join(run_dir, f".write-test-{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            error = str(e)
    # Only rank 0 can see the problem; share it so no rank goes on to wait for rank 0.
    if all_gather_ints(ctx, [int(bool(error))])[0][0]:
        raise OSError(
            f"rank 0 cannot write the run directory {run_dir!r} ({error or 'see rank 0'}); pass a writable --run-dir."
        )


# ---------------------------------------------------------------------------------------------
# Synchronization primitives
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def broadcast_state(modules: list[nn.Module], world_size: int) -> None:
    """Copy rank 0's parameters *and* buffers (normalizer statistics) into every rank's modules."""
    if world_size == 1:
        return
    for module in modules:
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)


def all_reduce_gradients(
    params: list[nn.Parameter], world_size: int, extras: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Average gradients over ranks with ONE all_reduce of a flat buffer; return averaged `extras`.

    A parameter without a gradient counts as zeros so every rank sends the same layout. Values
    that must be averaged at the same moment (the KL for the learning rate, loss statistics) ride
    along in `extras` instead of costing a collective each.
    """
    pieces = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params]
    if extras is not None:
        pieces.append(extras.reshape(-1).to(pieces[0].dtype))
    flat = torch.cat(pieces)
    if world_size > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= world_size
    offset = 0
    for p in params:
        synced = flat[offset : offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = synced.clone()
        else:
            p.grad.copy_(synced)
        offset += p.numel()
    return flat[offset:] if extras is not None else None


def adaptive_lr(
    kl: torch.Tensor, lr: torch.Tensor, desired_kl: float, min_lr: float = 1e-5, max_lr: float = 1e-2
) -> torch.Tensor:
    """rsl_rl's KL-adaptive rule: shrink by 1.5 above 2x the target KL, grow by 1.5 below half.

    Tensor in, tensor out, on the device: choosing the lr needs no host sync. The comparisons and
    the arithmetic run in `lr`'s dtype (float64 on CPU: the same bits as Python floats).
    """
    kl = kl.to(lr.dtype)
    grown = torch.where((kl > 0) & (kl < desired_kl / 2.0), (lr * 1.5).clamp(max=max_lr), lr)
    return torch.where(kl > desired_kl * 2.0, (lr / 1.5).clamp(min=min_lr), grown)


def sync_kl_and_lr(kl: torch.Tensor, lr: torch.Tensor, desired_kl: float, ctx: Dist) -> torch.Tensor:
    """rsl_rl's two collectives: all_reduce the mini-batch KL, rank 0 picks the lr, broadcast it."""
    kl = kl.detach().reshape(1).clone()
    if ctx.world_size > 1:
        dist.all_reduce(kl, op=dist.ReduceOp.SUM)
        kl /= ctx.world_size
    chosen = adaptive_lr(kl[0], lr, desired_kl).reshape(1) if ctx.is_main else torch.zeros_like(lr).reshape(1)
    if ctx.world_size > 1:
        dist.broadcast(chosen, src=0)
    return chosen[0]


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


def nonfinite_flags(value: torch.Tensor, ctx: Dist) -> torch.Tensor:
    """(world_size,) zeros with a 1 in this rank's slot if `value` is not finite. Sent inside the
    gradient all_reduce, they tell every rank which rank produced NaN/Inf first."""
    flags = torch.zeros(ctx.world_size, device=ctx.device)
    flags[ctx.rank] = (~torch.isfinite(value)).float()
    return flags


def first_flags(seen: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
    """Keep the reduced flags of the first step in which any rank was flagged: NaN spreads to every
    rank through the all_reduce, so the flags of later steps would blame them all."""
    return torch.where(seen.any(), seen, reduced)


def raise_if_update_failed(flags: torch.Tensor, grad_norm_ok: torch.Tensor, loss: str, sources: str) -> None:
    """After an update: raise if a rank's loss or the averaged gradient norm was not finite.

    Both come out of the all_reduce, equal on every rank, so every rank raises the same error here
    together, before any checkpoint is written. One host sync per update, not per mini-batch.
    """
    ranks = flags.nonzero().flatten().tolist()
    if ranks:
        raise FloatingPointError(
            f"non-finite {loss} on rank(s) {ranks}; {sources} produced NaN/Inf. No checkpoint was written."
        )
    if not grad_norm_ok:
        raise FloatingPointError(
            f"non-finite gradient in the update of the {loss}; lower the learning rate. No checkpoint was written."
        )


# ---------------------------------------------------------------------------------------------
# Returns and normalization
# ---------------------------------------------------------------------------------------------


def bootstrap_timeouts(
    rewards: torch.Tensor, values: torch.Tensor, time_outs: torch.Tensor, gamma: float
) -> torch.Tensor:
    """rsl_rl's truncation fix: an episode cut by the time limit earns `gamma * V(s_t)` extra."""
    return rewards + gamma * values * time_outs.to(rewards.dtype)


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_values: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over `(T, N)` tensors -> `(advantages, returns)`.

    `dones[t]` ends the episode after step t, cutting both the bootstrap and the recursion.
    """
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(last_values)
    next_values = last_values
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t].to(rewards.dtype)
        delta = rewards[t] + gamma * next_values * not_done - values[t]
        next_advantage = delta + gamma * lam * not_done * next_advantage
        advantages[t] = next_advantage
        next_values = values[t]
    return advantages, advantages + values


def normalize_advantages(advantages: torch.Tensor, world_size: int, eps: float = 1e-8) -> torch.Tensor:
    """Normalize with the mean and std of ALL ranks' advantages (one all_reduce of 3 numbers).

    With global statistics, N ranks x E envs give the same update as 1 rank x N*E envs.
    """
    a = advantages.to(torch.float64)
    sums = all_reduce_sum(
        torch.stack([a.sum(), (a * a).sum(), torch.tensor(a.numel(), dtype=torch.float64, device=a.device)]), world_size
    )
    total, total_sq, count = sums[0], sums[1], sums[2]
    mean = total / count
    std = ((total_sq - count * mean * mean) / (count - 1).clamp(min=1)).clamp(min=0).sqrt()
    return ((a - mean) / (std + eps)).to(advantages.dtype)


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

    def __init__(self, dim: int, eps: float = 1e-2) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(dim, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize `x` (..., dim) with the current statistics."""
        return (x - self.mean.to(x.dtype)) / (self.var.sqrt().to(x.dtype) + self.eps)

    @torch.no_grad()
    def update(self, x: torch.Tensor, world_size: int) -> None:
        """Fold a batch of raw observations from every rank into the statistics. One all_gather.

        Each rank's batch moments are gathered and merged in rank order, so all ranks compute the
        same bits; the result is the mean and variance of the union of the ranks' batches.
        """
        x = x.reshape(-1, self.mean.numel()).to(torch.float64)
        local = torch.cat(
            [torch.tensor([x.shape[0]], dtype=torch.float64, device=x.device), x.mean(0), ((x - x.mean(0)) ** 2).sum(0)]
        )
        gathered = [torch.zeros_like(local) for _ in range(world_size)]
        if world_size > 1:
            dist.all_gather(gathered, local)
        else:
            gathered = [local]
        dim = self.mean.numel()
        moments = (self.count, self.mean, self.var * self.count)
        for g in gathered:
            moments = merge_moments(moments, (g[0], g[1 : 1 + dim], g[1 + dim :]))
        count, mean, m2 = moments
        self.count.copy_(count)
        self.mean.copy_(mean)
        self.var.copy_(m2 / count.clamp(min=1))


# ---------------------------------------------------------------------------------------------
# Environments
# ---------------------------------------------------------------------------------------------


class VecEnv(Protocol):
    """rsl_rl's vectorized environment protocol, which every script trains on.

    `get_observations()` -> {group: (num_envs, dim)}; `step(actions)` -> (obs, rewards (num_envs,),
    dones (num_envs,), extras) with `extras["time_outs"]` marking truncations and `extras["log"]`
    holding scalars to log.
    """

    num_envs: int
    num_actions: int
    max_episode_length: int
    episode_length_buf: torch.Tensor
    device: torch.device

    def get_observations(self) -> Mapping[str, torch.Tensor]: ...

    def step(self, actions: torch.Tensor) -> tuple[Mapping[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]: ...


def angle_normalize(x: torch.Tensor) -> torch.Tensor:
    """Wrap angles to [-pi, pi)."""
    return torch.remainder(x + math.pi, 2 * math.pi) - math.pi


class Pendulum:
    """Gymnasium's Pendulum-v1, batched: same dynamics, reward, limits, start state, 200-step limit.

    Groups: `policy` = (cos th, sin th, thdot) as in Gymnasium. The log also reports the style of the
    motion: `swingup_ccw_fraction`, the share of recent swing-ups (from below horizontal to within
    0.5 rad of upright) made counter-clockwise, which the reward does not care about (AMP's target).
    """

    max_speed, max_torque, dt, g, m, l = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0

    def __init__(self, num_envs: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.num_envs, self.num_actions, self.max_episode_length = num_envs, 1, 200
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.theta = torch.zeros(num_envs, device=self.device)
        self.theta_dot = torch.zeros(num_envs, device=self.device)
        self.mass = torch.full((num_envs,), self.m, device=self.device)
        self.length = torch.full((num_envs,), self.l, device=self.device)
        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.was_down = torch.zeros(num_envs, dtype=torch.bool, device=self.device)
        self.swingups = torch.zeros(2, device=self.device)  # decayed counts: [counter-clockwise, all]
        self.allocate()
        self.reset_idx(torch.arange(num_envs, device=self.device))

    def allocate(self) -> None:
        """Hook for variants that keep more state per env (called before the first reset)."""

    def reset_idx(self, ids: torch.Tensor) -> None:
        """Gymnasium's start state: theta ~ U(-pi, pi), theta_dot ~ U(-1, 1)."""
        u = torch.rand(2, ids.numel(), generator=self.generator, device=self.device)
        self.theta[ids] = (2 * u[0] - 1) * math.pi
        self.theta_dot[ids] = 2 * u[1] - 1
        self.episode_length_buf[ids] = 0
        self.was_down[ids] = self.theta[ids].abs() > math.pi / 2

    def get_observations(self) -> dict[str, torch.Tensor]:
        """The `policy` group."""
        return {"policy": torch.stack([self.theta.cos(), self.theta.sin(), self.theta_dot], dim=-1)}

    def step(self, actions: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """One 0.05 s step of every pendulum; auto-resets those that reach the time limit."""
        u = actions.reshape(self.num_envs, -1)[:, 0].clamp(-self.max_torque, self.max_torque)
        th, thdot, m, l = self.theta, self.theta_dot, self.mass, self.length
        costs = angle_normalize(th) ** 2 + 0.1 * thdot**2 + 0.001 * u**2
        new_thdot = thdot + (3 * self.g / (2 * l) * th.sin() + 3.0 / (m * l**2) * u) * self.dt
        new_thdot = new_thdot.clamp(-self.max_speed, self.max_speed)
        self.theta = th + new_thdot * self.dt
        self.theta_dot = new_thdot
        # Style bookkeeping: a swing-up ends when a pendulum that was below horizontal nears the top.
        angle = angle_normalize(self.theta).abs()
        swingup = self.was_down & (angle < 0.5)
        self.was_down = (self.was_down | (angle > math.pi / 2)) & ~swingup
        counts = torch.stack([(swingup & (new_thdot > 0)).sum(), swingup.sum()]).float()
        self.swingups = 0.99 * self.swingups + counts
        self.episode_length_buf += 1
        time_outs = self.episode_length_buf >= self.max_episode_length
        self.reset_idx(time_outs.nonzero().flatten())
        log = {"swingup_ccw_fraction": self.swingups[0] / self.swingups[1].clamp(min=1e-6)}
        return self.get_observations(), -costs, time_outs, {"time_outs": time_outs, "log": log}


class PendulumPartial(Pendulum):
    """Pendulum-v1 with randomized physics, seen partially: the distillation task.

    Mass and length are drawn per episode from U(0.7, 1.3) x nominal. Groups: `teacher` (5) =
    cos th, sin th, thdot, mass, length (privileged); `policy` (9) = the last 4 frames of
    (cos th, sin th) with N(0, 0.02) noise, and the last torque: what a robot with only an angle
    encoder would have.
    """

    history, noise = 4, 0.02

    def allocate(self) -> None:
        """Frame history and last action."""
        self.frames = torch.zeros(self.num_envs, self.history, 2, device=self.device)
        self.last_torque = torch.zeros(self.num_envs, device=self.device)

    def reset_idx(self, ids: torch.Tensor) -> None:
        """Gymnasium's start state, new physics, a history filled with the first frame."""
        super().reset_idx(ids)
        u = torch.rand(2, ids.numel(), generator=self.generator, device=self.device)
        self.mass[ids] = self.m * (0.7 + 0.6 * u[0])
        self.length[ids] = self.l * (0.7 + 0.6 * u[1])
        self.frames[ids] = self.noisy_frame()[ids].unsqueeze(1)
        self.last_torque[ids] = 0.0

    def noisy_frame(self) -> torch.Tensor:
        """(cos th, sin th) of every env with sensor noise -> (num_envs, 2)."""
        clean = torch.stack([self.theta.cos(), self.theta.sin()], -1)
        return clean + self.noise * torch.randn(clean.shape, generator=self.generator, device=self.device)

    def get_observations(self) -> dict[str, torch.Tensor]:
        """`teacher` (privileged) and `policy` (noisy angle history + last torque)."""
        teacher = torch.stack([self.theta.cos(), self.theta.sin(), self.theta_dot, self.mass, self.length], -1)
        return {"policy": torch.cat([self.frames.flatten(1), self.last_torque[:, None]], -1), "teacher": teacher}

    def step(self, actions: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """Pendulum step, then push the new noisy frame and the applied torque into the history."""
        _, rewards, dones, extras = super().step(actions)
        torque = actions.reshape(self.num_envs, -1)[:, 0].clamp(-self.max_torque, self.max_torque)
        self.last_torque = torch.where(dones, torch.zeros_like(torque), torque)
        self.frames = torch.cat([self.noisy_frame()[:, None], self.frames[:, :-1]], 1)
        return self.get_observations(), rewards, dones, extras


class Reacher:
    """A planar two-link arm (links 0.6 m and 0.4 m) that must bring its fingertip to a random target.

    Joints are torque-driven with viscous damping; a new target every episode (100 steps of 0.05 s).
    Groups: `policy` (10) = cos/sin of both joints, joint velocities, target xy, fingertip-target xy;
    `critic` (12) = `policy` plus the distance and the fingertip speed.
    Reward: -distance - 0.05 |torque|^2, +1 per step within 5 cm.
    """

    links, dt, damping, gain, max_speed = (0.6, 0.4), 0.05, 1.0, 10.0, 10.0

    def __init__(self, num_envs: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.num_envs, self.num_actions, self.max_episode_length = num_envs, 2, 100
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.q = torch.zeros(num_envs, 2, device=self.device)
        self.qd = torch.zeros(num_envs, 2, device=self.device)
        self.target = torch.zeros(num_envs, 2, device=self.device)
        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.reset_idx(torch.arange(num_envs, device=self.device))

    def reset_idx(self, ids: torch.Tensor) -> None:
        """Random joint angles, zero velocity, a target uniform in the reachable annulus."""
        u = torch.rand(4, ids.numel(), generator=self.generator, device=self.device)
        self.q[ids] = (2 * torch.stack([u[0], u[1]], -1) - 1) * math.pi
        self.qd[ids] = 0.0
        radius = 0.2 + 0.8 * u[2]
        angle = 2 * math.pi * u[3]
        self.target[ids] = torch.stack([radius * angle.cos(), radius * angle.sin()], -1)
        self.episode_length_buf[ids] = 0

    def fingertip(self) -> torch.Tensor:
        """Forward kinematics -> (num_envs, 2)."""
        l1, l2 = self.links
        a1, a12 = self.q[:, 0], self.q[:, 0] + self.q[:, 1]
        return torch.stack([l1 * a1.cos() + l2 * a12.cos(), l1 * a1.sin() + l2 * a12.sin()], -1)

    def get_observations(self) -> dict[str, torch.Tensor]:
        """`policy` and the privileged `critic` group."""
        delta = self.fingertip() - self.target
        policy = torch.cat([self.q.cos(), self.q.sin(), self.qd, self.target, delta], -1)
        critic = torch.cat([policy, delta.norm(dim=-1, keepdim=True), self.qd.norm(dim=-1, keepdim=True)], -1)
        return {"policy": policy, "critic": critic}

    def step(self, actions: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """Semi-implicit Euler step of both joints; auto-resets at the time limit."""
        torque = actions.reshape(self.num_envs, 2).clamp(-1.0, 1.0)
        self.qd = (self.qd + (self.gain * torque - self.damping * self.qd) * self.dt).clamp(
            -self.max_speed, self.max_speed
        )
        self.q = angle_normalize(self.q + self.qd * self.dt)
        distance = (self.fingertip() - self.target).norm(dim=-1)
        reward = -distance - 0.05 * (torque**2).sum(-1) + (distance < 0.05).float()
        self.episode_length_buf += 1
        time_outs = self.episode_length_buf >= self.max_episode_length
        self.reset_idx(time_outs.nonzero().flatten())
        return (
            self.get_observations(),
            reward,
            time_outs,
            {"time_outs": time_outs, "log": {"final_distance": distance.mean()}},
        )


TASKS: dict[str, Callable[..., VecEnv]] = {
    "pendulum": Pendulum,
    "pendulum_partial": PendulumPartial,
    "reacher": Reacher,
}


def make_env(task: str, num_envs: int, device: torch.device | str, seed: int) -> VecEnv:
    """Build a built-in task by name, or a user's environment from `module:function`.

    The function is called as `function(num_envs=..., device=..., seed=...)` and must return an
    object following the `VecEnv` protocol.
    """
    if ":" in task:
        module_name, _, function_name = task.partition(":")
        sys.path.insert(0, os.getcwd())  # torchrun does not put the working directory on the path.
        try:
            factory = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"cannot load environment {task!r}: {error}. Expected 'module:function' importable from {os.getcwd()}."
            ) from error
        return factory(num_envs=num_envs, device=device, seed=seed)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose one of {sorted(TASKS)} or give 'module:function'.")
    return TASKS[task](num_envs, device, seed)


def observation_group(obs: Mapping[str, torch.Tensor], group: str, fallback: str | None = "policy") -> torch.Tensor:
    """`obs[group]`, falling back to `obs[fallback]` when the group is missing (rsl_rl's rule)."""
    if group in obs:
        return obs[group]
    if fallback is not None and fallback in obs:
        return obs[fallback]
    raise ValueError(f"observation group {group!r} not found; the environment provides {sorted(obs.keys())}.")


# ---------------------------------------------------------------------------------------------
# Networks
# ---------------------------------------------------------------------------------------------


def mlp(in_dim: int, hidden: list[int], out_dim: int, activation: type[nn.Module] = nn.ELU) -> nn.Sequential:
    """A plain multilayer perceptron."""
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(in_dim, width), activation()]
        in_dim = width
    layers.append(nn.Linear(in_dim, out_dim))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------
# PPO building blocks (shared by ppo_ddp.py and ppo_amp_ddp.py)
# ---------------------------------------------------------------------------------------------


class Actor(nn.Module):
    """Gaussian policy: normalizer -> MLP -> mean; a state-independent log standard deviation."""

    def __init__(
        self, obs_dim: int, num_actions: int, hidden: tuple[int, ...], init_std: float, normalize: bool
    ) -> None:
        super().__init__()
        self.normalizer = EmpiricalNormalizer(obs_dim) if normalize else nn.Identity()
        self.net = mlp(obs_dim, list(hidden), num_actions)
        self.log_std = nn.Parameter(torch.full((num_actions,), math.log(init_std)))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (mean, std), each (batch, num_actions)."""
        mean = self.net(self.normalizer(obs))
        return mean, self.log_std.exp().expand_as(mean)


class Critic(nn.Module):
    """State-value function: normalizer -> MLP -> V(s)."""

    def __init__(self, obs_dim: int, hidden: tuple[int, ...], normalize: bool) -> None:
        super().__init__()
        self.normalizer = EmpiricalNormalizer(obs_dim) if normalize else nn.Identity()
        self.net = mlp(obs_dim, list(hidden), 1)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """-> values (batch,)."""
        return self.net(self.normalizer(obs)).squeeze(-1)


def make_adam(params: list[nn.Parameter], lr: float, device: torch.device) -> torch.optim.Optimizer:
    """Adam whose learning rate is a 0-dim tensor on `device`, so that the adaptive schedule can change
    it in place with no host sync. On CUDA the fused kernel reads it from the GPU (it wants float32);
    elsewhere the default implementation reads a float64 one, bit for bit what a Python float gives."""
    if device.type == "cuda":
        return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), fused=True)
    return torch.optim.Adam(params, lr=torch.tensor(lr, dtype=torch.float64, device=device))


def make_actor_critic(obs: Mapping[str, torch.Tensor], num_actions: int, args: PPOArgs, device: torch.device) -> dict:
    """{"actor": the policy on `args.actor_obs`, "critic": the value function on `args.critic_obs`
    (the actor's group when the env has no such group)}, on `device`."""
    actor_dim = observation_group(obs, args.actor_obs, None).shape[-1]
    critic_dim = observation_group(obs, args.critic_obs, args.actor_obs).shape[-1]
    actor = Actor(actor_dim, num_actions, args.actor_hidden, args.init_noise_std, args.normalize_obs)
    critic = Critic(critic_dim, args.critic_hidden, args.normalize_obs)
    return {"actor": actor.to(device), "critic": critic.to(device)}


def gaussian_log_prob(actions: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log density of a diagonal Gaussian, summed over action dimensions."""
    return (-((actions - mean) ** 2) / (2 * std**2) - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)


def gaussian_kl(old_mean: torch.Tensor, old_std: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(old || new) of diagonal Gaussians per sample, rsl_rl's formula."""
    return (torch.log(std / old_std) + (old_std**2 + (old_mean - mean) ** 2) / (2.0 * std**2) - 0.5).sum(-1)


@dataclass
class Rollout:
    """Preallocated storage for one rollout, each tensor (T, N, ...)."""

    actor_obs: torch.Tensor
    critic_obs: torch.Tensor
    actions: torch.Tensor
    log_probs: torch.Tensor
    means: torch.Tensor
    stds: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    dones: torch.Tensor


def make_rollout(
    steps: int, num_envs: int, actor_dim: int, critic_dim: int, num_actions: int, device: torch.device
) -> Rollout:
    """Allocate rollout storage once, outside inference mode, so the update can backprop from it."""

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(steps, num_envs, *shape, device=device)

    return Rollout(
        zeros(actor_dim),
        zeros(critic_dim),
        zeros(num_actions),
        zeros(),
        zeros(num_actions),
        zeros(num_actions),
        zeros(),
        zeros(),
        zeros(),
    )


@dataclass
class Episodes:
    """Running return and length of every env, and sums over episodes finished this iteration."""

    returns: torch.Tensor
    lengths: torch.Tensor
    finished: torch.Tensor  # [sum of returns, sum of lengths, count]


def make_episodes(num_envs: int, device: torch.device) -> Episodes:
    """Zeroed episode statistics for `num_envs` envs."""
    return Episodes(
        torch.zeros(num_envs, device=device), torch.zeros(num_envs, device=device), torch.zeros(3, device=device)
    )


def track_episodes(episodes: Episodes, rewards: torch.Tensor, dones: torch.Tensor) -> None:
    """Add one step to every env's running return and length; fold finished episodes into `finished`."""
    episodes.returns += rewards
    episodes.lengths += 1
    episodes.finished += torch.stack([(episodes.returns * dones).sum(), (episodes.lengths * dones).sum(), dones.sum()])
    episodes.returns *= 1 - dones
    episodes.lengths *= 1 - dones


def accumulate_logs(
    logs: dict[str, torch.Tensor], step_logs: Mapping[str, Any], weight: float, device: torch.device
) -> None:
    """Add `weight * value` for each of the env's `extras["log"]` scalars (a mean over the rollout)."""
    for key, value in step_logs.items():
        logs[key] = logs.get(key, 0.0) + torch.as_tensor(value, dtype=torch.float32, device=device).mean() * weight


def ppo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    clip: float,
    value_coef: float,
    entropy_coef: float,
    clip_value_loss: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate + (clipped) value loss - entropy bonus -> (loss, [surrogate, value, entropy])."""
    ratio = torch.exp(log_probs - old_log_probs)
    surrogate = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip)).mean()
    value_loss = (values - returns) ** 2
    if clip_value_loss:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        value_loss = torch.max(value_loss, (clipped - returns) ** 2)
    value_loss = value_loss.mean()
    loss = surrogate + value_coef * value_loss - entropy_coef * entropy.mean()
    return loss, torch.stack([surrogate, value_loss, entropy.mean()]).detach()


def flatten_rollout(buf: Rollout, advantages: torch.Tensor, returns: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rollout as one batch of T * N samples, for drawing mini-batches."""
    names = ("actor_obs", "critic_obs", "actions", "log_probs", "means", "stds", "values")
    return {
        **{n: getattr(buf, n).flatten(0, 1) for n in names},
        "advantages": advantages.flatten(),
        "returns": returns.flatten(),
    }


def ppo_minibatch_loss(
    actor: nn.Module, critic: nn.Module, batch: dict[str, torch.Tensor], idx: torch.Tensor, args: PPOArgs,
    loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """PPO loss of the samples `idx` of a flattened rollout -> (loss, mean KL(old || new), [surrogate,
    value, entropy]). Local: no communication. `loss_fn` replaces `ppo_loss` (a compiled one, say)."""
    mean, std = actor(batch["actor_obs"][idx])
    log_probs = gaussian_log_prob(batch["actions"][idx], mean, std)
    entropy = (0.5 + 0.5 * math.log(2 * math.pi) + std.log()).sum(-1)
    values = critic(batch["critic_obs"][idx])
    kl = gaussian_kl(batch["means"][idx], batch["stds"][idx], mean.detach(), std.detach()).mean()
    loss, stats = (loss_fn or ppo_loss)(
        log_probs, batch["log_probs"][idx], batch["advantages"][idx], values, batch["values"][idx],
        batch["returns"][idx], entropy, args.clip, args.value_coef, args.entropy_coef, args.clip_value_loss,
    )  # fmt: skip
    return loss, kl, stats


# ---------------------------------------------------------------------------------------------
# Logging (rank 0 only)
# ---------------------------------------------------------------------------------------------


def default_run_dir(script: str, task: str) -> str:
    """`runs/{script}_{task}/{timestamp}`: a fresh directory per run, so nothing is overwritten."""
    name = task.replace(":", "_").replace("/", "_").replace(".", "_")
    return os.path.join("runs", f"{script}_{name}", time.strftime("%Y-%m-%d_%H-%M-%S"))


def open_tensorboard(run_dir: str, purge_step: int | None = None) -> Any:
    """A TensorBoard SummaryWriter when `tensorboard` is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(run_dir, purge_step=purge_step)


def log_metrics(run_dir: str, metrics: dict[str, Any], writer: Any, total_iterations: int) -> None:
    """Append one line to `metrics.jsonl`, write TensorBoard scalars, print one console line."""
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    it = metrics["iteration"]
    if writer is not None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and key != "iteration":
                writer.add_scalar(key, value, it)
    shown = [f"it {it}/{total_iterations}", f"steps {metrics['env_steps']:.3g}", f"fps {metrics['fps']:.0f}"]
    for key, value in metrics.items():
        if key not in ("iteration", "env_steps", "fps", "time_s", "world_size") and isinstance(value, float):
            shown.append(f"{key} {value:.4g}")
    eta = metrics["time_s"] / max(1, it - metrics.get("first_iteration", 1) + 1) * (total_iterations - it)
    shown.append(f"eta {eta:.0f}s")
    print(" | ".join(shown), flush=True)


@dataclass
class RunArgs:
    """The arguments every script shares: sizes per process, seeds, device, run directory, checks.

    Each script's `Args` adds its algorithm's fields to these.
    """

    num_envs: int = 256
    """Environments per process; the global batch grows with the number of processes."""
    steps_per_env: int = 32
    """Rollout length per iteration (rsl_rl's num_steps_per_env)."""
    init_at_random_ep_len: bool = True
    """Start each env at a random point of its time limit, so that envs do not all reset at the same
    step and every rollout mixes all phases of an episode (Isaac Lab's training default)."""
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
    """Checkpoint file or run directory to continue from."""
    check_interval: int = 50
    """Every this many iterations, compare a hash of the trained state across ranks (0: never)."""
    dist_timeout_s: float = 60.0
    """Seconds a collective may wait for a lost rank before the job fails."""


@dataclass
class PPOArgs(RunArgs):
    """The PPO hyperparameters of ppo_ddp.py and ppo_amp_ddp.py, with rsl_rl's defaults."""

    iterations: int = 250
    """Total learning iterations; a resumed run continues up to this number."""
    actor_obs: str = "policy"
    """Observation group fed to the actor."""
    critic_obs: str = "critic"
    """Observation group fed to the critic; falls back to `actor_obs` when the env has none."""
    actor_hidden: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the actor MLP (ELU activations)."""
    critic_hidden: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the critic MLP (ELU activations)."""
    init_noise_std: float = 1.0
    """Initial standard deviation of the Gaussian policy."""
    normalize_obs: bool = True
    """Normalize actor and critic inputs with running statistics merged across ranks."""
    epochs: int = 5
    """PPO epochs over each rollout."""
    mini_batches: int = 4
    """Mini-batches per epoch; each is one optimizer step and ONE gradient all_reduce."""
    clip: float = 0.2
    """PPO ratio clip, also the value clip."""
    gamma: float = 0.99
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    value_coef: float = 1.0
    """Weight of the value loss."""
    clip_value_loss: bool = True
    """Clip the value loss around the rollout's values, as rsl_rl does."""
    entropy_coef: float = 0.01
    """Weight of the entropy bonus."""
    learning_rate: float = 1e-3
    """Initial Adam learning rate of actor and critic."""
    schedule: Literal["adaptive", "fixed"] = "adaptive"
    """`adaptive` (KL-driven, rsl_rl's rule; the KL rides in the gradient all_reduce) or `fixed`."""
    desired_kl: float = 0.01
    """Target KL for the adaptive schedule."""
    max_grad_norm: float = 1.0
    """Gradient clipping of actor and critic, after the all_reduce so every rank clips the same gradient."""


def check_args(args: RunArgs, at_least_one: tuple[str, ...], mini_batches: int | None = None) -> None:
    """Raise a ValueError naming the argument when one of `at_least_one` is below 1, or when the
    rollout does not split into `mini_batches` equal mini-batches. Local: no communication."""
    low = [f"{name} = {getattr(args, name)}" for name in at_least_one if getattr(args, name) < 1]
    if low:
        raise ValueError(f"{', '.join(low)}: must be at least 1.")
    if mini_batches is not None and (args.num_envs * args.steps_per_env) % mini_batches:
        raise ValueError(
            f"num_envs * steps_per_env = {args.num_envs * args.steps_per_env} is not divisible by mini_batches = {mini_batches}; change one of them."
        )


def resolve_run_dir(args: RunArgs, script: str, task: str) -> str:
    """`--run-dir`, else the directory of the resumed checkpoint, else a fresh `default_run_dir`."""
    if args.run_dir:
        return args.run_dir
    return os.path.dirname(resolve_checkpoint(args.resume)) if args.resume else default_run_dir(script, task)


@dataclass
class Run:
    """Bookkeeping of one training run: where rank 0 writes, the counters, the stop request."""

    dir: str
    first_iteration: int
    total_iterations: int
    env_steps: int
    stop_requested: Callable[[], bool]
    writer: Any = None
    start_time: float = 0.0
    last_return: float | None = None  # over the latest iteration in which episodes finished
    last_length: float | None = None
    log_keys: list[str] | None = None  # the env log scalars, fixed at the first iteration


def rank_seed(seed: int, rank: int, first_iteration: int) -> int:
    """`seed + rank` for a fresh run; a resumed run moves on with the iteration, so that it does not
    replay the random numbers of the first run."""
    return seed + rank + 1_000_003 * (first_iteration - 1)


def make_rank_env(task: str, args: RunArgs, ctx: Dist, first_iteration: int) -> tuple[VecEnv, int]:
    """Seed torch with this rank's seed (`rank_seed`), build the env with it, and spread the episode
    starts when `args.init_at_random_ep_len`. Local: no communication. Returns (env, seed)."""
    seed = rank_seed(args.seed, ctx.rank, first_iteration)
    torch.manual_seed(seed)
    env = make_env(task, args.num_envs, ctx.device, seed)
    if args.init_at_random_ep_len:
        env.episode_length_buf = torch.randint_like(env.episode_length_buf, high=int(env.max_episode_length))
    return env, seed


def start_run(ctx: Dist, run_dir: str, first_iteration: int, total_iterations: int, env_steps: int, banner: str) -> Run:
    """Check that rank 0 can write `run_dir` (a collective), open TensorBoard, catch SIGTERM/SIGINT."""
    # SYNC: only rank 0 writes, but every rank must stop if it cannot.
    prepare_run_dir(ctx, run_dir)
    run = Run(run_dir, first_iteration, total_iterations, env_steps, install_stop_handler(), start_time=time.time())
    if ctx.is_main:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        if first_iteration > 1 and os.path.exists(metrics):
            # Resuming after an unclean stop: drop the rows logged after the checkpoint we resume from.
            with open(metrics) as f:
                kept = [line for line in f if json.loads(line)["iteration"] < first_iteration]
            _atomic_write(metrics, lambda f: f.write("".join(kept).encode()))
        run.writer = open_tensorboard(run_dir, purge_step=first_iteration)
        print(f"{banner}; run dir {run_dir}", flush=True)
    return run


def end_iteration(
    ctx: Dist,
    run: Run,
    it: int,
    episodes: Episodes,
    env_logs: dict[str, torch.Tensor],
    steps: int,
    timings: dict[str, float],
    metrics: dict[str, float],
) -> bool:
    """Reduce the iteration's statistics over ranks, log them on rank 0; return whether to stop.

    One all_reduce carries the finished episodes' sums, the env's log scalars and every rank's stop
    request: deciding on the reduced flag makes all ranks leave at the same iteration.
    """
    if run.log_keys is None:
        # The all_reduce below needs the same layout on every rank: take the union of the keys the
        # ranks log now (one all_gather, first iteration only); a key a rank lacks counts as 0 there.
        gathered = [None] * ctx.world_size
        if ctx.world_size > 1:
            dist.all_gather_object(gathered, sorted(env_logs))
        run.log_keys = sorted(set().union(*gathered)) if ctx.world_size > 1 else sorted(env_logs)
    zero = torch.zeros((), device=ctx.device)
    logs = [
        torch.as_tensor(env_logs.get(k, zero), dtype=torch.float32, device=ctx.device).reshape(1) for k in run.log_keys
    ]
    stop = torch.tensor([float(run.stop_requested())], device=ctx.device)
    reduced = all_reduce_sum(torch.cat([episodes.finished, *logs, stop]), ctx.world_size).tolist()
    keys = run.log_keys
    episodes.finished.zero_()
    if reduced[2] > 0:
        run.last_return, run.last_length = reduced[0] / reduced[2], reduced[1] / reduced[2]
    run.env_steps += steps
    if ctx.is_main:
        row = {
            "iteration": it,
            "env_steps": run.env_steps,
            "fps": steps / sum(timings.values()),
            "episode_return": run.last_return,
            "episode_length": run.last_length,
            "episodes_finished": int(reduced[2]),
            **metrics,
            **{k: reduced[3 + i] / ctx.world_size for i, k in enumerate(keys)},
            **timings,
            "time_s": time.time() - run.start_time,
            "world_size": ctx.world_size,
            "first_iteration": run.first_iteration,
        }
        log_metrics(run.dir, row, run.writer, run.total_iterations)
    if reduced[-1] > 0 and ctx.is_main:
        print(f"stop signal received: stopping after iteration {it}; resume with --resume {run.dir}", flush=True)
    return reduced[-1] > 0


def is_save_iteration(it: int, run: Run, save_interval: int, stop: bool) -> bool:
    """Checkpoint every `save_interval` iterations, at the last one, and when asked to stop."""
    return it % save_interval == 0 or it == run.total_iterations or stop


def check_and_save(
    ctx: Dist, run: Run, it: int, stop: bool, args: RunArgs, kind: str, modules: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer], extra: dict[str, Any],
) -> None:  # fmt: skip
    """The end of every iteration after `end_iteration`: every `args.check_interval` iterations, compare
    the trained state across ranks; on checkpoint iterations (`is_save_iteration`), rank 0 writes
    `checkpoint_state(kind, modules, optimizers, args, iteration=it, env_steps=run.env_steps, **extra)`.
    Every rank must call it."""
    if args.check_interval and it % args.check_interval == 0:
        # SYNC: a cheap guard against silent divergence: every rank must hold the same bits (1 all_gather).
        check_state_consistent(ctx, it, [*modules.values()], [*optimizers.values()])
    if is_save_iteration(it, run, args.save_interval, stop):
        # SYNC: rank 0 writes; all ranks learn whether it worked (1 all_gather).
        extra = {"iteration": it, "env_steps": run.env_steps, **extra}
        state = checkpoint_state(kind, modules, optimizers, args, **extra) if ctx.is_main else None
        save_on_rank0(ctx, run.dir, it, state, args.keep_checkpoints)


def check_state_consistent(
    ctx: Dist, it: int, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> None:
    """Raise on every rank if any rank's trained state differs from rank 0's. One all_gather."""
    fingerprint = state_fingerprint(trained_tensors(modules, optimizers))
    check_same_on_all_ranks(
        ctx, f"the trained state at iteration {it}", fingerprint, "ranks drifted apart; report this as a bug"
    )


def check_resumed_state(
    path: str, checkpoint: dict[str, Any], modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> None:
    """Raise if the loaded state does not hash to what the checkpoint recorded when it was saved."""
    if state_fingerprint(trained_tensors(modules, optimizers)) != checkpoint.get("fingerprint"):
        raise ValueError(f"checkpoint {path!r} does not reproduce the state it was saved from; it is damaged.")


def checkpoint_state(
    kind: str, modules: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], args: RunArgs,
    **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """Everything a resume needs, as tensors, numbers, strings and plain containers only: the state
    of every module and optimizer under its name, `extra`, the args and the fingerprint of it all."""
    return {
        "kind": kind,
        **{name: module.state_dict() for name, module in modules.items()},
        **{name: optimizer.state_dict() for name, optimizer in optimizers.items()},
        **extra,
        "args": dataclasses.asdict(args),
        "fingerprint": state_fingerprint(trained_tensors([*modules.values()], [*optimizers.values()])),
    }


def restore_checkpoint(
    checkpoint: dict[str, Any], path: str, modules: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]
) -> None:
    """Load `checkpoint_state`'s entries back (the learning rates are in the optimizers' param groups)
    and check that they reproduce the saved fingerprint. Local: no communication."""
    try:
        for name, module in modules.items():
            module.load_state_dict(checkpoint[name])
    except RuntimeError as error:
        raise ValueError(f"checkpoint {path!r} does not fit this task and network: {error}") from error
    for name, optimizer in optimizers.items():
        lrs = [group["lr"] for group in optimizer.param_groups]
        optimizer.load_state_dict(checkpoint[name])
        for group, lr in zip(optimizer.param_groups, lrs):
            if torch.is_tensor(lr):  # keep a tensor lr a tensor, on its device and in its dtype (make_adam)
                group["lr"] = torch.tensor(float(group["lr"]), dtype=lr.dtype, device=lr.device)
    check_resumed_state(path, checkpoint, [*modules.values()], [*optimizers.values()])


# ---------------------------------------------------------------------------------------------
# Checkpoints (rank 0 writes, every rank reads the same file)
# ---------------------------------------------------------------------------------------------


def save_checkpoint(run_dir: str, iteration: int, state: dict[str, Any], keep: int = 5) -> str:
    """Write `model_{iteration}.pt` atomically, point `latest` at it, keep the newest `keep`.

    Temp file, flush, fsync, rename: a crash at any moment leaves the previous checkpoint whole.
    """
    for stale in (f for f in os.listdir(run_dir) if ".tmp-" in f):  # left by a killed run
        os.remove(os.path.join(run_dir, stale))
    name = f"model_{iteration}.pt"
    path = os.path.join(run_dir, name)
    _atomic_write(path, lambda f: torch.save(state, f))
    _atomic_write(os.path.join(run_dir, "latest"), lambda f: f.write(name.encode()))
    saved = sorted((f for f in os.listdir(run_dir) if re.fullmatch(r"model_\d+\.pt", f)), key=lambda f: int(f[6:-3]))
    for old in saved[: max(0, len(saved) - keep)]:
        os.remove(os.path.join(run_dir, old))
    return path


def save_on_rank0(ctx: Dist, run_dir: str, iteration: int, state: dict[str, Any] | None, keep: int) -> None:
    """Rank 0 saves a checkpoint; every rank learns whether that worked (one all_gather), so a failed
    write stops all ranks together instead of leaving them waiting for rank 0."""
    error = ""
    if ctx.is_main:
        try:
            save_checkpoint(run_dir, iteration, state, keep)
        except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
            error = f"{type(e).__name__}: {e}"
    if all_gather_ints(ctx, [int(bool(error))])[0][0]:
        raise OSError(
            f"rank 0 could not write the checkpoint of iteration {iteration} in {run_dir!r} ({error or 'see rank 0'}); the previous checkpoints are intact."
        )


def _atomic_write(path: str, write: Callable[[Any], Any]) -> None:
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


RESUME_KEYS = ("iteration", "env_steps", "fingerprint")  # what a resume needs besides the state dicts


def load_checkpoint(path: str, kind: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load a checkpoint without running code (`weights_only=True`); check its kind and `required` keys."""
    path = resolve_checkpoint(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file gets the same advice
        raise ValueError(
            f"cannot read checkpoint {path!r} ({error}); it is damaged or not a checkpoint of these scripts."
        ) from error
    if not isinstance(state, dict) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"checkpoint {path!r} is not a {kind!r} checkpoint (found {found!r}); pass one written by the matching script."
        )
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {missing}: it was not written by this script.")
    return state


# ---------------------------------------------------------------------------------------------
# Preemption
# ---------------------------------------------------------------------------------------------


def install_stop_handler() -> Callable[[], bool]:
    """Turn SIGTERM/SIGINT into a flag, read at iteration boundaries; returns the flag reader.

    A second signal is not caught: it acts as usual (a rank stuck in a collective can still be stopped).
    """
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        received.append(signum)
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return lambda: bool(received)
