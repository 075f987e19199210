"""`reacher`: a planar two-link arm reaching random targets (2 actions, a privileged critic
group)."""

from __future__ import annotations

import math

import torch

from envs.pendulum import angle_normalize


class Reacher:
    """A planar two-link arm (links 0.6 m and 0.4 m) that must bring its fingertip to a random
    target.

    Joints are torque-driven with viscous damping; a new target every episode (100 steps of 0.05 s).
    Groups: `policy` (10) = cos/sin of both joints, joint velocities, target xy, fingertip-target
    xy; `critic` (12) = `policy` plus the distance and the fingertip speed. Reward: -distance - 0.05
    |torque|^2, +1 per step within 5 cm.
    """

    links, dt, damping, gain, max_speed = (0.6, 0.4), 0.05, 1.0, 10.0, 10.0

    def __init__(self, num_envs: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.num_envs, self.num_actions, self.max_episode_length = num_envs, 2, 100
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.q = torch.zeros(num_envs, 2, device=self.device)
        self.qd = torch.zeros(num_envs, 2, device=self.device)
        self.target = torch.zeros(num_envs, 2, device=self.device)
        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.reset_where(torch.ones(num_envs, dtype=torch.bool, device=self.device))

    def reset_where(self, mask: torch.Tensor) -> None:
        """Random joint angles, zero velocity, a target uniform in the reachable annulus, where
        `mask` is true (every env draws, the masked ones take the draw: no host sync, as
        envs/pendulum.py)."""
        u = torch.rand(4, self.num_envs, generator=self.generator, device=self.device)
        column = mask[:, None]
        self.q = torch.where(column, (2 * torch.stack([u[0], u[1]], -1) - 1) * math.pi, self.q)
        self.qd = self.qd.masked_fill(column, 0.0)
        radius = 0.2 + 0.8 * u[2]
        angle = 2 * math.pi * u[3]
        self.target = torch.where(
            column, torch.stack([radius * angle.cos(), radius * angle.sin()], -1), self.target
        )
        self.episode_length_buf.masked_fill_(mask, 0)

    def fingertip(self) -> torch.Tensor:
        """Forward kinematics -> (num_envs, 2)."""
        l1, l2 = self.links
        a1, a12 = self.q[:, 0], self.q[:, 0] + self.q[:, 1]
        return torch.stack([l1 * a1.cos() + l2 * a12.cos(), l1 * a1.sin() + l2 * a12.sin()], -1)

    def get_observations(self) -> dict[str, torch.Tensor]:
        """`policy` and the privileged `critic` group."""
        delta = self.fingertip() - self.target
        policy = torch.cat([self.q.cos(), self.q.sin(), self.qd, self.target, delta], -1)
        critic = torch.cat(
            [policy, delta.norm(dim=-1, keepdim=True), self.qd.norm(dim=-1, keepdim=True)], -1
        )
        return {"policy": policy, "critic": critic}

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """Semi-implicit Euler step of both joints; auto-resets at the time limit, the observation
        before the reset in `extras["final_obs"]`."""
        torque = actions.reshape(self.num_envs, 2).clamp(-1.0, 1.0)
        self.qd = (self.qd + (self.gain * torque - self.damping * self.qd) * self.dt).clamp(
            -self.max_speed, self.max_speed
        )
        self.q = angle_normalize(self.q + self.qd * self.dt)
        distance = (self.fingertip() - self.target).norm(dim=-1)
        reward = -distance - 0.05 * (torque**2).sum(-1) + (distance < 0.05).float()
        self.episode_length_buf += 1
        time_outs = self.episode_length_buf >= self.max_episode_length
        final = self.get_observations()  # before the reset: where no env ends, the one returned
        self.reset_where(time_outs)
        log = {"final_distance": distance.mean()}
        extras = {"time_outs": time_outs, "log": log, "final_obs": final}
        return self.get_observations(), reward, time_outs, extras
