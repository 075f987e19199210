"""Environments: the built-in tasks (shapes, determinism, Pendulum-v1 by hand), the Gymnasium
adapter against Gymnasium itself, and an rsl_rl-style env with TensorDict observations and several
groups."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import arguments
import envs
import ppo_ddp
from dist_helpers import ROOT, count_host_reads, run_ranks, small_args
from envs import TASKS, make_env, rank_seed, task_defaults
from envs.pendulum import Pendulum


@pytest.mark.parametrize("task", sorted(TASKS))
def test_shapes_and_dtypes(task):
    env = make_env(task, num_envs=5, device="cpu", seed=0)
    obs = env.get_observations()
    assert "policy" in obs and obs["policy"].shape[0] == 5 and obs["policy"].dtype == torch.float32
    next_obs, rewards, dones, extras = env.step(torch.zeros(5, env.num_actions))
    assert rewards.shape == (5,) and rewards.dtype == torch.float32
    assert dones.shape == (5,) and dones.dtype == torch.bool
    assert extras["time_outs"].shape == (5,)
    assert all(v.shape == obs[k].shape for k, v in next_obs.items())
    assert all(torch.as_tensor(v).numel() == 1 for v in extras["log"].values())


def test_reacher_has_two_actions_and_a_privileged_critic_group():
    env = make_env("reacher", num_envs=3, device="cpu", seed=0)
    obs = env.get_observations()
    assert (
        env.num_actions == 2 and obs["policy"].shape == (3, 10) and obs["critic"].shape == (3, 12)
    )


@pytest.mark.parametrize("task", sorted(TASKS))
def test_same_seed_same_trajectory_other_seed_differs(task):
    def trajectory(seed):
        env = make_env(task, num_envs=4, device="cpu", seed=seed)
        out = [env.get_observations()["policy"]]
        actions = torch.linspace(-1, 1, 4 * env.num_actions).reshape(4, env.num_actions)
        for _ in range(env.max_episode_length + 3):  # crosses a reset
            out.append(env.step(actions)[0]["policy"])
        return torch.stack(out)

    assert torch.equal(trajectory(3), trajectory(3))
    # every episode starts at rest, hanging down: nothing random to seed
    if task == "pendulum_sparse":
        assert torch.equal(trajectory(3), trajectory(4))
    else:
        assert not torch.equal(trajectory(3), trajectory(4))


def test_pendulum_sparse_pays_only_near_upright_minus_the_torque_cost():
    env = make_env("pendulum_sparse", num_envs=3, device="cpu", seed=0)
    assert (
        env.theta.tolist() == pytest.approx([math.pi] * 3) and env.theta_dot.tolist() == [0.0] * 3
    )  # at rest, down
    env.theta = torch.tensor([0.2, -0.29, 0.5])
    _, reward, _, _ = env.step(torch.tensor([[0.5], [-3.0], [0.0]]))  # the second is clipped to -1
    assert reward.tolist() == pytest.approx([1 - 0.05 * 0.25, 1 - 0.05, 0.0])


def test_pendulum_matches_gymnasium_equations_by_hand():
    env = Pendulum(num_envs=3, seed=0)
    env.theta = torch.tensor([0.3, -3.0, 1.5])
    env.theta_dot = torch.tensor([-0.5, 7.9, 7.9])
    u = [1.5, -5.0, 2.0]  # the second is clipped to -2; the third hits the 8 rad/s speed limit
    obs, reward, _, _ = env.step(torch.tensor(u).reshape(3, 1))
    assert obs["policy"][2, 2].item() == 8.0
    for i, (th, thdot, torque) in enumerate([(0.3, -0.5, 1.5), (-3.0, 7.9, -2.0), (1.5, 7.9, 2.0)]):
        norm_th = ((th + math.pi) % (2 * math.pi)) - math.pi
        cost = norm_th**2 + 0.1 * thdot**2 + 0.001 * torque**2
        new_thdot = min(8.0, max(-8.0, thdot + (3 * 10.0 / 2 * math.sin(th) + 3.0 * torque) * 0.05))
        new_th = th + new_thdot * 0.05
        assert reward[i].item() == pytest.approx(-cost, rel=1e-5)
        assert obs["policy"][i].tolist() == pytest.approx(
            [math.cos(new_th), math.sin(new_th), new_thdot], rel=1e-5, abs=1e-6
        )


def test_pendulum_start_state_and_200_step_time_limit():
    env = Pendulum(num_envs=1000, seed=1)
    assert env.theta.abs().max() <= math.pi and env.theta_dot.abs().max() <= 1.0
    assert env.theta.min() < -3.0 and env.theta.max() > 3.0  # the whole range is used
    for step in range(1, 201):
        _, _, dones, extras = env.step(torch.zeros(1000, 1))
        assert bool(dones.all()) == (step == 200)
    assert extras["time_outs"].all() and (env.episode_length_buf == 0).all()


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match="unknown task 'cartpole'.*pendulum"):
        make_env("cartpole", 2, "cpu", 0)


def test_unknown_task_lists_every_form_on_one_line_and_suggests_the_nearest_name():
    with pytest.raises(ValueError) as typo:
        make_env("pendlum", 2, "cpu", 0)
    message = str(typo.value)
    assert message.startswith("unknown task 'pendlum' (did you mean 'pendulum'?): choose one of ")
    forms = [*TASKS, "go1", "gym:<id>", "gym-async:<id>", "envpool:<id>", "mjlab:<id>"]
    assert all(f"'{form}'" in message for form in [*forms, "isaaclab:<id>", "module:function"])
    assert "\n" not in message
    with pytest.raises(ValueError) as far:
        make_env("nope", 2, "cpu", 0)
    assert "did you mean" not in str(far.value)


def test_a_task_loads_its_own_module_and_no_other_task_or_adapter(tmp_path):
    """Importing envs, building pendulum and reading the settings of every built-in task and of a
    user's env load envs/pendulum.py and pendulum_image.py (its settings) alone: no other task,
    no adapter (envs/envpool.py only for an `envpool:` task)."""
    code = (
        "import sys, envs\n"
        "envs.make_env('pendulum', 2, 'cpu', 0)\n"
        "for task in [*envs.TASKS, 'my_env:make', 'nope']:\n"
        "    envs.task_defaults(task)\n"
        "print(sorted(m for m in sys.modules if m.startswith('envs.')))\n"
        "envs.task_defaults('envpool:Hopper-v5')\n"
        "print('envs.envpool' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.splitlines() == ["['envs.pendulum', 'envs.pendulum_image']", "True"]


def test_user_environment_from_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(
        textwrap.dedent(
            """
            from envs.pendulum import Pendulum
            def make(num_envs, device, seed):
                return Pendulum(num_envs, device, seed)
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    env = make_env("my_env:make", 3, "cpu", 0)
    assert env.num_envs == 3
    with pytest.raises(ValueError, match="cannot load environment 'my_env:nope'"):
        make_env("my_env:nope", 3, "cpu", 0)


