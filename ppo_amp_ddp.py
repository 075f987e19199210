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
    torchrun --standalone --nproc_per_node=2 ppo_amp_ddp.py --resume runs/ppo_amp_pendulum/<time> --iterations 1000
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import bookkeeping
import checkpoints
import cnn
import common
import cuda_graphs
import envs
import extensions.reward_scaling
import extensions.rnd
import extensions.symmetry
import ppo_ddp as ppo

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Args(ppo.Args):
    """AMP on top of PPO (ppo_ddp.Args: rsl_rl's defaults); sizes are per process."""

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
    task must weigh about 200x less than the style for the style to win (docs/amp.md: the runs)."""
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


# --- Reference motions, policy transitions, discriminator -----------------------------------------


def load_motions(path: str, amp_dim: int, env_dt: float | None = None) -> tuple[torch.Tensor, float]:
    """Read a motion file -> (the consecutive (s, s') pairs of every clip (P, 2 * amp_dim), dt).

    Local: every rank reads the same file, so every rank raises the same error before any collective.
    """
    found = path if os.path.isabs(path) or os.path.isfile(path) else os.path.join(HERE, path)
    if not os.path.isfile(found):
        places = {os.path.abspath(path), os.path.abspath(found)}  # one place for an absolute path
        raise FileNotFoundError(
            f"motion file {path!r} not found (looked for {' and '.join(sorted(places))}): check the path given to "
            "--motion-file, or make the default one with `python data/make_amp_motions.py`."
        )
    arrays = None
    try:
        loaded = np.load(found, allow_pickle=False)  # arrays only: loading never runs code
        if hasattr(loaded, "files"):  # an .npz archive, not a single .npy array
            with loaded:
                arrays = {k: loaded[k] for k in loaded.files}
    except (OSError, ValueError):  # not a numpy file at all, or an array of Python objects
        pass
    if arrays is None or any(a.dtype.kind not in "fiu" for a in arrays.values()):
        raise ValueError(
            f"motion file {found!r} is not an .npz archive of numeric arrays; write one as data/make_amp_motions.py does."
        )
    dt = arrays.get("dt")
    if dt is None or dt.shape != () or not np.isfinite(dt) or dt <= 0:
        found_dt = "none" if dt is None else f"shape {dt.shape}" if dt.shape else f"{dt.item()}"
        raise ValueError(
            f"motion file {found!r}: `dt` must be a positive number, the seconds between frames (found {found_dt}); "
            "save it as a scalar array, as data/make_amp_motions.py does."
        )
    clips = [torch.as_tensor(arrays[k], dtype=torch.float32) for k in sorted(arrays) if k.startswith("clip_")]
    for i, clip in enumerate(clips):
        if clip.ndim != 2 or clip.shape[1] != amp_dim:
            raise ValueError(
                f"motion file {found!r}: clip {i} has shape {tuple(clip.shape)}, but each clip must be 2-D, "
                f"(frames, amp_dim) with amp_dim {amp_dim}, the size of the environment's AMP group; check --amp-obs."
            )
    if sum(max(0, len(clip) - 1) for clip in clips) == 0:
        raise ValueError(
            f"motion file {found!r} holds no clip of 2+ frames (arrays clip_000, clip_001, ...); add at least one, "
            "as data/make_amp_motions.py writes them."
        )
    dt = float(dt)
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
        self.net = common.mlp(2 * amp_dim, hidden, 1, nn.ReLU)

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


def draw_disc_batch(index: dict[str, torch.Tensor], reference: torch.Tensor, replay: ReplayBuffer) -> None:
    """Fill `index` with the next discriminator mini-batch's rows, uniform over the reference pairs and
    over the replay's filled part (`torch.randint`'s draws, written in place). Local."""
    index["reference"].random_(0, reference.shape[0])
    index["policy"].random_(0, replay.size)


def discriminator_loss(
    disc: Discriminator, reference: torch.Tensor, replay: ReplayBuffer, index: dict[str, torch.Tensor], args: Args
) -> tuple[torch.Tensor, torch.Tensor]:
    """One discriminator mini-batch, the reference pairs against this rank's replay pairs that `index`
    picks -> (loss, [LSGAN loss, gradient penalty, mean reference score, mean policy score]). Local."""
    ref_index, policy_index = index["reference"], index["policy"]
    ref_in = disc.normalize(reference[ref_index]).requires_grad_(True)
    ref_scores, policy_scores = disc(ref_in), disc(disc.normalize(replay.pairs[policy_index]))
    loss = lsgan_loss(ref_scores, policy_scores)
    penalty = gradient_penalty(ref_scores, ref_in)
    stats = torch.stack([loss, penalty, ref_scores.mean(), policy_scores.mean()]).detach()
    # lsgan_loss is the paper's LSGAN term halved, hence w_gp / 4 on the penalty rather than w_gp / 2.
    return loss + 0.25 * args.gp_weight * penalty, stats


def discriminator_side_loss(
    disc: Discriminator, optimizer: torch.optim.Optimizer, reference: torch.Tensor, replay: ReplayBuffer, args: Args
) -> extensions.SideLoss:
    """The discriminator as a side loss of ppo_ddp's update: one discriminator mini-batch with every PPO
    mini-batch, its gradients in the same all_reduce as the actor's and critic's. Its rows are drawn
    before each step (the replay's filled size changes while a CUDA graph of the step would not)."""
    names = ("disc_loss", "grad_penalty", "disc_ref", "disc_policy")
    index = {
        side: torch.zeros(args.disc_batch_size, dtype=torch.long, device=reference.device)
        for side in ("reference", "policy")
    }
    loss = lambda mb: discriminator_loss(disc, reference, replay, index, args)  # noqa: E731 - its own batch
    draw = lambda: draw_disc_batch(index, reference, replay)  # noqa: E731
    return extensions.SideLoss(loss, names, optimizer, args.disc_max_grad_norm, "disc", "the motion file", draw)


# --- Process group, then the training loop: ppo_ddp.train plus replay, style reward, discriminator -


def main(args: Args) -> dict[str, str]:
    """Join the process group, train, leave the group (also on error)."""
    with common.distributed(args.device, args.seed, args.dist_timeout_s, args.start_timeout_s) as ctx:
        return train(args, ctx)


def train(args: Args, ctx: common.Dist) -> dict[str, str]:
    """Train on this rank; returns fingerprints of the final trained state (equal on all ranks)."""
    # SYNC: each rank checks its arguments, reads checkpoint and motions and builds env and networks
    # alone, then all compare notes (1 all_gather): if one failed (a missing or mismatched motion
    # file, say) or ranks disagree, every rank stops here instead of hanging or diverging later.
    with common.start_together(ctx, args, "sizes, motions or checkpoint") as agree:
        bookkeeping.check_args(
            args, (*ppo.PPO_COUNTS, "replay_size", "disc_batch_size"),
            (*ppo.PPO_POSITIVE, "disc_learning_rate", "disc_max_grad_norm"),
            (*ppo.PPO_NON_NEGATIVE, "task_weight", "style_weight", "gp_weight"), ("gamma", "lam"), args.mini_batches,
        )  # fmt: skip
        parts = ("actor", "critic", "discriminator", "optimizer", "disc_optimizer")
        resume, env, obs = bookkeeping.start_rank(args, ctx, "ppo_amp", parts)
        groups, actor, critic = ppo.make_networks(obs, env.num_actions, args, ctx.device)
        groups["amp"] = envs.resolve_groups(obs, (args.amp_obs,), ("policy",), "--amp-obs")
        graphs = cuda_graphs.use_cuda_graphs(args.cuda_graphs, ctx.device, ctx.is_main)  # on CUDA only; else a note
        rnd, rnd_optimizer = extensions.rnd.make_rnd(obs, groups, args, ctx.device, graphs)  # (None, None): no RND
        mirror = extensions.symmetry.load_mirror(args, env, obs, groups, env.num_actions)  # None: no --symmetry
        dims = {network: envs.concat(obs, g).shape[-1] for network, g in groups.items()}
        reference = load_motions(args.motion_file, dims["amp"], envs.step_dt(env))[0].to(ctx.device)
        disc = Discriminator(dims["amp"], args.disc_hidden).to(ctx.device)
        optimizer = common.make_adam(
            [*actor.parameters(), *critic.parameters()], args.learning_rate, ctx.device, graphs
        )
        disc_optimizer = torch.optim.Adam(disc.parameters(), lr=args.disc_learning_rate, capturable=graphs)
        modules = {"actor": actor, "critic": critic, "discriminator": disc}
        trained = checkpoints.Trained("ppo_amp", modules, {"optimizer": optimizer, "disc_optimizer": disc_optimizer})
        if rnd is not None:
            trained.modules["rnd"], trained.optimizers["rnd_optimizer"] = rnd, rnd_optimizer
        scaler = extensions.reward_scaling.make_scaler(args, ctx.device, trained.modules)  # None: off
        checkpoints.restore(resume, trained, args)  # a fresh start: nothing to restore
        motions = common.state_fingerprint([reference])
        agree(dims, env.num_actions, motions, resume.first_iteration, resume.fingerprint)
    # SYNC: start every rank from rank 0's weights and normalizer statistics, discriminator (and RND) included.
    common.broadcast_state([*trained.modules.values()], ctx.world_size)

    # SYNC: every rank stops if rank 0 cannot write the run directory (1 all_gather).
    title = f"PPO+AMP on {args.task} with {reference.shape[0]} reference transitions"
    saved_with = {"obs_dims": {**dims, "actions": env.num_actions}, "images": cnn.image_shapes(obs, *groups.values())}
    run_log = bookkeeping.start_run(ctx, args, trained, title, resume, saved_with)
    buf = ppo.make_rollout(args.steps_per_env, args.num_envs, dims, env.num_actions, ctx.device)
    replay = ReplayBuffer(torch.zeros(args.replay_size, 2 * dims["amp"], device=ctx.device))
    sides = (discriminator_side_loss(disc, disc_optimizer, reference, replay, args),)
    sides += (extensions.rnd.rnd_side_loss(rnd, rnd_optimizer),) if rnd is not None else ()
    sides += (extensions.symmetry.symmetry_side_loss(mirror, actor, args),) if mirror is not None else ()
    intrinsic_return = torch.zeros(args.num_envs, device=ctx.device)  # RND's reward normalization, per env
    episodes = envs.make_episodes(args.num_envs, ctx.device, env.episode_length_buf)
    # The two steps an iteration repeats, built once: with --cuda-graphs each is captured and replayed.
    policy_step = cuda_graphs.cuda_graph(functools.partial(ppo.act, actor, critic), graphs)
    update = ppo.make_update(actor, critic, optimizer, ppo.rollout_batch(buf), args, ctx, sides, graphs)
    for it in range(resume.first_iteration, args.iterations + 1):
        t0 = time.time()
        # COLLECT: PPO's rollout, which also records the AMP group of every step
        obs, env_logs = ppo.rollout(env, policy_step, obs, groups, buf, episodes, args)
        frames = torch.cat([buf.obs["amp"], envs.concat(obs, groups["amp"])[None]])  # (T + 1, N, amp_dim)
        # SYNC: a rank whose environment produced NaN/Inf stops every rank, with its name (1 all_reduce).
        inputs = {"observations": buf.obs["actor"], "critic observations": buf.obs["critic"], "rewards": buf.rewards}
        inputs.update({"AMP observations": frames, **({"RND observations": buf.obs["rnd"]} if rnd is not None else {})})
        common.raise_if_nonfinite(ctx, inputs, f"from the environment at iteration {it}")
        replay_add(replay, transition_pairs(frames, buf.dones))
        if it == resume.first_iteration:
            # SYNC: the replay only grows, so it can be empty only now, and only its rank sees that:
            # every rank learns of it (1 all_gather) and all stop together.
            empty = [r for r, (flag,) in enumerate(common.all_gather_ints(ctx, [int(replay.size == 0)])) if flag]
            if empty:
                raise common.Failure(
                    f"rank(s) {empty} collected no policy transition: every step of the rollout ended an "
                    "episode; AMP needs episodes of 2 steps or more: check the env's terminations and time limit."
                )

        # STYLE REWARD, mixed with the task reward
        with torch.inference_mode():
            last_values = critic(envs.concat(obs, groups["critic"]))
            # Style reward of every step with the discriminator as it is now; 0 for reset steps.
            style = style_reward(disc(disc.normalize(torch.cat([frames[:-1], frames[1:]], -1))))
            style *= 1 - buf.dones
        env_logs["style_reward"] = style.sum() / (1 - buf.dones).sum().clamp(min=1)
        env_logs["task_reward"] = sum(buf.rewards[t].mean() * (1 / args.steps_per_env) for t in range(len(buf.rewards)))
        # Time-outs bootstrapped as in ppo_ddp.py, on the weighted task reward.
        task = extensions.reward_scaling.scale_rewards(scaler, buf.rewards, buf.dones)  # --scale-rewards; local
        rewards = args.task_weight * task + args.gamma * buf.values * buf.time_outs
        rewards += args.style_weight * style
        if rnd is not None:
            # INTRINSIC REWARD (RND), as in ppo_ddp.py. SYNC (with --rnd-normalize-rewards): 1 all_gather.
            intrinsic, weight = extensions.rnd.rollout_intrinsic_rewards(
                rnd, buf.obs["rnd"], obs, groups["rnd"], intrinsic_return, it, envs.step_dt(env), args, ctx.world_size
            )
            rewards += intrinsic
            env_logs.update(intrinsic_reward=intrinsic.mean(), rnd_weight=weight)

        # ADVANTAGES
        # SYNC: GAE, its advantages normalized with the mean and std of all ranks (1 all_reduce of 3 numbers).
        ppo.write_advantages(buf, rewards, last_values, args, ctx.world_size)
        collect_s = time.time() - t0

        # UPDATE: actor, critic, discriminator (and RND's predictor, symmetry), one all_reduce per mini-batch
        ppo.linear_lr(optimizer, args, it)  # --schedule linear; the same on every rank: local
        losses = update()
        # SYNC: normalizer statistics merged over every rank's rollout (1 all_gather for all of them),
        # after the update, so that the update normalizes exactly as its rollout did (ratio starts at 1,
        # and D trains on the inputs its style reward saw).
        normalized = [*ppo.normalizer_batches(actor, critic, rnd, buf, scaler), (disc.normalizer, buf.obs["amp"])]
        common.update_normalizers(normalized, ctx.world_size)

        # LOG, CHECK, SAVE. SYNC: the iteration's statistics (1 all_reduce), then the state check and the save
        # (1 all_gather each, when due), in one order on every rank: bookkeeping.end_iteration.
        metrics = {"learning_rate": float(optimizer.param_groups[0]["lr"]), **losses}
        if bookkeeping.end_iteration(ctx, run_log, it, episodes, env_logs, metrics, t0, collect_s):
            break
    bookkeeping.finish_run(ctx, run_log)
    return {
        "policy": common.fingerprint([actor, critic], [optimizer]),
        "discriminator": common.fingerprint([disc.net], [disc_optimizer]),
        "disc_normalizer": common.fingerprint([disc.normalizer], []),
        **({"rnd": common.fingerprint([rnd], [rnd_optimizer])} if rnd else {}),
    }


if __name__ == "__main__":
    bookkeeping.cli(main, Args, envs.task_defaults)  # a task family may bring settings of its own (envs/)
