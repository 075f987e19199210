"""`--compile`: the whole mini-batch step (forward, losses, backward, clipping, Adam) and the policy
step compiled by torch.compile, the all_reduce eager between two compiled halves. Ranks stay bitwise
identical; the compiled update matches the eager one to float tolerance (PPO, the recurrent step,
the image step, AMP, distillation); nothing is compiled again after the first iteration (every
script). `aot_eager` needs no C++ compiler; `inductor` tests skip without one."""

import contextlib
import io
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import arguments
import common
import distill_ddp
import networks
import ppo_amp_ddp
import ppo_ddp
import ppo_rnn_ddp
import speedups
from dist_helpers import (
    chdir_rank_dir,
    cpu_dist,
    rollout_batch,
    run_ranks,
    sequence_batch,
    small_args,
    small_ppo,
)

CPU1 = cpu_dist()
CPU = torch.device("cpu")


def check(backend: str | None, device: str = "cpu") -> None:
    speedups.check(speedups.SpeedArgs(compile=backend), torch.device(device), speak=False)


def needs(backend: str) -> None:
    """Skip where `--compile backend` cannot run: inductor without the C++ compiler it would use
    (start-up says the same, `speedups.check`)."""
    try:
        check(backend)
    except ValueError as reason:
        pytest.skip(str(reason))