# --- Gymnasium environments (envs/gymnasium.py) ---------------------------------------------------


def test_gym_pendulum_returns_gymnasiums_own_rewards_with_clipped_actions():
    """Same seed, same actions: the adapter's rewards and observations are Gymnasium's, actions
    beyond the bounds are clipped, and copies reset on the step their episode ends."""
    gym = pytest.importorskip("gymnasium", reason="Gymnasium is optional (requirements-envs.txt)")
    env = make_env("gym:Pendulum-v1", 3, "cpu", seed=7)
    reference = gym.make_vec(
        "Pendulum-v1", 3, vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}
    )
    ref_obs, _ = reference.reset(seed=7 * 3)  # copy i of the adapter: seed * num_envs + i
    assert env.num_actions == 1 and env.max_episode_length == 200
    assert torch.equal(
        env.get_observations()["policy"], torch.as_tensor(ref_obs, dtype=torch.float32)
    )
    for step in range(1, 201):
        actions = torch.full((3, 1), 5.0) * (-1) ** step  # beyond the torque bound of 2
        obs, rewards, dones, extras = env.step(actions)
        ref_obs, ref_rewards, _, ref_truncated, _ = reference.step(actions.numpy().clip(-2, 2))
        assert torch.equal(rewards, torch.as_tensor(ref_rewards, dtype=torch.float32))
        assert torch.equal(obs["policy"], torch.as_tensor(ref_obs, dtype=torch.float32))
        assert (
            bool(dones.all())
            == bool(extras["time_outs"].all())
            == bool(ref_truncated.all())
            == (step == 200)
        )


