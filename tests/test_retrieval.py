"""Approximate retrieval (rcdl.retrieval.topk) against dense references: the exact index against
brute force, top-k attention against the exact attention (float64), the left-out bound,
FAISS against the exact index, the layer mode following its store, its index saved with a
checkpoint, and the hybrid trained on top-k attention against dense twins.

The FAISS tests skip where the ``faiss`` extra is not installed, except under ``make test``
(which installs it and sets ``RCDL_REQUIRE_EXTRAS=classical,faiss``: there a missing faiss
fails, so the CI runs them; tests/conftest.py); everything else runs on the torch index."""

import copy
import io
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import (
    MLP,
    ClippedSoftmaxRule,
    FunctionalSGD,
    Grower,
    GrowingRBFNet,
    GrowingSoftmaxNet,
    HybridSoftmaxNet,
    to_dual_form,
)
from rcdl.app.data import TeacherConfig, make_teacher_data
from rcdl.nn.gates import DistanceGate
from rcdl.nn.hybrid import HybridSoftmax, hybrid_layers
from rcdl.nn.layers import growing_layers
from rcdl.ops.attention import attention
from rcdl.ops.kernels import KERNELS as REGISTRY
from rcdl.ops.kernels import naive_attention
from rcdl.optim.entry_adam import EntryAdam
from rcdl.optim.hybrid_grower import HybridGrower
from rcdl.retrieval.indices import ExactIndex, FaissIndex, RetrievalIndex, metric_for
from rcdl.retrieval.topk import (
    TopK,
    load_retrieval_state,
    recall_at_k,
    retrieval_state,
    topk_attention,
    use_exact,
    use_topk,
)
from rcdl.train.loop import train_one_pass

try:
    import faiss  # noqa: F401
except ImportError:
    faiss = None
requires_faiss = pytest.mark.extra("faiss")  # skips without faiss unless it is required

KERNELS = [name for name, k in REGISTRY.items() if k.index_metric]  # those with top-k
TEMPERATURE = {name: 1.0 for name in KERNELS} | {"rbf": 2.0, "softmax": 0.7}


def make_entries(n, d_in=5, d_out=3, batch=4, seed=0, weights="positive"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, d_in, generator=gen, dtype=torch.float64)
    keys = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    values = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    w = torch.rand(n, generator=gen, dtype=torch.float64) + 0.1
    if weights == "signed":
        w = w - 0.6
    elif weights == "spread":  # weights over six orders of magnitude: rescoring matters
        w = torch.exp(6 * torch.randn(n, generator=gen, dtype=torch.float64))
    return q, keys, values, w


def exact_index(kernel, keys):
    index = ExactIndex(metric_for(kernel), dtype=torch.float64, chunk_size=7)
    index.add(keys)
    return index


def log_kappa(kernel, q, keys):  # (B, N) dense log kernel values
    tau = TEMPERATURE[kernel] * q.shape[1] ** 0.5
    if kernel == "softmax":
        return q @ keys.T / tau
    return -torch.cdist(q, keys) ** 2 / (2 * tau)


# --------------------------------------------------------------------------- indices


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_exact_index_matches_brute_force(metric):
    q, keys, _, _ = make_entries(50)
    index = ExactIndex(metric, dtype=torch.float64, chunk_size=8)  # ragged chunks
    for part in keys.split(13):  # added in pieces, as a growing store is
        index.add(part)
    scores, found = index.search(q, 6)
    brute = q @ keys.T if metric == "ip" else torch.cdist(q, keys) ** 2  # (B, N)
    best = brute.topk(6, dim=1, largest=metric == "ip")
    assert torch.equal(found, best.indices)
    assert_close(scores, best.values)
    assert len(index) == 50 and index.nbytes == 50 * 5 * 8
    assert isinstance(index, RetrievalIndex)
    index.reset()
    assert len(index) == 0


def test_exact_index_refuses_bad_searches():
    index = ExactIndex("l2")
    index.add(torch.randn(4, 3))
    with pytest.raises(ValueError, match="more than the 4 keys"):
        index.search(torch.randn(2, 3), 5)
    with pytest.raises(ValueError, match=r"expected queries \(B, 3\)"):
        index.search(torch.randn(2, 4), 1)
    with pytest.raises(ValueError, match=r"expected keys \(n, 3\)"):
        index.add(torch.randn(2, 4))
    with pytest.raises(ValueError, match="unknown metric"):
        ExactIndex("cosine")


