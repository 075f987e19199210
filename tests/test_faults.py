"""Fault injection: a failing rank, NaN from the environment, SIGTERM, kill -9, bad input, drift."""

import hashlib
import importlib.util
import json
import math
import os
import random
import re
import runpy
import signal
import subprocess
import sys
import time

import pytest
import torch

import arguments
import checkpoints
import common
import ppo_ddp
from dist_helpers import (
    FAR_TIMEOUT,
    PROMPT_S,
    ROOT,
    chdir_rank_dir,
    free_port,
    our_traceback,
    run_ranks,
    script_ranks,
    small_args,
    torchrun,
    torchrun_command,
)

SMALL = ("--num-envs", "16", "--steps-per-env", "8")

FAULTY_ENV = '''
import os
import signal
import time
import torch
from envs.pendulum import Pendulum


class Faulty(Pendulum):
    """Pendulum that misbehaves on rank 1 from its `at_step`-th step on."""

    def __init__(self, num_envs, device, seed, mode, at_step):
        super().__init__(num_envs, device, seed)
        self.mode, self.at_step, self.steps = mode, at_step, 0

    def step(self, actions):
        obs, rewards, dones, extras = super().step(actions)
        self.steps += 1
        if os.environ.get("RANK") == "1" and self.steps >= self.at_step:
            if self.mode == "raise":
                raise RuntimeError("injected failure in the environment")
            if self.mode == "hang":
                while True:  # a simulator that never returns
                    time.sleep(0.1)
            if self.mode == "die":
                if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                    os.kill(os.getpid(), signal.SIGKILL)  # a lost node, the first time only
                return obs, rewards, dones, extras
            if self.mode == "done":
                extras = {**extras, "time_outs": torch.ones_like(dones)}
                return obs, rewards, torch.ones_like(dones), extras
            rewards = rewards.clone()
            # "huge" is finite, so it passes the check of the rollout, but its squared error is not
            rewards[0] = float("nan") if self.mode == "nan" else 1e30
        return obs, rewards, dones, extras


def raising(num_envs, device, seed):
    return Faulty(num_envs, device, seed, "raise", at_step=8 * 3 + 1)  # first step of iteration 4


def always_done(num_envs, device, seed):
    return Faulty(num_envs, device, seed, "done", at_step=1)


def nan(num_envs, device, seed):
    return Faulty(num_envs, device, seed, "nan", at_step=8 * 3 + 1)


def huge(num_envs, device, seed):
    return Faulty(num_envs, device, seed, "huge", at_step=8 * 3 + 1)


def hanging(num_envs, device, seed):
    return Faulty(num_envs, device, seed, "hang", at_step=8 * 3 + 1)


def dying(num_envs, device, seed):
    return Faulty(num_envs, device, seed, "die", at_step=8 * 3 + 1)
'''


