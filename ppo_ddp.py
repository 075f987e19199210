"""Data-parallel PPO (rsl_rl's multi-GPU mechanism) in one file.

Each process owns a vectorized environment, collects its own rollout, and joins the update through
hand-called torch.distributed collectives: one broadcast at start, then per PPO mini-batch ONE
all_reduce that carries the gradients and the KL for the adaptive learning rate.

Launch:
    python ppo_ddp.py                                              # 1 process
    torchrun --standalone --nproc_per_node=2 ppo_ddp.py            # 2 processes on CPU (gloo)
    torchrun --standalone --nproc_per_node=8 ppo_ddp.py --device cuda   # 8 GPUs (NCCL)
    # 2 nodes x 8 GPUs: run on each node, with NODE_RANK 0 and 1 and the first node's address
    torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc_per_node=8 \
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD_ADDR:29500 ppo_ddp.py --device cuda
    torchrun --standalone --nproc_per_node=2 ppo_ddp.py --resume runs/ppo_pendulum/<time>  # resume
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from torch import nn

from common import (
    Actor,
    Critic,
    Dist,
    Episodes,
    Rollout,
    RunArgs,
    VecEnv,
    accumulate_logs,
    adaptive_lr,
    all_gather_ints,
    all_reduce_gradients,
    bootstrap_timeouts,
    broadcast_state,
    check_resumed_state,
    check_state_consistent,
    compute_gae,
    default_run_dir,
    distributed,
    end_iteration,
    gaussian_kl,
    gaussian_log_prob,
    is_save_iteration,
    load_checkpoint,
    make_rank_env,
    make_rollout,
    normalize_advantages,
    observation_group,
    ppo_loss,
    raise_if_nonfinite,
    resolve_checkpoint,
    save_on_rank0,
    start_run,
    start_together,
    state_fingerprint,
    sync_kl_and_lr,
    track_episodes,
    trained_tensors,
)


@dataclass
class Args(RunArgs):
    """PPO with rsl_rl's defaults; sizes are per process (the run arguments are common.RunArgs)."""

    task: str = "pendulum"
    """Built-in task (`pendulum`, `reacher`, `pendulum_partial`) or your own env as `module:function`."""
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
    """Mini-batches per epoch; each is one optimizer step and one gradient all_reduce."""
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
    """Initial Adam learning rate."""
    schedule: Literal["adaptive", "fixed"] = "adaptive"
    """`adaptive` (KL-driven, rsl_rl's rule) or `fixed`."""
    desired_kl: float = 0.01
    """Target KL for the adaptive schedule."""
    max_grad_norm: float = 1.0
    """Gradient clipping, applied after the all_reduce so every rank clips the same gradient."""
    fuse_kl: bool = True
    """Carry the KL in the gradient all_reduce (1 collective per mini-batch) instead of rsl_rl's
    separate KL all_reduce and lr broadcast (3 collectives per mini-batch)."""
    compile: str | None = None
    """torch.compile backend for the networks and the loss (e.g. `inductor`); off by default."""