def test_recall_at_k():
    exact = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    approx = torch.tensor([[3, 1, 9, 8], [7, 6, 5, -1]])
    assert recall_at_k(approx, exact) == pytest.approx((2 / 4 + 3 / 4) / 2)
    assert recall_at_k(exact, exact) == 1.0


# --------------------------------------------------------------------------- top-k attention


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("weights", ["positive", "signed"])
@pytest.mark.parametrize("k", [23, 40], ids=["k=N", "k>N"])
def test_all_entries_kept_is_the_exact_attention(kernel, weights, k):
    """With k ≥ N every entry is kept: outputs and query gradients equal the streaming
    attention's in float64, and nothing is left out."""
    q, keys, values, w = make_entries(23, weights=weights)
    q.requires_grad_()
    t = TEMPERATURE[kernel]
    result = topk_attention(q, keys, values, w, kernel=kernel, temperature=t,
                            index=exact_index(kernel, keys), k=k)
    exact = attention(q, keys, values, w, kernel=kernel, temperature=t)
    assert_close(result.out, exact, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(exact)
    (g_topk,) = torch.autograd.grad(result.out, q, grad_out)
    (g_exact,) = torch.autograd.grad(exact, q, grad_out)
    assert_close(g_topk, g_exact, rtol=1e-10, atol=1e-12)
    assert torch.equal(result.left_out, torch.zeros(4, dtype=torch.float64))
    assert torch.equal(result.indices.sort(1).values, torch.arange(23).expand(4, -1))


def test_rbf_top_k_is_the_dense_reference_over_the_nearest_keys():
    q, keys, values, w = make_entries(60, batch=5)
    result = topk_attention(q, keys, values, w, kernel="rbf", temperature=2.0,
                            index=exact_index("rbf", keys), k=9)
    nearest = torch.cdist(q, keys).topk(9, dim=1, largest=False).indices  # (B, 9)
    for i, rows in enumerate(nearest):
        assert set(result.indices[i].tolist()) == set(rows.tolist())
        ref = naive_attention(q[i : i + 1], keys[rows], values[rows], w[rows], kernel="rbf",
                              temperature=2.0)
        assert_close(result.out[i : i + 1], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weights", ["spread", "signed"])
def test_softmax_rescoring_keeps_the_top_k_by_logit_plus_log_weight(weights):
    """Candidates by inner product, then the k best by z + log|w| among them, and the
    weighted softmax over exactly those."""
    q, keys, values, w = make_entries(80, batch=6, weights=weights)
    k, c = 5, 20
    result = topk_attention(q, keys, values, w, kernel="softmax", temperature=0.7,
                            index=exact_index("softmax", keys), k=k, candidates=c)
    z = log_kappa("softmax", q, keys)  # (B, N)
    candidates = z.topk(c, dim=1).indices  # (B, c)
    score = z.gather(1, candidates) + w[candidates].abs().log()
    expected = candidates.gather(1, score.topk(k, dim=1).indices)  # (B, k)
    assert torch.equal(result.indices, expected)
    assert not torch.equal(expected.sort(1).values, z.topk(k, dim=1).indices.sort(1).values)
    for i, rows in enumerate(expected):
        ref = naive_attention(q[i : i + 1], keys[rows], values[rows], w[rows],
                              kernel="softmax", temperature=0.7)
        assert_close(result.out[i : i + 1], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("k", "candidates"), [(4, None), (4, 16), (30, None)])
def test_left_out_estimate_bounds_the_true_left_out_mass(kernel, k, candidates):
    """With an exact index, ρ̂ ≥ Σ_{j∉K} |w_j| κ_j / Σ_j |w_j| κ_j for every query."""
    q, keys, values, w = make_entries(70, batch=8, weights="spread", seed=3)
    q = 3 * q  # peaked kernels: left-out fractions spread over (0, 1)
    result = topk_attention(q, keys, values, w, kernel=kernel, temperature=TEMPERATURE[kernel],
                            index=exact_index(kernel, keys), k=k, candidates=candidates)
    mass = w.abs() * log_kappa(kernel, q, keys).exp()  # (B, N)
    kept = mass.gather(1, result.indices).sum(1)
    true = 1 - kept / mass.sum(1)  # (B,)
    assert (result.left_out >= true - 1e-12).all()
    assert (result.left_out <= 1).all() and (true > 1e-6).any()


@pytest.mark.parametrize("kernel", KERNELS)
def test_half_precision_store(kernel):
    """bfloat16 keys and values (float32 queries and weights): the index compares float32
    copies of the keys, the values are gathered and cast; k = N agrees with the streaming
    attention, which multiplies in bfloat16, to bfloat16 rounding."""
    q, keys, values, w = (t.float() for t in make_entries(30, batch=6))
    keys, values = keys.bfloat16(), values.bfloat16()
    index = ExactIndex(metric_for(kernel))
    index.add(keys)
    t = TEMPERATURE[kernel]
    result = topk_attention(q, keys, values, w, kernel=kernel, temperature=t, index=index, k=30)
    exact = attention(q, keys, values, w, kernel=kernel, temperature=t)
    assert result.out.dtype == torch.float32
    assert_close(result.out, exact, rtol=2e-2, atol=2e-2)


def test_empty_store_answers_zero():
    q = torch.randn(3, 4, dtype=torch.float64)
    empty = torch.empty(0, 4, dtype=torch.float64)
    result = topk_attention(q, empty, torch.empty(0, 2, dtype=torch.float64),
                            torch.empty(0, dtype=torch.float64), kernel="softmax",
                            index=ExactIndex("ip"), k=5)
    assert torch.equal(result.out, torch.zeros(3, 2, dtype=torch.float64))


def test_topk_attention_refuses_bad_input():
    q, keys, values, w = make_entries(10)
    index = exact_index("softmax", keys)
    kw = {"index": index, "k": 3}
    with pytest.raises(ValueError, match="linear kernel.*to_linear"):
        topk_attention(q, keys, values, w, kernel="linear", **kw)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        topk_attention(q, keys, values, w, kernel="softmax", index=index, k=0)
    with pytest.raises(ValueError, match=r"candidates \(2\) must be >= k \(3\)"):
        topk_attention(q, keys, values, w, kernel="softmax", candidates=2, **kw)
    with pytest.raises(ValueError, match="needs an index by 'l2'"):
        topk_attention(q, keys, values, w, kernel="rbf", **kw)
    with pytest.raises(ValueError, match="index holds 10 rows, the store 9"):
        topk_attention(q, keys[:9], values[:9], w[:9], kernel="softmax", **kw)


# --------------------------------------------------------------------------- FAISS


@requires_faiss
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_faiss_flat_equals_the_exact_index(metric):
    gen = torch.Generator().manual_seed(1)
    keys, q = torch.randn(300, 16, generator=gen), torch.randn(25, 16, generator=gen)
    flat, exact = FaissIndex(metric, kind="flat"), ExactIndex(metric)
    for part in keys.split(100):
        flat.add(part)
        exact.add(part)
    scores, found = flat.search(q, 10)
    ref_scores, ref_found = exact.search(q, 10)
    assert torch.equal(found, ref_found) and found.dtype == torch.int64
    assert_close(scores, ref_scores, rtol=1e-4, atol=1e-4)
    assert len(flat) == 300 and flat.nbytes == 300 * 16 * 4
    assert isinstance(flat, RetrievalIndex)


@requires_faiss
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_faiss_hnsw_recall(metric):
    gen = torch.Generator().manual_seed(2)
    keys, q = torch.randn(2000, 32, generator=gen), torch.randn(50, 32, generator=gen)
    hnsw, exact = FaissIndex(metric, kind="hnsw", hnsw_m=16, ef_search=64), ExactIndex(metric)
    hnsw.add(keys)
    exact.add(keys)
    assert recall_at_k(hnsw.search(q, 10)[1], exact.search(q, 10)[1]) >= 0.9
    assert hnsw.nbytes > 2000 * 32 * 4  # the keys and the graph


def test_missing_faiss_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # makes `import faiss` fail
    with pytest.raises(ImportError, match=r"pip install 'rcdl\[faiss\]'"):
        FaissIndex("l2")
    with pytest.raises(ImportError, match="faiss"):
        TopK(8, backend="faiss-hnsw")


# --------------------------------------------------------------------------- the layer mode


def batch(seed, b=6, d_in=5, classes=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d_in, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, classes, (b,), generator=gen)


def make_net(kind):
    torch.manual_seed(0)
    if kind == "rbf":
        return GrowingRBFNet(5, 3, 1, temperature=0.5, rule=FunctionalSGD(0.5)).double()
    return GrowingSoftmaxNet(5, 3, 1, temperature=0.5, rule=ClippedSoftmaxRule(0.05, 3.0),
                             seed=0).double()


def train(net, grower, steps, start=0):
    net.train()
    for i in range(start, start + steps):
        x, y = batch(i)
        F.cross_entropy(net(x), y).backward()
        grower.step()


def outputs(net, x):
    with torch.no_grad():
        return net.eval()(x)


@pytest.mark.parametrize("kind", ["rbf", "softmax"])
def test_use_topk_follows_the_store(kind, monkeypatch):
    """k ≥ N gives the exact outputs; new rows are added, not re-indexed; a removal
    rebuilds the index; use_exact switches it off."""
    net = make_net(kind)
    grower = Grower(net)
    train(net, grower, 3)
    x_test, _ = batch(99, b=7)
    exact = outputs(net, x_test)
    use_topk(net, 1000, backend="exact")
    modes = [layer.retrieval for _, layer in growing_layers(net)]
    assert all(isinstance(mode, TopK) for mode in modes)
    assert_close(outputs(net, x_test), exact, rtol=1e-6, atol=1e-7)  # float32 index, k ≥ N

    added = []
    monkeypatch.setattr(ExactIndex, "add",
                        lambda self, keys, add=ExactIndex.add: (added.append(len(keys)),
                                                                add(self, keys)))
    train(net, grower, 2, start=3)  # training mode: exact attention, the store grows
    outputs(net, x_test)
    assert added == [12] * len(modes)  # the two steps' 6 + 6 rows of each layer, only
    for (_, layer), mode in zip(growing_layers(net), modes, strict=True):
        assert len(mode.index) == len(layer.store) and mode.rebuilds == 0
        assert mode.rows_added == 12 and mode.calls == 2 and mode.left_out == 0.0

    first = net.blocks[0]
    first.remove_entries(torch.arange(len(first.store)) % 3 == 0)
    use_exact(net)
    exact = outputs(net, x_test)
    first.retrieval = modes[0]
    assert_close(outputs(net, x_test), exact, rtol=1e-6, atol=1e-7)
    assert modes[0].rebuilds == 1 and len(modes[0].index) == len(first.store)


def test_top_k_changes_outputs_and_reports_left_out_mass():
    net = make_net("softmax")
    train(net, Grower(net), 4)
    x_test, _ = batch(99, b=7)
    exact = outputs(net, x_test)
    use_topk(net, 3, backend="exact")
    approx = outputs(net, x_test)
    assert not torch.allclose(approx, exact)
    stats = net.readout.retrieval.stats()
    assert stats["calls"] == 1 and 0 < stats["left_out"] <= 1
    assert stats["rows_indexed"] == len(net.readout.store) and stats["index_bytes"] > 0


def test_resume_rebuilds_the_index_from_the_loaded_store():
    net = make_net("softmax")
    train(net, Grower(net), 3)
    x_test, _ = batch(99, b=7)
    use_topk(net, 5, backend="exact")
    before = outputs(net, x_test)
    resumed = make_net("softmax")
    resumed.load_state_dict(net.state_dict())
    use_topk(resumed, 5, backend="exact")
    assert torch.equal(outputs(resumed, x_test), before)
    copied = copy.deepcopy(net)  # a copy drops the index and rebuilds it
    assert copied.readout.retrieval.index is None
    assert torch.equal(outputs(copied, x_test), before)


@requires_faiss
def test_faiss_backends_in_a_network():
    net = make_net("rbf")
    train(net, Grower(net), 3)
    x_test, _ = batch(99, b=7)
    exact = outputs(net, x_test)
    for backend in ("faiss-flat", "faiss-hnsw"):
        use_topk(net, 100, backend=backend, ef_search=200)  # k ≥ N: every entry
        assert_close(outputs(net, x_test), exact, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["rbf", "softmax"])
def test_training_with_top_k(kind):
    """train=True: training forwards attend to the top-k entries, entries are written, and
    with k ≥ N the stores equal those of exact training."""
    reference, candidate = make_net(kind), make_net(kind)
    train(reference, Grower(reference), 4)
    use_topk(candidate, 1000, backend="exact", train=True)
    train(candidate, Grower(candidate), 4)
    for (_, ref), (_, layer) in zip(growing_layers(reference), growing_layers(candidate),
                                    strict=True):
        assert layer.retrieval.calls == 4 and len(layer.store) == len(ref.store)
        assert_close(layer.store.values, ref.store.values, rtol=1e-6, atol=1e-8)
    small = make_net(kind)
    use_topk(small, 2, backend="exact", train=True)
    train(small, Grower(small), 4)
    assert all(len(layer.store) >= 24 for _, layer in growing_layers(small))
    assert small.readout.retrieval.calls == 4


def test_use_topk_applies_in_eval_only_by_default():
    net = make_net("rbf")
    use_topk(net, 4, backend="exact")
    mode = net.readout.retrieval
    assert mode.applies(net.readout.eval()) and not mode.applies(net.readout.train())
    with torch.no_grad():
        assert mode.applies(net.readout)


def test_use_topk_refuses_what_it_cannot_serve():
    dual = to_dual_form(MLP(5, 8, 3), lr=0.1)
    with pytest.raises(ValueError, match="no growing RBF or softmax layer.*to_linear"):
        use_topk(dual, 8, backend="exact")
    layer = next(m for _, m in growing_layers(dual))
    layer.retrieval = TopK(8, backend="exact")
    with pytest.raises(ValueError, match="GrowingLinear.*linear kernel"), torch.no_grad():
        dual.eval()(torch.randn(2, 5))
    net = make_net("rbf")
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        use_topk(net, 0, backend="exact")
    with pytest.raises(ValueError, match="unknown retrieval backend 'ivf'"):
        use_topk(net, 4, backend="ivf")
    with pytest.raises(ValueError, match=r"candidates \(2\) must be >= k \(4\)"):
        use_topk(net, 4, backend="exact", candidates=2)
    with pytest.raises(TypeError, match="ef_search"):  # the exact index has no such setting
        use_topk(net, 4, backend="exact", ef_search=64)
    net.blocks[0].shard = object()  # as rcdl.distributed.shard marks a split store
    with pytest.raises(ValueError, match="'blocks.0' is sharded"):
        use_topk(net, 4, backend="exact")
    assert all(layer.retrieval is None for _, layer in growing_layers(net))


# --------------------------------------------------------------------------- checkpoints

F64_INDEX = {"backend": "exact", "dtype": torch.float64}  # the exact index, compared in float64


def through_a_file(state):
    """``state`` after ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def modes(net):
    return [layer.retrieval for _, layer in growing_layers(net)]


@pytest.fixture
def one_faiss_thread():
    """HNSW insertion on several threads may link the graph differently run to run."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


@requires_faiss
def test_hnsw_index_round_trips_without_a_rebuild(monkeypatch, one_faiss_thread):
    """The graph grown step by step comes back byte for byte: the same searches and the same
    top-k attention, nothing rebuilt or added; a graph built in one pass is another graph."""
    hnsw = {"backend": "faiss-hnsw", "hnsw_m": 4, "ef_search": 4}
    net = use_topk(make_net("softmax"), 3, train=True, **hnsw)
    train(net, Grower(net), 4)  # four growth steps: four adds
    x_test, _ = batch(99, b=7)
    before = outputs(net, x_test)
    state = through_a_file(retrieval_state(net))
    resumed = make_net("softmax")
    resumed.load_state_dict(net.state_dict())
    use_topk(resumed, 3, train=True, **hnsw)
    load_retrieval_state(resumed, state)
    monkeypatch.setattr(FaissIndex, "add", lambda *_: pytest.fail("the index was rebuilt"))
    assert torch.equal(outputs(resumed, x_test), before)
    q = torch.randn(20, 5, generator=torch.Generator().manual_seed(7))
    for saved, loaded in zip(modes(net), modes(resumed), strict=True):
        assert (loaded.restores, loaded.rebuilds) == (1, 0)
        assert all(torch.equal(a, b) for a, b in zip(saved.index.search(q, 3),
                                                      loaded.index.search(q, 3), strict=True))
        graph = saved.index.state_dict()["faiss"]
        assert torch.equal(loaded.index.state_dict()["faiss"], graph)
    monkeypatch.undo()
    one_pass = FaissIndex("ip", kind="hnsw", hnsw_m=4)
    one_pass.add(net.readout.store.keys)
    assert not torch.equal(one_pass.state_dict()["faiss"], graph)


def test_exact_index_round_trips_and_a_store_that_moved_on_rebuilds():
    net = use_topk(make_net("softmax"), 4, train=True, **F64_INDEX)
    grower = Grower(net)
    train(net, grower, 3)
    x_test, _ = batch(99, b=7)
    outputs(net, x_test)
    state = through_a_file(retrieval_state(net))
    assert state["readout"]["rows"] == state["readout"]["store_rows"] == len(net.readout.store)

    def resume(model_state):
        resumed = make_net("softmax")
        resumed.load_state_dict(model_state)
        load_retrieval_state(use_topk(resumed, 4, train=True, **F64_INDEX), state)
        return resumed

    same = resume(net.state_dict())
    assert torch.equal(outputs(same, x_test), outputs(net, x_test))
    for saved, loaded in zip(modes(net), modes(same), strict=True):
        assert (loaded.restores, loaded.rebuilds) == (1, 0)
        assert torch.equal(loaded.index.state_dict()["rows"], saved.index.state_dict()["rows"])

    train(net, grower, 2, start=3)  # the store moves on: the saved index no longer fits it
    later = resume(net.state_dict())
    assert torch.equal(outputs(later, x_test), outputs(net, x_test))
    for layer, loaded in zip(growing_layers(later), modes(later), strict=True):
        assert (loaded.restores, loaded.rebuilds) == (0, 1)
        assert len(loaded.index) == len(layer[1].store)


def test_a_model_without_top_k_saves_and_loads_as_before():
    """The indices travel beside the model's state dict, never in it; loading them needs
    the saved run's top-k modes."""
    net = make_net("rbf")
    train(net, Grower(net), 2)
    keys = list(net.state_dict())
    assert retrieval_state(net) is None
    load_retrieval_state(net, None)  # a checkpoint saved without top-k: nothing to do
    use_topk(net, 4, backend="exact")
    outputs(net, batch(99)[0])
    assert list(net.state_dict()) == keys
    state = retrieval_state(net)
    fresh = make_net("rbf")
    fresh.load_state_dict(net.state_dict())  # strict, as before
    with pytest.raises(ValueError, match="layer 'blocks.0' of the saved state has no top-k mode"):
        load_retrieval_state(fresh, state)
    use_topk(fresh, 4, backend="exact", dtype=torch.float64)
    with pytest.raises(ValueError, match="saved run's backend and index settings"):
        load_retrieval_state(fresh, state)
    outputs(fresh, batch(99)[0])
    assert all(mode.restores == 0 for mode in modes(fresh))  # the refused load changed nothing
    use_topk(fresh, 8, backend="exact", chunk_size=3)  # k and search settings may differ
    load_retrieval_state(fresh, state)
    outputs(fresh, batch(99)[0])
    assert all(mode.restores == 1 for mode in modes(fresh))


TEACHER = make_teacher_data(TeacherConfig(d_in=4, hidden=8, depth=1, n_train=50, n_test=20))
INDEX_KW = {"exact": {}, "faiss-hnsw": {"hnsw_m": 4, "ef_search": 4}}


def build_run(kind, backend):
    """A model in top-k training mode and its learners, as a fresh process builds them."""
    torch.manual_seed(0)
    if kind == "rbf":
        model = GrowingRBFNet(4, 1, 1, temperature=1.0, rule=FunctionalSGD(0.1))
        learner, refresh = {"grower": Grower(model)}, {}
    else:  # Adam moves the entries every step; the index follows every fourth move
        model = HybridSoftmaxNet(4, 1, 1, temperature=1.0, rule=ClippedSoftmaxRule(1.0, 3.0),
                                 trigger=DistanceGate(1.0), initial_entries=4)
        learner = {"optimizer": EntryAdam(model, lr=0.01), "grower": Grower(model)}
        refresh = {"refresh_every": 4}
    use_topk(model, 3, backend=backend, train=True, **refresh, **INDEX_KW[backend])
    return model, learner


@pytest.mark.parametrize("backend", ["exact", pytest.param("faiss-hnsw", marks=requires_faiss)])
@pytest.mark.parametrize("kind", ["rbf", "hybrid"])
def test_a_top_k_run_resumes_with_its_saved_index(interrupt_after, tmp_path, kind, backend,
                                                  request):
    """train_one_pass saves each layer's index in its checkpoint and restores it: the resumed
    run ends with the uninterrupted run's history and the very same index."""
    if backend == "faiss-hnsw":
        request.getfixturevalue("one_faiss_thread")
    kw = {"batch_size": 4, "eval_every": 5, "progress": False, "seed": 3}
    reference, learner = build_run(kind, backend)
    expected = train_one_pass(reference, TEACHER, **learner, **kw)

    ckpt = tmp_path / "ckpt.pt"
    model, learner = build_run(kind, backend)
    stopped = interrupt_after(learner["grower"], 7)
    with pytest.raises(stopped):
        train_one_pass(model, TEACHER, **learner, checkpoint_path=ckpt, checkpoint_every=2,
                       **kw)
    from rcdl.train.checkpoint import checkpoint_files, load_checkpoint

    saved = load_checkpoint(checkpoint_files(ckpt, 6))["retrieval"]  # the newest: step 6
    assert set(saved) == {"blocks.0", "readout"}
    assert all(s["index"] is not None for s in saved.values())
    model, learner = build_run(kind, backend)  # a fresh process: only the checkpoint survives
    resumed = train_one_pass(model, TEACHER, **learner, checkpoint_path=ckpt, **kw)
    assert resumed["resumed"] and resumed["history"] == expected["history"]
    for ref, mode in zip(modes(reference), modes(model), strict=True):
        assert mode.restores == 1
        assert kind == "hybrid" or mode.rebuilds == 0  # a store that only grows: never rebuilt
        for a, b in zip(ref.index.state_dict().values(), mode.index.state_dict().values(),
                        strict=True):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------- the hybrid


def hybrid_net():
    torch.manual_seed(0)
    return HybridSoftmaxNet(5, 3, 1, temperature=0.7, rule=ClippedSoftmaxRule(1.0, 3.0),
                            trigger=DistanceGate(1.5), initial_entries=6).double()


def hybrid_layer(n=40, seed=5):
    """A hybrid layer of ``n`` entries whose weights spread over orders of magnitude."""
    layer = HybridSoftmax(5, 3, temperature=0.7, rule=ClippedSoftmaxRule(1.0, 3.0),
                          trigger=DistanceGate(1.5), initial_entries=n, seed=0).double()
    gen = torch.Generator().manual_seed(seed)
    layer.store.weights.copy_(torch.exp(2 * torch.randn(n, generator=gen, dtype=torch.float64)))
    layer.store.touch()
    return layer


def dense_top_k(q, keys, values, weights, rows):
    """The dense attention of each query ``q[i]`` over its rows ``rows[i]`` only."""
    return torch.cat([naive_attention(q[i : i + 1], keys[r], values[r], weights[r],
                                      kernel="softmax", temperature=0.7)
                      for i, r in enumerate(rows)])


def top_rows(q, keys, weights, k, candidates=None):  # (B, k)
    """The rows topk_attention keeps: candidates by logit, rescored by logit + log|w|."""
    z = q @ keys.T / (0.7 * q.shape[1] ** 0.5)  # (B, N)
    found = z.topk(candidates or k, dim=1).indices  # (B, c)
    score = z.gather(1, found) + weights[found].abs().log()
    return found.gather(1, score.topk(k, dim=1).indices)


@pytest.mark.parametrize("refresh_every", [1, 2])
def test_hybrid_training_with_k_at_least_n_is_exact_training(refresh_every):
    """Dense twin in float64: every step's loss, every entry gradient and the entries after
    each step equal those of exact training, whether the index follows each Adam move or
    every second (with k ≥ N every row is kept, whatever the index found)."""
    reference, candidate = hybrid_net(), hybrid_net()
    use_topk(candidate, 1000, train=True, refresh_every=refresh_every, **F64_INDEX)
    nets = (reference, candidate)
    optimizers = [HybridGrower(net, lr=1e-2) for net in nets]
    for step in range(3):
        x, y = batch(step)
        losses = [F.cross_entropy(net.train()(x), y) for net in nets]
        for loss in losses:
            loss.backward()
        assert_close(losses[1], losses[0], rtol=1e-12, atol=1e-12)
        pairs = list(zip(hybrid_layers(reference), hybrid_layers(candidate), strict=True))
        for (_, ref), (_, layer) in pairs:
            for want, got in zip(ref.entry_leaves(), layer.entry_leaves(), strict=True):
                assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-13)
        for opt in optimizers:
            opt.step()
        for (_, ref), (_, layer) in pairs:
            assert len(layer.store) == len(ref.store)
            for name in ("keys", "values", "weights"):
                assert_close(getattr(layer.store, name), getattr(ref.store, name),
                             rtol=1e-10, atol=1e-13)
    assert [mode.calls for mode in modes(candidate)] == [3, 3]
    assert [mode.rebuilds for mode in modes(candidate)] == [2 // refresh_every] * 2


@pytest.mark.parametrize("candidates", [None, 12], ids=["c=k", "c=3k"])
def test_hybrid_top_k_is_the_dense_attention_over_the_top_k_rows(candidates):
    """k < N with an exact index: the output and the gradients on the query and on every
    entry tensor equal a dense reference restricted to each query's top-k rows; rows no
    query kept get zero gradient, so the first Adam step moves them not at all."""
    layer = hybrid_layer()
    use_topk(layer, 4, candidates=candidates, train=True, **F64_INDEX)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    out = layer.train()(q)
    out.backward(grad_out)

    q_ref = q.detach().clone().requires_grad_()
    entries = [t.detach().clone().requires_grad_() for t in layer.entry_leaves()]
    rows = top_rows(q_ref.detach(), entries[0].detach(), entries[2].detach(), 4, candidates)
    ref = dense_top_k(q_ref, *entries, rows)
    ref.backward(grad_out)
    assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert_close(q.grad, q_ref.grad, rtol=1e-10, atol=1e-13)
    for got, want in zip(layer.entry_leaves(), entries, strict=True):
        assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-13)
    unused = torch.ones(40, dtype=torch.bool)
    unused[rows.flatten()] = False
    assert unused.any()
    assert all((leaf.grad[unused] == 0).all() for leaf in layer.entry_leaves())

    before = layer.store.keys.clone()
    EntryAdam(layer, lr=1e-2).step()
    assert torch.equal(layer.store.keys[unused], before[unused])
    assert not torch.equal(layer.store.keys[~unused], before[~unused])


def test_a_stale_index_is_refreshed_every_r_moves_and_at_once_after_a_removal():
    """refresh_every = 3: the index keeps the keys of its last rebuild for two Adam moves;
    meanwhile each query attends, with the current entries, to the rows that the stale keys
    rank first. A removal rebuilds at the next call. A checkpoint keeps the staleness."""
    layer = hybrid_layer(n=30)
    use_topk(layer, 4, train=True, refresh_every=3, **F64_INDEX)
    mode, opt = layer.retrieval, HybridGrower(layer, lr=5e-2)
    gen = torch.Generator().manual_seed(8)
    rebuilds, stale = [], []
    for _ in range(7):
        q = torch.randn(4, 5, generator=gen, dtype=torch.float64)
        indexed = None if mode.index is None else mode.index.state_dict()["rows"]
        out = layer.train()(q)
        rebuilds.append(mode.rebuilds)
        stale.append(mode.stats()["stale_moves"])
        if stale[-1]:  # the index searched keys from before the last Adam steps
            keys, values, weights = (t.detach() for t in layer.entry_leaves())
            searched = torch.cat([indexed, keys[len(indexed) :]])  # + rows appended since
            assert not torch.equal(searched, keys)
            rows = top_rows(q, searched, weights, 4)
            assert_close(out, dense_top_k(q, keys, values, weights, rows), rtol=1e-12,
                         atol=1e-12)
        out.square().mean().backward()
        opt.step()
    assert rebuilds == [0, 0, 0, 1, 1, 1, 2] and stale == [0, 1, 2, 0, 1, 2, 0]

    state = through_a_file(retrieval_state(layer))
    assert state[""]["stale"] == 1  # one Adam move since the last call
    twin = copy.deepcopy(layer)  # drops the index, as a fresh process would
    load_retrieval_state(twin, state)
    q = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(twin.eval()(q), layer.eval()(q))
    assert twin.retrieval.restores == 1
    assert twin.retrieval.stats()["stale_moves"] == mode.stats()["stale_moves"] == 1

    layer.remove_entries(torch.arange(len(layer.store)) % 4 == 0)
    layer.train()(q).sum().backward()
    assert mode.rebuilds == 3 and mode.stats()["stale_moves"] == 0
    assert retrieval_state(layer)[""]["index"] is not None
    opt.zero_grad()
