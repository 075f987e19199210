"""`--task envpool:<id>` (envs/envpool.py) against EnvPool's own step-by-step output: the same
transitions, each episode restarted on the step it ends instead of the next one; time-outs apart
from terminations; the settings a task brings; 2 ranks training on it bitwise identical; the bad
inputs. Skipped without `envpool`."""

import builtins
import dataclasses
import json
import os

import numpy as np
import pytest
import torch

import arguments
import checkpoints
import envs
import ppo_ddp
from dist_helpers import ROOT, chdir_rank_dir, run_ranks

envpool = pytest.importorskip(
    "envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)"
)
from envs import envpool as adapter  # noqa: E402 - after EnvPool is known to be there


def test_each_transition_is_envpools_and_an_episode_restarts_on_the_step_it_ends():
    """Hopper-v5 under random actions, 4 envs, 200 steps: ours next to a raw EnvPool of the same
    seeds. EnvPool spends the step after an episode's end on its reset (reward 0, action ignored);
    ours resets on the done step itself. So raw env i runs one step behind ours per reset it made,
    and is fed our actions that late: every one of our steps is then raw's step, to the last bit,
    and no raw step but the resets is left over."""
    n, steps, rng = 4, 200, np.random.default_rng(0)
    ours = envs.make_env("envpool:Hopper-v5", n, "cpu", seed=3)
    raw = envpool.make_gymnasium("Hopper-v5", num_envs=n, seed=3 * n, num_threads=1)
    raw_obs, _ = raw.reset()
    np.testing.assert_array_equal(
        ours.get_observations()["policy"].numpy(), raw_obs.astype(np.float32)
    )
    ours_log = [[] for _ in range(n)]  # per env: (obs after, reward, done) of every step ours took
    raw_log = [[] for _ in range(n)]
    actions = rng.uniform(-1, 1, (steps, n, 3)).astype(np.float32)
    lag, pending_reset = np.zeros(n, dtype=int), np.zeros(n, dtype=bool)
    done_steps = 0
    for t in range(steps):
        obs, rewards, dones, extras = ours.step(torch.from_numpy(actions[t]))
        for i in range(n):
            ours_log[i].append((obs["policy"][i].numpy(), float(rewards[i]), bool(dones[i])))
        assert not extras["time_outs"].any()  # Hopper's 1,000-step limit is never reached here
        done_steps += int(dones.sum())
        # raw: env i acts with the action ours took `lag[i]` steps earlier; a pending reset ignores
        # it.
        raw_actions = np.stack([actions[max(t - lag[i], 0), i] for i in range(n)])
        raw_obs, raw_rewards, terminated, truncated, _ = raw.step(raw_actions.astype(np.float64))
        for i in range(n):
            if pending_reset[
                i
            ]:  # EnvPool's own reset step: the observation ours gave on the done step
                assert raw_rewards[i] == 0.0
                np.testing.assert_array_equal(
                    ours_log[i][len(raw_log[i]) - 1][0], raw_obs[i].astype(np.float32)
                )
                pending_reset[i], lag[i] = False, lag[i] + 1
                continue
            raw_log[i].append(
                (
                    raw_obs[i].astype(np.float32),
                    float(np.float32(raw_rewards[i])),
                    bool(terminated[i]),
                )
            )
            pending_reset[i] = terminated[i] or truncated[i]
    assert done_steps >= 2 * n  # episodes ended and restarted in every env, more than once
    for i in range(n):
        for k, ((o, r, d), (ro, rr, rd)) in enumerate(zip(ours_log[i], raw_log[i])):
            if (
                d
            ):  # ours: the next episode's first observation; raw: its last, then the reset step's
                assert rd and r == rr, (i, k)
            else:
                np.testing.assert_array_equal(o, ro, err_msg=f"env {i}, step {k}")
                assert (r, d) == (rr, rd), (i, k)


