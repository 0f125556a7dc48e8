"""Half-precision stores (docs/precision.md): keys and values kept in bfloat16 or float16,
the attention multiplying in that dtype and accumulating in the queries' dtype.

The dense twin of a half-precision attention is the float64 attention over the same rounded
numbers (queries, keys and values rounded to the storage dtype): the streaming op differs
from it only by the rounding of its products' outputs, a few half-precision ulps.
"""

import importlib.util

import pytest
import torch
from torch.testing import assert_close

from rcdl import (
    ClippedSoftmaxRule,
    FunctionalSGD,
    Grower,
    GrowingRBFNet,
    GrowingSoftmaxNet,
    set_store_dtype,
)
from rcdl.nn.hybrid import HybridSoftmax
from rcdl.nn.store import EntryStore
from rcdl.ops import streaming
from rcdl.ops.attention import attention, attention_partial, finalize, nearest_sq_distance
from rcdl.ops.half import half_products
from rcdl.ops.kernels import KERNELS, naive_attention
from rcdl.ops.rounding import round_stochastically, rounding_noise
from rcdl.optim.entry_adam import EntryMoments

HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
# every kernel of the registry is tested; these two at other temperatures than 1
TEMPERATURE = {name: 1.0 for name in KERNELS} | {"rbf": 2.0, "softmax": 0.7}
# relative error of the half-precision products: bf16 keeps 8 significant bits, fp16 11
RTOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.fixture(params=["native", "float32", "widen"])
def path(request):
    """Every product path of a half store on every machine (rcdl.ops.half): the one this CPU
    would pick and the others, forced (``widen`` where numba is installed; it falls back to
    float32 chunks for float16 and batches over WIDEN_MAX_BATCH)."""
    if request.param == "widen" and importlib.util.find_spec("numba") is None:
        pytest.skip("needs the fast-cpu extra (numba): pip install -e '.[fast-cpu]'")
    with half_products(request.param):
        yield request.param


def queries64(q, dtype, path):
    """The queries as the products see them: rounded to the store's dtype on the native
    path, as they are on the float32 one."""
    return rounded64(q, dtype) if path == "native" else q.double()


def entries(n=300, d_in=32, d_out=6, batch=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, d_in, generator=gen)
    keys = torch.randn(n, d_in, generator=gen)
    values = torch.randn(n, d_out, generator=gen)
    weights = torch.rand(n, generator=gen) + 0.1
    return q, keys, values, weights


