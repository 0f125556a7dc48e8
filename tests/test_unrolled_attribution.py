"""benchmarks/unrolled_attribution.py: the readout cascade is the exact first-order effect of
scaling one entry's value on everything the readout writes after it (against replaying the
writes, float64), its first term is the entry's share, and it refuses readouts it does not
model."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from rcdl import GrowingSoftmax
from rcdl.memory.attribution import entry_contributions
from rcdl.nn.rules import ClippedSoftmaxRule

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "unrolled_attribution", ROOT / "benchmarks" / "unrolled_attribution.py")
unrolled = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("unrolled_attribution", unrolled)
_spec.loader.exec_module(unrolled)


def test_cascade_is_the_replayed_readouts_derivative():
    assert unrolled.check() < 1e-5


def test_cascade_starts_from_the_shares_and_one_level_is_its_truncation():
    torch.manual_seed(1)
    layer = unrolled.GrowingRBF(5, 3, temperature=1.0, rule=unrolled.FunctionalSGD(1.5)).double()
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    grower = unrolled.Grower(layer)
    for begin in range(0, 12, 4):
        unrolled.train_step(layer, x[begin:begin + 4], y[begin:begin + 4],
                            torch.nn.functional.cross_entropy, grower=grower)
    q, d = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    found = unrolled.readout_cascade(layer, q, d)
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
        unrolled.readout_cascade(layer, torch.randn(2, 4), torch.randn(2, 3))
