"""rcdl.memory.cascade: the readout cascade is the exact first-order effect of scaling one
entry's value on everything the readout writes after it (against replaying the writes,
float64), its first term is the entry's share, and it refuses readouts it does not model."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import FunctionalSGD, Grower, GrowingRBF, GrowingSoftmax
from rcdl.memory.attribution import entry_contributions
from rcdl.memory.cascade import cascade_error, readout_cascade
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.train.loop import train_step


def check(eps: float = 1e-6) -> float:
    """The cascade of a small RBF readout, trained three samples a step (entries of one step
    do not see each other), against a central difference of its replayed writes."""
    torch.manual_seed(0)
    layer = GrowingRBF(6, 4, temperature=1.0, rule=FunctionalSGD(2.0)).double()
    x, y = torch.randn(24, 6, dtype=torch.float64), torch.randint(0, 4, (24,))
    grower = Grower(layer)
    for begin in range(0, 24, 3):
        train_step(layer, x[begin:begin + 3], y[begin:begin + 3], F.cross_entropy,
                   grower=grower)
    q, d = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    return cascade_error(layer, q, d, eps=eps)


def test_cascade_is_the_replayed_readouts_derivative():
    assert check() < 1e-5


def test_cascade_starts_from_the_shares_and_one_level_is_its_truncation():
    torch.manual_seed(1)
    layer = GrowingRBF(5, 3, temperature=1.0, rule=FunctionalSGD(1.5)).double()
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    grower = Grower(layer)
    for begin in range(0, 12, 4):
        train_step(layer, x[begin:begin + 4], y[begin:begin + 4],
                   torch.nn.functional.cross_entropy, grower=grower)
    q, d = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    found = readout_cascade(layer, q, d)
    assert_close(found["share"], entry_contributions(layer, q, d))
    steps = layer.store.written_at
    last = steps == steps.max()  # nothing written after
    assert_close(found["cascade"][:, last], found["share"][:, last])
    assert_close(found["one_level"][:, last], found["share"][:, last])
    # one step before the last: only one later write, so one level is the whole cascade
    penultimate = steps == steps[~last].max()
    assert_close(found["one_level"][:, penultimate], found["cascade"][:, penultimate])
    first = steps == steps.min()  # two later steps: the truncation differs
    assert not torch.allclose(found["one_level"][:, first], found["cascade"][:, first])
    assert not torch.allclose(found["cascade"][:, ~last], found["share"][:, ~last])


def test_cascade_refuses_a_normalised_readout():
    layer = GrowingSoftmax(4, 3, temperature=1.0, rule=ClippedSoftmaxRule(0.1, 1.0))
    with pytest.raises(ValueError, match="does not normalise"):
        readout_cascade(layer, torch.randn(2, 4), torch.randn(2, 3))
