"""tools/: evaluate, play, export, plot and average on short runs of the four scripts."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import ROOT, cpu_dist, script_ranks, small_args

sys.path.insert(0, os.path.join(ROOT, "tools"))
import average  # noqa: E402
import evaluate  # noqa: E402
import export  # noqa: E402
import play  # noqa: E402
import plot  # noqa: E402
import policy  # noqa: E402

import distill_ddp  # noqa: E402
import envs  # noqa: E402
import ppo_ddp  # noqa: E402

RUNS = {  # short runs, one process: what each tool is tried on
    "ppo": ["ppo_ddp.py"],
    "cnn": ["ppo_ddp.py", "--task", "pendulum_image"],
    "amp": ["ppo_amp_ddp.py", "--disc-batch-size", "64"],
    "mlp": ["distill_ddp.py", "--eval-envs", "4"],
    "gru": ["distill_ddp.py", "--eval-envs", "4", "--student", "gru"],
    "rnn_gru": ["ppo_rnn_ddp.py", "--steps-per-env", "8", "--rnn-hidden", "8"],
    "rnn_lstm": [
        "ppo_rnn_ddp.py",
        "--steps-per-env",
        "8",
        "--rnn",
        "lstm",
        "--rnn-hidden",
        "8",
        "--rnn-layers",
        "2",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for name, (script, *extra) in RUNS.items():
        args = (
            "--iterations",
            "3",
            "--num-envs",
            "16",
            "--run-dir",
            name,
            "--logger",
            "none",
            *extra,
        )
        # as `python script ...` runs it
        codes, output = script_ranks(script, *args, cwd=root, nproc=1)
        assert codes == [0], output
    return root


def test_evaluate_gives_distillations_own_teacher_return_on_the_same_episodes(tmp_path):
    """The shipped teacher (a ppo_ddp.py checkpoint) on distill_ddp.evaluate's episodes (64 envs,
    seed 10000, rank 0): the same starts, physics and noise, so the same mean return to the last
    bit."""
    teacher_path = os.path.join(ROOT, distill_ddp.SHIPPED_TEACHER)
    result = evaluate.evaluate(
        evaluate.Config(teacher_path, episodes=64, seed=10_000, out=str(tmp_path / "eval.json"))
    )
    args = small_args(distill_ddp.Args, eval_envs=64)
    teacher = distill_ddp.load_teacher(
        args.teacher, envs.make_env(args.task, 1, "cpu", 0).get_observations(), 1, args.task
    )
    student = distill_ddp.Student({"policy": [9]}, 1, (8,), 0, True)
    ctx = cpu_dist()
    assert (
        result["return_mean"]
        == distill_ddp.evaluate(student, teacher, 1, args, ctx)["teacher_return"]
    )
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["episodes"] == len(written["returns"]) == 64 and written["length_mean"] == 200.0
    assert written["task"] == "pendulum_partial" and written["policy"] == "actor mean"
    # its log
    assert written["terms"] == result["terms"] and set(written["terms"]) == {"swingup_ccw_fraction"}


@pytest.mark.parametrize("name", ["ppo", "cnn", "amp", "gru", "rnn_lstm"])
def test_evaluate_reads_every_kind_of_checkpoint(runs, name):
    result = evaluate.evaluate(evaluate.Config(str(runs / name), episodes=4))
    assert (
        result["iteration"] == 3 and len(result["returns"]) == 4 and result["length_mean"] == 200.0
    )
    assert os.path.isfile(runs / name / "eval_3.json")
    assert result["policy"] == ("student" if name == "gru" else "actor mean")


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", ["ppo", "cnn", "amp", "mlp", "gru", "rnn_gru", "rnn_lstm"])
def test_export_round_trip_matches_the_checkpoints_policy(runs, name, tmp_path):
    has_onnx = all(policy_module_installed(m) for m in ("onnx", "onnxscript"))
    formats = ("torchscript", "onnx") if has_onnx else ("torchscript",)
    errors = export.export(export.Config(str(runs / name), out_dir=str(tmp_path), formats=formats))
    assert (
        all(e is None or e <= 1e-5 for e in errors.values()) and errors["torchscript"] is not None
    )
    # Independently of the tool's own check: the TorchScript file on fresh observations.
    loaded = policy.load_policy(str(runs / name))
    program = torch.jit.load(str(tmp_path / "policy.pt"))
    recurrent = loaded.memory_size > 0
    ours = theirs = policy.initial_memory(loaded, 5, "cpu")
    for _ in range(3):  # a recurrent policy's memory carried from step to step
        # one input per group
        obs = {group: torch.randn(5, *shape) * 2 for group, shape in loaded.obs_shapes.items()}
        memory = ours
        expected, ours = policy.act(loaded, obs, memory)
        got, theirs = (
            program(*obs.values(), theirs) if recurrent else (program(*obs.values()), theirs)
        )
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    meta = json.loads((tmp_path / "policy.json").read_text())
    groups = {"cnn": ["policy", "image"]}.get(
        name, ["policy"]
    )  # the groups each run's policy reads, in order
    assert list(loaded.obs_shapes) == groups and meta["observation_shapes"] == loaded.obs_shapes
    assert meta["inputs"] == [*groups, *(["memory_in"] if recurrent else [])]
    assert meta["outputs"] == (["actions", "memory_out"] if recurrent else ["actions"])
    # a GRU student's memory is its --rnn-hidden (64); an LSTM's row holds h and c of each of its 2
    # layers
    assert (
        meta["memory_size"]
        == loaded.memory_size
        == {"gru": 64, "rnn_gru": 8, "rnn_lstm": 2 * 2 * 8}.get(name, 0)
    )
    assert not {"obs_dim", "hidden_size", "observation_groups"} & meta.keys()
    if name.startswith(
        "rnn"
    ):  # one memory row per env: h (and an LSTM's c) of each layer, side by side
        lstm = name == "rnn_lstm"
        layout = f"{'h then c' if lstm else 'h'}, each (layers, hidden) flattened, layer 0 first"
        assert meta["rnn"] == {
            "type": "lstm" if lstm else "gru",
            "layers": 1 + lstm,
            "hidden": 8,
            "memory": layout,
        }
    # the ONNX file, run here by onnxruntime itself
    if has_onnx and policy_module_installed("onnxruntime"):
        import onnxruntime

        session = onnxruntime.InferenceSession(
            str(tmp_path / "policy.onnx"), providers=["CPUExecutionProvider"]
        )
        feed = dict(zip(meta["inputs"], (*(x.numpy() for x in obs.values()), memory.numpy())))
        results = session.run(meta["outputs"], feed)
        torch.testing.assert_close(torch.from_numpy(results[0]), expected, rtol=0, atol=1e-5)
        if recurrent:
            torch.testing.assert_close(torch.from_numpy(results[1]), ours, rtol=0, atol=1e-5)


def policy_module_installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_plot_writes_a_png_for_each_script_and_groups_seeds(runs, tmp_path):
    pytest.importorskip("matplotlib", reason="tools/plot.py needs matplotlib")
    for name in ("ppo", "amp", "mlp"):
        out = plot.plot(plot.Config((str(runs / name),), out=str(tmp_path / f"{name}.png")))
        assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert plot.group_runs(("a/PPO_seed1", "a/PPO_seed2", "a/PPO_RND_seed1", "b/other")) == {
        "PPO": ["a/PPO_seed1", "a/PPO_seed2"],
        "PPO_RND": ["a/PPO_RND_seed1"],
        "other": ["b/other"],
    }
    # Two folders with runs of the same name are two settings, named with their folders.
    assert plot.group_runs(("exp1/run", "exp2/run")) == {
        "exp1/run": ["exp1/run"],
        "exp2/run": ["exp2/run"],
    }
    seeds = [
        [{"env_steps": 10, "r": 1.0}, {"env_steps": 20, "r": 3.0}],
        [{"env_steps": 10, "r": 3.0}],
    ]
    assert plot.curves(seeds, "r") == ([10], [2.0], [1.0], [3.0])  # cut to the shortest seed
    picked = plot.plot(
        plot.Config((str(runs / "ppo"),), out=str(tmp_path / "some.png"), keys=("kl", "entropy"))
    )
    assert open(picked, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"--keys \['nope'\] not in the runs' metrics"):
        plot.plot(
            plot.Config((str(runs / "ppo"),), out=str(tmp_path / "none.png"), keys=("kl", "nope"))
        )


def test_play_draws_the_pendulum_episode(runs, tmp_path):
    pytest.importorskip("matplotlib", reason="drawing the built-in tasks needs matplotlib")
    gif, strip = play.play(play.Config(str(runs / "amp"), out=str(tmp_path / "amp.gif"), every=20))
    assert open(gif, "rb").read(6) == b"GIF89a" and open(strip, "rb").read(4) == b"\x89PNG"


def test_play_picks_the_farthest_start_and_frames_where_the_return_accrues(runs):
    policy = play.load_policy(str(runs / "ppo"), "cpu")
    states, rewards = play.play_built_in(policy, "pendulum", seed=0)
    returns, *_ = play.run_episodes(policy, play.envs.make_env("pendulum", play.STARTS, "cpu", 0))
    assert (
        sum(rewards) == pytest.approx(float(returns.min())) and len(states) == len(rewards) == 200
    )
    # A swing-up in 20 steps, then holding still: the strip spans the swing-up.
    assert play.strip_steps([-5.0] * 20 + [0.0] * 180) == [0, 3, 6, 9, 11, 14, 17, 20]
    # nothing accrues: the whole episode
    assert play.strip_steps([0.0] * 10) == [0, 1, 3, 4, 6, 7, 9, 10]


def test_play_records_a_gym_task_and_the_tools_say_one_line_on_bad_input(tmp_path):
    for module in ("gymnasium", "pygame", "imageio"):
        pytest.importorskip(
            module, reason="recording gym: tasks needs gymnasium[classic-control] and imageio"
        )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    train = (
        "--task",
        "gym:Pendulum-v1",
        "--iterations",
        "1",
        "--num-envs",
        "4",
        "--run-dir",
        "gym",
        "--logger",
        "none",
    )
    assert script_ranks("ppo_ddp.py", *train, cwd=tmp_path, nproc=1)[0] == [0]
    tool = [sys.executable, os.path.join(ROOT, "tools", "play.py"), "gym", "--out", "gym/play.gif"]
    subprocess.run(tool, cwd=tmp_path, env=env, check=True, capture_output=True)
    assert open(tmp_path / "gym" / "play.gif", "rb").read(6) == b"GIF89a"
    bad = subprocess.run(
        [*tool[:2], "README.md"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert bad.returncode == 1 and bad.stderr.startswith(
        "error: cannot read checkpoint 'README.md'"
    )
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_a_missing_optional_package_is_one_line_naming_it(runs, monkeypatch, tmp_path):
    import importlib.util

    # `import matplotlib` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"^plotting needs matplotlib: pip install matplotlib$"):
        plot.plot(plot.Config((str(runs / "ppo"),), out=str(tmp_path / "x.png")))
    with pytest.raises(
        ImportError, match=r"^drawing the built-in tasks needs matplotlib: pip install matplotlib$"
    ):
        play.play(play.Config(str(runs / "ppo"), out=str(tmp_path / "x.gif")))
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "onnxscript" else found(name, *a),
    )
    with pytest.raises(
        ImportError, match=r"ONNX export needs onnx and onnxscript: pip install onnx onnxscript"
    ):
        export.export(export.Config(str(runs / "ppo"), out_dir=str(tmp_path)))
    assert not os.path.exists(tmp_path / "policy.pt")  # nothing written


def test_a_tanh_actor_is_rebuilt_as_the_tanh_network_it_was_trained_as(tmp_path):
    """`--activation tanh` is in the actor's config the checkpoint keeps: the tools rebuild that
    network (an ELU one would load the same weights without complaint and act differently)."""
    actor = ppo_ddp.Actor({"policy": [3]}, 1, (8,), 1.0, True, activation="tanh")
    args = dataclasses.asdict(small_args(ppo_ddp.Args, actor_hidden=(8,), activation="tanh"))
    state = {
        "script": "ppo",
        "actor": actor.state_dict(),
        "args": args,
        "configs": {"actor": actor.config},
    }
    torch.save({**state, "iteration": 1}, tmp_path / "model_1.pt")
    x = {"policy": torch.randn(5, 3)}
    assert torch.equal(policy.load_policy(str(tmp_path / "model_1.pt")).network(x)[0], actor(x)[0])


def test_a_shipped_policy_is_used_without_writing_into_the_checkout(tmp_path, monkeypatch):
    """The tools write beside a checkpoint, but a policy under policies/ (tracked by git) gets its
    outputs under runs/<its folder>/ of the working directory: `git status` stays clean."""
    import types

    monkeypatch.chdir(tmp_path)
    shipped = types.SimpleNamespace(path=os.path.join(ROOT, "policies", "walker", "model_1.pt"))
    assert policy.output_path(shipped, "eval_1.json") == os.path.join(
        "runs", "walker", "eval_1.json"
    )
    assert (tmp_path / "runs" / "walker").is_dir()
    own = types.SimpleNamespace(path=str(tmp_path / "run" / "model_1.pt"))
    assert policy.output_path(own, "exported") == str(tmp_path / "run" / "exported")
    shipped_runs = os.path.join(ROOT, "policies")  # a shipped folder with its metrics, if any
    folders = sorted(
        f
        for f in os.listdir(shipped_runs)
        if "metrics.jsonl" in os.listdir(os.path.join(shipped_runs, f))
    )
    if folders and policy_module_installed("matplotlib"):  # tools/plot.py's curves, by the rule
        folder = os.path.join(ROOT, "policies", folders[0])
        out = plot.plot(plot.Config((folder,), keys=("episode_length",)))
        assert out == os.path.join("runs", folders[0], "curves.png")
        assert (tmp_path / out).is_file() and "curves.png" not in os.listdir(folder)


@pytest.mark.parametrize("name", list(RUNS))
def test_average_rebuilds_every_kind_of_checkpoints_fingerprint(runs, name):
    """tools/average.py reads the fingerprint off the saved dicts as the scripts compute it from
    their modules and optimizers, for every script's checkpoint."""
    state = torch.load(runs / name / "model_3.pt", weights_only=True)
    assert average.saved_fingerprint(state) == state["fingerprint"]
    state[state["parts"][-1]]["param_groups"][0]["lr"] *= 2  # a changed state, another print
    assert average.saved_fingerprint(state) != state["fingerprint"]


