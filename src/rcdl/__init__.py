"""rcdl — Retrieval-Centric Deep Learning: growing nonparametric networks in PyTorch."""

from rcdl._version import __version__
from rcdl.age import AgeCoefficients
from rcdl.attention import Partial, attention, attention_partial, finalize, merge_partials
from rcdl.dual_optim import FOOF, DeltaNetDecay
from rcdl.grower import Grower
from rcdl.hybrid import (
    AlwaysGrow,
    CapacityGate,
    DistanceGate,
    EntryAdam,
    ErrorScaledGate,
    HybridGrower,
    HybridSoftmax,
)
from rcdl.kernels import KERNELS, Kernel, naive_attention
from rcdl.layers import (
    GrowingLayer,
    GrowingLinear,
    GrowingRBF,
    GrowingSoftmax,
    ParametricSoftmax,
    growing_layers,
    set_store_dtype,
)
from rcdl.memory import EVICTION_POLICIES, MemoryBudget, contribution_scores
from rcdl.networks import (
    MLP,
    GrowingRBFNet,
    GrowingSoftmaxNet,
    HybridSoftmaxNet,
    ParametricSoftmaxNet,
    ResidualNet,
    ResNetMLP,
    RMSNorm,
    from_dual_form,
    growing_softmax_net,
    hybrid_softmax_net,
    to_dual_form,
)
from rcdl.rules import ClippedSoftmaxRule, FunctionalSGD, GaugeSoftmaxRule, LearningRule
from rcdl.store import EntryStore
from rcdl.vit import ViT, mlp_vit, rcdl_vit

__all__ = [
    "AgeCoefficients",
    "AlwaysGrow",
    "CapacityGate",
    "ClippedSoftmaxRule",
    "DeltaNetDecay",
    "DistanceGate",
    "EVICTION_POLICIES",
    "EntryAdam",
    "EntryStore",
    "ErrorScaledGate",
    "FOOF",
    "FunctionalSGD",
    "GaugeSoftmaxRule",
    "Grower",
    "GrowingLayer",
    "GrowingLinear",
    "GrowingRBF",
    "GrowingRBFNet",
    "GrowingSoftmax",
    "GrowingSoftmaxNet",
    "HybridGrower",
    "HybridSoftmax",
    "HybridSoftmaxNet",
    "KERNELS",
    "Kernel",
    "LearningRule",
    "MLP",
    "MemoryBudget",
    "ParametricSoftmax",
    "ParametricSoftmaxNet",
    "Partial",
    "RMSNorm",
    "ResNetMLP",
    "ResidualNet",
    "ViT",
    "__version__",
    "attention",
    "attention_partial",
    "contribution_scores",
    "finalize",
    "growing_layers",
    "growing_softmax_net",
    "set_store_dtype",
    "hybrid_softmax_net",
    "merge_partials",
    "mlp_vit",
    "naive_attention",
    "rcdl_vit",
    "from_dual_form",
    "to_dual_form",
]
