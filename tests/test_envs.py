"""Built-in tasks: shapes, dtypes, determinism per seed, Pendulum-v1 dynamics by hand."""

import math
import textwrap

import pytest
import torch

from envs import TASKS, make_env
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
    assert env.num_actions == 2 and obs["policy"].shape == (3, 10) and obs["critic"].shape == (3, 12)


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
    assert not torch.equal(trajectory(3), trajectory(4))


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
