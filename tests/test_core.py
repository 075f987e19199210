"""Single-process checks of the pure functions: GAE, the KL rule, normalization, the PPO loss; the
linear learning-rate schedule and CleanRL's network."""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import common
import ppo_ddp
import speedups
from common import EmpiricalNormalizer, merge_moments
from dist_helpers import cpu_dist, rollout_batch, small_args
from ppo_ddp import adaptive_lr, compute_gae, gaussian_log_prob, normalize_advantages, ppo_loss


def test_gae_matches_hand_computed_case_with_termination_and_timeout():
    """The training loop bootstraps time-outs (`r + gamma * V(s_t)`, rsl_rl) before GAE."""
    gamma, lam = 0.9, 0.5
    # env 0 terminates after step 1; env 1 is truncated by the time limit after step 0.
    raw_rewards = torch.tensor([[1.0, -1.0], [2.0, 0.0], [3.0, 1.0]])
    values = torch.tensor([[0.5, 2.0], [1.0, 0.0], [1.5, 1.0]])
    dones = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    time_outs = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    rewards = raw_rewards + gamma * values * time_outs  # as in ppo_ddp.train
    assert rewards[0, 1].item() == pytest.approx(-1.0 + 0.9 * 2.0)
    adv, ret = compute_gae(rewards, values, dones, torch.tensor([2.0, 0.0]), gamma, lam)
    # By hand: env 0 deltas 1.4, 1.0 (cut), 3.3; env 1 deltas -1.2 (cut), 0.9, 0.0.
    expected_adv = torch.tensor([[1.4 + 0.45 * 1.0, -1.2], [1.0, 0.9], [3.3, 0.0]])
    assert torch.allclose(adv, expected_adv, atol=1e-6)
    assert torch.allclose(ret, expected_adv + values, atol=1e-6)


@pytest.mark.parametrize(
    "kl, lr, expected",
    [
        (0.05, 1e-3, 1e-3 / 1.5),  # above 2x desired: shrink
        (0.05, 1.2e-5, 1e-5),  # ... but never below 1e-5
        (0.001, 1e-3, 1.5e-3),  # below half desired: grow
        (0.001, 8e-3, 1e-2),  # ... but never above 1e-2
        (0.0, 1e-3, 1e-3),  # zero KL (nothing learned): unchanged
        (0.01, 1e-3, 1e-3),  # inside the band: unchanged
        (0.02, 1e-3, 1e-3),  # exactly 2x desired is still inside
    ],
)
def test_adaptive_lr_rule_at_each_branch(kl, lr, expected):
    chosen = adaptive_lr(torch.tensor(kl), torch.tensor(lr, dtype=torch.float64), desired_kl=0.01)
    assert chosen.dtype == torch.float64 and chosen.item() == pytest.approx(expected)


def test_adaptive_lr_matches_python_float_arithmetic_bit_for_bit():
    # The rule runs on the device in float64: the same bits as rsl_rl's Python-float version.
    lr = 1e-3
    for kl in [0.05, 0.001, 0.03, 0.0001, 0.0001, 0.05, 0.012, float("nan")]:
        expected = (
            max(1e-5, lr / 1.5) if kl > 0.02 else min(1e-2, lr * 1.5) if 0.0 < kl < 0.005 else lr
        )
        chosen = adaptive_lr(
            torch.tensor(kl), torch.tensor(lr, dtype=torch.float64), desired_kl=0.01
        ).item()
        assert chosen == expected
        lr = chosen


def test_normalize_advantages_single_process_is_standard_score_and_explained_variance_cleanrls():
    """The standard score of the advantages, and CleanRL's explained variance of the returns by the
    values (`returns - advantages`): 1 - Var[returns - values] / Var[returns]."""
    adv, values = torch.randn(7, 5) * 3 + 2, torch.randn(7, 5)
    out, explained = normalize_advantages(adv, adv + values, world_size=1)
    assert torch.allclose(out, (adv - adv.mean()) / (adv.std() + 1e-8), atol=1e-5)
    y, values = (adv + values).double().flatten().numpy(), values.double().flatten().numpy()
    assert explained.item() == pytest.approx(1 - np.var(y - values) / np.var(y), abs=1e-6)


