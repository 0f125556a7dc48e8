"""Leave-one-out predictions (rcdl.memory.leave_one_out): in float64, exactly the output of
a copy of the model with the sample's entries deleted by rcdl.forget."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import FunctionalSGD, Grower, GrowingRBFNet, GrowingSoftmaxNet, forget
from rcdl.memory.leave_one_out import leave_one_out
from rcdl.memory.provenance import UNKNOWN, samples
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.train.loop import train_step


def _trained(kind: str, n: int = 24) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "rbf":
        net = GrowingRBFNet(6, 3, 2, temperature=0.5, rule=FunctionalSGD(1.0))
    else:  # gws: initial entries (of no sample) and a normalised kernel
        net = GrowingSoftmaxNet(6, 3, 2, temperature=2.0, rule=ClippedSoftmaxRule(0.5, 2.0))
    net = net.double()
    grower = Grower(net)
    x, y = torch.randn(n, 6, dtype=torch.float64), torch.arange(n) % 3
    for i in range(0, n, 4):
        with samples(net, torch.arange(i, i + 4)):
            train_step(net, x[i:i + 4], y[i:i + 4], F.cross_entropy, grower=grower)
    return net, x, y


@pytest.mark.parametrize("kind", ["rbf", "gws"])
def test_leave_one_out_is_the_model_with_the_samples_entries_deleted(kind):
    net, x, _ = _trained(kind)
    probe = torch.cat([x[:6], torch.randn(3, 6, dtype=torch.float64)])  # training and new
    leave = torch.tensor([0, 1, 5, 5, 17, UNKNOWN, 2, 9, UNKNOWN])
    got = leave_one_out(net, probe, leave)
    for b, i in enumerate(leave.tolist()):
        reference = copy.deepcopy(net).eval()
        if i != UNKNOWN:
            forget(reference, torch.tensor([i]), scan=False)
        with torch.no_grad():
            assert_close(got[b], reference(probe[b:b + 1])[0], rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        unchanged = net.eval()(probe)
    assert torch.equal(got[5], unchanged[5])
    assert not torch.allclose(got[0], unchanged[0])  # its own entries mattered


def test_leave_one_out_refuses_what_it_cannot_do():
    net, x, _ = _trained("rbf", n=8)
    with pytest.raises(ValueError, match=r"one sample per input, \(3,\)"):
        leave_one_out(net, x[:3], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="no growing layers"):
        leave_one_out(torch.nn.Linear(6, 3), x[:3], torch.tensor([0, 1, 2]))
