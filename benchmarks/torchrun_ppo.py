"""What the learning benchmarks (mujoco.py, rnd.py) share: one ppo_ddp.py run under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def train(nproc: int, run_dir: str, args: list[str]) -> tuple[list[dict], float]:
    """`torchrun --standalone --nproc_per_node=<nproc> ppo_ddp.py --run-dir <run_dir> <args>`, run
    from the repository root with one thread per process -> (rank 0's metrics.jsonl rows, wall
    seconds)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "ppo_ddp.py",
        "--run-dir",
        run_dir,
        *args,
    ]
    started = time.time()
    subprocess.run(
        command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    wall = time.time() - started
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], wall
