"""Packed chunks (rcdl.ops.packed): the sums over a full chunk's entries multiplied from a
packed copy of the chunk give the plain products' answers (float32 and, where the CPU
multiplies it natively, bfloat16) and the float64 reference's within float32 rounding, in
outputs and gradients; chunks are packed at their first use and give the same numbers
whatever the cache holds; they are dropped on every change of the store's keys or values
other than an append, and never copied, pickled or saved (docs/precision.md, "Packed
chunks")."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

from rcdl import ClippedSoftmaxRule, FunctionalSGD, Grower, GrowingRBF, GrowingSoftmax
from rcdl.app.rundir import environment_info
from rcdl.nn.store import EntryStore
from rcdl.ops import packed as packing
from rcdl.ops.attention import attend
from rcdl.ops.entries import Entries
from rcdl.ops.half import native_products
from rcdl.ops.kernels import KERNELS
from rcdl.ops.packed import PackedChunks, packed_chunks

needs_packing = pytest.mark.skipif(not packing.supported(torch.float32),
                                   reason="this torch build's oneDNN does not pack float32")
DTYPES = [torch.float32] + [torch.bfloat16] * (packing.supported(torch.bfloat16)
                                                and native_products(torch.bfloat16))


def rows(n, d, dtype, seed):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def attend_and_grads(q, entries):
    """The output and the gradients w.r.t. the queries and the weights."""
    q = q.detach().requires_grad_()
    weights = entries.weights.detach().requires_grad_()
    out = attend(q, entries.replace(weights=weights, packed=entries.packed))
    (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
    return out.detach(), q.grad, weights.grad


@needs_packing
@pytest.mark.parametrize("mode", ["auto", "all"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_products_give_the_plain_products_and_the_float64_answers(kernel, dtype, mode):
    """53 rows in chunks of 8: six full chunks packed, a partial one plain. The first call
    packs every full chunk of keys and values (for the sums; with ``"all"`` for the scores
    too), and it and the second (from the packs kept) give the same bits; both agree with
    the plain path and with float64 over the stored numbers (the queries rounded as the
    products round them)."""
    n, d, d_out, b = 53, 12, 7, 5
    keys, values = rows(n, d, dtype, 0), rows(n, d_out, dtype, 1)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(2))
    q = rows(b, d, torch.float32, 3)
    cache = PackedChunks()
    entries = Entries(keys, values, weights, kernel, chunk_size=8)
    plain = attend_and_grads(q, entries)
    copies = 2 if mode == "all" else 1  # per chunk of keys and of values
    with packed_chunks(mode):
        first = attend_and_grads(q, entries.replace(packed=cache))
        assert len(cache) == 12 * copies
        second = attend_and_grads(q, entries.replace(packed=cache))
    for f, p in zip(first, second, strict=True):
        assert torch.equal(f, p)
    assert len(cache) == 12 * copies
    assert cache.nbytes >= copies * 6 * 8 * (d + d_out) * keys.element_size()
    q_products = q.to(dtype).double()  # the products multiply the queries in the store's dtype
    exact = attend_and_grads(q_products, Entries(keys.double(), values.double(),
                                                  weights.double(), kernel, chunk_size=8))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, p, a, e in zip(("output", "grad q", "grad w"), second, plain, exact, strict=True):
        scale = e.abs().max().item()
        torch.testing.assert_close(p, a, rtol=tol, atol=tol * scale, msg=name)
        torch.testing.assert_close(p.double(), e, rtol=tol, atol=tol * scale, msg=name)


@needs_packing
def test_a_chunk_is_packed_once_for_training_batches_with_the_mode_on():
    cache = PackedChunks()
    chunk = rows(16, 4, torch.float32, 0)
    first = cache.get("keys", chunk, 0, 16)
    assert first is not None and cache.get("keys", chunk, 0, 16) is first and len(cache) == 1
    assert cache.get("keys", chunk, 16, 16) is not None  # another chunk
    assert cache.get("values", chunk, 0, 16) is not None and len(cache) == 3  # another tensor
    assert cache.get("keys", chunk, 0, packing.MAX_BATCH + 1) is None  # an evaluation batch
    assert cache.get("keys", chunk, 0, 16, scores=True) is None  # scores: the mode "all" only
    with packed_chunks("all"):
        scores = cache.get("keys", chunk, 0, 16, scores=True)
        assert scores is not None and len(cache) == 4
        torch.testing.assert_close(packing.packed_product(chunk[:3], scores), chunk[:3] @ chunk.T)
        torch.testing.assert_close(packing.packed_product(chunk[:, :3].T, first),
                                   chunk[:, :3].T @ chunk)
    with packed_chunks("off"):
        assert cache.get("keys", chunk, 0, 16) is None
    assert cache.get("keys", chunk.double(), 32, 16) is None  # float64: never packed
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_the_mode_is_checked_and_recorded():
    with pytest.raises(ValueError, match="packed chunks mode must be one of auto, all, off"):
        packing.set_packed_chunks("on")
    env = environment_info("cpu")
    assert env["packed_chunks"] == packing.PACKED.get()
    assert set(env["packed_chunk_dtypes"]) == {"float32", "bfloat16"}
    with packed_chunks("off"):
        assert not any(packing.packed_dtypes().values())


def filled_store(n=40, dtype=torch.float32):
    store = EntryStore(6, 3, dtype=dtype)
    store.append(rows(n, 6, dtype, 0), rows(n, 3, dtype, 1))
    return store


def packed_store(n=40):
    store = filled_store(n)
    for begin in range(0, n - 7, 8):
        store.packed_chunks.get("keys", store.keys[begin:begin + 8], begin, 16)
    return store


@needs_packing
@pytest.mark.parametrize("change", ["remove", "rewrite", "touch", "moved", "to", "clear",
                                    "rewind", "load_rows", "storage_dtype"])
def test_every_change_of_keys_or_values_but_an_append_drops_the_packed_chunks(change):
    store = packed_store()
    assert len(store.packed_chunks) == 5 and "packed" in repr(store)
    store.append(rows(3, 6, torch.float32, 5), rows(3, 3, torch.float32, 6))
    assert len(store.packed_chunks) == 5  # rows after the full chunks: nothing changes
    store.rewrite(slice(0, 2), weights=torch.full((2,), 0.5))
    assert len(store.packed_chunks) == 5  # weights are not packed
    mask = torch.zeros(len(store), dtype=torch.bool)
    mask[3] = True
    {"remove": lambda: store.remove(mask),
     "rewrite": lambda: store.rewrite(slice(0, 1), keys=torch.zeros(1, 6)),
     "touch": store.touch, "moved": store.moved, "to": lambda: store.to(torch.float32),
     "clear": store.clear, "rewind": lambda: store.rewind(10, 10),
     "load_rows": lambda: store.load_rows(store.rows()),
     "storage_dtype": lambda: store.set_storage_dtype(torch.bfloat16)}[change]()
    assert len(store.packed_chunks) == 0 and store.packed_chunks.nbytes == 0


@needs_packing
def test_packed_chunks_are_never_copied_pickled_or_saved():
    store = packed_store()
    assert len(store.packed_chunks) == 5
    assert len(copy.deepcopy(store).packed_chunks) == 0  # an mkldnn tensor cannot be copied
    assert len(pickle.loads(pickle.dumps(store)).packed_chunks) == 0
    buffer = io.BytesIO()
    torch.save(store.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert set(state) == {"keys", "values", "weights", "written_at", "ids", "next_id"}
    assert len(store.packed_chunks) == 5  # saving keeps them


def test_entries_over_other_rows_leave_the_packed_chunks_out():
    store = filled_store()
    entries = Entries(store.keys, store.values, store.weights, "softmax",
                      packed=store.packed_chunks)
    assert entries.replace(chunk_size=8).packed is store.packed_chunks
    assert entries.rows(slice(8, 16)).packed is None
    assert entries.replace(values=store.values[:, :0]).packed is None
    assert entries.replace(keys=store.keys * 2).packed is None


def train(layer, steps=12, batch=6, seed=0):
    """``steps`` growth steps on random data; the layer's outputs on held-out inputs."""
    gen = torch.Generator().manual_seed(seed)
    grower = Grower(layer)
    for _ in range(steps):
        x = torch.randn(batch, layer.d_in, generator=gen).requires_grad_()  # grads both ways
        y = torch.randint(0, layer.d_out, (batch,), generator=gen)
        grower.zero_grad()
        F.cross_entropy(layer(x), y).backward()
        grower.step()
    with torch.no_grad():
        return layer(torch.randn(9, layer.d_in, generator=gen))