def test_no_two_gym_copies_of_a_job_share_a_seed():
    """Each rank's copies draw their own reset noise: every first observation of a 3-rank job, 4
    copies a rank, is different (copies seeded `seed + i` per rank would repeat across neighbouring
    ranks)."""
    pytest.importorskip("gymnasium", reason="Gymnasium is optional (requirements-envs.txt)")
    for first_iteration in (1, 7):  # a fresh run, and one resumed
        rows = torch.cat(
            [
                make_env(
                    "gym:Pendulum-v1", 4, "cpu", seed=rank_seed(0, rank, first_iteration)
                ).get_observations()["policy"]
                for rank in range(3)
            ]
        )
        assert len({tuple(row.tolist()) for row in rows}) == 12


@pytest.mark.parametrize("kind", ["gym", "gym-async"])
def test_gym_mujoco_copies_step_and_reset_as_gymnasiums_vector_env(kind):
    """Hopper-v5, whose copies fall (terminated) and, started late, reach the adapter's time limit:
    the copies give the observations, rewards and dones of Gymnasium's own vector env stepped with
    the same clipped actions, its copies at the limit reset through `reset_mask`; the final
    observation (`extras["final_obs"]`) is the one Gymnasium's info holds for the copies that
    ended, the one before `reset_mask` for those the adapter cut, and the observation elsewhere."""
    gym = pytest.importorskip("gymnasium", reason="Gymnasium is optional (requirements-envs.txt)")
    pytest.importorskip("mujoco", reason="MuJoCo is optional (requirements-envs.txt)")
    torch.manual_seed(0)
    env = make_env(f"{kind}:Hopper-v5", 4, "cpu", seed=7)
    reference = gym.make_vec(
        "Hopper-v5", 4, vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}
    )
    reference.reset(seed=7 * 4)
    length = torch.tensor([993, 0, 997, 0])  # two copies 7 and 3 steps from the limit
    env.episode_length_buf[:] = length
    terminations = cuts = finals = 0
    for _ in range(200):
        actions = torch.randn(4, 3) * 2  # beyond the bounds of +-1
        obs, rewards, dones, extras = env.step(actions)
        ref_obs, ref_rewards, terminated, truncated, info = reference.step(
            actions.numpy().clip(-1, 1)
        )
        final = ref_obs.astype(np.float32)  # before a cut's reset: the final observation
        for i in np.flatnonzero(info.get("_final_obs", ())):
            final[i], finals = info["final_obs"][i], finals + 1
        length += 1
        cut = (length >= 1000).numpy() & ~(terminated | truncated)
        if cut.any():
            fresh, _ = reference.reset(options={"reset_mask": cut})
            ref_obs = np.where(cut[:, None], fresh, ref_obs)
        ref_dones = torch.as_tensor(terminated | truncated | cut)
        length[ref_dones] = 0
        assert torch.equal(obs["policy"], torch.as_tensor(ref_obs, dtype=torch.float32))
        assert torch.equal(rewards, torch.as_tensor(ref_rewards, dtype=torch.float32))
        assert torch.equal(dones, ref_dones) and torch.equal(
            extras["time_outs"], torch.as_tensor(truncated | cut)
        )
        assert torch.equal(extras["final_obs"]["policy"], torch.as_tensor(final))
        terminations, cuts = terminations + int(terminated.sum()), cuts + int(cut.sum())
    assert terminations > 4 and cuts == 2 and finals == terminations  # Gymnasium gave each one


