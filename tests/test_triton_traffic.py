"""The traffic model of the Triton path (rcdl.ops.triton_traffic) against what its kernels
load and store, counted under Triton's interpreter.

``TRITON_INTERPRET=1`` is set before triton is imported (as in tests/test_triton_attention.py).
A fixture wraps the interpreter's masked load and store and its launcher: every launch records,
by kernel argument, the elements whose mask holds. Each launch's counts must equal the model's
exactly: a change that reads a row of the keys or the values once more, or a scratch once
more, fails here. Small shapes with ragged blocks of queries, entries and columns, several
splits; the model's traffic at the paper's shape is then checked against the store's size.
"""

import inspect
import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from rcdl.ops.attention import attend  # noqa: E402
from rcdl.ops.entries import Entries  # noqa: E402
from rcdl.ops.triton_attention import TritonAttention  # noqa: E402
from rcdl.ops.triton_traffic import (  # noqa: E402
    H200,
    Problem,
    backward_launches,
    forward_launches,
    keeps,
    old_backward_launches,
    old_forward_launches,
    seconds,
    store_bytes,
)

pytestmark = pytest.mark.extra("triton")

interpreter = pytest.importorskip("triton.runtime.interpreter")

# the kernels' pointer arguments and the model's names for their tensors
TENSORS = {"q_ptr": "q", "k_ptr": "keys", "v_ptr": "values", "w_ptr": "weights", "g_ptr": "g",
           "stats_ptr": "stats", "scores_ptr": "scores", "num_ptr": "num", "c_ptr": "c",
           "p_ptr": "p", "dw_ptr": "dw", "out_ptr": "shares", "grad_k_ptr": "grad_k",
           "grad_v_ptr": "grad_v", "grad_w_ptr": "grad_w"}
BLOCKS = {"block_b": 16, "block_n": 16, "block_d": 16, "block_v": 16}


@pytest.fixture
def launches(monkeypatch):
    """The kernel launches of the test, each ``{"name", "grid", "loads", "stores"}`` with the
    elements loaded and stored by tensor."""
    record: list[dict] = []
    builder = interpreter.interpreter_builder
    load, store = builder.create_masked_load, builder.create_masked_store
    call = interpreter.GridExecutor.__call__

    def tally(kind, ptrs, mask):
        launch = record[-1]
        addresses = ptrs.data[mask.data.astype(bool)]
        for name, (first, end) in launch["ranges"].items():
            count = int(((addresses >= first) & (addresses < end)).sum())
            if count:
                launch[kind][name] = launch[kind].get(name, 0) + count

    def counted_load(ptrs, mask, other, cache_policy, is_volatile):
        tally("loads", ptrs, mask)
        return load(ptrs, mask, other, cache_policy, is_volatile)

    def counted_store(ptrs, value, mask, cache_policy):
        tally("stores", ptrs, mask)
        return store(ptrs, value, mask, cache_policy)

    def counted_call(self, *args, **kwargs):
        bound = inspect.getcallargs(self.fn, *args, **kwargs)
        ranges = {TENSORS[name]: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                  for name, t in bound.items() if isinstance(t, torch.Tensor) and t.numel()}
        record.append({"name": self.fn.__name__, "grid": tuple(self.grid), "loads": {},
                       "stores": {}, "ranges": ranges})
        return call(self, *args, **kwargs)

    monkeypatch.setattr(builder, "create_masked_load", counted_load)
    monkeypatch.setattr(builder, "create_masked_store", counted_store)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted_call)
    return record


def kernel_launches(model):
    """The model's kernel launches (not the torch operations around them)."""
    return [launch for launch in model if launch.grid]


def assert_counts_match(counted, model):
    assert [c["name"] for c in counted] == [m.name for m in model]
    for c, m in zip(counted, model, strict=True):
        assert c["grid"] == m.grid, c["name"]
        assert c["loads"] == m.loads, f"{c['name']} loads"
        assert c["stores"] == m.stores, f"{c['name']} stores"


