"""Random Network Distillation (Burda et al. 2018), as rsl_rl 5.5.1's `rsl_rl/extensions/rnd.py`: an
intrinsic reward for novel states. ppo_ddp.py calls it in four places: `make_rnd` at start-up (its
modules join the broadcast, checkpoint and state checks), `rollout_intrinsic_rewards` after the
rollout, `predictor_loss` in the update (the predictor's gradients ride in PPO's one all_reduce per
mini-batch), and its state normalizer in the merge after the update. docs/rnd.md has the formulas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

import common
import envs
import networks
import speedups
from arguments import RndArgs
from extensions.reward_scaling import running_returns


class RND(nn.Module):
    """Random Network Distillation (Burda et al. 2018), as rsl_rl's RandomNetworkDistillation: a
    frozen random target network and a predictor trained to match it on the states the policy
    visits. The predictor errs most on states seldom seen: that error is the intrinsic reward."""

    def __init__(
        self,
        obs_shapes: dict[str, list[int]],
        hidden: Sequence[int],
        outputs: int,
        normalize_states: bool,
        normalize_rewards: bool,
    ) -> None:
        super().__init__()
        self.config = networks.config_of(locals())
        # Both normalizers stop learning after 1e8 samples, as rsl_rl's.
        self.inputs = networks.Inputs(obs_shapes, normalize_states, until=1e8)
        self.target = networks.mlp(self.inputs.width, tuple(hidden), outputs).requires_grad_(False)
        self.predictor = networks.mlp(self.inputs.width, tuple(hidden), outputs)
        # Statistics of the discounted intrinsic return, whose std scales the reward (Burda et al.).
        self.reward_normalizer = (
            common.EmpiricalNormalizer(1, until=1e8) if normalize_rewards else None
        )

    def forward(self, states: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw states, its observation groups (..., dim) -> (predicted, target) embeddings (...,
        outputs)."""
        x = self.inputs(states)
        return self.predictor(x), self.target(x)

    def loss(self, mb: dict[str, Any]) -> torch.Tensor:
        """`predictor_loss(self, mb)`."""
        return predictor_loss(self, mb)


def make_rnd(
    obs: Mapping[str, torch.Tensor], actor_groups: Sequence[str], args: Any, device: torch.device
) -> tuple[RND | None, torch.optim.Optimizer | None]:
    """RND on the groups `--rnd-obs` names (the actor's, `actor_groups`, where the env lacks them)
    and its predictor's Adam, or (None, None) when no weight is above 0. `args`: the script's
    (`args.rnd`, `args.speed`). Local."""
    rnd_args = args.rnd
    if rnd_args.rnd_weight == 0 and (
        rnd_args.rnd_schedule == "constant" or rnd_args.rnd_final_weight == 0
    ):
        return None, None
    start, end = rnd_args.rnd_schedule_steps
    if rnd_args.rnd_schedule != "constant" and not (0 <= start <= end and end > 0):
        raise ValueError(
            f"--rnd-schedule {rnd_args.rnd_schedule} with --rnd-schedule-steps {start} {end}: give "
            "a start of 0 or more and a later end above 0 (the schedule would be at its final "
            "weight at once)."
        )
    groups = envs.resolve_groups(obs, rnd_args.rnd_obs, tuple(actor_groups), "--rnd-obs")
    normalize = (rnd_args.rnd_normalize_states, rnd_args.rnd_normalize_rewards)
    shapes = envs.group_shapes(obs, groups)
    rnd = RND(shapes, rnd_args.rnd_hidden, rnd_args.rnd_outputs, *normalize).to(device)
    fused = speedups.fused_adam(args.speed, device)
    lr = rnd_args.rnd_learning_rate
    return rnd, torch.optim.Adam(rnd.predictor.parameters(), lr=lr, fused=fused)


