"""Multi-process claims, each checked in real processes joined by gloo."""

import contextlib
import functools
import json
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import arguments
import bookkeeping
import common
import distill_ddp
import envs
import launch
import ppo_ddp
import speedups
from dist_helpers import (
    chdir_rank_dir,
    count_host_reads,
    counting_collectives,
    cpu_dist,
    expect_files,
    ppo_update,
    process_group,
    run_ranks,
    small_args,
    small_ppo,
    write_row,
)
from extensions import rnd as rnd_ext

# --- broadcast ------------------------------------------------------------------------------


def _broadcast_worker():
    with process_group("cpu", seed=0) as ctx:
        torch.manual_seed(100 + ctx.rank)  # every rank starts different
        actor = ppo_ddp.Actor({"policy": [3]}, 2, (8,), 1.0, normalize=True)
        local_only = [(actor.inputs.normalizer, torch.randn(10, 3) + ctx.rank)]
        common.update_normalizers(local_only, world_size=1)
        critic = ppo_ddp.Critic({"critic": [4]}, (8,), normalize=True)
        before = common.fingerprint({"actor": actor, "critic": critic})
        common.broadcast_state([actor, critic], ctx.world_size)
        return before, common.fingerprint({"actor": actor, "critic": critic})


def test_after_broadcast_every_rank_holds_rank0_state():
    results = run_ranks(_broadcast_worker, 3)
    befores, afters = zip(*results)
    assert len(set(befores)) == 3, "ranks should start different for the test to mean anything"
    assert afters[0] == befores[0] and set(afters) == {befores[0]}


# --- the update's gradient all_reduce ------------------------------------------------------


def _union_batch(n=24):
    g = torch.Generator().manual_seed(7)
    return {
        "obs": torch.randn(n, 3, generator=g),
        "actions": torch.randn(n, 2, generator=g),
        "advantages": torch.randn(n, generator=g) * 3 + 1,
        "values": torch.randn(n, generator=g),
        "returns": torch.randn(n, generator=g),
    }


def _update_grads(batch, ctx, schedule="fixed", world_size=None):
    """One update (1 epoch, 1 mini-batch, clipping far off) of ppo_ddp.make_update on `batch`, its
    advantages normalized over `world_size` ranks (ctx's by default) -> the gradients it stepped
    with (what the all_reduce gave; clipping left them alone), the lr it chose, the KL statistic and
    the collectives the update made."""
    torch.manual_seed(0)  # identical initial networks everywhere
    shapes, n = {"policy": [3]}, batch["obs"].shape[0]
    actor, critic = (
        ppo_ddp.Actor(shapes, 2, (16,), 1.0, False),
        ppo_ddp.Critic(shapes, (16,), False),
    )
    optimizer = speedups.adam(
        [*actor.parameters(), *critic.parameters()], 1e-3, speedups.SpeedArgs(), ctx.device
    )
    rows = {"obs": {"policy": batch["obs"]}, "actions": batch["actions"], "values": batch["values"]}
    rows |= {"means": batch["actions"] + 0.1, "stds": torch.ones(n, 2), "returns": batch["returns"]}
    rows["log_probs"] = ppo_ddp.gaussian_log_prob(rows["actions"], rows["means"], rows["stds"])
    world_size = ctx.world_size if world_size is None else world_size
    advantages, _ = ppo_ddp.normalize_advantages(batch["advantages"], batch["returns"], world_size)
    rows["advantages"] = advantages
    args = small_args(ppo_ddp.Args, epochs=1, mini_batches=1, max_grad_norm=1e9, schedule=schedule)
    with counting_collectives() as calls:
        stats = ppo_ddp.make_update(actor, critic, optimizer, rows, args, ctx)()
    grads = [p.grad.clone() for p in [*actor.parameters(), *critic.parameters()]]
    return grads, float(optimizer.param_groups[0]["lr"]), stats["kl"], calls["n"]


