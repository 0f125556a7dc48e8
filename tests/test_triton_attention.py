"""The Triton compute path (rcdl.ops.triton_attention) against the streaming path and the dense
twin: outputs, partial statistics and every gradient, on CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` is set when this module is imported, before triton is, so the kernels
(whose module is imported on first use) take CPU tensors. The path is registered for
``"cpu"`` by a fixture, with blocks of 16 so that the small shapes below span several blocks
of entries, of key and of value columns, and several blocks per split (the online softmax's
rescaling within a program) as well as several splits (their merge). The backward runs from
the scores the forward kept and, where the op keeps none, computing them again (``SAVED``).

Tolerances: float64 (the interpreter runs ``tl.dot`` in float64) agrees to summation order,
``rtol 1e-10``; float32 queries over a float32 or bfloat16 store agree with the streaming path
in its float32 product mode to float32's summation order, ``rtol 1e-5``; a bfloat16 store's
key and value gradients are returned in bfloat16, so they agree to its rounding, ``rtol 2⁻⁷``.
"""

import os
import subprocess
import sys
from pathlib import Path

# Before triton is imported (the extra's check imports it before the first test runs): triton
# defines its own language functions when it is imported, interpreted or compiled as this says.
# It stays set for the process (a test worker), where nothing else runs Triton kernels.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.testing import assert_close  # noqa: E402

from rcdl.ops import triton_attention  # noqa: E402
from rcdl.ops.attention import (  # noqa: E402
    attend,
    attend_partial,
    path_for,
    register_path,
    shares,
    unregister_path,
)
from rcdl.ops.entries import Entries, merge_partials  # noqa: E402
from rcdl.ops.kernels import naive_attention  # noqa: E402
from rcdl.ops.streaming import STREAMING  # noqa: E402
from rcdl.ops.triton_attention import KERNEL_CODES, TritonAttention  # noqa: E402

pytestmark = pytest.mark.extra("triton")


KERNELS = list(KERNEL_CODES)
F64 = {"dtype": torch.float64}
NAMES = ("q", "keys", "values", "weights")


@pytest.fixture
def triton_path():
    """The Triton path registered for CPU tensors (blocks of 16, two splits)."""
    path = register_path(TritonAttention(block_b=16, block_n=16, block_d=16, block_v=16,
                                         splits=2),
                         device="cpu", dtypes=[torch.float64, torch.float32, torch.bfloat16],
                         kernels=KERNELS)
    yield path
    unregister_path(path)


def make(n=50, d_in=12, d_out=20, batch=5, signs="mixed", seed=0, dtype=torch.float64):
    """Queries ``(batch, d_in)`` and entries; weights positive or of both signs."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, d_in, generator=gen, dtype=dtype)
    keys = torch.randn(n, d_in, generator=gen, dtype=dtype)
    values = torch.randn(n, d_out, generator=gen, dtype=dtype)
    weights = torch.rand(n, generator=gen, dtype=dtype) + 0.1
    if signs == "mixed":
        weights = weights - 0.45
    return q, keys, values, weights


# the backward from the forward's kept scores, or computing them again (attend's save_fraction)
SAVED = {"kept": 1e3, "recomputed": 0.0}


def outputs_and_grads(q, keys, values, weights, grad, save_fraction=0.05, **settings):
    """The op's output and its four gradients (the path is whichever the op picks)."""
    leaves = [t.detach().requires_grad_() for t in (q, keys, values, weights)]
    out = attend(leaves[0], Entries(*leaves[1:], **settings), save_fraction=save_fraction)
    return (out, *torch.autograd.grad(out, leaves, grad))


def dense_outputs_and_grads(q, keys, values, weights, grad, kernel, temperature=1.0,
                            eps=1e-6):
    leaves = [t.detach().requires_grad_() for t in (q, keys, values, weights)]
    out = naive_attention(*leaves, kernel=kernel, temperature=temperature, eps=eps)
    return (out, *torch.autograd.grad(out, leaves, grad))


def assert_all_close(got, want, **tol):
    for name, a, b in zip(("out", *NAMES), got, want, strict=True):
        assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("saved", list(SAVED))
@pytest.mark.parametrize(("kernel", "signs"), [
    *((kernel, "mixed") for kernel in KERNELS), ("softmax", "positive")])
