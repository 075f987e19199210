"""A fork's change to a network touches its script alone: networks keep their constructor config in
the checkpoint, and training, resuming, evaluating, playing and exporting rebuild them from it
(`Class(**config)`). The fork here adds a layer norm to ppo_ddp.Actor's MLP, as a subclass put in
its place."""

import dataclasses
import importlib.util
import os
import re
import sys

import pytest
import torch
from torch import nn

from dist_helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import evaluate  # noqa: E402
import export  # noqa: E402
import play  # noqa: E402
import policy  # noqa: E402

import common  # noqa: E402
import ppo_ddp  # noqa: E402


class LayerNormActor(ppo_ddp.Actor):
    """The fork's actor: an option of its own, `layer_norm`, a LayerNorm after every hidden layer of
    the MLP. A fork would write it into ppo_ddp.Actor itself; its config carries the option like any
    other argument."""

    def __init__(self, *args, layer_norm: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config["layer_norm"] = layer_norm
        if layer_norm:
            layers = list(self.net)
            with_norms = [
                m
                for layer in layers
                for m in (
                    [layer, nn.LayerNorm(layer.out_features)]
                    if isinstance(layer, nn.Linear) and layer is not layers[-1]
                    else [layer]
                )
            ]
            self.net = nn.Sequential(*with_norms)


@pytest.fixture
def fork(monkeypatch):
    """ppo_ddp.Actor replaced by the fork's, everywhere it is looked up (make_networks,
    tools/policy.py)."""
    monkeypatch.setattr(ppo_ddp, "Actor", LayerNormActor)


def small_run(run_dir, iterations: int, **overrides) -> ppo_ddp.Args:
    return ppo_ddp.Args(
        num_envs=8,
        steps_per_env=8,
        iterations=iterations,
        run_dir=str(run_dir),
        logger="none",
        **overrides,
    )


def test_a_forked_actor_trains_resumes_evaluates_and_exports_with_no_other_edit(fork, tmp_path):
    run = tmp_path / "run"
    ppo_ddp.main(small_run(run, 2))
    state = torch.load(run / "model_2.pt", weights_only=True)
    assert state["configs"]["actor"]["layer_norm"] is True
    assert any(key.startswith("net.1.") for key in state["actor"])  # the LayerNorm's weights
    ppo_ddp.main(small_run(run, 3, resume=str(run)))  # the config compared and the weights loaded
    assert os.path.exists(run / "model_3.pt")

    loaded = policy.load_policy(str(run))
    assert isinstance(loaded.network, LayerNormActor) and loaded.iteration == 3
    result = evaluate.evaluate(evaluate.Config(str(run), episodes=4))
    assert result["episodes"] == 4 and torch.isfinite(torch.tensor(result["returns"])).all()

    formats = (
        ("torchscript", "onnx") if importlib.util.find_spec("onnxscript") else ("torchscript",)
    )
    errors = export.export(export.Config(str(run), formats=formats, check_envs=4))
    assert all(error is None or error <= 1e-5 for error in errors.values())
    program = torch.jit.load(str(run / "exported" / "policy.pt"))
    assert "aten::layer_norm" in str(
        program.inlined_graph
    )  # the fork's layer is in the deployed program


def test_a_forked_actor_plays(fork, tmp_path):
    pytest.importorskip(
        "matplotlib", reason="tools/play.py draws the built-in tasks with matplotlib"
    )
    ppo_ddp.main(small_run(tmp_path, 1))
    animation, strip = play.play(play.Config(str(tmp_path), every=20))
    assert os.path.getsize(animation) > 0 and os.path.getsize(strip) > 0


def test_a_checkpoint_of_other_networks_is_found_by_their_configs(fork, tmp_path, monkeypatch):
    """Resuming the fork's checkpoint without the fork (or with the option off) is refused at
    start-up in one line naming the config that differs: the configs are compared, not the state
    dicts' shapes alone."""
    ppo_ddp.main(small_run(tmp_path, 1))
    # the original actor, without the option
    monkeypatch.setattr(ppo_ddp, "Actor", LayerNormActor.__mro__[1])
    with pytest.raises(common.Failure, match=re.escape("actor layer_norm=True (this run: None)")):
        ppo_ddp.main(small_run(tmp_path, 2, resume=str(tmp_path)))
    monkeypatch.setattr(ppo_ddp, "Actor", LayerNormActor)
    bigger = dataclasses.replace(small_run(tmp_path, 2, resume=str(tmp_path)), actor_hidden=(32,))
    with pytest.raises(common.Failure, match=re.escape("actor hidden=[64, 64] (this run: [32])")):
        ppo_ddp.main(bigger)
