"""Growth triggers: which of the entries a hybrid layer's rule proposes are written
(docs/reference.md §4, docs/hybrid.md).

A trigger sees, per proposed entry, the query's squared distance to the layer's nearest
stored key (asked of the layer's backend, so over every rank of a sharded store), the number
of entries stored and the sample's error ``‖g_i‖``, and answers which to write.
:class:`DistanceGate` is the paper's (τ = 50 at CIFAR-10's width; :func:`default_tau` for
others), :class:`CapacityGate` raises τ as the store fills, :class:`ErrorScaledGate` lets badly
served samples write from nearer, and :class:`AlwaysGrow` writes every one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "AlwaysGrow", "CapacityGate", "DistanceGate", "ErrorScaledGate", "GrowthTrigger",
    "default_tau",
]  # fmt: skip


class GrowthTrigger(Protocol):
    """Decides which proposed entries are written.

    ``accept(sq_distance (B,) or None, size, errors (B,)) -> (B,) bool``, given each query's
    squared distance to the nearest stored key (computed only if ``needs_distance``), the
    number of entries the layer stores (over every rank if the store is sharded: counted
    only if ``needs_size``, as it costs a collective then; 0 otherwise) and each sample's
    error ``‖g_i‖``. Every argument is the same on every rank, so the ranks of a sharded
    store accept the same samples.
    """

    needs_distance: bool
    needs_size: bool

    def accept(self, sq_distance: Tensor | None, size: int, errors: Tensor) -> Tensor: ...


# --------------------------------------------------------------------------- growth triggers


@dataclass(frozen=True)
class AlwaysGrow:
    """Every sample writes its entry (the pure growing network's behaviour)."""

    needs_distance = False
    needs_size = False

    def accept(self, sq_distance: Tensor | None, size: int, errors: Tensor) -> Tensor:
        return torch.ones(errors.shape[0], dtype=torch.bool, device=errors.device)


PAPER_TAU, PAPER_WIDTH = 50.0, 3072  # docs/reference.md §6: τ = 50 on CIFAR-10's 3 072 pixels


def default_tau(d: int) -> float:
    """The default distance threshold for queries of width ``d``: ``τ = 50 · √(d / 3072)``.

    The layers of the residual networks see RMS-normalised queries, ``‖q‖ = √d``, so this is
    the paper's τ = 50 at d = 3 072 (docs/reference.md §6) kept at the same fraction, 0.90, of
    the query norm at any width: 5.1 at d = 32, 7.2 at d = 64. A threshold fixed at 50 would
    refuse every sample of a narrow layer (two unit-RMS queries of width 32 are at most
    2·√32 ≈ 11.3 apart) and the layer would never grow.
    """
    if d < 1:
        raise ValueError(f"default_tau: the query width must be >= 1, got {d}")
    return PAPER_TAU * math.sqrt(d / PAPER_WIDTH)


def _check_tau(tau: float) -> None:
    if not (tau >= 0 and math.isfinite(tau)):
        raise ValueError(f"the distance threshold tau must be a finite number >= 0, got {tau}")


def _needed_distance(gate: GrowthTrigger, sq_distance: Tensor | None) -> Tensor:
    if sq_distance is None:
        raise ValueError(f"{gate} gates on distances (needs_distance): sq_distance is None")
    return sq_distance


@dataclass(frozen=True)
class DistanceGate:
    """Write iff ``min_j ‖q − k_j‖ > τ`` over the layer's stored keys
    (docs/reference.md §4 default).

    The comparison is made on squared distances, ``d² > τ²``; samples of one batch do not
    gate each other (each is compared with the store as it stands after the Adam step).
    """

    tau: float
    needs_distance = True
    needs_size = False

    def __post_init__(self) -> None:
        _check_tau(self.tau)

    def threshold(self, size: int) -> float:
        return self.tau

    def accept(self, sq_distance: Tensor | None, size: int,
               errors: Tensor) -> Tensor:  # (B,) bool
        return _needed_distance(self, sq_distance) > self.threshold(size) ** 2


@dataclass(frozen=True)
class CapacityGate(DistanceGate):
    """Distance gate whose threshold rises as the store fills (docs/reference.md §4):
    ``τ_eff = τ · (1 + p · (N / capacity)²)`` with ``N`` entries stored (by all ranks
    together if the store is sharded)."""

    capacity: int = 1
    penalty: float = 1.0
    needs_size = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity < 1 or self.penalty < 0:
            raise ValueError(f"CapacityGate needs capacity >= 1 and penalty >= 0, got "
                             f"{self.capacity} and {self.penalty}")

    def threshold(self, size: int) -> float:
        return self.tau * (1 + self.penalty * (size / self.capacity) ** 2)


@dataclass(frozen=True)
class ErrorScaledGate(DistanceGate):
    """Distance scaled by the sample's error: write iff ``d · e_i / ē > τ`` (docs/reference.md §4).

    The error ``e_i = ‖g_i‖`` is the norm of the per-sample gradient of the loss at this
    layer's output, ``ē`` its batch mean: a local measure of how badly the sample is served
    (for the readout under cross-entropy it is ``‖softmax − onehot‖``), available to every
    layer without extra plumbing. A badly served sample writes from nearer than τ, a
    well-served one only from farther.
    """

    def accept(self, sq_distance: Tensor | None, size: int, errors: Tensor) -> Tensor:
        relative = errors / errors.mean().clamp_min(torch.finfo(errors.dtype).tiny)  # (B,)
        return _needed_distance(self, sq_distance) * relative.square() > self.tau**2
