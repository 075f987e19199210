"""--logger: rank 0 alone opens TensorBoard, W&B or Neptune (offline here, no network), after the
start-up agreement, under rsl_rl's metric names; other ranks import no logger and write no file."""

import glob
import json
import os
import sys

import pytest

import arguments
import bookkeeping
import common
import ppo_ddp as ppo
from dist_helpers import chdir_rank_dir, run_ranks, small_args, write_row

LOGGER_MODULES = ("wandb", "neptune", "torch.utils.tensorboard")


def _logger_worker(root, logger):
    home = os.path.join(
        root, "home"
    )  # W&B's cache and settings, away from the user's and from the rank dirs
    os.environ.update(
        WANDB_MODE="offline", WANDB_SILENT="true", NEPTUNE_MODE="offline", WANDB_CACHE_DIR=home
    )
    os.environ.update(WANDB_CONFIG_DIR=home, WANDB_DATA_DIR=home)
    chdir_rank_dir(root)
    ppo.main(
        small_args(
            ppo.Args, num_envs=8, steps_per_env=8, iterations=2, run_dir="run", logger=logger
        )
    )
    return [name for name in LOGGER_MODULES if name in sys.modules]


def _metrics(root):
    with open(os.path.join(root, "0", "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("logger", ["wandb", "neptune"])
def test_offline_logger_is_opened_and_written_by_rank_0_alone(tmp_path, logger):
    pytest.importorskip(logger)
    imported = run_ranks(_logger_worker, 2, str(tmp_path), logger, timeout=240)
    assert logger in imported[0] and logger not in imported[1]  # rank 1 never even imported it
    assert os.listdir(tmp_path / "1") == []  # and wrote nothing
    rows = _metrics(tmp_path)
    if logger == "wandb":  # a binary record file; the metric names are in it as plain strings
        (record,) = glob.glob(str(tmp_path / "0" / "run" / "wandb" / "offline-run-*" / "*.wandb"))
        data = open(record, "rb").read()
        assert (
            b"Loss/surrogate" in data
            and b"Perf/total_fps" in data
            and b"Episode/swingup_ccw_fraction" in data
        )
    else:  # Neptune's offline queue: one JSON operation per line
        (queue,) = glob.glob(str(tmp_path / "0" / ".neptune" / "offline" / "*" / "data-1.log"))
        logged = {}
        for line in open(queue):
            op = json.loads(line)["obj"]
            if op["type"] == "LogFloats":
                logged.setdefault("/".join(op["path"]), []).extend(v["value"] for v in op["values"])
        assert logged["Loss/learning_rate"] == [r["learning_rate"] for r in rows]
        assert logged["Loss/value"] == [r["value_loss"] for r in rows]


def test_tensorboard_writes_rsl_rl_names_and_none_writes_only_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    imported = run_ranks(_logger_worker, 2, str(tmp_path / "tb"), "tensorboard")
    assert "torch.utils.tensorboard" in imported[0] and "torch.utils.tensorboard" not in imported[1]
    events = EventAccumulator(str(tmp_path / "tb" / "0" / "run")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"Loss/surrogate", "Perf/total_fps", "Episode/swingup_ccw_fraction", "kl"} <= tags
    assert [e.value for e in events.Scalars("Loss/value")] == pytest.approx(
        [r["value_loss"] for r in _metrics(tmp_path / "tb")]
    )
    run_ranks(_logger_worker, 1, str(tmp_path / "none"), "none")
    assert sorted(os.listdir(tmp_path / "none" / "0" / "run")) == [
        ".lock",
        "latest",
        "metrics.jsonl",
        "model_2.pt",
    ]


def test_a_missing_logger_package_is_one_line_naming_what_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    for logger in ("wandb", "neptune"):
        with pytest.raises(
            ValueError,
            match=rf"^--logger {logger} needs its package: pip install {logger}, "
            r"or pass --logger none\.$",
        ):
            arguments.check_args(small_args(ppo.Args, logger=logger))


def test_dashboard_names_follow_rsl_rl():
    names = {
        k: bookkeeping.dashboard_name(
            k, ["swingup_ccw_fraction", "Episode_Reward/track", "rnd_weight"]
        )
        for k in (
            "episode_return",
            "value_loss",
            "fps",
            "swingup_ccw_fraction",
            "Episode_Reward/track",
            "rnd_weight",
            "kl",
        )
    }
    assert names == {
        "episode_return": "Train/mean_reward",
        "value_loss": "Loss/value",
        "fps": "Perf/total_fps",
        "swingup_ccw_fraction": "Episode/swingup_ccw_fraction",
        "Episode_Reward/track": "Episode_Reward/track",
        "rnd_weight": "Rnd/weight",
        "kl": "kl",
    }


def _failing_logger_worker(root):
    for name in ("NEPTUNE_MODE", "NEPTUNE_API_TOKEN", "NEPTUNE_PROJECT"):
        os.environ.pop(
            name, None
        )  # Neptune's default online mode without credentials: it cannot start
    chdir_rank_dir(root)
    try:
        ppo.main(
            small_args(
                ppo.Args, num_envs=8, steps_per_env=8, iterations=1, run_dir="run", logger="neptune"
            )
        )
    except common.Failure as failure:
        return str(failure), os.listdir(".")
    return "", os.listdir(".")


def test_a_logger_that_cannot_start_stops_every_rank_with_one_line_and_leaves_nothing(tmp_path):
    pytest.importorskip("neptune")
    (message0, files0), (message1, files1) = run_ranks(_failing_logger_worker, 2, str(tmp_path))
    assert message0.startswith(
        "rank 0 cannot start --logger neptune (NeptuneMissingApiTokenException: "
    )
    assert message0.endswith("; fix its settings or pass --logger none.") and "\n" not in message0
    assert message1 == message0  # every rank raises rank 0's line (rank 0 alone prints it)
    assert files0 == files1 == []  # the run directory rank 0 had created is gone again


def test_a_logger_that_fails_mid_run_is_closed_and_training_goes_on(tmp_path, capsys):
    closed, sent = [], []

    class Failing(bookkeeping.Logger):
        finish = staticmethod(lambda: closed.append(1))

        def send(self, scalars: dict[str, float], it: int) -> None:
            sent.append(it)
            raise ConnectionError("service gone")

    args = small_args(ppo.Args, num_envs=32, steps_per_env=2, iterations=2)
    run = bookkeeping.RunLog(args, "ppo", {}, {}, str(tmp_path), 1, 0, 64)
    run.logger = Failing()
    for it in (1, 2):
        write_row(run, it, {"collect_s": 0.5, "update_s": 0.5})
    assert (
        "warning: --logger failed (ConnectionError: service gone); metrics.jsonl only."
        in capsys.readouterr().out
    )
    assert closed == [1] and sent == [1]  # closed once, and not written to again
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
