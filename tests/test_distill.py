"""distill_ddp.py: labels, loss, truncated BPTT coverage, frozen teacher, rank sync, errors,
torchrun."""

import functools
import json
import os

import pytest
import torch
import torch.distributed as dist

import checkpoints
import common
import distill_ddp
import envs
import ppo_ddp
import ppo_rnn_ddp
from dist_helpers import (
    count_host_reads,
    cpu_dist,
    expect_files,
    process_group,
    run_ranks,
    small_args,
)
from envs import make_env

CPU1 = cpu_dist()


def _fake_teacher_checkpoint(path, obs_dim=2, **overrides):
    """A ppo_ddp.py-shaped checkpoint whose actor, on the `teacher` group, is one known linear layer
    behind a known normalizer."""
    actor = ppo_ddp.Actor({"teacher": [obs_dim]}, 1, (), 1.0, normalize=True)
    with torch.no_grad():
        actor.net[0].weight.copy_(torch.arange(1.0, obs_dim + 1).reshape(1, -1))
        actor.net[0].bias.fill_(0.5)
        actor.inputs.normalizer.count.fill_(10.0)
        actor.inputs.normalizer.mean.fill_(1.0)
        actor.inputs.normalizer.var.fill_(4.0)
    state = {
        "script": "ppo",
        "actor": actor.state_dict(),
        "args": {"actor_hidden": (), "normalize_obs": True},
        "configs": {"actor": actor.config},
        **overrides,
    }
    torch.save(state, path)
    return str(path)


# --- labels and loss ------------------------------------------------------------------------


def test_teacher_label_is_its_mean_through_its_saved_normalizer(tmp_path):
    obs = {"teacher": torch.tensor([[3.0, 5.0], [1.0, 1.0]])}
    teacher = distill_ddp.load_teacher(
        _fake_teacher_checkpoint(tmp_path / "t.pt"), obs, 1, "pendulum_partial"
    )
    # (obs - mean 1) / (std 2 + eps 0.01), then 1 * x0 + 2 * x1 + 0.5
    expected = torch.tensor([[2 / 2.01 + 2 * 4 / 2.01 + 0.5], [0.5]])
    labels = teacher(obs)[0]  # the mean of its Gaussian
    assert torch.allclose(labels, expected)
    assert torch.equal(teacher(obs)[0], labels)  # deterministic: no sampling
    assert type(teacher) is ppo_ddp.Actor  # the PPO actor class itself, not a copy of it
    normalizer = teacher.inputs.normalizer
    assert normalizer.count.item() == 10.0 and normalizer.mean.tolist() == [1.0, 1.0]
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())


def test_a_tanh_teacher_labels_with_its_tanh_network(tmp_path):
    """A teacher trained with `--activation tanh` is rebuilt as one: its label is the tanh actor's
    mean."""
    actor = ppo_ddp.Actor({"teacher": [2]}, 1, (8,), 1.0, True, activation="tanh")
    args = {"actor_hidden": (8,), "normalize_obs": True, "activation": "tanh"}
    configs = {"actor": actor.config}
    path = _fake_teacher_checkpoint(
        tmp_path / "t.pt", actor=actor.state_dict(), args=args, configs=configs
    )
    obs = {"teacher": torch.randn(4, 2)}
    assert torch.equal(
        distill_ddp.load_teacher(path, obs, 1, "pendulum_partial")(obs)[0], actor(obs)[0]
    )


def test_a_checkpoint_that_deploys_no_feed_forward_actor_is_refused_in_one_line(tmp_path):
    """The teacher is the actor a checkpoint deploys (`deployed`): a student, or a recurrent actor,
    which labels no state alone, is refused in one line before a network is built."""
    student = distill_ddp.Student({"teacher": [2]}, 1, (8,), 0, True)
    recurrent = ppo_rnn_ddp.Recurrent({"teacher": [2]}, True, "gru", 8, 1, {"num_actions": 1})
    cases = {
        "distill": ("student", student, "deploys distill_ddp.Student, its student, not an actor"),
        "ppo_rnn": ("actor", recurrent, "Recurrent, the actor of"),
    }
    obs = {"teacher": torch.randn(4, 2)}
    for script, (part, network, expected) in cases.items():
        trained = {part: network}
        path = tmp_path / f"{script}.pt"
        configs, deployed = checkpoints.configs(trained), checkpoints.deployed(trained)
        state = {"script": script, part: network.state_dict(), "configs": configs}
        torch.save({**state, "deployed": deployed}, path)
        with pytest.raises(ValueError) as refused:
            distill_ddp.load_teacher(str(path), obs, 1, "pendulum_partial")
        message = str(refused.value)
        assert expected in message and "PPO policy" in message and "\n" not in message


