"""rcdl — Retrieval-Centric Deep Learning: growing nonparametric networks in PyTorch.

The front page: what a user builds models from (docs/ has the maths of each).

Layers (one store of (weight, key, value) entries each; docs/reference.md §2–3)
    GrowingLinear, GrowingRBF, GrowingLaplacian, GrowingSoftmax, HybridSoftmax,
    ParametricSoftmax,
    GrowingLayer (their base), growing_layers (a model's growing layers)
Networks (the residual backbone of docs/reference.md §6 and the baselines)
    GrowingRBFNet, GrowingSoftmaxNet, HybridSoftmaxNet, ParametricSoftmaxNet, ResNetMLP,
    ResidualNet, MLP, ViT, mlp_vit, rcdl_vit,
    to_dual_form, from_dual_form (the linear dual form and back)
Learning rules and growth (what writes entries after each backward)
    FunctionalSGD, ClippedSoftmaxRule, GaugeSoftmaxRule, LearningRule, Grower,
    HybridGrower, EntryAdam, DistanceGate, AlwaysGrow, CapacityGate, ErrorScaledGate
Memory and precision
    MemoryBudget, EVICTION_POLICIES, set_store_dtype, EntryStore
Retrieval (approximate, opt-in; docs/retrieval.md)
    use_topk, use_exact
Optimizers from dual forms (docs/reference.md §7)
    FOOF, DeltaNetDecay
Training
    train_one_pass, evaluate
Checkpoints (checksummed, all-or-nothing; docs/faults.md)
    save_checkpoint, load_checkpoint, load_model_state, DamagedCheckpoint, UnsafeCheckpoint,
    CheckpointInUse

Internals stay importable from their modules and are not listed here: the streaming
attention and its partials (:mod:`rcdl.ops.attention`), kernels and the dense reference
(:mod:`rcdl.ops.kernels`), age coefficients (:mod:`rcdl.nn.age`), sharding
(:mod:`rcdl.distributed`), indices (:mod:`rcdl.retrieval.topk`). The experiments and the
``rcdl`` command live in :mod:`rcdl.app`, which the library never imports.
"""

from rcdl._version import __version__
from rcdl.memory.attribution import explain
from rcdl.memory.budgets import EVICTION_POLICIES, MemoryBudget
from rcdl.memory.cascade import readout_cascade
from rcdl.memory.forgetting import forget
from rcdl.memory.repair import forget_and_repair
from rcdl.nn.gates import AlwaysGrow, CapacityGate, DistanceGate, ErrorScaledGate, default_tau
from rcdl.nn.hybrid import GrowthStalledWarning, HybridSoftmax
from rcdl.nn.layers import (
    GrowingLaplacian,
    GrowingLayer,
    GrowingLinear,
    GrowingRBF,
    GrowingSoftmax,
    ParametricSoftmax,
    growing_layers,
    set_store_dtype,
)
from rcdl.nn.networks import (
    MLP,
    GrowingRBFNet,
    GrowingSoftmaxNet,
    HybridSoftmaxNet,
    ParametricSoftmaxNet,
    ResidualNet,
    ResNetMLP,
    from_dual_form,
    to_dual_form,
)
from rcdl.nn.records import UnsteppedBatchWarning
from rcdl.nn.rules import ClippedSoftmaxRule, FunctionalSGD, GaugeSoftmaxRule, LearningRule
from rcdl.nn.store import EntryStore
from rcdl.nn.vit import ViT, mlp_vit, rcdl_vit
from rcdl.optim.dual_optim import FOOF, DeltaNetDecay
from rcdl.optim.entry_adam import EntryAdam
from rcdl.optim.grower import Grower
from rcdl.optim.hybrid_grower import HybridGrower
from rcdl.retrieval.topk import use_exact, use_topk
from rcdl.train.checkpoint import (
    CheckpointInUse,
    DamagedCheckpoint,
    UnsafeCheckpoint,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
)
from rcdl.train.loop import evaluate, train_one_pass

__all__ = [
    "__version__",
    # layers
    "GrowingLaplacian", "GrowingLayer", "GrowingLinear", "GrowingRBF", "GrowingSoftmax",
    "HybridSoftmax",
    "ParametricSoftmax", "UnsteppedBatchWarning", "growing_layers",
    # networks
    "GrowingRBFNet", "GrowingSoftmaxNet", "HybridSoftmaxNet", "MLP", "ParametricSoftmaxNet",
    "ResNetMLP", "ResidualNet", "ViT", "from_dual_form", "mlp_vit", "rcdl_vit", "to_dual_form",
    # learning rules and growth
    "AlwaysGrow", "CapacityGate", "ClippedSoftmaxRule", "DistanceGate", "EntryAdam",
    "ErrorScaledGate", "FunctionalSGD", "GaugeSoftmaxRule", "Grower", "GrowthStalledWarning",
    "HybridGrower", "LearningRule", "default_tau",
    # memory and precision
    "EVICTION_POLICIES", "EntryStore", "MemoryBudget", "set_store_dtype",
    # retrieval
    "use_exact", "use_topk",
    # optimizers from dual forms
    "DeltaNetDecay", "FOOF",
    # training
    "evaluate", "train_one_pass",
    # attribution and forgetting
    "explain", "forget", "forget_and_repair", "readout_cascade",
    # checkpoints
    "CheckpointInUse", "DamagedCheckpoint", "UnsafeCheckpoint", "load_checkpoint",
    "load_model_state", "save_checkpoint",
]  # fmt: skip
