"""Exact equivalences: the dual form of an MLP trained by SGD is that MLP
(docs/reference.md §1, §3)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import MLP, Grower, to_dual_form
from rcdl.nn.age import AgeCoefficients

SETTINGS = [
    pytest.param({}, id="plain"),
    pytest.param({"weight_decay": 0.05}, id="weight_decay"),
    pytest.param({"momentum": 0.9}, id="momentum"),
    pytest.param({"weight_decay": 0.05, "momentum": 0.9}, id="decay+momentum"),
]


def teacher_batches(steps, batch=8, d_in=6, d_out=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, d_out, generator=gen, dtype=torch.float64)
    for _ in range(steps):
        x = torch.randn(batch, d_in, generator=gen, dtype=torch.float64)
        yield x, torch.tanh(x @ w)


@pytest.mark.parametrize("loss_name", ["mse", "cross_entropy"])
@pytest.mark.parametrize("opt_kw", SETTINGS)
def test_dual_form_mlp_equals_sgd_trained_mlp(opt_kw, loss_name):
    torch.manual_seed(0)
    mlp = MLP(6, 16, 3, depth=2, act="relu").double()
    dual = to_dual_form(mlp, lr=0.05, **opt_kw)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.05, **opt_kw)
    grower = Grower(dual)
    x_held = torch.randn(32, 6, dtype=torch.float64)

    def loss_fn(out, y):
        if loss_name == "mse":
            return F.mse_loss(out, y)
        return F.cross_entropy(out, y.argmax(1))

    for x, y in teacher_batches(25):
        opt.zero_grad()
        loss_fn(mlp(x), y).backward()
        opt.step()
        loss_fn(dual(x), y).backward()
        grower.step()

    mlp.eval()
    dual.eval()
    with torch.no_grad():
        assert_close(dual(x_held), mlp(x_held), rtol=1e-10, atol=1e-10)
    assert grower.num_entries == 25 * 8 * 3  # one entry per sample per layer


def test_layers_grow_by_batch_and_record_steps():
    dual = to_dual_form(MLP(6, 16, 3, depth=2).double(), lr=0.1)
    grower = Grower(dual)
    for x, y in teacher_batches(3, batch=5):
        F.mse_loss(dual(x), y).backward()
        grower.step()
    for layer in grower.layers:
        assert len(layer.store) == 15
        assert int(layer.steps) == 3
        assert layer.store.written_at.tolist() == [1] * 5 + [2] * 5 + [3] * 5


@pytest.mark.parametrize(("lr", "wd", "mu"), [(0.1, 0.3, 0.0), (0.1, 0.0, 0.8), (0.05, 0.2, 0.7)])
def test_age_coefficients_closed_forms(lr, wd, mu):
    ages = AgeCoefficients(lr, wd, mu)
    a = torch.arange(12)
    h = ages.entry(a)
    if mu == 0:
        assert_close(h, (1 - lr * wd) ** a.double())
        assert ages.initial(7) == pytest.approx((1 - lr * wd) ** 7)
    elif wd == 0:
        assert_close(h, (1 - mu ** (a.double() + 1)) / (1 - mu))
        assert ages.initial(7) == 1.0
    else:  # scalar SGD on one weight, with the impulse written at step 0, matches h
        w = torch.zeros((), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([w], lr=lr, momentum=mu, weight_decay=wd)
        for step in range(12):
            w.grad = torch.tensor(1.0 if step == 0 else 0.0, dtype=torch.float64)
            opt.step()
            assert float(w.detach()) == pytest.approx(-lr * float(h[step]))


def test_sgd_copy_is_independent():
    mlp = MLP(4, 8, 2).double()
    before = copy.deepcopy(mlp.state_dict())
    to_dual_form(mlp, lr=0.1)
    for k, v in mlp.state_dict().items():
        assert torch.equal(v, before[k])


def test_models_with_other_trainable_parameters_are_refused_by_name():
    """A LayerNorm's scale or an embedding would stay untrained in the dual form, so the copy
    would not be the SGD-trained model: refused, naming them."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.LayerNorm(6),
                                torch.nn.Linear(6, 3))
    with pytest.raises(ValueError, match=r"outside nn.Linear layers \(0.weight, 1.weight, "
                                         r"1.bias\)"):
        to_dual_form(model, lr=0.1)
    for module in (model[0], model[1]):
        module.requires_grad_(False)  # frozen: nothing left untrained, so it is accepted
    dual = to_dual_form(model, lr=0.1)
    assert not any(p.requires_grad for p in dual.parameters())


@pytest.mark.parametrize("opt_kw", SETTINGS)
def test_collapsed_dual_form_equals_the_growing_layers(opt_kw):
    """``from_dual_form`` turns every GrowingLinear into the nn.Linear ``r W₀ + Σ_j c_j v_j k_jᵀ``
    it computes: equal on held-out inputs to 1e-10 in float64, with the age coefficients of
    weight decay and momentum, and equal to the SGD-trained MLP itself."""
    from rcdl import from_dual_form
    from rcdl.nn.layers import GrowingLinear

    torch.manual_seed(0)
    mlp = MLP(6, 16, 3, depth=2, act="relu").double()
    dual = to_dual_form(mlp, lr=0.05, **opt_kw)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.05, **opt_kw)
    grower = Grower(dual)
    for x, y in teacher_batches(20):
        opt.zero_grad()
        F.mse_loss(mlp(x), y).backward()
        opt.step()
        F.mse_loss(dual(x), y).backward()
        grower.step()
    collapsed = from_dual_form(dual)
    assert not any(isinstance(m, GrowingLinear) for m in collapsed.modules())
    x_held = torch.randn(64, 6, dtype=torch.float64)
    with torch.no_grad():
        assert_close(collapsed(x_held), dual(x_held), rtol=1e-10, atol=1e-10)
        assert_close(collapsed(x_held), mlp(x_held), rtol=1e-10, atol=1e-10)
        for layer, linear in ((dual[0], collapsed[0]), (dual[-1], collapsed[-1])):
            assert_close(linear.weight, layer.to_linear().weight, rtol=0, atol=0)
    assert len(dual[0].store) == 20 * 8  # the dual form is untouched


def test_collapsed_layer_without_bias():
    from rcdl.nn.layers import GrowingLinear
    from rcdl.nn.rules import FunctionalSGD

    torch.manual_seed(0)
    layer = GrowingLinear(5, 2, bias=False, rule=FunctionalSGD(0.1, 0.01, 0.5, per_sample=False),
                          dtype=torch.float64)
    grower = Grower(layer)
    for _ in range(6):
        layer(torch.randn(4, 5, dtype=torch.float64)).pow(2).sum().backward()
        grower.step()
    x = torch.randn(10, 5, dtype=torch.float64)
    linear = layer.to_linear()
    assert linear.bias is None
    with torch.no_grad():
        assert_close(linear(x), layer(x), rtol=1e-10, atol=1e-10)
