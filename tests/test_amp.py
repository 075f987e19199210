"""ppo_amp_ddp.py: AMP's pieces at known inputs, and the discriminator kept in sync across real
ranks."""

import functools
import json
import os
import re

import numpy as np
import pytest
import torch

import common
import envs
import ppo_amp_ddp as amp
from dist_helpers import (
    ROOT,
    count_host_reads,
    cpu_dist,
    process_group,
    rollout_batch,
    run_ranks,
    script_ranks,
    small_args,
    small_ppo,
)
from envs import motions
from envs.pendulum import Pendulum

SMALL = {
    "num_envs": 16,
    "steps_per_env": 8,
    "disc_hidden": (32, 32),
    "disc_batch_size": 64,
    "replay_size": 1000,
    "run_dir": "run",
}

# --- discriminator loss and reward ------------------------------------------------------------


def test_style_reward_is_one_at_reference_score_and_zero_at_policy_score():
    scores = torch.tensor([1.0, 0.0, -1.0, 3.0, -3.0, 2.0])
    assert amp.style_reward(scores).tolist() == [1.0, 0.75, 0.0, 0.0, 0.0, 0.75]


def test_discriminator_loss_is_lsgan_and_the_gradient_penalty_of_a_linear_d():
    """A linear D(x) = w.x + b: its input gradient is w everywhere, so the penalty is |w|^2 and
    trains w by 2w; the LSGAN term is half the mean squared errors to +1 (reference) and -1
    (policy)."""
    torch.manual_seed(0)
    disc = amp.Discriminator(3, hidden=())
    w, b = disc.net[0].weight, disc.net[0].bias
    with torch.no_grad():
        w.copy_(torch.tensor([[0.5, -1.0, 0.25, 2.0, 0.0, 1.0]]))
        b.zero_()
    reference, policy = torch.randn(7, 6), torch.randn(5, 6)
    loss, stats = amp.discriminator_loss(disc, reference, policy, gp_weight=4.0)
    scale = 1 / (1 + 1e-2)  # the untrained normalizer: (x - 0) / (sqrt(1) + eps)
    ref_scores, policy_scores = (
        (reference * scale) @ w[0].detach(),
        (policy * scale) @ w[0].detach(),
    )
    lsgan = 0.5 * (((ref_scores - 1) ** 2).mean() + ((policy_scores + 1) ** 2).mean())
    assert stats["grad_penalty"].item() == pytest.approx((w**2).sum().item(), rel=1e-6)
    assert stats["disc_loss"].item() == pytest.approx(lsgan.item(), rel=1e-5)
    assert stats["disc_ref"].item() == pytest.approx(ref_scores.mean().item(), rel=1e-5, abs=1e-6)
    assert loss.item() == pytest.approx(lsgan.item() + 0.25 * 4.0 * (w**2).sum().item(), rel=1e-5)
    without_penalty, _ = amp.discriminator_loss(disc, reference, policy, gp_weight=0.0)
    (loss - without_penalty).backward()  # 0.25 * 4 * |w|^2, differentiable in w: its gradient is 2w
    assert torch.allclose(w.grad, 2 * w.detach(), atol=1e-5)


# --- policy transitions ----------------------------------------------------------------------


class CountingEnv:
    """AMP observation (episode id, step within the episode, 0); episodes end at random steps."""

    def __init__(self, num_envs=6):
        self.num_envs, self.num_actions, self.max_episode_length = num_envs, 1, 1000
        self.device = torch.device("cpu")
        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long)
        self.episode = torch.arange(num_envs) * 1000.0
        self.generator = torch.Generator().manual_seed(3)

    def get_observations(self):
        step = self.episode_length_buf.float()
        return {"policy": torch.stack([self.episode, step, torch.zeros_like(step)], -1)}

    def step(self, actions):
        self.episode_length_buf += 1
        dones = torch.rand(self.num_envs, generator=self.generator) < 0.3
        self.episode[dones] += 1
        self.episode_length_buf[dones] = 0
        return (
            self.get_observations(),
            torch.ones(self.num_envs),
            dones,
            {"time_outs": dones, "log": {}},
        )


