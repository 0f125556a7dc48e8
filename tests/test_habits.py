"""Ordinary PyTorch habits must not break training, and the training API is shaped like an
optimizer (issue 12): abandoned forwards, refused steps, exceptions between backward and
step, eval mode, unbatched inputs, diverging layers, the hybrid step order, all-or-nothing
steps, zero_grad, learning-rate schedulers, state dicts and torch.compile."""

import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import (
    AlwaysGrow,
    ClippedSoftmaxRule,
    EntryAdam,
    FunctionalSGD,
    Grower,
    GrowingRBFNet,
    GrowingSoftmaxNet,
    HybridGrower,
    HybridSoftmaxNet,
    MemoryBudget,
)

D_IN, CLASSES, B = 6, 3, 5


def batch(seed, b=B):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, D_IN, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (b,), generator=gen)


def rbf_net():
    torch.manual_seed(0)
    return GrowingRBFNet(D_IN, CLASSES, 1, temperature=1.0, rule=FunctionalSGD(0.5)).double()


def gws_net():
    rule = ClippedSoftmaxRule(eta=0.003, beta=3.0)
    return GrowingSoftmaxNet(D_IN, CLASSES, 1, temperature=1.0, rule=rule, seed=0).double()


def hybrid_net():
    rule = ClippedSoftmaxRule(eta=1.0, beta=3.0)
    return HybridSoftmaxNet(D_IN, CLASSES, 1, temperature=1.0, rule=rule, seed=0,
                            initial_entries=4, trigger=AlwaysGrow()).double()


def growing(kind):
    """``(model, optimizer-like object driving its whole step)``."""
    if kind == "hybrid":
        net = hybrid_net()
        return net, HybridGrower(net, lr=0.01)
    net = rbf_net() if kind == "rbf" else gws_net()
    return net, Grower(net)


def train_step(net, opt, seed):
    x, y = batch(seed)
    F.cross_entropy(net(x), y).backward()
    opt.step()


def stores(net, opt=None):
    """Every store's tensors, and the entries' Adam moments if ``opt`` holds them, cloned."""
    parts = [(f"{name}.store", module.store) for name, module in net.named_modules()
             if hasattr(getattr(module, "store", None), "written_at")]
    adam = getattr(opt, "adam", opt)  # a HybridGrower's EntryAdam, or EntryAdam itself
    for name, moments in getattr(adam, "moments", {}).items():
        moments.sync()
        parts += [(f"{name}.adam_m", moments.m), (f"{name}.adam_v", moments.v)]
    return {f"{part}.{field}": getattr(store, field).clone() for part, store in parts
            for field in ("keys", "values", "weights", "written_at")}


