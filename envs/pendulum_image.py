"""`pendulum_image`: Pendulum-v1 whose angle is seen only in a small rendered frame (the task that
needs a CNN)."""

from __future__ import annotations

import torch

from envs.pendulum import Pendulum


class PendulumImage(Pendulum):
    """Pendulum-v1 (dynamics, reward, start state, 200-step limit) with two observation groups:
    `policy` (1), the angular velocity alone, and `image` (1, 16, 16), the rod drawn from the pivot
    at the frame's centre to the bob, its grey level falling linearly from 1 on its axis to 0 at
    `half_width` from it. Without the image a policy knows how fast the pendulum turns, not where it
    is, and cannot swing it up. Pure torch, on any device; the frame is mirror-symmetric
    (envs.mirrors:pendulum_image flips it)."""

    # pixels per side; the frame spans [-extent, extent]; the rod
    size, extent, half_width = 16, 1.25, 0.25

    def allocate(self) -> None:
        centres = (
            torch.arange(self.size, device=self.device) + 0.5
        ) / self.size * 2 * self.extent - self.extent
        y, x = torch.meshgrid(centres.flip(0), centres, indexing="ij")  # row 0 at the top
        self.pixels = torch.stack([x.flatten(), y.flatten()], -1)  # (H W, 2)

    def get_observations(self) -> dict[str, torch.Tensor]:
        """`policy`: the angular velocity (num_envs, 1); `image`: the frame (num_envs, 1, 16,
        16)."""
        # unit length; theta = 0 is upright
        bob = torch.stack([self.theta.sin(), self.theta.cos()], -1)
        along = (bob @ self.pixels.T).clamp(
            0, 1
        )  # (num_envs, H W): each pixel's nearest point of the rod
        distance = (self.pixels - along[..., None] * bob[:, None]).norm(dim=-1)
        image = (
            (1 - distance / self.half_width)
            .clamp(min=0)
            .reshape(self.num_envs, 1, self.size, self.size)
        )
        return {"policy": self.theta_dot[:, None], "image": image}


# What `--task pendulum_image` brings (envs.task_defaults): both networks read the velocity and the
# frame, through two 3 x 3, stride 2 convolutions (16 x 16 -> 7 x 7 x 8 -> 3 x 3 x 16).
SETTINGS = {
    "actor_obs": ("policy", "image"),
    "critic_obs": ("policy", "image"),
    "cnn_channels": (8, 16),
}
