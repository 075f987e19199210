"""`--cuda-graphs` without a GPU: the one-line note and the same run; the steps a graph replays, free
of host syncs with RND and the discriminator on; a whole iteration's few host reads; and training
through `cuda_graphs.cuda_graph` with a CPU stand-in for torch.cuda.CUDAGraph that, like a CUDA graph,
runs Python once and replays the recorded ops, cut where the all_reduce stays eager. (The real capture
needs a GPU: `python benchmarks/gpu.py` there.)"""

import dataclasses
import functools
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import checkpoints
import common
import cuda_graphs
import distill_ddp
import ppo_amp_ddp as amp
import ppo_ddp as ppo
import ppo_rnn_ddp as rnn
from dist_helpers import (
    chdir_rank_dir,
    count_host_reads,
    counting_collectives,
    run_ranks,
    script_ranks,
    small_ppo,
)
from extensions import rnd as rnd_ext
from extensions import symmetry

CPU1 = common.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
SMALL = ("--num-envs", "16", "--steps-per-env", "8", "--iterations", "3")


SYMMETRY = {"symmetry": "envs.mirrors:pendulum", "symmetry_augment": True, "symmetry_mirror_loss": 0.5}


def pendulum_mirror(args: ppo.Args, buf: ppo.Rollout, actor: ppo.Actor, critic: ppo.Critic) -> symmetry.Mirror:
    """The pendulum's mirror function for an update of `buf`, whose networks read its 3-wide `policy` group."""
    return symmetry.load_mirror(args, None, {"policy": buf.obs["policy"][0]}, actor, critic, 1)


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
    buf = ppo.make_rollout(4, 6, {"policy": [3], "rnd_state": [3]}, 1, torch.device("cpu"))
    fill_randomly(buf)
    rnd = rnd_ext.RND({"rnd_state": [3]}, (8,), 4, normalize_states=True, normalize_rewards=False)
    disc = amp.Discriminator(3, (8,))
    replay = amp.ReplayBuffer(torch.zeros(50, 6))
    amp.replay_add(replay, torch.randn(30, 6))
    sides = (
        amp.discriminator_side_loss(disc, torch.optim.Adam(disc.parameters()), torch.randn(40, 6), replay, args),
        rnd_ext.rnd_side_loss(rnd, torch.optim.Adam(rnd.predictor.parameters())),
        symmetry.symmetry_side_loss(pendulum_mirror(args, buf, actor, critic), actor, args),
    )
    update = ppo.make_update(actor, critic, optimizer, ppo.rollout_batch(buf), args, CPU1, sides)
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
    eager_codes, eager = script_ranks("ppo_ddp.py", *SMALL, "--run-dir", "eager", cwd=tmp_path)
    codes, graphs = script_ranks("ppo_ddp.py", *SMALL, "--cuda-graphs", "--run-dir", "graphs", cwd=tmp_path)
    assert eager_codes == codes == [0, 0], graphs
    note = "note: --cuda-graphs needs a CUDA device (this run is on cpu): running eagerly."
    assert graphs.count(note) == 1 and note not in eager
    assert _metrics(tmp_path / "graphs" / "metrics.jsonl") == _metrics(tmp_path / "eager" / "metrics.jsonl")


# --- cuda_graphs.cuda_graph's capture, with a CPU stand-in for torch.cuda.CUDAGraph ------------------

# Ops a CUDA graph capture cannot hold: each makes the host wait for a value (or for an output shape).
HOST_WAITS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.is_nonzero", "aten.equal")


