"""`pendulum`: Gymnasium's Pendulum-v1, batched in torch."""

from __future__ import annotations

import math

import torch


def angle_normalize(x: torch.Tensor) -> torch.Tensor:
    """Wrap angles to [-pi, pi)."""
    return torch.remainder(x + math.pi, 2 * math.pi) - math.pi


class Pendulum:
    """Gymnasium's Pendulum-v1, batched: same dynamics, reward, limits, start state, 200-step limit.

    Groups: `policy` = (cos th, sin th, thdot) as in Gymnasium. The log also reports the style of
    the motion: `swingup_ccw_fraction`, the share of recent swing-ups (from below horizontal to
    within 0.5 rad of upright) made counter-clockwise, which the reward does not care about (AMP's
    target).
    """

    max_speed, max_torque, dt, g, m, l = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0

    def __init__(self, num_envs: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.num_envs, self.num_actions, self.max_episode_length = num_envs, 1, 200
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.theta = torch.zeros(num_envs, device=self.device)
        self.theta_dot = torch.zeros(num_envs, device=self.device)
        self.mass = torch.full((num_envs,), self.m, device=self.device)
        self.length = torch.full((num_envs,), self.l, device=self.device)
        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.was_down = torch.zeros(num_envs, dtype=torch.bool, device=self.device)
        # decayed counts: [counter-clockwise, all]
        self.swingups = torch.zeros(2, device=self.device)
        self.allocate()
        self.reset_where(torch.ones(num_envs, dtype=torch.bool, device=self.device))

    def allocate(self) -> None:
        """Hook for variants that keep more state per env (called before the first reset)."""

    def reset_where(self, mask: torch.Tensor) -> None:
        """Gymnasium's start state, theta ~ U(-pi, pi) and theta_dot ~ U(-1, 1), where `mask`
        (num_envs,) is true. Masked, not indexed: every env draws and only the masked ones take the
        draw, so the shapes never depend on how many reset and the GPU never waits for the host to
        count them."""
        u = torch.rand(2, self.num_envs, generator=self.generator, device=self.device)
        self.theta = torch.where(mask, (2 * u[0] - 1) * math.pi, self.theta)
        self.theta_dot = torch.where(mask, 2 * u[1] - 1, self.theta_dot)
        self.episode_length_buf.masked_fill_(mask, 0)
        self.was_down = torch.where(mask, self.theta.abs() > math.pi / 2, self.was_down)

    def get_observations(self) -> dict[str, torch.Tensor]:
        """The `policy` group."""
        return {"policy": torch.stack([self.theta.cos(), self.theta.sin(), self.theta_dot], dim=-1)}

    def final_observations(self) -> dict[str, torch.Tensor]:
        """Every env's observation before the step's reset (`extras["final_obs"]`): where no env
        ends, the observation the step returns."""
        return self.get_observations()

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """One 0.05 s step of every pendulum; auto-resets those that reach the time limit, whose
        observation before the reset is in `extras["final_obs"]`."""
        u = actions.reshape(self.num_envs, -1)[:, 0].clamp(-self.max_torque, self.max_torque)
        th, thdot, m, l = self.theta, self.theta_dot, self.mass, self.length
        costs = angle_normalize(th) ** 2 + 0.1 * thdot**2 + 0.001 * u**2
        new_thdot = thdot + (3 * self.g / (2 * l) * th.sin() + 3.0 / (m * l**2) * u) * self.dt
        new_thdot = new_thdot.clamp(-self.max_speed, self.max_speed)
        self.theta = th + new_thdot * self.dt
        self.theta_dot = new_thdot
        # Style bookkeeping: a swing-up ends when a pendulum that was below horizontal nears the
        # top.
        angle = angle_normalize(self.theta).abs()
        swingup = self.was_down & (angle < 0.5)
        self.was_down = (self.was_down | (angle > math.pi / 2)) & ~swingup
        counts = torch.stack([(swingup & (new_thdot > 0)).sum(), swingup.sum()]).float()
        self.swingups = 0.99 * self.swingups + counts
        self.episode_length_buf += 1
        time_outs = self.episode_length_buf >= self.max_episode_length
        final = self.final_observations()
        self.reset_where(time_outs)
        log = {"swingup_ccw_fraction": self.swingups[0] / self.swingups[1].clamp(min=1e-6)}
        extras = {"time_outs": time_outs, "log": log, "final_obs": final}
        return self.get_observations(), -costs, time_outs, extras
