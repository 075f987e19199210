"""ppo_ddp.py next to mjlab's own trainer (rsl_rl 5.4.2's OnPolicyRunner) on one mjlab task.

For each seed, one run after another: `ppo_ddp.py --task mjlab:<task>` under `torchrun
--nproc_per_node=<nproc>` with `--envs` per process (with `--one-process`, again in 1 process with
all the envs; with `--cuda-graphs`, again with CUDA graphs), then `python -m mjlab.scripts.train
<task>` with the same envs in all: on `cuda` one process per GPU with `--envs` each, on `cpu` one
process with `nproc x envs`. Both trainers take the task's registered rsl_rl settings (networks,
steps per env, PPO), the same iterations and the same seed. For every run it reports the env steps
per second (median of the per-iteration figure over the second half of the run), the return and the
env's logs (`Metrics/*`, `Episode_Reward/*`, ...) at the same env steps (`--checkpoints`), and the
wall time of the whole command (start-up and Warp's kernels included); then a Markdown table with
the mean ± std over seeds, the return's mean ± standard error with the pairs of trainers that differ
(benchmarks/vs_rsl_rl.py's table), and with `--plot` the return against env steps.

The return is rsl_rl's `Train/mean_reward`: the mean return of the last 100 episodes finished.
mjlab's trainer logs it. ppo_ddp.py's metrics.jsonl has, per iteration, the mean return of the
episodes finished in it and their count; the benchmark takes the newest iterations until they hold
100 episodes, weighted by count (the oldest one only by the episodes still missing). It differs from
rsl_rl's buffer only inside that oldest iteration, whose episodes count at their mean. An env log at
a checkpoint is its per-iteration value averaged over the last `--log-window` iterations.

Run it from the repository root in mjlab's venv (`pip install -r requirements-mjlab.txt`, plus
matplotlib for `--plot`). Each run writes `<out>/<trainer>_seed<seed>/` (the trainer's own output),
`.log` (its console) and `.json` (its series, wall time, load average before and after). A run whose
`.json` exists is read, not run again: rerunning with more seeds adds only those, and the same
command again prints the table. Delete the `.json` to run it again.

    # One GPU: Go1 on flat ground, 4,096 envs: ppo_ddp eager, with CUDA graphs, and mjlab's trainer
    python benchmarks/mjlab.py --task Mjlab-Velocity-Flat-Unitree-Go1 --device cuda --nproc 1 \\
        --envs 4096 --iterations 300 --cuda-graphs --out runs/benchmark_mjlab_go1 \\
        --plot runs/benchmark_mjlab_go1/return.png
    # The 2-core CPU: Cartpole swing-up, 2 processes x 64 envs and 1 x 128 against mjlab's trainer
    # with 128 envs
    python benchmarks/mjlab.py --one-process --plot docs/img/mjlab_cartpole.png
    # A smoke run of the first on a CPU (minutes; a task's first build compiles Warp's kernels)
    python benchmarks/mjlab.py --task Mjlab-Velocity-Flat-Unitree-Go1 --envs 4 --iterations 2 \\
        --seeds 1 --cuda-graphs --checkpoints 0.5 1.0 --out runs/smoke_mjlab_go1

On `cpu` every process runs with `CUDA_VISIBLE_DEVICES=""` (MuJoCo Warp on Warp's CPU device) and
one OpenMP thread, as torchrun gives each rank; `--cuda-graphs` there runs eagerly, with a note.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
# The return as rsl_rl logs it, the points of the budget, and the mean ± s.e. table with the pairs
# that differ.
import torchrun_ppo  # noqa: E402
from vs_rsl_rl import last_episodes_mean, point_indices  # noqa: E402
from vs_rsl_rl import table as compare  # noqa: E402

LOG_PREFIXES = (
    "Metrics/",
    "Episode_Reward/",
    "Episode_Termination/",
)  # the env's extras["log"] keys
# env_steps, fps, return: one value per iteration; logs: key -> one value per iteration
Series = dict[str, Any]


@dataclass
class Config:
    task: str = "Mjlab-Cartpole-Swingup"
    """mjlab task id (`python -m mjlab.scripts.list_envs` lists them)."""
    seeds: tuple[int, ...] = (1, 2, 3)
    """One run of each trainer per seed."""
    nproc: int = 2
    """ppo_ddp.py's processes; mjlab's trainer: as many GPUs on cuda, one process on cpu."""
    envs: int = 64
    """Envs per process of ppo_ddp.py; mjlab's trainer gets as many in all."""
    one_process: bool = False
    """Also run ppo_ddp.py in 1 process with all the envs: it separates data parallelism from the
    trainer."""
    iterations: int = 100
    """PPO iterations of every run."""
    device: Literal["cpu", "cuda"] = "cpu"
    cuda_graphs: bool = False
    """Also run ppo_ddp.py with --cuda-graphs."""
    checkpoints: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    """Where the runs are compared, as fractions of the iterations."""
    keys: tuple[str, ...] = ("Metrics/",)
    """Env logs in the table (at the last checkpoint), by prefix."""
    log_window: int = 10
    """Iterations an env log is averaged over, up to a checkpoint."""
    extra: str = ""
    """More ppo_ddp.py arguments; mjlab's trainer does not get them."""
    out: str = "runs/benchmark_mjlab"
    plot: str = ""
    """A .png of the return against env steps, every run (needs matplotlib)."""


