"""Approximate retrieval (rcdl.retrieval) against dense references: the exact index against
brute force, top-k attention against the exact attention (float64), the left-out bound,
FAISS against the exact index, and the layer mode following its store.

The FAISS tests skip where the ``faiss`` extra is not installed (the CI installs ``dev`` and
``classical`` only); everything else runs on the torch index."""

import copy
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
    to_dual_form,
)
from rcdl.attention import attention
from rcdl.kernels import naive_attention
from rcdl.layers import growing_layers
from rcdl.retrieval import (
    ExactIndex,
    FaissIndex,
    RetrievalIndex,
    TopK,
    metric_for,
    recall_at_k,
    topk_attention,
    use_exact,
    use_topk,
)

try:
    import faiss  # noqa: F401
except ImportError:
    faiss = None
requires_faiss = pytest.mark.skipif(faiss is None, reason="needs the faiss extra: "
                                    "pip install 'rcdl[faiss]'")

TEMPERATURE = {"rbf": 2.0, "softmax": 0.7}
KERNELS = ("rbf", "softmax")


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
