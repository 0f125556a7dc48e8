"""The hybrid growing network (docs/reference.md §4): entries trained by Adam, growth gated by
distance.

A :class:`HybridSoftmax` layer is a :class:`rcdl.nn.layers.GrowingSoftmax` whose stored keys,
weighted values and weights are *also* trained, jointly, by one Adam step per batch
(:class:`rcdl.optim.entry_adam.EntryAdam`, lr 1e−3). After the Adam step, a sample writes its gws
entry only if its query is farther than τ from every stored key of that layer
(:class:`rcdl.nn.gates.DistanceGate`); the other growth triggers are in :mod:`rcdl.nn.gates`
too (:class:`~rcdl.nn.gates.AlwaysGrow`, :class:`~rcdl.nn.gates.CapacityGate`,
:class:`~rcdl.nn.gates.ErrorScaledGate`).

One training step: :class:`rcdl.optim.hybrid_grower.HybridGrower` drives it, in the only
valid order::

    opt = HybridGrower(model, lr=1e-3)
    loss = F.cross_entropy(model(x), y)     # the forward records q, s and (by a hook) ḡ
    loss.backward()                         # gradients w.r.t. every stored entry, too
    opt.step()                              # EntryAdam moves the entries, then gated writes
    opt.zero_grad()                         # as for any optimizer: the parameters' gradients

(The two halves also exist alone, :class:`~rcdl.optim.entry_adam.EntryAdam` and
:class:`rcdl.optim.grower.Grower`. In the wrong order the growth step drops the entries'
gradients, and the next ``EntryAdam.step()`` raises an error saying so instead of silently
skipping the update.)

Entries are plain rows of the layer's :class:`~rcdl.nn.store.EntryStore`, not ``nn.Parameter``s:
the store grows, and a growing parameter list does not fit ``torch.optim``. In training mode
the forward pass attends over fresh leaf tensors that share the store's memory, so
``backward()`` leaves the entries' gradients on them, and :meth:`HybridSoftmax.take_entry_grads`
hands them to the optimizer. Adam's moments are the optimizer's state, as in
``torch.optim.Adam``: :class:`rcdl.optim.entry_adam.EntryMoments` keeps them aligned with the
layer's rows by entry id (growth and removal need not tell it), with each entry's own step
count, so its bias correction is that of a parameter created when it was written.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from rcdl.nn.gates import (
    DistanceGate,
    GrowthTrigger,
    default_tau,
)
from rcdl.nn.layers import GrowingSoftmax
from rcdl.nn.records import Record
from rcdl.nn.rules import LearningRule

__all__ = ["GrowthStalledWarning", "HybridSoftmax", "hybrid_layers"]


class GrowthStalledWarning(UserWarning):
    """A hybrid layer's trigger has refused every sample for many steps (the layer is not
    learning from its data): usually a distance threshold too large for its queries."""


# --------------------------------------------------------------------------- the layer


class HybridSoftmax(GrowingSoftmax):
    """Weighted-softmax layer whose entries are trained by Adam and grown by a trigger
    (docs/reference.md §4).

    ``s(q) = Σ_j e^{z_j} ṽ_j / Σ_j w_j e^{z_j}`` as in :class:`~rcdl.nn.layers.GrowingSoftmax`;
    ``k_j``, ``ṽ_j`` and ``w_j`` all receive gradients in training mode. Trained weights may
    turn negative and the denominator small: the attention's guard keeps outputs finite.

    Args:
        rule: the rule proposing entries
            (docs/reference.md §6: ``ClippedSoftmaxRule(eta=1, beta=30)``).
        trigger: which proposed entries are written (default
            ``DistanceGate(default_tau(d_in))``, τ = 50 · √(d_in / 3072): the paper's τ = 50 at
            its width, the same fraction of ``‖q‖ = √d_in`` at any other). If it refuses every
            sample of the first ``STALL_STEPS`` (100) steps, a :class:`GrowthStalledWarning`
            says so, with the distances it saw.
        seed: seeds the initial entries (default: torch's global generator) and the
            stochastic rounding of a half-precision store (:mod:`rcdl.ops.rounding`; default: a
            number drawn from torch's global generator). Saved with the model as the buffer
            ``rounding_seed``.
        max_output_growth: a step is refused, with an error naming the layer and saying
            which of the rule's η and β to change, once the RMS of the layer's outputs
            exceeds this multiple of their RMS at the first step (default 100, where other
            growing layers use 1e4; ``None`` turns the check off). With non-negative
            weights a weighted softmax outputs a weighted mean of its entries' values
            ``v_j = ṽ_j / w_j``, so its outputs grow only where the rule writes values far
            beyond the store's (they scale as β/η, docs/reference.md §3) or entries of
            zero weight pile up in the numerator: a hundredfold growth is such a run, not
            learning (docs/reference.md §4 compares runs that learn and runs that do not).

    Other arguments as :class:`~rcdl.nn.layers.GrowingSoftmax` (docs/reference.md §6: T = 5).

    The entries written and the samples refused are counted by the learner that writes
    them (:class:`rcdl.optim._step.Growth`, one per layer in
    :attr:`rcdl.optim.grower.Grower.growth`, saved with the learner's state); :meth:`stats`
    reports what the layer holds.
    """

    trains_entries = True  # EntryAdam moves every entry: no cached evaluation partials
    STALL_STEPS = 100  # growth steps without a single write before GrowthStalledWarning
    # the buffers a state saved before the learner kept the counts holds them in
    OLD_COUNTS = {"entries_written": "written", "entries_refused": "refused"}
    rounding_seed: Tensor  # () the seed of the Adam step's rounding

    def __init__(self, d_in: int, d_out: int, *, temperature: float, rule: LearningRule,
                 trigger: GrowthTrigger | None = None, initial_entries: int = 16,
                 seed: int | None = None, max_output_growth: float | None = 100.0,
                 **kw) -> None:
        super().__init__(d_in, d_out, temperature=temperature, rule=rule,
                         initial_entries=initial_entries, seed=seed,
                         max_output_growth=max_output_growth, **kw)
        if rule.needs_log_normalizer:
            raise ValueError(
                "HybridSoftmax: the 1/Z-normalised rule needs Z(q) > 0, but Adam may drive "
                "stored weights negative (Z ≤ 0, log Z undefined); use the clipped gws rule "
                "(ClippedSoftmaxRule(normalize=False)) as the paper does (docs/reference.md §4)")
        self.trigger: GrowthTrigger = (
            DistanceGate(default_tau(d_in)) if trigger is None else trigger)
        rounding_seed = int(torch.randint(1 << 62, ())) if seed is None else seed
        self.register_buffer("rounding_seed", torch.tensor(rounding_seed, dtype=torch.long))
        self._leaves: tuple[Tensor, Tensor, Tensor] | None = None
        # the counts of the learner that steps this layer (it owns and saves them), for stats()
        # the counts an older state held on the layer, until its learner's state loads
        self._old_counts: dict[str, int] | None = None
        self._last_sq_distance: Tensor | None = None  # (B,) of the last gated batch
        self._adam_skipped = False  # a growth step dropped entry gradients Adam never used

    # ---------------------------------------------------------------- forward
    def attend(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B, d_out)
        """In training (grad enabled), attention over the trainable :meth:`entry_leaves`:
        over all of them, or, with a top-k mode that applies in training
        (``use_topk(model, k, train=True)``), over each query's top-k rows found by its index,
        so that the leaves' gradients are zero outside the rows gathered (docs/retrieval.md,
        "Training the hybrid with top-k"). Otherwise as :class:`GrowingSoftmax`."""
        if not (self.training and torch.is_grad_enabled()):
            return super().attend(q)
        return self.backend.attend(self, q, self.entries(*self.entry_leaves()), self._stats)

    def entry_leaves(self) -> tuple[Tensor, Tensor, Tensor]:
        """Leaf tensors sharing the store's live rows, on which backward leaves the entries'
        gradients (made once per step, reused if the layer runs twice in a step)."""
        n = len(self.store)
        if self._leaves is None or self._leaves[0].shape[0] != n:
            store = self.store
            self._leaves = (store.keys.detach().requires_grad_(),
                            store.values.detach().requires_grad_(),
                            store.weights.detach().requires_grad_())
        return self._leaves

    def release_rows(self) -> list[str]:
        dropped = super().release_rows()
        if self._leaves is not None:  # views of the rows as they were
            self._leaves = None
            dropped.append("entry gradient leaves")
        return dropped

    def _drop_unstepped(self) -> None:
        if self.recorder.ready():  # the entries' gradients belong to the same dropped batch
            self._leaves = None
        super()._drop_unstepped()

    def take_entry_grads(self) -> tuple[Tensor | None, Tensor | None, Tensor | None] | None:
        """The gradients backward left on the entries' keys, weighted values and weights
        since the last Adam step (``None`` for one that got none), handed over once: the
        leaves are dropped. ``None`` if backward left none."""
        leaves, self._leaves = self._leaves, None
        if leaves is None or all(t.grad is None for t in leaves):
            return None
        if leaves[0].shape[0] != len(self.store):
            raise RuntimeError(f"HybridSoftmax {self.name!r}: the store changed between the "
                               "forward pass and the Adam step; step Adam before the Grower")
        return leaves[0].grad, leaves[1].grad, leaves[2].grad

    def adam_update_lost(self) -> bool:
        """Whether a growth step dropped entry gradients that no Adam step had used (the
        steps ran in the wrong order; ``EntryAdam.step`` then refuses, saying so)."""
        return self._adam_skipped

    def drop_leaves(self) -> None:
        """Forget the entries' gradients of this step (their leaves): the step's records are
        discarded (:func:`rcdl.optim._step.discard`)."""
        self._leaves = None

    def drop_entry_grads(self) -> None:
        """Forget the entries' gradients of this step (their leaves), and a lost update."""
        self._leaves = None
        self._adam_skipped = False

    @property
    def has_entry_grads(self) -> bool:
        """Whether backward has left gradients on the entries that no Adam step used yet."""
        return self._leaves is not None and any(t.grad is not None for t in self._leaves)

    def entry_grads_finite(self) -> Tensor:  # () bool, no device sync
        """Whether every entry gradient waiting for the Adam step is finite."""
        grads = [] if self._leaves is None else [t.grad for t in self._leaves]
        sums = [g.sum() for g in grads if g is not None]  # a NaN/inf anywhere makes a sum so
        return torch.stack(sums).isfinite().all() if sums else torch.tensor(True)

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        # .to() / .double() / .cuda() replace the store's tensors: leaves made before would be
        # views of the old ones, so they are dropped (a step in flight loses its gradients)
        self._leaves = None
        return super()._apply(fn, *args, **kwargs)

    # ---------------------------------------------------------------- growth
    def accepts(self, record: Record) -> Tensor:  # (B,) bool
        """Which rows of ``record`` the trigger lets write their entries (the learner's step
        zeroes the others and keeps only these, :mod:`rcdl.optim._step`)."""
        errors = (record.grad_mean * record.n_samples).norm(dim=1)  # (B,) per-sample ‖g‖
        sq_distance = None
        if self.trigger.needs_distance:
            sq_distance = self.backend.nearest_sq_distance(self, record.q)  # (B,) all ranks
            self._last_sq_distance = sq_distance
        size = self.num_entries_all_ranks() if getattr(self.trigger, "needs_size", True) else 0
        return self.trigger.accept(sq_distance, size, errors)

    def end_growth_step(self) -> None:
        """A growth step commits (:func:`rcdl.optim._step.commit`): entry gradients no Adam
        step used are lost (the steps ran in the wrong order: ``EntryAdam.step`` then
        refuses, saying so), and the leaves go with the rows they viewed."""
        if self.has_entry_grads:  # Grower.step() ran before EntryAdam.step()
            self._adam_skipped = True
        self._leaves = None

    def warn_stalled(self) -> None:
        """Warn that the trigger refused every sample of the first :attr:`STALL_STEPS`
        steps (the learner counts them: :class:`rcdl.optim._step.Growth`), with the
        distances of the last batch's queries to their nearest key."""
        seen = ""
        if self._last_sq_distance is not None and self._last_sq_distance.numel():
            d = self._last_sq_distance.float().clamp_min(0).sqrt().median()
            seen = (f" (the last batch's queries were a median {float(d):.3g} from their "
                    "nearest key)")
        warnings.warn(
            f"{self.where} has written no entry in {self.STALL_STEPS} steps: its trigger "
            f"{self.trigger} refused every sample{seen}. A distance threshold is in the units "
            f"of the layer's queries (‖q‖ = √d = {math.sqrt(self.store.d_in):.3g} after the "
            f"networks' RMS norm); the default for this width is "
            f"DistanceGate({default_tau(self.store.d_in):.3g}) (rcdl.nn.gates.default_tau)",
            GrowthStalledWarning, stacklevel=2)

    def stats(self) -> dict[str, int]:
        """Entries stored and their bytes (what was written and refused is the learner's:
        :attr:`rcdl.optim.grower.Grower.growth`)."""
        return {"entries": len(self.store), "bytes": self.store.nbytes}

    # ---------------------------------------------------------------- older states
    def state_keys(self) -> tuple[str, ...]:
        """The keys (relative to the layer's prefix) its state dict part may hold besides its
        parameters and buffers: the counts a state saved before the learner kept them holds
        (:attr:`OLD_COUNTS`), read and handed to the learner (:meth:`keep_old_counts`)."""
        return tuple(self.OLD_COUNTS)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:  # noqa: ANN001, ANN002
        self.keep_old_counts({name: state_dict.pop(prefix + name) for name in self.OLD_COUNTS
                              if prefix + name in state_dict})
        super()._load_from_state_dict(state_dict, prefix, *args)

    def keep_old_counts(self, found: Mapping[str, Any]) -> None:
        """Keep the counts an older state held on the layer (``found``: values by the
        names of :attr:`OLD_COUNTS`; none: a state of this layout) for the learner whose
        state loads next to take over where its own state holds none
        (:meth:`take_old_counts`, :meth:`rcdl.optim.grower.Grower.load_state_dict`)."""
        self._old_counts = None if not found else {
            key: int(found.get(name, 0)) for name, key in self.OLD_COUNTS.items()}

    def take_old_counts(self) -> dict[str, int] | None:
        """The counts :meth:`keep_old_counts` kept, ``{"written", "refused"}`` (``None``:
        none), handed over once."""
        counts, self._old_counts = self._old_counts, None
        return counts

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, trigger={self.trigger}"


def hybrid_layers(model: nn.Module) -> list[tuple[str, HybridSoftmax]]:
    """All hybrid layers of ``model`` with their module paths."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, HybridSoftmax)]