def test_behavior_loss_mse_and_huber_on_a_known_case():
    actions, labels = torch.tensor([[0.0], [3.0]]), torch.tensor([[1.0], [0.0]])
    assert distill_ddp.behavior_loss(actions, labels, "mse").item() == pytest.approx((1 + 9) / 2)
    # Huber (delta 1): 0.5 * 1^2 for the error of 1, 3 - 0.5 for the error of 3.
    assert distill_ddp.behavior_loss(actions, labels, "huber").item() == pytest.approx(
        (0.5 + 2.5) / 2
    )


def test_shipped_teacher_fits_pendulum_partial_teacher_group():
    env = make_env("pendulum_partial", 4, "cpu", 0)
    obs = env.get_observations()
    teacher = distill_ddp.load_teacher(
        distill_ddp.SHIPPED_TEACHER, obs, env.num_actions, "pendulum_partial"
    )
    # the group its checkpoint names
    assert teacher.inputs.shapes == {"teacher": [obs["teacher"].shape[-1]]}
    assert teacher({"teacher": obs["teacher"]})[0].shape == (4, 1)


# --- every step enters the loss ---------------------------------------------------------------


@pytest.mark.parametrize("steps, gradient_length", [(32, 8), (7, 3), (5, 5), (3, 8), (9, 1)])
def test_time_chunks_cover_every_step_exactly_once_in_order(steps, gradient_length):
    chunks = distill_ddp.time_chunks(steps, gradient_length)
    assert [t for c in chunks for t in c] == list(range(steps))
    assert (
        all(len(c) == gradient_length for c in chunks[:-1])
        and 1 <= len(chunks[-1]) <= gradient_length
    )


def _student_and_rollout(kind, steps=7, envs=3, obs_dim=4):
    torch.manual_seed(0)
    student = distill_ddp.Student(
        {"policy": [obs_dim]}, 1, (8,), 5 if kind == "gru" else 0, normalize=True
    )
    buf = distill_ddp.DistillRollout(
        {
            "policy": torch.randn(steps, envs, obs_dim).requires_grad_()
        },  # a leaf: each step's input collects its gradient
        torch.randn(steps, envs, 1),
        torch.zeros(steps, envs),
        student.initial_memory(envs, torch.device("cpu")),
    )
    return student, buf


@pytest.mark.parametrize("kind", ["mlp", "gru"])
def test_every_rollout_step_gets_gradient_with_a_short_last_window(kind):
    student, buf = _student_and_rollout(kind, steps=7)
    buf.dones[2, 0] = 1.0
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
    steps = []
    optimizer.step = lambda *a, _step=optimizer.step, **k: steps.append(1) or _step(*a, **k)
    args = small_args(distill_ddp.Args, steps_per_env=7, gradient_length=3, epochs=1)
    loss = distill_ddp.make_update(student, optimizer, buf, args, CPU1)()["behavior_loss"]
    assert len(steps) == 3  # windows 0-2, 3-5 and the short 6: none dropped
    per_step = buf.obs["policy"].grad.abs().sum(-1)  # (steps, envs)
    assert (per_step > 0).all(), per_step  # rsl_rl would leave step 6 at zero
    assert loss > 0


def test_gru_memory_is_reset_at_dones_inside_the_update():
    student, buf = _student_and_rollout("gru", steps=4, envs=2)
    buf.dones[1, 0] = 1.0  # env 0's episode ends after step 1; env 1 runs on
    # labels that the student already meets at steps 0-1: zero loss gradient there
    with torch.no_grad():
        memory = buf.memory
        for t in range(2):
            actions, memory = student({"policy": buf.obs["policy"][t]}, memory)
            buf.labels[t] = actions
            memory = memory * (1 - buf.dones[t, :, None])
    optimizer = torch.optim.SGD(student.parameters(), lr=0.0)
    args = small_args(distill_ddp.Args, steps_per_env=4, gradient_length=4)
    distill_ddp.make_update(student, optimizer, buf, args, CPU1)()
    grad = buf.obs["policy"].grad.abs().sum(-1)
    # steps 2-3 of env 0 belong to a new episode and cannot see steps 0-1
    assert (grad[:2, 0] == 0).all()
    assert (grad[:2, 1] > 0).all()  # env 1's later losses reach back through its memory