def _allreduce_worker():
    with process_group("cpu", seed=0) as ctx:
        union = _union_batch()
        per_rank = union["obs"].shape[0] // ctx.world_size
        mine = {k: v[ctx.rank * per_rank : (ctx.rank + 1) * per_rank] for k, v in union.items()}
        local = _update_grads(
            mine, cpu_dist(), world_size=3
        )  # this rank's gradient, not all_reduced
        return local, _update_grads(mine, ctx)


def test_averaged_gradient_equals_union_batch_gradient_in_one_collective():
    """3 ranks each hold a third of a batch: ppo_ddp's update steps with the mean of the ranks'
    gradients, bitwise the same on every rank, equal to one process's on the whole batch (global
    advantage normalization makes it so); one collective for the mini-batch."""
    results = run_ranks(_allreduce_worker, 3)
    locals_, reduceds = zip(*results)
    assert [collectives for *_, collectives in reduceds] == [1, 1, 1]
    grads = [reduced[0] for reduced in reduceds]
    for i in range(len(grads[0])):
        mean_of_ranks = sum(local[0][i] for local in locals_) / 3
        assert torch.allclose(grads[0][i], mean_of_ranks, atol=1e-6)
        assert all(torch.equal(g[i], grads[0][i]) for g in grads)  # bitwise the same everywhere
    union_grads, *_ = _update_grads(_union_batch(), cpu_dist())
    for got, want in zip(grads[0], union_grads):
        assert torch.allclose(got, want, atol=1e-5), (got, want)
    # ranks really had different gradients
    assert not torch.allclose(locals_[0][0][0], locals_[1][0][0])


def _grad_of_none_worker():
    """A parameter that gets no gradient on rank 0 (a fork's unused layer, say): the update's flat
    buffer counts it as zeros on that rank, so the layout stays the same on every rank."""
    with process_group("cpu", seed=0) as ctx:
        torch.manual_seed(0)  # the same networks on both ranks, as the broadcast leaves them
        actor, critic, optimizer, buf = small_ppo(4, 6, normalize=False)
        extra = torch.nn.Parameter(torch.zeros(3))
        actor.register_parameter("extra", extra)
        if ctx.rank == 1:  # only rank 1's loss reaches `extra`
            forward = actor.forward
            actor.forward = lambda obs: (forward(obs)[0] + extra.sum(), forward(obs)[1])
        optimizer = speedups.adam(
            [*actor.parameters(), *critic.parameters()], 1e-3, speedups.SpeedArgs(), ctx.device
        )
        args = small_args(
            ppo_ddp.Args, epochs=1, mini_batches=1, max_grad_norm=1e9, schedule="fixed"
        )
        torch.manual_seed(ctx.rank)
        ppo_update(actor, critic, optimizer, buf, torch.randn(4, 6), torch.randn(4, 6), args, ctx)
        return extra.grad.tolist(), common.fingerprint({"actor": actor, "critic": critic})


def test_a_parameter_without_a_gradient_counts_as_zeros_in_the_all_reduce():
    (grad0, hash0), (grad1, hash1) = run_ranks(_grad_of_none_worker, 2)
    assert grad0 == grad1 and hash0 == hash1
    assert grad0[0] != 0 and grad0 == pytest.approx([grad0[0]] * 3)  # rank 1's gradient, halved


# --- KL and learning rate -------------------------------------------------------------------


def rsl_rl_kl_and_lr(kl, lr, desired_kl, ctx):
    """rsl_rl 5.5.1's order, for comparison: all_reduce the KL, rank 0 picks the lr, broadcast
    it."""
    kl = kl.detach().reshape(1).clone()
    dist.all_reduce(kl, op=dist.ReduceOp.SUM)
    kl /= ctx.world_size
    chosen = (
        ppo_ddp.adaptive_lr(kl[0], lr, desired_kl).reshape(1)
        if ctx.is_main
        else torch.zeros(1, dtype=lr.dtype)
    )
    dist.broadcast(chosen, src=0)
    return chosen[0]


