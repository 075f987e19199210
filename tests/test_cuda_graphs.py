"""`--cuda-graphs` without a GPU: the one-line note and the same run; the steps a graph replays, free
of host syncs with RND and the discriminator on; a whole iteration's few host reads; and training
through `common.cuda_graph` with its capture replaced by a trace that, like a CUDA graph, runs Python
once and replays the recorded ops. (The real capture needs a GPU: `python benchmarks/gpu.py` there.)"""

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import common
import distill_ddp
import ppo_amp_ddp as amp
import ppo_ddp as ppo
from dist_helpers import chdir_rank_dir, count_host_reads, run_ranks, small_ppo, torchrun
from extensions import rnd as rnd_ext
from extensions import symmetry

CPU1 = common.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
SMALL = ("--num-envs", "16", "--steps-per-env", "8", "--iterations", "3")


SYMMETRY = {"symmetry": "envs.mirrors:pendulum", "symmetry_augment": True, "symmetry_mirror_loss": 0.5}


def pendulum_mirror(args: ppo.Args, buf: ppo.Rollout) -> symmetry.Mirror:
    """The pendulum's mirror function for an update of `buf`, whose networks read 3-wide inputs."""
    return symmetry.load_mirror(
        args, None, {"policy": buf.obs["actor"][0]}, {"actor": ("policy",), "critic": ("policy",)}, 1
    )


def fill_randomly(buf: ppo.Rollout) -> None:
    """Standard-normal data in every field of `buf` the update reads, stds 1."""
    for tensor in (*buf.obs.values(), buf.actions, buf.means, buf.values, buf.advantages, buf.returns):
        tensor.normal_()
    buf.stds.fill_(1.0)


def _update_with_every_side_loss(epochs: int, mini_batches: int) -> int:
    """Host reads our code makes in one PPO update with RND's predictor, the discriminator and symmetry
    (augmentation and mirror loss) beside it."""
    torch.manual_seed(0)
    args = amp.Args(epochs=epochs, mini_batches=mini_batches, disc_batch_size=8, **SYMMETRY)
    actor, critic, optimizer, _ = small_ppo(4, 6)
    buf = ppo.make_rollout(4, 6, {"actor": 3, "critic": 3, "rnd": 3}, 1, torch.device("cpu"))
    fill_randomly(buf)
    rnd = rnd_ext.RND(3, (8,), 4, normalize_states=True, normalize_rewards=False)
    disc = amp.Discriminator(3, (8,))
    replay = amp.ReplayBuffer(torch.zeros(50, 6))
    amp.replay_add(replay, torch.randn(30, 6))
    sides = (
        amp.discriminator_side_loss(disc, torch.optim.Adam(disc.parameters()), torch.randn(40, 6), replay, args),
        rnd_ext.rnd_side_loss(rnd, torch.optim.Adam(rnd.predictor.parameters())),
        symmetry.symmetry_side_loss(pendulum_mirror(args, buf), actor, args),
    )
    update = ppo.make_update(actor, critic, optimizer, buf, args, CPU1, sides)
    return count_host_reads(update)


def test_update_steps_with_every_side_loss_never_wait_for_the_host():
    # As many host reads for 1 mini-batch as for 6: the step a CUDA graph replays makes none (the
    # mirror function included), and neither do the discriminator's draws between steps. Those left are the per-update results.
    once = _update_with_every_side_loss(1, 1)
    assert _update_with_every_side_loss(2, 3) == once
    assert once > 0  # the counter sees the per-update reads, so it would see per-step ones