def rnd_weights(args: RndArgs, steps: torch.Tensor, dt: float) -> torch.Tensor:
    """The intrinsic reward's weight at each of `steps` (float, env steps per env since the start),
    rsl_rl's schedules, times the env's step length `dt` (rsl_rl scales only the first weight)."""
    start, end = args.rnd_schedule_steps
    first, final = args.rnd_weight * dt, args.rnd_final_weight * dt
    if args.rnd_schedule == "step":
        return torch.where(steps < end, first, final)
    if args.rnd_schedule == "linear":
        progress = ((steps - start) / max(end - start, 1)).clamp(0, 1)
        return first + (final - first) * progress
    return torch.full_like(steps, first)


@torch.no_grad()
def intrinsic_rewards(
    rnd: RND,
    next_states: Mapping[str, torch.Tensor],
    weights: torch.Tensor,
    running_return: torch.Tensor,
    gamma: float,
    world_size: int,
) -> torch.Tensor:
    """RND's reward for every step of a rollout, `weight * |target(s') - predictor(s')|` with s' the
    state the step led to, (T, N). With reward normalization, divided by the std of the discounted
    intrinsic return, whose statistics take in this rollout first (`running_return` (N,), per env,
    is carried over from rollout to rollout; it never resets, the intrinsic reward is not episodic).
    """
    predicted, target = rnd(next_states)
    rewards = (target - predicted).norm(dim=-1)
    if rnd.reward_normalizer is not None:
        returns = running_returns(rewards, running_return, gamma)
        # SYNC: the return statistics cover every rank's rollout (1 all_gather), so every rank
        # scales alike.
        common.update_normalizers([(rnd.reward_normalizer, returns)], world_size)
        std = rnd.reward_normalizer.var.sqrt().to(rewards.dtype)
        rewards = torch.where(std > 0, rewards / std, rewards)
    return weights[:, None] * rewards


def rollout_intrinsic_rewards(
    rnd: RND | None,
    buf: Any,
    obs: Mapping[str, torch.Tensor],
    running_return: torch.Tensor,
    it: int,
    env: Any,
    args: RndArgs,
    ctx: common.Dist,
    logs: dict[str, torch.Tensor],
) -> torch.Tensor | None:
    """`intrinsic_rewards` of the rollout `buf` (its observation groups (T, N, ...) and rewards)
    whose last step led to `obs` -> rewards (T, N), logged into `logs` with the env's and the
    weight; None without RND. rsl_rl's step counter: step t of iteration `it` is (it - 1) T + t + 1,
    the weight per second times the env's `dt`. One all_gather with reward normalization, else
    local."""
    if rnd is None:
        return None
    next_states = {
        group: torch.cat([buf.obs[group][1:], obs[group][None]]) for group in rnd.inputs.shapes
    }
    steps_per_env = buf.rewards.shape[0]
    steps = (it - 1) * steps_per_env + torch.arange(
        1, steps_per_env + 1, device=running_return.device
    )
    dt = envs.step_dt(env)
    weights = rnd_weights(args, steps.to(torch.float32), 1.0 if dt is None else dt)
    # The intrinsic return's discount is rsl_rl's fixed 0.99, whatever --gamma.
    intrinsic = intrinsic_rewards(rnd, next_states, weights, running_return, 0.99, ctx.world_size)
    logs.update(
        extrinsic_reward=buf.rewards.mean(),
        intrinsic_reward=intrinsic.mean(),
        rnd_weight=weights[-1],
    )
    return intrinsic


def predictor_loss(rnd: RND, mb: dict[str, Any]) -> torch.Tensor:
    """The predictor's loss on a PPO mini-batch: mean squared error to the frozen target's
    embedding, on the mini-batch's own rows only (symmetry's mirrored copies follow them). Local."""
    rows = mb["means"].shape[0]
    predicted, target = rnd({group: mb["obs"][group][:rows] for group in rnd.inputs.shapes})
    return nn.functional.mse_loss(predicted, target)
