"""`pendulum_angle`: Pendulum-v1 seen through a noisy angle sensor alone (the task that needs
memory)."""

from __future__ import annotations

import torch

from envs.pendulum import Pendulum


class PendulumAngle(Pendulum):
    """Pendulum-v1 (dynamics, reward, start state, 200-step limit) whose one observation group is
    `policy` (2) = (cos th, sin th) + N(0, 0.02^2) noise: no velocity and no history. From one frame
    a policy cannot tell which way the pendulum swings, or how fast; from successive frames it can.
    """

    noise = 0.02

    def get_observations(self) -> dict[str, torch.Tensor]:
        """The `policy` group: the angle's cosine and sine, each with fresh sensor noise."""
        clean = torch.stack([self.theta.cos(), self.theta.sin()], -1)
        return {
            "policy": clean
            + self.noise * torch.randn(clean.shape, generator=self.generator, device=self.device)
        }
