"""`--cuda-graphs` without a GPU: the one-line note and the same run; the steps a graph would replay,
free of host syncs with RND and the discriminator on; and `common.cuda_graph`'s warm-up, capture and
replay plumbing, run against a stand-in for torch.cuda's graph API. (The real capture needs a GPU:
`python benchmarks/gpu.py --extra --cuda-graphs` there.)"""

import contextlib
import json

import pytest
import torch

import common
import ppo_amp_ddp as amp
import ppo_ddp as ppo
from dist_helpers import chdir_rank_dir, count_host_reads, run_ranks, small_ppo, torchrun

CPU1 = common.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
SMALL = ("--num-envs", "16", "--steps-per-env", "8", "--iterations", "3")


def _update_with_every_side_loss(epochs: int, mini_batches: int) -> int:
    """Host reads our code makes in one PPO update with RND's predictor and the discriminator beside it."""
    torch.manual_seed(0)
    args = amp.Args(epochs=epochs, mini_batches=mini_batches, disc_batch_size=8)
    actor, critic, optimizer, buf = small_ppo(4, 6)
    buf = ppo.make_rollout(4, 6, {"actor": 3, "critic": 3, "rnd": 3}, 1, torch.device("cpu"))
    for tensor in (*buf.obs.values(), buf.actions, buf.means, buf.values, buf.advantages, buf.returns):
        tensor.normal_()
    buf.stds.fill_(1.0)
    rnd = ppo.RND(3, (8,), 4, normalize_states=True, normalize_rewards=False)
    disc = amp.Discriminator(3, (8,))
    replay = amp.ReplayBuffer(torch.zeros(50, 6))
    amp.replay_add(replay, torch.randn(30, 6))
    sides = (
        amp.discriminator_side_loss(disc, torch.optim.Adam(disc.parameters()), torch.randn(40, 6), replay, args),
        ppo.rnd_side_loss(rnd, torch.optim.Adam(rnd.predictor.parameters())),
    )
    update = ppo.make_update(actor, critic, optimizer, buf, args, CPU1, sides)
    return count_host_reads(update)


def test_update_steps_with_rnd_and_discriminator_never_wait_for_the_host():
    # As many host reads for 1 mini-batch as for 6: the step a CUDA graph replays makes none, and
    # neither do the discriminator's draws between steps. Those left are the per-update results.
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


# --- common.cuda_graph against a stand-in for torch.cuda -------------------------------------------


class FakeCUDA:
    """torch.cuda's stream and graph calls that `common.cuda_graph` makes, on the CPU. Capturing runs the
    function once (its work is the capturing call's; a real capture only records it and the replay
    that follows does the work), and each later replay runs it again on the captured inputs, writing
    into the captured outputs: the data flow of a CUDA graph, though Python runs at every replay."""

    def __init__(self) -> None:
        self.eager_calls, self.captures, self.replays = 0, 0, 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self

        class Graph:
            def __init__(self) -> None:
                self.run, self.fresh = None, False

            def replay(self) -> None:
                fake.replays += 1
                if self.fresh:  # the capturing call already did this call's work
                    self.fresh = False
                    return
                self.run()

        @contextlib.contextmanager
        def graph(g: Graph):
            import inspect

            caller = inspect.currentframe().f_back.f_back  # common.cuda_graph's `call`
            yield
            fn, inputs, outputs = caller.f_locals["fn"], caller.f_locals["inputs"], caller.f_locals["outputs"]
            fake.captures += 1

            def run() -> None:
                for captured, new in zip(_tensors(outputs), _tensors(fn(*inputs))):
                    captured.set_(new)  # the same tensor object now holds the new values (expanded ones too)

            g.run, g.fresh = run, True

        class Stream:
            def wait_stream(self, other: object) -> None:
                pass

        @contextlib.contextmanager
        def stream(s: Stream):
            fake.eager_calls += 1
            yield

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", Stream)


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _tensors(v)] if isinstance(value, (tuple, list)) else []


def test_cuda_graph_warms_up_captures_once_then_replays_on_copies_of_the_arguments(monkeypatch):
    fake = FakeCUDA()
    fake.install(monkeypatch)
    seen = []

    def double(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return 2 * x

    graphed = common.cuda_graph(double, on=True, warmup=2)
    results, values = [], []
    for i in range(5):
        results.append(graphed(torch.full((3,), float(i))))
        values.append(results[-1][0].item())
    assert values == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert (fake.eager_calls, fake.captures, fake.replays) == (2, 1, 3)
    assert results[2] is results[3] is results[4]  # the captured output, overwritten by each replay
    assert seen[2] is seen[3] is seen[4]  # replays read the captured input, refreshed with each argument
    assert common.cuda_graph(double, on=False) is double


def _train_worker(root: str, graphs: bool) -> tuple[str, int]:
    chdir_rank_dir(root)
    fake = FakeCUDA()
    with pytest.MonkeyPatch.context() as monkeypatch:
        if graphs:
            fake.install(monkeypatch)
            monkeypatch.setattr(common, "use_cuda_graphs", lambda wanted, ctx: wanted)
        args = ppo.Args(num_envs=8, steps_per_env=8, iterations=3, run_dir="run", cuda_graphs=graphs, device="cpu")
        return ppo.main(args), fake.replays


def test_ppo_trains_the_same_through_the_graph_plumbing(tmp_path):
    # Every policy step and mini-batch step of 3 iterations goes through common.cuda_graph: the
    # rollout reads the captured outputs before the next replay overwrites them, the update's
    # accumulators and the learning rate live in place, and the trained state is the eager one.
    ((eager, _),) = run_ranks(_train_worker, 1, str(tmp_path / "eager"), False)
    ((graphed, replays),) = run_ranks(_train_worker, 1, str(tmp_path / "graphs"), True)
    assert replays == (3 * 8 - 3) + (3 * 5 * 4 - 3)  # every call after the 3 warm-up calls of each graph
    assert graphed == eager


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


def test_an_iteration_waits_for_the_host_a_fixed_few_times_whatever_its_length():
    # One more iteration costs the same host reads for 8 steps x 2 mini-batches as for 16 x 4 (RND
    # on): none of them is per env step or per mini-batch. They are the once-per-iteration checks and
    # statistics: non-finite inputs, the update's statistics and outcome (one read), RND's normalizer
    # limit, the learning rate, the logged line.
    def per_iteration(steps: int, mini_batches: int) -> int:
        (one,) = run_ranks(_host_reads_per_run_worker, 1, str(tmp), 1, steps, mini_batches)
        (two,) = run_ranks(_host_reads_per_run_worker, 1, str(tmp), 2, steps, mini_batches)
        return two - one

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        short, long = per_iteration(8, 2), per_iteration(16, 4)
    assert short == long == 5
