"""`isaaclab:<task id>`: an Isaac Lab task through Isaac Lab's own rsl_rl wrapper.

UNTESTED HERE: Isaac Sim does not install on the machines this project is built on. The factory
follows Isaac Lab 2.x's `scripts/reinforcement_learning/rsl_rl/train.py`; check it against the
version you run. Launch it as any other task, one process per GPU:

    torchrun --standalone --nproc_per_node=4 ppo_ddp.py \\
        --task isaaclab:Isaac-Velocity-Flat-Anymal-D-v0 \
        --num-envs 4096 --critic-obs critic --start-timeout-s 1800

Each rank starts its own headless Isaac Sim on its device (`cuda:LOCAL_RANK`), which takes minutes:
`--start-timeout-s` (default 1200 s) is how long the ranks wait for each other at start-up. The
wrapper serves rsl_rl's interface: TensorDict observations (`policy`, often `critic`),
`extras["time_outs"]`, `extras["log"]`, and an `episode_length_buf` that `--init-at-random-ep-len`
randomizes as rsl_rl's runner does. Task settings other than the number of envs and the seed come
from the task's registered config; rsl_rl's defaults for such tasks (thousands of envs per GPU, 24
steps per env, 5 epochs x 4 mini-batches, lr 1e-3 adaptive) are this project's defaults.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch


def make(task_id: str, num_envs: int, device: torch.device | str, seed: int) -> Any:
    """Start Isaac Sim on `device`, build `task_id` with `num_envs` envs and `seed`, wrap it for
    rsl_rl."""
    try:
        from isaaclab.app import AppLauncher
    except ImportError:
        raise ValueError(
            "--task isaaclab:... needs Isaac Lab; see https://isaac-sim.github.io/IsaacLab"
        ) from None
    app = AppLauncher(headless=True, device=str(device)).app  # before any other Isaac Lab import
    atexit.register(app.close)
    import gymnasium as gym
    import isaaclab_tasks  # noqa: F401 - registers the tasks with Gymnasium
    from isaaclab_rl.rsl_rl import RslRlVecEnvWrapper
    from isaaclab_tasks.utils import parse_env_cfg

    cfg = parse_env_cfg(task_id, device=str(device), num_envs=num_envs)
    cfg.seed = seed
    return RslRlVecEnvWrapper(gym.make(task_id, cfg=cfg))
