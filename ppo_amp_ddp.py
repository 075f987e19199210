"""Data-parallel PPO with Adversarial Motion Priors (Peng et al. 2021) in one file.

A discriminator D(s, s') learns to tell transitions of reference motions (+1) from the policy's (-1);
its score becomes a style reward mixed with the task reward. It is trained on every rank, so it is
synchronized like the actor and critic (rsl_rl's PPOAMP forgets this and every rank then trains its
own reward function): broadcast at start, its gradients in the SAME flat all_reduce as the actor's
and critic's (one collective per mini-batch, KL and statistics included), its input normalizer
merged across ranks, its weights and optimizer in the checkpoint.

Reference motions: a `.npz` file read with `numpy.load(allow_pickle=False)` (never runs code) that
holds `dt` (seconds between frames) and `clip_000`, `clip_001`, ... each a float array (frames,
amp_dim) of AMP observations, one row per frame; see data/make_amp_motions.py, which recorded the
default file (counter-clockwise pendulum swing-ups).

Launch:
    python ppo_amp_ddp.py                                             # 1 process
    torchrun --standalone --nproc_per_node=2 ppo_amp_ddp.py           # 2 processes on CPU (gloo)
    torchrun --standalone --nproc_per_node=8 ppo_amp_ddp.py --device cuda   # 8 GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 ppo_amp_ddp.py --resume runs/ppo_amp_pendulum/<time>
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import tyro
from torch import nn

import common

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Args(common.PPOArgs):
    """AMP on top of PPO (rsl_rl's defaults, common.PPOArgs); sizes are per process."""

    task: str = "pendulum"
    """Built-in task or your own environment as `module:function`; it needs an AMP observation group."""
    motion_file: str = "data/pendulum_ccw_motions.npz"
    """Reference motions (format in the module docstring); relative paths are tried from the working
    directory, then from this script's directory."""
    amp_obs: str = "amp"
    """Observation group the discriminator sees; falls back to `policy` when the env has none."""
    task_weight: float = 0.005
    """Weight of the task reward in the mixed reward `task_weight * task + style_weight * style`.
    Pendulum's task reward is -16.3..0 per step; swinging up only counter-clockwise costs about 50
    of task return per episode (scripted: -205 vs -151 free). With the paper's gradient penalty the
    discriminator is smooth and a clockwise swing-up loses only a few units of style return, so the
    task must weigh about 200x less than the style for the style to win (README: the runs)."""
    style_weight: float = 1.0
    """Weight of the style reward, which is in [0, 1] per step."""
    disc_hidden: tuple[int, ...] = (128, 128)
    """Hidden layer widths of the discriminator MLP (ReLU activations)."""
    disc_learning_rate: float = 5e-4
    """Adam learning rate of the discriminator (fixed)."""
    disc_batch_size: int = 512
    """Reference and policy pairs (each) per rank in every discriminator mini-batch."""
    gp_weight: float = 10.0
    """w_gp of the AMP paper: D minimizes E_ref[(D - 1)^2] + E_policy[(D + 1)^2] + w_gp / 2 E_ref[|grad D|^2]
    (the code halves that whole objective, so the penalty's coefficient there is w_gp / 4)."""
    disc_max_grad_norm: float = 1.0
    """Gradient clipping of the discriminator, after the all_reduce."""
    iterations: int = 500
    """Total learning iterations (PPO's 250 are too few for the adversarial game to settle)."""
    replay_size: int = 100_000
    """Policy transitions kept per rank for the discriminator (a ring buffer; not checkpointed)."""


# ---------------------------------------------------------------------------------------------
# Reference motions, policy transitions, discriminator
# ---------------------------------------------------------------------------------------------


def load_motions(path: str, amp_dim: int, env_dt: float | None = None) -> tuple[torch.Tensor, float]:
    """Read a motion file -> (the consecutive (s, s') pairs of every clip (P, 2 * amp_dim), dt).

    Local: every rank reads the same file, so every rank raises the same error before any collective.
    """
    found = path if os.path.isabs(path) or os.path.isfile(path) else os.path.join(HERE, path)
    if not os.path.isfile(found):
        raise FileNotFoundError(
            f"motion file {path!r} not found (looked in {os.getcwd()} and {HERE}); pass --motion-file, "
            f"or generate the default one with `python data/make_amp_motions.py`."
        )
    with np.load(found, allow_pickle=False) as data:  # arrays only: loading never runs code
        clips = [torch.as_tensor(data[k], dtype=torch.float32) for k in sorted(data.files) if k.startswith("clip_")]
        dt = float(data["dt"]) if "dt" in data.files else float("nan")
    for i, clip in enumerate(clips):
        if clip.ndim != 2 or clip.shape[1] != amp_dim:
            raise ValueError(
                f"motion file {found!r}: clip {i} has AMP observations of size {clip.shape[-1]} (shape "
                f"{tuple(clip.shape)}), but the environment's AMP group has size {amp_dim}; check --amp-obs."
            )
    if sum(max(0, len(clip) - 1) for clip in clips) == 0:
        raise ValueError(f"motion file {found!r} holds no clip of 2+ frames (arrays clip_000, clip_001, ...).")
    if env_dt is not None and not math.isclose(dt, env_dt):
        raise ValueError(f"motion file {found!r} has frames {dt} s apart but the env steps {env_dt} s; resample it.")
    return torch.cat([torch.cat([clip[:-1], clip[1:]], -1) for clip in clips]), dt


def transition_pairs(frames: torch.Tensor, dones: torch.Tensor) -> torch.Tensor:
    """(s_t, s_t+1) of a rollout's AMP frames (T+1, N, d) -> (M, 2d), dropping every t with dones[t].

    After a reset `frames[t + 1]` is the next episode's first frame: such a pair never happened.
    """
    pairs = torch.cat([frames[:-1], frames[1:]], -1)
    return pairs[dones == 0]


@dataclass
class ReplayBuffer:
    """Preallocated ring buffer of policy transitions (capacity, 2 * amp_dim), local to this rank."""

    pairs: torch.Tensor
    size: int = 0
    position: int = 0


def replay_add(replay: ReplayBuffer, pairs: torch.Tensor) -> None:
    """Insert pairs, overwriting the oldest once full."""
    capacity = replay.pairs.shape[0]
    pairs = pairs[-capacity:]
    index = (replay.position + torch.arange(pairs.shape[0], device=pairs.device)) % capacity
    replay.pairs[index] = pairs
    replay.position = (replay.position + pairs.shape[0]) % capacity
    replay.size = min(capacity, replay.size + pairs.shape[0])


class Discriminator(nn.Module):
    """D(s, s'): each frame normalized with running statistics, then an MLP on the pair -> score."""

    def __init__(self, amp_dim: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.normalizer = common.EmpiricalNormalizer(amp_dim)
        self.net = common.mlp(2 * amp_dim, list(hidden), 1, nn.ReLU)

    def normalize(self, pairs: torch.Tensor) -> torch.Tensor:
        """Raw pairs (..., 2d) -> normalized pairs (..., 2d), the input the score is a function of."""
        s, s_next = pairs.chunk(2, dim=-1)
        return torch.cat([self.normalizer(s), self.normalizer(s_next)], -1)

    def forward(self, normalized_pairs: torch.Tensor) -> torch.Tensor:
        """-> scores (...,): near +1 for reference-like transitions, near -1 for the policy's."""
        return self.net(normalized_pairs).squeeze(-1)


def lsgan_loss(reference_scores: torch.Tensor, policy_scores: torch.Tensor) -> torch.Tensor:
    """Least-squares GAN loss with targets +1 (reference) and -1 (policy), averaged over both."""
    return 0.5 * (((reference_scores - 1) ** 2).mean() + ((policy_scores + 1) ** 2).mean())


def gradient_penalty(scores: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """Mean over samples of |d score / d input|^2 (inputs must require grad); differentiable."""
    (grad,) = torch.autograd.grad(scores.sum(), inputs, create_graph=True)
    return grad.pow(2).sum(-1).mean()


def style_reward(scores: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """AMP's style reward `scale * max(0, 1 - 0.25 (d - 1)^2)`: `scale` at d = 1, 0 at d <= -1."""
    return scale * (1 - 0.25 * (scores - 1) ** 2).clamp(min=0)


# ---------------------------------------------------------------------------------------------
# Rollout
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def rollout(
    env: common.VecEnv, actor: common.Actor, critic: common.Critic, obs: dict, buf: common.Rollout,
    amp_frames: torch.Tensor, episodes: common.Episodes, args: Args,
) -> tuple[dict, dict[str, torch.Tensor]]:  # fmt: skip
    """Step the env `steps_per_env` times; fill `buf` (weighted task reward), `amp_frames` (T+1, N, d)
    and `episodes` (unweighted task return) in place. Local to this rank: no communication.

    Returns the next observations and step means of the env's `extras["log"]` and of the task reward.
    """
    logs: dict[str, torch.Tensor] = {}
    for t in range(args.steps_per_env):
        actor_obs = common.observation_group(obs, args.actor_obs, None)
        critic_obs = common.observation_group(obs, args.critic_obs, args.actor_obs)
        amp_frames[t] = common.observation_group(obs, args.amp_obs, "policy")
        mean, std = actor(actor_obs)
        actions = mean + std * torch.randn_like(mean)
        values = critic(critic_obs)
        next_obs, rewards, dones, extras = env.step(actions)
        dones = dones.to(torch.float32)
        buf.actor_obs[t], buf.critic_obs[t], buf.actions[t], buf.values[t] = actor_obs, critic_obs, actions, values
        buf.log_probs[t], buf.means[t], buf.stds[t] = common.gaussian_log_prob(actions, mean, std), mean, std
        time_outs = extras.get("time_outs", torch.zeros_like(dones))
        buf.rewards[t] = common.bootstrap_timeouts(args.task_weight * rewards, values, time_outs, args.gamma)
        buf.dones[t] = dones
        common.track_episodes(episodes, rewards, dones)
        step_logs = {**extras.get("log", {}), "task_reward": rewards.mean()}
        common.accumulate_logs(logs, step_logs, 1 / args.steps_per_env, buf.rewards.device)
        obs = next_obs
    amp_frames[-1] = common.observation_group(obs, args.amp_obs, "policy")
    return obs, logs


# ---------------------------------------------------------------------------------------------
# Update
# ---------------------------------------------------------------------------------------------


def update(
    modules: dict[str, nn.Module], optimizer: torch.optim.Optimizer, disc_optimizer: torch.optim.Optimizer,
    buf: common.Rollout, advantages: torch.Tensor, returns: torch.Tensor, reference: torch.Tensor,
    replay: ReplayBuffer, args: Args, ctx: common.Dist,
) -> dict[str, float]:  # fmt: skip
    """PPO epochs over the rollout, and with every PPO mini-batch one discriminator mini-batch.

    Actor, critic and discriminator gradients are averaged over ranks in ONE all_reduce per
    mini-batch. The learning rates live in the optimizers' param groups. Returns statistics averaged
    over ranks and mini-batches.
    """
    actor, critic, disc = modules.values()
    lr = optimizer.param_groups[0]["lr"]  # a tensor on the device (common.make_adam), changed in place
    batch = common.flatten_rollout(buf, advantages, returns)
    size = advantages.numel()
    ppo_params = [p for module in (actor, critic) for p in module.parameters()]
    disc_params = list(disc.parameters())
    names = ("kl", "surrogate_loss", "value_loss", "entropy", "disc_loss", "grad_penalty", "disc_ref", "disc_policy")
    totals = torch.zeros(len(names), device=ctx.device)
    flags = torch.zeros(ctx.world_size, device=ctx.device)  # which rank's loss went non-finite first
    grad_norm_ok = torch.ones((), dtype=torch.bool, device=ctx.device)
    for _ in range(args.epochs):
        for idx in torch.randperm(size, device=ctx.device).split(size // args.mini_batches)[: args.mini_batches]:
            loss, kl, stats = common.ppo_minibatch_loss(actor, critic, batch, idx, args)
            # Discriminator: reference pairs vs pairs from this rank's replay buffer.
            ref_index = torch.randint(reference.shape[0], (args.disc_batch_size,), device=ctx.device)
            policy_index = torch.randint(replay.size, (args.disc_batch_size,), device=ctx.device)
            ref_in = disc.normalize(reference[ref_index]).requires_grad_(True)
            ref_scores, policy_scores = disc(ref_in), disc(disc.normalize(replay.pairs[policy_index]))
            disc_loss = lsgan_loss(ref_scores, policy_scores)
            penalty = gradient_penalty(ref_scores, ref_in)
            optimizer.zero_grad(set_to_none=False)
            disc_optimizer.zero_grad(set_to_none=False)
            # Disjoint parameters: one backward of the sum gives each module its own loss's gradient.
            # disc_loss is the paper's LSGAN term halved, hence w_gp / 4 rather than w_gp / 2.
            (loss + disc_loss + 0.25 * args.gp_weight * penalty).backward()
            disc_stats = torch.stack([disc_loss, penalty, ref_scores.mean(), policy_scores.mean()]).detach()
            # SYNC: the one collective of the mini-batch. Actor, critic AND discriminator gradients,
            # the KL, the statistics and the non-finite flags are averaged over ranks in one flat
            # buffer: every rank gets the same bits, so all ranks keep training the same policy and
            # the same reward function.
            extras = torch.cat(
                [kl.reshape(1), stats, disc_stats, common.nonfinite_flags(loss + disc_loss + penalty, ctx)]
            )
            reduced = common.all_reduce_gradients(ppo_params + disc_params, ctx.world_size, extras)
            if args.schedule == "adaptive":
                # Every rank applies the rule to the same reduced KL, on the device: no lr broadcast
                # and no host sync are needed.
                lr.copy_(common.adaptive_lr(reduced[0], lr, args.desired_kl))
            # Clip after the all_reduce: clipping the averaged gradient keeps every rank identical.
            grad_norm_ok &= torch.isfinite(nn.utils.clip_grad_norm_(ppo_params, args.max_grad_norm))
            grad_norm_ok &= torch.isfinite(nn.utils.clip_grad_norm_(disc_params, args.disc_max_grad_norm))
            optimizer.step()
            disc_optimizer.step()
            totals += reduced[: len(names)]
            flags = common.first_flags(flags, reduced[len(names) :])
    sources = "the environment, the motion file or the learning rate"
    common.raise_if_update_failed(flags, grad_norm_ok, "PPO or discriminator loss", sources)
    return dict(zip(names, (totals / (args.epochs * args.mini_batches)).tolist()))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


@dataclass
class Start:
    """What a rank builds alone, before it talks to the others."""

    env: common.VecEnv
    obs: dict
    modules: dict[str, nn.Module]  # actor, critic, discriminator
    optimizers: dict[str, torch.optim.Optimizer]  # optimizer (actor + critic), disc_optimizer
    reference: torch.Tensor  # reference (s, s') pairs (P, 2 * amp_dim)
    first_iteration: int
    env_steps: int
    seed: int
    resumed_from: str  # the fingerprint of the checkpoint resumed from, "" for a fresh run


def prepare(args: Args, ctx: common.Dist) -> Start:
    """Check the arguments, read checkpoint and motions, build env and networks: local, no communication."""
    common.check_args(args, ("iterations", "save_interval", "keep_checkpoints", "replay_size"), args.mini_batches)
    required = ("actor", "critic", "discriminator", "optimizer", "disc_optimizer", *common.RESUME_KEYS)
    checkpoint = common.load_checkpoint(args.resume, "ppo_amp", required) if args.resume else None
    start = checkpoint["iteration"] + 1 if checkpoint else 1
    env, seed = common.make_rank_env(args.task, args, ctx, start)
    obs = env.get_observations()
    amp_dim = common.observation_group(obs, args.amp_obs, "policy").shape[-1]
    reference = load_motions(args.motion_file, amp_dim, getattr(env, "dt", None))[0].to(ctx.device)
    modules = common.make_actor_critic(obs, env.num_actions, args, ctx.device)
    actor, critic = modules.values()
    disc = modules["discriminator"] = Discriminator(amp_dim, args.disc_hidden).to(ctx.device)
    optimizers = {
        "optimizer": common.make_adam([*actor.parameters(), *critic.parameters()], args.learning_rate, ctx.device),
        "disc_optimizer": torch.optim.Adam(disc.parameters(), lr=args.disc_learning_rate),
    }
    if checkpoint:
        common.restore_checkpoint(checkpoint, args.resume, modules, optimizers)
    env_steps, resumed_from = (checkpoint["env_steps"], checkpoint["fingerprint"]) if checkpoint else (0, "")
    return Start(env, obs, modules, optimizers, reference, start, env_steps, seed, resumed_from)


def train(args: Args, ctx: common.Dist) -> dict[str, str]:
    """Train on this rank; returns fingerprints of the final trained state (equal on all ranks)."""

    def describe(s: Start) -> str:
        sizes = [m.net[0].in_features for m in s.modules.values()] + [s.env.num_actions]
        motions = common.state_fingerprint([s.reference])
        return repr((dataclasses.asdict(args), sizes, motions, s.first_iteration, s.resumed_from))

    # SYNC: if any rank failed to start (a missing or mismatched motion file, say), or ranks disagree
    # on arguments, sizes, motions or checkpoint, every rank stops here instead of hanging later.
    s = common.start_together(ctx, lambda: prepare(args, ctx), describe, "arguments, sizes, motions or checkpoint")
    env, obs, reference, modules, optimizers = s.env, s.obs, s.reference, s.modules, s.optimizers
    (actor, critic, disc), (optimizer, disc_optimizer) = modules.values(), optimizers.values()
    # SYNC: start every rank from rank 0's weights and normalizer statistics, discriminator included.
    common.broadcast_state([actor, critic, disc], ctx.world_size)

    seeds = [seed[0] for seed in common.all_gather_ints(ctx, [s.seed])]
    run_dir = common.resolve_run_dir(args, "ppo_amp", args.task)
    banner = (
        f"PPO+AMP on {args.task} with {reference.shape[0]} reference transitions: "
        f"{ctx.world_size} process(es) x {args.num_envs} envs on {ctx.device}, seeds {seeds}"
    )
    run = common.start_run(ctx, run_dir, s.first_iteration, args.iterations, s.env_steps, banner)
    actor_dim, critic_dim, amp_dim = actor.net[0].in_features, critic.net[0].in_features, disc.normalizer.mean.numel()
    dims = {"actor": actor_dim, "critic": critic_dim, "amp": amp_dim, "actions": env.num_actions}
    buf = common.make_rollout(args.steps_per_env, args.num_envs, actor_dim, critic_dim, env.num_actions, ctx.device)
    amp_frames = torch.zeros(args.steps_per_env + 1, args.num_envs, amp_dim, device=ctx.device)
    replay = ReplayBuffer(torch.zeros(args.replay_size, 2 * amp_dim, device=ctx.device))
    episodes = common.make_episodes(args.num_envs, ctx.device)
    for it in range(s.first_iteration, args.iterations + 1):
        t0 = time.time()
        obs, env_logs = rollout(env, actor, critic, obs, buf, amp_frames, episodes, args)
        # SYNC: a rank whose environment produced NaN/Inf stops every rank, with its name.
        common.raise_if_nonfinite(
            ctx,
            {"observations": buf.actor_obs, "critic observations": buf.critic_obs, "rewards": buf.rewards,
             "AMP observations": amp_frames},
            f"from the environment at iteration {it}",
        )  # fmt: skip
        replay_add(replay, transition_pairs(amp_frames, buf.dones))
        if it == s.first_iteration:
            # SYNC: the replay only grows, so an empty one is possible only now; stop every rank then.
            empty = "no policy transition: every step of the rollout ended an episode; raise --steps-per-env"
            common.raise_together(ctx, empty if replay.size == 0 else None)
        with torch.inference_mode():
            last_values = critic(common.observation_group(obs, args.critic_obs, args.actor_obs))
            # Style reward of every step with the discriminator as it is now; 0 for reset steps.
            style = style_reward(disc(disc.normalize(torch.cat([amp_frames[:-1], amp_frames[1:]], -1))))
            style *= 1 - buf.dones
            buf.rewards += args.style_weight * style
        env_logs["style_reward"] = style.sum() / (1 - buf.dones).sum().clamp(min=1)
        advantages, returns = common.compute_gae(buf.rewards, buf.values, buf.dones, last_values, args.gamma, args.lam)
        # SYNC: advantages normalized with the mean/std of all ranks (1 all_reduce of 3 numbers).
        advantages = common.normalize_advantages(advantages, ctx.world_size)
        collect_s = time.time() - t0

        losses = update(modules, optimizer, disc_optimizer, buf, advantages, returns, reference, replay, args, ctx)
        # SYNC: normalizer statistics merged over every rank's rollout (1 all_gather each), after the
        # update, so that the update normalizes exactly as its rollout did (ratio starts at 1, and D
        # trains on the inputs its style reward saw).
        if args.normalize_obs:
            actor.normalizer.update(buf.actor_obs, ctx.world_size)
            critic.normalizer.update(buf.critic_obs, ctx.world_size)
        disc.normalizer.update(amp_frames[:-1], ctx.world_size)

        # SYNC: episode statistics, env logs and stop requests of all ranks in one all_reduce.
        timings = {"collect_s": collect_s, "update_s": time.time() - t0 - collect_s}
        steps = args.steps_per_env * args.num_envs * ctx.world_size
        metrics = {"learning_rate": float(optimizer.param_groups[0]["lr"]), **losses}
        stop = common.end_iteration(ctx, run, it, episodes, env_logs, steps, timings, metrics)
        # SYNC: the state check and the checkpoint, each on its iterations (common.check_and_save).
        extra = {"learning_rate": metrics["learning_rate"], "obs_dims": dims}
        common.check_and_save(ctx, run, it, stop, args, "ppo_amp", modules, optimizers, extra)
        if stop:
            break
    if run.writer is not None:
        run.writer.close()
    return {
        "policy": common.state_fingerprint(common.trained_tensors([actor, critic], [optimizer])),
        "discriminator": common.state_fingerprint(common.trained_tensors([disc.net], [disc_optimizer])),
        "disc_normalizer": common.state_fingerprint(common.trained_tensors([disc.normalizer], [])),
    }


def main(args: Args) -> dict[str, str]:
    """Join the process group, train, leave the group (also on error)."""
    with common.distributed(args.device, args.seed, args.dist_timeout_s) as ctx:
        return train(args, ctx)


if __name__ == "__main__":
    main(tyro.cli(Args))
