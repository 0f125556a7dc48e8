"""Edits of a model's memory that meet (docs/unlearning.md, "Edits that compose"): a fast
``forget`` told to the replay log, then ``forget_exactly``, gives the model retrained without
both sets of samples; one not told is refused, as are merging budgets and data that do not
match the log; a replay that fails part-way leaves the model, its learners and the log as they
were. float64, tens of samples."""

import copy

import pytest
import torch
import torch.nn.functional as F

from rcdl import Grower, GrowingSoftmaxNet, HybridGrower, HybridSoftmaxNet
from rcdl.memory.budgets import MemoryBudget
from rcdl.memory.forgetting import forget
from rcdl.memory.provenance import entry_samples
from rcdl.nn.gates import DistanceGate
from rcdl.nn.layers import growing_layers
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.train.loop import train_one_pass
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly, stream_without
from small_runs import assert_same_stores, classification_data, same

D, CLASSES, N, B = 8, 3, 72, 8


def data():
    return classification_data(N, D)


def build(kind, budget=None):
    torch.manual_seed(0)
    if kind == "gws":
        model = GrowingSoftmaxNet(D, CLASSES, 2, temperature=1.0,
                                  rule=ClippedSoftmaxRule(0.01, 1.0)).double()
        return model, Grower(model, budget=budget)
    model = HybridSoftmaxNet(D, CLASSES, 2, temperature=1.0, trigger=DistanceGate(3.0),
                             rule=ClippedSoftmaxRule(0.3, 3.0), initial_entries=4).double()
    return model, HybridGrower(model, lr=1e-3, budget=budget)


def train(kind, budget=None, **kw):
    model, grower = build(kind, budget)
    train_one_pass(model, data(), batch_size=B, seed=3, grower=grower,
                   loss_fn=F.cross_entropy, eval_every=1000, progress=False, **kw)
    return model, grower


def exactly(model, grower, log, samples, x=None, y=None, loss_fn=F.cross_entropy, **kw):
    x_train, y_train = data()[:2]
    return forget_exactly(model, samples, replay=log, loss_fn=loss_fn, grower=grower,
                          data=(x_train if x is None else x, y_train if y is None else y), **kw)


def assert_same_model(a, b):
    assert_same_stores(a, b)
    x = data()[2]
    with torch.no_grad():
        assert torch.equal(a.eval()(x), b.eval()(x))


def everything(model, grower, log):
    """What a refused or failed request must leave as it was."""
    with torch.no_grad():
        outputs = model.eval()(data()[2])
    model.train()
    return {"model": copy.deepcopy(model.state_dict()), "outputs": outputs,
            "stores": [layer.store.rows() for _, layer in growing_layers(model)],
            "learner": copy.deepcopy(grower.state_dict()), "order": log.order.clone(),
            "snapshots": dict(log.snapshots)}


def assert_unchanged(before, model, grower, log):
    after = everything(model, grower, log)
    for key in ("model", "outputs", "stores", "learner", "order"):
        assert same(before[key], after[key]), key
    assert before["snapshots"].keys() == after["snapshots"].keys()
    assert all(before["snapshots"][s] is after["snapshots"][s] for s in before["snapshots"])


# ----------------------------------------------------------------- case 1: gws, S then T earlier


def test_a_told_forget_then_an_earlier_exact_request_is_the_run_without_both():
    log = ReplayLog(every=1)
    model, grower = train("gws", replay=log)
    late, early = log.stream[[57, 60]].tolist(), log.stream[[20]].tolist()  # batches 7 and 2
    retrain_order = stream_without(log, late + early)
    fast = forget(model, late, learners=[grower], replay=log)
    assert fast.checkpoints == ["replay snapshot at step 8", "replay snapshot at step 9"]
    assert sorted(log.forgotten.tolist()) == sorted(late)
    receipt = exactly(model, grower, log, early)
    retrained, _ = train("gws", order=retrain_order)
    assert_same_model(model, retrained)
    for _, layer in growing_layers(model):
        assert not torch.isin(entry_samples(layer), torch.tensor(late + early)).any()
    assert receipt.samples == 3 and receipt.scan is not None and receipt.scan.clean
    assert "restored step 2," in next(iter(receipt.released.values()))[0]
    assert torch.equal(log.order, retrain_order) and log.forgotten.numel() == 0


def test_an_exact_request_after_a_forget_the_log_was_not_told_of_is_refused():
    log = ReplayLog(every=1)
    model, grower = train("gws", replay=log)
    forget(model, log.stream[[57, 60]].tolist(), learners=[grower])
    before = everything(model, grower, log)
    with pytest.raises(ValueError, match=r"forget\(model, samples, replay=log\)") as err:
        exactly(model, grower, log, log.stream[[20]].tolist())
    assert "layer 'blocks.0'" in str(err.value)
    assert_unchanged(before, model, grower, log)


