"""The entry store: growth, removal, state dict, moves, refused writes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from rcdl.nn.store import EntryStore, format_bytes


def rows(b, d_in=3, d_out=2, start=0):
    keys = torch.arange(start, start + b, dtype=torch.float32)[:, None].expand(b, d_in) * 1.0
    values = -keys[:, :1].expand(b, d_out).clone()
    return keys.clone(), values, torch.full((b,), 0.5)


def test_append_views_and_sizes():
    store = EntryStore(3, 2)
    store.append(*rows(4), written_at=7)
    assert len(store) == 4
    assert store.keys.shape == (4, 3) and store.values.shape == (4, 2)
    assert store.written_at.tolist() == [7] * 4
    assert store.ids.tolist() == [0, 1, 2, 3] and store.next_id == 4
    assert store.nbytes == 4 * ((3 + 2 + 1) * 4 + 8 + 8)  # + written_at and id
    assert "N=4" in repr(store) and "used" in repr(store)


def test_growth_is_geometric_not_per_step():
    store = EntryStore(3, 2)
    reallocations, last = 0, store._keys.data_ptr()
    for step in range(200):
        store.append(*rows(16, start=16 * step))
        if store._keys.data_ptr() != last:
            reallocations, last = reallocations + 1, store._keys.data_ptr()
    assert len(store) == 3200
    assert reallocations <= 16  # log_1.5(3200 / 16) + 1 ≈ 14
    assert_close(store.keys[:, 0], torch.arange(3200, dtype=torch.float32))


def test_reserve_avoids_reallocation():
    store = EntryStore(3, 2)
    store.reserve(100)
    ptr = store._keys.data_ptr()
    for step in range(10):
        store.append(*rows(10, start=10 * step))
    assert store._keys.data_ptr() == ptr and store.capacity == 100


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 7), st.lists(st.booleans(), max_size=40)), max_size=25))
def test_matches_a_list_model(ops):
    """Appends and masked removals behave like a Python list of rows; every row keeps the
    id it was written with."""
    store, model, counter = EntryStore(3, 2, growth=1.3), [], 0
    for op in ops:
        if isinstance(op, int):
            store.append(*rows(op, start=counter), written_at=counter)
            model += [(counter + i, counter) for i in range(op)]
            counter += op
        else:
            mask = (op + [False] * len(model))[: len(model)]
            removed = store.remove(torch.tensor(mask, dtype=torch.bool))
            assert removed == sum(mask)
            model = [m for m, drop in zip(model, mask, strict=False) if not drop]
        assert len(store) == len(model)
        assert store.keys[:, 0].tolist() == [float(k) for k, _ in model]
        assert store.values[:, 1].tolist() == [-float(k) for k, _ in model]
        assert store.written_at.tolist() == [t for _, t in model]
        assert store.ids.tolist() == [k for k, _ in model]


def test_compact_releases_capacity():
    store = EntryStore(3, 2, capacity=100)
    store.append(*rows(5))
    store.compact()
    assert store.capacity == 5 and store.reserved_nbytes == store.nbytes
    store.append(*rows(1, start=5))
    assert store.keys[:, 0].tolist() == [0, 1, 2, 3, 4, 5]


def test_state_dict_round_trip_holds_live_rows_only():
    store = EntryStore(3, 2, capacity=64)
    store.append(*rows(6), written_at=3)
    state = store.state_dict()
    assert state["keys"].shape == (6, 3)
    fresh = EntryStore(3, 2)
    fresh.load_state_dict(state)
    for name in ("keys", "values", "weights", "written_at", "ids"):
        assert torch.equal(getattr(fresh, name), getattr(store, name))
    fresh.append(*rows(1))
    assert fresh.ids.tolist() == [0, 1, 2, 3, 4, 5, 6]  # numbering goes on after a load
    with pytest.raises(RuntimeError, match="expects"):
        EntryStore(4, 2).load_state_dict(state)


def test_explicit_ids_and_taken_ids():
    """A sharded layer takes the ids of a whole batch and appends its own rows with theirs."""
    store = EntryStore(3, 2)
    ids = store.new_ids(5)
    store.append(*rows(2), ids=ids[1::3])
    assert store.ids.tolist() == [1, 4] and store.next_id == 5
    store.append(*rows(1))
    assert store.ids.tolist() == [1, 4, 5]
    with pytest.raises(ValueError, match="ids must be an int64 tensor of shape"):
        store.append(*rows(2), ids=torch.tensor([1.0, 2.0]))


def test_dtype_and_device_moves_keep_entries():
    store = EntryStore(3, 2)
    store.append(*rows(3))
    store.double()
    assert store.dtype == torch.float64 and store.written_at.dtype == torch.long
    assert store.keys[:, 0].tolist() == [0.0, 1.0, 2.0]
    store.to("cpu", torch.float32)
    assert store.values.dtype == torch.float32


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda k, v, w: (k[:, :2], v, w), ValueError, "keys must have shape"),
        (lambda k, v, w: (k, v[:2], w), ValueError, "same B"),
        (lambda k, v, w: (k.double(), v, w), TypeError, "dtype"),
        (lambda k, v, w: (k, v.clone().fill_(float("nan")), w), ValueError, "NaN"),
        (lambda k, v, w: (k, v, w.clone().fill_(float("inf"))), ValueError, "NaN or inf"),
    ],
    ids=["width", "batch", "dtype", "nan", "inf"],
)
def test_refused_append_leaves_store_unchanged(change, error, match):
    store = EntryStore(3, 2)
    store.append(*rows(2))
    before = {k: v.clone() for k, v in store.state_dict().items()}
    with pytest.raises(error, match=match):
        store.append(*change(*rows(3, start=2)))
    for k, v in store.state_dict().items():
        assert torch.equal(v, before[k])


def test_bad_construction_and_mask():
    with pytest.raises(ValueError, match="widths must be positive"):
        EntryStore(0, 2)
    with pytest.raises(ValueError, match="growth factor"):
        EntryStore(2, 2, growth=1.0)
    store = EntryStore(3, 2)
    store.append(*rows(2))
    with pytest.raises(ValueError, match="bool tensor of shape"):
        store.remove(torch.tensor([1, 0]))


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3_100_000_000) == "3.10 GB"


def _filled_store(n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    store = EntryStore(3, 2)
    store.append(torch.randn(n, 3, generator=gen), torch.randn(n, 2, generator=gen),
                 torch.rand(n, generator=gen), written_at=4)
    return store


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        pytest.param(lambda s: s["keys"].__setitem__((1, 0), float("nan")), "keys contain NaN",
                     id="nan-keys"),
        pytest.param(lambda s: s["weights"].__setitem__(0, float("inf")), "weights contain NaN",
                     id="inf-weights"),
        pytest.param(lambda s: s.__setitem__("values", torch.zeros(4, 7)), "expects",
                     id="wrong-width"),
        pytest.param(lambda s: s.__setitem__("weights", torch.zeros(2)), "rows disagree",
                     id="wrong-rows"),
        pytest.param(lambda s: s.__setitem__("written_at", torch.zeros(4)), "integers",
                     id="float-steps"),
    ],
)
def test_refused_load_leaves_the_store_as_it_was(damage, match):
    state = {k: v.clone() for k, v in _filled_store(4, seed=1).state_dict().items()}
    damage(state)
    store = _filled_store()
    before = {k: v.clone() for k, v in store.state_dict().items()}
    with pytest.raises(RuntimeError, match=match):
        store.load_state_dict(state)
    after = store.state_dict()
    assert len(store) == 5
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def test_non_persistent_store_is_left_out_of_state_dicts():
    store = EntryStore(3, 2, persistent=False)
    store.append(torch.zeros(2, 3), torch.zeros(2, 2))
    assert store.state_dict() == {}
    store.load_state_dict({})  # nothing missing, nothing loaded
    assert len(store) == 2