def test_outputs_and_gradients_match_the_dense_twin_and_streaming_float64(
        triton_path, kernel, signs, saved):
    """40 entries: two splits, of two blocks and one; two chunks of key and of value
    columns; the backward from the forward's scores or computing them again."""
    tensors = make(n=40, d_in=20, d_out=18, signs=signs)
    grad = torch.randn(5, 18, **F64)
    settings = {"kernel": kernel, "temperature": 0.8}
    got = outputs_and_grads(*tensors, grad, SAVED[saved], **settings)
    assert path_for(tensors[0], Entries(*tensors[1:], **settings)) is triton_path
    dense = dense_outputs_and_grads(*tensors, grad, kernel, temperature=0.8)
    streaming = outputs_and_grads(*tensors, grad, **settings, chunk_size=7)
    assert_all_close(got, dense, rtol=1e-10, atol=1e-12)
    assert_all_close(got, streaming, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("saved", list(SAVED))
@pytest.mark.parametrize("kernel", ["rbf", "laplacian"])
def test_gradcheck(triton_path, kernel, saved):
    """The backward against finite differences of the forward (float64, both signs), for the
    distance kernels (the softmax's: with its guard, below; every kernel's gradients match
    the dense twin's autograd above)."""
    tensors = [t.requires_grad_() for t in make(n=20, d_in=4, d_out=3, batch=3)]

    def f(q, keys, values, weights):
        return attend(q, Entries(keys, values, weights, kernel, temperature=0.9),
                      save_fraction=SAVED[saved])

    assert torch.autograd.gradcheck(f, tensors, fast_mode=True)


def test_the_guard_acts_and_its_gradient_is_exact(triton_path):
    """With weights of both signs and a wide guard (eps = 0.3), some queries' denominators
    are floored at ±eps·mass: output and gradients still match the dense twin and the
    streaming path, and finite differences."""
    q, keys, values, weights = make(n=40, d_out=4, signs="mixed", seed=3)
    weights = weights - 0.1
    entries = Entries(keys, values, weights, "softmax", eps=0.3)
    part = attend_partial(q, entries)
    clamped = part.den.abs() < 0.3 * part.mass
    assert clamped.any() and not clamped.all(), clamped
    grad = torch.randn(5, 4, **F64)
    got = outputs_and_grads(q, keys, values, weights, grad, kernel="softmax", eps=0.3)
    dense = dense_outputs_and_grads(q, keys, values, weights, grad, "softmax", eps=0.3)
    streaming = outputs_and_grads(q, keys, values, weights, grad, kernel="softmax", eps=0.3,
                                  chunk_size=9)
    assert_all_close(got, dense, rtol=1e-10, atol=1e-12)
    assert_all_close(got, streaming, rtol=1e-10, atol=1e-12)
    small = [q[:3, :6], keys[:, :6], values[:, :3], weights]  # a smaller problem for gradcheck
    leaves = [t.detach().clone().requires_grad_() for t in small]

    def f(q, keys, values, weights):
        return attend(q, Entries(keys, values, weights, "softmax", eps=0.3))

    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)


@pytest.mark.parametrize(("kernel", "splits"), [("softmax", 1), ("softmax", 3), ("rbf", 3)])
def test_partials_match_streaming_and_merge(kernel, splits):
    """The partial statistics ``(m, num, den, mass)`` over all entries are the streaming
    path's, however the entries are split among programs, and partials of two parts merge
    into the whole's (the sharded and cached paths' use). 20 queries: two blocks of them."""
    q, keys, values, weights = make(n=70, d_out=3, batch=20)
    entries = Entries(keys, values, weights, kernel, temperature=1.3)
    path = TritonAttention(block_b=16, block_n=16, block_d=16, block_v=16, splits=splits)
    whole, _ = path.forward(q, entries, keep=False)
    reference, _ = STREAMING.forward(q, entries, keep=False)
    for a, b in zip(whole, reference, strict=True):
        assert_close(a, b, rtol=1e-10, atol=1e-12)
    first, _ = path.forward(q, entries.rows(slice(0, 23)), keep=False)
    rest, _ = path.forward(q, entries.rows(slice(23, None)), keep=False)
    for a, b in zip(merge_partials(first, rest), whole, strict=True):
        assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("saved", list(SAVED))
@pytest.mark.parametrize(("kernel", "store"), [
    ("softmax", torch.float32), ("softmax", torch.bfloat16), ("rbf", torch.bfloat16),
    ("linear", torch.bfloat16)], ids=["softmax-float32", "softmax-bfloat16", "rbf-bfloat16",
                                      "linear-bfloat16"])
