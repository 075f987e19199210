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

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import bookkeeping
import common
import cuda_graphs
import envs
import extensions
import ppo_ddp as ppo
from common import Count, NonNegative, Positive

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
    task_weight: NonNegative = 0.005
    """Weight of the task reward in the mixed reward `task_weight * task + style_weight * style` (docs/amp.md:
    why the pendulum's is 200 times below the style's)."""
    style_weight: NonNegative = 1.0
    """Weight of the style reward, which is in [0, 1] per step."""
    disc_hidden: tuple[int, ...] = (128, 128)
    """Hidden layer widths of the discriminator MLP (ReLU activations)."""
    disc_learning_rate: Positive = 5e-4
    """Adam learning rate of the discriminator (fixed)."""
    disc_batch_size: Count = 512
    """Reference and policy pairs (each) per rank in every discriminator mini-batch."""
    gp_weight: NonNegative = 10.0
    """w_gp of the AMP paper: D minimizes E_ref[(D - 1)^2] + E_policy[(D + 1)^2] + w_gp / 2 E_ref[|grad D|^2]
    (the code halves that whole objective, so the penalty's coefficient there is w_gp / 4)."""
    disc_max_grad_norm: Positive = 1.0
    """Gradient clipping of the discriminator, after the all_reduce."""
    iterations: Count = 500
    """Total learning iterations (PPO's 250 are too few for the adversarial game to settle)."""
    replay_size: Count = 100_000
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

    def __init__(self, amp_dim: int, hidden: Sequence[int]) -> None:
        super().__init__()
        self.config = common.constructor_config(locals())
        self.normalizer = common.EmpiricalNormalizer(amp_dim)
        self.net = common.mlp(2 * amp_dim, tuple(hidden), 1, nn.ReLU)

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


