"""The hybrid growing layer (docs/reference.md §4): distance-gated growth, Adam on the entries,
gradients against the dense reference, finite outputs on adversarial stores, checkpoint/resume."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl.nn.divergence import divergence_advice
from rcdl.nn.gates import AlwaysGrow, CapacityGate, DistanceGate, ErrorScaledGate
from rcdl.nn.hybrid import HybridSoftmax
from rcdl.nn.networks import HybridSoftmaxNet
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.ops.attention import nearest_sq_distance
from rcdl.ops.kernels import naive_attention
from rcdl.optim._step import commit
from rcdl.optim.entry_adam import EntryAdam, EntryMoments
from rcdl.optim.grower import Grower
from rcdl.train.loop import train_one_pass

RULE = ClippedSoftmaxRule(eta=1.0, beta=30.0)
F64 = {"dtype": torch.float64}


def _layer(d_in=4, d_out=3, trigger=None, initial_entries=5, **kw):
    layer = HybridSoftmax(d_in, d_out, temperature=1.0, rule=RULE, trigger=trigger,
                          initial_entries=initial_entries, seed=0, **kw).double()
    layer.name = "layer"
    return layer


def _train_step(layer, q, adam=None, target=None, grower=None):
    target = torch.zeros(q.shape[0], layer.d_out, **F64) if target is None else target
    loss = F.mse_loss(layer(q), target)
    loss.backward()
    if adam is not None:
        adam.step()
        adam.zero_grad()
    (Grower(layer) if grower is None else grower).step()
    return loss.item()


# --------------------------------------------------------------------------- distances


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_nearest_distance_matches_dense(chunk):
    gen = torch.Generator().manual_seed(0)
    q, keys = torch.randn(7, 5, generator=gen, **F64), torch.randn(20, 5, generator=gen, **F64)
    expected = torch.cdist(q, keys).pow(2).amin(1)
    assert_close(nearest_sq_distance(q, keys, chunk_size=chunk), expected)


def test_nearest_distance_of_an_empty_store_is_infinite():
    d = nearest_sq_distance(torch.randn(3, 4), torch.empty(0, 4))
    assert torch.isinf(d).all()


# --------------------------------------------------------------------------- gating


@pytest.mark.parametrize(("dtype", "eps"), [(torch.float64, 1e-9), (torch.float32, 1e-3)])
def test_distance_gate_is_exact_at_tau(dtype, eps):
    tau = 50.0
    layer = _layer(d_in=3, trigger=DistanceGate(tau), initial_entries=0).to(dtype)
    anchor = torch.tensor([[1.0, -2.0, 0.5]], dtype=dtype)  # one stored key
    commit(layer, (anchor, torch.zeros(1, 3, dtype=dtype), torch.ones(1, dtype=dtype)))
    direction = torch.tensor([0.6, 0.0, 0.8], dtype=dtype)  # unit vector
    q = anchor + torch.stack([(tau - eps) * direction, (tau + eps) * direction])  # (2, 3)
    loss = layer(q).sum()
    loss.backward()
    grower = Grower(layer)
    grower.step()
    assert len(layer.store) == 2
    assert_close(layer.store.keys[1], q[1])  # only the query beyond tau was written
    # the learner counts what its step wrote and refused (the anchor was committed by hand)
    growth = grower.growth[layer.name]
    assert (growth.written, int(growth.refused)) == (1, 1)
    assert layer.stats() == {"entries": 2, "bytes": layer.store.nbytes}


def test_samples_far_from_everything_are_written_near_ones_refused():
    layer = _layer(trigger=DistanceGate(1.0))
    near = layer.store.keys[:2] + 0.01
    far = layer.store.keys[:2] + 10.0
    grower = Grower(layer)
    _train_step(layer, torch.cat([near, far]), grower=grower)
    assert len(layer.store) == 5 + 2
    assert int(grower.growth[layer.name].refused) == 2


def test_always_grow_writes_every_sample():
    layer = _layer(trigger=AlwaysGrow())
    _train_step(layer, layer.store.keys[:3].clone())  # duplicates of stored keys
    assert len(layer.store) == 8


def test_capacity_gate_threshold_rises_as_the_store_fills():
    gate = CapacityGate(tau=2.0, capacity=100, penalty=3.0)
    assert gate.threshold(0) == 2.0
    assert gate.threshold(50) == pytest.approx(2.0 * (1 + 3.0 * 0.25))
    d2 = torch.tensor([9.0, 9.0])  # distance 3
    errors = torch.ones(2)
    assert gate.accept(d2, 0, errors).all()
    assert not gate.accept(d2, 100, errors).any()  # threshold 8


def test_error_scaled_gate_prefers_badly_served_samples():
    gate = ErrorScaledGate(tau=1.0)
    d2 = torch.full((2,), 0.8**2)  # both nearer than tau
    accepted = gate.accept(d2, 10, torch.tensor([3.0, 1.0]))  # relative errors 1.5, 0.5
    assert accepted.tolist() == [True, False]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_tau_is_refused(bad):
    with pytest.raises(ValueError, match="tau"):
        DistanceGate(bad)


def test_bad_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        CapacityGate(1.0, capacity=0)


# --------------------------------------------------------------------------- gradients


def test_gradients_wrt_entries_match_the_dense_reference():
    layer = _layer(d_in=6, d_out=4, initial_entries=9)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 6, generator=gen, **F64, requires_grad=True)
    out_grad = torch.randn(5, 4, generator=gen, **F64)
    (layer(q) * out_grad).sum().backward()
    keys, values, weights = layer.entry_leaves()

    ref = [t.detach().clone().requires_grad_() for t in (q, keys, values, weights)]
    (naive_attention(*ref, kernel="softmax", temperature=1.0) * out_grad).sum().backward()
    for mine, theirs in zip((q, keys, values, weights), ref, strict=True):
        assert_close(mine.grad, theirs.grad)


def test_adversarial_store_keeps_outputs_and_gradients_finite():
    layer = _layer(d_in=4, d_out=2, initial_entries=0)
    keys = torch.eye(4, **F64)[:2].repeat(2, 1)  # pairs of equal keys
    weights = torch.tensor([1.0, 1.0, -1.0, -1.0], **F64)  # denominator cancels exactly
    commit(layer, (keys, torch.randn(4, 2, **F64), weights))
    q = torch.randn(6, 4, **F64, requires_grad=True)
    out = layer(q)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert all(torch.isfinite(t.grad).all() for t in layer.entry_leaves())


# --------------------------------------------------------------------------- Adam


def test_entry_adam_equals_torch_adam_on_the_same_table():
    """Without growth, EntryAdam is Adam on (keys, weighted values, weights) as parameters
    (to 1e-12 in float64: the kernel divides the update by the step size, see adam_step)."""
    layer = _layer(d_in=5, d_out=3, trigger=DistanceGate(1e9), initial_entries=7)
    params = [t.detach().clone().requires_grad_() for t in
              (layer.store.keys, layer.store.values, layer.store.weights)]
    reference = torch.optim.Adam(params, lr=0.05)
    adam = EntryAdam(layer, lr=0.05)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        q, y = torch.randn(6, 5, generator=gen, **F64), torch.randn(6, 3, generator=gen, **F64)
        _train_step(layer, q, adam, target=y)
        ref_out = naive_attention(q, *params, kernel="softmax", temperature=1.0)
        F.mse_loss(ref_out, y).backward()
        reference.step()
        reference.zero_grad()
    assert len(layer.store) == 7  # the gate refused everything
    for mine, theirs in zip((layer.store.keys, layer.store.values, layer.store.weights), params,
                            strict=True):
        assert_close(mine, theirs.detach(), rtol=1e-12, atol=1e-15)


def _reference_adam(param, m, v, grad, t, lr, betas, eps):
    """Dense twin of ``EntryMoments.step`` for one tensor, the rule as docs/reference.md §4's
    Adam reads, with a per-entry step count ``t (N,)``; ``grad=None`` is a zero gradient."""
    b1, b2 = betas
    grad = torch.zeros_like(param) if grad is None else grad
    shape = (-1,) + (1,) * (param.dim() - 1)
    bias1, bias2 = (1 - b1**t).view(shape), (1 - b2**t).view(shape)
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad**2
    return param - lr * (m / bias1) / ((v / bias2).sqrt() + eps), m, v


def _grown_layer_with_gradients(dtype=torch.float64, drop_weight_grad=False):
    """A layer whose entries were written at four different Adam steps (trained in float64,
    then cast to ``dtype``), with the gradients of one more batch, and its Adam state."""
    layer = _layer(d_in=5, d_out=3, trigger=AlwaysGrow(), initial_entries=4)
    adam = EntryAdam(layer, lr=0.01)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        _train_step(layer, torch.randn(3, 5, generator=gen, **F64), adam)
    layer.to(dtype)
    q, y = torch.randn(4, 5, generator=gen, **F64), torch.randn(4, 3, generator=gen, **F64)
    F.mse_loss(layer(q.to(dtype)), y.to(dtype)).backward()
    if drop_weight_grad:
        layer.entry_leaves()[2].grad = None
    moments = adam.moments[""]
    moments.sync()  # the moments follow the cast and meet the last step's entries
    return layer, moments


@pytest.mark.parametrize("drop_weight_grad", [False, True], ids=["all-grads", "no-weight-grad"])
@pytest.mark.parametrize("chunk_elements", [1, 12, 1 << 18],
                         ids=["row-by-row", "uneven-blocks", "one-block"])
def test_adam_step_matches_the_dense_reference(chunk_elements, drop_weight_grad):
    """Entries of different ages, blocks that split the store anywhere: the in-place kernel
    computes the dense rule to 1e-12 in float64 (params and both moments)."""
    layer, adam = _grown_layer_with_gradients(drop_weight_grad=drop_weight_grad)
    ages = (adam.steps + 1 - adam.m.written_at).to(torch.float64)  # (N,)
    assert len(set(ages.tolist())) == 4  # four clocks
    lr, betas, eps = 0.01, (0.9, 0.999), 1e-8
    expected = [
        _reference_adam(p.clone(), m.clone(), v.clone(), leaf.grad, ages, lr, betas, eps)
        for p, m, v, leaf in zip(
            (layer.store.keys, layer.store.values, layer.store.weights),
            (adam.m.keys, adam.m.values, adam.m.weights),
            (adam.v.keys, adam.v.values, adam.v.weights),
            layer.entry_leaves(), strict=True)
    ]
    adam.step(lr, betas, eps, chunk_elements=chunk_elements)
    mine = [(layer.store.keys, adam.m.keys, adam.v.keys),
            (layer.store.values, adam.m.values, adam.v.values),
            (layer.store.weights, adam.m.weights, adam.v.weights)]
    for got, want in zip(mine, expected, strict=True):
        for a, b in zip(got, want, strict=True):
            assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_a_float32_store_takes_the_float64_step_to_float32_precision():
    """In float32 (the experiments' dtype) the kernel's step agrees with the float64 one to
    float32 precision; the per-entry scales are computed in float64 in both."""
    grown = [_grown_layer_with_gradients(dtype) for dtype in (torch.float32, torch.float64)]
    layers = [layer for layer, _ in grown]
    for _, adam in grown:
        adam.step(0.01, (0.9, 0.999), 1e-8, chunk_elements=12)
    mine, theirs = ((layer.store.keys, layer.store.values, layer.store.weights)
                    for layer in layers)
    for a, b in zip(mine, theirs, strict=True):
        assert a.dtype == torch.float32
        assert_close(a, b.float())


def test_a_run_with_the_reference_adam_ends_where_the_kernel_does(monkeypatch):
    """A whole hybrid run (forward, Adam, gated growth) with the dense reference rule in
    place of the kernel: the same entries written, the same losses and store to 1e-10
    (float64)."""

    @torch.no_grad()
    def reference_step(self, lr, betas, eps, half_adam=None):
        grads = self.layer.take_entry_grads()
        if grads is None:
            return
        self.sync()
        store = self.layer.store
        self.steps += 1
        ages = (self.steps - self.m.written_at).to(torch.float64)
        for p, m, v, grad in zip((store.keys, store.values, store.weights),
                                 (self.m.keys, self.m.values, self.m.weights),
                                 (self.v.keys, self.v.values, self.v.weights),
                                 grads, strict=True):
            new = _reference_adam(p, m, v, grad, ages, lr, betas, eps)
            for old, value in zip((p, m, v), new, strict=True):
                old.copy_(value)

    gen = torch.Generator().manual_seed(5)
    data = (*_task(96, gen), *_task(32, gen))
    kw = {"batch_size": 8, "eval_every": 4, "progress": False, "seed": 3,
          "loss_fn": F.cross_entropy, "metrics": {"test_loss": F.cross_entropy}}
    runs = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(EntryMoments, "step", reference_step)
        net, learner = _hybrid_net()
        result = train_one_pass(net, data, **learner, **kw)
        runs.append((result, [m for m in net.modules() if isinstance(m, HybridSoftmax)],
                     learner["grower"]))
    (kernel, kernel_layers, kernel_grower), (reference, reference_layers, reference_grower) = runs
    assert kernel["entries"] == reference["entries"]
    losses = [[h["test_loss"] for h in run["history"]] for run in (kernel, reference)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-10)
    assert kernel_grower.state_dict()["growth"] == reference_grower.state_dict()["growth"]
    for mine, theirs in zip(kernel_layers, reference_layers, strict=True):
        for a, b in ((mine.store.keys, theirs.store.keys), (mine.store.values,
                     theirs.store.values), (mine.store.weights, theirs.store.weights)):
            assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_adam_on_an_empty_store_then_growth():
    layer = _layer(initial_entries=0)
    adam = EntryAdam(layer, lr=0.01)
    _train_step(layer, torch.randn(2, 4, **F64), adam)  # gradients of shape (0, ...)
    moments = adam.moments[""].state()
    assert len(layer.store) == len(moments["m"]["ids"]) == 2 and moments["adam_steps"] == 1


def test_a_new_entry_gets_its_own_bias_correction():
    """An entry written after k Adam steps moves on its next step like a fresh Adam
    parameter: by ``lr · g / (|g| + eps)`` per coordinate."""
    layer = _layer(d_in=3, d_out=2, trigger=AlwaysGrow(), initial_entries=4)
    adam = EntryAdam(layer, lr=0.01)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        _train_step(layer, torch.randn(2, 3, generator=gen, **F64), adam)
    assert len(layer.store) == 10
    before = layer.store.values[-1].clone()
    q = torch.randn(2, 3, generator=gen, **F64)
    F.mse_loss(layer(q), torch.zeros(2, 2, **F64)).backward()
    grad = layer.entry_leaves()[1].grad[-1].clone()
    adam.step()
    assert_close(layer.store.values[-1], before - 0.01 * grad / (grad.abs() + 1e-8))


def test_removal_keeps_moments_aligned_with_entries():
    layer = _layer(initial_entries=6)
    adam = EntryAdam(layer, lr=0.01)
    _train_step(layer, torch.randn(3, 4, **F64) * 10, adam)
    mask = torch.zeros(len(layer.store), dtype=torch.bool)
    mask[[0, 4]] = True
    moments = adam.moments[""]
    moments.sync()
    expected = moments.v.keys[~mask].clone()
    layer.remove_entries(mask)
    moments.sync()
    assert len(moments.m) == len(moments.v) == len(layer.store)
    assert torch.equal(moments.m.ids, layer.store.ids)
    assert_close(moments.v.keys, expected)


def test_entry_adam_needs_hybrid_layers():
    with pytest.raises(ValueError, match="no HybridSoftmax"):
        EntryAdam(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------- networks


def _task(n, gen):
    x = torch.randn(n, 8, generator=gen, **F64)
    return x, (x[:, :2].sum(1) > 0).long()


def _hybrid_net(tau=3.0):
    torch.manual_seed(0)
    net = HybridSoftmaxNet(8, 2, depth=1, temperature=1.0,
                             rule=ClippedSoftmaxRule(eta=1.0, beta=3.0),
                             trigger=DistanceGate(tau), initial_entries=4).double()
    return net, {"optimizer": EntryAdam(net, lr=1e-2), "grower": Grower(net)}


def test_adam_and_growth_learn_a_small_task():
    gen = torch.Generator().manual_seed(0)
    data = (*_task(256, gen), *_task(128, gen))
    net, learner = _hybrid_net()
    result = train_one_pass(net, data, batch_size=8, loss_fn=F.cross_entropy,
                            metrics={"test_loss": F.cross_entropy}, eval_every=8,
                            progress=False, **learner)
    losses = [h["test_loss"] for h in result["history"]]
    assert losses[-1] < 0.8 * losses[0]
    counts = learner["grower"].state_dict()["growth"]  # the learner's, by layer
    assert len(counts) == 2
    assert all(0 < c["written"] < 256 for c in counts.values())  # the gate wrote and refused
    assert all(c["written"] + c["refused"] == 256 for c in counts.values())


def test_hybrid_run_resumes_to_the_same_result(interrupt_after, tmp_path):
    gen = torch.Generator().manual_seed(1)
    data = (*_task(96, gen), *_task(32, gen))
    kw = {"batch_size": 8, "eval_every": 4, "progress": False, "seed": 3,
          "loss_fn": F.cross_entropy, "metrics": {"test_loss": F.cross_entropy}}
    net, learner = _hybrid_net()
    reference = train_one_pass(net, data, **learner, **kw)

    ckpt = tmp_path / "ckpt.pt"
    net, learner = _hybrid_net()
    stopped = interrupt_after(learner["grower"], 7)
    with pytest.raises(stopped):
        train_one_pass(net, data, **learner, checkpoint_path=ckpt, checkpoint_every=3, **kw)
    net, learner = _hybrid_net()  # a fresh process: only the checkpoint survives
    resumed = train_one_pass(net, data, **learner, checkpoint_path=ckpt, **kw)
    assert resumed["resumed"]
    assert resumed["history"] == reference["history"]
    assert resumed["entries"] == reference["entries"]


def test_the_exact_rule_is_refused():
    with pytest.raises(ValueError, match="1/Z-normalised rule"):
        HybridSoftmax(4, 3, temperature=1.0, rule=ClippedSoftmaxRule(1.0, 1.0, normalize=True))


def test_moving_the_layer_drops_leaves_of_the_old_tensors():
    layer = _layer()
    adam = EntryAdam(layer, lr=0.01)
    F.mse_loss(layer(torch.randn(3, 4, **F64)), torch.zeros(3, 3, **F64)).backward()
    moved = layer.float()  # between backward and the Adam step
    before = moved.store.keys.clone()
    adam.step()  # the in-flight gradients belonged to the float64 tensors: nothing to apply
    assert moved.store.keys.dtype == torch.float32 and torch.equal(moved.store.keys, before)
    q = torch.randn(3, 4)
    F.mse_loss(moved(q), torch.zeros(3, 3)).backward()
    adam.step()  # new leaves on the moved store: a real step
    assert not torch.equal(moved.store.keys, before)


def test_adam_block_is_cache_sized_on_cpu_and_whole_on_gpus():
    from rcdl.optim.entry_adam import adam_block_elements

    cpu = torch.device("cpu")
    assert adam_block_elements("cpu", 10**7) == adam_block_elements(cpu, 5) == 1 << 18
    assert adam_block_elements("cuda", 10**7) == 10**7
    assert adam_block_elements("cuda:0", 0) == 1


def test_the_default_gate_follows_the_query_width():
    from rcdl import ClippedSoftmaxRule, HybridSoftmaxNet, default_tau

    assert default_tau(3072) == 50.0  # the paper's τ at its width, exactly
    assert default_tau(32) == pytest.approx(50 * (32 / 3072) ** 0.5)
    net = HybridSoftmaxNet(32, 1, 2, temperature=5.0, rule=ClippedSoftmaxRule(3.0, 30.0))
    assert {layer.trigger for layer in (net.blocks[0], net.blocks[1], net.readout)} == {
        DistanceGate(default_tau(32))}
    layer = HybridSoftmax(64, 3, temperature=1.0, rule=ClippedSoftmaxRule(1.0, 30.0))
    assert layer.trigger == DistanceGate(default_tau(64))
    with pytest.raises(ValueError, match="query width must be >= 1"):
        default_tau(0)


def test_a_gate_that_never_opens_warns_with_the_distances_it_saw():
    from rcdl import ClippedSoftmaxRule, GrowthStalledWarning, HybridGrower, HybridSoftmaxNet

    torch.manual_seed(0)
    net = HybridSoftmaxNet(8, 1, 1, temperature=5.0, rule=ClippedSoftmaxRule(1.0, 30.0),
                           trigger=DistanceGate(50.0))  # far above any distance at d = 8
    opt = HybridGrower(net, lr=1e-3)
    with pytest.warns(GrowthStalledWarning) as caught:
        for _ in range(HybridSoftmax.STALL_STEPS):
            opt.zero_grad()
            F.mse_loss(net(torch.randn(4, 8)), torch.zeros(4, 1)).backward()
            opt.step()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2  # one per layer, once
    assert all("has written no entry in 100 steps" in m and "DistanceGate(tau=50.0)" in m
               and "median" in m and "DistanceGate(2.55)" in m for m in messages), messages


def test_the_default_gate_follows_the_width_the_layers_see():
    """With ``width=`` the blocks and the readout see queries of that width (after the lift),
    so their default τ is that width's, not the input's."""
    from rcdl import ClippedSoftmaxRule, HybridSoftmaxNet, default_tau

    net = HybridSoftmaxNet(32, 1, 1, temperature=5.0, rule=ClippedSoftmaxRule(3.0, 30.0),
                           width=128)
    assert {net.blocks[0].trigger, net.readout.trigger} == {DistanceGate(default_tau(128))}


# --------------------------------------------------------------------------- step sizes


def _readme_hybrid(eta, seed):
    """The README's hybrid (d = 32, two blocks, T = 5, β = 30) on its teacher task."""
    from rcdl.app.data import TeacherConfig, make_teacher_data
    from rcdl.optim.hybrid_grower import HybridGrower

    x, y, _, _ = make_teacher_data(TeacherConfig(d_in=32, n_train=160))
    net = HybridSoftmaxNet(32, 1, 2, temperature=5.0, rule=ClippedSoftmaxRule(eta, 30.0),
                           seed=seed)
    return net, HybridGrower(net, lr=1e-3), zip(x.split(16), y.split(16), strict=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_smaller_eta_alone_is_refused_early_saying_to_lower_beta(seed):
    """η = 0.3 with β = 30 writes values ṽ/w ∝ β/η too large for the task: the outputs blow
    up within a few steps (docs/reference.md §3), and the step is refused, saying that β/η is
    what to change, not left to end 50 times worse than predicting zero."""
    net, opt, batches = _readme_hybrid(0.3, seed)
    steps = 0
    with pytest.raises(ValueError, match=r"values ṽ/w grow as β/η \(here 100\).*lower β or "
                                         r"raise η") as refused:
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            opt.step()
            steps += 1
    assert steps <= 3, f"refused only at step {steps}"
    assert "over 100 times its reference scale" in str(refused.value)


def test_the_readme_eta_trains_past_the_divergence_check():
    net, opt, batches = _readme_hybrid(3.0, 0)
    for x, y in batches:  # ten steps, none refused
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    assert all(len(layer.store) > 16 for layer in (*net.blocks, net.readout))


def test_a_refusal_names_beta_for_weighted_softmax_rules_and_the_learning_rate_otherwise():
    from rcdl import FunctionalSGD, GaugeSoftmaxRule, GrowingRBF, GrowingSoftmax

    gws = GrowingSoftmax(4, 2, temperature=5.0, rule=ClippedSoftmaxRule(0.3, 30.0))
    gauge = GrowingSoftmax(4, 2, temperature=5.0, rule=GaugeSoftmaxRule(10.0, 0.03, 3.0))
    rbf = GrowingRBF(4, 2, temperature=1.0, rule=FunctionalSGD(0.1))
    assert "β/η (here 100)" in divergence_advice(gws)
    assert "lower β or raise η" in divergence_advice(gauge)
    assert divergence_advice(rbf).startswith("lower the learning rate (rule FunctionalSGD")
    assert all("raise the temperature" in divergence_advice(layer)
               for layer in (gws, gauge, rbf))


# --------------------------------------------------------------------------- the learner's counts


def _counts_on_the_layers(state):
    """A grower's checkpoint ``state`` as saved when each hybrid layer held its write counts
    as buffers (``entries_written``, ``entries_refused`` in the model part) and the grower's
    state had none."""
    for name, counts in state["grower"].pop("growth").items():
        state["model"][f"{name}.entries_written"] = torch.tensor(counts["written"])
        state["model"][f"{name}.entries_refused"] = torch.tensor(counts["refused"])
    return state


@pytest.mark.parametrize("layout", ["learner", "layers"])
def test_a_resumed_run_counts_as_an_uninterrupted_one(interrupt_after, tmp_path, layout):
    """The entries written and samples refused are the learner's and saved with it; a
    checkpoint saved when the layers held them loads them into the learner."""
    import json

    from rcdl.train.checkpoint import load_checkpoint, save_checkpoint

    gen = torch.Generator().manual_seed(1)
    data = (*_task(96, gen), *_task(32, gen))
    kw = {"batch_size": 8, "eval_every": 4, "progress": False, "seed": 3,
          "loss_fn": F.cross_entropy, "metrics": {"test_loss": F.cross_entropy}}
    net, reference = _hybrid_net()
    train_one_pass(net, data, **reference, **kw)
    counts = reference["grower"].state_dict()["growth"]
    assert set(counts) == {"blocks.0", "readout"}
    assert all(c["written"] > 0 and c["refused"] > 0 for c in counts.values())

    ckpt = tmp_path / "ckpt.pt"
    net, learner = _hybrid_net()
    stopped = interrupt_after(learner["grower"], 7)
    with pytest.raises(stopped):
        train_one_pass(net, data, **learner, checkpoint_path=ckpt, checkpoint_every=3, **kw)
    if layout == "layers":  # rewrite the checkpoints, their digests in the manifest following
        manifest_path = tmp_path / "ckpt.manifest.json"
        manifest = json.loads(manifest_path.read_text())
        for entry in manifest["checkpoints"]:
            file = tmp_path / entry["files"][0]
            state = _counts_on_the_layers(load_checkpoint(file))
            assert "blocks.0.entries_written" in state["model"]
            entry["sha256"][0] = save_checkpoint(state, file)
        manifest_path.write_text(json.dumps(manifest))
    net, learner = _hybrid_net()  # a fresh process: only the checkpoint survives
    resumed = train_one_pass(net, data, **learner, checkpoint_path=ckpt, **kw)
    assert resumed["resumed"]
    assert learner["grower"].state_dict()["growth"] == counts
    assert "blocks.0.entries_written" not in net.state_dict()
    assert all(layer.take_old_counts() is None for layer in learner["grower"].layers)


def test_a_replay_snapshot_with_the_counts_on_the_layers_restores_them_to_the_learner():
    import copy

    from rcdl.train.replay import ReplayLog

    gen = torch.Generator().manual_seed(1)
    data = (*_task(48, gen), *_task(16, gen))
    net, learner = _hybrid_net()
    log = ReplayLog(every=2)
    train_one_pass(net, data, batch_size=8, progress=False, loss_fn=F.cross_entropy,
                   metrics={"test_loss": F.cross_entropy}, replay=log, **learner)
    learners = [learner["optimizer"], learner["grower"]]
    snap = log.snapshots[4]
    counts = snap.learners[1]["growth"]
    assert all(c["written"] > 0 for c in counts.values())
    old = copy.deepcopy(snap)  # as a snapshot of the layers' buffers
    for name, c in old.learners[1].pop("growth").items():
        old.tensors[f"buffer:{name}.entries_written"] = torch.tensor(c["written"])
        old.tensors[f"buffer:{name}.entries_refused"] = torch.tensor(c["refused"])
    for grown in learner["grower"].growth.values():  # counts that the restore must replace
        grown.written, grown.refused = 10**6, 10**6
    assert log.restore_problem(old, net) is None
    log.restore(old, net, learners)
    assert learner["grower"].state_dict()["growth"] == counts
