"""Checkpoint files: writing one atomically, reading one without running code, resuming from one
(`--resume auto` included). Local: no function here talks to other ranks.
"""

from __future__ import annotations

import errno
import inspect
import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import common


def configs(trained: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each network's `config`: what a checkpoint rebuilds it from."""
    return {name: part.config for name, part in trained.items() if hasattr(part, "config")}


@dataclass
class ResumeFrom:
    """The checkpoint a run continues: its file and what it holds; both None for a fresh start."""

    path: str | None
    state: dict[str, Any] | None

    @property
    def first_iteration(self) -> int:
        return self.state["iteration"] + 1 if self.state else 1

    @property
    def fingerprint(self) -> str | None:
        return self.state["fingerprint"] if self.state else None


# what a resume needs besides the state dicts
RESUME_KEYS = ("iteration", "env_steps", "fingerprint", "configs")
IMPLEMENTATION = ("foreach", "fused", "capturable")  # optimizer settings that choose how it steps
PART_FLAGS = {
    "rnd": "--rnd-weight",
    "rnd_optimizer": "--rnd-weight",
    "reward_scaler": "--scale-rewards",
}


def deployed(trained: dict[str, Any]) -> dict[str, str]:
    """The network a checkpoint deploys (the student, else the actor) and its class, named by the
    file that defines it: tools/policy.py rebuilds a fork's own class."""
    part = "student" if "student" in trained else "actor"
    cls = type(trained[part])
    module = os.path.splitext(os.path.basename(inspect.getfile(cls)))[0]
    return {"part": part, "module": module, "class": cls.__qualname__}


def plain(value: Any) -> Any:
    """A config as JSON would hold it (tuples as lists), to compare two."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return [plain(item) for item in value] if isinstance(value, (list, tuple)) else value


def misfit(
    path: str | None, saved: dict[str, dict[str, Any]], trained: dict[str, Any], task: str = "?"
) -> str:
    """The one line for a checkpoint whose networks' configs differ from this run's, or ""."""
    differ = []
    for name, config in configs(trained).items():
        theirs, ours = plain(saved.get(name, {})), plain(config)
        differ += [
            f"{name} {key}={theirs.get(key)} (this run: {ours.get(key)})"
            for key in {**theirs, **ours}
            if theirs.get(key) != ours.get(key)
        ]
    if not differ:
        return ""
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    return (
        f"checkpoint {path!r} (trained on --task {task}) holds networks built otherwise than this "
        f"run's: {'; '.join(differ[:3])}{more}. Resume with the arguments it was trained with (its "
        "`args`), or start a fresh run without --resume."
    )


def restore(resume_from: ResumeFrom, trained: dict[str, Any]) -> None:
    """Load the checkpoint `resume_from` continues into `trained`, and check that it gives back the
    fingerprint it was saved with; a ValueError otherwise. Local."""
    checkpoint, path = resume_from.state, resume_from.path
    if checkpoint is None:
        return
    expected = sorted(trained)
    saved = sorted(checkpoint["parts"])
    if saved != expected:
        differ = sorted({PART_FLAGS.get(part, part) for part in set(saved) ^ set(expected)})
        raise ValueError(
            f"checkpoint {path!r} holds the state of {saved}, this run trains {expected}; resume "
            f"with the options it was trained with ({', '.join(differ)} on or off as then)."
        )
    if message := misfit(
        path, checkpoint["configs"], trained, checkpoint.get("args", {}).get("task", "?")
    ):
        raise ValueError(message)
    try:
        for name, module in trained.items():
            if isinstance(module, nn.Module):
                module.load_state_dict(checkpoint[name])
    except RuntimeError as error:
        raise ValueError(
            f"checkpoint {path!r} does not load into the networks its configs describe "
            f"({common.first_line(error)}); it is damaged: pass an earlier model_*.pt of that run "
            "to --resume, or start a fresh run."
        ) from None
    own_lrs = []  # (param group, this run's learning-rate tensor)
    for name, optimizer in trained.items():
        if not isinstance(optimizer, torch.optim.Optimizer):
            continue
        # How this run steps (fused, capturable) is this machine's choice, not the checkpoint's.
        lrs = [group["lr"] for group in optimizer.param_groups]
        state = checkpoint[name]
        own = [
            {k: group[k] for k in IMPLEMENTATION if k in group} for group in optimizer.param_groups
        ]
        optimizer.load_state_dict(
            {**state, "param_groups": [{**g, **o} for g, o in zip(state["param_groups"], own)]}
        )
        own_lrs += [(group, lr) for group, lr in zip(optimizer.param_groups, lrs)]
    if common.fingerprint(trained) != checkpoint.get("fingerprint"):  # with the saved lr
        raise ValueError(
            f"checkpoint {path!r} does not reproduce the state it was saved from; it is damaged: "
            "pass an earlier model_*.pt of that run to --resume, or start a fresh run without "
            "--resume."
        )
    # A learning rate that is a tensor (`speedups.adam`) stays this run's tensor, on its device, in
    # its dtype (float32 under --compile), and takes the saved value.
    for group, lr in own_lrs:
        if torch.is_tensor(lr):
            group["lr"] = lr.fill_(float(group["lr"]))


def save_checkpoint(run_dir: str, iteration: int, state: dict[str, Any], keep: int = 5) -> None:
    """Write `model_{iteration}.pt` atomically, point `latest` at it, keep the newest `keep`."""
    for stale in (f for f in os.listdir(run_dir) if ".tmp-" in f):  # left by a killed run
        os.remove(os.path.join(run_dir, stale))
    name, data = f"model_{iteration}.pt", io.BytesIO()
    # in memory first: a full disk is then the OSError of a plain write, not torch's
    torch.save(state, data)
    atomic_write(os.path.join(run_dir, name), lambda f: f.write(data.getbuffer()))
    atomic_write(os.path.join(run_dir, "latest"), lambda f: f.write(name.encode()))
    saved = sorted(
        (f for f in os.listdir(run_dir) if re.fullmatch(r"model_\d+\.pt", f)),
        key=lambda f: int(f[6:-3]),
    )
    for old in saved[: max(0, len(saved) - keep)]:
        os.remove(os.path.join(run_dir, old))


# What to do when a checkpoint cannot be written, by the errno of the failed write.
WRITE_ADVICE = {
    errno.ENOSPC: "free space on that disk, or pass --run-dir on another",
    errno.EDQUOT: "free space within your quota, or pass --run-dir on another disk",
    errno.EACCES: "make the run directory writable, or pass another --run-dir",
    errno.EPERM: "make the run directory writable, or pass another --run-dir",
    errno.EROFS: "pass --run-dir on a writable file system",
}


def write_failure(code: int, error: str, run_dir: str) -> str:
    """The cause of a failed checkpoint write and what to do: `code` the errno rank 0 met, -1 for
    another error, whose text is `error`."""
    cause = os.strerror(code) if code > 0 else error or "see rank 0's console"
    advice = WRITE_ADVICE.get(code, "check that rank 0 can write the run directory")
    intact = f"the previous checkpoints are intact: {advice}, then continue with --resume {run_dir}"
    return f"({cause}); {intact}"


def atomic_write(path: str, write: Callable[[Any], Any]) -> None:
    """Write through a temporary file in the same directory, then rename over `path`."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint file, or a run directory / `latest` pointer naming the newest one."""
    if os.path.isdir(path):
        path = os.path.join(path, "latest")
    if os.path.basename(path) == "latest" and os.path.isfile(path):
        with open(path) as f:
            path = os.path.join(os.path.dirname(path), f.read().strip())
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"checkpoint {path!r} does not exist; pass a model_*.pt file or a run directory "
            "holding a 'latest' file."
        )
    return path


