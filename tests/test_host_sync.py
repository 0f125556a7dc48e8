"""A training step reads nothing back to the host (docs/gpu.md, "Host reads in a step").

On a GPU every read of a device value (``.item()``, ``bool(t)``, ``.tolist()``, ``int(t)``,
``float(t)``, ``.cpu()``) stalls the host until the device has caught up. These tests count
such reads on CPU, where every call counts, by wrapping the tensor methods that make them,
in steady-state steps of each growing model with deferred checks (``defer_checks=True``,
the default for stores on a GPU): zero for gws, gauge and RBF, one (the Adam step's check of
the entry gradients) for the hybrid. The deferred checks must still fire, naming the
problem, at the next check point.

Not counted: the bfloat16 products widened in registers (``rcdl/ops/widen.py``, a CPU-only
path taken on CPUs without native bfloat16) hand CPU tensors to numba as numpy arrays, which
reads nothing back from a device.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl import FunctionalSGD, Grower, GrowingRBFNet, GrowingSoftmaxNet
from rcdl.nn.networks import HybridSoftmaxNet
from rcdl.nn.rules import ClippedSoftmaxRule, GaugeSoftmaxRule
from rcdl.optim.hybrid_grower import HybridGrower
from rcdl.train.loop import train_one_pass, train_step

D, CLASSES, B = 16, 4, 8
_READS = ("item", "__bool__", "tolist", "__int__", "__float__", "__index__", "cpu", "numpy")
_CPU_ONLY = "rcdl/ops/widen.py"  # see the module docstring


@contextmanager
def counting_reads() -> Iterator[list[str]]:
    """Every host read of a tensor value while the block runs, as ``"method at file:line"``
    of the innermost rcdl frame."""
    reads: list[str] = []
    saved = {name: getattr(Tensor, name) for name in _READS}

    def counted(name, method):  # noqa: ANN001, ANN202
        def call(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            frames = [f for f in traceback.extract_stack()[:-1] if "rcdl" in f.filename
                      and "test_host_sync" not in f.filename]
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
            if _CPU_ONLY not in where:
                reads.append(f"{name} at {where}")
            return method(self, *args, **kwargs)
        return call

    for name, method in saved.items():
        setattr(Tensor, name, counted(name, method))
    try:
        yield reads
    finally:
        for name, method in saved.items():
            setattr(Tensor, name, method)


def build(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The models of the CIFAR-10 comparison at width 16, with their learners' checks
    deferred."""
    torch.manual_seed(0)
    if kind == "rbf":
        net: nn.Module = GrowingRBFNet(D, CLASSES, 2, temperature=10.0, rule=FunctionalSGD(10.0))
    elif kind == "hybrid":
        net = HybridSoftmaxNet(D, CLASSES, 2, temperature=5.0,
                               rule=ClippedSoftmaxRule(eta=1.0, beta=30.0))
        return net, HybridGrower(net, lr=1e-3, defer_checks=True)
    else:
        rule = (ClippedSoftmaxRule(eta=0.003, beta=3.0) if kind == "gws"
                else GaugeSoftmaxRule(alpha=10.0, eta=0.03, beta=100.0))
        net = GrowingSoftmaxNet(D, CLASSES, 2, temperature=5.0, rule=rule, seed=0)
    return net, Grower(net, defer_checks=True)


def batch(seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, D, generator=gen), torch.randint(0, CLASSES, (B,), generator=gen)


@pytest.mark.parametrize(("kind", "most"), [("gws", 0), ("gauge", 0), ("rbf", 0),
                                            ("hybrid", 1)])
def test_a_steady_state_step_reads_nothing_back(kind, most):
    net, learner = build(kind)
    for seed in range(3):  # warm-up: the first steps set the reference scales
        train_step(net, *batch(seed), F.cross_entropy, grower=learner, sync=False)
    for seed in range(3, 5):
        with counting_reads() as reads:
            loss = train_step(net, *batch(seed), F.cross_entropy, grower=learner, sync=False)
        assert len(reads) <= most, reads
        assert loss.dim() == 0
    learner.check()  # nothing was refused