def _metrics(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        for timing in ("fps", "collect_s", "update_s", "time_s"):
            row.pop(timing, None)
    return rows


def test_cuda_graphs_without_cuda_say_so_once_and_train_the_same(tmp_path):
    eager = torchrun("ppo_ddp.py", *SMALL, "--run-dir", "eager", cwd=tmp_path)
    graphs = torchrun("ppo_ddp.py", *SMALL, "--cuda-graphs", "--run-dir", "graphs", cwd=tmp_path)
    assert eager.returncode == 0 and graphs.returncode == 0, graphs.stderr
    note = "note: --cuda-graphs needs a CUDA device (this run is on cpu): running eagerly."
    assert graphs.stdout.count(note) == 1 and note not in eager.stdout
    assert _metrics(tmp_path / "graphs" / "metrics.jsonl") == _metrics(tmp_path / "eager" / "metrics.jsonl")


# --- common.cuda_graph's capture, replaced by its CPU analogue ------------------------------------


def traced_capture(fn, inputs):
    """`common.capture` on the CPU: `make_fx` with fake tensors records the aten ops of `fn(*inputs)`
    without running them, Python running once, as a CUDA graph capture records kernels; each replay
    runs the recorded ops on the real tensors (parameters, optimizer state, accumulators, inputs) and
    leaves the results in the returned output tensors. A Python value `fn` reads is frozen at the
    trace, and a host read anywhere in `fn` (torch's optimizer included) fails the trace."""
    graph = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
    (returned,) = [node.args[0] for node in graph.graph.nodes if node.op == "output"]  # None, a node or a tuple
    nodes = [] if returned is None else list(returned) if isinstance(returned, (tuple, list)) else [returned]
    tensors = [torch.empty(node.meta["val"].shape, dtype=node.meta["val"].dtype) for node in nodes]
    outputs = None if returned is None else tuple(tensors) if isinstance(returned, (tuple, list)) else tensors[0]

    def replay() -> None:
        results = graph(*inputs)
        results = [] if results is None else results if isinstance(results, (tuple, list)) else [results]
        for captured, new in zip(tensors, results):
            captured.set_(new)  # the same tensor object now holds this replay's values

    return replay, outputs


class Counted:
    """Counts captures and replays."""

    def __init__(self) -> None:
        self.captures, self.replays, self.eager = 0, 0, 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def capture(fn, inputs):
            self.captures += 1
            replay, outputs = traced_capture(fn, inputs)

            def counted_replay() -> None:
                self.replays += 1
                replay()

            return counted_replay, outputs

        def on_side_stream(fn, args, side):
            self.eager += 1
            return fn(*args)

        monkeypatch.setattr(common, "capture", capture)
        monkeypatch.setattr(common, "on_side_stream", on_side_stream)
        monkeypatch.setattr(torch.cuda, "Stream", lambda: None)


def cuda_like_adam(params, lr, device, capturable=False):
    """common.make_adam as on CUDA: fused, with a float32 learning-rate tensor (traceable on CPU)."""
    return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), fused=True)


def test_cuda_graph_warms_up_captures_once_then_replays_on_copies_of_the_arguments(monkeypatch):
    counted = Counted()
    counted.install(monkeypatch)
    seen = []

    def double(x: torch.Tensor) -> tuple[torch.Tensor]:
        seen.append(x)
        return (2 * x,)

    graphed = common.cuda_graph(double, on=True, warmup=2)
    results, values = [], []
    for i in range(5):
        results.append(graphed(torch.full((3,), float(i)))[0])
        values.append(results[-1][0].item())
    assert values == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert (counted.eager, counted.captures, counted.replays) == (2, 1, 3)
    assert len(seen) == 3  # Python ran twice eagerly and once for the capture, never for a replay
    assert results[2] is results[3] is results[4]  # the captured output, overwritten by each replay
    assert common.cuda_graph(double, on=False) is double


def _train_worker(root: str, graphs: bool) -> tuple[str, int]:
    chdir_rank_dir(root)
    counted = Counted()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(common, "make_adam", cuda_like_adam)
        if graphs:
            counted.install(monkeypatch)
            monkeypatch.setattr(common, "use_cuda_graphs", lambda wanted, ctx: wanted)
        args = ppo.Args(num_envs=8, steps_per_env=8, iterations=3, run_dir="run", cuda_graphs=graphs, device="cpu")
        return ppo.main(args), counted.replays


def test_ppo_trains_the_same_with_its_steps_captured_once_and_replayed(tmp_path):
    # 3 iterations in which every policy step and mini-batch step after the 3 warm-up calls of each
    # is a replay of one trace: the trained state is the eager run's, bit for bit. (On a GPU, float
    # rounding may differ between a graph and eager kernels; here both run the same CPU ops.)
    ((eager, _),) = run_ranks(_train_worker, 1, str(tmp_path / "eager"), False)
    ((graphed, replays),) = run_ranks(_train_worker, 1, str(tmp_path / "graphs"), True)
    assert replays == (3 * 8 - 3) + (3 * 5 * 4 - 3)
    assert graphed == eager


def _distill_worker(root: str, graphs: bool) -> tuple[tuple[str, str], int]:
    chdir_rank_dir(root)
    counted, adam = Counted(), torch.optim.Adam
    with pytest.MonkeyPatch.context() as monkeypatch:
        # Adam fused, as it can step in a trace on the CPU, the same in both runs.
        monkeypatch.setattr(torch.optim, "Adam", lambda params, lr, capturable=False: adam(params, lr=lr, fused=True))
        if graphs:
            counted.install(monkeypatch)
            monkeypatch.setattr(common, "use_cuda_graphs", lambda wanted, ctx: wanted)
        args = distill_ddp.Args(
            num_envs=8, steps_per_env=8, iterations=5, student="gru", gradient_length=3, eval_envs=2, run_dir="run",
            cuda_graphs=graphs, device="cpu",
        )  # fmt: skip
        return distill_ddp.main(args), counted.replays


def test_distillation_trains_the_same_with_its_steps_captured_once_and_replayed(tmp_path):
    # A GRU student, windows of 3, 3 and 2 steps: one graph per window length, memory carried from
    # window to window through the graphs' outputs and inputs. 5 iterations: the inference step
    # replays 40 - 3 times, the 3-step window 10 - 3 times, the 2-step window 5 - 3 times.
    ((eager, _),) = run_ranks(_distill_worker, 1, str(tmp_path / "eager"), False)
    ((graphed, replays),) = run_ranks(_distill_worker, 1, str(tmp_path / "graphs"), True)
    assert replays == 37 + 7 + 2
    assert graphed == eager


