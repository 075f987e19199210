"""Fault soak: a real training job under torchrun's restarts, a worker SIGKILLed K times at chosen
moments.

The job is `torchrun --standalone --nproc_per_node=<nproc> --max-restarts=<kills> ppo_ddp.py
--resume auto --run-dir <dir> --save-interval <n> --check-interval 1 --device cpu <extra>`. Each
time its workers (re)start, one is killed, as a node lost without warning would be, at one of five
moments, taken in turn from a shuffled list:

- start-up: a random time after the workers appear, before their first iteration ends;
- rollout, update: a random point of the iteration's collect or update phase, aimed from the times
  the previous iteration logged (`collect_s`, `update_s`) from the moment its row appeared;
- checkpoint write: rank 0, as soon as a `model_*.pt.tmp-*` file appears, while it writes;
- metrics write: rank 0, as soon as `metrics.jsonl` grows, before TensorBoard's row and the
  checkpoint.

Then it checks what a user needs: the job ends with rc 0; every iteration is in `metrics.jsonl`
once, env steps increasing by the same amount each; every checkpoint left loads (`weights_only`) and
its policy rebuilds; the ranks agreed at every iteration (`--check-interval 1`: a disagreement would
end the job with rc != 0); and, with `--baseline-seeds`, the final return lies within the spread of
unkilled runs of the same settings (their range widened by their std on each side). It prints

    faults survived N of N, rows lost 0, rows doubled 0, corrupt checkpoints 0

and the time the restarts cost against the unkilled runs' mean. Run from the repository root:

    python benchmarks/faults.py --kills 20       # the default PPO pendulum run, 250 iterations
    python benchmarks/faults.py --kills 2 --iterations 20 --baseline-seeds \\
        --extra "--num-envs 16 --steps-per-env 8"  # the short version the tests run
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# also when loaded by runpy (tests/test_faults.py)
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from torchrun_ppo import train  # noqa: E402

import checkpoints  # noqa: E402 - after its directory is on the path
from tools.policy import load_policy  # noqa: E402

MOMENTS = ("start-up", "rollout", "update", "checkpoint write", "metrics write")
POLL_S = 0.0002  # how often the file system is looked at while waiting for a write


@dataclass
class Config:
    kills: int = 20
    """Workers killed, one per (re)start; torchrun gets as many restarts."""
    moments: tuple[str, ...] = MOMENTS
    """The moments to kill at, each in turn, in a shuffled order (one of MOMENTS each)."""
    iterations: int = 250
    """Iterations of the job (ppo_ddp.py's default run: 250)."""
    save_interval: int = 10
    """Checkpoint every this many iterations (`--save-interval`)."""
    nproc: int = 2
    """Workers (`--nproc_per_node`)."""
    seed: int = 1
    """Seed of the killed job, and of the kill moments."""
    extra: str = ""
    """More ppo_ddp.py arguments (`--extra "--task reacher"`)."""
    baseline_seeds: tuple[int, ...] = field(default_factory=lambda: (1, 2, 3))
    """Unkilled runs of the same settings, for the return and the time; none to skip the comparison.
    """
    out: str = "runs/benchmark_faults"
    """Where the runs go (emptied first)."""


def ppo_args(config: Config, seed: int) -> list[str]:
    """ppo_ddp.py's arguments of a job (killed or not), its run directory apart."""
    return [
        "--resume",
        "auto",
        "--iterations",
        str(config.iterations),
        "--save-interval",
        str(config.save_interval),
        "--check-interval",
        "1",
        "--device",
        "cpu",
        "--seed",
        str(seed),
        *shlex.split(config.extra),
    ]


def command(config: Config, run_dir: str) -> list[str]:
    """The torchrun command of the killed job: as many restarts as kills."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={config.nproc}",
        f"--max-restarts={config.kills}",
        os.path.join(ROOT, "ppo_ddp.py"),
        "--run-dir",
        run_dir,
        *ppo_args(config, config.seed),
    ]


def workers(agent: int) -> dict[int, int]:
    """The agent's worker processes that have their rank: rank -> pid."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != agent:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError):  # gone meanwhile
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(name)
    return found


def rows_of(run_dir: str) -> list[dict]:
    """The rows of the run's metrics.jsonl that are whole (a half-written last line is not)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]  # what follows the last newline is not a whole row yet
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a damaged row: check_run counts its iteration as lost
            pass
    return rows


def wait_for(
    condition: Callable[[], bool],
    proc: subprocess.Popen,
    timeout: float = 600.0,
    poll: float = 0.01,
) -> bool:
    """Poll `condition` until it holds (True), or the job ended or `timeout` passed (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if condition():
            return True
        time.sleep(poll)
    return False


def final_return(rows: list[dict]) -> float | None:
    """The mean return of the last 10 iterations' finished episodes (None if none finished)."""
    returns = [row["episode_return"] for row in rows[-10:] if row.get("episode_return") is not None]
    return statistics.mean(returns) if returns else None


def size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def logged(log: str, offset: int) -> int:
    """Iterations rank 0 announced in the job's log after byte `offset` (its `it N/M` lines)."""
    with open(log, "rb") as f:
        f.seek(offset)
        return sum(line.startswith(b"it ") for line in f.read().split(b"\n"))


def kill_at(
    moment: str,
    proc: subprocess.Popen,
    pids: dict[int, int],
    run_dir: str,
    log: str,
    after: int,
    rng: random.Random,
) -> str:
    """Kill one of this (re)start's workers (`pids`: rank -> pid) at `moment`, in the iteration
    after this start's `after`-th (at start-up: at once); returns what was hit. `log` is the job's
    output, whose end marks where this start's lines begin."""
    offset = size(log)
    if moment == "start-up":
        time.sleep(rng.uniform(0.0, 2.0))
        rank = rng.choice(sorted(pids))
        late = logged(log, offset) > 0
        os.kill(pids[rank], signal.SIGKILL)
        when = "after its first iteration (start-up was quicker)" if late else "at start-up"
        return f"rank {rank} {when}"
    # After this start's first iteration (its metrics rows trimmed, its steps steady), and `after` -
    # 1 more.
    if not wait_for(lambda: logged(log, offset) >= after, proc):
        return "missed: the job ended first"
    if moment in ("rollout", "update"):
        last = rows_of(run_dir)[-1]
        start = time.time()  # the next iteration's rollout begins about as the line is printed
        offset_s = (
            rng.uniform(0.1, 0.9) * last[f"{'collect' if moment == 'rollout' else 'update'}_s"]
        )
        time.sleep(
            max(
                0.0,
                offset_s
                + (last["collect_s"] if moment == "update" else 0.0)
                - (time.time() - start),
            )
        )
        rank = rng.choice(sorted(pids))
        os.kill(pids[rank], signal.SIGKILL)
        return f"rank {rank} in the {moment} of iteration {last['iteration'] + 1}"
    if moment == "checkpoint write":
        mine = f".tmp-{pids[0]}"  # atomic_write's temporary file, of rank 0 of this start

        def writing() -> bool:
            return any(
                name.startswith("model_") and name.endswith(mine) for name in os.listdir(run_dir)
            )

        if not wait_for(writing, proc, poll=POLL_S):
            return "missed: the job ended first"
        os.kill(pids[0], signal.SIGKILL)
        return (
            f"rank 0 while writing a checkpoint{'' if writing() else ' (the write had just ended)'}"
        )
    metrics = os.path.join(run_dir, "metrics.jsonl")
    before = size(metrics)
    if not wait_for(lambda: size(metrics) != before, proc, poll=POLL_S):
        return "missed: the job ended first"
    os.kill(pids[0], signal.SIGKILL)
    return "rank 0 as its metrics row was written"


def soak(config: Config) -> dict:
    """Run the killed job; returns its checks and figures (and prints a line per kill)."""
    rng = random.Random(config.seed)
    run_dir, log = os.path.join(config.out, "killed"), os.path.join(config.out, "killed.log")
    moments = [config.moments[i % len(config.moments)] for i in range(config.kills)]
    rng.shuffle(moments)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    started = time.time()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command(config, run_dir), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env
        )
        hits, previous = [], set()

        def restarted() -> bool:  # all ranks of a new start are there
            found = workers(proc.pid)
            return len(found) == config.nproc and previous.isdisjoint(found.values())

        for number, moment in enumerate(moments, 1):
            if not wait_for(restarted, proc):
                hits.append(f"missed: no workers to kill (the job ended, rc {proc.poll()})")
                break
            pids = workers(proc.pid)
            previous = set(pids.values())
            # so that some kills come after a checkpoint
            after = 1 + rng.randrange(config.save_interval)
            hits.append(kill_at(moment, proc, pids, run_dir, log, after, rng))
            print(f"kill {number}/{config.kills} ({moment}): {hits[-1]}", flush=True)
        rc = proc.wait()
    return {"rc": rc, "wall_s": time.time() - started, "hits": hits, **check_run(run_dir, config)}


def check_run(run_dir: str, config: Config) -> dict:
    """Rows lost and doubled, env steps in order, checkpoints that do not load, the final return."""
    rows = rows_of(run_dir)
    iterations = [row["iteration"] for row in rows]
    lost = len(set(range(1, config.iterations + 1)) - set(iterations))
    doubled = len(iterations) - len(set(iterations))
    steps = [row["env_steps"] for row in rows]
    steady = all(b - a == steps[0] for a, b in zip(steps, steps[1:])) and iterations == sorted(
        iterations
    )
    corrupt = []
    for path in checkpoints.checkpoint_files(run_dir):
        try:
            checkpoints.load_checkpoint(path, "ppo", checkpoints.RESUME_KEYS)
            load_policy(path)
        except Exception as error:  # noqa: BLE001 - any failure to load is what is counted
            corrupt.append(f"{os.path.basename(path)}: {error}")
    leftovers = [name for name in os.listdir(run_dir) if ".tmp-" in name]
    return {
        "rows_lost": lost,
        "rows_doubled": doubled,
        "steps_in_order": steady,
        "corrupt": corrupt,
        "checkpoints": len(checkpoints.checkpoint_files(run_dir)),
        "tmp_left": leftovers,
        "final_return": final_return(rows),
    }


def baseline(config: Config, seed: int) -> tuple[float, float]:
    """An unkilled run of the same settings -> (mean return of its last 10 iterations, wall
    seconds)."""
    rows, wall = train(
        config.nproc, os.path.join(config.out, f"unkilled_seed{seed}"), ppo_args(config, seed)
    )
    return final_return(rows), wall


def main(config: Config) -> int:
    if unknown := set(config.moments) - set(MOMENTS):
        print(f"error: --moments {sorted(unknown)} unknown; choose among {list(MOMENTS)}.")
        return 2
    shutil.rmtree(config.out, ignore_errors=True)
    os.makedirs(config.out)
    print(f"soak: {' '.join(command(config, os.path.join(config.out, 'killed')))}")
    result = soak(config)
    made = sum(not hit.startswith("missed") for hit in result["hits"])
    # the job survived every kill but one that ended it
    survived = made if result["rc"] == 0 else made - 1
    print(
        f"faults survived {survived} of {config.kills}, rows lost {result['rows_lost']}, rows "
        f"doubled {result['rows_doubled']}, corrupt checkpoints {len(result['corrupt'])}"
    )
    print(
        f"job rc {result['rc']}, {result['wall_s']:.0f} s; env steps in order: "
        f"{result['steps_in_order']}; checkpoints left {result['checkpoints']}, .tmp files left "
        f"{len(result['tmp_left'])}"
    )
    for problem in result["corrupt"]:
        print(f"  corrupt: {problem}")
    ok = survived == config.kills and not result["rows_lost"] and not result["rows_doubled"]
    ok = ok and not result["corrupt"] and result["steps_in_order"]
    if config.baseline_seeds:
        unkilled = [baseline(config, seed) for seed in config.baseline_seeds]
        returns, walls = [r for r, _ in unkilled], [w for _, w in unkilled]
        spread = statistics.stdev(returns) if len(returns) > 1 else 0.0
        low, high = min(returns) - spread, max(returns) + spread
        within = result["final_return"] is not None and low <= result["final_return"] <= high
        print(
            f"final return (last 10 iterations) {result['final_return']:.1f}; unkilled seeds "
            f"{', '.join(f'{r:.1f}' for r in returns)}: within [{low:.1f}, {high:.1f}]: {within}"
        )
        print(
            f"time lost to restarts: {result['wall_s'] - statistics.mean(walls):.0f} s "
            f"({result['wall_s']:.0f} s against {statistics.mean(walls):.0f} s unkilled)"
        )
        ok = ok and within
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