class UnreadableCheckpoint(ValueError):
    """A checkpoint file that `torch.load` cannot read."""


def checkpoint_files(run_dir: str) -> list[str]:
    """The `model_<iteration>.pt` files in `run_dir`, newest first."""
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    names = [f for f in names if re.fullmatch(r"model_\d+\.pt", f)]
    return [os.path.join(run_dir, f) for f in sorted(names, key=lambda f: -int(f[6:-3]))]


def resume_point(args: Any, script: str, speak: bool) -> ResumeFrom:
    """What `--resume` continues, and a note (where `speak`) when the checkpoint's learning rate,
    which the run continues at as rsl_rl does, is not `--learning-rate`. Local."""
    resume_from = load_resume(args.resume, args.run_dir, script, speak)
    saved_lr = (resume_from.state or {}).get("learning_rate")
    fixed = getattr(args, "schedule", "fixed") == "fixed"  # linear: from the command line anyway
    if speak and fixed and saved_lr is not None and saved_lr != args.learning_rate:
        print(
            f"note: the run continues at its checkpoint's learning rate {saved_lr:g} (the "
            f"optimizer's state, as rsl_rl resumes); --learning-rate {args.learning_rate:g} "
            "applies to fresh runs."
        )
    return resume_from


def load_resume(
    resume: str | None, run_dir: str | None, script: str, speak: bool = True
) -> ResumeFrom:
    """The checkpoint `--resume` names, read and checked. `auto` takes the `--run-dir`'s newest
    readable one, skipping others with a line each (where `speak`), or starts fresh. An explicit one
    that cannot be read fails, naming the newest readable checkpoint beside it. Local."""
    if resume is None:
        return ResumeFrom(None, None)
    if resume != "auto":
        try:
            return ResumeFrom(resume, load_checkpoint(resume, script, RESUME_KEYS))
        except UnreadableCheckpoint as error:
            path = resolve_checkpoint(resume)
            readable = [
                f
                for f in checkpoint_files(os.path.dirname(path))
                if f != path and _readable(f, script)
            ]
            hint = (
                f" The newest readable checkpoint there is {readable[0]!r}: pass it to --resume."
                if readable
                else " No other checkpoint beside it can be read: pass another model_*.pt, or "
                "start a fresh run without --resume."
            )
            raise UnreadableCheckpoint(f"{error}{hint}") from None
    if not run_dir:
        raise ValueError(
            "--resume auto needs --run-dir: the directory a restarted job continues in."
        )
    skipped = []
    for path in checkpoint_files(run_dir):
        try:
            state = load_checkpoint(path, script, RESUME_KEYS)
        except UnreadableCheckpoint as error:
            skipped.append(path)
            if speak:
                print(f"warning: {error} --resume auto skips it.", flush=True)
            continue
        return ResumeFrom(path, state)
    if skipped:
        raise ValueError(
            f"--resume auto: no checkpoint in {run_dir!r} can be read ({len(skipped)} tried); move "
            "them away to start afresh there, or pass another --run-dir."
        )
    return ResumeFrom(None, None)