def assert_same_stores(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


KINDS = ["rbf", "gws", "hybrid"]


# --------------------------------------------------------------------------- habits


@pytest.mark.parametrize("kind", KINDS)
def test_forward_without_backward_then_a_normal_step(kind):
    """A test loss computed in training mode without no_grad: that batch writes nothing, its
    record dies with its graph, and the next training step writes only its own batch."""
    net, opt = growing(kind)
    train_step(net, opt, 0)
    first = net.blocks[0]
    size = len(first.store)
    x_test, y_test = batch(99, b=7)
    test_loss = F.cross_entropy(net(x_test), y_test)  # no backward, ever
    record = weakref.ref(first.recorder.latest_pending())
    x, y = batch(1)
    F.cross_entropy(net(x), y).backward()
    opt.step()
    assert len(first.store) - size == B  # never the 7 test samples
    assert_close(first.store.keys[-B:], net.norm(x))
    del test_loss
    gc.collect()
    assert record() is None  # the abandoned activations are freed with their graph


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("poison", ["target", "gradient"])
def test_refused_step_leaves_nothing_pending(kind, poison):
    net, opt = growing(kind)
    train_step(net, opt, 0)
    before = stores(net, opt)
    x, y = batch(1)
    out = net(x)
    if poison == "target":
        loss = F.mse_loss(out, torch.full_like(out, float("nan")))
    else:
        loss = (out * torch.tensor(float("nan"), dtype=out.dtype)).sum()
    loss.backward()
    with pytest.raises(ValueError, match="NaN or inf"):
        opt.step()
    assert_same_stores(stores(net, opt), before)
    for layer in opt.grower.layers if kind == "hybrid" else opt.layers:
        assert not layer.recorder.ready()
    train_step(net, opt, 2)  # the next clean batch steps normally
    assert len(net.readout.store) > len(before["readout.store.keys"])


@pytest.mark.parametrize("kind", KINDS)
def test_exception_between_backward_and_step(kind):
    """The batch whose step never came is dropped, with a warning saying so; the next batch
    writes only itself."""
    from rcdl import UnsteppedBatchWarning

    net, opt = growing(kind)
    train_step(net, opt, 0)
    reference, ref_opt = growing(kind)
    train_step(reference, ref_opt, 0)

    x, y = batch(1)
    try:
        F.cross_entropy(net(x), y).backward()
        raise KeyError("user code failed before opt.step()")
    except KeyError:
        pass
    with pytest.warns(UnsteppedBatchWarning, match="that batch is dropped"):
        train_step(net, opt, 2)
    train_step(reference, ref_opt, 2)  # never saw batch 1
    assert_same_stores(stores(net, opt), stores(reference, ref_opt))


@pytest.mark.parametrize("kind", KINDS)
def test_eval_mode_training_step_says_so(kind):
    net, opt = growing(kind)
    train_step(net, opt, 0)
    net.eval()
    x, y = batch(1)
    loss = F.cross_entropy(net(x), y)
    with pytest.raises(RuntimeError, match=r"eval mode.*call model\.train\(\)"):
        loss.backward()
    with pytest.raises(RuntimeError, match=r"eval mode.*call model\.train\(\)"):
        opt.step()
    net.train()
    train_step(net, opt, 2)


def test_eval_mode_outputs_are_ordinary_tensors_under_no_grad():
    net, _ = growing("rbf")
    net.eval()
    with torch.no_grad():
        assert not net(batch(0)[0]).requires_grad


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_input_asks_for_a_batch_dimension(kind):
    net, _ = growing(kind)
    with pytest.raises(ValueError, match=r"unbatched sample.*x\.unsqueeze\(0\)"):
        net(torch.randn(D_IN, dtype=torch.float64))


def test_diverging_layer_is_named_with_advice():
    """The README's settings on badly scaled features (a large common offset: after the RMS
    norm every input is nearly the same point, so each step overshoots many times over)."""
    torch.manual_seed(0)
    net = GrowingRBFNet(32, 1, 2, temperature=1.0, rule=FunctionalSGD(0.5))
    grower = Grower(net)
    w = torch.randn(32, 1)
    with pytest.raises(ValueError, match=r"GrowingRBF '.*'.*diverging.*learning rate.*"
                                         r"temperature"):
        for _ in range(40):
            x = torch.randn(16, 32) + 50
            F.mse_loss(net(x), (x - 50) @ w).backward()
            grower.step()
    for layer in grower.layers:  # refused: nothing pending, every store finite
        assert not layer.recorder.ready() and torch.isfinite(layer.store.values).all()


def test_non_finite_outputs_are_refused_naming_the_layer():
    net, grower = growing("rbf")
    train_step(net, grower, 0)
    x, y = batch(1)
    F.cross_entropy(net(x), y).backward()
    net.readout.recorder.ready()[0].s[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"GrowingRBF 'readout': outputs contain NaN or inf"):
        grower.step()


# --------------------------------------------------------------------------- hybrid order


def test_hybrid_grower_steps_adam_then_growth():
    net = hybrid_net()
    driver = HybridGrower(net, lr=0.01)
    twin = hybrid_net()
    adam, grower = EntryAdam(twin, lr=0.01), Grower(twin)
    for seed in range(3):
        x, y = batch(seed)
        F.cross_entropy(net(x), y).backward()
        driver.step()
        F.cross_entropy(twin(x), y).backward()
        adam.step()
        grower.step()
    assert_same_stores(stores(net, driver), stores(twin, adam))


def test_growth_before_adam_is_loud():
    net = hybrid_net()
    adam, grower = EntryAdam(net, lr=0.01), Grower(net)
    x, y = batch(0)
    F.cross_entropy(net(x), y).backward()
    grower.step()  # wrong order: the entries' gradients are dropped
    with pytest.raises(RuntimeError, match="Grower.step\\(\\) ran before this step"):
        adam.step()
    x, y = batch(1)  # the error is given once; the right order then works
    before = net.readout.store.keys.clone()
    F.cross_entropy(net(x), y).backward()
    adam.step()
    grower.step()
    assert not torch.equal(net.readout.store.keys[: len(before)], before)


# --------------------------------------------------------------------------- all or nothing


@pytest.mark.parametrize("budget", [None, MemoryBudget(12, "oldest")], ids=["unbounded", "budget"])
def test_only_the_last_layer_bad_refuses_every_layer(budget):
    """A layer-by-layer commit would write blocks.0 before finding the readout's NaN."""
    net = rbf_net()
    grower = Grower(net, budget=budget)
    for seed in range(3):
        train_step(net, grower, seed)
    before = stores(net)
    x, y = batch(5)
    F.cross_entropy(net(x), y).backward()
    assert grower.layers[-1].name == "readout"
    grower.layers[-1].recorder.ready()[0].grad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="'readout': the output gradient contains NaN"):
        grower.step()
    assert_same_stores(stores(net), before)


# --------------------------------------------------------------------------- optimizer shape


@pytest.mark.parametrize("kind", KINDS)
def test_zero_grad_forgets_what_was_recorded(kind):
    net, opt = growing(kind)
    train_step(net, opt, 0)
    before = stores(net, opt)
    x, y = batch(1)
    F.cross_entropy(net(x), y).backward()
    opt.zero_grad()
    opt.step()  # nothing recorded: a no-op, as for torch optimizers
    assert_same_stores(stores(net, opt), before)


