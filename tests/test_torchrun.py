"""The scripts as users launch them: torchrun subprocesses on loopback."""

import json
import os
import subprocess
import sys

import pytest

import ppo_ddp
from dist_helpers import ROOT, chdir_rank_dir, free_port, run_ranks, torchrun

SMALL = ("--num-envs", "16", "--steps-per-env", "8")


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_torchrun_trains_and_resume_continues_at_next_iteration(tmp_path):
    first = torchrun(
        "ppo_ddp.py", *SMALL, "--iterations", "3", "--save-interval", "1", "--run-dir", "run", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr
    assert "seeds [1, 2]" in first.stdout
    rows = _metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "run" / "latest").read_text() == "model_3.pt"

    second = torchrun("ppo_ddp.py", *SMALL, "--iterations", "5", "--resume", "run", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    rows = _metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[3]["env_steps"] == 4 * 8 * 16 * 2  # the global step counter continues
    assert rows[3]["learning_rate"] > 0
    assert "seeds [1, 2]" not in second.stdout  # a resumed run draws new random numbers


def test_two_nodes_on_loopback_train_and_seed_by_global_rank(tmp_path):
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=loopback-test",
            f"{ROOT}/ppo_ddp.py", *SMALL, "--iterations", "2", "--run-dir", "run",
        ]  # fmt: skip
        (tmp_path / f"node{node}").mkdir()
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path / f"node{node}",
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"},
            )
        )
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    # Both nodes have LOCAL_RANK 0; seeds must still differ, so they come from the global rank.
    assert "2 process(es)" in outputs[0][0] and "seeds [1, 2]" in outputs[0][0]
    assert (tmp_path / "node0" / "run" / "metrics.jsonl").exists() and not (tmp_path / "node1" / "run").exists()


def _wrong_device_worker():
    try:
        ppo_ddp.main(ppo_ddp.Args(device="cuda:5", num_envs=4, steps_per_env=4, iterations=1))
    except ValueError as error:
        return str(error)
    return "no error"


def test_wrong_device_is_raised_on_every_rank_and_torchrun_exits_nonzero(tmp_path):
    messages = run_ranks(_wrong_device_worker, 2)
    for rank, message in enumerate(messages):
        assert f"'cuda:5' does not match this process's LOCAL_RANK={rank}" in message and f"cuda:{rank}" in message
    result = torchrun("ppo_ddp.py", *SMALL, "--device", "cuda:5", "--iterations", "1", cwd=tmp_path, timeout=60)
    assert result.returncode != 0
    assert "does not match this process's LOCAL_RANK=" in result.stderr


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
    ppo_ddp.main(ppo_ddp.Args(num_envs=8, steps_per_env=8, iterations=1, run_dir="run"))
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to list threads")
def test_leaving_the_group_stops_gloos_threads(tmp_path):
    # If anything keeps the process group alive past destroy_process_group (torch._dynamo, imported
    # by torch.optim after the group exists, did), gloo's threads outlive it and the interpreter can
    # abort at exit with "terminate called without an active exception".
    for names in run_ranks(_threads_after_main_worker, 2, str(tmp_path)):
        assert not [n for n in names if "gloo" in n], names
