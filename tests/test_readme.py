"""The README's commands and example, run as written."""

import json
import os
import re

from dist_helpers import ROOT, torchrun

README = open(os.path.join(ROOT, "README.md")).read()


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "pip install -r requirements-dev.txt && python -m pytest -q" in README
    assert "python -m pip install -q -r requirements-dev.txt" in ci and ci.rstrip().endswith(
        "python -m pytest -q"
    )


def test_bring_your_own_environment_example_trains(tmp_path):
    section = README.split("## Bring your own environment", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_env.py").write_text(code)
    command = re.search(r"```bash\n(torchrun .*?)\n```", section).group(1)
    assert command == "torchrun --standalone --nproc_per_node=2 ppo_ddp.py --task my_env:PointMass"
    result = torchrun(
        "ppo_ddp.py",
        "--task",
        "my_env:PointMass",
        "--num-envs",
        "16",
        "--steps-per-env",
        "8",
        "--iterations",
        "3",
        "--run-dir",
        "run",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 3 and "abs_position" in rows[-1]


def test_how_it_works_links_point_at_the_lines_they_name():
    with open(os.path.join(ROOT, "ppo_ddp.py")) as f:
        lines = f.read().splitlines()
    links = re.findall(r"\[`(\w+)`\]\(ppo_ddp\.py#L(\d+)\)", README)
    assert len(links) >= 10
    for name, number in links:
        line = lines[int(number) - 1]
        assert "# SYNC" in line or f"def {name}(" in line, (name, number, line)
