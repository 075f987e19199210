"""ppo_ddp's update against rsl_rl 5.5.1's own `PPO.update` on identical batches (rsl-rl-lib, in
requirements-dev.txt): same weights, rollout, advantages and mini-batch order, with and without
gradient clipping (both clip actor and critic each on its own by default; `--grad-clip joint`
differs), in float32 and in bfloat16 (`--mixed-precision bf16`)."""

import pytest
import torch

import ppo_ddp
import ppo_rnn_ddp
import speedups
from dist_helpers import cpu_dist, rollout_batch, sequence_batch, small_args

rsl_rl = pytest.importorskip("rsl_rl", reason="rsl-rl-lib==5.5.1 is in requirements-dev.txt")
from rsl_rl.algorithms import PPO  # noqa: E402
from rsl_rl.models import MLPModel, RNNModel  # noqa: E402
from rsl_rl.storage import RolloutStorage  # noqa: E402
from tensordict import TensorDict  # noqa: E402

T, N, OBS, ACTIONS, HIDDEN = 8, 16, 3, 2, (8, 8)
CPU1 = cpu_dist()


def rsl_rl_ppo(
    actor: ppo_ddp.Actor,
    critic: ppo_ddp.Critic,
    buf: ppo_ddp.Rollout,
    std_type: str,
    max_grad_norm: float,
    mixed_precision: bool = False,
) -> PPO:
    """rsl_rl's PPO with our actor's and critic's weights and our rollout in its storage."""
    obs = TensorDict({"policy": buf.obs["policy"][0]}, batch_size=[N])
    groups = {"actor": ["policy"], "critic": ["policy"]}
    distribution = {"class_name": "GaussianDistribution", "init_std": 1.0, "std_type": std_type}
    their_actor = MLPModel(obs, groups, "actor", ACTIONS, HIDDEN, "elu", False, distribution)
    their_critic = MLPModel(obs, groups, "critic", 1, HIDDEN, "elu", False)
    with torch.no_grad():
        for mine, theirs in ((actor.net, their_actor.mlp), (critic.net, their_critic.mlp)):
            for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
                q.copy_(p)
        their_std = (
            their_actor.distribution.std_param
            if std_type == "scalar"
            else their_actor.distribution.log_std_param
        )
        their_std.copy_(actor.std if std_type == "scalar" else actor.log_std)
    storage = RolloutStorage("rl", N, T, obs, [ACTIONS])
    storage.observations["policy"].copy_(buf.obs["policy"])
    storage.actions.copy_(buf.actions)
    for name, ours in (
        ("values", buf.values),
        ("actions_log_prob", buf.log_probs),
        ("returns", buf.returns),
    ):
        getattr(storage, name).copy_(ours.unsqueeze(-1))
    storage.advantages = buf.advantages.unsqueeze(-1).clone()
    storage.distribution_params = (buf.means.clone(), buf.stds.clone())
    return PPO(
        their_actor,
        their_critic,
        storage,
        num_learning_epochs=3,
        num_mini_batches=4,
        max_grad_norm=max_grad_norm,
        use_mixed_precision=mixed_precision,
    )


