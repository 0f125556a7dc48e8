"""Learning rules: which entry each training sample writes (docs/reference.md §3).

A rule turns what a layer saw in one training step — its queries ``q (B, d_in)``, its
outputs ``s (B, d_out)`` computed from the store *before* the step, and the gradient of the
batch-mean loss w.r.t. those outputs ``ḡ (B, d_out)`` — into ``B`` new entries
``(keys (B, d_in), values (B, d_out), weights (B,))``. The per-sample gradient is
``g = n · ḡ`` for a loss averaged over ``n`` samples.

Every rule satisfies :class:`LearningRule`: its step size η is ``rule.lr``, and
``rule.with_lr(lr)`` is the same rule with another η (what a learning-rate scheduler driving
:class:`rcdl.optim.grower.Grower` changes). For the weighted-softmax rules η is the step of the
weights only, and a smaller η alone makes the written values *larger* (they scale as β/η);
their value step is β (docs/reference.md §3, "What η and β do in a written step").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from rcdl.nn.age import AgeCoefficients

_GAUGE_EPS = 1e-8

__all__ = [
    "ClippedSoftmaxRule", "FunctionalSGD", "GaugeSoftmaxRule", "LearningRule", "NewEntries", "Step",
]  # fmt: skip

NewEntries = tuple[Tensor, Tensor, Tensor]  # keys (B, d_in), values (B, d_out), weights (B,)


class Step:
    """What a learning rule sees of one layer's training step: one object, so that a rule
    needing more (a statistic of the store) does not widen every rule's signature.

    ``q (B, d_in)`` the queries, ``s (B, d_out)`` the outputs of the pre-step store,
    ``grad_mean (B, d_out)`` the gradient of the batch-mean loss w.r.t. them and
    ``n_samples`` the samples that loss averages over; :attr:`grad` is the per-sample
    gradient ``n · ḡ``. :attr:`log_z`, the log-normaliser ``log Σ_j w_j e^{z_j}`` of the
    pre-step store (softmax layers), is computed by the layer's backend on first use only.
    """

    def __init__(self, q: Tensor, s: Tensor, grad_mean: Tensor, n_samples: int,
                 log_z: Callable[[], Tensor] | Tensor | None = None) -> None:
        self.q, self.s, self.grad_mean, self.n_samples = q, s, grad_mean, n_samples
        self._log_z = log_z

    @property
    def grad(self) -> Tensor:  # (B, d_out)
        return self.grad_mean * self.n_samples

    @property
    def log_z(self) -> Tensor:  # (B,)
        if self._log_z is None:
            raise ValueError("this step has no log-normaliser: only softmax layers give one")
        if callable(self._log_z):
            self._log_z = self._log_z()
        return self._log_z


@runtime_checkable
class LearningRule(Protocol):
    """What a growing layer asks of its learning rule.

    ``entries(step)`` returns the ``B`` entries to append, from what the :class:`Step`
    holds: the queries, the outputs of the pre-step store and the gradient of the
    batch-mean loss w.r.t. them, and on request the store's log-normaliser.
    ``needs_log_normalizer`` says whether the rule reads ``step.log_z`` (the layers refuse
    such a rule where ``Z`` may vanish). ``lr`` is the rule's step size η; ``with_lr(lr)``
    returns the rule with η replaced. ``ages`` are the rule's age coefficients
    (:class:`rcdl.nn.age.AgeCoefficients`: weight decay and momentum as per-entry factors of
    the entries' ages), or ``None`` where entries do not age.
    """

    needs_log_normalizer: bool

    @property
    def ages(self) -> AgeCoefficients | None: ...

    @property
    def lr(self) -> float: ...

    def with_lr(self, lr: float) -> LearningRule: ...

    def entries(self, step: Step) -> NewEntries: ...


@dataclass(frozen=True)
class FunctionalSGD:
    """Functional gradient descent: append ``k = q``, ``v = −η g`` (linear dual form, RBF).

    For the linear kernel this is the dual form of SGD on the layer's weight; for the RBF
    kernel it is the RKHS functional gradient step (docs/reference.md §3). Weight decay and momentum
    enter through per-entry age coefficients (:class:`rcdl.nn.age.AgeCoefficients`).

    Args:
        lr: η.
        weight_decay: λ; every entry (and the initial weight) decays by ``1 − ηλ`` per step.
        momentum: heavy-ball μ (PyTorch's convention, no dampening).
        per_sample: if True, ``g`` is the per-sample gradient (the growing-RBF units of
            docs/reference.md §6, η = 10 there); if False, the batch-mean gradient ``ḡ`` (what
            ``torch.optim.SGD`` steps on, so that the dual form equals it exactly).
    """

    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.0
    per_sample: bool = True
    needs_log_normalizer = False

    def __post_init__(self) -> None:
        self.ages: AgeCoefficients  # not a dataclass field: derived from the three above
        object.__setattr__(self, "ages", AgeCoefficients(self.lr, self.weight_decay, self.momentum))

    def with_lr(self, lr: float) -> FunctionalSGD:
        """This rule with step size ``lr``. Refused with weight decay or momentum: their age
        coefficients (:mod:`rcdl.nn.age`) assume one η for the whole run."""
        if lr != self.lr and not self.ages.trivial:
            raise ValueError(
                f"FunctionalSGD: cannot change lr from {self.lr} to {lr} with weight_decay="
                f"{self.weight_decay}, momentum={self.momentum}: the entries' age coefficients "
                "assume a constant learning rate; schedule lr only without decay and momentum")
        return dataclasses.replace(self, lr=lr)

    def entries(self, step: Step) -> NewEntries:
        q = step.q
        g = step.grad if self.per_sample else step.grad_mean
        weights = torch.ones(q.shape[0], dtype=q.dtype, device=q.device)
        return q, -self.lr * g, weights


@dataclass(frozen=True)
class ClippedSoftmaxRule:
    """The growing weighted-softmax rule "gws" (docs/reference.md §3), per-sample units.

    Append ``k = q``, ``ṽ = −β g``, ``w = max(0, η · clip(⟨s, g⟩, −B, B))`` with ``B`` the
    batch size. With ``normalize=True`` both ``ṽ`` and ``w`` are divided by
    ``Z(q) = Σ_j w_j e^{⟨q, k_j⟩/τ}`` of the pre-step store, the per-sample step size of the
    exact L² functional-gradient step of docs/reference.md §3. The clip and the ``max(0, ·)`` stay,
    so this is the exact step only for samples where neither acts; the exact step itself
    (``w = η⟨s, g⟩/Z``, which can be negative) is not offered as a rule.

    Appending ``(εw, k, εṽ)`` changes the sample's loss by ``ε c(q)(⟨g, ṽ⟩ − w⟨g, s⟩) + O(ε²)``,
    ``c(q) = e^{⟨q,k⟩/τ}/Z(q) > 0``; for this rule that is ``−ε c (β‖g‖² + w⟨g, s⟩) ≤ 0``
    because ``w`` has the sign of ``⟨s, g⟩`` or is zero. docs/reference.md §6: T = 6, β = 3,
    η = 0.003.

    The entry is written whole, not at first order: at its own query the output becomes
    ``s' = (s + c ṽ) / (1 + c w)``, a move from ``s`` toward the entry's value
    ``v = ṽ / w = −β g / (η clip(⟨s, g⟩, −B, B))`` (``s + c ṽ`` where ``w = 0``). β is the
    step size of the values; η that of the weights, which sets how far the output moves
    toward ``v`` and ``v``'s scale β/η. Where the clip acts, ``v = −(β / (ηB)) g``: a
    functional-SGD step from zero at rate β/(ηB), larger for a *smaller* η. To take smaller
    steps, lower β (docs/reference.md §3).
    """

    eta: float
    beta: float
    normalize: bool = False
    needs_log_normalizer = property(lambda self: self.normalize)
    lr = property(lambda self: self.eta, doc=(
        "The step size η of the weights (what a scheduler's ``lr`` replaces; β stays, so "
        "lowering it raises the written values ṽ/w ∝ β/η)."))
    ages = None  # entries do not age

    def with_lr(self, lr: float) -> ClippedSoftmaxRule:
        return dataclasses.replace(self, eta=lr)

    def divergence_advice(self) -> str:
        """What a diverging layer should change: β, not η alone (class docstring)."""
        return _smaller_steps(self, self.beta, self.eta)

    def entries(self, step: Step) -> NewEntries:
        q, n_samples = step.q, step.n_samples
        g = step.grad  # (B, d_out) per-sample gradient
        s_dot_g = (step.s * g).sum(1)  # (B,)
        weights = (self.eta * s_dot_g.clamp(-n_samples, n_samples)).clamp_min(0.0)
        values = -self.beta * g
        if self.normalize:
            inv_z = torch.exp(-step.log_z)  # (B,)
            weights, values = weights * inv_z, values * inv_z[:, None]
        return q, values, weights


@dataclass(frozen=True)
class GaugeSoftmaxRule:
    """The gauge-invariant weighted-softmax rule (docs/reference.md §3), batch-mean units
    ``ḡ = g/B``.

    Append ``k = q``, ``w = η α ‖ḡ‖``, ``ṽ = (−η α² − β + η α ⟨s, ḡ⟩ / (‖ḡ‖ + 1e−8)) ḡ``:
    the gws step taken in the frame shifted by ``b = (α − ⟨s, ĝ⟩) ĝ``, where
    ``⟨s + b, ḡ⟩ = α‖ḡ‖ > 0``, and mapped back. Existing entries are untouched and the new
    weight is never negative. First-order change of the loss: ``−c (β + ηα²)‖ḡ‖²``.
    docs/reference.md §6: T = 5, α = 10, η = 0.03, β = 100. In the shifted frame the entry's
    value ``ṽ/w`` has the scale β/(ηα): as for gws, a smaller η alone makes it larger
    (docs/reference.md §3).
    """

    alpha: float
    eta: float
    beta: float
    needs_log_normalizer = False
    lr = property(lambda self: self.eta, doc=(
        "The step size η of the weights (what a scheduler's ``lr`` replaces; β stays)."))
    ages = None  # entries do not age

    def with_lr(self, lr: float) -> GaugeSoftmaxRule:
        return dataclasses.replace(self, eta=lr)

    def divergence_advice(self) -> str:
        """What a diverging layer should change: β, not η alone (class docstring)."""
        return _smaller_steps(self, self.beta, self.eta)


    def entries(self, step: Step) -> NewEntries:
        q, grad_mean = step.q, step.grad_mean
        g_norm = grad_mean.norm(dim=1)  # (B,)
        s_dot_g = (step.s * grad_mean).sum(1)  # (B,)
        weights = self.eta * self.alpha * g_norm
        coef = -self.eta * self.alpha**2 - self.beta + self.eta * self.alpha * s_dot_g / (
            g_norm + _GAUGE_EPS)
        return q, coef[:, None] * grad_mean, weights


def _smaller_steps(rule: object, beta: float, eta: float) -> str:
    """The advice of the weighted-softmax rules, whose written values ṽ/w scale as β/η."""
    ratio = f" (here {beta / eta:.3g})" if eta > 0 else ""
    return (f"{rule} writes entries whose values ṽ/w grow as β/η{ratio}, so a smaller η alone "
            "makes every write larger: lower β or raise η (docs/reference.md §3)")
