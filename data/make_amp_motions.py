"""Record the AMP reference motions of the `pendulum` task: counter-clockwise swing-ups, then
balance.

A scripted energy-pumping controller drives envs.pendulum.Pendulum (Gymnasium's Pendulum-v1) from
its own random start states. With E = thdot^2 / 2 + a cos(th) (a = 3g / 2l; E = a upright at rest),
it
  - balances with a saturated PD law once near the top (|th| < 0.6 and E close to a);
  - pumps energy, torque = max_torque * sign(thdot), while E < a (moving either way);
  - but never lets a clockwise swing (thdot < 0) carry more than `CW_ENERGY_CAP`: it brakes instead,
    so every swing that reaches the top goes counter-clockwise (thdot > 0 there).
The task reward does not care about the direction; ppo_amp_ddp.py learns it from these clips.

File format (`pendulum_ccw_motions.npz`, read with `numpy.load(path, allow_pickle=False)`, which
never runs code):
    dt        float64 scalar: seconds between consecutive frames (0.05, the env step)
    clip_000  float32 (frames, amp_dim): AMP observations of clip 0, one row per frame
    clip_001  ...
For the pendulum, amp_dim = 3: (cos th, sin th, thdot), the env's `policy` group.

Run:  python data/make_amp_motions.py [--out PATH]   (--help for the options)
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from envs.pendulum import Pendulum, angle_normalize  # noqa: E402

CLIPS, FRAMES, SEED = 64, 200, 12345
CW_ENERGY_CAP = 5.0  # well below the energy needed to pass |th| < 0.5 (a cos 0.5 = 13.2)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pendulum_ccw_motions.npz")


def controller(theta: torch.Tensor, theta_dot: torch.Tensor, env: Pendulum) -> torch.Tensor:
    """Energy pumping that only ever completes counter-clockwise swing-ups, then PD balance."""
    a = 3 * env.g / (2 * env.l)
    energy = 0.5 * theta_dot**2 + a * theta.cos()
    angle = angle_normalize(theta)
    pump = env.max_torque * torch.sign(theta_dot + 1e-6)
    pump = torch.where(energy > a, -pump, pump)  # too much energy: brake
    brake_cw = (theta_dot < 0) & (energy > CW_ENERGY_CAP)
    pump = torch.where(brake_cw, torch.full_like(pump, env.max_torque), pump)
    balance = (-10.0 * angle - 2.0 * theta_dot).clamp(-env.max_torque, env.max_torque)
    near_top = (angle.abs() < 0.6) & ((energy - a).abs() < 4.0)
    return torch.where(near_top, balance, pump)


def record() -> tuple[np.ndarray, dict[str, float]]:
    """Run the controller in CLIPS envs for FRAMES frames -> (CLIPS, FRAMES, 3) and a summary."""
    env = Pendulum(CLIPS, "cpu", SEED)
    frames, task_return = [env.get_observations()["policy"]], torch.zeros(CLIPS)
    for _ in range(FRAMES - 1):  # FRAMES - 1 < 200 steps: no time-limit reset inside a clip
        _, reward, _, extras = env.step(controller(env.theta, env.theta_dot, env).unsqueeze(-1))
        frames.append(env.get_observations()["policy"])
        task_return += reward
    summary = {
        "swingup_ccw_fraction": float(extras["log"]["swingup_ccw_fraction"]),
        "mean_task_return": float(task_return.mean()),
        "final_upright_fraction": float((angle_normalize(env.theta).abs() < 0.2).float().mean()),
    }
    return torch.stack(frames, 1).numpy().astype(np.float32), summary


def main(out: str = OUT) -> None:
    """Record the reference motions of ppo_amp_ddp.py's default task and write them to `out`.

    Args:
        out: Where to write the motion file (.npz); the default is the file ppo_amp_ddp.py reads.
    """
    clips, summary = record()
    assert summary["swingup_ccw_fraction"] == 1.0, summary
    arrays = {f"clip_{i:03d}": clip for i, clip in enumerate(clips)}
    np.savez_compressed(out, dt=np.float64(Pendulum.dt), **arrays)
    print(
        f"wrote {len(arrays)} clips of {clips.shape[1]} frames x {clips.shape[2]} to {out}: "
        f"{summary}"
    )
    assert not math.isnan(summary["mean_task_return"])


if __name__ == "__main__":
    tyro.cli(main)