@needs_packing
@pytest.mark.parametrize("mode", ["auto", "all"])
@pytest.mark.parametrize("kind", ["gws", "rbf"])
def test_a_layer_trained_with_packed_chunks_learns_what_it_learns_without(kind, mode):
    """Growing layers in chunks of 8 growing to 72 entries (88 with the softmax's 16 initial
    ones): the keys and values of every full chunk are packed, and the trained layer answers
    as the one trained without packing, to float32 rounding carried through 12 steps."""
    def layer():
        torch.manual_seed(0)
        if kind == "rbf":
            return GrowingRBF(10, 4, temperature=1.0, rule=FunctionalSGD(0.5), chunk_size=8)
        return GrowingSoftmax(10, 4, temperature=2.0, rule=ClippedSoftmaxRule(0.1, 1.0),
                              chunk_size=8)

    packed_layer = layer()
    with packed_chunks(mode):
        with_packing = train(packed_layer)
    copies = 2 if mode == "all" else 1
    assert len(packed_layer.store.packed_chunks) >= copies * 2 * 7  # 7+ full chunks
    with packed_chunks("off"):
        plain_layer = layer()
        without = train(plain_layer)
    assert len(plain_layer.store.packed_chunks) == 0
    torch.testing.assert_close(with_packing, without, rtol=1e-4, atol=1e-5)
    assert len(packed_layer.store) == len(plain_layer.store) == 72 + 16 * (kind == "gws")