# --compile leaves it eager: the gradient penalty differentiates through the discriminator twice (create_graph),
# which a compiled graph's backward cannot.
@torch.compiler.disable
def discriminator_loss(
    disc: Discriminator, reference: torch.Tensor, replay: ReplayBuffer, index: dict[str, torch.Tensor], args: Args
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One discriminator mini-batch, the reference pairs against this rank's replay pairs that `index`
    picks -> (loss, {LSGAN loss, gradient penalty, mean reference score, mean policy score}). Local."""
    ref_index, policy_index = index["reference"], index["policy"]
    ref_in = disc.normalize(reference[ref_index]).requires_grad_(True)
    ref_scores, policy_scores = disc(ref_in), disc(disc.normalize(replay.pairs[policy_index]))
    loss = lsgan_loss(ref_scores, policy_scores)
    penalty = gradient_penalty(ref_scores, ref_in)
    stats = {
        "disc_loss": loss,
        "grad_penalty": penalty,
        "disc_ref": ref_scores.mean(),
        "disc_policy": policy_scores.mean(),
    }
    stats = {name: value.detach() for name, value in stats.items()}
    # lsgan_loss is the paper's LSGAN term halved, hence w_gp / 4 on the penalty rather than w_gp / 2.
    return loss + 0.25 * args.gp_weight * penalty, stats


def discriminator_side_loss(
    disc: Discriminator, optimizer: torch.optim.Optimizer, reference: torch.Tensor, replay: ReplayBuffer, args: Args
) -> extensions.SideLoss:
    """The discriminator as a side loss of ppo_ddp's update: one discriminator mini-batch with every PPO
    mini-batch, its gradients in the same all_reduce as the actor's and critic's. Its rows are drawn
    before each step (the replay's filled size changes while a CUDA graph of the step would not)."""
    index = {
        side: torch.zeros(args.disc_batch_size, dtype=torch.long, device=reference.device)
        for side in ("reference", "policy")
    }
    loss = lambda mb: discriminator_loss(disc, reference, replay, index, args)  # noqa: E731 - its own batch
    draw = lambda: draw_disc_batch(index, reference, replay)  # noqa: E731
    return extensions.SideLoss(loss, optimizer, args.disc_max_grad_norm, "disc", "the motion file", draw)


# --- AMP's parts at ppo_ddp.train's seams -----------------------------------------------------------


def plug_in(
    args: Args, env: envs.VecEnv, obs: Mapping[str, torch.Tensor], ctx: common.Dist, graphs: bool
) -> extensions.Plugin:
    """The discriminator, its optimizer, the reference motions and the replay, at PPO's seams (`extensions.Plugin`):
    its loss in every mini-batch step, its style reward mixed with the task's, its normalizer merged. Local."""
    (group,) = envs.resolve_groups(obs, (args.amp_obs,), ("policy",), "--amp-obs")
    amp_dim = obs[group].shape[-1]
    device = ctx.device
    reference = load_motions(args.motion_file, amp_dim, envs.step_dt(env))[0].to(device)
    disc = Discriminator(amp_dim, args.disc_hidden).to(device)
    fused = cuda_graphs.fused_adam(args.compile, device)  # under --compile on CPU
    disc_optimizer = torch.optim.Adam(disc.parameters(), lr=args.disc_learning_rate, capturable=graphs, fused=fused)
    replay = ReplayBuffer(torch.zeros(args.replay_size, 2 * amp_dim, device=device))
    style = torch.zeros(args.steps_per_env, args.num_envs, device=device)  # the rollout's, written after it
    checked: list[int] = []  # the first iteration of this run, once its replay was checked

    def after_rollout(buf: ppo.Rollout, next_obs: Mapping[str, torch.Tensor], it: int, env_logs: dict) -> None:
        """The rollout's transitions to the replay (every rank stops if one has none yet: 1 all_gather, at the
        first iteration only), and the style reward of every step with the discriminator as it is now."""
        frames = torch.cat([buf.obs[group], next_obs[group][None]])  # (T + 1, N, amp_dim)
        replay_add(replay, transition_pairs(frames, buf.dones))
        if not checked:
            checked.append(it)
            # SYNC: the replay only grows, so it can be empty only now, and only its rank sees that:
            # every rank learns of it (1 all_gather) and all stop together.
            empty = [r for r, (flag,) in enumerate(common.all_gather_ints(ctx, [int(replay.size == 0)])) if flag]
            if empty:
                raise common.Failure(
                    f"rank(s) {empty} collected no policy transition: every step of the rollout ended an "
                    "episode; AMP needs episodes of 2 steps or more: check the env's terminations and time limit."
                )
        with torch.inference_mode():  # 0 for reset steps: such a pair never happened
            style.copy_(style_reward(disc(disc.normalize(torch.cat([frames[:-1], frames[1:]], -1)))) * (1 - buf.dones))
        env_logs["style_reward"] = style.sum() / (1 - buf.dones).sum().clamp(min=1)
        env_logs["task_reward"] = sum(buf.rewards[t].mean() * (1 / args.steps_per_env) for t in range(len(buf.rewards)))

    def mix_rewards(task: torch.Tensor, bootstrap: torch.Tensor, intrinsic: torch.Tensor | None) -> torch.Tensor:
        """`task_weight * task + style_weight * style`, time-outs bootstrapped on the weighted task reward
        as in ppo_ddp.py, RND's intrinsic reward last."""
        rewards = args.task_weight * task + bootstrap
        rewards += args.style_weight * style
        return rewards if intrinsic is None else rewards + intrinsic

    return extensions.Plugin(
        {"discriminator": disc}, {"disc_optimizer": disc_optimizer}, (group,),
        discriminator_side_loss(disc, disc_optimizer, reference, replay, args), after_rollout, mix_rewards,
        lambda buf: [(disc.normalizer, buf.obs[group])], common.state_fingerprint([reference]),
        f" with {reference.shape[0]} reference transitions",
    )  # fmt: skip


AMP = dataclasses.replace(ppo.PPO, script="ppo_amp", title=lambda args: "PPO+AMP", plug_in=plug_in)  # ppo_ddp.train


def main(args: Args) -> str:
    """Join the process group, train (ppo_ddp.train with AMP's parts), leave the group (also on error)."""
    return ppo.main(args, AMP)


if __name__ == "__main__":
    bookkeeping.cli(main, Args, envs.task_defaults)  # a task family may bring settings of its own (envs/)