def our_update_and_theirs(
    monkeypatch, std_type: str, max_grad_norm: float, grad_clip: str, mixed_precision: str = "none"
) -> tuple:
    """3 epochs x 4 mini-batches of ppo_ddp's update and of rsl_rl 5.5.1's, adaptive schedule, from
    the same weights on the same batches in the same order -> (our parameters, theirs, our lr,
    theirs, our norms)."""
    torch.manual_seed(0)
    actor = ppo_ddp.Actor({"policy": [OBS]}, ACTIONS, HIDDEN, 1.0, False, std_type)
    critic = ppo_ddp.Critic(
        {"policy": [OBS]}, HIDDEN, False
    )  # rsl_rl's critic reads the same group
    optimizer = speedups.adam(
        [*actor.parameters(), *critic.parameters()], 1e-3, speedups.SpeedArgs(), torch.device("cpu")
    )
    buf = ppo_ddp.make_rollout(T, N, {"policy": [OBS]}, ACTIONS, torch.device("cpu"))
    for tensor in (buf.obs["policy"], buf.actions, buf.values, buf.advantages, buf.returns):
        tensor.normal_()
    with torch.no_grad():  # what the rollout stored: the policy's own mean, std and log-probability
        buf.means.copy_(actor(buf.obs)[0] + 0.01 * torch.randn_like(buf.means))
        buf.stds.copy_(actor(buf.obs)[1])
        buf.log_probs.copy_(ppo_ddp.gaussian_log_prob(buf.actions, buf.means, buf.stds))
    theirs = rsl_rl_ppo(actor, critic, buf, std_type, max_grad_norm, mixed_precision == "bf16")
    # Both draw one permutation per update and reuse it every epoch (`--shuffle once`): the same one
    # here.
    order = torch.randperm(T * N)
    monkeypatch.setattr(torch, "randperm", lambda *args, **kwargs: order.clone())
    args = small_args(
        ppo_ddp.Args,
        epochs=3,
        mini_batches=4,
        max_grad_norm=max_grad_norm,
        grad_clip=grad_clip,
        std_type=std_type,
        mixed_precision=mixed_precision,
    )
    losses = ppo_ddp.make_update(actor, critic, optimizer, rollout_batch(buf), args, CPU1)()
    theirs.update()
    ours = [
        *actor.net.parameters(),
        actor.std if std_type == "scalar" else actor.log_std,
        *critic.net.parameters(),
    ]
    dist = theirs.actor.distribution
    their_std = dist.std_param if std_type == "scalar" else dist.log_std_param
    their_params = [*theirs.actor.mlp.parameters(), their_std, *theirs.critic.mlp.parameters()]
    norms = {k: v for k, v in losses.items() if k.endswith("grad_norm")}
    return ours, their_params, float(optimizer.param_groups[0]["lr"]), theirs.learning_rate, norms


@pytest.mark.parametrize("max_grad_norm", [float("inf"), 0.1])
@pytest.mark.parametrize("std_type", ["log", "scalar"])
def test_update_equals_rsl_rls_on_identical_batches(monkeypatch, std_type, max_grad_norm):
    """Parameters and learning rate bitwise equal after 3 epochs x 4 mini-batches with the adaptive
    schedule, for both parameterizations of the std (rsl_rl 5.5.1's `std_type`), unclipped and
    clipped at a norm the gradients exceed (each network clipped on its own, as rsl_rl 5.5.1 does).
    """
    ours, theirs, lr, their_lr, norms = our_update_and_theirs(
        monkeypatch, std_type, max_grad_norm, "per-network"
    )
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    assert lr == their_lr != 1e-3  # the rule moved it
    assert set(norms) == {"actor_grad_norm", "critic_grad_norm"}
    # the mean norm before clipping: clipping was on in every step seen
    assert min(norms.values()) > 0.1


@pytest.mark.parametrize("max_grad_norm", [float("inf"), 0.1])
def test_bf16_update_equals_rsl_rls_with_use_mixed_precision(monkeypatch, max_grad_norm):
    """`--mixed-precision bf16` against rsl_rl 5.5.1's `use_mixed_precision=True`: the same autocast
    region (forward passes, KL, losses) gives the same parameters to the last bit on CPU, and
    bfloat16 did act: they differ from the float32 update's by more than float32 rounding."""
    ours, theirs, lr, their_lr, _ = our_update_and_theirs(
        monkeypatch, "log", max_grad_norm, "per-network", "bf16"
    )
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    assert lr == their_lr
    in_float32, *_ = our_update_and_theirs(monkeypatch, "log", max_grad_norm, "per-network")
    assert max((p - q).abs().max().item() for p, q in zip(ours, in_float32)) > 1e-4


