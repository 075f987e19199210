"""What a reader of each training script must read: (1) the lines of project code its default run
loads (one iteration, one process, the project's .py files in `sys.modules`), and (2) the functions
it calls or runs inside for the six parts of the mechanism and the loop, whole, with their
`file:first-last`.

    python benchmarks/reading.py            # both, for the four scripts
    python benchmarks/reading.py --loaded ppo_ddp.py   # (1) alone, one script (tests use it)
"""

from __future__ import annotations

import ast
import os
import runpy
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("ppo_ddp.py", "ppo_amp_ddp.py", "ppo_rnn_ddp.py", "distill_ddp.py")
# (2): the script's own (its command-line block too), then what it calls in common.py and, for
# rank 0's row, bookkeeping.py
OWN = ("main", "train", "make_update", "all_reduce_mean", "adaptive_lr", "__main__")
COMMON = ("agree", "as_flags", "broadcast_state", "normalizer_batches", "update_normalizers")
COMMON += ("Moments", "merge_moments", "reduce_logs", "log_pair")
BOOKKEEPING = ("Logger", "metrics_row", "console_line", "scalars")


def loaded_lines(script: str) -> dict[str, int]:
    """Run `script` for one iteration in this process -> each loaded project file's line count."""
    run_dir = tempfile.mkdtemp(prefix="reading_")
    sys.argv = [script, "--iterations", "1", "--run-dir", run_dir, "--logger", "none"]
    sys.path.insert(0, ROOT)
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    except SystemExit as done:
        if done.code:
            raise
    files = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None) or ""
        mine = os.path.abspath(path) == os.path.abspath(__file__)  # this tool is not the run's
        if path.startswith(ROOT + os.sep) and path.endswith(".py") and not mine:
            with open(path) as f:
                files[os.path.relpath(path, ROOT)] = sum(1 for _ in f)
    return files


def spans(path: str, names: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of the top-level functions, classes and assignments `names` in
    `path`, decorators included; `__main__` is the `if __name__ == "__main__":` block."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    found = []
    for node in tree.body:
        name = getattr(node, "name", None)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id  # a type alias a counted signature uses
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            name = "__main__"
        if name in names:
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            found.append((name, first, node.end_lineno))
    return found


def main() -> None:
    if sys.argv[1:2] == ["--loaded"]:
        files = loaded_lines(sys.argv[2])
        print(f"TOTAL {sum(files.values())} in {len(files)} files")
        return
    for script in SCRIPTS:
        done = subprocess.run(
            [sys.executable, __file__, "--loaded", script], capture_output=True, text=True
        )
        total = [line for line in done.stdout.splitlines() if line.startswith("TOTAL")]
        parts = [(script, OWN), ("common.py", COMMON), ("bookkeeping.py", BOOKKEEPING)]
        rows = [(path, *span) for path, names in parts for span in spans(path, names)]
        read = sum(last - first + 1 for _, _, first, last in rows)
        print(f"{script}: loads {total[0][6:] if total else '?'}; reads {read} lines in 3 files")
        for path, name, first, last in rows:
            print(f"    {path}:{first}-{last} {name} ({last - first + 1})")


if __name__ == "__main__":
    main()
