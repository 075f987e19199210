"""The variants copy ppo_ddp.py's pieces rather than import them (each script reads alone). These
tests keep the copies equal: the same inputs give the same bits as ppo_ddp.py's, the flat gradient
all_reduce is the same code in every script, and AMP's update moves actor and critic exactly as
PPO's does (its discriminator's loss beside PPO's changes nothing else)."""

import ast
import inspect
import textwrap
from collections.abc import Callable

import pytest
import torch

import common
import distill_ddp
import envs
import ppo_amp_ddp
import ppo_ddp
import ppo_rnn_ddp
from dist_helpers import process_group, rollout_batch, run_ranks, small_args, small_ppo

VARIANTS = [ppo_amp_ddp, ppo_rnn_ddp]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


@pytest.mark.parametrize("script", VARIANTS, ids=lambda m: m.__name__)
def test_gae_and_gaussian_log_prob_copies_give_ppo_ddp_bits(script):
    torch.manual_seed(0)
    rewards, values = torch.randn(16, 8), torch.randn(16, 8)
    dones, last = (torch.rand(16, 8) < 0.2).float(), torch.randn(8)
    for ours, theirs in zip(
        script.compute_gae(rewards, values, dones, last, 0.99, 0.95),
        ppo_ddp.compute_gae(rewards, values, dones, last, 0.99, 0.95),
    ):
        assert same_bits(ours, theirs)
    actions, mean, std = torch.randn(32, 3), torch.randn(32, 3), torch.rand(32, 3) + 0.1
    expected = ppo_ddp.gaussian_log_prob(actions, mean, std)
    assert same_bits(script.gaussian_log_prob(actions, mean, std), expected)


@pytest.mark.parametrize("script", VARIANTS, ids=lambda m: m.__name__)
def test_kl_rule_copies_give_ppo_ddp_bits_on_both_sides_of_each_threshold(script):
    desired = 0.01
    for kl in (0.0, 1e-4, desired / 2 - 1e-9, desired / 2, desired, 2 * desired, 0.05, 1.0):
        for lr in (1e-6, 1e-5, 1e-3, 9e-3, 1e-2):
            args = (torch.tensor(kl), torch.tensor(lr, dtype=torch.float64), desired)
            assert same_bits(script.adaptive_lr(*args), ppo_ddp.adaptive_lr(*args)), (kl, lr)


def _normalize_worker(module_name: str) -> list[torch.Tensor]:
    """Each rank's advantages differ; the copy and ppo_ddp's normalize them with all ranks'."""
    script = __import__(module_name)
    with process_group("cpu", seed=0) as ctx:
        torch.manual_seed(10 + ctx.rank)
        advantages, returns = torch.randn(8, 4) * (1 + ctx.rank), torch.randn(8, 4)
        ours = script.normalize_advantages(advantages, returns, ctx.world_size)
        theirs = ppo_ddp.normalize_advantages(advantages, returns, ctx.world_size)
        return [*ours, *theirs]


@pytest.mark.parametrize("script", VARIANTS, ids=lambda m: m.__name__)
def test_advantage_normalization_copies_give_ppo_ddp_bits_over_two_ranks(script):
    for rank in run_ranks(_normalize_worker, 2, script.__name__):
        assert same_bits(rank[0], rank[2]) and same_bits(rank[1], rank[3])


def _minibatch(steps: int = 4, num_envs: int = 8) -> tuple:
    """A small PPO actor and critic and one mini-batch of made-up rollout rows."""
    torch.manual_seed(0)
    actor, critic, _, buf = small_ppo(steps, num_envs)
    buf.advantages.normal_()
    buf.returns.normal_()
    return actor, critic, rollout_batch(buf)


# What every copy's loss returns: the statistic the KL rule reads and the loss's parts.
CORE_STATS = {"kl", "surrogate_loss", "value_loss", "entropy"}


