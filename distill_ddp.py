"""Data-parallel student-teacher distillation (rsl_rl's Distillation, DAgger style) in one file.

A frozen teacher (ppo_ddp.py's, trained on privileged observations) labels every state the student
visits with its mean action; the student, seeing what a robot would, acts and imitates the labels.
Both are broadcast from rank 0 at start; then ONE all_reduce of the student's gradients per step.

Pipeline (the first command, on CPU, made data/pendulum_partial_teacher.pt: docs/distillation.md):
    torchrun --standalone --nproc_per_node=2 ppo_ddp.py --task pendulum_partial \
        --actor-obs teacher --run-dir runs/teacher
    torchrun --standalone --nproc_per_node=2 distill_ddp.py --teacher runs/teacher
Launch:
    python distill_ddp.py                                              # 1 process, shipped teacher
    torchrun --standalone --nproc_per_node=2 distill_ddp.py            # 2 processes on CPU (gloo)
    torchrun --standalone --nproc_per_node=2 distill_ddp.py --student gru   # recurrent student
    torchrun --standalone --nproc_per_node=8 distill_ddp.py --device cuda   # 8 GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 distill_ddp.py \\
        --resume runs/distill_pendulum_partial/<time> --iterations 200
"""

from __future__ import annotations

import datetime
import functools
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import arguments
import bookkeeping
import checkpoints
import common
import envs
import launch
import networks
import speedups
from arguments import Count, NonNegative, Options, Positive, Widths, options
from networks import Actor  # the teacher of a checkpoint without `deployed`

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED_TEACHER = "data/pendulum_partial_teacher.pt"  # relative, so ranks on other machines agree
TEACHER_RECIPE = (
    "torchrun --standalone --nproc_per_node=2 ppo_ddp.py --task {task} --actor-obs {group} "
    "--run-dir runs/teacher"
)


@dataclass
class Args:
    """Distillation; sizes are per process."""

    task: str = "pendulum_partial"
    """Built-in task or your own environment as `module:function`; it must provide the student's
    groups and the teacher's (those its checkpoint names)."""
    teacher: str = SHIPPED_TEACHER
    """Checkpoint (file or run directory) of ppo_ddp.py or ppo_amp_ddp.py, trained on the privileged
    groups; the teacher reads the groups its checkpoint names."""
    student_obs: tuple[str, ...] = ("policy",)  # Observation groups the student sees (a robot's).
    student: Literal["mlp", "gru"] = "mlp"
    """`mlp`, or `gru`: a GRU cell before the MLP, trained by truncated backprop through time."""
    student_hidden: Widths = (128, 128)  # Hidden layer widths of the student MLP (ELU).
    rnn_hidden: Count = 64  # Width of the GRU cell of a `gru` student.
    num_envs: Count = 256  # Environments per process: the global batch grows with the processes.
    iterations: Count = 100  # Total learning iterations; a resumed run continues up to this number.
    seed: int = 1  # Base seed; rank r uses seed + r (moved on by the iteration when resuming).
    device: str = "auto"
    """`auto` (cuda:LOCAL_RANK if there is a GPU, else cpu), `cpu`, `cuda` (cuda:LOCAL_RANK: one GPU
    per process) or `cuda:N` (GPU N, for a single process)."""
    run_dir: str | None = None
    """Rank 0's metrics, checkpoints; default runs/<script>_<task>/<time>, or the resumed run's."""
    resume: str | None = None
    """Checkpoint file or run directory to continue from; `auto`: the `--run-dir`'s newest
    checkpoint, or a fresh start where it has none (what `torchrun --max-restarts` needs)."""
    logger: Literal["tensorboard", "wandb", "neptune", "none"] = "tensorboard"
    """Where rank 0 logs besides metrics.jsonl (always written), under rsl_rl's metric names; W&B
    and Neptune take other settings from the environment (WANDB_MODE=offline, NEPTUNE_MODE...)."""
    steps_per_env: Count = 32  # Rollout length per iteration.
    init_at_random_ep_len: bool = True  # Start each env at a random point of its time limit.
    normalize_obs: bool = True  # Normalize the student's input with statistics of every rank.
    action_noise_std: NonNegative = 0.1
    """Std of the Gaussian noise added to the student's actions while collecting (rsl_rl's student
    init_noise_std): it widens the states the teacher labels. 0 acts deterministically."""
    epochs: Count = 1  # Passes over each rollout.
    gradient_length: Count = 8
    """Rollout steps per optimizer step (the BPTT window of a `gru` student). A shorter last window
    is kept, not dropped as in rsl_rl, so every step of the rollout enters the loss."""
    loss: Literal["mse", "huber"] = "mse"  # Behavior loss between student and teacher actions.
    learning_rate: Positive = 1e-3  # Adam learning rate (fixed).
    max_grad_norm: Positive = 1.0  # Gradient clipping of the student, after the all_reduce.
    eval_envs: Count = 64  # Evaluation episodes per process at the end, for each of the 3 policies.
    eval_seed: int = 10_000  # Env seed of the evaluation on rank r: eval_seed + r, alike for all 3.
    random_action_bound: NonNegative = 2.0
    """The random baseline's uniform actions in [-bound, bound]."""
    speed: Annotated[speedups.SpeedArgs, Options] = options(speedups.SpeedArgs)
    run: Annotated[arguments.RunArgs, Options] = options(arguments.RunArgs)
    dist: Annotated[arguments.DistArgs, Options] = options(arguments.DistArgs)