def test_the_checks_once_run_in_the_step_now_read_twice():
    """Without deferral the grower reads its faults twice a step (records, proposals), where
    every check used to read on its own (16 reads in an RBF step at depth 2)."""
    net, _ = build("rbf")
    grower = Grower(net)  # on CPU: immediate
    train_step(net, *batch(0), F.cross_entropy, grower=grower)
    with counting_reads() as reads:
        train_step(net, *batch(1), F.cross_entropy, grower=grower)
    grower_reads = [r for r in reads if "grower.py" in r or "divergence.py" in r]
    assert len(grower_reads) == 2, reads


def test_a_deferred_divergence_is_raised_at_the_check_with_stores_finite():
    """The README's diverging RBF (tests/test_habits.py) with deferred checks: the steps
    run on, the refused ones change no output, and the check names the layer and the step."""
    torch.manual_seed(0)
    net = GrowingRBFNet(32, 1, 2, temperature=1.0, rule=FunctionalSGD(0.5))
    grower = Grower(net, defer_checks=True)
    w = torch.randn(32, 1)
    for _ in range(40):
        x = torch.randn(16, 32) + 50
        F.mse_loss(net(x), (x - 50) @ w).backward()
        grower.step()  # never raises: the fault stays on the device
    for layer in grower.layers:
        assert torch.isfinite(layer.store.values).all()
    with pytest.raises(ValueError, match=r"GrowingRBF '.*'.*diverging.*learning rate.*"
                                         r"temperature.*grower step \d+"):
        grower.check()
    grower.check()  # reported once


@pytest.mark.parametrize("kind", ["rbf", "gws", "hybrid"])
def test_a_nan_target_is_refused_and_changes_no_output(kind):
    net, learner = build(kind)
    train_step(net, *batch(0), F.cross_entropy, grower=learner, sync=False)
    x_probe = batch(9)[0]
    with torch.no_grad():
        before = net.eval()(x_probe)
    net.train()
    x, _ = batch(1)
    out = net(x)
    loss = F.mse_loss(out, torch.full_like(out, float("nan")))
    loss.backward()
    if kind == "hybrid":  # the Adam step's own check is still immediate: its one read
        with pytest.raises(ValueError, match="NaN or inf"):
            learner.step()
        return
    learner.step()
    learner.zero_grad()
    with torch.no_grad():
        assert torch.equal(net.eval()(x_probe), before)
    with pytest.raises(ValueError, match="output gradient contains NaN or inf"):
        learner.state_dict()  # never saved with a refused step in it


def test_deferred_and_immediate_runs_agree_and_the_loop_names_a_bad_loss():
    """train_one_pass with deferred checks records the same losses and metrics as with
    immediate ones; a non-finite loss is still named, with its step, before it is saved."""
    gen = torch.Generator().manual_seed(0)
    data = (torch.randn(64, D, generator=gen), torch.randint(0, CLASSES, (64,), generator=gen),
            torch.randn(32, D, generator=gen), torch.randint(0, CLASSES, (32,), generator=gen))
    results = []
    for defer in (False, True):
        torch.manual_seed(0)
        net = GrowingRBFNet(D, CLASSES, 2, temperature=10.0, rule=FunctionalSGD(10.0))
        grower = Grower(net, defer_checks=defer)
        assert grower.defer_checks is defer
        results.append(train_one_pass(net, data, batch_size=B, grower=grower,
                                      loss_fn=F.cross_entropy, metrics={"loss": F.cross_entropy},
                                      eval_every=3, progress=False))
    immediate, deferred = results
    assert immediate["entries"] == deferred["entries"]
    for key in ("train_loss", "loss"):
        assert immediate[key] == pytest.approx(deferred[key], rel=1e-12), key
    assert len(immediate["history"]) == len(deferred["history"]) > 1
    for a, b in zip(immediate["history"], deferred["history"], strict=True):
        assert a.keys() == b.keys()
        for name in a:  # step, samples, epoch exactly; losses and metrics to rounding
            assert a[name] == pytest.approx(b[name], rel=1e-12), name

    x_train, y_train, x_test, y_test = data
    targets = torch.randn(64, CLASSES)
    targets[20] = float("nan")  # in batch 2 of the order 0, 1, ..., 63
    order = torch.arange(64)
    net = GrowingRBFNet(D, CLASSES, 2, temperature=10.0, rule=FunctionalSGD(10.0))
    with pytest.raises(FloatingPointError, match="training loss is nan at step 2"):
        train_one_pass(net, (x_train, targets, x_test, torch.randn(32, CLASSES)),
                       batch_size=B, grower=Grower(net, defer_checks=True), order=order,
                       eval_every=5, progress=False)