def same_shared_stats(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> bool:
    """The statistics both losses return have the same bits, and they include CORE_STATS. One that
    a fork adds to one script's loss alone (docs/forking.md) is not compared."""
    shared = ours.keys() & theirs.keys()
    return CORE_STATS <= shared and all(same_bits(ours[k], theirs[k]) for k in shared)


def test_amp_ppo_loss_gives_ppo_ddp_bits_and_gradients():
    actor, critic, mb = _minibatch()
    results = []
    for script in (ppo_ddp, ppo_amp_ddp):
        actor.zero_grad(), critic.zero_grad()
        loss, stats = script.ppo_loss(actor, critic, mb, small_args(script.Args))
        loss.backward()
        grads = [p.grad.clone() for p in (*actor.parameters(), *critic.parameters())]
        results.append((loss, stats, grads))
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = results
    assert same_bits(loss_a, loss_b) and same_shared_stats(stats_a, stats_b)
    assert all(same_bits(a, b) for a, b in zip(grads_a, grads_b))


def test_recurrent_ppo_loss_gives_ppo_ddp_bits_with_memoryless_stand_ins():
    """ppo_rnn_ddp's loss unrolls its networks over sequences; stand-ins that ignore memory make it
    ppo_ddp's loss of the same rows."""
    actor, critic, mb = _minibatch()
    sequences = {**mb, "actor_memory": None, "critic_memory": None, "dones": None}
    rnn_actor = lambda obs, memory, dones: (actor(obs), memory)  # noqa: E731
    rnn_critic = lambda obs, memory, dones: (critic(obs), memory)  # noqa: E731
    ours, ours_stats = ppo_rnn_ddp.ppo_loss(
        rnn_actor, rnn_critic, sequences, small_args(ppo_rnn_ddp.Args)
    )
    theirs, theirs_stats = ppo_ddp.ppo_loss(actor, critic, mb, small_args(ppo_ddp.Args))
    assert same_bits(ours, theirs) and same_shared_stats(ours_stats, theirs_stats)


def _rollout(script, policy, *memory) -> object:
    """A 12-step rollout of 4 pendulums with `script`'s rollout, from one seed."""
    torch.manual_seed(3)
    env = envs.make_env("pendulum", 4, torch.device("cpu"), 3)
    obs = env.get_observations()
    buf = script.make_rollout(12, 4, {"policy": [3]}, 1, torch.device("cpu"))
    args = small_args(script.Args, steps_per_env=12, num_envs=4)
    episodes = envs.make_episodes(4, torch.device("cpu"), env.episode_length_buf)
    head = (env, policy, obs, *memory)
    next_obs, logs, problem = script.rollout(*head, buf, episodes, args)
    assert problem == ""
    return buf, next_obs["policy"], episodes


@pytest.mark.parametrize("script", VARIANTS, ids=lambda m: m.__name__)
def test_rollout_and_act_copies_fill_the_rollout_with_ppo_ddp_bits(script):
    torch.manual_seed(0)
    actor, critic, *_ = small_ppo(1, 1)
    ppo_act = lambda obs: ppo_ddp.act(actor, critic, obs)  # noqa: E731
    expected = _rollout(ppo_ddp, ppo_act)
    if script is ppo_rnn_ddp:  # memory the stand-in passes through untouched
        policy = lambda obs, memory: (*ppo_act(obs), memory)  # noqa: E731
        got = _rollout(script, policy, (torch.zeros(4, 2),))
    else:
        got = _rollout(script, lambda obs: script.act(actor, critic, obs))
    for field in ("actions", "log_probs", "means", "stds", "values", "rewards", "dones"):
        assert same_bits(getattr(got[0], field), getattr(expected[0], field)), field
    assert all(same_bits(got[0].obs[g], expected[0].obs[g]) for g in expected[0].obs)
    assert same_bits(got[1], expected[1])


def _code(function) -> list[str]:
    """The statements of a function's source, comments and docstrings dropped."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return ast.unparse(tree).splitlines()


def _body(function) -> list[str]:
    """A function's decorators and statements; its signature and docstring aside."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(function))).body
    docstring = node.body[0] if ast.get_docstring(node) is not None else None
    statements = [statement for statement in node.body if statement is not docstring]
    return [ast.unparse(part) for part in (*node.decorator_list, *statements)]


def _sync_block(script) -> list[str]:
    """The flat gradient all_reduce of `script`'s update, from flattening to the copy back."""
    lines = _code(script.make_update)
    start = next(i for i, line in enumerate(lines) if "grads = [p.grad" in line)
    end = next(i for i, line in enumerate(lines) if "offset += p.numel()" in line)
    return [line.strip() for line in lines[start : end + 1]]


@pytest.mark.parametrize("script", [*VARIANTS, distill_ddp], ids=lambda m: m.__name__)
def test_every_update_flattens_all_reduces_and_copies_back_as_ppo_ddp_does(script):
    ours, theirs = _sync_block(script), _sync_block(ppo_ddp)
    if script is distill_ddp:  # one network and one statistic: the student's gradients, its loss
        ours = [line.replace("params", "synced") for line in ours]
        theirs = [line for line in theirs if "statistics = " not in line]
        theirs = [line.replace("statistics", "summed.detach().reshape(1)") for line in theirs]
    assert ours == theirs
    assert sum("all_reduce_mean(flat, ctx.world_size)" in line for line in ours) == 1
    assert _body(script.all_reduce_mean) == _body(ppo_ddp.all_reduce_mean)  # its own copy


def _cli_block(script) -> list[str]:
    """The statements of a script's `if __name__ == "__main__":` block."""
    tree = ast.parse(inspect.getsource(script))
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
    ]
    return ast.unparse(block).splitlines()


