"""ppo_ddp.py next to rsl_rl 5.5.1's own OnPolicyRunner: the same env, the same settings, the same
env steps.

For each seed, three runs, one after another, each process on one thread:
- `rsl_rl`: rsl-rl-lib's `OnPolicyRunner` in this process, on the task behind its VecEnv interface
  (`RslRlEnv`: TensorDict observations, the only glue), `--num-envs` envs;
- `ppo_ddp 1x<N>`: `torchrun --nproc_per_node=1 ppo_ddp.py` with the same `--num-envs`;
- `ppo_ddp <P>x<N/P>`: `--nproc <P>` processes with `N/P` envs each, the same global batch.

The settings are ppo_ddp.py's for the task (its defaults, the task's own, then `--extra`), given to
rsl_rl through `rsl_rl_config`, which refuses in one line what rsl_rl has no key for (joint
clipping, a fresh mini-batch order every epoch, a linear schedule, reward scaling, ...). The return
and episode length are the mean over the last 100 episodes finished: rsl_rl's own logged `Mean
reward` (its `rewbuffer`), and for ppo_ddp.py the newest iterations of metrics.jsonl until they hold
100 episodes, weighted by their counts (`last_episodes_mean`). The table gives them at fractions of
the budget (`--points`) as mean ± standard error over seeds, and marks where two columns differ by
more than twice the standard error of their difference. `--plot` writes the return against env steps
(matplotlib).

Each run writes `<out>/<trainer>_seed<seed>.json` (its series, wall time, load average); a run whose
`.json` exists is read, not run again, so more seeds add only theirs and the same command prints the
table again.

    pip install -r requirements-dev.txt      # rsl-rl-lib 5.5.1, tensordict, matplotlib
    python benchmarks/vs_rsl_rl.py --task pendulum --seeds 1 2 3 4 5  # 2 minutes a seed, 2 cores
    python benchmarks/vs_rsl_rl.py --iterations 4 --seeds 1 --num-envs 32 \\
        --out runs/smoke_vs_rsl_rl  # a smoke run

Run it from the repository root; the tables go to stdout as Markdown.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import arguments  # noqa: E402
import envs  # noqa: E402
import ppo_ddp  # noqa: E402

# env_steps, return, length: one value per iteration (None before an episode ends)
Series = dict[str, list]


@dataclass
class Config:
    task: str = "pendulum"
    """The env both trainers train on: a built-in task or `module:function` (envs.make_env)."""
    seeds: tuple[int, ...] = (1, 2, 3)
    num_envs: int = 256
    """Envs in all: rsl_rl's and the one-process run's; the `--nproc` run splits them."""
    nproc: int = 2
    """Processes of the data-parallel run."""
    iterations: int = 125
    extra: str = ""
    """More ppo_ddp.py arguments (e.g. `--extra="--max-grad-norm 0.5"`), given to rsl_rl too."""
    points: tuple[float, ...] = (0.2, 0.4, 0.6, 1.0)
    """Fractions of the budget the table shows."""
    digits: int = 1
    """Decimals of the return in the table."""
    out: str = "runs/vs_rsl_rl"
    plot: str | None = None
    """Where to write the plot of the return (needs matplotlib)."""


# --- The same settings for both trainers ---------------------------------------------------------


def ppo_args(cfg: Config, num_envs: int) -> ppo_ddp.Args:
    """ppo_ddp.py's arguments for one process of `num_envs` envs: the defaults, the task's, then
    `--extra`."""
    argv = ["--task", cfg.task, "--num-envs", str(num_envs), *shlex.split(cfg.extra)]
    with contextlib.redirect_stdout(
        io.StringIO()
    ):  # the line on the task's settings: printed by the runs
        return arguments.parse_args(ppo_ddp.Args, envs.task_defaults, argv)


def rsl_rl_config(args: ppo_ddp.Args, groups: dict[str, list[str]]) -> dict[str, Any]:
    """rsl_rl 5.5.1's OnPolicyRunner configuration that trains as `args` does; `groups`: the
    observation groups actor and critic read. Raises ValueError on a setting rsl_rl has no key for.
    """
    missing = {
        "--grad-clip joint": args.grad_clip == "joint",
        "--schedule linear": args.schedule == "linear",
        "--shuffle every-epoch": args.shuffle == "every-epoch",
        "--activation tanh (CleanRL's orthogonal init)": args.activation == "tanh",
        "--scale-rewards": args.scaling.scale_rewards,
        "--rnd-weight": args.rnd.rnd_weight > 0,
        "--symmetry": args.mirror.symmetry is not None,
    }
    refused = [flag for flag, set_ in missing.items() if set_]
    if refused:
        raise ValueError(
            f"rsl_rl's OnPolicyRunner has no setting for {', '.join(refused)}; leave it out of "
            "--extra."
        )

    def model(hidden: tuple[int, ...]) -> dict[str, Any]:
        return {
            "class_name": "MLPModel",
            "hidden_dims": list(hidden),
            "activation": args.activation,
            "obs_normalization": args.normalize_obs,
        }

    distribution = {
        "class_name": "GaussianDistribution",
        "init_std": args.init_noise_std,
        "std_type": args.std_type,
    }
    return {
        "num_steps_per_env": args.steps_per_env,
        "save_interval": 10**9,
        "obs_groups": groups,
        "algorithm": {
            "class_name": "PPO",
            "num_learning_epochs": args.epochs,
            "num_mini_batches": args.mini_batches,
            "learning_rate": args.learning_rate,
            "schedule": args.schedule,
            "desired_kl": args.desired_kl,
            "clip_param": args.clip,
            "gamma": args.gamma,
            "lam": args.lam,
            "value_loss_coef": args.value_coef,
            "entropy_coef": args.entropy_coef,
            "max_grad_norm": args.max_grad_norm,
            "use_clipped_value_loss": args.clip_value_loss,
        },
        "actor": {**model(args.actor_hidden), "distribution_cfg": distribution},
        "critic": model(args.critic_hidden),
    }


class RslRlEnv:
    """One of our envs (envs.VecEnv) behind rsl_rl 5.5.1's VecEnv interface: TensorDict
    observations."""

    def __init__(self, env: envs.VecEnv) -> None:
        self.env, self.num_envs, self.num_actions = env, env.num_envs, env.num_actions
        self.max_episode_length, self.device, self.cfg = env.max_episode_length, env.device, {}

    @property
    def episode_length_buf(self) -> torch.Tensor:
        return self.env.episode_length_buf

    @episode_length_buf.setter
    def episode_length_buf(self, value: torch.Tensor) -> None:
        self.env.episode_length_buf = value

    def get_observations(self) -> Any:
        from tensordict import TensorDict

        return TensorDict(dict(self.env.get_observations()), batch_size=[self.num_envs])

    def step(self, actions: torch.Tensor) -> tuple:
        from tensordict import TensorDict

        obs, rewards, dones, extras = self.env.step(actions)
        return TensorDict(dict(obs), batch_size=[self.num_envs]), rewards, dones, extras


# --- The runs -------------------------------------------------------------------------------------


def trainers(cfg: Config) -> list[str]:
    return [
        "rsl_rl",
        f"ppo_ddp 1x{cfg.num_envs}",
        f"ppo_ddp {cfg.nproc}x{cfg.num_envs // cfg.nproc}",
    ]


def run_rsl_rl(cfg: Config, seed: int, run_dir: str) -> Series:
    """rsl_rl's OnPolicyRunner in this process, on one thread, from `seed`, writing its TensorBoard
    log and models to `run_dir` (its episode statistics are kept only with a log writer) -> its
    series."""
    from rsl_rl.runners import OnPolicyRunner

    args = ppo_args(cfg, cfg.num_envs)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    env = envs.make_env(cfg.task, cfg.num_envs, "cpu", seed)
    obs = env.get_observations()
    groups = {"actor": list(envs.resolve_groups(obs, args.actor_obs))}
    groups["critic"] = list(envs.resolve_groups(obs, args.critic_obs, groups["actor"]))
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its networks
        runner = OnPolicyRunner(
            RslRlEnv(env), rsl_rl_config(args, groups), log_dir=run_dir, device="cpu"
        )
    series: Series = {"env_steps": [], "return": [], "length": []}
    logger, log = runner.logger, runner.logger.log

    def read_its_log(*a: Any, **k: Any) -> None:  # its own 100-episode buffers, each iteration
        series["env_steps"].append(
            (len(series["env_steps"]) + 1) * cfg.num_envs * args.steps_per_env
        )
        series["return"].append(statistics.mean(logger.rewbuffer) if logger.rewbuffer else None)
        series["length"].append(statistics.mean(logger.lenbuffer) if logger.lenbuffer else None)
        log(*a, **k)

    logger.log = read_its_log
    with contextlib.redirect_stdout(io.StringIO()):
        runner.learn(cfg.iterations, init_at_random_ep_len=args.init_at_random_ep_len)
    return series


def last_episodes_mean(
    values: list[float | None], counts: list[int], n: int = 100
) -> list[float | None]:
    """Per iteration, the mean of the last `n` episodes finished, from each iteration's mean and its
    count of episodes: the newest iterations until they hold `n`, the oldest of them weighted by the
    episodes still missing. It differs from rsl_rl's buffer only inside that oldest iteration, whose
    episodes count at their mean. None before the first episode ends."""
    out: list[float | None] = []
    for i in range(len(values)):
        total, weight = 0.0, 0
        for value, count in zip(values[i::-1], counts[i::-1]):
            if count > 0 and value is not None:
                take = min(count, n - weight)
                total, weight = total + take * value, weight + take
                if weight == n:
                    break
        out.append(total / weight if weight else None)
    return out


def run_ppo_ddp(cfg: Config, seed: int, nproc: int, run_dir: str) -> Series:
    """`ppo_ddp.py` under torchrun, `nproc` processes of `num_envs / nproc` envs -> its series (rank
    0's metrics)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "ppo_ddp.py",
        "--task",
        cfg.task,
        "--num-envs",
        str(cfg.num_envs // nproc),
        "--iterations",
        str(cfg.iterations),
        "--seed",
        str(seed),
        "--device",
        "cpu",
        "--logger",
        "none",
        "--run-dir",
        run_dir,
        *shlex.split(cfg.extra),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(
            f"{shlex.join(cmd)} failed (exit status {done.returncode}):\n{done.stderr[-2000:]}"
        )
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    counts = [row["episodes_finished"] for row in rows]
    return {
        "env_steps": [row["env_steps"] for row in rows],
        "return": last_episodes_mean([row["episode_return"] for row in rows], counts),
        "length": last_episodes_mean([row["episode_length"] for row in rows], counts),
    }


def run_one(cfg: Config, trainer: str, seed: int) -> dict[str, Any]:
    """One run, or its saved record: trainer, seed, wall time, load averages, series."""
    name = f"{trainer.replace(' ', '_')}_seed{seed}"
    path = os.path.join(cfg.out, f"{name}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    load_before, started = os.getloadavg()[0], time.time()
    run_dir = os.path.abspath(os.path.join(cfg.out, name))
    if trainer == "rsl_rl":
        series = run_rsl_rl(cfg, seed, run_dir)
    else:
        series = run_ppo_ddp(cfg, seed, int(trainer.split()[1].split("x")[0]), run_dir)
    record = {
        "trainer": trainer,
        "seed": seed,
        "wall_s": time.time() - started,
        "load_before": load_before,
    }
    record.update(load_after=os.getloadavg()[0], series=series)
    with open(path, "w") as f:
        json.dump(record, f)
    print(
        f"{name}: {record['wall_s']:.0f} s, load {load_before:.1f} -> {record['load_after']:.1f}",
        flush=True,
    )
    return record


# --- The tables and the plot ----------------------------------------------------------------------


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for one value)."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.mean(values), se


def differ(a: list[float], b: list[float]) -> bool:
    """Whether two columns' means differ by more than twice the standard error of their
    difference."""
    if len(a) < 2 or len(b) < 2:
        return False
    (ma, sa), (mb, sb) = mean_se(a), mean_se(b)
    return abs(ma - mb) > 2 * math.sqrt(sa**2 + sb**2)


def point_indices(points: Sequence[float], iterations: int) -> list[int]:
    """The iterations (from 0) at these fractions of the budget, in order, each once."""
    return sorted({max(1, round(point * iterations)) - 1 for point in points})


def table(
    names: list[str], runs: list[dict[str, Any]], key: str, indices: list[int], digits: int
) -> str:
    """Markdown: `key` at each iteration of `indices`, mean ± s.e. over seeds per trainer of
    `names`; the last column names the pairs that differ (`differ`)."""
    lines = [
        f"| env steps | {' | '.join(f'`{n}`' for n in names)} | differ by > 2 s.e. |",
        "|---" * (len(names) + 2) + "|",
    ]
    short = [name.removeprefix("ppo_ddp ") for name in names]
    for i in indices:
        cells, columns, steps = [], [], 0
        for name in names:
            series = [r["series"] for r in runs if r["trainer"] == name]
            values = [s[key][i] for s in series if s[key][i] is not None]
            steps = series[0]["env_steps"][i]
            columns.append(values)
            mean, se = mean_se(values) if values else (math.nan, math.nan)
            cells.append(f"{mean:,.{digits}f} ± {se:,.{digits}f}")
        pairs = itertools.combinations(range(len(names)), 2)
        flagged = [f"{short[a]} / {short[b]}" for a, b in pairs if differ(columns[a], columns[b])]
        lines.append(f"| {steps:,} | {' | '.join(cells)} | {', '.join(flagged) or '-'} |")
    return "\n".join(lines)


def plot(cfg: Config, runs: list[dict[str, Any]]) -> None:
    """The return against env steps, every seed a thin line, the mean over seeds a thick one."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in zip(trainers(cfg), ("tab:gray", "tab:blue", "tab:orange")):
        series = [r["series"] for r in runs if r["trainer"] == name]
        for s in series:
            ax.plot(
                s["env_steps"],
                [math.nan if v is None else v for v in s["return"]],
                color=color,
                lw=0.5,
                alpha=0.4,
            )
        means = [
            statistics.mean(v)
            if (v := [s["return"][i] for s in series if s["return"][i] is not None])
            else math.nan
            for i in range(len(series[0]["return"]))
        ]
        ax.plot(
            series[0]["env_steps"], means, color=color, lw=2, label=f"{name} ({len(series)} seeds)"
        )
    ax.set(xlabel="env steps", ylabel="return (last 100 episodes)", title=cfg.task)
    ax.legend()
    fig.tight_layout()
    fig.savefig(cfg.plot, dpi=120)
    print(f"plot: {cfg.plot}")


def main(cfg: Config) -> None:
    try:
        import rsl_rl  # noqa: F401
        import tensordict  # noqa: F401
    except ImportError:
        sys.exit(
            "this benchmark runs rsl_rl's own runner: pip install rsl-rl-lib==5.5.1 "
            "(requirements-dev.txt)"
        )
    if cfg.num_envs % cfg.nproc:
        sys.exit(
            f"--num-envs {cfg.num_envs} does not split over --nproc {cfg.nproc}: give a multiple "
            "of it."
        )
    try:
        rsl_rl_config(ppo_args(cfg, cfg.num_envs), {})
    except ValueError as error:
        sys.exit(str(error))
    os.makedirs(cfg.out, exist_ok=True)
    runs = [run_one(cfg, trainer, seed) for seed in cfg.seeds for trainer in trainers(cfg)]
    print(
        f"\n{cfg.task}, {cfg.num_envs} envs in all, {cfg.iterations} iterations, seeds "
        f"{list(cfg.seeds)}; ppo_ddp.py "
        f"{shlex.join(['--task', cfg.task, *shlex.split(cfg.extra)])}\n"
    )
    indices = point_indices(cfg.points, cfg.iterations)
    print("Return (last 100 episodes), mean ± s.e. over seeds:\n")
    print(table(trainers(cfg), runs, "return", indices, cfg.digits))
    print("\nEpisode length (last 100 episodes):\n")
    print(table(trainers(cfg), runs, "length", indices, 1))
    print(
        "\nWall time per run (s): "
        + ", ".join(
            f"{name} {statistics.mean(r['wall_s'] for r in runs if r['trainer'] == name):.0f}"
            for name in trainers(cfg)
        )
    )
    if cfg.plot:
        plot(cfg, runs)


if __name__ == "__main__":
    main(tyro.cli(Config))
