"""Run bookkeeping the scripts share, none of it the algorithm or the sync: the run's arguments and the command
line, the start-up every rank makes alone, the run directory and its lock, metrics and rank-0 loggers, saving
checkpoints (their files: checkpoints.py), and the after-update sequence every loop ends its iteration with. The
distributed mechanism it uses is common.py's.

Every function that talks to other ranks says so in its docstring, and every rank must call it in
the same order: a collective that one rank skips is a hang.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
import tyro

import checkpoints
import common
import cuda_graphs
import envs
from common import Dist, Failure

# --- Arguments and the command line ---------------------------------------------------------------


@dataclass
class RunArgs:
    """The arguments every script shares: task, sizes per process, seeds, device, the run's directory, logs and checks."""

    task: str = "pendulum"
    """Built-in (`pendulum`, `reacher`, `pendulum_partial`, `pendulum_sparse`, `pendulum_angle`, `pendulum_image`),
    an adapter (`gym:<id>`, `gym-async:<id>`, `envpool:<id>`, `mjlab:<id>`, `isaaclab:<id>`) or your `module:function`."""
    num_envs: common.Count = 256
    """Environments per process; the global batch grows with the number of processes."""
    steps_per_env: common.Count = 32
    """Rollout length per iteration (rsl_rl's num_steps_per_env)."""
    init_at_random_ep_len: bool = True
    """Start each env at a random point of its time limit, so rollouts mix all phases of an episode."""
    seed: int = 1
    """Base seed; rank r uses seed + r (moved on by the iteration when resuming)."""
    device: str = "auto"
    """`auto` (cuda:LOCAL_RANK if there is a GPU, else cpu), `cpu`, `cuda` (cuda:LOCAL_RANK: one GPU per
    process) or `cuda:N` (GPU N, for a single process)."""
    pin_cores: bool = True
    """On CPU with several processes per machine, bind each one's training thread, and the threads it starts,
    to its own share of the cores. `--no-pin-cores`: the OS places them (for jobs that share a machine)."""
    run_dir: str | None = None
    """Where rank 0 writes metrics and checkpoints; default runs/<script>_<task>/<time>, or the resumed run's."""
    save_interval: common.Count = 50
    """Checkpoint every this many iterations (and at the end)."""
    keep_checkpoints: common.Count = 5
    """How many of the newest checkpoints to keep."""
    resume: str | None = None
    """Checkpoint file or run directory to continue from; `auto`: the `--run-dir`'s newest checkpoint if it
    has one, else a fresh start (what a job restarted by `torchrun --max-restarts` needs)."""
    check_interval: Annotated[int, common.Range(0)] = 50
    """Every this many iterations, compare a hash of the trained state across ranks (0: never)."""
    dist_timeout_s: common.Positive = 60.0
    """Seconds a collective may wait for a lost rank before the job fails."""
    start_timeout_s: common.Positive = 1200.0
    """Seconds the ranks wait for each other at start-up (building envs: a simulator may take minutes)."""
    stop_grace_s: common.Positive = 25.0
    """Seconds a rank has, after SIGTERM or Ctrl-C, to end its iteration and save; past them (waiting for a
    rank that hangs) it exits with one line. torchrun, SLURM and Kubernetes kill 30 s after their SIGTERM."""
    logger: Literal["tensorboard", "wandb", "neptune", "none"] = "tensorboard"
    """Where rank 0 logs besides metrics.jsonl (always written), under rsl_rl's metric names. W&B and
    Neptune take their other settings from the environment (WANDB_MODE=offline, NEPTUNE_MODE, ...)."""
    logger_project: str | None = None
    """W&B project (default: the script's name) or Neptune project `workspace/name` (default: NEPTUNE_PROJECT)."""


def check_args(args: RunArgs, mini_batches: int | None = None) -> None:
    """Raise one ValueError naming every argument out of the range its field gives (`common.Range`), or an
    uneven mini-batch split of the rollout into `mini_batches`. Local."""
    bad = common.out_of_range(args)
    if bad:
        raise ValueError(f"bad argument{'s' * (len(bad) > 1)}: {'; '.join(bad)}.")
    if args.logger in ("wandb", "neptune") and importlib.util.find_spec(args.logger) is None:  # finds, not imports
        raise ValueError(f"--logger {args.logger} needs its package: pip install {args.logger}, or pass --logger none.")
    if mini_batches is not None and (args.num_envs * args.steps_per_env) % mini_batches:
        raise ValueError(
            f"num_envs * steps_per_env = {args.num_envs * args.steps_per_env} is not divisible by mini_batches = {mini_batches}; change --num-envs, --steps-per-env or --mini-batches."
        )


