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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

import bookkeeping
import checkpoints
import common
import cuda_graphs
import envs

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED_TEACHER = "data/pendulum_partial_teacher.pt"  # relative, so ranks on other machines agree
TEACHER_RECIPE = (
    "torchrun --standalone --nproc_per_node=2 ppo_ddp.py --task {task} --actor-obs {group} --run-dir runs/teacher"
)


@dataclass
class Args(bookkeeping.RunArgs):
    """Distillation; sizes are per process (the run arguments are bookkeeping.RunArgs)."""

    task: str = "pendulum_partial"
    """Built-in task or your own environment as `module:function`; it must provide both groups below."""
    teacher: str = SHIPPED_TEACHER
    """ppo_ddp.py checkpoint (file or run directory) of a teacher trained on `teacher_obs`."""
    student_obs: tuple[str, ...] = ("policy",)
    """Observation groups the student sees, concatenated (what a deployed robot has)."""
    teacher_obs: tuple[str, ...] = ("teacher",)
    """Privileged observation groups the teacher was trained on (its `--actor-obs`)."""
    iterations: int = 100
    """Total learning iterations; a resumed run continues up to this number."""
    student: Literal["mlp", "gru"] = "mlp"
    """`mlp`, or `gru`: a GRU cell before the MLP, trained with truncated backpropagation through time."""
    student_hidden: tuple[int, ...] = (128, 128)
    """Hidden layer widths of the student MLP (ELU activations)."""
    rnn_hidden: int = 64
    """Size of the GRU state of a `gru` student."""
    normalize_obs: bool = True
    """Normalize the student's input with running statistics merged across ranks."""
    action_noise_std: float = 0.1
    """Std of the Gaussian noise added to the student's actions while collecting (not trained; rsl_rl's
    student init_noise_std); it widens the states the teacher labels. 0 acts deterministically."""
    epochs: int = 1
    """Passes over each rollout."""
    gradient_length: int = 8
    """Rollout steps per optimizer step (the BPTT window of a `gru` student). A shorter last window is
    kept, not dropped as in rsl_rl, so every step of the rollout enters the loss."""
    loss: Literal["mse", "huber"] = "mse"
    """Behavior loss between student and teacher actions: `mse` or `huber`."""
    learning_rate: float = 1e-3
    """Adam learning rate (fixed)."""
    max_grad_norm: float = 1.0
    """Gradient clipping over all student parameters, after the all_reduce."""
    eval_envs: int = 64
    """Evaluation episodes per process at the end (one per env), for teacher, student and random policy."""
    eval_seed: int = 10_000
    """Env seed of the evaluation on rank r: eval_seed + r, the same for the three policies."""
    random_action_bound: float = 2.0
    """The random baseline draws actions uniformly from [-bound, bound] (Pendulum's torque limit)."""
    cuda_graphs: bool = False
    """Replay the inference step (student and teacher) and every window's optimizer step from CUDA
    graphs (docs/gpu.md). Needs a CUDA device; elsewhere a note, and the same steps run eagerly."""


# --- Teacher and student --------------------------------------------------------------------------


class Teacher(nn.Module):
    """A frozen ppo_ddp.py actor (the same layout, so its saved `actor` state loads as it is): its
    label is the mean of its Gaussian, through its own saved observation normalizer."""

    def __init__(
        self, obs_dim: int, num_actions: int, hidden: tuple[int, ...], normalize: bool, std_name: str = "log_std",
        activation: str = "elu",
    ) -> None:  # fmt: skip
        super().__init__()
        self.normalizer = common.EmpiricalNormalizer(obs_dim) if normalize else nn.Identity()
        self.net = common.mlp(obs_dim, hidden, num_actions, activation)
        # Saved with the actor (`log_std`, or `std` for --std-type scalar); labels do not use it.
        self.register_parameter(std_name, nn.Parameter(torch.zeros(num_actions)))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """The teacher's label: its deterministic action (batch, num_actions)."""
        return self.net(self.normalizer(obs))