def test_rollout_carries_gru_memory_over_and_resets_it_at_dones():
    args = small_args(distill_ddp.Args, num_envs=4, steps_per_env=5, student="gru")
    env = make_env("pendulum_partial", 4, "cpu", 0)
    # envs 0-1 end at the last step of the rollout
    env.episode_length_buf[:2] = env.max_episode_length - 5
    obs = env.get_observations()
    teacher = distill_ddp.load_teacher(distill_ddp.SHIPPED_TEACHER, obs, 1, "pendulum_partial")
    student, _ = _student_and_rollout("gru", steps=5, envs=4, obs_dim=9)
    stored = {"policy": torch.zeros(5, 4, 9)}
    buf = distill_ddp.DistillRollout(
        stored, torch.zeros(5, 4, 1), torch.zeros(5, 4), torch.zeros(4, 5)
    )
    episodes = envs.make_episodes(4, torch.device("cpu"))
    memory = student.initial_memory(4, torch.device("cpu"))
    act = functools.partial(distill_ddp.act, student, teacher, args.action_noise_std)
    obs, memory, logs, problem = distill_ddp.rollout(env, act, obs, memory, buf, episodes, args)
    assert problem == ""
    assert buf.dones[-1].tolist() == [1.0, 1.0, 0.0, 0.0] and episodes.finished[2].item() == 2
    assert (memory[:2] == 0).all() and (memory[2:] != 0).any(-1).all()
    assert logs["teacher_action_error"].item() > 0
    carried = memory.clone()
    distill_ddp.rollout(env, act, obs, memory, buf, episodes, args)
    assert torch.equal(buf.memory, carried) and not buf.memory.requires_grad


# --- 2 real processes (one spawn; each test below checks one claim on its results) ---------------


def _two_rank_worker(root):
    rank = os.environ["RANK"]
    rank_dir = os.path.join(root, f"rank{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    os.chdir(rank_dir)  # same relative --run-dir on every rank, a different place on disk
    torch.set_num_threads(1)  # torch was imported before dist_helpers set OMP_NUM_THREADS=1
    bad_teachers = {
        "missing": os.path.join(root, "missing.pt"),
        "wrong_kind": _fake_teacher_checkpoint(
            os.path.join(root, f"distill{rank}.pt"), 5, script="distill"
        ),
        "no_keys": os.path.join(root, f"nokeys{rank}.pt"),
        "wrong_size": _fake_teacher_checkpoint(os.path.join(root, f"small{rank}.pt"), 3),
        "old_format": os.path.join(root, f"old{rank}.pt"),
    }
    torch.save({"script": "ppo", "actor": {}}, bad_teachers["no_keys"])
    torch.save(
        {"kind": "ppo", "actor": {}, "obs_dims": {"actor": 5, "critic": 5, "actions": 1}},
        bad_teachers["old_format"],
    )
    results, collectives, originals = {}, [], {}
    # every collective it calls
    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast"):
        originals[name] = original = getattr(dist, name)
        setattr(
            dist, name, lambda *a, _o=original, _n=name, **k: collectives.append(_n) or _o(*a, **k)
        )
    with process_group("cpu", seed=1) as ctx:
        for case, teacher in bad_teachers.items():
            try:
                bad = small_args(
                    distill_ddp.Args, teacher=teacher, num_envs=4, steps_per_env=4, run_dir="bad"
                )
                distill_ddp.train(bad, ctx)
                results[case] = "no error"
            except common.Failure as error:
                results[case] = str(error)
        results["collectives_before_errors"] = list(collectives)
        for name, original in originals.items():
            setattr(dist, name, original)

        for student in ("mlp", "gru"):
            sizes = {
                "num_envs": 8,
                "steps_per_env": 7,
                "gradient_length": 3,
                "iterations": 3,
                "eval_envs": 4,
            }
            run = {"run_dir": f"run_{student}", "save_interval": 2, "check_interval": 1}
            args = small_args(distill_ddp.Args, student=student, **sizes, **run)
            results[student] = distill_ddp.train(args, ctx)

        # Without the gradient all_reduce the ranks drift, and the drift check stops both.
        synced = distill_ddp.all_reduce_mean
        distill_ddp.all_reduce_mean = lambda flat, world_size: None
        try:
            unsynced = small_args(
                distill_ddp.Args, **sizes, run_dir="run_unsynced", check_interval=1
            )
            distill_ddp.train(unsynced, ctx)
            results["unsynced"] = "no error"
        except common.Failure as error:
            results["unsynced"] = str(error)
        finally:
            distill_ddp.all_reduce_mean = synced

        # same seed: the same student on both ranks
        student, buf = _student_and_rollout("mlp", steps=7)
        # only rank 1, first window: NaN then spreads
        buf.labels[0, 0] = float("nan") if ctx.rank == 1 else 0.0
        try:
            args = small_args(distill_ddp.Args, steps_per_env=7, gradient_length=3)
            distill_ddp.make_update(
                student, torch.optim.Adam(student.parameters()), buf, args, ctx
            )()
            results["nonfinite"] = "no error"
        except common.Failure as error:
            results["nonfinite"] = str(error)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_ranks")
    return root, run_ranks(_two_rank_worker, 2, str(root))


def test_two_ranks_end_bitwise_identical_and_only_rank0_writes(two_ranks):
    root, (rank0, rank1) = two_ranks
    obs = make_env("pendulum_partial", 1, "cpu", 0).get_observations()
    teacher = distill_ddp.load_teacher(distill_ddp.SHIPPED_TEACHER, obs, 1, "pendulum_partial")
    assert os.listdir(root / "rank1") == []
    for student in ("mlp", "gru"):
        (student0, teacher0), (student1, teacher1) = rank0[student], rank1[student]
        assert student0 == student1  # parameters, optimizer state and normalizer, bit for bit
        assert teacher0 == teacher1 == distill_ddp.teacher_fingerprint(teacher)
        run = root / "rank0" / f"run_{student}"
        expect_files(run, "eval.json", "latest", "metrics.jsonl", "model_2.pt", "model_3.pt")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in rows] == [1, 2, 3]
        assert all(
            r["env_steps"] == r["iteration"] * 7 * 8 * 2 and r["world_size"] == 2 for r in rows
        )
        assert all(r["behavior_loss"] > 0 and r["teacher_action_error"] > 0 for r in rows)
        evaluation = json.loads((run / "eval.json").read_text())
        assert evaluation["eval_episodes"] == 8
        # the shipped teacher swings up
        assert evaluation["teacher_return"] > evaluation["random_return"]
        checkpoint = torch.load(run / "model_3.pt", weights_only=True)
        assert checkpoint["script"] == "distill" and checkpoint["iteration"] == 3
        assert checkpoint["configs"]["student"]["rnn_hidden"] == (64 if student == "gru" else 0)
    assert rank0["mlp"][0] != rank0["gru"][0]


