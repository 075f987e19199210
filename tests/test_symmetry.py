"""Symmetry (extensions/symmetry.py): rsl_rl 5.5.1's augmentation and mirror loss on identical
batches, the built-in mirror functions true symmetries of their tasks, the mirror loss's gradients
in the one all_reduce per mini-batch, ranks bitwise identical, the union batch, and bad input
stopped at start-up."""

import json
import math
import types

import pytest
import torch

import bookkeeping
import common
import envs
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
from envs import mirrors
from extensions import symmetry

REACHER = {
    "actor": ("policy",),
    "critic": ("critic",),
}  # the reacher's groups: the critic reads its privileged one
POLICY_ONLY = {
    "actor": ("policy",),
    "critic": ("policy",),
}  # the built-in pendulum's and the README's PointMass


def networks(obs, num_actions, groups=REACHER, normalize=False):
    """An actor and a critic (hidden (16,)) that read `groups` of `obs`: the groups a Mirror
    mirrors."""
    actor_shapes, critic_shapes = (
        envs.group_shapes(obs, groups[name]) for name in ("actor", "critic")
    )
    return ppo.Actor(actor_shapes, num_actions, (16,), 1.0, normalize), ppo.Critic(
        critic_shapes, (16,), normalize
    )


def three_way(env, obs=None, actions=None):
    """A mirror function with k = 3: the reacher's mirror image, then the negated originals (not a
    symmetry of anything: it only shows that every copy comes back in rsl_rl's order)."""
    twice, doubled = mirrors.reacher(env, obs, actions)
    obs = None if obs is None else {g: torch.cat([twice[g], -obs[g]]) for g in obs.keys()}
    return obs, None if actions is None else torch.cat([doubled, -actions])


def reacher_batch(rows: int = 6):
    """(env, mirror's arguments, a mini-batch as ppo_ddp.make_update slices one) of `rows` reacher
    states."""
    env = envs.make_env("reacher", rows, "cpu", 0)
    obs = env.get_observations()
    g = torch.Generator().manual_seed(1)
    mb = {
        "obs": {"policy": obs["policy"], "critic": obs["critic"]},
        "actions": torch.randn(rows, 2, generator=g),
    }
    for name in ("log_probs", "values", "advantages", "returns"):
        mb[name] = torch.randn(rows, generator=g)
    mb["means"], mb["stds"] = (
        torch.randn(rows, 2, generator=g),
        torch.rand(rows, 2, generator=g) + 0.5,
    )
    return env, obs, mb


def load(function, obs, env=None, **flags):
    """Our Mirror of `function` (given as `module:function`) for the reacher's groups."""
    spec = f"{function.__module__}:{function.__name__}"
    args = small_args(ppo.Args, symmetry=spec, **flags).mirror
    return symmetry.load_mirror(args, env, obs, *networks(obs, 2), 2)


def as_rsl_rl(function):
    """`function` as rsl_rl 5.5.1's Symmetry calls it: observations in and out as a TensorDict."""
    from tensordict import TensorDict

    def mirror(env, obs=None, actions=None):
        out_obs, out_actions = function(env, None if obs is None else dict(obs.items()), actions)
        rows = None if out_obs is None else next(iter(out_obs.values())).shape[0]
        return (None if out_obs is None else TensorDict(out_obs, batch_size=[rows])), out_actions

    return mirror


def rsl_rl_batch(mb):
    """The same mini-batch as rsl_rl 5.5.1's RolloutStorage.Batch holds it (the fields Symmetry
    reads)."""
    from tensordict import TensorDict

    obs = TensorDict(dict(mb["obs"]), batch_size=[mb["actions"].shape[0]])
    columns = {
        f: mb[name][:, None]
        for f, name in [("old_actions_log_prob", "log_probs"), ("values", "values")]
    }
    columns |= {name: mb[name][:, None] for name in ("advantages", "returns")}
    return types.SimpleNamespace(observations=obs, actions=mb["actions"], **columns)


