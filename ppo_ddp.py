"""Data-parallel PPO (rsl_rl's multi-GPU mechanism) in one file, in the order it runs.

Each process owns a vectorized environment, collects its own rollout, and joins the update through
hand-called torch.distributed collectives: rank 0's weights broadcast at start, then per PPO
mini-batch ONE all_reduce that carries the gradients and the KL for the adaptive learning rate.
Every collective below is marked `# SYNC:` with the reason it is there. The extensions (RND,
symmetry, reward scaling) live in extensions/ (rsl_rl's `rsl_rl/extensions/`) and act where they show up.
The variants (ppo_rnn_ddp.py, ppo_amp_ddp.py) hand `train` their own pieces (`Variant`) and never copy it.

Launch:
    python ppo_ddp.py                                              # 1 process
    torchrun --standalone --nproc_per_node=2 ppo_ddp.py            # 2 processes on CPU (gloo)
    torchrun --standalone --nproc_per_node=8 ppo_ddp.py --device cuda [--cuda-graphs]   # 8 GPUs (NCCL)
    # 2 nodes x 8 GPUs: the same command on each node, with one node's address (the rendezvous numbers them)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-id=$JOB_ID \\
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD_ADDR:29500 ppo_ddp.py --device cuda
    torchrun --standalone --nproc_per_node=2 ppo_ddp.py --resume runs/ppo_pendulum/<time> --iterations 500  # on to 500
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

import bookkeeping
import checkpoints
import common
import cuda_graphs
import envs
import extensions
import extensions.reward_scaling
import extensions.rnd
import extensions.symmetry
import inputs
from common import Count, Fraction, NonNegative, Positive


@dataclass
class PPOArgs(common.UpdateArgs, bookkeeping.RunArgs):
    """PPO's own arguments, rsl_rl's defaults (after the run's and the update's); `Args` adds the extensions'."""

    iterations: Count = 250
    """Total learning iterations; a resumed run continues up to this number."""
    actor_obs: tuple[str, ...] = ("policy",)
    """Observation groups the actor reads (rsl_rl's obs_groups): flat ones side by side, then images (inputs.py)."""
    critic_obs: tuple[str, ...] = ("critic",)
    """Observation groups the critic reads; the actor's when the env lacks one (rsl_rl's fallback)."""
    actor_hidden: tuple[int, ...] = (64, 64)  # Hidden layer widths of the actor MLP.
    critic_hidden: tuple[int, ...] = (64, 64)  # Hidden layer widths of the critic MLP.
    activation: Literal["elu", "tanh"] = "elu"
    """`elu` (rsl_rl's, torch's default init) or `tanh` (CleanRL's, orthogonal init) in actor and critic."""
    init_noise_std: Positive = 1.0  # Initial standard deviation of the Gaussian policy.
    std_type: Literal["log", "scalar"] = "log"
    """The action std is learned as its log (`log`) or as itself, clamped to [1e-6, 1e6] (`scalar`, rsl_rl 5.5.1's default)."""
    normalize_obs: bool = True  # Normalize actor and critic inputs with running statistics merged across ranks.
    epochs: Count = 5  # PPO epochs over each rollout.
    mini_batches: Count = 4  # Mini-batches per epoch; each is one optimizer step and ONE gradient all_reduce.
    shuffle: Literal["once", "every-epoch"] = "once"
    """Mini-batch order: one permutation per update, reused by every epoch (`once`, rsl_rl 5.5.1's), or a fresh one every epoch (CleanRL's)."""
    clip: Positive = 0.2  # PPO ratio clip, also the value clip.
    gamma: Fraction = 0.99  # Discount factor.
    lam: Fraction = 0.95  # GAE lambda.
    value_coef: NonNegative = 1.0  # Weight of the value loss.
    clip_value_loss: bool = True  # Clip the value loss around the rollout's values, as rsl_rl does.
    entropy_coef: NonNegative = 0.01  # Weight of the entropy bonus.
    learning_rate: Positive = 1e-3  # Initial Adam learning rate of actor and critic.
    schedule: Literal["adaptive", "fixed", "linear"] = "adaptive"
    """`adaptive` (rsl_rl's KL rule; the KL rides in the gradient all_reduce), `fixed` or `linear` (to 0, CleanRL's)."""
    desired_kl: Positive = 0.01  # Target KL for the adaptive schedule.
    max_grad_norm: Positive = 1.0  # Gradient clipping, after the all_reduce so every rank clips the same gradient.
    grad_clip: Literal["per-network", "joint"] = "per-network"
    """Clip the actor's and the critic's gradients each to `--max-grad-norm` (rsl_rl 5.5.1), or both as one (CleanRL)."""