# ---------------------------------------------------------------------------------------------
# Rollout
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def rollout(
    env: VecEnv, actor: Actor, critic: Critic, obs: dict, buf: Rollout, episodes: Episodes, args: Args
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Step the env `steps_per_env` times with the current policy; fill `buf` and `episodes` in place.

    Local to this rank: no communication. Returns the next observations and the mean of the env's
    `extras["log"]` scalars.
    """
    logs: dict[str, torch.Tensor] = {}
    for t in range(args.steps_per_env):
        actor_obs = observation_group(obs, args.actor_obs, None)
        critic_obs = observation_group(obs, args.critic_obs, args.actor_obs)
        mean, std = actor(actor_obs)
        actions = mean + std * torch.randn_like(mean)
        values = critic(critic_obs)
        next_obs, rewards, dones, extras = env.step(actions)
        dones = dones.to(torch.float32)
        buf.actor_obs[t], buf.critic_obs[t], buf.actions[t] = actor_obs, critic_obs, actions
        buf.log_probs[t], buf.means[t], buf.stds[t], buf.values[t] = (
            gaussian_log_prob(actions, mean, std),
            mean,
            std,
            values,
        )
        buf.rewards[t] = bootstrap_timeouts(
            rewards, values, extras.get("time_outs", torch.zeros_like(dones)), args.gamma
        )
        buf.dones[t] = dones
        track_episodes(episodes, rewards, dones)
        accumulate_logs(logs, extras.get("log", {}), 1 / args.steps_per_env, buf.rewards.device)
        obs = next_obs
    return obs, logs


# ---------------------------------------------------------------------------------------------
# Update
# ---------------------------------------------------------------------------------------------


def update(
    actor: nn.Module,
    critic: nn.Module,
    optimizer: torch.optim.Optimizer,
    buf: Rollout,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    args: Args,
    ctx: Dist,
    loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = ppo_loss,
) -> dict[str, float]:
    """PPO epochs over the rollout; every mini-batch's gradient is averaged over ranks before the step.

    The learning rate lives in the optimizer's param groups. Returns loss statistics averaged over
    ranks and mini-batches.
    """
    lr = optimizer.param_groups[0]["lr"]
    flat = {
        name: getattr(buf, name).flatten(0, 1)
        for name in ("actor_obs", "critic_obs", "actions", "log_probs", "means", "stds", "values")
    }
    flat_adv, flat_ret = advantages.flatten(), returns.flatten()
    batch = flat_adv.numel()
    mini = batch // args.mini_batches
    params = [p for module in (actor, critic) for p in module.parameters()]
    totals = torch.zeros(4, device=ctx.device)  # kl, surrogate, value, entropy
    # 1 in slot r: rank r saw a non-finite loss, in the first mini-batch where any rank did (NaN
    # spreads to every rank through the all_reduce, so later mini-batches would blame them all).
    nonfinite = torch.zeros(ctx.world_size, device=ctx.device)
    grad_norm_ok = torch.ones((), dtype=torch.bool, device=ctx.device)
    for _ in range(args.epochs):
        for idx in torch.randperm(batch, device=ctx.device).split(mini)[: args.mini_batches]:
            mean, std = actor(flat["actor_obs"][idx])
            log_probs = gaussian_log_prob(flat["actions"][idx], mean, std)
            entropy = (0.5 + 0.5 * math.log(2 * math.pi) + std.log()).sum(-1)
            values = critic(flat["critic_obs"][idx])
            kl = gaussian_kl(flat["means"][idx], flat["stds"][idx], mean.detach(), std.detach()).mean()
            if args.schedule == "adaptive" and not args.fuse_kl:
                # rsl_rl's order: all_reduce the KL, rank 0 picks the lr, broadcast it (2 collectives).
                lr = sync_kl_and_lr(kl, lr, args.desired_kl, ctx)
            loss, stats = loss_fn(
                log_probs,
                flat["log_probs"][idx],
                flat_adv[idx],
                values,
                flat["values"][idx],
                flat_ret[idx],
                entropy,
                args.clip,
                args.value_coef,
                args.entropy_coef,
                args.clip_value_loss,
            )
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            local_flag = torch.zeros(ctx.world_size, device=ctx.device)
            local_flag[ctx.rank] = (~torch.isfinite(loss)).float()
            # SYNC: the one collective of the mini-batch. Gradients, KL and loss statistics are summed
            # over ranks in one flat buffer and divided by the world size; every rank gets the same bits.
            reduced = all_reduce_gradients(params, ctx.world_size, torch.cat([kl.reshape(1), stats, local_flag]))
            if args.schedule == "adaptive" and args.fuse_kl:
                # Every rank applies the rule to the same reduced KL, so they all pick rank 0's lr
                # without the broadcast rsl_rl spends on it.
                lr = adaptive_lr(reduced[0].item(), lr, args.desired_kl)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Clip after the all_reduce: clipping the averaged gradient keeps every rank identical.
            grad_norm_ok &= torch.isfinite(nn.utils.clip_grad_norm_(params, args.max_grad_norm))
            optimizer.step()
            totals += reduced[:4]
            nonfinite = torch.where(nonfinite.any(), nonfinite, reduced[4:])
    bad = nonfinite.nonzero().flatten().tolist()
    if bad:
        # The flags came through the all_reduce, so every rank raises here together.
        raise FloatingPointError(
            f"non-finite PPO loss on rank(s) {bad}; the environment or the learning rate produced NaN/Inf. No checkpoint was written."
        )
    if not grad_norm_ok:
        # The averaged gradient is the same on every rank, and so is this decision.
        raise FloatingPointError(
            "non-finite gradient in the PPO update; lower the learning rate. No checkpoint was written."
        )
    totals = (totals / (args.epochs * args.mini_batches)).tolist()
    return dict(zip(("kl", "surrogate_loss", "value_loss", "entropy"), totals))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def checkpoint_state(
    actor: Actor, critic: Critic, optimizer: torch.optim.Optimizer, it: int, env_steps: int, args: Args
) -> dict:
    """Everything a resume needs, as tensors, numbers, strings and plain containers only."""
    return {
        "kind": "ppo",
        "actor": actor.state_dict(),
        "critic": critic.state_dict(),
        "optimizer": optimizer.state_dict(),
        "learning_rate": optimizer.param_groups[0]["lr"],
        "iteration": it,
        "env_steps": env_steps,
        "args": dataclasses.asdict(args),
        "obs_dims": {
            "actor": actor.net[0].in_features,
            "critic": critic.net[0].in_features,
            "actions": actor.log_std.numel(),
        },
        "fingerprint": state_fingerprint(trained_tensors([actor, critic], [optimizer])),
    }


@dataclass
class Start:
    """What a rank builds alone, before it talks to the others."""

    env: VecEnv
    obs: dict
    actor: Actor
    critic: Critic
    optimizer: torch.optim.Optimizer
    first_iteration: int
    env_steps: int
    seed: int
    resumed_from: str  # the fingerprint of the checkpoint resumed from, "" for a fresh run


def prepare(args: Args, ctx: Dist) -> Start:
    """Check the arguments, read the checkpoint, build env and networks: local, no communication."""
    if (args.num_envs * args.steps_per_env) % args.mini_batches:
        raise ValueError(
            f"num_envs * steps_per_env = {args.num_envs * args.steps_per_env} is not divisible by mini_batches = {args.mini_batches}; change one of them."
        )
    if min(args.save_interval, args.keep_checkpoints, args.iterations) < 1:
        raise ValueError("iterations, save_interval and keep_checkpoints must each be at least 1.")
    required = ("actor", "critic", "optimizer", "iteration", "env_steps", "fingerprint")
    checkpoint = load_checkpoint(args.resume, "ppo", required) if args.resume else None
    start = checkpoint["iteration"] + 1 if checkpoint else 1
    env, seed = make_rank_env(args.task, args, ctx, start)
    obs = env.get_observations()
    actor_dim = observation_group(obs, args.actor_obs, None).shape[-1]
    critic_dim = observation_group(obs, args.critic_obs, args.actor_obs).shape[-1]
    actor = Actor(actor_dim, env.num_actions, args.actor_hidden, args.init_noise_std, args.normalize_obs).to(ctx.device)
    critic = Critic(critic_dim, args.critic_hidden, args.normalize_obs).to(ctx.device)
    optimizer = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=args.learning_rate)
    if checkpoint:
        try:
            actor.load_state_dict(checkpoint["actor"])
            critic.load_state_dict(checkpoint["critic"])
        except RuntimeError as error:
            raise ValueError(f"checkpoint {args.resume!r} does not fit this task and network: {error}") from error
        optimizer.load_state_dict(checkpoint["optimizer"])  # the learning rate is in its param groups
        check_resumed_state(args.resume, checkpoint, [actor, critic], [optimizer])
    resumed_from = checkpoint["fingerprint"] if checkpoint else ""
    return Start(
        env, obs, actor, critic, optimizer, start, checkpoint["env_steps"] if checkpoint else 0, seed, resumed_from
    )


def train(args: Args, ctx: Dist) -> str:
    """Train on this rank; returns the fingerprint of the final trained state (equal on all ranks)."""

    def describe(s: Start) -> str:
        sizes = (s.actor.net[0].in_features, s.critic.net[0].in_features, s.env.num_actions)
        return repr((dataclasses.asdict(args), sizes, s.first_iteration, s.resumed_from))

    # SYNC: if any rank failed to start, or ranks disagree on arguments, sizes or the checkpoint they
    # resume from, every rank stops here instead of hanging or diverging later.
    s = start_together(ctx, lambda: prepare(args, ctx), describe, "arguments, observation sizes or checkpoint")
    env, obs, actor, critic, optimizer = s.env, s.obs, s.actor, s.critic, s.optimizer
    # SYNC: start every rank from rank 0's weights and normalizer statistics.
    broadcast_state([actor, critic], ctx.world_size)

    # Optional fast path: compiled views of the same modules (state_dict, normalizers stay on the originals).
    policy, value, loss_fn = actor, critic, ppo_loss
    if args.compile:
        policy, value = torch.compile(actor, backend=args.compile), torch.compile(critic, backend=args.compile)
        loss_fn = torch.compile(ppo_loss, backend=args.compile)

    seeds = [seed[0] for seed in all_gather_ints(ctx, [s.seed])]
    run_dir = args.run_dir or (
        os.path.dirname(resolve_checkpoint(args.resume)) if args.resume else default_run_dir("ppo", args.task)
    )
    banner = f"PPO on {args.task}: {ctx.world_size} process(es) x {args.num_envs} envs on {ctx.device}, seeds {seeds}"
    run = start_run(ctx, run_dir, s.first_iteration, args.iterations, s.env_steps, banner)
    actor_dim, critic_dim = actor.net[0].in_features, critic.net[0].in_features
    buf = make_rollout(args.steps_per_env, args.num_envs, actor_dim, critic_dim, env.num_actions, ctx.device)
    episodes = Episodes(*(torch.zeros(n, device=ctx.device) for n in (args.num_envs, args.num_envs, 3)))
    for it in range(s.first_iteration, args.iterations + 1):
        t0 = time.time()
        obs, env_logs = rollout(env, policy, value, obs, buf, episodes, args)
        # SYNC: a rank whose environment produced NaN/Inf stops every rank, with its name.
        raise_if_nonfinite(
            ctx,
            {"observations": buf.actor_obs, "critic observations": buf.critic_obs, "rewards": buf.rewards},
            f"from the environment at iteration {it}",
        )
        with torch.inference_mode():
            last_values = value(observation_group(obs, args.critic_obs, args.actor_obs))
        advantages, returns = compute_gae(buf.rewards, buf.values, buf.dones, last_values, args.gamma, args.lam)
        # SYNC: advantages normalized with the mean/std of all ranks (1 all_reduce of 3 numbers).
        advantages = normalize_advantages(advantages, ctx.world_size)
        collect_s = time.time() - t0

        losses = update(policy, value, optimizer, buf, advantages, returns, args, ctx, loss_fn)
        if args.normalize_obs:
            # SYNC: normalizer statistics merged over every rank's rollout (1 all_gather each), after
            # the update, so that the update normalizes exactly as its rollout did (ratio starts at 1).
            actor.normalizer.update(buf.actor_obs, ctx.world_size)
            critic.normalizer.update(buf.critic_obs, ctx.world_size)

        # SYNC: episode statistics, env logs and stop requests of all ranks in one all_reduce.
        timings = {"collect_s": collect_s, "update_s": time.time() - t0 - collect_s}
        steps = args.steps_per_env * args.num_envs * ctx.world_size
        stop = end_iteration(
            ctx,
            run,
            it,
            episodes,
            env_logs,
            steps,
            timings,
            {"learning_rate": optimizer.param_groups[0]["lr"], **losses},
        )
        if args.check_interval and it % args.check_interval == 0:
            # SYNC: a cheap guard against silent divergence: every rank must hold the same bits.
            check_state_consistent(ctx, it, [actor, critic], [optimizer])
        if is_save_iteration(it, run, args.save_interval, stop):
            # SYNC: rank 0 writes; all ranks learn whether it worked.
            state = checkpoint_state(actor, critic, optimizer, it, run.env_steps, args) if ctx.is_main else None
            save_on_rank0(ctx, run.dir, it, state, args.keep_checkpoints)
        if stop:
            break
    if run.writer is not None:
        run.writer.close()
    return state_fingerprint(trained_tensors([actor, critic], [optimizer]))


def main(args: Args) -> str:
    """Join the process group, train, leave the group (also on error)."""
    with distributed(args.device, args.seed, args.dist_timeout_s) as ctx:
        return train(args, ctx)


if __name__ == "__main__":
    main(tyro.cli(Args))