def _lr_worker():
    with process_group("cpu", seed=0) as ctx:
        union = _union_batch()
        per_rank = union["obs"].shape[0] // ctx.world_size
        mine = {k: v[ctx.rank * per_rank : (ctx.rank + 1) * per_rank] for k, v in union.items()}
        _, ours, kl, _ = _update_grads(mine, ctx, schedule="adaptive")
        _, _, local_kl, _ = _update_grads(mine, cpu_dist(), "adaptive", world_size=3)  # this rank's
        lr = torch.tensor(1e-3, dtype=torch.float64)
        theirs = rsl_rl_kl_and_lr(torch.tensor(local_kl), lr, 0.01, ctx)
        return ours, float(theirs), kl, local_kl


def test_every_rank_picks_the_lr_rsl_rls_kl_allreduce_and_broadcast_picks():
    """The KL averaged inside the update's gradient all_reduce, the rule applied on every rank: the
    same lr, on every rank, as rsl_rl's KL all_reduce + rank-0 rule + broadcast (2 collectives
    more)."""
    results = run_ranks(_lr_worker, 3)
    assert len({ours for ours, *_ in results}) == 1 and len({kl for _, _, kl, _ in results}) == 1
    ours, theirs, kl, _ = results[0]
    assert kl == pytest.approx(sum(local for *_, local in results) / 3, rel=1e-6)
    assert kl != results[1][3]  # the ranks' own KLs differ: the mean is what they agree on
    assert ours == theirs != 1e-3  # the rule moved the lr, and both ways picked the same


# --- normalizer -----------------------------------------------------------------------------


def _normalizer_worker():
    with process_group("cpu", seed=0) as ctx:
        norm = common.EmpiricalNormalizer(4)
        for step in range(2):
            g = torch.Generator().manual_seed(10 * ctx.rank + step)
            x = torch.randn(5 + 3 * ctx.rank, 4, generator=g) * (ctx.rank + 1) + ctx.rank
            common.update_normalizers([(norm, x)], ctx.world_size)
        return norm.count.item(), norm.mean.numpy(), norm.var.numpy()


def test_normalizer_statistics_equal_numpy_on_union_of_ranks_data():
    results = run_ranks(_normalizer_worker, 3)
    union = []
    for rank in range(3):
        for step in range(2):
            g = torch.Generator().manual_seed(10 * rank + step)
            union.append(torch.randn(5 + 3 * rank, 4, generator=g) * (rank + 1) + rank)
    union = torch.cat(union).double().numpy()
    for count, mean, var in results:
        assert count == len(union)
        assert mean.tolist() == results[0][1].tolist() and var.tolist() == results[0][2].tolist()
        assert mean == pytest.approx(union.mean(0), rel=1e-10)
        assert var == pytest.approx(union.var(0), rel=1e-10)


def _normalizers_together_worker():
    with process_group("cpu", seed=0) as ctx:
        g = torch.Generator().manual_seed(ctx.rank)
        batches = [torch.randn(6 + ctx.rank, 3, generator=g), torch.randn(4, 5, generator=g) * 3]
        alone = [common.EmpiricalNormalizer(3), common.EmpiricalNormalizer(5)]
        together = [common.EmpiricalNormalizer(3), common.EmpiricalNormalizer(5)]
        for normalizer, x in zip(alone, batches):
            common.update_normalizers([(normalizer, x)], ctx.world_size)
        with counting_collectives() as calls:
            common.update_normalizers(list(zip(together, batches)), ctx.world_size)
        same = [
            common.fingerprint({"a": a}) == common.fingerprint({"a": b})
            for a, b in zip(alone, together)
        ]
        return calls["n"], same


def test_several_normalizers_merge_in_one_all_gather_with_the_same_bits():
    results = run_ranks(_normalizers_together_worker, 2)
    assert results == [(1, [True, True])] * 2