def trainers(cfg: Config) -> list[str]:
    """The runs of one seed, named `ppo_ddp <processes>x<envs each>` and `mjlab train`."""
    ppo = f"ppo_ddp {cfg.nproc}x{cfg.envs}"
    one = [f"ppo_ddp 1x{cfg.nproc * cfg.envs}"] * (cfg.one_process and cfg.nproc > 1)
    return [ppo, *one] + [f"{ppo} --cuda-graphs"] * cfg.cuda_graphs + ["mjlab train"]


def command(cfg: Config, trainer: str, seed: int, run_dir: str) -> list[str]:
    """The command line of one run; ppo_ddp.py takes the task's settings as its defaults, mjlab's
    trainer its own."""
    if trainer == "mjlab train":
        gpus = [str(i) for i in range(cfg.nproc)] if cfg.device == "cuda" else ["None"]
        num_envs = cfg.envs if cfg.device == "cuda" else cfg.nproc * cfg.envs
        return [
            sys.executable,
            "-m",
            "mjlab.scripts.train",
            cfg.task,
            "--gpu-ids",
            *gpus,
            "--env.scene.num-envs",
            str(num_envs),
            "--agent.max-iterations",
            str(cfg.iterations),
            "--agent.seed",
            str(seed),
            "--agent.logger",
            "tensorboard",
            "--log-root",
            run_dir,
            "--agent.run-name",
            f"seed{seed}",
        ]
    nproc, envs = trainer.split()[1].split("x")
    return [
        *torchrun_ppo.command(int(nproc)),
        "--task",
        f"mjlab:{cfg.task}",
        "--num-envs",
        envs,
        "--iterations",
        str(cfg.iterations),
        "--seed",
        str(seed),
        "--device",
        cfg.device,
        "--run-dir",
        run_dir,
        *shlex.split(cfg.extra),
    ] + ["--cuda-graphs"] * trainer.endswith("graphs")


def read_ppo(run_dir: str) -> Series:
    """ppo_ddp.py's series, from rank 0's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    keys = sorted({k for row in rows for k in row if k.startswith(LOG_PREFIXES)})
    return {
        "env_steps": [row["env_steps"] for row in rows],
        "fps": [row["fps"] for row in rows],
        "return": last_episodes_mean(
            [r["episode_return"] for r in rows], [r["episodes_finished"] for r in rows]
        ),
        "logs": {k: [row.get(k) for row in rows] for k in keys},
    }


def read_mjlab(run_dir: str, envs_in_all: int) -> Series:
    """mjlab's trainer's series, from its TensorBoard events (step: the iteration, from 0) and its
    steps per env."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(run_dir, "**", "events.out.tfevents.*"), recursive=True)
    (agent,) = glob.glob(os.path.join(run_dir, "**", "params", "agent.yaml"), recursive=True)
    with open(agent) as f:
        steps_per_env = int(
            re.search(r"^num_steps_per_env:\s*(\d+)", f.read(), re.MULTILINE).group(1)
        )
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    iterations = [e.step for e in acc.Scalars("Perf/total_fps")]

    def series(tag: str) -> list[float | None]:
        values = {e.step: e.value for e in acc.Scalars(tag)} if tag in tags else {}
        return [values.get(it) for it in iterations]

    return {
        "env_steps": [(it + 1) * steps_per_env * envs_in_all for it in iterations],
        "fps": series("Perf/total_fps"),
        "return": series("Train/mean_reward"),
        "logs": {k: series(k) for k in sorted(t for t in tags if t.startswith(LOG_PREFIXES))},
    }


def run_one(cfg: Config, trainer: str, seed: int) -> dict[str, Any]:
    """One run, or its saved record: trainer, seed, wall time, load averages, series."""
    name = f"{trainer.replace(' --', '_').replace(' ', '_')}_seed{seed}"
    run_dir, record_path = os.path.join(cfg.out, name), os.path.join(cfg.out, f"{name}.json")
    if os.path.exists(record_path):
        with open(record_path) as f:
            return json.load(f)
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ)
    if cfg.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = command(cfg, trainer, seed, os.path.abspath(run_dir))
    load_before, started = os.getloadavg()[0], time.time()
    with open(os.path.join(cfg.out, f"{name}.log"), "w") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"{name} failed (exit status {done.returncode}); see {cfg.out}/{name}.log")
    wall_s, load_after = time.time() - started, os.getloadavg()[0]
    series = (
        read_mjlab(run_dir, cfg.nproc * cfg.envs) if trainer == "mjlab train" else read_ppo(run_dir)
    )
    record = {"trainer": trainer, "seed": seed, "command": shlex.join(cmd), "wall_s": wall_s}
    record.update(load_before=load_before, load_after=load_after, series=series)
    with open(record_path, "w") as f:
        json.dump(record, f)
    print(f"{name}: {wall_s:.0f} s, load {load_before:.1f} -> {load_after:.1f}", flush=True)
    return record


