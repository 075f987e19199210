"""Milliseconds per PPO mini-batch step, eager against `--compile` (the whole step compiled:
forward, losses, backward, clipping, Adam), and per policy step of the rollout (actor, sampling,
log-probability, critic), on one process: CleanRL's MuJoCo sizes by default (Hopper-v5: 11
observations, 3 actions, [64, 64] tanh networks, mini-batches of 512 rows; 16 envs a policy step, as
each rank of the MuJoCo settings has), the compile time apart.

    python benchmarks/compile_step.py                         # eager, aot_eager, inductor
    python benchmarks/compile_step.py --backends inductor --rows 4096 --hidden 512 256 128
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import arguments  # noqa: E402
import common  # noqa: E402
import ppo_ddp  # noqa: E402
import speedups  # noqa: E402


@dataclass
class Config:
    backends: tuple[str, ...] = ("eager", "aot_eager", "inductor")
    """`eager` (no --compile), then torch.compile backends."""
    obs: int = 11
    """Observation width (Hopper-v5's)."""
    actions: int = 3
    hidden: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    rows: int = 512
    """Rows per mini-batch."""
    steps: int = 400
    """Mini-batch steps timed after the warm-up (the first update, which compiles)."""
    envs: int = 16
    """Rows of a policy step (envs per process)."""
    policy_steps: int = 4000
    """Policy steps timed after the first, which compiles."""
    threads: int = 1
    """torch threads, as each of 2 ranks on a 2-core machine has."""


def networks(config: Config) -> tuple[dict[str, list[int]], ppo_ddp.Actor, ppo_ddp.Critic]:
    """(the observation group's shape, actor, critic) of `config`'s sizes, initialized from seed
    0."""
    torch.manual_seed(0)
    shapes = {"policy": [config.obs]}
    actor = ppo_ddp.Actor(shapes, config.actions, config.hidden, activation=config.activation)
    return shapes, actor, ppo_ddp.Critic(shapes, config.hidden, activation=config.activation)


def step_ms(config: Config, backend: str) -> tuple[float, float]:
    """(the first update's seconds, compile included; milliseconds per mini-batch step after it)."""
    shapes, actor, critic = networks(config)
    cpu = torch.device("cpu")
    compiled = {"compile": None if backend == "eager" else backend}
    args = arguments.with_values(ppo_ddp.Args(), {"epochs": 1, "mini_batches": 4, **compiled})
    optimizer = speedups.adam([*actor.parameters(), *critic.parameters()], 3e-4, args.speed, cpu)
    # 4 mini-batches of `rows`
    buf = ppo_ddp.make_rollout(config.rows, 4, shapes, config.actions, cpu)
    for tensor in (buf.obs["policy"], buf.actions, buf.values, buf.advantages, buf.returns):
        tensor.normal_()
    buf.stds.fill_(1.0)
    buf.log_probs.copy_(ppo_ddp.gaussian_log_prob(buf.actions, buf.means, buf.stds))
    fields = ("actions", "log_probs", "means", "stds", "values", "advantages", "returns")
    batch = {name: getattr(buf, name).flatten(0, 1) for name in fields}  # as ppo_ddp.train makes it
    batch["obs"] = {group: stored.flatten(0, 1) for group, stored in buf.obs.items()}
    ctx = common.Dist(0, 1, cpu, True)
    update = ppo_ddp.make_update(actor, critic, optimizer, batch, args, ctx)
    start = time.perf_counter()
    update()
    first = time.perf_counter() - start
    updates = max(1, config.steps // 4)
    start = time.perf_counter()
    for _ in range(updates):
        update()
    return first, (time.perf_counter() - start) / (4 * updates) * 1e3


def policy_ms(config: Config, backend: str) -> tuple[float, float]:
    """(the first policy step's seconds, compile included; milliseconds per policy step after it),
    as the rollout calls it: `ppo_ddp.act` on `envs` rows, under inference mode."""
    _, actor, critic = networks(config)
    speed = speedups.SpeedArgs(compile=None if backend == "eager" else backend)
    step = speedups.compiled(
        functools.partial(ppo_ddp.act, actor, critic), speed, torch.device("cpu")
    )
    obs = {"policy": torch.randn(config.envs, config.obs)}
    with torch.inference_mode():
        start = time.perf_counter()
        step(obs)
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(config.policy_steps):
            step(obs)
    return first, (time.perf_counter() - start) / config.policy_steps * 1e3


def main(config: Config) -> None:
    torch.set_num_threads(config.threads)
    hidden = ", ".join(map(str, config.hidden))
    print(f"[{hidden}] {config.activation}, {config.threads} thread(s), torch {torch.__version__}")
    for name, timer, size in (
        ("mini-batch", step_ms, f"{config.rows} rows"),
        ("policy", policy_ms, f"{config.envs} rows"),
    ):
        results = {backend: timer(config, backend) for backend in config.backends}
        eager = results["eager"][1] if "eager" in results else None
        print(
            f"\n| {name} step, {size} | first call (s, compile included) | ms per step | speed-up |"
        )
        print("|---|---|---|---|")
        for backend, (first, ms) in results.items():
            speed_up = f"{eager / ms:.2f}x" if eager is not None else "– (no eager run)"
            print(f"| {backend} | {first:.1f} | {ms:.3f} | {speed_up} |")


if __name__ == "__main__":
    main(tyro.cli(Config))
