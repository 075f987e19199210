"""Reference motions for AMP (ppo_amp_ddp.py): an `.npz` archive of `dt` (seconds between frames, a
scalar) and `clip_000`, `clip_001`, ..., each a float array (frames, amp_dim) of AMP observations,
one row per frame. Read with `numpy.load(allow_pickle=False)`: loading never runs code.
data/make_amp_motions.py recorded the default file (counter-clockwise pendulum swing-ups).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path: str, amp_dim: int, env_dt: float | None) -> torch.Tensor:
    """Every clip's consecutive (s, s') frames -> (P, 2 amp_dim). Local: every rank reads the same
    file, so every rank raises the same one line before any collective."""
    found = path if os.path.isabs(path) or os.path.isfile(path) else os.path.join(ROOT, path)
    where = f"motion file {found!r}"
    if not os.path.isfile(found):
        places = " and ".join(sorted({os.path.abspath(path), os.path.abspath(found)}))
        raise FileNotFoundError(
            f"motion file {path!r} not found (looked for {places}): check --motion-file, or make "
            "the default one with `python data/make_amp_motions.py`."
        )
    try:
        with np.load(found, allow_pickle=False) as archive:  # arrays only: loading never runs code
            arrays = {k: archive[k] for k in archive.files}
    except (OSError, ValueError, TypeError, AttributeError):  # not an .npz, or objects in it
        arrays = None
    if arrays is None or any(a.dtype.kind not in "fiu" for a in arrays.values()):
        raise ValueError(
            f"{where} is not an .npz archive of numeric arrays; write one as "
            "data/make_amp_motions.py does."
        )
    dt = arrays.get("dt")
    if dt is None or dt.shape != () or not np.isfinite(dt) or dt <= 0:
        seen = "none" if dt is None else f"shape {dt.shape}" if dt.shape else f"{dt.item()}"
        raise ValueError(
            f"{where}: `dt` must be a positive number, the seconds between frames (found {seen}); "
            "save it as a scalar array, as data/make_amp_motions.py does."
        )
    if env_dt is not None and not math.isclose(float(dt), env_dt):
        raise ValueError(
            f"{where} has frames {float(dt)} s apart but the env steps {env_dt} s; resample it."
        )
    clips = [
        torch.as_tensor(arrays[k], dtype=torch.float32)
        for k in sorted(arrays)
        if k.startswith("clip_")
    ]
    for i, clip in enumerate(clips):
        if clip.ndim != 2 or clip.shape[1] != amp_dim:
            raise ValueError(
                f"{where}: clip {i} has shape {tuple(clip.shape)}, but each clip must be 2-D, "
                f"(frames, amp_dim) with amp_dim {amp_dim}, the size of the env's AMP group; check "
                "--amp-obs."
            )
    if sum(max(0, len(clip) - 1) for clip in clips) == 0:
        raise ValueError(
            f"{where} holds no clip of 2+ frames (clip_000, ...); add one as "
            "data/make_amp_motions.py does."
        )
    return torch.cat([torch.cat([clip[:-1], clip[1:]], -1) for clip in clips])
