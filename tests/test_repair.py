"""Fast forgetting (rcdl.memory.repair): the readout's entries re-written under the model
without the forgotten samples, in float64 against dense twins — the readout trained alone,
step by step, on its stored keys, and each sample's features computed by a copy of the
model that keeps only the rows written before its step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rcdl import Grower, GrowingRBFNet, GrowingSoftmaxNet, HybridSoftmaxNet
from rcdl.memory.forgetting import forget
from rcdl.memory.provenance import entry_samples, samples
from rcdl.memory.repair import forget_and_repair, recompute_readout_keys, rewrite_readout
from rcdl.nn.gates import DistanceGate
from rcdl.nn.layers import GrowingLaplacian, growing_layers
from rcdl.nn.networks import ResidualNet
from rcdl.nn.rules import ClippedSoftmaxRule, FunctionalSGD, GaugeSoftmaxRule
from rcdl.train.loop import accuracy, train_one_pass, train_step

D, CLASSES, N, B = 8, 3, 64, 8
KINDS = ("gws", "gws-normalized", "gauge", "rbf", "laplacian")


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N + 32, D, generator=gen, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x[:N], y[:N], x[N:], y[N:]


def build(kind):
    torch.manual_seed(0)
    if kind == "rbf":
        return GrowingRBFNet(D, CLASSES, 2, temperature=1.0, rule=FunctionalSGD(1.0)).double()
    if kind == "laplacian":
        def layer(a, b=None):
            return GrowingLaplacian(a, b or a, temperature=1.0, rule=FunctionalSGD(0.5))
        return ResidualNet(D, CLASSES, 2, make_block=layer, make_readout=layer).double()
    rule = {"gws": ClippedSoftmaxRule(0.01, 1.0),
            "gws-normalized": ClippedSoftmaxRule(0.01, 1.0, normalize=True),
            "gauge": GaugeSoftmaxRule(1.0, 0.03, 1.0)}[kind]
    return GrowingSoftmaxNet(D, CLASSES, 2, temperature=1.0, rule=rule, initial_entries=4).double()


def train(kind, order=None):
    model = build(kind)
    train_one_pass(model, data(), batch_size=B, seed=3, grower=Grower(model),
                   loss_fn=F.cross_entropy, eval_every=1000, progress=False,
                   metrics={"acc": accuracy}, order=order)
    return model


class Alone(nn.Module):
    """The readout by itself, fed its stored keys: the dense twin of the re-write."""

    def __init__(self, readout):
        super().__init__()
        self.readout = readout

    def forward(self, q):
        return self.readout(q)


def twin_rewrite(model, gone, labels):
    """The readout's entries re-written by training a copy of it alone, step by step, on its
    stored keys: each step's whole batch, the forgotten rows with no loss (the batch-mean
    loss still over the batch) and their entries removed right after the step."""
    layer = copy.deepcopy(model.readout)
    owners, written = entry_samples(layer), layer.store.written_at.clone()
    keys = layer.store.keys.clone()
    layer.remove_entries(owners >= 0)
    alone = Alone(layer)
    grower = Grower(alone)
    kept = ~torch.isin(torch.arange(N), torch.as_tensor(gone))
    for step in written[owners >= 0].unique().tolist():
        rows = written == step
        q, ids = keys[rows], owners[rows]

        w = kept[ids].double()

        def loss(s, y, w=w):
            return (F.cross_entropy(s, y, reduction="none") * w).mean()

        with samples(alone, ids):
            train_step(alone, q, labels[ids], loss, None, grower)
        layer.remove_entries(torch.isin(entry_samples(layer), torch.as_tensor(gone)))
    return layer


@pytest.mark.parametrize("kind", KINDS)
def test_rewriting_what_nothing_changed_gives_back_what_training_wrote(kind):
    model = train(kind)
    layer = model.readout
    before = {f: getattr(layer.store, f).clone() for f in ("keys", "values", "weights")}
    count = recompute_readout_keys(model, layer, data()[0], from_step=1, block=13)
    entries, steps = rewrite_readout(layer, data()[1], from_step=1, block=13)
    assert count == entries == N and steps == N // B
    for field, old in before.items():
        torch.testing.assert_close(getattr(layer.store, field), old, rtol=1e-10, atol=1e-12,
                                   msg=field)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [1, 20, 512])
def test_rewrite_equals_training_the_readout_alone_on_its_stored_keys(kind, block):
    model = train(kind)
    gone = [3, 17, 40, 41]
    twin = twin_rewrite(model, gone, data()[1])
    forget(model, gone)
    first = 1  # sample order is seeded: some forgotten sample is in an early batch
    rewrite_readout(model.readout, data()[1], from_step=first, block=block,
                    batch_sizes=dict.fromkeys(range(1, N // B + 1), B))
    for field in ("keys", "values", "weights"):
        torch.testing.assert_close(getattr(model.readout.store, field),
                                   getattr(twin.store, field), rtol=1e-10, atol=1e-12, msg=field)


def twin_keys(model, x):
    """Each readout entry's key as a copy of the model keeping only the rows written before
    its step computes it."""
    owners, written = entry_samples(model.readout), model.readout.store.written_at
    keys = model.readout.store.keys.clone()
    for step in written[owners >= 0].unique().tolist():
        past = copy.deepcopy(model).eval()
        for _, layer in growing_layers(past):
            layer.remove_entries(layer.store.written_at >= step)
        seen = {}
        past.readout.register_forward_pre_hook(lambda m, a, seen=seen: seen.update(q=a[0]))
        rows = (written == step) & (owners >= 0)
        with torch.no_grad():
            past(x[owners[rows]])
        keys[rows] = seen["q"]
    return keys


@pytest.mark.parametrize("kind", KINDS)
def test_recomputed_keys_are_the_features_of_the_model_at_each_write(kind):
    model = train(kind)
    forget(model, [0, 5, 33])
    x = data()[0]
    expected = twin_keys(model, x)
    recompute_readout_keys(model, model.readout, x, from_step=1, block=20)
    torch.testing.assert_close(model.readout.store.keys, expected, rtol=1e-10, atol=1e-12)
    assert model.training  # the mode it was in


@pytest.mark.parametrize("kind", ["rbf", "gauge"])
def test_repair_moves_the_forgotten_model_toward_retraining(kind):
    """On this toy the clipped-softmax nets are chaotic (a model retrained without a quarter
    of the samples agrees with the original on about 60 % of the test points), so the
    behaviour is asserted for the kernels whose training is stable here; the CIFAR-10
    measurement of every model is docs/unlearning.md's."""
    x, y, x_test, _ = data()
    gone = torch.arange(0, N, 4)  # a quarter of the samples
    model = train(kind)
    order = torch.tensor([i for i in _stream() if i % 4])
    retrained = train(kind, order=order)
    plain, fast = copy.deepcopy(model), copy.deepcopy(model)
    forget(plain, gone)
    receipt = forget_and_repair(fast, gone, labels=y, inputs=x)
    assert receipt.scan is not None and receipt.scan.clean
    assert any("re-wrote" in r for r in receipt.released["readout"])
    with torch.no_grad():
        want = retrained.eval()(x_test).softmax(1)
        gap_plain = (plain.eval()(x_test).softmax(1) - want).abs().sum(1).mean()
        gap_fast = (fast.eval()(x_test).softmax(1) - want).abs().sum(1).mean()
    assert gap_fast < 0.7 * gap_plain


