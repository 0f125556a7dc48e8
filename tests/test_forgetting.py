"""Forgetting (rcdl.memory.forgetting): nothing of a forgotten sample stays in any buffer,
copy or saved index; what is not a list of sample indices, a layer that cannot name its
samples and a step in flight are refused; the exactness of one-batch removal per rule; the
caller's sample ids; the receipt and its scan."""

import copy
import importlib
import io
import json
import re

import pytest
import torch
import torch.nn.functional as F

from rcdl import Grower, GrowingRBF, GrowingRBFNet, GrowingSoftmax, HybridGrower, HybridSoftmaxNet
from rcdl.memory.forgetting import forget, scan_for_rows
from rcdl.memory.provenance import entry_samples, samples
from rcdl.nn.backends import enable_eval_cache, start_evaluation
from rcdl.nn.gates import AlwaysGrow
from rcdl.nn.layers import growing_layers
from rcdl.nn.rules import ClippedSoftmaxRule, FunctionalSGD, GaugeSoftmaxRule
from rcdl.retrieval.topk import load_retrieval_state, retrieval_state, use_topk
from rcdl.train.loop import accuracy, train_one_pass

D, CLASSES, N = 8, 3, 96


def data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N + 32, D, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x[:N], y[:N], x[N:], y[N:]


def trained(kind="rbf", **kw):
    torch.manual_seed(0)
    if kind == "rbf":
        model = GrowingRBFNet(D, CLASSES, 2, temperature=1.0, rule=FunctionalSGD(1.0))
        learner = Grower(model)
    else:
        model = HybridSoftmaxNet(D, CLASSES, 2, temperature=1.0, trigger=AlwaysGrow(),
                                 rule=ClippedSoftmaxRule(0.3, 3.0), initial_entries=4)
        learner = HybridGrower(model, lr=1e-3)
    train_one_pass(model, data(), batch_size=16, grower=learner, loss_fn=F.cross_entropy,
                   eval_every=100, progress=False, metrics={"acc": accuracy}, **kw)
    return model, learner


def keys_of(model, sample):
    """The bytes of every key ``sample`` wrote, per layer."""
    return [layer.store.keys[entry_samples(layer) == sample].numpy().tobytes()
            for _, layer in growing_layers(model)]


def saved_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- 1: every buffer


@pytest.mark.parametrize("kind", ["rbf", "hybrid"])
def test_nothing_of_a_forgotten_sample_stays_in_a_saved_or_copied_model(kind):
    model, learner = trained(kind)
    gone = [5, 17, 40]
    keys = [k for s in gone for k in keys_of(model, s)]
    assert all(len(k) == 4 * D for k in keys)
    receipt = forget(model, gone, learners=[learner])
    whole = saved_bytes(model) + saved_bytes(copy.deepcopy(model)) + saved_bytes(
        learner.state_dict()) + saved_bytes(copy.deepcopy(learner))
    assert not [k for k in keys if k in whole]  # not in the spare capacity either
    state = model.state_dict()
    for name, _ in growing_layers(model):
        assert not bool(torch.isin(state[f"{name}.provenance.samples"],
                                   torch.tensor(gone)).any())
    assert receipt.scan is not None and receipt.scan.clean and receipt.scan.rows > 0
    if kind == "hybrid":  # the moments follow the rows now, their freed rows zeroed
        for name, layer in growing_layers(model):
            moments = learner.adam.moments[name]
            assert len(moments) == len(layer.store)
            assert bool((moments.m._keys[len(layer.store):] == 0).all())
            assert bool((moments.v._keys[len(layer.store):] == 0).all())


# --------------------------------------------------------------------------- 2: refusals


def test_forget_refuses_masks_floats_and_negatives():
    model, _ = trained()
    mask = torch.zeros(N, dtype=torch.bool)
    mask[[3, 9]] = True
    with pytest.raises(TypeError, match="boolean mask"):
        forget(model, mask)
    with pytest.raises(TypeError, match="must be integers"):
        forget(model, [3.9])
    with pytest.raises(ValueError, match=">= 0"):
        forget(model, [4, -1])
    assert all(len(layer.store) == N for _, layer in growing_layers(model))  # untouched
    assert forget(model, []) == {name: 0 for name, _ in growing_layers(model)}


