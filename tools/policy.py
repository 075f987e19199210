"""A trained policy out of any checkpoint of the four scripts, and the plumbing the tools share.

`load_policy` rebuilds the deployable network of a checkpoint from the config the checkpoint keeps,
with the scripts' own classes: `Class(**config)`. For `ppo_ddp.py` and `ppo_amp_ddp.py` the actor
(`ppo_ddp.Actor`, whose deterministic action is the mean of its Gaussian), for `ppo_rnn_ddp.py` the
recurrent actor (`ppo_rnn_ddp.Recurrent`, GRU or LSTM), for `distill_ddp.py` the student
(`distill_ddp.Student`, MLP or GRU). Each carries its observation normalizer as saved. Loading never
runs code (`torch.load(weights_only=True)`).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the scripts and envs/, whatever the working directory
import checkpoints  # noqa: E402
import common  # noqa: E402
import distill_ddp  # noqa: E402
import envs  # noqa: E402
import envs.envpool  # noqa: E402  (the gait clock; EnvPool itself is imported where used)
import ppo_ddp  # noqa: E402
import ppo_rnn_ddp  # noqa: E402

# What each script's checkpoint deploys: the class, looked up when it is used (a fork's own), and
# its part's name.
DEPLOYED = {
    "ppo": (lambda: ppo_ddp.Actor, "actor"),
    "ppo_amp": (lambda: ppo_ddp.Actor, "actor"),
    "ppo_rnn": (lambda: ppo_rnn_ddp.Recurrent, "actor"),
    "distill": (lambda: distill_ddp.Student, "student"),
}


@dataclass
class Policy:
    """What a checkpoint's policy needs to act: its network, the observation groups it reads, its
    task."""

    script: str  # "ppo", "ppo_amp", "ppo_rnn" or "distill"
    network: nn.Module  # ppo_ddp.Actor, ppo_rnn_ddp.Recurrent or distill_ddp.Student, in eval mode
    obs_shapes: dict[str, list[int]]  # the groups it reads, in order, and one env's shape of each
    task: str  # the task it was trained on
    num_actions: int
    memory_size: int  # a recurrent policy's memory per env (GRU student, ppo_rnn_ddp); else 0
    iteration: int
    path: str  # the checkpoint file


def load_policy(path: str, device: str | torch.device = "cpu") -> Policy:
    """The policy of a checkpoint file or run directory (its newest checkpoint). ValueError if it is
    none."""
    # one line for a device this machine lacks
    device = common.resolve_device(str(device), local_rank=0)
    path = checkpoints.resolve_checkpoint(path)
    state = checkpoints.load_checkpoint(path, None, ("args", "configs", "iteration"))
    network_class, part = deployed_class(state, path)
    try:
        network = network_class(**state["configs"][part])
        network.load_state_dict(state[part])
    # a config or weights this code cannot build
    except (KeyError, TypeError, RuntimeError) as error:
        raise ValueError(
            f"checkpoint {path!r} does not describe a policy this code can rebuild "
            f"({common.first_line(error)}); pass one written by this version of the training "
            "scripts."
        ) from None
    network = network.to(device).eval().requires_grad_(False)
    shapes = {group: list(shape) for group, shape in network.inputs.shapes.items()}
    config, memory_size = state["configs"][part], getattr(network, "memory_size", 0)
    if keeps_clock(network):  # its memory is the clock steps; the env need not give the clock
        shapes.pop("clock")
        memory_size = 1
        network.clock_weights = clock_weights(state["args"]["task"], path)
    num_actions = (
        config.get("num_actions") or config["head_config"]["num_actions"]
    )  # a recurrent actor's head's
    return Policy(
        state["script"],
        network,
        shapes,
        state["args"]["task"],
        num_actions,
        memory_size,
        state["iteration"],
        path,
    )


def deployed_class(state: dict[str, Any], path: str) -> tuple[type, str]:
    """The class of the network a checkpoint deploys, and the part that holds it: the class the
    checkpoint names (`deployed`: a class in a script of this repository, a fork's own too), else
    its script's (DEPLOYED, for checkpoints that name none). ValueError if neither is here."""
    named = state.get("deployed") or {}
    module = str(named.get("module", ""))
    if re.fullmatch(r"\w+", module) and os.path.isfile(os.path.join(ROOT, module + ".py")):
        found = getattr(importlib.import_module(module), str(named.get("class")), None)
        if isinstance(found, type) and issubclass(found, nn.Module):
            return found, str(named.get("part"))
    if state["script"] in DEPLOYED:
        network_class, part = DEPLOYED[state["script"]]
        return network_class(), part
    what = f"{module}.{named.get('class')}" if named else f"script {state['script']!r}"
    raise ValueError(
        f"checkpoint {path!r} deploys {what}, which is not among this repository's scripts; run "
        "the tool from the checkout that trained it."
    )


def output_path(policy: Policy, name: str) -> str:
    """Where a tool writes `name` unless told: beside the checkpoint (`output_folder`)."""
    return os.path.join(output_folder(os.path.dirname(policy.path)), name)


def output_folder(folder: str) -> str:
    """Where a tool writes what it makes of a run directory: that directory; for a policy the
    repository ships (under `policies/`, tracked by git), `runs/<its folder>/`, so that
    evaluating, playing, exporting or plotting it leaves the checkout clean. The folder is made."""
    folder, shipped = os.path.abspath(folder), os.path.join(ROOT, "policies")
    if os.path.commonpath([folder, shipped]) == shipped:
        folder = os.path.join("runs", os.path.relpath(folder, shipped))
    os.makedirs(folder, exist_ok=True)
    return folder


def initial_memory(policy: Policy, batch: int, device: str | torch.device) -> torch.Tensor:
    """A blank memory for `batch` envs, (batch, memory_size); (batch, 0) for a policy without
    one."""
    return torch.zeros(batch, policy.memory_size, device=device)


@torch.inference_mode()
def act(
    policy: Policy, obs: Mapping[str, torch.Tensor], memory: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic action of raw observations (groups) -> (actions (batch, num_actions), next
    memory)."""
    return step(policy.script, policy.network, obs, memory)


def clock_weights(task: str, path: str) -> dict[str, float]:
    """The weights of the task a clock policy was trained on (envs/envpool.py `CLOCK`), which give
    its clock's period and how fast it turns. ValueError for a task this checkout does not name."""
    if task not in envs.envpool.CLOCK:
        raise ValueError(
            f"checkpoint {path!r} reads a gait clock, but its task {task!r} is not among "
            "envs/envpool.py's CLOCK tasks, which give the clock's period; run the tool from the "
            "checkout that trained it."
        )
    return envs.envpool.CLOCK[task]


def keeps_clock(network: nn.Module) -> bool:
    """Whether `network` is an actor trained on a gait clock (envs/envpool.py `ClockGo1`'s `clock`
    group), which it keeps as its memory where the env gives none (the plain Go1 id)."""
    return "clock" in getattr(getattr(network, "inputs", None), "shapes", {})


def step(
    script: str, network: nn.Module, obs: Mapping[str, torch.Tensor], memory: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One deterministic step of a deployed `network` of `script` (what tools/export.py traces): the
    mean of an actor (`ppo`, `ppo_amp`, and tools/evaluate.py's `zeros`), a student's action, a
    recurrent actor's from its memory; an actor with a gait clock reads it off its memory, the
    clock steps of the episode so far (`envs.envpool.gait_clock`, at the period of the task
    `load_policy` found), and turns it on as the task's clock does (`envs.envpool.clock_rate` of
    the command in `state`: one step, unless the task sets a cadence)."""
    if keeps_clock(network):
        weights = network.clock_weights
        clock = envs.envpool.gait_clock(memory[:, 0], weights["period_steps"])
        rate = envs.envpool.clock_rate(obs["state"], weights)
        return network({**obs, "clock": clock})[0], memory + rate[:, None]
    if script == "distill":
        return network(obs, memory)
    if script == "ppo_rnn":  # one step of a sequence
        (mean, _), memory = network({group: x[:, None] for group, x in obs.items()}, memory)
        return mean[:, 0], memory
    return network(obs)[0], memory


@torch.inference_mode()
def run_episodes(
    policy: Policy, env: envs.VecEnv, on_step: Callable[[int], None] | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor]], dict[str, float]]:
    """Play the first episode of every env of `env` with the deterministic policy -> (returns,
    lengths, the observation groups the policy saw at each step, the mean per step of every value
    the env logs (`extras["log"]`: reward terms) over those episodes). `on_step(t)` is called after
    every step."""
    device = env.device
    obs, memory = env.get_observations(), initial_memory(policy, env.num_envs, device)
    check_fits(policy, obs)
    returns, lengths = (
        torch.zeros(env.num_envs, device=device),
        torch.zeros(env.num_envs, device=device),
    )
    alive, seen, logged = torch.ones(env.num_envs, device=device), [], {}
    for t in range(int(env.max_episode_length)):
        seen.append({group: obs[group].clone() for group in policy.obs_shapes})
        actions, memory = act(policy, obs, memory)
        obs, rewards, dones, extras = env.step(actions)
        returns += rewards.to(returns.dtype) * alive
        lengths += alive
        # a mean over the envs, or one value per env
        for key, value in extras.get("log", {}).items():
            per_env = torch.as_tensor(value, dtype=torch.float32, device=device).expand(
                env.num_envs
            )
            total, count = logged.get(key, (0.0, 0.0))
            logged[key] = (total + (per_env * alive).sum().item(), count + alive.sum().item())
        alive *= 1.0 - dones.to(alive.dtype)  # only each env's first episode counts
        # blank where an episode ended
        memory = memory * (1.0 - dones.to(memory.dtype)).unsqueeze(-1)
        if on_step is not None:
            on_step(t)
        if not alive.any():
            break
    return (
        returns,
        lengths,
        seen,
        {key: total / max(count, 1) for key, (total, count) in logged.items()},
    )


def check_fits(policy: Policy, obs: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless the env has the policy's observation groups, of the shapes it was trained
    on."""
    envs.resolve_groups(obs, list(policy.obs_shapes), images=True)  # one line for a missing group
    here = envs.group_shapes(obs, list(policy.obs_shapes))
    if here != policy.obs_shapes:
        raise ValueError(
            f"the policy reads {policy.obs_shapes}, but this task gives {here}; pass the --task it "
            "was trained on, or leave --task out."
        )


def run_tool(main: Callable[[Any], Any], config_type: type) -> None:
    """Parse the command line into `config_type`, call `main`; bad input is one line, `error: ...`,
    exit 1."""
    import tyro

    config = tyro.cli(config_type)
    try:
        main(config)
    except (ValueError, OSError, ImportError) as error:
        print(
            "error: " + str(error).replace("\n", " "), file=sys.stderr
        )  # one line, as the training scripts' errors
        raise SystemExit(1) from None