@pytest.fixture
def rsl_rl_symmetry():
    pytest.importorskip("tensordict", reason="rsl_rl's observation container")
    return pytest.importorskip("rsl_rl.extensions", reason="rsl-rl-lib 5.5.1 is optional").Symmetry


@pytest.mark.parametrize("function", [mirrors.reacher, three_way])
def test_augmentation_equals_rsl_rls_symmetry_on_the_same_batch(function, rsl_rl_symmetry):
    env, obs, mb = reacher_batch()
    ours = symmetry.augment_batch(load(function, obs), mb)
    theirs = rsl_rl_batch(mb)
    rsl_rl_symmetry(env, as_rsl_rl(function), use_data_augmentation=True).augment_batch(theirs, 6)
    assert ours["actions"].shape[0] == (18 if function is three_way else 12)
    assert set(ours["obs"]) == {"policy", "critic"}
    assert torch.equal(ours["obs"]["policy"], theirs.observations["policy"])
    assert torch.equal(ours["obs"]["critic"], theirs.observations["critic"])
    assert torch.equal(ours["actions"], theirs.actions)
    # repeated, not recomputed
    assert torch.equal(ours["log_probs"], theirs.old_actions_log_prob[:, 0])
    for name in ("values", "advantages", "returns"):
        assert torch.equal(ours[name], getattr(theirs, name)[:, 0])
    # KL and entropy: the originals only
    assert ours["means"] is mb["means"] and ours["stds"] is mb["stds"]


@pytest.mark.parametrize("augment", [False, True])
def test_mirror_loss_and_its_gradient_equal_rsl_rls_on_the_same_batch(augment, rsl_rl_symmetry):
    env, obs, mb = reacher_batch()
    torch.manual_seed(0)
    actor = ppo.Actor({"policy": [10]}, 2, (16,), 1.0, normalize=True)
    common.update_normalizers(
        [(actor.inputs.normalizer, torch.randn(50, 10) * 2 + 1)], world_size=1
    )
    mirror = load(mirrors.reacher, obs)
    ours = symmetry.mirror_loss(
        mirror, actor, symmetry.augment_batch(mirror, mb) if augment else mb, augment
    )
    ours.backward()
    our_grads = [p.grad.clone() for p in actor.net.parameters()]
    actor.zero_grad(set_to_none=True)
    rsl_rl = rsl_rl_symmetry(
        env, as_rsl_rl(mirrors.reacher), augment, use_mirror_loss=True, mirror_loss_coeff=1.0
    )
    batch = rsl_rl_batch(mb)
    rsl_rl.augment_batch(batch, 6)
    theirs = rsl_rl.compute_loss(lambda td: actor({"policy": td["policy"]})[0], batch, 6)
    theirs.backward()
    assert ours.item() > 0 and torch.equal(ours, theirs)
    assert actor.log_std.grad is None and all(
        torch.equal(a, p.grad) for a, p in zip(our_grads, actor.net.parameters())
    )


def _one_update(weight: float | None) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One ppo_ddp update (1 epoch x 1 mini-batch) of pendulum-like rows -> (its statistics, the new
    parameters): without --symmetry (None), or with the pendulum's mirror loss at `weight`."""
    torch.manual_seed(0)
    actor, critic, optimizer, buf = small_ppo(4, 6)
    flags = (
        {}
        if weight is None
        else {"symmetry": "envs.mirrors:pendulum", "symmetry_mirror_loss": weight}
    )
    args = small_args(ppo.Args, epochs=1, mini_batches=1, **flags)
    mirror = symmetry.load_mirror(
        args.mirror, None, {"policy": buf.obs["policy"][0]}, actor, critic, 1
    )
    stats = ppo_update(
        actor,
        critic,
        optimizer,
        buf,
        torch.randn(4, 6),
        torch.randn(4, 6),
        args,
        cpu_dist(),
        mirror=mirror,
    )
    return stats, [p.detach().clone() for p in [*actor.parameters(), *critic.parameters()]]


