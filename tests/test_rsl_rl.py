"""ppo_ddp's update against rsl_rl 5.5.1's own `PPO.update` on identical batches (rsl-rl-lib, in
requirements-dev.txt): same weights, rollout, advantages and mini-batch order, gradient clipping off
(rsl_rl clips actor and critic one by one, ppo_ddp both together: docs/rsl_rl.md)."""

import pytest
import torch

import common
import ppo_ddp

rsl_rl = pytest.importorskip("rsl_rl", reason="rsl-rl-lib==5.5.1 is in requirements-dev.txt")
from rsl_rl.algorithms import PPO  # noqa: E402
from rsl_rl.models import MLPModel  # noqa: E402
from rsl_rl.storage import RolloutStorage  # noqa: E402
from tensordict import TensorDict  # noqa: E402

T, N, OBS, ACTIONS, HIDDEN = 8, 16, 3, 2, (8, 8)


def rsl_rl_ppo(actor: ppo_ddp.Actor, critic: ppo_ddp.Critic, buf: ppo_ddp.Rollout, std_type: str) -> PPO:
    """rsl_rl's PPO with our actor's and critic's weights and our rollout in its storage."""
    obs = TensorDict({"policy": buf.obs["actor"][0]}, batch_size=[N])
    groups = {"actor": ["policy"], "critic": ["policy"]}
    distribution = {"class_name": "GaussianDistribution", "init_std": 1.0, "std_type": std_type}
    their_actor = MLPModel(obs, groups, "actor", ACTIONS, HIDDEN, "elu", False, distribution)
    their_critic = MLPModel(obs, groups, "critic", 1, HIDDEN, "elu", False)
    with torch.no_grad():
        for mine, theirs in ((actor.net, their_actor.mlp), (critic.net, their_critic.mlp)):
            for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
                q.copy_(p)
        their_std = (
            their_actor.distribution.std_param if std_type == "scalar" else their_actor.distribution.log_std_param
        )
        their_std.copy_(actor.std if std_type == "scalar" else actor.log_std)
    storage = RolloutStorage("rl", N, T, obs, [ACTIONS])
    storage.observations["policy"].copy_(buf.obs["actor"])
    storage.actions.copy_(buf.actions)
    for name, ours in (("values", buf.values), ("actions_log_prob", buf.log_probs), ("returns", buf.returns)):
        getattr(storage, name).copy_(ours.unsqueeze(-1))
    storage.advantages = buf.advantages.unsqueeze(-1).clone()
    storage.distribution_params = (buf.means.clone(), buf.stds.clone())
    return PPO(
        their_actor, their_critic, storage, num_learning_epochs=3, num_mini_batches=4, max_grad_norm=float("inf")
    )


@pytest.mark.parametrize("std_type", ["log", "scalar"])
def test_update_equals_rsl_rls_on_identical_batches(monkeypatch, std_type):
    """Parameters and learning rate bitwise equal after 3 epochs x 4 mini-batches with the adaptive
    schedule, for both parameterizations of the std (rsl_rl 5.5.1's `std_type`)."""
    torch.manual_seed(0)
    actor = ppo_ddp.Actor(OBS, ACTIONS, HIDDEN, 1.0, False, std_type)
    critic = ppo_ddp.Critic(OBS, HIDDEN, False)
    optimizer = common.make_adam([*actor.parameters(), *critic.parameters()], 1e-3, torch.device("cpu"))
    buf = ppo_ddp.make_rollout(T, N, {"actor": OBS, "critic": OBS}, ACTIONS, torch.device("cpu"))
    buf.obs["critic"] = buf.obs["actor"]  # rsl_rl's critic reads the same group
    for tensor in (buf.obs["actor"], buf.actions, buf.values, buf.advantages, buf.returns):
        tensor.normal_()
    with torch.no_grad():  # what the rollout stored: the policy's own mean, std and log-probability
        buf.means.copy_(actor(buf.obs["actor"])[0] + 0.01 * torch.randn_like(buf.means))
        buf.stds.copy_(actor(buf.obs["actor"])[1])
        buf.log_probs.copy_(ppo_ddp.gaussian_log_prob(buf.actions, buf.means, buf.stds))
    theirs = rsl_rl_ppo(actor, critic, buf, std_type)
    # rsl_rl draws one permutation per update and reuses it every epoch; ppo_ddp draws one per epoch.
    order = torch.randperm(T * N)
    monkeypatch.setattr(torch, "randperm", lambda *args, **kwargs: order.clone())
    args = ppo_ddp.Args(epochs=3, mini_batches=4, max_grad_norm=float("inf"), std_type=std_type)
    ppo_ddp.make_update(actor, critic, optimizer, buf, args, common.Dist(0, 0, 1, torch.device("cpu")))()
    theirs.update()
    ours = [*actor.net.parameters(), actor.std if std_type == "scalar" else actor.log_std, *critic.net.parameters()]
    dist = theirs.actor.distribution
    their_std = dist.std_param if std_type == "scalar" else dist.log_std_param
    for p, q in zip(ours, [*theirs.actor.mlp.parameters(), their_std, *theirs.critic.mlp.parameters()], strict=True):
        assert torch.equal(p, q)
    assert float(optimizer.param_groups[0]["lr"]) == theirs.learning_rate != 1e-3  # the rule moved it
