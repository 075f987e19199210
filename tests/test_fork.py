"""docs/forking.md's recipes, applied as written: each ```diff block of a recipe is patched into a
copy of the repository, and the copy runs what the recipe promises. A recipe whose text no longer
matches the script fails here, not in a reader's hands."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import bookkeeping
import ppo_ddp
from benchmarks import bootstrap
from dist_helpers import ROOT, counting_collectives, process_group, run_ranks, small_args, torchrun

SMALL = ["--num-envs", "8", "--steps-per-env", "8", "--logger", "none", "--check-interval", "1"]


def recipe_diffs(number: int) -> list[tuple[str, str]]:
    """The ```diff blocks of recipe `number` in docs/forking.md, as (old text, new text)."""
    with open(os.path.join(ROOT, "docs", "forking.md")) as f:
        diffs = bootstrap.recipe_diffs(f.read(), number)  # as the benchmark applies recipe 5
    assert diffs, f"recipe {number} of docs/forking.md has no diff"
    return diffs


FORKED = ("ppo_ddp.py", "networks.py")  # the files a recipe may change


def forked_copy(tmp_path, *numbers: int) -> str:
    """A copy of the repository's code with the diffs of recipes `numbers` applied, each matching
    one place exactly in one of `FORKED`; -> its root."""
    root = str(tmp_path / "fork")
    skip = shutil.ignore_patterns(".git", "runs", "__pycache__", "tests", "docs", "benchmarks")
    shutil.copytree(ROOT, root, ignore=skip)
    texts = {}
    for name in FORKED:
        with open(os.path.join(root, name)) as f:
            texts[name] = f.read()
    for number in numbers:
        for old, new in recipe_diffs(number):
            fits = [name for name, text in texts.items() if text.count(old) == 1]
            assert len(fits) == 1, f"recipe {number} does not fit one of {FORKED} once:\n{old}"
            texts[fits[0]] = texts[fits[0]].replace(old, new)
    for name, text in texts.items():
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    return root


def run(root: str, *command: str) -> str:
    """`python command...` in the fork's root -> its output; it must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, *command], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    return done.stdout


def test_each_recipe_fits_the_files_as_they_are(tmp_path):
    forked_copy(tmp_path, 1, 2, 3, 5)  # every diff matches one file once, all four together
    with open(os.path.join(ROOT, "docs", "forking.md")) as f:
        text = f.read()
    assert "### 1. A LayerNorm actor (two files: `networks.py` and `ppo_ddp.py`)" in text


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_layer_norm_actor_trains_resumes_evaluates_exports_and_teaches(tmp_path):
    """Recipe 1, on 2 processes: train, resume, evaluate, export and distill from the fork's actor,
    with no other edit; without the flag, a resume is refused in one line."""
    root = forked_copy(tmp_path, 1)
    ln = ["--task", "pendulum_partial", "--actor-obs", "teacher", "--actor-layer-norm", *SMALL]
    first = ["--run-dir", "runs/ln", "--iterations", "2"]
    done = torchrun(os.path.join(root, "ppo_ddp.py"), *ln, *first, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    resume = ["--resume", "runs/ln", "--iterations", "3"]
    state = torch.load(os.path.join(root, "runs", "ln", "model_2.pt"), weights_only=True)
    assert state["configs"]["actor"]["layer_norm"] is True
    assert state["deployed"] == {"part": "actor", "module": "networks", "class": "Actor"}
    assert state["actor"]["net.1.weight"].shape == (64,)  # the LayerNorm after the first layer
    done = torchrun(os.path.join(root, "ppo_ddp.py"), *ln, *resume, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert os.path.exists(os.path.join(root, "runs", "ln", "model_3.pt"))

    without = [arg for arg in ln if arg != "--actor-layer-norm"]
    refused = subprocess.run(
        [sys.executable, "ppo_ddp.py", *without, *resume[:2], "--iterations", "4"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "actor layer_norm=True (this run: False)" in refused.stderr

    out = run(root, "tools/evaluate.py", "runs/ln", "--episodes", "4")
    assert "4 episodes" in out and "runs/ln/model_3.pt" in out, out
    out = run(root, "tools/export.py", "runs/ln", "--formats", "torchscript")
    program = torch.jit.load(os.path.join(root, "runs", "ln", "exported", "policy.pt"))
    assert "aten::layer_norm" in str(program.inlined_graph)  # the fork's layer is deployed

    student = ["--teacher", "runs/ln", "--run-dir", "runs/student", "--iterations", "2"]
    done = torchrun(os.path.join(root, "distill_ddp.py"), *student, *SMALL, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "student_return" in done.stdout


def _train_worker(root: str, fork: str | None, iterations: int) -> tuple[str, int, list]:
    """One rank of a short PPO run of ppo_ddp.py, or of the fork in `fork` -> (the fingerprint of
    the trained state, the collectives the iterations made, metrics.jsonl's rows on rank 0)."""
    import importlib.util

    module = ppo_ddp
    if fork is not None:
        spec = importlib.util.spec_from_file_location("forked_ppo_ddp", fork)
        module = importlib.util.module_from_spec(spec)
        sys.modules["forked_ppo_ddp"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    from dist_helpers import chdir_rank_dir

    chdir_rank_dir(root)
    args = small_args(
        module.Args,
        num_envs=8,
        steps_per_env=8,
        iterations=iterations,
        run_dir="run",
        logger="none",
        check_interval=10**6,
    )
    with process_group("cpu", seed=args.seed) as ctx, counting_collectives() as calls:
        fingerprint = module.train(args, ctx)
    rows = []
    if ctx.rank == 0:
        with open(os.path.join("run", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    return fingerprint, calls["n"], rows


def test_a_new_logged_scalar_reaches_metrics_and_its_own_dashboard_tab(tmp_path):
    """Recipe 2: the std the rollout acted with, averaged over ranks, in every row of metrics.jsonl
    under the name it was given, and under that name on the dashboards."""
    fork = os.path.join(forked_copy(tmp_path, 2), "ppo_ddp.py")
    ranks = run_ranks(_train_worker, 2, str(tmp_path / "runs"), fork, 2)
    rows = ranks[0][2]
    assert [row["iteration"] for row in rows] == [1, 2]
    assert rows[0]["Policy/action_std"] == pytest.approx(1.0)  # exp(log std 0) on every rank
    assert all(0 < row["Policy/action_std"] < 10 for row in rows)
    keys = ["Policy/action_std", "action_std"]
    assert bookkeeping.dashboard_name("Policy/action_std", keys) == "Policy/action_std"
    assert bookkeeping.dashboard_name("action_std", keys) == "Episode/action_std"  # without a "/"


def test_per_rank_advantages_keep_ranks_identical_with_one_collective_fewer(tmp_path):
    """Recipe 3: rsl_rl's per-rank normalization. The ranks still end with the same bits, each
    iteration makes one collective fewer, and the training differs from the global one."""
    fork = os.path.join(forked_copy(tmp_path, 3), "ppo_ddp.py")
    iterations = 3
    forked = run_ranks(_train_worker, 2, str(tmp_path / "forked"), fork, iterations)
    plain = run_ranks(_train_worker, 2, str(tmp_path / "plain"), None, iterations)
    assert forked[0][0] == forked[1][0]  # identical ranks
    assert forked[0][1] == plain[0][1] - iterations  # one all_reduce fewer per iteration
    assert forked[0][0] != plain[0][0]  # a different update


class Jump:
    """Episodes of one step, each a time-out: even envs observe L and earn 1 into H, odd envs
    observe H and earn 3 into H again. The step from L jumps to H, which L does not show. With
    gamma 0.5 the values are V(H) = 3 / (1 - 0.5) = 6 and V(L) = 1 + 0.5 * 6 = 4; rsl_rl's
    bootstrap, 1 + 0.5 * V(L), makes V(L) = 1 / (1 - 0.5) = 2 instead."""

    def __init__(self, num_envs: int, device: str, seed: int, final_obs: bool = True) -> None:
        self.num_envs, self.num_actions, self.max_episode_length = num_envs, 1, 1
        self.device, self.final_obs = torch.device(device), final_obs
        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long)
        self.high = torch.arange(num_envs) % 2 == 1
        self.obs = {"policy": torch.stack([~self.high, self.high], -1).float()}  # [L, H] one-hot

    def get_observations(self) -> dict[str, torch.Tensor]:
        return self.obs

    def step(self, actions: torch.Tensor) -> tuple[dict, torch.Tensor, torch.Tensor, dict]:
        rewards = torch.where(self.high, 3.0, 1.0)
        ended = torch.ones(self.num_envs, dtype=torch.bool)
        extras = {"time_outs": ended}
        if self.final_obs:  # every env ends in H
            extras["final_obs"] = {"policy": torch.tensor([[0.0, 1.0]]).expand(self.num_envs, 2)}
        return self.obs, rewards, ended, extras


def jump_without_final_obs(num_envs: int, device: str, seed: int) -> Jump:
    return Jump(num_envs, device, seed, final_obs=False)


def _jump_worker(root: str, fork: str | None, task: str, iterations: int) -> tuple:
    """One rank of a run on `task` (Jump) with a fixed learning rate and unclipped value loss ->
    (the fingerprint, rank 0's critic values of L and H and its normalizer's mean, its output)."""
    import contextlib
    import importlib.util
    import io

    module = ppo_ddp
    if fork is not None:
        spec = importlib.util.spec_from_file_location("forked_ppo_ddp", fork)
        module = importlib.util.module_from_spec(spec)
        sys.modules["forked_ppo_ddp"] = module
        spec.loader.exec_module(module)
    from dist_helpers import chdir_rank_dir

    chdir_rank_dir(root)
    args = small_args(
        module.Args,
        task=task,
        num_envs=8,
        steps_per_env=8,
        iterations=iterations,
        gamma=0.5,
        schedule="fixed",
        learning_rate=1e-2,
        clip_value_loss=False,
        run_dir="run",
        logger="none",
        check_interval=10**6,
    )
    output = io.StringIO()
    with process_group("cpu", seed=1) as ctx, contextlib.redirect_stdout(output):
        fingerprint = module.train(args, ctx)
    if ctx.rank != 0:
        return fingerprint, None, None, ""
    state = torch.load(os.path.join("run", f"model_{iterations}.pt"), weights_only=True)
    critic = module.Critic(**state["configs"]["critic"])
    critic.load_state_dict(state["critic"])
    with torch.no_grad():
        values = critic({"policy": torch.eye(2)}).tolist()  # V(L), V(H)
    mean = state["critic"]["inputs.normalizer.mean"].tolist()
    return fingerprint, values, mean, output.getvalue()


def test_final_observation_bootstrap_learns_the_true_value_rsl_rls_its_own(tmp_path):
    """Recipe 5 on 2 ranks, 20 iterations of Jump: the fork's critic learns V(L) = 4 (the value of
    the state the time-out reached, H, bootstrapped), ppo_ddp.py's V(L) = 2 (rsl_rl's V(s_t));
    both V(H) = 6. The final observations do not join the normalizer: it saw L and H half each."""
    fork = os.path.join(forked_copy(tmp_path, 5), "ppo_ddp.py")
    task = "test_fork:Jump"
    forked = run_ranks(_jump_worker, 2, str(tmp_path / "forked"), fork, task, 20)
    plain = run_ranks(_jump_worker, 2, str(tmp_path / "plain"), None, task, 20)
    assert forked[0][0] == forked[1][0] and plain[0][0] == plain[1][0]  # identical ranks
    assert forked[0][1] == pytest.approx([4.0, 6.0], abs=0.05)
    assert plain[0][1] == pytest.approx([2.0, 6.0], abs=0.05)
    assert forked[0][2] == [0.5, 0.5]


def test_without_final_obs_the_fork_trains_ppo_ddps_bits_and_says_so(tmp_path):
    """Recipe 5 on an env that gives no final observation: rsl_rl's bootstrap, to the bits of
    ppo_ddp.py (which ignores the field where an env gives it), said in one line at the start."""
    fork = os.path.join(forked_copy(tmp_path, 5), "ppo_ddp.py")
    without = "test_fork:jump_without_final_obs"
    forked = run_ranks(_jump_worker, 2, str(tmp_path / "forked"), fork, without, 3)
    plain = run_ranks(_jump_worker, 2, str(tmp_path / "plain"), None, "test_fork:Jump", 3)
    assert forked[0][0] == forked[1][0] == plain[0][0]
    line = "the env gives no extras['final_obs']: time-outs bootstrap from V(s_t) (rsl_rl)"
    assert forked[0][3].count(line) == 1 and line not in plain[0][3]


def test_the_bootstrap_benchmark_runs_the_recipes_fork_and_the_script(tmp_path):
    """benchmarks/bootstrap.py snapshots the code twice: ppo_ddp.py as it is, and recipe 5's fork
    of it, the very file this module's tests run."""
    roots = bootstrap.snapshot(str(tmp_path / "bench"))
    with open(os.path.join(forked_copy(tmp_path, 5), "ppo_ddp.py")) as f:
        fork = f.read()
    with open(os.path.join(roots["final"], "ppo_ddp.py")) as f:
        assert f.read() == fork
    with open(os.path.join(roots["rsl_rl"], "ppo_ddp.py")) as f, open(ppo_ddp.__file__) as g:
        assert f.read() == g.read()


def new_script(tmp_path, *edits: tuple[str, str]) -> str:
    """docs/forking.md's new script: a copy of ppo_ddp.py, my_ppo_ddp.py, whose checkpoints carry
    a name of their own ("my_ppo"), with `edits` (old text, new text; each matching once) applied
    -> the root of the repository's copy that holds it."""
    root = forked_copy(tmp_path)
    with open(os.path.join(root, "ppo_ddp.py")) as f:
        script = f.read()
    assert '"ppo"' in script, 'ppo_ddp.py names its checkpoints otherwise than "ppo"'
    script = script.replace('"ppo"', '"my_ppo"')  # where it names its runs and checkpoints
    for old, new in edits:
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    with open(os.path.join(root, "my_ppo_ddp.py"), "w") as f:
        f.write(script)
    return root


def test_a_new_script_is_evaluated_and_exported_with_no_registration(tmp_path):
    """docs/forking.md: a copy of ppo_ddp.py whose checkpoints carry a name of their own; the tools
    rebuild its actor from the class its checkpoints name (networks.py's, which it imports)."""
    root = new_script(tmp_path)
    run(root, "my_ppo_ddp.py", *SMALL, "--iterations", "1", "--run-dir", "runs/mine")
    state = torch.load(os.path.join(root, "runs", "mine", "model_1.pt"), weights_only=True)
    assert state["script"] == "my_ppo" and state["deployed"]["module"] == "networks"
    out = run(root, "tools/evaluate.py", "runs/mine", "--episodes", "2")
    assert "2 episodes" in out, out
    run(root, "tools/export.py", "runs/mine", "--formats", "torchscript")
    assert os.path.exists(os.path.join(root, "runs", "mine", "exported", "policy.pt"))


# A new script's own actor class: a subclass of the Actor it copies, which builds its actor.
OWN_ACTOR = (
    (
        "\ndef make_networks(",
        "\nclass MyActor(Actor):\n    pass\n\n\ndef make_networks(",
    ),
    ("    actor = Actor(", "    actor = MyActor("),
)


def test_a_new_scripts_actor_teaches_as_its_own_class_and_a_student_does_not(tmp_path):
    """Distillation takes as teacher the actor a checkpoint deploys, a new script's too: a copy of
    ppo_ddp.py with an actor class of its own trains one iteration, distill_ddp.py distills from it
    on 2 processes and rebuilds the teacher as that class. A checkpoint that deploys no actor (the
    student's) is refused in one line."""
    root = new_script(tmp_path, *OWN_ACTOR)
    privileged = ["--task", "pendulum_partial", "--actor-obs", "teacher"]
    run(root, "my_ppo_ddp.py", *privileged, *SMALL, "--iterations", "1", "--run-dir", "runs/mine")
    state = torch.load(os.path.join(root, "runs", "mine", "model_1.pt"), weights_only=True)
    assert state["deployed"] == {"part": "actor", "module": "my_ppo_ddp", "class": "MyActor"}

    student = ["--teacher", "runs/mine", "--run-dir", "runs/student", "--iterations", "1"]
    done = torchrun(os.path.join(root, "distill_ddp.py"), *student, *SMALL, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "student_return" in done.stdout
    rebuilt = (
        "import distill_ddp, envs, my_ppo_ddp\n"
        "obs = envs.make_env('pendulum_partial', 1, 'cpu', 0).get_observations()\n"
        "teacher = distill_ddp.load_teacher('runs/mine', obs, 1, 'pendulum_partial')\n"
        "print(type(teacher).__module__, type(teacher).__qualname__, "
        "type(teacher) is my_ppo_ddp.MyActor)"
    )
    assert run(root, "-c", rebuilt).split() == ["my_ppo_ddp", "MyActor", "True"]

    refused = subprocess.run(
        [sys.executable, "distill_ddp.py", "--teacher", "runs/student", *SMALL],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "deploys distill_ddp.Student, its student, not an actor" in lines[0]
