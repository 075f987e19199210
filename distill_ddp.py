"""Data-parallel student-teacher distillation (rsl_rl's Distillation, DAgger style) in one file.

A frozen teacher, trained with privileged observations by ppo_ddp.py, labels every state the student
visits with its deterministic action (the actor mean); the student, which sees only what a deployed
robot would see, acts in the environment and learns to imitate the labels (MSE or Huber). Across
processes: the student and the teacher are broadcast from rank 0 at start, then each optimizer step
costs ONE all_reduce of the student's gradients. No adaptive learning rate.

Pipeline (data/pendulum_partial_teacher.pt was trained by the first command, on CPU: docs/distillation.md):
    torchrun --standalone --nproc_per_node=2 ppo_ddp.py --task pendulum_partial --actor-obs teacher \
        --run-dir runs/teacher
    torchrun --standalone --nproc_per_node=2 distill_ddp.py --teacher runs/teacher
Launch:
    python distill_ddp.py                                              # 1 process, shipped teacher
    torchrun --standalone --nproc_per_node=2 distill_ddp.py            # 2 processes on CPU (gloo)
    torchrun --standalone --nproc_per_node=2 distill_ddp.py --student gru   # recurrent student
    torchrun --standalone --nproc_per_node=8 distill_ddp.py --device cuda   # 8 GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 distill_ddp.py --resume runs/distill_pendulum_partial/<time> --iterations 200
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

import bookkeeping
import checkpoints
import common
import cuda_graphs
import envs
import inputs
from common import Count, NonNegative, Positive

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED_TEACHER = "data/pendulum_partial_teacher.pt"  # relative, so ranks on other machines agree
TEACHER_RECIPE = (
    "torchrun --standalone --nproc_per_node=2 ppo_ddp.py --task {task} --actor-obs {group} --run-dir runs/teacher"
)


@dataclass
class Args(common.UpdateArgs, bookkeeping.RunArgs):
    """Distillation; sizes are per process (the run's arguments are bookkeeping.RunArgs, the update's common.UpdateArgs)."""

    task: str = "pendulum_partial"
    """Built-in task or your own environment as `module:function`; it must provide the student's groups and the
    teacher's (those its checkpoint names)."""
    teacher: str = SHIPPED_TEACHER
    """ppo_ddp.py checkpoint (file or run directory) of a teacher trained on the privileged groups; it reads the
    groups its checkpoint names."""
    student_obs: tuple[str, ...] = ("policy",)
    """Observation groups the student sees, side by side (what a deployed robot has)."""
    iterations: Count = 100
    """Total learning iterations; a resumed run continues up to this number."""
    student: Literal["mlp", "gru"] = "mlp"
    """`mlp`, or `gru`: a GRU cell before the MLP, trained with truncated backpropagation through time."""
    student_hidden: tuple[int, ...] = (128, 128)
    """Hidden layer widths of the student MLP (ELU activations)."""
    rnn_hidden: Count = 64
    """Width of the GRU cell of a `gru` student."""
    normalize_obs: bool = True
    """Normalize the student's input with running statistics merged across ranks."""
    action_noise_std: NonNegative = 0.1
    """Std of the Gaussian noise added to the student's actions while collecting (not trained; rsl_rl's
    student init_noise_std); it widens the states the teacher labels. 0 acts deterministically."""
    epochs: Count = 1
    """Passes over each rollout."""
    gradient_length: Count = 8
    """Rollout steps per optimizer step (the BPTT window of a `gru` student). A shorter last window is
    kept, not dropped as in rsl_rl, so every step of the rollout enters the loss."""
    loss: Literal["mse", "huber"] = "mse"
    """Behavior loss between student and teacher actions: `mse` or `huber`."""
    learning_rate: Positive = 1e-3
    """Adam learning rate (fixed)."""
    max_grad_norm: Positive = 1.0
    """Gradient clipping over all student parameters, after the all_reduce."""
    eval_envs: Count = 64
    """Evaluation episodes per process at the end (one per env), for teacher, student and random policy."""
    eval_seed: int = 10_000
    """Env seed of the evaluation on rank r: eval_seed + r, the same for the three policies."""
    random_action_bound: NonNegative = 2.0
    """The random baseline draws actions uniformly from [-bound, bound] (Pendulum's torque limit)."""


