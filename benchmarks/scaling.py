"""Weak-scaling benchmark of the three scripts: global FPS, collectives, time shares, ceiling.

For each script it runs, with the script's default sizes per rank (envs per rank fixed):
  1. one process;
  2. N processes joined by a process group (torchrun), the real data-parallel run;
  3. N independent single processes side by side, no process group: what N processes on this
     machine can do at best (shared cores, caches and memory bandwidth, no communication).
Every process is pinned to its own share of the cores (`launch.rank_cores`: whole physical cores
while there is one per process) and runs as many threads as its share has CPUs (`--no-pin` leaves
placement to the OS, with `CPUs // N` threads each), so N processes never oversubscribe the cores.
In N processes it also times one flattened all_reduce against one all_reduce per parameter tensor
for each script's default networks, the cheapest collective (one number), and the lock-step cost of
one synchronization between phases of computation, which bounds what any data-parallel code can
reach on the machine.

    python benchmarks/scaling.py                      # N=2, all three scripts, CPU
    python benchmarks/scaling.py --nproc 8 --device cuda

Prints the markdown tables and writes them, a JSON of all figures and fps.png to --out. Collective
time is measured around each call; on CUDA the wrapper synchronizes the device first, so that time
is the collective's, not the queue's.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPTS = ("ppo_ddp", "ppo_amp_ddp", "distill_ddp")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter")


@dataclass
class Config:
    nproc: int = 2
    """N, the number of processes compared against one."""
    scripts: tuple[str, ...] = SCRIPTS
    """Which scripts to measure."""
    iterations: int = 30
    """Iterations per run, warm-up included."""
    warmup: int = 5
    """Iterations left out of every figure."""
    device: str = "cpu"
    """Device of every run (`cuda`: one GPU per process)."""
    out: str = os.path.join(ROOT, "benchmarks", "results")
    """Folder for results.md, results.json and fps.png."""
    pin: bool = True
    """Pin process i (rank i, or the i-th independent process) to its own share of the cores
    (`launch.rank_cores`), so the scheduler neither moves it nor stacks two processes on one core.
    """
    pin_gloo: bool = False
    """With `--pin`, pin before the process group starts, so that gloo's threads share the training
    thread's cores. By default the training thread alone is pinned, once the group is up, and gloo's
    threads stay free to run on any core: collectives cost less (benchmarks/README.md)."""
    sync_matmuls: int = 20
    """Matrix products (256 x 256) each rank computes between two synchronizations in the lock-step
    measurement: about one PPO mini-batch of work on the 2-core CPU machine."""
    slot: int = -1
    """Internal: which share of the cores an independent process is pinned to."""
    role: str = "driver"
    """Internal: `driver`, `worker` (one training process) or `allreduce` (the micro-benchmark)."""
    script: str = "ppo_ddp"
    """Internal: the script a worker runs."""
    report: str = ""
    """Internal: where a worker writes its figures."""


# ---------------------------------------------------------------------------------------------
# Worker: one training process with instrumented collectives
# ---------------------------------------------------------------------------------------------


def instrument(device: str) -> dict:
    """Wrap torch.distributed collectives to count and time them, split by phase."""
    # start-up is not counted
    stats = {"phase": "startup", "calls": {}, "seconds": {}, "steps": 0, "spans": []}

    for name in COLLECTIVES:
        original = getattr(dist, name)

        def timed(*args: object, _original=original, **kwargs: object) -> object:  # noqa: ANN001
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
            result = _original(*args, **kwargs)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            end, phase = time.monotonic(), stats["phase"]
            stats["calls"][phase] = stats["calls"].get(phase, 0) + 1
            stats["seconds"][phase] = stats["seconds"].get(phase, 0.0) + end - start
            if phase == "update":  # when this rank reached the collective and left it
                stats["spans"].append((start, end))
            return result

        setattr(dist, name, timed)
    return stats


def pin_to_cores(cfg: Config) -> None:
    """Restrict the calling thread (and the threads it starts later) to this process's share of the
    cores: before the process group starts (gloo's threads share them), or with `--no-pin-gloo`
    once it is up (gloo's threads stay free to run on any core)."""
    import launch

    processes = int(os.environ.get("BENCH_PIN_PROCESSES", "0"))
    if processes > 0:
        slot = cfg.slot if cfg.slot >= 0 else int(os.environ.get("LOCAL_RANK", "0"))
        launch.pin_to_cores(
            slot, processes
        )  # the scripts' own rule: nothing with fewer CPUs than processes


def run_worker(cfg: Config) -> None:
    """Train one script with its defaults for cfg.iterations; write FPS and collective figures."""
    import arguments
    import launch

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not cfg.pin_gloo:
        share_cores = launch.share_cores  # what `main` calls once the group is up

        def pinned_once_joined(*args: object, **kwargs: object) -> None:
            share_cores(*args, **kwargs)
            pin_to_cores(cfg)

        launch.share_cores = pinned_once_joined
    else:
        pin_to_cores(cfg)
    stats = instrument(cfg.device)
    stats["iteration"] = 0
    module = importlib.import_module(cfg.script)
    owner = module  # each script holds its own rollout and update
    original_rollout = owner.rollout
    steps: dict[int, int] = {}

    def outside_update() -> str:
        return "other" if stats["iteration"] > cfg.warmup else "warmup"

    def rollout(*args: object, **kwargs: object) -> object:
        stats["iteration"] += 1
        stats["phase"] = outside_update()
        return original_rollout(*args, **kwargs)

    def in_update_phase(update: Callable[..., object]) -> Callable[..., object]:
        def timed_update(*args: object, **kwargs: object) -> object:
            # Every collective inside the update belongs to the mini-batch loop.
            stats["phase"] = "update" if stats["iteration"] > cfg.warmup else "warmup"
            try:
                return update(*args, **kwargs)
            finally:
                stats["phase"] = outside_update()

        return timed_update

    original_make_update = owner.make_update  # each script builds its update once, before the loop
    owner.make_update = lambda *args, **kwargs: in_update_phase(
        original_make_update(*args, **kwargs)
    )

    for cls in (torch.optim.Adam, torch.optim.AdamW):

        def counted(  # noqa: ANN202
            self: torch.optim.Optimizer,
            *args: object,
            _original: Callable[..., object] = cls.step,
            **kwargs: object,
        ) -> object:
            if stats["phase"] == "update":
                steps[id(self)] = steps.get(id(self), 0) + 1
            return _original(self, *args, **kwargs)

        cls.step = counted
    owner.rollout = rollout
    # Ranks of one job must agree on every argument, the run directory included: name it after
    # torchrun's agent (their parent); independent processes each get their own.
    owner = os.getppid() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else os.getpid()
    run_dir = os.path.join(os.path.dirname(cfg.report), f"run-{cfg.script}-{owner}")
    # The benchmark pins by its own rule (`--pin`, `--pin-gloo`, independent processes): the
    # scripts' is off.

    run = {"run_dir": run_dir, "save_interval": 10**9, "device": cfg.device, "pin_cores": False}
    args = arguments.with_values(module.Args(), {"iterations": cfg.iterations, **run})
    wall = time.time()
    module.main(args)
    wall = time.time() - wall
    rank = int(os.environ.get("RANK", "0"))
    report = {
        "rank": rank,
        "calls": stats["calls"],
        "seconds": stats["seconds"],
        "optimizer_steps": max(steps.values(), default=0),
        "wall_s": wall,
        "spans": stats["spans"],
    }
    if rank == 0:
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        measured = [r for r in rows if r["iteration"] > cfg.warmup]
        start = rows[cfg.warmup - 1]
        report["window_s"] = measured[-1]["time_s"] - start["time_s"]
        report["fps"] = (measured[-1]["env_steps"] - start["env_steps"]) / report["window_s"]
        report["iterations"] = len(measured)
        report["collect_s"] = sum(r.get("collect_s", 0.0) for r in measured)
        report["update_s"] = sum(r.get("update_s", 0.0) for r in measured)
    with open(cfg.report, "w") as f:
        json.dump(report, f)


def default_networks(device: torch.device) -> dict[str, list[torch.nn.Parameter]]:
    """The parameters each script trains and averages, at its default sizes, on its default task."""
    import distill_ddp
    import envs
    import ppo_amp_ddp
    import ppo_ddp

    ppo, amp, distill = ppo_ddp.Args(), ppo_amp_ddp.Args(), distill_ddp.Args()

    def env_obs(task: str) -> tuple[dict[str, torch.Tensor], int]:
        env = envs.make_env(task, 8, device, 0)
        return env.get_observations(), env.num_actions

    obs, num_actions = env_obs(ppo.task)
    actor, critic = (net.to(device) for net in ppo_ddp.make_networks(obs, num_actions, ppo))
    obs, _ = env_obs(amp.task)
    (amp_group,) = envs.resolve_groups(obs, (amp.amp_obs,), ("policy",), "--amp-obs")
    disc = ppo_amp_ddp.Discriminator(obs[amp_group].shape[-1], amp.disc_hidden).to(device)
    obs, num_actions = env_obs(distill.task)
    shapes = envs.group_shapes(
        obs, envs.resolve_groups(obs, distill.student_obs, flag="--student-obs")
    )
    student = distill_ddp.Student(shapes, num_actions, distill.student_hidden, 0, True).to(device)
    return {
        "ppo_ddp": [*actor.parameters(), *critic.parameters()],
        "ppo_amp_ddp": [*actor.parameters(), *critic.parameters(), *disc.parameters()],
        "distill_ddp": list(student.parameters()),
    }


def run_allreduce(cfg: Config) -> None:
    """Time one flattened all_reduce against one all_reduce per parameter tensor for each script's
    default networks; then the cheapest collective and the cost of one lock-step synchronization."""
    import common

    if cfg.pin_gloo:
        pin_to_cores(cfg)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = common.resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")), world_size)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = common.Dist(rank, world_size, device, rank == 0)
    try:
        if not cfg.pin_gloo:
            pin_to_cores(cfg)  # once the group is up: gloo's threads stay free (see pin_to_cores)

        def timed(fn: object, repeats: int = 200) -> float:
            for _ in range(20):
                fn()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - start) / repeats

        trained, networks = default_networks(ctx.device), {}
        for script, params in trained.items():
            for p in params:
                p.grad = torch.randn_like(p)
            extras = torch.zeros(8, device=ctx.device)

            def per_parameter(params: list[torch.nn.Parameter] = params) -> None:
                for p in params:
                    dist.all_reduce(p.grad)
                    p.grad /= ctx.world_size

            def flat(
                params: list[torch.nn.Parameter] = params, extras: torch.Tensor = extras
            ) -> None:
                # the scripts' mini-batch collective: flatten, one all_reduce, divide, copy back
                buffer = torch.cat([*(p.grad.reshape(-1) for p in params), extras])
                dist.all_reduce(buffer)
                buffer /= ctx.world_size
                offset = 0
                for p in params:
                    p.grad.copy_(buffer[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

            networks[script] = {
                "tensors": len(params),
                "numel": sum(p.numel() for p in params),
                "flat": timed(flat),
                "per_parameter": timed(per_parameter),
            }
        one = torch.zeros(1, device=ctx.device)
        gathered = [torch.zeros(1, device=ctx.device) for _ in range(ctx.world_size)]

        def floor() -> None:
            # The cheapest collectives there are: one number each. No collective costs less.
            dist.all_reduce(one)
            dist.broadcast(one, src=0)
            dist.all_gather(gathered, one)

        timings = {"networks": networks, "floor": timed(floor)}
        timings["floor"] /= 3  # per collective

        # Lock-step cost: both ranks compute for a few ms (like one PPO mini-batch) and then meet in
        # one gradient-sized all_reduce, against the same compute with no collective. The difference
        # is what one synchronization costs on this machine whatever code makes it: the transfer,
        # waking the waiting threads, and waiting for the rank the OS slowed down.
        work = torch.randn(256, 256, device=ctx.device)
        buffer = torch.cat([p.grad.reshape(-1) for p in trained["ppo_ddp"]])

        def compute() -> None:
            for _ in range(cfg.sync_matmuls):
                work @ work
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()

        def lockstep(sync: bool) -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(40):
                compute()
                if sync:
                    dist.all_reduce(buffer)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - start) / 40

        lockstep(True)  # warm-up
        # Five pairs; the smallest difference, so that a slow moment of the machine cannot inflate
        # the cost: the bounds below are then the most favourable ones the measurement allows.
        pairs = [(lockstep(False), lockstep(True)) for _ in range(5)]
        alone, synced = min(pairs, key=lambda pair: pair[1] - pair[0])
        timings["compute_ms"] = alone * 1e3
        timings["sync_cost"] = max(0.0, synced - alone)
        timings["sync_costs"] = [synced - alone for alone, synced in pairs]
        if ctx.is_main:
            with open(cfg.report, "w") as f:
                json.dump(timings, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def threads_per_process(nproc: int, pin: bool) -> int:
    """torch threads for each of `nproc` processes sharing the CPUs this one may use: the fewest
    CPUs a pinned process gets (`launch.rank_cores`), or the CPUs divided among the processes."""
    import launch

    cpus = launch.usable_cores()
    shares = [len(launch.rank_cores(slot, nproc, cpus)) for slot in range(nproc)] if pin else []
    return max(1, min(shares) if shares and min(shares) else len(cpus) // nproc)


def launch(
    cfg: Config, script: str, nproc: int, synced: bool, workdir: str, role: str = "worker"
) -> list[dict]:
    """Run `nproc` workers, joined by torchrun when `synced`, else side by side; their reports."""
    threads = str(threads_per_process(cfg.nproc, cfg.pin))
    # Passed by environment: torchrun would take `--nproc` after the script for its own option.
    pinned = str(cfg.nproc if cfg.pin else 0)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "PYTHONPATH": ROOT,
        "BENCH_PIN_PROCESSES": pinned,
    }
    base = [
        os.path.abspath(__file__),
        "--role",
        role,
        "--script",
        script,
        "--iterations",
        str(cfg.iterations),
        "--warmup",
        str(cfg.warmup),
        "--device",
        cfg.device,
        "--pin-gloo" if cfg.pin_gloo else "--no-pin-gloo",
    ]
    reports = [
        os.path.join(workdir, f"{script}-{role}-{nproc}-{synced}-{i}.json") for i in range(nproc)
    ]
    if synced:
        template = reports[0].replace("-0.json", "-RANK.json")  # each rank writes its own
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            *base,
            "--report",
            template,
        ]
        subprocess.run(
            cmd,
            cwd=ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(workdir, f"{script}-{role}.log"), "w"),
        )
        files = [template.replace("RANK", str(r)) for r in range(nproc)]
    else:
        procs = [
            subprocess.Popen(
                [sys.executable, *base, "--report", path, "--slot", str(i)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
            )
            for i, path in enumerate(reports)
        ]
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError(f"a {script} worker failed")
        files = reports
    return [json.load(open(f)) for f in files if os.path.exists(f)]


def summarize(
    cfg: Config,
    script: str,
    one: dict,
    synced: list[dict],
    alone: list[dict],
    cost_s: float,
    typical_s: float,
) -> dict:
    """Figures of one script: FPS, efficiencies, collectives per mini-batch, time shares, and the
    bounds that a cost of `cost_s` per collective puts on them, and the efficiency `typical_s`
    predicts."""
    main = next(r for r in synced if r["rank"] == 0)
    fps_1, fps_n = one["fps"], main["fps"]
    fps_alone = sum(r["fps"] for r in alone)
    per_rank_comm = [
        r["seconds"].get("update", 0.0) + r["seconds"].get("other", 0.0) for r in synced
    ]
    steps = max(1, main["optimizer_steps"])
    update_comm = [r["seconds"].get("update", 0.0) / steps * 1e3 for r in synced]
    # Each update collective's time on a rank = waiting for the last rank to arrive + the collective
    # itself once all are there (transfer, waking the waiting threads): the ranks share one clock.
    calls = list(zip(*(r["spans"] for r in synced)))
    waiting = [max(a for a, _ in call) - start for call in calls for start, _ in call]
    after_arrival = [end - max(a for a, _ in call) for call in calls for _, end in call]
    # Bounds: each of the run's collectives costs `cost_s` on top of the iteration time of the
    # independent processes (which make none), whatever the code does around them.
    iterations = main["iterations"]
    calls_per_iteration = (
        main["calls"].get("update", 0) + main["calls"].get("other", 0)
    ) / iterations
    iteration_s = sum(r["window_s"] / r["iterations"] for r in alone) / len(alone)
    comm_floor_s = calls_per_iteration * cost_s
    return {
        "script": script,
        "collectives_per_iteration": calls_per_iteration,
        "independent_iteration_ms": iteration_s * 1e3,
        "comm_floor_ms_per_iteration": comm_floor_s * 1e3,
        "communication_efficiency_bound": iteration_s / (iteration_s + comm_floor_s),
        "communication_efficiency_at_typical": iteration_s
        / (iteration_s + calls_per_iteration * typical_s),
        "weak_scaling_bound": fps_alone
        / (cfg.nproc * fps_1)
        * iteration_s
        / (iteration_s + comm_floor_s),
        "comm_share_floor": comm_floor_s / (iteration_s + comm_floor_s),
        "fps_1": fps_1,
        "fps_n": fps_n,
        "fps_n_independent": fps_alone,
        "weak_scaling": fps_n / (cfg.nproc * fps_1),
        "communication_efficiency": fps_n / fps_alone,
        "collectives_per_minibatch": main["calls"].get("update", 0) / steps,
        "comm_ms_per_minibatch_mean": sum(update_comm) / len(update_comm),
        "comm_ms_per_minibatch_max": max(update_comm),
        "waiting_ms_per_minibatch": sum(waiting) / max(1, len(waiting)) * 1e3,
        "after_arrival_ms_per_minibatch": sum(after_arrival) / max(1, len(after_arrival)) * 1e3,
        "collect_share": main["collect_s"] / main["window_s"],
        "update_share": main["update_s"] / main["window_s"],
        "comm_share_max": max(per_rank_comm) / main["window_s"],
    }


def main(cfg: Config) -> None:
    """Run every measurement, print and write the results."""
    import launch

    os.makedirs(cfg.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench-")
    rows = []
    print("measuring collectives ...", flush=True)
    allreduce = launch(cfg, "ppo_ddp", cfg.nproc, True, workdir, role="allreduce")[0]
    for script in cfg.scripts:
        print(f"measuring {script} ...", flush=True)
        one = launch(cfg, script, 1, False, workdir)[0]
        synced = launch(cfg, script, cfg.nproc, True, workdir)
        alone = launch(cfg, script, cfg.nproc, False, workdir)
        typical = statistics.median(allreduce["sync_costs"])
        rows.append(summarize(cfg, script, one, synced, alone, allreduce["sync_cost"], typical))
    lines = [
        f"Weak scaling, {cfg.nproc} processes vs 1, default sizes per rank, {cfg.iterations} "
        f"iterations ({cfg.warmup} warm-up left out), device {cfg.device}, "
        f"{threads_per_process(cfg.nproc, cfg.pin)} thread(s) per process, "
        f"{len(launch.usable_cores())} CPUs.",
        "",
        f"| script | FPS 1 proc | FPS {cfg.nproc} synced | FPS {cfg.nproc} independent | weak "
        "scaling | communication eff. | collectives / mini-batch | comm ms / mini-batch (mean, "
        "max over ranks) | of which waiting for the last rank, then the collective | rollout "
        "share | update share | comm share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['script']} | {r['fps_1']:.0f} | {r['fps_n']:.0f} | {r['fps_n_independent']:.0f} "
            f"| {r['weak_scaling']:.2f} | {r['communication_efficiency']:.2f} | "
            f"{r['collectives_per_minibatch']:.2f} | {r['comm_ms_per_minibatch_mean']:.3f}, "
            f"{r['comm_ms_per_minibatch_max']:.3f} | {r['waiting_ms_per_minibatch']:.3f} + "
            f"{r['after_arrival_ms_per_minibatch']:.3f} | {r['collect_share']:.0%} | "
            f"{r['update_share']:.0%} | {r['comm_share_max']:.1%} |"
        )
    lines += [
        "",
        f"Gradient all_reduce of each script's default networks, {cfg.nproc} processes:",
        "",
        "| networks | tensors | numbers | the scripts' flat all_reduce (one collective) | one "
        "all_reduce per tensor | per tensor / ours |",
        "|---|---|---|---|---|---|",
    ]
    for script, n in allreduce["networks"].items():
        lines.append(
            f"| {script} | {n['tensors']} | {n['numel']} | {n['flat'] * 1e6:.0f} us | "
            f"{n['per_parameter'] * 1e6:.0f} us | {n['per_parameter'] / n['flat']:.1f}x |"
        )
    lines += [
        "",
        "What the machine allows. Back to back, with both ranks waiting, the cheapest collective "
        f"(one number; all_reduce, broadcast, all_gather) costs {allreduce['floor'] * 1e6:.0f} us. "
        f"In lock-step, each rank computing {allreduce['compute_ms']:.1f} ms ({cfg.sync_matmuls} "
        "products of 256 x 256 matrices) between two gradient all_reduces, one synchronization "
        f"adds at least {allreduce['sync_cost'] * 1e6:.0f} us to the compute alone (the smallest "
        f"of 5 measurements; their median {statistics.median(allreduce['sync_costs']) * 1e6:.0f} "
        "us) (transfer, waking the threads that wait, waiting for the rank the OS slowed down). "
        "Any code that synchronizes the ranks once per collective of the table above pays that on "
        "top of the independent processes' iteration:",
        "",
        "| script | collectives / iteration | independent iteration | their lock-step cost | best "
        "possible comm. eff. | comm. eff. at the median cost | best possible weak scaling | least "
        "possible comm share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['script']} | {r['collectives_per_iteration']:.0f} | "
            f"{r['independent_iteration_ms']:.0f} ms | {r['comm_floor_ms_per_iteration']:.1f} ms | "
            f"{r['communication_efficiency_bound']:.2f} | "
            f"{r['communication_efficiency_at_typical']:.2f} | {r['weak_scaling_bound']:.2f} | "
            f"{r['comm_share_floor']:.1%} |"
        )
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(cfg.out, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(cfg.out, "results.json"), "w") as f:
        json.dump(
            {"config": dataclasses.asdict(cfg), "scripts": rows, "allreduce": allreduce},
            f,
            indent=1,
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -r benchmarks/requirements.txt)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.plot(
            [1, cfg.nproc], [r["fps_1"], r["fps_n"]], marker="o", label=f"{r['script']} (synced)"
        )
        ax.plot(
            [1, cfg.nproc],
            [r["fps_1"], r["fps_n_independent"]],
            linestyle=":",
            marker="x",
            label=f"{r['script']} (independent)",
        )
    ax.set_xlabel("processes")
    ax.set_ylabel("global env steps / s")
    ax.set_xticks([1, cfg.nproc])
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(cfg.out, "fps.png"), dpi=120)


if __name__ == "__main__":
    config = tyro.cli(Config)
    config.report = config.report.replace("RANK", os.environ.get("RANK", "0"))
    if config.role == "worker":
        run_worker(config)
    elif config.role == "allreduce":
        run_allreduce(config)
    else:
        main(config)