def test_a_layer_whose_entries_are_trained_hands_no_packed_chunks_to_the_attention():
    from rcdl.app.models import build_model

    model, _, _ = build_model("hybrid-tau50", 0)
    layers = [m for m in model.modules() if getattr(m, "trains_entries", False)]
    assert layers and all(layer.entries().packed is None for layer in layers)
    gws, _, _ = build_model("gws", 0)
    assert gws.blocks[0].entries().packed is gws.blocks[0].store.packed_chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", ["rbf", "laplacian"])
def test_a_distance_kernel_keeps_each_full_chunks_key_norms_with_the_same_numbers(kernel, dtype):
    """With packing off only the keys' squared norms are kept: six full chunks of 8 rows,
    formed at the first call, where the products take the store's rows as they lie (float32;
    bfloat16 with native products: elsewhere its chunks are widened or converted, and their
    norms formed on the way); the answers are those of entries without the cache, bit for
    bit, in outputs and gradients."""
    kept_bytes = 6 * 8 * 4 if dtype == torch.float32 or native_products(dtype) else 0
    n, d = 53, 12
    keys, values = rows(n, d, dtype, 0), rows(n, 7, dtype, 1)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(2))
    q = rows(5, d, torch.float32, 3)
    entries = Entries(keys, values, weights, kernel, chunk_size=8)
    cache = PackedChunks()
    with packed_chunks("off"):
        plain = attend_and_grads(q, entries)
        for _ in range(2):
            kept = attend_and_grads(q, entries.replace(packed=cache))
            assert len(cache) == 0 and cache.nbytes == kept_bytes  # float32 norms, no packs
            for a, b in zip(plain, kept, strict=True):
                assert torch.equal(a, b)