def rounded64(t, dtype):
    return t.to(dtype).double()


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kernel", KERNELS)
def test_half_store_matches_the_float64_attention_over_the_rounded_numbers(kernel, dtype,
                                                                            path):
    q, keys, values, weights = entries()
    t = TEMPERATURE[kernel]
    leaves = [q.clone(), keys.to(dtype), values.to(dtype), weights.clone()]
    leaves = [x.requires_grad_() for x in leaves]
    out = attention(*leaves, kernel=kernel, temperature=t, chunk_size=64)
    assert out.dtype == torch.float32
    ref_leaves = [queries64(q, dtype, path), rounded64(keys, dtype), rounded64(values, dtype),
                  weights.double()]
    ref_leaves = [x.requires_grad_() for x in ref_leaves]
    ref = naive_attention(*ref_leaves, kernel=kernel, temperature=t)
    assert relative_error(out, ref) < RTOL[dtype]
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref.backward(grad_out.double())
    for name, leaf, ref_leaf in zip("qkvw", leaves, ref_leaves, strict=True):
        assert leaf.grad.dtype == leaf.dtype, name  # entry gradients in the entries' dtype
        assert relative_error(leaf.grad, ref_leaf.grad) < 2 * RTOL[dtype], name


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kernel", KERNELS)
def test_half_entry_gradients_formed_in_row_blocks_round_the_same_product(kernel, dtype, path,
                                                                          monkeypatch):
    """A half store's key and value gradients are formed a block of rows at a time into a
    reused float32 buffer and rounded into the store's dtype; the blocks give the numbers
    one product gives, up to the last bit of a float32 product flipping one rounding."""
    q, keys, values, weights = entries(n=200, d_out=40)
    kw = {"kernel": kernel, "temperature": TEMPERATURE[kernel], "chunk_size": 96}

    def entry_grads():
        leaves = [x.clone().requires_grad_() for x in (q, keys.to(dtype), values.to(dtype),
                                                        weights)]
        attention(*leaves, **kw).sum().backward()
        return [leaf.grad for leaf in leaves[1:3]]

    monkeypatch.setattr(streaming, "_NARROW_BLOCK_BYTES", 1 << 30)  # one product per chunk
    whole = entry_grads()
    monkeypatch.setattr(streaming, "_NARROW_BLOCK_BYTES", 16 * 4 * 40)  # blocks of 16 rows
    for blocked, one in zip(entry_grads(), whole, strict=True):
        assert blocked.dtype == dtype
        ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
        assert_close(blocked.float(), one.float(), rtol=ulp, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_half_store_partials_merge_like_one_pass(kernel, path):
    q, keys, values, weights = entries(n=500)
    keys, values = keys.bfloat16(), values.bfloat16()
    kw = {"kernel": kernel, "temperature": TEMPERATURE[kernel], "chunk_size": 128}
    whole = attention(q, keys, values, weights, **kw)
    part = attention_partial(q, keys, values, weights, **kw)
    assert part.num.dtype == torch.float32  # partials accumulate in the queries' dtype
    assert_close(finalize(part, kernel=kernel), whole)
    # each chunk's value product is rounded to bfloat16 once: other chunks, other roundings
    other_chunks = attention(q, keys, values, weights, **{**kw, "chunk_size": 37})
    assert relative_error(other_chunks, whole) < 1e-2


def test_nearest_sq_distance_of_a_half_store(path):
    q, keys, _, _ = entries(n=400)
    got = nearest_sq_distance(q, keys.bfloat16(), chunk_size=64)
    ref = torch.cdist(queries64(q, torch.bfloat16, path),
                      rounded64(keys, torch.bfloat16)).amin(1) ** 2
    assert relative_error(got, ref) < 3e-2


def test_mixed_dtypes_are_refused_with_what_was_given():
    q, keys, values, weights = entries(n=10)
    with pytest.raises(TypeError, match="keys torch.bfloat16, values torch.float32"):
        attention(q, keys.bfloat16(), values, weights, kernel="softmax")
    with pytest.raises(TypeError, match="weights torch.bfloat16"):
        attention(q, keys.bfloat16(), values.bfloat16(), weights.bfloat16(), kernel="softmax")


# ------------------------------------------------------------------------------- the store


def test_store_keeps_half_keys_and_values_and_halves_their_bytes():
    full = EntryStore(64, 64)
    half = EntryStore(64, 64, storage_dtype=torch.bfloat16)
    keys, values = torch.randn(10, 64), torch.randn(10, 64)
    for store in (full, half):
        store.append(keys, values, written_at=3)
    assert half.keys.dtype == half.values.dtype == torch.bfloat16
    assert half.dtype == half.weights.dtype == torch.float32
    assert_close(half.keys, keys.bfloat16())
    # (64 + 64) numbers of 2 bytes instead of 4; the float32 weight and the int64 step and
    # id alike
    assert half.nbytes == 10 * (128 * 2 + 4 + 16) and full.nbytes == 10 * (128 * 4 + 4 + 16)
    half.double()  # the weights follow the module's dtype, the half rows stay half
    assert half.keys.dtype == torch.bfloat16 and half.weights.dtype == torch.float64
    assert "storage_dtype=torch.bfloat16" in repr(half)


def test_half_store_state_dict_round_trip_is_exact():
    store = EntryStore(8, 3, storage_dtype=torch.float16)
    store.append(torch.randn(5, 8), torch.randn(5, 3), torch.rand(5), written_at=2)
    state = store.state_dict()
    assert state["keys"].dtype == torch.float16
    copy = EntryStore(8, 3, storage_dtype=torch.float16)
    copy.load_state_dict(state)
    for name in ("keys", "values", "weights", "written_at"):
        assert torch.equal(getattr(copy, name), getattr(store, name)), name
    wide = EntryStore(8, 3)  # a float32 store takes the half rows, widened exactly
    wide.load_state_dict(state)
    assert torch.equal(wide.keys, store.keys.float())


def test_float16_overflow_is_refused_and_nothing_written():
    store = EntryStore(2, 1, storage_dtype=torch.float16)
    with pytest.raises(ValueError, match="overflow the storage dtype torch.float16"):
        store.append(torch.tensor([[1e6, 0.0]]), torch.zeros(1, 1))
    assert len(store) == 0


def test_set_storage_dtype_converts_the_rows_held_and_is_refused_for_non_floats():
    store = EntryStore(4, 2)
    store.append(torch.randn(3, 4), torch.randn(3, 2))
    keys = store.keys.clone()
    version = store.version
    store.set_storage_dtype(torch.bfloat16)
    assert torch.equal(store.keys, keys.bfloat16()) and store.version > version
    store.set_storage_dtype(None)
    assert store.keys.dtype == torch.float32
    with pytest.raises(ValueError, match="storage_dtype must be a floating"):
        store.set_storage_dtype(torch.int8)


# ------------------------------------------------------------------------------- networks


def _train(net, grower, steps=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(24, 4, generator=gen)
    for _ in range(steps):
        x = torch.randn(16, 24, generator=gen)
        y = (x @ w_true).argmax(1)
        grower.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        grower.step()
    return torch.randn(64, 24, generator=gen)


NETS = {
    "gws": lambda **kw: GrowingSoftmaxNet(24, 4, 2, temperature=1.0,
                                          rule=ClippedSoftmaxRule(0.05, 3.0), **kw),
    "rbf": lambda **kw: GrowingRBFNet(24, 4, 2, temperature=1.0, rule=FunctionalSGD(1.0), **kw),
}


@pytest.mark.parametrize("name", list(NETS))
def test_half_store_network_follows_the_float32_network(name):
    full, half = NETS[name](), NETS[name](store_dtype=torch.bfloat16)
    x_full = _train(full, Grower(full))
    x_half = _train(half, Grower(half))
    for layer in (m for m in half.modules() if hasattr(m, "store")):
        assert layer.store.keys.dtype == torch.bfloat16 and len(layer.store) > 0
    with torch.no_grad():
        assert relative_error(half(x_half), full(x_full)) < 5e-2


def test_set_store_dtype_on_a_built_network_equals_building_it_half():
    built = NETS["gws"](store_dtype=torch.bfloat16)
    converted = set_store_dtype(NETS["gws"](), torch.bfloat16)
    for a, b in zip(built.state_dict().values(), converted.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_hybrid_trained_in_float32_and_converted_answers_as_before():
    """The recipe docs/precision.md gives for the hybrid ("The hybrid's accuracy with a
    bfloat16 store"): train with float32 entries, then hold them in bfloat16. The converted
    network answers as the float32 one over its entries rounded to nearest bfloat16 (the
    float64 reference), within the products' rounding, and keeps training."""
    import copy

    from rcdl import HybridGrower, HybridSoftmaxNet

    net = HybridSoftmaxNet(24, 4, 1, temperature=1.0, rule=ClippedSoftmaxRule(0.05, 3.0))
    x = _train(net, HybridGrower(net, lr=1e-2), steps=8)
    rounded = copy.deepcopy(net).double()
    for layer in (m for m in rounded.modules() if isinstance(m, HybridSoftmax)):
        assert len(layer.store) > 16  # grown and moved by Adam
        for t in (layer.store.keys, layer.store.values):
            t.copy_(t.float().bfloat16().double())
    half = set_store_dtype(copy.deepcopy(net), torch.bfloat16)
    for model in (net, rounded, half):
        model.eval()
    # the stored numbers times float32 queries (a CPU with bfloat16 units would multiply
    # queries rounded to bfloat16 too, within their rounding of the same answer)
    with torch.no_grad(), half_products("float32"):
        expected, before = rounded(x.double()), net(x)
        assert relative_error(half(x), expected) < 1e-5
        assert 0 < relative_error(half(x), before) < 3e-2  # rounding moved it, a little
    with torch.no_grad(), half_products("native"):
        assert relative_error(half(x), expected) < 3e-2
    layers = [m for m in half.modules() if isinstance(m, HybridSoftmax)]
    held = [layer.store.keys.clone() for layer in layers]
    half.train()
    _train(half, HybridGrower(half, lr=1e-2), steps=2, seed=1)
    for layer, keys in zip(layers, held, strict=True):  # moved by Adam, still bfloat16
        assert layer.store.keys.dtype == torch.bfloat16
        assert not torch.equal(layer.store.keys[: len(keys)], keys)


# ------------------------------------------------------------------------------- the hybrid


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_unbiased_and_exact_on_representable_numbers(dtype):
    torch.manual_seed(0)
    step = 0.3 * torch.finfo(dtype).eps  # under half an ulp at 1: lost to nearest rounding
    x = torch.full((200_000,), 1.0 + step)
    assert torch.equal(x.to(dtype).float(), torch.ones_like(x))
    for sign in (1, -1):  # the magnitude rounds, whatever the sign
        mean = round_stochastically(sign * x, dtype).double().mean().item()
        assert mean == pytest.approx(sign * (1.0 + step), abs=0.02 * step)
    exact = torch.randn(1000).to(dtype)
    assert torch.equal(round_stochastically(exact.float(), dtype), exact)


@pytest.mark.parametrize("source", [torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", HALF)
def test_counter_based_rounding_noise_is_unbiased_too(dtype, source):
    """With the noise of :func:`rounding_noise` (keyed on entry ids, not drawn from torch's
    generator) the rounding is unbiased as well, on both paths (the float32 → bfloat16 bit
    trick and the general one)."""
    step = 0.3 * torch.finfo(dtype).eps
    x = torch.full((400, 500), 1.0 + step, dtype=source)
    for sign in (1, -1):
        noise = rounding_noise(seed=7, step=3 + sign, ids=torch.arange(400), width=500)
        mean = round_stochastically(sign * x, dtype, noise).double().mean().item()
        assert mean == pytest.approx(sign * (1.0 + step), abs=0.02 * step)
    bits = rounding_noise(seed=7, step=0, ids=torch.arange(400), width=500)  # int32
    assert bits.dtype == torch.int32
    for shift in (0, 12, 28):  # low, middle and high bits are each uniform
        counts = torch.bincount(((bits >> shift) & 0xF).flatten().long(), minlength=16)
        assert (counts.double() / counts.double().mean() - 1).abs().max() < 0.03


def test_hybrid_adam_moves_half_entries_by_small_steps_on_average():
    """An Adam step of 1e-3 is under half a bfloat16 ulp of entries near 1: rounded to nearest
    it would vanish; rounded stochastically, the entries move by it on average."""
    torch.manual_seed(0)
    layer = HybridSoftmax(256, 256, temperature=1.0, rule=ClippedSoftmaxRule(0.5, 3.0),
                          initial_entries=64, store_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.store.keys.fill_(1.0)
    before = layer.store.keys.float().clone()
    for leaf in layer.entry_leaves():
        leaf.grad = -torch.ones_like(leaf)  # the first Adam step moves each number by +lr
    moments = EntryMoments(layer)
    moments.step(1e-3, (0.9, 0.999), 1e-8)
    moved = layer.store.keys.float() - before  # (64, 256), each 0 or one ulp (2^-7)
    assert layer.store.keys.dtype == torch.bfloat16
    assert set(moved.unique().tolist()) == {0.0, 2.0**-7}
    assert moved.mean().item() == pytest.approx(1e-3, rel=0.05)
    assert moments.m.keys.dtype == torch.float32  # the moments stay in the layer's dtype


@pytest.mark.parametrize("kernel", [n for n, k in KERNELS.items() if k.index_metric])
def test_large_batches_of_a_half_store_take_the_other_score_layout(kernel):
    """Over 128 queries the half-precision scores are formed as ``q @ keys.T`` (faster there
    on CPUs with AMX): the same products, the same answers as in batches of 100."""
    q, keys, values, weights = entries(n=400, batch=200)
    keys, values = keys.bfloat16(), values.bfloat16()
    kw = {"kernel": kernel, "temperature": TEMPERATURE[kernel], "chunk_size": 128}
    whole = attention(q, keys, values, weights, **kw)
    halves = torch.cat([attention(part, keys, values, weights, **kw) for part in q.split(100)])
    assert relative_error(whole, halves) < 1e-2
    ref = naive_attention(rounded64(q, torch.bfloat16), rounded64(keys, torch.bfloat16),
                          rounded64(values, torch.bfloat16), weights.double(), kernel=kernel,
                          temperature=TEMPERATURE[kernel])
    assert relative_error(whole, ref) < RTOL[torch.bfloat16]


def test_the_product_path_follows_the_cpu_and_can_be_forced(monkeypatch):
    from rcdl.ops import half

    monkeypatch.setattr(half.PRODUCTS, "_value", "auto")  # whatever RCDL_HALF_PRODUCTS says
    monkeypatch.setattr(half, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))  # AVX2 only
    assert half.upcast_chunks(torch.bfloat16, torch.device("cpu"))
    assert not half.upcast_chunks(torch.float32, torch.device("cpu"))
    assert not half.upcast_chunks(torch.bfloat16, torch.device("meta"))  # a GPU-like device
    with half.half_products("native"):
        assert not half.upcast_chunks(torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(half, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(half, "_aten_capability", lambda: "AVX512")  # as that CPU runs
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert not half.upcast_chunks(torch.bfloat16, torch.device("cpu"))
    assert half.upcast_chunks(torch.float16, torch.device("cpu"))  # no avx512_fp16
    with half.half_products("float32"):
        assert half.upcast_chunks(torch.bfloat16, torch.device("cpu"))


def test_an_emulated_machine_class_takes_the_path_of_a_real_one(monkeypatch):
    """Capping torch or oneDNN below half-precision units (how an AVX2-only or an AVX512
    CPU without bf16 is emulated) takes the float32-chunk path a real CPU of that class
    takes, though the CPU's own flags name avx512_bf16."""
    from rcdl.ops import half

    monkeypatch.setattr(half.PRODUCTS, "_value", "auto")
    monkeypatch.setattr(half, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(half, "_aten_capability", lambda: "AVX512")
    for cap, native in (("", True), ("AVX512_CORE_BF16", True), ("avx512_core_amx", True),
                        ("AVX512_CORE", False), ("AVX2", False)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert half.native_products(torch.bfloat16) is native, cap
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(half, "_aten_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert half.upcast_chunks(torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(half, "widen_pays", lambda: False)  # where numba is slower here
    assert half.product_path(torch.bfloat16, torch.device("cpu")) == "float32 chunks"
    with pytest.raises(ValueError, match="one of auto, native, float32, widen, got 'fast'"):
        half.set_half_products("fast")


def test_the_float32_path_reads_chunks_and_keeps_the_store_half():
    """The store stays bfloat16 (its bytes); only chunks are converted, and the answer is the
    native path's up to the rounding of the queries."""
    q, keys, values, weights = entries(n=300)
    keys, values = keys.bfloat16(), values.bfloat16()
    with half_products("float32"):
        up = attention(q, keys, values, weights, kernel="softmax", chunk_size=64)
    with half_products("native"):
        native = attention(q, keys, values, weights, kernel="softmax", chunk_size=64)
    assert keys.dtype == values.dtype == torch.bfloat16 and up.dtype == torch.float32
    assert relative_error(up, native) < 1e-2
    exact = naive_attention(q.double(), rounded64(keys, torch.bfloat16),
                            rounded64(values, torch.bfloat16), weights.double(),
                            kernel="softmax")
    assert relative_error(up, exact) < 1e-5  # float32 products of the stored numbers


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("batch", [9, 200])  # a training batch and an evaluation batch
def test_converted_chunks_of_equal_keys_and_values_share_one_buffer_exactly(kernel, batch):
    """Where keys and values have one shape, a forward pass over converted chunks converts the
    values into the keys' buffer once the block is formed: the answer is still the float32
    products of the stored numbers (the keys are not read after the values overwrite them)."""
    q, keys, values, weights = entries(n=300, d_in=24, d_out=24, batch=batch)
    keys, values = keys.bfloat16(), values.bfloat16()
    with half_products("float32"):
        got = attention(q, keys, values, weights, kernel=kernel, chunk_size=64)
    exact = naive_attention(q.double(), rounded64(keys, torch.bfloat16),
                            rounded64(values, torch.bfloat16), weights.double(), kernel=kernel)
    assert relative_error(got, exact) < 1e-5