# --- Teacher and student --------------------------------------------------------------------------
def load_teacher(
    path: str, obs: Mapping[str, torch.Tensor], num_actions: int, task: str
) -> nn.Module:
    """The frozen teacher: the actor of a ppo_ddp.py or ppo_amp_ddp.py checkpoint, or of a fork's,
    rebuilt by the class the checkpoint deploys (`teacher_class`), `Class(**config)`; its label is
    the mean of its Gaussian, through its saved normalizer. It must read groups this env provides,
    of the shapes it was trained on, and give `num_actions` actions.

    Local to this rank (every rank reads the same file), so a bad file raises on every rank before
    any collective.
    """
    recipe = TEACHER_RECIPE.format(task=task, group="<privileged group>")
    try:
        found = path if os.path.isabs(path) or os.path.exists(path) else os.path.join(HERE, path)
        checkpoint = checkpoints.load_checkpoint(found, None)
        actor_class = teacher_class(checkpoint, path)
        missing = [key for key in ("actor", "configs") if key not in checkpoint]
        if missing:
            raise ValueError(f"checkpoint {path!r} lacks {missing}.")
        config = checkpoint["configs"].get("actor")
        if not isinstance(config, dict) or not {"obs_shapes", "num_actions"} <= config.keys():
            raise ValueError(
                f"{actor_class.__qualname__}, the actor of {path!r}, is not a feed-forward actor "
                "that labels each state alone (its config lacks obs_shapes or num_actions)."
            )
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"teacher checkpoint {path!r} not found; train a teacher on the privileged group with "
            f"`{recipe}` and pass --teacher runs/teacher (or one of its model_*.pt files)."
        ) from error
    except ValueError as error:
        raise ValueError(
            f"--teacher must be a PPO policy written by ppo_ddp.py, ppo_amp_ddp.py or a fork of "
            f"them: {error} Make one with `{recipe}`."
        ) from error
    wanted = {group: list(shape) for group, shape in config["obs_shapes"].items()}
    here = {group: list(obs[group].shape[1:]) if group in obs else None for group in wanted}
    if here != wanted or config["num_actions"] != num_actions:
        raise ValueError(
            f"teacher {path!r} reads {wanted} and gives {config['num_actions']} actions, but this "
            f"environment has {here} and {num_actions} actions. Train the teacher on this task's "
            f"privileged group: `{recipe}`."
        )
    try:
        teacher = actor_class(**config)
        teacher.load_state_dict(checkpoint["actor"])
    except (TypeError, RuntimeError) as error:
        name = f"{actor_class.__module__}.{actor_class.__qualname__}"
        raise ValueError(
            f"teacher {path!r} does not match the network its config describes "
            f"({common.first_line(error)}): it is damaged, or {name} changed since; train a "
            f"teacher again: `{recipe}`."
        ) from None
    teacher.requires_grad_(False)  # frozen: never in the optimizer, never in the all_reduce
    return teacher.eval()