@pytest.mark.parametrize("script", [*VARIANTS, distill_ddp], ids=lambda m: m.__name__)
def test_every_script_joins_the_group_and_exits_as_ppo_ddp_does(script):
    """`main` (the process group, the device rule, the seed, the barrier, the teardown) and the
    command-line block are copies: the same statements as ppo_ddp.py's (distillation's task
    settings aside: its defaults come from the teacher)."""
    assert _body(script.main) == _body(ppo_ddp.main)
    ours, theirs = _cli_block(script), _cli_block(ppo_ddp)
    if script is distill_ddp:
        theirs = [line.replace("(Args, envs.task_defaults)", "(Args)") for line in theirs]
    assert ours == theirs and sum("sys.exit(bookkeeping.exit_code(" in line for line in ours) == 1


def _amp_beside_ppo_worker() -> list[str]:
    """Two ranks, different data on each: one PPO update and one AMP update from the same actor,
    critic, optimizer state and rows -> the fingerprints of each one's actor, critic and
    optimizer, and of each one's statistics."""
    with process_group("cpu", seed=0) as ctx:
        args = small_args(ppo_amp_ddp.Args, epochs=2, mini_batches=3, steps_per_env=6)
        args_ppo = small_args(ppo_ddp.Args, epochs=2, mini_batches=3, steps_per_env=6)
        states = []
        for script in (ppo_ddp, ppo_amp_ddp):
            torch.manual_seed(0)  # the same networks on both ranks and in both updates
            actor, critic, optimizer, _ = small_ppo(6, 16)
            torch.manual_seed(1 + ctx.rank)  # the data differs by rank
            *_, buf = small_ppo(6, 16)
            buf.advantages.normal_()
            buf.returns.normal_()
            batch = rollout_batch(buf)
            if script is ppo_ddp:
                update = ppo_ddp.make_update(actor, critic, optimizer, batch, args_ppo, ctx)
            else:
                disc = ppo_amp_ddp.Discriminator(3, (8,))
                replay = ppo_amp_ddp.Replay(torch.zeros(50, 6))
                ppo_amp_ddp.replay_add(replay, torch.randn(30, 6))
                optimizers = (optimizer, torch.optim.Adam(disc.parameters()))
                reference = torch.randn(40, 6)
                parts = (actor, critic, disc, optimizers, batch, reference, replay, args, ctx)
                update = ppo_amp_ddp.make_update(*parts)
            torch.manual_seed(5)  # the same mini-batch order
            stats = update()
            ppo_stats = {k: stats[k] for k in ("kl", "surrogate_loss", "value_loss", "entropy")}
            trained = {"actor": actor, "critic": critic, "optimizer": optimizer}
            states.append((common.fingerprint(trained), repr(ppo_stats)))
        return states