def _stream():
    from rcdl.train.loop import epoch_permutation
    return epoch_permutation(N, 3, 0).tolist()


def test_a_budget_rewrites_only_the_first_steps():
    model = train("gws")
    forget(model, [0])
    layer = model.readout
    old = layer.store.values.clone()
    written = layer.store.written_at
    entries, steps = rewrite_readout(layer, data()[1], from_step=2, steps=3)
    assert steps == 3 and entries == int(((written >= 2) & (written <= 4)).sum())
    untouched = (written < 2) | (written > 4)
    assert torch.equal(layer.store.values[untouched], old[untouched])
    assert not torch.equal(layer.store.values[~untouched], old[~untouched])


def test_forgetting_nothing_in_the_readout_leaves_it_as_it_was():
    model = train("rbf")
    before = model.readout.store.values.clone()
    receipt = forget_and_repair(model, [N + 5], labels=data()[1])  # a sample never seen
    assert dict(receipt) == {name: 0 for name, _ in growing_layers(model)}
    assert torch.equal(model.readout.store.values, before)


def test_refusals_name_the_problem():
    y = data()[1]
    model = train("gws")
    with pytest.raises(ValueError, match="no module 'head'"):
        forget_and_repair(model, [1], labels=y, readout="head")
    with pytest.raises(TypeError, match="not a growing layer"):
        forget_and_repair(model, [1], labels=y, readout="norm")
    with pytest.raises(ValueError, match="labels for 10 samples"):
        forget_and_repair(model, [1], labels=y[:10])
    with pytest.raises(TypeError, match="boolean mask"):
        forget_and_repair(model, torch.zeros(N, dtype=torch.bool), labels=y)
    hybrid = HybridSoftmaxNet(D, CLASSES, 1, temperature=1.0, trigger=DistanceGate(3.0),
                              rule=ClippedSoftmaxRule(0.3, 3.0), initial_entries=4).double()
    with pytest.raises(ValueError, match="trained by an optimizer"):
        forget_and_repair(hybrid, [1], labels=y)
    decayed = GrowingRBFNet(D, CLASSES, 1, temperature=1.0,
                            rule=FunctionalSGD(1.0, weight_decay=0.1)).double()
    with pytest.raises(ValueError, match="weight decay or momentum"):
        forget_and_repair(decayed, [1], labels=y)