# --- real training --------------------------------------------------------------------------


def _train_worker(root, overrides=None):
    rank_dir = os.path.join(root, f"rank{os.environ['RANK']}")
    os.makedirs(rank_dir, exist_ok=True)
    os.chdir(rank_dir)  # same relative --run-dir on every rank, a different place on disk
    small = {
        "num_envs": 16,
        "steps_per_env": 8,
        "iterations": 4,
        "run_dir": "run",
        "save_interval": 2,
    }
    return ppo_ddp.main(small_args(ppo_ddp.Args, **small, **(overrides or {})))


@pytest.mark.parametrize("task", ["pendulum", "reacher"])
def test_training_leaves_ranks_bitwise_identical_and_only_rank0_writes(tmp_path, task):
    """Parameters, normalizers, optimizer state and lr hash the same on both ranks after
    training."""
    hashes = run_ranks(_train_worker, 2, str(tmp_path), {"task": task})
    assert hashes[0] == hashes[1]
    expect_files(tmp_path / "rank0" / "run", "latest", "metrics.jsonl", "model_2.pt", "model_4.pt")
    assert sorted(f for f in os.listdir(tmp_path / "rank0" / "run") if f.endswith(".pt")) == [
        "model_2.pt",
        "model_4.pt",
    ]
    assert os.listdir(tmp_path / "rank1") == []
    rows = [
        json.loads(line)
        for line in (tmp_path / "rank0" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["world_size"] == 2
        assert r["env_steps"] == r["iteration"] * 8 * 16 * 2  # counts both ranks
    checkpoint = torch.load(tmp_path / "rank0" / "run" / "model_4.pt", weights_only=True)
    assert checkpoint["iteration"] == 4 and checkpoint["env_steps"] == 4 * 8 * 16 * 2


def test_training_without_sync_would_diverge(tmp_path, monkeypatch):
    # The control for the test above: with the gradient all_reduce disabled, ranks drift apart.
    hashes = run_ranks(_train_worker_unsynced, 2, str(tmp_path))
    assert hashes[0] != hashes[1]


def _train_worker_unsynced(root):
    ppo_ddp.all_reduce_mean = lambda flat, world_size: None
    return _train_worker(root)


# --- device checks --------------------------------------------------------------------------


def test_wrong_cuda_device_for_local_rank_is_a_value_error_naming_both():
    with pytest.raises(ValueError, match=r"'cuda:1' is not cuda:LOCAL_RANK"):
        common.resolve_device("cuda:1", local_rank=0, world_size=2, gpus=2)
    assert common.resolve_device("cpu", local_rank=3, world_size=4) == torch.device("cpu")


def test_device_rule_with_a_faked_gpu_count():
    """One process may use any GPU; several use cuda:LOCAL_RANK, spelled `cuda`, `auto` or per rank;
    a LOCAL_RANK past the node's GPUs and an unknown device name get their own message."""
    assert common.resolve_device("cuda:1", local_rank=0, world_size=1, gpus=2) == torch.device(
        "cuda:1"
    )
    for spelled in ("cuda", "auto", "cuda:1"):
        assert common.resolve_device(spelled, local_rank=1, world_size=2, gpus=2) == torch.device(
            "cuda:1"
        )
    assert common.resolve_device("auto", local_rank=1, world_size=2, gpus=0) == torch.device("cpu")
    too_many = r"4 processes per node but this node has 2 GPU\(s\): no GPU for LOCAL_RANK 2 and up"
    for local_rank in range(4):  # every rank of the node says the same: one line for the job
        with pytest.raises(ValueError, match=too_many):
            common.resolve_device("cuda", local_rank=local_rank, world_size=4, gpus=2)
    with pytest.raises(ValueError, match=r"no GPU cuda:3: this node has 2 GPU\(s\)"):
        common.resolve_device("cuda:3", local_rank=0, world_size=1, gpus=2)
    with pytest.raises(ValueError, match="CUDA is not available"):
        common.resolve_device("cuda", local_rank=0, world_size=1, gpus=0)
    with pytest.raises(ValueError, match="unknown device 'gpu': pass auto, cpu, cuda or cuda:N"):
        common.resolve_device("gpu", local_rank=0)


def _pinned_worker(pin: bool) -> tuple[set[int], set[int], list[set[int]], str | None, int]:
    """This rank's cores after start-up, a thread's started then, those of the threads already
    running, the `RANK_CORES` it leaves and torch's thread count."""
    # as inherited from a parent: a start that pins nothing must not keep it
    os.environ["RANK_CORES"] = "99"
    del os.environ["OMP_NUM_THREADS"]  # unset: the start sizes torch's pool itself
    with process_group("cpu", pin_cores=pin):
        main = os.sched_getaffinity(0)
        later: list[set[int]] = []
        thread = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join()
        others = []
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != threading.get_native_id():
                with contextlib.suppress(OSError):  # a thread that ended since the listing
                    others.append(os.sched_getaffinity(int(tid)))
        return main, later[0], others, os.environ.get("RANK_CORES"), torch.get_num_threads()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity call on this OS")
def test_each_rank_takes_its_own_share_of_the_cores_and_gloos_threads_stay_free():
    """`--pin-cores` (the default): rank r's training thread, and the threads it starts, keep to
    rank r's share of the cores the job may use (`launch.rank_cores`); gloo's threads, started
    before, keep them all. torch's pool gets the rank's cores; unpinned, its share of them."""
    allowed = set(launch.usable_cores())
    shares = [set(launch.rank_cores(rank, 2, allowed)) for rank in range(2)]
    if not shares[0]:
        pytest.skip("one core: two ranks cannot each have their own")
    results = run_ranks(_pinned_worker, 2, True)
    assert not shares[0] & shares[1]
    for share, (main, later, others, named, threads) in zip(shares, results, strict=True):
        assert main == later == share
        assert allowed in others  # gloo's threads, free to run beside either rank
        assert named == ",".join(map(str, sorted(main))) and threads == len(share)
    for main, later, _, named, threads in run_ranks(_pinned_worker, 2, False):
        assert main == later == allowed and named is None and threads == len(allowed) // 2


def _cores_after_a_run(root: str, script: str) -> tuple[set[int], str | None]:
    chdir_rank_dir(root)
    small = {"num_envs": 8, "steps_per_env": 8, "iterations": 1, "run_dir": "run"}
    if script == "ppo_ddp.py":
        ppo_ddp.main(small_args(ppo_ddp.Args, **small))
    else:
        distill_ddp.main(small_args(distill_ddp.Args, **small, eval_envs=2))
    return os.sched_getaffinity(0), os.environ.get("RANK_CORES")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity call on this OS")
@pytest.mark.parametrize("script", ["ppo_ddp.py", "distill_ddp.py"])
def test_the_scripts_pin_cores_by_default(tmp_path, script):
    """Two of the scripts (each copies the same start-up) pin with their default arguments."""
    assert arguments.DistArgs().pin_cores
    allowed = launch.usable_cores()
    if len(allowed) < 2:
        pytest.skip("one core: two ranks cannot each have their own")
    for rank, (cores, named) in enumerate(run_ranks(_cores_after_a_run, 2, str(tmp_path), script)):
        expected = launch.rank_cores(rank, 2, allowed)
        assert cores == set(expected) and named == ",".join(map(str, expected))


def _siblings(root: Path, siblings: dict[int, str]) -> str:
    """A fake /sys/devices/system/cpu: each CPU's thread_siblings_list."""
    for cpu, text in siblings.items():
        (root / f"cpu{cpu}" / "topology").mkdir(parents=True, exist_ok=True)
        (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    return str(root)


def test_hyperthreads_of_one_core_go_to_one_rank(tmp_path):
    """Linux numbers the second hyperthread of each core after all the first ones (4 cores: CPU 0
    and 4 share one). A rank takes whole cores while there is one per rank, what is left over
    idling; with fewer cores than ranks, the first threads of all cores go before any second one."""
    four = _siblings(tmp_path / "four", {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)})
    assert launch.physical_cores(range(8), four) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [launch.rank_cores(rank, 2, range(8), four) for rank in range(2)] == [
        [0, 1, 4, 5],
        [2, 3, 6, 7],
    ]
    assert [launch.rank_cores(rank, 3, range(8), four) for rank in range(3)] == [
        [0, 4],
        [1, 5],
        [2, 6],
    ]
    assert [launch.rank_cores(rank, 6, range(8), four) for rank in range(6)] == [
        [0],
        [1],
        [2],
        [3],
        [4],
        [5],
    ]
    assert launch.rank_cores(0, 9, range(8), four) == []  # fewer threads than ranks
    for rank, ranks in [(2, 2), (6, 6), (-2, 4)]:  # a local rank outside its node
        assert launch.rank_cores(rank, ranks, range(8), four) == []
    pairs = _siblings(
        tmp_path / "pairs", {cpu: f"{cpu - cpu % 2}-{cpu - cpu % 2 + 1}" for cpu in range(4)}
    )
    assert [launch.rank_cores(rank, 3, range(4), pairs) for rank in range(3)] == [[0], [2], [1]]
    smt4x3 = _siblings(
        tmp_path / "smt4x3", {cpu: f"{cpu - cpu % 4}-{cpu - cpu % 4 + 3}" for cpu in range(12)}
    )
    # in order
    assert [launch.rank_cores(rank, 5, range(12), smt4x3) for rank in range(2)] == [[0, 4], [1, 8]]
    three = _siblings(tmp_path / "three", {cpu: f"{cpu % 3},{cpu % 3 + 3}" for cpu in range(6)})
    assert [launch.rank_cores(rank, 2, range(6), three) for rank in range(2)] == [[0, 3], [1, 4]]
    # Ranges, several per list; a list that cannot be read, or no topology at all: a core of its
    # own.
    smt4 = _siblings(tmp_path / "smt4", {0: "0-1,4-5", 1: "0-1,4-5", 4: "0-1,4-5", 5: "0-1,4-5"})
    _siblings(tmp_path / "smt4", {2: "2-3,6-7", 3: "2-3,6-7", 6: "2-3,6-7", 7: "2-3,6-7", 8: ""})
    assert launch.physical_cores([7, 5, 8, 0, 6, 1, 4, 2, 3], smt4) == [
        [0, 1, 4, 5],
        [2, 3, 6, 7],
        [8],
    ]
    mixed = _siblings(tmp_path / "mixed", {0: "0,2-3", 2: "0,2-3", 3: "0,2-3", 1: "1"})
    assert launch.physical_cores(range(4), mixed) == [[0, 2, 3], [1]]
    assert launch.physical_cores([3, 1, 2], str(tmp_path / "nowhere")) == [[1], [2], [3]]


def test_a_rank_on_a_device_drops_an_inherited_rank_cores(monkeypatch):
    """RANK_CORES from a parent process would size EnvPool's pool for cores a GPU rank was never
    given."""
    monkeypatch.setenv("RANK_CORES", "99")
    launch.share_cores(0, pin=False, cpu=False)  # what `main` does on a GPU
    assert "RANK_CORES" not in os.environ


def test_more_ranks_than_cores_pins_nothing(monkeypatch):
    pinned: list[set[int]] = []
    monkeypatch.setattr(
        os, "sched_setaffinity", lambda pid, cores: pinned.append(cores), raising=False
    )
    monkeypatch.delenv("RANK_CORES", raising=False)
    assert launch.pin_to_cores(0, len(launch.usable_cores()) + 1) == set()
    assert (
        launch.pin_to_cores(2, 2) == set()
    )  # a local rank past its node's count (a wrong LOCAL_RANK)
    assert pinned == [] and "RANK_CORES" not in os.environ


def test_envpool_threads_fill_a_pinned_ranks_cores_or_split_the_processs(monkeypatch):
    from envs import envpool as adapter  # imports EnvPool only to build a pool

    monkeypatch.delenv("ENVPOOL_THREADS", raising=False)
    monkeypatch.setenv("RANK_CORES", "4,5,6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")
    assert adapter.threads_per_rank() == 3  # the rank's own cores, not divided again
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("RANK_CORES")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert adapter.threads_per_rank() == max(1, cores // 2)
    monkeypatch.setenv("ENVPOOL_THREADS", "3")
    assert adapter.threads_per_rank() == 3


def test_pinned_and_unpinned_runs_train_the_same_bits(tmp_path):
    pinned = run_ranks(_train_worker, 2, str(tmp_path / "pinned"), {"pin_cores": True})
    free = run_ranks(_train_worker, 2, str(tmp_path / "free"), {"pin_cores": False})
    assert pinned == free and pinned[0] == pinned[1]


def _update_collectives_worker():
    with process_group("cpu", seed=0) as ctx:
        torch.manual_seed(0)
        args = small_args(ppo_ddp.Args, epochs=2, mini_batches=3)
        actor, critic, optimizer, buf = small_ppo(4, 6, normalize=False)
        with counting_collectives() as calls:
            ppo_update(
                actor, critic, optimizer, buf, torch.randn(4, 6), torch.randn(4, 6), args, ctx
            )
        return calls["n"], float(optimizer.param_groups[0]["lr"])


def test_ppo_update_spends_one_collective_per_minibatch():
    """Gradients, KL and loss statistics in one all_reduce; rsl_rl 5.5.1 spends 3."""
    results = run_ranks(_update_collectives_worker, 2)
    assert [n for n, _ in results] == [2 * 3] * 2
    assert results[0][1] == results[1][1]  # and the same learning rate everywhere


def _end_iteration_worker(root):
    with process_group("cpu", seed=0) as ctx:
        os.chdir(root)
        args = small_args(ppo_ddp.Args, num_envs=32, steps_per_env=1, iterations=2)
        run = bookkeeping.RunLog(args, "ppo", {}, {}, "run", 1, 0, 64, ctx.world_size)
        os.makedirs("run", exist_ok=True)
        rank = ctx.rank
        # rank 0 finished 1 episode of return -10 and length 100; rank 1 two of returns -20, -40
        # (length 200).
        finished = torch.tensor([[-10.0, 100.0, 1.0], [-60.0, 400.0, 2.0]][rank])
        # Ranks log different keys; a key is averaged over the ranks (and steps) that logged it.
        logs = {
            "shared": torch.tensor(float(rank + 1)),
            **({"only_rank1": torch.tensor(4.0)} if rank else {}),
        }
        timings = {"collect_s": 0.5, "update_s": 0.5}
        logged, stop = common.reduce_logs(ctx, finished, logs, run.log_keys, False)
        assert not finished.any()  # zeroed for the next iteration
        if ctx.is_main:
            write_row(run, 1, {**logged, **timings}, stop)
        # Iteration 2: an env logs a key for the first time (mjlab logs on the steps an env resets),
        # as (sum, count) over the steps that logged it: rank 0 on 2 steps (3.0 in all), rank 1 on 1
        # (2.0).
        logs = {}
        envs.accumulate_logs(logs, {"log": {"at_reset": 1.0 + rank}}, ctx.device)
        if rank == 0:
            envs.accumulate_logs(logs, {"log": {"at_reset": 2.0}}, ctx.device)
        logged, _ = common.reduce_logs(ctx, finished, logs, run.log_keys, rank == 1)
        if ctx.is_main:
            write_row(run, 2, {**logged, **timings}, stop)
        return stop, _, run.last_return, run.log_keys


def test_end_of_iteration_statistics_cover_every_rank_and_log_key(tmp_path):
    results = run_ranks(_end_iteration_worker, 2, str(tmp_path))
    keys = ["at_reset", "only_rank1", "shared"]
    assert results[0] == (False, True, -70.0 / 3, keys) and results[1] == (False, True, None, keys)
    first, second = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert first["episode_return"] == pytest.approx(-70 / 3) and first[
        "episode_length"
    ] == pytest.approx(500 / 3)
    assert first["episodes_finished"] == 3 and first["shared"] == 1.5 and first["only_rank1"] == 4.0
    # logged by no rank
    assert second["at_reset"] == pytest.approx(5.0 / 3) and "shared" not in second
    # the latest iteration that finished some
    assert second["episode_return"] == first["episode_return"]


# --- host syncs ------------------------------------------------------------------------------


def _host_syncs_in_update(epochs: int, mini_batches: int, schedule: str) -> int:
    """Calls that read a tensor's value on the host, made by our code during one PPO update."""
    torch.manual_seed(0)
    ctx = cpu_dist()
    args = small_args(ppo_ddp.Args, epochs=epochs, mini_batches=mini_batches, schedule=schedule)
    actor, critic, optimizer, buf = small_ppo(4, 6, normalize=False)
    return count_host_reads(
        lambda: ppo_update(
            actor, critic, optimizer, buf, torch.randn(4, 6), torch.randn(4, 6), args, ctx
        )
    )


@pytest.mark.parametrize("schedule", ["adaptive", "fixed"])
def test_ppo_minibatch_loop_reads_nothing_back_to_the_host(schedule):
    # The same number of host reads for 1 and for 6 mini-batches: none of them is in the loop (the
    # adaptive lr is chosen on the device); those left are the once-per-update statistics and
    # checks.
    once = _host_syncs_in_update(1, 1, schedule)
    assert _host_syncs_in_update(2, 3, schedule) == once
    # the counter does see the per-update reads, so it would see per-mini-batch ones
    assert once > 0


def test_rollout_intrinsic_reward_and_advantages_read_nothing_back_to_the_host():
    """Collecting a rollout (the built-in env's masked resets included), scoring it with RND and
    computing the normalized advantages: the host never waits for the device."""
    torch.manual_seed(0)
    cpu, args = (
        torch.device("cpu"),
        small_args(ppo_ddp.Args, num_envs=8, steps_per_env=5, rnd_weight=1.0),
    )
    ctx = cpu_dist()
    env = envs.make_env("pendulum_sparse", 8, cpu, 0, random_start=True)
    obs = env.get_observations()
    actor, critic = ppo_ddp.make_networks(obs, env.num_actions, args)
    rnd, _ = rnd_ext.make_rnd(obs, actor.inputs.shapes, args, cpu)
    groups = [*actor.inputs.shapes, *critic.inputs.shapes, *rnd.inputs.shapes]
    shapes = envs.group_shapes(obs, [*dict.fromkeys(groups)])
    buf = ppo_ddp.make_rollout(5, 8, shapes, env.num_actions, cpu)
    episodes = envs.make_episodes(8, cpu)

    def iteration_until_the_update() -> None:
        policy_step = functools.partial(ppo_ddp.act, actor, critic)
        next_obs, logs, _ = ppo_ddp.rollout(env, policy_step, obs, buf, episodes, args)
        intrinsic = rnd_ext.rollout_intrinsic_rewards(
            rnd, buf, next_obs, torch.zeros(8), 1, env, args.rnd, ctx, logs
        )
        last_values = critic(next_obs).detach()
        advantages, returns = ppo_ddp.compute_gae(
            buf.rewards + intrinsic, buf.values, buf.dones, last_values, 0.99, 0.95
        )
        ppo_ddp.normalize_advantages(advantages, returns, world_size=1)

    assert count_host_reads(iteration_until_the_update) == 0
