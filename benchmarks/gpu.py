"""Throughput on one GPU: ppo_ddp.py next to rsl_rl 5.5.1's OnPolicyRunner, on the same batched
pendulum.

For each size (envs per GPU) it trains `ppo_ddp.py` in this process (one rank), eagerly and with
`--cuda-graphs`, and, when `rsl-rl-lib` is installed, rsl_rl's `OnPolicyRunner` with the same PPO
(ppo_ddp.py's defaults, given to it by vs_rsl_rl.py's `rsl_rl_config`: [64, 64] ELU actor and critic
with observation normalization, 32 steps per env, 5 epochs x 4 mini-batches, adaptive learning
rate), on the same torch Pendulum (`envs/pendulum.py`, behind rsl_rl's TensorDict interface:
vs_rsl_rl.py's `RslRlEnv`). It prints the median global FPS over the second half of the iterations,
how far the graphed run's first iterations are from the eager run's (same seed: equal up to float
rounding), and, with `--profile` on CUDA, what one iteration costs: CUDA kernels launched, host
synchronizations, GPU-busy time.

    pip install rsl-rl-lib==5.5.1                  # optional: the side-by-side column
    python benchmarks/gpu.py            # 4,096 / 32,768 / 262,144 envs on cuda, with --profile
    python benchmarks/gpu.py --device cpu --sizes 64 --iterations 4 --no-profile   # a smoke run

Run it from the repository root; results go to stdout as Markdown.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from vs_rsl_rl import RslRlEnv, rsl_rl_config  # noqa: E402  (benchmarks/, beside this file)

import arguments  # noqa: E402
import common  # noqa: E402
import ppo_ddp  # noqa: E402
from envs.pendulum import Pendulum  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# What the host calls to start GPU work: a graph replay is one launch for all of its kernels.
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
)


@dataclass
class Config:
    sizes: tuple[int, ...] = (4096, 32768, 262144)
    """Envs per GPU."""
    iterations: int = 30
    """Iterations per run; FPS is the median over the second half."""
    device: str = "cuda"
    """`cuda` (one GPU) or `cpu` (a smoke run)."""
    profile: bool = True
    """Profile one iteration of each run (the fifth): CUDA kernels, host syncs, GPU-busy time (all 0
    on CPU)."""
    extra: list[str] = field(default_factory=list)
    """More ppo_ddp.py arguments for our runs (e.g. `--extra --compile inductor`)."""
    graphs: bool = True
    """Also run ppo_ddp.py with `--cuda-graphs` (on CPU it runs eagerly, with a note)."""


def profiled(device: str) -> Any:
    """A torch.profiler that records the fifth iteration (one step per iteration)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * device.startswith("cuda")
    return profile(activities=activities, schedule=schedule(wait=3, warmup=1, active=1))


def iteration_costs(prof: Any) -> dict[str, float]:
    """Kernels run, launches from the host, host syncs and GPU-busy milliseconds of the profiled
    iteration."""
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:  # the union of the kernels' intervals
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    syncs = sum(1 for e in events if e.name in SYNC_CALLS)
    launches = sum(1 for e in events if e.name in LAUNCH_CALLS)
    return {"kernels": len(kernels), "launches": launches, "syncs": syncs, "busy_ms": busy / 1000}


