"""Evaluate a trained policy: N episodes of its deterministic action, mean and std of return and
length.

Works on checkpoints of ppo_ddp.py, ppo_amp_ddp.py, ppo_rnn_ddp.py (the actor's mean action; a
recurrent one's memory carried from step to step, blank at each episode's start) and distill_ddp.py
(the student), on the task they are scored on or another one with the same observation groups, for
built-in tasks, `gym:` and `envpool:` tasks and your own `module:function`. The task scored on is
the one trained on, unless its module names another (envs/<task>.py `EVAL_TASK`: a robot's plain
id, whose reward is the robot's own, not the training task's shaped one); tools/play.py plays the
same by default. One process; one episode per env, all envs stepped together, each starting fresh
from `--seed`.

    python tools/evaluate.py runs/ppo_pendulum/<time>                # newest checkpoint of the run
    python tools/evaluate.py runs/ppo_pendulum/<time>/model_250.pt --episodes 1000 --device cuda
    python tools/evaluate.py data/pendulum_partial_teacher.pt --task pendulum_partial

Prints the task whose reward it sums, `return <mean> ± <std> | length <mean> ± <std>`, then the
mean per step of every value the env logs (an EnvPool robot's reward terms:
`reward_tracking_lin_vel` ...), and writes them, with every episode's return, as JSON (`--out`;
default `eval_<iteration>.json` beside the checkpoint; for a shipped policy, under `runs/`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Annotated

import torch
import tyro
from policy import common, envs, load_policy, output_path, run_episodes, run_tool


@dataclass
class Config:
    checkpoint: Annotated[str, tyro.conf.Positional]
    """A checkpoint file (`model_<iteration>.pt`) or a run directory (its newest checkpoint)."""
    task: str | None = None
    """Task to evaluate on; default: the one the checkpoint is scored on (its training task, or
    the task its module names: envs/<task>.py `EVAL_TASK`)."""
    episodes: int = 100
    """Episodes, one per env, stepped as one batch."""
    seed: int = 0
    """Env seed: the same seed gives the same episodes."""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto` (a GPU if there is one)."""
    out: str | None = None
    """Where to write the JSON; default `eval_<iteration>.json` beside the checkpoint (a shipped
    policy's: under `runs/`, see `policy.output_path`)."""
    zero_actions: bool = False
    """Act with zeros instead of the policy, on the same episodes: the baseline of a robot that
    holds its default pose (the checkpoint gives the task and its observation groups). Written to
    `eval_zero_actions.json`."""


class ZeroActions(torch.nn.Module):
    """A stand-in for a deployed actor that always acts with zeros: for a Playground robot, its
    default pose."""

    def __init__(self, num_actions: int) -> None:
        super().__init__()
        self.num_actions = num_actions

    def forward(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        group = next(iter(obs.values()))
        zeros = torch.zeros(group.shape[0], self.num_actions, device=group.device)
        return zeros, torch.ones_like(zeros)


def evaluate(config: Config) -> dict:
    """Run the episodes; print and write the result, and return it."""
    if config.episodes < 1:
        raise ValueError(f"--episodes {config.episodes} (must be at least 1).")
    # `auto`, or one line for a missing GPU
    device = common.resolve_device(config.device, local_rank=0)
    policy = load_policy(config.checkpoint, device)
    if config.zero_actions:
        policy = dataclasses.replace(
            policy, script="zeros", network=ZeroActions(policy.num_actions)
        )
    task = config.task or policy.eval_task
    torch.manual_seed(config.seed)
    env = envs.make_env(task, config.episodes, device, config.seed)
    returns, lengths, _, terms = run_episodes(policy, env)
    result = {
        "checkpoint": policy.path,
        "iteration": policy.iteration,
        "policy": {"distill": "student", "zeros": "zero actions"}.get(policy.script, "actor mean"),
        "task": task,
        "seed": config.seed,
        "episodes": config.episodes,
        "return_mean": returns.mean().item(),
        "return_std": returns.std(correction=0).item(),
        "length_mean": lengths.mean().item(),
        "length_std": lengths.std(correction=0).item(),
        # the mean per step of each value the env logs (an EnvPool robot's reward terms)
        "terms": terms,
        "returns": returns.tolist(),
    }
    name = "zero_actions" if config.zero_actions else policy.iteration
    out = config.out or output_path(policy, f"eval_{name}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    shown = "".join(f" | {k} {v:.3g}" for k, v in terms.items())
    print(
        f"{task}'s reward, {config.episodes} episodes, {result['policy']} of {policy.path}: "
        f"return {result['return_mean']:.1f} ± {result['return_std']:.1f} | length "
        f"{result['length_mean']:.1f} ± {result['length_std']:.1f}{shown}; written to {out}"
    )
    return result


if __name__ == "__main__":
    run_tool(evaluate, Config)
