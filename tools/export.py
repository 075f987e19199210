"""Export a trained policy for deployment: TorchScript and ONNX, observation normalizer folded in.

The exported program is the policy alone: input the raw observation (the checkpoint's observation
groups concatenated as the env gives them, image groups flattened after the flat ones: `envs.concat`),
output the deterministic action (the actor's mean; the student for distillation). A recurrent policy (a GRU student, ppo_rnn_ddp.py's GRU or LSTM actor)
is exported as one step, with its memory as a second input and output, one row per env (start from
zeros, zero a row when its episode ends); an LSTM's memory row is its h of each layer, then its c of
each layer (`policy.json` says the sizes). On export, the programs are run on a batch of real
observations (the policy playing its task, memory carried) and must give the checkpoint's actions to
1e-5; the ONNX file is checked with onnxruntime when it is installed.

    python tools/export.py runs/ppo_pendulum/<time>            # -> runs/ppo_pendulum/<time>/exported/
    python tools/export.py runs/distill_pendulum_partial/<time> --formats onnx
    python tools/export.py runs/ppo_rnn_pendulum_angle/<time>  # (obs, hidden_in) -> (actions, hidden_out)

Writes `policy.pt` (TorchScript: `torch.jit.load`, or libtorch in C++), `policy.onnx` and
`policy.json` (inputs, outputs, sizes, observation groups). ONNX needs `pip install onnx onnxscript`;
the check `pip install onnxruntime`.
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
from policy import Policy, cnn, common, envs, initial_hidden, load_policy, run_episodes, run_tool, step
from torch import nn


class ExportedMlp(nn.Module):
    """(obs - mean) / (std + eps) -> MLP -> action: the actor's mean, or an MLP student."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(policy.obs_dim))
        self.register_buffer("denominator", torch.ones(policy.obs_dim))
        normalizer = policy.network.normalizer
        if isinstance(normalizer, common.EmpiricalNormalizer):  # the same float32 values the policy computes
            self.mean.copy_(normalizer.mean.float())
            self.denominator.copy_(normalizer.var.sqrt().float() + normalizer.eps)
        self.net = copy.deepcopy(getattr(policy.network, "head", policy.network).net).cpu()  # a recurrent one's head

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net((obs - self.mean) / self.denominator)


