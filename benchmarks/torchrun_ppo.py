"""What the benchmarks share: ppo_ddp.py's command line under torchrun (`command`, for mjlab.py),
and one run of it for the learning benchmarks (mujoco_suite.py, rnd.py, faults.py: `train`).
vs_rsl_rl.py writes the command itself: the tests run it in their own process, where this folder on
`sys.path` would let benchmarks/mjlab.py stand in for the mjlab package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def command(nproc: int) -> list[str]:
    """`torchrun --standalone --nproc_per_node=<nproc> ppo_ddp.py`, through this Python."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "ppo_ddp.py",
    ]


def train(nproc: int, run_dir: str, args: list[str]) -> tuple[list[dict], float]:
    """`torchrun --standalone --nproc_per_node=<nproc> ppo_ddp.py --run-dir <run_dir> <args>`, run
    from the repository root with one thread per process -> (rank 0's metrics.jsonl rows, wall
    seconds)."""
    started = time.time()
    subprocess.run(
        [*command(nproc), "--run-dir", run_dir, *args],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wall = time.time() - started
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], wall
