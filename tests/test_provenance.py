"""Provenance (rcdl.provenance): every entry knows the training sample that wrote it, and
forget() removes a sample's entries."""

import pytest
import torch
import torch.nn.functional as F

from rcdl import Grower, GrowingRBF, GrowingRBFNet, HybridGrower, HybridSoftmaxNet
from rcdl.gates import AlwaysGrow, DistanceGate
from rcdl.layers import growing_layers
from rcdl.provenance import UNKNOWN, entry_samples, forget, samples
from rcdl.rules import ClippedSoftmaxRule, FunctionalSGD
from rcdl.training import accuracy, train_one_pass

D, CLASSES, N = 8, 3, 96


def data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N + 32, D, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x[:N], y[:N], x[N:], y[N:]


def rbf_net():
    torch.manual_seed(0)
    return GrowingRBFNet(D, CLASSES, 2, temperature=1.0, rule=FunctionalSGD(1.0))


def test_train_one_pass_tags_every_entry_with_its_training_sample():
    model = rbf_net()
    train_one_pass(model, data(), batch_size=16, grower=Grower(model), loss_fn=F.cross_entropy,
                   eval_every=100, progress=False,
                   metrics={"acc": accuracy})
    x_train = data()[0]
    for _, layer in growing_layers(model):
        owners = entry_samples(layer)
        assert sorted(owners.tolist()) == list(range(N))  # one entry per sample, all known
    first = growing_layers(model)[0][1]
    # the first layer's keys are its inputs: each entry's key is its sample's (normalised) row
    normalised = model.norm(x_train) if hasattr(model, "norm") else None
    if normalised is not None:
        torch.testing.assert_close(first.store.keys, normalised[entry_samples(first)])


@pytest.mark.parametrize("trigger", ["always", "distance"])
def test_a_gated_hybrid_tags_the_entries_it_keeps(trigger):
    torch.manual_seed(0)
    gate = AlwaysGrow() if trigger == "always" else DistanceGate(2.5)
    model = HybridSoftmaxNet(D, CLASSES, 2, temperature=1.0, trigger=gate,
                             rule=ClippedSoftmaxRule(0.3, 3.0), initial_entries=4)
    train_one_pass(model, data(), batch_size=16, grower=HybridGrower(model, lr=1e-3),
                   loss_fn=F.cross_entropy, eval_every=100, progress=False,
                   metrics={"acc": accuracy})
    for _, layer in growing_layers(model):
        owners = entry_samples(layer)
        assert bool((owners[:4] == UNKNOWN).all())  # the initial entries
        written = owners[4:]
        assert bool((written >= 0).all()) and written.unique().numel() == written.numel()
        assert written.numel() == int(layer.entries_written)
        if trigger == "always":
            assert sorted(written.tolist()) == list(range(N))


def test_rows_of_one_sample_share_its_index_and_a_loop_of_ones_own_passes_them():
    layer = GrowingRBF(D, 2, temperature=1.0, rule=FunctionalSGD(1.0))
    grower = Grower(layer)
    x = torch.randn(4, 3, D)  # 4 samples of 3 rows each (tokens, say)
    with samples(layer, torch.tensor([10, 11, 12, 13])):
        layer(x).square().mean().backward()
    grower.step()
    assert entry_samples(layer).tolist() == [10, 10, 10, 11, 11, 11, 12, 12, 12, 13, 13, 13]
    layer(torch.randn(2, D)).square().mean().backward()  # no indices given: unknown
    grower.step()
    assert entry_samples(layer)[-2:].tolist() == [UNKNOWN, UNKNOWN]
    with (pytest.raises(ValueError, match="3 sample indices were given for a batch of 4"),
          samples(layer, torch.tensor([1, 2, 3]))):
        layer(torch.randn(4, D))


def test_provenance_survives_removal_a_state_dict_and_loads_as_unknown_from_an_older_one():
    model = rbf_net()
    train_one_pass(model, data(), batch_size=16, grower=Grower(model), loss_fn=F.cross_entropy,
                   eval_every=100, progress=False,
                   metrics={"acc": accuracy})
    layer = growing_layers(model)[0][1]
    before = entry_samples(layer).clone()
    layer.remove_entries(torch.arange(len(layer.store)) % 3 == 0)
    assert entry_samples(layer).tolist() == [s for i, s in enumerate(before.tolist()) if i % 3]
    state = model.state_dict()
    other = rbf_net()
    other.load_state_dict(state)
    assert entry_samples(growing_layers(other)[0][1]).tolist() == entry_samples(layer).tolist()
    older = {k: v for k, v in state.items() if not k.endswith("provenance.samples")}
    third = rbf_net()
    third.load_state_dict(older)
    loaded = growing_layers(third)[0][1]
    assert bool((entry_samples(loaded) == UNKNOWN).all()) and len(loaded.store) > 0
    assert loaded.provenance.loaded_without_samples


def test_forget_removes_every_entry_of_the_samples_in_every_layer():
    model = rbf_net()
    train_one_pass(model, data(), batch_size=16, grower=Grower(model), loss_fn=F.cross_entropy,
                   eval_every=100, progress=False,
                   metrics={"acc": accuracy})
    gone = list(range(0, N, 4))
    removed = forget(model, gone)
    assert removed == {name: len(gone) for name, _ in growing_layers(model)}
    for _, layer in growing_layers(model):
        owners = set(entry_samples(layer).tolist())
        assert not owners & set(gone) and len(owners) == N - len(gone)
    assert forget(model, gone) == {name: 0 for name, _ in growing_layers(model)}


def test_forget_is_exact_where_no_entry_depended_on_another():
    """One growing layer trained by one batch from an empty store: every entry comes from
    its own sample alone (k = q, v = −η g with g = ∂ℓ/∂s at s = 0), so forgetting samples
    leaves exactly the store of a layer trained without them."""
    torch.manual_seed(0)
    x, y = torch.randn(20, D), torch.randn(20, 2)
    kept = [i for i in range(20) if i not in (3, 7)]
    stores = []
    for rows in (list(range(20)), kept):
        layer = GrowingRBF(D, 2, temperature=1.0, rule=FunctionalSGD(1.0))
        grower = Grower(layer)
        with samples(layer, torch.tensor(rows)):
            F.mse_loss(layer(x[rows]), y[rows]).backward()
        grower.step()
        stores.append(layer)
    full, without = stores
    assert forget(full, [3, 7]) == {"": 2}
    torch.testing.assert_close(full.store.keys, without.store.keys)
    torch.testing.assert_close(full.store.values, without.store.values)
    assert entry_samples(full).tolist() == kept
