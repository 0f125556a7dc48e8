"""Growing layers: recorded per-sample gradients, first-order descent of the RBF rule,
state-dict round trips and moves."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import MLP, Grower, GrowingLinear, GrowingRBF, GrowingRBFNet, to_dual_form
from rcdl.nn.rules import FunctionalSGD
from rcdl.optim._step import commit, discard, propose


def regression_batch(batch=6, d_in=5, d_out=3, seed=0, target=torch.tanh):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_in, generator=gen, dtype=torch.float64)
    return x, target(x[:, :d_out])


def grown_rbf_net(steps=4, seed=0):
    torch.manual_seed(seed)
    net = GrowingRBFNet(5, 3, 2, temperature=0.5, rule=FunctionalSGD(0.5)).double()
    grower = Grower(net)
    for i in range(steps):
        x, y = regression_batch(seed=100 + i, target=lambda t: torch.sin(2 * t))
        F.mse_loss(net(x), y).backward()
        grower.step()
    return net, grower


def test_records_hold_per_sample_gradients():
    """ḡ recorded by the hook times B is the gradient of each sample's own loss."""
    net, _ = grown_rbf_net()
    x, y = regression_batch(batch=4)
    F.mse_loss(net(x), y).backward()
    record = net.readout.recorder.ready()[0]
    per_sample = torch.stack([
        torch.autograd.grad(F.mse_loss(s, t), s)[0]
        for s, t in zip(record.s.clone().requires_grad_(), y, strict=False)
    ])
    assert_close(record.grad * record.n_samples, per_sample)
    discard(net.readout)


def test_rbf_rule_decreases_the_loss_at_first_order():
    """Appending every layer's entries scaled by ε changes the batch loss at rate
    Σ_layers Σ_ij ⟨ḡ_i, φ(q_i, q_j) (−η g_j)⟩ < 0 (central finite differences)."""
    net, grower = grown_rbf_net()
    x, y = regression_batch(seed=7)
    F.mse_loss(net(x), y).backward()
    proposals = [propose(layer) for layer in grower.layers]
    predicted = 0.0
    for layer, (keys, values, _) in zip(grower.layers, proposals, strict=False):
        record = layer.recorder.ready()[0]
        tau = layer.temperature * layer.d_in**0.5
        phi = torch.exp(-torch.cdist(record.q, keys) ** 2 / (2 * tau))  # (B, B)
        predicted += float((record.grad * (phi @ values)).sum())
    grower.discard()

    def loss_after(eps):
        moved = copy.deepcopy(net)
        for layer, (keys, values, weights) in zip(Grower(moved).layers, proposals, strict=False):
            commit(layer, (keys, eps * values, weights))
        with torch.no_grad():
            return float(F.mse_loss(moved(x), y))

    h = 1e-5
    finite_diff = (loss_after(h) - loss_after(-h)) / (2 * h)
    assert predicted < 0
    assert finite_diff == pytest.approx(predicted, rel=1e-5)


def test_training_reduces_loss():
    torch.manual_seed(0)
    net = GrowingRBFNet(5, 3, 2, temperature=1.0, rule=FunctionalSGD(0.3)).double()
    grower = Grower(net)
    x_test, y_test = regression_batch(batch=200, seed=99)
    with torch.no_grad():
        before = F.mse_loss(net.eval()(x_test), y_test)
    net.train()
    for i in range(60):
        x, y = regression_batch(batch=8, seed=i)
        F.mse_loss(net(x), y).backward()
        grower.step()
    with torch.no_grad():
        after = F.mse_loss(net.eval()(x_test), y_test)
    assert after < 0.2 * before
    assert grower.num_entries == 60 * 8 * 3


def test_rbf_weight_decay_scales_old_entries():
    layer = GrowingRBF(2, 1, temperature=1.0, rule=FunctionalSGD(1.0, weight_decay=0.5)).double()
    keys = torch.zeros(1, 2, dtype=torch.float64)
    commit(layer, (keys, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)))
    commit(layer, (keys + 100, torch.zeros(1, 1, dtype=torch.float64),
                  torch.ones(1, dtype=torch.float64)))
    with torch.no_grad():
        assert float(layer.eval()(keys)) == pytest.approx(0.5)  # (1 - lr * wd) ** 1


def test_state_dict_round_trip_and_double():
    net, _ = grown_rbf_net()
    fresh = GrowingRBFNet(5, 3, 2, temperature=0.5, rule=FunctionalSGD(0.5)).double()
    fresh.load_state_dict(net.state_dict())
    x, _ = regression_batch(seed=3)
    with torch.no_grad():
        assert_close(fresh.eval()(x), net.eval()(x))
    assert int(fresh.readout.steps) == 4
    dual = to_dual_form(MLP(5, 8, 3), lr=0.1)
    dual.double()
    assert dual[0].store.dtype == torch.float64 and dual[0].weight0.dtype == torch.float64


def test_layer_called_twice_writes_both_calls():
    layer = GrowingLinear(3, 2, rule=FunctionalSGD(0.1, per_sample=False)).double()
    grower = Grower(layer)
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    (layer(a).sum() + layer(b).sum()).backward()
    grower.step()
    assert len(layer.store) == 6 and int(layer.steps) == 1


def test_leading_dims_are_flattened():
    layer = GrowingRBF(3, 2, temperature=1.0, rule=FunctionalSGD(1.0))
    grower = Grower(layer)
    x = torch.randn(4, 5, 3)  # (batch, tokens, d_in)
    assert layer(x).shape == (4, 5, 2)
    layer(x).pow(2).mean().backward()
    discard(layer)
    layer(x).pow(2).mean().backward()
    grower.step()
    assert len(layer.store) == 20


def test_every_network_is_built_the_same_way():
    """``Net(d_in, d_out, depth, *, temperature, rule, ...)``, the hidden width as width=."""
    from rcdl import (
        ClippedSoftmaxRule,
        GaugeSoftmaxRule,
        GrowingSoftmaxNet,
        HybridSoftmaxNet,
    )  # fmt: skip

    nets = [
        GrowingRBFNet(5, 3, 2, temperature=1.0, rule=FunctionalSGD(0.5), width=7),
        GrowingSoftmaxNet(5, 3, 2, temperature=1.0, rule=ClippedSoftmaxRule(0.1, 1.0), width=7),
        GrowingSoftmaxNet(5, 3, 2, temperature=1.0, rule=GaugeSoftmaxRule(1.0, 0.1, 1.0)),
        HybridSoftmaxNet(5, 3, 2, temperature=1.0, rule=ClippedSoftmaxRule(1.0, 1.0)),
    ]
    for net in nets:
        assert len(net.blocks) == 2 and net(torch.randn(4, 5)).shape == (4, 3)
    assert nets[0].readout.d_in == nets[1].readout.d_in == 7


def test_the_old_rbf_net_signature_says_what_changed():
    with pytest.raises(TypeError, match=r"hidden width moved .* to width="):
        GrowingRBFNet(5, None, 3, 2, temperature=1.0, rule=FunctionalSGD(0.5))


def test_rules_are_typed():
    from rcdl import LearningRule

    assert isinstance(FunctionalSGD(0.1), LearningRule)
    with pytest.raises(TypeError, match="rule must be a rcdl.nn.rules.LearningRule"):
        GrowingRBF(3, 2, temperature=1.0, rule=0.5)
    with pytest.raises(TypeError, match="per_sample=False"):
        GrowingLinear(3, 2, rule=FunctionalSGD(0.1))  # per-sample units: not SGD's dual