def test_gym_copies_started_at_random_points_end_their_first_episode_in_turn():
    pytest.importorskip("gymnasium", reason="Gymnasium is optional (requirements-envs.txt)")
    torch.manual_seed(0)
    env = make_env("gym:Pendulum-v1", 8, "cpu", seed=0, random_start=True)
    start = env.episode_length_buf.clone()
    assert len(set(start.tolist())) > 4  # staggered
    first_end = torch.full((8,), -1)
    for step in range(1, 201):
        _, _, dones, extras = env.step(torch.zeros(8, 1))
        assert torch.equal(dones, extras["time_outs"])  # Pendulum never terminates
        first_end[dones & (first_end < 0)] = step
    assert torch.equal(first_end, 200 - start)
    assert bool((env.episode_length_buf == 200 - first_end).all())  # counting again from 0


def test_gym_async_steps_the_same_copies_in_subprocesses():
    pytest.importorskip("gymnasium", reason="Gymnasium is optional (requirements-envs.txt)")
    sync, asynchronous = (
        make_env("gym:Pendulum-v1", 2, "cpu", 3),
        make_env("gym-async:Pendulum-v1", 2, "cpu", 3),
    )
    for _ in range(3):
        actions = torch.randn(2, 1)
        assert torch.equal(sync.step(actions)[0]["policy"], asynchronous.step(actions)[0]["policy"])
    asynchronous.env.close()


def test_gym_errors_are_one_line_with_what_to_do():
    gym = pytest.importorskip("gymnasium", reason="Gymnasium is optional (requirements-envs.txt)")
    with pytest.raises(ValueError, match="cannot make Gymnasium env 'NoSuchEnv-v0'"):
        make_env("gym:NoSuchEnv-v0", 2, "cpu", 0)
    with pytest.raises(ValueError, match="acts in Discrete.*pick a task with continuous actions"):
        make_env("gym:CartPole-v1", 2, "cpu", 0)
    assert gym.__version__


def test_gym_task_without_gymnasium_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"needs Gymnasium: pip install -r requirements-envs.txt"):
        make_env("gym:Pendulum-v1", 2, "cpu", 0)


def test_gym_task_runs_with_a_mujoco_build_that_has_no_warning_hook(monkeypatch):
    """Some MuJoCo builds lack `set_mju_user_warning`: the adapter then leaves MuJoCo's own printing
    as it is."""
    pytest.importorskip("gymnasium", reason="Gymnasium is optional (requirements-envs.txt)")
    import types

    # a module without the hook
    monkeypatch.setitem(sys.modules, "mujoco", types.ModuleType("mujoco"))
    env = make_env("gym:Pendulum-v1", 2, "cpu", 0)
    assert env.get_observations()["policy"].shape == (2, 3)


# --- Settings a task family brings --------------------------------------------------------------


def test_task_settings_are_defaults_the_command_line_overrides(capsys):
    brought = {
        "num_envs": 64,
        "epochs": 5,
        "learning_rate": 3e-4,
        "actor_hidden": [8, 8],
        "normalize_obs": False,
    }
    argv = ["--task", "fam:x", "--learning-rate", "1e-3", "--iterations", "7"]
    args = arguments.parse_args(
        ppo_ddp.Args, lambda task: (brought, "its paper") if task == "fam:x" else ({}, ""), argv
    )
    # from the task
    assert (args.num_envs, args.actor_hidden, args.normalize_obs) == (64, (8, 8), False)
    assert (args.learning_rate, args.iterations) == (1e-3, 7)  # given on the command line: they win
    line = capsys.readouterr().out
    # One line with what the run took from the task (not --epochs: 5 is the script's default too).
    assert (
        line
        == "settings from fam:x (its paper): --num-envs 64 --actor-hidden 8 8 --no-normalize-obs "
        "(an argument on the command line overrides any)\n"
    )  # noqa: E501
    assert (
        arguments.parse_args(
            ppo_ddp.Args, lambda task: (brought, ""), ["--task", "pendulum"]
        ).num_envs
        == 64
    )
    assert arguments.parse_args(ppo_ddp.Args, None, ["--task", "fam:x"]).num_envs == 256