def test_mirror_loss_at_weight_0_is_logged_and_trains_nothing_and_at_05_trains_the_actor():
    """rsl_rl logs the mirror loss even when it does not train it: at weight 0 the update is PPO's
    alone, to the bit; at 0.5 the actor learns from it too."""
    plain, plain_params = _one_update(None)
    logged, logged_params = _one_update(0.0)
    trained, trained_params = _one_update(0.5)
    assert "symmetry_loss" not in plain and logged["symmetry_loss"] > 0
    # the loss before the step is the same
    assert logged["symmetry_loss"] == trained["symmetry_loss"]
    assert all(torch.equal(a, b) for a, b in zip(plain_params, logged_params))
    assert any(not torch.equal(a, b) for a, b in zip(plain_params, trained_params))


def test_ppo_loss_on_an_augmented_batch_takes_kl_and_entropy_of_the_originals():
    """As rsl_rl 5.5.1: surrogate and value loss over every row, KL and entropy over the rollout's
    rows."""
    _, obs, mb = reacher_batch()
    torch.manual_seed(0)
    actor, critic = networks(obs, 2)
    augmented = symmetry.augment_batch(load(mirrors.reacher, obs), mb)
    _, stats = ppo.ppo_loss(actor, critic, augmented, ppo.Args())
    _, plain_stats = ppo.ppo_loss(actor, critic, mb, ppo.Args())
    # The same batch with the old means and stds repeated too: the surrogate and value loss do not
    # read them.
    repeated = {**augmented, "means": mb["means"].repeat(2, 1), "stds": mb["stds"].repeat(2, 1)}
    _, every_row = ppo.ppo_loss(actor, critic, repeated, ppo.Args())
    assert torch.equal(stats["kl"], plain_stats["kl"]) and torch.equal(
        stats["entropy"], plain_stats["entropy"]
    )
    losses = ("surrogate_loss", "value_loss")
    assert all(torch.equal(stats[name], every_row[name]) for name in losses)
    assert not all(torch.equal(stats[name], plain_stats[name]) for name in losses)


def mirrored_state(env, task: str) -> None:
    """Put `env` in the mirror image of its own state (its twin, built with the same seed, keeps the
    original)."""
    if task == "reacher":
        env.q, env.qd, env.target = -env.q, -env.qd, env.target * torch.tensor([1.0, -1.0])
        return
    env.theta, env.theta_dot = -env.theta, -env.theta_dot
    if task == "pendulum_partial":
        env.frames, env.last_torque = env.frames * torch.tensor([1.0, -1.0]), -env.last_torque


@pytest.mark.parametrize("task", ["pendulum", "pendulum_sparse", "pendulum_partial", "reacher"])
def test_built_in_mirror_is_a_symmetry_of_its_task(task):
    """From mirrored states, mirrored actions lead to the mirror images of the observations, with
    the same rewards: what the mirror function of the task claims. (Observation noise off.)"""
    function = getattr(mirrors, "pendulum" if task == "pendulum_sparse" else task)
    env, twin = envs.make_env(task, 64, "cpu", 3), envs.make_env(task, 64, "cpu", 3)
    env.noise = twin.noise = 0.0
    mirrored_state(twin, task)
    obs, rows = env.get_observations(), 64
    for _ in range(3):
        expected = {group: tensor[rows:] for group, tensor in function(env, obs, None)[0].items()}
        for group, tensor in twin.get_observations().items():
            torch.testing.assert_close(tensor, expected[group], rtol=0, atol=2e-6)
        actions = torch.randn(rows, env.num_actions)
        obs, rewards, _, _ = env.step(actions)
        _, twin_rewards, _, _ = twin.step(function(env, None, actions)[1][rows:])
        torch.testing.assert_close(twin_rewards, rewards, rtol=0, atol=2e-5)