class _Recording(TorchDispatchMode):
    """Records every aten op `fn` runs, with its tensor arguments and outputs, for `TracedGraph`."""

    def __init__(self, graph: "TracedGraph") -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        boolean_index = name.startswith("aten.index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        )
        if name in HOST_WAITS or boolean_index:
            raise RuntimeError(f"{name} waits for the host: a CUDA graph cannot capture it")
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes():
                storage = tensor.untyped_storage()  # first seen as an input: it existed before; keep its bytes
                self.graph.saved.setdefault(storage.data_ptr(), (storage, storage.clone()))
        outputs = func(*args, **kwargs)
        for tensor in tree_flatten(outputs)[0]:
            if isinstance(tensor, torch.Tensor):  # made by the capture: nothing to put back
                self.graph.saved.setdefault(tensor.untyped_storage().data_ptr(), None)
        self.graph.ops.append((func, args, kwargs, outputs))
        return outputs


class TracedGraph:
    """torch.cuda.CUDAGraph's stand-in on the CPU, installed as `cuda_graphs.GRAPH`. Between `capture_begin`
    and `capture_end` the ops run and are recorded, then every tensor they touched gets its bytes back and
    the random generator its state: like a CUDA capture, the capture changes nothing. `replay` runs the
    recorded ops again on the same tensors (parameters, optimizer state, sums, inputs), each output landing
    in the tensor the capture produced, so Python runs once and a value it read then stays frozen. An op
    that waits for the host fails the capture, as on a GPU."""

    captures = replays = 0  # over all graphs, for the tests' counts

    def __init__(self) -> None:
        self.ops, self.saved, self.mode, self.rng = [], {}, None, None

    def pool(self) -> None:  # one memory pool for all graphs: nothing to share on the CPU
        return None

    def capture_begin(self, pool: None = None) -> None:
        TracedGraph.captures += 1
        self.rng, self.mode = torch.get_rng_state(), _Recording(self)
        self.mode.__enter__()

    def capture_end(self) -> None:
        self.mode.__exit__(None, None, None)
        for saved in self.saved.values():
            if saved is not None:
                saved[0].copy_(saved[1])
        self.saved = {}
        torch.set_rng_state(self.rng)

    def replay(self) -> None:
        TracedGraph.replays += 1
        with torch._C._AutoDispatchBelowAutograd():  # where the ops were recorded; grad mode as it was
            for func, args, kwargs, outputs in self.ops:
                results = func(*args, **kwargs)
                for captured, result in zip(tree_flatten(outputs)[0], tree_flatten(results)[0]):
                    if isinstance(captured, torch.Tensor) and captured is not result:
                        captured.set_(result)  # the same tensor object now holds this replay's values


class Counted:
    """Installs the stand-in and counts graphs captured, graph replays and eager warm-up calls."""

    def __init__(self) -> None:
        self.eager, self.start = 0, (TracedGraph.captures, TracedGraph.replays)

    @property
    def captures(self) -> int:
        return TracedGraph.captures - self.start[0]

    @property
    def replays(self) -> int:
        return TracedGraph.replays - self.start[1]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def on_side_stream(fn, args, side):
            self.eager += 1
            return fn(*args)

        monkeypatch.setattr(cuda_graphs, "GRAPH", TracedGraph)
        monkeypatch.setattr(cuda_graphs, "on_side_stream", on_side_stream)
        monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
        self.start = (TracedGraph.captures, TracedGraph.replays)


def cuda_like_adam(params, lr, device, capturable=False, backend=None):
    """common.make_adam as on CUDA: fused, with a float32 learning-rate tensor."""
    return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), fused=True)


def test_cuda_graph_warms_up_captures_once_then_replays_on_copies_of_the_arguments(monkeypatch):
    counted = Counted()
    counted.install(monkeypatch)
    seen = []

    def double(x: torch.Tensor) -> tuple[torch.Tensor]:
        seen.append(x)
        return (2 * x,)

    graphed = cuda_graphs.cuda_graph(double, graphs=True, warmup=2)
    results, values = [], []
    for i in range(5):
        results.append(graphed(torch.full((3,), float(i)))[0])
        values.append(results[-1][0].item())
    assert values == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert (counted.eager, counted.captures, counted.replays) == (2, 1, 3)
    assert len(seen) == 3  # Python ran twice eagerly and once for the capture, never for a replay
    assert results[2] is results[3] is results[4]  # the captured output, overwritten by each replay
    assert cuda_graphs.cuda_graph(double, graphs=False) is double


def _step_with_a_cut(cut: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Counted, list[float], list[float]]:
    """Six calls of a graphed step `total += 2 * (x + 1)`, its `+ 1` inside `cuda_graphs.eager` when `cut`
    (where the all_reduce stands) -> (the counts, the values the eager call saw, the total)."""
    counted, calls, total = Counted(), [], torch.zeros(2)
    counted.install(monkeypatch)

    def add_one(flat: torch.Tensor) -> None:
        calls.append(flat[0].item())
        flat.add_(1.0)

    def step(x: torch.Tensor) -> None:
        flat = x.clone()
        if cut:
            cuda_graphs.eager(add_one, flat)
        else:
            flat.add_(1.0)
        total.add_(2 * flat)

    graphed = cuda_graphs.cuda_graph(step, graphs=True)
    for i in range(6):
        graphed(torch.full((2,), float(i)))
    return counted, calls, total.tolist()