def test_builtin_tasks_bring_no_settings_but_the_image_one_and_mujoco_tasks_bring_theirs():
    assert all(task_defaults(task) == ({}, "") for task in TASKS if task != "pendulum_image")
    image = arguments.parse_args(
        ppo_ddp.Args, task_defaults, ["--task", "pendulum_image", "--cnn-channels", "4"]
    )
    assert image.actor_obs == image.critic_obs == (
        "policy",
        "image",
    ) and image.cnn.cnn_channels == (4,)  # yours
    pytest.importorskip("gymnasium", reason="Gymnasium is optional (requirements-envs.txt)")
    assert task_defaults("gym:Pendulum-v1") == task_defaults("gym:NoSuchEnv-v0") == ({}, "")
    settings, source = task_defaults("gym:Hopper-v5")
    assert source == "the MuJoCo settings of docs/environments.md"
    assert (
        settings["iterations"] * 2 * settings["num_envs"] * settings["steps_per_env"] >= 1_000_000
    )  # 2 processes
    args = arguments.parse_args(
        ppo_ddp.Args, task_defaults, ["--task", "gym:Hopper-v5", "--seed", "3"]
    )
    assert (
        all(arguments.get(args, k) == v for k, v in settings.items()) and args.scaling.scale_rewards
    )
    shared = task_defaults("gym:Walker2d-v5")[0]  # the task's own entries over the shared settings
    assert (
        settings == {**shared, "mini_batches": 4, "learning_rate": 3e-4} and args.mini_batches == 4
    )
    assert task_defaults("gym:HalfCheetah-v5")[0] == {
        **shared,
        "scale_rewards": False,
        "init_noise_std": 0.135,
    }


def test_no_table_of_task_settings_names_a_group():
    """The settings tables of gym: (every id observes one array, `policy`) and of the built-in tasks
    name no group but the task's own: a default may never send a network to a group its task does
    not provide. (envpool: reads its groups off each env, tests/test_envpool.py; mjlab: takes its
    task's own, test_mjlab.)"""
    from envs import gymnasium, pendulum_image

    for table in (gymnasium.MUJOCO, *gymnasium.MUJOCO_TASKS.values()):
        assert not {"actor_obs", "critic_obs"} & table.keys()
    image = pendulum_image.PendulumImage(2, "cpu", 0).get_observations()
    assert (
        set(pendulum_image.SETTINGS["actor_obs"]) | set(pendulum_image.SETTINGS["critic_obs"])
        <= image.keys()
    )


def test_mujoco_benchmark_passes_only_task_and_seed_on_2_processes(monkeypatch):
    """benchmarks/mujoco_suite.py runs what a user types (`--task gym:<id> --seed S`); on 4
    processes it halves the iterations to keep 1 M steps."""
    pytest.importorskip("gymnasium", reason="Gymnasium is optional (requirements-envs.txt)")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # its torchrun_ppo
    spec = importlib.util.spec_from_file_location(
        "benchmark_mujoco", os.path.join(ROOT, "benchmarks", "mujoco_suite.py")
    )
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "benchmark_mujoco", benchmark)  # for its dataclass
    spec.loader.exec_module(benchmark)
    assert benchmark.task_args(benchmark.Config(), "Hopper-v5", 2) == [
        "--task",
        "gym:Hopper-v5",
        "--seed",
        "2",
    ]
    four = benchmark.task_args(benchmark.Config(nproc=4), "Walker2d-v5", 1)
    assert four == ["--task", "gym:Walker2d-v5", "--seed", "1", "--iterations", "245"]
    if importlib.util.find_spec("envpool") is not None:  # its ids bring the same settings
        pooled = benchmark.task_args(benchmark.Config(adapter="envpool"), "Hopper-v5", 3)
        assert pooled == ["--task", "envpool:Hopper-v5", "--seed", "3"]


