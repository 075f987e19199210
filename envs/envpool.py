"""`envpool:<id>`: EnvPool's C++ vectorized environments as a `VecEnv`: Gymnasium's MuJoCo tasks,
dm_control, MuJoCo Playground's legged robots (`Go1JoystickFlatTerrain-v1`,
`G1JoystickFlatTerrain-v1`, ...).

One EnvPool per rank steps its envs in C++ threads, with no Python per env step. Per rank:

- Observations: a Box is the `policy` group; a Dict of Boxes keeps its names (Playground's `state`
  and `privileged_state`, which the task's settings give to the actor and the critic: `defaults`).
- Episodes end and restart on the same step, as the scripts expect. EnvPool itself resets an env on
  the step *after* its episode ended (that step ignores its action and returns the first
  observation); here every env that ended is reset at once (`reset(env_id=...)`), so the observation
  returned on a done step is the next episode's first, and no step is spent on a reset; the one the
  episode ended in is in `extras["final_obs"]` (the observation returned where an env did not end).
- The time limit is counted here (`episode_length_buf`), so that `--init-at-random-ep-len` can start
  each env at a random point of it; reaching it is a time-out (bootstrapped), a termination is not.
- `extras["log"]`: the task's reward terms where EnvPool reports them (`reward_*` in its info), one
  value per env (the scripts log their mean; tools/evaluate.py the mean over the episodes it plays).
- Seeds: env i of a rank seeded `seed * num_envs + i` (modulo int32), so that no two envs of a job
  share a seed (the scripts give each rank its own `seed`).
- `shape`: a hook for a task built on this class to add training-only reward terms (envs/go1.py).
- Threads: the cores the rank is pinned to (`--pin-cores`, the default on CPU), else the cores this
  process may use shared by the ranks of a node (`len(os.sched_getaffinity(0)) // LOCAL_WORLD_SIZE`,
  at least 1); `ENVPOOL_THREADS` overrides it.

Needs `pip install envpool` (1.2.5 ships wheels for Python 3.11; later releases for 3.12 and up).
"""

from __future__ import annotations

import os
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
    """An EnvPool of `num_envs` envs behind rsl_rl's `VecEnv` protocol (the module docstring)."""

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
        is_dict = isinstance(obs_space, gym.spaces.Dict)
        spaces = dict(obs_space.spaces) if is_dict else {"policy": obs_space}
        flat = [n for n, b in spaces.items() if isinstance(b, gym.spaces.Box) and len(b.shape) == 1]
        if not flat:
            raise ValueError(
                f"{task_id!r} observes {obs_space}; envpool: takes flat Box observations: pick "
                "another task."
            )
        self.groups = flat
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
        reset and its info -> (rewards, the added terms by log name). None here; a task built on
        this class may add some (envs/go1.py)."""
        return rewards, {}

    def get_observations(self) -> dict[str, torch.Tensor]:
        """Every flat observation group, as float32 tensors on the run's device."""
        return {
            name: torch.as_tensor(value, device=self.device) for name, value in self.obs.items()
        }

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """Step every env with the clipped actions; reset at once the envs whose episode ended
        (their observation before the reset in `extras["final_obs"]`)."""
        clipped = np.clip(
            actions.detach().cpu().numpy().astype(self.low.dtype), self.low, self.high
        )
        obs, rewards, terminated, truncated, info = self.env.step(clipped)
        rewards, added = self.shape(obs, np.asarray(rewards, dtype=np.float32), info)
        self.episode_length_buf += 1
        at_limit = (self.episode_length_buf >= self.max_episode_length).numpy()
        time_outs = (truncated | at_limit) & ~terminated
        dones = terminated | time_outs
        self.obs = final = self._groups(obs)
        if dones.any():
            final = {name: value.copy() for name, value in final.items()}  # before the reset
            ended = np.flatnonzero(dones)
            fresh = self._groups(self.env.reset(env_id=ended)[0])
            for name in self.groups:
                self.obs[name][ended] = fresh[name]
        self.episode_length_buf[torch.from_numpy(dones)] = 0
        terms = {key: value for key, value in info.items() if key.startswith("reward_")} | added
        log = {key: torch.as_tensor(value, dtype=torch.float32) for key, value in terms.items()}
        extras = {"time_outs": torch.as_tensor(time_outs, device=self.device), "log": log}
        extras["final_obs"] = {k: torch.as_tensor(v, device=self.device) for k, v in final.items()}
        rewards = torch.as_tensor(np.asarray(rewards, dtype=np.float32), device=self.device)
        return self.get_observations(), rewards, torch.as_tensor(dones, device=self.device), extras


def make(
    task_id: str, num_envs: int, device: torch.device | str, seed: int, render: bool = False
) -> EnvPoolVecEnv:
    """`envpool:<task_id>`."""
    return EnvPoolVecEnv(task_id, num_envs, device, seed, render=render)


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
    module, _, options = registry.specs.get(task_id, ("", "", {}))
    if module == "envpool.mujoco.gym":
        from envs import gymnasium

        return gymnasium.mujoco_defaults(task_id), gymnasium.MUJOCO_SOURCE
    if module == "envpool.mujoco.playground" and options.get("task_name", "").startswith(
        LOCOMOTION
    ):
        groups = playground_groups(envpool.make_spec(task_id).observation_space)  # builds no env
        one = "one observation array: the policy group"
        where = "groups from the env's observation dict" if groups else one
        return {**PLAYGROUND, **groups}, f"{PLAYGROUND_SOURCE}; {where}"
    return {}, ""
