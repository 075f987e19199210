"""Learning benchmark on an environment nobody here wrote: Gymnasium's MuJoCo HalfCheetah-v5.

Runs `ppo_ddp.py --task gym:<env>` under torchrun once per seed, one run at a time, and prints a
Markdown table: the return at the end (the mean of the episodes finished in the last iteration)
and over the last 10 iterations, env steps, wall time, for each seed, then the mean and the
standard deviation over seeds.

    pip install -r requirements-envs.txt
    python benchmarks/mujoco.py                       # HalfCheetah-v5, 3 seeds, 2 processes
    python benchmarks/mujoco.py --seeds 1 2 3 4 5 --nproc 4

Run it from the repository root. Every PPO argument not set here keeps ppo_ddp.py's default;
`--extra` appends more (`--extra "--learning-rate 1e-4"`).
"""

from __future__ import annotations

import os
import shlex
import statistics
import sys
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from torchrun_ppo import train  # noqa: E402

import ppo_ddp  # noqa: E402 - after its directory is on the path

# What these settings are and why: docs/environments.md ("Defaults and the kind of task").
SETTINGS = "--num-envs 64 --steps-per-env 32 --epochs 10 --mini-batches 4 --schedule fixed --learning-rate 3e-4 --no-clip-value-loss --entropy-coef 0"


@dataclass
class Config:
    env: str = "HalfCheetah-v5"
    """Gymnasium id."""
    seeds: tuple[int, ...] = (1, 2, 3)
    """One run per seed."""
    nproc: int = 2
    """Processes per run (torchrun --nproc_per_node)."""
    env_steps: int = 1_000_000
    """Budget per run, over all processes: the iterations are rounded up to reach it."""
    settings: str = SETTINGS
    """PPO arguments of every run."""
    extra: str = ""
    """More ppo_ddp.py arguments, appended."""
    out: str = "runs/benchmark_mujoco"
    """Where the runs are written (one directory per seed)."""


def run(cfg: Config, seed: int) -> dict[str, float]:
    """One training run; its figures from rank 0's metrics.jsonl."""
    args = shlex.split(cfg.settings) + shlex.split(cfg.extra)
    ppo = tyro.cli(ppo_ddp.Args, args=args)  # parsed as ppo_ddp.py parses them: the last value of a flag wins
    per_iteration = ppo.num_envs * ppo.steps_per_env * cfg.nproc
    iterations = -(-cfg.env_steps // per_iteration)
    run_dir = os.path.join(cfg.out, f"{cfg.env}_seed{seed}")
    task = ["--task", f"gym:{cfg.env}", "--seed", str(seed), "--iterations", str(iterations)]
    rows, wall = train(cfg.nproc, run_dir, [*task, *args])
    last = [r["episode_return"] for r in rows[-10:] if r["episode_return"] is not None]
    return {
        "final": rows[-1]["episode_return"],
        "last10": statistics.mean(last),
        "steps": rows[-1]["env_steps"],
        "wall": wall,
    }


def main(cfg: Config) -> None:
    results = {}
    for seed in cfg.seeds:
        results[seed] = run(cfg, seed)
        print(f"seed {seed}: {results[seed]}", flush=True)
    settings = " ".join(filter(None, (cfg.settings, cfg.extra)))
    print(f"\n{cfg.env}, {cfg.nproc} processes, `{settings}`\n")
    print("| seed | return at the end | last 10 iterations | env steps | wall time |\n|---|---|---|---|---|")
    for seed, r in results.items():
        print(f"| {seed} | {r['final']:.0f} | {r['last10']:.0f} | {r['steps']:,} | {r['wall']:.0f} s |")
    for name, pick in (("mean", statistics.mean), ("std", statistics.stdev)):
        if len(results) > 1:
            cells = [pick([r[k] for r in results.values()]) for k in ("final", "last10")]
            print(f"| {name} | {cells[0]:.0f} | {cells[1]:.0f} | | |")


if __name__ == "__main__":
    main(tyro.cli(Config))