def cli(
    main: Callable[[Any], Any],
    args_type: type,
    task_defaults: Callable[[str], tuple[dict[str, Any], str]] | None = None,
) -> None:
    """The scripts' entry point: parse the command line (rank 0 alone prints help, a usage error, and the
    settings the task brought: the command line is the same on every rank), run `main(args)`, exit
    with 1 on a `Failure`. `task_defaults`: see `parse_args`."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        with open(os.devnull, "w") as null, contextlib.ExitStack() as stack:
            if rank:
                stack.enter_context(contextlib.redirect_stdout(null))
                stack.enter_context(contextlib.redirect_stderr(null))
            args = parse_args(args_type, task_defaults)  # SystemExit on --help or a usage error
        main(args)
    except cuda_graphs.CompileFailed as failed:  # the same on every rank: rank 0 says it
        if rank == 0:
            print(f"error: {failed}", file=sys.stderr, flush=True)
        sys.exit(1)
    except (Failure, SystemExit) as stop:
        code, speaker = (1, stop.speaker) if isinstance(stop, Failure) else (stop.code, 0)
        if code and rank != speaker and "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(5)  # torchrun stops every rank once one fails: let the one that speaks print first
        sys.exit(code)
    except KeyboardInterrupt:  # Ctrl-C before the run's stop handler is in place (start-up), or a second one
        held = [*_RUN_DIR_LOCKS]  # rank 0's run directory, once it has one
        then = f"continue from its newest checkpoint with --resume {held[0]}" if held else "run the command again"
        if rank == 0:
            print(f"error: interrupted (Ctrl-C); no checkpoint was damaged: {then}.", file=sys.stderr, flush=True)
        sys.exit(130)
    except RuntimeError as error:  # gloo's, when another worker of a torchrun job died: one line, not a traceback
        lost = re.search(r"Connection (reset|closed) by peer", str(error))
        if lost is None or "TORCHELASTIC_RUN_ID" not in os.environ:
            raise
        print(f"error: rank {rank} lost another rank ({lost.group(0)}): a worker died (its own output says why) or "
              "was killed; torchrun starts the job again if --max-restarts allows, and --resume auto continues "
              "from the newest checkpoint.", file=sys.stderr, flush=True)  # fmt: skip
        sys.exit(1)
    finally:
        release_run_dir()  # rank 0's hold on its run directory, also after a failure


def parse_args(
    args_type: type,
    task_defaults: Callable[[str], tuple[dict[str, Any], str]] | None = None,
    argv: list[str] | None = None,
) -> Any:
    """The command line (`argv`, default sys.argv) as `args_type`. With `task_defaults(task)` (a field -> value
    map and its source, envs.task_defaults), the task's family supplies defaults of its own, an argument given
    on the command line always wins, and one line says which settings the run took from the task, and whence. `--help` opens
    with the script's own docstring: what it trains and how to launch it."""
    doc = sys.modules[args_type.__module__].__doc__ or ""
    description = doc.strip().split("\n\n")[0] + ("\n\n" + doc[doc.index("Launch:") :] if "Launch:" in doc else "")
    args = tyro.cli(args_type, args=argv, description=description)
    fields = {field.name for field in dataclasses.fields(args_type)}
    brought, source = task_defaults(args.task) if task_defaults else ({}, "")
    brought = {k: tuple(v) if isinstance(v, list) else v for k, v in brought.items() if k in fields}
    if not brought:
        return args
    plain = args_type()
    with_task = tyro.cli(args_type, args=argv, default=dataclasses.replace(plain, **brought), description=description)
    # Taken from the task: what the command line left at the script's default, and the task changes.
    taken = [k for k, v in brought.items() if getattr(args, k) == getattr(plain, k) != v == getattr(with_task, k)]
    if taken:
        flags = " ".join(cli_flag(k, getattr(with_task, k)) for k in taken)
        print(
            f"settings from {args.task} ({source}): {flags} (an argument on the command line overrides any)", flush=True
        )
    return with_task