def test_float32_queries_over_float32_and_bfloat16_stores(triton_path, kernel, store, saved):
    """float32 queries over a float32 or bfloat16 store: the streaming path with products on
    float32 copies of the store's chunks (what the Triton path does), and the dense twin in
    float64 on the stored numbers."""
    q, keys, values, weights = make(n=40, d_out=6, signs="mixed", dtype=torch.float32)
    keys, values = keys.to(store), values.to(store)
    grad = torch.randn(5, 6)
    settings = {"kernel": kernel, "temperature": 0.9, "half_products": "float32"}
    got = outputs_and_grads(q, keys, values, weights, grad, SAVED[saved], **settings)
    assert [t.dtype for t in got] == [torch.float32, torch.float32, store, store, torch.float32]
    streaming = outputs_and_grads(q, keys, values, weights, grad, **settings, chunk_size=11)
    dense = dense_outputs_and_grads(*(t.double() for t in (q, keys, values, weights)),
                                    grad.double(), kernel, temperature=0.9)
    if store == torch.float32:
        assert_all_close(got, streaming, rtol=1e-5, atol=1e-5)
        assert_all_close(got, [t.float() for t in dense], rtol=1e-5, atol=1e-5)
    else:  # the store's gradients are rounded to bfloat16
        tol = {"rtol": 2.0**-7, "atol": 1e-2}
        for i, (a, b) in enumerate(zip(got, streaming, strict=True)):
            assert_close(a, b, **({"rtol": 1e-5, "atol": 1e-5} if i in (0, 1, 4) else tol))
        for i, (a, b) in enumerate(zip(got, dense, strict=True)):
            assert_close(a.double(), b, **({"rtol": 1e-5, "atol": 1e-5} if i in (0, 1, 4)
                                            else tol))