def test_average_is_the_mean_of_the_networks_and_a_run_resumes_from_it(tmp_path):
    """Each network weight is the float64 mean over the checkpoints, cast back; the normalizers,
    the optimizer and the iteration are the last checkpoint's; `--resume` takes the result (it
    checks the fingerprint against the state it loads). Bad input is a ValueError, nothing
    written."""
    short = ("--num-envs", "16", "--logger", "none")
    codes, output = script_ranks(
        "ppo_ddp.py",
        "--iterations",
        "3",
        "--save-interval",
        "1",
        "--run-dir",
        "run",
        *short,
        cwd=tmp_path,
        nproc=1,
    )
    assert codes == [0], output
    paths = tuple(str(tmp_path / "run" / f"model_{i}.pt") for i in (1, 2, 3))
    out = str(tmp_path / "avg" / "model_3.pt")
    averaged = average.average(average.Config(paths, out=out))
    states = [torch.load(path, weights_only=True) for path in paths]
    for name in ("actor", "critic"):
        for key, value in states[-1][name].items():
            mean = torch.stack([state[name][key].double() for state in states]).mean(0)
            expected = value if "normalizer" in key else mean.to(value.dtype)
            assert torch.equal(averaged[name][key], expected), (name, key)
    assert not torch.equal(averaged["actor"]["net.0.weight"], states[-1]["actor"]["net.0.weight"])
    assert averaged["optimizer"]["state"][0]["exp_avg"].equal(
        states[-1]["optimizer"]["state"][0]["exp_avg"]
    )
    assert averaged["iteration"] == 3 and averaged["fingerprint"] != states[-1]["fingerprint"]
    assert torch.load(out, weights_only=True)["fingerprint"] == averaged["fingerprint"]
    codes, output = script_ranks(
        "ppo_ddp.py",
        "--iterations",
        "4",
        "--run-dir",
        "on",
        "--resume",
        out,
        *short,
        cwd=tmp_path,
        nproc=1,
    )
    assert codes == [0], output
    with pytest.raises(ValueError, match="exists; name a new file"):
        average.average(average.Config(paths, out=out))
    with pytest.raises(ValueError, match="two or more"):
        average.average(average.Config(paths[:1], out=str(tmp_path / "one.pt")))
    other = {**states[0], "actor": {**states[0]["actor"], "net.0.weight": torch.zeros(1, 1)}}
    torch.save(other, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="built otherwise"):
        average.average(average.Config((str(tmp_path / "other.pt"), paths[-1]), out="x.pt"))
    assert not os.path.exists(tmp_path / "one.pt") and not os.path.exists("x.pt")
