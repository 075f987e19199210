"""The benchmarks run: benchmarks/gpu.py end to end (a CPU smoke run; rsl_rl's side when rsl-rl-lib is installed),
benchmarks/mjlab.py's return as rsl_rl logs it."""

import importlib.util
import os
import runpy
import subprocess
import sys

from dist_helpers import ROOT


def test_gpu_benchmark_smoke_run_on_cpu_prints_its_tables():
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--device", "cpu", "--sizes", "16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [*command, "--iterations", "6"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stderr[-2000:]
    header = (
        "| envs per GPU | `ppo_ddp.py` FPS | `--cuda-graphs` FPS | rsl_rl 5.5.1 FPS | ratio | `--cuda-graphs` ratio |"
    )
    row = result.stdout.split(header, 1)[1].splitlines()[2].split("|")
    assert row[1].strip() == "16" and float(row[2].replace(",", "")) > 0 and float(row[3].replace(",", "")) > 0
    if importlib.util.find_spec("rsl_rl") is not None:  # rsl_rl's runner ran on the same env and sizes
        assert float(row[4].replace(",", "")) > 0
    # Without CUDA, --cuda-graphs runs the same steps eagerly: the first iterations agree exactly.
    assert "(first 3 iterations within 0.0e+00 of eager)" in result.stdout
    assert "One iteration under torch.profiler" in result.stdout


def test_mjlab_benchmark_return_is_the_mean_of_the_last_100_episodes():
    # runpy: the module's own namespace, without mjlab or tensorboard (imported only to run and read the trainers).
    bench = runpy.run_path(os.path.join(ROOT, "benchmarks", "mjlab.py"), run_name="benchmark_mjlab")
    means = bench["last_episodes_mean"]([None, 1.0, 1.0, 2.0, 3.0], [0, 60, 0, 30, 20])
    assert means == [None, 1.0, 1.0, (60 + 60) / 90, (50 * 1.0 + 30 * 2.0 + 20 * 3.0) / 100]