def at(cfg: Config, series: Series, fraction: float) -> dict[str, Any]:
    """The run at a fraction of its iterations: env steps, return, env logs averaged over
    `log_window` iterations."""
    (i,) = point_indices([fraction], len(series["env_steps"]))
    logs = {}
    for key, values in series["logs"].items():
        seen = [v for v in values[max(0, i + 1 - cfg.log_window) : i + 1] if v is not None]
        logs[key] = statistics.mean(seen) if seen else None
    return {"env_steps": series["env_steps"][i], "return": series["return"][i], "logs": logs}


def mean_std(values: list[float | None], digits: int) -> str:
    """`mean ± std` of the values given (one value: itself; none: `–`)."""
    seen = [v for v in values if v is not None]
    if not seen:
        return "–"
    text = f"{statistics.mean(seen):,.{digits}f}"
    return text + (f" ± {statistics.stdev(seen):,.{digits}f}" if len(seen) > 1 else "")


def table(cfg: Config, runs: list[dict[str, Any]]) -> str:
    """Markdown: a row per run, then per trainer the mean ± std over seeds."""
    for r in runs:
        r["points"] = [at(cfg, r["series"], f) for f in cfg.checkpoints]
        r["fps"] = statistics.median(r["series"]["fps"][len(r["series"]["fps"]) // 2 :])
    n = len(cfg.checkpoints)
    keys = sorted({k for r in runs for k in r["points"][-1]["logs"] if k.startswith(cfg.keys)})
    header = ["trainer", "seed", "env steps/s"] + [
        f"return at {p['env_steps']:,}" for p in runs[0]["points"]
    ]
    header += [f"{k} (end)" for k in keys] + ["wall time", "load (1 min) before, after"]

    def row(group: list[dict[str, Any]], seed: str) -> str:
        cells = [group[0]["trainer"], seed, mean_std([r["fps"] for r in group], 0)]
        cells += [mean_std([r["points"][i]["return"] for r in group], 2) for i in range(n)]
        cells += [mean_std([r["points"][-1]["logs"].get(k) for r in group], 3) for k in keys]
        cells.append(mean_std([r["wall_s"] for r in group], 0) + " s")
        cells.append("; ".join(f"{r['load_before']:.1f}, {r['load_after']:.1f}" for r in group))
        return "| " + " | ".join(cells) + " |"

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [row([r], str(r["seed"])) for r in runs]
    for trainer in dict.fromkeys(r["trainer"] for r in runs):
        group = [r for r in runs if r["trainer"] == trainer]
        if len(group) > 1:
            lines.append(row(group, "mean ± std"))
    return "\n".join(lines)


def plot(cfg: Config, runs: list[dict[str, Any]]) -> None:
    """The return (last 100 episodes) against env steps: a line per run, a colour per trainer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(trainers(cfg), ("tab:blue", "tab:green", "tab:red", "tab:orange")))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labelled = set()
    for r in runs:
        points = [
            (s, v) for s, v in zip(r["series"]["env_steps"], r["series"]["return"]) if v is not None
        ]
        if points:  # none before the first episode ends
            label = None if r["trainer"] in labelled else r["trainer"]
            labelled.add(r["trainer"])
            ax.plot(*zip(*points), color=colours[r["trainer"]], alpha=0.8, label=label)
    ax.set_xlabel("env steps (all processes)")
    ax.set_ylabel("return, mean of the last 100 episodes")
    seeds = ", ".join(str(s) for s in cfg.seeds)
    ax.set_title(
        f"{cfg.task}, {cfg.nproc * cfg.envs} envs in all, {cfg.device}, seeds {seeds}", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(cfg.plot)), exist_ok=True)
    fig.savefig(cfg.plot, dpi=110)
    print(f"wrote {cfg.plot}")


def main(cfg: Config) -> None:
    os.makedirs(cfg.out, exist_ok=True)
    runs = [run_one(cfg, trainer, seed) for seed in cfg.seeds for trainer in trainers(cfg)]
    runs.sort(key=lambda r: trainers(cfg).index(r["trainer"]))  # stable: by trainer, then seed
    print(
        f"\n{cfg.task}: ppo_ddp.py {cfg.nproc} x {cfg.envs} envs, mjlab's trainer as many in all, "
        f"{cfg.iterations} iterations, {cfg.device}\n"
    )
    print(table(cfg, runs))
    if len(cfg.seeds) > 1:
        indices = point_indices(cfg.checkpoints, cfg.iterations)
        print("\nReturn (last 100 episodes), mean ± standard error over seeds:\n")
        print(compare(trainers(cfg), runs, "return", indices, 2))
    if cfg.plot:
        plot(cfg, runs)


if __name__ == "__main__":
    main(tyro.cli(Config))