def test_amp_update_moves_actor_and_critic_to_ppo_ddp_bits_on_two_ranks():
    for ppo, amp in run_ranks(_amp_beside_ppo_worker, 2):
        assert ppo == amp


def test_the_stand_ins_above_would_see_a_drifted_copy(monkeypatch):
    """Control: a copy that drifts by one operation fails the comparison the tests above make."""
    actor, critic, mb = _minibatch()
    args = small_args(ppo_amp_ddp.Args)
    loss, _ = ppo_amp_ddp.ppo_loss(actor, critic, mb, args)
    drifted = small_args(ppo_amp_ddp.Args, clip=0.2000001)
    other, _ = ppo_amp_ddp.ppo_loss(actor, critic, mb, drifted)
    assert not same_bits(loss, other)

    def shifted(kl: torch.Tensor, lr: torch.Tensor, desired: float, *rest: float) -> torch.Tensor:
        return ppo_ddp.adaptive_lr(kl, lr, desired * 1.01)

    monkeypatch.setattr(ppo_rnn_ddp, "adaptive_lr", shifted)
    kl, lr = torch.tensor(0.00502), torch.tensor(1e-3, dtype=torch.float64)
    assert not same_bits(ppo_rnn_ddp.adaptive_lr(kl, lr, 0.01), ppo_ddp.adaptive_lr(kl, lr, 0.01))


def _with_stats(ppo_loss: Callable, change: Callable[[dict], dict]) -> Callable:
    """`ppo_loss` whose statistics go through `change`."""

    def changed(*args: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = ppo_loss(*args)
        return loss, change(dict(stats))

    return changed


def test_the_loss_copy_tests_pass_a_statistic_one_script_adds_and_fail_a_drifted_one(monkeypatch):
    """docs/forking.md's second route adds a statistic to the loss of the script one forks: the
    other scripts' copy tests still pass, as they compare the statistics both losses return. A
    shared statistic whose value drifts by one ulp, or one a copy drops, still fails them."""
    loss_tests = {
        ppo_amp_ddp: test_amp_ppo_loss_gives_ppo_ddp_bits_and_gradients,
        ppo_rnn_ddp: test_recurrent_ppo_loss_gives_ppo_ddp_bits_with_memoryless_stand_ins,
    }
    added = lambda stats: {**stats, "mean_abs_action": torch.tensor(0.5)}  # noqa: E731
    for script in (ppo_ddp, *VARIANTS):
        with monkeypatch.context() as patch:
            patch.setattr(script, "ppo_loss", _with_stats(script.ppo_loss, added))
            for loss_test in loss_tests.values():
                loss_test()
    drifts = {
        "entropy one ulp up": lambda s: {**s, "entropy": s["entropy"].nextafter(s["entropy"] + 1)},
        "kl dropped": lambda s: {k: v for k, v in s.items() if k != "kl"},
    }
    for script, loss_test in loss_tests.items():
        for drift in drifts.values():
            with monkeypatch.context() as patch:
                patch.setattr(script, "ppo_loss", _with_stats(script.ppo_loss, drift))
                with pytest.raises(AssertionError):
                    loss_test()