NEEDS = {"all": (True, True, True, True), "queries": (True, False, False, False),
         "entries": (False, True, True, True), "values": (False, False, True, False)}


# every gradient set and both backward modes for the softmax; the other kernels differ from it
# in what their launches read (no normaliser, no shift), which every gradient at once shows
CASES = ([("softmax", needs, saved) for needs in NEEDS for saved in (False, True)]
         + [(kernel, "all", saved) for kernel in ("rbf", "linear") for saved in (False, True)])


@pytest.mark.parametrize(("kernel", "needs", "saved"), CASES,
                         ids=[f"{'kept' if s else 'recomputed'}-{n}-{k}" for k, n, s in CASES])
def test_the_kernels_load_and_store_what_the_model_says(launches, kernel, needs, saved):
    """20 queries (a block and a part), 70 entries (five blocks in three splits: two, two,
    and a part), 20 key and 18 value columns (a chunk and a part); float32 queries over a
    bfloat16 store; the backward from the forward's scores or computing them again."""
    gen = torch.Generator().manual_seed(0)
    b, n, d, d_out = 20, 70, 20, 18
    path = TritonAttention(**BLOCKS, splits=3)
    tensors = [torch.randn(b, d, generator=gen), torch.randn(n, d, generator=gen).bfloat16(),
               torch.randn(n, d_out, generator=gen).bfloat16(),
               torch.rand(n, generator=gen) + 0.5]
    leaves = [t.requires_grad_(need) for t, need in zip(tensors, NEEDS[needs], strict=True)]
    out = attend(leaves[0], Entries(*leaves[1:], kernel), path=path,
                 save_fraction=1e3 if saved else 0.0)
    torch.autograd.grad(out, [t for t in leaves if t.requires_grad], torch.randn(b, d_out))
    problem = Problem(b, n, d, d_out, kernel, store_bytes=2, splits=3,
                      **{k: v for k, v in BLOCKS.items()})
    model = kernel_launches(forward_launches(problem)
                            + backward_launches(problem, NEEDS[needs], saved))
    assert_counts_match(launches, model)
    forward = launches[0]["loads"]  # each key and value row once per block of queries
    assert forward["keys"] == 2 * n * d and forward["values"] == 2 * n * d_out


def test_the_paper_shape_reads_the_store_about_once():
    """At B = 16, N = 50 000 (a gws block, d = d_out = 3 072, and its readout, d_out = 10), in
    float32 and bfloat16 stores: the forward's HBM traffic and the backward's (the query
    gradient, from the kept scores) are each within 1.25× of one read of the store (every
    load counted, within 1.6×: the queries and the scratches re-read from L2), where the
    path before read the keys 48 times in each; the forward's floor on an H200 is
    bandwidth-bound."""
    cached = H200.l2_bytes / 4
    for d_out, store_size in [(3072, 4), (3072, 2), (10, 4), (10, 2)]:
        problem = Problem(16, 50_000, 3072, d_out, "softmax", store_bytes=store_size,
                          multiprocessors=H200.multiprocessors)
        store = store_bytes(problem)
        assert keeps(problem)
        for launches in (forward_launches(problem),
                         backward_launches(problem, NEEDS["queries"], saved=True)):
            assert sum(launch.hbm_bytes(cached) for launch in launches) <= 1.25 * store
            assert sum(launch.bytes for launch in launches) <= 1.6 * store
    problem = Problem(16, 50_000, 3072, 3072, "softmax", multiprocessors=H200.multiprocessors)
    store = store_bytes(problem)
    launch = forward_launches(problem)[0]
    assert launch.hbm_bytes(cached) / H200.bandwidth > launch.flops / H200.flops
    before = replace(problem, block_d=64, block_v=64)  # the path before: its blocks
    old = old_forward_launches(before)
    assert sum(launch.bytes for launch in old) >= 20 * store
    assert old[0].loads["keys"] == 48 * 50_000 * 3072
    assert seconds(forward_launches(problem), H200) < seconds(old, H200) / 10
    assert old_backward_launches(before, NEEDS["queries"])[0].loads["keys"] == 49 * 50_000 * 3072
