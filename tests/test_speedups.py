"""Speed-ups (speedups.py) that wrap the eager steps: `--cuda-graphs` without a GPU says so once and
trains the same bits; `--cuda-graphs` on CUDA asks torch.compile for torch's own CUDA graphs; under
`--compile` the collective stays eager between compiled halves; the steps make no host read per
mini-batch, an iteration a fixed few; a resume keeps how this run steps its optimizer. (The GPU
itself: docs/gpu.md.)"""

import json

import pytest
import torch

import checkpoints
import common
import ppo_amp_ddp as amp
import ppo_ddp as ppo
import speedups
from dist_helpers import (
    chdir_rank_dir,
    count_host_reads,
    counting_collectives,
    cpu_dist,
    process_group,
    rollout_batch,
    run_ranks,
    script_ranks,
    small_args,
    small_ppo,
)
from extensions import rnd as rnd_ext
from extensions import symmetry

SMALL = ("--num-envs", "16", "--steps-per-env", "8", "--iterations", "3")
SYMMETRY = {
    "symmetry": "envs.mirrors:pendulum",
    "symmetry_augment": True,
    "symmetry_mirror_loss": 0.5,
}


def _metrics(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        for timing in ("fps", "collect_s", "update_s", "time_s"):
            row.pop(timing, None)
    return rows


def test_cuda_graphs_without_cuda_say_so_once_and_train_the_same(tmp_path):
    eager_codes, eager = script_ranks("ppo_ddp.py", *SMALL, "--run-dir", "eager", cwd=tmp_path)
    codes, graphs = script_ranks(
        "ppo_ddp.py", *SMALL, "--cuda-graphs", "--run-dir", "graphs", cwd=tmp_path
    )
    assert eager_codes == codes == [0, 0], graphs
    note = "note: --cuda-graphs needs a CUDA device (this run is on cpu): not used."
    assert graphs.count(note) == 1 and note not in eager
    assert _metrics(tmp_path / "graphs" / "metrics.jsonl") == _metrics(
        tmp_path / "eager" / "metrics.jsonl"
    )


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"cuda_graphs": True}, {"backend": "cudagraphs", "mode": None}),
        (
            {"cuda_graphs": True, "compile": "inductor"},
            {"backend": "inductor", "mode": "reduce-overhead"},
        ),
        ({"cuda_graphs": True, "compile": "aot_eager"}, {"backend": "cudagraphs", "mode": None}),
        ({"compile": "aot_eager"}, {"backend": "aot_eager", "mode": None}),
    ],
)
def test_cuda_graphs_on_a_cuda_device_are_torch_compiles_own(monkeypatch, flags, expected):
    """On a CUDA device `--cuda-graphs` is torch.compile's CUDA graphs (cudagraph trees): inductor's
    `reduce-overhead` mode, else the `cudagraphs` backend; on the CPU it changes nothing."""
    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: asked.append(kwargs) or fn)
    monkeypatch.setattr(speedups, "same_kernels_on_every_x86", lambda: None)
    speed = speedups.SpeedArgs(**flags)
    step = speedups.compiled(lambda x: x + 1, speed, torch.device("cuda", 0))
    assert asked == [expected] and step(torch.ones(1)).item() == 2.0
    assert speedups.asked(speed, torch.device("cuda", 0))
    cuda_graphs_alone = speedups.SpeedArgs(cuda_graphs=True)
    assert not speedups.asked(cuda_graphs_alone, torch.device("cpu")) and len(asked) == 1


def _compiled_update_worker() -> tuple[int, int, str]:
    """One PPO update (2 epochs x 3 mini-batches) compiled by aot_eager on this rank's own data ->
    (torch.distributed.all_reduce calls made in it, mini-batches, the trained state's hash)."""
    with process_group("cpu", seed=0) as ctx:
        torch.manual_seed(0)
        actor, critic, optimizer, _ = small_ppo(4, 6)
        torch.manual_seed(1 + ctx.rank)
        buf = small_ppo(4, 6)[3]
        buf.advantages.normal_()
        buf.returns.normal_()
        args = small_args(ppo.Args, epochs=2, mini_batches=3, compile="aot_eager")
        update = ppo.make_update(actor, critic, optimizer, rollout_batch(buf), args, ctx)
        with counting_collectives() as calls:
            update()
        return (
            calls["n"],
            2 * 3,
            common.fingerprint({"actor": actor, "critic": critic, "opt": optimizer}),
        )


def test_under_compile_the_all_reduce_stays_an_eager_call_between_compiled_halves():
    """Each compiled mini-batch step calls torch.distributed's all_reduce itself, once (not a
    collective traced into a graph, which a CUDA graph would then capture), and the ranks end
    identical."""
    (calls0, steps, state0), (calls1, _, state1) = run_ranks(_compiled_update_worker, 2)
    assert calls0 == calls1 == steps and state0 == state1