def _all_tensors_finite(value):
    if torch.is_tensor(value):
        return bool(torch.isfinite(value).all()) if value.is_floating_point() else True
    if isinstance(value, dict):
        return all(_all_tensors_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_all_tensors_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


FAILURES = {
    "raising": "injected failure in the environment",
    "nan": "non-finite values (NaN/Inf) in rewards on rank 1 at iteration 4",
    "huge": "non-finite {stats} in the update: the environment",
}


AMP = ("ppo_amp_ddp.py", ("--disc-batch-size", "64"))


@pytest.mark.parametrize(
    "script, extra, mode", [("ppo_ddp.py", (), m) for m in sorted(FAILURES)] + [(*AMP, "huge")]
)
def test_failure_on_rank1_at_iteration_4_stops_every_rank_in_time(tmp_path, script, extra, mode):
    """Rank 1's env raises, returns NaN, or returns a reward so large that its loss overflows, at
    iteration 4: every rank stops at once, and no checkpoint after iteration 3 exists. AMP shares
    the first two paths with PPO; its loss, with the discriminator's, is the third."""
    message = re.escape(FAILURES[mode]).replace(r"\{stats\}", r"[a-z_, ]+")
    (tmp_path / "faulty_env.py").write_text(FAULTY_ENV)
    args = (*SMALL, *FAR_TIMEOUT, *extra, "--task", f"faulty_env:{mode}", "--iterations", "50")
    # FAR_TIMEOUT: no waiting for a collective
    args = (*args, "--save-interval", "1", "--run-dir", "run")
    if mode == "raising":  # rank 1 dies with its exception; torchrun stops the other ranks
        result = torchrun(script, *args, cwd=tmp_path, timeout=PROMPT_S)
        assert result.returncode != 0 and re.search(message, result.stderr)
        # torchrun names the failing rank
        assert "[rank1]" in result.stderr or "rank: 1" in result.stderr
    else:  # detected at a point every rank reaches: all stop together, and the job says why once
        codes, output = script_ranks(script, *args, cwd=tmp_path)
        assert (
            all(codes)
            and len(re.findall(f"error: {message}", output)) == 1
            and not our_traceback(output)
        ), output
    # The last completed iteration's checkpoint loads, and nothing non-finite reached a checkpoint.
    assert (tmp_path / "run" / "latest").read_text() == "model_3.pt"
    for name in os.listdir(tmp_path / "run"):
        if name.endswith(".pt"):
            state = checkpoints.load_checkpoint(
                str(tmp_path / "run" / name), script[: -len("_ddp.py")]
            )
            assert state["iteration"] <= 3 and _all_tensors_finite(state)


SCRIPT_ARGS = {
    "ppo_ddp.py": SMALL,
    "distill_ddp.py": (*SMALL, "--eval-envs", "4"),
}


def sigterm_once_saved(
    tmp_path, cmd: list[str], checkpoint: str, settle_s: float = 0.0
) -> tuple[int, str, str]:
    """Start `cmd` (torchrun) in `tmp_path`, wait until `run/<checkpoint>` exists and `settle_s`
    more, send SIGTERM to torchrun as a cluster scheduler does -> (its exit code, stdout, stderr).
    The output goes to files, not pipes: a pipe nobody reads fills (64 KiB, about 900 iterations'
    lines) and blocks rank 0 in `print` while rank 1 waits for it in a collective."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=err, text=True, env=env)
    deadline = time.time() + PROMPT_S
    while not (tmp_path / "run" / checkpoint).exists() and time.time() < deadline:
        time.sleep(0.2)
    saved = (tmp_path / "run" / checkpoint).exists()
    time.sleep(settle_s)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=PROMPT_S)
    assert saved, f"run/{checkpoint} did not appear within {PROMPT_S:g} s: {err_path.read_text()}"
    return proc.returncode, out_path.read_text(), err_path.read_text()


# Every loop ends its iteration with the same calls (common.reduce_logs, bookkeeping.save);
# distillation's ends with an evaluation of its own.
@pytest.mark.parametrize("script", ["distill_ddp.py", "ppo_ddp.py"])
def test_sigterm_saves_the_last_iteration_and_resume_continues(tmp_path, script):
    args = (*SCRIPT_ARGS[script], "--save-interval", "2", "--run-dir", "run")
    cmd = torchrun_command(script, *args, "--iterations", "100000")  # until the signal
    # `latest`, not model_2.pt: --keep-checkpoints 5 removes model_2.pt 10 iterations on, which
    # can be less than a poll's wait on a loaded machine
    code, out, err = sigterm_once_saved(tmp_path, cmd, "latest")
    assert code == 1, err  # torchrun's own exit code after a signal; the workers exit 0
    last = int(
        [line for line in out.splitlines() if line.startswith("it ")][-1].split()[1].split("/")[0]
    )
    assert f"stop signal received: stopping after iteration {last}" in out and "seeds [1, 2]" in out
    assert (tmp_path / "run" / "latest").read_text() == f"model_{last}.pt"

    resumed = torchrun(
        script, *args, "--iterations", str(last + 2), "--resume", "run", cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[1].startswith(f"it {last + 1}/")
    assert "seeds [1, 2]" not in resumed.stdout  # a resumed run draws new random numbers
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iteration"] for r in rows] == list(range(1, last + 3))
    assert rows[-1]["env_steps"] == (last + 2) * 8 * 16 * 2  # the global step counter continues
    if script == "distill_ddp.py":
        assert "teacher_return" in resumed.stdout  # the closing evaluation


def test_sigterm_while_a_rank_hangs_ends_every_rank_before_torchrun_must_kill(tmp_path):
    """torchrun sends one SIGTERM, then SIGKILL 30 s later. Rank 1's env hangs at iteration 4 and
    rank 0 waits for it in a collective, where no flag is read: the stop's grace timer ends each
    rank, rank 1 with one line that says why, before torchrun has to kill; the checkpoints already
    written stay whole."""
    (tmp_path / "faulty_env.py").write_text(FAULTY_ENV)
    args = (
        *SMALL,
        *FAR_TIMEOUT,
        "--task",
        "faulty_env:hanging",
        "--iterations",
        "50",
        "--save-interval",
        "1",
    )
    cmd = torchrun_command("ppo_ddp.py", *args, "--run-dir", "run", "--stop-grace-s", "5")
    # rank 1 hung, rank 0 waiting
    _, _, err = sigterm_once_saved(tmp_path, cmd, "model_3.pt", settle_s=1.0)
    assert "forcefully exiting" not in err, err  # torchrun's line when it has to SIGKILL a worker
    assert "error: rank 1 did not stop within --stop-grace-s 5 s of the stop signal" in err, err
    assert "resume from run." in err and not our_traceback(err)
    assert (tmp_path / "run" / "latest").read_text() == "model_3.pt"
    for name in os.listdir(tmp_path / "run"):
        if name.endswith(".pt"):
            assert (
                checkpoints.load_checkpoint(str(tmp_path / "run" / name), "ppo")["iteration"] <= 3
            )


def test_kill9_at_random_moments_leaves_every_checkpoint_loadable(tmp_path):
    rng = random.Random(0)
    run = str(tmp_path / "run")  # absolute: it marks every process of this test on its command line
    for round_ in range(2):
        resume = ("--resume", run) if (tmp_path / "run" / "latest").exists() else ()
        args = (*SMALL, "--iterations", "100000", "--save-interval", "1", "--keep-checkpoints", "3")
        cmd = torchrun_command("ppo_ddp.py", *args, "--run-dir", run, *resume)
        proc = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        )
        latest = tmp_path / "run" / "latest"
        before = latest.read_text() if latest.exists() else None
        deadline = time.time() + PROMPT_S
        while (not latest.exists() or latest.read_text() == before) and time.time() < deadline:
            time.sleep(0.05)  # training (again) and saving
        time.sleep(rng.uniform(0.0, 2.0))
        # torchrun starts each worker in a session of its own: kill them all, as a dying node would.
        subprocess.run(["pkill", "-9", "-f", run], check=False)
        proc.wait(timeout=PROMPT_S)
        deadline = time.time() + PROMPT_S
        while (
            subprocess.run(["pgrep", "-f", run], capture_output=True).returncode == 0
            and time.time() < deadline
        ):
            time.sleep(0.1)
        saved = [f for f in os.listdir(run) if f.endswith(".pt")]
        # --keep-checkpoints 3; a kill between writing the newest and removing the oldest leaves one
        # more, which the next save removes.
        assert 1 <= len(saved) <= 3 + 1, f"round {round_}: {saved}"
        for name in saved:
            assert checkpoints.load_checkpoint(os.path.join(run, name), "ppo")["iteration"] > 0
        assert checkpoints.load_checkpoint(run, "ppo")  # `latest` names a whole file


# --- in-process ranks: bad input on every rank -----------------------------------------------


@pytest.fixture(scope="module")
def pendulum_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pendulum")
    ppo_ddp.main(
        small_args(
            ppo_ddp.Args,
            num_envs=8,
            steps_per_env=8,
            iterations=2,
            run_dir=str(root / "run"),
            device="cpu",
        )
    )
    return root / "run"


def _bad_input_worker(root, cases, ports):
    """Run every bad-input case in this process, one process group (and port) per case."""
    os.chdir(root)
    messages = {}
    for (name, (overrides, per_rank)), port in zip(cases.items(), ports):
        os.environ["MASTER_PORT"] = str(port)
        settings = {"num_envs": 8, "steps_per_env": 8, "iterations": 2, "run_dir": "run"}
        args = small_args(
            ppo_ddp.Args, **{**settings, **overrides, **per_rank.get(os.environ["RANK"], {})}
        )
        try:
            ppo_ddp.main(args)
            messages[name] = "no error"
        except Exception as error:  # noqa: BLE001 - the message is what we check
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def _digest(folder):
    return {
        f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in sorted(os.listdir(folder))
    }


BAD_INPUTS = {
    "wrong device": ({"device": "cuda:5"}, {}, "'cuda:5' is not cuda:LOCAL_RANK"),
    "unknown task": ({"task": "nope"}, {}, "unknown task 'nope'"),
    "bad batch sizes": ({"mini_batches": 3}, {}, "is not divisible by mini_batches = 3"),
    "missing checkpoint": (
        {"resume": "nowhere/model_7.pt"},
        {},
        "checkpoint 'nowhere/model_7.pt' does not exist",
    ),
    "checkpoint of another task": (
        {"task": "reacher", "resume": "{run}"},
        {},
        "holds networks built otherwise than this run's: actor obs_shapes={'policy': [3]} (this "
        "run: {'policy': [10]})",
    ),
    "other network sizes": (
        {"actor_hidden": (128, 128), "resume": "{run}"},
        {},
        "holds networks built otherwise than this run's: actor hidden=[64, 64] (this run: [128, "
        "128]).",
    ),
    "not a PPO checkpoint": (
        {"resume": "{other}"},
        {},
        "is not a 'ppo' checkpoint (found 'distill')",
    ),
    "checkpoint of an earlier version": (
        {"resume": "{earlier}"},
        {},
        "in the format of an earlier version",
    ),
    "damaged checkpoint": (
        {"resume": "{damaged}"},
        {},
        "does not reproduce the state it was saved from",
    ),
    "mismatched ranks": (
        {},
        {"1": {"num_envs": 16}},
        "rank(s) [1] disagree with rank 0 on --num-envs;",
    ),
    "non-writable run directory": (
        {"run_dir": "{file}/run"},
        {},
        "rank 0 cannot write the run directory",
    ),
}


def test_bad_input_raises_on_every_rank_and_leaves_checkpoints_intact(tmp_path, pendulum_run):
    other = tmp_path / "other.pt"
    torch.save({"script": "distill", "student": {}}, other)
    earlier = tmp_path / "earlier.pt"
    # the format before networks kept their configs
    torch.save({"kind": "ppo", "actor": {}}, earlier)
    damaged = tmp_path / "damaged.pt"
    state = torch.load(pendulum_run / "model_2.pt", weights_only=True)
    state["actor"]["log_std"] += 1.0  # the weights no longer match the saved fingerprint
    torch.save(state, damaged)
    (tmp_path / "a_file").write_text("not a directory")
    paths = {
        "run": str(pendulum_run),
        "other": str(other),
        "earlier": str(earlier),
        "damaged": str(damaged),
    }
    paths["file"] = str(tmp_path / "a_file")
    cases = {
        name: (
            {k: v.format(**paths) if isinstance(v, str) else v for k, v in overrides.items()},
            per_rank,
        )
        for name, (overrides, per_rank, _) in BAD_INPUTS.items()
    }
    before = _digest(pendulum_run)
    results = run_ranks(_bad_input_worker, 2, str(tmp_path), cases, [free_port() for _ in cases])
    for rank, messages in enumerate(results):
        for name, (_, _, expected) in BAD_INPUTS.items():
            assert expected in messages[name], f"{name}, rank {rank}: {messages[name]}"
    assert _digest(pendulum_run) == before


def _error_of_small_run(error_type: type, **overrides: object) -> str:
    """Train a small ppo_ddp.py run in ./run; the message of the `error_type` it raises, or "no
    error"."""
    try:
        ppo_ddp.main(
            small_args(
                ppo_ddp.Args, **{"num_envs": 8, "steps_per_env": 8, "run_dir": "run", **overrides}
            )
        )
    except error_type as error:
        return str(error)
    return "no error"


def _drift_worker(root):
    chdir_rank_dir(root)
    # a bug: the gradient buffer is not averaged
    ppo_ddp.all_reduce_mean = lambda flat, world_size: None
    return _error_of_small_run(common.Failure, iterations=4, check_interval=2)


def test_periodic_consistency_check_stops_ranks_that_drifted(tmp_path):
    for message in run_ranks(_drift_worker, 2, str(tmp_path)):
        assert (
            "rank(s) [1] disagree with rank 0 on the trained state at iteration 2; ranks drifted "
            "apart" in message
        )


def _fingerprint_worker(root, iterations, resume):
    chdir_rank_dir(root)
    return ppo_ddp.main(
        small_args(
            ppo_ddp.Args,
            num_envs=8,
            steps_per_env=8,
            iterations=iterations,
            run_dir="run",
            resume=os.path.join(root, "0", "run") if resume else None,
        )
    )


def test_resume_restores_the_saved_state_hash_on_every_rank(tmp_path):
    first = run_ranks(_fingerprint_worker, 2, str(tmp_path), 2, False)
    saved = torch.load(tmp_path / "0" / "run" / "model_2.pt", weights_only=True)
    assert first[0] == first[1] == saved["fingerprint"]
    # On resume every rank recomputes the hash after loading and raises if it differs
    # (see the "damaged checkpoint" case above). Resumed with nothing left to train: the state every
    # rank holds right after the resume. (The SIGTERM and restart tests train on after a resume.)
    right_after = run_ranks(_fingerprint_worker, 2, str(tmp_path), 2, True)
    assert right_after == [saved["fingerprint"]] * 2


def _failed_save_worker(root):
    chdir_rank_dir(root)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    torch.save = disk_full  # only rank 0 writes checkpoints
    return _error_of_small_run(common.Failure, iterations=3, save_interval=2)


def test_failed_checkpoint_write_on_rank0_stops_every_rank(tmp_path):
    # the cause reaches rank 1 too, as its errno
    for message in run_ranks(_failed_save_worker, 2, str(tmp_path)):
        assert (
            "rank 0 could not write the checkpoint of iteration 2 in 'run' (No space left on "
            "device); the previous" in message
        )
        assert (
            "free space on that disk, or pass --run-dir on another, then continue with --resume "
            "run." in message
        )


def _full_disk_worker(root, run_dir):
    chdir_rank_dir(root)
    return _error_of_small_run(
        common.Failure, iterations=60, save_interval=1, keep_checkpoints=100, run_dir=run_dir
    )


def test_a_full_disk_is_named_and_the_checkpoints_before_it_load(tmp_path):
    """The run directory on a 300 KB tmpfs (needs the right to mount: root, as in CI and here): the
    disk fills at some checkpoint, every rank stops with one line that says so, and every checkpoint
    written before it, `latest` among them, loads whole."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(disk)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        messages = run_ranks(_full_disk_worker, 2, str(tmp_path), str(disk / "run"))
        assert all(m == messages[0] for m in messages), messages
        assert re.search(
            r"could not write the checkpoint of iteration \d+ in '.*' \(No space left on device\)",
            messages[0],
        )
        saved = sorted(f for f in os.listdir(disk / "run") if f.startswith("model_"))
        assert len(saved) >= 2 and not [f for f in os.listdir(disk / "run") if ".tmp-" in f]
        for name in [*saved, "latest"]:
            checkpoints.load_checkpoint(str(disk / "run" / name), "ppo")  # raises if damaged
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_amp_rank_without_policy_transitions_stops_every_rank(tmp_path):
    (tmp_path / "faulty_env.py").write_text(FAULTY_ENV)
    args = (
        "--disc-batch-size",
        "64",
        "--task",
        "faulty_env:always_done",
        "--iterations",
        "3",
        "--run-dir",
        "run",
    )
    codes, output = script_ranks("ppo_amp_ddp.py", *SMALL, *args, cwd=tmp_path)
    assert all(codes) and not our_traceback(output)
    assert output.count("error: rank(s) [1] collected no policy transition") == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_envs": -4}, "--num-envs -4 (must be at least 1)"),
        ({"num_envs": 0}, "--num-envs 0 (must be at least 1)"),
        ({"steps_per_env": 0}, "--steps-per-env 0 (must be at least 1)"),
        (
            {"mini_batches": 0, "epochs": 0},
            "--epochs 0 (must be at least 1); --mini-batches 0 (must be at least 1)",
        ),
        (
            {"gamma": 1.5, "learning_rate": 0.0},
            "--gamma 1.5 (must be in [0, 1]); --learning-rate 0.0 (must be above 0)",
        ),
        ({"entropy_coef": -0.1}, "--entropy-coef -0.1 (must be 0 or more)"),
        ({"device": "gpu"}, "unknown device 'gpu'"),
    ],
)
def test_bad_argument_is_named_before_anything_is_written(tmp_path, overrides, message):
    args = small_args(
        ppo_ddp.Args,
        **{"num_envs": 8, "steps_per_env": 8, "run_dir": str(tmp_path / "run"), **overrides},
    )
    with pytest.raises((common.Failure, ValueError)) as error:
        arguments.check_args(args)  # as the command line is parsed, before any process group
        ppo_ddp.main(args)
    assert message in str(error.value)
    assert not (tmp_path / "run").exists()


def test_console_lines_are_short_and_the_run_ends_with_a_summary(tmp_path, capsys):
    """Every console line fits 120 columns; the run says where its last checkpoint is; resuming a
    finished run says there is nothing to train."""
    args = {
        "num_envs": 8,
        "steps_per_env": 8,
        "iterations": 2,
        "device": "cpu",
        "run_dir": str(tmp_path / "run"),
    }
    ppo_ddp.main(small_args(ppo_ddp.Args, **args))
    out = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 120 for line in out if line.startswith("it ")), out
    assert (
        out[-1].startswith("done: iteration 2/2")
        and f"last checkpoint {tmp_path / 'run' / 'model_2.pt'}" in out[-1]
    )
    ppo_ddp.main(
        small_args(ppo_ddp.Args, **args, resume=str(tmp_path / "run"), compile="aot_eager")
    )
    out = capsys.readouterr().out
    assert "nothing to train: the run reached iteration 2 of --iterations 2" in out
    assert "compiles" not in out  # no iteration, nothing to compile


@pytest.mark.parametrize("save_interval, resumed_at", [(2, 3), (10, 1)])
def test_restarted_job_logs_each_iteration_once(tmp_path, save_interval, resumed_at):
    """Rank 1 is killed at iteration 4 under `torchrun --max-restarts=1` with `--resume auto`: the
    restarted job continues from model_2.pt (or, with no checkpoint yet, starts afresh), keeps only
    the rows before that, and ends with one row per iteration, in order, in metrics.jsonl and in
    TensorBoard alike; its ranks agree on the trained state at every iteration (`--check-interval
    1`)."""
    (tmp_path / "faulty_env.py").write_text(FAULTY_ENV)
    args = (
        "--task",
        "faulty_env:dying",
        "--iterations",
        "6",
        "--save-interval",
        str(save_interval),
    )
    result = torchrun(
        "ppo_ddp.py",
        *SMALL,
        *args,
        "--check-interval",
        "1",
        "--run-dir",
        "run",
        "--resume",
        "auto",
        cwd=tmp_path,
        timeout=120,
        extra=("--max-restarts=1",),
    )
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["first_iteration"] for r in rows] == [1] * (resumed_at - 1) + [resumed_at] * (
        7 - resumed_at
    )
    assert [r["env_steps"] for r in rows] == [i * 8 * 16 * 2 for i in range(1, 7)]
    assert result.stdout.count("PPO on faulty_env:dying") == 2  # the first start and the restart
    # a resumed run draws new numbers
    assert result.stdout.count("seeds [1, 2]") == 1 + (resumed_at == 1)
    assert (run / "latest").read_text() == "model_6.pt"
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        board = EventAccumulator(str(run))
        board.Reload()
        for tag in ("Loss/learning_rate", "Perf/total_fps"):
            assert [(e.step, e.value) for e in board.Scalars(tag)] == [
                (
                    r["iteration"],
                    pytest.approx(r[{"Loss/learning_rate": "learning_rate"}.get(tag, "fps")]),
                )
                for r in rows
            ]


def test_resume_auto_needs_a_run_dir_and_starts_fresh_in_an_empty_one(tmp_path):
    with pytest.raises(common.Failure, match="--resume auto needs --run-dir"):
        ppo_ddp.main(
            small_args(
                ppo_ddp.Args, num_envs=8, steps_per_env=8, iterations=1, device="cpu", resume="auto"
            )
        )
    args = {
        "num_envs": 8,
        "steps_per_env": 8,
        "device": "cpu",
        "resume": "auto",
        "run_dir": str(tmp_path / "run"),
    }
    ppo_ddp.main(small_args(ppo_ddp.Args, iterations=1, **args))  # nothing there yet: a fresh run
    ppo_ddp.main(small_args(ppo_ddp.Args, iterations=2, **args))  # continues at iteration 2
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in rows] == [1, 2]


def test_a_resume_keeps_the_checkpoints_learning_rate_and_says_so(tmp_path, capsys):
    """As rsl_rl does, a resumed run takes the optimizer's state with its learning rate: a fixed
    schedule's `--learning-rate` on the resuming command line does not change it, and one line says
    so."""
    args = {"num_envs": 8, "steps_per_env": 8, "device": "cpu", "schedule": "fixed"}
    args["run_dir"] = str(tmp_path / "run")
    ppo_ddp.main(small_args(ppo_ddp.Args, iterations=1, learning_rate=1e-3, **args))
    capsys.readouterr()
    resume = {**args, "resume": "auto"}
    ppo_ddp.main(small_args(ppo_ddp.Args, iterations=2, learning_rate=1e-4, **resume))
    assert "continues at its checkpoint's learning rate 0.001" in capsys.readouterr().out
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["learning_rate"] for line in rows] == [1e-3, 1e-3]
    ppo_ddp.main(small_args(ppo_ddp.Args, iterations=3, learning_rate=1e-3, **resume))
    assert "checkpoint's learning rate" not in capsys.readouterr().out


def test_fault_soak_survives_workers_killed_while_writing(tmp_path):
    """benchmarks/faults.py's short version: under `torchrun --max-restarts=2 --resume auto`, rank 0
    is SIGKILLed once while it writes a checkpoint and once as it writes its metrics row; the job
    ends with every iteration logged once and every checkpoint loadable."""
    out = tmp_path / "soak"
    command = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "faults.py"),
        "--kills",
        "2",
        "--moments",
        "checkpoint write",
        "metrics write",
        "--iterations",
        "12",
        "--save-interval",
        "3",
        "--extra=--num-envs 16 --steps-per-env 8",
        "--baseline-seeds",
        "--out",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "faults survived 2 of 2, rows lost 0, rows doubled 0, corrupt checkpoints 0"
        in result.stdout
    )
    assert (
        re.search(r"kill 1/2 \(\w+ write\): rank 0 ", result.stdout)
        and "missed" not in result.stdout
    )
    log = (
        out / "killed.log"
    ).read_text()  # the job's output: the surviving rank says in one line what it lost
    assert "lost another rank" in log and not our_traceback(log), log
    rows = [
        json.loads(line) for line in (out / "killed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iteration"] for r in rows] == list(range(1, 13))
    assert [r["env_steps"] for r in rows] == [i * 8 * 16 * 2 for i in range(1, 13)]


def test_two_nodes_restart_after_a_worker_dies_and_resume_from_the_shared_run_dir(tmp_path):
    """Two torchrun agents on loopback (two "nodes" of one process each, c10d rendezvous,
    --max-restarts=1), one run directory both see: the worker of one node is SIGKILLed after
    model_2.pt; both agents start a new round, the job resumes from the newest checkpoint and ends
    with every iteration logged once."""
    workers = runpy.run_path(os.path.join(ROOT, "benchmarks", "faults.py"), run_name="faults")[
        "workers"
    ]
    # one directory for both nodes: a shared file system
    port, run = free_port(), str(tmp_path / "run")
    args = (
        *SMALL,
        "--iterations",
        "10",
        "--save-interval",
        "2",
        "--check-interval",
        "1",
        "--resume",
        "auto",
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--max-restarts=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=restart-test",
                os.path.join(ROOT, "ppo_ddp.py"),
                *args,
                "--run-dir",
                run,
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    deadline = time.time() + PROMPT_S
    while not os.path.exists(os.path.join(run, "model_2.pt")) and time.time() < deadline:
        time.sleep(0.05)
    victim = workers(agents[1].pid)
    assert len(victim) == 1, "the second agent's worker is not running"
    os.kill(next(iter(victim.values())), signal.SIGKILL)
    outputs = [agent.communicate(timeout=PROMPT_S)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    both = "".join(outputs)
    # the first round and the restarted one
    assert both.count("PPO on pendulum: 2 process(es)") == 2
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == list(range(1, 11))
    assert rows[-1]["first_iteration"] > 1  # the restarted round resumed from a checkpoint
    assert [r["env_steps"] for r in rows] == [i * 8 * 16 * 2 for i in range(1, 11)]