def run_ours(
    num_envs: int, cfg: Config, extra: tuple[str, ...] = ()
) -> tuple[float, dict[str, float], list[dict]]:
    """ppo_ddp.py in this process -> (median FPS over the second half, profile of one iteration,
    metrics rows)."""
    sizes = ["--num-envs", str(num_envs), "--iterations", str(cfg.iterations)]
    args = tyro.cli(ppo_ddp.Args, args=[*sizes, *cfg.extra, *extra])
    prof = profiled(cfg.device) if cfg.profile else None
    original = common.reduce_logs

    def reduce_logs(*a: Any, **k: Any) -> Any:  # at the end of every iteration: one profiler step
        if prof is not None:
            prof.step()
        return original(*a, **k)

    with tempfile.TemporaryDirectory() as run_dir:
        run = {"run_dir": run_dir, "device": cfg.device, "logger": "none", "save_interval": 10**9}
        args = arguments.with_values(args, run)
        common.reduce_logs = reduce_logs
        try:
            if prof is not None:
                prof.start()
            with contextlib.redirect_stdout(io.StringIO()):  # its line per iteration
                ppo_ddp.main(args)
        finally:
            common.reduce_logs = original
            if prof is not None:
                prof.stop()
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    fps = [row["fps"] for row in rows]
    return (
        statistics.median(fps[len(fps) // 2 :]),
        iteration_costs(prof) if prof is not None else {},
        rows,
    )


def largest_difference(a: list[dict], b: list[dict], iterations: int = 3) -> float:
    """The largest relative difference between two runs' loss statistics over their first
    iterations."""
    keys = ("kl", "surrogate_loss", "value_loss", "entropy", "learning_rate")
    return max(
        abs(x[k] - y[k]) / max(abs(x[k]), 1e-12)
        for x, y in zip(a[:iterations], b[:iterations])
        for k in keys
    )


def run_rsl_rl(num_envs: int, cfg: Config) -> tuple[float, dict[str, float]]:
    """rsl_rl's OnPolicyRunner in this process -> (median FPS over the second half, profile of one
    iteration)."""
    from rsl_rl.runners import OnPolicyRunner

    torch.manual_seed(1)
    env = RslRlEnv(Pendulum(num_envs, cfg.device, seed=1))
    config = rsl_rl_config(ppo_ddp.Args(), {"actor": ["policy"], "critic": ["policy"]})
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its networks
        runner = OnPolicyRunner(env, config, log_dir=None, device=cfg.device)
    prof = profiled(cfg.device) if cfg.profile else None
    seconds: list[float] = []
    original: Callable = runner.logger.log

    def log(
        *a: Any, collect_time: float, learn_time: float, **k: Any
    ) -> None:  # the runner's own timings
        seconds.append(collect_time + learn_time)
        if prof is not None:
            prof.step()
        original(*a, collect_time=collect_time, learn_time=learn_time, **k)

    runner.logger.log = log
    if prof is not None:
        prof.start()
    try:
        runner.learn(cfg.iterations, init_at_random_ep_len=True)
    finally:
        if prof is not None:
            prof.stop()
    fps = [num_envs * 32 / s for s in seconds]
    return statistics.median(fps[len(fps) // 2 :]), iteration_costs(
        prof
    ) if prof is not None else {}


def main(cfg: Config) -> None:
    try:
        import rsl_rl  # noqa: F401

        have_rsl_rl = True
    except ImportError:
        have_rsl_rl = False
        print(
            "rsl-rl-lib is not installed (pip install rsl-rl-lib==5.5.1): ppo_ddp.py alone.",
            flush=True,
        )
    nothing = (float("nan"), {}, [])
    rows = []
    for size in cfg.sizes:
        started = time.time()
        eager = run_ours(size, cfg)
        graphed = run_ours(size, cfg, ("--cuda-graphs",)) if cfg.graphs else nothing
        theirs = run_rsl_rl(size, cfg)[:2] + ([],) if have_rsl_rl else nothing
        gap = largest_difference(eager[2], graphed[2]) if cfg.graphs else float("nan")
        rows.append((size, eager, graphed, theirs, gap))
        print(
            f"{size} envs: ppo_ddp.py {eager[0]:,.0f} FPS, with --cuda-graphs {graphed[0]:,.0f} "
            f"(first 3 iterations within {gap:.1e} of eager), rsl_rl {theirs[0]:,.0f} "
            f"({time.time() - started:.0f} s)",
            flush=True,
        )
    name = torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "CPU"
    print(
        f"\n{name}, torch {torch.__version__}, one process, {cfg.iterations} iterations, extra: "
        f"{cfg.extra}\n"
    )
    print(
        "| envs per GPU | `ppo_ddp.py` FPS | `--cuda-graphs` FPS | rsl_rl 5.5.1 FPS | ratio | "
        "`--cuda-graphs` ratio |"
    )
    print("|---|---|---|---|---|---|")
    for size, eager, graphed, theirs, _ in rows:
        print(
            f"| {size:,} | {eager[0]:,.0f} | {graphed[0]:,.0f} | {theirs[0]:,.0f} | "
            f"{eager[0] / theirs[0]:.2f} | {graphed[0] / theirs[0]:.2f} |"
        )
    if cfg.profile:
        print(
            "\nOne iteration under torch.profiler (kernels run, launches from the host, host "
            "syncs, GPU-busy ms):\n"
        )
        print("| envs per GPU | run | kernels | launches | host syncs | GPU busy ms |")
        print("|---|---|---|---|---|---|")
        for size, *runs, _ in rows:
            for label, (_, costs, _) in zip(("ppo_ddp.py", "--cuda-graphs", "rsl_rl 5.5.1"), runs):
                cells = [
                    costs.get(k, float("nan")) for k in ("kernels", "launches", "syncs", "busy_ms")
                ]
                print(
                    f"| {size:,} | {label} | {cells[0]:,.0f} | {cells[1]:,.0f} | {cells[2]:,.0f} | "
                    f"{cells[3]:.1f} |"
                )


if __name__ == "__main__":
    main(tyro.cli(Config))