@pytest.mark.parametrize(
    "cut, graphs, replays, calls", [(True, 2, 6, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]), (False, 1, 3, [])]
)
def test_an_eager_call_cuts_the_capture_and_runs_between_the_graphs(monkeypatch, cut, graphs, replays, calls):
    """With the cut, two graphs, and the eager call made from Python at every call but the capture's
    (which runs nothing), between them, on what the first graph wrote; the total is an eager run's.
    Without it, one graph and no call from Python."""
    counted, seen, total = _step_with_a_cut(cut, monkeypatch)
    assert (counted.captures, counted.replays, seen) == (graphs, replays, calls)
    assert total == [2.0 * sum(i + 1 for i in range(6))] * 2


def _train_worker(root: str, graphs: bool) -> tuple[str, int]:
    chdir_rank_dir(root)
    counted = Counted()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(common, "make_adam", cuda_like_adam)
        if graphs:
            counted.install(monkeypatch)
            monkeypatch.setattr(cuda_graphs, "use_cuda_graphs", lambda cuda_graphs, device, speak: cuda_graphs)
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


def test_recurrent_ppo_trains_the_same_with_its_steps_captured_once_and_replayed(tmp_path, monkeypatch):
    """ppo_rnn_ddp.py: the policy step carries both memories in and out of its graph; each mini-batch
    step unrolls whole env sequences, blanking memories at dones with fixed shapes, so one trace
    serves every mini-batch, whatever the dones. The trained state is the eager run's, bit for bit."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "make_adam", cuda_like_adam)
    small = {"num_envs": 4, "steps_per_env": 4, "epochs": 2, "mini_batches": 2, "iterations": 2, "rnn_hidden": 8}
    args = rnn.Args(**small, actor_hidden=(8,), critic_hidden=(8,), device="cpu", logger="none")
    eager = rnn.main(dataclasses.replace(args, run_dir="eager"))
    counted = Counted()
    counted.install(monkeypatch)
    monkeypatch.setattr(cuda_graphs, "use_cuda_graphs", lambda cuda_graphs, device, speak: cuda_graphs)
    graphed = rnn.main(dataclasses.replace(args, run_dir="graphs", cuda_graphs=True))
    assert counted.replays == (2 * 4 - 3) + (2 * 2 * 2 - 3)
    assert graphed == eager


def _distill_worker(root: str, graphs: bool) -> tuple[tuple[str, str], int]:
    chdir_rank_dir(root)
    counted, adam = Counted(), torch.optim.Adam
    with pytest.MonkeyPatch.context() as monkeypatch:
        # Adam fused, as it can step in a trace on the CPU, the same in both runs.
        monkeypatch.setattr(
            torch.optim, "Adam", lambda params, lr, capturable=False, fused=None: adam(params, lr=lr, fused=True)
        )
        if graphs:
            counted.install(monkeypatch)
            monkeypatch.setattr(cuda_graphs, "use_cuda_graphs", lambda cuda_graphs, device, speak: cuda_graphs)
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


def _updates_with_every_side_loss(
    graphs: bool, monkeypatch: pytest.MonkeyPatch, ctx: common.Dist = CPU1, with_sides: bool = True
) -> tuple[str, Counted]:
    """Three updates with RND's predictor, the discriminator and symmetry beside PPO (`with_sides`), the
    replay buffer growing between them (a Python size a capture would freeze), this rank's own data
    -> (fingerprint of everything trained, the captures and replays)."""
    counted = Counted()
    if graphs:
        counted.install(monkeypatch)
    torch.manual_seed(0)
    args = amp.Args(epochs=2, mini_batches=2, disc_batch_size=8, **SYMMETRY)
    actor, critic, _, _ = small_ppo(4, 6)
    buf = ppo.make_rollout(4, 6, {"policy": [3], "rnd_state": [3]}, 1, torch.device("cpu"))
    optimizer = cuda_like_adam([*actor.parameters(), *critic.parameters()], 1e-3, torch.device("cpu"))
    rnd = rnd_ext.RND({"rnd_state": [3]}, (8,), 4, normalize_states=True, normalize_rewards=False)
    disc = amp.Discriminator(3, (8,))
    optimizers = [optimizer, *(torch.optim.Adam(m.parameters(), fused=True) for m in (disc, rnd.predictor))]
    replay = amp.ReplayBuffer(torch.zeros(50, 6))
    sides = (
        amp.discriminator_side_loss(disc, optimizers[1], torch.randn(40, 6), replay, args),
        rnd_ext.rnd_side_loss(rnd, optimizers[2]),
        symmetry.symmetry_side_loss(pendulum_mirror(args, buf, actor, critic), actor, args),
    )
    batch, sides = ppo.rollout_batch(buf), sides if with_sides else ()
    update = ppo.make_update(actor, critic, optimizer, batch, args, ctx, sides, graphs=graphs)
    torch.manual_seed(1 + ctx.rank)
    for _ in range(3):
        fill_randomly(buf)
        amp.replay_add(replay, torch.randn(12, 6))
        update()
    return common.fingerprint([actor, critic, disc, rnd], optimizers), counted


def test_updates_with_every_side_loss_are_the_same_captured_once_and_replayed(monkeypatch):
    # The discriminator draws its rows before each step, from the replay's size at that moment: a
    # capture that read the size inside the step would keep sampling the first 12 pairs.
    eager, _ = _updates_with_every_side_loss(False, monkeypatch)
    graphed, counted = _updates_with_every_side_loss(True, monkeypatch)
    assert graphed == eager
    assert (counted.captures, counted.replays) == (1, 3 * 2 * 2 - 3)


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
    saved = {"net": net.state_dict(), "optimizer": fused.state_dict(), "parts": ["net", "optimizer"], "configs": {}}
    saved["fingerprint"] = common.fingerprint([net], [fused])
    net2, plain = build()
    checkpoints.restore(
        checkpoints.ResumeFrom("model_1.pt", saved), checkpoints.Trained("ppo", {"net": net2}, {"optimizer": plain})
    )
    assert not plain.param_groups[0]["fused"] and fused.param_groups[0]["fused"]
    assert common.fingerprint([net2], [plain]) == saved["fingerprint"]
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
    # limit, the learning rate, the logged line (the explained variance rides in it).
    def per_iteration(steps: int, mini_batches: int) -> int:
        root = str(tmp_path / f"{steps}x{mini_batches}")
        (one,) = run_ranks(_host_reads_per_run_worker, 1, root, 1, steps, mini_batches)
        (two,) = run_ranks(_host_reads_per_run_worker, 1, root, 2, steps, mini_batches)
        return two - one

    assert per_iteration(8, 2) == per_iteration(16, 4) == 5


# --- Several ranks: each optimizer step two graphs, the all_reduce eager between them ------------


def _distill_updates(graphs: bool, monkeypatch: pytest.MonkeyPatch, ctx: common.Dist) -> tuple[str, Counted]:
    """Four distillation updates of a GRU student, windows of 3, 3 and 2 steps, this rank's own random
    rollouts -> (fingerprint of the student and its Adam, the captures and replays)."""
    counted = Counted()
    if graphs:
        counted.install(monkeypatch)
    torch.manual_seed(0)
    args = distill_ddp.Args(steps_per_env=8, gradient_length=3, student="gru", rnn_hidden=4)
    student = distill_ddp.Student({"policy": [3]}, 1, (8,), 4, normalize=True)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-3, fused=True)  # steps in a trace on the CPU
    obs = {"policy": torch.zeros(8, 6, 3)}
    buf = distill_ddp.DistillRollout(obs, torch.zeros(8, 6, 1), torch.zeros(8, 6), student.initial_memory(6, "cpu"))
    update = distill_ddp.make_update(student, optimizer, buf, args, ctx, graphs)
    torch.manual_seed(1 + ctx.rank)
    for _ in range(4):
        for tensor in (buf.obs["policy"], buf.labels, buf.memory):
            tensor.normal_()
        buf.dones.bernoulli_(0.2)
        update()
    return common.fingerprint([student], [optimizer]), counted


def _recurrent_updates(graphs: bool, monkeypatch: pytest.MonkeyPatch, ctx: common.Dist) -> tuple[str, Counted]:
    """Three recurrent PPO updates of LSTMs (ppo_rnn_ddp.py), 2 epochs x 2 mini-batches of whole env
    sequences, this rank's own random rollouts, dones and carried-in memories -> (fingerprint, Counted)."""
    counted = Counted()
    if graphs:
        counted.install(monkeypatch)
    torch.manual_seed(0)
    shapes, head = {"policy": [3]}, {"num_actions": 1, "hidden": (8,), "init_std": 1.0, "std_type": "log"}
    actor = rnn.Recurrent(shapes, True, "lstm", 4, 1, head)
    critic = rnn.Recurrent(shapes, True, "lstm", 4, 1, {"hidden": (8,)})
    optimizer = cuda_like_adam([*actor.parameters(), *critic.parameters()], 1e-3, torch.device("cpu"))
    buf = ppo.make_rollout(4, 6, shapes, 1, torch.device("cpu"))
    start = tuple(torch.zeros(6, net.memory_size) for net in (actor, critic))
    batch, args = rnn.sequence_batch(buf, start), rnn.Args(epochs=2, mini_batches=2)
    update = ppo.make_update(actor, critic, optimizer, batch, args, ctx, (), graphs, rnn.sequence_loss)
    torch.manual_seed(1 + ctx.rank)
    for _ in range(3):
        fill_randomly(buf)
        buf.dones.bernoulli_(0.2)
        for memory in start:
            memory.normal_()
        update()
    return common.fingerprint([actor, critic], [optimizer]), counted


