"""`launch.record_error`: the one line a worker exits with becomes torchrun's root cause, read by
torch's own parser of the error file and shown in a real torchrun's `ChildFailedError` report."""

import os

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import launch
from dist_helpers import PROMPT_S, ROOT, torchrun

LINE = "unknown task 'pendlum' (did you mean 'pendulum'?): choose one of 'pendulum' or 'go1'."


def test_torchs_reader_takes_the_recorded_line_as_the_failure(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    launch.record_error(LINE)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == LINE
    report = ChildFailedError("ppo_ddp.py", {0: failure}).format_msg()
    assert f"traceback : {LINE}\n" in report and "<N/A>" not in report, report


def test_nothing_is_written_outside_torchrun(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    launch.record_error(LINE)
    assert os.listdir(tmp_path) == []


def test_an_unwritable_error_file_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "no_such_dir" / "error.json"))
    launch.record_error(LINE)  # no exception: the report falls back to <N/A>
    assert os.listdir(tmp_path) == []


def test_torchruns_report_names_the_line_as_its_root_cause(tmp_path):
    """Two workers record the line and exit 1: the report's root cause carries it, not `<N/A>`.
    With OMP_NUM_THREADS=1 set (the helper sets it, as README's command does), torchrun prints no
    warning about it."""
    (tmp_path / "fails.py").write_text(
        f"import sys\nsys.path.insert(0, {ROOT!r})\nimport launch\n"
        f"launch.record_error({LINE!r})\nsys.exit(1)\n"
    )
    result = torchrun(str(tmp_path / "fails.py"), cwd=tmp_path, timeout=PROMPT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    root_cause = output.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {LINE}\n" in root_cause and "<N/A>" not in root_cause, output
    assert "OMP_NUM_THREADS" not in output, output
