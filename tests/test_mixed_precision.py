"""`--mixed-precision bf16` (rsl_rl 5.5's use_mixed_precision): the update's forward passes and
losses in bfloat16, the rollout in float32, every rank the same bits. Its equality with rsl_rl
5.5.1's own bf16 update is in test_rsl_rl.py."""

import os

import torch

import arguments
import distill_ddp
import ppo_ddp
import ppo_rnn_ddp
from dist_helpers import chdir_rank_dir, free_port, run_ranks, small_args


def test_the_rollout_runs_in_float32_and_the_update_in_bfloat16(tmp_path, monkeypatch):
    """Every Gaussian log-probability the run takes, with the autocast state and the dtype of the
    mean it came from: the rollout's (`act`, steps x iterations of them) in float32 with autocast
    off, the update's (`ppo_loss`, epochs x mini-batches x iterations) from bfloat16 means."""
    seen, log_prob = [], ppo_ddp.gaussian_log_prob

    def recorded(actions: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        seen.append((torch.is_autocast_enabled("cpu"), mean.dtype))
        return log_prob(actions, mean, std)

    monkeypatch.setattr(ppo_ddp, "gaussian_log_prob", recorded)
    args = small_args(
        ppo_ddp.Args,
        num_envs=8,
        steps_per_env=6,
        iterations=2,
        epochs=2,
        mini_batches=3,
        logger="none",
    )
    ppo_ddp.main(
        arguments.with_values(args, {"mixed_precision": "bf16", "run_dir": str(tmp_path / "run")})
    )
    assert seen.count((False, torch.float32)) == 6 * 2
    assert seen.count((True, torch.bfloat16)) == 2 * 3 * 2
    assert len(seen) == 6 * 2 + 2 * 3 * 2


def _bf16_worker(root: str, ports: list[int]) -> dict[str, str]:
    """Two iterations of PPO, recurrent PPO and distillation (MLP and GRU students), each with
    --mixed-precision bf16, and PPO in float32 -> the trained state's hash of each. Each run's group
    on a port of its own (a second group on the first one's port can meet its store going down)."""
    chdir_rank_dir(root)
    small = {"num_envs": 8, "steps_per_env": 8, "iterations": 2, "logger": "none"}
    runs = {
        "ppo": lambda: ppo_ddp.main(
            small_args(ppo_ddp.Args, **small, mixed_precision="bf16", run_dir="ppo")
        ),
        "ppo_float32": lambda: ppo_ddp.main(
            small_args(ppo_ddp.Args, **small, run_dir="ppo_float32")
        ),
        "gru": lambda: ppo_rnn_ddp.main(
            small_args(ppo_rnn_ddp.Args, **small, mixed_precision="bf16", run_dir="gru")
        ),
        "distill": lambda: distill_ddp.main(
            small_args(distill_ddp.Args, **small, mixed_precision="bf16", run_dir="d")
        )[0],
        "distill_gru": lambda: distill_ddp.main(
            small_args(
                distill_ddp.Args, **small, mixed_precision="bf16", student="gru", run_dir="d_gru"
            )
        )[0],
    }
    hashes = {}
    for (name, run), port in zip(runs.items(), ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        hashes[name] = run()
    return hashes


def test_bf16_leaves_two_ranks_bitwise_identical(tmp_path):
    ranks = run_ranks(_bf16_worker, 2, str(tmp_path), [free_port() for _ in range(5)], timeout=300)
    assert ranks[0] == ranks[1]
    assert ranks[0]["ppo"] != ranks[0]["ppo_float32"]  # bfloat16 changed the update