def teacher_class(checkpoint: dict[str, Any], path: str) -> type[nn.Module]:
    """The class of the actor a checkpoint deploys (`checkpoints.deployed`), imported from the
    script beside this one that defines it: a fork's own class too. A checkpoint that names none
    (written before they did) is ppo_ddp.py's or ppo_amp_ddp.py's: `Actor`. ValueError for one that
    deploys no actor. Nothing of the checkpoint runs: at most the named script is imported."""
    named = checkpoint.get("deployed")
    if not named:
        if checkpoint["script"] not in ("ppo", "ppo_amp"):
            raise ValueError(
                f"checkpoint {path!r} is a {checkpoint['script']!r} checkpoint, which deploys no "
                "actor."
            )
        return Actor
    module, name, part = (str(named.get(key)) for key in ("module", "class", "part"))
    if part != "actor":
        raise ValueError(f"checkpoint {path!r} deploys {module}.{name}, its {part}, not an actor.")
    if not re.fullmatch(r"\w+", module) or not os.path.isfile(os.path.join(HERE, module + ".py")):
        raise ValueError(
            f"checkpoint {path!r} deploys {module}.{name}, from no script beside distill_ddp.py; "
            "distill in the checkout that trained it."
        )
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError as error:
        raise ValueError(
            f"checkpoint {path!r} deploys {module}.{name}, and {module}.py does not import "
            f"({common.first_line(error)})."
        ) from error
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(f"checkpoint {path!r} deploys {module}.{name}, which is no network class.")
    return found


def teacher_fingerprint(teacher: nn.Module) -> str:
    """Hash of the teacher's weights and normalizer: a resume must use the teacher it started
    with."""
    return common.fingerprint({"teacher": teacher})