def test_joint_clipping_is_not_rsl_rls():
    """`--grad-clip joint` (CleanRL's, and the design document's one ActorCritic) clips one norm
    over both networks: where the gradients exceed it, the result differs from rsl_rl 5.5.1's."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        ours, theirs, _, _, norms = our_update_and_theirs(monkeypatch, "scalar", 0.1, "joint")
    assert set(norms) == {"grad_norm"}
    assert max((p - q).abs().max().item() for p, q in zip(ours, theirs)) > 1e-4


# --- recurrent PPO (ppo_rnn_ddp.py) against rsl_rl 5.5.1's RNNModel and recurrent mini-batch genera

RNN_HIDDEN, RNN_LAYERS = 6, 2


def recurrent_rollout(kind: str) -> tuple:
    """Our recurrent actor and critic, and a rollout of random data in which episodes end
    mid-rollout and every env carries a non-zero memory in from "the previous rollout"; its means,
    stds and log-probs are those of the actor's own unroll (slightly moved, so the KL is not 0)."""
    torch.manual_seed(0)
    rnn = (False, kind, RNN_HIDDEN, RNN_LAYERS)
    head = {"num_actions": ACTIONS, "hidden": HIDDEN, "init_std": 1.0, "std_type": "scalar"}
    actor = ppo_rnn_ddp.Recurrent({"policy": [OBS]}, *rnn, head)
    critic = ppo_rnn_ddp.Recurrent(
        {"policy": [OBS]}, *rnn, {"hidden": HIDDEN}
    )  # the same group, as rsl_rl's
    buf = ppo_ddp.make_rollout(T, N, {"policy": [OBS]}, ACTIONS, torch.device("cpu"))
    for tensor in (buf.obs["policy"], buf.actions, buf.values, buf.advantages, buf.returns):
        tensor.normal_()
    buf.dones.bernoulli_(
        0.15
    )  # about 1 done in 7 steps: most envs' rollouts hold 2 or more episodes
    start = tuple(torch.randn(N, net.rnn.size) for net in (actor, critic))
    with torch.no_grad():
        (mean, std), _ = actor(
            {"policy": buf.obs["policy"].transpose(0, 1)}, start[0], buf.dones.transpose(0, 1)
        )
        buf.means.copy_(mean.transpose(0, 1) + 0.01 * torch.randn_like(buf.means))
        buf.stds.copy_(std.transpose(0, 1))
        buf.log_probs.copy_(ppo_ddp.gaussian_log_prob(buf.actions, buf.means, buf.stds))
    return actor, critic, buf, start


def memories_by_step(
    net: ppo_rnn_ddp.Recurrent, obs: torch.Tensor, start: torch.Tensor, dones: torch.Tensor
) -> list:
    """What rsl_rl's storage saves at every step: the memory each step starts from (reset after a
    done), as its hidden-state tensors (T, layers, N, hidden) (a GRU's h; an LSTM's h and c)."""
    memories, memory = [], start
    with torch.no_grad():
        for t in range(T):
            memories.append(memory)
            memory = net.rnn(obs[t][:, None], memory, dones[t][:, None])[1]
    flat = torch.stack(memories)  # (T, N, parts * layers * hidden)
    # (parts, T, layers, N, hidden)
    parts = flat.view(T, N, -1, RNN_LAYERS, RNN_HIDDEN).permute(2, 0, 3, 1, 4)
    return [part.contiguous() for part in parts]


def rsl_rl_recurrent_ppo(
    kind: str, actor, critic, buf: ppo_ddp.Rollout, start: tuple, max_grad_norm: float
) -> PPO:
    """rsl_rl's PPO with RNNModels holding our weights, and our rollout, dones and per-step memories
    in its storage."""
    obs = TensorDict({"policy": buf.obs["policy"][0]}, batch_size=[N])
    groups = {"actor": ["policy"], "critic": ["policy"]}
    distribution = {"class_name": "GaussianDistribution", "init_std": 1.0, "std_type": "scalar"}
    rnn = {"rnn_type": kind, "rnn_hidden_dim": RNN_HIDDEN, "rnn_num_layers": RNN_LAYERS}
    their_actor = RNNModel(obs, groups, "actor", ACTIONS, HIDDEN, "elu", False, distribution, **rnn)
    their_critic = RNNModel(obs, groups, "critic", 1, HIDDEN, "elu", False, **rnn)
    with torch.no_grad():
        for mine, theirs in ((actor, their_actor), (critic, their_critic)):
            for p, q in zip(
                [*mine.rnn.rnn.parameters(), *mine.head.net.parameters()],
                [*theirs.rnn.rnn.parameters(), *theirs.mlp.parameters()],
                strict=True,
            ):
                q.copy_(p)
        their_actor.distribution.std_param.copy_(actor.head.std)
    storage = RolloutStorage("rl", N, T, obs, [ACTIONS])
    storage.observations["policy"].copy_(buf.obs["policy"])
    storage.actions.copy_(buf.actions)
    storage.dones.copy_(buf.dones.unsqueeze(-1))
    for name, ours in (
        ("values", buf.values),
        ("actions_log_prob", buf.log_probs),
        ("returns", buf.returns),
    ):
        getattr(storage, name).copy_(ours.unsqueeze(-1))
    storage.advantages = buf.advantages.unsqueeze(-1).clone()
    storage.distribution_params = (buf.means.clone(), buf.stds.clone())
    storage.saved_hidden_state_a = memories_by_step(actor, buf.obs["policy"], start[0], buf.dones)
    storage.saved_hidden_state_c = memories_by_step(critic, buf.obs["policy"], start[1], buf.dones)
    return PPO(
        their_actor,
        their_critic,
        storage,
        num_learning_epochs=3,
        num_mini_batches=4,
        max_grad_norm=max_grad_norm,
    )