class ExportedCnn(nn.Module):
    """An actor with image groups: its input the flat groups then each image flattened (`envs.concat`'s row);
    the flat part normalized, each image through its encoder (cnn.py), the latents after it, then the MLP."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        actor = policy.network
        self.encoders = nn.ModuleList([copy.deepcopy(encoder).cpu() for encoder in actor.cnns.values()])
        self.shapes = [list(encoder.shape) for encoder in actor.cnns.values()]  # (C, H, W) of each, in order
        self.flat = policy.obs_dim - cnn.image_width(self.shapes)
        self.register_buffer("mean", torch.zeros(self.flat))
        self.register_buffer("denominator", torch.ones(self.flat))
        if isinstance(actor.normalizer, common.EmpiricalNormalizer):
            self.mean.copy_(actor.normalizer.mean.float())
            self.denominator.copy_(actor.normalizer.var.sqrt().float() + actor.normalizer.eps)
        self.net = copy.deepcopy(actor.net).cpu()

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        latents = [(obs[:, : self.flat] - self.mean) / self.denominator]
        offset = self.flat
        for i, encoder in enumerate(self.encoders):
            c, h, w = self.shapes[i]
            latents.append(encoder(obs[:, offset : offset + c * h * w].reshape(-1, c, h, w)))
            offset += c * h * w
        return self.net(torch.cat(latents, dim=-1))


class ExportedGru(ExportedMlp):
    """One step of a GRU student: (obs, memory) -> (action, next memory)."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.rnn = copy.deepcopy(policy.network.rnn).cpu()

    def forward(self, obs: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        hidden = self.rnn((obs - self.mean) / self.denominator, hidden)
        return self.net(hidden), hidden


class ExportedRecurrent(ExportedMlp):
    """One step of a recurrent PPO actor (ppo_rnn_ddp.py), GRU or LSTM: (obs, memory) -> (action, next memory)."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.rnn = copy.deepcopy(policy.network.rnn).cpu()

    def forward(self, obs: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        outputs, hidden = self.rnn(((obs - self.mean) / self.denominator)[:, None], hidden)
        return self.net(outputs[:, 0]), hidden


@dataclass
class Config:
    checkpoint: Annotated[str, tyro.conf.Positional]
    """A checkpoint file (`model_<iteration>.pt`) or a run directory (its newest checkpoint)."""
    out_dir: str | None = None
    """Where to write; default `exported/` beside the checkpoint."""
    formats: tuple[Literal["torchscript", "onnx"], ...] = ("torchscript", "onnx")
    """What to export."""
    check_envs: int = 16
    """Envs of the task whose observations the check replays (for 100 steps at most)."""
    tolerance: float = 1e-5
    """Largest absolute difference allowed between exported and checkpoint actions."""


def real_observations(policy: Policy, num_envs: int) -> torch.Tensor:
    """(steps, envs, obs_dim): what the policy sees playing its own task, up to 100 steps (CPU)."""
    env = envs.make_env(policy.task, num_envs, "cpu", seed=0)
    env.max_episode_length = min(int(env.max_episode_length), 100)  # run_episodes plays this many steps
    return torch.stack(run_episodes(policy, env)[2])


@torch.inference_mode()
def largest_error(policy: Policy, run: Callable, observations: torch.Tensor) -> float:
    """max |exported - checkpoint| over the replayed observations; `run(obs, hidden) -> (actions, hidden)`."""
    hidden = ours = initial_hidden(policy, observations.shape[1], "cpu")
    worst = 0.0
    for obs in observations:  # step by step, so that a GRU's memory carries through the sequence
        expected, ours = step(policy, obs, ours)
        actions, hidden = run(obs, hidden)
        worst = max(worst, (torch.as_tensor(actions) - expected).abs().max().item())
        hidden = torch.as_tensor(hidden)
    return worst


def export(config: Config) -> dict:
    """Export, check, write; returns the largest error of each format."""
    if "onnx" in config.formats and not all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript")):
        raise ImportError(
            "ONNX export needs onnx and onnxscript: pip install onnx onnxscript (or --formats torchscript)."
        )
    policy = load_policy(config.checkpoint, "cpu")
    recurrent = policy.hidden_size > 0
    images = len(getattr(policy.network, "cnns", ())) > 0
    exported = ExportedRecurrent if policy.kind == "ppo_rnn" else ExportedGru if recurrent else ExportedMlp
    exported = ExportedCnn if images else exported
    module = exported(policy).eval()
    inputs, outputs = (["obs", "hidden_in"], ["actions", "hidden_out"]) if recurrent else (["obs"], ["actions"])
    observations = real_observations(policy, config.check_envs)
    example = (observations[0], initial_hidden(policy, config.check_envs, "cpu"))[: len(inputs)]
    out_dir = config.out_dir or os.path.join(os.path.dirname(policy.path), "exported")
    os.makedirs(out_dir, exist_ok=True)
    errors: dict[str, float | None] = {}
    # Written and checked in a scratch folder first: a failed export leaves an earlier one untouched.
    scratch = tempfile.TemporaryDirectory(dir=out_dir, prefix=".export-")
    files = {"torchscript": os.path.join(scratch.name, "policy.pt"), "onnx": os.path.join(scratch.name, "policy.onnx")}
    # Quiet: torch.jit's deprecation notice (TorchScript still loads in libtorch), the ONNX exporter's progress.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with scratch, warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if "torchscript" in config.formats:
            torch.jit.script(module).save(files["torchscript"])
            loaded = torch.jit.load(files["torchscript"])
            run = (lambda o, h: loaded(o, h)) if recurrent else (lambda o, h: (loaded(o), h))
            errors["torchscript"] = largest_error(policy, run, observations)
        if "onnx" in config.formats:
            batch = torch.export.Dim("batch", min=1)
            shapes = {name: {0: batch} for name in ("obs", "hidden")[: len(inputs)]}
            torch.onnx.export(
                module, example, files["onnx"], input_names=inputs, output_names=outputs, dynamic_shapes=shapes,
                external_data=False,
            )  # fmt: skip
            errors["onnx"] = onnx_error(policy, files["onnx"], inputs, observations)
        for name, error in errors.items():
            if error is not None and error > config.tolerance:
                raise ValueError(
                    f"the {name} export differs from the checkpoint's policy by {error:.3g} (> --tolerance "
                    f"{config.tolerance}); nothing was written: raise --tolerance if that is close enough."
                )
        for name in errors:
            os.replace(files[name], os.path.join(out_dir, os.path.basename(files[name])))
    meta = {
        "checkpoint": policy.path, "iteration": policy.iteration, "task": policy.task, "observation_groups": list(policy.groups),
        "obs_dim": policy.obs_dim, "num_actions": policy.num_actions, "hidden_size": policy.hidden_size,
        "inputs": inputs, "outputs": outputs, "largest_error": errors, **memory_layout(policy),
    }  # fmt: skip
    with open(os.path.join(out_dir, "policy.json"), "w") as f:
        json.dump(meta, f, indent=1)
    checked = ", ".join(
        f"{k} {'not checked (pip install onnxruntime)' if v is None else f'max error {v:.1e}'}"
        for k, v in errors.items()
    )
    what = "recurrent policy" if policy.kind == "ppo_rnn" else "GRU student" if recurrent else "policy"
    print(f"exported the {what} of {policy.path} to {out_dir}: {checked}")
    return errors


def memory_layout(policy: Policy) -> dict:
    """What a recurrent PPO actor's memory row holds, for policy.json: {} for the other policies."""
    if policy.kind != "ppo_rnn":
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


def onnx_error(policy: Policy, path: str, inputs: list[str], observations: torch.Tensor) -> float | None:
    """The ONNX program's largest error, run by onnxruntime; None when onnxruntime is not installed."""
    if importlib.util.find_spec("onnxruntime") is None:
        return None
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])

    def run(obs: torch.Tensor, hidden: torch.Tensor) -> tuple:
        feed = dict(zip(inputs, (obs.numpy(), hidden.numpy())))
        result = session.run(None, feed)
        return (result[0], result[1]) if len(result) > 1 else (result[0], hidden)

    return largest_error(policy, run, observations)


if __name__ == "__main__":
    run_tool(export, Config)
