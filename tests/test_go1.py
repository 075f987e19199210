"""`--task go1` (envs/go1.py): its curriculum's stages by the env's steps and on a resume, its
reward as Playground's terms at the stage's scales, the `clock` group and its reset, the clock's
mirror, and the tools rebuilding the clock on the plain id. The mirror needs only torch; the rest
needs EnvPool and MuJoCo."""

import json
import os
import sys

import numpy as np
import pytest
import torch

import arguments
import envs
import ppo_ddp
from dist_helpers import ROOT
from envs import go1, mirrors

PLAIN = f"envpool:{go1.ID}"


def needs_envpool() -> None:
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    pytest.importorskip("mujoco", reason="the feet's heights need MuJoCo (requirements-envs.txt)")


def test_the_mirror_moves_the_clock_half_a_period_on():
    """Left and right swap the diagonal pairs, whose swings the clock's two halves time."""
    steps = torch.arange(60.0)
    both, _ = mirrors.go1(None, {"clock": go1.gait_clock(steps)})
    torch.testing.assert_close(both["clock"][:60], go1.gait_clock(steps))
    torch.testing.assert_close(both["clock"][60:], go1.gait_clock(steps + go1.PERIOD_STEPS / 2))


def test_go1_brings_its_settings_and_an_argument_wins():
    args = arguments.parse_args(ppo_ddp.Args, envs.task_defaults, ["--task", "go1"])
    assert args.actor_obs == ("state", "clock") and args.critic_obs == ("privileged_state", "clock")
    assert args.mirror.symmetry == "envs.mirrors:go1" and args.mirror.symmetry_augment
    assert (args.num_envs, args.iterations, args.steps_per_env) == (128, 1627, 24)
    argv = ["--task", "go1", "--num-envs", "4"]
    assert arguments.parse_args(ppo_ddp.Args, envs.task_defaults, argv).num_envs == 4


def test_the_stages_start_at_iterations_491_and_1001_and_a_resume_lands_in_its_stage():
    """At 24 steps per env an iteration, stage 2 starts at iteration 491 and stage 3 at 1001. A run
    resumed at iteration `it` builds its env with `steps_taken` 24 x (it - 1)
    (bookkeeping.start_rank): it is in the stage of a run that never stopped, and moves on."""
    assert [start for start, _, _ in go1.STAGES] == [24 * 0, 24 * 490, 24 * 1000]
    needs_envpool()
    env = envs.make_env("go1", 2, "cpu", 0, steps_taken=24 * 489)  # resumed at iteration 490
    for _ in range(24):
        assert env.stage() == 1
        env.step(torch.zeros(2, 12))
    assert env.steps_taken == 24 * 490 and env.stage() == 2
    assert envs.make_env("go1", 2, "cpu", 0, steps_taken=24 * 1000).stage() == 3  # at 1001
    for steps, stage in [(0, 1), (24 * 1000 - 1, 2), (10**8, 3)]:
        env.steps_taken = steps
        assert env.stage() == stage, steps


