"""The divergence guard: a step that would make a layer diverge writes nothing
(docs/training.md, "Refused steps").

A growing layer's outputs can blow up when its learning rate or temperature does not suit
its inputs. Each layer holds a :class:`DivergenceGuard`, and the learners wrap their step in
it, as ``optax.apply_if_finite`` wraps an update: :meth:`DivergenceGuard.check_records`
before anything is proposed (finite outputs and gradients, outputs within
``max_output_growth`` times the layer's reference scale), and
:meth:`DivergenceGuard.checked` around each proposal (the outputs the step would leave on its
own batch, predicted in ``O(B²d)`` by :meth:`rcdl.nn.layers.GrowingLayer.outputs_after`). A
refusal raises a ``ValueError`` naming the layer and what to change; the learner then drops
the step's records (:class:`rcdl.optim.grower.Grower`). The guard's one piece of state is the
reference scale, set at the first step that writes; a grower's state dict saves it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from rcdl.nn.records import Record
from rcdl.nn.rules import NewEntries

__all__ = ["DivergenceGuard", "GuardedLayer"]


class GuardedLayer(Protocol):
    """What the guard reads of the layer it guards (a :class:`rcdl.nn.layers.GrowingLayer`)."""

    @property
    def where(self) -> str: ...

    def ready_records(self) -> list[Record]: ...

    def outputs_after(self, records: list[Record], keys: Tensor, values: Tensor,
                      weights: Tensor) -> Tensor | None: ...

    def divergence_advice(self) -> str: ...


@dataclass(eq=False)
class DivergenceGuard:
    """Refuses a layer's step whose outputs are not finite or grow past ``max_output_growth``
    times the reference scale (``None``: only non-finite outputs are refused).

    The reference scale ``output_scale`` is the outputs' RMS at the first step where they
    were non-zero, but at least :attr:`SCALE_FLOOR` times the inputs' RMS then: without the
    floor, a sharp kernel whose first answers are nearly zero (the far tail of an RBF, 1e−7)
    would refuse ordinary growth as divergence."""

    max_output_growth: float | None = 1e4
    output_scale: float | None = None

    SCALE_FLOOR = 1e-3  # the reference scale is at least this fraction of the inputs' RMS

    def __post_init__(self) -> None:
        limit = self.max_output_growth
        if limit is not None and not limit > 1:
            raise ValueError(f"max_output_growth must be > 1 or None, got {limit}")

    def restore(self, output_scale: float | None) -> None:
        """The reference scale from a learner's state dict."""
        self.output_scale = output_scale

    @torch.no_grad()
    def check_records(self, layer: GuardedLayer) -> None:
        """Raise ``ValueError`` naming ``layer`` if a ready record's output or gradient is not
        finite, or its outputs grew past ``max_output_growth`` (nothing is changed but the
        reference scale, set at the first records with non-zero outputs)."""
        for record in layer.ready_records():
            checks = [record.s.double().square().mean().sqrt(),
                      torch.isfinite(record.grad_mean).all().double()]
            if self.output_scale is None:  # the reference scale's floor, needed once
                checks.append(record.q.double().square().mean().sqrt())
            rms, grad_finite, *q_rms = torch.stack(checks).tolist()  # one device sync
            self._check_output_scale(layer, rms,
                                     floor=self.SCALE_FLOOR * q_rms[0] if q_rms else 0.0)
            if not grad_finite:
                raise ValueError(
                    f"{layer.where}: the output gradient contains NaN or inf (a NaN in the "
                    "targets or the loss?); no entry written")

    def _check_output_scale(self, layer: GuardedLayer, rms: float, floor: float) -> None:
        advice = f"the layer is diverging: {layer.divergence_advice()}; no entry written"
        if not math.isfinite(rms):
            raise ValueError(f"{layer.where}: outputs contain NaN or inf; {advice}")
        if self.output_scale is None:
            if rms > 0:
                self.output_scale = max(rms, floor)  # set at the first step that writes
            return
        limit = self.max_output_growth
        if limit is not None and rms > limit * self.output_scale:
            raise ValueError(
                f"{layer.where}: output RMS {rms:.3g} is over {limit:g} times its reference "
                f"scale {self.output_scale:.3g}; {advice} (or raise max_output_growth)")

    @torch.no_grad()
    def checked(self, layer: GuardedLayer, proposal: NewEntries | None) -> NewEntries | None:
        """``proposal`` (what ``layer.propose()`` returned), after refusing it if it would
        make this batch's outputs diverge, before it writes.

        For the linear and RBF kernels the new entries add ``Δs(q) = Σ_new w κ(q, k) v`` to
        the output; for the weighted softmax, ``s' = (Z s + N_new) / (Z + Z_new)`` with the
        pre-step normaliser ``Z`` the forward recorded (:meth:`GrowingLayer.outputs_after
        <rcdl.nn.layers.GrowingLayer.outputs_after>`; not checked where it cannot be had
        cheaply: a hybrid layer, a top-k training forward, a guarded denominator). The
        outputs the step would leave on its own batch must stay within ``max_output_growth``
        times the reference scale, or, while the store has answered only zeros (an empty
        store), the RMS of the batch's inputs."""
        limit = self.max_output_growth
        if proposal is None or limit is None or proposal[0].shape[0] == 0:
            return proposal
        records = layer.ready_records()
        after_s = layer.outputs_after(records, *proposal)
        if after_s is None:
            return proposal
        q = torch.cat([r.q for r in records])  # (B, d_in)
        after = float(after_s.double().square().mean().sqrt())
        reference = self.output_scale or float(q.double().square().mean().sqrt())
        if not math.isfinite(after) or (reference > 0 and after > limit * reference):
            raise ValueError(
                f"{layer.where}: this step would raise the output RMS on its own batch to "
                f"{after:.3g}, over {limit:g} times the layer's reference scale "
                f"{reference:.3g}; the layer is diverging: {layer.divergence_advice()}; no "
                "entry written (or raise max_output_growth)")
        return proposal