def test_time_outs_are_counted_here_and_apart_from_terminations():
    """Env 0 starts 3 steps before the time limit (as --init-at-random-ep-len may put it): its 3rd
    step is a time-out; Hopper's falls are terminations, never time-outs."""
    env = envs.make_env("envpool:Hopper-v5", 3, "cpu", seed=1)
    env.episode_length_buf[0] = env.max_episode_length - 3
    seen_termination = False
    for t in range(60):
        # full torque: Hopper falls within tens of steps
        _, _, dones, extras = env.step(torch.ones(3, 3))
        time_outs = extras["time_outs"]
        assert bool(time_outs[0]) == (t == 2) and not time_outs[1:].any()
        assert (time_outs <= dones).all()
        seen_termination |= bool((dones & ~time_outs).any())
        assert env.episode_length_buf[dones].eq(0).all()
    assert seen_termination


def test_playground_go1_groups_reward_terms_and_settings():
    env = envs.make_env("envpool:Go1JoystickFlatTerrain-v1", 2, "cpu", seed=1)
    obs = env.get_observations()
    assert {k: tuple(v.shape) for k, v in obs.items()} == {
        "state": (2, 48),
        "privileged_state": (2, 123),
    }
    assert env.num_actions == 12 and all(v.dtype == torch.float32 for v in obs.values())
    _, rewards, _, extras = env.step(torch.zeros(2, 12))
    assert rewards.shape == (2,) and "reward_tracking_lin_vel" in extras["log"]
    # one value per env
    assert all(v.shape == (2,) and v.dtype == torch.float32 for v in extras["log"].values())
    settings, source = envs.task_defaults("envpool:Go1JoystickFlatTerrain-v1")
    assert settings["actor_obs"] == ("state",) and settings["critic_obs"] == ("privileged_state",)
    assert settings["actor_hidden"] == (512, 256, 128) and settings["learning_rate"] == 3e-4
    assert source == "MuJoCo Playground's rsl_rl_config; groups from the env's observation dict"
    assert (
        envs.task_defaults("envpool:Hopper-v5") == envs.task_defaults("gym:Hopper-v5") != ({}, "")
    )
    args = arguments.parse_args(
        ppo_ddp.Args, envs.task_defaults, ["--task", "envpool:Go1JoystickFlatTerrain-v1"]
    )
    assert args.steps_per_env == 24 and args.schedule == "fixed" and args.entropy_coef == 0.001


def test_every_playground_robots_groups_are_ones_its_env_provides():
    """For each locomotion id the adapter claims, the groups its settings name are among those its
    env provides (read off the spec, which builds no env); the ids observing one array bring none
    and train on `policy`."""
    robots = [task_id for task_id in adapter.claimed_ids() if not task_id.endswith("-v5")]
    assert len(robots) == 19  # EnvPool 1.2.5's locomotion tasks of MuJoCo Playground
    for task_id in robots:
        settings, source = envs.task_defaults(f"envpool:{task_id}")
        provided = envpool.make_spec(task_id).observation_space
        names = set(getattr(provided, "spaces", {"policy": provided}))
        named = set(settings.get("actor_obs", ("policy",))) | set(settings.get("critic_obs", ()))
        assert named <= names, (task_id, named, names)
        assert settings["actor_hidden"] == (512, 256, 128) and source.startswith(
            "MuJoCo Playground's rsl_rl_config"
        )
    assert "actor_obs" not in envs.task_defaults("envpool:BarkourJoystick-v1")[0]


# The sweep's sample in CI: the ids that observe one array (they once stopped at start-up) and a
# Gymnasium one; benchmarks/envpool_sweep.py starts every id of `claimed_ids` as a user would, with
# 8 envs. Building a robot's env takes about a second per env here, so the sample runs 2.
SWEEP_SAMPLE = [
    "BarkourJoystick-v1",
    "H1InplaceGaitTracking-v1",
    "H1JoystickGaitTracking-v1",
    "Op3Joystick-v1",
    "SpotGetup-v1",
    "SpotJoystickGaitTracking-v1",
    "Ant-v5",
]


