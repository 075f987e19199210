"""Data-parallel recurrent PPO (rsl_rl 5.5.1's RNNModel): a GRU or LSTM before the actor's and the critic's
MLP, as a delta on ppo_ddp.py, whose rollout, advantages, loss and update it reuses.

Each network carries a memory from step to step, and from rollout to rollout, blanked where an episode
ends. The update trains on whole env sequences: a mini-batch is a set of envs, and each network is
unrolled over all the steps of its env's rollout from the memory it began the rollout with, blanked in
place at every done, so that every episode in the rollout starts from the state it started from when
the policy acted: zero, or the memory carried in. rsl_rl 5.5.1 cuts the rollout at the dones into
padded, masked trajectories instead, whose count depends on the dones; here every shape is fixed, so a
CUDA graph can replay the step (the same mathematics: docs/rsl_rl.md, 15). The sync is PPO's: weights
broadcast at start, ONE all_reduce per mini-batch, global advantage normalization, normalizers merged.
The memory is each rank's own (its envs'), neither broadcast nor checkpointed: a resumed run starts it
at zero, as rsl_rl does.

Launch:
    python ppo_rnn_ddp.py                                             # 1 process, the task that needs memory
    torchrun --standalone --nproc_per_node=2 ppo_rnn_ddp.py           # 2 processes on CPU (gloo)
    torchrun --standalone --nproc_per_node=2 ppo_rnn_ddp.py --rnn lstm --rnn-hidden 256
    torchrun --standalone --nproc_per_node=8 ppo_rnn_ddp.py --device cuda --cuda-graphs   # 8 GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 ppo_rnn_ddp.py --resume runs/ppo_rnn_pendulum_angle/<time> --iterations 500
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

import bookkeeping
import checkpoints
import common
import cuda_graphs
import envs
import extensions.reward_scaling
import extensions.rnd
import extensions.symmetry
import ppo_ddp as ppo


@dataclass
class Args(ppo.Args):
    """Recurrent PPO on top of PPO (ppo_ddp.Args: rsl_rl's defaults); sizes are per process."""

    task: str = "pendulum_angle"
    """Built-in task or your own environment as `module:function`; `pendulum_angle` shows only a noisy
    angle, so a policy must remember past frames to know the velocity."""
    rnn: Literal["gru", "lstm"] = "gru"
    """The recurrent layer before each network's MLP (rsl_rl's `rnn_type`)."""
    rnn_hidden: int = 64
    """Size of the recurrent state of each layer (rsl_rl's `rnn_hidden_dim`, 256 there; docs/recurrent.md)."""
    rnn_layers: int = 1
    """Stacked recurrent layers (rsl_rl's `rnn_num_layers`)."""


# --- Networks: rsl_rl's RNNModel, normalizer -> GRU or LSTM -> ppo_ddp's MLP ----------------------


class RNN(nn.Module):
    """A GRU or LSTM whose memory is one row per env: (batch, size), the state of each layer side by side;
    an LSTM's h of each layer, then c of each layer."""

    __constants__ = ["lstm"]  # TorchScript compiles only the branch this RNN takes

    def __init__(self, input_dim: int, kind: str, hidden: int, layers: int) -> None:
        super().__init__()
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(input_dim, hidden, layers)
        self.lstm = kind == "lstm"
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
    """normalizer -> GRU or LSTM -> `head`: a ppo_ddp.Actor or Critic that reads the RNN's output."""

    def __init__(self, obs_dim: int, normalize: bool, kind: str, hidden: int, layers: int, head: nn.Module) -> None:
        super().__init__()
        self.normalizer = common.EmpiricalNormalizer(obs_dim) if normalize else nn.Identity()
        self.rnn = RNN(obs_dim, kind, hidden, layers)
        self.head = head

    def forward(
        self, obs: torch.Tensor, memory: torch.Tensor, dones: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
        """`RNN.forward` on the normalized inputs (batch, T, dim) -> (the head's outputs (batch, T, ...), memory)."""
        outputs, memory = self.rnn(self.normalizer(obs), memory, dones)
        return self.head(outputs), memory


def recurrent_actor(
    obs_dim: int, num_actions: int, hidden: tuple[int, ...], init_std: float, normalize: bool, std_type: str,
    rnn: str, rnn_hidden: int, rnn_layers: int, activation: str = "elu",
) -> Recurrent:  # fmt: skip
    """The recurrent Gaussian policy: its mean and std from ppo_ddp.Actor on the RNN's output."""
    head = ppo.Actor(rnn_hidden, num_actions, hidden, init_std, False, std_type, activation)
    return Recurrent(obs_dim, normalize, rnn, rnn_hidden, rnn_layers, head)


def make_networks(
    obs: dict[str, torch.Tensor], num_actions: int, args: Args, device: torch.device
) -> tuple[dict[str, tuple[str, ...]], Recurrent, Recurrent]:
    """ppo_ddp.make_networks with a GRU or LSTM before each MLP -> (groups, actor, critic). Local."""
    groups = {"actor": envs.resolve_groups(obs, args.actor_obs, flag="--actor-obs")}
    groups["critic"] = envs.resolve_groups(obs, args.critic_obs, args.actor_obs, "--actor-obs and --critic-obs")
    dims = {network: envs.concat(obs, g).shape[-1] for network, g in groups.items()}
    rnn = (args.rnn, args.rnn_hidden, args.rnn_layers)
    actor = recurrent_actor(
        dims["actor"], num_actions, args.actor_hidden, args.init_noise_std, args.normalize_obs, args.std_type, *rnn,
        args.activation,
    )  # fmt: skip
    head = ppo.Critic(args.rnn_hidden, args.critic_hidden, False, args.activation)
    critic = Recurrent(dims["critic"], args.normalize_obs, *rnn, head)
    return groups, actor.to(device), critic.to(device)


def act(
    actor: Recurrent, critic: Recurrent, actor_obs: torch.Tensor, critic_obs: torch.Tensor,
    actor_memory: torch.Tensor, critic_memory: torch.Tensor,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """ppo_ddp.act with memory: one step of each network -> (actions, their log-probability, mean, std,
    value, the actor's next memory, the critic's). Local; no host sync, so a CUDA graph can replay it."""
    (mean, std), actor_memory = actor(actor_obs[:, None], actor_memory)
    values, critic_memory = critic(critic_obs[:, None], critic_memory)
    mean, std = mean[:, 0], std[:, 0]
    actions = mean + std * torch.randn_like(mean)
    return actions, ppo.gaussian_log_prob(actions, mean, std), mean, std, values[:, 0], actor_memory, critic_memory


# --- Update: mini-batches of whole env sequences --------------------------------------------------


def sequence_batch(buf: ppo.Rollout, start: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The update's rows: one per env, its whole rollout (N, T, ...), views of the storage; with the dones
    and the memory each network began the rollout with (`start`: actor's, critic's; (N, size) each)."""
    batch = {f"{network}_obs": network_obs.transpose(0, 1) for network, network_obs in buf.obs.items()}
    for name in ("actions", "log_probs", "means", "stds", "values", "advantages", "returns", "dones"):
        batch[name] = getattr(buf, name).transpose(0, 1)
    return {**batch, "actor_memory": start[0], "critic_memory": start[1]}


def sequence_loss(
    actor: Recurrent, critic: Recurrent, mb: dict[str, torch.Tensor], args: Args
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ppo_ddp.ppo_loss of a mini-batch of envs, each network unrolled over their whole rollouts from the
    memory they began it with, blanked at dones. Local."""
    policy = lambda obs: actor(obs, mb["actor_memory"], mb["dones"])[0]  # noqa: E731 - bound to the mini-batch
    value = lambda obs: critic(obs, mb["critic_memory"], mb["dones"])[0]  # noqa: E731
    return ppo.ppo_loss(policy, value, mb, args)


# --- Process group, then the training loop: ppo_ddp.train with memory --------------------------------


def main(args: Args) -> str:
    """Join the process group, train, leave the group (also on error)."""
    with common.distributed(args.device, args.seed, args.dist_timeout_s, args.start_timeout_s) as ctx:
        return train(args, ctx)


def train(args: Args, ctx: common.Dist) -> str:
    """Train on this rank; returns the fingerprint of the final trained state (equal on all ranks)."""
    # SYNC: each rank checks its arguments, reads the checkpoint and builds env and networks alone,
    # then all compare notes (1 all_gather): if one failed, or ranks disagree on arguments, sizes or
    # checkpoint, every rank stops here instead of hanging or diverging later.
    with common.start_together(ctx, args, "observation sizes or checkpoint") as agree:
        counts = (*ppo.PPO_COUNTS, "rnn_hidden", "rnn_layers")
        bookkeeping.check_args(args, counts, ppo.PPO_POSITIVE, ppo.PPO_NON_NEGATIVE, ("gamma", "lam"))
        if args.num_envs % args.mini_batches:
            raise ValueError(
                f"--num-envs {args.num_envs} is not divisible by --mini-batches {args.mini_batches}: a recurrent "
                "mini-batch is a set of whole envs; change one of them."
            )
        resume, env, obs = bookkeeping.start_rank(args, ctx, "ppo_rnn", ("actor", "critic", "optimizer"))
        groups, actor, critic = make_networks(obs, env.num_actions, args, ctx.device)
        if extensions.rnd.make_rnd(obs, groups, args, ctx.device)[0] is not None:
            raise ValueError("--rnd-weight: RND is not wired into the recurrent script; train it with ppo_ddp.py.")
        extensions.symmetry.load_mirror(args, env, obs, groups, env.num_actions)  # refuses --symmetry (recurrent)
        graphs = cuda_graphs.use_cuda_graphs(args.cuda_graphs, ctx.device, ctx.is_main)  # on CUDA only; else a note
        optimizer = common.make_adam(
            [*actor.parameters(), *critic.parameters()], args.learning_rate, ctx.device, graphs
        )
        trained = checkpoints.Trained("ppo_rnn", {"actor": actor, "critic": critic}, {"optimizer": optimizer})
        scaler = extensions.reward_scaling.make_scaler(args, ctx.device, trained.modules)  # None: off
        checkpoints.restore(resume, trained, args)  # a fresh start: nothing to restore
        dims = {network: envs.concat(obs, g).shape[-1] for network, g in groups.items()}
        agree(dims, env.num_actions, resume.first_iteration, resume.fingerprint)
    # SYNC: start every rank from rank 0's weights (recurrent layers included) and normalizer statistics.
    common.broadcast_state([*trained.modules.values()], ctx.world_size)
    # --compile: compiled views of the same modules, which share their parameters and normalizers.
    policy, value = (torch.compile(net, backend=args.compile) if args.compile else net for net in (actor, critic))

    # SYNC: every rank stops if rank 0 cannot write the run directory (1 all_gather).
    title = f"recurrent PPO ({args.rnn} {args.rnn_layers} x {args.rnn_hidden}) on {args.task}"
    saved_with = {"obs_dims": {**dims, "actions": env.num_actions}}
    run_log = bookkeeping.start_run(ctx, args, trained, title, resume, saved_with)
    buf = ppo.make_rollout(args.steps_per_env, args.num_envs, dims, env.num_actions, ctx.device)
    episodes = envs.make_episodes(args.num_envs, ctx.device, env.episode_length_buf)
    # Each network's memory of this rank's envs, carried from step to step and from rollout to rollout,
    # and `start`, where the rollout began: the update unrolls each env's sequence from it.
    memory = tuple(torch.zeros(args.num_envs, net.rnn.size, device=ctx.device) for net in (actor, critic))
    start = tuple(torch.zeros_like(state) for state in memory)
    # The two steps an iteration repeats, built once: with --cuda-graphs each is captured and replayed.
    policy_step = cuda_graphs.cuda_graph(functools.partial(act, policy, value), graphs)
    batch = sequence_batch(buf, start)
    update = ppo.make_update(policy, value, optimizer, batch, args, ctx, graphs=graphs, loss_fn=sequence_loss)
    for it in range(resume.first_iteration, args.iterations + 1):
        t0 = time.time()
        # COLLECT, from the memory the last rollout left
        for began, state in zip(start, memory):
            began.copy_(state)
        obs, env_logs = ppo.rollout(env, policy_step, obs, groups, buf, episodes, args, memory)
        # SYNC: a rank whose environment produced NaN/Inf stops every rank, with its name (1 all_reduce).
        inputs = {"observations": buf.obs["actor"], "critic observations": buf.obs["critic"], "rewards": buf.rewards}
        common.raise_if_nonfinite(ctx, inputs, f"from the environment at iteration {it}")

        # ADVANTAGES
        with torch.inference_mode():  # the critic's memory as the rollout left it, not moved on
            last_values = value(envs.concat(obs, groups["critic"])[:, None], memory[1])[0][:, 0]
        # Time-outs are not failures: bootstrap them with the value of the state they cut off (rsl_rl).
        rewards = extensions.reward_scaling.scale_rewards(scaler, buf.rewards, buf.dones)  # --scale-rewards; local
        rewards = rewards + args.gamma * buf.values * buf.time_outs
        # SYNC: GAE, its advantages normalized with the mean and std of all ranks (1 all_reduce of 3 numbers).
        ppo.write_advantages(buf, rewards, last_values, args, ctx.world_size)
        collect_s = time.time() - t0

        # UPDATE: one all_reduce per mini-batch of whole env sequences, inside
        ppo.linear_lr(optimizer, args, it)  # --schedule linear; the same on every rank: local
        losses = update()
        # SYNC: normalizer statistics (and the reward scaler's) merged over every rank's rollout (1 all_gather
        # for all), after the update, so that the update normalizes exactly as its rollout did (ratio starts at 1).
        common.update_normalizers(ppo.normalizer_batches(actor, critic, None, buf, scaler), ctx.world_size)

        # LOG, CHECK, SAVE. SYNC: the iteration's statistics (1 all_reduce), then the state check and the save
        # (1 all_gather each, when due), in one order on every rank: bookkeeping.end_iteration.
        metrics = {"learning_rate": float(optimizer.param_groups[0]["lr"]), **losses}
        if bookkeeping.end_iteration(ctx, run_log, it, episodes, env_logs, metrics, t0, collect_s):
            break
    bookkeeping.finish_run(ctx, run_log)
    return checkpoints.fingerprint(trained)


if __name__ == "__main__":
    bookkeeping.cli(main, Args, envs.task_defaults)  # a task family may bring settings of its own (envs/)
