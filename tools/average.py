"""Average the networks of several checkpoints of one run (stochastic weight averaging).

Each weight of each network the checkpoints keep (the actor and critic; AMP's discriminator, a
distillation's student) becomes its mean over the checkpoints, taken in float64 and cast back.
Everything else comes from the last checkpoint named: the observation normalizers' statistics, the
optimizer's moments, the iteration, the args. The fingerprint is that of the averaged state, so the
result is a checkpoint like any other: the tools score it and `--resume` continues it.

    python tools/average.py runs/x/model_{2800..3200..50}.pt runs/x/model_3255.pt \\
        --out runs/x_avg/model_3255.pt

Averaging the checkpoints of a stretch of a run whose learning rate is still high smooths the
noise of its updates, as a falling rate does. Writes nothing when a checkpoint cannot be read, when
the checkpoints hold networks of other shapes, or when `--out` exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import tyro
from policy import run_tool

import common
from checkpoints import RESUME_KEYS, atomic_write, load_checkpoint


@dataclass
class Config:
    checkpoints: Annotated[tuple[str, ...], tyro.conf.Positional]
    """Two or more checkpoint files of one run; the last one named gives all but the weights."""
    out: str
    """The averaged checkpoint to write (it must not exist)."""


def saved_fingerprint(state: dict[str, Any]) -> str:
    """`common.fingerprint` of the state a checkpoint holds, from its saved dicts."""
    return common.state_fingerprint({name: state[name] for name in state["parts"]})


def shapes(state: dict[str, Any]) -> dict[tuple[str, str], tuple[int, ...]]:
    """The shape of each tensor of each network a checkpoint keeps."""
    return {(n, k): tuple(v.shape) for n in state["configs"] for k, v in state[n].items()}


def average(config: Config) -> dict[str, Any]:
    """The averaged checkpoint, written to `config.out`; ValueError, nothing written, on bad
    input."""
    if len(config.checkpoints) < 2:
        raise ValueError("name two or more checkpoints of one run to average.")
    if os.path.exists(config.out):
        raise ValueError(f"--out {config.out!r} exists; name a new file.")
    states = [load_checkpoint(path, None, RESUME_KEYS) for path in config.checkpoints]
    last = states[-1]
    if saved_fingerprint(last) != last["fingerprint"]:
        raise ValueError(
            f"checkpoint {config.checkpoints[-1]!r} holds parts this tool does not know how to "
            "fingerprint; it averages the checkpoints of ppo_ddp.py, ppo_amp_ddp.py, "
            "ppo_rnn_ddp.py and distill_ddp.py."
        )
    for path, state in zip(config.checkpoints, states):
        if (state["script"], state["configs"], shapes(state)) != (
            last["script"],
            last["configs"],
            shapes(last),
        ):
            raise ValueError(
                f"checkpoint {path!r} holds networks built otherwise than "
                f"{config.checkpoints[-1]!r}'s; average checkpoints of one run."
            )
    for name in last["configs"]:  # the networks; their normalizers' statistics stay the last's
        for key, value in last[name].items():
            if "normalizer" not in key and value.is_floating_point():
                mean = torch.stack([state[name][key].double() for state in states]).mean(0)
                last[name][key] = mean.to(value.dtype)
    last["fingerprint"] = saved_fingerprint(last)
    os.makedirs(os.path.dirname(os.path.abspath(config.out)), exist_ok=True)
    atomic_write(config.out, lambda f: torch.save(last, f))
    print(f"{config.out}: the mean of {len(states)} checkpoints' networks")
    return last


if __name__ == "__main__":
    run_tool(average, Config)
