"""`gym:<id>`: any Gymnasium environment with Box observations and Box actions, as a `VecEnv`.

One Gymnasium vector env per rank (`gym:<id>` steps its copies in this process; `gym-async:<id>` in
one subprocess each, for machines with more cores than ranks), copy i seeded `seed * num_envs + i`
as `envpool:` seeds its envs. The scripts give each rank its own `seed` (`seed + rank`), so no two
copies of a job share a seed.
Observations and rewards come back as float32 tensors on the run's device.

- Actions are clipped to the action space's bounds (CleanRL's `ClipAction`); the policy's Gaussian
  is not squashed or rescaled, so log-probabilities stay those of the unclipped sample.
- `terminated` is a done; `truncated` (the time limit) is a done and a time-out, which PPO
  bootstraps. Copies reset on the step that ends them (Gymnasium's SAME_STEP autoreset): the
  observation returned is the next episode's first, as in rsl_rl; the one the episode ended in is
  in `extras["final_obs"]` (the observation returned where a copy did not end).
- The time limit is counted here, in `episode_length_buf`, so that `--init-at-random-ep-len` can
  start each copy at a random point of it (`envs.make_env`): the first episodes end at staggered
  steps, and rollouts mix all phases of an episode from the start. Copies cut short reset on
  that step too (`gym-async:` through Gymnasium's `reset_mask`).
- Rewards are the environment's own, unscaled: `episode_return` is the real return.

Needs `pip install -r requirements-envs.txt` (Gymnasium; MuJoCo for HalfCheetah and friends).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch


def _gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError:
        raise ValueError(
            "--task gym:... needs Gymnasium: pip install -r requirements-envs.txt"
        ) from None
    return gymnasium


def _mujoco_warnings_once() -> None:
    """MuJoCo prints its model-compiler warnings once per env copy (hundreds of identical lines for
    HalfCheetah with 64 copies per rank): print each distinct one once, on rank 0."""
    try:
        import mujoco
    except ImportError:
        return
    set_warning = getattr(mujoco, "set_mju_user_warning", None)  # not in every MuJoCo build
    if set_warning is None:
        return
    seen: set[str] = set()

    def once(message: str) -> None:
        if message not in seen and os.environ.get("RANK", "0") == "0":
            print(f"MuJoCo warning: {message}", flush=True)
        seen.add(message)

    set_warning(once)


class GymVecEnv:
    """A Gymnasium vector env behind rsl_rl's `VecEnv` protocol (see the module docstring)."""

    def __init__(
        self, env_id: str, num_envs: int, device: torch.device | str, seed: int, asynchronous: bool
    ) -> None:
        gym = _gymnasium()
        _mujoco_warnings_once()
        try:
            self.env = gym.make_vec(
                env_id,
                num_envs,
                vectorization_mode="async" if asynchronous else "sync",
                vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
            )
        # unknown id, a missing extra such as mujoco
        except (gym.error.Error, ImportError) as error:
            first_line = (str(error).splitlines() or [type(error).__name__])[0]
            raise ValueError(
                f"cannot make Gymnasium env {env_id!r}: {first_line}; check the id "
                "(gymnasium.pprint_registry() lists them) and install what it needs (pip install "
                "-r requirements-envs.txt)."
            ) from None
        obs_space, act_space = self.env.single_observation_space, self.env.single_action_space
        if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
            raise ValueError(
                f"{env_id!r} observes {obs_space}; gym: takes flat Box observations only: flatten "
                "them in a wrapper registered as an id of its own, or pick a task with Box "
                "observations."
            )
        if not isinstance(act_space, gym.spaces.Box) or len(act_space.shape) != 1:
            raise ValueError(
                f"{env_id!r} acts in {act_space}, but the policy here is a Gaussian over Box "
                "actions: pick a task with continuous actions (gym:Pendulum-v1, gym:Hopper-v5, "
                "...) or a discrete-action PPO."
            )
        if self.env.spec is None or not self.env.spec.max_episode_steps:
            raise ValueError(
                f"{env_id!r} has no time limit (max_episode_steps): register it with one "
                "(gymnasium.register(..., max_episode_steps=N)) and pass that id."
            )
        self.num_envs, self.num_actions, self.obs_dim = (
            num_envs,
            act_space.shape[0],
            obs_space.shape[0],
        )
        self.asynchronous = asynchronous
        self.max_episode_length = int(self.env.spec.max_episode_steps)
        self.device = torch.device(device)
        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long)
        self.low, self.high = act_space.low, act_space.high
        # copy i: seed * num_envs + i, disjoint across ranks
        obs, _ = self.env.reset(seed=seed * num_envs)
        self.obs = self._tensor(obs)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(array, dtype=np.float32), device=self.device)

    def get_observations(self) -> dict[str, torch.Tensor]:
        """The `policy` group: the environment's observation."""
        return {"policy": self.obs}

    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """Step every copy with the clipped actions; reset the copies whose episode ended."""
        clipped = np.clip(
            actions.detach().cpu().numpy().astype(self.low.dtype), self.low, self.high
        )
        self.episode_length_buf += 1
        # This env's own time limit, which may start at a random point (see the module docstring).
        at_limit = (self.episode_length_buf >= self.max_episode_length).numpy()
        step_copies = self._step_subprocesses if self.asynchronous else self._step_here
        obs, final, rewards, terminated, time_outs = step_copies(clipped, at_limit)
        dones = torch.as_tensor(terminated | time_outs)
        self.episode_length_buf[dones] = 0
        self.obs = self._tensor(obs)
        extras = {"time_outs": torch.as_tensor(time_outs).to(self.device)}
        extras["final_obs"] = {"policy": self._tensor(final)}
        return self.get_observations(), self._tensor(rewards), dones.to(self.device), extras

    def _step_here(self, actions: np.ndarray, at_limit: np.ndarray) -> tuple[np.ndarray, ...]:
        """`gym:`: Gymnasium's SyncVectorEnv.step (SAME_STEP) written out over its copies, without
        its merging of their info dicts, which nothing here reads (5 to 11 % of a 16-copy Hopper or
        Walker2d step); a copy at this adapter's time limit resets here too -> (obs, the obs before
        any reset, rewards, terminated, time-outs), float32 and bool."""
        obs = np.empty((self.num_envs, self.obs_dim), dtype=np.float32)
        final = np.empty_like(obs)
        rewards = np.empty(self.num_envs, dtype=np.float32)
        terminated, time_outs = (
            np.zeros(self.num_envs, dtype=bool),
            np.zeros(self.num_envs, dtype=bool),
        )
        for i, env in enumerate(self.env.envs):
            obs[i], rewards[i], terminated[i], truncated, _ = env.step(actions[i])
            time_outs[i] = truncated or (at_limit[i] and not terminated[i])
            final[i] = obs[i]
            if terminated[i] or time_outs[i]:
                obs[i], _ = env.reset()
        return obs, final, rewards, terminated, time_outs

    def _step_subprocesses(
        self, actions: np.ndarray, at_limit: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        """`gym-async:`: the vector env steps its subprocesses (each resets on its own end and gives
        the observation before in its info's `final_obs`); the copies at this adapter's time limit
        are reset after -> (obs, the obs before any reset, rewards, terminated, time-outs)."""
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        final = np.array(obs, dtype=np.float32)
        for i in np.flatnonzero(info.get("_final_obs", ())):
            final[i] = info["final_obs"][i]
        cut = at_limit & ~(terminated | truncated)
        if cut.any():
            fresh, _ = self.env.reset(options={"reset_mask": cut})
            obs = np.where(cut[:, None], fresh, obs)
        return obs, final, rewards, terminated, truncated | cut


# Gymnasium's MuJoCo tasks: 1 M env steps on 2 processes, with the settings docs/environments.md
# measured.
MUJOCO = {
    "num_envs": 16,
    # 2,048 samples per update on 2 processes, as CleanRL's 1 env x 2,048 steps
    "steps_per_env": 64,
    "iterations": 489,  # 489 x 2 x 16 x 64 = 1,001,472 env steps on 2 processes
    "epochs": 10,
    "mini_batches": 2,
    "schedule": "fixed",
    "learning_rate": 6e-4,
    "clip_value_loss": False,
    "entropy_coef": 0.0,
    "scale_rewards": True,
    "grad_clip": "joint",  # CleanRL clips its one agent's gradient as a whole
    "shuffle": "every-epoch",  # and draws a fresh mini-batch order every epoch
}
# On top of MUJOCO, by task name (the id without its version): HalfCheetah learns more from its own
# rewards and from a narrow first policy (RL Zoo's log std -2), Hopper from updates half the size at
# half the learning rate (docs/environments.md measured them).
MUJOCO_TASKS: dict[str, dict[str, object]] = {
    "HalfCheetah": {"scale_rewards": False, "init_noise_std": 0.135},
    "Hopper": {"mini_batches": 4, "learning_rate": 3e-4},
}


MUJOCO_SOURCE = "the MuJoCo settings of docs/environments.md"


def defaults(env_id: str) -> tuple[dict[str, object], str]:
    """The settings `--task gym:<env_id>` brings and where they come from (envs.task_defaults): for
    Gymnasium's MuJoCo tasks MUJOCO, with the task's own entry of MUJOCO_TASKS over it; ({}, "") for
    the others."""
    gym = _gymnasium()
    try:
        entry_point = str(gym.spec(env_id).entry_point)
    except gym.error.Error:  # an unknown id: building the env says so
        return {}, ""
    if not entry_point.startswith("gymnasium.envs.mujoco"):
        return {}, ""
    return mujoco_defaults(env_id), MUJOCO_SOURCE


def mujoco_defaults(env_id: str) -> dict[str, object]:
    """MUJOCO with the task's own entry of MUJOCO_TASKS over it, for a MuJoCo id of Gymnasium or of
    EnvPool."""
    return {**MUJOCO, **MUJOCO_TASKS.get(env_id.split("-")[0], {})}


def make(
    env_id: str, num_envs: int, device: torch.device | str, seed: int, asynchronous: bool = False
) -> GymVecEnv:
    """`num_envs` copies of Gymnasium's `env_id` (see the module docstring)."""
    return GymVecEnv(env_id, num_envs, device, seed, asynchronous)