# ----------------------------------------------------------------- case 2: the hybrid


def test_hybrid_a_told_forget_drops_the_snapshots_that_hold_its_rows():
    log = ReplayLog(every=1)
    model, grower = train("hybrid", replay=log)
    early, late = log.stream[[22]].tolist(), log.stream[[45]].tolist()  # batches 2 and 5
    retrain_order = stream_without(log, early + late)
    fast = forget(model, early, learners=[grower], replay=log)
    assert fast["blocks.0"] == 1 and fast["blocks.1"] == 1  # the gate let its rows in
    assert fast.checkpoints == [f"replay snapshot at step {s}" for s in range(3, 10)]
    assert fast.scan is not None and fast.scan.clean  # the log's snapshots are scanned too
    receipt = exactly(model, grower, log, late)
    retrained, _ = train("hybrid", order=retrain_order)
    assert_same_model(model, retrained)
    assert "restored step 2," in next(iter(receipt.released.values()))[0]
    assert receipt.scan is not None and receipt.scan.clean


def test_hybrid_an_exact_request_after_an_untold_forget_is_refused():
    log = ReplayLog(every=1)
    model, grower = train("hybrid", replay=log)
    forget(model, log.stream[[22]].tolist(), learners=[grower])  # batch 2
    before = everything(model, grower, log)
    with pytest.raises(ValueError, match=r"snapshot at step 5 belong to samples.*replay=log"):
        exactly(model, grower, log, log.stream[[45]].tolist())  # restores step 5: holds them
    assert_unchanged(before, model, grower, log)


# ----------------------------------------------------------------- case 3: budgets


@pytest.mark.parametrize("kind", ["gws", "hybrid"])
def test_an_exact_request_under_a_merging_budget_is_refused(kind):
    log = ReplayLog(every=1)
    model, grower = train(kind, budget=MemoryBudget(40, "newest", merge=True), replay=log)
    before = everything(model, grower, log)
    with pytest.raises(ValueError, match=r"merge=True.*'blocks\.0'"):
        exactly(model, grower, log, log.stream[[20]].tolist())
    assert_unchanged(before, model, grower, log)


def test_an_exact_request_under_an_evicting_budget_is_still_the_retrained_model():
    log = ReplayLog(every=1)
    model, grower = train("gws", budget=MemoryBudget(40, "newest"), replay=log)
    gone = log.stream[[20, 57]].tolist()
    retrain_order = stream_without(log, gone)
    exactly(model, grower, log, gone)
    assert_same_model(model, train("gws", budget=MemoryBudget(40, "newest"),
                                   order=retrain_order)[0])


# ----------------------------------------------------------------- case 4: all or nothing


def test_data_that_do_not_match_the_log_are_refused_before_anything_changes():
    log = ReplayLog(every=1)
    model, grower = train("gws", replay=log)
    before = everything(model, grower, log)
    x, y = data()[:2]
    with pytest.raises(ValueError, match=r"data holds 40 rows.*position 7\d|data holds 40 rows"):
        exactly(model, grower, log, log.stream[[20]].tolist(), x=x[:40], y=y[:40])
    with pytest.raises(ValueError, match="72 inputs and 71 labels"):
        exactly(model, grower, log, log.stream[[20]].tolist(), y=y[:71])
    assert_unchanged(before, model, grower, log)


def nan_after(calls):
    """A cross-entropy loss that turns NaN from its ``calls``-th call on."""
    count = [0]

    def loss_fn(out, y):
        count[0] += 1
        loss = F.cross_entropy(out, y)
        return loss * float("nan") if count[0] >= calls else loss
    return loss_fn


@pytest.mark.parametrize("failure", ["non-finite input", "non-finite loss"])
@pytest.mark.parametrize("kind", ["gws", "hybrid"])
def test_a_replay_that_fails_part_way_leaves_model_learners_and_log_as_they_were(kind, failure):
    log = ReplayLog(every=1)
    model, grower = train(kind, replay=log)
    gone = log.stream[[20]].tolist()  # batch 2: steps 2 to 8 are replayed
    before = everything(model, grower, log)
    if failure == "non-finite input":  # the layer refuses batch 6
        x = data()[0].clone()
        x[log.order[50]] = float("nan")
        with pytest.raises(ValueError, match="input contains NaN") as err:
            exactly(model, grower, log, gone, x=x)
    else:  # the fourth replayed step's loss is NaN
        with pytest.raises(FloatingPointError, match="training loss is nan at step 5") as err:
            exactly(model, grower, log, gone, loss_fn=nan_after(4))
    assert_unchanged(before, model, grower, log)
    assert any("as they were" in note for note in getattr(err.value, "__notes__", []))
    # and the model still forgets exactly afterwards
    retrain_order = stream_without(log, gone)
    exactly(model, grower, log, gone)
    assert_same_model(model, train(kind, order=retrain_order)[0])
