"""Data-parallel PPO with Adversarial Motion Priors (Peng et al. 2021) in one file, as it runs.

ppo_ddp.py's loop, copied, with a discriminator D(s, s') that tells reference transitions (+1) from
the policy's (-1); its score is a style reward. Every rank trains D, so D is synced as actor and
critic are (rsl_rl's design forgets it): broadcast, the SAME all_reduce, its normalizer merged.

Launch:
    python ppo_amp_ddp.py                                              # 1 process
    torchrun --standalone --nproc_per_node=2 ppo_amp_ddp.py            # 2 processes on CPU (gloo)
    torchrun --standalone --nproc_per_node=8 ppo_amp_ddp.py --device cuda   # 8 GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 ppo_amp_ddp.py \\
        --resume runs/ppo_amp_pendulum/<time> --iterations 1000        # continue up to 1000
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

import arguments
import bookkeeping
import checkpoints
import common
import envs
import launch
import networks
import speedups
from arguments import Count, Fraction, NonNegative, Options, Positive, Widths, options
from envs import Episodes, VecEnv, motions
from networks import Actor, Critic  # the PPO actor and critic, as ppo_ddp.py trains them


@dataclass
class Args:
    """PPO (rsl_rl's defaults) with a discriminator; sizes are per process."""

    task: str = "pendulum"  # Built-in task or your `module:function`, with an AMP group.
    num_envs: Count = 256  # Environments per process: the global batch grows with the processes.
    iterations: Count = 500  # Total learning iterations (PPO's 250 are too few for the game).
    seed: int = 1  # Base seed; rank r uses seed + r (moved on by the iteration when resuming).
    device: str = "auto"
    """`auto` (cuda:LOCAL_RANK if there is a GPU, else cpu), `cpu`, `cuda` (cuda:LOCAL_RANK: one GPU
    per process) or `cuda:N` (GPU N, for a single process)."""
    run_dir: str | None = None
    """Rank 0's metrics, checkpoints; default runs/<script>_<task>/<time>, or the resumed run's."""
    resume: str | None = None
    """Checkpoint file or run directory to continue from; `auto`: the `--run-dir`'s newest
    checkpoint, or a fresh start where it has none (what `torchrun --max-restarts` needs)."""
    logger: Literal["tensorboard", "wandb", "neptune", "none"] = "tensorboard"
    """Where rank 0 logs besides metrics.jsonl (always written), under rsl_rl's metric names; W&B
    and Neptune take other settings from the environment (WANDB_MODE=offline, NEPTUNE_MODE...)."""
    steps_per_env: Count = 32  # Rollout length per iteration (rsl_rl's num_steps_per_env).
    init_at_random_ep_len: bool = True  # Start each env at a random point of its time limit.
    actor_obs: tuple[str, ...] = ("policy",)  # Observation groups the actor reads (flat ones).
    critic_obs: tuple[str, ...] = ("critic",)  # The critic's; the actor's where the env lacks them.
    actor_hidden: Widths = (64, 64)  # Hidden layer widths of the actor MLP.
    critic_hidden: Widths = (64, 64)  # Hidden layer widths of the critic MLP.
    activation: Literal["elu", "tanh"] = "elu"  # rsl_rl's (torch's init) or CleanRL's (orthogonal).
    init_noise_std: Positive = 1.0  # Initial standard deviation of the Gaussian policy.
    std_type: Literal["log", "scalar"] = "log"  # Learn the std's log, or the std (rsl_rl's).
    normalize_obs: bool = True  # Normalize the networks' inputs with statistics of every rank.
    epochs: Count = 5  # PPO epochs over each rollout.
    mini_batches: Count = 4  # Mini-batches per epoch: each one optimizer step and ONE all_reduce.
    shuffle: Literal["once", "every-epoch"] = "once"  # One permutation per update, or per epoch.
    clip: Positive = 0.2  # PPO ratio clip, also the value clip.
    gamma: Fraction = 0.99  # Discount factor.
    lam: Fraction = 0.95  # GAE lambda.
    value_coef: NonNegative = 1.0  # Weight of the value loss.
    clip_value_loss: bool = True  # Clip the value loss around the rollout's values, as rsl_rl does.
    entropy_coef: NonNegative = 0.01  # Weight of the entropy bonus.
    learning_rate: Positive = 1e-3  # Initial Adam learning rate of actor and critic.
    schedule: Literal["adaptive", "fixed", "linear"] = "adaptive"  # rsl_rl's KL rule, or CleanRL's.
    desired_kl: Positive = 0.01  # Target KL of the adaptive schedule.
    max_grad_norm: Positive = 1.0  # Gradient clipping, after the all_reduce: alike on every rank.
    grad_clip: Literal["per-network", "joint"] = "per-network"  # Each network's (rsl_rl), or one.
    motion_file: str = "data/pendulum_ccw_motions.npz"  # Reference motions (envs/motions.py).
    amp_obs: str = "amp"  # Observation group the discriminator sees; `policy` where there is none.
    task_weight: NonNegative = 0.005
    """Weight of the task reward in `task_weight * task + style_weight * style` (docs/amp.md: why
    the pendulum's is 200 times below the style's)."""
    style_weight: NonNegative = 1.0  # Weight of the style reward, which is in [0, 1] per step.
    disc_hidden: Widths = (128, 128)  # Hidden layer widths of the discriminator (ReLU).
    disc_learning_rate: Positive = 5e-4  # Adam learning rate of the discriminator (fixed).
    disc_batch_size: Count = 512  # Reference and policy pairs (each) per rank in a D mini-batch.
    gp_weight: NonNegative = 10.0
    """w_gp of the AMP paper: D minimizes E_ref[(D - 1)^2] + E_policy[(D + 1)^2] + w_gp / 2
    E_ref[|grad D|^2] (the code halves that whole objective: the penalty's factor is w_gp / 4)."""
    disc_max_grad_norm: Positive = 1.0  # Gradient clipping of D, after the all_reduce.
    replay_size: Count = 100_000  # Policy transitions kept per rank for D (not checkpointed).
    speed: Annotated[speedups.SpeedArgs, Options] = options(speedups.SpeedArgs)
    run: Annotated[arguments.RunArgs, Options] = options(arguments.RunArgs)
    dist: Annotated[arguments.DistArgs, Options] = options(arguments.DistArgs)


# --- Networks: ppo_ddp.py's actor and critic, and the discriminator -------------------------------
def make_networks(obs: Mapping[str, Tensor], num_actions: int, args: Args) -> tuple[Actor, Critic]:
    """Actor and critic on the `--actor-obs` and `--critic-obs` groups (rsl_rl's fallback)."""
    a_groups = envs.resolve_groups(obs, args.actor_obs, flag="--actor-obs")
    both = "--actor-obs and --critic-obs"
    c_groups = envs.resolve_groups(obs, args.critic_obs, args.actor_obs, both)
    a_shapes, c_shapes = envs.group_shapes(obs, a_groups), envs.group_shapes(obs, c_groups)
    norm, act = args.normalize_obs, args.activation
    std, std_type = args.init_noise_std, args.std_type
    actor = Actor(a_shapes, num_actions, args.actor_hidden, std, norm, std_type, act)
    return actor, Critic(c_shapes, args.critic_hidden, norm, act)


class Discriminator(nn.Module):
    """D(s, s'): each frame normalized with running statistics, then an MLP on the pair -> score."""

    def __init__(self, amp_dim: int, hidden: Sequence[int]) -> None:
        super().__init__()
        self.config = networks.config_of(locals())
        self.normalizer = common.EmpiricalNormalizer(amp_dim)
        self.net = networks.mlp(2 * amp_dim, tuple(hidden), 1, nn.ReLU)

    def forward(self, pairs: Tensor) -> Tensor:
        """Raw pairs (..., 2 amp_dim) -> scores: near +1 for reference-like, -1 for the policy's."""
        return self.net(self.normalize(pairs)).squeeze(-1)

    def normalize(self, pairs: Tensor) -> Tensor:
        s, s_next = pairs.chunk(2, dim=-1)
        return torch.cat([self.normalizer(s), self.normalizer(s_next)], -1)


def gaussian_log_prob(actions: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    squared = -((actions - mean) ** 2) / (2 * std**2)
    return (squared - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)


# --- The policy's transitions, and the discriminator's loss --------------------------------------
def transition_pairs(frames: Tensor, dones: Tensor) -> Tensor:
    """(s_t, s_t+1) of AMP frames (T + 1, N, d) -> (M, 2d), without each t with dones[t]: there
    `frames[t + 1]` is the next episode's first frame, a pair that never happened."""
    pairs = torch.cat([frames[:-1], frames[1:]], -1)
    return pairs[dones == 0]


@dataclass
class Replay:
    """Ring buffer of this rank's policy transitions (capacity, 2 amp_dim): local."""

    pairs: Tensor
    size: int = 0
    position: int = 0


def replay_add(replay: Replay, pairs: Tensor) -> None:
    capacity = replay.pairs.shape[0]
    pairs = pairs[-capacity:]
    index = (replay.position + torch.arange(pairs.shape[0], device=pairs.device)) % capacity
    replay.pairs[index] = pairs
    replay.position = (replay.position + pairs.shape[0]) % capacity
    replay.size = min(capacity, replay.size + pairs.shape[0])


def load_motions(obs: Mapping[str, Tensor], env: VecEnv, args: Args, device: torch.device) -> tuple:
    """-> (`--amp-obs`, the group D reads; `--motion-file`'s transitions (M, 2 amp_dim)). Local."""
    (amp_group,) = envs.resolve_groups(obs, (args.amp_obs,), ("policy",), "--amp-obs")
    amp_dim = obs[amp_group].shape[-1]
    return amp_group, motions.load(args.motion_file, amp_dim, envs.step_dt(env)).to(device)


def check_replay(ctx: common.Dist, replay: Replay) -> None:
    """Stop every rank if a rank's replay holds no transition. 1 all_gather."""
    sizes = common.all_gather_ints(ctx, [replay.size])
    if empty := [rank for rank, (size,) in enumerate(sizes) if not size]:
        raise common.Failure(
            f"rank(s) {empty} collected no policy transition: every step of the rollout ended an "
            "episode; AMP needs episodes of 2 steps or more: check the env's terminations."
        )


@torch.inference_mode()
def rate_steps(disc: Discriminator, frames: Tensor, dones: Tensor, logs: dict) -> Tensor:
    """D's style reward (T, N) of frames (T + 1, N, d), 0 after a done; its mean into `logs`."""
    pairs = torch.cat([frames[:-1], frames[1:]], -1)
    style = style_reward(disc(pairs)) * (1 - dones)
    logs["style_reward"] = style.sum() / (1 - dones).sum().clamp(min=1)
    return style


def style_reward(scores: Tensor) -> Tensor:
    return (1 - 0.25 * (scores - 1) ** 2).clamp(min=0)


# --compile leaves it eager: the gradient penalty differentiates through D twice (create_graph).
@torch.compiler.disable
def discriminator_loss(
    disc: Discriminator, reference: Tensor, policy: Tensor, gp_weight: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """D's least-squares GAN loss (+1 reference, -1 policy), gradient penalty -> (loss, stats)."""
    ref_in = disc.normalize(reference).requires_grad_(True)
    ref_scores, policy_scores = disc.net(ref_in).squeeze(-1), disc(policy)
    lsgan = 0.5 * (((ref_scores - 1) ** 2).mean() + ((policy_scores + 1) ** 2).mean())
    (grad,) = torch.autograd.grad(ref_scores.sum(), ref_in, create_graph=True)
    penalty = grad.pow(2).sum(-1).mean()
    stats = {"disc_loss": lsgan, "grad_penalty": penalty}
    stats |= {"disc_ref": ref_scores.mean(), "disc_policy": policy_scores.mean()}
    loss = lsgan + 0.25 * gp_weight * penalty  # the paper's lsgan halved: w_gp / 4, not w_gp / 2
    return loss, {name: value.detach() for name, value in stats.items()}


# --- Rollout: local to each rank, no communication (ppo_ddp.py's) ---------------------------------
@dataclass
class Rollout:
    """One rollout of every env, each tensor (T, N, ...), allocated once."""

    obs: dict[str, Tensor]  # observation group -> (T, N, *shape): every group a network reads
    actions: Tensor
    log_probs: Tensor
    means: Tensor
    stds: Tensor
    values: Tensor
    rewards: Tensor  # as the env gave them
    dones: Tensor  # 1.0 where the step ended an episode (terminated or timed out)
    time_outs: Tensor  # 1.0 where the step ended an episode by the time limit
    advantages: Tensor  # written after the rollout, read by the update
    returns: Tensor


def make_rollout(
    steps: int, num_envs: int, shapes: dict[str, list[int]], actions: int, device: torch.device
) -> Rollout:
    """Rollout storage, outside inference mode, so that the update can backprop from it."""
    zeros = functools.partial(torch.zeros, steps, num_envs, device=device)  # zeros(*shape)
    obs, a = {group: zeros(*shape) for group, shape in shapes.items()}, actions
    return Rollout(obs, zeros(a), zeros(), zeros(a), zeros(a), *(zeros() for _ in range(6)))


def act(actor: Actor, critic: Critic, obs: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
    """The policy's step -> (actions, their log-probability, mean, std, the critic's value)."""
    mean, std = actor(obs)
    actions = mean + std * torch.randn_like(mean)
    return actions, gaussian_log_prob(actions, mean, std), mean, std, critic(obs)


@torch.inference_mode()
def rollout(
    env: VecEnv, policy: Callable, obs: Mapping, buf: Rollout, episodes: Episodes, args: Args
) -> tuple[Mapping[str, Tensor], dict[str, Tensor], str]:
    """Step the env `steps_per_env` times -> (next obs, its logs, "" or why the rollout stopped)."""
    logs: dict[str, Tensor] = {}
    for t in range(args.steps_per_env):
        for group, stored in buf.obs.items():
            if obs[group].shape != stored.shape[1:]:  # every rank hears of it after the rollout
                was, now = list(stored.shape[2:]), list(obs[group].shape[1:])
                problem = f"observation group {group!r} changed shape from {was} to {now}"
                return obs, logs, f"{problem} at step {t + 1} of {args.steps_per_env}"
            stored[t] = obs[group]
        outputs = policy({group: stored[t] for group, stored in buf.obs.items()})
        buf.actions[t], buf.log_probs[t], buf.means[t], buf.stds[t], buf.values[t] = outputs
        obs, rewards, dones, extras = env.step(buf.actions[t])
        buf.rewards[t], buf.dones[t] = rewards, dones
        buf.time_outs[t] = extras.get("time_outs", torch.zeros_like(dones))
        envs.track_episodes(episodes, rewards, buf.dones[t])
        envs.accumulate_logs(logs, extras, buf.rewards.device)
    return obs, logs, ""


def compute_gae(
    rewards: Tensor, values: Tensor, dones: Tensor, last_values: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE over (T, N) -> (advantages, returns); `dones[t]` cuts bootstrap and recursion after t."""
    advantages = torch.zeros_like(rewards)
    next_advantage, next_values = torch.zeros_like(last_values), last_values
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t].to(rewards.dtype)
        # TD error r + gamma V(s') - V(s); A_t = delta_t + gamma lambda A_t+1; both cut at a done
        delta = rewards[t] + gamma * next_values * not_done - values[t]
        next_advantage = delta + gamma * lam * not_done * next_advantage
        advantages[t] = next_advantage
        next_values = values[t]
    return advantages, advantages + values


def normalize_advantages(
    advantages: Tensor, returns: Tensor, world_size: int, eps: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """Normalize with ALL ranks' mean and std: N ranks x E envs update as 1 x N*E. 1 all_reduce."""
    a, r = advantages.to(torch.float64), returns.to(torch.float64)
    count = torch.tensor(a.numel(), dtype=torch.float64, device=a.device)
    sums = torch.stack([a.sum(), (a * a).sum(), count, r.sum(), (r * r).sum()])
    total, total_sq, count, r_total, r_total_sq = common.all_reduce_sum(sums, world_size)
    mean = total / count
    std = ((total_sq - count * mean * mean) / (count - 1).clamp(min=1)).clamp(min=0).sqrt()
    r_var = (r_total_sq - r_total * r_total / count) / (count - 1).clamp(min=1)
    return ((a - mean) / (std + eps)).to(advantages.dtype), 1 - std**2 / r_var


# --- Update: PPO's and the discriminator's, in the same steps -------------------------------------
def ppo_loss(
    actor: Callable[..., tuple[Tensor, Tensor]], critic: Callable[..., Tensor], mb: dict, args: Args
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO loss of one mini-batch -> (loss, its statistics by name, detached). Local."""
    mean, std = actor(mb["obs"])
    log_probs = gaussian_log_prob(mb["actions"], mean, std)
    values = critic(mb["obs"])
    entropy = (0.5 + 0.5 * math.log(2 * math.pi) + std.log()).sum(-1)
    # KL(old || new) of the diagonal Gaussians, rsl_rl's formula: what the adaptive lr reads.
    old_mean, old_std, new_mean, new_std = mb["means"], mb["stds"], mean.detach(), std.detach()
    spread = (old_std**2 + (old_mean - new_mean) ** 2) / (2.0 * new_std**2)
    kl = (torch.log(new_std / old_std) + spread - 0.5).sum(-1)
    ratio = torch.exp(log_probs - mb["log_probs"])
    advantages = mb["advantages"]
    clipped_ratio = ratio.clamp(1 - args.clip, 1 + args.clip)
    surrogate = torch.max(-advantages * ratio, -advantages * clipped_ratio).mean()
    value_loss = (values - mb["returns"]) ** 2
    if args.clip_value_loss:
        clipped = mb["values"] + (values - mb["values"]).clamp(-args.clip, args.clip)
        value_loss = torch.max(value_loss, (clipped - mb["returns"]) ** 2)
    value_loss = value_loss.mean()
    loss = surrogate + args.value_coef * value_loss - args.entropy_coef * entropy.mean()
    clipfrac = ((ratio.detach() - 1).abs() > args.clip).float().mean()  # CleanRL's: how often
    stats = {"kl": kl.mean(), "surrogate_loss": surrogate, "value_loss": value_loss}
    stats |= {"entropy": entropy.mean(), "clipfrac": clipfrac}
    return loss, {name: value.detach() for name, value in stats.items()}


def adaptive_lr(
    kl: Tensor, lr: Tensor, desired_kl: float, min_lr: float = 1e-5, max_lr: float = 1e-2
) -> Tensor:
    """rsl_rl's KL rule, on the device (no host sync), in `lr`'s dtype (float64: Python's bits)."""
    kl = kl.to(lr.dtype)
    grown = torch.where((kl > 0) & (kl < desired_kl / 2.0), (lr * 1.5).clamp(max=max_lr), lr)
    return torch.where(kl > desired_kl * 2.0, (lr / 1.5).clamp(min=min_lr), grown)


@torch.compiler.disable  # --compile, --cuda-graphs: the collective stays eager, between two graphs
def all_reduce_mean(flat: Tensor, world_size: int) -> None:
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size


def make_update(
    actor: Actor,
    critic: Critic,
    disc: Discriminator,
    optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    batch: dict[str, Any],
    reference: Tensor,
    replay: Replay,
    args: Args,
    ctx: common.Dist,
) -> Callable[[], dict[str, float]]:
    """`update()`, built once: epochs of steps of actor, critic and D -> means over ranks, steps."""
    optimizer, disc_optimizer = optimizers
    actor_params, critic_params = list(actor.parameters()), list(critic.parameters())
    disc_params = list(disc.parameters())
    synced = [*actor_params, *critic_params, *disc_params]  # every gradient the all_reduce averages
    clipped = {"actor_grad_norm": actor_params, "critic_grad_norm": critic_params}
    clipped = {"grad_norm": actor_params + critic_params} if args.grad_clip == "joint" else clipped
    bf16 = args.speed.mixed_precision == "bf16"  # autocast's casts not cached: CUDA graphs

    def minibatch_step(index: Tensor, ref_index: Tensor, policy_index: Tensor) -> dict[str, Tensor]:
        """PPO on the rows `index`, D on reference and this rank's replay pairs -> statistics."""
        mb = {name: rows[index] for name, rows in batch.items() if name != "obs"}
        mb["obs"] = {group: rows[index] for group, rows in batch["obs"].items()}
        with torch.autocast(ctx.device.type, torch.bfloat16, enabled=bf16, cache_enabled=False):
            loss, stats = ppo_loss(actor, critic, mb, args)
            pairs = (reference[ref_index], replay.pairs[policy_index])
            disc_loss, disc_stats = discriminator_loss(disc, *pairs, args.gp_weight)
            loss, stats = loss + disc_loss, {**stats, **disc_stats}
        optimizer.zero_grad(set_to_none=False)
        disc_optimizer.zero_grad(set_to_none=False)
        loss.backward()
        # SYNC: the mini-batch's one collective: every gradient, D's too, then the KL and loss
        # statistics, in one flat buffer averaged over ranks; copied back, all take the same step.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in synced]
        statistics = torch.stack([value.detach().float() for value in stats.values()])
        flat = torch.cat([*(grad.reshape(-1) for grad in grads), statistics])
        if ctx.world_size > 1:
            all_reduce_mean(flat, ctx.world_size)
        offset = 0
        for p in synced:
            grad = flat[offset : offset + p.numel()].view_as(p)
            p.grad = grad.clone() if p.grad is None else p.grad.copy_(grad)
            offset += p.numel()
        means = dict(zip(stats, flat[offset:]))
        if args.schedule == "adaptive":  # the same averaged KL on all ranks: one lr, no broadcast
            lr = optimizer.param_groups[0]["lr"]
            lr.copy_(adaptive_lr(means["kl"], lr, args.desired_kl))
        for name, params in clipped.items():  # clipped after the all_reduce: alike on every rank
            means[name] = nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        means["disc_grad_norm"] = nn.utils.clip_grad_norm_(disc_params, args.disc_max_grad_norm)
        disc_optimizer.step()
        return means

    step = minibatch_step
    if speedups.asked(args.speed, ctx.device):  # --compile, --cuda-graphs
        step = speedups.compiled(minibatch_step, args.speed, ctx.device)
    size, steps = batch["advantages"].shape[0], args.epochs * args.mini_batches
    draw = functools.partial(torch.randint, size=(args.disc_batch_size,), device=ctx.device)

    def update() -> dict[str, float]:
        sums: dict[str, Tensor] = {}  # on the device, read back once
        for epoch in range(args.epochs):
            if epoch == 0 or args.shuffle == "every-epoch":
                order = torch.randperm(size, device=ctx.device)
            for index in order.split(size // args.mini_batches)[: args.mini_batches]:
                # D's mini-batch: reference pairs, and pairs of the replay's filled part
                ref_index, policy_index = draw(0, reference.shape[0]), draw(0, replay.size)
                for name, value in step(index, ref_index, policy_index).items():
                    sums[name] = sums.get(name, 0) + value
        means = dict(zip(sums, (torch.stack(list(sums.values())) / steps).tolist()))
        common.check_update(means, "the environment, the motion file or the learning rate")
        return means

    return update


def main(args: Args) -> str:
    # SYNC: join torchrun's job as nanoGPT does; the finite timeout ends it when a rank is lost.
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank, d, start_group = int(os.environ.get("LOCAL_RANK", "0")), args.dist, None
    if world_size > 1:
        nccl = torch.cuda.is_available() and args.device.startswith(("auto", "cuda"))
        store = launch.attempt_store(rank, world_size, d.start_timeout_s)  # a restart's own store
        timeout = datetime.timedelta(seconds=d.dist_timeout_s)
        dist.init_process_group("nccl" if nccl else "gloo", timeout=timeout, **store)
        start_group = launch.start_group(rank, d.start_timeout_s)  # start-up's, a longer timeout
    try:
        device, problem = common.device_or_problem(args.device, local_rank, world_size)
        if device.type == "cuda":  # one GPU per process, cuda:{LOCAL_RANK}; auto: the CPU if none
            torch.cuda.set_device(device)
        launch.share_cores(local_rank, d.pin_cores and world_size > 1, device.type == "cpu")
        torch.manual_seed(args.seed + rank)  # the global rank: local ranks repeat on every node
        ctx = common.Dist(rank, world_size, device, rank == 0, start_group)
        common.agree(ctx, problem)  # SYNC: a rank without its device stops all (only it knows)
        fingerprint = train(args, ctx)
        if world_size > 1:  # SYNC: no rank leaves while another is still in its last collective
            dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
        return fingerprint
    finally:
        bookkeeping.let_go()  # the signal handlers put back, rank 0's run directory released
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: Args, ctx: common.Dist) -> str:
    """Train on this rank; -> the fingerprint of the final trained state (equal on every rank)."""
    problem, facts = None, None  # a failure waits for the start-up check: no rank hangs on another
    try:
        arguments.check_args(args)  # as the command line was checked; again for a caller of main
        speedups.check(args.speed, ctx.device, ctx.is_main)  # --compile inductor: a C++ compiler
        resume_from = checkpoints.resume_point(args, "ppo_amp", ctx.is_main)  # state None: fresh
        first = resume_from.first_iteration
        # seeds what is drawn from here on: env start times, network weights, action noise
        torch.manual_seed(seed := envs.rank_seed(args.seed, ctx.rank, first))
        steps_taken = args.steps_per_env * (first - 1)  # a curriculum's clock (envs/go1.py)
        env = envs.make_env(
            args.task, args.num_envs, ctx.device, seed, args.init_at_random_ep_len, steps_taken
        )
        obs = env.get_observations()
        actor, critic = (net.to(ctx.device) for net in make_networks(obs, env.num_actions, args))
        amp_group, reference = load_motions(obs, env, args, ctx.device)  # (M, 2 amp_dim) pairs
        disc = Discriminator(reference.shape[-1] // 2, args.disc_hidden).to(ctx.device)
        params = [*actor.parameters(), *critic.parameters()]
        optimizer = speedups.adam(params, args.learning_rate, args.speed, ctx.device)
        fused = speedups.fused_adam(args.speed, ctx.device)
        disc_optimizer = torch.optim.Adam(disc.parameters(), args.disc_learning_rate, fused=fused)
        trained = {"actor": actor, "critic": critic, "discriminator": disc}  # checkpointed
        trained |= {"optimizer": optimizer, "disc_optimizer": disc_optimizer}
        checkpoints.restore(resume_from, trained)  # a fresh start: nothing to restore
        groups = [*actor.inputs.shapes, *critic.inputs.shapes, amp_group]
        shapes = envs.group_shapes(obs, list(dict.fromkeys(groups)))  # every group stored, once
        same_motions = hashlib.sha256(reference.cpu().numpy().tobytes()).hexdigest()
        facts = (shapes, env.num_actions, same_motions, resume_from.fingerprint)
    except Exception as error:  # noqa: BLE001 - every rank hears of it at the check
        problem = error
    # SYNC: the start-up check (1 all_gather): a failed or differing rank stops all, in one line.
    common.agree(ctx, problem, facts, args)
    # SYNC: every rank starts from rank 0's weights and normalizer statistics, D's included.
    common.broadcast_state(trained.values(), ctx.world_size)
    title = f"PPO+AMP on {args.task} with {reference.shape[0]} reference transitions"
    run, problem = bookkeeping.start_run(ctx, args, "ppo_amp", trained, title, resume_from)
    common.agree(ctx, problem)  # SYNC: all stop if rank 0 could not take the run dir or logger
    buf = make_rollout(args.steps_per_env, args.num_envs, shapes, env.num_actions, ctx.device)
    fields = ("actions", "log_probs", "means", "stds", "values", "advantages", "returns")
    batch = {name: getattr(buf, name).flatten(0, 1) for name in fields}  # views: each new rollout
    batch["obs"] = {group: stored.flatten(0, 1) for group, stored in buf.obs.items()}
    episodes = envs.make_episodes(args.num_envs, ctx.device, env.episode_length_buf)
    replay = Replay(torch.zeros(args.replay_size, reference.shape[-1], device=ctx.device))
    policy_step = functools.partial(act, actor, critic)
    if speedups.asked(args.speed, ctx.device):  # --compile, --cuda-graphs (the update's step too)
        policy_step = speedups.compiled(policy_step, args.speed, ctx.device)
    optimizers = (optimizer, disc_optimizer)
    update = make_update(actor, critic, disc, optimizers, batch, reference, replay, args, ctx)
    for it in range(resume_from.first_iteration, args.iterations + 1):
        t0 = time.time()
        # COLLECT
        obs, logs, problem = rollout(env, policy_step, obs, buf, episodes, args)
        # SYNC: a changed shape or NaN/Inf on a rank stops every rank, naming it (1 all_reduce).
        common.check_rollout(ctx, problem, buf.obs, {"rewards": buf.rewards}, it)
        # STYLE: the rollout's transitions to the replay, and each step rated by D as it is now
        frames = torch.cat([buf.obs[amp_group], obs[amp_group][None]])  # (T + 1, N, amp_dim)
        replay_add(replay, transition_pairs(frames, buf.dones))
        if it == resume_from.first_iteration:  # SYNC: an empty replay stops all (1 all_gather)
            check_replay(ctx, replay)  # only the first rollout can leave a replay empty
        style = rate_steps(disc, frames, buf.dones, logs)
        logs["task_reward"] = sum(row.mean() * (1 / args.steps_per_env) for row in buf.rewards)
        # The rewards GAE sees: the weighted task reward, its time-outs' bootstrap (a time-out is
        # not a failure: the value of the state it cut off, as rsl_rl), the weighted style reward.
        rewards = args.task_weight * buf.rewards + args.gamma * buf.values * buf.time_outs
        rewards = rewards + args.style_weight * style
        # ADVANTAGES
        with torch.inference_mode():
            last = critic(obs)  # V of the states the rollout ended in
        advantages, returns = compute_gae(
            rewards, buf.values, buf.dones, last, args.gamma, args.lam
        )
        # SYNC: advantages normalized with the mean and std of all ranks' (1 all_reduce of 5 sums).
        advantages, explained = normalize_advantages(advantages, returns, ctx.world_size)
        logs["explained_variance"] = explained  # the same on every rank: logged as it is
        buf.advantages.copy_(advantages)
        buf.returns.copy_(returns)
        collect_s = time.time() - t0
        # UPDATE: one all_reduce per mini-batch, the discriminator's gradients in it
        if args.schedule == "linear":  # CleanRL's annealing to 0, the same on every rank
            lr = args.learning_rate * (1 - (it - 1) / args.iterations)
            optimizer.param_groups[0]["lr"].fill_(lr)
        losses = update()
        # SYNC: normalizer statistics, D's too, merged over every rank's rollout (1 all_gather for
        # all), after the update, so that the update normalized as its rollout did.
        normalized = common.normalizer_batches([actor, critic], buf.obs)
        normalized += [(disc.normalizer, buf.obs[amp_group])]
        common.update_normalizers(normalized, ctx.world_size)
        # LOG, CHECK, SAVE
        lr, update_s = float(optimizer.param_groups[0]["lr"]), time.time() - t0 - collect_s
        metrics = {"learning_rate": lr, **losses, "collect_s": collect_s, "update_s": update_s}
        # SYNC: every rank's finished episodes and env logs, and any stop request (1 all_reduce).
        stop_asked = run.stop_requested()
        logged, stop = common.reduce_logs(ctx, episodes.finished, logs, run.log_keys, stop_asked)
        if ctx.is_main:  # rank 0 alone writes: the row of metrics.jsonl, the console, the logger
            row = bookkeeping.metrics_row(run, it, {**logged, **metrics})
            with open(os.path.join(run.dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            print(bookkeeping.console_line(run, row, stop), flush=True)
            run.logger.write(bookkeeping.scalars(run, row), it)  # TensorBoard, W&B, Neptune
        # SYNC: every --check-interval iterations, the trained state's hash compared (1 all_gather).
        common.check_ranks_agree(ctx, it, args.dist.check_interval, trained)
        if bookkeeping.save_due(args, it, stop):
            problem = bookkeeping.save(run, it, lr) if ctx.is_main else None
            common.agree(ctx, problem)  # SYNC: all stop if rank 0 could not save (1 all_gather)
        if stop:
            break
    bookkeeping.finish_run(ctx, run)
    return common.fingerprint(trained)


if __name__ == "__main__":
    rank = int(os.environ.get("RANK", "0"))
    if rank:  # one command line for every rank: rank 0 alone prints --help, its errors, settings
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    try:
        args = arguments.parse_args(Args, envs.task_defaults)  # tyro.cli(Args); exits on --help
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        main(args)
    except BaseException as error:  # one line for an expected failure, and its exit code
        sys.exit(bookkeeping.exit_code(error, rank))
