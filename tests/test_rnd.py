"""RND (extensions/rnd.py): rsl_rl's formulas on identical batches, the predictor kept in sync
across real ranks in the one all_reduce per mini-batch, and checkpoints that name what they hold."""

import os
import types

import pytest
import torch

import checkpoints
import common
import ppo_ddp as ppo
from dist_helpers import (
    chdir_rank_dir,
    counting_collectives,
    cpu_dist,
    ppo_update,
    process_group,
    run_ranks,
    small_args,
    small_ppo,
)
from extensions import rnd as rnd_ext

# --- rsl_rl's formulas, transcribed from rsl_rl/extensions/rnd.py and modules/normalization.py ----


class RslRlRewardNormalizer:
    """rsl_rl's EmpiricalDiscountedVariationNormalization: per step, the discounted return `avg` is
    updated and folded into running moments; the reward is divided by their std."""

    def __init__(self, gamma: float) -> None:
        self.gamma, self.avg, self.count = gamma, None, 0
        self.mean, self.var = (
            torch.zeros(1, dtype=torch.float64),
            torch.ones(1, dtype=torch.float64),
        )

    def __call__(self, rew: torch.Tensor) -> torch.Tensor:
        self.avg = rew.double() if self.avg is None else self.avg * self.gamma + rew.double()
        x = self.avg[:, None]
        self.count += x.shape[0]
        rate = x.shape[0] / self.count
        var_x, mean_x = x.var(0, unbiased=False), x.mean(0)
        delta = mean_x - self.mean
        self.mean = self.mean + rate * delta
        self.var = self.var + rate * (var_x - self.var + delta * (mean_x - self.mean))
        std = self.var.sqrt()
        return rew / std.float() if std > 0 else rew


def rsl_rl_schedule(
    mode: str, step: int, initial: float, initial_step: int, final_step: int, final: float
) -> float:
    if mode == "step":
        return initial if step < final_step else final
    if mode == "linear":
        if step < initial_step:
            return initial
        if step > final_step:
            return final
        return initial + (final - initial) * (step - initial_step) / (final_step - initial_step)
    return initial


def test_intrinsic_reward_and_loss_equal_rsl_rls_formulas_on_the_same_batch():
    torch.manual_seed(0)
    rnd = rnd_ext.RND(
        {"rnd_state": [5]}, (16, 16), 8, normalize_states=True, normalize_rewards=False
    )
    normalizer = rnd.inputs.normalizer
    common.update_normalizers([(normalizer, torch.randn(100, 5) * 3 + 1)], world_size=1)
    states = torch.randn(4, 10, 5) * 3  # (T, N, dim)
    weights = torch.tensor([0.5, 0.5, 1.0, 2.0])
    ours = rnd_ext.intrinsic_rewards(
        rnd, {"rnd_state": states}, weights, torch.zeros(10), 0.99, world_size=1
    )
    # rsl_rl: weight * ||target(norm(s)) - predictor(norm(s))||_2, per step
    x = (states - normalizer.mean.float()) / (normalizer.var.sqrt().float() + 1e-2)
    expected = weights[:, None] * torch.linalg.norm(rnd.target(x) - rnd.predictor(x), dim=-1)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    # rsl_rl's loss: MSE between predicted and (detached) target embeddings, gradients to the
    # predictor only
    loss = rnd_ext.predictor_loss(rnd, {"obs": {"rnd_state": states[0]}, "means": states[0]})
    torch.testing.assert_close(loss, ((rnd.predictor(x[0]) - rnd.target(x[0])) ** 2).mean())
    loss.backward()
    assert all(p.grad is not None for p in rnd.predictor.parameters())
    assert all(p.grad is None and not p.requires_grad for p in rnd.target.parameters())