# --- Teacher and student --------------------------------------------------------------------------


class Teacher(nn.Module):
    """A frozen ppo_ddp.py actor, built from its checkpoint's config as ppo_ddp.Actor builds itself (its observation
    groups, inputs.py, then the MLP), so its saved `actor` state loads as it is: its label is the mean of its
    Gaussian, through its own saved observation normalizer. A fork that changes ppo_ddp.Actor changes this too."""

    def __init__(self, actor: dict[str, Any]) -> None:
        """`actor`: the config of a ppo_ddp.py checkpoint's actor (`configs["actor"]`)."""
        super().__init__()
        self.inputs = inputs.Inputs(actor["obs_shapes"], actor["normalize"], actor["cnn"], actor["activation"])
        self.net = common.mlp(self.inputs.width, tuple(actor["hidden"]), actor["num_actions"], actor["activation"])
        # Saved with the actor (`log_std`, or `std` for --std-type scalar); labels do not use it.
        std = nn.Parameter(torch.zeros(actor["num_actions"]))
        self.register_parameter("std" if actor["std_type"] == "scalar" else "log_std", std)

    def forward(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The teacher's label: its deterministic action (batch, num_actions)."""
        return self.net(self.inputs(obs))


def load_teacher(path: str, obs: Mapping[str, torch.Tensor], num_actions: int, task: str) -> Teacher:
    """Rebuild the frozen teacher from a ppo_ddp.py checkpoint; its saved normalizer is used as saved. It must read
    groups this env provides, of the shapes it was trained on, and give `num_actions` actions.

    Local to this rank (every rank reads the same file), so a bad file raises on every rank before
    any collective.
    """
    recipe = TEACHER_RECIPE.format(task=task, group="<privileged group>")
    try:
        found = path if os.path.isabs(path) or os.path.exists(path) else os.path.join(HERE, path)
        checkpoint = checkpoints.load_checkpoint(found, "ppo", ("actor", "configs"))
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"teacher checkpoint {path!r} not found; train a teacher on the privileged group with `{recipe}` "
            f"and pass --teacher runs/teacher (or one of its model_*.pt files)."
        ) from error
    except ValueError as error:
        raise ValueError(
            f"--teacher must be a PPO policy written by ppo_ddp.py: {error} Make one with `{recipe}`."
        ) from error
    config = checkpoint["configs"]["actor"]
    wanted = {group: list(shape) for group, shape in config["obs_shapes"].items()}
    here = {group: list(obs[group].shape[1:]) if group in obs else None for group in wanted}
    if here != wanted or config["num_actions"] != num_actions:
        raise ValueError(
            f"teacher {path!r} reads {wanted} and gives {config['num_actions']} actions, but this environment has "
            f"{here} and {num_actions} actions. Train the teacher on this task's privileged group: `{recipe}`."
        )
    teacher = Teacher(config)
    try:
        teacher.load_state_dict(checkpoint["actor"])
    except RuntimeError as error:
        raise ValueError(
            f"teacher {path!r} does not match the network its config describes ({common.first_line(error)}): it is "
            f"damaged, or ppo_ddp.Actor was changed without Teacher; train a teacher again: `{recipe}`."
        ) from None
    teacher.requires_grad_(False)  # frozen: never in the optimizer, never in the all_reduce
    return teacher.eval()


def teacher_fingerprint(teacher: Teacher) -> str:
    """Hash of the teacher's weights and normalizer: a resume must use the teacher it started with."""
    return common.fingerprint([teacher], [])


