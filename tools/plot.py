"""Learning curves of one or more runs, from their `metrics.jsonl`, as one PNG.

Panels: episode return, FPS, learning rate, every loss and every env log scalar the runs logged,
against env steps. Runs whose directory names differ only by a `_seed<N>` ending (as
benchmarks/rnd.py writes them) are seeds of one setting: drawn as their mean and a min-max band.

    python tools/plot.py runs/ppo_pendulum/<time>            # -> <that run>/curves.png
    python tools/plot.py runs/benchmark_rnd/* --out rnd.png  # PPO vs PPO + RND, 3 seeds each
    python tools/plot.py runs/ppo_reacher/<time> --keys episode_return value_loss  # some columns

Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Annotated

import tyro
from policy import output_folder, run_tool

# Columns that are bookkeeping, not curves.
SKIP = {
    "iteration",
    "env_steps",
    "episodes_finished",
    "time_s",
    "world_size",
    "first_iteration",
    "collect_s",
    "update_s",
}
# then the rest, in the order logged
FIRST = ["episode_return", "episode_length", "fps", "learning_rate"]


@dataclass
class Config:
    runs: Annotated[tuple[str, ...], tyro.conf.Positional]
    """Run directories (each with a metrics.jsonl)."""
    out: str | None = None
    """PNG to write; default `curves.png` in the first run's directory (a shipped policy's: under
    `runs/`, see `policy.output_folder`)."""
    title: str | None = None
    """Figure title; default: the run directories."""
    keys: tuple[str, ...] = ()
    """Only these columns, in this order (`--keys episode_return value_loss`); default: all."""


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of a run's metrics.jsonl; ValueError if it has none."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(
            f"{run_dir!r} has no metrics.jsonl; pass run directories written by the training "
            "scripts."
        )
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(
                    f"{path!r} line {number} is not JSON: the file is damaged; remove that line."
                ) from None
            # the last line of a run still writing it: left out
    if not rows:
        raise ValueError(
            f"{path!r} is empty: the run logged no iteration yet; plot it after its first "
            "iteration."
        )
    return rows


def group_runs(runs: tuple[str, ...]) -> dict[str, list[str]]:
    """Setting name -> its run directories: directories in the same folder whose names differ only
    by a `_seed<N>` ending are one setting. A setting is named by its directory name without the
    ending, with its folder when two settings would share that name."""
    groups: dict[str, list[str]] = {}
    for run in runs:
        path = os.path.normpath(run)
        groups.setdefault(
            os.path.join(os.path.dirname(path), re.sub(r"_seed\d+$", "", os.path.basename(path))),
            [],
        ).append(run)
    short = [os.path.basename(key) for key in groups]
    return {
        name if short.count(name) == 1 else key: members
        for key, name, members in zip(groups, short, groups.values())
    }


def curves(
    rows_of_seeds: list[list[dict]], key: str
) -> tuple[list[float], list[float], list[float], list[float]]:
    """(env steps, mean, min, max) of `key` over seeds, cut to the shortest run; missing values
    skipped."""
    length = min(len(rows) for rows in rows_of_seeds)
    steps, mean, low, high = [], [], [], []
    for i in range(length):
        values = [rows[i].get(key) for rows in rows_of_seeds]
        values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        if values:
            steps.append(rows_of_seeds[0][i]["env_steps"])
            mean.append(sum(values) / len(values))
            low.append(min(values))
            high.append(max(values))
    return steps, mean, low, high


def plot(config: Config) -> str:
    """Draw every panel; returns the PNG's path."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no window
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from None
    if not config.runs:
        raise ValueError("pass at least one run directory.")
    settings = {
        name: [read_metrics(run) for run in runs] for name, runs in group_runs(config.runs).items()
    }
    logged = dict.fromkeys(
        k for seeds in settings.values() for rows in seeds for row in rows for k in row
    )
    keys = [k for k in FIRST if k in logged] + [
        k for k in logged if k not in SKIP and k not in FIRST
    ]
    if config.keys:
        missing = [k for k in config.keys if k not in logged]
        if missing:
            raise ValueError(
                f"--keys {missing} not in the runs' metrics; they log {sorted(logged)}."
            )
        keys = list(config.keys)
    columns = min(4, len(keys))
    rows_count = math.ceil(len(keys) / columns)
    fig, axes = plt.subplots(
        rows_count, columns, figsize=(4 * columns, 3 * rows_count), squeeze=False
    )
    for ax, key in zip(axes.flat, keys):
        for name, seeds in settings.items():
            steps, mean, low, high = curves(seeds, key)
            label = f"{name} ({len(seeds)} seeds)" if len(seeds) > 1 else name
            ax.plot(steps, mean, label=label, linewidth=1.2)
            if len(seeds) > 1:
                ax.fill_between(steps, low, high, alpha=0.25)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("env steps", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(config.title or ", ".join(config.runs), fontsize=11)
    fig.tight_layout()
    out = config.out or os.path.join(output_folder(config.runs[0]), "curves.png")
    fig.savefig(out, dpi=80)
    plt.close(fig)
    print(f"{len(keys)} panels of {len(config.runs)} run(s) written to {out}")
    return out


if __name__ == "__main__":
    run_tool(plot, Config)