def test_policy_transition_pairs_from_the_rollout_never_straddle_a_reset():
    args = small_args(amp.Args, num_envs=6, steps_per_env=10)
    env = CountingEnv(args.num_envs)
    shapes = {"policy": [3]}  # actor, critic and discriminator read the one group
    actor, critic = amp.Actor(shapes, 1, (8,), 1.0, False), amp.Critic(shapes, (8,), False)
    buf = amp.make_rollout(args.steps_per_env, args.num_envs, shapes, 1, torch.device("cpu"))
    episodes = envs.make_episodes(6, torch.device("cpu"))
    obs, total_resets, total_pairs = env.get_observations(), 0, 0
    policy_step = functools.partial(amp.act, actor, critic)
    for _ in range(3):
        obs, _, problem = amp.rollout(env, policy_step, obs, buf, episodes, args)
        frames = torch.cat([buf.obs["policy"], obs["policy"][None]])  # as ppo_amp_ddp.train does
        pairs = amp.transition_pairs(frames, buf.dones)
        assert torch.equal(pairs[:, 0], pairs[:, 3]), "a pair joins two episodes"
        assert torch.equal(pairs[:, 4], pairs[:, 1] + 1), "a pair skips a frame"
        total_resets += int(buf.dones.sum())
        total_pairs += pairs.shape[0]
    assert problem == "" and total_resets > 5 and total_pairs == 3 * 10 * 6 - total_resets


def test_replay_buffer_is_a_ring_that_keeps_the_newest_pairs():
    replay = amp.Replay(torch.zeros(5, 2))
    amp.replay_add(replay, torch.arange(6.0).reshape(3, 2))
    assert replay.size == 3
    amp.replay_add(replay, torch.arange(6.0, 14.0).reshape(4, 2))
    assert replay.size == 5 and replay.position == 2
    assert sorted(replay.pairs[:, 0].tolist()) == [4.0, 6.0, 8.0, 10.0, 12.0]


# --- reference motions -----------------------------------------------------------------------


def test_motion_loader_pairs_frames_within_each_clip(tmp_path):
    path = tmp_path / "motions.npz"
    clip_a, clip_b = np.arange(9, dtype=np.float32).reshape(3, 3), -np.ones((2, 3), np.float32)
    np.savez(path, dt=np.float64(0.05), clip_000=clip_a, clip_001=clip_b)
    pairs = motions.load(str(path), 3, 0.05)
    expected = [[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8], [-1, -1, -1, -1, -1, -1]]
    assert pairs.tolist() == expected  # 2 pairs from clip 0, 1 from clip 1, none across clips
    with pytest.raises(
        ValueError, match=r"has frames 0.05 s apart but the env steps 0.02 s; resample it"
    ):
        motions.load(str(path), 3, 0.02)


