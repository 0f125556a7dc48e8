"""Bad input gets a clear error naming the problem, and refused writes change nothing."""

import pytest
import torch
import torch.nn.functional as F

from rcdl import MLP, Grower, GrowingLayer, GrowingRBF, GrowingRBFNet
from rcdl.nn.rules import FunctionalSGD


def net_and_grower():
    net = GrowingRBFNet(4, 2, 2, temperature=1.0, rule=FunctionalSGD(1.0))
    grower = Grower(net)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    F.mse_loss(net(x), y).backward()
    grower.step()
    return net, grower


def snapshot(net):
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize(
    ("x", "error", "match"),
    [
        (torch.randn(3, 5), ValueError, r"GrowingRBFNet: expected input \(\.\.\., 4\)"),
        (torch.randn(3, 4, dtype=torch.float64), TypeError, "dtype torch.float64"),
        (torch.randn(3, 4, device="meta"), ValueError, "on meta"),
        (torch.tensor([[0.0, float("nan"), 0.0, 0.0]]), ValueError, "NaN or inf"),
        (torch.tensor([[0.0, float("inf"), 0.0, 0.0]]), ValueError, "NaN or inf"),
        (torch.randn(0, 4), ValueError, "empty batch"),
        (torch.randn(4), ValueError, r"unbatched sample of shape \(4,\); inputs need a batch"),
    ],
    ids=["width", "dtype", "device", "nan", "inf", "empty", "1d"],
)
def test_bad_queries(x, error, match):
    net, _ = net_and_grower()
    with pytest.raises(error, match=match):
        net(x)


def test_nan_gradient_is_refused_and_no_store_changes():
    net, grower = net_and_grower()
    before = snapshot(net)
    out = net(torch.randn(3, 4))
    (out * float("nan")).sum().backward()
    with pytest.raises(ValueError, match=r"GrowingRBF '(readout|blocks\.\d)'.*NaN or inf"):
        grower.step()
    after = snapshot(net)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_step_without_backward():
    net, grower = net_and_grower()
    out = net(torch.randn(3, 4))  # the graph is alive: its backward may still come
    with pytest.raises(RuntimeError, match="call loss.backward"):
        grower.step()
    del out


def test_bad_construction():
    with pytest.raises(ValueError, match="temperature must be a positive"):
        GrowingRBF(4, 2, temperature=0.0, rule=FunctionalSGD(1.0))
    with pytest.raises(ValueError, match="temperature must be a positive"):
        GrowingRBF(4, 2, temperature=-1.0, rule=FunctionalSGD(1.0))
    with pytest.raises(ValueError, match="unknown kernel 'cosine'"):
        GrowingLayer(4, 2, kernel="cosine", rule=FunctionalSGD(1.0))
    with pytest.raises(ValueError, match="momentum must be in"):
        GrowingRBF(4, 2, temperature=1.0, rule=FunctionalSGD(1.0, momentum=1.0))
    with pytest.raises(ValueError, match="has no growing layers"):
        Grower(MLP(2, 3, 1))


def test_eval_mode_records_nothing():
    net, grower = net_and_grower()
    net.eval()
    net(torch.randn(3, 4))
    with torch.no_grad():
        net.train()(torch.randn(3, 4))
    grower.step()  # nothing recorded: nothing written, no error
    assert grower.num_entries == 3 * 3


@pytest.mark.parametrize("where", ["network", "layer"])
def test_integer_inputs_say_floating_point_is_needed(where):
    net, _ = net_and_grower()
    model = net if where == "network" else GrowingRBF(4, 2, temperature=1.0,
                                                      rule=FunctionalSGD(1.0))
    with pytest.raises(TypeError, match="floating-point inputs, got torch.int64"):
        model(torch.ones(3, 4, dtype=torch.long))


@pytest.mark.parametrize("kind", ["rbf", "hybrid"])
def test_accumulating_from_the_first_step_warns_at_the_users_line(kind):
    """Two micro-batches before the very first step: the first is dropped, and the warning
    says so from the start (it was held back until a step had committed) and points at the
    line of the forward pass that dropped it, not inside torch (for the hybrid, inside
    torch._dynamo)."""
    import inspect
    import warnings

    from rcdl import ClippedSoftmaxRule, HybridGrower, HybridSoftmaxNet, UnsteppedBatchWarning

    def build():
        torch.manual_seed(0)
        if kind == "rbf":
            net = GrowingRBFNet(4, 2, 1, temperature=1.0, rule=FunctionalSGD(1.0))
            return net, Grower(net)
        net = HybridSoftmaxNet(4, 2, 1, temperature=5.0, rule=ClippedSoftmaxRule(3.0, 30.0))
        return net, HybridGrower(net, lr=1e-3)

    net, opt = build()
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    opt.zero_grad()
    F.mse_loss(net(x[:3]), y[:3]).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        F.mse_loss(net(x[3:]), y[3:]).backward()  # the second micro-batch's forward
    opt.step()
    dropped = [w for w in caught if issubclass(w.category, UnsteppedBatchWarning)]
    assert dropped and all(w.filename == __file__ and w.lineno == line for w in dropped)
    assert "that batch is dropped" in str(dropped[0].message)
    alone, alone_opt = build()  # stepped on the second micro-batch only: the same entries
    F.mse_loss(alone(x[3:]), y[3:]).backward()
    alone_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(),
                                                 alone.state_dict().values(), strict=True))


def test_a_hybrid_trained_by_adam_alone_drops_its_records_silently():
    """Nothing grows the layers: records whose step never comes are not a mistake."""
    from rcdl import ClippedSoftmaxRule, HybridSoftmaxNet
    from rcdl.optim.entry_adam import EntryAdam

    torch.manual_seed(0)
    net = HybridSoftmaxNet(4, 2, 1, temperature=5.0, rule=ClippedSoftmaxRule(3.0, 30.0),
                           initial_entries=4)
    adam = EntryAdam(net, lr=1e-3)
    for _ in range(2):  # warnings are errors here
        adam.zero_grad()
        F.mse_loss(net(torch.randn(3, 4)), torch.randn(3, 2)).backward()
        adam.step()


def test_two_backwards_before_one_step_warn_that_the_first_batch_is_dropped():
    from rcdl import UnsteppedBatchWarning

    net, grower = net_and_grower()  # one step taken: the layers are being stepped
    before = grower.num_entries
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    F.mse_loss(net(x), y).backward()
    with pytest.warns(UnsteppedBatchWarning, match="backward\\(\\) ran but no step\\(\\)"):
        F.mse_loss(net(x[:2]), y[:2]).backward()  # gradient accumulation, as for parameters
    grower.step()
    assert grower.num_entries == before + 2 * 3  # only the last batch, in each of 3 layers