def test_store_rewrite_checks_before_writing():
    model = train("rbf")
    store = model.readout.store
    before = store.values.clone()
    with pytest.raises(ValueError, match="take values"):
        store.rewrite(slice(0, 4), values=torch.zeros(3, CLASSES, dtype=torch.float64))
    with pytest.raises(TypeError, match="float64"):
        store.rewrite(slice(0, 4), values=torch.zeros(4, CLASSES))
    bad = torch.zeros(4, CLASSES, dtype=torch.float64)
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite values"):
        store.rewrite(slice(0, 4), values=bad, weights=torch.ones(4, dtype=torch.float64))
    assert torch.equal(store.values, before)
    version = store.version
    store.rewrite(slice(2, 4), weights=torch.full((2,), 0.5, dtype=torch.float64))
    assert store.version == version + 1 and store.weights[2:4].tolist() == [0.5, 0.5]


def test_a_refused_request_removes_nothing():
    model = train("gws")
    sizes = [len(layer.store) for _, layer in growing_layers(model)]
    with pytest.raises(ValueError, match="inputs for 10 samples"):
        forget_and_repair(model, [1], labels=data()[1], inputs=data()[0][:10])
    assert [len(layer.store) for _, layer in growing_layers(model)] == sizes


@pytest.mark.parametrize("kind", ["gws", "rbf"])
def test_a_half_precision_readout_is_rewritten_to_its_rounding(kind):
    from rcdl.nn.layers import set_store_dtype
    model = build(kind).float()
    set_store_dtype(model, torch.bfloat16)
    x, y, _, _ = data()
    train_one_pass(model, (x.float(), y, x[:4].float(), y[:4]), batch_size=B, seed=3,
                   grower=Grower(model), loss_fn=F.cross_entropy, eval_every=1000,
                   progress=False, metrics={"acc": accuracy})
    layer = model.readout
    before = layer.store.values.float().clone()
    rewrite_readout(layer, y, from_step=1)
    assert layer.store.values.dtype == torch.bfloat16
    torch.testing.assert_close(layer.store.values.float(), before, rtol=0.05, atol=0.05)


def _half_readout_rewrites(kind):
    """A bfloat16 readout trained with native products, and how far its re-write, with
    nothing forgotten, lands from what training wrote: ``{mode: (values, weights)}`` of the
    absolute differences summed, re-written with the products training used (``native``)
    and with float32 products of the same stored numbers (``float32``)."""
    from rcdl.nn.layers import set_store_dtype
    from rcdl.ops.half import half_products

    x, y, _, _ = data()
    with half_products("native"):
        model = build(kind).float()
        set_store_dtype(model, torch.bfloat16)
        train_one_pass(model, (x.float(), y, x[:4].float(), y[:4]), batch_size=B, seed=3,
                       grower=Grower(model), loss_fn=F.cross_entropy, eval_every=1000,
                       progress=False, metrics={"acc": accuracy})
    written = {f: getattr(model.readout.store, f).float() for f in ("values", "weights")}
    gaps = {}
    for mode in ("native", "float32"):
        layer = copy.deepcopy(model.readout)
        with half_products(mode):
            rewrite_readout(layer, y, from_step=1)
        gaps[mode] = tuple(float((getattr(layer.store, f).float() - old).abs().sum())
                           for f, old in written.items())
    return gaps


@pytest.mark.parametrize("kind", ["rbf", "laplacian", "gauge"])
def test_a_half_precision_readout_is_rewritten_with_the_products_training_used(kind):
    """Nothing forgotten, the re-write of a bfloat16 readout multiplies as training did
    (queries and blocks rounded to bfloat16 before their products): closer to what training
    wrote than float32 products of the same numbers, and for the kernels that do not
    normalise, re-written in one block, bit for bit where bfloat16 is multiplied natively
    (the same sums in the same order). The softmax's partial over the rows before the
    re-written ones is merged with theirs, not summed with them in one product as in
    training, so its rounding differs there."""
    from rcdl.ops.half import native_products

    gaps = _half_readout_rewrites(kind)
    assert sum(gaps["native"]) < sum(gaps["float32"]), gaps
    if kind != "gauge" and native_products(torch.bfloat16):
        assert gaps["native"] == (0.0, 0.0), gaps
