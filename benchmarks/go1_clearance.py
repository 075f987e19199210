"""Where a Go1 policy's feet-clearance cost comes from, under Playground's default reward.

Playground's clearance cost is, per step, the sum over the four feet of |foot height - 0.1 m| times
the square root of the foot's horizontal speed. `privileged_state` gives each foot's contact and
velocity but not its height, so this plays the policy's mean action (16 envs, 300 steps, seed 0)
and splits the sum of root speeds by foot phase: swing (up), touch-down (the first step down),
lift-off (the last step down) and mid-stance. A least-squares fit of the cost on the down and up
sums gives the mean height term of each (a foot that is down sits about 0.077 m below 0.1 m). It
also prints how the speed of the feet on the ground follows the calf's pitch rate: a foot's sphere
rolls as the leg turns over it, in proportion to the body's speed; how long swings and stances
last; the clearance term, velocity tracking and lift-offs by commanded speed; how well the feet's
heights that `go1_foot_heights` computes (envs/envpool.py, for the swing-height term) rebuild the
cost; and a swing step by step.
With `--task`, a training task instead (its own scales): how often Playground's terms sum below 0,
where its clip at 0 makes every penalty free.

    python benchmarks/go1_clearance.py policies/go1_trot
    python benchmarks/go1_clearance.py policies/go1_trot --task go1_trot_swing

Needs EnvPool (`pip install -r requirements-envs.txt`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
from policy import act, initial_memory, load_policy  # noqa: E402

from envs.envpool import go1_foot_heights, make  # noqa: E402


@dataclass
class Config:
    checkpoint: Annotated[str, tyro.conf.Positional]
    """A checkpoint file or a run directory (its newest checkpoint)."""
    envs: int = 16
    steps: int = 300
    task: str = "Go1JoystickFlatTerrain-v1"
    """An EnvPool id or a named Go1 task (envs/envpool.py `NAMED`)."""


def main(config: Config) -> None:
    policy = load_policy(config.checkpoint)
    env = make(config.task, config.envs, "cpu", 0)
    scale = float(env.env.spec.config.feet_clearance_scale)
    added = {f"reward_{name}" for name in getattr(env, "weights", {})}  # TrotGo1's own terms
    below, body, down, cost, leg_rate, speed, command, heights, lin = ([] for _ in range(9))
    obs, memory = env.get_observations(), initial_memory(policy, config.envs, "cpu")
    for _ in range(config.steps):
        actions, memory = act(policy, obs, memory)
        obs, _, _, extras = env.step(actions)
        p = obs["privileged_state"].numpy()
        down.append(p[:, 99:103] > 0.5)  # foot contacts FR FL RR RL
        command.append(np.linalg.norm(p[:, 45:47], axis=-1))  # commanded vx, vy
        feet_xy = p[:, 103:115].reshape(-1, 4, 3)[..., :2]  # foot velocities
        speed.append(np.linalg.norm(feet_xy, axis=-1))
        joint_rates = p[:, 75:87].reshape(-1, 4, 3)  # hip, thigh, calf of each leg
        leg_rate.append(np.abs(joint_rates[..., 1] + joint_rates[..., 2]))  # the calf's pitch rate
        cost.append(extras["log"]["reward_feet_clearance"].numpy() / scale)
        lin.append(extras["log"]["reward_tracking_lin_vel"].numpy())
        playground = [v.numpy() for k, v in extras["log"].items() if k not in added]
        below.append(np.sum(playground, axis=0) < 0)
        body.append(np.linalg.norm(p[:, 57:59], axis=-1))  # the body's horizontal speed
        heights.append(go1_foot_heights(p[:, 63:75], p[:, 54:57]))  # joint angles, gravity
    down, cost, speed, heights = np.array(down), np.array(cost), np.array(speed), np.array(heights)
    root_speed = np.sqrt(speed)
    rebuilt = (np.abs(heights - 0.1) * root_speed).sum(axis=-1)
    on_ground = speed[down], np.array(leg_rate)[down]
    # phases of the steps that have a step before and after
    d, s = down[1:-1], root_speed[1:-1]
    touch, lift = d & ~down[:-2], d & ~down[2:]
    parts = {"swing": ~d, "touch-down": touch, "lift-off": lift, "mid-stance": d & ~touch & ~lift}
    per_step = {name: (s * mask).sum() / (len(d) * config.envs) for name, mask in parts.items()}
    sums = np.stack([(root_speed * down).sum(-1), (root_speed * ~down).sum(-1)], -1).reshape(-1, 2)
    (height_down, height_up), *_ = np.linalg.lstsq(sums, cost.reshape(-1), rcond=None)
    fitted = {n: (height_up if n == "swing" else height_down) * v for n, v in per_step.items()}
    print(
        f"{config.checkpoint} on {config.task}: clearance term {scale * cost.mean():.3f} (cost "
        f"{cost.mean():.4f}); Playground's terms sum below 0 on {np.mean(below):.0%} of the steps"
    )
    print(
        f"fitted height term: down {height_down:.3f} m, up {height_up:.3f} m; fitted cost "
        f"{sum(fitted.values()):.4f}, shared as"
    )
    for name, value in per_step.items():
        print(
            f"  {name:10s}: sum of root speeds {value:.3f} per step, cost {fitted[name]:.4f} "
            f"({fitted[name] / sum(fitted.values()):.0%})"
        )
    up_steps, down_steps = phase_lengths(down)
    dt = float(env.env.spec.config.ctrl_dt)
    print(
        f"  feet down {down.mean():.0%} of the time; a foot's swing lasts {up_steps:.1f} steps "
        f"({up_steps * dt:.2f} s) and its stance {down_steps:.1f} ({down_steps * dt:.2f} s)"
    )
    print(
        f"feet down: mean speed {on_ground[0].mean():.3f} m/s, correlation with the calf's pitch "
        f"rate (relative to the body) {np.corrcoef(*on_ground)[0, 1]:.2f}; commanded speed "
        f"{np.mean(command):.2f} m/s on average"
    )
    command, lin = np.array(command), np.array(lin)
    lift_offs = np.concatenate([np.zeros_like(down[:1]), down[:-1] & ~down[1:]]).sum(-1)
    for low, high in [(0.0, 0.1), (0.1, 0.6), (0.6, 0.9), (0.9, 1.2), (1.2, 2.0)]:
        at = (command >= low) & (command < high)
        print(
            f"  commanded {low:.1f} to {high:.1f} m/s on {at.mean():.0%} of the steps: clearance "
            f"term {scale * cost[at].mean():.3f}, {scale * cost[at].sum() / cost.size:.3f} of "
            f"the mean; lin {lin[at].mean():.3f}; {down[at].sum(-1).mean():.2f} feet down, "
            f"{lift_offs[at].mean() / dt:.1f} lift-offs a second"
        )
    mid, body = parts["mid-stance"], np.repeat(np.array(body)[1:-1, :, None], 4, axis=-1)
    for low, high in [(0.25, 0.5), (0.5, 0.75), (0.75, 1.0), (1.0, 1.25)]:
        at = mid & (body >= low) & (body < high)
        ratio = (speed[1:-1][at] / body[at]).mean()
        print(
            f"  body at {low:.2f} to {high:.2f} m/s: a foot in mid-stance moves {ratio:.3f} times "
            f"as fast and costs {np.mean(0.077 * s[at]):.4f} a step ({at.sum()} foot-steps)"
        )
    print(f"  feet in mid-stance: {mid.sum(-1).mean():.2f} per step")
    print(
        f"the cost rebuilt from go1_foot_heights: mean {rebuilt.mean():.4f}, correlation with "
        f"Playground's {np.corrcoef(rebuilt.reshape(-1), cost.reshape(-1))[0, 1]:.2f}"
    )
    print("a swing, step by step (0: the first step up; -1: the last step down before it; +1: the")
    print("first step down after it): mean height (m), horizontal speed (m/s), cost of the foot")
    for step, (height, foot_speed, foot_cost) in swing_profile(down, heights, speed):
        print(f"  {step:>4}: {height:.3f}  {foot_speed:.2f}  {foot_cost:.4f}")


def phase_lengths(down: np.ndarray) -> tuple[float, float]:
    """The mean length in steps of the feet's swings and of their stances (`down`: T, envs, 4),
    over the phases that start and end within the steps."""
    lengths: dict[bool, list[int]] = {False: [], True: []}  # by down: swings, then stances
    for env in range(down.shape[1]):
        for foot in range(4):
            feet = down[:, env, foot]
            changes = np.flatnonzero(feet[1:] != feet[:-1]) + 1  # the first step of each phase
            for start, end in zip(changes[:-1], changes[1:]):
                lengths[bool(feet[start])].append(int(end - start))
    swings, stances = (float(np.mean(v)) if v else float("nan") for v in lengths.values())
    return swings, stances


def swing_profile(
    down: np.ndarray, heights: np.ndarray, speed: np.ndarray, edge: int = 3
) -> list[tuple[str, np.ndarray]]:
    """Each foot's height, speed and clearance cost around its swings (T, envs, 4 each), averaged
    over the swings that start and end within the steps: the `edge` steps from one step before
    lift-off, then the `edge` steps up to one step after touch-down (`end-k` is k steps before
    the last step up)."""
    values = np.stack([heights, speed, np.abs(heights - 0.1) * np.sqrt(speed)], -1)
    rows: dict[str, list[np.ndarray]] = {}
    for env in range(down.shape[1]):
        for foot in range(4):
            up = ~down[:, env, foot]
            starts = np.flatnonzero(up[1:] & ~up[:-1]) + 1
            ends = np.flatnonzero(up[:-1] & ~up[1:]) + 1  # the first step down again
            for start in starts:
                later = ends[ends > start]
                if start < 1 or not len(later) or later[0] - start < 2 * edge:
                    continue
                end = later[0]
                for k in range(-1, edge):
                    rows.setdefault(str(k), []).append(values[start + k, env, foot])
                for k in range(edge, -2, -1):
                    name = "+1" if k == -1 else f"end-{k}"
                    rows.setdefault(name, []).append(values[end - 1 - k, env, foot])
    return [(name, np.mean(v, axis=0)) for name, v in rows.items()]


if __name__ == "__main__":
    main(tyro.cli(Config))
