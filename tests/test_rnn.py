"""ppo_rnn_ddp.py: memory blanked at dones in the rollout and the update alike, ranks identical, the
union batch, one all_reduce per mini-batch, resume, refusals. Equality with rsl_rl 5.5.1:
tests/test_rsl_rl.py."""

import functools
import os

import pytest
import torch

import arguments
import common
import envs
import ppo_ddp as ppo
import ppo_rnn_ddp as rnn
import speedups
from dist_helpers import (
    counting_collectives,
    cpu_dist,
    expect_files,
    process_group,
    run_ranks,
    sequence_batch,
    small_args,
)

CPU1 = cpu_dist()


def networks(
    kind: str, obs_dim: int = 3, hidden: int = 5, layers: int = 2
) -> tuple[rnn.Recurrent, rnn.Recurrent]:
    """A small recurrent actor and critic (1 action), the same for the same `kind` (seeded)."""
    torch.manual_seed(0)
    shapes = {"policy": [obs_dim]}
    actor_head = {"num_actions": 1, "hidden": (8,), "init_std": 1.0, "std_type": "log"}
    actor = rnn.Recurrent(shapes, True, kind, hidden, layers, actor_head)
    critic = rnn.Recurrent(shapes, True, kind, hidden, layers, {"hidden": (8,)})
    return actor, critic


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_unrolled_sequences_are_the_steps_the_policy_took(kind):
    """The update's unroll of a whole rollout (memory blanked after each done) gives, bit for bit,
    the outputs and memory of stepping once per env step as the rollout does (ppo_ddp.rollout's
    reset)."""
    actor, _ = networks(kind)
    x, dones = torch.randn(4, 7, 3), torch.zeros(4, 7)
    dones[0, 2] = dones[1, 5] = dones[2, 6] = 1.0
    start = torch.randn(4, actor.rnn.size)
    outputs, memory = actor.rnn(x, start, dones)
    stepped, state = [], start
    for t in range(7):
        output, state = actor.rnn(x[:, t : t + 1], state)
        stepped.append(output[:, 0])
        state = state * (1 - dones[:, t, None])  # as the rollout blanks it
    assert torch.equal(outputs, torch.stack(stepped, 1)) and torch.equal(memory, state)
    assert actor.rnn.size == actor.memory_size == (
        2 if kind == "lstm" else 1
    ) * 2 * 5 and outputs.shape == (4, 7, 5)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_an_episode_ending_mid_rollout_starts_the_next_from_zero_in_rollout_and_update(kind):
    """Envs 0 and 1 time out at step 2 of a 6-step rollout, with memories carried in from a previous
    one. Rollout: at step 3 they act as from a blank memory. Update: no loss after step 2 reaches
    their inputs up to step 2, while env 2's later losses reach back through its memory."""
    torch.manual_seed(1)
    env = envs.make_env("pendulum_angle", 4, "cpu", 0)
    env.episode_length_buf[:2] = env.max_episode_length - 3
    actor, critic = networks(kind, obs_dim=2)
    memory = tuple(torch.randn(4, net.rnn.size) for net in (actor, critic))
    args = small_args(rnn.Args, num_envs=4, steps_per_env=6)
    buf = rnn.make_rollout(6, 4, {"policy": [2]}, 1, torch.device("cpu"))
    step = functools.partial(rnn.act, actor, critic)
    rnn.rollout(env, step, env.get_observations(), memory, buf, envs.make_episodes(4, "cpu"), args)
    assert buf.dones[:, :2].tolist() == [[0, 0], [0, 0], [1, 1], [0, 0], [0, 0], [0, 0]]
    with torch.no_grad():  # all 4 envs in one batch, the same matrix shapes as in the rollout
        blank = torch.randn(4, actor.rnn.size)
        blank[:2] = 0.0
        (mean, _), _ = actor({"policy": buf.obs["policy"][3][:, None]}, blank)
    assert torch.equal(buf.means[3, :2], mean[:2, 0]) and not torch.equal(
        buf.means[3, 2:], mean[2:, 0]
    )

    obs = buf.obs["policy"].transpose(0, 1).clone().requires_grad_()  # (envs, steps, dim), a leaf
    (means, _), _ = actor(
        {"policy": obs}, torch.randn(4, actor.rnn.size), buf.dones.transpose(0, 1)
    )
    means[:, 3:].sum().backward()
    # (envs, steps): how much the losses of steps 3-5 depend on each input
    reach = obs.grad.abs().sum(-1)
    assert (reach[:2, :3] == 0).all() and (reach[2:, :3] > 0).all() and (reach[:, 3:] > 0).all()


