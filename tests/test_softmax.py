"""Growing weighted-softmax layers: gauge symmetry, the three write rules, descent."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import ClippedSoftmaxRule, GaugeSoftmaxRule, Grower, GrowingSoftmax
from rcdl.ops.kernels import naive_attention
from rcdl.optim._step import commit, discard, propose

RULES = {
    "gws": ClippedSoftmaxRule(eta=0.3, beta=2.0),
    "normalized": ClippedSoftmaxRule(eta=0.3, beta=2.0, normalize=True),
    "gauge": GaugeSoftmaxRule(alpha=2.0, eta=0.3, beta=5.0),
}
LOSSES = {
    "mse": lambda s, y: F.mse_loss(s, y),
    "cross_entropy": lambda s, y: F.cross_entropy(s, y.argmax(1)),
}


def random_layer(rule, n=12, d_in=6, d_out=4, seed=0):
    torch.manual_seed(seed)
    layer = GrowingSoftmax(d_in, d_out, temperature=0.8, rule=rule, initial_entries=n).double()
    with torch.no_grad():  # a random store with positive weights
        layer.store.weights.copy_(torch.rand(n, dtype=torch.float64) + 0.2)
    return layer


def data(batch, d_in=6, d_out=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, d_in, generator=gen, dtype=torch.float64),
            torch.randn(batch, d_out, generator=gen, dtype=torch.float64))


def test_initial_database():
    layer = GrowingSoftmax(8, 5, temperature=1.0, rule=RULES["gws"], seed=3)
    assert len(layer.store) == 16
    assert_close(layer.store.keys.pow(2).mean(1), torch.ones(16))
    assert_close(layer.store.values.pow(2).mean(1), torch.ones(16))
    assert_close(layer.store.weights, torch.full((16,), 1 / 16))


def test_gauge_shift_moves_every_output_by_b():
    layer = random_layer(RULES["gws"]).eval()
    q, _ = data(7)
    b = torch.randn(4, dtype=torch.float64)
    with torch.no_grad():
        before = layer(q)
        layer.store.values.add_(layer.store.weights[:, None] * b)
        assert_close(layer(q), before + b)


@pytest.mark.parametrize("rule_name", RULES)
@pytest.mark.parametrize("loss_name", LOSSES)
def test_appending_the_rules_entries_decreases_the_loss_at_first_order(rule_name, loss_name):
    """d/dε of the batch loss after appending (εw, q, εṽ) for every sample equals
    Σ_i Σ_j c_i(k_j) (⟨ḡ_i, ṽ_j⟩ − w_j ⟨ḡ_i, s_i⟩), and is negative."""
    layer = random_layer(RULES[rule_name])
    q, y = data(5)
    loss_fn = LOSSES[loss_name]
    grower = Grower(layer)
    loss_fn(layer(q), y).backward()
    record = layer.recorder.ready()[0]
    keys, values, weights = propose(layer)
    grower.discard()
    tau = layer.temperature * 6**0.5
    c = torch.exp(q @ keys.T / tau - layer.log_normalizer(q)[:, None])  # (B, B) c_i(k_j)
    g, s = record.grad, record.s
    predicted = float((c * (g @ values.T - (g * s).sum(1, keepdim=True) * weights)).sum())

    def loss_after(eps):
        moved = copy.deepcopy(layer)
        commit(moved, (keys, eps * values, eps * weights))
        with torch.no_grad():
            return float(loss_fn(moved(q), y))

    h = 1e-6
    assert predicted < 0
    assert (loss_after(h) - loss_after(-h)) / (2 * h) == pytest.approx(predicted, rel=1e-4)


def test_single_sample_gauge_descent_closed_form():
    """For one sample, the gauge rule's first-order change is −c (β + ηα²) ‖ḡ‖²."""
    rule = RULES["gauge"]
    layer = random_layer(rule)
    q, y = data(1)
    F.mse_loss(layer(q), y).backward()
    g, s = layer.recorder.ready()[0].grad, layer.recorder.ready()[0].s
    keys, values, weights = propose(layer)
    discard(layer)
    c = torch.exp(q @ keys.T / (layer.temperature * 6**0.5) - layer.log_normalizer(q))
    lhs = c * ((g * values).sum() - weights * (g * s).sum())
    expected = -c * (rule.beta + rule.eta * rule.alpha**2) * g.pow(2).sum()
    assert_close(lhs.squeeze(), expected.squeeze())


def test_gauge_rule_keeps_old_entries_and_writes_positive_weights():
    layer = random_layer(RULES["gauge"])
    grower = Grower(layer)
    before = layer.store.rows()
    for seed in range(3):
        q, y = data(5, seed=seed)
        F.mse_loss(layer(q), y).backward()
        grower.step()
    n0 = before["keys"].shape[0]
    for name, old in before.items():
        assert torch.equal(getattr(layer.store, name)[:n0], old)  # bit for bit
    assert (layer.store.weights[n0:] > 0).all()


def test_gws_weights_are_clipped_and_non_negative():
    layer = random_layer(ClippedSoftmaxRule(eta=100.0, beta=1.0))
    q, y = data(8)
    F.mse_loss(layer(q) * 50, y).backward()
    _, _, weights = propose(layer)
    discard(layer)
    assert (weights >= 0).all() and (weights <= 100.0 * 8).all()


def test_normalized_rule_divides_the_clipped_rule_by_the_normaliser():
    """``normalize=True`` is the clipped gws rule divided by Z(q), clip and max(0, ·) kept
    (it was called ``exact``, which it is not where the clip or the max act)."""
    q, y = data(3)
    entries = {}
    for name in ("gws", "normalized"):
        layer = random_layer(RULES[name])
        F.mse_loss(layer(q), y).backward()
        entries[name] = propose(layer)
        z = torch.exp(layer.log_normalizer(q))
        discard(layer)
    assert_close(entries["normalized"][1], entries["gws"][1] / z[:, None])
    assert_close(entries["normalized"][2], entries["gws"][2] / z)
    layer = random_layer(ClippedSoftmaxRule(eta=100.0, beta=1.0, normalize=True))
    F.mse_loss(layer(q) * 50, y).backward()
    assert (propose(layer)[2] >= 0).all()  # the max(0, ·) is kept
    discard(layer)
    with pytest.raises(TypeError, match="exact"):
        ClippedSoftmaxRule(eta=0.3, beta=2.0, exact=True)  # the misleading name is gone


def test_query_gradient_matches_dense_reference():
    layer = random_layer(RULES["gws"], n=30)
    layer.chunk_size = 7
    q = data(4)[0].requires_grad_()
    (g_fast,) = torch.autograd.grad(layer(q).pow(2).sum(), q)
    discard(layer)
    store = layer.store
    ref = naive_attention(q, store.keys, store.values, store.weights, kernel="softmax",
                          temperature=layer.temperature)
    (g_ref,) = torch.autograd.grad(ref.pow(2).sum(), q)
    assert_close(g_fast, g_ref)
