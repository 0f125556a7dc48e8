"""One growth step of one layer, on the learner's side (docs/reference.md §3): what a learner
does to a growing layer between ``loss.backward()`` and the next forward, as
``torch.optim``'s functional updates do to parameters. The layer answers; these functions
write it.

- :func:`proposal` — the entries the layer's ready records would write, made from the
  pre-step store by its rule (and its trigger, where it has one: the hybrid's), with the
  fault of their finiteness check; nothing is written and nothing read back;
- :func:`commit` — append a proposal (or entries of one's own) as written at the next step,
  with the samples they came from;
- :func:`discard` — forget the step's records; :func:`drop_last_step` — undo the last step;
  :func:`take_back_rows` — take back the rows of a step refused at a deferred check;
- :class:`Growth` — what the learner's steps wrote into a gated layer (the hybrid's) and what
  its trigger refused: the learner's counts, kept and saved by the learner as
  ``torch.optim`` keeps an optimizer's step counts, not by the layer it writes.

:class:`~rcdl.optim.grower.Grower` runs them over every layer at once, inside the
divergence guards it holds for them (:mod:`rcdl.nn.divergence`). Every write of the layer's
state goes through the store, the provenance map, or the layer's step counter
(:meth:`~rcdl.nn.layers.GrowingLayer.count_steps`); the rows removed go through the layer's
one removal door (:meth:`~rcdl.nn.layers.GrowingLayer.remove_entries`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rcdl._checks import is_count
from rcdl.nn.divergence import KEYS, VALUES, WEIGHTS, Fault, first_fault, no_fault, raise_first
from rcdl.nn.hybrid import HybridSoftmax
from rcdl.nn.layers import GrowingLayer
from rcdl.nn.rules import NewEntries
from rcdl.nn.sample_map import UNKNOWN

__all__ = ["Growth", "Proposal", "commit", "discard", "drop_last_step", "gated", "proposal",
           "propose", "take_back_rows"]


@dataclass(frozen=True, eq=False)
class Proposal:
    """The entries one layer's step would write, made from the pre-step store.

    ``entries``: keys ``(B, key_dim)``, values ``(B, d_out)``, weights ``(B,)``, one row per
    recorded query, zero where the layer's trigger refused it; ``samples (B,)``: the training
    sample of each row (``UNKNOWN`` where not given); ``keep (B,)``: the rows the trigger
    accepted (``None``: every row, a layer without a trigger); ``refused``: how many it
    refused (a ``()`` tensor on the device, or 0)."""

    entries: NewEntries
    samples: Tensor
    keep: Tensor | None = None
    refused: Tensor | int = 0

    def with_entries(self, entries: NewEntries) -> Proposal:
        """This proposal with other entries for the same rows (a refused step's zeros)."""
        return dataclasses.replace(self, entries=entries)


def gated(layer: GrowingLayer) -> bool:
    """Whether ``layer`` writes only what its trigger accepts (the hybrid): its step's
    :func:`commit` returns what it wrote and refused, for the learner's :class:`Growth`."""
    return isinstance(layer, HybridSoftmax)


@dataclass
class Growth:
    """What a learner's steps wrote into one gated layer (the hybrid's): ``written``
    entries (all ranks together), ``refused`` samples its trigger refused (a ``()`` int64
    tensor on the device while training, summed without a read back; or an int), and
    ``dry_steps``, the steps in a row that wrote nothing (the stall warning's count, not
    saved). The learner keeps one per gated layer and saves it with its state
    (:meth:`state_dict`), as ``torch.optim`` keeps an optimizer's step counts."""

    written: int = 0
    refused: Tensor | int = 0
    dry_steps: int = 0

    def count(self, layer: GrowingLayer, written: int, refused: Tensor | int) -> None:
        """Count one step of the gated ``layer`` (what :func:`commit` returned). A trigger
        that refused every sample of the first :attr:`HybridSoftmax.STALL_STEPS` steps
        this learner counted is warned of (:meth:`HybridSoftmax.warn_stalled`)."""
        assert isinstance(layer, HybridSoftmax), "only a gated layer's steps are counted"
        self.written += written
        self.refused = self.refused + refused  # () on the device: no read
        self.dry_steps = 0 if written else self.dry_steps + 1
        if self.dry_steps == layer.STALL_STEPS and self.written == 0:
            layer.warn_stalled()

    def state_dict(self) -> dict[str, int]:
        """``{"written", "refused"}`` as ints (reads ``refused`` back once)."""
        return {"written": self.written, "refused": int(self.refused)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Take the counts of a :meth:`state_dict` (checked by the learner)."""
        self.written, self.refused = int(state["written"]), int(state["refused"])

    @staticmethod
    def state_problem(state: Any) -> str | None:
        """What makes ``state`` other than a :meth:`state_dict` (``None``: nothing)."""
        if not isinstance(state, Mapping) or set(state) != {"written", "refused"}:
            return (f"must be a dict with 'written' and 'refused', got "
                    f"{sorted(state) if isinstance(state, Mapping) else type(state).__name__}")
        bad = [k for k, v in state.items() if not is_count(v)]
        return None if not bad else f"{bad[0]} must be an int >= 0, got {state[bad[0]]!r}"


@torch.no_grad()
def proposal(layer: GrowingLayer) -> tuple[Proposal | None, Fault]:
    """The entries ``layer``'s ready records would write (``None``: no record is ready), with
    the fault of their finiteness check (:mod:`rcdl.nn.divergence`: the first of non-finite
    keys, values, weights; code 0 where all are finite). Nothing is written or read back:
    the learner passes the entries through the layer's guard before committing them."""
    records = layer.recorder.ready()
    if not records:
        return None, no_fault(layer.store.device)
    # the layer's trigger, where it has one: the gated layer is the hybrid, whose commit and
    # discard below handle its accepted rows and entry gradients
    gate = layer.accepts if isinstance(layer, HybridSoftmax) else None
    parts, samples, accepted = [], [], []
    refused: Tensor | int = 0
    for record in records:
        keys, values, weights = layer.make_entries(record)
        if gate is not None:  # zeroed where refused: one selection on the device at commit
            accept = gate(record)  # (B,) bool
            accepted.append(accept)
            refused = refused + (~accept).sum()  # () on the device: no read
            keys, values = keys.where(accept[:, None], 0.0), values.where(accept[:, None], 0.0)
            weights = weights.where(accept, 0.0)
        parts.append((keys, values, weights))
        rows = record.q.shape[0]
        samples.append(record.samples if record.samples is not None else record.q.new_full(
            (rows,), UNKNOWN, dtype=torch.long))
    keys, values, weights = (torch.cat(p) for p in zip(*parts, strict=True))
    zero = weights.new_zeros((), dtype=torch.float64)
    fault = first_fault(*(torch.stack([zero + code, zero, zero]).where(
        ~torch.isfinite(t).all(), 0.0) for code, t in ((KEYS, keys), (VALUES, values),
                                                      (WEIGHTS, weights))))
    keep = torch.cat(accepted) if accepted else None
    return Proposal((keys, values, weights), torch.cat(samples), keep, refused), fault


@torch.no_grad()
def propose(layer: GrowingLayer) -> NewEntries | None:
    """The entries ``layer``'s step would write, the rows its trigger accepts (nothing is
    written). Raises ``ValueError`` naming the layer if the rule produced non-finite entries
    (a read back to the host: the learners call :func:`proposal` and read the faults of every
    layer at once)."""
    made, fault = proposal(layer)
    raise_first([layer], fault[None])
    if made is None or made.keep is None:
        return None if made is None else made.entries
    return tuple(t[made.keep] for t in made.entries)  # type: ignore[return-value]


@torch.no_grad()
def commit(layer: GrowingLayer, entries: Proposal | NewEntries | None,
           ok: Tensor | None = None) -> tuple[int, Tensor | int] | None:
    """Append ``entries`` to ``layer``'s store as written at the next step: a
    :class:`Proposal` (checked finite there, so not again here: its accepted rows, with their
    samples) or entries of one's own (every row, samples unknown); then the step's records
    are forgotten.

    ``ok`` (a ``()`` bool on the device, or ``None``: passed) is the verdict of a step whose
    checks are deferred (:class:`~rcdl.optim.grower.Grower`'s ``defer_checks``): where it is
    False the step was refused and the grower has zeroed the entries. They are appended all
    the same (their number is all the host knows), but the step counter advances by ``ok``,
    not 1, so no entry ages (weight decay, momentum) and the zero rows count as written at the
    last step that passed. Nothing is read back. A layer with a trigger (the hybrid) appends
    only the accepted rows, and none where ``ok`` is False, as a step refused in the step
    writes nothing: selecting rows by a device mask sizes the append from the device (an
    implicit synchronisation, the one the trigger's choice always made).

    Returns, for a gated layer (:func:`gated`), ``(written, refused)``: the rows written
    (all ranks together) and the samples its trigger refused (a ``()`` tensor on the
    device, or 0), for the learner's :class:`Growth`; ``None`` for any other layer."""
    made: Proposal | None
    new: NewEntries | None
    made, new = (entries, entries.entries) if isinstance(entries, Proposal) else (None, entries)
    samples, refused = (None, 0) if made is None else (made.samples, made.refused)
    if new is not None and isinstance(layer, HybridSoftmax):
        count = new[0].shape[0]
        keep = None if made is None else made.keep  # (B,) bool
        if ok is not None:
            ok = ok.to(new[0].device)
            keep = ok.expand(count) if keep is None else keep & ok
            refused = refused * ok  # a refused step's samples are not the trigger's
        if keep is not None:  # the accepted rows' positions, read from the device once
            rows = keep.nonzero().squeeze(1)  # (A,)
            new = (new[0].index_select(0, rows), new[1].index_select(0, rows),
                   new[2].index_select(0, rows))
            samples = None if samples is None else samples.index_select(
                0, rows.to(samples.device))
    growth: tuple[int, Tensor | int] | None = None
    if isinstance(layer, HybridSoftmax):
        layer.end_growth_step()
        growth = (0 if new is None else int(new[0].shape[0]), refused)
    discard(layer, stepped=True)
    if new is None:
        return growth
    # a refused step leaves the counter: the entries' ages stay as they were
    layer.count_steps(1 if ok is None else ok.to(layer.steps.dtype))
    count = new[0].shape[0]  # B, the same on every rank
    ids = layer.store.new_ids(count)  # (B,) the batch's ids, the same on every rank
    layer.provenance.record(ids, samples if samples is not None and samples.shape[0] == count
                            else None, end=layer.store.next_id)
    shard = layer.shard
    if shard is not None:  # this rank stores its rows of the batch
        keep_rows = shard.owned(count, new[0].device, offset=int(layer.steps) * count)  # (B,)
        new, ids = (new[0][keep_rows], new[1][keep_rows], new[2][keep_rows]), ids[keep_rows]
    # checked finite by proposal(); the write step as a tensor: no device sync
    layer.store.append(*new, written_at=layer.steps, ids=ids, check_finite=False)
    return growth


def discard(layer: GrowingLayer, stepped: bool = False) -> None:
    """Forget ``layer``'s records of this step without writing anything: records made so far
    are never written, even if their backward runs later (a hybrid's entry gradients go with
    them). ``stepped``: a step has just committed them."""
    layer.recorder.discard(stepped)
    if isinstance(layer, HybridSoftmax):
        layer.drop_leaves()


@torch.no_grad()
def drop_last_step(layer: GrowingLayer) -> int:
    """Undo ``layer``'s last growth step: remove the entries it wrote (``written_at`` is the
    current step; the zero rows of steps refused at a deferred check since, written at the
    same step, go with them) and step the counter back, so the layer computes what it did
    before that step (weight decay and momentum included). Returns how many entries went.
    Not undone: evictions by a memory budget, and the hybrid's Adam moves of the other
    entries."""
    if int(layer.steps) == 0:
        return 0
    removed = layer.remove_entries(layer.store.written_at == layer.steps)
    layer.count_steps(-1)
    return removed


@torch.no_grad()
def take_back_rows(layer: GrowingLayer, size: int, next_id: int) -> None:
    """Take back the rows appended since ``layer``'s store held ``size`` rows and handed out
    ids up to ``next_id`` (the zero rows of a step refused at a deferred check, when a memory
    budget reads the step's verdict): the store and the provenance map as they were then
    (:meth:`rcdl.nn.store.EntryStore.rewind`)."""
    if len(layer.store) == size and layer.store.next_id == next_id:
        return
    layer.release_rows()
    layer.store.rewind(size, next_id)
    layer.provenance.rewind(next_id)