# --- rsl_rl / Isaac Lab style environments: TensorDict observations, several groups ---------------

RSL_RL_STYLE_ENV = '''
import torch
from tensordict import TensorDict

from envs.reacher import Reacher


class RslRlStyle(Reacher):
    """The reacher behind rsl_rl's VecEnv interface as Isaac Lab's wrapper serves it: TensorDict
    observations with a `policy` group, a `privileged` group (no `critic` group), and a camera."""

    def get_observations(self):
        obs = super().get_observations()
        camera = torch.zeros(self.num_envs, 3, 4, 4)
        groups = {"policy": obs["policy"], "privileged": obs["critic"][:, -2:], "camera": camera}
        return TensorDict(groups, batch_size=[self.num_envs])

    def step(self, actions):
        _, rewards, dones, extras = super().step(actions)
        extras = {"time_outs": extras["time_outs"], "episode": extras["log"]}
        return self.get_observations(), rewards, dones, extras


def make(num_envs, device, seed):
    return RslRlStyle(num_envs, device, seed)
'''


def _rsl_rl_style_worker(root, overrides):
    import ppo_ddp
    from dist_helpers import chdir_rank_dir

    sys.path.insert(0, root)  # where rslrl_env.py is
    chdir_rank_dir(root)
    args = {
        "task": "rslrl_env:make",
        "num_envs": 16,
        "steps_per_env": 8,
        "iterations": 3,
        "run_dir": "run",
    }
    return ppo_ddp.main(small_args(ppo_ddp.Args, **args, **overrides))


def test_rsl_rl_style_env_with_concatenated_groups_trains_identically_on_two_ranks(
    tmp_path, monkeypatch
):
    """TensorDict observations; the critic reads `policy` and `privileged` side by side; the
    `episode` log reaches metrics.jsonl; both ranks end bitwise identical. A camera group gets a CNN
    encoder in PPO's actor and is refused with a clear message elsewhere, and so is a group the env
    lacks."""
    pytest.importorskip(
        "tensordict", reason="tensordict is optional (rsl_rl's observation container)"
    )
    import ppo_ddp
    from dist_helpers import run_ranks

    (tmp_path / "rslrl_env.py").write_text(RSL_RL_STYLE_ENV)
    monkeypatch.chdir(tmp_path)
    obs = make_env("rslrl_env:make", 4, "cpu", 0).get_observations()
    actor, critic = ppo_ddp.make_networks(
        obs, 2, small_args(ppo_ddp.Args, critic_obs=("policy", "privileged"))
    )
    assert list(actor.inputs.shapes) == ["policy"] and list(critic.inputs.shapes) == [
        "policy",
        "privileged",
    ]
    assert (
        actor.inputs.normalizer.mean.shape[-1] == 10
        and critic.inputs.normalizer.mean.shape[-1] == 12
    )
    assert list(ppo_ddp.make_networks(obs, 2, ppo_ddp.Args())[1].inputs.shapes) == [
        "policy"
    ]  # rsl_rl's fallback
    camera = small_args(ppo_ddp.Args, actor_obs=("policy", "camera"), cnn_channels=(8,))
    assert list(ppo_ddp.make_networks(obs, 2, camera)[0].inputs.cnns) == ["camera"]  # a CNN encoder
    with pytest.raises(
        ValueError, match=r"'camera' is an image \(3, 4, 4\): only PPO's actor and critic encode"
    ):
        # a network without encoders
        envs.resolve_groups(obs, ("policy", "camera"), flag="--rnd-obs")
    with pytest.raises(
        ValueError,
        match=r"\['lidar'\] not found; the environment provides "
        r"\['camera', 'policy', 'privileged'\]: pass groups it has to --actor-obs\.",
    ):
        ppo_ddp.make_networks(obs, 2, small_args(ppo_ddp.Args, actor_obs=("lidar",)))

    hashes = run_ranks(
        _rsl_rl_style_worker, 2, str(tmp_path), {"critic_obs": ("policy", "privileged")}
    )
    assert hashes[0] == hashes[1]
    last = (tmp_path / "0" / "run" / "metrics.jsonl").read_text().splitlines()[-1]
    assert '"final_distance"' in last  # the env's extras["episode"] scalars are logged


