"""Provenance (rcdl.memory.provenance): every entry knows the training sample that wrote it, and
forget() removes a sample's entries."""

import pytest
import torch
import torch.nn.functional as F

from rcdl import Grower, GrowingRBF, GrowingRBFNet, HybridGrower, HybridSoftmaxNet
from rcdl.memory.forgetting import forget
from rcdl.memory.provenance import UNKNOWN, entry_samples, samples
from rcdl.nn.gates import AlwaysGrow, DistanceGate
from rcdl.nn.layers import growing_layers
from rcdl.nn.rules import ClippedSoftmaxRule, FunctionalSGD
from rcdl.train.loop import accuracy, train_one_pass

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
    grower = HybridGrower(model, lr=1e-3)
    train_one_pass(model, data(), batch_size=16, grower=grower,
                   loss_fn=F.cross_entropy, eval_every=100, progress=False,
                   metrics={"acc": accuracy})
    for name, layer in growing_layers(model):
        owners = entry_samples(layer)
        assert bool((owners[:4] == UNKNOWN).all())  # the initial entries
        written = owners[4:]
        assert bool((written >= 0).all()) and written.unique().numel() == written.numel()
        assert written.numel() == grower.growth[name].written
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


# --------------------------------------------------------------------------- merge counts


def _six_entries():
    """A growing RBF layer whose six entries (keys: their inputs) come from samples 10..15:
    ids 0..5 at x₀ = 0, 0.1, 5, 5.1, −0.1, 10 (in every coordinate)."""
    from rcdl.memory.provenance import merged_counts

    layer = GrowingRBF(D, 2, temperature=1.0, rule=FunctionalSGD(1.0))
    grower = Grower(layer)
    x = torch.tensor([0.0, 0.1, 5.0, 5.1, -0.1, 10.0])[:, None].expand(6, D).contiguous()
    with samples(layer, torch.arange(10, 16)):
        F.mse_loss(layer(x), torch.ones(6, 2)).backward()
    grower.step()
    assert merged_counts(layer).tolist() == [0] * 6
    return layer


def test_a_merge_counts_the_entries_each_survivor_absorbed_and_keeps_its_sample():
    from rcdl.memory.budgets import merge_into_nearest
    from rcdl.memory.provenance import merged_counts

    layer = _six_entries()
    evicted = torch.tensor([False, True, False, False, True, False])  # ids 1 and 4 go into 0
    assert merge_into_nearest(layer, evicted).tolist() == [0, 0]
    layer.remove_entries(evicted)
    assert layer.store.ids.tolist() == [0, 2, 3, 5]
    assert merged_counts(layer).tolist() == [2, 0, 0, 0]
    assert entry_samples(layer).tolist() == [10, 12, 13, 15]  # each keeps its own sample
    # id 0, which had absorbed two, goes into id 2 (x = 5 is nearer 0 than 5.1 and 10):
    # id 2 now holds three entries besides its own
    evicted = torch.tensor([True, False, False, False])
    merge_into_nearest(layer, evicted)
    layer.remove_entries(evicted)
    assert merged_counts(layer).tolist() == [3, 0, 0]
    assert layer.provenance.absorbed(torch.tensor([0, 2, 99])).tolist() == [2, 3, 0]


def test_a_merging_budget_counts_every_entry_it_merged_away():
    from rcdl import MemoryBudget
    from rcdl.memory.provenance import merged_counts

    model = rbf_net()
    grower = Grower(model, budget=MemoryBudget(20, "oldest", merge=True, slack=4))
    train_one_pass(model, data(), batch_size=16, grower=grower, loss_fn=F.cross_entropy,
                   eval_every=100, progress=False, metrics={"acc": accuracy})
    for name, layer in growing_layers(model):
        counts = merged_counts(layer)
        assert counts.shape == (len(layer.store),) and len(layer.store) <= 20
        # every entry merged away is counted once, by the entry that holds it now
        assert int(counts.sum()) == grower.evicted[name] == N - len(layer.store) > 0
        owners = entry_samples(layer)
        assert bool((owners >= 0).all()) and owners.unique().numel() == owners.numel()


def test_merge_counts_survive_a_state_dict_and_load_as_zeros_from_an_older_one():
    from rcdl import MemoryBudget
    from rcdl.memory.provenance import merged_counts

    model = rbf_net()
    grower = Grower(model, budget=MemoryBudget(20, "contribution", merge=True))
    train_one_pass(model, data(), batch_size=16, grower=grower, loss_fn=F.cross_entropy,
                   eval_every=100, progress=False, metrics={"acc": accuracy})
    state = model.state_dict()
    assert any(key.endswith("provenance.merged") for key in state)
    layers = [layer for _, layer in growing_layers(model)]
    assert all(int(merged_counts(layer).sum()) > 0 for layer in layers)
    other = rbf_net()
    other.load_state_dict(state)
    for mine, theirs in zip(layers, [la for _, la in growing_layers(other)], strict=True):
        assert merged_counts(theirs).tolist() == merged_counts(mine).tolist()
    older = {k: v for k, v in state.items() if not k.endswith("provenance.merged")}
    third = rbf_net()
    third.load_state_dict(older)  # strict: the missing counts are not an error
    for mine, loaded in zip(layers, [la for _, la in growing_layers(third)], strict=True):
        assert merged_counts(loaded).tolist() == [0] * len(mine.store)
        assert entry_samples(loaded).tolist() == entry_samples(mine).tolist()
        assert not loaded.provenance.loaded_without_samples


def test_merge_counts_of_another_length_than_the_samples_are_refused():
    model = rbf_net()
    state = model.state_dict()
    key = next(k for k in state if k.endswith("provenance.merged"))
    state[key] = torch.zeros(3, dtype=torch.long)
    with pytest.raises(RuntimeError, match="merged must have one count per id"):
        model.load_state_dict(state)
