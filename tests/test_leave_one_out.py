"""Leave-one-out predictions (rcdl.memory.leave_one_out): in float64, exactly the output of
a copy of the model with the sample's entries deleted by rcdl.forget."""

import copy

import pytest
import torch
from torch.testing import assert_close

from rcdl import forget
from rcdl.memory.leave_one_out import leave_one_out
from rcdl.memory.provenance import UNKNOWN
from tiny_nets import tiny_net, train_with_samples


def _trained(kind: str, n: int = 24) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    net = tiny_net(kind, 6, 3, depth=2, gws_rule=(0.5, 2.0))
    x, y = torch.randn(n, 6, dtype=torch.float64), torch.arange(n) % 3
    train_with_samples(net, x, y, 4)
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
