"""Reward scaling, as CleanRL's MuJoCo PPO does it with Gymnasium's `NormalizeReward` and a clip:
each reward divided by the running std of the discounted return, then clipped at `--reward-clip`.
Off by default (rsl_rl's tasks come with rewards their designers scaled); Gymnasium's MuJoCo tasks
bring it on (envs/gymnasium.py), since their returns run into the thousands.

ppo_ddp.py calls it in three places: `make_scaler` at start-up (its statistics join the broadcast,
checkpoint and state checks), `scale_rewards` after the rollout, and `normalizer_batch` in the
normalizer merge after the update. Across ranks: the statistics cover every rank's returns, merged
in the normalizers' one all_gather after the update, so scaling adds no collective; every rank
divides by the same std. The price is a lag of one rollout: the rewards of a rollout are divided by
the std of the returns up to the one before (CleanRL folds in each step before dividing; the first
rollout here is divided by 1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import common


class RewardScaler(nn.Module):
    """The discounted return's statistics over every rank (the state: broadcast, saved and compared
    like the networks'), and outside the state this rank's running return per env and the rollout's
    returns."""

    def scale(self, rewards: torch.Tensor, dones: torch.Tensor) -> torch.Tensor:
        """`scale_rewards(self, rewards, dones)`."""
        return scale_rewards(self, rewards, dones)

    def __init__(self, num_envs: int, steps: int, gamma: float, clip: float) -> None:
        super().__init__()
        self.gamma, self.clip = gamma, clip
        self.normalizer = common.EmpiricalNormalizer(1)
        # Per rank and per episode: not part of the state ranks share (a resumed run restarts them
        # at 0).
        self.register_buffer("running", torch.zeros(num_envs), persistent=False)
        self.register_buffer("returns", torch.zeros(steps, num_envs), persistent=False)


def make_scaler(args: Any, device: torch.device) -> RewardScaler | None:
    """With `--scale-rewards`, a RewardScaler for this rank's envs (its statistics are broadcast,
    saved and checked as the networks' are); None without. `args`: the script's. Local."""
    if not args.scaling.scale_rewards:
        return None
    scaler = RewardScaler(args.num_envs, args.steps_per_env, args.gamma, args.scaling.reward_clip)
    return scaler.to(device)


def running_returns(
    rewards: torch.Tensor, running: torch.Tensor, gamma: float, dones: torch.Tensor | None = None
) -> torch.Tensor:
    """The discounted return so far at every step of a rollout (T, N): `running` (N,), carried over
    from rollout to rollout, becomes `gamma * running + r` at each step and, with `dones`, restarts
    after an episode's last step. In place on `running`; local."""
    returns = torch.zeros_like(rewards)
    for t in range(rewards.shape[0]):
        returns[t] = running.mul_(gamma).add_(rewards[t])
        if dones is not None:
            running.mul_(1 - dones[t])
    return returns


@torch.no_grad()
def scale_rewards(
    scaler: RewardScaler | None, rewards: torch.Tensor, dones: torch.Tensor
) -> torch.Tensor:
    """A rollout's rewards (T, N) divided by the std of the discounted return, `sqrt(var + 1e-8)` as
    Gymnasium's NormalizeReward, and clipped at +-clip; `rewards` itself when `scaler` is None. The
    statistics are those merged after the previous update; this rollout's returns are kept for the
    next merge (`normalizer_batch`). Local."""
    if scaler is None:
        return rewards
    scaler.returns.copy_(running_returns(rewards, scaler.running, scaler.gamma, dones))
    std = (scaler.normalizer.var + 1e-8).sqrt().to(rewards.dtype)
    return (rewards / std).clamp(-scaler.clip, scaler.clip)


def normalizer_batch(
    scaler: RewardScaler | None,
) -> list[tuple[common.EmpiricalNormalizer, torch.Tensor]]:
    """The return statistics and the rollout's returns, for `common.update_normalizers`; [] without
    a scaler."""
    return [] if scaler is None else [(scaler.normalizer, scaler.returns)]
