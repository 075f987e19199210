"""Watch a trained policy: one episode of its deterministic action, as an animation and a strip of
frames.

Built-in tasks (`pendulum`, `pendulum_partial`, `pendulum_angle`, `pendulum_sparse`, `reacher`) are
drawn with matplotlib: of 16 starts, the episode with the most to do (the lowest return), as a GIF
and as a PNG strip of 8 frames over the part where its return accrues, with the tip's recent path,
so that the swing-up and (for AMP) its direction show. `gym:` tasks are recorded with the
environment's own `rgb_array` rendering: an MP4 (with imageio-ffmpeg) or a GIF, and the strip;
`envpool:` tasks with MuJoCo's renderer. Works on checkpoints of the four scripts, as
tools/evaluate.py, and plays the task evaluate scores by default (`Policy.eval_task`), printing the
return under that task's reward.

    python tools/play.py runs/ppo_amp_pendulum/<time>     # -> play_<iteration>.gif and .png there
    python tools/play.py runs/ppo_gym_HalfCheetah-v5/<time> --out cheetah.mp4

Needs matplotlib (built-in tasks; `pip install matplotlib`) or imageio (`gym:` tasks; `pip install
imageio imageio-ffmpeg`, and the task's own rendering extras, such as `gymnasium[classic-control]`).
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch
import tyro
from policy import (
    Policy,
    act,
    check_fits,
    envs,
    initial_memory,
    load_policy,
    output_path,
    run_episodes,
    run_tool,
)

DRAWN = (
    "pendulum",
    "pendulum_partial",
    "pendulum_angle",
    "pendulum_sparse",
    "reacher",
)  # the built-in tasks drawn here


@dataclass
class Config:
    checkpoint: Annotated[str, tyro.conf.Positional]
    """A checkpoint file (`model_<iteration>.pt`) or a run directory (its newest checkpoint)."""
    task: str | None = None
    """Task to play; default: the one the checkpoint is scored on, as tools/evaluate.py's (its
    training task, or the task its module names: envs/<task>.py `EVAL_TASK`)."""
    seed: int = 0
    """Env seed. Built-in tasks: of 16 starts, the episode with the lowest return (the farthest
    start) is played; `gym:` tasks: the one episode."""
    out: str | None = None
    """Animation to write (`.gif`, or `.mp4` for `gym:` tasks); default `play_<iteration>.gif` (or
    `.mp4`) beside the checkpoint (a shipped policy's: under `runs/`). The strip of frames goes
    beside it, as `.png`."""
    every: int = 2
    """Draw every this many steps (built-in and EnvPool tasks): fewer frames, a smaller file."""
    strip_steps: int = 0
    """EnvPool tasks: the strip's 8 frames, at full size in two rows, this many steps apart from
    mid-episode on (3 shows a legged robot's gait cycle, its feet lifting); 0: 8 frames spread over
    the episode, in one row."""


def play(config: Config) -> tuple[str, str]:
    """Play and write; returns the paths of the animation and the strip."""
    policy = load_policy(config.checkpoint, "cpu")
    task = config.task or policy.eval_task
    stem = output_path(policy, f"play_{policy.iteration}")
    if task in DRAWN:
        states, rewards = play_built_in(policy, task, config.seed)
        return draw(task, states, rewards, config.out or stem + ".gif", max(1, config.every))
    if task.startswith(("gym:", "gym-async:")):
        return record_gym(policy, task.partition(":")[2], config.seed, config.out or stem)
    if task.startswith("envpool:"):
        return record_envpool(
            policy,
            task.removeprefix("envpool:"),
            config.seed,
            config.out or stem,
            config.every,
            config.strip_steps,
        )
    raise ValueError(
        f"play draws the built-in tasks {list(DRAWN)} and records gym:<id> and envpool:<id> tasks, "
        f"not {task!r}; pass --task one of those, or measure this task with tools/evaluate.py."
    )


STARTS = 16  # play_built_in plays this many starts and keeps the one with the most to do


def play_built_in(policy: Policy, task: str, seed: int) -> tuple[list[torch.Tensor], list[float]]:
    """The first episode of each of `STARTS` envs seeded `seed`; of these, the one with the lowest
    return (the farthest start: a swing-up from hanging down, a far target) -> the state before
    every step (pendulum: angle and speed; reacher: joint angles and target), and the reward of
    every step."""
    env = envs.make_env(task, STARTS, "cpu", seed)

    def state() -> torch.Tensor:  # (STARTS, 2 or 4)
        return (
            torch.stack([env.theta, env.theta_dot], -1)
            if task != "reacher"
            else torch.cat([env.q, env.target], -1)
        )

    states, rewards = [state()], []
    original_step = env.step

    def step(actions: torch.Tensor) -> tuple:  # records what the episodes did, step by step
        result = original_step(actions)
        rewards.append(result[1].clone())
        states.append(state())
        return result

    env.step = step
    returns, lengths, *_ = run_episodes(policy, env)
    played = int(returns.argmin())
    length = int(lengths[played])  # the state after the last step is the next episode's start
    return [s[played] for s in states[:length]], [float(r[played]) for r in rewards[:length]]


def strip_steps(rewards: list[float], count: int = 8) -> list[int]:
    """`count` steps spread over the part of an episode where its return accrues: from the start to
    the step by which 99.9% of it has (a policy that swings up and then holds still shows the
    swing-up)."""
    accrued = np.cumsum(np.abs(rewards))
    end = (
        int(np.searchsorted(accrued, 0.999 * accrued[-1])) + 1
        if len(rewards) and accrued[-1] > 0
        else len(rewards)
    )
    end = min(len(rewards), max(end, count - 1))
    return np.linspace(0, end, count).round().astype(int).tolist()


def draw(
    task: str, states: list[torch.Tensor], rewards: list[float], out: str, every: int
) -> tuple[str, str]:
    """The episode as a GIF and a PNG strip of 8 frames."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.animation import FuncAnimation, PillowWriter
    except ImportError:
        raise ImportError(
            "drawing the built-in tasks needs matplotlib: pip install matplotlib"
        ) from None
    returns = np.cumsum(rewards).round(1) + 0.0  # + 0.0: no "-0.0"

    def frame(ax: object, t: int) -> None:
        ax.clear()
        ax.set_xlim(-1.2, 1.2), ax.set_ylim(-1.2, 1.2), ax.set_aspect("equal"), ax.axis("off")
        if task == "reacher":
            q0, q1, tx, ty = states[t].tolist()
            elbow = (0.6 * math.cos(q0), 0.6 * math.sin(q0))
            tip = (elbow[0] + 0.4 * math.cos(q0 + q1), elbow[1] + 0.4 * math.sin(q0 + q1))
            ax.plot(
                [0, elbow[0], tip[0]], [0, elbow[1], tip[1]], "-o", color="tab:blue", linewidth=4
            )
            ax.plot(tx, ty, "x", color="tab:red", markersize=12, markeredgewidth=3)
            title = f"step {t}"
        else:  # Gymnasium's picture: angle 0 is up, a positive speed turns counter-clockwise
            path = [
                (-math.sin(s[0].item()), math.cos(s[0].item()))
                for s in states[max(0, t - 15) : t + 1]
            ]
            for i in range(1, len(path)):  # the tip's recent path, fading out
                ax.plot(
                    *zip(path[i - 1], path[i]), color="tab:orange", alpha=i / len(path), linewidth=2
                )
            ax.plot(
                [0, path[-1][0]],
                [0, path[-1][1]],
                color="tab:blue",
                linewidth=6,
                solid_capstyle="round",
            )
            ax.plot(0, 0, "o", color="black")
            title = f"step {t}, {'ccw' if states[t][1] > 0 else 'cw'}"  # the way it turns
        ax.set_title(f"{title}\nreturn {returns[t - 1] if t else 0.0:.1f}", fontsize=9)

    fig, ax = plt.subplots(figsize=(3, 3.2))
    steps = list(range(0, len(states), every))
    animation = FuncAnimation(fig, lambda i: frame(ax, steps[i]), frames=len(steps))
    animation.save(out, writer=PillowWriter(fps=max(1, round(20 / every))))
    plt.close(fig)
    strip_path = os.path.splitext(out)[0] + ".png"
    # room for the titles, no overlap
    fig, axes = plt.subplots(1, 8, figsize=(16, 2.8), layout="constrained")
    for ax, t in zip(axes, strip_steps(rewards)):
        frame(ax, min(t, len(states) - 1))
    fig.suptitle(f"{task}: return {returns[-1]:.1f} over {len(states)} steps", fontsize=10)
    fig.savefig(strip_path, dpi=80)
    plt.close(fig)
    print(
        f"{task}'s reward: return {returns[-1]:.1f} over {len(states)} steps; written {out} and "
        f"{strip_path}"
    )
    return out, strip_path


def record_gym(policy: Policy, env_id: str, seed: int, out: str) -> tuple[str, str]:
    """One episode of a Gymnasium env with its `rgb_array` rendering -> an MP4 (or GIF) and a PNG
    strip."""
    try:
        import imageio.v2 as imageio
    except ImportError:
        raise ImportError(
            "recording gym: tasks needs imageio: pip install imageio imageio-ffmpeg"
        ) from None
    try:
        import gymnasium as gym
    except ImportError:
        raise ImportError(
            "recording gym: tasks needs Gymnasium: pip install -r requirements-envs.txt"
        ) from None

    # pygame-drawn envs: no sound card, no warning about one
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    try:
        env = gym.make(env_id, render_mode="rgb_array")
    except (gym.error.Error, ImportError) as error:
        raise ValueError(
            f"cannot make Gymnasium env {env_id!r} with rgb_array rendering: {error}; check the id "
            "and install what rendering needs (pip install -r requirements-envs.txt; pygame for "
            "classic control)."
        ) from None
    obs, _ = env.reset(seed=seed)
    check_fits(policy, {"policy": torch.zeros(1, len(obs))})
    memory, frames, rewards, done = initial_memory(policy, 1, "cpu"), [env.render()], [], False
    while not done:
        actions, memory = act(
            policy, {"policy": torch.as_tensor(obs, dtype=torch.float32)[None]}, memory
        )
        action = np.clip(actions[0].numpy(), env.action_space.low, env.action_space.high)
        obs, reward, terminated, truncated, _ = env.step(action)
        rewards.append(float(reward))
        done = terminated or truncated
        frames.append(env.render())
    total = sum(rewards)
    env.close()
    has_ffmpeg = importlib.util.find_spec("imageio_ffmpeg") is not None
    if not os.path.splitext(out)[1]:
        out += ".mp4" if has_ffmpeg else ".gif"
    if out.endswith(".mp4") and not has_ffmpeg:
        raise ImportError(
            "writing MP4 needs imageio-ffmpeg: pip install imageio-ffmpeg (or pass --out "
            "<name>.gif)"
        )
    fps = env.metadata.get("render_fps", 30)
    if out.endswith(".mp4"):
        imageio.mimsave(out, frames, fps=fps, macro_block_size=1)
    else:
        imageio.mimsave(out, frames, duration=1000 / fps)
    strip_path = os.path.splitext(out)[0] + ".png"
    picks = strip_steps(rewards)
    imageio.imwrite(strip_path, np.concatenate([frames[i] for i in picks], axis=1))
    print(
        f"gym:{env_id}'s reward: return {total:.1f} over {len(frames) - 1} steps; written {out} "
        f"and {strip_path}"
    )
    return out, strip_path


def gl_context(size: int) -> object:
    """A current OpenGL context for MuJoCo's renderer (EGL by default, `MUJOCO_GL=osmesa` for
    software), made before EnvPool renders its first frame; one line saying what to install where
    there is none."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        import mujoco

        context = mujoco.GLContext(size, size)
        context.make_current()
    except ImportError:
        raise ImportError(
            "recording envpool: tasks needs MuJoCo's Python package: pip install mujoco"
        ) from None
    except Exception as error:  # noqa: BLE001 - no GL library, or no display for the one named
        raise ImportError(
            f"recording envpool: tasks needs an OpenGL library ({type(error).__name__}: {error}): "
            "install Debian's libegl-mesa0 (or libosmesa6, with MUJOCO_GL=osmesa)."
        ) from None
    return context


def record_envpool(
    policy: Policy, task_id: str, seed: int, out: str, every: int, strip_steps: int = 0
) -> tuple[str, str]:
    """One episode of an EnvPool task (`envpool:<id>`) with MuJoCo's renderer, every `every`-th
    frame at half size -> a GIF (or MP4) and a PNG strip of 8 frames: at full size `strip_steps`
    apart from mid-episode on, or spread over the episode (0)."""
    try:
        import imageio.v2 as imageio
    except ImportError:
        raise ImportError(
            "recording envpool: tasks needs imageio: pip install imageio imageio-ffmpeg"
        ) from None
    from envs import envpool

    context = gl_context(480)  # kept alive while frames are rendered
    env = envpool.make(task_id, 1, "cpu", seed, render=True)
    obs, memory = env.get_observations(), initial_memory(policy, 1, "cpu")
    check_fits(policy, obs)
    frames, rewards, strip = [env.env.render()[0][::2, ::2]], [], []
    middle = int(env.max_episode_length) // 2
    for t in range(int(env.max_episode_length)):
        actions, memory = act(policy, obs, memory)
        obs, reward, done, _ = env.step(actions)
        rewards.append(float(reward[0]))
        if (t + 1) % max(1, every) == 0:
            frames.append(env.env.render()[0][::2, ::2])
        if strip_steps > 0 and t + 1 >= middle and (t + 1 - middle) % strip_steps == 0:
            if len(strip) < 8:
                strip.append(env.env.render()[0])  # full size: the feet show
        if done[0]:
            break
    del context
    has_ffmpeg = importlib.util.find_spec("imageio_ffmpeg") is not None
    if not os.path.splitext(out)[1]:
        out += ".gif"
    fps = max(1, round(1 / (0.02 * max(1, every))))  # Playground's robots step 50 times a second
    if out.endswith(".mp4"):
        if not has_ffmpeg:
            raise ImportError(
                "writing MP4 needs imageio-ffmpeg: pip install imageio-ffmpeg (or pass --out "
                "<name>.gif)"
            )
        imageio.mimsave(out, frames, fps=fps, macro_block_size=1)
    else:
        imageio.mimsave(out, frames, duration=1000 / fps, loop=0)
    strip_path = os.path.splitext(out)[0] + ".png"
    if len(strip) == 8:  # full-size frames: two rows of four
        image = np.concatenate(
            [np.concatenate(strip[:4], axis=1), np.concatenate(strip[4:], axis=1)]
        )
    else:  # spread over the episode (or it ended before mid-episode)
        picks = np.linspace(0, len(frames) - 1, 8).round().astype(int)
        image = np.concatenate([frames[i] for i in picks], axis=1)
    imageio.imwrite(strip_path, image)
    print(
        f"envpool:{task_id}'s reward: return {sum(rewards):.1f} over {len(rewards)} steps; "
        f"written {out} and {strip_path}"
    )
    return out, strip_path


if __name__ == "__main__":
    run_tool(play, Config)
