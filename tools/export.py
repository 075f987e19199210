"""Export a trained policy for deployment: TorchScript and ONNX, observation normalizer folded in.

The exported program is the policy's own network, traced: one input per observation group it reads,
in its order, each as the env gives it ((batch, dim), or (batch, C, H, W) for an image), and the
deterministic action out (the actor's mean; the student for distillation). A recurrent policy (a GRU
student, ppo_rnn_ddp.py's GRU or LSTM actor) is exported as one step, with its memory as a last
input and a second output, one row per env (start from zeros, zero a row when its episode ends); an
LSTM's memory row is its h of each layer, then its c of each layer (`policy.json` says the sizes).
A policy whose task keeps some of its inputs in memory (tools/policy.py: envs/<task>.py
`policy_inputs`) is exported the same way, those inputs built inside the program from its memory,
so that it runs on the id the task is scored on. Whatever a fork adds to the network is in the
program. On export, the programs are run on real observations (the policy playing the task it is
scored on, memory carried) and must give the checkpoint's actions to
1e-5; the ONNX file is checked with onnxruntime when it is installed.

    python tools/export.py runs/ppo_pendulum/<time>  # -> runs/ppo_pendulum/<time>/exported/
    python tools/export.py runs/distill_pendulum_partial/<time> --formats onnx
    python tools/export.py runs/ppo_rnn_pendulum_angle/<time>
        # (obs groups, memory_in) -> (actions, memory_out)

Writes `policy.pt` (TorchScript: `torch.jit.load`, or libtorch in C++), `policy.onnx` and
`policy.json` (inputs, outputs, shapes, observation groups). ONNX needs `pip install onnx
onnxscript`; the check `pip install onnxruntime`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro
from policy import (
    Policy,
    envs,
    initial_memory,
    load_policy,
    output_path,
    run_episodes,
    run_tool,
    step,
)
from torch import nn


class Exported(nn.Module):
    """The policy's deterministic step as a program: (each observation group, [memory]) -> (actions,
    [memory])."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.script, self.groups = policy.script, list(policy.obs_shapes)
        self.network = copy.deepcopy(policy.network).cpu()
        self.recurrent, self.own_inputs = policy.memory_size > 0, policy.own_inputs

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        obs = dict(zip(self.groups, inputs))
        memory = inputs[-1] if self.recurrent else inputs[0].new_zeros(inputs[0].shape[0], 0)
        actions, memory = step(self.script, self.network, obs, memory, self.own_inputs)
        return (actions, memory) if self.recurrent else actions


@dataclass
class Config:
    checkpoint: Annotated[str, tyro.conf.Positional]
    """A checkpoint file (`model_<iteration>.pt`) or a run directory (its newest checkpoint)."""
    out_dir: str | None = None
    """Where to write; default `exported/` beside the checkpoint (a shipped policy's: under
    `runs/`)."""
    formats: tuple[Literal["torchscript", "onnx"], ...] = ("torchscript", "onnx")
    """What to export."""
    check_envs: int = 16
    """Envs of the task whose observations the check replays (for 100 steps at most)."""
    tolerance: float = 1e-5
    """Largest absolute difference allowed between exported and checkpoint actions."""


def real_observations(policy: Policy, num_envs: int) -> list[dict[str, torch.Tensor]]:
    """The observation groups the policy sees playing the task it is scored on (`eval_task`: its
    own, or the id its task names), step by step, up to 100 steps (CPU)."""
    env = envs.make_env(policy.eval_task, num_envs, "cpu", seed=0)
    # run_episodes plays this many steps
    env.max_episode_length = min(int(env.max_episode_length), 100)
    return run_episodes(policy, env)[2]


@torch.inference_mode()
def largest_error(
    policy: Policy, run: Callable, observations: list[dict[str, torch.Tensor]]
) -> float:
    """max |exported - checkpoint| over the replayed observations; `run(groups..., memory) ->
    (actions, memory)`."""
    memory = ours = initial_memory(policy, next(iter(observations[0].values())).shape[0], "cpu")
    worst = 0.0
    # step by step, so that a recurrent memory carries through the sequence
    for obs in observations:
        expected, ours = step(policy.script, policy.network, obs, ours, policy.own_inputs)
        actions, memory = run(*obs.values(), memory)
        worst = max(worst, (torch.as_tensor(actions) - expected).abs().max().item())
        memory = torch.as_tensor(memory)
    return worst