@pytest.mark.parametrize("task_id", SWEEP_SAMPLE)
def test_a_task_named_alone_starts_on_2_ranks_and_trains(tmp_path, task_id):
    """`--task envpool:<id> --iterations 1 --num-envs 2` and nothing else: the task's own settings
    start and train."""
    run_ranks(
        _train_worker,
        2,
        str(tmp_path),
        f"envpool:{task_id}",
        ["--iterations", "1", "--num-envs", "2"],
    )


def _train_worker(root: str, task: str, argv: list[str] | None = None) -> str:
    chdir_rank_dir(root)
    argv = [
        "--task",
        task,
        *(argv or ["--num-envs", "8", "--steps-per-env", "8", "--iterations", "3"]),
        "--run-dir",
        "run",
    ]
    args = arguments.parse_args(
        ppo_ddp.Args, envs.task_defaults, [*argv, "--logger", "none"]
    )  # the task's own
    return ppo_ddp.main(args)


@pytest.mark.parametrize("task", ["envpool:Hopper-v5", "envpool:Go1JoystickFlatTerrain-v1"])
def test_two_ranks_train_bitwise_identical(tmp_path, task):
    """A few iterations with the task's settings (Go1: `state` to the actor, `privileged_state` to
    the critic): the trained state's hash equal on both ranks."""
    fingerprints = run_ranks(_train_worker, 2, str(tmp_path), task)
    assert fingerprints[0] == fingerprints[1]


