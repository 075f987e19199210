"""Bad input as a user meets it: `torchrun --nproc_per_node=2` on each row of the table in
docs/failures.md. The job exits non-zero without waiting for a collective to time out, says what was
wrong in one line printed once (not once per rank), shows no traceback from our processes and leaves
no run directory behind. torchrun's own ChildFailedError report (with its own traceback) follows our
line; it is not ours."""

import os
import signal
import subprocess
import time

import numpy as np
import pytest

from dist_helpers import (
    FAR_TIMEOUT,
    PROMPT_S,
    ROOT,
    our_traceback,
    script_ranks,
    torchrun,
    torchrun_command,
)

SMALL = (
    "--num-envs",
    "8",
    "--steps-per-env",
    "8",
    "--iterations",
    "2",
    "--device",
    "cpu",
    *FAR_TIMEOUT,
)  # a later --device wins

# One environment per rank: rank 1's simulator cannot start (a file missing on one node, say).
ONE_RANK_FAILS = """
import os
from envs.pendulum import Pendulum

def flaky(num_envs, device, seed):
    if os.environ["RANK"] == "1":
        raise FileNotFoundError("no simulator license on this node")
    return Pendulum(num_envs, device, seed)
"""

# Rank 1's simulator takes a minute to boot.
SLOW_RANK = """
import os, time
from envs.pendulum import Pendulum

def slow(num_envs, device, seed):
    if os.environ["RANK"] == "1":
        time.sleep(60)
    return Pendulum(num_envs, device, seed)
"""

# An environment function that takes other arguments than the scripts pass (num_envs, device, seed).
WRONG_SIGNATURE = """
from envs.pendulum import Pendulum

def make(n, where):
    return Pendulum(n, where, 0)
"""

# Rank 1's env starts to give a wider `policy` group at its 40th step (iteration 2 of 32 steps).
SHAPE_SHIFTER = """
import os
import torch
from envs.pendulum import Pendulum
from envs.pendulum_partial import PendulumPartial

class ShapeShifter({base}):
    steps = 0

    def get_observations(self):
        obs = super().get_observations()
        if os.environ["RANK"] == "1" and self.steps >= 40:
            obs["policy"] = torch.cat([obs["policy"], obs["policy"][:, :1]], -1)
        return obs

    def step(self, actions):
        self.steps += 1
        return super().step(actions)

def make(num_envs, device, seed):
    return ShapeShifter(num_envs, device, seed)
"""

# Launches ppo_ddp.py with a different --seed on each rank, as a broken launcher script would.
PER_RANK_SEED = f"""
import os, runpy, sys
sys.path.insert(0, {ROOT!r})
sys.argv += ["--seed", os.environ["RANK"]]
runpy.run_path({os.path.join(ROOT, "ppo_ddp.py")!r}, run_name="__main__")
"""