def load_teacher(path: str, obs_dim: int, num_actions: int, group: str, task: str) -> Teacher:
    """Rebuild the frozen teacher from a ppo_ddp.py checkpoint; its saved normalizer is used as saved.

    Local to this rank (every rank reads the same file), so a bad file raises on every rank before
    any collective.
    """
    recipe = TEACHER_RECIPE.format(task=task, group=group)
    try:
        found = path if os.path.isabs(path) or os.path.exists(path) else os.path.join(HERE, path)
        checkpoint = checkpoints.load_checkpoint(found, "ppo", ("actor", "args", "obs_dims"))
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"teacher checkpoint {path!r} not found; train a teacher on the privileged group with `{recipe}` "
            f"and pass --teacher runs/teacher (or one of its model_*.pt files)."
        ) from error
    except ValueError as error:
        raise ValueError(
            f"--teacher must be a PPO policy written by ppo_ddp.py: {error} Make one with `{recipe}`."
        ) from error
    dims = checkpoint["obs_dims"]
    if (dims.get("actor"), dims.get("actions")) != (obs_dim, num_actions):
        raise ValueError(
            f"teacher {path!r} takes {dims.get('actor')} observations and gives {dims.get('actions')} actions, but "
            f"this environment's {group!r} group has {obs_dim} observations and {num_actions} actions. Train the "
            f"teacher on this task's {group!r} group: `{recipe}`."
        )
    saved = checkpoint["args"]
    std_name = "std" if saved.get("std_type") == "scalar" else "log_std"
    activation = saved.get("activation", "elu")  # older checkpoints: ELU
    hidden, normalize = tuple(saved["actor_hidden"]), saved.get("normalize_obs", True)
    teacher = Teacher(obs_dim, num_actions, hidden, normalize, std_name, activation)
    try:
        teacher.load_state_dict(checkpoint["actor"])
    except RuntimeError as error:
        first_line = common.first_line(error)
        raise ValueError(
            f"teacher {path!r} does not match the network its args describe ({first_line}): it is damaged or was "
            f"edited; train a teacher again: `{recipe}`."
        ) from None
    teacher.requires_grad_(False)  # frozen: never in the optimizer, never in the all_reduce
    return teacher.eval()


def teacher_fingerprint(teacher: Teacher) -> str:
    """Hash of the teacher's weights and normalizer: a resume must use the teacher it started with."""
    return common.fingerprint([teacher], [])


