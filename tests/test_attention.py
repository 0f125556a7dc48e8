"""The streaming attention against its dense twin: outputs and every gradient (float64)."""

import pytest
import torch
from torch.testing import assert_close

from rcdl.ops.attention import attention, attention_partial, finalize, merge_partials
from rcdl.ops.kernels import KERNELS, naive_attention

# every kernel of the registry is tested; these two at other temperatures than 1
TEMPERATURE = {name: 1.0 for name in KERNELS} | {"rbf": 2.0, "softmax": 0.7}


def make_entries(n, d_in=5, d_out=3, batch=4, seed=0, positive_weights=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, d_in, generator=gen, dtype=torch.float64)
    keys = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    values = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    weights = torch.rand(n, generator=gen, dtype=torch.float64) + 0.1
    if not positive_weights:
        weights = weights - 0.6
    return q, keys, values, weights


def both(kernel, q, keys, values, weights, **kw):
    t = TEMPERATURE[kernel]
    fast = attention(q, keys, values, weights, kernel=kernel, temperature=t, **kw)
    ref = naive_attention(q, keys, values, weights, kernel=kernel, temperature=t)
    return fast, ref


CASES = [  # (N, chunk): chunk 1, N not a multiple of the chunk, chunk > N, empty store
    pytest.param(7, 1, id="chunk1"),
    pytest.param(11, 4, id="ragged"),
    pytest.param(6, 64, id="chunk>N"),
    pytest.param(0, 4, id="empty"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("n", "chunk"), CASES)
@pytest.mark.parametrize("save_fraction", [0.0, 1e9], ids=["recompute", "saved"])
def test_outputs_and_gradients_match_dense_reference(kernel, n, chunk, save_fraction):
    tensors = [t.requires_grad_() for t in make_entries(n)]
    fast, ref = both(kernel, *tensors, chunk_size=chunk, save_fraction=save_fraction)
    assert_close(fast, ref)
    grad_out = torch.randn_like(ref)
    fast_grads = torch.autograd.grad(fast, tensors, grad_out)
    ref_grads = torch.autograd.grad(ref, tensors, grad_out, allow_unused=True)
    names = ("q", "keys", "values", "weights")
    for name, g_fast, g_ref in zip(names, fast_grads, ref_grads, strict=True):
        g_ref = torch.zeros_like(g_fast) if g_ref is None else g_ref
        assert_close(g_fast, g_ref, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("save_fraction", [0.0, 1e9], ids=["recompute", "saved"])
def test_gradcheck(kernel, save_fraction):
    tensors = [t.requires_grad_() for t in make_entries(9, d_in=3, d_out=2, batch=3)]

    def fn(*args):
        return attention(*args, kernel=kernel, temperature=TEMPERATURE[kernel], chunk_size=4,
                         save_fraction=save_fraction)

    assert torch.autograd.gradcheck(fn, tensors)


def test_gradient_wrt_queries_only_matches():
    q, keys, values, weights = make_entries(13)
    q.requires_grad_()
    fast, ref = both("softmax", q, keys, values, weights, chunk_size=5)
    (g_fast,) = torch.autograd.grad(fast.sum(), q)
    (g_ref,) = torch.autograd.grad(ref.sum(), q)
    assert_close(g_fast, g_ref)


@pytest.mark.parametrize("kernel", KERNELS)
def test_shards_merge_exactly(kernel):
    q, keys, values, weights = make_entries(20)
    t = TEMPERATURE[kernel]
    parts = [
        attention_partial(q, keys[s], values[s], weights[s], kernel=kernel, temperature=t,
                          chunk_size=3)
        for s in (slice(0, 0), slice(0, 8), slice(8, 20))
    ]
    merged = merge_partials(merge_partials(parts[0], parts[1]), parts[2])
    assert_close(finalize(merged, kernel=kernel), naive_attention(
        q, keys, values, weights, kernel=kernel, temperature=t))


def test_large_logits_stay_finite():
    q, keys, values, weights = make_entries(10)
    out = attention(q * 1e4, keys, values, weights, kernel="softmax", chunk_size=3)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("chunk", [1, 3, 50])
def test_vanishing_or_negative_denominator_stays_finite(chunk):
    """Adversarial store: weights that cancel exactly, and negative totals
    (docs/reference.md §2)."""
    q, keys, values, _ = make_entries(4, batch=3)
    keys = torch.zeros_like(keys)  # all logits equal: denominator = sum of weights
    for weights in (torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64),
                    torch.tensor([-1.0, -2.0, 0.5, 0.1], dtype=torch.float64)):
        tensors = [t.clone().requires_grad_() for t in (q, keys, values, weights)]
        fast, ref = both("softmax", *tensors, chunk_size=chunk)
        assert torch.isfinite(fast).all()
        assert_close(fast, ref)
        grads = torch.autograd.grad(fast.sum(), tensors)
        assert all(torch.isfinite(g).all() for g in grads)
        ref_grads = torch.autograd.grad(ref.sum(), tensors, allow_unused=True)
        for g, r in zip(grads, ref_grads, strict=False):
            assert_close(g, torch.zeros_like(g) if r is None else r)
    # a negative total keeps its sign: out = num / D with D < 0
    out = attention(q, keys, values, torch.full((4,), -0.25, dtype=torch.float64),
                    kernel="softmax")
    assert_close(out, -values.sum(0).expand_as(out))


def test_float32_matches_float64():
    q, keys, values, weights = make_entries(300, d_in=16, d_out=8, batch=7)
    out64 = attention(q, keys, values, weights, kernel="softmax", chunk_size=64)
    out32 = attention(*(t.float() for t in (q, keys, values, weights)), kernel="softmax",
                      chunk_size=64)
    assert_close(out32.double(), out64, rtol=1e-4, atol=1e-5)


def test_unknown_kernel_and_bad_temperature():
    q, keys, values, weights = make_entries(3)
    with pytest.raises(ValueError, match="unknown kernel 'cosine'"):
        attention(q, keys, values, weights, kernel="cosine")
    with pytest.raises(ValueError, match="temperature must be a positive"):
        attention(q, keys, values, weights, kernel="softmax", temperature=0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        attention(q[:, :2], keys, values, weights, kernel="softmax")
    with pytest.raises(TypeError, match="keys torch.float32"):
        attention(q, keys.float(), values, weights, kernel="softmax")


def test_default_chunk_size_is_cache_sized_on_cpu_and_large_on_gpus():
    from rcdl.ops.attention import default_chunk_size

    assert default_chunk_size(16) == default_chunk_size(16, "cpu") == 2048
    assert default_chunk_size(500, torch.device("cpu")) == 1024
    assert default_chunk_size(16, "cuda") == default_chunk_size(500, "cuda:0") == 1 << 16


# ------------------------------------------------------------------ the denominator's guard
# Mixed-sign weights and a large eps put some queries under the floor |D| ≥ eps · Σ|w_j|e^{z_j}
# and leave others above it, away from the boundary and from w_j = 0 (where |w_j| has a kink).
GUARD_EPS = 0.3


def guarded_store(n=9, d_in=3, d_out=2, batch=6, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, d_in, generator=gen, dtype=torch.float64)
    keys = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    values = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    magnitudes = torch.rand(n, generator=gen, dtype=torch.float64) + 0.2
    signs = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).double()
    return q, keys, values, magnitudes * signs


def guard_ratio(q, keys, weights, temperature):  # (B,) |D| / mass
    e = torch.exp(q @ keys.T / (temperature * q.shape[1] ** 0.5))
    return (e @ weights).abs() / (e @ weights.abs())


def test_guarded_store_has_both_regimes_away_from_the_boundary():
    q, keys, _, weights = guarded_store()
    ratio = guard_ratio(q, keys, weights, TEMPERATURE["softmax"])
    assert (ratio < GUARD_EPS - 0.02).any() and (ratio > GUARD_EPS + 0.02).any()
    assert ((ratio - GUARD_EPS).abs() > 0.02).all()


def sdpa_reference(q, keys, values, weights, **kw):
    from rcdl.ops.kernels import sdpa_softmax_attention

    return sdpa_softmax_attention(q, keys, values, weights, **kw)


@pytest.mark.parametrize("save_fraction", [0.0, 1e9], ids=["recompute", "saved"])
def test_gradcheck_with_the_floor_active(save_fraction):
    tensors = [t.requires_grad_() for t in guarded_store()]

    def fn(*args):
        return attention(*args, kernel="softmax", temperature=TEMPERATURE["softmax"],
                         chunk_size=4, eps=GUARD_EPS, save_fraction=save_fraction)

    assert torch.autograd.gradcheck(fn, tensors)


@pytest.mark.parametrize("reference", [naive_attention, sdpa_reference], ids=["dense", "sdpa"])
def test_guarded_outputs_and_gradients_match_both_references(reference):
    tensors = [t.requires_grad_() for t in guarded_store()]
    t = TEMPERATURE["softmax"]
    fast = attention(*tensors, kernel="softmax", temperature=t, chunk_size=4, eps=GUARD_EPS)
    kw = {"kernel": "softmax"} if reference is naive_attention else {}
    ref = reference(*tensors, temperature=t, eps=GUARD_EPS, **kw)
    assert_close(fast, ref)
    grad_out = torch.randn_like(ref)
    fast_grads = torch.autograd.grad(fast, tensors, grad_out)
    ref_grads = torch.autograd.grad(ref, tensors, grad_out)
    for name, g_fast, g_ref in zip(("q", "keys", "values", "weights"), fast_grads, ref_grads,
                                   strict=True):
        assert_close(g_fast, g_ref, msg=lambda m, name=name: f"grad {name}: {m}")


def test_sdpa_reference_matches_dense_twin_unguarded():
    q, keys, values, weights = make_entries(12)
    assert_close(sdpa_reference(q, keys, values, weights, temperature=0.7),
                 naive_attention(q, keys, values, weights, kernel="softmax", temperature=0.7))


@pytest.mark.parametrize("eps", [1e-6, GUARD_EPS], ids=["floor-idle", "floor-active"])
def test_zero_weight_entry_with_the_largest_logit_changes_nothing(eps):
    """The clipped rule writes w = 0 entries; one of them holding the max logit must not move
    the floor (it did when the floor was relative to e^{max logit})."""
    q, keys, values, weights = guarded_store()
    far = q.sum(0, keepdim=True) * 50  # (1, d_in): the largest logit for every query
    with_zero = [torch.cat([keys, far]), torch.cat([values, torch.zeros(1, 2).double()]),
                 torch.cat([weights, torch.zeros(1).double()])]
    kw = {"kernel": "softmax", "temperature": TEMPERATURE["softmax"], "eps": eps}
    assert_close(attention(q, *with_zero, **kw), attention(q, keys, values, weights, **kw))


def test_store_without_weight_mass_answers_zero_with_zero_gradients():
    q, keys, values, _ = make_entries(5)
    tensors = [t.requires_grad_() for t in (q, keys, values, torch.zeros(5).double())]
    out = attention(*tensors, kernel="softmax", chunk_size=2)
    assert_close(out, torch.zeros_like(out))
    for g in torch.autograd.grad(out.sum(), tensors):
        assert_close(g, torch.zeros_like(g))
