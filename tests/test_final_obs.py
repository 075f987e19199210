"""`extras["final_obs"]`: in the rows whose episode ended, the observation it ended in, before the
reset; in the others, the observation returned. The built-in tasks, `envpool:` and `go1` (the last
two skip without their packages); `gym:` and `gym-async:` are checked against Gymnasium's own vector
env in tests/test_envs.py."""

import numpy as np
import pytest
import torch

from envs import TASKS, make_env


def rows(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`mask` (num_envs,) shaped to select whole rows of `like`."""
    return mask.view(-1, *[1] * (like.dim() - 1))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_builtin_tasks_final_obs_is_what_it_observes_without_the_limit(task):
    """Envs 0 and 1 reach the time limit on steps 2 and 4: their final observation is, bit for bit,
    what a twin of the same seed without a time limit observes on that step (every env draws at
    every reset, so the twins' random streams stay together); the other rows are the observation
    returned, and every group is there."""
    env, twin = make_env(task, 4, "cpu", 5), make_env(task, 4, "cpu", 5)
    twin.max_episode_length = 10**9
    limit = env.max_episode_length
    env.episode_length_buf[:2] = torch.tensor([limit - 2, limit - 4])
    actions = torch.linspace(-1, 1, 4 * env.num_actions).reshape(4, env.num_actions)
    for step in range(1, 5):
        obs, _, dones, extras = env.step(actions)
        twin_obs = twin.step(actions)[0]
        assert dones.tolist() == [step == 2, step == 4, False, False]
        final = extras["final_obs"]
        assert final.keys() == obs.keys()
        for group, value in final.items():
            expected = torch.where(rows(dones, value), twin_obs[group], obs[group])
            assert torch.equal(value, expected), (step, group)
            if dones.any():  # the reset changed what the env returns
                assert not torch.equal(value[dones], obs[group][dones])


def test_envpool_final_obs_is_envpools_last_observation():
    """Hopper-v5 next to a raw EnvPool of the same seeds and actions: at each env's first end (a
    fall, or env 0's time-out at the adapter's limit on step 5), the final observation is the one
    EnvPool returned on that step, before the adapter's reset; the other rows are the observation
    returned."""
    envpool = pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt)")
    n, rng = 4, np.random.default_rng(0)
    ours = make_env("envpool:Hopper-v5", n, "cpu", seed=3)
    raw = envpool.make_gymnasium("Hopper-v5", num_envs=n, seed=3 * n, num_threads=1)
    raw.reset()
    ours.episode_length_buf[0] = ours.max_episode_length - 5
    ended = np.zeros(n, dtype=bool)
    for step in range(1, 201):
        actions = rng.uniform(-1, 1, (n, 3)).astype(np.float32)
        obs, _, dones, extras = ours.step(torch.from_numpy(actions))
        raw_obs = raw.step(actions.astype(np.float64))[0].astype(np.float32)
        final, dones = extras["final_obs"]["policy"].numpy(), dones.numpy()
        first = dones & ~ended  # raw has not reset these envs yet
        np.testing.assert_array_equal(final[first], raw_obs[first], err_msg=f"step {step}")
        np.testing.assert_array_equal(final[~dones], obs["policy"].numpy()[~dones])
        assert bool(extras["time_outs"][0]) == (step == 5)
        if dones.any():  # the reset changed what the env returns
            assert not np.array_equal(final[dones], obs["policy"].numpy()[dones])
        ended |= dones
    assert ended.all()


def test_go1_final_obs_keeps_the_clock_before_it_restarts():
    """`--task go1`: env 0 times out on step 3; its final observation holds the clock of 3 steps
    (the returned one is back at 0) and every group; env 1's is the observation returned."""
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt)")
    pytest.importorskip("mujoco", reason="MuJoCo is optional (requirements-envs.txt)")
    from envs.go1 import gait_clock

    env = make_env("go1", 2, "cpu", seed=1)
    env.episode_length_buf[0] = env.max_episode_length - 3
    for _ in range(3):
        obs, _, dones, extras = env.step(torch.zeros(2, 12))
    assert dones.tolist() == [True, False]
    final = extras["final_obs"]
    assert final.keys() == obs.keys() == {"state", "privileged_state", "clock"}
    assert torch.equal(final["clock"][0], gait_clock(torch.tensor([3.0]))[0])
    assert torch.equal(obs["clock"][0], gait_clock(torch.tensor([0.0]))[0])
    for group, value in final.items():
        assert torch.equal(value[1], obs[group][1]), group
    assert not torch.equal(final["state"][0], obs["state"][0])  # the reset's first observation
