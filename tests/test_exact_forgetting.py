"""Exact forgetting (rcdl.train.unlearning, rcdl.train.replay): restoring the newest snapshot
before the earliest forgotten sample and replaying the rest of the stream gives, bit for bit
in float64, the model trained on the stream without those samples."""

import pytest
import torch
import torch.nn.functional as F

from rcdl import Grower, GrowingRBFNet, GrowingSoftmaxNet, HybridGrower, HybridSoftmaxNet
from rcdl.memory.forgetting import forget
from rcdl.nn.gates import DistanceGate
from rcdl.nn.layers import growing_layers
from rcdl.nn.rules import ClippedSoftmaxRule, FunctionalSGD
from rcdl.train.loop import accuracy, train_one_pass
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly, stream_without
from small_runs import assert_same_stores, classification_data

D, CLASSES, N, B = 8, 3, 72, 8


def data():
    return classification_data(N, D)


def build(kind):
    torch.manual_seed(0)
    if kind == "rbf":
        model = GrowingRBFNet(D, CLASSES, 2, temperature=1.0, rule=FunctionalSGD(1.0)).double()
        return model, None, Grower(model)
    if kind == "gws":
        model = GrowingSoftmaxNet(D, CLASSES, 2, temperature=1.0,
                                  rule=ClippedSoftmaxRule(0.01, 1.0)).double()
        return model, None, Grower(model)
    model = HybridSoftmaxNet(D, CLASSES, 2, temperature=1.0, trigger=DistanceGate(3.0),
                             rule=ClippedSoftmaxRule(0.3, 3.0), initial_entries=4).double()
    return model, None, HybridGrower(model, lr=1e-3)


def train(kind, **kw):
    model, optimizer, grower = build(kind)
    train_one_pass(model, data(), batch_size=B, seed=3, optimizer=optimizer, grower=grower,
                   loss_fn=F.cross_entropy, eval_every=1000, progress=False,
                   metrics={"acc": accuracy}, **kw)
    return model, optimizer, grower


def assert_same(a, b):
    assert_same_stores(a, b)
    for (_, la), (_, lb) in zip(growing_layers(a), growing_layers(b), strict=True):
        assert la.store.next_id == lb.store.next_id and int(la.steps) == int(lb.steps)
    for (k, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        if not k.endswith(("provenance.samples", "provenance.merged")):  # capacity may differ
            assert torch.equal(pa, pb), k
    x = data()[2]
    with torch.no_grad():
        assert torch.equal(a.eval()(x), b.eval()(x))


@pytest.mark.parametrize(("kind", "every"), [("rbf", 1), ("gws", 3), ("hybrid", 2)])
def test_exact_forgetting_equals_retraining_without_the_samples(kind, every):
    log = ReplayLog(every=every)
    model, optimizer, grower = train(kind, replay=log)
    gone = log.stream[[30, 41, 60]].tolist()  # seen in batches 3, 5 and 7
    retrain_order = stream_without(log, gone)
    receipt = forget_exactly(model, gone, replay=log, data=data()[:2], loss_fn=F.cross_entropy,
                             optimizer=optimizer, grower=grower)
    retrained, _, _ = train(kind, order=retrain_order)
    assert_same(model, retrained)
    assert receipt.scan is not None and receipt.scan.clean
    restored = 30 // B // every * every
    assert all(f"restored step {restored}," in r[0] for r in receipt.released.values())
    if kind != "hybrid":  # every sample writes one entry per layer
        assert dict(receipt) == {name: 3 for name, _ in growing_layers(model)}
    # the log now describes the new run: a second request is exact too
    again = forget_exactly(model, [log.stream[5].item()], replay=log, data=data()[:2],
                           loss_fn=F.cross_entropy, optimizer=optimizer, grower=grower,
                           scan=False)
    assert "restored step 0," in next(iter(again.released.values()))[0]
    retrained, _, _ = train(kind, order=stream_without(log, []))
    assert_same(model, retrained)


def test_a_late_sample_replays_only_the_steps_after_it_and_snapshots_cost_little():
    log = ReplayLog(every=1)
    model, _, grower = train("rbf", replay=log)
    assert len(log.snapshots) == N // B + 1
    assert log.nbytes < 4096 * len(log.snapshots)  # no store rows: counts and buffers
    loaded, _, loaded_grower = build("rbf")  # a saved and loaded model forgets as well
    loaded.load_state_dict(model.state_dict())
    loaded_grower.load_state_dict(grower.state_dict())
    receipt = forget_exactly(loaded, [log.stream[-1].item()], replay=log, data=data()[:2],
                             loss_fn=F.cross_entropy, grower=loaded_grower)
    assert "replayed 1 of 9 steps" in next(iter(receipt.released.values()))[0]
    assert_same(loaded, train("rbf", order=log.order)[0])


def test_exact_forgetting_refuses_a_store_changed_since_the_run():
    log = ReplayLog(every=1)
    model, _, grower = train("rbf", replay=log)
    forget(model, [log.stream[0].item()])  # removal: the history is no longer append-only
    sizes = [len(layer.store) for _, layer in growing_layers(model)]
    with pytest.raises(ValueError, match="lost rows it held at step"):
        forget_exactly(model, [log.stream[9].item()], replay=log, data=data()[:2],
                       loss_fn=F.cross_entropy, grower=grower)
    assert [len(layer.store) for _, layer in growing_layers(model)] == sizes
    with pytest.raises(ValueError, match="replay log records one epoch"):
        train("rbf", replay=ReplayLog(), epochs=2)
    with pytest.raises(ValueError, match="every must be an integer"):
        ReplayLog(every=0)