def _updates_with_every_side_loss(graphs: bool, monkeypatch: pytest.MonkeyPatch) -> str:
    """Three updates with RND's predictor, the discriminator and symmetry beside PPO, the replay buffer
    growing between them (a Python size a capture would freeze) -> fingerprint of everything trained."""
    counted = Counted()
    if graphs:
        counted.install(monkeypatch)
    torch.manual_seed(0)
    args = amp.Args(epochs=2, mini_batches=2, disc_batch_size=8, **SYMMETRY)
    actor, critic, _, _ = small_ppo(4, 6)
    buf = ppo.make_rollout(4, 6, {"actor": 3, "critic": 3, "rnd": 3}, 1, torch.device("cpu"))
    optimizer = cuda_like_adam([*actor.parameters(), *critic.parameters()], 1e-3, torch.device("cpu"))
    rnd, disc = rnd_ext.RND(3, (8,), 4, normalize_states=True, normalize_rewards=False), amp.Discriminator(3, (8,))
    optimizers = [optimizer, *(torch.optim.Adam(m.parameters(), fused=True) for m in (disc, rnd.predictor))]
    replay = amp.ReplayBuffer(torch.zeros(50, 6))
    sides = (
        amp.discriminator_side_loss(disc, optimizers[1], torch.randn(40, 6), replay, args),
        rnd_ext.rnd_side_loss(rnd, optimizers[2]),
        symmetry.symmetry_side_loss(pendulum_mirror(args, buf), actor, args),
    )
    update = ppo.make_update(actor, critic, optimizer, buf, args, CPU1, sides, graphs=graphs)
    for _ in range(3):
        fill_randomly(buf)
        amp.replay_add(replay, torch.randn(12, 6))
        update()
    assert counted.replays == (3 * 2 * 2 - 3 if graphs else 0)
    return common.state_fingerprint(common.trained_tensors([actor, critic, disc, rnd], optimizers))


def test_updates_with_every_side_loss_are_the_same_captured_once_and_replayed(monkeypatch):
    # The discriminator draws its rows before each step, from the replay's size at that moment: a
    # capture that read the size inside the step would keep sampling the first 12 pairs.
    eager = _updates_with_every_side_loss(False, monkeypatch)
    assert _updates_with_every_side_loss(True, monkeypatch) == eager


def test_resuming_keeps_how_this_run_steps_its_optimizer():
    # A checkpoint saved by a fused Adam (CUDA; --cuda-graphs adds capturable) resumed by a run that
    # steps differently, here the plain CPU Adam: the state is restored, the run's own kernel stays.
    def build(**kwargs: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2)
        return net, torch.optim.Adam(net.parameters(), lr=1e-3, **kwargs)

    net, fused = build(fused=True)
    net(torch.randn(4, 3)).sum().backward()
    fused.step()
    saved = {"net": net.state_dict(), "optimizer": fused.state_dict(), "parts": ["net", "optimizer"]}
    saved["fingerprint"] = common.state_fingerprint(common.trained_tensors([net], [fused]))
    net2, plain = build()
    common.restore_checkpoint(saved, "model_1.pt", {"net": net2}, {"optimizer": plain})
    assert not plain.param_groups[0]["fused"] and fused.param_groups[0]["fused"]
    assert common.state_fingerprint(common.trained_tensors([net2], [plain])) == saved["fingerprint"]
    net2(torch.randn(4, 3)).sum().backward()
    plain.step()  # steps with the restored moments


def _host_reads_per_run_worker(root: str, iterations: int, steps: int, mini_batches: int) -> int:
    chdir_rank_dir(root)
    args = ppo.Args(
        num_envs=8, steps_per_env=steps, mini_batches=mini_batches, iterations=iterations, run_dir=f"run{iterations}",
        device="cpu", logger="none", rnd_weight=1.0,
    )  # fmt: skip
    return count_host_reads(lambda: ppo.main(args))


def test_an_iteration_waits_for_the_host_a_fixed_few_times_whatever_its_length(tmp_path):
    # One more iteration costs the same host reads for 8 steps x 2 mini-batches as for 16 x 4 (RND
    # on): none of them is per env step or per mini-batch. They are the once-per-iteration checks and
    # statistics: non-finite inputs, the update's statistics and outcome (one read), RND's normalizer
    # limit, the learning rate, the logged line.
    def per_iteration(steps: int, mini_batches: int) -> int:
        root = str(tmp_path / f"{steps}x{mini_batches}")
        (one,) = run_ranks(_host_reads_per_run_worker, 1, root, 1, steps, mini_batches)
        (two,) = run_ranks(_host_reads_per_run_worker, 1, root, 2, steps, mini_batches)
        return two - one

    assert per_iteration(8, 2) == per_iteration(16, 4) == 5
