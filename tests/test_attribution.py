"""Entry shares (rcdl.memory.attribution): exact per layer, first-order through a model."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import Grower, GrowingLayer, GrowingRBFNet, GrowingSoftmaxNet
from rcdl.memory.attribution import entry_contributions, explain
from rcdl.nn.rules import FunctionalSGD
from rcdl.ops.kernels import KERNELS
from rcdl.optim._step import commit

D_IN, D_OUT, N, B = 6, 4, 300, 5


def filled_layer(kernel: str, seed: int = 0, decay: float = 0.0) -> GrowingLayer:
    gen = torch.Generator().manual_seed(seed)
    layer = GrowingLayer(D_IN, D_OUT, kernel=kernel, temperature=0.7, dtype=torch.float64,
                         rule=FunctionalSGD(0.1, weight_decay=decay))
    for _ in range(3):  # three steps, so that the entries have ages
        b = N // 3
        keys = torch.randn(b, D_IN, generator=gen, dtype=torch.float64)
        values = torch.randn(b, D_OUT, generator=gen, dtype=torch.float64)
        weights = torch.rand(b, generator=gen, dtype=torch.float64) + 0.1
        commit(layer, (layer.query_keys(keys), values, weights))
    return layer


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("decay", [0.0, 0.5])
def test_the_shares_sum_to_the_layers_output(kernel, decay):
    layer = filled_layer(kernel, decay=decay)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    eye = torch.eye(D_OUT, dtype=torch.float64)
    shares = torch.stack([entry_contributions(layer, x, eye[i].expand(B, D_OUT),
                                              chunk_size=64) for i in range(D_OUT)], 2)
    assert shares.shape == (B, N, D_OUT)
    with torch.no_grad():
        out = layer.attend(layer.query_keys(x))
    assert_close(shares.sum(1), out, rtol=1e-10, atol=1e-12)


def test_softmax_shares_with_negative_weights_use_the_guarded_denominator():
    layer = filled_layer("softmax", seed=2)
    with torch.no_grad():
        layer.store.weights[::2] *= -1.0  # the denominator may come near 0: the guard acts
    x = torch.randn(B, D_IN, dtype=torch.float64)
    u = torch.randn(B, D_OUT, dtype=torch.float64)
    with torch.no_grad():
        out = layer.attend(layer.query_keys(x))
    assert_close(entry_contributions(layer, x, u).sum(1), (u * out).sum(1),
                 rtol=1e-9, atol=1e-12)


def test_bad_shapes_are_named():
    layer = filled_layer("rbf")
    with pytest.raises(ValueError, match=r"expected inputs \(B, 6\)"):
        entry_contributions(layer, torch.zeros(2, 5, dtype=torch.float64),
                            torch.zeros(2, D_OUT, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"expected a direction \(2, 4\)"):
        entry_contributions(layer, torch.zeros(2, D_IN, dtype=torch.float64),
                            torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("net", ["rbf", "softmax"])
def test_explain_gives_the_readouts_exact_shares_of_the_explained_logit(net):
    torch.manual_seed(0)
    d, classes = 8, 3
    if net == "rbf":
        model = GrowingRBFNet(d, classes, 2, temperature=1.0, rule=FunctionalSGD(1.0)).double()
    else:
        from rcdl.nn.rules import ClippedSoftmaxRule
        model = GrowingSoftmaxNet(d, classes, 2, temperature=1.0,
                                  rule=ClippedSoftmaxRule(0.1, 3.0)).double()
    grower = Grower(model)
    x = torch.randn(96, d, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    for i in range(0, 96, 16):
        F.cross_entropy(model(x[i:i + 16]), y[i:i + 16]).backward()
        grower.step()
        grower.zero_grad()
    x_test = torch.randn(4, d, dtype=torch.float64)
    readout_name, readout = [(n, m) for n, m in model.named_modules()
                             if isinstance(m, GrowingLayer)][-1]
    size = len(readout.store)
    sizes = [len(m.store) for m in model.modules() if isinstance(m, GrowingLayer)]
    exp = explain(model, x_test, k=size)
    assert model.training  # restored
    assert set(exp.layers) == {n for n, m in model.named_modules() if isinstance(m, GrowingLayer)}
    with torch.no_grad():
        logits = model.eval()(x_test)
    assert_close(exp.output, logits.gather(1, exp.target[:, None]).squeeze(1))
    values, ids = exp.layers[readout_name]
    assert values.shape == ids.shape == (4, size)
    assert bool((values[:, :-1] >= values[:, 1:]).all())  # largest first
    # the readout's output is the logit (plus its initial part, if any): its shares sum to it
    initial = logits - readout.attend(readout.query_keys(_readout_input(model, x_test)))
    expected = exp.output - initial.gather(1, exp.target[:, None]).squeeze(1)
    assert_close(values.sum(1), expected, rtol=1e-9, atol=1e-10)
    assert sizes == [len(m.store) for m in model.modules() if isinstance(m, GrowingLayer)]


def _readout_input(model, x):
    seen = {}
    readout = [m for m in model.modules() if isinstance(m, GrowingLayer)][-1]
    handle = readout.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model.eval()(x)
    handle.remove()
    return seen["x"]


def test_explain_sums_each_training_samples_contributions_over_its_entries():
    from rcdl.memory.provenance import entry_samples
    from rcdl.train.loop import accuracy, train_one_pass

    torch.manual_seed(0)
    d, classes, n = 8, 3, 64
    model = GrowingRBFNet(d, classes, 2, temperature=1.0, rule=FunctionalSGD(1.0)).double()
    x = torch.randn(n + 8, d, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    train_one_pass(model, (x[:n], y[:n], x[n:], y[n:]), batch_size=16, grower=Grower(model),
                   loss_fn=F.cross_entropy, metrics={"acc": accuracy}, eval_every=100,
                   progress=False)
    exp = explain(model, x[n:n + 3], k=10 * n)
    values, owners = exp.samples
    assert values.shape == owners.shape == (3, n)  # every training sample, once
    assert sorted(owners[0].tolist()) == list(range(n))
    assert bool((values[:, :-1] >= values[:, 1:]).all())
    # the per-sample totals are the per-entry contributions regrouped
    layer_total = sum(v.sum(1) for v, _ in exp.layers.values())
    assert_close(values.sum(1), layer_total, rtol=1e-9, atol=1e-12)
    name, readout = list(exp.layers.items())[-1]
    contrib, ids = readout
    sample_of_top = {int(i): int(s) for i, s in zip(
        [m for m in model.modules() if isinstance(m, GrowingLayer)][-1].store.ids.tolist(),
        entry_samples([m for m in model.modules() if isinstance(m, GrowingLayer)][-1]).tolist(),
        strict=True)}
    assert all(sample_of_top[int(i)] in range(n) for i in ids[0])


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_deletion_effects_are_the_change_from_deleting_each_entry(kernel):
    """float64: for every entry, the exact change of ⟨u, s(x)⟩ when it alone is deleted;
    for the softmax it differs from minus the share (the normaliser shrinks too)."""
    from rcdl.memory.attribution import deletion_effects

    layer = filled_layer(kernel, seed=3)
    n = 30
    layer.remove_entries(torch.arange(len(layer.store)) >= n)  # a small store
    x = torch.randn(B, D_IN, dtype=torch.float64)
    u = torch.randn(B, D_OUT, dtype=torch.float64)
    got = deletion_effects(layer, x, u, chunk=7)
    with torch.no_grad():
        base = (u * layer.attend(layer.query_keys(x))).sum(1)
    for j in range(n):
        deleted = copy.deepcopy(layer)
        deleted.remove_entries(torch.arange(n) == j)
        with torch.no_grad():
            after = (u * deleted.attend(deleted.query_keys(x))).sum(1)
        assert_close(got[:, j], after - base, rtol=1e-9, atol=1e-12)
    share = entry_contributions(layer, x, u)
    if kernel == "softmax":
        assert not torch.allclose(got, -share)
    else:
        assert_close(got, -share)
