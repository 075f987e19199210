"""Time-outs bootstrapped two ways: rsl_rl's `gamma * V(s_t)` (`ppo_ddp.py`) against
`gamma * V(final observation)` (recipe 5 of docs/forking.md), seed by seed.

Both scripts run from one snapshot of the repository, taken at the start into `--out`/code (the
fork: the recipe's diffs applied to the snapshot's ppo_ddp.py), so that an edit made while the
runs go does not reach them. Each run is `torchrun --standalone --nproc_per_node=<nproc>
ppo_ddp.py --task <task> --seed <seed>` with the task's own settings, one run at a time; the
table gives, per run, the mean `episode_return` of the last 10 iterations, the mean value loss and
explained variance of the last 50, and env steps per second: all env steps over the iterations'
time (start-up excluded), and over the rollouts' time alone (where the fork's critic call goes).

    python benchmarks/bootstrap.py                                   # pendulum, 3 seeds, both ways
    python benchmarks/bootstrap.py --tasks envpool:Hopper-v5         # 1 M env steps (its settings)
    python benchmarks/bootstrap.py --tasks go1 --extra="--iterations 489"   # stage 1, 3.0 M steps

Run it from the repository root; `--extra` appends ppo_ddp.py arguments to every run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = ("rsl_rl", "final")  # ppo_ddp.py as it is, and its fork


@dataclass
class Config:
    tasks: tuple[str, ...] = ("pendulum",)
    """`--task` of each run."""
    seeds: tuple[int, ...] = (1, 2, 3)
    """One run per task, seed and rule."""
    nproc: int = 2
    """Processes per run (torchrun --nproc_per_node)."""
    extra: str = ""
    """More ppo_ddp.py arguments, appended to every run's."""
    out: str = "runs/benchmark_bootstrap"
    """Where the snapshot and the runs are written (a directory per task, rule and seed)."""


def recipe_diffs(text: str, number: int) -> list[tuple[str, str]]:
    """The ```diff blocks of recipe `number` of docs/forking.md's `text`, as (old text, new text)
    (tests/test_fork.py applies every recipe's diffs with it)."""
    section = re.search(rf"^### {number}\. .*?(?=^### |^## |\Z)", text, re.M | re.S).group(0)
    diffs = []
    for indent, body in re.findall(r"^( *)```diff\n(.*?)^\1```", section, re.M | re.S):
        lines = [line[len(indent) :] for line in body.splitlines()]
        old = [line[1:] for line in lines if not line.startswith("+")]
        new = [line[1:] for line in lines if not line.startswith("-")]
        diffs.append(("\n".join(old) + "\n", "\n".join(new) + "\n"))
    return diffs


def snapshot(out: str) -> dict[str, str]:
    """The repository's code copied twice under `out`/code: as it is, and with recipe 5 applied
    to ppo_ddp.py -> rule -> the copy's root."""
    with open(os.path.join(ROOT, "docs", "forking.md")) as f:
        diffs = recipe_diffs(f.read(), 5)
    skip = shutil.ignore_patterns(".git", "runs", "__pycache__", "tests", "docs", "benchmarks")
    roots = {rule: os.path.abspath(os.path.join(out, "code", rule)) for rule in RULES}
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(ROOT, root, ignore=skip)
    path = os.path.join(roots["final"], "ppo_ddp.py")
    with open(path) as f:
        script = f.read()
    for old, new in diffs:
        if script.count(old) != 1:
            raise SystemExit(f"recipe 5 of docs/forking.md does not fit ppo_ddp.py:\n{old}")
        script = script.replace(old, new)
    with open(path, "w") as f:
        f.write(script)
    return roots


def summary(rows: list[dict]) -> dict[str, float]:
    """A run's figures from its metrics.jsonl rows."""
    returns = [row["episode_return"] for row in rows[-10:] if row["episode_return"] is not None]
    last = rows[-50:]
    return {
        "return": statistics.mean(returns) if returns else float("nan"),
        "value_loss": statistics.mean(row["value_loss"] for row in last),
        "explained": statistics.mean(row["explained_variance"] for row in last),
        "fps": rows[-1]["env_steps"] / rows[-1]["time_s"],
        "collect_fps": rows[-1]["env_steps"] / sum(row["collect_s"] for row in rows),
        "env_steps": rows[-1]["env_steps"],
    }


def run(cfg: Config, root: str, task: str, seed: int, run_dir: str) -> dict[str, float]:
    """One run in the copy at `root` -> its figures."""
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["--task", task, "--seed", str(seed), "--logger", "none", *shlex.split(cfg.extra)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={cfg.nproc}", "ppo_ddp.py", "--run-dir", run_dir, *args]
    started = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    subprocess.run(command, cwd=root, check=True, stdout=subprocess.DEVNULL, env=env)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        figures = summary([json.loads(line) for line in f])
    return {**figures, "wall_s": time.time() - started}


def main(cfg: Config) -> None:
    roots = snapshot(cfg.out)
    print(
        "| task | bootstrap | seed | last-10 return | value loss (last 50) | explained variance "
        "(last 50) | env steps/s | collect steps/s | env steps | wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for task in cfg.tasks:
        for seed in cfg.seeds:
            for rule in RULES:
                name = f"{task.replace(':', '_')}_{rule}_s{seed}"
                run_dir = os.path.abspath(os.path.join(cfg.out, name))
                f = run(cfg, roots[rule], task, seed, run_dir)
                print(
                    f"| {task} | {rule} | {seed} | {f['return']:.1f} | {f['value_loss']:.3g} | "
                    f"{f['explained']:.3f} | {f['fps']:,.0f} | {f['collect_fps']:,.0f} | "
                    f"{f['env_steps']:,} | {f['wall_s']:.0f} s |",
                    flush=True,
                )


if __name__ == "__main__":
    main(tyro.cli(Config))