def test_reward_normalization_equals_rsl_rls_step_by_step_normalizer():
    # rsl_rl folds each step's discounted return into the statistics, then divides; with one step
    # per rollout ours does exactly that (longer rollouts fold in all their steps first, as Burda et
    # al.).
    torch.manual_seed(1)
    rnd = rnd_ext.RND({"rnd_state": [3]}, (8,), 4, normalize_states=False, normalize_rewards=True)
    reference, running = RslRlRewardNormalizer(0.99), torch.zeros(6)
    for _ in range(4):
        states = torch.randn(1, 6, 3)
        ours = rnd_ext.intrinsic_rewards(
            rnd, {"rnd_state": states}, torch.ones(1), running, 0.99, world_size=1
        )
        raw = torch.linalg.norm(rnd.target(states[0]) - rnd.predictor(states[0]), dim=-1).detach()
        torch.testing.assert_close(ours[0], reference(raw), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["constant", "step", "linear"])
def test_weight_schedules_equal_rsl_rls_times_the_step_length(mode):
    schedule = {"rnd_schedule": mode, "rnd_schedule_steps": (10, 30)}
    args = small_args(ppo.Args, rnd_weight=2.0, rnd_final_weight=0.5, **schedule).rnd
    steps = torch.arange(0, 50, dtype=torch.float32)
    ours = rnd_ext.rnd_weights(args, steps, dt=0.05)
    expected = [0.05 * rsl_rl_schedule(mode, int(s), 2.0, 10, 30, 0.5) for s in steps]
    torch.testing.assert_close(ours, torch.tensor(expected), rtol=1e-6, atol=1e-7)


def test_rollout_rewards_read_the_next_state_and_rsl_rls_step_counter():
    """Step t of iteration `it` is scored on the state it led to (the rollout's t + 1, the
    observations after the rollout for the last step), with the weight of step (it - 1) T + t + 1
    times the env's `dt`; the weight of the last step is logged."""
    torch.manual_seed(2)
    rnd = rnd_ext.RND({"policy": [3]}, (8,), 4, normalize_states=False, normalize_rewards=False)
    buf = ppo.make_rollout(4, 5, {"policy": [3]}, 1, torch.device("cpu"))
    buf.obs["policy"].normal_()
    after = {"policy": torch.randn(5, 3)}
    schedule = {"rnd_schedule": "linear", "rnd_schedule_steps": (0, 40)}
    args = small_args(
        ppo.Args, steps_per_env=4, rnd_weight=1.0, rnd_final_weight=3.0, **schedule
    ).rnd
    env, ctx, logs = types.SimpleNamespace(dt=0.5), cpu_dist(), {}
    rewards = rnd_ext.rollout_intrinsic_rewards(
        rnd, buf, after, torch.zeros(5), 3, env, args, ctx, logs
    )
    next_states = torch.cat([buf.obs["policy"][1:], after["policy"][None]])
    steps = torch.tensor([9.0, 10.0, 11.0, 12.0])  # iteration 3 of 4 steps: (3 - 1) * 4 + 1 ... + 4
    weights = 0.5 * (1.0 + 2.0 * steps / 40)
    expected = weights[:, None] * torch.linalg.norm(
        rnd.target(next_states) - rnd.predictor(next_states), dim=-1
    )
    torch.testing.assert_close(rewards, expected.detach())
    assert logs["rnd_weight"].item() == pytest.approx(weights[-1].item())


# --- the sync ------------------------------------------------------------------------------------


