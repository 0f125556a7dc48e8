"""Tiny float64 growing networks, trained a few steps with each entry tied to its sample,
for the tests that need a stored model to read (not a test module)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rcdl import FunctionalSGD, Grower, GrowingRBFNet, GrowingSoftmaxNet
from rcdl.memory.provenance import samples
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.train.loop import train_step


def tiny_net(kind: str, d_in: int, d_out: int, depth: int = 1, *,
             gws_rule: tuple[float, float] = (0.1, 1.0)) -> nn.Module:
    """``"rbf"`` (T = 0.5, η = 1) or ``"gws"`` (T = 2, ``ClippedSoftmaxRule(*gws_rule)``),
    float64, built from ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    if kind == "rbf":
        net = GrowingRBFNet(d_in, d_out, depth, temperature=0.5, rule=FunctionalSGD(1.0))
    else:
        net = GrowingSoftmaxNet(d_in, d_out, depth, temperature=2.0,
                                rule=ClippedSoftmaxRule(*gws_rule))
    return net.double()


def train_with_samples(net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int,
                       grower: Grower | None = None) -> Grower:
    """One pass over ``x``, ``batch`` at a time, sample ``i`` being row ``i``."""
    grower = Grower(net) if grower is None else grower
    for i in range(0, len(x), batch):
        with samples(net, torch.arange(i, min(i + batch, len(x)))):
            train_step(net, x[i:i + batch], y[i:i + batch], F.cross_entropy, grower=grower)
    return grower
