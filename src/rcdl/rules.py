"""Learning rules: which entry each training sample writes (SPEC §3).

A rule turns what a layer saw in one training step — its queries ``q (B, d_in)``, its
outputs ``s (B, d_out)`` computed from the store *before* the step, and the gradient of the
batch-mean loss w.r.t. those outputs ``ḡ (B, d_out)`` — into ``B`` new entries
``(keys (B, d_in), values (B, d_out), weights (B,))``. The per-sample gradient is
``g = n · ḡ`` for a loss averaged over ``n`` samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rcdl.age import AgeCoefficients

__all__ = ["Entries", "FunctionalSGD"]

Entries = tuple[Tensor, Tensor, Tensor]  # keys (B, d_in), values (B, d_out), weights (B,)


@dataclass(frozen=True)
class FunctionalSGD:
    """Functional gradient descent: append ``k = q``, ``v = −η g`` (linear dual form, RBF).

    For the linear kernel this is the dual form of SGD on the layer's weight; for the RBF
    kernel it is the RKHS functional gradient step (SPEC §3). Weight decay and momentum
    enter through per-entry age coefficients (:class:`rcdl.age.AgeCoefficients`).

    Args:
        lr: η.
        weight_decay: λ; every entry (and the initial weight) decays by ``1 − ηλ`` per step.
        momentum: heavy-ball μ (PyTorch's convention, no dampening).
        per_sample: if True, ``g`` is the per-sample gradient (the SPEC's growing-RBF units,
            η = 10 there); if False, the batch-mean gradient ``ḡ`` (what ``torch.optim.SGD``
            steps on, so that the dual form equals it exactly).
    """

    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.0
    per_sample: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "ages", AgeCoefficients(self.lr, self.weight_decay, self.momentum))

    def entries(self, q: Tensor, s: Tensor, grad_mean: Tensor, n_samples: int) -> Entries:
        g = grad_mean * n_samples if self.per_sample else grad_mean
        weights = torch.ones(q.shape[0], dtype=q.dtype, device=q.device)
        return q, -self.lr * g, weights