class Student(nn.Module):
    """normalizer -> (GRU cell) -> MLP -> action. `hidden` is (batch, rnn_hidden), or (batch, 0) for an MLP."""

    def __init__(
        self, obs_dim: int, num_actions: int, hidden: tuple[int, ...], rnn_hidden: int, normalize: bool
    ) -> None:
        super().__init__()
        self.normalizer = common.EmpiricalNormalizer(obs_dim) if normalize else nn.Identity()
        self.rnn = nn.GRUCell(obs_dim, rnn_hidden) if rnn_hidden > 0 else None
        self.obs_dim, self.num_actions, self.hidden_size = obs_dim, num_actions, rnn_hidden
        self.net = common.mlp(rnn_hidden if self.rnn is not None else obs_dim, hidden, num_actions)

    def initial_hidden(self, batch: int, device: torch.device) -> torch.Tensor:
        """A blank memory for `batch` envs."""
        return torch.zeros(batch, self.hidden_size, device=device)

    def forward(self, obs: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: -> (actions (batch, num_actions), next hidden state)."""
        x = self.normalizer(obs)
        if self.rnn is not None:
            hidden = self.rnn(x, hidden)
            x = hidden
        return self.net(x), hidden


def behavior_loss(actions: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean MSE or Huber (delta 1) loss between student actions and teacher labels."""
    return F.mse_loss(actions, labels) if kind == "mse" else F.huber_loss(actions, labels, delta=1.0)


def time_chunks(steps: int, gradient_length: int) -> list[range]:
    """Consecutive windows of `gradient_length` steps covering [0, steps); the last may be shorter."""
    return [range(s, min(s + gradient_length, steps)) for s in range(0, steps, gradient_length)]


# --- Rollout --------------------------------------------------------------------------------------


@dataclass
class DistillRollout:
    """One rollout: student inputs, teacher labels and dones (T, N, ...), and the memory before step 0."""

    student_obs: torch.Tensor
    labels: torch.Tensor
    dones: torch.Tensor
    hidden: torch.Tensor


def act(
    student: Student, teacher: Teacher, noise_std: float, student_obs: torch.Tensor, teacher_obs: torch.Tensor,
    hidden: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The inference step -> (the student's actions, those actions with exploration noise, its next
    memory, the teacher's labels). Local; no host sync, so `cuda_graphs.cuda_graph` can replay it."""
    actions, hidden = student(student_obs, hidden)
    labels = teacher(teacher_obs)
    return actions, actions + noise_std * torch.randn_like(actions), hidden, labels


@torch.inference_mode()
def rollout(
    env: envs.VecEnv, policy_step: Callable[..., tuple[torch.Tensor, ...]], obs: dict, hidden: torch.Tensor,
    buf: DistillRollout, episodes: envs.Episodes, args: Args,
) -> tuple[dict, torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """The student acts for `steps_per_env` steps, the teacher labels each state (DAgger); fills `buf`.

    `policy_step(student_obs, teacher_obs, hidden)` is `act` on student and teacher, or its CUDA graph.
    Local to this rank: no communication. Returns the next observations, the student's memory (carried
    into the next rollout) and the mean of the env's log scalars plus the teacher-action error.
    """
    buf.hidden.copy_(hidden)
    logs: dict[str, torch.Tensor] = {"teacher_action_error": torch.zeros((), device=buf.labels.device)}
    for t in range(args.steps_per_env):
        student_obs = envs.concat(obs, args.student_obs)
        actions, noisy, hidden, labels = policy_step(student_obs, envs.concat(obs, args.teacher_obs), hidden)
        logs["teacher_action_error"] += (actions - labels).norm(dim=-1).mean() / args.steps_per_env
        next_obs, rewards, dones, extras = env.step(noisy)
        dones = dones.to(torch.float32)
        buf.student_obs[t], buf.labels[t], buf.dones[t] = student_obs, labels, dones
        hidden = common.reset_hidden(hidden, dones)
        envs.track_episodes(episodes, rewards, dones)
        envs.accumulate_logs(logs, extras, rewards.device)
        obs = next_obs
    return obs, hidden, logs


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
    sums = torch.zeros(2, device=ctx.device)  # the summed behavior loss, the summed gradient norm

    def window_step(
        student_obs: torch.Tensor, labels: torch.Tensor, dones: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """One optimizer step on one window of the rollout (`student_obs`, `labels`, `dones`: (steps, N, ...)),
        the student unrolled from memory `hidden` -> the memory the next window starts from, cut from the
        graph (truncated BPTT). Adds its loss and gradient norm to `sums`; writes in place only and never
        reads back to the host, so that a CUDA graph can replay it."""
        step_losses = []
        for t in range(student_obs.shape[0]):
            with common.autocast(ctx.device, args.mixed_precision):  # float32, or bfloat16 (--mixed-precision)
                actions, hidden = student(student_obs[t], hidden)
                step_losses.append(behavior_loss(actions, labels[t], args.loss))
            hidden = common.reset_hidden(hidden, dones[t])
        summed = torch.stack(step_losses).float().sum()
        optimizer.zero_grad(set_to_none=False)
        (summed / args.gradient_length).backward()
        # SYNC: the optimizer step's one collective: the student's gradients and the loss averaged over ranks
        # in one flat buffer (one per --grad-bucket-mb for a larger student); every rank takes the same step.
        loss = common.all_reduce_gradients(params, ctx.world_size, summed.detach().reshape(1), args.grad_bucket_mb)
        # Clip after the all_reduce: clipping the averaged gradient keeps every rank identical.
        norm = nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        sums.add_(torch.cat([loss, norm.reshape(1)]))
        return hidden.detach().float()  # float32 between windows, whatever the student's memory was

    windows = time_chunks(args.steps_per_env, args.gradient_length)
    steps = {len(w): cuda_graphs.cuda_graph(window_step, graphs) for w in windows}  # a graph per window length
    sources = "the environment, the teacher or the learning rate"

    def update() -> dict[str, float]:
        sums.zero_()
        for _ in range(args.epochs):
            hidden = buf.hidden  # every epoch starts from the memory the rollout started with
            for window in windows:
                rows = slice(window.start, window.stop)
                hidden = steps[len(window)](buf.student_obs[rows], buf.labels[rows], buf.dones[rows], hidden)
        # One read back to the host, which raises on every rank if the loss or the gradient went NaN/Inf.
        summed = common.read_update(sums, ("behavior_loss", "grad_norm"), 1, sources)
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
        obs, hidden = env.get_observations(), student.initial_hidden(args.eval_envs, ctx.device)
        returns, alive = torch.zeros(args.eval_envs, device=ctx.device), torch.ones(args.eval_envs, device=ctx.device)
        for _ in range(int(env.max_episode_length)):
            if name == "teacher":
                actions = teacher(envs.concat(obs, args.teacher_obs))
            elif name == "student":
                actions, hidden = student(envs.concat(obs, args.student_obs), hidden)
            else:
                u = torch.rand(args.eval_envs, num_actions, generator=generator, device=ctx.device)
                actions = (2 * u - 1) * args.random_action_bound
            obs, rewards, dones, _ = env.step(actions)
            returns += rewards * alive  # only each env's first episode counts
            alive *= 1.0 - dones.float()
            hidden = common.reset_hidden(hidden, dones)
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
    with common.distributed(args.device, args.seed, args.dist_timeout_s, args.start_timeout_s) as ctx:
        return train(args, ctx)


def train(args: Args, ctx: common.Dist) -> tuple[str, str]:
    """Distill on this rank; returns fingerprints of the student's trained state and of the teacher."""
    # SYNC: each rank checks its arguments, reads checkpoint and teacher and builds env and student
    # alone, then all compare notes (1 all_gather): if one failed (a bad teacher file, say) or ranks
    # disagree on arguments, sizes or checkpoint, every rank stops here instead of hanging later.
    with common.start_together(ctx, args, "sizes or checkpoint") as agree:
        counts = ("iterations", "epochs", "gradient_length", "eval_envs", "rnn_hidden")
        bookkeeping.check_args(
            args, counts, ("learning_rate", "max_grad_norm"), ("action_noise_std", "random_action_bound")
        )
        resume, env, obs = bookkeeping.start_rank(args, ctx, "distill", ("student", "optimizer"))
        dims = {"student": envs.concat(obs, envs.resolve_groups(obs, args.student_obs, flag="--student-obs")).shape[-1]}
        dims["teacher"] = envs.concat(obs, envs.resolve_groups(obs, args.teacher_obs, flag="--teacher-obs")).shape[-1]
        teacher = load_teacher(args.teacher, dims["teacher"], env.num_actions, " ".join(args.teacher_obs), args.task)
        rnn_hidden = args.rnn_hidden if args.student == "gru" else 0
        student = Student(dims["student"], env.num_actions, args.student_hidden, rnn_hidden, args.normalize_obs)
        student, teacher = student.to(ctx.device), teacher.to(ctx.device)
        graphs = cuda_graphs.use_cuda_graphs(args.cuda_graphs, ctx.device, ctx.is_main)  # on CUDA only; else a note
        optimizer = torch.optim.Adam(student.parameters(), lr=args.learning_rate, capturable=graphs)
        trained = checkpoints.Trained("distill", {"student": student}, {"optimizer": optimizer})
        checkpoints.restore(resume, trained, args)  # a fresh start: nothing to restore
        if resume.checkpoint and resume.checkpoint.get("teacher_fingerprint") != teacher_fingerprint(teacher):
            raise ValueError(
                f"--teacher {args.teacher!r} is not the teacher the checkpoint {resume.path!r} was distilled from "
                f"({resume.checkpoint.get('teacher')!r}); resume with that teacher."
            )
        agree(dims, env.num_actions, resume.first_iteration, resume.fingerprint)
    # SYNC: start every rank from rank 0's student (weights and normalizer) and teacher.
    common.broadcast_state([student, teacher], ctx.world_size)

    # SYNC: every rank stops if rank 0 cannot write the run directory (1 all_gather).
    title = f"Distillation on {args.task} ({args.student} student, teacher {args.teacher})"
    saved_with = {"teacher": args.teacher, "teacher_fingerprint": teacher_fingerprint(teacher)}
    saved_with["obs_dims"] = {**dims, "actions": env.num_actions}
    run_log = bookkeeping.start_run(ctx, args, trained, title, resume, saved_with)
    T, N, A = args.steps_per_env, args.num_envs, env.num_actions
    buf = DistillRollout(
        *(torch.zeros(s, device=ctx.device) for s in ((T, N, dims["student"]), (T, N, A), (T, N))),
        student.initial_hidden(N, ctx.device),
    )
    hidden = buf.hidden.clone()  # the student's memory, carried from rollout to rollout
    episodes = envs.make_episodes(N, ctx.device, env.episode_length_buf)
    # The two steps an iteration repeats, built once: with --cuda-graphs each is captured and replayed.
    policy_step = cuda_graphs.cuda_graph(functools.partial(act, student, teacher, args.action_noise_std), graphs)
    update = make_update(student, optimizer, buf, args, ctx, graphs)
    stop = False
    for it in range(resume.first_iteration, args.iterations + 1):
        t0 = time.time()
        # COLLECT: the student acts, the teacher labels
        obs, hidden, logs = rollout(env, policy_step, obs, hidden, buf, episodes, args)
        # SYNC: a rank whose environment or teacher produced NaN/Inf stops every rank, with its name.
        tensors = {"student observations": buf.student_obs, "teacher labels": buf.labels}
        common.raise_if_nonfinite(ctx, tensors, f"in the rollout of iteration {it}")
        collect_s = time.time() - t0

        # UPDATE: one all_reduce per optimizer step, inside
        if args.normalize_obs:
            # SYNC: student input statistics merged over every rank's rollout (1 all_gather), before the
            # update, so the student is trained with the normalization it will act with next.
            student.normalizer.update(buf.student_obs, ctx.world_size)
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
