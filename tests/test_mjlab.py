"""`--task mjlab:<id>` on CPU: a 2-rank run with the task's own settings, then evaluate and export.

Needs mjlab in a venv of its own (`pip install -r requirements-mjlab.txt`); skipped without it. The
first build of a task compiles Warp's kernels (about 100 s on 2 cores), cached in ~/.cache/warp.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import ROOT, torchrun

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mjlab") is None,
    reason="needs mjlab: pip install -r requirements-mjlab.txt (own venv)",
)

TASK = "mjlab:Mjlab-Cartpole-Swingup"


def test_mjlab_task_trains_on_two_ranks_with_its_settings_then_evaluates_and_exports(tmp_path):
    # 10 x 100 steps: every env reaches its 1,000-step time limit once (mjlab logs its values on
    # resets).
    args = (
        "--task",
        TASK,
        "--num-envs",
        "4",
        "--steps-per-env",
        "100",
        "--iterations",
        "10",
        "--actor-hidden",
        "32",
        "32",
    )
    result = torchrun(
        "ppo_ddp.py",
        *args,
        "--check-interval",
        "1",
        "--run-dir",
        "run",
        "--logger",
        "none",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    # The task's rsl_rl settings are the defaults; the command line's --actor-hidden wins.
    config = "mjlab's registered rsl_rl config"
    settings = f"settings from {TASK} ({config}): --actor-obs actor --no-normalize-obs"
    assert result.stdout.count(settings) == 1, result.stdout
    saved = torch.load(tmp_path / "run" / "model_10.pt", weights_only=True)
    assert saved["args"]["actor_hidden"] == (32, 32) and saved["args"]["critic_hidden"] == (64, 64)
    assert saved["args"]["actor_obs"] == ("actor",) and saved["args"]["std_type"] == "scalar"
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iteration"] for r in rows] == list(range(1, 11))
    assert any(k.startswith("Episode_Reward/") for r in rows for k in r)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    for tool, extra in (
        ("evaluate.py", ("--episodes", "4")),
        ("export.py", ("--formats", "torchscript")),
    ):
        done = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", tool), "run", *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "run" / "exported" / "policy.pt").exists()
