"""A compute path is one class registered for (device, dtype, kernel); every caller of the
attention op then computes through it (docs/architecture.md, "The attention op").

The path below is the whole of a new one, written for the test: dense attention from the
kernels' formulas, its backward by autograd over the same formulas. It is registered for
float64 on CPU only, so the float32 and bfloat16 calls keep the streaming path."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import (
    ClippedSoftmaxRule,
    FunctionalSGD,
    Grower,
    GrowingRBFNet,
    GrowingSoftmaxNet,
    explain,
    growing_layers,
)
from rcdl.nn.backends import enable_eval_cache, start_evaluation
from rcdl.ops.attention import (
    attend,
    attend_partial,
    attention,
    path_for,
    register_path,
    resume,
    shares,
    unregister_path,
)
from rcdl.ops.entries import Entries, Partial
from rcdl.ops.kernels import naive_attention
from rcdl.ops.streaming import STREAMING


class DensePath:
    """Dense attention: ``(B, N)`` kernel values at once. Counts its calls."""

    name = "dense (test)"

    def __init__(self) -> None:
        self.calls = {"forward": 0, "backward": 0}

    def supports(self, q, entries):
        return entries.chunk_size is None  # declines an explicit chunk size

    def forward(self, q, entries, *, keep):
        self.calls["forward"] += 1
        kernel, tau = entries.kernel, entries.tau(q.shape[1])
        values, weights = entries.values, entries.weights
        phi = kernel.dense(q, entries.keys, tau)  # (B, N)
        if not kernel.normalised:
            zero = q.new_zeros(q.shape[0])
            return Partial(zero, (phi * weights) @ values, zero, zero.clone()), None
        if len(entries) == 0:
            m = q.new_full((q.shape[0],), float("-inf"))
            return Partial(m, q.new_zeros(q.shape[0], values.shape[1]), m * 0, m * 0), None
        m = phi.amax(1)
        e = torch.exp(phi - m[:, None])
        return Partial(m, e @ values, e @ weights, e @ weights.abs()), None

    def backward(self, grad_out, q, entries, out, m, den, clamped, *, needs, saved):
        self.calls["backward"] += 1
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in
                      zip((q, entries.keys, entries.values, entries.weights), needs, strict=True)]
            again = naive_attention(*leaves, kernel=entries.kernel,
                                    temperature=entries.temperature, eps=entries.eps)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(again, wanted, grad_out, allow_unused=True))
        return tuple(next(grads) if t.requires_grad else None for t in leaves)


@pytest.fixture
def dense():
    path = register_path(DensePath(), device="cpu", dtypes=[torch.float64],
                         kernels=["softmax", "rbf", "linear"])
    yield path
    unregister_path(path)


def test_registration_picks_the_path_for_its_device_dtype_and_kernel(dense):
    q = torch.randn(2, 4, dtype=torch.float64)
    f64 = {"dtype": torch.float64}
    entries = Entries(torch.randn(5, 4, **f64), torch.randn(5, 3, **f64), torch.ones(5, **f64),
                      "softmax")
    assert path_for(q, entries) is dense
    assert path_for(q, entries.replace(kernel="laplacian")) is STREAMING  # not registered
    assert path_for(q, entries.replace(chunk_size=2)) is STREAMING  # declined by supports
    assert path_for(q.float(), entries.replace(keys=entries.keys.float(),
                                               values=entries.values.float(),
                                               weights=entries.weights.float())) is STREAMING
    unregister_path(dense)
    assert path_for(q, entries) is STREAMING


@pytest.mark.parametrize("kernel", ["softmax", "rbf", "linear"])
def test_a_registered_path_answers_the_op_like_the_streaming_path(dense, kernel):
    torch.manual_seed(0)
    q = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    keys, values = torch.randn(30, 6, dtype=torch.float64), torch.randn(30, 3, dtype=torch.float64)
    weights = torch.rand(30, dtype=torch.float64) - 0.2  # both signs
    tensors = [t.requires_grad_() for t in (keys, values, weights)]
    grad = torch.randn(5, 3, dtype=torch.float64)
    answers = []
    for chunk in (None, 7):  # None: the dense path; 7: the streaming one (declined)
        out = attention(q, *tensors, kernel=kernel, temperature=0.7, chunk_size=chunk)
        answers.append((out, *torch.autograd.grad(out, [q, *tensors], grad)))
    assert dense.calls == {"forward": 1, "backward": 1}
    for a, b in zip(*answers, strict=True):
        assert_close(a, b, rtol=1e-10, atol=1e-12)
    entries = Entries(keys.detach(), values.detach(), weights.detach(), kernel, 0.7)
    part, state = resume(q.detach(), entries)  # the path has no resume: a full pass
    assert state is None and dense.calls["forward"] == 2
    assert_close(part.num, attend_partial(q.detach(), entries).num)


def train(model, x, y, steps=4):
    grower = Grower(model)
    for rows in torch.arange(len(x)).split(len(x) // steps):
        grower.zero_grad()
        F.mse_loss(model(x[rows]), y[rows]).backward()
        grower.step()
    return model


@pytest.mark.parametrize("make", [
    lambda: GrowingRBFNet(6, 2, 2, temperature=1.0, rule=FunctionalSGD(0.5)),
    lambda: GrowingSoftmaxNet(6, 2, 2, temperature=1.0, rule=ClippedSoftmaxRule(0.3, 2.0)),
], ids=["rbf", "softmax"])
def test_every_caller_computes_through_the_registered_path(dense, make):
    """Training (forward, backward, the step's look-ahead), the evaluation cache and
    attribution go through the path registered for float64, and give what the streaming path
    gives."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 6, dtype=torch.float64), torch.randn(32, 2, dtype=torch.float64)
    models = []
    for registered in (True, False):
        if not registered:
            unregister_path(dense)
        torch.manual_seed(1)
        model = train(make().double(), x, y)
        for _, layer in growing_layers(model):
            enable_eval_cache(layer)
            start_evaluation(layer)
        with torch.no_grad():
            out = model.eval()(x)
        models.append((model, out, explain(model, x[:3], k=4)))
    (model, out, why), (twin, twin_out, twin_why) = models
    assert dense.calls["forward"] > 8 and dense.calls["backward"] >= 8
    assert_close(out, twin_out, rtol=1e-9, atol=1e-12)
    for (_, a), (_, b) in zip(growing_layers(model), growing_layers(twin), strict=True):
        assert_close(a.store.keys, b.store.keys, rtol=1e-9, atol=1e-12)
        assert_close(a.store.values, b.store.values, rtol=1e-9, atol=1e-12)
    for name, (contrib, ids) in why.layers.items():
        assert torch.equal(ids, twin_why.layers[name][1])
        assert_close(contrib, twin_why.layers[name][0], rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("kernel", ["softmax", "rbf"])
@pytest.mark.parametrize("products", ["native", "float32"])
def test_shares_sum_to_the_output_to_its_own_rounding(kernel, products):
    """A bfloat16 store's shares are formed from the products its output is formed from: they
    sum to the output to within one bfloat16 rounding of it (native products, which round
    each chunk's sum) or to float32's (products on float32 chunks)."""
    torch.manual_seed(0)
    q = torch.randn(8, 64)
    entries = Entries(torch.randn(300, 64).bfloat16(), torch.randn(300, 10).bfloat16(),
                      torch.rand(300), kernel, temperature=0.3, half_products=products)
    out = attend(q, entries)
    total = torch.stack([shares(q, entries, torch.eye(10)[i].expand(8, 10)).sum(1)
                         for i in range(10)], dim=1)  # (B, d_out)
    unit = 2.0**-8 if products == "native" else 2.0**-20
    assert ((total - out).abs() <= unit * out.abs() + 1e-6).all()
