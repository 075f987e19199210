"""A trained policy out of any checkpoint of the three scripts, and the plumbing the tools share.

`load_policy` rebuilds the deployable network of a checkpoint with the scripts' own classes: for
`ppo_ddp.py` and `ppo_amp_ddp.py` the actor (`ppo_ddp.Actor`, whose deterministic action is the mean
of its Gaussian), for `ppo_rnn_ddp.py` the recurrent actor (`ppo_rnn_ddp.Recurrent`, GRU or LSTM),
for `distill_ddp.py` the student (`distill_ddp.Student`, MLP or GRU). Each carries its observation
normalizer as saved. Loading never runs code (`torch.load(weights_only=True)`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the scripts and envs/, whatever the working directory
import checkpoints  # noqa: E402
import cnn  # noqa: E402
import common  # noqa: E402
import distill_ddp  # noqa: E402
import envs  # noqa: E402
import ppo_ddp  # noqa: E402
import ppo_rnn_ddp  # noqa: E402


@dataclass
class Policy:
    """What a checkpoint's policy needs to act: its network, the observation groups it reads, its task."""

    kind: str  # "ppo", "ppo_amp", "ppo_rnn" or "distill"
    network: nn.Module  # ppo_ddp.Actor, ppo_rnn_ddp.Recurrent or distill_ddp.Student, in eval mode
    groups: tuple[str, ...]  # concatenated, in order, into the network's input
    task: str  # the task it was trained on
    obs_dim: int
    num_actions: int
    hidden_size: int  # a recurrent policy's memory per env (GRU student, ppo_rnn_ddp); 0 for the others
    iteration: int
    path: str  # the checkpoint file


def load_policy(path: str, device: str | torch.device = "cpu") -> Policy:
    """The policy of a checkpoint file or run directory (its newest checkpoint). ValueError if it is none."""
    device = common.resolve_device(str(device), local_rank=0)  # one line for a device this machine lacks
    path = checkpoints.resolve_checkpoint(path)
    state = checkpoints.load_checkpoint(
        path, ("ppo", "ppo_amp", "ppo_rnn", "distill"), ("args", "obs_dims", "iteration")
    )
    try:
        return _rebuild(state, path, device)
    except (KeyError, RuntimeError) as error:  # a field missing, or weights of another shape
        first_line = common.first_line(error)
        raise ValueError(
            f"checkpoint {path!r} does not describe a policy these tools can rebuild ({first_line}); pass one written "
            "by this version of the training scripts."
        ) from None


def _rebuild(state: dict[str, Any], path: str, device: torch.device) -> Policy:
    """The policy of a loaded checkpoint (load_policy)."""
    kind, args, dims = state["kind"], state["args"], state["obs_dims"]
    if kind == "distill":
        rnn_hidden = args["rnn_hidden"] if args["student"] == "gru" else 0
        network: nn.Module = distill_ddp.Student(
            dims["student"], dims["actions"], tuple(args["student_hidden"]), rnn_hidden, args["normalize_obs"]
        )
        network.load_state_dict(state["student"])
        groups, obs_dim = args["student_obs"], dims["student"]
    else:
        hidden, std_type = tuple(args["actor_hidden"]), args.get("std_type", "log")  # older checkpoints: log
        shapes = {group: shape for group, shape in state.get("images", {}).items() if group in args["actor_obs"]}
        flat = dims["actor"] - cnn.image_width(shapes.values())  # the images follow (envs.concat)
        actor = (flat, dims["actions"], hidden, args["init_noise_std"], args["normalize_obs"], std_type)
        activation = args.get("activation", "elu")  # older checkpoints: ELU
        if kind == "ppo_rnn":
            rnn = (args["rnn"], args["rnn_hidden"], args["rnn_layers"])
            network = ppo_rnn_ddp.recurrent_actor(*actor, *rnn, activation)
        else:
            network = ppo_ddp.Actor(*actor, activation, cnn.encoders(shapes, args, activation))
        network.load_state_dict(state["actor"])
        groups, obs_dim = args["actor_obs"], dims["actor"]
        rnn_hidden = network.rnn.size if kind == "ppo_rnn" else 0
    groups = (groups,) if isinstance(groups, str) else tuple(groups)  # older checkpoints name one group
    network = network.to(device).eval().requires_grad_(False)
    return Policy(kind, network, groups, args["task"], obs_dim, dims["actions"], rnn_hidden, state["iteration"], path)


def initial_hidden(policy: Policy, batch: int, device: str | torch.device) -> torch.Tensor:
    """A blank memory for `batch` envs, (batch, hidden_size); (batch, 0) for a policy without one."""
    return torch.zeros(batch, policy.hidden_size, device=device)


@torch.inference_mode()
def act(policy: Policy, obs: Mapping[str, torch.Tensor], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic action of raw observations -> (actions (batch, num_actions), next memory)."""
    return step(policy, envs.concat(obs, policy.groups), hidden)


@torch.inference_mode()
def step(policy: Policy, x: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`act` on the network's input, the observation groups already concatenated."""
    if policy.kind == "distill":
        return policy.network(x, hidden)
    if policy.kind == "ppo_rnn":  # one step of a sequence
        (mean, _), hidden = policy.network(x[:, None], hidden)
        return mean[:, 0], hidden
    return policy.network(x)[0], hidden


@torch.inference_mode()
def run_episodes(
    policy: Policy, env: envs.VecEnv, on_step: Callable[[int], None] | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Play the first episode of every env of `env` with the deterministic policy -> (returns, lengths,
    the observations the policy saw at each step). `on_step(t)` is called after every step."""
    device = env.device
    obs, hidden = env.get_observations(), initial_hidden(policy, env.num_envs, device)
    check_fits(policy, obs)
    returns, lengths = torch.zeros(env.num_envs, device=device), torch.zeros(env.num_envs, device=device)
    alive, seen = torch.ones(env.num_envs, device=device), []
    for t in range(int(env.max_episode_length)):
        seen.append(envs.concat(obs, policy.groups).clone())
        actions, hidden = act(policy, obs, hidden)
        obs, rewards, dones, _ = env.step(actions)
        returns += rewards.to(returns.dtype) * alive
        lengths += alive
        alive *= 1.0 - dones.to(alive.dtype)  # only each env's first episode counts
        hidden = common.reset_hidden(hidden, dones)
        if on_step is not None:
            on_step(t)
        if not alive.any():
            break
    return returns, lengths, seen


def check_fits(policy: Policy, obs: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless the env has the policy's observation groups, of the size it was trained on."""
    dim = envs.concat(obs, envs.resolve_groups(obs, policy.groups, images=True)).shape[-1]
    if dim != policy.obs_dim:
        raise ValueError(
            f"the policy reads {policy.obs_dim} observations from {list(policy.groups)}, but this task gives {dim}; "
            "pass the --task it was trained on, or leave --task out."
        )


def run_tool(main: Callable[[Any], Any], config_type: type) -> None:
    """Parse the command line into `config_type`, call `main`; bad input is one line, `error: ...`, exit 1."""
    import tyro

    config = tyro.cli(config_type)
    try:
        main(config)
    except (ValueError, OSError, ImportError) as error:
        print("error: " + str(error).replace("\n", " "), file=sys.stderr)  # one line, as the training scripts' errors
        raise SystemExit(1) from None