def _split_graphs_worker() -> dict[str, tuple]:
    """On each of 2 gloo ranks: PPO updates, PPO with the discriminator, RND and symmetry, recurrent PPO
    (LSTM) and GRU distillation, each eagerly and then with its steps split in two traces, a real all_reduce between
    -> for each (eager fingerprint, graphed fingerprint, (captures, replays), collectives while graphed)."""
    results = {}
    runs = {
        "ppo": functools.partial(_updates_with_every_side_loss, with_sides=False),
        "ppo_amp_rnd_symmetry": _updates_with_every_side_loss,
        "ppo_rnn_lstm": _recurrent_updates,
        "distill_gru": _distill_updates,
    }
    with common.distributed("cpu", seed=0) as ctx, pytest.MonkeyPatch.context() as monkeypatch:
        for name, run in runs.items():
            eager, _ = run(False, monkeypatch, ctx)
            with counting_collectives() as calls:
                graphed, counted = run(True, monkeypatch, ctx)
            results[name] = (eager, graphed, (counted.captures, counted.replays), calls["n"])
    return results


@pytest.fixture(scope="module")
def split_graphs_on_two_ranks():
    return run_ranks(_split_graphs_worker, 2)


@pytest.mark.parametrize("name", ["ppo", "ppo_amp_rnd_symmetry", "ppo_rnn_lstm", "distill_gru"])
def test_two_ranks_split_graphs_train_as_eager_does_bit_for_bit(split_graphs_on_two_ranks, name):
    """With two ranks each step is two traces (before and after the all_reduce) and the all_reduce
    runs eagerly between them: the trained state is the eager run's, bit for bit, on both ranks."""
    (eager0, graphed0, *_), (eager1, graphed1, *_) = (rank[name] for rank in split_graphs_on_two_ranks)
    assert graphed0 == eager0 and graphed1 == eager1
    assert eager0 == eager1  # the ranks' data differ, their trained bits do not


def test_two_ranks_split_graphs_keep_one_all_reduce_per_optimizer_step(split_graphs_on_two_ranks):
    """PPO (recurrent too): 3 updates x 2 epochs x 2 mini-batches, each step two graphs (3 warm-up calls each, then
    replays). Distillation: 4 updates x 3 windows, a graph pair for each window length (the 2-step
    window's 4 calls: one replay each)."""
    for rank in split_graphs_on_two_ranks:
        assert (
            rank["ppo"][2:] == rank["ppo_amp_rnd_symmetry"][2:] == rank["ppo_rnn_lstm"][2:] == ((2, 2 * (12 - 3)), 12)
        )
        assert rank["distill_gru"][2:] == ((4, 2 * (8 - 3) + 2 * (4 - 3)), 12)