# --- host syncs ------------------------------------------------------------------------------


@pytest.mark.parametrize("task", sorted(TASKS))
def test_builtin_tasks_step_and_reset_without_host_syncs(task):
    # Masked resets: in 40 steps from random starts some envs reach the time limit, and the host
    # never waits.
    env = make_env(task, 16, "cpu", 0, random_start=True)
    actions = torch.zeros(16, env.num_actions)

    def steps() -> None:
        for _ in range(40):
            env.step(actions)

    before = env.episode_length_buf.clone()
    assert count_host_reads(steps) == 0
    assert (env.episode_length_buf != (before + 40) % env.max_episode_length).sum() == 0


def test_host_read_counter_sees_boolean_indexing_and_nonzero():
    # The counter behind the tests above does see the syncs that index-based resets make.
    x = torch.randn(8)

    def index_based_reset() -> None:
        done = x > 0
        x[done] = 0.0
        x[done.nonzero().flatten()] = 1.0
        _ = x[done]
        float(x.sum())

    assert count_host_reads(index_based_reset, files=(os.path.abspath(__file__),)) == 4


def test_episodes_cut_short_by_a_random_start_train_but_are_not_counted():
    """Env 0 starts at a reset, env 1 at step 150 of its time limit: env 1's first episode is not
    counted."""
    episodes = envs.make_episodes(2, torch.device("cpu"), torch.tensor([0, 150]))
    # env 1: its cut-short end
    envs.track_episodes(episodes, torch.tensor([1.0, 5.0]), torch.tensor([0.0, 1.0]))
    assert episodes.finished.tolist() == [0.0, 0.0, 0.0]
    # both end whole episodes
    envs.track_episodes(episodes, torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]))
    assert episodes.finished.tolist() == [2.0 + 2.0, 2.0 + 1.0, 2.0]
    # without `started`: every episode counts (a fresh env)
    every = envs.make_episodes(2, torch.device("cpu"))
    envs.track_episodes(every, torch.tensor([1.0, 5.0]), torch.tensor([0.0, 1.0]))
    assert every.finished.tolist() == [5.0, 1.0, 1.0]


def _whole_episodes_worker(root: str, resume: bool) -> list[dict]:
    os.chdir(root)
    small = {"num_envs": 64, "iterations": 20 if resume else 10, "logger": "none", "run_dir": "run"}
    ppo_ddp.main(small_args(ppo_ddp.Args, **small, resume="run" if resume else None))
    with open(os.path.join(root, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_log_counts_whole_episodes_only_at_the_start_and_after_a_resume(tmp_path):
    """pendulum: 200-step episodes, every one a time-out. Each env starts at a random step of it (at
    the start of a run and of a resume), so the first episodes end short, as rsl_rl's logger would
    count them. Here none is counted until a whole one ends (200 steps = 6.25 iterations of 32), and
    every episode logged is 200 steps long."""
    run_ranks(_whole_episodes_worker, 1, str(tmp_path), False)
    rows = run_ranks(_whole_episodes_worker, 1, str(tmp_path), True)[0]
    assert [row["iteration"] for row in rows] == list(range(1, 21))
    for first in (0, 10):  # the fresh start, the resume at iteration 11
        assert all(
            row["episodes_finished"] == 0 and row["episode_return"] is None
            for row in rows[first : first + 6]
        )
    counted = [row for row in rows if row["episodes_finished"]]
    assert counted and all(row["episode_length"] == 200.0 for row in counted)
