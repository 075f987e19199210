"""Data-parallel recurrent PPO (rsl_rl 5.5.1's RNNModel) in one file, in the order it runs.

ppo_ddp.py's loop, copied, with a GRU or LSTM before the actor's and the critic's MLP. Each network
carries a memory from step to step and from rollout to rollout, blanked where an episode ends. The
update trains on whole env sequences: a mini-batch is a set of envs, and each network is unrolled
over its env's rollout from the memory it began the rollout with, blanked in place at every done, so
every step starts from the state it started from when the policy acted. rsl_rl 5.5.1 cuts the
rollout into padded, masked trajectories instead: the same mathematics (docs/rsl_rl.md, 15), but
here every shape is fixed, so a CUDA graph can replay the step. The sync is PPO's. The memory is
each rank's own (its envs'), neither broadcast nor checkpointed: a resumed run starts it at zero, as
rsl_rl does.

Launch:
    python ppo_rnn_ddp.py                                      # 1 process, a task that needs memory
    torchrun --standalone --nproc_per_node=2 ppo_rnn_ddp.py    # 2 processes on CPU (gloo)
    torchrun --standalone --nproc_per_node=2 ppo_rnn_ddp.py --rnn lstm --rnn-hidden 256
    torchrun --standalone --nproc_per_node=8 ppo_rnn_ddp.py --device cuda   # 8 GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 ppo_rnn_ddp.py \\
        --resume runs/ppo_rnn_pendulum_angle/<time> --iterations 500   # continue up to 500
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
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
from envs import Episodes, VecEnv
from networks import Actor, Critic  # the heads after the recurrent layer


@dataclass
class Args:
    """Recurrent PPO (rsl_rl's defaults); sizes are per process."""

    task: str = "pendulum_angle"
    """Built-in task or your `module:function`; `pendulum_angle` shows a noisy angle alone, so a
    policy must remember past frames to know the velocity."""
    rnn: Literal["gru", "lstm"] = "gru"
    """The recurrent layer before each MLP (rsl_rl's `rnn_type`)."""
    rnn_hidden: Count = 64  # Width of each recurrent layer (rsl_rl's `rnn_hidden_dim`, 256 there).
    rnn_layers: Count = 1  # Stacked recurrent layers (rsl_rl's `rnn_num_layers`).
    num_envs: Count = 256  # Environments per process: the global batch grows with the processes.
    iterations: Count = 250  # Total learning iterations; a resumed run continues up to this number.
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
    mini_batches: Count = 4  # Mini-batches of whole envs per epoch: each ONE all_reduce.
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
    speed: Annotated[speedups.SpeedArgs, Options] = options(speedups.SpeedArgs)
    run: Annotated[arguments.RunArgs, Options] = options(arguments.RunArgs)
    dist: Annotated[arguments.DistArgs, Options] = options(arguments.DistArgs)


# --- Networks: rsl_rl's RNNModel, inputs -> GRU or LSTM -> ppo_ddp.py's MLP -----------------------
class RNN(nn.Module):
    """A GRU or LSTM whose memory is one row per env, (batch, size): the state of each layer side by
    side; an LSTM's h of each layer, then c of each layer."""

    __constants__ = ["lstm"]  # TorchScript compiles only the branch this RNN takes

    def __init__(self, input_dim: int, rnn_type: str, hidden: int, layers: int) -> None:
        super().__init__()
        self.rnn = (nn.LSTM if rnn_type == "lstm" else nn.GRU)(input_dim, hidden, layers)
        self.lstm = rnn_type == "lstm"
        self.size = (2 if self.lstm else 1) * layers * hidden

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, dones: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each env's inputs (batch, T, dim) from its memory (batch, size) before the first of them;
        with `dones` (batch, T) the memory is blanked after every step that ended an episode, as the
        rollout does -> (outputs (batch, T, hidden), the memory after the last step)."""
        batch = x.shape[0]
        # torch's RNNs keep their state as (layers, batch, hidden), an LSTM's as the pair (h, c).
        state = memory.view(batch, -1, self.rnn.num_layers, self.rnn.hidden_size).permute(
            1, 2, 0, 3
        )
        h, c = state[0].contiguous(), state[-1].contiguous()  # c: the LSTM's cell state
        outputs = []
        for t in range(x.shape[1]):  # one step at a time, as the policy acted
            if self.lstm:
                output, (h, c) = self.rnn(x[:, t][None], (h, c))
            else:
                output, h = self.rnn(x[:, t][None], h)
            outputs.append(output[0])
            if dones is not None:
                keep = 1.0 - dones[:, t, None]
                h, c = h * keep, c * keep
        state = torch.stack([h, c]) if self.lstm else h[None]
        return torch.stack(outputs, 1), state.permute(2, 0, 1, 3).reshape(batch, -1)


class Recurrent(nn.Module):
    """rsl_rl's RNNModel: observation groups (flat ones) -> GRU or LSTM -> `head`, ppo_ddp.py's
    Actor (`head_config` its arguments but the groups) or, without `num_actions` in them, its
    Critic."""

    def __init__(
        self,
        obs_shapes: dict[str, list[int]],
        normalize: bool,
        rnn_type: str,
        rnn_hidden: int,
        rnn_layers: int,
        head_config: dict[str, Any],
    ) -> None:
        super().__init__()
        self.config = networks.config_of(locals())
        # The head's weights are drawn before the recurrent layer's, its parameters come after them.
        head_inputs = {"obs_shapes": {"memory": [rnn_hidden]}, "normalize": False}
        head = (Actor if "num_actions" in head_config else Critic)(**head_inputs, **head_config)
        self.inputs = networks.Inputs(obs_shapes, normalize)
        self.rnn = RNN(self.inputs.width, rnn_type, rnn_hidden, rnn_layers)
        self.head, self.memory_size = head, self.rnn.size

    def forward(
        self,
        obs: Mapping[str, torch.Tensor],
        memory: torch.Tensor,
        dones: torch.Tensor | None = None,
    ) -> tuple[Any, torch.Tensor]:
        """`RNN.forward` on the groups (batch, T, dim) -> (the head's outputs (batch, T, ...),
        memory)."""
        outputs, memory = self.rnn(self.inputs(obs), memory, dones)
        return self.head({"memory": outputs}), memory


def make_networks(obs: Mapping[str, Tensor], actions: int, args: Args) -> tuple[Recurrent, ...]:
    """Actor and critic, each its GRU or LSTM before its MLP, on the groups `--actor-obs` and
    `--critic-obs` name (rsl_rl's fallback). Local."""
    a_groups = envs.resolve_groups(obs, args.actor_obs, flag="--actor-obs")
    both = "--actor-obs and --critic-obs"
    c_groups = envs.resolve_groups(obs, args.critic_obs, args.actor_obs, both)
    rnn = (args.normalize_obs, args.rnn, args.rnn_hidden, args.rnn_layers)
    actor_head = {"num_actions": actions, "hidden": args.actor_hidden}
    actor_head |= {"init_std": args.init_noise_std, "std_type": args.std_type}
    actor_head |= {"activation": args.activation}
    critic_head = {"hidden": args.critic_hidden, "activation": args.activation}
    actor = Recurrent(envs.group_shapes(obs, a_groups), *rnn, actor_head)
    return actor, Recurrent(envs.group_shapes(obs, c_groups), *rnn, critic_head)


def gaussian_log_prob(actions: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    squared = -((actions - mean) ** 2) / (2 * std**2)
    return (squared - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)


# --- Rollout: local to each rank, no communication ------------------------------------------------
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


def act(
    actor: Recurrent,
    critic: Recurrent,
    obs: Mapping[str, Tensor],
    actor_memory: Tensor,
    critic_memory: Tensor,
) -> tuple[Tensor, ...]:
    """The policy's step, one step of each network -> (actions, their log-probability, mean, std,
    value, the actor's next memory, the critic's). Local."""
    one_step = {group: x[:, None] for group, x in obs.items()}  # sequences of one step (N, 1, dim)
    (mean, std), actor_memory = actor(one_step, actor_memory)
    values, critic_memory = critic(one_step, critic_memory)
    mean, std = mean[:, 0], std[:, 0]
    actions = mean + std * torch.randn_like(mean)
    log_prob = gaussian_log_prob(actions, mean, std)
    return actions, log_prob, mean, std, values[:, 0], actor_memory, critic_memory


@torch.inference_mode()
def rollout(
    env: VecEnv,
    policy: Callable,
    obs: Mapping,
    memory: tuple,
    buf: Rollout,
    episodes: Episodes,
    args: Args,
) -> tuple[Mapping[str, Tensor], dict[str, Tensor], str]:
    """Step the env `steps_per_env` times with `policy` (`act`), the networks' `memory` carried in
    place, blanked where an episode ended; fill `buf` and `episodes`. -> (the next observations,
    the env's log values, "" or why the rollout stopped: an observation of another shape). Local."""
    logs: dict[str, Tensor] = {}
    for t in range(args.steps_per_env):
        for group, stored in buf.obs.items():
            if obs[group].shape != stored.shape[1:]:  # every rank hears of it after the rollout
                was, now = list(stored.shape[2:]), list(obs[group].shape[1:])
                problem = f"observation group {group!r} changed shape from {was} to {now}"
                return obs, logs, f"{problem} at step {t + 1} of {args.steps_per_env}"
            stored[t] = obs[group]
        outputs = policy({group: stored[t] for group, stored in buf.obs.items()}, *memory)
        buf.actions[t], buf.log_probs[t], buf.means[t], buf.stds[t], buf.values[t], *new = outputs
        obs, rewards, dones, extras = env.step(buf.actions[t])
        buf.rewards[t], buf.dones[t] = rewards, dones
        buf.time_outs[t] = extras.get("time_outs", torch.zeros_like(dones))
        for state, next_state in zip(memory, new):  # an episode that ended leaves no memory
            state.copy_(next_state * (1.0 - buf.dones[t]).unsqueeze(-1))
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


# --- Update: mini-batches of whole env sequences --------------------------------------------------
def ppo_loss(
    actor: Recurrent, critic: Recurrent, mb: dict[str, Any], args: Args
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO loss of a mini-batch of envs, each network unrolled over their whole rollouts from the
    memory they began it with, blanked at dones -> (loss, its statistics by name, detached)."""
    (mean, std), _ = actor(mb["obs"], mb["actor_memory"], mb["dones"])
    log_probs = gaussian_log_prob(mb["actions"], mean, std)
    values, _ = critic(mb["obs"], mb["critic_memory"], mb["dones"])
    entropy = (0.5 + 0.5 * math.log(2 * math.pi) + std.log()).sum(-1)
    # KL(old || new) of the diagonal Gaussians, rsl_rl's formula: what the adaptive lr reads.
    old_mean, old_std, new_mean, new_std = mb["means"], mb["stds"], mean.detach(), std.detach()
    spread = (old_std**2 + (old_mean - new_mean) ** 2) / (2.0 * new_std**2)
    kl = (torch.log(new_std / old_std) + spread - 0.5).sum(-1)
    # Clipped surrogate: the ratio pi_new / pi_old moves the objective within [1 - clip, 1 + clip].
    ratio = torch.exp(log_probs - mb["log_probs"])
    advantages = mb["advantages"]
    clipped_ratio = ratio.clamp(1 - args.clip, 1 + args.clip)
    surrogate = torch.max(-advantages * ratio, -advantages * clipped_ratio).mean()
    # Value loss, clipped around the rollout's values the same way (rsl_rl's default).
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
    actor: Recurrent,
    critic: Recurrent,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Any],
    args: Args,
    ctx: common.Dist,
) -> Callable[[], dict[str, float]]:
    """The update of `batch` (one row per env, its whole rollout: (N, T, ...)), built once:
    `update()` runs the epochs of mini-batch steps -> the statistics averaged over ranks and steps.
    """
    actor_params, critic_params = list(actor.parameters()), list(critic.parameters())
    synced = [*actor_params, *critic_params]  # every gradient the all_reduce averages
    clipped = {"actor_grad_norm": actor_params, "critic_grad_norm": critic_params}
    clipped = {"grad_norm": synced} if args.grad_clip == "joint" else clipped
    bf16 = args.speed.mixed_precision == "bf16"  # autocast's casts not cached: CUDA graphs

    def minibatch_step(index: torch.Tensor) -> dict[str, torch.Tensor]:
        """One optimizer step on the envs `index`, their whole sequences -> its statistics by
        name."""
        mb = {name: rows[index] for name, rows in batch.items() if name != "obs"}
        mb["obs"] = {group: rows[index] for group, rows in batch["obs"].items()}
        with torch.autocast(ctx.device.type, torch.bfloat16, enabled=bf16, cache_enabled=False):
            loss, stats = ppo_loss(actor, critic, mb, args)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        # SYNC: the mini-batch's one collective: every gradient, then the KL and loss statistics, in
        # one flat buffer averaged over ranks; copied back, every rank takes the same step.
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
        return means

    step = minibatch_step
    if speedups.asked(args.speed, ctx.device):  # --compile, --cuda-graphs
        step = speedups.compiled(minibatch_step, args.speed, ctx.device)
    size, steps = batch["advantages"].shape[0], args.epochs * args.mini_batches

    def update() -> dict[str, float]:
        sums: dict[str, torch.Tensor] = {}  # on the device, read back once
        for epoch in range(args.epochs):
            if epoch == 0 or args.shuffle == "every-epoch":
                order = torch.randperm(size, device=ctx.device)
            for index in order.split(size // args.mini_batches)[: args.mini_batches]:
                for name, value in step(index).items():
                    sums[name] = sums.get(name, 0) + value
        means = dict(zip(sums, (torch.stack(list(sums.values())) / steps).tolist()))
        common.check_update(means, "the environment or the learning rate")  # alike on every rank
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
        if args.num_envs % args.mini_batches:
            raise ValueError(
                f"--num-envs {args.num_envs} is not divisible by --mini-batches "
                f"{args.mini_batches}: a recurrent mini-batch is a set of whole envs; change one "
                "of them."
            )
        arguments.check_args(args)  # as the command line was checked; again for a caller of main
        speedups.check(args.speed, ctx.device, ctx.is_main)  # --compile inductor: a C++ compiler
        resume_from = checkpoints.resume_point(args, "ppo_rnn", ctx.is_main)  # state None: fresh
        first = resume_from.first_iteration
        # seeds what is drawn from here on: env start times, network weights, action noise
        torch.manual_seed(seed := envs.rank_seed(args.seed, ctx.rank, first))
        steps_taken = args.steps_per_env * (first - 1)  # a curriculum's clock (envs/go1.py)
        env = envs.make_env(
            args.task, args.num_envs, ctx.device, seed, args.init_at_random_ep_len, steps_taken
        )
        obs = env.get_observations()
        actor, critic = (net.to(ctx.device) for net in make_networks(obs, env.num_actions, args))
        params = [*actor.parameters(), *critic.parameters()]
        optimizer = speedups.adam(params, args.learning_rate, args.speed, ctx.device)
        trained = {"actor": actor, "critic": critic, "optimizer": optimizer}  # checkpointed
        checkpoints.restore(resume_from, trained)  # a fresh start: nothing to restore
        groups = [*actor.inputs.shapes, *critic.inputs.shapes]
        shapes = envs.group_shapes(obs, list(dict.fromkeys(groups)))  # every group stored, once
        facts = (shapes, env.num_actions, resume_from.first_iteration, resume_from.fingerprint)
    except Exception as error:  # noqa: BLE001 - every rank hears of it at the check
        problem = error
    # SYNC: the start-up check (1 all_gather): a failed or differing rank stops all, in one line.
    common.agree(ctx, problem, facts, args)
    # SYNC: every rank starts from rank 0's weights and normalizer statistics.
    common.broadcast_state(trained.values(), ctx.world_size)
    title = f"recurrent PPO ({args.rnn} {args.rnn_layers} x {args.rnn_hidden}) on {args.task}"
    run, problem = bookkeeping.start_run(ctx, args, "ppo_rnn", trained, title, resume_from)
    common.agree(ctx, problem)  # SYNC: all stop if rank 0 could not take the run dir or logger
    buf = make_rollout(args.steps_per_env, args.num_envs, shapes, env.num_actions, ctx.device)
    # Each network's memory of this rank's envs, carried from step to step and rollout to rollout,
    # and the memory the rollout began with: the update unrolls each env from there.
    zeros = functools.partial(torch.zeros, args.num_envs, device=ctx.device)
    memory = tuple(zeros(net.memory_size) for net in (actor, critic))
    began = tuple(torch.zeros_like(state) for state in memory)
    fields = ("actions", "log_probs", "means", "stds", "values", "advantages", "returns", "dones")
    batch = {name: getattr(buf, name).transpose(0, 1) for name in fields}  # one row per env: (N, T)
    batch["obs"] = {group: stored.transpose(0, 1) for group, stored in buf.obs.items()}
    batch |= {"actor_memory": began[0], "critic_memory": began[1]}
    episodes = envs.make_episodes(args.num_envs, ctx.device, env.episode_length_buf)
    policy_step = functools.partial(act, actor, critic)
    if speedups.asked(args.speed, ctx.device):  # --compile, --cuda-graphs (the update's step too)
        policy_step = speedups.compiled(policy_step, args.speed, ctx.device)
    update = make_update(actor, critic, optimizer, batch, args, ctx)
    for it in range(resume_from.first_iteration, args.iterations + 1):
        t0 = time.time()
        # COLLECT
        for start, state in zip(began, memory):
            start.copy_(state)
        obs, logs, problem = rollout(env, policy_step, obs, memory, buf, episodes, args)
        # SYNC: a changed shape or NaN/Inf on a rank stops every rank, naming it (1 all_reduce).
        common.check_rollout(ctx, problem, buf.obs, {"rewards": buf.rewards}, it)
        # A time-out is not a failure: its reward gets the value of the state it cut off (rsl_rl).
        rewards = buf.rewards + args.gamma * buf.values * buf.time_outs
        # ADVANTAGES: V of where the rollout ended, from the critic's memory as the rollout left it
        with torch.inference_mode():
            last = critic({group: x[:, None] for group, x in obs.items()}, memory[1])[0][:, 0]
        advantages, returns = compute_gae(
            rewards, buf.values, buf.dones, last, args.gamma, args.lam
        )
        # SYNC: advantages normalized with the mean and std of all ranks' (1 all_reduce of 5 sums).
        advantages, explained = normalize_advantages(advantages, returns, ctx.world_size)
        logs["explained_variance"] = explained  # the same on every rank: logged as it is
        buf.advantages.copy_(advantages)
        buf.returns.copy_(returns)
        collect_s = time.time() - t0
        # UPDATE: one all_reduce per mini-batch, inside
        if args.schedule == "linear":  # CleanRL's annealing to 0, the same on every rank
            lr = args.learning_rate * (1 - (it - 1) / args.iterations)
            optimizer.param_groups[0]["lr"].fill_(lr)
        losses = update()
        # SYNC: normalizer statistics merged over every rank's rollout (1 all_gather for all),
        # after the update, so that the update normalized as its rollout did (ratio 1 at first).
        normalized = common.normalizer_batches([actor, critic], buf.obs)
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