# row: (script, arguments, the line the job prints)
TABLE = {
    "bad arguments": (
        "ppo_ddp.py",
        ("--num-envs", "0", "--mini-batches", "0"),
        "error: bad arguments: --num-envs 0 (must be at least 1); --mini-batches 0 (must be at "
        "least 1).",
    ),
    "unparsable argument": ("ppo_ddp.py", ("--num-envs", "many"), "many"),
    "unknown task": ("ppo_ddp.py", ("--task", "nope"), "error: unknown task 'nope': choose one of"),
    "typo of a task name": (
        "ppo_ddp.py",
        ("--task", "pendlum"),
        "error: unknown task 'pendlum' (did you mean 'pendulum'?): choose one of",
    ),
    "environment fails to load": (
        "ppo_ddp.py",
        ("--task", "nosuchmodule:make"),
        "error: cannot load environment 'nosuchmodule:make': No module named 'nosuchmodule'.",
    ),
    "mirror function fails to load": (
        "ppo_ddp.py",
        ("--symmetry", "nosuchmodule:mirror"),
        "error: cannot load mirror function (--symmetry) 'nosuchmodule:mirror': No module named "
        "'nosuchmodule'.",
    ),
    "one GPU for two processes": (
        "ppo_ddp.py",
        ("--device", "cuda:7"),
        "error: device 'cuda:7' is not cuda:LOCAL_RANK",
    ),
    "missing checkpoint": (
        "ppo_ddp.py",
        ("--resume", "nowhere/model_7.pt"),
        "error: checkpoint 'nowhere/model_7.pt'",
    ),
    "missing teacher": (
        "distill_ddp.py",
        ("--teacher", "gone.pt"),
        "error: teacher checkpoint 'gone.pt' not found;",
    ),
    "motion file that is text": (
        "ppo_amp_ddp.py",
        ("--motion-file", "notes.npz"),
        "is not an .npz archive of numeric",
    ),
    "motion file whose dt is an array": (
        "ppo_amp_ddp.py",
        ("--motion-file", "dt_array.npz"),
        "`dt` must be a positive number, the seconds between frames (found shape (10, 3)); save it "
        "as a scalar",
    ),
    "motion clip that is not 2-D": (
        "ppo_amp_ddp.py",
        ("--motion-file", "flat_clip.npz"),
        "clip 0 has shape (30,), but each clip must be 2-D, (frames, amp_dim) with amp_dim 3,",
    ),
    "one rank fails": (
        "ppo_ddp.py",
        ("--task", "flaky_env:flaky"),
        "error: rank 1: no simulator license on this node",
    ),
    "ranks disagree": (
        "per_rank_seed.py",
        (),
        "error: rank(s) [1] disagree with rank 0 on --seed;",
    ),
    "image for a network without an encoder": (
        "ppo_rnn_ddp.py",
        ("--task", "pendulum_image"),
        "error: observation group 'image' is an image (1, 16, 16): only PPO's actor and critic "
        "encode images",
    ),
    "image too small for the CNN": (
        "ppo_ddp.py",
        ("--task", "pendulum_image", "--cnn-channels", "8", "8", "8", "8"),
        "error: an image of (1, 16, 16) leaves nothing after convolution 4 of --cnn-channels (8, "
        "8, 8, 8)",
    ),
    "unknown compile backend": (
        "distill_ddp.py",
        ("--compile", "nonsense"),
        "invalid choice 'nonsense'",
    ),
    "environment function of other parameters": (
        "ppo_ddp.py",
        ("--task", "wrong_env:make"),
        "error: --task wrong_env:make cannot be called as make(num_envs=..., device=..., seed=...) "
        "(",
    ),
    "a hidden layer of width 0": (
        "ppo_ddp.py",
        ("--actor-hidden", "64", "0"),
        "error: bad argument: --actor-hidden 64 0 (must be at least 1).",
    ),
    "a collective timeout of 0": (
        "ppo_ddp.py",
        ("--dist-timeout-s", "0"),
        "error: bad argument: --dist-timeout-s 0.0 (must be above 0).",
    ),
    # the pendulum's mirror reads the velocity pendulum_angle hides
    "mirror that does not fit the env": (
        "ppo_ddp.py",
        ("--task", "pendulum_angle", "--symmetry", "envs.mirrors:pendulum"),
        "error: --symmetry envs.mirrors:pendulum failed on this env's first observations, groups "
        "policy (2), and 1",
    ),
}


# Rows that go through torchrun itself; the others run the script in 2 ranks as torchrun starts them
# (dist_helpers.script_ranks), without 3 fresh interpreters each.
THROUGH_TORCHRUN = {"one rank fails", "unparsable argument", "missing teacher"}


@pytest.mark.parametrize("row", sorted(TABLE))
def test_bad_input_is_one_line_for_the_whole_job(tmp_path, row):
    script, args, line = TABLE[row]
    (tmp_path / "flaky_env.py").write_text(ONE_RANK_FAILS)
    (tmp_path / "wrong_env.py").write_text(WRONG_SIGNATURE)
    (tmp_path / "per_rank_seed.py").write_text(PER_RANK_SEED)
    (tmp_path / "notes.npz").write_text("these are my notes, not motions\n")
    np.savez(
        tmp_path / "dt_array.npz", dt=np.full((10, 3), 0.05), clip_000=np.zeros((10, 3), np.float32)
    )
    np.savez(tmp_path / "flat_clip.npz", dt=np.float64(0.05), clip_000=np.zeros(30, np.float32))
    path = str(tmp_path / script) if script == "per_rank_seed.py" else script
    if row in THROUGH_TORCHRUN:
        # no waiting for a collective
        result = torchrun(path, *SMALL, *args, cwd=tmp_path, timeout=PROMPT_S)
        failed, output = result.returncode != 0, result.stdout + result.stderr
    else:
        codes, output = script_ranks(path, *SMALL, *args, cwd=tmp_path)
        failed = all(codes)
    assert failed, output
    assert output.count(line) == 1, output
    assert not our_traceback(output), output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script", ["ppo_ddp.py", "distill_ddp.py"])