def recurrent_updates(
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    fault: str | None = None,
    max_grad_norm: float = float("inf"),
) -> tuple:
    """Ours and rsl_rl 5.5.1's update of the same recurrent rollout, 3 epochs x 4 mini-batches of 4
    envs, adaptive schedule, each network clipped on its own at `max_grad_norm` -> (largest
    parameter difference, our losses, theirs, our lr, theirs). `fault`, ours only: "no_reset" (the
    memory never blanked at dones), "zero_start" (every env unrolled from a blank memory, not the
    one it carried in)."""
    actor, critic, buf, start = recurrent_rollout(kind)
    # trajectories split mid-rollout in most envs
    assert (buf.dones[:-1].sum(0) > 0).sum() >= N // 2
    theirs = rsl_rl_recurrent_ppo(kind, actor, critic, buf, start, max_grad_norm)
    # rsl_rl's recurrent generator takes envs in order, the same mini-batches every epoch.
    monkeypatch.setattr(torch, "randperm", lambda n, **kwargs: torch.arange(n))
    args = small_args(
        ppo_rnn_ddp.Args, epochs=3, mini_batches=4, max_grad_norm=max_grad_norm, std_type="scalar"
    )
    optimizer = speedups.adam(
        [*actor.parameters(), *critic.parameters()], 1e-3, speedups.SpeedArgs(), torch.device("cpu")
    )
    batch = sequence_batch(buf, start)
    if fault == "no_reset":
        batch["dones"] = torch.zeros_like(batch["dones"])
    if fault == "zero_start":
        batch["actor_memory"], batch["critic_memory"] = (torch.zeros_like(m) for m in start)
    ours = ppo_rnn_ddp.make_update(actor, critic, optimizer, batch, args, CPU1)()
    their_losses = theirs.update()
    mine = [
        *actor.rnn.parameters(),
        *actor.head.net.parameters(),
        actor.head.std,
        *critic.parameters(),
    ]
    their_params = [
        *theirs.actor.rnn.parameters(),
        *theirs.actor.mlp.parameters(),
        theirs.actor.distribution.std_param,
        *theirs.critic.rnn.parameters(),
        *theirs.critic.mlp.parameters(),
    ]
    moved = max((p - q).abs().max().item() for p, q in zip(mine, their_params, strict=True))
    return moved, ours, their_losses, float(optimizer.param_groups[0]["lr"]), theirs.learning_rate


@pytest.mark.parametrize("max_grad_norm", [float("inf"), 0.1])
@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_recurrent_update_equals_rsl_rls_on_identical_batches(monkeypatch, kind, max_grad_norm):
    """rsl_rl 5.5.1 cuts every env's steps at the dones into padded trajectories, each started from
    the memory saved at its first step, and runs the RNN once over the padded batch; ours unrolls
    each env's whole rollout a step at a time from its first memory, blanked at the dones. Every
    parameter equal to float32 rounding (the sums run in another order: docs/rsl_rl.md, 15), the
    learning rate exactly."""
    moved, ours, theirs, lr, their_lr = recurrent_updates(
        monkeypatch, kind, max_grad_norm=max_grad_norm
    )
    assert moved < 1e-6
    assert min(ours["actor_grad_norm"], ours["critic_grad_norm"]) > 0.1  # clipping, where on, acted
    assert lr == their_lr != 1e-3  # the rule moved it
    for name in ("surrogate", "value", "entropy"):
        assert ours[f"{name}_loss" if name != "entropy" else name] == pytest.approx(
            theirs[name], rel=1e-5
        )


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_recurrent_update_is_rsl_rls_mathematics_to_float64_rounding(monkeypatch, float64, kind):
    """The same two updates in float64: the order of the sums costs ~1e-16 per operation, so the
    parameters agree to 1e-12 (1e-16 to 1e-15 measured). A real difference would not (checked on the
    GRU): our memory not blanked at the dones, or not carried in from the last rollout, moves them
    0.05 to 0.16 apart."""
    moved, *_ = recurrent_updates(monkeypatch, kind)
    assert moved < 1e-12
    # the scale of a real difference, once
    for fault in ("no_reset", "zero_start") if kind == "gru" else ():
        assert recurrent_updates(monkeypatch, kind, fault)[0] > 1e-3, fault