class Student(nn.Module):
    """Its observation groups (inputs.py, flat ones) -> (GRU cell) -> MLP -> action. Its memory is (batch,
    memory_size): the GRU's state, or (batch, 0) for an MLP."""

    def __init__(
        self, obs_shapes: dict[str, list[int]], num_actions: int, hidden: Sequence[int], rnn_hidden: int,
        normalize: bool,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = common.constructor_config(locals())
        self.inputs = inputs.Inputs(obs_shapes, normalize)
        self.rnn = nn.GRUCell(self.inputs.width, rnn_hidden) if rnn_hidden > 0 else None
        self.memory_size = rnn_hidden
        self.net = common.mlp(rnn_hidden if self.rnn is not None else self.inputs.width, tuple(hidden), num_actions)

    def initial_memory(self, batch: int, device: torch.device) -> torch.Tensor:
        """A blank memory for `batch` envs."""
        return torch.zeros(batch, self.memory_size, device=device)

    def forward(self, obs: Mapping[str, torch.Tensor], memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: -> (actions (batch, num_actions), next memory)."""
        x = self.inputs(obs)
        if self.rnn is not None:
            memory = self.rnn(x, memory)
            x = memory
        return self.net(x), memory


def behavior_loss(actions: torch.Tensor, labels: torch.Tensor, loss: str) -> torch.Tensor:
    """Mean MSE or Huber (delta 1) loss between student actions and teacher labels."""
    return F.mse_loss(actions, labels) if loss == "mse" else F.huber_loss(actions, labels, delta=1.0)


def time_chunks(steps: int, gradient_length: int) -> list[range]:
    """Consecutive windows of `gradient_length` steps covering [0, steps); the last may be shorter."""
    return [range(s, min(s + gradient_length, steps)) for s in range(0, steps, gradient_length)]


# --- Rollout --------------------------------------------------------------------------------------


@dataclass
class DistillRollout:
    """One rollout: the student's observation groups, teacher labels and dones (T, N, ...), and the memory
    before step 0."""

    obs: dict[str, torch.Tensor]  # the student's groups, each (T, N, dim)
    labels: torch.Tensor
    dones: torch.Tensor
    memory: torch.Tensor


def act(
    student: Student, teacher: Teacher, noise_std: float, obs: Mapping[str, torch.Tensor], memory: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inference step -> (the student's actions, those actions with exploration noise, its next
    memory, the teacher's labels). Local; no host sync, so `cuda_graphs.cuda_graph` can replay it."""
    actions, memory = student(obs, memory)
    labels = teacher(obs)
    return actions, actions + noise_std * torch.randn_like(actions), memory, labels


@torch.inference_mode()
def rollout(
    env: envs.VecEnv, policy_step: Callable[..., tuple[torch.Tensor, ...]], obs: Mapping, groups: Sequence[str],
    memory: torch.Tensor, buf: DistillRollout, episodes: envs.Episodes, args: Args,
) -> tuple[Mapping, torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """The student acts for `steps_per_env` steps, the teacher labels each state (DAgger); fills `buf`.

    `policy_step(obs of `groups`, memory)` is `act` on student and teacher, or its CUDA graph. Local to this
    rank: no communication. Returns the next observations, the student's memory (carried into the next
    rollout) and the mean of the env's log scalars plus the teacher-action error.
    """
    buf.memory.copy_(memory)
    logs: dict[str, torch.Tensor] = {"teacher_action_error": torch.zeros((), device=buf.labels.device)}
    for t in range(args.steps_per_env):
        actions, noisy, memory, labels = policy_step({group: obs[group] for group in groups}, memory)
        logs["teacher_action_error"] += (actions - labels).norm(dim=-1).mean() / args.steps_per_env
        for group, stored in buf.obs.items():
            stored[t] = obs[group]
        obs, rewards, dones, extras = env.step(noisy)
        dones = dones.to(torch.float32)
        buf.labels[t], buf.dones[t] = labels, dones
        memory = common.forget(memory, dones)
        envs.track_episodes(episodes, rewards, dones)
        envs.accumulate_logs(logs, extras, rewards.device)
    return obs, memory, logs


# --- Update ---------------------------------------------------------------------------------------


def make_update(
    student: Student, optimizer: torch.optim.Optimizer, buf: DistillRollout, args: Args, ctx: common.Dist,
    graphs: bool = False,
) -> Callable[[], dict[str, float]]:  # fmt: skip
    """Behavior cloning on the rollout in `buf`, built once per run: `update()` takes one optimizer step
    per window of `gradient_length` steps and returns the mean behavior loss over steps, epochs and
    ranks and the mean gradient norm before clipping. With `graphs`, each step is replayed from CUDA
    graphs (cuda_graphs.py; one per window length).

    The student replays the rollout from its stored memory (resetting it at dones, as when acting),
    so a GRU learns through time; the graph is cut between windows (truncated BPTT). Each window's
    loss is its per-step losses summed and divided by `gradient_length`: every step weighs the same,
    also in a shorter last window.
    """
    params = list(student.parameters())
    totals = common.Totals()  # the summed behavior loss, the summed gradient norm

    def window_step(
        obs: dict[str, torch.Tensor], labels: torch.Tensor, dones: torch.Tensor, memory: torch.Tensor
    ) -> torch.Tensor:
        """One optimizer step on one window of the rollout (`obs`, `labels`, `dones`: (steps, N, ...)), the
        student unrolled from `memory` -> the memory the next window starts from, cut from the graph (truncated
        BPTT). Adds its loss and gradient norm to `totals`; writes in place only and never reads back to the
        host, so that a CUDA graph can replay it."""
        step_losses = []
        for t in range(labels.shape[0]):
            with common.autocast(ctx.device, args.mixed_precision):  # float32, or bfloat16 (--mixed-precision)
                actions, memory = student({group: x[t] for group, x in obs.items()}, memory)
                step_losses.append(behavior_loss(actions, labels[t], args.loss))
            memory = common.forget(memory, dones[t])
        summed = torch.stack(step_losses).float().sum()
        optimizer.zero_grad(set_to_none=False)
        (summed / args.gradient_length).backward()
        # SYNC: the optimizer step's one collective: the student's gradients and the loss averaged over ranks
        # in one flat buffer (one per --grad-bucket-mb for a larger student); every rank takes the same step.
        loss = common.all_reduce_gradients(params, ctx.world_size, summed.detach().reshape(1), args.grad_bucket_mb)
        # Clip after the all_reduce: clipping the averaged gradient keeps every rank identical.
        norm = nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        totals.add(["behavior_loss", "grad_norm"], torch.cat([loss, norm.reshape(1)]))
        return memory.detach().float()  # float32 between windows, whatever the student's memory was

    windows = time_chunks(args.steps_per_env, args.gradient_length)
    # --compile, --cuda-graphs: the same step compiled, replayed (a graph per window length); the SYNC between two.
    step = cuda_graphs.compiled(window_step, args.compile)
    window_steps = {len(w): cuda_graphs.cuda_graph(step, graphs) for w in windows}
    causes = "the environment, the teacher or the learning rate"

    def update() -> dict[str, float]:
        totals.zero()
        for _ in range(args.epochs):
            memory = buf.memory  # every epoch starts from the memory the rollout started with
            for window in windows:
                rows = slice(window.start, window.stop)
                obs = {group: x[rows] for group, x in buf.obs.items()}
                memory = window_steps[len(window)](obs, buf.labels[rows], buf.dones[rows], memory)
        # One read back to the host, which raises on every rank if the loss or the gradient went NaN/Inf.
        summed = totals.read(1, causes)
        windows_run = args.epochs * len(windows)
        return {
            "behavior_loss": summed["behavior_loss"] / (args.epochs * args.steps_per_env),
            "grad_norm": summed["grad_norm"] / windows_run,
        }

    return update


# --- Evaluation -----------------------------------------------------------------------------------


@torch.inference_mode()
def evaluate(student: Student, teacher: Teacher, num_actions: int, args: Args, ctx: common.Dist) -> dict[str, float]:
    """Mean return of the teacher, the student (both deterministic) and a uniform random policy, one
    episode per env on every rank, each from env seed eval_seed + rank: the same start states, physics
    and sensor noise for all three. One all_reduce."""
    sums = []
    for name in ("teacher", "student", "random"):
        env = envs.make_env(args.task, args.eval_envs, ctx.device, args.eval_seed + ctx.rank)
        generator = torch.Generator(device=ctx.device).manual_seed(args.eval_seed + ctx.rank)
        obs, memory = env.get_observations(), student.initial_memory(args.eval_envs, ctx.device)
        returns, alive = torch.zeros(args.eval_envs, device=ctx.device), torch.ones(args.eval_envs, device=ctx.device)
        for _ in range(int(env.max_episode_length)):
            if name == "teacher":
                actions = teacher(obs)
            elif name == "student":
                actions, memory = student(obs, memory)
            else:
                u = torch.rand(args.eval_envs, num_actions, generator=generator, device=ctx.device)
                actions = (2 * u - 1) * args.random_action_bound
            obs, rewards, dones, _ = env.step(actions)
            returns += rewards * alive  # only each env's first episode counts
            alive *= 1.0 - dones.float()
            memory = common.forget(memory, dones)
        sums.append(returns.sum())
    episodes = args.eval_envs * ctx.world_size
    # SYNC: returns of every rank's evaluation episodes, summed in one all_reduce.
    teacher_return, student_return, random_return = (
        common.all_reduce_sum(torch.stack(sums), ctx.world_size) / episodes
    ).tolist()
    gap = teacher_return - random_return
    return {
        "teacher_return": teacher_return,
        "student_return": student_return,
        "random_return": random_return,
        "student_fraction_of_teacher": (student_return - random_return) / gap if gap else float("nan"),
        "eval_episodes": episodes,
    }


# --- Process group, then the training loop ---------------------------------------------------------


def main(args: Args) -> tuple[str, str]:
    """Join the process group, distill, leave the group (also on error)."""
    with common.distributed(args.device, args.seed, args.dist_timeout_s, args.start_timeout_s, args.pin_cores) as ctx:
        return train(args, ctx)


def train(args: Args, ctx: common.Dist) -> tuple[str, str]:
    """Distill on this rank; returns fingerprints of the student's trained state and of the teacher."""
    # SYNC: each rank checks its arguments, reads checkpoint and teacher and builds env and student
    # alone, then all compare notes (1 all_gather): if one failed (a bad teacher file, say) or ranks
    # disagree on arguments, sizes or checkpoint, every rank stops here instead of hanging later.
    with common.start_together(ctx, args, "sizes or checkpoint") as agree:
        bookkeeping.check_args(args)
        cuda_graphs.check_backend(args.compile, ctx.device)  # inductor on CPU: a C++ compiler is there
        resume_from, env, obs = bookkeeping.start_rank(args, ctx, "distill")
        student_groups = envs.resolve_groups(obs, args.student_obs, flag="--student-obs")
        teacher = load_teacher(args.teacher, obs, env.num_actions, args.task)
        rnn_hidden = args.rnn_hidden if args.student == "gru" else 0
        shapes = envs.group_shapes(obs, student_groups)
        student = Student(shapes, env.num_actions, args.student_hidden, rnn_hidden, args.normalize_obs)
        student, teacher = student.to(ctx.device), teacher.to(ctx.device)
        graphs = cuda_graphs.use_cuda_graphs(args.cuda_graphs, ctx.device, ctx.is_main)  # on CUDA only; else a note
        fused = cuda_graphs.fused_adam(args.compile, ctx.device)  # under --compile on CPU
        optimizer = torch.optim.Adam(student.parameters(), lr=args.learning_rate, capturable=graphs, fused=fused)
        trained = checkpoints.Trained("distill", {"student": student}, {"optimizer": optimizer})
        checkpoints.restore(resume_from, trained)  # a fresh start: nothing to restore
        if resume_from.state and resume_from.state.get("teacher_fingerprint") != teacher_fingerprint(teacher):
            raise ValueError(
                f"--teacher {args.teacher!r} is not the teacher the checkpoint {resume_from.path!r} was distilled "
                f"from ({resume_from.state.get('teacher')!r}); resume with that teacher."
            )
        agree(shapes, env.num_actions, resume_from.first_iteration, resume_from.fingerprint)
    # SYNC: start every rank from rank 0's student (weights and normalizer) and teacher.
    common.broadcast_state([student, teacher], ctx.world_size)

    # SYNC: every rank stops if rank 0 cannot write the run directory (1 all_gather).
    title = f"Distillation on {args.task} ({args.student} student, teacher {args.teacher})"
    saved_with = {"teacher": args.teacher, "teacher_fingerprint": teacher_fingerprint(teacher)}
    run_log = bookkeeping.start_run(ctx, args, trained, title, resume_from, saved_with)
    T, N, A = args.steps_per_env, args.num_envs, env.num_actions
    stored = {group: torch.zeros(T, N, *shape, device=ctx.device) for group, shape in shapes.items()}
    buf = DistillRollout(stored, torch.zeros(T, N, A, device=ctx.device), torch.zeros(T, N, device=ctx.device),
                         student.initial_memory(N, ctx.device))  # fmt: skip
    memory = buf.memory.clone()  # the student's memory, carried from rollout to rollout
    episodes = envs.make_episodes(N, ctx.device, env.episode_length_buf)
    # The two steps an iteration repeats, built once: --compile compiles each, --cuda-graphs captures and replays it.
    policy_step = cuda_graphs.cuda_graph(
        cuda_graphs.compiled(functools.partial(act, student, teacher, args.action_noise_std), args.compile), graphs
    )
    step_groups = [*dict.fromkeys([*student.inputs.shapes, *teacher.inputs.shapes])]
    update = make_update(student, optimizer, buf, args, ctx, graphs)
    stop = False
    for it in range(resume_from.first_iteration, args.iterations + 1):
        t0 = time.time()
        # COLLECT: the student acts, the teacher labels
        obs, memory, logs = rollout(env, policy_step, obs, step_groups, memory, buf, episodes, args)
        # SYNC: a rank whose environment or teacher produced NaN/Inf stops every rank, with its name.
        tensors = {**{f"observation group {group!r}": x for group, x in buf.obs.items()}, "teacher labels": buf.labels}
        common.raise_if_nonfinite(ctx, tensors, f"in the rollout of iteration {it}")
        collect_s = time.time() - t0

        # UPDATE: one all_reduce per optimizer step, inside
        if args.normalize_obs:
            # SYNC: student input statistics merged over every rank's rollout (1 all_gather), before the
            # update, so the student is trained with the normalization it will act with next.
            student.inputs.normalizer.update(student.inputs.flat_part(buf.obs), ctx.world_size)
        losses = update()

        # LOG, CHECK, SAVE. SYNC: the iteration's statistics (1 all_reduce), then the state check and the save
        # (1 all_gather each, when due), in one order on every rank: bookkeeping.end_iteration.
        metrics = {"learning_rate": optimizer.param_groups[0]["lr"], **losses}
        stop = bookkeeping.end_iteration(ctx, run_log, it, episodes, logs, metrics, t0, collect_s)
        if stop:
            break
    if not stop:
        # EVALUATE: teacher, student and a random policy on the same episodes (1 all_reduce)
        result = evaluate(student, teacher, A, args, ctx)
        if ctx.is_main:
            with open(os.path.join(run_log.dir, "eval.json"), "w") as f:
                json.dump(result, f, indent=1)
            print("evaluation: " + " | ".join(f"{k} {v:.4g}" for k, v in result.items()), flush=True)
    bookkeeping.finish_run(ctx, run_log)
    return checkpoints.fingerprint(trained), teacher_fingerprint(teacher)


if __name__ == "__main__":
    bookkeeping.cli(main, Args)