def test_float64_queries_over_a_bfloat16_store_match_exactly_in_float64(triton_path):
    """The store's tiles are converted in registers: float64 queries over a bfloat16 store are
    the dense twin on the stored numbers, to float64's summation order."""
    q, keys, values, weights = make(n=30, signs="mixed")
    keys, values = keys.bfloat16(), values.bfloat16()
    grad = torch.randn(5, 20, **F64)
    got = outputs_and_grads(q, keys, values, weights, grad, kernel="softmax")
    dense = dense_outputs_and_grads(q, keys.double(), values.double(), weights, grad, "softmax")
    assert_close(got[0], dense[0], rtol=1e-10, atol=1e-12)
    assert_close(got[1], dense[1], rtol=1e-10, atol=1e-12)
    assert_close(got[4], dense[4], rtol=1e-10, atol=1e-12)
    assert_close(got[2].double(), dense[2], rtol=2.0**-8, atol=1e-6)  # rounded to bfloat16
    assert_close(got[3].double(), dense[3], rtol=2.0**-8, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_shares_match_streaming_and_sum_to_the_output(triton_path, kernel):
    """The entries' shares of the output projected on a direction per query
    (``rcdl.ops.attention.shares``, which takes the Triton path's own): the streaming path's
    in float64, summing over the entries to the output's projection; the softmax with its
    guard acting for some queries."""
    q, keys, values, weights = make(n=40, d_out=4, signs="mixed", seed=3)  # as for the guard
    eps = 0.3 if kernel == "softmax" else 1e-6
    entries = Entries(keys, values, weights - 0.1, kernel, eps=eps)
    direction = torch.randn(5, 4, **F64)
    got = shares(q, entries, direction)
    whole = None
    if kernel == "softmax":
        whole, _ = STREAMING.forward(q, entries.replace(values=values[:, :0]), keep=False)
        clamped = whole.den.abs() < eps * whole.mass
        assert clamped.any() and not clamped.all(), clamped
    want = STREAMING.shares(q, entries, direction, whole)
    assert_close(got, want, rtol=1e-10, atol=1e-12)
    out = attend(q, entries)
    assert_close(got.sum(1), (out * direction).sum(1), rtol=1e-10, atol=1e-12)
    assert torch.equal(shares(q, entries.rows(slice(0, 0)), direction), torch.zeros(5, 0, **F64))


@pytest.mark.parametrize("kernel", ["softmax", "rbf"])
def test_only_the_gradients_asked_for_and_an_empty_store(triton_path, kernel):
    q, keys, values, weights = make(n=30)
    leaves = [q.clone().requires_grad_(), keys, values.clone().requires_grad_(), weights]
    out = attend(leaves[0], Entries(*leaves[1:], kernel))
    grad_q, grad_v = torch.autograd.grad(out, [leaves[0], leaves[2]], torch.ones_like(out))
    ref = dense_outputs_and_grads(q, keys, values, weights, torch.ones_like(out), kernel)
    assert_close(grad_q, ref[1], rtol=1e-10, atol=1e-12)
    assert_close(grad_v, ref[3], rtol=1e-10, atol=1e-12)
    empty = Entries(keys[:0], values[:0], weights[:0], kernel)
    for a, b in zip(triton_path.forward(q, empty, keep=False)[0],
                    STREAMING.forward(q, empty, keep=False)[0], strict=True):
        assert torch.equal(a, b)
    q_leaf = q.clone().requires_grad_()
    out = attend(q_leaf, empty)
    assert torch.equal(out, torch.zeros(5, 20, **F64))
    (grad_q,) = torch.autograd.grad(out, [q_leaf], torch.ones_like(out))
    assert torch.equal(grad_q, torch.zeros_like(q))


def test_never_taken_on_cpu_unless_registered_and_interpreted(monkeypatch):
    """Importing rcdl registers the path for CUDA devices only; on CPU tensors it declines
    unless Triton's interpreter runs; where triton does not import it declines and says why."""
    q, keys, values, weights = make(n=10)
    entries = Entries(keys, values, weights, "softmax")
    assert path_for(q, entries) is STREAMING
    path = TritonAttention()
    assert path.supports(q, entries)  # interpreted here
    # a float32 store under float64 queries is no store the op takes from any path
    assert not path.supports(q, entries.replace(keys=keys.float(), values=values.float()))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not path.supports(q, entries)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(triton_attention._loaded, "module", "ImportError: no triton here")
    assert not path.supports(q, entries)
    assert path.unavailable == "ImportError: no triton here"
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        TritonAttention(block_n=24)


# Compiles the kernels for an sm_90 GPU (Triton's front end, then ptxas, which the triton wheel
# ships): a check that the interpreter cannot make, e.g. of tl.dot's shapes and dtypes. It
# runs in a process of its own, where the kernels are defined compiled, not interpreted.
COMPILE = """
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rcdl.ops import _triton_kernels as K
blocks = dict(BLOCK_B=16, BLOCK_N=64, BLOCK_D=128, BLOCK_V=128)  # the defaults
code, distance = int(sys.argv[1]), sys.argv[2] == "distance"  # the kernel's code and kind
for fn in (K.attention_forward, K.attention_grad_queries, K.attention_grad_entries):
    names = fn.arg_names
    const = dict(KERNEL=code, DISTANCE=distance, SAVED=True, NEED_Q=True, NEED_K=True,
                 NEED_V=True, NEED_W=True, SHARES=False, **blocks)
    const = {k: v for k, v in const.items() if k in names}
    signature = {n: "constexpr" if n in const else "*bf16" if n in ("k_ptr", "v_ptr")
                 else "*fp32" if n.endswith("_ptr") else "fp32" if n in ("tau", "scale")
                 else "i32" for n in names}
    try:
        source = ASTSource(fn=fn, signature=signature,
                           constexprs={(names.index(k),): v for k, v in const.items()})
    except TypeError as err:  # another triton's compiler API
        print("UNKNOWN API", err)
        sys.exit(0)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm, fn
print("COMPILED")
"""


@pytest.mark.spawns
@pytest.mark.parametrize("code, kind", [(1, "distance"), (3, "normalised")],
                         ids=["rbf", "softmax"])
def test_the_kernels_compile_for_a_gpu(code, kind):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE, str(code), kind], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    if "UNKNOWN API" in run.stdout:
        pytest.skip(f"this triton's compiler API is not the one this test calls: {run.stdout}")
    assert "COMPILED" in run.stdout, run.stdout + run.stderr


@pytest.mark.spawns
def test_the_gpu_check_script_agrees_on_cpu_through_the_interpreter():
    """benchmarks/check_triton.py (the first step of benchmarks/gpu_speed.sh) compares the
    Triton path with the streaming one and fails on a disagreement; on CPU through the
    interpreter, at small shapes, the two agree."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "check_triton.py"
    run = subprocess.run([sys.executable, str(script), "--device", "cpu", "--entries", "40",
                          "--width", "16", "--batches", "5", "18", "--kernels", "softmax"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if "rel. error" in line]
    assert len(lines) == 4 and not any("FAILED" in line for line in lines), run.stdout