def test_bad_envpool_input_is_one_line_with_what_to_do(monkeypatch):
    with pytest.raises(
        ValueError, match=r"unknown EnvPool id 'NoSuch-v0'; envpool.list_all_envs\(\) lists them"
    ):
        envs.make_env("envpool:NoSuch-v0", 2, "cpu", 0)
    with pytest.raises(
        ValueError,
        match=r"'CartPole-v1' acts in Discrete\(2\).*pick a task with continuous actions",
    ):
        envs.make_env("envpool:CartPole-v1", 2, "cpu", 0)
    real_import = builtins.__import__

    def without_envpool(name, *args, **kwargs):
        if name == "envpool":
            raise ImportError("No module named 'envpool'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_envpool)
    with pytest.raises(
        ValueError, match=r"--task envpool:\.\.\. needs EnvPool: pip install envpool"
    ):
        envs.make_env("envpool:Hopper-v5", 2, "cpu", 0)


@pytest.fixture(scope="module")
def go1_run(tmp_path_factory):
    """One short iteration of `--task go1` (envs/go1.py: the Go1 id on a gait clock, trained with
    its mirror), its run directory."""
    pytest.importorskip(
        "mujoco", reason="the go1 task's foot heights need MuJoCo (requirements-dev)"
    )
    run = tmp_path_factory.mktemp("go1")
    argv = ["--task", "go1", "--num-envs", "4", "--steps-per-env", "4", "--iterations", "1"]
    argv += ["--run-dir", str(run), "--logger", "none"]
    ppo_ddp.main(arguments.parse_args(ppo_ddp.Args, envs.task_defaults, argv))
    return run


def test_a_go1_run_trains_on_the_clock_with_its_mirror(go1_run):
    """`--task go1` brings its groups (the clock beside Playground's) and its symmetry; the env
    keeps the id's own reward scales."""
    state = torch.load(go1_run / "model_1.pt", weights_only=True)
    assert state["args"]["task"] == "go1" and state["configs"]["actor"]["obs_shapes"] == {
        "state": [48],
        "clock": [2],
    }
    assert state["args"]["mirror"]["symmetry"] == "envs.mirrors:go1"
    config = envs.make_env("go1", 2, "cpu", 0).env.spec.config
    assert config.pose_scale == envpool.make_spec("Go1JoystickFlatTerrain-v1").config.pose_scale


def test_evaluate_scores_go1_on_the_plain_id_for_the_policy_and_zero_actions(go1_run, tmp_path):
    """tools/evaluate.py on a `go1` checkpoint: by default on the plain id (envs/go1.py
    `EVAL_TASK`), under Playground's reward, with the mean per step of every reward term beside
    return and length, for the policy and for zero actions (the robot holding its default pose) on
    the same episodes."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import evaluate

    config = evaluate.Config(str(go1_run), episodes=2, out=str(tmp_path / "policy.json"))
    policy, zeros = (
        evaluate.evaluate(config),
        evaluate.evaluate(
            dataclasses.replace(config, zero_actions=True, out=str(tmp_path / "zeros.json"))
        ),
    )
    for result in (policy, zeros):
        assert result["task"] == "envpool:Go1JoystickFlatTerrain-v1" and result["episodes"] == 2
        assert {"reward_tracking_lin_vel", "reward_pose", "reward_feet_air_time"} <= set(
            result["terms"]
        )
        assert "reward_phase_contact" not in result["terms"]  # the training task's own terms
        assert all(np.isfinite(v) for v in result["terms"].values())
    assert zeros["policy"] == "zero actions" and zeros["terms"] != policy["terms"]


def test_play_records_an_envpool_robot_or_says_what_to_install(go1_run, tmp_path):
    """tools/play.py on a `go1` checkpoint, run as a user runs it: the plain id, as evaluate scores
    it, recorded as a GIF and a strip through MuJoCo's EGL renderer. In a process of its own: MuJoCo
    takes its OpenGL backend when it is first imported, and this test process may have imported it
    already (the foot heights) without one. Skipped, saying why, where there is no OpenGL library
    or no `mujoco` package."""
    import subprocess
    import sys

    out = tmp_path / "go1.gif"
    command = [sys.executable, os.path.join(ROOT, "tools", "play.py"), str(go1_run)]
    command += ["--every", "100", "--strip-steps", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    missing = ("needs an OpenGL library", "needs MuJoCo's Python package")
    if done.returncode == 1 and any(reason in done.stderr for reason in missing):
        pytest.skip(f"no OpenGL context here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("envpool:Go1JoystickFlatTerrain-v1's reward: return")
    assert out.stat().st_size > 0 and (tmp_path / "go1.png").stat().st_size > 0


def test_the_shipped_go1_policy_loads_fits_the_plain_id_and_its_run_continues(tmp_path):
    """policies/go1 (docs/go1.md): at most 6 MB, a policy the tools rebuild for the plain id (its
    clock kept in memory), and a run this version resumes on `--task go1` for one more iteration,
    in the curriculum's last stage."""
    import shutil

    from tools.policy import check_fits, load_policy

    shipped = os.path.join(ROOT, "policies", "go1")
    size = sum(os.path.getsize(os.path.join(shipped, f)) for f in os.listdir(shipped))
    assert size <= 6 * 2**20, size
    state = checkpoints.load_checkpoint(
        shipped, "ppo", ("actor", "critic", "optimizer", "iteration", "args")
    )
    policy = load_policy(shipped)
    assert policy.task == state["args"]["task"] == "go1" and policy.num_actions == 12
    assert policy.iteration == state["iteration"] == 1627 and policy.obs_shapes == {"state": [48]}
    plain = envs.make_env(policy.eval_task, 2, "cpu", 0).get_observations()
    assert policy.eval_task == "envpool:Go1JoystickFlatTerrain-v1" and "clock" not in plain
    check_fits(policy, plain)
    shutil.copytree(shipped, tmp_path / "run")
    argv = ["--task", "go1", "--num-envs", "4", "--steps-per-env", "24"]
    argv += ["--iterations", str(state["iteration"] + 1), "--run-dir", str(tmp_path / "run")]
    argv += ["--resume", "auto", "--logger", "none"]
    ppo_ddp.main(arguments.parse_args(ppo_ddp.Args, envs.task_defaults, argv))
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [state["iteration"] + 1]
    assert rows[0]["curriculum_stage"] == 3.0