def test_merge_moments_equals_numpy_on_concatenation():
    rng = np.random.default_rng(0)
    a, b = rng.normal(3, 2, (50, 4)), rng.normal(-1, 5, (30, 4))

    def moments(x):
        return (
            torch.tensor(float(len(x)), dtype=torch.float64),
            torch.tensor(x.mean(0)),
            torch.tensor(((x - x.mean(0)) ** 2).sum(0)),
        )

    n, mean, m2 = merge_moments(moments(a), moments(b))
    union = np.concatenate([a, b])
    assert n.item() == 80
    np.testing.assert_allclose(mean.numpy(), union.mean(0), rtol=1e-12)
    np.testing.assert_allclose((m2 / n).numpy(), union.var(0), rtol=1e-12)


def test_normalizer_single_process_tracks_all_batches():
    norm = EmpiricalNormalizer(3)
    batches = [torch.randn(20, 3) * 4 + 1, torch.randn(10, 3) - 2]
    for x in batches:
        common.update_normalizers([(norm, x)], world_size=1)
    union = torch.cat(batches).double()
    assert torch.allclose(norm.mean, union.mean(0))
    assert torch.allclose(norm.var, union.var(0, unbiased=False))
    x = torch.randn(5, 3)
    assert torch.allclose(
        norm(x),
        ((x.double() - union.mean(0)) / (union.var(0, unbiased=False).sqrt() + 1e-2)).float(),
        atol=1e-6,
    )


def _fixed_networks(mean, std, values):
    """Stand-ins for actor and critic that return the given outputs whatever the observation."""
    return (lambda obs: (mean, std)), (lambda obs: values)


def test_gaussian_log_prob_and_the_loss_kl_match_torch_distributions():
    mean, std = torch.randn(6, 2), torch.rand(6, 2) + 0.1
    actions = torch.randn(6, 2)
    reference = torch.distributions.Normal(mean, std)
    assert torch.allclose(
        gaussian_log_prob(actions, mean, std), reference.log_prob(actions).sum(-1), atol=1e-5
    )
    new_mean, new_std = torch.randn(6, 2), torch.rand(6, 2) + 0.1
    actor, critic = _fixed_networks(new_mean, new_std, torch.zeros(6))
    zeros = torch.zeros(6)
    mb = {"obs": {"policy": zeros}, "actions": actions, "log_probs": zeros, "means": mean}
    mb |= {"stds": std, "values": zeros, "advantages": zeros, "returns": zeros}
    _, stats = ppo_loss(actor, critic, mb, ppo_ddp.Args())
    expected = torch.distributions.kl_divergence(
        reference, torch.distributions.Normal(new_mean, new_std)
    ).sum(-1)
    assert list(stats)[0] == "kl" and stats["kl"].item() == pytest.approx(
        expected.mean().item(), rel=1e-5
    )


def test_ppo_loss_clips_ratio_and_value():
    mean, std, actions = torch.zeros(2, 1), torch.ones(2, 1), torch.tensor([[0.3], [-0.7]])
    log_probs = gaussian_log_prob(actions, mean, std)
    values = torch.tensor([1.0, 0.0])
    actor, critic = _fixed_networks(mean, std, values)
    mb = {
        "obs": {"policy": torch.zeros(2, 3)},
        "actions": actions,
        "log_probs": log_probs - torch.log(torch.tensor([2.0, 0.5])),  # ratios 2 and 0.5
        "means": mean,
        "stds": std,
        "values": torch.zeros(2),  # the rollout's values
        "advantages": torch.tensor([1.0, -1.0]),
        "returns": torch.tensor([1.0, 0.0]),
    }
    args = ppo_ddp.Args(clip=0.2, value_coef=1.0, entropy_coef=0.0)
    loss, stats = ppo_loss(actor, critic, mb, args)
    assert list(stats) == ["kl", "surrogate_loss", "value_loss", "entropy", "clipfrac"]
    # ratio 2 with A=1 is clipped to 1.2; ratio 0.5 with A=-1 is clipped to 0.8 -> surrogate -(1.2 -
    # 0.8)/2
    assert stats["surrogate_loss"].item() == pytest.approx(-(1.2 - 0.8) / 2)
    # value 1.0 moved 1.0 from old 0.0: clipped to 0.2 -> max((1-1)^2, (0.2-1)^2) = 0.64, mean with
    # 0
    assert stats["value_loss"].item() == pytest.approx(0.64 / 2)
    assert loss.item() == pytest.approx(stats["surrogate_loss"].item() + stats["value_loss"].item())
    assert stats["kl"].item() == 0.0  # the policy did not move
    assert stats["clipfrac"].item() == 1.0  # both ratios, 2 and 0.5, lie outside [0.8, 1.2]
    unclipped, unclipped_stats = ppo_loss(
        actor, critic, mb, ppo_ddp.Args(clip_value_loss=False, entropy_coef=0.0)
    )
    assert unclipped_stats["value_loss"].item() == pytest.approx(0.0) and math.isfinite(
        unclipped.item()
    )