def export(config: Config) -> dict:
    """Export, check, write; returns the largest error of each format."""
    if "onnx" in config.formats and not all(
        importlib.util.find_spec(m) for m in ("onnx", "onnxscript")
    ):
        raise ImportError(
            "ONNX export needs onnx and onnxscript: pip install onnx onnxscript (or --formats "
            "torchscript)."
        )
    policy = load_policy(config.checkpoint, "cpu")
    recurrent = policy.memory_size > 0
    module = Exported(policy).eval()
    inputs = [*policy.obs_shapes, *(["memory_in"] if recurrent else [])]
    outputs = ["actions", "memory_out"] if recurrent else ["actions"]
    observations = real_observations(policy, config.check_envs)
    example = (
        *observations[0].values(),
        *([initial_memory(policy, config.check_envs, "cpu")] if recurrent else []),
    )
    out_dir = config.out_dir or output_path(policy, "exported")
    os.makedirs(out_dir, exist_ok=True)
    errors: dict[str, float | None] = {}
    # Written and checked in a scratch folder first: a failed export leaves an earlier one
    # untouched.
    scratch = tempfile.TemporaryDirectory(dir=out_dir, prefix=".export-")
    files = {
        "torchscript": os.path.join(scratch.name, "policy.pt"),
        "onnx": os.path.join(scratch.name, "policy.onnx"),
    }
    # Quiet: torch.jit's deprecation notice (TorchScript still loads in libtorch), the ONNX
    # exporter's progress.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with (
        scratch,
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        torch.no_grad(),
    ):
        warnings.simplefilter("ignore")
        if "torchscript" in config.formats:
            torch.jit.trace(module, example, check_trace=False).save(files["torchscript"])
            loaded = torch.jit.load(files["torchscript"])
            run = (lambda *x: loaded(*x)) if recurrent else (lambda *x: (loaded(*x[:-1]), x[-1]))
            errors["torchscript"] = largest_error(policy, run, observations)
        if "onnx" in config.formats:
            batch = torch.export.Dim("batch", min=1)
            torch.onnx.export(
                module,
                example,
                files["onnx"],
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=[tuple({0: batch} for _ in inputs)],
                external_data=False,
            )
            errors["onnx"] = onnx_error(policy, files["onnx"], inputs, observations)
        for name, error in errors.items():
            if error is not None and error > config.tolerance:
                raise ValueError(
                    f"the {name} export differs from the checkpoint's policy by {error:.3g} (> "
                    f"--tolerance {config.tolerance}); nothing was written: raise --tolerance if "
                    "that is close enough."
                )
        for name in errors:
            os.replace(files[name], os.path.join(out_dir, os.path.basename(files[name])))
    meta = {
        "checkpoint": policy.path,
        "iteration": policy.iteration,
        "task": policy.task,
        "checked_on": policy.eval_task,
        "observation_shapes": policy.obs_shapes,
        "num_actions": policy.num_actions,
        "memory_size": policy.memory_size,
        "inputs": inputs,
        "outputs": outputs,
        "largest_error": errors,
        **memory_layout(policy),
    }
    with open(os.path.join(out_dir, "policy.json"), "w") as f:
        json.dump(meta, f, indent=1)
    checked = ", ".join(
        f"{k} {'not checked (pip install onnxruntime)' if v is None else f'max error {v:.1e}'}"
        for k, v in errors.items()
    )
    what = (
        "recurrent policy"
        if policy.script == "ppo_rnn"
        else "policy with its task's inputs in memory"
        if policy.own_inputs is not None
        else "GRU student"
        if recurrent
        else "policy"
    )
    print(f"exported the {what} of {policy.path} to {out_dir}: {checked}")
    return errors


def memory_layout(policy: Policy) -> dict:
    """What a recurrent PPO actor's memory row holds, or the groups a policy's memory gives it
    (its task's `policy_inputs`), for policy.json: {} for the other policies."""
    if policy.own_inputs is not None:
        given = policy.own_inputs(torch.zeros(1, policy.memory_size))[0]
        what = " ".join((policy.own_inputs.__doc__ or "").split())  # its docstring, on one line
        return {"memory_gives": sorted(given), "memory": f"envs/{policy.task}.py: {what}"}
    if policy.script != "ppo_rnn":
        return {}
    rnn = policy.network.rnn.rnn
    parts = " then ".join(["h", "c"] if isinstance(rnn, nn.LSTM) else ["h"])
    layout = f"{parts}, each (layers, hidden) flattened, layer 0 first"
    return {
        "rnn": {
            "type": type(rnn).__name__.lower(),
            "layers": rnn.num_layers,
            "hidden": rnn.hidden_size,
            "memory": layout,
        }
    }


def onnx_error(
    policy: Policy, path: str, inputs: list[str], observations: list[dict[str, torch.Tensor]]
) -> float | None:
    """The ONNX program's largest error, run by onnxruntime; None when onnxruntime is not
    installed."""
    if importlib.util.find_spec("onnxruntime") is None:
        return None
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])

    def run(*values: torch.Tensor) -> tuple:
        # the memory is left out when there is none
        feed = dict(zip(inputs, (value.numpy() for value in values)))
        result = session.run(None, feed)
        return (result[0], result[1]) if len(result) > 1 else (result[0], values[-1])

    return largest_error(policy, run, observations)


if __name__ == "__main__":
    run_tool(export, Config)
