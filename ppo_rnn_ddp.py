"""Data-parallel recurrent PPO (rsl_rl 5.5.1's RNNModel): a GRU or LSTM before the actor's and the critic's
MLP, as a variant of ppo_ddp.py, whose training loop, rollout, advantages, loss and update it runs.

Each network carries a memory from step to step, and from rollout to rollout, blanked where an episode
ends. The update trains on whole env sequences: a mini-batch is a set of envs, and each network is
unrolled over all the steps of its env's rollout from the memory it began the rollout with, blanked in
place at every done, so that every episode in the rollout starts from the state it started from when
the policy acted: zero, or the memory carried in. rsl_rl 5.5.1 cuts the rollout at the dones into
padded, masked trajectories instead, whose count depends on the dones; here every shape is fixed, so a
CUDA graph can replay the step (the same mathematics: docs/rsl_rl.md, 15). The sync is PPO's: weights
broadcast at start, ONE all_reduce per mini-batch, global advantage normalization, normalizers merged.
The memory is each rank's own (its envs'), neither broadcast nor checkpointed: a resumed run starts it
at zero, as rsl_rl does. RND, symmetry and image groups are ppo_ddp.py's alone (rsl_rl refuses symmetry
with a recurrent model too).

Launch:
    python ppo_rnn_ddp.py                                             # 1 process, the task that needs memory
    torchrun --standalone --nproc_per_node=2 ppo_rnn_ddp.py           # 2 processes on CPU (gloo)
    torchrun --standalone --nproc_per_node=2 ppo_rnn_ddp.py --rnn lstm --rnn-hidden 256
    torchrun --standalone --nproc_per_node=8 ppo_rnn_ddp.py --device cuda --cuda-graphs   # 8 GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 ppo_rnn_ddp.py --resume runs/ppo_rnn_pendulum_angle/<time> --iterations 500
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

import bookkeeping
import common
import envs
import extensions.reward_scaling
import inputs
import ppo_ddp as ppo
from common import Count


@dataclass
class Args(extensions.reward_scaling.ScalingArgs, ppo.PPOArgs):
    """Recurrent PPO: PPO's arguments (ppo_ddp.PPOArgs, rsl_rl's defaults) and reward scaling; sizes are per process."""

    task: str = "pendulum_angle"
    """Built-in task or your own environment as `module:function`; `pendulum_angle` shows only a noisy
    angle, so a policy must remember past frames to know the velocity."""
    rnn: Literal["gru", "lstm"] = "gru"
    """The recurrent layer before each network's MLP (rsl_rl's `rnn_type`)."""
    rnn_hidden: Count = 64
    """Width of each recurrent layer (rsl_rl's `rnn_hidden_dim`, 256 there; docs/recurrent.md)."""
    rnn_layers: Count = 1
    """Stacked recurrent layers (rsl_rl's `rnn_num_layers`)."""


# --- Networks: rsl_rl's RNNModel, inputs -> GRU or LSTM -> ppo_ddp's MLP ----------------------------


class RNN(nn.Module):
    """A GRU or LSTM whose memory is one row per env: (batch, size), the state of each layer side by side;
    an LSTM's h of each layer, then c of each layer."""

    __constants__ = ["lstm"]  # TorchScript compiles only the branch this RNN takes

    def __init__(self, input_dim: int, rnn_type: str, hidden: int, layers: int) -> None:
        super().__init__()
        self.rnn = (nn.LSTM if rnn_type == "lstm" else nn.GRU)(input_dim, hidden, layers)
        self.lstm = rnn_type == "lstm"
        self.size = (2 if self.lstm else 1) * layers * hidden

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, dones: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each env's inputs (batch, T, dim) from its memory (batch, size) before the first of them; with
        `dones` (batch, T), the memory is blanked after every step that ended an episode, as the rollout
        does -> (outputs (batch, T, hidden), the memory after the last step)."""
        batch = x.shape[0]
        # torch's RNNs keep their state as (layers, batch, hidden), an LSTM's as the pair (h, c).
        state = memory.view(batch, -1, self.rnn.num_layers, self.rnn.hidden_size).permute(1, 2, 0, 3)
        h, c = state[0].contiguous(), state[-1].contiguous()  # c: the LSTM's cell state
        outputs = []
        for t in range(x.shape[1]):  # one step at a time, as the policy acted
            if self.lstm:
                output, (h, c) = self.rnn(x[:, t][None], (h, c))
            else:
                output, h = self.rnn(x[:, t][None], h)
            outputs.append(output[0])
            if dones is not None:
                keep = 1.0 - dones[:, t, None]
                h, c = h * keep, c * keep
        state = torch.stack([h, c]) if self.lstm else h[None]
        return torch.stack(outputs, 1), state.permute(2, 0, 1, 3).reshape(batch, -1)


class Recurrent(nn.Module):
    """rsl_rl's RNNModel: its observation groups (inputs.py, flat ones) -> GRU or LSTM -> `head`, ppo_ddp's Actor
    (`head_config` its arguments but the groups) or, without `num_actions` in them, its Critic, on the output."""

    def __init__(
        self, obs_shapes: dict[str, list[int]], normalize: bool, rnn_type: str, rnn_hidden: int, rnn_layers: int,
        head_config: dict[str, Any],
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = common.constructor_config(locals())
        # The head's weights are drawn before the recurrent layer's, and its parameters come after them.
        head_inputs = {"obs_shapes": {"memory": [rnn_hidden]}, "normalize": False}
        head = (ppo.Actor if "num_actions" in head_config else ppo.Critic)(**head_inputs, **head_config)
        self.inputs = inputs.Inputs(obs_shapes, normalize)
        self.rnn = RNN(self.inputs.width, rnn_type, rnn_hidden, rnn_layers)
        self.head, self.memory_size = head, self.rnn.size

    def forward(
        self, obs: Mapping[str, torch.Tensor], memory: torch.Tensor, dones: torch.Tensor | None = None
    ) -> tuple[Any, torch.Tensor]:
        """`RNN.forward` on the groups (batch, T, dim) -> (the head's outputs (batch, T, ...), memory)."""
        outputs, memory = self.rnn(self.inputs(obs), memory, dones)
        return self.head({"memory": outputs}), memory


def make_networks(obs: Mapping[str, torch.Tensor], num_actions: int, args: Args) -> tuple[Recurrent, Recurrent]:
    """ppo_ddp.make_networks with a GRU or LSTM before each MLP -> (actor, critic). Local."""
    actor_groups = envs.resolve_groups(obs, args.actor_obs, flag="--actor-obs")
    critic_groups = envs.resolve_groups(obs, args.critic_obs, args.actor_obs, "--actor-obs and --critic-obs")
    rnn = (args.normalize_obs, args.rnn, args.rnn_hidden, args.rnn_layers)
    actor_head = {"num_actions": num_actions, "hidden": args.actor_hidden, "init_std": args.init_noise_std,
                  "std_type": args.std_type, "activation": args.activation}  # fmt: skip
    critic_head = {"hidden": args.critic_hidden, "activation": args.activation}
    actor = Recurrent(envs.group_shapes(obs, actor_groups), *rnn, actor_head)
    return actor, Recurrent(envs.group_shapes(obs, critic_groups), *rnn, critic_head)


def one_step(obs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One step's observation groups (N, dim) as sequences of one step (N, 1, dim)."""
    return {group: x[:, None] for group, x in obs.items()}


def act(
    actor: Recurrent, critic: Recurrent, obs: Mapping[str, torch.Tensor], actor_memory: torch.Tensor,
    critic_memory: torch.Tensor,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """ppo_ddp.act with memory: one step of each network -> (actions, their log-probability, mean, std,
    value, the actor's next memory, the critic's). Local; no host sync, so a CUDA graph can replay it."""
    (mean, std), actor_memory = actor(one_step(obs), actor_memory)
    values, critic_memory = critic(one_step(obs), critic_memory)
    mean, std = mean[:, 0], std[:, 0]
    actions = mean + std * torch.randn_like(mean)
    return actions, ppo.gaussian_log_prob(actions, mean, std), mean, std, values[:, 0], actor_memory, critic_memory


def last_values(critic: Recurrent, obs: Mapping[str, torch.Tensor], memory: Sequence[torch.Tensor]) -> torch.Tensor:
    """V of the observations the rollout ended on, from the critic's memory as the rollout left it (not moved on)."""
    return critic(one_step(obs), memory[1])[0][:, 0]


# --- Update: mini-batches of whole env sequences --------------------------------------------------


def sequence_batch(buf: ppo.Rollout, began: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """The update's rows: one per env, its whole rollout (N, T, ...), views of the storage; with the dones
    and the memory each network began the rollout with (`began`: actor's, critic's; (N, size) each)."""
    batch: dict[str, Any] = {name: getattr(buf, name).transpose(0, 1) for name in (*ppo.ROLLOUT_FIELDS, "dones")}
    obs = {group: stored.transpose(0, 1) for group, stored in buf.obs.items()}
    return {"obs": obs, **batch, "actor_memory": began[0], "critic_memory": began[1]}


def sequence_loss(
    actor: Recurrent, critic: Recurrent, mb: dict[str, Any], args: Args
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ppo_ddp.ppo_loss of a mini-batch of envs, each network unrolled over their whole rollouts from the
    memory they began it with, blanked at dones. Local."""
    policy = lambda obs: actor(obs, mb["actor_memory"], mb["dones"])[0]  # noqa: E731 - bound to the mini-batch
    value = lambda obs: critic(obs, mb["critic_memory"], mb["dones"])[0]  # noqa: E731
    return ppo.ppo_loss(policy, value, mb, args)


def check_args(args: Args) -> None:
    """A recurrent mini-batch is a set of whole envs: they must split evenly. Local."""
    if args.num_envs % args.mini_batches:
        raise ValueError(
            f"--num-envs {args.num_envs} is not divisible by --mini-batches {args.mini_batches}: a recurrent "
            "mini-batch is a set of whole envs; change one of them."
        )


# ppo_ddp.train with these pieces replaced (extensions.Variant).
RECURRENT = dataclasses.replace(
    ppo.PPO, script="ppo_rnn", title=lambda args: f"recurrent PPO ({args.rnn} {args.rnn_layers} x {args.rnn_hidden})",
    make_networks=make_networks, act=act, make_batch=sequence_batch, loss=sequence_loss, last_values=last_values,
    check_args=check_args,
)  # fmt: skip


def main(args: Args) -> str:
    """Join the process group, train (ppo_ddp.train with memory), leave the group (also on error)."""
    return ppo.main(args, RECURRENT)


if __name__ == "__main__":
    bookkeeping.cli(main, Args, envs.task_defaults)  # a task family may bring settings of its own (envs/)
