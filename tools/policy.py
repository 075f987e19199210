"""A trained policy out of any checkpoint of the four scripts, and the plumbing the tools share.

`load_policy` rebuilds the deployable network of a checkpoint from the config the checkpoint keeps,
with the scripts' own classes: `Class(**config)`. For `ppo_ddp.py` and `ppo_amp_ddp.py` the actor
(`networks.Actor`, whose deterministic action is the mean of its Gaussian), for `ppo_rnn_ddp.py` the
recurrent actor (`ppo_rnn_ddp.Recurrent`, GRU or LSTM), for `distill_ddp.py` the student
(`distill_ddp.Student`, MLP or GRU). Each carries its observation normalizer as saved. Loading never
runs code (`torch.load(weights_only=True)`).

A task of this repository's own name may give its policies inputs that the id it is scored on
lacks (such as a count of the episode's steps). Its module, envs/<task>.py, then defines
`policy_inputs(memory) -> (groups, memory one step on)`, `POLICY_MEMORY` (the memory's width) and
`EVAL_TASK` (the task the tools score on by default): the policy keeps those groups in its memory,
zero at each episode's start, as a recurrent policy keeps its own, and reads them from it on any
task, so that its exported program runs on the scored id.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the scripts and envs/, whatever the working directory
import checkpoints  # noqa: E402
import common  # noqa: E402
import distill_ddp  # noqa: E402
import envs  # noqa: E402
import networks  # noqa: E402
import ppo_rnn_ddp  # noqa: E402

# What each script's checkpoint deploys: the class, looked up when it is used (a fork's own), and
# its part's name.
DEPLOYED = {
    "ppo": (lambda: networks.Actor, "actor"),
    "ppo_amp": (lambda: networks.Actor, "actor"),
    "ppo_rnn": (lambda: ppo_rnn_ddp.Recurrent, "actor"),
    "distill": (lambda: distill_ddp.Student, "student"),
}


# A task's `policy_inputs`: the memory (N, POLICY_MEMORY) -> (groups, the memory one step on).
OwnInputs = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


@dataclass
class Policy:
    """What a checkpoint's policy needs to act: its network, the observation groups it reads, its
    task."""

    script: str  # "ppo", "ppo_amp", "ppo_rnn" or "distill"
    network: nn.Module  # networks.Actor, ppo_rnn_ddp.Recurrent or distill_ddp.Student, in eval mode
    obs_shapes: dict[str, list[int]]  # the env's groups it reads, in order, one env's shape of each
    task: str  # the task it was trained on
    num_actions: int
    memory_size: int  # per env: a recurrent policy's, or its task's POLICY_MEMORY; else 0
    iteration: int
    path: str  # the checkpoint file
    eval_task: str  # the task the tools score it on by default: its task's `EVAL_TASK`, else `task`
    own_inputs: OwnInputs | None = None  # its task's `policy_inputs`, where it reads what they give


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
    task = state["args"]["task"]
    module = task_module(task)
    own_inputs = getattr(module, "policy_inputs", None)
    if own_inputs is not None:
        given = own_inputs(torch.zeros(1, module.POLICY_MEMORY, device=device))[0]
        if not given.keys() & shapes.keys():
            own_inputs = None  # it reads none of them: the env's groups are all it needs
        elif memory_size:
            raise ValueError(
                f"checkpoint {path!r} reads groups its task keeps in memory ({sorted(given)}) and "
                "has a memory of its own; the tools rebuild only one of the two."
            )
        else:
            shapes = {group: shape for group, shape in shapes.items() if group not in given}
            memory_size = module.POLICY_MEMORY
    num_actions = config.get("num_actions") or config["head_config"]["num_actions"]  # or its head's
    return Policy(
        script=state["script"],
        network=network,
        obs_shapes=shapes,
        task=task,
        num_actions=num_actions,
        memory_size=memory_size,
        iteration=state["iteration"],
        path=path,
        eval_task=getattr(module, "EVAL_TASK", task),
        own_inputs=own_inputs,
    )


def task_module(task: str) -> ModuleType | None:
    """The module of a task of this repository's own name (envs/<task>.py), imported; None for the
    others (`gym:<id>`, `module:function`, ...)."""
    if re.fullmatch(r"\w+", task) and os.path.isfile(os.path.join(ROOT, "envs", task + ".py")):
        return importlib.import_module(f"envs.{task}")
    return None


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
    return step(policy.script, policy.network, obs, memory, policy.own_inputs)


def step(
    script: str,
    network: nn.Module,
    obs: Mapping[str, torch.Tensor],
    memory: torch.Tensor,
    own_inputs: OwnInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One deterministic step of a deployed `network` of `script` (what tools/export.py traces): the
    mean of an actor (`ppo`, `ppo_amp`, and tools/evaluate.py's `zeros`), a student's action, a
    recurrent actor's from its memory; with `own_inputs` (its task's `policy_inputs`), the actor's
    mean on the env's groups and those its memory gives, and the memory one step on."""
    if own_inputs is not None:
        given, memory = own_inputs(memory)
        return network({**obs, **given})[0], memory
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