def test_memory_ending_a_rollout_is_carried_into_the_next_and_blank_after_a_done():
    """The memory a rollout leaves is the next one's start; an env whose episode ended at the last
    step starts the next rollout blank."""
    env = envs.make_env("pendulum_angle", 4, "cpu", 0)
    env.episode_length_buf[:2] = env.max_episode_length - 5  # envs 0-1 end at the last of 5 steps
    actor, critic = networks("gru", obs_dim=2)
    memory = tuple(torch.zeros(4, net.rnn.size) for net in (actor, critic))
    buf = rnn.make_rollout(5, 4, {"policy": [2]}, 1, torch.device("cpu"))
    args = small_args(rnn.Args, num_envs=4, steps_per_env=5)
    step, episodes = functools.partial(rnn.act, actor, critic), envs.make_episodes(4, "cpu")
    rnn.rollout(env, step, env.get_observations(), memory, buf, episodes, args)
    for state in memory:
        assert (state[:2] == 0).all() and (state[2:] != 0).any(-1).all()


# --- 2 real processes (one spawn; each test below checks one claim on its results) ---------------

E = 4  # envs per rank in the union-batch update


def union_rollout() -> tuple[rnn.Rollout, tuple[torch.Tensor, torch.Tensor]]:
    """A fixed random 6-step rollout of 2E envs with dones mid-rollout, and the memories it starts
    from."""
    g = torch.Generator().manual_seed(3)
    buf = rnn.make_rollout(6, 2 * E, {"policy": [3]}, 1, torch.device("cpu"))
    for tensor in (
        *buf.obs.values(),
        buf.actions,
        buf.means,
        buf.values,
        buf.advantages,
        buf.returns,
    ):
        tensor.copy_(torch.randn(tensor.shape, generator=g))
    buf.stds.fill_(1.0)
    buf.log_probs.copy_(rnn.gaussian_log_prob(buf.actions, buf.means, buf.stds))
    buf.dones.copy_(torch.rand(buf.dones.shape, generator=g) < 0.2)
    actor, critic = networks("lstm")
    start = tuple(torch.randn(2 * E, net.rnn.size, generator=g) for net in (actor, critic))
    return buf, start


def recurrent_update(
    ctx: common.Dist, buf: rnn.Rollout, start: tuple, order: torch.Tensor
) -> tuple:
    """One recurrent update of LSTMs (2 epochs x 2 mini-batches, envs taken in `order`) ->
    (parameters, lr)."""
    actor, critic = networks("lstm")
    optimizer = speedups.adam(
        [*actor.parameters(), *critic.parameters()], 1e-3, speedups.SpeedArgs(), torch.device("cpu")
    )
    args = small_args(rnn.Args, epochs=2, mini_batches=2)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(torch, "randperm", lambda n, **kwargs: order.clone())
        rnn.make_update(actor, critic, optimizer, sequence_batch(buf, start), args, ctx)()
    return [p.detach().clone() for p in [*actor.parameters(), *critic.parameters()]], float(
        optimizer.param_groups[0]["lr"]
    )


def _two_rank_worker(root: str) -> dict:
    rank = int(os.environ["RANK"])
    results = {}
    with process_group("cpu", seed=0) as ctx:
        # This rank's share of the union rollout: envs [rank E, (rank + 1) E), mini-batches of E / 2
        # envs.
        whole, start = union_rollout()
        mine = rnn.make_rollout(6, E, {"policy": [3]}, 1, torch.device("cpu"))
        for name in (
            "actions",
            "log_probs",
            "means",
            "stds",
            "values",
            "advantages",
            "returns",
            "dones",
        ):
            getattr(mine, name).copy_(getattr(whole, name)[:, rank * E : (rank + 1) * E])
        for group in mine.obs:
            mine.obs[group].copy_(whole.obs[group][:, rank * E : (rank + 1) * E])
        share = tuple(s[rank * E : (rank + 1) * E] for s in start)
        # both ranks
        normalized, _ = rnn.normalize_advantages(mine.advantages, mine.returns, ctx.world_size)
        mine.advantages.copy_(normalized)
        with counting_collectives() as calls:
            results["union"] = recurrent_update(ctx, mine, share, torch.arange(E))
        results["collectives"] = calls["n"]

        rank_dir = os.path.join(root, f"rank{rank}")
        os.makedirs(rank_dir, exist_ok=True)
        os.chdir(rank_dir)  # same relative --run-dir on every rank, a different place on disk
        for kind in ("gru", "lstm"):
            sizes = {"rnn_hidden": 8, "actor_hidden": (8,), "critic_hidden": (8,), "num_envs": 4}
            sizes |= {"steps_per_env": 6, "epochs": 2, "mini_batches": 2, "iterations": 3}
            run = {
                "save_interval": 2,
                "check_interval": 1,
                "run_dir": f"run_{kind}",
                "logger": "none",
            }
            results[kind] = rnn.train(small_args(rnn.Args, rnn=kind, **sizes, **run), ctx)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("rnn_two_ranks")
    return root, run_ranks(_two_rank_worker, 2, str(root))