def test_motion_loader_errors_name_the_file_and_both_sizes(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        motions.load(str(tmp_path / "nope.npz"), 3, None)
    np.savez(tmp_path / "wide.npz", dt=np.float64(0.05), clip_000=np.zeros((4, 5), np.float32))
    with pytest.raises(
        ValueError, match=r"clip 0 has shape \(4, 5\).*2-D, \(frames, amp_dim\) with amp_dim 3"
    ):
        motions.load(str(tmp_path / "wide.npz"), 3, None)
    for name, clip in (
        ("flat", np.zeros(12, np.float32)),
        ("cube", np.zeros((4, 3, 1), np.float32)),
    ):
        np.savez(tmp_path / f"{name}.npz", dt=np.float64(0.05), clip_000=clip)
        with pytest.raises(
            ValueError, match=rf"shape {re.escape(str(clip.shape))}, but each clip must be 2-D"
        ):
            motions.load(str(tmp_path / f"{name}.npz"), 3, None)
    for dt, found in (
        (np.zeros((10, 3)), "shape (10, 3)"),
        (np.float64(-0.05), "-0.05"),
        (None, "none"),
    ):
        np.savez(
            tmp_path / "dt.npz",
            clip_000=np.zeros((4, 3), np.float32),
            **({} if dt is None else {"dt": dt}),
        )
        with pytest.raises(
            ValueError, match=rf"`dt` must be a positive number.*\(found {re.escape(found)}\)"
        ):
            motions.load(str(tmp_path / "dt.npz"), 3, None)
    np.savez(
        tmp_path / "code.npz", dt=np.float64(0.05), clip_000=np.array([object()], dtype=object)
    )
    # refused, never run
    with pytest.raises(ValueError, match="not an .npz archive of numeric arrays"):
        motions.load(str(tmp_path / "code.npz"), 3, None)
    (tmp_path / "text.npz").write_text("time,angle\n0.0,1.0\n")
    with pytest.raises(ValueError, match="text.npz' is not an .npz archive"):
        motions.load(str(tmp_path / "text.npz"), 3, None)
    np.save(tmp_path / "one.npy", np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match="one.npy' is not an .npz archive"):
        motions.load(str(tmp_path / "one.npy"), 3, None)


def test_shipped_motions_are_counter_clockwise_swingups_of_the_pendulum():
    pairs = motions.load("data/pendulum_ccw_motions.npz", 3, Pendulum.dt)  # its dt is the env's
    assert pairs.shape[0] > 1000
    s_next = pairs[:, 3:]
    near_top = s_next[:, 0] > torch.cos(torch.tensor(0.5))  # |theta| < 0.5
    arriving = near_top & (pairs[:, 0] <= torch.cos(torch.tensor(0.5)))  # entering the top region
    # always with theta_dot > 0
    assert arriving.sum() > 10 and bool((s_next[arriving, 2] > 0).all())


def _bad_motion_worker(motion_file):
    try:
        amp.main(
            small_args(
                amp.Args, **{**SMALL, "run_dir": None}, iterations=1, motion_file=motion_file
            )
        )
    except common.Failure as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("name", ["missing", "wide"])
def test_bad_motion_file_stops_every_rank_with_its_error_before_training(tmp_path, name):
    """One job per file: a process group on a reused port could meet the previous group's store."""
    np.savez(tmp_path / "wide.npz", dt=np.float64(0.05), clip_000=np.zeros((4, 5), np.float32))
    for error in run_ranks(_bad_motion_worker, 2, str(tmp_path / f"{name}.npz")):
        if name == "missing":
            # One place looked in (the path is absolute), and what to do for a user who did pass
            # --motion-file.
            assert (
                f"not found (looked for {tmp_path / 'missing.npz'}): check --motion-file" in error
            )
        else:
            assert "shape (4, 5)" in error and "amp_dim 3" in error


# --- real training in 2 processes --------------------------------------------------------------


def main_by_part(args, monkeypatch_fingerprint=True):
    """amp.main(args) -> (its fingerprint, the names of what it trained, and the fingerprint of each
    part of that state: `policy` (actor, critic and their Adam), `discriminator` (its MLP and Adam)
    and `disc_normalizer`), read from what the run fingerprints last (the state it returns)."""
    original, seen = common.fingerprint, []
    common.fingerprint = lambda trained: seen.append(trained) or original(trained)
    try:
        fingerprint = amp.main(args)
    finally:
        common.fingerprint = original
    trained = seen[-1]
    disc = trained["discriminator"]
    policy = {name: trained[name] for name in ("actor", "critic", "optimizer")}
    parts = {
        "policy": original(policy),
        "discriminator": original({"net": disc.net, "disc_optimizer": trained["disc_optimizer"]}),
        "disc_normalizer": original({"normalizer": disc.normalizer}),
    }
    return fingerprint, sorted(trained), parts


def _train_worker(root, overrides):
    rank_dir = os.path.join(root, f"rank{os.environ['RANK']}")
    os.makedirs(rank_dir, exist_ok=True)
    os.chdir(rank_dir)  # same relative --run-dir on every rank, a different place on disk
    return main_by_part(
        small_args(amp.Args, **{**SMALL, "iterations": 3, "save_interval": 2, **overrides})
    )


def test_discriminator_state_is_bitwise_identical_on_every_rank(tmp_path):
    ranks = run_ranks(_train_worker, 2, str(tmp_path), {})
    assert ranks[0][1] == ["actor", "critic", "disc_optimizer", "discriminator", "optimizer"]
    assert ranks[0] == ranks[1]  # the whole state's fingerprint and each part's
    rows = [
        json.loads(line)
        for line in (tmp_path / "rank0" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for key in (
        "disc_loss",
        "grad_penalty",
        "disc_ref",
        "disc_policy",
        "style_reward",
        "task_reward",
    ):
        assert all(np.isfinite(r[key]) for r in rows), key
    assert "swingup_ccw_fraction" in rows[-1] and rows[-1]["env_steps"] == 3 * 8 * 16 * 2
    assert os.listdir(tmp_path / "rank1") == []  # only rank 0 writes


def _small_amp(args) -> tuple:
    """Small actor, critic and discriminator, their optimizers, a rollout of 6 x 16 random steps, a
    replay of 30 random pairs and 40 reference pairs: inputs for update tests."""
    actor, critic, optimizer, buf = small_ppo(6, 16)
    disc = amp.Discriminator(3, (8,))
    replay = amp.Replay(torch.zeros(50, 6))
    amp.replay_add(replay, torch.randn(30, 6))
    buf.advantages.normal_()
    buf.returns.normal_()
    optimizers = (optimizer, torch.optim.Adam(disc.parameters()))
    return actor, critic, disc, optimizers, rollout_batch(buf), torch.randn(40, 6), replay


def _update_collectives_worker():
    from dist_helpers import counting_collectives

    with process_group("cpu", seed=0) as ctx:
        args = small_args(amp.Args, **{**SMALL, "epochs": 2, "mini_batches": 3, "steps_per_env": 6})
        torch.manual_seed(0)  # the same networks on both ranks; the data below differs by rank
        actor, critic, disc, optimizers, *_ = _small_amp(args)
        optimizer, disc_optimizer = optimizers
        torch.manual_seed(1 + ctx.rank)
        *_, batch, reference, replay = _small_amp(args)
        update = amp.make_update(
            actor, critic, disc, optimizers, batch, reference, replay, args, ctx
        )
        with counting_collectives() as calls:
            update()
        trained = {
            "actor": actor,
            "critic": critic,
            "disc": disc,
            "opt": optimizer,
            "disc_opt": disc_optimizer,
        }
        return calls["n"], common.fingerprint(trained)


def test_amp_update_takes_one_collective_per_mini_batch():
    (calls0, state0), (calls1, state1) = run_ranks(_update_collectives_worker, 2)
    assert calls0 == calls1 == 2 * 3  # epochs x mini-batches, and nothing else
    assert state0 == state1  # different data on each rank, the same trained bits after the update


def _unsynced_discriminator_worker(root):
    """rsl_rl's PPOAMP: actor and critic synchronized, the discriminator neither broadcast nor in
    the all_reduce (its gradients sit between the critic's and the statistics in the flat buffer).
    """
    env = envs.make_env("pendulum", 2, torch.device("cpu"), 0)
    networks = amp.make_networks(env.get_observations(), env.num_actions, small_args(amp.Args))
    policy = sum(p.numel() for net in networks for p in net.parameters())
    disc = sum(p.numel() for p in amp.Discriminator(3, SMALL["disc_hidden"]).parameters())
    all_reduce_mean, broadcast = amp.all_reduce_mean, common.broadcast_state

    def without_disc(flat, world_size):
        kept = torch.cat([flat[:policy], flat[policy + disc :]])
        all_reduce_mean(kept, world_size)
        flat[:policy], flat[policy + disc :] = kept[:policy], kept[policy:]

    amp.all_reduce_mean = without_disc
    common.broadcast_state = lambda modules, world_size: broadcast(
        [m for m in modules if not isinstance(m, amp.Discriminator)], world_size
    )
    return _train_worker(root, {})


def test_control_discriminator_left_out_of_the_sync_differs_across_ranks(tmp_path):
    parts = [rank[2] for rank in run_ranks(_unsynced_discriminator_worker, 2, str(tmp_path))]
    assert parts[0]["discriminator"] != parts[1]["discriminator"]
    # The policy stays in sync even then: only the reward function each rank trains differs.
    assert parts[0]["policy"] == parts[1]["policy"]


def test_resume_restores_the_discriminator_and_its_optimizer(tmp_path):
    first = run_ranks(_train_worker, 2, str(tmp_path), {"iterations": 2})
    # Resuming a finished run trains nothing and returns the state it loaded.
    run = str(tmp_path / "rank0" / "run")  # every rank reads the file that rank 0 wrote
    resumed = run_ranks(
        _train_worker, 2, str(tmp_path), {"iterations": 2, "resume": run, "run_dir": run}
    )
    assert resumed[0] == resumed[1] == first[0]
    checkpoint = torch.load(tmp_path / "rank0" / "run" / "model_2.pt", weights_only=True)
    assert checkpoint["script"] == "ppo_amp" and checkpoint["iteration"] == 2
    assert (
        checkpoint["configs"]["discriminator"]["amp_dim"] == 3
        and len(checkpoint["disc_optimizer"]["state"]) > 0
    )


def test_amp_update_reads_nothing_back_to_the_host_per_mini_batch():
    def reads(epochs: int, mini_batches: int) -> int:
        torch.manual_seed(0)
        args = small_args(
            amp.Args,
            **{**SMALL, "epochs": epochs, "mini_batches": mini_batches, "steps_per_env": 6},
        )
        parts = _small_amp(args)
        return count_host_reads(amp.make_update(*parts, args, cpu_dist()))

    assert reads(1, 1) == reads(2, 3) > 0  # none of them per mini-batch


def test_motion_recorder_takes_arguments_and_reproduces_the_shipped_file(tmp_path):
    """`--help` prints the options and writes nothing; `--out` records the shipped motions again."""
    script, shipped = (
        os.path.join(ROOT, "data", "make_amp_motions.py"),
        os.path.join(ROOT, amp.Args.motion_file),
    )
    before = os.stat(shipped).st_mtime_ns
    codes, shown = script_ranks(script, "--help", cwd=tmp_path, nproc=1)
    assert codes == [0] and "--out" in shown and os.stat(shipped).st_mtime_ns == before
    assert script_ranks(script, "--out", str(tmp_path / "m.npz"), cwd=tmp_path, nproc=1)[0] == [0]
    with np.load(tmp_path / "m.npz") as new, np.load(shipped) as old:
        assert sorted(new.files) == sorted(old.files)
        assert all(np.array_equal(new[k], old[k]) for k in old.files)
