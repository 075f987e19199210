"""Learning benchmark on environments nobody here wrote: Gymnasium's MuJoCo HalfCheetah, Hopper,
Walker2d.

Runs `ppo_ddp.py --task gym:<env> --seed <seed>` (or `envpool:<env>`) under torchrun, one run at a
time, with the settings the task brings (envs/gymnasium.py: 1 M env steps on 2 processes), and
prints two Markdown tables: every run (return at the end, the mean of the last 10 iterations, env
steps, wall time, the CPU time of all its processes, the machine's load when it started), then each
task's mean and standard deviation over seeds next to CleanRL's published figures. On a machine
other work shares, the wall time grows with the load; the returns do not (a seed gives the same
run).

    pip install -r requirements-envs.txt
    python benchmarks/mujoco_suite.py                               # 3 tasks x 3 seeds, 2 processes
    python benchmarks/mujoco_suite.py --envs Hopper-v5 --seeds 1 2 3 4 5 --nproc 4
    python benchmarks/mujoco_suite.py --adapter envpool             # the same tasks through EnvPool

Run it from the repository root. `--extra` appends ppo_ddp.py arguments (`--extra "--mini-batches
8"`); with other `--nproc` or `--extra` sizes, the iterations are set to reach `--env-steps`.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import shlex
import statistics
import sys
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from torchrun_ppo import train  # noqa: E402

import arguments  # noqa: E402
import envs  # noqa: E402
import ppo_ddp  # noqa: E402

# CleanRL's ppo_continuous_action at 1 M steps (openrlbenchmark, MuJoCo v4, 1 env): mean ± std over
# seeds.
CLEANRL = {"HalfCheetah": "1,442 ± 46", "Hopper": "2,383 ± 272", "Walker2d": "2,288 ± 572"}


@dataclass
class Config:
    envs: tuple[str, ...] = ("HalfCheetah-v5", "Hopper-v5", "Walker2d-v5")
    """Gymnasium ids."""
    adapter: str = "gym"
    """`gym` (Gymnasium's MuJoCo, Python per step) or `envpool` (EnvPool's C++ port of the same
    tasks)."""
    seeds: tuple[int, ...] = (1, 2, 3)
    """One run per task and seed."""
    nproc: int = 2
    """Processes per run (torchrun --nproc_per_node)."""
    env_steps: int = 1_000_000
    """Budget per run, over all processes: the iterations are rounded up to reach it."""
    extra: str = ""
    """More ppo_ddp.py arguments, appended to the task's settings."""
    out: str = "runs/benchmark_mujoco"
    """Where the runs are written (one directory per task and seed)."""


def task_args(cfg: Config, env: str, seed: int) -> list[str]:
    """The run's arguments: task, seed, `--extra`, and `--iterations` only where the task's own do
    not reach `--env-steps` on `--nproc` processes exactly as they would on 2."""
    args = ["--task", f"{cfg.adapter}:{env}", "--seed", str(seed), *shlex.split(cfg.extra)]
    # parsed as ppo_ddp.py parses them, without its line
    with contextlib.redirect_stdout(io.StringIO()):
        ppo = arguments.parse_args(ppo_ddp.Args, envs.task_defaults, args)
    iterations = -(-cfg.env_steps // (ppo.num_envs * ppo.steps_per_env * cfg.nproc))
    return args if iterations == ppo.iterations else [*args, "--iterations", str(iterations)]


def run(cfg: Config, env: str, seed: int) -> dict[str, float]:
    """One training run; its figures from rank 0's metrics.jsonl."""
    load, before = os.getloadavg()[0], resource.getrusage(resource.RUSAGE_CHILDREN)
    rows, wall = train(
        cfg.nproc,
        os.path.join(cfg.out, f"{cfg.adapter}_{env}_seed{seed}"),
        task_args(cfg, env, seed),
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # torchrun's, its ranks' included
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    last = [r["episode_return"] for r in rows[-10:] if r["episode_return"] is not None]
    return {
        "final": rows[-1]["episode_return"],
        "last10": statistics.mean(last),
        "steps": rows[-1]["env_steps"],
        "wall": wall,
        "cpu": cpu,
        "load": load,
    }


def main(cfg: Config) -> None:
    results = {}
    for env in cfg.envs:
        for seed in cfg.seeds:
            results[env, seed] = run(cfg, env, seed)
            print(f"{env} seed {seed}: {results[env, seed]}", flush=True)
    extra = f", `{cfg.extra}`" if cfg.extra else ""
    print(f"\n`{cfg.adapter}:`, {cfg.nproc} processes, each task's settings{extra}\n")
    print(
        "| task | seed | return at the end | last 10 iterations | env steps | wall time | CPU time "
        "| load at start |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (env, seed), r in results.items():
        print(
            f"| {env} | {seed} | {r['final']:,.0f} | {r['last10']:,.0f} | {r['steps']:,} | "
            f"{r['wall']:.0f} s | {r['cpu']:.0f} s | {r['load']:.1f} |"
        )
    print(
        "\n| task | return at the end, mean ± std | last 10 iterations | wall time per run | "
        "processes | CleanRL |"
    )
    print("|---|---|---|---|---|---|")
    for env in cfg.envs:
        runs = [results[env, seed] for seed in cfg.seeds]
        cells = []
        for key in ("final", "last10"):
            values = [r[key] for r in runs]
            spread = f" ± {statistics.stdev(values):,.0f}" if len(values) > 1 else ""
            cells.append(f"{statistics.mean(values):,.0f}{spread}")
        walls = [r["wall"] for r in runs]
        cleanrl = CLEANRL.get(env.split("-")[0], "")
        print(
            f"| {env} | {cells[0]} | {cells[1]} | {min(walls):.0f}-{max(walls):.0f} s | "
            f"{cfg.nproc} | {cleanrl} |"
        )


if __name__ == "__main__":
    main(tyro.cli(Config))
