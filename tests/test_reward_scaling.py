"""Reward scaling (extensions/reward_scaling.py): Gymnasium's NormalizeReward formula, statistics
merged across real ranks as those of the union of their returns, in the normalizers' all_gather (no
collective of its own), ranks bitwise identical in training, and the state in the checkpoint."""

import numpy as np
import pytest
import torch

import common
import ppo_ddp as ppo
import ppo_rnn_ddp
from dist_helpers import chdir_rank_dir, counting_collectives, process_group, run_ranks, small_args
from extensions import reward_scaling


def reference_returns(rewards: np.ndarray, dones: np.ndarray, gamma: float) -> np.ndarray:
    """The discounted return so far of every step, restarted after an episode's last step (by
    hand)."""
    running, returns = np.zeros(rewards.shape[1]), np.zeros_like(rewards)
    for t in range(len(rewards)):
        running = gamma * running + rewards[t]
        returns[t] = running
        running = running * (1 - dones[t])
    return returns


def test_rewards_are_divided_by_the_std_of_the_returns_seen_before_and_clipped():
    """Each rollout is divided by sqrt(var + 1e-8) of the returns of the rollouts before it (the
    first by 1: no statistics yet), then clipped; the running return carries over rollouts and
    restarts at dones."""
    torch.manual_seed(0)
    scaler = reward_scaling.RewardScaler(num_envs=3, steps=4, gamma=0.9, clip=2.5)
    rollouts = [(torch.randn(4, 3) * 5, (torch.rand(4, 3) < 0.3).float()) for _ in range(3)]
    seen, clipped = [], False
    all_rewards = np.concatenate([r.numpy() for r, _ in rollouts])
    all_returns = reference_returns(
        all_rewards, np.concatenate([d.numpy() for _, d in rollouts]), 0.9
    )
    for k, (rewards, dones) in enumerate(rollouts):
        scaled = reward_scaling.scale_rewards(scaler, rewards, dones)
        std = np.sqrt(np.concatenate(seen).var() + 1e-8) if seen else np.sqrt(1 + 1e-8)
        np.testing.assert_allclose(
            scaled.numpy(), np.clip(rewards.numpy() / std, -2.5, 2.5), rtol=1e-6
        )
        clipped |= bool((scaled.abs() == 2.5).any())
        np.testing.assert_allclose(
            scaler.returns.numpy(), all_returns[4 * k : 4 * k + 4], rtol=1e-6
        )
        common.update_normalizers(reward_scaling.normalizer_batch(scaler), world_size=1)
        seen.append(all_returns[4 * k : 4 * k + 4].reshape(-1))
    assert clipped  # the clip did act (on the first rollout, divided by 1)
    assert reward_scaling.scale_rewards(None, rollouts[0][0], rollouts[0][1]) is rollouts[0][0]


def _merge_worker():
    with process_group("cpu", seed=0) as ctx:
        scaler = reward_scaling.RewardScaler(num_envs=2 + ctx.rank, steps=5, gamma=0.99, clip=10.0)
        g = torch.Generator().manual_seed(ctx.rank)
        for _ in range(2):
            rewards, dones = (
                torch.randn(5, 2 + ctx.rank, generator=g) * (1 + ctx.rank),
                torch.zeros(5, 2 + ctx.rank),
            )
            dones[2] = 1.0
            reward_scaling.scale_rewards(scaler, rewards, dones)
            with (
                counting_collectives() as calls
            ):  # the scaler rides in the one all_gather of the observations'
                common.update_normalizers(
                    [(common.EmpiricalNormalizer(3), torch.randn(4, 3))]
                    + reward_scaling.normalizer_batch(scaler),
                    ctx.world_size,
                )
        normalizer = scaler.normalizer
        return (
            calls["n"],
            normalizer.count.item(),
            normalizer.mean.item(),
            normalizer.var.item(),
            list(scaler.state_dict()),
        )


def test_return_statistics_merged_across_ranks_equal_those_of_the_union():
    results = run_ranks(_merge_worker, 2)
    union = []
    for rank in range(2):
        g = torch.Generator().manual_seed(rank)
        rewards, dones = [], []
        for _ in range(2):
            rewards.append(torch.randn(5, 2 + rank, generator=g).numpy() * (1 + rank))
            dones.append(np.zeros((5, 2 + rank)))
            dones[-1][2] = 1.0
        union.append(
            reference_returns(np.concatenate(rewards), np.concatenate(dones), 0.99).reshape(-1)
        )
    union = np.concatenate(union)
    assert results[0] == results[1]  # the same bits on both ranks
    calls, count, mean, var, state = results[0]
    assert calls == 1 and count == len(union)
    assert mean == pytest.approx(union.mean(), rel=1e-6) and var == pytest.approx(
        union.var(), rel=1e-6
    )  # float32 returns
    # per-rank returns stay out
    assert state == ["normalizer.count", "normalizer.mean", "normalizer.var"]


def _train_worker(root, scale, recurrent=False):
    chdir_rank_dir(root)
    script, sizes = (
        (ppo_rnn_ddp, {"rnn_hidden": 8, "schedule": "linear"}) if recurrent else (ppo, {})
    )
    sizes |= {
        "num_envs": 16,
        "steps_per_env": 8,
        "iterations": 4,
        "run_dir": "run",
        "check_interval": 1,
    }
    args = small_args(script.Args, **sizes, **({"scale_rewards": True} if scale else {}))
    with counting_collectives() as calls:
        fingerprint = script.main(args)
    return calls["n"], fingerprint


def test_training_with_reward_scaling_keeps_ranks_identical_and_adds_no_collective(tmp_path):
    """With --scale-rewards both ranks hash the same (and are compared every iteration in the run),
    the checkpoint holds the return statistics, and over 4 iterations the run makes 3 collectives
    more than without: the start-up broadcast of the statistics' 3 tensors, none per iteration."""
    scaled = run_ranks(_train_worker, 2, str(tmp_path / "scaled"), True)
    plain = run_ranks(_train_worker, 2, str(tmp_path / "plain"), False)
    assert scaled[0] == scaled[1] and scaled[0][1] != plain[0][1]
    assert scaled[0][0] - plain[0][0] == 3
    checkpoint = torch.load(tmp_path / "scaled" / "0" / "run" / "model_4.pt", weights_only=True)
    assert sorted(checkpoint["parts"]) == ["actor", "critic", "optimizer", "reward_scaler"]
    # every step of both ranks
    assert checkpoint["reward_scaler"]["normalizer.count"] == 4 * 8 * 16 * 2


def test_recurrent_ppo_anneals_the_learning_rate_with_ranks_identical(tmp_path):
    """ppo_rnn_ddp.py takes --schedule linear as ppo_ddp.py does: ranks identical, and the learning
    rate saved after the last iteration is 1/4 of the start (reward scaling is ppo_ddp.py's alone).
    """
    runs = run_ranks(_train_worker, 2, str(tmp_path / "rnn"), False, True)
    assert runs[0] == runs[1]
    checkpoint = torch.load(tmp_path / "rnn" / "0" / "run" / "model_4.pt", weights_only=True)
    assert "reward_scaler" not in checkpoint and checkpoint["learning_rate"] == pytest.approx(
        1e-3 / 4
    )
