"""Exploration benchmark: PPO with and without RND on `pendulum_sparse` (reward only near upright).

Runs `ppo_ddp.py` under torchrun once per seed and setting, one run at a time, and prints a
Markdown table: for each run the return over the last 10 iterations, the iteration at which the
return first passed 10 (the policy found the top), and the wall time; then mean and standard
deviation over seeds.

    python benchmarks/rnd.py                          # 3 seeds x (PPO, PPO + RND), 2 processes
    python benchmarks/rnd.py --seeds 1 2 3 4 5 --rnd "--rnd-weight 10"

Run it from the repository root; the results and their reading are in docs/rnd.md.
"""

from __future__ import annotations

import os
import shlex
import statistics
from dataclasses import dataclass

import tyro
from torchrun_ppo import train


@dataclass
class Config:
    task: str = "pendulum_sparse"
    seeds: tuple[int, ...] = (1, 2, 3)
    """One run per seed and setting."""
    nproc: int = 2
    """Processes per run (torchrun --nproc_per_node)."""
    iterations: int = 300
    """Budget per run (2 processes x 256 envs x 32 steps: 16,384 env steps per iteration)."""
    rnd: str = "--rnd-weight 40"
    """The RND run's arguments; the other run has none (--rnd-weight 0)."""
    out: str = "runs/benchmark_rnd"
    """Where the runs are written (one directory per setting and seed)."""


def run(cfg: Config, name: str, args: list[str], seed: int) -> dict[str, float]:
    """One training run; its figures from rank 0's metrics.jsonl."""
    run_dir = os.path.join(cfg.out, f"{name}_seed{seed}")
    task = ["--task", cfg.task, "--seed", str(seed), "--iterations", str(cfg.iterations)]
    rows, wall = train(cfg.nproc, run_dir, [*task, *args])
    returns = [row["episode_return"] or 0.0 for row in rows]
    found = next((i + 1 for i, r in enumerate(returns) if r > 10), None)
    return {"last10": statistics.mean(returns[-10:]), "found": found, "wall": wall}


def main(cfg: Config) -> None:
    settings = {"PPO": [], "PPO + RND": shlex.split(cfg.rnd)}
    results = {
        (name, seed): run(cfg, name.replace(" + ", "_"), args, seed)
        for name, args in settings.items()
        for seed in cfg.seeds
    }
    print(f"\n{cfg.task}, {cfg.nproc} processes, {cfg.iterations} iterations, RND: `{cfg.rnd}`\n")
    print(
        "| run | seed | return, last 10 iterations | found the top (return > 10) at iteration | "
        "wall time |"
    )
    print("|---|---|---|---|---|")
    for (name, seed), r in results.items():
        found = "never" if r["found"] is None else str(r["found"])
        print(
            f"| {name} | {seed} | {round(r['last10'], 1) + 0.0:.1f} | {found} | {r['wall']:.0f} s |"
        )  # no -0.0
    for name in settings:
        last10 = [results[name, seed]["last10"] for seed in cfg.seeds]
        spread = f" ± {statistics.stdev(last10):.1f}" if len(last10) > 1 else ""
        print(f"| {name} | mean | {round(statistics.mean(last10), 1) + 0.0:.1f}{spread} | | |")


if __name__ == "__main__":
    main(tyro.cli(Config))
