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

    def angle(self) -> torch.Tensor:
        """(cos th, sin th) of every env, without noise -> (num_envs, 2)."""
        return torch.stack([self.theta.cos(), self.theta.sin()], -1)

    def get_observations(self) -> dict[str, torch.Tensor]:
        """The `policy` group: the angle's cosine and sine, each with fresh sensor noise (kept in
        `sensor_noise`)."""
        shape = (self.num_envs, 2)
        self.sensor_noise = self.noise * torch.randn(
            shape, generator=self.generator, device=self.device
        )
        return {"policy": self.angle() + self.sensor_noise}

    def final_observations(self) -> dict[str, torch.Tensor]:
        """The angle before the reset, without noise: `step` adds the noise of the observation it
        returns, so that the random stream stays that of the observations."""
        return {"policy": self.angle()}

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """Pendulum step; the final observation takes this step's sensor noise."""
        obs, rewards, dones, extras = super().step(actions)
        extras["final_obs"]["policy"] = extras["final_obs"]["policy"] + self.sensor_noise
        return obs, rewards, dones, extras