def _update_with_every_extension(epochs: int, mini_batches: int) -> int:
    """Host reads our code makes in one PPO update with RND's predictor and symmetry (augmentation
    and mirror loss) beside it."""
    torch.manual_seed(0)
    args = small_args(ppo.Args, epochs=epochs, mini_batches=mini_batches, **SYMMETRY)
    actor, critic, optimizer, buf = small_ppo(4, 6)
    buf.advantages.normal_()
    buf.returns.normal_()
    buf.obs["rnd_state"] = torch.randn(4, 6, 3)
    rnd = rnd_ext.RND({"rnd_state": [3]}, (8,), 4, normalize_states=True, normalize_rewards=False)
    mirror = symmetry.load_mirror(
        args.mirror, None, {"policy": buf.obs["policy"][0]}, actor, critic, 1
    )
    rnd_optimizer = torch.optim.Adam(rnd.predictor.parameters())
    update = ppo.make_update(
        actor, critic, optimizer, rollout_batch(buf), args, cpu_dist(), rnd, rnd_optimizer, mirror
    )
    return count_host_reads(update)


def _amp_update(epochs: int, mini_batches: int) -> int:
    """Host reads our code makes in one AMP update, the discriminator's draws between the steps
    included."""
    torch.manual_seed(0)
    args = small_args(amp.Args, epochs=epochs, mini_batches=mini_batches, disc_batch_size=8)
    actor, critic, optimizer, buf = small_ppo(4, 6)
    disc = amp.Discriminator(3, (8,))
    replay = amp.Replay(torch.zeros(50, 6))
    amp.replay_add(replay, torch.randn(30, 6))
    optimizers = (optimizer, torch.optim.Adam(disc.parameters()))
    parts = (actor, critic, disc, optimizers, rollout_batch(buf), torch.randn(40, 6), replay)
    return count_host_reads(amp.make_update(*parts, args, cpu_dist()))


@pytest.mark.parametrize("update", [_update_with_every_extension, _amp_update])
def test_update_steps_never_wait_for_the_host(update):
    # As many host reads for 1 mini-batch as for 6: no step waits for the host (the mirror function
    # included), and neither do the discriminator's draws between steps. Those left are per update.
    once = update(1, 1)
    assert update(2, 3) == once and once > 0  # the counter sees the per-update reads


def test_resuming_keeps_how_this_run_steps_its_optimizer():
    # A checkpoint saved by a fused Adam (CUDA's, and the CPU's under --compile) resumed by a run
    # that steps differently, here the plain CPU Adam: the state is restored, the run's own kernel
    # stays.
    def build(**kwargs: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2)
        return net, torch.optim.Adam(net.parameters(), lr=1e-3, **kwargs)

    net, fused = build(fused=True)
    net(torch.randn(4, 3)).sum().backward()
    fused.step()
    saved = {
        "net": net.state_dict(),
        "optimizer": fused.state_dict(),
        "parts": ["net", "optimizer"],
        "configs": {},
    }
    saved["fingerprint"] = common.fingerprint({"net": net, "optimizer": fused})
    net2, plain = build()
    checkpoints.restore(
        checkpoints.ResumeFrom("model_1.pt", saved), {"net": net2, "optimizer": plain}
    )
    assert not plain.param_groups[0]["fused"] and fused.param_groups[0]["fused"]
    assert common.fingerprint({"net": net2, "optimizer": plain}) == saved["fingerprint"]
    net2(torch.randn(4, 3)).sum().backward()
    plain.step()  # steps with the restored moments


def _host_reads_per_run_worker(root: str, iterations: int, steps: int, mini_batches: int) -> int:
    chdir_rank_dir(root)
    sizes = {
        "num_envs": 8,
        "steps_per_env": steps,
        "mini_batches": mini_batches,
        "iterations": iterations,
    }
    run = {"run_dir": f"run{iterations}", "device": "cpu", "logger": "none"}
    args = small_args(ppo.Args, **sizes, **run, rnd_weight=1.0)
    return count_host_reads(lambda: ppo.main(args))


def test_an_iteration_waits_for_the_host_a_fixed_few_times_whatever_its_length(tmp_path):
    # One more iteration costs the same host reads for 8 steps x 2 mini-batches as for 16 x 4 (RND
    # on): none of them is per env step or per mini-batch. They are the once-per-iteration checks
    # and statistics: the rollout's check, the update's statistics (one read), RND's normalizer
    # limit, the learning rate, the logged line (the explained variance rides in it).
    def per_iteration(steps: int, mini_batches: int) -> int:
        root = str(tmp_path / f"{steps}x{mini_batches}")
        (one,) = run_ranks(_host_reads_per_run_worker, 1, root, 1, steps, mini_batches)
        (two,) = run_ranks(_host_reads_per_run_worker, 1, root, 2, steps, mini_batches)
        return two - one

    assert per_iteration(8, 2) == per_iteration(16, 4) == 5
