"""One job per run directory, and a run that continues past a damaged checkpoint."""

import hashlib
import importlib.util
import json
import os
import subprocess
import time

import pytest

import bookkeeping
import common
import ppo_ddp
from dist_helpers import (
    FAR_TIMEOUT,
    PROMPT_S,
    our_traceback,
    small_args,
    torchrun,
    torchrun_command,
)

# An env that holds its job after iteration 2 until the file `go` appears in the working directory.
GATED_ENV = """
import os, time
from envs.pendulum import Pendulum


class Gated(Pendulum):
    def step(self, actions):
        self.steps = getattr(self, "steps", 0) + 1
        while self.steps > 16 and not os.path.exists("go"):
            time.sleep(0.05)
        return super().step(actions)
"""

SMALL = ("--num-envs", "8", "--steps-per-env", "8", "--device", "cpu")


def _rows(run_dir):
    return [
        json.loads(line)["iteration"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def _digest(folder):
    """The run's files (`.lock` names whichever job took the directory last; only a held lock
    counts)."""
    files = sorted(f for f in os.listdir(folder) if f != ".lock")
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in files}


def test_second_job_into_a_taken_run_dir_stops_and_touches_nothing(tmp_path):
    """Job A holds `run` while it trains; job B, started into the same directory, stops at once with
    one line naming A's process and changes no file of A's; A then ends with one row per iteration.
    """
    (tmp_path / "gated_env.py").write_text(GATED_ENV)
    args = (
        *SMALL,
        *FAR_TIMEOUT,
        "--task",
        "gated_env:Gated",
        "--iterations",
        "5",
        "--run-dir",
        "run",
    )
    args = (*args, "--save-interval", "1")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    first = subprocess.Popen(
        torchrun_command("ppo_ddp.py", *args),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + PROMPT_S
        while not (tmp_path / "run" / "model_2.pt").exists():  # A is waiting at iteration 3
            assert time.time() < deadline and first.poll() is None, (
                "the first job did not reach iteration 2"
            )
            time.sleep(0.2)
        before = _digest(tmp_path / "run")
        second = torchrun("ppo_ddp.py", *args, cwd=tmp_path, timeout=PROMPT_S)
        output = second.stdout + second.stderr
        assert second.returncode != 0, output
        assert output.count("error: run directory 'run' is in use by another job (pid ") == 1, (
            output
        )
        assert "wait for it to end, or pass another --run-dir." in output and not our_traceback(
            output
        ), output
        assert _digest(tmp_path / "run") == before
    finally:
        (tmp_path / "go").write_text("")
        out, err = first.communicate(timeout=PROMPT_S)
    assert first.returncode == 0, err
    assert _rows(tmp_path / "run") == [1, 2, 3, 4, 5]


ARGS = {"num_envs": 8, "steps_per_env": 8, "device": "cpu", "save_interval": 2}


def test_resume_auto_skips_a_damaged_newest_checkpoint(tmp_path, capsys):
    """The newest checkpoint cut to half its size: `--resume auto` says so in one line and continues
    from the one before; an explicit `--resume` of it fails, naming that older checkpoint."""
    run = tmp_path / "run"
    ppo_ddp.main(small_args(ppo_ddp.Args, **ARGS, iterations=4, run_dir=str(run)))
    damaged = run / "model_4.pt"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    with pytest.raises(common.Failure, match=f"cannot read checkpoint '{damaged}'") as refused:
        ppo_ddp.main(
            small_args(ppo_ddp.Args, **ARGS, iterations=6, run_dir=str(run), resume=str(damaged))
        )
    assert (
        f"The newest readable checkpoint there is '{run / 'model_2.pt'}': pass it to --resume."
        in str(refused.value)
    )
    capsys.readouterr()
    ppo_ddp.main(small_args(ppo_ddp.Args, **ARGS, iterations=6, run_dir=str(run), resume="auto"))
    out = capsys.readouterr().out
    assert (
        out.count(f"warning: cannot read checkpoint '{damaged}'") == 1
        and "--resume auto skips it." in out
    )
    assert _rows(run) == [1, 2, 3, 4, 5, 6]
    assert [
        json.loads(line)["first_iteration"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ] == [1, 1, 3, 3, 3, 3]


def test_fresh_start_into_a_run_dir_with_checkpoints_is_refused(tmp_path):
    """Its checkpoints would mix with the other run's (and `--keep-checkpoints` would delete its
    own)."""
    run = tmp_path / "run"
    ppo_ddp.main(small_args(ppo_ddp.Args, **ARGS, iterations=2, run_dir=str(run)))
    before = _digest(run)
    with pytest.raises(
        common.Failure, match=r"holds checkpoints of another run \(newest model_2.pt\); continue it"
    ):
        ppo_ddp.main(small_args(ppo_ddp.Args, **ARGS, iterations=2, run_dir=str(run)))
    assert _digest(run) == before


def test_a_run_whose_metrics_end_in_half_a_row_resumes_and_keeps_every_iteration_once(tmp_path):
    """A crash in mid-write leaves `metrics.jsonl` ending in half a row (and, with TensorBoard
    installed, its event file cut short): `--resume auto` sets the half row aside in
    `metrics.jsonl.damaged` with one line, on 2 ranks, and every iteration is in the file exactly
    once; TensorBoard reads each curve in order."""
    board = importlib.util.find_spec("tensorboard") is not None
    logger = ("--logger", "tensorboard" if board else "none")
    args = (*SMALL, "--run-dir", "run", "--resume", "auto", "--save-interval", "1", *logger)
    first = torchrun("ppo_ddp.py", *args, "--iterations", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "env_steps": 38')  # iteration 3's row, cut off by the crash
    events = [
        tmp_path / "run" / name
        for name in os.listdir(tmp_path / "run")
        if name.startswith("events.out")
    ]
    for event_file in events:  # its last record cut short
        os.truncate(event_file, os.path.getsize(event_file) - 7)
    second = torchrun("ppo_ddp.py", *args, "--iterations", "4", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert not our_traceback(second.stderr)
    notes = [line for line in second.stdout.splitlines() if "damaged row" in line]
    assert len(notes) == 1 and "metrics.jsonl.damaged" in notes[0]
    assert _rows(tmp_path / "run") == [1, 2, 3, 4]
    if board:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        curves = EventAccumulator(str(tmp_path / "run"))
        curves.Reload()
        steps = {tag: [e.step for e in curves.Scalars(tag)] for tag in curves.Tags()["scalars"]}
        assert len(steps) > 5 and all(s == sorted(set(s)) and s[-1] == 4 for s in steps.values())
        # the one record cut short: its iteration 2
        assert sum(s != [1, 2, 3, 4] for s in steps.values()) <= 1
    assert (
        tmp_path / "run" / "metrics.jsonl.damaged"
    ).read_text() == '{"iteration": 3, "env_steps": 38\n'


def test_a_whole_last_row_cut_before_its_newline_is_kept_and_the_next_row_starts_on_its_own_line(
    tmp_path,
):
    metrics = tmp_path / "metrics.jsonl"
    # the crash came between the row and its newline
    metrics.write_text('{"iteration": 1}\n{"iteration": 2}')
    bookkeeping.trim_metrics(str(tmp_path), 3)
    with open(metrics, "a") as f:
        f.write('{"iteration": 3}\n')
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    assert not (tmp_path / "metrics.jsonl.damaged").exists()