def test_step_lr_halves_eta_for_entries_written_afterwards():
    net, grower = growing("rbf")
    scheduler = torch.optim.lr_scheduler.StepLR(grower, step_size=2, gamma=0.5)
    for step in range(4):
        x, y = batch(step)
        F.cross_entropy(net(x), y).backward()
        record = net.readout.recorder.ready()[0]
        g = record.grad * record.n_samples  # (B, classes) per-sample gradient
        grower.step()
        scheduler.step()
        eta = 0.5 * 0.5 ** (step // 2)
        assert_close(net.readout.store.values[-B:], -eta * g)
    assert [group["lr"] for group in grower.param_groups] == [0.125, 0.125]


def test_scheduler_drives_the_hybrid_adam_and_growth_rates():
    net = hybrid_net()
    driver = HybridGrower(net, lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(driver, step_size=1, gamma=0.5)
    train_step(net, driver, 0)
    scheduler.step()
    assert driver.adam.lr == 0.005
    train_step(net, driver, 1)
    assert [layer.rule.lr for layer in driver.grower.layers] == [0.5, 0.5]


def test_schedules_are_refused_for_decay_and_momentum():
    torch.manual_seed(0)
    rule = FunctionalSGD(0.5, momentum=0.9)
    net = GrowingRBFNet(D_IN, CLASSES, 1, temperature=1.0, rule=rule).double()
    grower = Grower(net)
    grower.param_groups[0]["lr"] = 0.25
    x, y = batch(0)
    F.cross_entropy(net(x), y).backward()
    with pytest.raises(ValueError, match="constant learning rate"):
        grower.step()


def _save(*objects):
    buffer = io.BytesIO()
    torch.save([o.state_dict() for o in objects], buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("kind", [*KINDS, "rbf-budget"])
def test_state_dict_round_trip_continues_bit_identically(kind):
    def build():
        if kind == "rbf-budget":
            net = rbf_net()
            return net, Grower(net, budget=MemoryBudget(9, "contribution", merge=True))
        return growing(kind)

    net, opt = build()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for seed in range(3):
        train_step(net, opt, seed)
        scheduler.step()
    saved = _save(net, opt, scheduler)
    for seed in range(3, 6):
        train_step(net, opt, seed)
        scheduler.step()

    resumed, resumed_opt = build()
    resumed_scheduler = torch.optim.lr_scheduler.StepLR(resumed_opt, step_size=2, gamma=0.5)
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    resumed_scheduler.load_state_dict(saved[2])
    for seed in range(3, 6):
        train_step(resumed, resumed_opt, seed)
        resumed_scheduler.step()
    assert_same_stores(stores(resumed, resumed_opt), stores(net, opt))
    assert resumed_opt.state_dict().keys() == opt.state_dict().keys()
    x, _ = batch(50, b=9)
    with torch.no_grad():
        assert torch.equal(resumed.eval()(x), net.eval()(x))


def test_grower_state_holds_counters_and_evictions():
    net = rbf_net()
    grower = Grower(net, budget=MemoryBudget(6, "oldest"))
    for seed in range(3):
        train_step(net, grower, seed)
    state = grower.state_dict()
    assert state["steps"] == {"blocks.0": 3, "readout": 3}
    assert state["evicted"] == {"blocks.0": 9, "readout": 9}
    other = Grower(GrowingRBFNet(D_IN, CLASSES, 2, temperature=1.0, rule=FunctionalSGD(0.5)))
    with pytest.raises(ValueError, match="the state is for layers"):
        other.load_state_dict(state)


def test_entry_adam_state_holds_the_moments_and_checks_rows():
    net = hybrid_net()
    driver = HybridGrower(net, lr=0.01)
    train_step(net, driver, 0)
    state = driver.adam.state_dict()
    moments = state["layers"]["readout"]
    assert moments["m"]["keys"].shape[0] == len(net.readout.store)
    assert not any("adam" in key for key in net.state_dict())  # the optimizer's, not the model's
    fresh = hybrid_net()  # its stores hold only the initial entries
    with pytest.raises(ValueError, match="load the model's state saved with it first"):
        EntryAdam(fresh).load_state_dict(state)


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.slow
# torch's own: its jit imports, and dynamo reading .grad of the non-leaf inputs it wraps
@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_training_matches_eager(kind):
    """Growing layers run eagerly inside a compiled model (torch.compiler.disable): the
    records and hooks are Python side effects; the norms and residual adds are compiled."""
    (eager, eager_opt), (net, opt) = growing(kind), growing(kind)
    compiled = torch.compile(net)
    for seed in range(3):
        x, y = batch(seed)
        for model, driver in ((eager, eager_opt), (compiled, opt)):
            F.cross_entropy(model(x), y).backward()
            driver.step()
    a, b = stores(eager, eager_opt), stores(net, opt)
    assert a.keys() == b.keys()
    for key in a:
        assert_close(a[key], b[key], msg=key)
    x, _ = batch(9)
    with torch.no_grad():
        assert_close(compiled(x), eager(x))
