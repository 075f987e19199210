"""Run plumbing the scripts call in one line each, none of it a collective: the exit, the run
directory and its lock, stop signals, the metrics row and loggers, saving checkpoints. What one rank
decides here, the script hands to every rank (`common.agree`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import checkpoints
import common
import envs
import launch
from common import Dist, Failure


def exit_code(error: BaseException, rank: int) -> int:
    """The exit code of a run that ended in `error`, after one line for an expected failure (a
    `Failure`, a bad argument, Ctrl-C, gloo's word that another worker died); any other error is
    raised again. Under torchrun a rank that does not speak waits 5 s, so that the one that does
    prints before torchrun stops the job."""
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    lost = re.search(r"Connection (reset|closed) by peer", str(error))
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else 1
    if isinstance(error, KeyboardInterrupt):  # before the stop handler is in place, or a second
        held = [*_RUN_DIR_LOCKS]  # rank 0's run directory, once it has one
        then = f"continue with --resume {held[0]}" if held else "run the command again"
        line, speaker, code = f"interrupted (Ctrl-C); no checkpoint was damaged: {then}.", 0, 130
    elif isinstance(error, Failure):
        line, speaker, code = str(error).replace("\n", " "), error.speaker, 1
    elif isinstance(error, RuntimeError) and lost is not None and torchrun:
        line, speaker, code = (
            f"rank {rank} lost another rank ({lost.group(0)}): a worker died (its own output says "
            "why) or was killed; torchrun starts the job again if --max-restarts allows, and "
            "--resume auto continues from the newest checkpoint.",
            rank,
            1,
        )
    else:
        raise error
    launch.record_error(line)  # torchrun's report names it as the root cause, not <N/A>
    if rank == speaker:
        print(f"error: {line}", file=sys.stderr, flush=True)
    elif torchrun:
        time.sleep(5)
    return code


def let_go() -> None:
    """Give back the signal handlers a run replaced and rank 0's run directory."""
    for sig, handler in _SAVED_HANDLERS.items():
        signal.signal(sig, handler)
    _SAVED_HANDLERS.clear()
    release_run_dir()


@dataclass
class RunLog:
    """One run's bookkeeping: what it saves, where rank 0 writes, its counters, the stop request."""

    args: Any
    script: str  # `ppo`, `ppo_amp`, `ppo_rnn`, `distill`: its checkpoints, its run directories
    trained: dict[str, Any]  # modules and optimizers, by the names the checkpoint keeps them under
    saved_with: dict[str, Any]  # written into every checkpoint beside the state (the teacher)
    dir: str
    first_iteration: int
    env_steps: int  # over all ranks, since the first iteration of the first run
    steps_per_iteration: int = 0  # over all ranks
    world_size: int = 1
    stop_requested: Callable[[], bool] = lambda: False
    logger: Logger | None = None  # rank 0's
    start_time: float = 0.0
    last_return: float | None = None  # over the latest iteration in which episodes finished
    last_length: float | None = None
    log_keys: list[str] = field(default_factory=list)  # the env's log keys seen so far, on any rank
    iteration: int = 0  # the last one completed
    last_checkpoint: str | None = None


def install_stop_handler(grace_s: float, run_dir: str) -> Callable[[], bool]:
    """Turn SIGTERM/SIGINT into a flag read at iteration boundaries; returns its reader. A second
    signal acts as usual. Schedulers kill 30 s after SIGTERM, and a rank that cannot reach the next
    boundary would sit that out in silence: so the first signal also starts a timer that ends the
    process `grace_s` seconds on, with one line. Exiting cancels it."""
    received: list[int] = []

    def give_up() -> None:
        rank = os.environ.get("RANK", "0")
        print(
            f"error: rank {rank} did not stop within --stop-grace-s {grace_s:g} s of the stop "
            "signal (a step that hangs, or a wait for a rank that does not answer); exiting "
            f"without a last checkpoint; resume from {run_dir}.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def handler(signum: int, frame: Any) -> None:
        if not received:
            timer = threading.Timer(grace_s, give_up)
            timer.daemon = True
            timer.start()
            # a rank that stopped in time exits however long teardown takes
            atexit.register(timer.cancel)
        received.append(signum)
        signal.signal(
            signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler
        )

    for sig in (signal.SIGTERM, signal.SIGINT):
        _SAVED_HANDLERS.setdefault(sig, signal.getsignal(sig))  # `let_go` puts them back
        signal.signal(sig, handler)
    return lambda: bool(received)


_SAVED_HANDLERS: dict[int, Any] = {}


def start_run(
    ctx: Dist,
    args: Any,
    script: str,
    trained: dict[str, Any],
    title: str,
    resume_from: checkpoints.ResumeFrom,
    saved_with: dict[str, Any] | None = None,
) -> tuple[RunLog, Failure | None]:
    """Rank 0 takes the run directory (a resumed run's by default, else
    `runs/{script}_{task}/{time}`), checks it can write there and opens the logger -> (the run,
    rank 0's reason to stop, for the script to hand to every rank). Local."""
    state = resume_from.state
    name = args.task.replace(":", "_").replace("/", "_").replace(".", "_")
    run_dir = args.run_dir or os.path.join(
        "runs", f"{script}_{name}", time.strftime("%Y-%m-%d_%H-%M-%S")
    )
    if args.resume and not args.run_dir:
        run_dir = os.path.dirname(checkpoints.resolve_checkpoint(args.resume))
    first_iteration, env_steps = (state["iteration"] + 1, state["env_steps"]) if state else (1, 0)
    # What can stop the start, as (what, what to do); rank 0 alone knows which, and the details.
    problems = [
        (
            f"run directory {run_dir!r} is in use by another job",
            "wait for it to end, or pass another --run-dir",
        ),
        (
            f"run directory {run_dir!r} holds checkpoints of another run",
            f"continue it with --resume {run_dir} (or --resume auto), or pass another --run-dir",
        ),
        (f"rank 0 cannot write the run directory {run_dir!r}", "pass a writable --run-dir"),
        (f"rank 0 cannot start --logger {args.logger}", "fix its settings or pass --logger none"),
    ]
    problem, detail, logger = 0, "", None  # problem: 1 + its index, 0 for none
    if ctx.is_main:
        problem, detail, logger = take_and_open(
            args, script, run_dir, state is not None, first_iteration
        )
    failure = None
    if problem:
        what, advice = problems[problem - 1]
        failure = Failure(f"{what} ({detail}); {advice}.")
    steps_per_iteration = args.steps_per_env * args.num_envs * ctx.world_size
    stop_requested = install_stop_handler(args.dist.stop_grace_s, run_dir)
    log = RunLog(args, script, trained, saved_with or {}, run_dir, first_iteration, env_steps)
    log.steps_per_iteration, log.stop_requested = steps_per_iteration, stop_requested
    log.logger = logger or Logger()
    log.world_size, log.start_time = ctx.world_size, time.time()
    atexit.register(log.logger.close)  # also when the run ends in a failure
    if ctx.is_main and failure is None:
        seeds = [envs.rank_seed(args.seed, rank, first_iteration) for rank in range(ctx.world_size)]
        line = f"{title}: {ctx.world_size} process(es) x {args.num_envs} envs on {ctx.device}, "
        line += f"seeds {seeds}; run dir {run_dir}"
        if args.speed.compile and first_iteration <= args.iterations:
            line += f"; the first iteration compiles the steps (--compile {args.speed.compile})"
        if first_iteration > args.iterations:
            line += f"\nnothing to train: the run reached iteration {first_iteration - 1} of "
            line += f"--iterations {args.iterations}; pass a larger --iterations to continue."
        print(line, flush=True)
    return log, failure


def take_and_open(
    args: Any, script: str, run_dir: str, resumed: bool, first_iteration: int
) -> tuple[int, str, Any]:
    """Rank 0's part of `start_run` -> (1 + the problem's index there, or 0; its detail; the
    logger). Whatever stops the start leaves nothing behind in a directory it created."""
    problem, detail, logger, stale_events = 0, "", None, []
    created = not os.path.exists(run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
        if holder := take_run_dir(run_dir):  # another job's
            problem, detail = 1, holder
        # would mix with ours
        elif not resumed and (found := checkpoints.checkpoint_files(run_dir)):
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
        # one line, no colors
        plain = " ".join(re.sub(r"\x1b\[[0-9;]*m|-{3,}", " ", str(e)).split())
        short = plain if len(plain) < 200 else plain[:200] + " ..."
        problem, detail = 4, f"{type(e).__name__}: {short}"
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
    return problem, detail, logger


def trim_metrics(run_dir: str, first_iteration: int) -> None:
    """Drop the rows of `metrics.jsonl` an earlier attempt logged from `first_iteration` on. A row
    that does not parse (a crash in mid-write) is set aside in `metrics.jsonl.damaged`."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics):
        return
    kept, damaged = [], []
    with open(metrics, errors="replace") as f:
        for line in f:
            # a row cut before its newline stays one
            line = line if line.endswith("\n") else line + "\n"
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
        print(
            f"note: {len(damaged)} damaged row(s) of {metrics} (a crash in mid-write) set aside in "
            f"{metrics}.damaged; every whole row is kept.",
            flush=True,
        )
    checkpoints.atomic_write(metrics, lambda f: f.write("".join(kept).encode()))


# run directory -> the open lock file that holds it for this process
_RUN_DIR_LOCKS: dict[str, Any] = {}


def take_run_dir(run_dir: str) -> str:
    """Hold `run_dir` with a lock on `run_dir/.lock`, which the OS releases when the process exits
    or dies, so a crash never leaves it taken. Returns "" or who holds it (pid, host, since)."""
    import fcntl  # POSIX

    key = os.path.realpath(run_dir)
    # an earlier run of this same process (runs in one process follow each other)
    release_run_dir(key)
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
    lock.write(
        f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    )
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


# rsl_rl's names for the scalars it logs too, so that dashboards of both compare; the env's log
# values go to "Episode/<key>" unless the key has a "/" of its own.
RSL_RL_NAMES = {
    "episode_return": "Train/mean_reward",
    "episode_length": "Train/mean_episode_length",
    "learning_rate": "Loss/learning_rate",
    "surrogate_loss": "Loss/surrogate",
    "value_loss": "Loss/value",
    "entropy": "Loss/entropy",
    "rnd_loss": "Loss/rnd",
    "behavior_loss": "Loss/behavior",
    "rnd_weight": "Rnd/weight",
    "symmetry_loss": "Loss/symmetry",
    "intrinsic_reward": "Rnd/intrinsic_reward",
    "extrinsic_reward": "Rnd/extrinsic_reward",
    "explained_variance": "Policy/explained_variance",
    "clipfrac": "Loss/clipfrac",
    "fps": "Perf/total_fps",
    "collect_s": "Perf/collection_time",
    "update_s": "Perf/learning_time",
}


def dashboard_name(key: str, log_keys: list[str]) -> str:
    """The name a metrics.jsonl column gets in TensorBoard, W&B and Neptune."""
    if key in log_keys and key not in RSL_RL_NAMES:
        return key if "/" in key else f"Episode/{key}"
    return RSL_RL_NAMES.get(key, key)


class Logger:
    """Rank 0's scalars to a service (TensorBoard, W&B, Neptune); one that fails is closed with a
    warning, and training goes on."""

    finish: Callable[[], Any] | None = None  # None: closed, or nothing to close
    send: Callable[[dict[str, float], int], None]  # each service's own

    def write(self, scalars: dict[str, float], it: int) -> None:
        try:
            if self.finish is not None:
                self.send(scalars, it)
        except Exception as e:  # noqa: BLE001 - a logging service must not stop training
            print(f"warning: --logger failed ({type(e).__name__}: {e}); metrics.jsonl only.")
            self.close()

    def close(self) -> None:
        finish, self.finish = self.finish, None
        try:
            if finish is not None:
                finish()
        except Exception as e:  # noqa: BLE001 - closing is best effort
            print(f"warning: closing --logger failed ({type(e).__name__}: {e}).", flush=True)


class TensorBoard(Logger):
    def __init__(self, run_dir: str, first_iteration: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(run_dir, purge_step=first_iteration)
        self.finish = self.writer.close

    def send(self, scalars: dict[str, float], it: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, it)


class WandB(Logger):
    def __init__(self, project: str, run_dir: str, config: dict[str, Any]) -> None:
        import wandb

        name = os.path.basename(os.path.normpath(run_dir))
        self.run = wandb.init(project=project, dir=run_dir, name=name, config=config)
        self.finish = self.run.finish

    def send(self, scalars: dict[str, float], it: int) -> None:
        self.run.log(scalars, step=it)


class Neptune(Logger):
    def __init__(self, project: str | None, run_dir: str, config: dict[str, Any]) -> None:
        import neptune
        from neptune.utils import stringify_unsupported

        self.run = neptune.init_run(project=project, name=run_dir, capture_hardware_metrics=False)
        self.run["config"] = stringify_unsupported(config)
        self.finish = self.run.stop

    def send(self, scalars: dict[str, float], it: int) -> None:
        for key, value in scalars.items():
            self.run[key].append(value, step=it)


def open_logger(args: Any, script: str, run_dir: str, first_iteration: int) -> Logger | None:
    """Rank 0's `--logger`; None for `none`, or TensorBoard not installed."""
    logger, project, config = args.logger, args.run.logger_project, dataclasses.asdict(args)
    if logger == "tensorboard":
        try:
            return TensorBoard(run_dir, first_iteration)
        except ImportError:  # the default, and optional: metrics.jsonl has everything
            print("TensorBoard is not installed (pip install tensorboard): metrics.jsonl only.")
            return None
    if logger == "wandb":
        return WandB(project or script, run_dir, config)
    return Neptune(project, run_dir, config) if logger == "neptune" else None


def metrics_row(run: RunLog, it: int, values: dict[str, float]) -> dict[str, Any]:
    """The iteration's row of metrics.jsonl from `values`; the run's counters move on."""
    run.env_steps, run.iteration = run.env_steps + run.steps_per_iteration, it
    if "episode_return" in values:
        run.last_return = values.pop("episode_return")
        run.last_length = values.pop("episode_length")
    seconds, elapsed = values["collect_s"] + values["update_s"], time.time() - run.start_time
    counts = {"iteration": it, "env_steps": run.env_steps}
    counts |= {"fps": run.steps_per_iteration / seconds, "episode_return": run.last_return}
    ends = {"time_s": elapsed, "world_size": run.world_size, "first_iteration": run.first_iteration}
    return {**counts, "episode_length": run.last_length, **values, **ends}


def console_line(run: RunLog, row: dict[str, Any], stop: bool) -> str:
    it, total, ret = row["iteration"], run.args.iterations, row["episode_return"]
    eta = row["time_s"] / max(1, it - run.first_iteration + 1) * (total - it)
    line = f"it {it}/{total} | steps {run.env_steps:.3g} | fps {row['fps']:.0f} | return "
    line += f"{'-' if ret is None else f'{ret:.1f}'} | eta {eta:.0f}s"
    stopping = f"\nstop signal received: stopping after iteration {it}; resume with --resume "
    return line + (stopping + run.dir if stop else "")


def scalars(run: RunLog, row: dict[str, Any]) -> dict[str, float]:
    """A row's numbers by their dashboard names (`dashboard_name`), for the logger."""
    numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "iteration"}
    return {dashboard_name(k, run.log_keys): v for k, v in numbers.items()}


def finish_run(ctx: Dist, run: RunLog) -> None:
    """Rank 0 closes its logger and says what the run did and how to continue it."""
    run.logger.close()
    release_run_dir(run.dir)
    if ctx.is_main and run.iteration >= run.first_iteration:
        last = "-" if run.last_return is None else f"{run.last_return:.1f}"
        done = f"done: iteration {run.iteration}/{run.args.iterations}, "
        done += f"{run.env_steps:.3g} env steps, training return {last}, "
        done += f"{time.time() - run.start_time:.0f} s; last checkpoint {run.last_checkpoint}"
        print(f"{done}; continue with --resume {run.dir} --iterations <more>", flush=True)


def save_due(args: Any, it: int, stop: bool) -> bool:
    """Whether iteration `it` saves: every `--save-interval`, the last, and on a stop request."""
    return not it % args.run.save_interval or it == args.iterations or stop


def save(run: RunLog, it: int, learning_rate: float | None = None) -> Failure | None:
    """Rank 0 writes all a resume needs (tensors, numbers, strings only) -> None, or why it could
    not, for the script to hand to every rank. Local."""
    run.last_checkpoint = os.path.join(run.dir, f"model_{it}.pt")
    try:
        state = {
            "script": run.script,
            "parts": list(run.trained),
            "configs": checkpoints.configs(run.trained),
            "deployed": checkpoints.deployed(run.trained),
            **{name: part.state_dict() for name, part in run.trained.items()},
            "iteration": it,
            "env_steps": run.env_steps,
            **({"learning_rate": learning_rate} if learning_rate is not None else {}),
            **run.saved_with,
            "args": dataclasses.asdict(run.args),
            "fingerprint": common.fingerprint(run.trained),
        }
        checkpoints.save_checkpoint(run.dir, it, state, run.args.run.keep_checkpoints)
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
        code = e.errno if isinstance(e, OSError) and e.errno else -1
        why = checkpoints.write_failure(code, f"{type(e).__name__}: {e}", run.dir)
        return Failure(
            f"rank 0 could not write the checkpoint of iteration {it} in {run.dir!r} {why}."
        )
    return None