def test_forget_refuses_a_layer_that_cannot_say_which_samples_wrote_its_entries():
    model, _ = trained()
    older = {k: v for k, v in model.state_dict().items() if not k.endswith("provenance.samples")}
    loaded = GrowingRBFNet(D, CLASSES, 2, temperature=1.0, rule=FunctionalSGD(1.0))
    loaded.load_state_dict(older)
    with pytest.raises(ValueError, match="knows the sample of none"):
        forget(loaded, [3])
    layer = GrowingRBF(D, 2, temperature=1.0, rule=FunctionalSGD(1.0))  # no indices given
    grower = Grower(layer)
    layer(torch.randn(4, D)).square().mean().backward()
    grower.step()
    with pytest.raises(ValueError, match="trained without sample indices") as refused:
        forget(layer, [0])
    # the context manager the message points at is importable by the name it gives
    path = re.search(r"wrap the training forward in ([\w.]+)\(", str(refused.value))[1]
    module, _, attr = path.rpartition(".")
    assert callable(getattr(importlib.import_module(module), attr))


# --------------------------------------------------------------------------- 3: a step in flight


@pytest.mark.parametrize("kind", ["rbf", "hybrid"])
def test_forget_between_backward_and_step_is_refused(kind):
    model, learner = trained(kind)
    x, y = data()[:2]
    sizes = [len(layer.store) for _, layer in growing_layers(model)]
    with samples(model, torch.arange(4)):
        F.cross_entropy(model(x[:4]), y[:4]).backward()
    with pytest.raises(RuntimeError, match="before forget"):
        forget(model, [1])
    assert [len(layer.store) for _, layer in growing_layers(model)] == sizes
    learner.step()  # the batch steps as it would have
    learner.zero_grad()
    assert forget(model, [1])  # and then forgetting works
    with samples(model, torch.arange(4)):
        F.cross_entropy(model(x[:4]), y[:4]).backward()
    learner.zero_grad()  # dropping the batch also clears the way
    forget(model, [2])


# --------------------------------------------------------------------------- 4: a saved index


def test_a_resumed_top_k_index_does_not_carry_forgotten_keys_into_the_next_save():
    model, _ = trained()
    use_topk(model, 4, backend="exact")
    model.eval()
    with torch.no_grad():
        model(data()[2])  # builds the indices
    saved_model, saved_index = model.state_dict(), retrieval_state(model)
    resumed = GrowingRBFNet(D, CLASSES, 2, temperature=1.0, rule=FunctionalSGD(1.0))
    resumed.load_state_dict(saved_model)
    use_topk(resumed, 4, backend="exact")
    load_retrieval_state(resumed, saved_index)
    keys = keys_of(resumed, 7)
    assert all(k in saved_bytes(retrieval_state(resumed)) for k in keys)  # the loaded index
    receipt = forget(resumed, [7])
    after = saved_bytes(retrieval_state(resumed))
    assert not [k for k in keys if k in after]
    assert all("top-k index" in r for r in receipt.released.values())
    resumed.eval()
    with torch.no_grad():  # the next call rebuilds from the store
        out = resumed(data()[2])
    assert bool(torch.isfinite(out).all())


# --------------------------------------------------------------------------- 5: exact where


def _one_batch(rule, rows, x, y, kernel):
    """A layer with six entries written without sample indices, then one batch of
    ``rows``."""
    torch.manual_seed(0)
    layer = (GrowingRBF(D, 2, temperature=1.0, rule=rule, dtype=torch.float64)
             if kernel == "rbf" else
             GrowingSoftmax(D, 2, temperature=1.0, rule=rule, dtype=torch.float64,
                            initial_entries=0))
    grower = Grower(layer)
    layer.rule = FunctionalSGD(0.05)  # six entries of unknown origin first
    F.mse_loss(layer(x[20:26]), y[20:26]).backward()
    grower.step()
    layer.rule = rule
    with samples(layer, torch.tensor(rows)):
        F.mse_loss(layer(x[rows]), y[rows]).backward()
    grower.step()
    return layer


RULES = {  # rule, kernel, exact: one batch's entries each come from their own sample alone
    "functional-sgd per sample": (FunctionalSGD(1.0), "rbf", True),
    "gws (clip not acting)": (ClippedSoftmaxRule(0.01, 0.5), "softmax", True),
    "functional-sgd batch mean": (FunctionalSGD(1.0, per_sample=False), "rbf", False),
    "gauge (batch-mean units)": (GaugeSoftmaxRule(alpha=1.0, eta=0.03, beta=1.0), "softmax",
                                 False),
}


