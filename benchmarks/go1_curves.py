"""Go1 under Playground's default reward along a run's checkpoints: each `model_<it>.pt` of the
given run directories evaluated with the mean action (`tools/evaluate.py --episodes 16 --task
envpool:Go1JoystickFlatTerrain-v1`, kept as `eval_<it>.json` beside it; an `eval_<it>.json` already
there is reused, with or without its checkpoint), then one PNG of return and the tracking, pose and
clearance terms against env steps, with standing's (zero actions) dashed and the goals of
docs/go1.md dotted. Directories are read in the order given (a run and its continuations);
`<dir>:<iteration>` leaves out what that directory holds past the iteration its continuation
started from.

    python benchmarks/go1_curves.py runs/go1_trot:450 runs/go1_trot_lift:750 runs/go1_trot_high \
        --out docs/img/go1_trot_eval.png

Needs EnvPool and matplotlib (`pip install -r requirements-envs.txt matplotlib`).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Annotated

import tyro

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import evaluate  # noqa: E402
from policy import output_folder  # noqa: E402

TASK = "envpool:Go1JoystickFlatTerrain-v1"
TERMS = ["reward_tracking_lin_vel", "reward_tracking_ang_vel", "reward_pose"]
TERMS += ["reward_feet_clearance"]
# the bar a walking policy has to clear (docs/go1.md)
GOALS = {"return_mean": 24.0, "reward_tracking_lin_vel": 0.8, "reward_tracking_ang_vel": 0.4}
GOALS["reward_feet_clearance"] = -0.1


@dataclass
class Config:
    runs: Annotated[list[str], tyro.conf.Positional]
    """Run directories, in the order the run went through them."""
    out: str = "go1_curves.png"
    """PNG to write."""
    every: int = 1
    """Evaluate every this many checkpoints of each run (its last always)."""


def evaluated(checkpoint: str) -> dict:
    """The default-reward evaluation of one checkpoint, cached beside it (a shipped policy's: under
    `runs/`, `policy.output_folder`)."""
    iteration = re.search(r"model_(\d+)\.pt$", checkpoint).group(1)
    cached = os.path.join(output_folder(os.path.dirname(checkpoint)), f"eval_{iteration}.json")
    if os.path.exists(cached):
        with open(cached) as f:
            return json.load(f)
    config = evaluate.Config(checkpoint, episodes=16, task=TASK, out=cached)
    return evaluate.evaluate(config)


def figure_of(result: dict, key: str) -> float:
    """The mean return, or a term's mean per step, of an evaluation."""
    return result[key] if key == "return_mean" else result["terms"][key]


def main(config: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []  # (env steps, result)
    for spec in config.runs:
        run, _, until = spec.partition(":")
        found = glob.glob(os.path.join(run, "model_*.pt")) + glob.glob(
            os.path.join(run, "eval_*.json")
        )
        iterations = sorted(
            {int(n) for n in re.findall(r"(?:model|eval)_(\d+)\.", " ".join(found))}
        )
        iterations = [i for i in iterations if not until or i <= int(until)]
        picked = iterations[:: max(1, config.every)]
        if iterations and iterations[-1] not in picked:
            picked.append(iterations[-1])
        for iteration in picked:
            result = evaluated(os.path.join(run, f"model_{iteration}.pt"))
            steps = result["iteration"] * 6144  # 2 processes x 128 envs x 24 steps
            points.append((steps, result))
            print(f"{run} {iteration}: {steps / 1e6:.2f} M env steps, {result['return_mean']:.1f}")
    last = points[-1][1]["checkpoint"]
    cached = os.path.join(output_folder(os.path.dirname(last)), "eval_zero_actions.json")
    if os.path.exists(cached):
        with open(cached) as f:
            standing = json.load(f)
    else:
        zeros = evaluate.Config(last, episodes=16, task=TASK, out=cached, zero_actions=True)
        standing = evaluate.evaluate(zeros)
    steps = [s / 1e6 for s, _ in points]
    panels = [("return", "return_mean")] + [(term.removeprefix("reward_"), term) for term in TERMS]
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for axis, (title, key) in zip(axes, panels):
        axis.plot(steps, [figure_of(r, key) for _, r in points], "o-", label="policy")
        axis.axhline(figure_of(standing, key), color="gray", linestyle="--", label="standing")
        if key in GOALS:
            axis.axhline(GOALS[key], color="tab:red", linestyle=":", label="goal")
        axis.set_title(title)
        axis.set_xlabel("env steps (M)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(config.out, dpi=100)
    print(f"written {config.out}")


if __name__ == "__main__":
    main(tyro.cli(Config))