class Student(nn.Module):
    """Its groups (flat ones) -> (GRU cell) -> MLP -> action; memory (batch, 0) without a GRU."""

    def __init__(
        self,
        obs_shapes: dict[str, list[int]],
        num_actions: int,
        hidden: Sequence[int],
        rnn_hidden: int,
        normalize: bool,
    ) -> None:
        super().__init__()
        self.config = networks.config_of(locals())
        self.inputs = networks.Inputs(obs_shapes, normalize)
        self.rnn = nn.GRUCell(self.inputs.width, rnn_hidden) if rnn_hidden > 0 else None
        self.memory_size = rnn_hidden
        width = rnn_hidden if self.rnn is not None else self.inputs.width
        self.net = networks.mlp(width, tuple(hidden), num_actions)

    def initial_memory(self, batch: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(batch, self.memory_size, device=device)

    def forward(
        self, obs: Mapping[str, torch.Tensor], memory: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.inputs(obs)
        if self.rnn is not None:
            memory = self.rnn(x, memory)
            x = memory
        return self.net(x), memory


def behavior_loss(actions: torch.Tensor, labels: torch.Tensor, loss: str) -> torch.Tensor:
    return (
        F.mse_loss(actions, labels) if loss == "mse" else F.huber_loss(actions, labels, delta=1.0)
    )


def time_chunks(steps: int, gradient_length: int) -> list[range]:
    """Windows of `gradient_length` steps covering [0, steps); the last may be shorter."""
    return [range(s, min(s + gradient_length, steps)) for s in range(0, steps, gradient_length)]


@dataclass
class DistillRollout:
    """The student's groups, teacher labels and dones (T, N, ...), and the memory before step 0."""

    obs: dict[str, torch.Tensor]  # the student's groups, each (T, N, dim)
    labels: torch.Tensor
    dones: torch.Tensor
    memory: torch.Tensor


def act(
    student: Student,
    teacher: Actor,
    noise_std: float,
    obs: Mapping[str, torch.Tensor],
    memory: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (the student's actions, them with exploration noise, its memory, the teacher's labels)."""
    actions, memory = student(obs, memory)
    labels = teacher(obs)[0]
    return actions, actions + noise_std * torch.randn_like(actions), memory, labels


@torch.inference_mode()
def rollout(
    env: envs.VecEnv,
    policy_step: Callable[..., tuple[torch.Tensor, ...]],
    obs: Mapping[str, torch.Tensor],
    memory: torch.Tensor,
    buf: DistillRollout,
    episodes: envs.Episodes,
    args: Args,
) -> tuple[Mapping[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], str]:
    """Student acts, teacher labels (DAgger) -> (next obs, memory, logs, "" or why it stopped)."""
    buf.memory.copy_(memory)
    logs: dict[str, torch.Tensor] = {
        "teacher_action_error": torch.zeros((), device=buf.labels.device)
    }
    for t in range(args.steps_per_env):
        for group, stored in buf.obs.items():
            if obs[group].shape != stored.shape[1:]:  # every rank hears of it after the rollout
                was, now = list(stored.shape[2:]), list(obs[group].shape[1:])
                where = f"step {t + 1} of {args.steps_per_env}"
                problem = (
                    f"observation group {group!r} changed shape from {was} to {now} at {where}"
                )
                return obs, memory, logs, problem
        actions, noisy, memory, labels = policy_step(obs, memory)
        logs["teacher_action_error"] += (actions - labels).norm(dim=-1).mean() / args.steps_per_env
        for group, stored in buf.obs.items():
            stored[t] = obs[group]
        obs, rewards, dones, extras = env.step(noisy)
        dones = dones.to(torch.float32)
        buf.labels[t], buf.dones[t] = labels, dones
        memory = memory * (1.0 - dones).unsqueeze(-1)  # an episode that ended leaves no memory
        envs.track_episodes(episodes, rewards, dones)
        envs.accumulate_logs(logs, extras, rewards.device)
    return obs, memory, logs, ""


@torch.compiler.disable  # --compile, --cuda-graphs: the collective stays eager, between two graphs
def all_reduce_mean(flat: torch.Tensor, world_size: int) -> None:
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size


def make_update(
    student: Student,
    optimizer: torch.optim.Optimizer,
    buf: DistillRollout,
    args: Args,
    ctx: common.Dist,
) -> Callable[[], dict[str, float]]:
    """Behavior cloning on `buf`, built once: `update()` steps once per `gradient_length` window ->
    mean loss and gradient norm. The student replays the rollout from its stored memory (truncated
    BPTT). A window's summed loss is divided by `gradient_length`: every step weighs the same."""
    params = list(student.parameters())
    bf16 = args.speed.mixed_precision == "bf16"  # autocast's casts not cached: CUDA graphs

    def window_step(
        obs: dict[str, torch.Tensor],
        labels: torch.Tensor,
        dones: torch.Tensor,
        memory: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One step on a window ((steps, N, ...)) from `memory` -> (the next memory, statistics)."""
        step_losses = []
        for t in range(labels.shape[0]):
            with torch.autocast(ctx.device.type, torch.bfloat16, enabled=bf16, cache_enabled=False):
                actions, memory = student({group: x[t] for group, x in obs.items()}, memory)
                step_losses.append(behavior_loss(actions, labels[t], args.loss))
            memory = memory * (1.0 - dones[t].to(memory.dtype)).unsqueeze(-1)
        summed = torch.stack(step_losses).float().sum()
        optimizer.zero_grad(set_to_none=False)
        (summed / args.gradient_length).backward()
        # SYNC: the optimizer step's one collective: the student's gradients, then the loss, in one
        # flat buffer averaged over ranks; copied back, every rank takes the same step.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([*(grad.reshape(-1) for grad in grads), summed.detach().reshape(1)])
        if ctx.world_size > 1:
            all_reduce_mean(flat, ctx.world_size)
        offset = 0
        for p in params:
            grad = flat[offset : offset + p.numel()].view_as(p)
            p.grad = grad.clone() if p.grad is None else p.grad.copy_(grad)
            offset += p.numel()
        norm = nn.utils.clip_grad_norm_(params, args.max_grad_norm)  # after the all_reduce: alike
        optimizer.step()
        # float32 between windows, whatever the student's memory was
        return memory.detach().float(), {"behavior_loss": flat[-1], "grad_norm": norm}

    step = window_step
    if speedups.asked(args.speed, ctx.device):  # --compile, --cuda-graphs
        step = speedups.compiled(window_step, args.speed, ctx.device)
    windows = time_chunks(args.steps_per_env, args.gradient_length)

    def update() -> dict[str, float]:
        sums: dict[str, torch.Tensor] = {}  # on the device, read back once
        for _ in range(args.epochs):
            memory = buf.memory  # every epoch starts from the memory the rollout started with
            for window in windows:
                rows = slice(window.start, window.stop)
                obs = {group: x[rows] for group, x in buf.obs.items()}
                memory, stats = step(obs, buf.labels[rows], buf.dones[rows], memory)
                for name, value in stats.items():
                    sums[name] = sums.get(name, 0) + value
        summed = dict(zip(sums, torch.stack(list(sums.values())).tolist()))
        means = {"behavior_loss": summed["behavior_loss"] / (args.epochs * args.steps_per_env)}
        means["grad_norm"] = summed["grad_norm"] / (args.epochs * len(windows))
        common.check_update(means, "the environment, the teacher or the learning rate")
        return means

    return update


# --- Evaluation -----------------------------------------------------------------------------------
@torch.inference_mode()
def evaluate(
    student: Student, teacher: Actor, num_actions: int, args: Args, ctx: common.Dist
) -> dict[str, float]:
    """Mean return of teacher, student and random actions on the same new episodes. 1 all_reduce."""
    sums = []
    for name in ("teacher", "student", "random"):
        env = envs.make_env(args.task, args.eval_envs, ctx.device, args.eval_seed + ctx.rank)
        generator = torch.Generator(device=ctx.device).manual_seed(args.eval_seed + ctx.rank)
        obs, memory = env.get_observations(), student.initial_memory(args.eval_envs, ctx.device)
        returns = torch.zeros(args.eval_envs, device=ctx.device)
        alive = torch.ones(args.eval_envs, device=ctx.device)
        for _ in range(int(env.max_episode_length)):
            if name == "teacher":
                actions = teacher(obs)[0]
            elif name == "student":
                actions, memory = student(obs, memory)
            else:
                u = torch.rand(args.eval_envs, num_actions, generator=generator, device=ctx.device)
                actions = (2 * u - 1) * args.random_action_bound
            obs, rewards, dones, _ = env.step(actions)
            returns += rewards * alive  # only each env's first episode counts
            alive *= 1.0 - dones.float()
            memory = memory * (1.0 - dones.to(memory.dtype)).unsqueeze(-1)
        sums.append(returns.sum())
    episodes = args.eval_envs * ctx.world_size
    # SYNC: returns of every rank's evaluation episodes, summed in one all_reduce.
    totals = common.all_reduce_sum(torch.stack(sums), ctx.world_size) / episodes
    teacher_return, student_return, random_return = totals.tolist()
    gap = teacher_return - random_return
    return {
        "teacher_return": teacher_return,
        "student_return": student_return,
        "random_return": random_return,
        "student_fraction_of_teacher": (student_return - random_return) / gap
        if gap
        else float("nan"),
        "eval_episodes": episodes,
    }


def main(args: Args) -> tuple[str, str]:
    # SYNC: join torchrun's job as nanoGPT does; the finite timeout ends it when a rank is lost.
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank, d, start_group = int(os.environ.get("LOCAL_RANK", "0")), args.dist, None
    if world_size > 1:
        nccl = torch.cuda.is_available() and args.device.startswith(("auto", "cuda"))
        store = launch.attempt_store(rank, world_size, d.start_timeout_s)  # a restart's own store
        timeout = datetime.timedelta(seconds=d.dist_timeout_s)
        dist.init_process_group("nccl" if nccl else "gloo", timeout=timeout, **store)
        start_group = launch.start_group(rank, d.start_timeout_s)  # start-up's, a longer timeout
    try:
        device, problem = common.device_or_problem(args.device, local_rank, world_size)
        if device.type == "cuda":  # one GPU per process, cuda:{LOCAL_RANK}; auto: the CPU if none
            torch.cuda.set_device(device)
        launch.share_cores(local_rank, d.pin_cores and world_size > 1, device.type == "cpu")
        torch.manual_seed(args.seed + rank)  # the global rank: local ranks repeat on every node
        ctx = common.Dist(rank, world_size, device, rank == 0, start_group)
        common.agree(ctx, problem)  # SYNC: a rank without its device stops all (only it knows)
        fingerprint = train(args, ctx)
        if world_size > 1:  # SYNC: no rank leaves while another is still in its last collective
            dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
        return fingerprint
    finally:
        bookkeeping.let_go()  # the signal handlers put back, rank 0's run directory released
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: Args, ctx: common.Dist) -> tuple[str, str]:
    """Distill on this rank; -> fingerprints of the student's trained state and of the teacher."""
    problem, facts = None, None  # a failure waits for the start-up check: no rank hangs on another
    try:
        arguments.check_args(args)  # as the command line was checked; again for a caller of main
        speedups.check(args.speed, ctx.device, ctx.is_main)  # --compile inductor: a C++ compiler
        resume_from = checkpoints.resume_point(args, "distill", ctx.is_main)  # state None: fresh
        first = resume_from.first_iteration
        # seeds what is drawn from here on: env start times, network weights, action noise
        torch.manual_seed(seed := envs.rank_seed(args.seed, ctx.rank, first))
        steps_taken = args.steps_per_env * (first - 1)  # a curriculum's clock (envs/go1.py)
        env = envs.make_env(
            args.task, args.num_envs, ctx.device, seed, args.init_at_random_ep_len, steps_taken
        )
        obs = env.get_observations()
        student_groups = envs.resolve_groups(obs, args.student_obs, flag="--student-obs")
        teacher = load_teacher(args.teacher, obs, env.num_actions, args.task)
        rnn_hidden = args.rnn_hidden if args.student == "gru" else 0
        shapes = envs.group_shapes(obs, student_groups)
        student = Student(
            shapes, env.num_actions, args.student_hidden, rnn_hidden, args.normalize_obs
        )
        student, teacher = student.to(ctx.device), teacher.to(ctx.device)
        fused = speedups.fused_adam(args.speed, ctx.device)
        optimizer = torch.optim.Adam(student.parameters(), lr=args.learning_rate, fused=fused)
        trained = {"student": student, "optimizer": optimizer}  # checkpointed, checked
        checkpoints.restore(resume_from, trained)  # a fresh start: nothing to restore
        if resume_from.state and resume_from.state.get(
            "teacher_fingerprint"
        ) != teacher_fingerprint(teacher):
            raise ValueError(
                f"--teacher {args.teacher!r} is not the teacher the checkpoint "
                f"{resume_from.path!r} was distilled from ({resume_from.state.get('teacher')!r}); "
                "resume with that teacher."
            )
        facts = (shapes, env.num_actions, resume_from.first_iteration, resume_from.fingerprint)
    except Exception as error:  # noqa: BLE001 - every rank hears of it at the check
        problem = error
    # SYNC: the start-up check (1 all_gather): a failed or differing rank stops all, in one line.
    common.agree(ctx, problem, facts, args)
    # SYNC: every rank starts from rank 0's student (weights and normalizer) and teacher.
    common.broadcast_state([student, teacher], ctx.world_size)
    title = f"Distillation on {args.task} ({args.student} student, teacher {args.teacher})"
    saved_with = {"teacher": args.teacher, "teacher_fingerprint": teacher_fingerprint(teacher)}
    run, problem = bookkeeping.start_run(
        ctx, args, "distill", trained, title, resume_from, saved_with
    )
    common.agree(ctx, problem)  # SYNC: all stop if rank 0 could not take the run dir or logger
    T, N, A = args.steps_per_env, args.num_envs, env.num_actions
    stored = {
        group: torch.zeros(T, N, *shape, device=ctx.device) for group, shape in shapes.items()
    }
    zeros = functools.partial(torch.zeros, device=ctx.device)
    buf = DistillRollout(stored, zeros(T, N, A), zeros(T, N), student.initial_memory(N, ctx.device))
    memory = buf.memory.clone()  # the student's memory, carried from rollout to rollout
    episodes = envs.make_episodes(N, ctx.device, env.episode_length_buf)
    labelled_step = functools.partial(act, student, teacher, args.action_noise_std)
    policy_step = labelled_step
    if speedups.asked(args.speed, ctx.device):  # --compile, --cuda-graphs (the update's step too)
        policy_step = speedups.compiled(policy_step, args.speed, ctx.device)
    update = make_update(student, optimizer, buf, args, ctx)
    stop = False
    for it in range(resume_from.first_iteration, args.iterations + 1):
        t0 = time.time()
        # COLLECT: the student acts, the teacher labels
        obs, memory, logs, problem = rollout(env, policy_step, obs, memory, buf, episodes, args)
        # SYNC: a stopped rollout or NaN/Inf on a rank stops every rank, naming it (1 all_reduce).
        common.check_rollout(ctx, problem, buf.obs, {"teacher labels": buf.labels}, it)
        collect_s = time.time() - t0
        # UPDATE: one all_reduce per optimizer step, inside
        if args.normalize_obs:
            # SYNC: student input statistics merged over every rank's rollout (1 all_gather), before
            # the update, so the student trains with the normalization it will act with next.
            normalizer_batch = (student.inputs.normalizer, student.inputs.flat_part(buf.obs))
            common.update_normalizers([normalizer_batch], ctx.world_size)
        losses = update()
        # LOG, CHECK, SAVE
        lr, update_s = optimizer.param_groups[0]["lr"], time.time() - t0 - collect_s
        metrics = {"learning_rate": lr, **losses, "collect_s": collect_s, "update_s": update_s}
        # SYNC: every rank's finished episodes and env logs, and any stop request (1 all_reduce).
        logged, stop = common.reduce_logs(
            ctx, episodes.finished, logs, run.log_keys, run.stop_requested()
        )
        if ctx.is_main:  # rank 0 alone writes: the row of metrics.jsonl, the console, the logger
            row = bookkeeping.metrics_row(run, it, {**logged, **metrics})
            with open(os.path.join(run.dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            print(bookkeeping.console_line(run, row, stop), flush=True)
            run.logger.write(bookkeeping.scalars(run, row), it)  # TensorBoard, W&B, Neptune
        # SYNC: every --check-interval iterations, the trained state's hash compared (1 all_gather).
        common.check_ranks_agree(ctx, it, args.dist.check_interval, trained)
        if bookkeeping.save_due(args, it, stop):
            problem = bookkeeping.save(run, it, metrics["learning_rate"]) if ctx.is_main else None
            common.agree(ctx, problem)  # SYNC: all stop if rank 0 could not save (1 all_gather)
        if stop:
            break
    if not stop:
        # EVALUATE: teacher, student and a random policy on the same new episodes (1 all_reduce)
        result = evaluate(student, teacher, A, args, ctx)
        if ctx.is_main:
            with open(os.path.join(run.dir, "eval.json"), "w") as f:
                json.dump(result, f, indent=1)
            said = " | ".join(f"{k} {v:.4g}" for k, v in result.items())
            noisy = f"training returns: the student with --action-noise-std {args.action_noise_std}"
            print(f"evaluation, deterministic actions on the same new episodes ({noisy}): {said}")
    bookkeeping.finish_run(ctx, run)
    return common.fingerprint(trained), teacher_fingerprint(teacher)


if __name__ == "__main__":
    rank = int(os.environ.get("RANK", "0"))
    if rank:  # one command line for every rank: rank 0 alone prints --help, its errors, settings
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    try:
        args = arguments.parse_args(Args)  # tyro.cli(Args), checked; exits on --help
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        main(args)
    except BaseException as error:  # one line for an expected failure, and its exit code
        sys.exit(bookkeeping.exit_code(error, rank))