def test_inductor_is_accepted_where_its_cpp_compiler_runs():
    """Start-up lets inductor through wherever inductor itself finds its compiler (`CXX`, else g++),
    and the other backends and CUDA devices without looking."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        pytest.skip("no C++ compiler here for inductor (CXX, else g++)")
    check("inductor")  # raises nothing
    for backend, device in (
        ("aot_eager", "cpu"),
        ("eager", "cpu"),
        (None, "cpu"),
        ("inductor", "cuda"),
    ):
        check(backend, device)


def test_inductor_writes_the_same_kernels_on_every_x86_cpu():
    """`--compile inductor` on an x86 CPU with AVX2 or AVX-512 has inductor write 256-bit kernels
    (AVX2's), so a seed gives the same run on both; the other backends, and other CPUs, leave
    inductor's choice alone."""
    from torch._inductor import config

    x86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    before = config.cpp.simdlen
    try:
        config.cpp.simdlen = None
        speedups.compiled(lambda x: x + 1, speedups.SpeedArgs(compile="aot_eager"), CPU)
        assert config.cpp.simdlen is None
        speedups.compiled(lambda x: x + 1, speedups.SpeedArgs(compile="inductor"), CPU)
        assert config.cpp.simdlen == (256 if x86 else None)
        if x86:
            # the width resolves to a vector ISA that builds here, not to scalar code
            needs("inductor")
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            assert pick_vec_isa().bit_width() == 256
    finally:
        config.cpp.simdlen = before


def assert_compiled_matches_eager(
    parameters_after: Callable[[Any], list[torch.Tensor]], args: Any, backend: str = "aot_eager"
) -> list[torch.Tensor]:
    """`parameters_after(args)`, then the same with `--compile backend` on a fresh dynamo: the
    compiled run did compile, and its parameters are the eager run's to float tolerance. -> the
    eager run's parameters."""
    eager = parameters_after(args)
    torch._dynamo.reset()
    counters.clear()
    compiled = parameters_after(arguments.with_values(args, {"compile": backend}))
    assert counters["stats"]["unique_graphs"] > 0
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return eager


def update_of(args: ppo_ddp.Args, obs_shapes: dict, recurrent: bool = False) -> list[torch.Tensor]:
    """One update (3 epochs x 2 mini-batches) of fresh networks on a fixed random rollout -> their
    parameters."""
    torch.manual_seed(0)
    if recurrent:
        head = {"num_actions": 2, "hidden": (16,), "std_type": "log"}
        actor = ppo_rnn_ddp.Recurrent(obs_shapes, True, "gru", 8, 1, head)
        critic = ppo_rnn_ddp.Recurrent(obs_shapes, True, "gru", 8, 1, {"hidden": (16,)})
    else:
        cnn = networks.settings(args.cnn, obs_shapes)
        actor, critic = (
            ppo_ddp.Actor(obs_shapes, 2, (16,), cnn=cnn),
            ppo_ddp.Critic(obs_shapes, (16,), cnn=cnn),
        )
    buf = ppo_ddp.make_rollout(8, 6, obs_shapes, 2, torch.device("cpu"))
    for tensor in (*buf.obs.values(), buf.actions, buf.values, buf.advantages, buf.returns):
        tensor.normal_()
    buf.stds.fill_(1.0)
    buf.log_probs.copy_(ppo_ddp.gaussian_log_prob(buf.actions, buf.means, buf.stds))
    optimizer = speedups.adam([*actor.parameters(), *critic.parameters()], 1e-3, args.speed, CPU)
    if recurrent:
        began = tuple(torch.zeros(6, net.memory_size) for net in (actor, critic))
        update = ppo_rnn_ddp.make_update(
            actor, critic, optimizer, sequence_batch(buf, began), args, CPU1
        )
    else:
        update = ppo_ddp.make_update(actor, critic, optimizer, rollout_batch(buf), args, CPU1)
    for _ in range(2):
        update()
    return [p.detach().clone() for p in [*actor.parameters(), *critic.parameters()]]


CASES = {
    "ppo": ({"policy": [3]}, False),
    "recurrent": ({"policy": [3]}, True),
    "image": ({"policy": [1], "image": [1, 16, 16]}, False),
}


# inductor compiles for a minute on 2 cores: the PPO case alone with it, every case with aot_eager.
@pytest.mark.parametrize(
    "case, backend", [*((case, "aot_eager") for case in sorted(CASES)), ("ppo", "inductor")]
)
def test_the_compiled_update_matches_the_eager_one(case, backend):
    needs(backend)
    shapes, recurrent = CASES[case]
    args = small_args(ppo_rnn_ddp.Args, epochs=3, mini_batches=2)
    if not recurrent:
        args = small_args(ppo_ddp.Args, epochs=3, mini_batches=2, cnn_channels=(4,))
    eager = assert_compiled_matches_eager(
        lambda args: update_of(args, shapes, recurrent), args, backend
    )
    moved = max(
        (a - b).abs().max().item() for a, b in zip(eager, update_of(args, shapes, recurrent))
    )
    assert moved == 0.0  # the eager update is deterministic: any difference above is the compiler's


def amp_update_of(args: ppo_amp_ddp.Args) -> list[torch.Tensor]:
    """Two AMP updates (PPO's with the discriminator's loss joined, its gradient penalty a double
    backward) of fresh networks on a fixed random rollout and replay -> the actor's, critic's and
    D's parameters."""
    torch.manual_seed(0)
    actor, critic, _, buf = small_ppo(6, 16)
    params = [*actor.parameters(), *critic.parameters()]
    optimizer = speedups.adam(params, 1e-3, args.speed, CPU)  # as the script makes it
    disc = ppo_amp_ddp.Discriminator(3, (8,))
    disc_optimizer = torch.optim.Adam(disc.parameters())
    replay = ppo_amp_ddp.Replay(torch.zeros(50, 6))
    ppo_amp_ddp.replay_add(replay, torch.randn(30, 6))
    buf.advantages.normal_()
    buf.returns.normal_()
    parts = (
        actor,
        critic,
        disc,
        (optimizer, disc_optimizer),
        rollout_batch(buf),
        torch.randn(40, 6),
    )
    update = ppo_amp_ddp.make_update(*parts, replay, args, CPU1)
    for _ in range(2):
        update()
    return [
        p.detach().clone() for p in [*actor.parameters(), *critic.parameters(), *disc.parameters()]
    ]


def test_the_compiled_amp_update_matches_the_eager_one():
    """The discriminator's loss stays eager under --compile (a compiled graph's backward cannot be
    differentiated again, as the gradient penalty needs); the rest compiles, and the update is the
    eager one's."""
    args = small_args(
        ppo_amp_ddp.Args, epochs=2, mini_batches=3, steps_per_env=6, num_envs=16, disc_batch_size=16
    )
    assert_compiled_matches_eager(amp_update_of, args)


def distill_update_of(args: distill_ddp.Args, student_kind: str) -> list[torch.Tensor]:
    """Two distillation updates (windows of 3 steps and a short last one of 1; a GRU student learns
    through each window) of a fresh student on fixed random labels -> its parameters."""
    torch.manual_seed(0)
    student = distill_ddp.Student(
        {"policy": [4]}, 2, (8,), 5 if student_kind == "gru" else 0, normalize=True
    )
    buf = distill_ddp.DistillRollout(
        {"policy": torch.randn(7, 6, 4)},
        torch.randn(7, 6, 2),
        (torch.rand(7, 6) < 0.2).float(),
        student.initial_memory(6, torch.device("cpu")),
    )
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
    update = distill_ddp.make_update(student, optimizer, buf, args, CPU1)
    for _ in range(2):
        update()
    return [p.detach().clone() for p in student.parameters()]


@pytest.mark.parametrize("student_kind", ["mlp", "gru"])
def test_the_compiled_distillation_update_matches_the_eager_one(student_kind):
    args = small_args(distill_ddp.Args, steps_per_env=7, gradient_length=3, epochs=2)
    assert_compiled_matches_eager(lambda args: distill_update_of(args, student_kind), args)


SCRIPTS = {
    "ppo_ddp": (ppo_ddp, {}),
    "ppo_ddp with RND, symmetry and reward scaling": (
        ppo_ddp,
        {
            "rnd_weight": 1.0,
            "symmetry": "envs.mirrors:pendulum",
            "symmetry_augment": True,
            "scale_rewards": True,
        },
    ),
    "ppo_rnn_ddp": (ppo_rnn_ddp, {}),
    "ppo_amp_ddp": (ppo_amp_ddp, {"disc_batch_size": 64}),
    "distill_ddp": (distill_ddp, {"eval_envs": 4}),  # one window an iteration: 8 steps
    # 3, 3 and 2 steps
    "distill_ddp, uneven windows": (distill_ddp, {"eval_envs": 4, "gradient_length": 3}),
}


def _train_worker(root: str, backend: str, script: str) -> tuple[object, int, int, str]:
    """4 iterations of `script` with --compile -> (the trained state's hash, graphs compiled after
    iteration 1, in all, what the rank printed)."""
    chdir_rank_dir(root)
    graphs = []

    def reduce_logs(*a, **k):  # at the end of every iteration of every script
        graphs.append(counters["stats"]["unique_graphs"])
        return original(*a, **k)

    original = common.reduce_logs
    common.reduce_logs = reduce_logs
    module, extra = SCRIPTS[script]
    small = {"num_envs": 8, "steps_per_env": 8, "iterations": 4, "logger": "none", "run_dir": "run"}
    args = small_args(module.Args, **small, compile=backend, **extra)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        fingerprint = module.main(args)
    return fingerprint, graphs[-1] - graphs[0], graphs[-1], printed.getvalue()


# aot_eager: the same graphs, breaks and recompiles as inductor's, without a minute of C++ compiling
# per rank.
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_two_ranks_stay_bitwise_identical_and_nothing_compiles_after_the_first_iteration(
    tmp_path, script
):
    ranks = run_ranks(_train_worker, 2, str(tmp_path), "aot_eager", script, timeout=600)
    assert ranks[0][0] == ranks[1][0]
    assert ranks[0][1] == ranks[1][1] == 0  # no graph compiled after iteration 1 (no recompile)
    assert ranks[0][2] > 0  # and it did compile
    # the wait, announced
    assert "; the first iteration compiles the steps (--compile aot_eager)" in ranks[0][3]


def test_dynamo_leaves_out_the_optimizer_steps_profiler_label_without_a_warning():
    """Adam's step runs under a profiler label dynamo ignores; it says so once per process, which
    `speedups.compiled` keeps off the console (every rank printed it). Other warnings still pass."""
    from torch._logging._internal import warning_once

    params = [torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.Adam(params, lr=0.1)

    def step() -> None:
        params[0].grad = torch.ones(3)
        optimizer.step()

    # torch's loggers do not propagate to the root one, so the test listens on the logger itself (a
    # handler there sees what passes the logger's filters), not through caplog.
    logger = logging.getLogger("torch._dynamo.variables.ctx_manager")
    heard: list[str] = []
    listener = logging.Handler(logging.WARNING)
    listener.emit = lambda record: heard.append(record.getMessage())  # type: ignore[method-assign]
    assert logger.isEnabledFor(logging.WARNING), (
        "dynamo's warnings are turned off here (TORCH_LOGS?)"
    )
    filtered = (
        speedups.without_profiler_note in logger.filters
    )  # an earlier test's `wrap` put it there
    logger.removeFilter(speedups.without_profiler_note)
    logger.addHandler(listener)
    try:
        # and may have compiled an optimizer step in this process already
        warning_once.cache_clear()
        torch._dynamo.reset()
        torch.compile(step, backend="aot_eager")()
        # what torch says alone
        assert any(message.startswith("Profiler record function") for message in heard)
        heard.clear()
        warning_once.cache_clear()
        torch._dynamo.reset()
        speedups.compiled(step, speedups.SpeedArgs(compile="aot_eager"), CPU)()
        logger.warning("another warning")
        assert heard == ["another warning"]
    finally:
        logger.removeHandler(listener)
        if not filtered:  # as the test found it
            logger.removeFilter(speedups.without_profiler_note)
