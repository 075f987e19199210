"""Every EnvPool id whose settings `envs/envpool.py` claims, started as a user would start it:

    torchrun --standalone --nproc_per_node=2 ppo_ddp.py --task envpool:<id> --iterations 1 \
        --num-envs 8

MuJoCo Playground's 19 locomotion tasks and Gymnasium's MuJoCo v5 tasks, one after another. Prints a
Markdown table: the id, whether it trained its iteration (rc 0 and one row in metrics.jsonl), the
wall seconds, the observation groups the actor and the critic read, and where the settings came
from. Exits 1 if any id failed. tests/test_envpool.py runs a sample of it in CI.

    python benchmarks/envpool_sweep.py                 # every id (about 10 minutes on 2 cores)
    python benchmarks/envpool_sweep.py --ids Go1JoystickFlatTerrain-v1 Hopper-v5
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from envs import envpool as adapter  # noqa: E402 - after its directory is on the path


@dataclass
class Config:
    ids: tuple[str, ...] = ()
    """EnvPool ids to start (default: every id the adapter claims settings for)."""
    num_envs: int = 8
    """Envs per process."""


def start(task_id: str, num_envs: int, run_dir: str) -> tuple[bool, float, str]:
    """One 2-process run of one iteration -> (trained, wall seconds, the settings line or the last
    error line)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "ppo_ddp.py",
        "--task",
        f"envpool:{task_id}",
        "--iterations",
        "1",
        "--num-envs",
        str(num_envs),
        "--run-dir",
        run_dir,
        "--logger",
        "none",
    ]
    started = time.time()
    done = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wall = time.time() - started
    metrics = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    lines = done.stdout.splitlines() + done.stderr.splitlines()
    said = next((line for line in lines if line.startswith("settings from")), "")
    if done.returncode or len(rows) != 1:
        said = next(
            (line for line in reversed(lines) if line.startswith("error:")),
            lines[-1] if lines else "",
        )
    return done.returncode == 0 and len(rows) == 1, wall, said


def main(config: Config) -> int:
    ids = list(config.ids) or adapter.claimed_ids()
    print("| id | trained | wall s | actor reads | critic reads | settings from |")
    print("|---|---|---|---|---|---|")
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        for task_id in ids:
            ok, wall, said = start(task_id, config.num_envs, os.path.join(scratch, task_id))
            failed += not ok
            actor = re.search(r"--actor-obs (\S+)", said)
            critic = re.search(r"--critic-obs (\S+)", said)
            source = re.search(r"\((.*?)\):", said)
            cells = [
                task_id,
                "yes" if ok else f"NO: {said}",
                f"{wall:.0f}",
                actor[1] if actor else "policy",
                critic[1] if critic else "policy (fallback)",
                source[1] if source else "",
            ]
            print("| " + " | ".join(cells) + " |", flush=True)
    print(
        f"\n{len(ids) - failed} of {len(ids)} ids trained one iteration on 2 processes with "
        f"{config.num_envs} envs each"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