def stepped(env, steps: int) -> list[tuple]:
    """(reward, logged terms) of `steps` steps of small random actions (the robot stands and
    wobbles: most steps earn more than they are charged), seeded."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(steps):
        actions = 0.1 * torch.randn(env.num_envs, 12, generator=generator)
        _, rewards, _, extras = env.step(actions)
        rows.append((rewards.numpy(), {k: v.numpy() for k, v in extras["log"].items()}))
    return rows


def test_the_reward_is_playgrounds_terms_at_the_stages_scales_plus_the_clocks():
    """The plain id pays max(0, dt x the sum of its info's terms): Playground's reward, its terms at
    its own scales. `go1` logs the same terms at those scales, and pays in each stage their sum
    again with each term the stage raises multiplied by (its scale / Playground's), clipped at 0
    in stages 1 and 2 only, plus dt x each added term as logged."""
    needs_envpool()
    plain = envs.make_env(PLAIN, 3, "cpu", 0)
    dt = float(plain.env.spec.config.ctrl_dt)
    for rewards, log in stepped(plain, 10):
        total = dt * np.sum(list(log.values()), axis=0)
        np.testing.assert_allclose(rewards, np.maximum(total, 0.0), rtol=1e-5, atol=1e-7)
    env = envs.make_env("go1", 3, "cpu", 0)
    assert env.scales["tracking_lin_vel"] == plain.env.spec.config.tracking_lin_vel_scale == 1.0
    for stage, (start, raised, weights) in enumerate(go1.STAGES, 1):
        env.steps_taken = start
        added = {f"reward_{name}" for name in weights}
        unclipped = 0
        for rewards, log in stepped(env, 10):
            assert added <= log.keys() and log["curriculum_stage"].tolist() == [stage] * 3
            total = np.zeros(3)
            for key, value in log.items():
                name = key.removeprefix("reward_")
                if key.startswith("reward_") and key not in added:
                    total += value * (raised[name] / env.scales[name] if name in raised else 1.0)
            total *= dt
            paid = total if stage == 3 else np.maximum(total, 0.0)
            expected = paid + dt * np.sum([log[key] for key in added], axis=0)
            np.testing.assert_allclose(rewards, expected, rtol=1e-5, atol=1e-6)
            unclipped += int((total > 0).sum())
        assert unclipped > 0, stage  # steps whose pay the raised scales set


def test_the_clock_counts_the_episodes_steps_and_restarts_with_each_episode():
    """`clock` is `gait_clock` of the control steps since the episode began: 0 at the start, one
    step a step, and back to 0 on the step an episode ends (here a time-out of env 0); the tools'
    `policy_inputs` gives the same from a memory that counts the steps and is zeroed at the end."""
    needs_envpool()
    env = envs.make_env("go1", 2, "cpu", 0)
    torch.testing.assert_close(env.get_observations()["clock"], go1.gait_clock(torch.zeros(2)))
    env.episode_length_buf[0] = env.max_episode_length - 5
    memory = torch.zeros(2, go1.POLICY_MEMORY)
    for t in range(1, 8):
        given, memory = go1.policy_inputs(memory)
        obs, _, dones, extras = env.step(torch.zeros(2, 12))
        assert dones.tolist() == [t == 5, False] == extras["time_outs"].tolist()
        memory = memory * (1.0 - dones.float()).unsqueeze(-1)  # as the tools blank it
        expected = torch.tensor([t if t < 5 else t - 5, t], dtype=torch.float32)
        torch.testing.assert_close(obs["clock"], go1.gait_clock(expected))
        torch.testing.assert_close(go1.policy_inputs(memory)[0]["clock"], obs["clock"])


def test_the_tools_keep_the_clock_in_memory_and_export_it_for_the_plain_id(tmp_path):
    """An actor that reads `state` and `clock`, saved as a `go1` checkpoint: tools/policy.py reads
    only `state` from the env and keeps the clock as a memory of 1 (envs/go1.py `policy_inputs`),
    which gives the actions the env's own clock gives, episode ends included; the tools score it on
    the plain id, whose groups are all it needs, and its exported program runs there."""
    needs_envpool()
    from tools import policy as tools_policy

    torch.manual_seed(0)
    actor = ppo_ddp.Actor({"state": [48], "clock": [2]}, 12, (16,), 0.5, True)
    torch.nn.init.normal_(actor.net[-1].weight, std=0.5)  # actions that move the legs
    state = {"script": "ppo", "actor": actor.state_dict(), "args": {"task": "go1"}, "iteration": 1}
    torch.save({**state, "configs": {"actor": actor.config}}, tmp_path / "model_1.pt")
    policy = tools_policy.load_policy(str(tmp_path / "model_1.pt"))
    assert policy.obs_shapes == {"state": [48]} and policy.memory_size == 1
    assert policy.eval_task == PLAIN and policy.own_inputs is go1.policy_inputs
    env = envs.make_env("go1", 2, "cpu", 0)
    env.episode_length_buf[1] = env.max_episode_length - 10
    obs, memory = env.get_observations(), tools_policy.initial_memory(policy, 2, "cpu")
    for _ in range(20):
        actions, memory = tools_policy.act(policy, {"state": obs["state"]}, memory)
        assert torch.equal(actions, actor(obs)[0])
        obs, _, dones, _ = env.step(actions)
        memory = memory * (1.0 - dones.float()).unsqueeze(-1)
    assert env.clock_steps.tolist() == [20.0, 10.0]  # env 1's episode ended on the way
    tools_policy.check_fits(policy, envs.make_env(PLAIN, 2, "cpu", 0).get_observations())
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import export

    out = str(tmp_path / "out")
    config = export.Config(str(tmp_path / "model_1.pt"), out, ("torchscript",), check_envs=2)
    assert export.export(config) == {"torchscript": 0.0}
    meta = json.loads((tmp_path / "out" / "policy.json").read_text())
    assert meta["inputs"] == ["state", "memory_in"] and meta["checked_on"] == PLAIN
    assert meta["memory_gives"] == ["clock"] and meta["memory_size"] == 1