@pytest.mark.parametrize("case", list(RULES))
def test_one_batch_removal_equals_retraining_exactly_for_per_sample_rules_only(case):
    """Per-sample rules write entries that depend on their own sample (and the pre-step
    store) alone, so forgetting some of one batch's samples leaves exactly the store of a
    layer trained without them; rules in batch-mean units write ``ḡ = g / B``, so every
    kept entry of that batch is ``B / (B − f)`` too small against retraining."""
    rule, kernel, exact = RULES[case]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(26, D, generator=gen, dtype=torch.float64)
    y = torch.randn(26, 2, generator=gen, dtype=torch.float64) * 0.1
    everything, forgotten = list(range(20)), [3, 7]
    kept = [i for i in everything if i not in forgotten]
    full = _one_batch(rule, everything, x, y, kernel)
    without = _one_batch(rule, kept, x, y, kernel)
    forget(full, forgotten, scan=False)
    assert entry_samples(full).tolist() == entry_samples(without).tolist()
    torch.testing.assert_close(full.store.keys, without.store.keys, rtol=0, atol=0)
    if exact:
        torch.testing.assert_close(full.store.values, without.store.values, rtol=1e-12,
                                   atol=1e-15)
        torch.testing.assert_close(full.store.weights, without.store.weights, rtol=1e-12,
                                   atol=1e-15)
    else:
        ratio = (len(everything) - len(forgotten)) / len(everything)
        new = entry_samples(full) >= 0  # the batch's entries
        torch.testing.assert_close(full.store.values[new], ratio * without.store.values[new])
        assert not torch.allclose(full.store.values[new], without.store.values[new])


# --------------------------------------------------------------------------- 6: sample ids


def test_train_one_pass_records_the_callers_sample_ids_for_a_subset():
    x, y, xt, yt = data()
    subset = torch.arange(N)[torch.arange(N) % 3 == 1]  # dataset indices 1, 4, 7, ...
    torch.manual_seed(0)
    model = GrowingRBFNet(D, CLASSES, 2, temperature=1.0, rule=FunctionalSGD(1.0))
    train_one_pass(model, (x[subset], y[subset], xt, yt), batch_size=8, grower=Grower(model),
                   loss_fn=F.cross_entropy, progress=False, metrics={"acc": accuracy},
                   sample_ids=subset)
    for _, layer in growing_layers(model):
        assert sorted(entry_samples(layer).tolist()) == subset.tolist()
    assert forget(model, [4]) == {name: 1 for name, _ in growing_layers(model)}
    assert forget(model, [0, 2]) == {name: 0 for name, _ in growing_layers(model)}
    with pytest.raises(ValueError, match="sample_ids must be an integer tensor"):
        train_one_pass(model, (x[subset], y[subset], xt, yt), batch_size=8,
                       grower=Grower(model), progress=False, sample_ids=subset[:-1])


# --------------------------------------------------------------------------- 10: the receipt


def test_the_receipt_says_what_went_and_the_scan_finds_a_copy_left_behind():
    model, learner = trained()
    for _, layer in growing_layers(model):
        enable_eval_cache(layer)
    with torch.no_grad():
        model.eval()
        for _, layer in growing_layers(model):
            start_evaluation(layer)
        model(data()[2])
    model.train()
    first = growing_layers(model)[0][1]
    model.leak = first.store.keys[entry_samples(first) == 9].clone()  # a copy of one's own
    receipt = forget(model, [9, 9, 11], learners=[learner])
    assert receipt.samples == 2
    assert dict(receipt) == {name: 2 for name, _ in growing_layers(model)}
    assert all("evaluation cache" in r for r in receipt.released.values())
    assert all(n == 2 for n in receipt.map_erased.values())
    assert receipt.scan is not None and receipt.scan.holders == ("model.leak",)
    assert json.loads(json.dumps(receipt.to_json()))["scan"]["holders"] == ["model.leak"]
    del model.leak
    found = scan_for_rows({"model": model}, [first.store.keys[:1].clone()])
    assert found.holders and not found.clean  # a kept row is found where it lives


def test_the_scan_reads_packed_copies_of_a_stores_chunks():
    """A store's full chunks may be kept packed for the sums over their entries
    (rcdl.ops.packed: mkldnn tensors, which have no storage to read): the scan reads them
    densely and finds a forgotten row there too, in each of two packed copies of one width
    (it used to fail with 'Cannot access storage of OpaqueTensorImpl')."""
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    packed = [first.to_mkldnn(), second.to_mkldnn()]
    found = scan_for_rows({"cache": packed}, [first[2:3], second[4:5]])
    assert found.holders == ("cache[0]", "cache[1]")
    assert scan_for_rows({"cache": packed}, [torch.randn(1, 8, generator=gen)]).holders == ()
