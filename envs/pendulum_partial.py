"""`pendulum_partial`: Pendulum-v1 with randomized physics, partially observed (the distillation
task)."""

from __future__ import annotations

import torch

from envs.pendulum import Pendulum


class PendulumPartial(Pendulum):
    """Pendulum-v1 with randomized physics, seen partially: the distillation task.

    Mass and length are drawn per episode from U(0.7, 1.3) x nominal. Groups: `teacher` (5) =
    cos th, sin th, thdot, mass, length (privileged); `policy` (9) = the last 4 frames of
    (cos th, sin th) with N(0, 0.02) noise, and the last torque: what a robot with only an angle
    encoder would have.
    """

    history, noise = 4, 0.02

    def allocate(self) -> None:
        """Frame history and last action."""
        self.frames = torch.zeros(self.num_envs, self.history, 2, device=self.device)
        self.last_torque = torch.zeros(self.num_envs, device=self.device)

    def reset_where(self, mask: torch.Tensor) -> None:
        """Gymnasium's start state, new physics, a history filled with the first frame, where `mask`
        is true."""
        super().reset_where(mask)
        u = torch.rand(2, self.num_envs, generator=self.generator, device=self.device)
        self.mass = torch.where(mask, self.m * (0.7 + 0.6 * u[0]), self.mass)
        self.length = torch.where(mask, self.l * (0.7 + 0.6 * u[1]), self.length)
        self.frames = torch.where(mask[:, None, None], self.noisy_frame()[:, None], self.frames)
        self.last_torque = self.last_torque.masked_fill(mask, 0.0)

    def frame_noise(self) -> torch.Tensor:
        """A fresh draw of the sensor's noise -> (num_envs, 2)."""
        shape = (self.num_envs, 2)
        return self.noise * torch.randn(shape, generator=self.generator, device=self.device)

    def noisy_frame(self) -> torch.Tensor:
        """(cos th, sin th) of every env with sensor noise -> (num_envs, 2)."""
        return torch.stack([self.theta.cos(), self.theta.sin()], -1) + self.frame_noise()

    def get_observations(self) -> dict[str, torch.Tensor]:
        """`teacher` (privileged) and `policy` (noisy angle history + last torque)."""
        teacher = torch.stack(
            [self.theta.cos(), self.theta.sin(), self.theta_dot, self.mass, self.length], -1
        )
        return {
            "policy": torch.cat([self.frames.flatten(1), self.last_torque[:, None]], -1),
            "teacher": teacher,
        }

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """Pendulum step, then push the new noisy frame and the applied torque into the history. The
        final observation pushes the frame before the reset, with the same noise, onto the history
        before the reset."""
        history = self.frames  # a reset refills the rows that end
        _, rewards, dones, extras = super().step(actions)
        torque = actions.reshape(self.num_envs, -1)[:, 0].clamp(-self.max_torque, self.max_torque)
        self.last_torque = torch.where(dones, torch.zeros_like(torque), torque)
        noise = self.frame_noise()
        frame = torch.stack([self.theta.cos(), self.theta.sin()], -1) + noise
        self.frames = torch.cat([frame[:, None], self.frames[:, :-1]], 1)
        final = extras["final_obs"]  # `teacher` from before the reset, its first two (cos, sin)
        final_frames = torch.cat([(final["teacher"][:, :2] + noise)[:, None], history[:, :-1]], 1)
        final["policy"] = torch.cat([final_frames.flatten(1), torque[:, None]], -1)
        return self.get_observations(), rewards, dones, extras
