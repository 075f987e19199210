"""Data-parallel PPO (rsl_rl's multi-GPU mechanism) in one file.

Each process owns a vectorized environment, collects its own rollout, and joins the update through
hand-called torch.distributed collectives: rank 0's weights broadcast at start, then per PPO
mini-batch ONE all_reduce that carries the gradients and the KL for the adaptive learning rate.

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
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import tyro
from torch import nn

import common


@dataclass
class Args(common.PPOArgs):
    """PPO with rsl_rl's defaults; sizes are per process (the PPO hyperparameters are common.PPOArgs,
    the run arguments common.RunArgs)."""

    task: str = "pendulum"
    """Built-in task (`pendulum`, `reacher`, `pendulum_partial`) or your own env as `module:function`."""
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
    env: common.VecEnv, actor: common.Actor, critic: common.Critic, obs: dict, buf: common.Rollout,
    episodes: common.Episodes, args: Args,
) -> tuple[dict, dict[str, torch.Tensor]]:  # fmt: skip
    """Step the env `steps_per_env` times with the current policy; fill `buf` and `episodes` in place.

    Local to this rank: no communication. Returns the next observations and the mean of the env's
    `extras["log"]` scalars.
    """
    logs: dict[str, torch.Tensor] = {}
    for t in range(args.steps_per_env):
        actor_obs = common.observation_group(obs, args.actor_obs, None)
        critic_obs = common.observation_group(obs, args.critic_obs, args.actor_obs)
        mean, std = actor(actor_obs)
        actions = mean + std * torch.randn_like(mean)
        values = critic(critic_obs)
        next_obs, rewards, dones, extras = env.step(actions)
        dones = dones.to(torch.float32)
        buf.actor_obs[t], buf.critic_obs[t], buf.actions[t] = actor_obs, critic_obs, actions
        buf.log_probs[t], buf.means[t], buf.stds[t] = common.gaussian_log_prob(actions, mean, std), mean, std
        time_outs = extras.get("time_outs", torch.zeros_like(dones))
        # Time-outs are not failures: bootstrap them with the value of the state they cut off.
        buf.rewards[t] = common.bootstrap_timeouts(rewards, values, time_outs, args.gamma)
        buf.values[t], buf.dones[t] = values, dones
        common.track_episodes(episodes, rewards, dones)
        common.accumulate_logs(logs, extras.get("log", {}), 1 / args.steps_per_env, buf.rewards.device)
        obs = next_obs
    return obs, logs


# ---------------------------------------------------------------------------------------------
# Update
# ---------------------------------------------------------------------------------------------


def update(
    actor: nn.Module, critic: nn.Module, optimizer: torch.optim.Optimizer, buf: common.Rollout,
    advantages: torch.Tensor, returns: torch.Tensor, args: Args, ctx: common.Dist,
    loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, float]:  # fmt: skip
    """PPO epochs over the rollout; every mini-batch's gradient is averaged over ranks before the step.

    The learning rate lives in the optimizer's param group, as a device tensor. Returns loss statistics averaged over
    ranks and mini-batches.
    """
    lr = optimizer.param_groups[0]["lr"]  # a tensor on the device (common.make_adam), changed in place
    batch = common.flatten_rollout(buf, advantages, returns)
    size = advantages.numel()
    params = [p for module in (actor, critic) for p in module.parameters()]
    totals = torch.zeros(4, device=ctx.device)  # kl, surrogate, value, entropy
    flags = torch.zeros(ctx.world_size, device=ctx.device)  # which rank's loss went non-finite first
    grad_norm_ok = torch.ones((), dtype=torch.bool, device=ctx.device)
    for _ in range(args.epochs):
        for idx in torch.randperm(size, device=ctx.device).split(size // args.mini_batches)[: args.mini_batches]:
            loss, kl, stats = common.ppo_minibatch_loss(actor, critic, batch, idx, args, loss_fn)
            if args.schedule == "adaptive" and not args.fuse_kl:
                # rsl_rl's order: all_reduce the KL, rank 0 picks the lr, broadcast it (2 collectives).
                lr.copy_(common.sync_kl_and_lr(kl, lr, args.desired_kl, ctx))
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            # SYNC: the one collective of the mini-batch. Gradients, KL, loss statistics and non-finite
            # flags are summed over ranks in one flat buffer and divided by the world size; every rank
            # gets the same bits.
            extras = torch.cat([kl.reshape(1), stats, common.nonfinite_flags(loss, ctx)])
            reduced = common.all_reduce_gradients(params, ctx.world_size, extras)
            if args.schedule == "adaptive" and args.fuse_kl:
                # Every rank applies the rule to the same reduced KL, so they all pick rank 0's lr
                # without the broadcast rsl_rl spends on it; on the device, so without a host sync.
                lr.copy_(common.adaptive_lr(reduced[0], lr, args.desired_kl))
            # Clip after the all_reduce: clipping the averaged gradient keeps every rank identical.
            grad_norm_ok &= torch.isfinite(nn.utils.clip_grad_norm_(params, args.max_grad_norm))
            optimizer.step()
            totals += reduced[:4]
            flags = common.first_flags(flags, reduced[4:])
    common.raise_if_update_failed(flags, grad_norm_ok, "PPO loss", "the environment or the learning rate")
    totals = (totals / (args.epochs * args.mini_batches)).tolist()
    return dict(zip(("kl", "surrogate_loss", "value_loss", "entropy"), totals))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


@dataclass
class Start:
    """What a rank builds alone, before it talks to the others."""

    env: common.VecEnv
    obs: dict
    modules: dict[str, nn.Module]  # actor, critic
    optimizer: torch.optim.Optimizer
    first_iteration: int
    env_steps: int
    seed: int
    resumed_from: str  # the fingerprint of the checkpoint resumed from, "" for a fresh run


def prepare(args: Args, ctx: common.Dist) -> Start:
    """Check the arguments, read the checkpoint, build env and networks: local, no communication."""
    common.check_args(args, ("iterations", "save_interval", "keep_checkpoints"), args.mini_batches)
    required = ("actor", "critic", "optimizer", *common.RESUME_KEYS)
    checkpoint = common.load_checkpoint(args.resume, "ppo", required) if args.resume else None
    start = checkpoint["iteration"] + 1 if checkpoint else 1
    env, seed = common.make_rank_env(args.task, args, ctx, start)
    obs = env.get_observations()
    modules = common.make_actor_critic(obs, env.num_actions, args, ctx.device)
    optimizer = common.make_adam([p for m in modules.values() for p in m.parameters()], args.learning_rate, ctx.device)
    if checkpoint:
        common.restore_checkpoint(checkpoint, args.resume, modules, {"optimizer": optimizer})
    env_steps, resumed_from = (checkpoint["env_steps"], checkpoint["fingerprint"]) if checkpoint else (0, "")
    return Start(env, obs, modules, optimizer, start, env_steps, seed, resumed_from)


def train(args: Args, ctx: common.Dist) -> str:
    """Train on this rank; returns the fingerprint of the final trained state (equal on all ranks)."""

    def describe(s: Start) -> str:
        sizes = [m.net[0].in_features for m in s.modules.values()] + [s.env.num_actions]
        return repr((dataclasses.asdict(args), sizes, s.first_iteration, s.resumed_from))

    # SYNC: if any rank failed to start, or ranks disagree on arguments, sizes or the checkpoint they
    # resume from, every rank stops here instead of hanging or diverging later.
    s = common.start_together(ctx, lambda: prepare(args, ctx), describe, "arguments, observation sizes or checkpoint")
    env, obs, modules, optimizer = s.env, s.obs, s.modules, s.optimizer
    actor, critic = modules.values()
    # SYNC: start every rank from rank 0's weights and normalizer statistics.
    common.broadcast_state([actor, critic], ctx.world_size)

    # Optional fast path: compiled views of the same modules (state_dict, normalizers stay on the originals).
    policy, value, loss_fn = actor, critic, None
    if args.compile:
        policy, value = torch.compile(actor, backend=args.compile), torch.compile(critic, backend=args.compile)
        loss_fn = torch.compile(common.ppo_loss, backend=args.compile)

    seeds = [seed[0] for seed in common.all_gather_ints(ctx, [s.seed])]
    banner = f"PPO on {args.task}: {ctx.world_size} process(es) x {args.num_envs} envs on {ctx.device}, seeds {seeds}"
    run_dir = common.resolve_run_dir(args, "ppo", args.task)
    run = common.start_run(ctx, run_dir, s.first_iteration, args.iterations, s.env_steps, banner)
    actor_dim, critic_dim = actor.net[0].in_features, critic.net[0].in_features
    dims = {"actor": actor_dim, "critic": critic_dim, "actions": env.num_actions}  # saved for distill_ddp.py
    buf = common.make_rollout(args.steps_per_env, args.num_envs, actor_dim, critic_dim, env.num_actions, ctx.device)
    episodes = common.make_episodes(args.num_envs, ctx.device)
    for it in range(s.first_iteration, args.iterations + 1):
        t0 = time.time()
        obs, env_logs = rollout(env, policy, value, obs, buf, episodes, args)
        # SYNC: a rank whose environment produced NaN/Inf stops every rank, with its name.
        common.raise_if_nonfinite(
            ctx,
            {"observations": buf.actor_obs, "critic observations": buf.critic_obs, "rewards": buf.rewards},
            f"from the environment at iteration {it}",
        )
        with torch.inference_mode():
            last_values = value(common.observation_group(obs, args.critic_obs, args.actor_obs))
        advantages, returns = common.compute_gae(buf.rewards, buf.values, buf.dones, last_values, args.gamma, args.lam)
        # SYNC: advantages normalized with the mean/std of all ranks (1 all_reduce of 3 numbers).
        advantages = common.normalize_advantages(advantages, ctx.world_size)
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
        metrics = {"learning_rate": float(optimizer.param_groups[0]["lr"]), **losses}
        stop = common.end_iteration(ctx, run, it, episodes, env_logs, steps, timings, metrics)
        # SYNC: the state check and the checkpoint, each on its iterations (common.check_and_save).
        extra = {"learning_rate": metrics["learning_rate"], "obs_dims": dims}
        common.check_and_save(ctx, run, it, stop, args, "ppo", modules, {"optimizer": optimizer}, extra)
        if stop:
            break
    if run.writer is not None:
        run.writer.close()
    return common.state_fingerprint(common.trained_tensors([actor, critic], [optimizer]))


def main(args: Args) -> str:
    """Join the process group, train, leave the group (also on error)."""
    with common.distributed(args.device, args.seed, args.dist_timeout_s) as ctx:
        return train(args, ctx)


if __name__ == "__main__":
    main(tyro.cli(Args))