def test_without_gradient_all_reduce_the_drift_check_stops_both_ranks(two_ranks):
    for rank in two_ranks[1]:
        assert "disagree with rank 0 on the trained state at iteration 1" in rank["unsynced"]


def test_bad_teacher_files_stop_every_rank_at_start_up(two_ranks):
    for r in two_ranks[1]:
        # Only train's start-up agreement, which every rank reaches, one per case (main's of the
        # device is not in train). No rank is left waiting for another.
        assert r["collectives_before_errors"] == ["all_gather_object"] * 5
        assert "not found" in r["missing"] and "missing.pt" in r["missing"]
        # the command that makes one (no --teacher-obs any more: it names the privileged group to
        # pass)
        assert "ppo_ddp.py --task pendulum_partial --actor-obs" in r["missing"]
        assert "PPO policy" in r["wrong_kind"] and "'distill'" in r["wrong_kind"]
        assert (
            "PPO policy" in r["no_keys"] and "lacks" in r["no_keys"] and "configs" in r["no_keys"]
        )
        assert (
            "reads {'teacher': [3]}" in r["wrong_size"]
            and "environment has {'teacher': [5]}" in r["wrong_size"]
        )
        assert "PPO policy" in r["old_format"] and "earlier version" in r["old_format"]
        assert all(
            "\n" not in r[case]
            for case in ("missing", "wrong_kind", "no_keys", "wrong_size", "old_format")
        )


def test_nonfinite_loss_on_one_rank_stops_every_rank(two_ranks):
    rank0, rank1 = (r["nonfinite"] for r in two_ranks[1])
    assert rank0 == rank1 and rank0.startswith(
        "non-finite behavior_loss, grad_norm in the update: the environment"
    )


# --- the script as users launch it -----------------------------------------------------------


def test_resume_with_another_teacher_is_refused(tmp_path):
    small = {
        "num_envs": 4,
        "steps_per_env": 4,
        "eval_envs": 2,
        "device": "cpu",
        "run_dir": str(tmp_path / "run"),
    }
    distill_ddp.main(small_args(distill_ddp.Args, iterations=1, **small))
    other = torch.load(
        os.path.join(distill_ddp.HERE, distill_ddp.SHIPPED_TEACHER), weights_only=True
    )
    other["actor"]["log_std"] += 0.1  # another teacher of the same shape
    torch.save(other, tmp_path / "other_teacher.pt")
    with pytest.raises(common.Failure, match="is not the teacher the checkpoint"):
        resume = {"resume": str(tmp_path / "run"), "teacher": str(tmp_path / "other_teacher.pt")}
        distill_ddp.main(small_args(distill_ddp.Args, iterations=2, **resume, **small))


@pytest.mark.parametrize("kind", ["mlp", "gru"])
def test_student_update_reads_nothing_back_to_the_host_per_optimizer_step(kind):
    def reads(steps: int) -> int:
        student, buf = _student_and_rollout(kind, steps=steps)
        optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
        args = small_args(distill_ddp.Args, steps_per_env=steps, gradient_length=2)
        return count_host_reads(distill_ddp.make_update(student, optimizer, buf, args, CPU1))

    # 1 window or 4 windows (4 optimizer steps): the same reads, all of them once per update.
    assert reads(2) == reads(8) > 0