def test_two_ranks_train_gru_and_lstm_bitwise_identical_and_only_rank0_writes(two_ranks):
    root, (rank0, rank1) = two_ranks
    assert rank0["gru"] == rank1["gru"] and rank0["lstm"] == rank1["lstm"] != rank0["gru"]
    assert os.listdir(root / "rank1") == []
    for kind in ("gru", "lstm"):
        expect_files(
            root / "rank0" / f"run_{kind}", "latest", "metrics.jsonl", "model_2.pt", "model_3.pt"
        )
        checkpoint = torch.load(root / "rank0" / f"run_{kind}" / "model_3.pt", weights_only=True)
        assert checkpoint["script"] == "ppo_rnn" and checkpoint["parts"] == [
            "actor",
            "critic",
            "optimizer",
        ]
        assert checkpoint["args"]["rnn"] == kind and "rnn.rnn.weight_hh_l0" in checkpoint["actor"]
        assert (
            checkpoint["configs"]["actor"]["rnn_type"]
            == checkpoint["configs"]["critic"]["rnn_type"]
            == kind
        )


def test_recurrent_update_spends_one_all_reduce_per_minibatch(two_ranks):
    assert [rank["collectives"] for rank in two_ranks[1]] == [2 * 2] * 2


def test_two_ranks_of_e_envs_update_as_one_process_of_2e_envs(two_ranks):
    """Each rank's mini-batch i is half of the union's mini-batch i: the union process takes envs
    0-1 and 4-5, then 2-3 and 6-7. The averaged gradient of the ranks is the union's (global
    advantage statistics, equal shares), so the parameters agree to float rounding and the lr
    exactly."""
    (params0, lr0), (params1, lr1) = (rank["union"] for rank in two_ranks[1])
    assert all(torch.equal(p, q) for p, q in zip(params0, params1)) and lr0 == lr1
    buf, start = union_rollout()
    buf.advantages.copy_(rnn.normalize_advantages(buf.advantages, buf.returns, world_size=1)[0])
    order = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])
    union, lr = recurrent_update(CPU1, buf, start, order)
    assert max((p - q).abs().max().item() for p, q in zip(params0, union)) < 1e-6 and lr == lr0
    before, _ = networks("lstm")
    assert not torch.equal(next(before.parameters()), params0[0])  # the update moved them


# --- the script in one process ----------------------------------------------------------------


def test_resume_continues_with_a_blank_memory(tmp_path):
    """The memory is not in the checkpoint: the resumed run starts it at zero and trains on."""
    small = {
        "num_envs": 4,
        "steps_per_env": 4,
        "rnn_hidden": 4,
        "device": "cpu",
        "run_dir": str(tmp_path / "run"),
    }
    rnn.main(small_args(rnn.Args, iterations=2, logger="none", **small))
    rnn.main(
        small_args(rnn.Args, iterations=3, resume=str(tmp_path / "run"), logger="none", **small)
    )
    checkpoint = torch.load(tmp_path / "run" / "model_3.pt", weights_only=True)
    assert checkpoint["iteration"] == 3 and not any("memory" in key for key in checkpoint)


@pytest.mark.parametrize(
    "flag, value", [("symmetry", "envs.mirrors:pendulum"), ("rnd_weight", "1.0")]
)
def test_what_recurrence_cannot_do_is_not_offered(flag, value, capsys):
    """Symmetry (a mirrored copy of a sequence) and RND are ppo_ddp.py's alone: the recurrent script
    has no such flag, so the command line refuses it before anything starts."""
    assert arguments.has_field(ppo.Args(), flag) and not arguments.has_field(rnn.Args(), flag)
    with pytest.raises(SystemExit) as usage:
        arguments.parse_args(rnn.Args, None, [f"--{flag.replace('_', '-')}", value])
    assert usage.value.code != 0 and f"--{flag.replace('_', '-')}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            {"num_envs": 6},
            "--num-envs 6 is not divisible by --mini-batches 4: a recurrent mini-batch is a set of",
        ),
        ({"rnn_hidden": 0}, "bad argument: --rnn-hidden 0 (must be at least 1)."),
    ],
)
def test_what_recurrence_cannot_do_is_one_line_at_start_up(tmp_path, overrides, line):
    small = {
        "num_envs": 8,
        "steps_per_env": 4,
        "iterations": 1,
        "run_dir": str(tmp_path / "run"),
        "device": "cpu",
    }
    args = small_args(rnn.Args, **{**small, **overrides})
    with pytest.raises((common.Failure, ValueError)) as failure:
        arguments.check_args(args)  # as the command line is parsed
        rnn.main(args)
    assert str(failure.value).startswith(line) and "\n" not in str(failure.value)
    assert not (tmp_path / "run").exists()