def test_bad_mirror_input_is_a_one_line_value_error():
    _, obs, _ = reacher_batch()
    actor, critic = networks(obs, 2)

    def expect(message, **flags):
        with pytest.raises(ValueError, match=message) as error:
            symmetry.load_mirror(small_args(ppo.Args, **flags).mirror, None, obs, actor, critic, 2)
        assert "\n" not in str(error.value)

    expect(
        "cannot load mirror function .* 'nosuchmodule:f': No module named",
        symmetry="nosuchmodule:f",
    )
    expect(
        "cannot load mirror function .* 'envs.mirrors': expected 'module:function'",
        symmetry="envs.mirrors",
    )
    expect(
        "cannot be called as f\\(env=, obs=, actions=\\)",
        symmetry="envs.mirrors:with_mirror_images",
    )
    expect(
        "mirrors the groups \\['policy'\\], not \\['critic'\\]", symmetry="envs.mirrors:pendulum"
    )
    expect("need --symmetry module:function", symmetry_augment=True)
    expect("need --symmetry module:function", symmetry_mirror_loss=1.0)
    expect(
        "given observations and actions of 6 rows it returned shapes",
        symmetry="test_symmetry:originals_only",
    )
    expect(
        "given actions of 6 rows it returned shapes \\{'actions': None\\}",
        symmetry="test_symmetry:no_actions_alone",
    )
    assert symmetry.load_mirror(ppo.Args().mirror, None, obs, actor, critic, 2) is None
    # The pendulum's mirror on the README's PointMass (policy: position, velocity): it reads a
    # column that is not there.
    with pytest.raises(ValueError) as error:
        point_mass = {"policy": torch.zeros(6, 2)}
        args = small_args(ppo.Args, symmetry="envs.mirrors:pendulum").mirror
        symmetry.load_mirror(args, None, point_mass, *networks(point_mass, 1, POLICY_ONLY), 1)
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        "--symmetry envs.mirrors:pendulum failed on this env's"
    )
    assert "groups policy (2), and 1 action(s)" in message and "IndexError" in message


def originals_only(env, obs=None, actions=None):
    """No mirrored copies: k = 1."""
    return obs, actions


def no_actions_alone(env, obs=None, actions=None):
    """Mirrors actions only when it also gets observations."""
    return mirrors.reacher(env, obs, actions if obs is not None else None)


def test_mirror_gets_the_groups_in_the_envs_tensordict():
    """Isaac Lab's mirror functions use TensorDict methods: an env that returns a TensorDict hands
    one over."""
    tensordict = pytest.importorskip("tensordict", reason="rsl_rl's observation container")
    _, obs, mb = reacher_batch()
    seen = []

    def recording(env, obs=None, actions=None):
        seen.append(type(obs))
        return mirrors.reacher(env, None if obs is None else dict(obs.items()), actions)

    mirror = load(mirrors.reacher, obs)
    mirror.function, mirror.container = recording, tensordict.TensorDict
    symmetry.augment_batch(mirror, mb)
    assert seen == [tensordict.TensorDict]


# --- the sync: 2 real ranks -----------------------------------------------------------------------


SYMMETRY = {
    "symmetry": "envs.mirrors:pendulum",
    "symmetry_augment": True,
    "symmetry_mirror_loss": 0.5,
}


def pendulum_batch(rows: int, rank: int) -> dict:
    """A rank's share of a union batch of pendulum-like rows (both networks read `policy`)."""
    g = torch.Generator().manual_seed(7)
    theta = torch.rand(2 * rows, generator=g) * 6 - 3
    policy = torch.stack([theta.cos(), theta.sin(), torch.randn(2 * rows, generator=g)], -1)
    union = {"obs": {"policy": policy}, "actions": torch.randn(2 * rows, 1, generator=g)}
    for name in ("log_probs", "values", "advantages", "returns"):
        union[name] = torch.randn(2 * rows, generator=g)
    union["means"], union["stds"] = torch.randn(2 * rows, 1, generator=g), torch.ones(2 * rows, 1)
    if rank is None:
        return union
    mine = slice(rank * rows, (rank + 1) * rows)
    return {
        name: {"policy": policy[mine]} if name == "obs" else rows_[mine]
        for name, rows_ in union.items()
    }


