"""The benchmarks run: benchmarks/gpu.py end to end (a CPU smoke run; rsl_rl's side when rsl-rl-lib
is installed), benchmarks/vs_rsl_rl.py end to end and its translation of our settings to rsl_rl's,
the return as rsl_rl logs it."""

import importlib.util
import os
import runpy
import subprocess
import sys

import pytest

from dist_helpers import ROOT

SCRIPTS = ["ppo_ddp.py", "ppo_amp_ddp.py", "ppo_rnn_ddp.py", "distill_ddp.py"]


def test_gpu_benchmark_smoke_run_on_cpu_prints_its_tables():
    command = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "gpu.py"),
        "--device",
        "cpu",
        "--sizes",
        "16",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [*command, "--iterations", "6"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    header = (
        "| envs per GPU | `ppo_ddp.py` FPS | `--cuda-graphs` FPS | rsl_rl 5.5.1 FPS | ratio | "
        "`--cuda-graphs` ratio |"
    )
    row = result.stdout.split(header, 1)[1].splitlines()[2].split("|")
    assert (
        row[1].strip() == "16"
        and float(row[2].replace(",", "")) > 0
        and float(row[3].replace(",", "")) > 0
    )
    if (
        importlib.util.find_spec("rsl_rl") is not None
    ):  # rsl_rl's runner ran on the same env and sizes
        assert float(row[4].replace(",", "")) > 0
    # Without CUDA, --cuda-graphs runs the same steps eagerly: the first iterations agree exactly.
    assert "(first 3 iterations within 0.0e+00 of eager)" in result.stdout
    assert "One iteration under torch.profiler" in result.stdout


def test_the_return_is_the_mean_of_the_last_100_episodes_as_rsl_rl_logs_it():
    # runpy: the module's own namespace; rsl_rl and mjlab are imported only to run the trainers.
    bench = runpy.run_path(
        os.path.join(ROOT, "benchmarks", "vs_rsl_rl.py"), run_name="benchmark_vs_rsl_rl"
    )
    means = bench["last_episodes_mean"]([None, 1.0, 1.0, 2.0, 3.0], [0, 60, 0, 30, 20])
    assert means == [None, 1.0, 1.0, (60 + 60) / 90, (50 * 1.0 + 30 * 2.0 + 20 * 3.0) / 100]


def test_vs_rsl_rl_gives_rsl_rl_our_settings_and_refuses_what_it_lacks():
    bench = runpy.run_path(
        os.path.join(ROOT, "benchmarks", "vs_rsl_rl.py"), run_name="benchmark_vs_rsl_rl"
    )
    args = bench["ppo_args"](
        bench["Config"](extra="--learning-rate 3e-4 --actor-hidden 32 16 --std-type scalar"), 64
    )
    config = bench["rsl_rl_config"](args, {"actor": ["policy"], "critic": ["policy"]})
    assert config["algorithm"]["learning_rate"] == 3e-4 and config["actor"]["hidden_dims"] == [
        32,
        16,
    ]
    assert (
        config["actor"]["distribution_cfg"]["std_type"] == "scalar"
        and config["num_steps_per_env"] == 32
    )
    joint = bench["ppo_args"](bench["Config"](extra="--grad-clip joint --scale-rewards"), 64)
    with pytest.raises(ValueError, match="no setting for --grad-clip joint, --scale-rewards"):
        bench["rsl_rl_config"](joint, {})


def test_vs_rsl_rl_smoke_run_prints_the_three_columns(tmp_path):
    pytest.importorskip("rsl_rl", reason="rsl-rl-lib==5.5.1 is in requirements-dev.txt")
    pytest.importorskip(
        "tensorboard", reason="rsl_rl keeps its episode statistics only with its log writer"
    )
    script = os.path.join(ROOT, "benchmarks", "vs_rsl_rl.py")
    # Every env from a reset, so that by step 200 (iteration 7 of 32 steps) each has ended a whole
    # episode.
    command = [sys.executable, script, "--iterations", "7", "--seeds", "1", "2", "--num-envs", "16"]
    command += ["--points", "1.0", "--out", str(tmp_path), "--extra=--no-init-at-random-ep-len"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    header = "| env steps | `rsl_rl` | `ppo_ddp 1x16` | `ppo_ddp 2x8` | differ by > 2 s.e. |"
    row = result.stdout.split(header, 1)[1].splitlines()[2].split("|")
    assert row[1].strip() == f"{7 * 16 * 32:,}"
    for cell in row[2:5]:  # every trainer finished episodes
        mean, se = (float(x.replace(",", "")) for x in cell.split("±"))
        assert mean < 0 and se >= 0, row
    # Run again: every run is read from its record, none trained again, the same table.
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and header in again.stdout and "seed1:" not in again.stdout
    assert again.stdout.split(header, 1)[1] == result.stdout.split(header, 1)[1]


def test_compile_step_benchmark_prints_the_mini_batch_and_the_policy_step(capsys):
    """A smoke run of benchmarks/compile_step.py with aot_eager (no C++ compiler needed): both
    tables, each with a row per backend and a positive time per step."""
    module = runpy.run_path(os.path.join(ROOT, "benchmarks", "compile_step.py"))
    config = module["Config"](backends=("eager", "aot_eager"), steps=4, policy_steps=4)
    module["main"](config)
    out = capsys.readouterr().out
    for table in ("| mini-batch step, 512 rows |", "| policy step, 16 rows |"):
        rows = out.split(table, 1)[1].splitlines()[2:4]
        assert [row.split("|")[1].strip() for row in rows] == ["eager", "aot_eager"]
        assert all(float(row.split("|")[3]) > 0 for row in rows)
    # no eager row to compare with
    module["main"](module["Config"](backends=("aot_eager",), steps=4, policy_steps=4))
    out = capsys.readouterr().out
    assert out.count("| – (no eager run) |") == 2 and "nan" not in out


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_default_run_loads_at_most_3000_lines_of_project_code(script, tmp_path):
    """benchmarks/reading.py: each script's default run (one iteration, one process) loads at most
    3,000 lines of the project's code: an extension, an adapter or a tool it does not use stays
    unloaded."""
    reading = os.path.join(ROOT, "benchmarks", "reading.py")
    done = subprocess.run(
        [sys.executable, reading, "--loaded", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    total = int(done.stdout.split("TOTAL ")[1].split()[0])
    assert 1000 < total <= 3000, done.stdout
