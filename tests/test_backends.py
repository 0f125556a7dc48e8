"""A layer attends through one chain of backends (docs/architecture.md, "Backends"): the
switches install wrappers, and a backend of one's own is one class that wraps another."""

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import FunctionalSGD, Grower, GrowingRBFNet, growing_layers, use_exact, use_topk
from rcdl.nn.backends import (
    Backend,
    EvalCached,
    Exact,
    disable_eval_cache,
    enable_eval_cache,
    eval_cache_hits,
    start_evaluation,
    wrap_backend,
)
from rcdl.optim._step import propose


@dataclass(eq=False)
class Logged:
    """A no-op backend that counts what passes through it: the whole of a new backend."""

    inner: Backend
    calls: dict[str, int] = field(default_factory=dict)

    def _count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def attend(self, layer, q, entries=None, stats=None):
        self._count("attend")
        return self.inner.attend(layer, q, entries, stats)

    def partial(self, layer, q, entries):
        self._count("partial")
        return self.inner.partial(layer, q, entries)

    def nearest_sq_distance(self, layer, q):
        self._count("nearest")
        return self.inner.nearest_sq_distance(layer, q)

    def size(self, layer):
        self._count("size")
        return self.inner.size(layer)


def chain(layer):
    kinds, node = [], layer.backend.chain
    while node is not None:
        kinds.append(type(node).__name__)
        node = node.inner
    return kinds


def net_and_data():
    torch.manual_seed(0)
    net = GrowingRBFNet(6, 2, 1, temperature=1.0, rule=FunctionalSGD(0.5)).double()
    x, y = torch.randn(40, 6, dtype=torch.float64), torch.randn(40, 2, dtype=torch.float64)
    return net, x, y


def test_the_switches_compose_one_chain_and_keep_a_wrapper_of_ones_own():
    net, _, _ = net_and_data()
    layer = net.blocks[0]
    assert chain(layer) == ["Exact"] and layer.retrieval is None and layer.shard is None
    wrap_backend(layer, Logged)
    use_topk(net, 100, backend="exact", dtype=torch.float64)
    enable_eval_cache(layer)
    assert chain(layer) == ["Logged", "TopK", "EvalCached", "Exact"]
    assert layer.retrieval is layer.backend.chain.inner.mode
    disable_eval_cache(layer)
    use_exact(net)
    assert chain(layer) == ["Logged", "Exact"]
    with pytest.raises(TypeError, match="dataclass backend whose inner is the backend"):
        wrap_backend(layer, lambda inner: Exact())


def test_a_backend_of_ones_own_sees_every_call_and_changes_nothing():
    net, x, y = net_and_data()
    twin, _, _ = net_and_data()
    for _, layer in growing_layers(net):
        wrap_backend(layer, Logged)
    for model in (net, twin):
        grower = Grower(model)
        for rows in torch.arange(40).split(8):
            grower.zero_grad()
            F.mse_loss(model(x[rows]), y[rows]).backward()
            grower.step()
        for _, layer in growing_layers(model):
            enable_eval_cache(layer)
        with torch.no_grad():
            for _ in range(2):  # the second evaluation is served by the cache
                for _, layer in growing_layers(model):
                    start_evaluation(layer)
                out = model.eval()(x)
    with torch.no_grad():
        assert_close(net(x), twin(x), rtol=0, atol=0)
    logged = net.blocks[0].backend.chain
    assert isinstance(logged, Logged) and isinstance(logged.inner, EvalCached)
    assert logged.calls["attend"] == 5 + 2 + 1  # 5 training steps, 2 evaluations, 1 check
    assert eval_cache_hits(net.blocks[0]) == 1 and out.shape == (40, 2)


def test_the_normalised_rule_reads_the_forwards_normaliser_instead_of_the_store_again():
    """``ClippedSoftmaxRule(normalize=True)`` needs ``log Z`` of the pre-step store; the
    forward's attention has folded it already, so the step asks the backend nothing more, and
    the entries equal those of a second pass over the store."""
    from rcdl import ClippedSoftmaxRule, GrowingSoftmax
    from rcdl.nn.rules import Step

    torch.manual_seed(0)
    layer = GrowingSoftmax(6, 2, temperature=1.0, rule=ClippedSoftmaxRule(0.3, 2.0, normalize=True),
                           initial_entries=4, seed=0).double()
    grower = Grower(layer)
    wrap_backend(layer, Logged)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    F.mse_loss(layer(x), y).backward()
    record = layer.recorder.ready()[0]
    again = layer.rule.entries(Step(record.q, record.s, record.grad_mean, record.n_samples,
                                    log_z=layer.log_normalizer(record.q)))
    layer.backend.chain.calls.clear()
    proposed = propose(layer)
    assert "partial" not in layer.backend.chain.calls
    for a, b in zip(proposed, again, strict=True):
        assert_close(a, b, rtol=1e-12, atol=0)
    grower.step()