def _rnd_update_worker():
    with process_group("cpu", seed=0) as ctx:
        torch.manual_seed(0)  # the same networks on both ranks; the data differs by rank
        args = small_args(ppo.Args, epochs=2, mini_batches=3)
        actor, critic, optimizer, _ = small_ppo(4, 6, normalize=False)
        rnd = rnd_ext.RND(
            {"rnd_state": [3]}, (8,), 4, normalize_states=True, normalize_rewards=False
        )
        rnd_optimizer = torch.optim.Adam(rnd.predictor.parameters(), lr=1e-3)
        torch.manual_seed(1 + ctx.rank)
        buf = small_ppo(4, 6, normalize=False)[3]
        buf.obs["rnd_state"] = torch.randn(4, 6, 3)
        before = [p.detach().clone() for p in rnd.predictor.parameters()]
        advantages, returns = torch.randn(4, 6), torch.randn(4, 6)
        with counting_collectives() as calls:
            losses = ppo_update(
                actor,
                critic,
                optimizer,
                buf,
                advantages,
                returns,
                args,
                ctx,
                rnd=rnd,
                rnd_optimizer=rnd_optimizer,
            )
        moved = any(not torch.equal(a, b) for a, b in zip(before, rnd.predictor.parameters()))
        trained = {
            "actor": actor,
            "critic": critic,
            "rnd": rnd,
            "opt": optimizer,
            "rnd_opt": rnd_optimizer,
        }
        fingerprint = common.fingerprint(trained)
        return calls["n"], moved, losses["rnd_loss"], fingerprint


def test_predictor_gradients_ride_in_the_one_all_reduce_per_minibatch():
    results = run_ranks(_rnd_update_worker, 2)
    assert [r[0] for r in results] == [2 * 3] * 2  # 2 epochs x 3 mini-batches, RND included
    # the predictor trained, on a loss logged as rnd_loss
    assert results[0][1] and results[0][2] > 0
    # the same averaged loss and the same bits on both ranks
    assert results[0][2:] == results[1][2:]


def _train_worker(root, overrides):
    chdir_rank_dir(root)
    small = {
        "num_envs": 16,
        "steps_per_env": 8,
        "iterations": 3,
        "run_dir": "run",
        "check_interval": 1,
    }
    rnd = {"task": "pendulum_sparse", "rnd_weight": 40.0, "rnd_normalize_rewards": True}
    return ppo.main(small_args(ppo.Args, **rnd, **{**small, **overrides}))


def test_training_with_rnd_leaves_ranks_bitwise_identical_and_checkpoints_it(tmp_path):
    """Target, predictor, both normalizers and the predictor's Adam hash the same on both ranks
    (also checked every iteration inside the run); the checkpoint holds them; resuming without RND
    is refused."""
    hashes = run_ranks(_train_worker, 2, str(tmp_path), {})
    assert hashes[0] == hashes[1]
    checkpoint = torch.load(tmp_path / "0" / "run" / "model_3.pt", weights_only=True)
    assert {"rnd", "rnd_optimizer"} <= set(checkpoint["parts"])
    assert {
        "target.0.weight",
        "predictor.0.weight",
        "inputs.normalizer.mean",
        "reward_normalizer.var",
    } <= set(checkpoint["rnd"])
    assert os.listdir(tmp_path / "1") == []
    with pytest.raises(ValueError, match=r"holds the state of .*'rnd'.*--rnd-weight"):
        checkpoints.restore(checkpoints.ResumeFrom("model_3.pt", checkpoint), _plain_parts())


def _plain_parts():
    actor, critic, optimizer, _ = small_ppo(1, 1)
    return {"actor": actor, "critic": critic, "optimizer": optimizer}


def test_rnd_reads_its_group_or_the_actors_and_is_off_at_weight_zero():
    obs = {"policy": torch.zeros(4, 3), "rnd_state": torch.zeros(4, 2)}
    actor_groups, cpu = ("policy",), torch.device("cpu")

    def make(**flags):
        args = small_args(ppo.Args, **flags)
        return rnd_ext.make_rnd(obs, actor_groups, args, cpu)

    assert make() == (None, None)
    rnd, _ = make(rnd_weight=1.0)
    assert rnd.inputs.shapes == {"rnd_state": [2]} and rnd.target[0].in_features == 2
    del obs["rnd_state"]
    rnd, _ = make(rnd_weight=1.0)
    assert rnd.inputs.shapes == {"policy": [3]} and rnd.target[0].in_features == 3
    with pytest.raises(
        ValueError, match="--rnd-schedule linear with --rnd-schedule-steps 5 2: give a start"
    ):
        make(rnd_schedule="linear", rnd_final_weight=1.0, rnd_schedule_steps=(5, 2))