def test_an_observation_that_changes_shape_mid_run_is_one_line_naming_it(tmp_path, script):
    """Rank 1's env widens its `policy` group in iteration 2: the rollout stops there, and every
    rank learns of it in the check after the rollout; rank 1 says which group, both shapes and the
    step."""
    # distillation's student reads pendulum_partial's 9-wide policy group, its teacher the teacher
    # group
    base, width = ("PendulumPartial", 9) if script == "distill_ddp.py" else ("Pendulum", 3)
    (tmp_path / "shifting_env.py").write_text(SHAPE_SHIFTER.format(base=base))
    args = (
        "--task",
        "shifting_env:make",
        "--num-envs",
        "8",
        "--steps-per-env",
        "32",
        "--iterations",
        "3",
    )
    codes, output = script_ranks(script, *args, *FAR_TIMEOUT, "--device", "cpu", cwd=tmp_path)
    changed = f"changed shape from [{width}] to [{width + 1}] at step 9 of 32"
    line = f"error: rank 1, iteration 2: observation group 'policy' {changed}"
    assert all(codes) and output.count(line) == 1, output
    assert output.count("error:") == 1 and not our_traceback(output), output


def test_inductor_without_a_cpp_compiler_is_one_line_before_anything_is_written(
    tmp_path, monkeypatch
):
    """`--compile inductor` where the C++ compiler named (CXX) does not exist, as on a machine
    without g++: one line at start-up, not a compile error in the first iteration after the run
    directory was made."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    result = torchrun("ppo_ddp.py", *SMALL, "--compile", "inductor", cwd=tmp_path, timeout=PROMPT_S)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert (
        output.count(
            "error: --compile inductor needs a C++ compiler (No working C++ compiler found"
        )
        == 1
    ), output
    assert not our_traceback(output) and not (tmp_path / "runs").exists()


def test_start_up_timeout_is_its_own_and_named_when_it_fires(tmp_path):
    """Rank 1 is still building its env when `--start-timeout-s 3` runs out: rank 0 says so once and
    torchrun stops rank 1; the collective timeout (`--dist-timeout-s`) plays no part."""
    (tmp_path / "slow_env.py").write_text(SLOW_RANK)
    args = ("--task", "slow_env:slow", "--start-timeout-s", "3")
    # rank 1 sleeps 60 s
    result = torchrun("ppo_ddp.py", *SMALL, *args, cwd=tmp_path, timeout=PROMPT_S)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert output.count("error: not every rank finished start-up within --start-timeout-s;") == 1, (
        output
    )
    assert not our_traceback(output) and not (tmp_path / "runs").exists()


# Both ranks take a minute to build their env, and say when they have begun.
BUILDING = """
import os, time
from envs.pendulum import Pendulum

def building(num_envs, device, seed):
    open(f"building{os.environ['RANK']}", "w").close()
    time.sleep(60)
    return Pendulum(num_envs, device, seed)
"""


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    """Ctrl-C in the terminal (SIGINT to torchrun and both ranks) while the ranks build their envs:
    one line, no traceback of ours, nothing written. (Ctrl-C during training: test_torchrun.py, a
    checkpoint.)"""
    (tmp_path / "building_env.py").write_text(BUILDING)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    command = torchrun_command("ppo_ddp.py", *SMALL, "--task", "building_env:building")
    job = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + PROMPT_S
        while (
            not all((tmp_path / f"building{rank}").exists() for rank in (0, 1))
            and time.time() < deadline
        ):
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGINT)  # what the terminal sends the foreground job on Ctrl-C
        output, _ = job.communicate(timeout=PROMPT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0, output
    assert (
        output.count(
            "error: interrupted (Ctrl-C); no checkpoint was damaged: run the command again."
        )
        == 1
    ), output
    assert not our_traceback(output), output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script", ["ppo_ddp", "ppo_amp_ddp", "distill_ddp", "ppo_rnn_ddp"])
def test_help_says_what_the_script_trains_and_how_to_launch_it(script, capsys):
    import importlib
    import inspect

    import arguments
    import envs
    import envs.mirrors

    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as done:
        arguments.parse_args(module.Args, envs.task_defaults, ["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # the words, whatever the terminal's width
    assert text.startswith("usage:")
    assert (
        module.__doc__.splitlines()[0] in text
        and "Launch:" in text
        and "torchrun --standalone" in text
    )
    assert "common.RunArgs" not in text and "cuda:N" in text
    if script == "ppo_ddp":  # the full lists: built-in tasks, adapters, built-in mirrors
        for task in [*envs.TASKS, "gym:<id>", "mjlab:<id>", "isaaclab:<id>"]:
            assert f"`{task}`" in text, task
        mirrors = [
            name
            for name, f in inspect.getmembers(envs.mirrors, inspect.isfunction)
            if f.__module__ == "envs.mirrors" and "env" in inspect.signature(f).parameters
        ]
        assert mirrors and all(f"`envs.mirrors:{name}`" in text for name in mirrors), mirrors