def symmetric_step(batch: dict, ctx: common.Dist) -> list[torch.Tensor]:
    """One ppo_ddp mini-batch step of the whole batch (an update of 1 epoch x 1 mini-batch) with
    augmentation and mirror loss, plain SGD and no clipping: the new parameters are the old minus lr
    x the (averaged) gradient."""
    torch.manual_seed(0)
    actor, critic = networks(batch["obs"], 1, POLICY_ONLY)
    args = small_args(
        ppo.Args, schedule="fixed", max_grad_norm=1e9, epochs=1, mini_batches=1, **SYMMETRY
    )
    batch["advantages"] = ppo.normalize_advantages(
        batch["advantages"], batch["returns"], ctx.world_size
    )[0]
    mirror = symmetry.load_mirror(args.mirror, None, batch["obs"], actor, critic, 1)
    optimizer = torch.optim.SGD([*actor.parameters(), *critic.parameters()], lr=0.1)
    ppo.make_update(actor, critic, optimizer, batch, args, ctx, mirror=mirror)()
    return [p.detach().clone() for p in [*actor.parameters(), *critic.parameters()]]


def _sync_worker():
    with process_group("cpu", seed=0) as ctx:
        step_params = symmetric_step(pendulum_batch(8, ctx.rank), ctx)
        # A whole update, 2 epochs x 3 mini-batches, with augmentation and mirror loss on.
        torch.manual_seed(0)  # the same networks on both ranks; the data differs by rank
        args = small_args(ppo.Args, epochs=2, mini_batches=3, **SYMMETRY)
        actor, critic, optimizer, _ = small_ppo(4, 6)
        torch.manual_seed(1 + ctx.rank)
        buf = small_ppo(4, 6)[3]  # both networks read the one `policy` group
        mirror = symmetry.load_mirror(
            args.mirror, None, {"policy": buf.obs["policy"][0]}, actor, critic, 1
        )
        advantages, returns = torch.randn(4, 6), torch.randn(4, 6)
        with counting_collectives() as calls:
            losses = ppo_update(
                actor, critic, optimizer, buf, advantages, returns, args, ctx, mirror=mirror
            )
        fingerprint = common.fingerprint({"actor": actor, "critic": critic, "optimizer": optimizer})
        return step_params, calls["n"], losses["symmetry_loss"], fingerprint


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_sync_worker, 2)


def test_mirror_loss_rides_in_the_one_all_reduce_per_minibatch(two_ranks):
    assert [r[1] for r in two_ranks] == [2 * 3] * 2  # 2 epochs x 3 mini-batches, symmetry included
    # the same loss and bits everywhere
    assert two_ranks[0][2] > 0 and two_ranks[0][2:] == two_ranks[1][2:]


def test_augmented_step_of_two_ranks_equals_one_process_on_the_union_batch(two_ranks):
    """Augmentation is local, every loss a mean over equal mini-batches: N ranks x E envs update as
    1 process x N*E envs."""
    ctx = cpu_dist()
    union = symmetric_step(pendulum_batch(8, None), ctx)
    assert all(torch.equal(a, b) for a, b in zip(two_ranks[0][0], two_ranks[1][0]))
    for got, want in zip(two_ranks[0][0], union):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # ranks differ
    assert not torch.equal(two_ranks[0][0][0], symmetric_step(pendulum_batch(8, 0), ctx)[0])


def _train_worker(root):
    chdir_rank_dir(root)
    small = {
        "num_envs": 16,
        "steps_per_env": 8,
        "iterations": 3,
        "run_dir": "run",
        "check_interval": 1,
    }
    return ppo.main(small_args(ppo.Args, **SYMMETRY, **small))


def test_training_with_symmetry_leaves_ranks_bitwise_identical(tmp_path):
    """Also checked every iteration inside the run (--check-interval 1); the loss is logged."""
    hashes = run_ranks(_train_worker, 2, str(tmp_path))
    assert hashes[0] == hashes[1]
    rows = [
        json.loads(line)
        for line in (tmp_path / "0" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 3 and all(math.isfinite(row["symmetry_loss"]) for row in rows)
    assert bookkeeping.dashboard_name("symmetry_loss", []) == "Loss/symmetry"  # rsl_rl 5.5.1's name