def test_linear_schedule_anneals_from_the_learning_rate_towards_zero(tmp_path):
    """`--schedule linear`, CleanRL's annealing: iteration i of n trains with lr * (1 - (i - 1) /
    n)."""
    small = {
        "num_envs": 8,
        "steps_per_env": 4,
        "iterations": 4,
        "logger": "none",
        "run_dir": str(tmp_path),
    }
    ppo_ddp.main(small_args(ppo_ddp.Args, **small, schedule="linear", learning_rate=1e-3))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["learning_rate"] for row in rows] == pytest.approx(
        [1e-3, 7.5e-4, 5e-4, 2.5e-4], rel=1e-12
    )


def test_tanh_network_is_cleanrls_orthogonal_init_and_elu_stays_torchs():
    """`--activation tanh`: tanh layers, orthogonal weights of gain sqrt(2) (0.01 for the actor's
    output, 1 for the critic's), zero biases. `elu` builds exactly the MLP torch's default init
    gives."""
    actor = ppo_ddp.Actor({"policy": [5]}, 3, (64, 32), 1.0, True, activation="tanh")
    critic = ppo_ddp.Critic({"policy": [5]}, (64, 32), True, "tanh")
    for net, output_gain in ((actor.net, 0.01), (critic.net, 1.0)):
        assert [type(m) for m in net] == [nn.Linear, nn.Tanh, nn.Linear, nn.Tanh, nn.Linear]
        for layer in net[::2]:
            w = layer.weight.detach().double()
            gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w  # orthogonal rows, or columns
            gain = output_gain if layer is net[-1] else math.sqrt(2)
            assert torch.allclose(
                gram, gain**2 * torch.eye(len(gram), dtype=torch.float64), atol=1e-5
            )
            assert not layer.bias.any()
    torch.manual_seed(0)
    elu = ppo_ddp.Actor({"policy": [5]}, 3, (64, 32), 1.0, True)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 64), nn.ELU(), nn.Linear(64, 32), nn.ELU(), nn.Linear(32, 3))
    assert [type(m) for m in elu.net] == [type(m) for m in plain]
    assert all(
        torch.equal(a, b)
        for a, b in zip(elu.net.state_dict().values(), plain.state_dict().values())
    )


@pytest.mark.parametrize("shuffle, draws", [("once", 1), ("every-epoch", 3)])
def test_mini_batch_order_is_drawn_once_per_update_or_every_epoch(monkeypatch, shuffle, draws):
    """`--shuffle once` (rsl_rl 5.5.1's): every epoch walks the same mini-batches in the same order;
    `every-epoch` (CleanRL's): a fresh permutation each epoch."""
    torch.manual_seed(0)
    actor, critic = (
        ppo_ddp.Actor({"policy": [3]}, 1, (8,), 1.0, False),
        ppo_ddp.Critic({"policy": [3]}, (8,), False),
    )
    optimizer = speedups.adam(
        [*actor.parameters(), *critic.parameters()], 1e-3, speedups.SpeedArgs(), torch.device("cpu")
    )
    buf = ppo_ddp.make_rollout(4, 8, {"policy": [3]}, 1, torch.device("cpu"))
    for tensor in (buf.obs["policy"], buf.actions, buf.advantages, buf.returns):
        tensor.normal_()
    buf.stds.fill_(1.0)  # the rollout's policy: N(0, 1)
    buf.log_probs.copy_(gaussian_log_prob(buf.actions, buf.means, buf.stds))
    drawn, randperm = [], torch.randperm
    monkeypatch.setattr(
        torch, "randperm", lambda *a, **k: drawn.append(randperm(*a, **k)) or drawn[-1]
    )
    args = ppo_ddp.Args(epochs=3, mini_batches=2, shuffle=shuffle)
    ppo_ddp.make_update(actor, critic, optimizer, rollout_batch(buf), args, cpu_dist())()
    assert len(drawn) == draws and all(sorted(order.tolist()) == list(range(32)) for order in drawn)


def test_an_update_statistic_that_is_nan_stops_with_one_line_naming_it():
    """The means of an update's statistics come out of the all_reduce, alike on every rank: one that
    is NaN/Inf raises a Failure naming it and the likely causes, before any checkpoint is written.
    """
    common.check_update({"kl": 0.01, "value_loss": 2.0}, "the test")
    with pytest.raises(
        common.Failure, match="non-finite value_loss in the update: the test produced"
    ):
        common.check_update({"kl": 0.01, "value_loss": float("nan")}, "the test")