def cli_flag(name: str, value: Any) -> str:
    """How `value` of field `name` is written on the command line: `--num-envs 64`, `--no-normalize-obs`."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, tuple) else value}"


# --- What a rank trains, and where it starts -------------------------------------------------------


def start_rank(args: RunArgs, ctx: Dist, script: str) -> tuple[checkpoints.ResumeFrom, envs.VecEnv, dict]:
    """The start-up every script makes on each rank alone, inside `common.start_together` -> (the checkpoint
    to continue, one `script` wrote: `--resume`, with `auto` the `--run-dir`'s newest readable one, a fresh
    start without; this rank's env; its first observations). The rank's seed, from the base seed, the rank
    and the first iteration, seeds all that is drawn from here on: env start times, network initialization,
    action noise. Local."""
    resume_from = checkpoints.load_resume(args.resume, args.run_dir, script, ctx.is_main)
    seed = envs.rank_seed(args.seed, ctx.rank, resume_from.first_iteration)
    torch.manual_seed(seed)
    env = envs.make_env(args.task, args.num_envs, ctx.device, seed, args.init_at_random_ep_len)
    return resume_from, env, env.get_observations()


# --- The run directory, metrics and loggers -------------------------------------------------------


@dataclass
class RunLog:
    """Bookkeeping of one training run: what it trains and saves, where rank 0 writes, the counters, the
    stop request."""

    args: RunArgs
    trained: checkpoints.Trained
    saved_with: dict[str, Any]  # written into every checkpoint beside the state (distillation's teacher)
    dir: str
    first_iteration: int
    total_iterations: int
    env_steps: int  # over all ranks, since the first iteration of the first run
    steps_per_iteration: int  # over all ranks
    stop_requested: Callable[[], bool]
    logger: tuple[Callable[[dict[str, float], int], Any], Callable[[], Any]] | None = None  # (write, close), rank 0
    start_time: float = 0.0
    last_return: float | None = None  # over the latest iteration in which episodes finished
    last_length: float | None = None
    log_keys: list[str] = dataclasses.field(default_factory=list)  # the env log values seen so far, on any rank
    iteration: int = 0  # the last one completed
    last_checkpoint: str | None = None


def install_stop_handler(grace_s: float, run_dir: str) -> Callable[[], bool]:
    """Turn SIGTERM/SIGINT into a flag read at iteration boundaries; returns its reader. A second signal
    acts as usual. torchrun and cluster schedulers send one SIGTERM and kill 30 s later, and a rank that
    cannot reach the next boundary (its step hangs, or it waits in a collective for such a rank) would sit
    that out in silence: so the first signal also starts a timer that ends the process `grace_s` seconds
    on, with one line (its thread runs while the main thread waits in a collective, which releases the
    GIL). Exiting cancels it."""
    received: list[int] = []

    def give_up() -> None:
        rank = os.environ.get("RANK", "0")
        print(
            f"error: rank {rank} did not stop within --stop-grace-s {grace_s:g} s of the stop signal (a step that "
            f"hangs, or a wait for a rank that does not answer); exiting without a last checkpoint; resume from "
            f"{run_dir}.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def handler(signum: int, frame: Any) -> None:
        if not received:
            timer = threading.Timer(grace_s, give_up)
            timer.daemon = True
            timer.start()
            atexit.register(timer.cancel)  # a rank that stopped in time exits however long its teardown takes
        received.append(signum)
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return lambda: bool(received)


def start_run(
    ctx: Dist, args: RunArgs, trained: checkpoints.Trained, title: str, resume_from: checkpoints.ResumeFrom,
    saved_with: dict[str, Any] | None = None,
) -> RunLog:  # fmt: skip
    """Rank 0 takes the run directory for this job (a resumed run's by default, else
    `runs/{kind}_{task}/{time}`), checks it can write there and opens the logger; if not, every rank
    stops (one all_gather). Then rank 0 keeps only the metrics rows before the first iteration; SIGTERM
    and SIGINT become a stop request. `saved_with` goes into every checkpoint beside the state."""
    script, total, state = trained.script, args.iterations, resume_from.state
    name = args.task.replace(":", "_").replace("/", "_").replace(".", "_")
    run_dir = args.run_dir or os.path.join("runs", f"{script}_{name}", time.strftime("%Y-%m-%d_%H-%M-%S"))
    if args.resume and not args.run_dir:
        run_dir = os.path.dirname(checkpoints.resolve_checkpoint(args.resume))
    first_iteration, env_steps = (state["iteration"] + 1, state["env_steps"]) if state else (1, 0)
    # What can stop the start, as (what, what to do); rank 0 alone knows which, and the details.
    problems = [
        (f"run directory {run_dir!r} is in use by another job", "wait for it to end, or pass another --run-dir"),
        (
            f"run directory {run_dir!r} holds checkpoints of another run",
            f"continue it with --resume {run_dir} (or --resume auto), or pass another --run-dir",
        ),
        (f"rank 0 cannot write the run directory {run_dir!r}", "pass a writable --run-dir"),
        (f"rank 0 cannot start --logger {args.logger}", "fix its settings or pass --logger none"),
    ]
    problem, detail, logger, stale_events = 0, "see rank 0", None, []  # problem: 1 + its index, 0 for none
    if ctx.is_main:
        created = not os.path.exists(run_dir)
        try:
            os.makedirs(run_dir, exist_ok=True)
            if holder := take_run_dir(run_dir):  # another job's
                problem, detail = 1, holder
            elif not state and (found := checkpoints.checkpoint_files(run_dir)):  # a fresh start's would mix with them
                problem, detail = 2, f"newest {os.path.basename(found[0])}"
            else:
                checkpoints.atomic_write(os.path.join(run_dir, ".write-test"), lambda f: f.write(b"ok"))
                os.remove(os.path.join(run_dir, ".write-test"))
        except OSError as e:
            problem, detail = 3, str(e)
        if not problem and first_iteration == 1:  # a fresh start's TensorBoard curves begin anew
            stale_events = [f for f in os.listdir(run_dir) if f.startswith("events.out.tfevents.")]
        try:
            logger = None if problem else open_logger(args, script, run_dir, first_iteration)
        except Exception as e:  # noqa: BLE001 - a service that cannot start must reach the other ranks
            plain = " ".join(re.sub(r"\x1b\[[0-9;]*m|-{3,}", " ", str(e)).split())  # one line, no colors
            problem, detail = 4, f"{type(e).__name__}: {plain if len(plain) < 200 else plain[:200] + ' ...'}"
        if not problem:  # the last to change the directory: a start that stops has written nothing
            try:
                trim_metrics(run_dir, first_iteration)
                for stale in stale_events:  # an earlier attempt's curves: this run starts them again
                    os.remove(os.path.join(run_dir, stale))
            except OSError as e:
                problem, detail = 3, str(e)
        if problem > 1:  # the directory is ours: let go of it, and leave nothing behind in a new one
            release_run_dir(run_dir)
            if created:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(run_dir, ".lock"))
                    os.rmdir(run_dir)
    # Over the start-up group: opening a logger that talks to a service may take longer than --dist-timeout-s.
    problem = common.gather_at_start(ctx, [problem])[0][0]
    if problem:
        what, advice = problems[problem - 1]
        raise Failure(f"{what} ({detail}); {advice}.")
    steps_per_iteration = args.steps_per_env * args.num_envs * ctx.world_size
    stop_requested = install_stop_handler(args.stop_grace_s, run_dir)
    run = RunLog(
        args, trained, saved_with or {}, run_dir, first_iteration, total, env_steps, steps_per_iteration,
        stop_requested, logger, time.time(),
    )  # fmt: skip
    if logger is not None:
        atexit.register(close_logger, run)  # also when the run ends in a failure
    if ctx.is_main:
        seeds = [envs.rank_seed(args.seed, rank, first_iteration) for rank in range(ctx.world_size)]
        where = f"{ctx.world_size} process(es) x {args.num_envs} envs on {ctx.device}, seeds {seeds}"
        compiling = (
            f"; the first iteration compiles the steps (--compile {args.compile})"
            if getattr(args, "compile", None) and first_iteration <= total
            else ""
        )
        print(f"{title}: {where}; run dir {run_dir}{compiling}", flush=True)
        if first_iteration > total:
            reached = f"the run reached iteration {first_iteration - 1} of --iterations {total}"
            print(f"nothing to train: {reached}; pass a larger --iterations to continue.", flush=True)
    return run


def trim_metrics(run_dir: str, first_iteration: int) -> None:
    """Keep one row per iteration in `metrics.jsonl`: drop the rows an earlier attempt logged from
    `first_iteration` on. A row that does not parse (a crash in mid-write leaves half a line) is set aside in
    `metrics.jsonl.damaged`, with one line that says so, and the run goes on. Rank 0, before the start-up
    agreement on the run directory: an OSError here stops every rank with one line."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics):
        return
    kept, damaged = [], []
    with open(metrics, errors="replace") as f:
        for line in f:
            line = line if line.endswith("\n") else line + "\n"  # a whole row cut before its newline stays one
            try:
                iteration = json.loads(line)["iteration"]
            except (ValueError, TypeError, KeyError):
                damaged.append(line)
                continue
            if iteration < first_iteration:
                kept.append(line)
    if damaged:
        with open(metrics + ".damaged", "a") as f:
            f.write("".join(damaged))
        print(f"note: {len(damaged)} damaged row(s) of {metrics} (a crash in mid-write) set aside in "
              f"{metrics}.damaged; every whole row is kept.", flush=True)  # fmt: skip
    checkpoints.atomic_write(metrics, lambda f: f.write("".join(kept).encode()))


_RUN_DIR_LOCKS: dict[str, Any] = {}  # run directory -> the open lock file that holds it for this process


def take_run_dir(run_dir: str) -> str:
    """Hold `run_dir` for this job until it ends: an exclusive lock on `run_dir/.lock`, which the OS
    releases when the process exits or dies, so a crash never leaves the directory taken. Returns ""
    or, when another job holds it, who that is (pid, host, since when). Rank 0 only."""
    import fcntl  # POSIX

    key = os.path.realpath(run_dir)
    release_run_dir(key)  # an earlier run of this same process (runs in one process follow each other)
    lock = open(os.path.join(run_dir, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "process not known"
        lock.close()
        return holder
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    _RUN_DIR_LOCKS[key] = lock
    return ""


def release_run_dir(run_dir: str | None = None) -> None:
    """Let go of `run_dir` (every run directory this process holds, when None)."""
    keys = list(_RUN_DIR_LOCKS) if run_dir is None else [os.path.realpath(run_dir)]
    for key in keys:
        lock = _RUN_DIR_LOCKS.pop(key, None)
        if lock is not None:
            lock.close()


# rsl_rl's names for the scalars it logs too, so that dashboards of both compare; env log scalars go
# to "Episode/<key>" unless the key has a "/" of its own; the rest keep their metrics.jsonl names.
RSL_RL_NAMES = {
    "episode_return": "Train/mean_reward", "episode_length": "Train/mean_episode_length",
    "learning_rate": "Loss/learning_rate", "surrogate_loss": "Loss/surrogate", "value_loss": "Loss/value",
    "entropy": "Loss/entropy", "rnd_loss": "Loss/rnd", "behavior_loss": "Loss/behavior", "rnd_weight": "Rnd/weight",
    "symmetry_loss": "Loss/symmetry",
    "intrinsic_reward": "Rnd/intrinsic_reward", "extrinsic_reward": "Rnd/extrinsic_reward",
    "explained_variance": "Policy/explained_variance", "clipfrac": "Loss/clipfrac", "fps": "Perf/total_fps", "collect_s": "Perf/collection_time", "update_s": "Perf/learning_time",
}  # fmt: skip


def dashboard_name(key: str, log_keys: list[str]) -> str:
    """The name a metrics.jsonl column gets in TensorBoard, W&B and Neptune."""
    if key in log_keys and key not in RSL_RL_NAMES:
        return key if "/" in key else f"Episode/{key}"
    return RSL_RL_NAMES.get(key, key)


def open_logger(
    args: RunArgs, script: str, run_dir: str, first_iteration: int
) -> tuple[Callable[[dict[str, float], int], Any], Callable[[], Any]] | None:
    """Rank 0's `--logger` as (write(scalars, iteration), close); None for `none`, or TensorBoard not installed."""
    if args.logger == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the default, and optional: metrics.jsonl has everything
            print("TensorBoard is not installed (pip install tensorboard): logging to metrics.jsonl only.")
            return None
        writer = SummaryWriter(run_dir, purge_step=first_iteration)
        return lambda scalars, it: [writer.add_scalar(k, v, it) for k, v in scalars.items()], writer.close
    config = dataclasses.asdict(args)
    if args.logger == "wandb":
        import wandb

        name = os.path.basename(os.path.normpath(run_dir))
        run = wandb.init(project=args.logger_project or script, dir=run_dir, name=name, config=config)
        return lambda scalars, it: run.log(scalars, step=it), run.finish
    if args.logger == "neptune":
        import neptune
        from neptune.utils import stringify_unsupported

        run = neptune.init_run(project=args.logger_project, name=run_dir, capture_hardware_metrics=False)
        run["config"] = stringify_unsupported(config)
        return lambda scalars, it: [run[k].append(v, step=it) for k, v in scalars.items()], run.stop
    return None


# --- The end of every iteration ------------------------------------------------------------------


def end_iteration(
    ctx: Dist, run: RunLog, it: int, episodes: envs.Episodes, env_logs: dict[str, torch.Tensor],
    metrics: dict[str, float], t0: float, collect_s: float,
) -> bool:  # fmt: skip
    """What every training loop does after its update, in one place, so that no two loops can call their
    collectives in another order (a hang): log the iteration (`log_iteration`: 1 all_reduce, rank 0
    writes); every `--check-interval` iterations, compare a hash of the trained state across ranks (1
    all_gather); every `--save-interval` iterations, at the last and when asked to stop, save a
    checkpoint (`save_if_due`: 1 all_gather). Returns whether to stop, the same on every rank. `t0`: when
    the iteration began (`time.time()`), `collect_s`: the seconds its rollout took."""
    timings = {"collect_s": collect_s, "update_s": time.time() - t0 - collect_s}
    stop = log_iteration(ctx, run, it, episodes, env_logs, timings, metrics)
    modules, optimizers = [*run.trained.modules.values()], [*run.trained.optimizers.values()]
    common.check_ranks_agree(ctx, it, run.args.check_interval, modules, optimizers)
    save_if_due(ctx, run, it, stop, metrics.get("learning_rate"))
    return stop


def log_iteration(
    ctx: Dist, run: RunLog, it: int, episodes: envs.Episodes, env_logs: dict[str, torch.Tensor],
    timings: dict[str, float], metrics: dict[str, float],
) -> bool:  # fmt: skip
    """Reduce the iteration's statistics over ranks, rank 0 logs them; returns whether to stop. One all_reduce
    carries episode sums, env log values and stop requests: all ranks leave at the same iteration. A log
    value is a mean (a scalar) or a (sum, count) pair (`envs.accumulate_logs`); each key is averaged over
    every rank's count of it. An all_gather of the keys, and the all_reduce again, when a key is new."""
    while True:
        pairs = [log_pair(env_logs.get(k), ctx.device) for k in run.log_keys]
        stop = float(run.stop_requested())
        new = float(bool(set(env_logs) - set(run.log_keys)))  # the layout must be the same on every rank
        reduced = common.all_reduce_sum(
            torch.cat([episodes.finished, *pairs, torch.tensor([stop, new], device=ctx.device)]), ctx.world_size
        ).tolist()
        if not reduced[-1]:
            break
        # An env may log a key on some ranks only, or only once an episode ends (mjlab): take the union.
        gathered = [sorted(env_logs)] * ctx.world_size
        if ctx.world_size > 1:
            dist.all_gather_object(gathered, sorted(env_logs))
        run.log_keys = sorted(set(run.log_keys).union(*gathered))
    episodes.finished.zero_()
    if reduced[2] > 0:
        run.last_return, run.last_length = reduced[0] / reduced[2], reduced[1] / reduced[2]
    run.env_steps += run.steps_per_iteration
    run.iteration = it
    if ctx.is_main:
        row = {
            "iteration": it,
            "env_steps": run.env_steps,
            "fps": run.steps_per_iteration / sum(timings.values()),
            "episode_return": run.last_return,
            "episode_length": run.last_length,
            "episodes_finished": int(reduced[2]),
            **metrics,
            **{k: reduced[3 + 2 * i] / n for i, k in enumerate(run.log_keys) if (n := reduced[4 + 2 * i])},
            **timings,
            "time_s": time.time() - run.start_time,
            "world_size": ctx.world_size,
            "first_iteration": run.first_iteration,
        }
        with open(os.path.join(run.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        if run.logger is not None:  # TensorBoard, W&B or Neptune
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "iteration"}
            try:
                run.logger[0]({dashboard_name(k, run.log_keys): v for k, v in scalars.items()}, it)
            except Exception as e:  # noqa: BLE001 - a logging service must not stop training; metrics.jsonl has it all
                print(f"warning: --logger failed ({type(e).__name__}: {e}); logging to metrics.jsonl only.", flush=True)
                close_logger(run)
        # One short console line; everything else is in metrics.jsonl and TensorBoard.
        eta = row["time_s"] / max(1, it - run.first_iteration + 1) * (run.total_iterations - it)
        ret = "-" if run.last_return is None else f"{run.last_return:.1f}"
        fps = row["fps"]
        print(
            f"it {it}/{run.total_iterations} | steps {run.env_steps:.3g} | fps {fps:.0f} | return {ret} | eta {eta:.0f}s"
        )
    if reduced[-2] > 0 and ctx.is_main:
        print(f"stop signal received: stopping after iteration {it}; resume with --resume {run.dir}", flush=True)
    return reduced[-2] > 0


def log_pair(value: torch.Tensor | float | None, device: torch.device) -> torch.Tensor:
    """A log value as (sum, count): a scalar is a mean of weight 1; None (not logged here) is (0, 0)."""
    if value is None:
        return torch.zeros(2, device=device)
    value = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1)
    return value if value.numel() == 2 else torch.cat([value, torch.ones(1, device=device)])


def close_logger(run: RunLog) -> None:
    """Close rank 0's logger once (flushing its last events): at the end, or at exit after a failure."""
    logger, run.logger = run.logger, None
    if logger is not None:
        try:
            logger[1]()
        except Exception as e:  # noqa: BLE001 - closing is best effort
            print(f"warning: closing --logger failed ({type(e).__name__}: {e}).", flush=True)


def finish_run(ctx: Dist, run: RunLog) -> None:
    """Rank 0 closes its logger and says what the run did and how to continue it."""
    close_logger(run)
    release_run_dir(run.dir)
    if ctx.is_main and run.iteration >= run.first_iteration:
        done = f"done: iteration {run.iteration}/{run.total_iterations}, {run.env_steps:.3g} env steps, return "
        done += f"{run.last_return and round(run.last_return, 1)}, {time.time() - run.start_time:.0f} s; last "
        done += f"checkpoint {run.last_checkpoint}"
        print(f"{done}; continue with --resume {run.dir} --iterations <more>", flush=True)


def save_if_due(ctx: Dist, run: RunLog, it: int, stop: bool, learning_rate: float | None) -> None:
    """Every `--save-interval` iterations, at the last and when asked to stop, rank 0 writes all a resume
    needs (tensors, numbers, strings only: every module's and optimizer's state, the learning rate, what
    the run saves with them, the args, the fingerprint of it all); all ranks learn whether that worked
    (one all_gather), and stop together if not."""
    args, trained = run.args, run.trained
    if it % args.save_interval and it != run.total_iterations and not stop:
        return
    code, error = 0, ""  # code: 0 written, the errno of an OSError, -1 another error (rank 0's `error`)
    if ctx.is_main:
        try:
            state = {
                "script": trained.script,
                "parts": [*trained.modules, *trained.optimizers],
                "configs": trained.configs(),
                **{name: module.state_dict() for name, module in trained.modules.items()},
                **{name: optimizer.state_dict() for name, optimizer in trained.optimizers.items()},
                "iteration": it,
                "env_steps": run.env_steps,
                **({"learning_rate": learning_rate} if learning_rate is not None else {}),
                **run.saved_with,
                "args": dataclasses.asdict(args),
                "fingerprint": checkpoints.fingerprint(trained),
            }
            checkpoints.save_checkpoint(run.dir, it, state, args.keep_checkpoints)
        except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
            code, error = (e.errno if isinstance(e, OSError) and e.errno else -1), f"{type(e).__name__}: {e}"
    run.last_checkpoint = os.path.join(run.dir, f"model_{it}.pt")
    code = common.all_gather_ints(ctx, [code])[0][0]  # SYNC: rank 0's outcome, to every rank (1 all_gather)
    if code:
        why = checkpoints.write_failure(code, error, run.dir)
        raise Failure(f"rank 0 could not write the checkpoint of iteration {it} in {run.dir!r} {why}.")
