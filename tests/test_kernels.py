"""Kernels are objects in a registry: a new kernel is one class, and the library runs it.

The Cauchy kernel below lives only in this test. It follows docs/architecture.md, "Adding a
kernel", step by step, and nothing else is edited: registered, it streams against its dense
twin (outputs and every gradient, float64, any chunking), passes gradcheck, trains a growing
layer with the functional-gradient rule, and its top-k attention with k ≥ N is exact.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close

from rcdl import FunctionalSGD, Grower, GrowingLayer
from rcdl.ops.attention import attention
from rcdl.ops.kernels import KERNELS, Kernel, check_kernel, naive_attention, register_kernel
from rcdl.retrieval.indices import ExactIndex
from rcdl.retrieval.topk import topk_attention


class CauchyKernel(Kernel):
    """``φ = 1 / (1 + ‖q − k‖² / τ)``: positive definite, bounded, heavy-tailed."""

    name = "cauchy"
    distance = True  # a function of ‖q − k‖²: the attention adds the −q, −k gradient terms
    index_metric = "l2"  # its largest values are at the nearest keys

    def values_(self, scores, q_sqnorm, keys, tau, dtype):
        k_sqnorm = (keys * keys).sum(1, dtype=dtype)  # (c,)
        sq = scores.mul_(-2).add_(q_sqnorm).add_(k_sqnorm[:, None]).clamp_min_(0.0)  # (c, B)
        return sq.div_(tau).add_(1.0).reciprocal_()

    def grad_factor_(self, grad, block, tau):
        # ∂φ/∂⟨q, k⟩ = 2φ²/τ, over scale(τ) = 1/τ
        return grad.mul_(block.square().mul_(2.0))

    def dense(self, q: Tensor, keys: Tensor, tau: float) -> Tensor:
        sq = ((q[:, None, :] - keys[None, :, :]) ** 2).sum(-1)
        return 1.0 / (1.0 + sq / tau)

    def log_kernel(self, index_score, tau):
        return -torch.log1p(index_score.clamp_min(0.0) / tau)


@pytest.fixture
def cauchy(monkeypatch):
    """The kernel registered for one test (in a copy of the registry)."""
    import rcdl.ops.kernels

    monkeypatch.setattr(rcdl.ops.kernels, "KERNELS", dict(rcdl.ops.kernels.KERNELS))
    return register_kernel(CauchyKernel())


def entries(n=13, d_in=5, d_out=3, batch=4):
    gen = torch.Generator().manual_seed(0)
    q, keys = (torch.randn(b, d_in, generator=gen, dtype=torch.float64) for b in (batch, n))
    values = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    weights = torch.rand(n, generator=gen, dtype=torch.float64) + 0.1
    return q, keys, values, weights


def test_the_registry_holds_the_library_kernels_by_name():
    assert list(KERNELS) == ["linear", "rbf", "laplacian", "softmax"]
    assert all(check_kernel(name) is kernel and kernel == name for name, kernel in
               KERNELS.items())
    with pytest.raises(ValueError, match="unknown kernel 'nope'; known kernels: linear, rbf"):
        check_kernel("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_kernel(type(KERNELS["rbf"])())


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_a_kernel_added_in_one_class_streams_like_its_dense_twin(cauchy, chunk):
    tensors = [t.requires_grad_() for t in entries()]
    fast = attention(*tensors, kernel="cauchy", temperature=0.8, chunk_size=chunk)
    ref = naive_attention(*tensors, kernel=cauchy, temperature=0.8)
    assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(fast, tensors, grad_out),
                    torch.autograd.grad(ref, tensors, grad_out), strict=True):
        assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda *t: attention(*t, kernel=cauchy, temperature=0.8, chunk_size=chunk), tensors)


def test_a_kernel_added_in_one_class_trains_a_growing_layer(cauchy):
    torch.manual_seed(0)
    x = torch.randn(96, 4)
    y = torch.sin(x.sum(1, keepdim=True))
    layer = GrowingLayer(4, 1, kernel="cauchy", temperature=0.5, rule=FunctionalSGD(0.5))
    grower = Grower(layer)
    for xb, yb in zip(x.split(8), y.split(8), strict=True):
        grower.zero_grad()
        F.mse_loss(layer(xb), yb).backward()
        grower.step()
    assert len(layer.store) == 96 and layer.kernel is cauchy
    with torch.no_grad():
        assert F.mse_loss(layer(x), y) < 0.5 * y.square().mean()  # it learned


def test_a_kernel_added_in_one_class_has_exact_top_k(cauchy):
    q, keys, values, weights = entries()
    index = ExactIndex("l2", dtype=torch.float64)
    index.add(keys)
    result = topk_attention(q, keys, values, weights, kernel="cauchy", temperature=0.8,
                            index=index, k=13)
    exact = attention(q, keys, values, weights, kernel="cauchy", temperature=0.8)
    assert_close(result.out, exact, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_row_norms_are_exact_sums_of_squares_in_blocks_and_in_one(dtype):
    """A half store's rows are widened a 4 MiB block at a time (more rows than one block
    here): every row's norm is the float64 sum of its stored numbers' squares, to the
    accumulating dtype's rounding, not to the store's."""
    from rcdl.ops.kernels import row_sq_norms

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(1500, 1000, generator=gen).to(dtype)  # 1 048 rows per float32 block
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    got = row_sq_norms(rows, acc)
    assert got.dtype == acc and got.shape == (1500,)
    want = rows.double().square().sum(1)
    assert ((got.double() - want).abs() / want).max() < (1e-12 if acc == torch.float64 else 1e-5)
    assert row_sq_norms(rows[:0], acc).shape == (0,)
