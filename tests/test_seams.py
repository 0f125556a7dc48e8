"""Where two features meet: one test per seam defect found by review (each failed before its
fix). The sharded ones (capacity and error-scaled gates, half-precision hybrids) are in
``tests/test_distributed.py``; the random combinations of every feature are in
``tests/test_feature_matrix.py``."""

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from rcdl import (
    ClippedSoftmaxRule,
    DistanceGate,
    EntryAdam,
    FunctionalSGD,
    Grower,
    GrowingRBF,
    GrowingSoftmax,
    GrowingSoftmaxNet,
    HybridGrower,
    HybridSoftmax,
    HybridSoftmaxNet,
    growing_layers,
    use_exact,
    use_topk,
)
from rcdl.nn.backends import disable_eval_cache, enable_eval_cache, start_evaluation
from rcdl.ops.kernels import naive_attention
from rcdl.train.loop import train_one_pass

D = 5
F64_INDEX = {"backend": "exact", "dtype": torch.float64}


def batch(step, n=7, d=D, d_out=3):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x, torch.tanh(2 * x[:, :d_out])


def held_out(n=9, d=D):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def through_a_file(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# --------------------------------------------------------------------------- 2. half-precision
# stochastic rounding: a function of (seed, Adam step, entry id), not of torch's global stream


def bf16_hybrid(seed=0):
    torch.manual_seed(seed)
    net = HybridSoftmaxNet(D, 3, 1, temperature=1.0, initial_entries=4,
                           rule=ClippedSoftmaxRule(1.0, 2.0), trigger=DistanceGate(2.2),
                           store_dtype=torch.bfloat16).double()
    return net, HybridGrower(net, lr=0.05)


def train(net, opt, steps):
    for step in steps:
        x, y = batch(step)
        F.mse_loss(net.train()(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_a_bfloat16_hybrid_resumes_bit_identically_whatever_the_global_generator_did():
    """A resumed run draws its rounding noise from what is the same after a resume (the
    layer's seed, its Adam step and each entry's id), so it ends bit-identical to the
    uninterrupted run even though the process's global generator is elsewhere."""
    net, opt = bf16_hybrid()
    train(net, opt, range(6))
    with torch.no_grad():
        want = net.eval()(held_out())

    net, opt = bf16_hybrid()
    train(net, opt, range(3))
    saved = through_a_file([net.state_dict(), opt.state_dict()])
    torch.manual_seed(1234)  # a fresh process: the global generator is not where it was
    torch.rand(100)
    net, opt = bf16_hybrid()
    net.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    train(net, opt, range(3, 6))
    with torch.no_grad():
        assert torch.equal(net.eval()(held_out()), want)


def test_rounding_noise_follows_the_entry_not_its_row():
    """Removing rows (as a shard split or a budget does) leaves every other entry's noise as
    it was: the noise is keyed on the entry's id."""
    from rcdl.ops.rounding import rounding_noise

    ids = torch.arange(10)
    full = rounding_noise(seed=3, step=5, ids=ids, width=4, stream=1)  # (10, 4)
    odd = rounding_noise(seed=3, step=5, ids=ids[1::2], width=4, stream=1)
    assert torch.equal(odd, full[1::2])
    assert not torch.equal(full, rounding_noise(seed=3, step=6, ids=ids, width=4, stream=1))
    assert not torch.equal(full, rounding_noise(seed=4, step=5, ids=ids, width=4, stream=1))
    assert not torch.equal(full, rounding_noise(seed=3, step=5, ids=ids, width=4, stream=0))
    assert len(set(full.flatten().tolist())) == 40


# --------------------------------------------------------------------------- 3. one learner
# protocol: train_one_pass zeroes every learner's gradients after its step


class FrontedHybrid(nn.Module):
    """An ordinary ``nn.Linear`` in front of a hybrid net: parameters and entries."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.front = nn.Linear(D, D)
        self.net = HybridSoftmaxNet(D, 3, 1, temperature=1.0, initial_entries=4,
                                    rule=ClippedSoftmaxRule(1.0, 2.0), trigger=DistanceGate(2.2))
        self.double()

    def forward(self, x):
        return self.net(self.front(x))


def test_hybrid_grower_and_entry_adam_plus_grower_train_alike_in_train_one_pass():
    """``HybridGrower`` is ``EntryAdam`` then ``Grower``: through ``train_one_pass`` both
    give the same model when the model has ordinary parameters too (their gradients are
    zeroed after every step, whichever learner holds them)."""
    x, y = batch(0, n=64)
    data = (x, y, *batch(1, n=16))
    one, two = FrontedHybrid(), FrontedHybrid()
    kw = {"batch_size": 8, "eval_every": 4, "progress": False}
    train_one_pass(one, data, grower=HybridGrower(one, lr=0.05), **kw)
    train_one_pass(two, data, optimizer=EntryAdam(two, lr=0.05), grower=Grower(two), **kw)
    assert_close(one.front.weight, two.front.weight, rtol=1e-12, atol=1e-12)
    for (_, a), (_, b) in zip(growing_layers(one), growing_layers(two), strict=True):
        assert len(a.store) == len(b.store)
        assert_close(a.store.keys, b.store.keys, rtol=1e-12, atol=1e-12)


def test_the_hybrid_grower_docstring_loop_zeroes_gradients():
    import rcdl.nn.hybrid

    assert "opt.zero_grad()" in rcdl.optim.hybrid_grower.HybridGrower.__doc__
    assert "opt.zero_grad()" in rcdl.nn.hybrid.__doc__


# --------------------------------------------------------------------------- 4. a stale index
# changes which rows are chosen, never the attention over them


def test_evaluation_through_a_stale_index_attends_over_the_current_keys():
    """refresh_every = 3 and k ≥ N: after Adam moved the keys the index still holds their old
    values, but evaluation (no gradient) attends with the current ones: it equals exact
    attention, as training through the same index does."""
    torch.manual_seed(0)
    net = HybridSoftmaxNet(D, 3, 1, temperature=1.0, initial_entries=6,
                           rule=ClippedSoftmaxRule(1.0, 2.0), trigger=DistanceGate(2.2)).double()
    use_topk(net, 1000, train=True, refresh_every=3, **F64_INDEX)
    opt = HybridGrower(net, lr=0.05)
    q = held_out()
    for step in range(4):
        train(net, opt, [step])
        with torch.no_grad():
            got = net.eval()(q)
            modes = [layer.retrieval for _, layer in growing_layers(net)]
            use_exact(net)
            want = net(q)
        for (_, layer), mode in zip(growing_layers(net), modes, strict=True):
            layer.retrieval = mode
        assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"after step {step}")
    assert any(mode.stats()["stale_moves"] for mode in modes)  # the index did lag


# --------------------------------------------------------------------------- 5. the evaluation
# cache keeps its own partials


@pytest.mark.parametrize("kernel", ["rbf", "linear", "softmax"])
def test_an_in_place_op_on_an_evaluation_output_leaves_the_cache_intact(kernel):
    from rcdl import GrowingLinear

    torch.manual_seed(0)
    if kernel == "rbf":
        layer = GrowingRBF(D, 3, temperature=1.0, rule=FunctionalSGD(0.3))
    elif kernel == "linear":
        layer = GrowingLinear(D, 3, rule=FunctionalSGD(0.3, per_sample=False))
    else:
        layer = GrowingSoftmax(D, 3, temperature=1.0, rule=ClippedSoftmaxRule(0.3, 2.0))
    layer = layer.double()
    grower = Grower(layer)
    train(layer, grower, [0])
    enable_eval_cache(layer)
    q = held_out()
    for step in (1, 2):
        start_evaluation(layer.eval())
        with torch.no_grad():
            layer(q).mul_(0.0).add_(1e6)  # a user's in-place post-processing
        train(layer, grower, [step])
    start_evaluation(layer.eval())
    with torch.no_grad():
        cached = layer(q)
        disable_eval_cache(layer)
        assert_close(cached, layer(q), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- 6. a sharded
# Checkpointer given one path: see tests/test_distributed.py


# --------------------------------------------------------------------------- 7. entry weights
# with age coefficients keep the stored weights


def test_entry_weights_multiply_the_stored_weights_by_the_age_coefficients():
    layer = GrowingRBF(D, 3, temperature=1.0, rule=FunctionalSGD(0.2, momentum=0.5)).double()
    gen = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(4, n, generator=gen, dtype=torch.float64) for n in (D, 3))
    weights = torch.tensor([2.0, 0.5, 1.0, 3.0], dtype=torch.float64)
    layer.store.append(keys, values, weights, written_at=torch.tensor([0, 1, 1, 2]))
    layer.steps.fill_(3)
    ages = layer.rule.ages.entry(torch.tensor([3, 2, 2, 1]))
    assert_close(layer.entry_weights(), weights * ages, rtol=1e-15, atol=0)
    q = held_out()
    with torch.no_grad():
        want = naive_attention(q, keys, values, weights * ages, kernel="rbf")
        assert_close(layer.eval()(q), want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- 8. a normalised
# gws layer needs a starting store


def test_a_normalised_gws_layer_without_initial_entries_is_refused_at_construction():
    rule = ClippedSoftmaxRule(0.3, 2.0, normalize=True)
    with pytest.raises(ValueError, match="initial_entries"):
        GrowingSoftmax(D, 3, temperature=1.0, rule=rule, initial_entries=0)
    with pytest.raises(ValueError, match="initial_entries"):
        GrowingSoftmaxNet(D, 3, 1, temperature=1.0, rule=rule, initial_entries=0)
    GrowingSoftmax(D, 3, temperature=1.0, rule=rule, initial_entries=1)  # one is enough


# --------------------------------------------------------------------------- 9. in-place
# activations after a growing layer


def layered(kind, inplace):
    torch.manual_seed(0)
    if kind == "rbf":
        first = GrowingRBF(D, 6, temperature=1.0, rule=FunctionalSGD(0.3))
        second = GrowingRBF(6, 3, temperature=1.0, rule=FunctionalSGD(0.3))
    elif kind == "gws":
        first = GrowingSoftmax(D, 6, temperature=1.0, rule=ClippedSoftmaxRule(0.3, 2.0))
        second = GrowingSoftmax(6, 3, temperature=1.0, rule=ClippedSoftmaxRule(0.3, 2.0))
    else:
        rule, gate = ClippedSoftmaxRule(1.0, 2.0), DistanceGate(1.0)
        first = HybridSoftmax(D, 6, temperature=1.0, rule=rule, trigger=gate, initial_entries=4)
        second = HybridSoftmax(6, 3, temperature=1.0, rule=rule, trigger=gate, initial_entries=4)
    net = nn.Sequential(first, nn.ReLU(inplace=inplace), second).double()
    return net, (HybridGrower(net, lr=0.05) if kind == "hybrid" else Grower(net))


@pytest.mark.parametrize("kind", ["rbf", "gws", "hybrid"])
def test_an_in_place_activation_after_a_growing_layer_trains_as_an_out_of_place_one(kind):
    """``nn.ReLU(inplace=True)`` after a growing layer: the step runs, and what the layer
    recorded for its rule (its output before the ReLU) is not changed by it."""
    nets = [layered(kind, inplace) for inplace in (False, True)]
    for net, opt in nets:
        train(net, opt, range(4))
    (ref, _), (net, _) = nets
    for (_, a), (_, b) in zip(growing_layers(ref), growing_layers(net), strict=True):
        assert len(a.store) == len(b.store) > 4
        for name in ("keys", "values", "weights"):
            assert_close(getattr(b.store, name), getattr(a.store, name), rtol=1e-12,
                         atol=1e-12)


def test_an_in_place_activation_after_a_layer_that_is_the_first_trainable_one():
    """A growing layer fed by data alone makes its output a fresh leaf of the graph; an
    in-place op on that output must work as on any other."""
    layer = GrowingRBF(D, 3, temperature=1.0, rule=FunctionalSGD(0.3)).double()
    grower = Grower(layer)
    train(layer, grower, [0])
    x, y = batch(1)
    out = layer.train()(x)
    out.relu_()
    F.mse_loss(out, y).backward()
    grower.step()
    assert len(layer.store) == 14
