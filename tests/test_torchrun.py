"""The scripts as users launch them: torchrun subprocesses on loopback."""

import os
import subprocess
import sys

import pytest

import ppo_ddp
from dist_helpers import ROOT, chdir_rank_dir, free_port, run_ranks, small_args, torchrun

SMALL = ("--num-envs", "16", "--steps-per-env", "8")


def test_two_nodes_on_loopback_train_and_seed_by_global_rank(tmp_path):
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=loopback-test",
            f"{ROOT}/ppo_ddp.py",
            *SMALL,
            "--iterations",
            "2",
            "--run-dir",
            "run",
        ]
        (tmp_path / f"node{node}").mkdir()
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path / f"node{node}",
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={
                    "OMP_NUM_THREADS": "1",
                    "PATH": "/usr/bin:/bin",
                    "PYTHONUNBUFFERED": "1",
                    "CUDA_VISIBLE_DEVICES": "",
                },
            )
        )
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    # The rendezvous numbers the nodes (README's recipe passes no --node-rank); rank 0 alone writes.
    head = [node for node in range(2) if "process(es)" in outputs[node][0]]
    assert len(head) == 1 and (tmp_path / f"node{head[0]}" / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / f"node{1 - head[0]}" / "run").exists()
    # Both nodes have LOCAL_RANK 0; seeds must still differ, so they come from the global rank.
    assert "2 process(es)" in outputs[head[0]][0] and "seeds [1, 2]" in outputs[head[0]][0]


def test_compiled_networks_and_loss_train_in_two_processes(tmp_path):
    # The aot_eager backend traces forward and backward like inductor does, without its C++ build.
    result = torchrun(
        "ppo_ddp.py",
        *SMALL,
        "--iterations",
        "2",
        "--compile",
        "aot_eager",
        "--check-interval",
        "1",
        "--run-dir",
        "run",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "it 2/2" in result.stdout


def _threads_after_main_worker(root):
    chdir_rank_dir(root)
    ppo_ddp.main(small_args(ppo_ddp.Args, num_envs=8, steps_per_env=8, iterations=1, run_dir="run"))
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to list threads"
)
def test_leaving_the_group_stops_gloos_threads(tmp_path):
    # If anything keeps the process group alive past destroy_process_group (torch._dynamo, imported
    # by torch.optim after the group exists, did), gloo's threads outlive it and the interpreter can
    # abort at exit with "terminate called without an active exception".
    for names in run_ranks(_threads_after_main_worker, 2, str(tmp_path)):
        assert not [n for n in names if "gloo" in n], names
