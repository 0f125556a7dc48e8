"""The divergence guard: a step that would make a layer diverge writes nothing
(docs/training.md, "Refused steps").

A growing layer's outputs can blow up when its learning rate or temperature does not suit
its inputs. The learner that steps a layer holds a :class:`DivergenceGuard` for it and wraps
its step in the guard, as ``optax.apply_if_finite`` wraps an update (the layer never learns
that it is guarded): :meth:`DivergenceGuard.check_records` before anything is proposed
(finite inputs, outputs and gradients, outputs within the layer's ``max_output_growth``
times the reference scale), and :meth:`DivergenceGuard.lookahead` on each proposal (the
outputs the step would leave on its own batch, predicted in ``O(B²d)`` by
:func:`outputs_after`).

Every check is computed on the layer's device and answered as a :data:`Fault`, a ``(3,)``
float64 tensor ``[code, value, reference]`` (code 0: passed), so that a step reads nothing
back to the host: the learner reads the faults of all its layers at once where it raises
(:meth:`raise_first`), now or at a later check point (``Grower(defer_checks=True)``,
docs/gpu.md, "Host reads in a step"). A refusal raises a ``ValueError`` naming the
layer and what to change; the learner then drops the step's records
(:class:`rcdl.optim.grower.Grower`). The guard's one piece of state is the reference scale,
set at the first step that writes; a grower's state dict saves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rcdl.nn.records import Record
from rcdl.nn.rules import NewEntries
from rcdl.ops.attention import attend, attend_partial
from rcdl.ops.partials import output_with

if TYPE_CHECKING:
    from rcdl.nn.layers import GrowingLayer

__all__ = ["DivergenceGuard", "Fault", "divergence_advice", "first_fault", "outputs_after",
           "raise_first"]

Fault = Tensor  # (3,) float64 [code, value, reference]; code 0: the check passed
# the codes of a fault, in the order the checks of one record run
INPUT, OUTPUT, GROWTH, GRAD, KEYS, VALUES, WEIGHTS, AFTER = range(1, 9)
_ENTRY_CODES = {KEYS: "keys", VALUES: "values", WEIGHTS: "weights"}


def no_fault(device: torch.device | str) -> Fault:
    """A passed check ``[0, 0, 0]``."""
    return torch.zeros(3, dtype=torch.float64, device=device)


def _fault(code: int, value: Tensor, reference: Tensor | float) -> Fault:  # (3,)
    reference = torch.as_tensor(reference, dtype=torch.float64, device=value.device)
    return torch.stack([value.new_tensor(float(code)), value, reference])


def first_fault(*faults: Fault) -> Fault:
    """The first of ``faults`` whose code is not 0 (else a passed one): the fault the checks,
    run in this order, would have raised first."""
    out = faults[-1]
    for fault in reversed(faults[:-1]):
        out = torch.where(fault[0] != 0, fault, out)
    return out


def raise_first(layers: Sequence[GrowingLayer], faults: Tensor, suffix: str = "") -> None:
    """Raise the ``ValueError`` of the first fault of ``faults (L, 3)`` (row ``i`` is layer
    ``layers[i % len(layers)]``'s); nothing if none. One read of ``faults`` to the host."""
    rows = faults.tolist()
    for i, (code, value, reference) in enumerate(rows):
        if code:
            layer = layers[i % len(layers)]
            raise ValueError(_message(layer, int(code), value, reference) + suffix)


def divergence_advice(layer: GrowingLayer) -> str:
    """What a refusal for divergence tells the user to change: the rule's own advice where it
    has one (a rule whose step size is not simply its learning rate, such as gws's η, says
    what to change instead), else its learning rate; or the temperature."""
    advice = getattr(layer.rule, "divergence_advice", None)
    step = advice() if advice is not None else f"lower the learning rate (rule {layer.rule})"
    return f"{step}, or raise the temperature (T = {layer.temperature}), or normalise its inputs"


def _message(layer: GrowingLayer, code: int, value: float, reference: float) -> str:
    """The error of a fault: what was found, in which layer, and what to change."""
    where, limit = layer.where, layer.max_output_growth
    advice = f"the layer is diverging: {divergence_advice(layer)}; no entry written"
    if code == INPUT:
        return f"{where}: input contains NaN or inf; no entry written"
    if code == OUTPUT:
        return f"{where}: outputs contain NaN or inf; {advice}"
    if code == GROWTH:
        return (f"{where}: output RMS {value:.3g} is over {limit:g} times its reference "
                f"scale {reference:.3g}; {advice} (or raise max_output_growth)")
    if code == GRAD:
        return (f"{where}: the output gradient contains NaN or inf (a NaN in the targets or "
                "the loss?); no entry written")
    if code in _ENTRY_CODES:
        return f"{where}: the rule produced non-finite {_ENTRY_CODES[code]}; no entry written"
    return (f"{where}: this step would raise the output RMS on its own batch to {value:.3g}, "
            f"over {limit:g} times the layer's reference scale {reference:.3g}; {advice} "
            "(or raise max_output_growth)")


def _rms(x: Tensor) -> Tensor:  # () float64
    return x.double().square().mean().sqrt()


@torch.no_grad()
def outputs_after(layer: GrowingLayer, records: list[Record], keys: Tensor, values: Tensor,
                  weights: Tensor) -> Tensor | None:  # (B, d_out)
    """``layer``'s outputs on the records' queries once ``(keys, values, weights)`` are
    appended (what :meth:`DivergenceGuard.lookahead` reads; ``None`` where they cannot be had
    cheaply: a softmax forward that recorded no normaliser). For the linear and RBF kernels
    the new entries add ``Δs(q) = Σ_new w κ(q, k) v``; for the weighted softmax,
    ``s' = (Z s + N_new) / (Z + Z_new)`` with the pre-step normaliser ``Z = e^m den`` the
    forward recorded. Where the attention's guard changed a softmax denominator (negative
    weights) there is no cheap answer either: the recorded outputs ``s`` are returned in its
    place, which the guard has already passed (a choice made on the device, with no read
    back). The age coefficients of the existing entries' next step are not applied."""
    q = torch.cat([r.q for r in records])  # (B, d_in)
    s = torch.cat([r.s for r in records])  # (B, d_out)
    new_entries = layer.entries(keys, values, weights).replace(chunk_size=None)
    if not layer.kernel.normalised:
        return s + attend(layer.query_keys(q), new_entries)
    if any(r.normaliser is None for r in records):  # none recorded (top-k, the hybrid)
        return None
    m, den = (torch.cat(t) for t in zip(*(r.normaliser for r in records), strict=True))
    cheap = (den > 0).all()  # () False where the guard acted (negative weights)
    log_z = m + torch.log(den)  # (B,) of the pre-step store
    after = output_with(s, log_z, attend_partial(q, new_entries))  # the new entries merged in
    return torch.where(cheap, after, s)


@dataclass(eq=False)
class DivergenceGuard:
    """Refuses a layer's step whose outputs are not finite or grow past the layer's
    ``max_output_growth`` times the reference scale (``None``: only non-finite outputs are
    refused). One guard per layer, held by the learner that steps it
    (:class:`rcdl.optim.grower.Grower`'s ``guards``).

    The reference scale is the outputs' RMS at the first step where they were non-zero, but
    at least :attr:`SCALE_FLOOR` times the inputs' RMS then: without the floor, a sharp
    kernel whose first answers are nearly zero (the far tail of an RBF, 1e−7) would refuse
    ordinary growth as divergence. It is kept as a 0-dim float64 tensor on the layer's
    device, ``scale`` (0 while unset), so that setting it reads nothing back;
    :attr:`output_scale` reads it (``None`` while unset)."""

    scale: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))

    SCALE_FLOOR = 1e-3  # the reference scale is at least this fraction of the inputs' RMS

    def restore(self, output_scale: float | None) -> None:
        """The reference scale from a learner's state dict."""
        self.scale = torch.tensor(output_scale or 0.0, dtype=torch.float64,
                                  device=self.scale.device)

    @property
    def output_scale(self) -> float | None:
        """The reference scale (``None`` before the first step that wrote); a host read."""
        value = float(self.scale)
        return value if value > 0 else None

    @torch.no_grad()
    def check_records(self, layer: GrowingLayer, clean: Tensor | None = None) -> Fault:
        """The first fault of ``layer``'s ready records, in the order of the checks of each
        record: an input with NaN/inf (:data:`INPUT`), non-finite outputs (:data:`OUTPUT`),
        an output RMS over ``max_output_growth`` times the reference scale (:data:`GROWTH`),
        a non-finite output gradient (:data:`GRAD`). Reads nothing back.

        The reference scale is set, ``max(rms, SCALE_FLOOR · rms(q))``, at the first record
        with finite non-zero outputs, if no fault came before it: in this layer's earlier
        records, or before this layer (``clean``, a 0-dim bool, False where an earlier layer
        of the step faulted)."""
        records = layer.recorder.ready()
        device = records[0].q.device if records else self.scale.device
        self.scale = self.scale.to(device)
        fault = no_fault(device)
        ok = torch.ones((), dtype=torch.bool, device=device) if clean is None else clean
        limit = layer.max_output_growth
        for record in records:
            rms = _rms(record.s)
            unset = self.scale == 0
            checks = [_fault(INPUT, rms, 0.0).where(~torch.isfinite(record.q).all(), 0.0),
                      _fault(OUTPUT, rms, 0.0).where(~rms.isfinite(), 0.0)]
            if limit is not None:
                over = ~unset & (rms > limit * self.scale)
                checks.append(_fault(GROWTH, rms, self.scale).where(over, 0.0))
            record_fault = first_fault(*checks)
            sets = ok & (record_fault[0] == 0) & unset & (rms > 0)
            floored = torch.maximum(rms, self.SCALE_FLOOR * _rms(record.q))
            self.scale = torch.where(sets, floored, self.scale)
            grad_bad = ~torch.isfinite(record.grad_mean).all()
            record_fault = first_fault(record_fault,
                                       _fault(GRAD, rms, 0.0).where(grad_bad, 0.0))
            fault = first_fault(fault, record_fault)
            ok = ok & (record_fault[0] == 0)
        return fault

    @torch.no_grad()
    def lookahead(self, layer: GrowingLayer, proposal: NewEntries | None) -> Fault:
        """The fault of ``proposal`` (the entries the learner's step proposes,
        :mod:`rcdl.optim._step`) if it would make this batch's outputs diverge (:data:`AFTER`),
        else a passed one. Reads nothing back.

        For the linear and RBF kernels the new entries add ``Δs(q) = Σ_new w κ(q, k) v`` to
        the output; for the weighted softmax, ``s' = (Z s + N_new) / (Z + Z_new)`` with the
        pre-step normaliser ``Z`` the forward recorded (:func:`outputs_after`; not checked
        where it cannot be had cheaply: a hybrid layer, a top-k training forward, a guarded
        denominator). The
        outputs the step would leave on its own batch must stay within ``max_output_growth``
        times the reference scale, or, while the store has answered only zeros (an empty
        store), the RMS of the batch's inputs."""
        limit = layer.max_output_growth
        device = self.scale.device
        if proposal is None or limit is None or proposal[0].shape[0] == 0:
            return no_fault(device)
        records = layer.recorder.ready()
        after_s = outputs_after(layer, records, *proposal)
        if after_s is None:
            return no_fault(device)
        after = _rms(after_s)
        reference = torch.where(self.scale > 0, self.scale,
                                _rms(torch.cat([r.q for r in records])))
        bad = ~after.isfinite() | ((reference > 0) & (after > limit * reference))
        return _fault(AFTER, after, reference).where(bad, 0.0)
