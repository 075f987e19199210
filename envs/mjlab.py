"""`mjlab:<task id>`: an mjlab task (Isaac Lab's manager-based API on MuJoCo Warp) through mjlab's
own rsl_rl wrapper.

mjlab pins its own rsl_rl (rsl-rl-lib 5.4.2), torch and Warp stack: install it in a venv of its own
with `pip install -r requirements-mjlab.txt`. Launch it as any other task, one process per GPU:

    torchrun --standalone --nproc_per_node=2 ppo_ddp.py \\
        --task mjlab:Mjlab-Velocity-Flat-Unitree-Go1 --num-envs 8 --iterations 2

Each rank simulates on its own device, `cuda:LOCAL_RANK` or `cpu`; with `CUDA_VISIBLE_DEVICES=""`
MuJoCo Warp runs on Warp's CPU device (slow, but enough for smoke tests). The first build of a task
on a device compiles Warp's kernels, minutes on a small CPU (~1.5 min for Go1 on two cores); they
are cached in ~/.cache/warp. `defaults(task_id)` gives the rsl_rl settings the task was tuned with,
under this project's argument names (actor and critic read mjlab's `actor` and `critic` groups, not
`policy`).

Warp and GPUs: mjlab runs every Warp call in `wp.ScopedDevice(device)`, so a rank's simulation stays
on its device. But Warp's start-up greeting (log level INFO, Warp's default) asks every visible GPU
for its memory, and for a GPU whose context it does not hold yet that retains and releases the
primary context: a transient CUDA context on all GPUs, from every rank (warp/_src/context.py
`Runtime.__init__` -> `Device.total_memory` -> native/warp.cu `wp_cuda_device_get_memory_info`).
`make` sets Warp's log level to WARNING, which skips the greeting (and Warp's line per kernel module
loaded). Per-rank `CUDA_VISIBLE_DEVICES` would break `cuda:LOCAL_RANK` under torchrun.

The wrapper serves rsl_rl's interface: TensorDict observations, float32 rewards already multiplied
by the step length `dt` (mjlab's `scale_rewards_by_dt`), int64 dones, bool `extras["time_outs"]`
(absent for finite-horizon tasks), `extras["log"]` (episode sums of the envs that reset), envs that
reset themselves on the step that ends them, and an `episode_length_buf` that
`--init-at-random-ep-len` randomizes. Building the env seeds Python, NumPy, Warp and torch's global
generator with `seed` (mjlab's `seed_rng`); MuJoCo Warp is not bit-deterministic.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from envs import VecEnv


def _mjlab(task_id: str) -> Any:
    """mjlab's task registry, with every task registered; a ValueError when mjlab is missing or
    `task_id` unknown."""
    try:
        import mjlab.tasks  # noqa: F401 - registers the tasks
        from mjlab.tasks import registry
    except ImportError:
        raise ValueError(
            "--task mjlab:... needs mjlab: pip install -r requirements-mjlab.txt (in a venv of its "
            "own: mjlab pins rsl-rl-lib==5.4.2 and its own torch and Warp)"
        ) from None
    if task_id not in registry.list_tasks():
        raise ValueError(f"unknown mjlab task {task_id!r}: choose one of {registry.list_tasks()}.")
    return registry


def make(task_id: str, num_envs: int, device: torch.device | str, seed: int) -> VecEnv:
    """Build `task_id` with `num_envs` envs on `device`, seeded with `seed`, behind mjlab's rsl_rl
    wrapper (actions clipped as the task's rsl_rl config says)."""
    registry = _mjlab(task_id)
    rl = registry.load_rl_cfg(task_id)
    _check_networks(
        task_id, rl
    )  # task_defaults leaves such a task's settings out; here it stops, in one line
    import warp as wp
    from mjlab.envs import ManagerBasedRlEnv
    from mjlab.rl import RslRlVecEnvWrapper

    cfg = registry.load_env_cfg(task_id)
    motion = cfg.commands.get("motion")
    if motion is not None and not getattr(motion, "motion_file", None):
        raise ValueError(
            f"{task_id} tracks a motion file, which --task mjlab: cannot pass; use another task."
        )
    cfg.scene.num_envs, cfg.seed = num_envs, seed
    # Warp at log level WARNING: no start-up greeting that touches every visible GPU (see the module
    # docstring), and not a line per kernel module loaded on every rank (tens per task).
    wp.config.log_level = max(wp.config.log_level, wp.LOG_WARNING)
    wp.init()
    if os.environ.get("RANK", "0") == "0":
        print(
            f"building {task_id} on {device}; a first build compiles Warp's kernels (minutes on a "
            "CPU), later ones load them from ~/.cache/warp",
            flush=True,
        )
    with contextlib.ExitStack() as stack:
        if os.environ.get("RANK", "0") != "0":  # mjlab prints its managers' tables: on rank 0 only
            stack.enter_context(
                contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w")))
            )
        env = ManagerBasedRlEnv(cfg=cfg, device=str(device))
        return RslRlVecEnvWrapper(env, clip_actions=rl.clip_actions)


def _check_networks(task_id: str, rl: Any) -> None:
    """A ValueError for a network this project cannot build: it trains ELU MLPs."""
    for name, model in (("actor", rl.actor), ("critic", rl.critic)):
        if model.activation.lower() != "elu" or model.rnn_type is not None:
            raise ValueError(
                f"{task_id}'s {name} is a {model.rnn_type or model.activation} network; this "
                "project trains ELU MLPs only: pick an mjlab task whose actor and critic are ELU "
                "MLPs."
            )


def defaults(task_id: str) -> tuple[dict[str, object], str]:
    """The rsl_rl settings `task_id` was tuned with, as this project's PPO arguments, and their
    source. mjlab's scene default is one env, so `num_envs` is left out; its seed (42) is too. A
    ValueError for a network this project cannot build (it trains ELU MLPs; the camera tasks' CNNs
    read a `camera` group that `envs.resolve_groups` rejects unless left out)."""
    rl = _mjlab(task_id).load_rl_cfg(task_id)
    actor, critic, algo = rl.actor, rl.critic, rl.algorithm
    _check_networks(task_id, rl)
    settings: dict[str, object] = {
        "steps_per_env": rl.num_steps_per_env,
        "iterations": rl.max_iterations,
        "save_interval": rl.save_interval,
        "actor_obs": tuple(rl.obs_groups["actor"]),
        "critic_obs": tuple(rl.obs_groups.get("critic", rl.obs_groups["actor"])),
        "actor_hidden": tuple(actor.hidden_dims),
        "critic_hidden": tuple(critic.hidden_dims),
        # one flag here; mjlab sets actor and critic alike in every task
        "normalize_obs": actor.obs_normalization,
        "epochs": algo.num_learning_epochs,
        "mini_batches": algo.num_mini_batches,
        "clip": algo.clip_param,
        "gamma": algo.gamma,
        "lam": algo.lam,
        "value_coef": algo.value_loss_coef,
        "clip_value_loss": algo.use_clipped_value_loss,
        "entropy_coef": algo.entropy_coef,
        "learning_rate": algo.learning_rate,
        "schedule": algo.schedule,
        "desired_kl": algo.desired_kl,
        "max_grad_norm": algo.max_grad_norm,
    }
    distribution = actor.distribution_cfg or {}
    if "init_std" in distribution:
        settings["init_noise_std"] = float(distribution["init_std"])
    if "std_type" in distribution:
        settings["std_type"] = distribution["std_type"]
    return settings, "mjlab's registered rsl_rl config"
