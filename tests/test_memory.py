"""Memory budgets for growing layers: capacity is never exceeded, each policy evicts what it
says, the contribution score is the leave-one-out change it claims, merging keeps the
store's mass, a layer under budget is untouched, and a budgeted model still learns."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import (
    EVICTION_POLICIES,
    ClippedSoftmaxRule,
    Grower,
    GrowingLinear,
    GrowingRBF,
    GrowingRBFNet,
    GrowingSoftmax,
    GrowingSoftmaxNet,
    MemoryBudget,
)
from rcdl.memory.budgets import contribution_scores, merge_into_nearest
from rcdl.nn.rules import FunctionalSGD
from rcdl.ops.kernels import naive_attention

POLICIES = [*EVICTION_POLICIES, *(f"{p}+merge" for p in EVICTION_POLICIES)]


def blobs(n, seed, d=8, classes=3):
    """Three Gaussian blobs in ``d`` dimensions (float64)."""
    gen = torch.Generator().manual_seed(seed)
    centres = 2 * torch.randn(classes, d, generator=torch.Generator().manual_seed(123))
    y = torch.randint(0, classes, (n,), generator=gen)
    return (centres[y] + torch.randn(n, d, generator=gen)).double(), y


def softmax_net(seed=0):
    rule = ClippedSoftmaxRule(eta=0.003, beta=3.0)
    net = GrowingSoftmaxNet(8, 3, 1, temperature=1.0, rule=rule, seed=seed).double()
    # Tight budgets evict the initial entries, the store's main weight mass: the outputs
    # then grow far past their first scale, which the divergence check rightly refuses.
    # These tests count entries, so the check is off.
    for layer in net.modules():
        if isinstance(layer, GrowingSoftmax):
            layer.max_output_growth = None
    return net


def train(net, grower, steps, batch=8, after_step=None):
    for step in range(steps):
        x, y = blobs(batch, 100 + step)
        F.cross_entropy(net(x), y).backward()
        grower.step()
        if after_step is not None:
            after_step(step)


def filled_layer(kernel="softmax", n=10, d_in=4, d_out=3, seed=0):
    """A layer whose store holds ``n`` random entries written at steps 0, 0, 1, 1, 2, ..."""
    gen = torch.Generator().manual_seed(seed)
    if kernel == "softmax":
        layer = GrowingSoftmax(d_in, d_out, temperature=1.0, initial_entries=0,
                               rule=ClippedSoftmaxRule(eta=0.1, beta=1.0)).double()
        weights = torch.rand(n, generator=gen, dtype=torch.float64)
        weights[::3] = 0.0  # the clipped rule writes w = 0 for many entries
    elif kernel == "rbf":
        layer = GrowingRBF(d_in, d_out, temperature=1.0, rule=FunctionalSGD(1.0)).double()
        weights = torch.ones(n, dtype=torch.float64)
    else:
        layer = GrowingLinear(d_in - 1, d_out, rule=FunctionalSGD(1.0, per_sample=False)).double()
        weights = torch.ones(n, dtype=torch.float64)
    layer.name = f"{kernel}-layer"
    keys = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    values = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    layer.store.append(keys, values, weights, written_at=torch.arange(n) // 2)
    return layer


def snapshot(layer):
    s = layer.store
    return [t.clone() for t in (s.keys, s.values, s.weights, s.written_at)]


# --------------------------------------------------------------------------- the invariant


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("capacity", [5, 20], ids=["below-initial", "above-initial"])
def test_stores_never_exceed_the_capacity(policy, capacity):
    net = softmax_net()
    budget = MemoryBudget.from_policy(capacity, policy)
    grower = Grower(net, budget=budget)
    sizes = []

    def check(step):
        sizes.append([len(layer.store) for layer in grower.layers])
        assert all(len(layer.store) <= capacity for layer in grower.layers), (step, sizes[-1])

    train(net, grower, steps=6, after_step=check)
    assert sizes[-1] == [capacity, capacity]
    for layer in grower.layers:  # every entry written is either kept or counted as evicted
        assert len(layer.store) + grower.evicted[layer.name] == 16 + 6 * 8
    assert grower.num_evicted == sum(grower.evicted.values()) == 2 * (16 + 48 - capacity)


def test_oldest_keeps_exactly_the_newest_entries():
    net = softmax_net()
    grower = Grower(net, budget=MemoryBudget(12, "oldest"))

    def check(step):  # 8 entries a step: the last 12 are 4 of the step before and 8 of this one
        for layer in grower.layers:
            assert layer.store.written_at.tolist() == [step] * 4 + [step + 1] * 8

    train(net, grower, steps=4, after_step=check)
    # the first block's last 8 keys are the last batch's queries (RMS-normalised inputs)
    x, _ = blobs(8, 100 + 3)
    assert_close(net.blocks[0].store.keys[4:], net.norm(x))


def test_slack_evicts_in_blocks():
    """With slack s, a full store drops to C − s and refills: evictions every few steps."""
    net = softmax_net()
    grower = Grower(net, budget=MemoryBudget(40, "contribution", merge=True, slack=16))
    sizes = []
    train(net, grower, steps=8, after_step=lambda step: sizes.append(len(net.readout.store)))
    # 16 initial + 8 per step: 24 32 40, then 48 > 40 -> 24, 32 40, 48 -> 24, ...
    assert sizes == [24, 32, 40, 24, 32, 40, 24, 32]
    assert grower.evicted["readout"] == 16 + 64 - 32


def test_oldest_and_newest_break_ties_by_row_order():
    layer = filled_layer("rbf", n=7)  # written_at 0 0 1 1 2 2 3
    assert MemoryBudget(3, "oldest").evict_mask(layer).tolist() == [1, 1, 1, 1, 0, 0, 0]
    assert MemoryBudget(3, "newest").evict_mask(layer).tolist() == [0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("kernel", ["softmax", "rbf", "linear"])
def test_contribution_policy_evicts_the_lowest_scores(kernel):
    layer = filled_layer(kernel, n=10)
    scores = contribution_scores(layer)
    keys = layer.store.keys.clone()
    evicted = MemoryBudget(6, "contribution").enforce(layer)
    assert evicted == 4 and len(layer.store) == 6
    kept = scores.argsort(descending=True)[:6].sort().values  # the 6 largest, in row order
    assert_close(layer.store.keys, keys[kept])


def test_softmax_score_is_the_leave_one_out_change_at_q0():
    """Removing entry j moves s(0) by exactly −(ṽ_j − w_j s̄)/(Σw − w_j): the score times
    that denominator, and the score is gauge invariant (ṽ_i → ṽ_i + w_i b)."""
    layer = filled_layer("softmax", n=9)
    keys, values, weights = (t.clone() for t in (layer.store.keys, layer.store.values,
                                                 layer.store.weights))
    q0 = torch.zeros(1, keys.shape[1], dtype=torch.float64)

    def s0(k, v, w):
        return naive_attention(q0, k, v, w, kernel="softmax", temperature=1.0)[0]

    full = s0(keys, values, weights)
    scores = contribution_scores(layer)
    for j in range(9):
        keep = torch.arange(9) != j
        change = s0(keys[keep], values[keep], weights[keep]) - full
        assert_close(change.norm() * (weights.sum() - weights[j]), scores[j])
    b = torch.randn(values.shape[1], dtype=torch.float64)
    layer.store.values.add_(weights[:, None] * b)
    assert_close(contribution_scores(layer), scores)


def test_rbf_and_linear_scores():
    rbf, linear = filled_layer("rbf"), filled_layer("linear")
    assert_close(contribution_scores(rbf), rbf.store.values.norm(dim=1))
    assert_close(contribution_scores(linear),
                 linear.store.values.norm(dim=1) * linear.store.keys.norm(dim=1))


def test_random_policy_is_reproducible_and_redrawn_each_step():
    layer = filled_layer("rbf", n=10)
    budget = MemoryBudget(4, "random", seed=3)
    mask = budget.evict_mask(layer)
    assert int(mask.sum()) == 6 and torch.equal(mask, budget.evict_mask(layer))
    masks = set()
    for step in range(20):  # a fresh draw per layer step
        layer.steps.fill_(step)
        masks.add(tuple(budget.evict_mask(layer).tolist()))
    assert len(masks) > 5


# --------------------------------------------------------------------------- merging


def test_merge_keeps_the_softmax_mass_and_the_output_at_q0():
    layer = filled_layer("softmax", n=10)
    keys = layer.store.keys.clone()
    sum_w, sum_v = layer.store.weights.sum(), layer.store.values.sum(0)
    q0 = torch.zeros(1, 4, dtype=torch.float64)
    out0 = layer.attend(q0)
    mask = MemoryBudget(4, "oldest").evict_mask(layer)
    targets = merge_into_nearest(layer, mask)
    # each evicted entry went into the kept entry with the nearest key
    kept = (~mask).nonzero().squeeze(1)
    nearest = kept[torch.cdist(keys[mask], keys[kept]).argmin(1)]
    assert torch.equal(targets, nearest)
    layer.remove_entries(mask)
    assert len(layer.store) == 4
    assert_close(layer.store.weights.sum(), sum_w)
    assert_close(layer.store.values.sum(0), sum_v)
    assert_close(layer.attend(q0), out0)


def test_merge_keeps_the_rbf_weighted_values():
    layer = filled_layer("rbf", n=10)
    layer.store.weights.mul_(torch.linspace(0.5, 2.0, 10, dtype=torch.float64))
    total = (layer.store.weights[:, None] * layer.store.values).sum(0)
    MemoryBudget(3, "contribution", merge=True).enforce(layer)
    assert len(layer.store) == 3
    assert_close((layer.store.weights[:, None] * layer.store.values).sum(0), total)


def test_merging_is_refused_for_linear_and_aged_layers():
    net = torch.nn.Sequential(GrowingLinear(3, 2, rule=FunctionalSGD(0.1, per_sample=False)))
    with pytest.raises(ValueError, match="linear kernel; merging is defined for softmax and RBF"):
        Grower(net, budget=MemoryBudget(4, merge=True))
    Grower(net, budget=MemoryBudget(4))  # without merging, fine
    aged_rule = FunctionalSGD(0.1, momentum=0.9)
    aged = torch.nn.Sequential(GrowingRBF(3, 2, temperature=1.0, rule=aged_rule))
    with pytest.raises(ValueError, match="by age"):
        Grower(aged, budget=MemoryBudget(4, "oldest", merge=True))


# --------------------------------------------------------------------------- the grower


def test_a_layer_under_budget_is_unchanged():
    """A budget larger than every store changes nothing: same entries as without one."""
    free, bounded = softmax_net(), softmax_net()
    grower_free, grower = Grower(free), Grower(bounded, budget=MemoryBudget(1000, "random"))
    train(free, grower_free, steps=4)
    train(bounded, grower, steps=4)
    for a, b in zip(grower_free.layers, grower.layers, strict=True):
        for ta, tb in zip(snapshot(a), snapshot(b), strict=True):
            assert torch.equal(ta, tb)
    assert grower.evicted == {"blocks.0": 0, "readout": 0} and grower.num_evicted == 0


def test_eviction_goes_through_remove_entries():
    """Subclasses that keep per-entry state override remove_entries; the budget uses it."""
    calls = []

    class Tracked(GrowingRBF):
        def remove_entries(self, mask):
            calls.append(int(mask.sum()))
            return super().remove_entries(mask)

    net = torch.nn.Sequential(Tracked(8, 3, temperature=1.0, rule=FunctionalSGD(0.5))).double()
    grower = Grower(net, budget=MemoryBudget(10, "contribution", merge=True))
    for step in range(3):
        x, y = blobs(8, step)
        F.cross_entropy(net(x), y).backward()
        grower.step()
    assert calls == [6, 8] and len(net[0].store) == 10


def test_a_refused_step_leaves_every_store_unchanged():
    net = softmax_net()
    grower = Grower(net, budget=MemoryBudget(20, "oldest"))
    train(net, grower, steps=3)
    before = [snapshot(layer) for layer in grower.layers]
    x, y = blobs(8, 0)
    out = net(x)
    (out * float("nan")).sum().backward()
    with pytest.raises(ValueError, match="NaN or inf"):
        grower.step()
    grower.discard()
    for layer, saved in zip(grower.layers, before, strict=True):
        for t, s in zip(snapshot(layer), saved, strict=True):
            assert torch.equal(t, s)


@pytest.mark.parametrize("policy", ["contribution", "contribution+merge", "newest+merge"])
def test_a_budgeted_softmax_net_still_learns(policy):
    x_test, y_test = blobs(300, 1)
    net = softmax_net()
    grower = Grower(net, budget=MemoryBudget.from_policy(24, policy))
    train(net, grower, steps=25)
    net.eval()
    with torch.no_grad():
        accuracy = (net(x_test).argmax(1) == y_test).double().mean()
    assert accuracy > 0.7  # chance is 1/3; unbounded reaches about 0.9 with 18x the entries
    assert grower.num_entries == 2 * 24


@pytest.mark.parametrize("policy", ["contribution+merge", "newest+merge"])
def test_a_budgeted_rbf_net_still_learns(policy):
    """Regression with 30 entries per layer out of 320 written. (Dropping entries without
    merging loses the fit here: each RBF entry is an increment of the function, and the
    window or random policies forget increments the later ones were corrections to.)"""
    torch.manual_seed(0)
    net = GrowingRBFNet(4, 2, 1, temperature=0.5, rule=FunctionalSGD(0.2)).double()
    grower = Grower(net, budget=MemoryBudget.from_policy(30, policy))
    gen = torch.Generator().manual_seed(0)
    x_test = torch.randn(200, 4, generator=gen, dtype=torch.float64)
    y_test = torch.sin(2 * x_test[:, :2])
    with torch.no_grad():
        initial = F.mse_loss(net(x_test), y_test).item()
    for _ in range(40):
        x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
        F.mse_loss(net(x), torch.sin(2 * x[:, :2])).backward()
        grower.step()
    with torch.no_grad():
        assert F.mse_loss(net(x_test), y_test).item() < 0.7 * initial
    assert all(len(layer.store) <= 30 for layer in grower.layers)


def test_budget_on_a_hybrid_layer_keeps_its_moments_aligned():
    from rcdl.nn.gates import AlwaysGrow
    from rcdl.nn.hybrid import HybridSoftmax
    from rcdl.optim.entry_adam import EntryAdam

    layer = HybridSoftmax(8, 3, temperature=1.0, rule=ClippedSoftmaxRule(1.0, 3.0),
                          trigger=AlwaysGrow(), seed=0).double()
    net = torch.nn.Sequential(layer)
    adam, grower = EntryAdam(net), Grower(net, budget=MemoryBudget(20, "oldest"))
    for step in range(3):
        x, y = blobs(8, step)
        F.cross_entropy(net(x), y).backward()
        adam.step()
        adam.zero_grad()
        grower.step()
        moments = adam.moments["0"]
        moments.sync()
        assert len(layer.store) == len(moments.m) == len(moments.v) <= 20
        assert torch.equal(moments.m.ids, layer.store.ids)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True, "10"])
def test_bad_capacity_is_an_error(capacity):
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        MemoryBudget(capacity)


def test_bad_policy_is_an_error():
    with pytest.raises(ValueError, match="unknown eviction policy 'lru'; known: oldest, newest"):
        MemoryBudget(10, "lru")
    with pytest.raises(ValueError, match="unknown policy 'oldest\\+prune'"):
        MemoryBudget.from_policy(10, "oldest+prune")
    with pytest.raises(ValueError, match="merge must be True or False"):
        MemoryBudget(10, merge="yes")
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        MemoryBudget(10, "random", seed=-1)
    with pytest.raises(ValueError, match="slack must be an int with 0 <= slack < capacity = 10"):
        MemoryBudget(10, slack=10)
    with pytest.raises(TypeError, match="budget must be a rcdl.memory.budgets.MemoryBudget"):
        Grower(softmax_net(), budget=10)


def test_policy_names_round_trip():
    for policy in POLICIES:
        budget = MemoryBudget.from_policy(7, policy, seed=2)
        assert budget.policy == policy and budget.capacity == 7 and budget.seed == 2
    assert MemoryBudget(5, "newest", merge=True).describe() == (
        "5 entries per layer, evict newest, merged")


def test_float32_softmax_scores_rank_like_float64_under_a_gauge_offset():
    """With a common offset ṽ_j = w_j b + δ_j (what the gauge rule's frame shifts leave in a
    store), the expanded ‖ṽ‖² − 2w⟨ṽ, s̄⟩ + w²‖s̄‖² cancelled in float32: the lowest scores,
    the ones eviction removes, came out in another order than in float64."""
    n, d_out = 4000, 10
    gen = torch.Generator().manual_seed(5)
    layer = GrowingSoftmax(6, d_out, temperature=1.0, initial_entries=0,
                           rule=ClippedSoftmaxRule(eta=0.1, beta=1.0))
    weights = torch.rand(n, generator=gen) + 0.5
    offset = 300 * torch.randn(d_out, generator=gen)
    values = weights[:, None] * offset + 0.01 * torch.randn(n, d_out, generator=gen)
    layer.store.append(torch.randn(n, 6, generator=gen), values, weights)
    scores32 = contribution_scores(layer)
    scores64 = contribution_scores(layer.double())  # the same stored numbers, in float64
    rel_err = ((scores32.double() - scores64) / scores64).abs()
    assert rel_err.median() < 1e-5
    lowest32 = set(scores32.argsort()[:100].tolist())
    lowest64 = set(scores64.argsort()[:100].tolist())
    assert len(lowest32 & lowest64) >= 98