def _readable(path: str, script: str) -> bool:
    try:
        load_checkpoint(path, script, RESUME_KEYS)
    except ValueError:
        return False
    return True


def load_checkpoint(
    path: str, script: str | tuple[str, ...] | None, required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Load a checkpoint without running code; check that one of `script` (None: any) wrote it and
    that it has the `required` keys."""
    path = resolve_checkpoint(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file gets the same advice
        first_line = common.first_line(error)
        raise UnreadableCheckpoint(
            f"cannot read checkpoint {path!r} ({first_line}); it is damaged or not a checkpoint of "
            "these scripts."
        ) from error
    scripts = (script,) if isinstance(script, str) else script
    if isinstance(state, dict) and "kind" in state and "script" not in state:
        raise ValueError(
            f"checkpoint {path!r} is in the format of an earlier version of these scripts (its "
            "networks keep no config, which this version rebuilds them from): train it again with "
            "this version."
        )
    found = state.get("script") if isinstance(state, dict) else type(state).__name__
    if scripts is not None and found not in scripts:
        raise ValueError(
            f"checkpoint {path!r} is not a {' or '.join(map(repr, scripts))} checkpoint (found "
            f"{found!r}); pass one written by the matching script."
        )
    if not isinstance(state, dict) or not isinstance(found, str):
        raise ValueError(f"checkpoint {path!r} is not a checkpoint of these scripts.")
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(
            f"checkpoint {path!r} lacks {missing}: it was not written by this script ({found}); "
            "pass a model_*.pt that it wrote."
        )
    return state
