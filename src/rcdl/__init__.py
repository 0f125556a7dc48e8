"""rcdl — Retrieval-Centric Deep Learning: growing nonparametric networks in PyTorch."""

from rcdl._version import __version__
from rcdl.age import AgeCoefficients
from rcdl.attention import Partial, attention, attention_partial, finalize, merge_partials
from rcdl.grower import Grower
from rcdl.kernels import KERNELS, naive_attention
from rcdl.layers import (
    GrowingLayer,
    GrowingLinear,
    GrowingRBF,
    GrowingSoftmax,
    ParametricSoftmax,
    growing_layers,
)
from rcdl.networks import (
    MLP,
    GrowingRBFNet,
    ParametricSoftmaxNet,
    ResidualNet,
    ResNetMLP,
    RMSNorm,
    growing_softmax_net,
    to_dual_form,
)
from rcdl.rules import ClippedSoftmaxRule, FunctionalSGD, GaugeSoftmaxRule
from rcdl.store import EntryStore

__all__ = [
    "AgeCoefficients",
    "ClippedSoftmaxRule",
    "EntryStore",
    "FunctionalSGD",
    "GaugeSoftmaxRule",
    "Grower",
    "GrowingLayer",
    "GrowingLinear",
    "GrowingRBF",
    "GrowingRBFNet",
    "GrowingSoftmax",
    "KERNELS",
    "MLP",
    "ParametricSoftmax",
    "ParametricSoftmaxNet",
    "Partial",
    "RMSNorm",
    "ResNetMLP",
    "ResidualNet",
    "__version__",
    "attention",
    "attention_partial",
    "finalize",
    "growing_layers",
    "growing_softmax_net",
    "merge_partials",
    "naive_attention",
    "to_dual_form",
]
