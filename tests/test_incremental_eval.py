"""Incremental evaluation: each growing layer keeps the state of its streaming attention after
the last full chunk of the previous evaluation of the same inputs and folds only the chunks
from there on. Over a run it equals full evaluation bit for bit (float32 too, and after a
resume), and it falls back to full evaluation wherever a cache would be stale."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import (
    ClippedSoftmaxRule,
    FunctionalSGD,
    Grower,
    GrowingRBFNet,
    GrowingSoftmaxNet,
    HybridGrower,
    HybridSoftmaxNet,
    MemoryBudget,
    growing_layers,
)
from rcdl.app.data import TeacherConfig, make_teacher_data
from rcdl.nn.backends import (
    disable_eval_cache,
    enable_eval_cache,
    eval_cache_hits,
    start_evaluation,
)
from rcdl.train.loop import train_one_pass


def data(dtype="float64"):
    return make_teacher_data(TeacherConfig(d_in=6, hidden=8, d_out=2, n_train=120, n_test=40,
                                           dtype=dtype))


def build(kind, dtype=torch.float64):
    torch.manual_seed(0)
    if kind == "gws":
        net = GrowingSoftmaxNet(6, 2, 2, temperature=1.0, rule=ClippedSoftmaxRule(0.3, 2.0))
    elif kind == "rbf":
        net = GrowingRBFNet(6, 2, 1, temperature=1.0, rule=FunctionalSGD(0.2))
    elif kind == "rbf-momentum":
        net = GrowingRBFNet(6, 2, 1, temperature=1.0, rule=FunctionalSGD(0.1, momentum=0.5))
    else:
        net = HybridSoftmaxNet(6, 2, 1, temperature=1.0, rule=ClippedSoftmaxRule(1.0, 2.0))
    net = net.to(dtype)
    if kind == "hybrid":
        return net, HybridGrower(net, lr=0.01)
    budget = MemoryBudget(60, "contribution", merge=True) if kind == "rbf" else None
    return net, Grower(net, budget=budget)


def run(kind, incremental, dtype=torch.float64, track=None):
    net, learner = build(kind, dtype)
    result = train_one_pass(net, data("float64" if dtype == torch.float64 else "float32"),
                            batch_size=8, eval_every=3, progress=False, loss_fn=F.mse_loss,
                            grower=learner, incremental_eval=incremental)
    if track is not None:  # the cache hits of every layer, after the run
        track.update({layer.name: eval_cache_hits(layer) for _, layer in growing_layers(net)})
    return [h["test_mse"] for h in result["history"]]


@pytest.mark.parametrize("kind", ["gws", "rbf", "rbf-momentum", "hybrid"])
def test_incremental_evaluation_equals_full_evaluation(kind):
    hits = {}
    full = run(kind, incremental=False)
    incremental = run(kind, incremental=True, track=hits)
    assert len(full) == 6  # evaluations at steps 0, 3, ..., 15
    assert_close(torch.tensor(incremental), torch.tensor(full), rtol=1e-12, atol=1e-14)
    if kind == "gws":  # the first layer's queries are the test inputs: it hits every time
        assert hits["blocks.0"] == 5  # every evaluation after the first
        assert hits["blocks.1"] == hits["readout"] == 0  # their queries move: no caching
    elif kind == "rbf":  # hits while the store is under its budget (steps 3, 6), then the
        assert hits["blocks.0"] == 2  # evictions and merges change rows: stale, recomputed
    else:  # momentum ages every weight; Adam moves every hybrid entry: not cached at all
        assert set(hits.values()) == {0}


@pytest.mark.parametrize("chunk", [None, 7], ids=["one-chunk", "chunks-of-7"])
def test_float32_incremental_evaluation_is_bit_identical(chunk, monkeypatch):
    """The cache keeps the streaming fold's state after the last full chunk and folds the
    same chunks a full pass folds: bit for bit the same, in float32 too, with chunk
    boundaries that the store crosses between evaluations."""
    if chunk is not None:
        from rcdl.ops import streaming

        monkeypatch.setattr(streaming, "default_chunk_size", lambda batch, device=None: chunk)
    full = run("gws", incremental=False, dtype=torch.float32)
    incremental = run("gws", incremental=True, dtype=torch.float32)
    assert incremental == full


def test_a_resumed_run_evaluates_bit_identically_with_the_cache_on(interrupt_after, tmp_path):
    """A resumed run's cache starts empty; its first evaluation is one full pass, which is
    what the uninterrupted run's cached evaluations are too (float32)."""
    kw = {"batch_size": 8, "eval_every": 3, "progress": False, "loss_fn": F.mse_loss,
          "incremental_eval": True}
    net, grower = build("gws", torch.float32)
    reference = train_one_pass(net, data("float32"), grower=grower, **kw)
    net, grower = build("gws", torch.float32)
    stopped = interrupt_after(grower, 8)
    with pytest.raises(stopped):
        train_one_pass(net, data("float32"), grower=grower, checkpoint_path=tmp_path / "c.pt",
                       checkpoint_every=4, **kw)
    net, grower = build("gws", torch.float32)
    resumed = train_one_pass(net, data("float32"), grower=grower,
                             checkpoint_path=tmp_path / "c.pt", **kw)
    assert resumed["resumed"] and resumed["history"] == reference["history"]


def test_other_inputs_are_not_served_from_the_cache():
    net, grower = build("gws")
    layer = net.blocks[0]
    enable_eval_cache(layer)
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    net.eval()
    with torch.no_grad():
        net(x)
    net.train()
    F.mse_loss(net(x), y).backward()
    grower.step()
    start_evaluation(layer)
    net.eval()
    other = torch.randn(5, 6, dtype=torch.float64)
    with torch.no_grad():
        got = net(other)
    disable_eval_cache(layer)
    with torch.no_grad():
        assert_close(got, net(other))