@dataclass
class Args(extensions.reward_scaling.ScalingArgs, extensions.symmetry.SymmetryArgs, extensions.rnd.RndArgs, inputs.CnnArgs, PPOArgs):  # fmt: skip
    """PPO with rsl_rl's defaults, sizes per process; then image encoders and the extensions (RND, symmetry, reward scaling)."""


# --- Networks: each reads its observation groups through `inputs.Inputs`; its config rebuilds it --------


class Actor(nn.Module):
    """Gaussian policy: its observation groups (inputs.py) -> MLP -> mean; a state-independent standard deviation,
    learned as its log (`log_std`) or as itself (`std`, clamped to [1e-6, 1e6]: rsl_rl's "scalar")."""

    def __init__(
        self, obs_shapes: dict[str, list[int]], num_actions: int, hidden: Sequence[int] = (64, 64),
        init_std: float = 1.0, normalize: bool = True, std_type: str = "log", activation: str = "elu",
        cnn: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = common.constructor_config(locals())  # checkpoints keep it: Actor(**config) rebuilds it
        self.inputs = inputs.Inputs(obs_shapes, normalize, cnn, activation)
        self.net = common.mlp(self.inputs.width, tuple(hidden), num_actions, activation, gain=0.01)
        std = torch.full((num_actions,), init_std if std_type == "scalar" else math.log(init_std))
        self.register_parameter("std" if std_type == "scalar" else "log_std", nn.Parameter(std))

    def forward(self, obs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Observation groups -> (mean, std), each (..., num_actions)."""
        mean = self.net(self.inputs(obs))
        std = self.std.clamp(1e-6, 1e6) if hasattr(self, "std") else self.log_std.exp()
        return mean, std.expand_as(mean)


class Critic(nn.Module):
    """State-value function: its observation groups (inputs.py) -> MLP -> V(s)."""

    def __init__(
        self, obs_shapes: dict[str, list[int]], hidden: Sequence[int] = (64, 64), normalize: bool = True,
        activation: str = "elu", cnn: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = common.constructor_config(locals())  # as the actor's
        self.inputs = inputs.Inputs(obs_shapes, normalize, cnn, activation)
        self.net = common.mlp(self.inputs.width, tuple(hidden), 1, activation)

    def forward(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Observation groups -> values (...,)."""
        return self.net(self.inputs(obs)).squeeze(-1)


def make_networks(obs: Mapping[str, torch.Tensor], num_actions: int, args: Args) -> tuple[Actor, Critic]:
    """Actor and critic on the groups `--actor-obs` and `--critic-obs` name; rsl_rl's fallback: without the
    critic's groups the critic reads the actor's. Image groups get CNN encoders (inputs.py). Local."""
    actor_groups = envs.resolve_groups(obs, args.actor_obs, flag="--actor-obs", images=True)
    critic_groups = envs.resolve_groups(obs, args.critic_obs, args.actor_obs, "--actor-obs and --critic-obs", True)
    shapes = {"actor": envs.group_shapes(obs, actor_groups), "critic": envs.group_shapes(obs, critic_groups)}
    a, norm, cnn = (
        args.activation,
        args.normalize_obs,
        {name: inputs.settings(args, shape) for name, shape in shapes.items()},
    )
    actor = Actor(
        shapes["actor"], num_actions, args.actor_hidden, args.init_noise_std, norm, args.std_type, a, cnn["actor"]
    )
    return actor, Critic(shapes["critic"], args.critic_hidden, norm, a, cnn["critic"])  # fmt: skip


def gaussian_log_prob(actions: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log density of a diagonal Gaussian, summed over action dimensions."""
    return (-((actions - mean) ** 2) / (2 * std**2) - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)


# --- Rollout: local to each rank, no communication ------------------------------------------------


@dataclass
class Rollout:
    """One rollout of every env, each tensor (T, N, ...): the observations, each group once, and what happened."""

    obs: dict[str, torch.Tensor]  # observation group -> (T, N, *shape): every group a network reads
    actions: torch.Tensor
    log_probs: torch.Tensor
    means: torch.Tensor
    stds: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor  # as the env gave them, before time-out bootstrapping
    dones: torch.Tensor  # 1.0 where the step ended an episode (terminated or timed out)
    time_outs: torch.Tensor  # 1.0 where the step ended an episode by the time limit
    advantages: torch.Tensor  # written after the rollout, read by the update
    returns: torch.Tensor


def make_rollout(steps: int, num_envs: int, shapes: dict[str, list[int]], num_actions: int, device: torch.device) -> Rollout:  # fmt: skip
    """Allocate rollout storage once, outside inference mode, so the update can backprop from it, and at
    fixed addresses, so a CUDA graph of the update can read it every iteration. `shapes`: group -> one env's."""
    zeros = functools.partial(torch.zeros, steps, num_envs, device=device)  # zeros(*shape): (T, N, *shape)
    obs, a = {group: zeros(*shape) for group, shape in shapes.items()}, num_actions
    return Rollout(obs, zeros(a), zeros(), zeros(a), zeros(a), *(zeros() for _ in range(6)))


def act(actor: nn.Module, critic: nn.Module, obs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The policy's inference step -> (actions drawn from the Gaussian, their log-probability, mean, std,
    the critic's value). Local; no host sync, so `cuda_graphs.cuda_graph` can replay it."""
    mean, std = actor(obs)
    actions = mean + std * torch.randn_like(mean)
    return actions, gaussian_log_prob(actions, mean, std), mean, std, critic(obs)


@torch.inference_mode()
def rollout(
    env: envs.VecEnv, policy_step: Callable[..., tuple[torch.Tensor, ...]], obs: Mapping, groups: Sequence[str],
    buf: Rollout, episodes: envs.Episodes, args: Args, memory: tuple[torch.Tensor, ...] = (),
) -> tuple[Mapping, dict[str, torch.Tensor]]:  # fmt: skip
    """Step the env `steps_per_env` times with `policy_step(obs of the groups named, *memory)` (`act`, or its CUDA
    graph); fill `buf` (every group it stores) and `episodes` in place. Returns the next observations and the
    env's `extras["log"]` values as (sum, count) (`envs.accumulate_logs`). `memory`: a recurrent policy's
    state (ppo_rnn_ddp.py), in and out of `policy_step`, blank where an episode ended."""
    logs: dict[str, torch.Tensor] = {}
    for t in range(args.steps_per_env):
        for group, stored in buf.obs.items():
            stored[t] = obs[group]
        outputs = policy_step({group: buf.obs[group][t] for group in groups}, *memory)
        buf.actions[t], buf.log_probs[t], buf.means[t], buf.stds[t], buf.values[t], *next_memory = outputs
        obs, rewards, dones, extras = env.step(buf.actions[t])  # the stored copy: a graph reuses its outputs
        buf.rewards[t], buf.dones[t] = rewards, dones
        buf.time_outs[t] = extras.get("time_outs", torch.zeros_like(dones))
        for state, next_state in zip(memory, next_memory):  # an episode that ended leaves no memory behind
            state.copy_(common.forget(next_state, buf.dones[t]))
        envs.track_episodes(episodes, rewards, buf.dones[t])
        envs.accumulate_logs(logs, extras, buf.rewards.device)
    return obs, logs


# --- Advantages -----------------------------------------------------------------------------------


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Generalized advantage estimation over `(T, N)` tensors -> `(advantages, returns)`. `dones[t]` ends the
    episode after step t, cutting both the bootstrap and the recursion."""
    advantages = torch.zeros_like(rewards)
    next_advantage, next_values = torch.zeros_like(last_values), last_values
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t].to(rewards.dtype)
        # TD error: r + gamma * V(s') - V(s), with V(s') = 0 after the episode's last step
        delta = rewards[t] + gamma * next_values * not_done - values[t]
        # A_t = delta_t + gamma * lambda * A_{t+1}, cut at the episode's end
        next_advantage = delta + gamma * lam * not_done * next_advantage
        advantages[t] = next_advantage
        next_values = values[t]
    return advantages, advantages + values


def normalize_advantages(
    advantages: torch.Tensor, returns: torch.Tensor, world_size: int, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize with the mean and std of ALL ranks' advantages: with global statistics, N ranks x E envs give the
    same update as 1 rank x N*E envs. -> (normalized advantages, the explained variance of all ranks' `returns` by
    the values, `returns - advantages`: 1 - Var[A] / Var[returns], CleanRL's). One all_reduce of 5 sums."""
    a, r = advantages.to(torch.float64), returns.to(torch.float64)
    count = torch.tensor(a.numel(), dtype=torch.float64, device=a.device)
    sums = torch.stack([a.sum(), (a * a).sum(), count, r.sum(), (r * r).sum()])
    total, total_sq, count, r_total, r_total_sq = common.all_reduce_sum(sums, world_size)
    mean = total / count
    std = ((total_sq - count * mean * mean) / (count - 1).clamp(min=1)).clamp(min=0).sqrt()
    r_var = (r_total_sq - r_total * r_total / count) / (count - 1).clamp(min=1)
    return ((a - mean) / (std + eps)).to(advantages.dtype), 1 - std**2 / r_var


def write_advantages(buf: Rollout, rewards: torch.Tensor, last_values: torch.Tensor, args: Args, world_size: int) -> torch.Tensor:  # fmt: skip
    """GAE of the rollout in `buf` with `rewards` (time-outs bootstrapped), its returns into `buf.returns`
    and its advantages, normalized over all ranks (`normalize_advantages`: 1 all_reduce), into `buf.advantages`.
    -> the explained variance of the returns by the values."""
    advantages, returns = compute_gae(rewards, buf.values, buf.dones, last_values, args.gamma, args.lam)
    normalized, explained_variance = normalize_advantages(advantages, returns, world_size)
    buf.advantages.copy_(normalized)
    buf.returns.copy_(returns)
    return explained_variance


# --- Update ---------------------------------------------------------------------------------------


def ppo_loss(
    actor: Callable[..., tuple[torch.Tensor, torch.Tensor]], critic: Callable[..., torch.Tensor], mb: dict, args: Args
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO loss of one mini-batch -> (loss, its statistics by name: the mean KL(old || new) first). Local."""
    mean, std = actor(mb["obs"])
    log_probs = gaussian_log_prob(mb["actions"], mean, std)
    values = critic(mb["obs"])
    # Entropy and KL are of the rollout's own n rows; symmetry's mirrored copies follow them (rsl_rl).
    n = mb["means"].shape[0]
    entropy = (0.5 + 0.5 * math.log(2 * math.pi) + std[:n].log()).sum(-1)
    # KL(old || new) of the diagonal Gaussians, rsl_rl's formula: what the adaptive learning rate reads.
    old_mean, old_std, new_mean, new_std = mb["means"], mb["stds"], mean[:n].detach(), std[:n].detach()
    kl = (torch.log(new_std / old_std) + (old_std**2 + (old_mean - new_mean) ** 2) / (2.0 * new_std**2) - 0.5).sum(-1)
    # Clipped surrogate: the ratio pi_new / pi_old may move the objective only within [1 - clip, 1 + clip].
    ratio = torch.exp(log_probs - mb["log_probs"])
    advantages = mb["advantages"]
    surrogate = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip, 1 + args.clip)).mean()
    # Value loss, clipped around the rollout's values the same way (rsl_rl's default).
    value_loss = (values - mb["returns"]) ** 2
    if args.clip_value_loss:
        clipped = mb["values"] + (values - mb["values"]).clamp(-args.clip, args.clip)
        value_loss = torch.max(value_loss, (clipped - mb["returns"]) ** 2)
    value_loss = value_loss.mean()
    loss = surrogate + args.value_coef * value_loss - args.entropy_coef * entropy.mean()
    clipfrac = ((ratio.detach() - 1).abs() > args.clip).float().mean()  # CleanRL's: how often the clip held
    stats = {"kl": kl.mean(), "surrogate_loss": surrogate, "value_loss": value_loss, "entropy": entropy.mean()}
    return loss, {name: value.detach() for name, value in {**stats, "clipfrac": clipfrac}.items()}


def adaptive_lr(kl: torch.Tensor, lr: torch.Tensor, desired_kl: float, min_lr: float = 1e-5, max_lr: float = 1e-2) -> torch.Tensor:  # fmt: skip
    """rsl_rl's KL-adaptive rule: shrink by 1.5 above 2x the target KL, grow by 1.5 below half. Tensor in,
    tensor out, on the device: choosing the lr needs no host sync. The comparisons and the arithmetic run
    in `lr`'s dtype (float64 on CPU: the same bits as Python floats)."""
    kl = kl.to(lr.dtype)
    grown = torch.where((kl > 0) & (kl < desired_kl / 2.0), (lr * 1.5).clamp(max=max_lr), lr)
    return torch.where(kl > desired_kl * 2.0, (lr / 1.5).clamp(min=min_lr), grown)


def linear_lr(optimizer: torch.optim.Optimizer, args: Args, it: int) -> None:
    """With `--schedule linear`, CleanRL's annealing: the learning rate of iteration `it` falls linearly to 0."""
    if args.schedule == "linear":
        optimizer.param_groups[0]["lr"].fill_(args.learning_rate * (1 - (it - 1) / args.iterations))


ROLLOUT_FIELDS = ("actions", "log_probs", "means", "stds", "values", "advantages", "returns")  # what the update reads


def rollout_batch(buf: Rollout, memory: tuple[torch.Tensor, ...] = ()) -> dict[str, Any]:
    """The update's rows: every step of every env, (T * N, ...), as views of the rollout storage, so that an update
    built once reads each new rollout (and a CUDA graph of its step reads fixed addresses). `obs`: by group."""
    obs = {group: stored.flatten(0, 1) for group, stored in buf.obs.items()}
    return {"obs": obs, **{name: getattr(buf, name).flatten(0, 1) for name in ROLLOUT_FIELDS}}


def make_update(
    actor: nn.Module, critic: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any], args: Args,
    ctx: common.Dist, sides: tuple[extensions.SideLoss, ...] = (), graphs: bool = False,
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] = ppo_loss,
) -> Callable[[], dict[str, float]]:  # fmt: skip
    """The PPO update of `batch` (`rollout_batch`), built once per run: `update()` runs the epochs of mini-batch
    steps -> the loss statistics averaged over ranks and mini-batches, the gradient norms before clipping.
    `sides`: losses trained in the same step (RND, symmetry, AMP's discriminator). `graphs`: each step replayed
    from CUDA graphs (cuda_graphs.py). `loss_fn`: `ppo_loss`, or ppo_rnn_ddp.py's on whole env sequences."""
    params, n = [*actor.parameters(), *critic.parameters()], len([*actor.parameters()])
    own, own_params = extensions.with_optimizers(sides)  # the others train the actor (symmetry)
    reduced = [*params, *(p for side_params in own_params for p in side_params)]  # every gradient, in order
    # Clipped each alone (rsl_rl 5.5.1's) or as one (--grad-clip joint), by the name its norm is logged under.
    each = {"actor_grad_norm": params[:n], "critic_grad_norm": params[n:]}
    clipped = {"grad_norm": params} if args.grad_clip == "joint" else each
    totals = common.Totals()  # the statistics and gradient norms of every step, summed by name

    def minibatch_step(index: torch.Tensor) -> None:
        """One optimizer step of every network on the rows `index` of the batch, its statistics and gradient
        norms added to the sums. In place only, no read back to the host: a CUDA graph can replay it."""
        mb = common.take(batch, index)
        with common.autocast(ctx.device, args.mixed_precision):  # float32, or bfloat16 (--mixed-precision)
            for side in sides:  # symmetry appends the mirrored copies (extensions/symmetry.py); the others keep mb
                mb = side.augment(mb)
            loss, stats = loss_fn(actor, critic, mb, args)
            for side in sides:  # one backward of the sum gives each network its gradient (the actor: their sum)
                side_loss, side_stats = side.loss(mb)
                loss, stats = loss + side_loss, {**stats, **side_stats}
        for opt in [*(side.optimizer for side in own), optimizer]:
            opt.zero_grad(set_to_none=False)
        loss.backward()
        # SYNC: the mini-batch's one collective: every gradient (the side losses' too), the KL and the loss
        # statistics averaged over ranks in one flat buffer (one per --grad-bucket-mb for larger networks);
        # every rank takes the same step from here on.
        tail = torch.stack([value.float().reshape(()) for value in stats.values()])
        statistics = common.all_reduce_gradients(reduced, ctx.world_size, tail, args.grad_bucket_mb)
        if args.schedule == "adaptive":
            # Every rank applies the rule to the same averaged KL, so they all pick rank 0's lr without the
            # broadcast rsl_rl spends on it; on the device (the lr is a tensor), so without a host sync.
            lr = optimizer.param_groups[0]["lr"]
            lr.copy_(adaptive_lr(statistics[list(stats).index("kl")], lr, args.desired_kl))
        # Clip after the all_reduce: clipping the averaged gradient keeps every rank identical.
        norms = {name: nn.utils.clip_grad_norm_(group, args.max_grad_norm) for name, group in clipped.items()}
        optimizer.step()
        for side, side_params in zip(own, own_params):
            norms[f"{side.name}_grad_norm"] = nn.utils.clip_grad_norm_(side_params, side.max_grad_norm)
            side.optimizer.step()
        totals.add([*stats, *norms], torch.cat([statistics, torch.stack(list(norms.values()))]))

    # --compile, --cuda-graphs: the same step compiled, replayed; on several ranks in two halves, the SYNC between.
    step = cuda_graphs.cuda_graph(cuda_graphs.compiled(minibatch_step, args.compile), graphs)
    size, optimizer_steps = batch["advantages"].shape[0], args.epochs * args.mini_batches
    causes = ", ".join(["the environment", *(side.cause for side in sides)]) + " or the learning rate"

    def update() -> dict[str, float]:
        totals.zero()
        for epoch in range(args.epochs):
            if epoch == 0 or args.shuffle == "every-epoch":
                order = torch.randperm(size, device=ctx.device)
            for index in order.split(size // args.mini_batches)[: args.mini_batches]:
                for side in sides:
                    side.draw()
                step(index)
        # One read back to the host, which raises on every rank if a statistic or a gradient norm is NaN/Inf.
        return totals.read(optimizer_steps, causes)

    return update


def mix_rewards(task: torch.Tensor, bootstrap: torch.Tensor, intrinsic: torch.Tensor | None) -> torch.Tensor:
    """The rewards GAE sees: the env's (scaled with --scale-rewards), RND's intrinsic ones, then the time-outs'
    bootstrap `gamma * V(s)`: a time-out is not a failure, so the value of the state it cut off is added (rsl_rl)."""
    rewards = task if intrinsic is None else task + intrinsic
    return rewards + bootstrap


# --- Plain PPO's pieces (a variant replaces some: extensions.Variant), process group, then the training loop ---

PPO = extensions.Variant("ppo", lambda args: "PPO", make_networks, act, rollout_batch, ppo_loss,
                         last_values=lambda critic, obs, memory: critic(obs))  # fmt: skip


def main(args: Args, variant: extensions.Variant = PPO) -> str:
    """Join the process group, train, leave the group (also on error)."""
    with common.distributed(args.device, args.seed, args.dist_timeout_s, args.start_timeout_s, args.pin_cores) as ctx:
        return train(args, ctx, variant)


def train(args: Args, ctx: common.Dist, variant: extensions.Variant = PPO) -> str:
    """Train on this rank; returns the fingerprint of the final trained state (equal on all ranks)."""
    # SYNC: each rank checks its arguments, reads the checkpoint and builds env and networks alone, then all compare
    # notes (1 all_gather): if one failed, or ranks disagree, every rank stops here instead of hanging later.
    with common.start_together(ctx, args, "observation shapes or checkpoint") as agree:
        bookkeeping.check_args(args, args.mini_batches)
        variant.check_args(args)
        cuda_graphs.check_backend(args.compile, ctx.device)  # inductor on CPU: a C++ compiler is there
        resume_from, env, obs = bookkeeping.start_rank(args, ctx, variant.script)
        actor, critic = (net.to(ctx.device) for net in variant.make_networks(obs, env.num_actions, args))
        graphs = cuda_graphs.use_cuda_graphs(args.cuda_graphs, ctx.device, ctx.is_main)  # on CUDA only; else a note
        rnd, rnd_optimizer = extensions.rnd.make_rnd(obs, actor.inputs.shapes, args, ctx.device, graphs)  # or None
        mirror = extensions.symmetry.load_mirror(args, env, obs, actor, critic, env.num_actions)  # None: no --symmetry
        plugin = variant.plug_in(args, env, obs, ctx, graphs) if variant.plug_in else None  # AMP's parts
        optimizer = common.make_adam([*actor.parameters(), *critic.parameters()], args.learning_rate, ctx.device, graphs, args.compile)  # fmt: skip
        trained = checkpoints.Trained(variant.script, {"actor": actor, "critic": critic}, {"optimizer": optimizer})
        if rnd is not None:
            trained.modules["rnd"], trained.optimizers["rnd_optimizer"] = rnd, rnd_optimizer
        trained.modules.update(plugin.modules if plugin else {})
        trained.optimizers.update(plugin.optimizers if plugin else {})
        scaler = extensions.reward_scaling.make_scaler(args, ctx.device, trained.modules)  # None: off
        checkpoints.restore(resume_from, trained)  # a fresh start: nothing to restore
        stored = [*actor.inputs.shapes, *critic.inputs.shapes, *(rnd.inputs.shapes if rnd else ()), *(plugin.groups if plugin else ())]  # fmt: skip
        shapes = envs.group_shapes(obs, dict.fromkeys(stored))  # every group a network reads, each once
        agree(shapes, env.num_actions, plugin and plugin.agreed, resume_from.first_iteration, resume_from.fingerprint)
    # SYNC: start every rank from rank 0's weights and normalizer statistics (RND's, AMP's networks too).
    common.broadcast_state([*trained.modules.values()], ctx.world_size)

    # SYNC: every rank stops if rank 0 cannot write the run directory (1 all_gather).
    title = f"{variant.title(args)} on {args.task}{plugin.title if plugin else ''}"  # the run's first line
    run_log = bookkeeping.start_run(ctx, args, trained, title, resume_from)
    buf = make_rollout(args.steps_per_env, args.num_envs, shapes, env.num_actions, ctx.device)
    episodes = envs.make_episodes(args.num_envs, ctx.device, env.episode_length_buf)
    sides = (plugin.side_loss,) if plugin else ()
    sides += (extensions.rnd.rnd_side_loss(rnd, rnd_optimizer),) if rnd is not None else ()
    sides += (extensions.symmetry.symmetry_side_loss(mirror, actor, args),) if mirror is not None else ()
    # A recurrent policy's memory of this rank's envs (ppo_rnn_ddp.py; none here), carried over from step to step and
    # rollout to rollout, and where the rollout `began` it: the update unrolls each env from there.
    memory = tuple(torch.zeros(args.num_envs, n.memory_size, device=ctx.device) for n in (actor, critic) if getattr(n, "memory_size", 0))  # fmt: skip
    began = tuple(torch.zeros_like(state) for state in memory)
    # The two steps an iteration repeats, built once: --compile compiles each, --cuda-graphs captures and replays it.
    policy_step = cuda_graphs.cuda_graph(cuda_graphs.compiled(functools.partial(variant.act, actor, critic), args.compile), graphs)  # fmt: skip
    batch = variant.make_batch(buf, began)
    update = make_update(actor, critic, optimizer, batch, args, ctx, sides, graphs, variant.loss)
    policy_groups = [*dict.fromkeys([*actor.inputs.shapes, *critic.inputs.shapes])]
    intrinsic_return = torch.zeros(args.num_envs, device=ctx.device)  # RND's reward normalization, per env
    for it in range(resume_from.first_iteration, args.iterations + 1):
        t0 = time.time()
        # COLLECT
        for start, state in zip(began, memory):
            start.copy_(state)
        obs, env_logs = rollout(env, policy_step, obs, policy_groups, buf, episodes, args, memory)
        # SYNC: a rank whose environment produced NaN/Inf stops every rank, with its name (1 all_reduce).
        stored = {f"observation group {group!r}": x for group, x in buf.obs.items()}
        common.raise_if_nonfinite(ctx, {**stored, "rewards": buf.rewards}, f"from the environment at iteration {it}")
        if plugin is not None:  # AMP: the policy's transitions to its replay, its style reward (ppo_amp_ddp.py)
            plugin.after_rollout(buf, obs, it, env_logs)
        task_rewards = extensions.reward_scaling.scale_rewards(scaler, buf.rewards, buf.dones)  # --scale-rewards
        # INTRINSIC REWARD (extensions/rnd.py): the novelty of the state each step led to, for the critic (None
        # without RND). SYNC (with --rnd-normalize-rewards): return statistics merged over ranks (1 all_gather).
        intrinsic = extensions.rnd.rollout_intrinsic_rewards(
            rnd, buf, obs, intrinsic_return, it, env, args, ctx, env_logs
        )

        # ADVANTAGES
        with torch.inference_mode():
            last_values = variant.last_values(critic, obs, memory)
        bootstrap = args.gamma * buf.values * buf.time_outs  # a time-out's reward gets V(s) of the state it cut off
        rewards = (plugin.mix_rewards if plugin else mix_rewards)(task_rewards, bootstrap, intrinsic)
        # SYNC: GAE, its advantages normalized with the mean and std of all ranks (1 all_reduce of 5 numbers).
        explained_variance = write_advantages(buf, rewards, last_values, args, ctx.world_size)
        collect_s = time.time() - t0

        # UPDATE: one all_reduce per mini-batch, inside; symmetry, RND's predictor and AMP's discriminator join it
        linear_lr(optimizer, args, it)  # --schedule linear; the same on every rank: local
        losses = update()
        # SYNC: normalizer statistics (and the reward scaler's) merged over every rank's rollout (1 all_gather
        # for all), after the update, so that the update normalizes exactly as its rollout did (ratio starts at 1).
        normalized = inputs.normalizer_batches([actor, critic, *([rnd] if rnd else [])], buf.obs)
        normalized += extensions.reward_scaling.normalizer_batch(scaler) + (plugin.normalizer_batches(buf) if plugin else [])  # fmt: skip
        common.update_normalizers(normalized, ctx.world_size)

        # LOG, CHECK, SAVE. SYNC: the iteration's statistics (1 all_reduce), then the state check and the save
        # (1 all_gather each, when due), in one order on every rank: bookkeeping.end_iteration.
        env_logs["explained_variance"] = explained_variance  # the same on every rank: read with the logs, no sync
        metrics = {"learning_rate": float(optimizer.param_groups[0]["lr"]), **losses}
        if bookkeeping.end_iteration(ctx, run_log, it, episodes, env_logs, metrics, t0, collect_s):
            break
    bookkeeping.finish_run(ctx, run_log)
    return checkpoints.fingerprint(trained)


if __name__ == "__main__":
    bookkeeping.cli(main, Args, envs.task_defaults)  # a task family may bring settings of its own (envs/)
