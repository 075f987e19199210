"""`pendulum_sparse`: Pendulum-v1's dynamics, a weaker motor and a reward paid only near upright."""

from __future__ import annotations

import math

import torch

from envs.pendulum import Pendulum, angle_normalize


class PendulumSparse(Pendulum):
    """Pendulum-v1's dynamics and 200-step limit with a sparse reward: the exploration task of RND.

    Every episode starts at rest, hanging straight down. Reward per step: 1 when the step starts
    within `upright` rad of the top, minus `torque_cost * torque^2`. The motor (`max_torque` 1, half
    of Pendulum-v1's) cannot lift the pendulum directly: it takes several swings that pump energy
    in, and until the first swing-up the only signal is the torque cost, which teaches a policy to
    hang still. Plain PPO settles there (return 0); the best policies swing up within about 100
    steps and balance (return about 100).
    """

    max_torque, upright, torque_cost = 1.0, 0.3, 0.05

    def reset_where(self, mask: torch.Tensor) -> None:
        """At rest, straight down, where `mask` is true."""
        super().reset_where(mask)
        self.theta = self.theta.masked_fill(mask, math.pi)
        self.theta_dot = self.theta_dot.masked_fill(mask, 0.0)
        self.was_down = self.was_down | mask

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """Pendulum step; the reward is of the state the step starts from, as Pendulum-v1's cost."""
        torque = actions.reshape(self.num_envs, -1)[:, 0].clamp(-self.max_torque, self.max_torque)
        upright = (angle_normalize(self.theta).abs() < self.upright).float()
        obs, _, dones, extras = super().step(actions)
        return obs, upright - self.torque_cost * torque**2, dones, extras
