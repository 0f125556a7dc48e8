"""A growing layer's map from entry ids to the training samples that wrote them
(docs/attribution.md, "Provenance").

:class:`SampleMap` is the per-layer record behind :mod:`rcdl.memory.provenance`: each layer keeps
one, and its ids are the store's (:attr:`rcdl.nn.store.EntryStore.ids`). It knows nothing of
layers or models; the model-wide questions (which sample wrote each entry, forgetting
samples, tagging a batch with its samples) are :mod:`rcdl.memory.provenance`'s.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["UNKNOWN", "SampleMap"]

UNKNOWN = -1  # the sample of an entry of unknown origin


class SampleMap(nn.Module):
    """Entry id → training-sample index for one layer (:data:`UNKNOWN` where not known), and
    entry id → how many entries were merged into it (0 where none).

    Saved in the layer's state dict as ``samples`` and ``merged`` (one int64 each per id
    handed out); a state dict without ``samples`` (saved before provenance existed) loads with
    every sample unknown, and one without ``merged`` (saved before merges were counted) loads
    with every count 0."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self._samples = torch.full((0,), UNKNOWN, dtype=torch.long, device=device)
        self._merged = torch.zeros((0,), dtype=torch.long, device=device)  # row-aligned
        self.loaded_without_samples = False  # the last load had no provenance to load

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - torch signature
        self._samples = fn(self._samples)
        self._merged = fn(self._merged)
        return super()._apply(fn, recurse)

    def _cover(self, needed: int) -> None:
        """Grow both maps to hold ids ``[0, needed)`` (new ids: unknown sample, nothing
        merged)."""
        have = self._samples.shape[0]
        if needed <= have:
            return
        size, device = max(needed, 2 * have), self._samples.device
        samples = torch.full((size,), UNKNOWN, dtype=torch.long, device=device)
        merged = torch.zeros((size,), dtype=torch.long, device=device)
        samples[:have], merged[:have] = self._samples, self._merged
        self._samples, self._merged = samples, merged

    def record(self, ids: Tensor, samples: Tensor | None, end: int | None = None) -> None:
        """Entries ``ids (B,)`` were written by ``samples (B,)`` (``None``: unknown). ``end``
        bounds the ids from above (``max(ids) < end``, e.g. the store's next id) where the
        caller knows it, so that the map need not read ``max(ids)`` back from the device."""
        if ids.numel() == 0:
            return
        self._cover(int(ids.max()) + 1 if end is None else end)
        if samples is not None:
            self._samples[ids] = samples.to(self._samples.device, torch.long)

    def erase(self, samples: Tensor) -> int:
        """Make every id written by one of ``samples (S,)`` unknown, so that the map (and
        the state dict it saves) no longer names those samples; returns how many ids it
        changed. Forgetting calls it (:func:`rcdl.memory.forgetting.forget`)."""
        hit = torch.isin(self._samples, samples.to(self._samples.device)) & (
            self._samples != UNKNOWN)
        self._samples[hit] = UNKNOWN
        return int(hit.sum())

    def rewind(self, next_id: int) -> None:
        """Forget every id from ``next_id`` on (unknown sample, nothing merged): the map as it
        was before those ids were handed out (:meth:`rcdl.nn.store.EntryStore.rewind`)."""
        self._samples[next_id:] = UNKNOWN
        self._merged[next_id:] = 0

    def names_samples(self) -> bool:
        """Whether the map knows the sample of at least one id (a layer trained without
        sample indices, or loaded from a state dict without them, knows none)."""
        return bool((self._samples != UNKNOWN).any())

    @staticmethod
    def _lookup(table: Tensor, ids: Tensor, missing: int) -> Tensor:  # (...,) int64
        """``table[ids]``, ``missing`` for ids past its end (handed out by no write yet)."""
        known = ids < table.shape[0]
        out = torch.full_like(ids, missing)
        out[known] = table.to(ids.device)[ids[known]]
        return out

    def of(self, ids: Tensor) -> Tensor:  # (...,) int64
        """The samples that wrote the entries ``ids`` (:data:`UNKNOWN` where not known)."""
        return self._lookup(self._samples, ids, UNKNOWN)

    def absorb(self, into: Tensor, merged: Tensor) -> None:
        """The entries ``merged (E,)`` (ids) were folded into the entries ``into (E,)``
        (ids; one may receive several): ``count[into_e] += 1 + count[merged_e]``, so a
        survivor counts every entry folded into it, directly or through an entry that had
        absorbed others. :func:`rcdl.memory.budgets.merge_into_nearest` calls it."""
        if into.shape != merged.shape or into.dim() != 1:
            raise ValueError(f"SampleMap.absorb: expected ids into (E,) and merged (E,), got "
                             f"{tuple(into.shape)} and {tuple(merged.shape)}")
        if into.numel() == 0:
            return
        self._cover(int(torch.cat([into, merged]).max()) + 1)
        device = self._merged.device
        into, merged = into.to(device), merged.to(device)
        self._merged.index_add_(0, into, 1 + self._merged[merged])

    def absorbed(self, ids: Tensor) -> Tensor:  # (...,) int64
        """How many entries were merged into each of the entries ``ids`` (0 where none)."""
        return self._lookup(self._merged, ids, 0)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "samples"] = self._samples.clone()
        destination[prefix + "merged"] = self._merged.clone()

    def state_keys(self) -> tuple[str, ...]:
        """The keys (relative to the map's prefix) its state dict part holds."""
        return ("samples", "merged")

    def state_problem(self, state_dict: dict[str, Tensor], prefix: str = "") -> str | None:
        """What would make :meth:`load_state_dict` refuse this map's part of ``state_dict``
        (``None`` if nothing): ``samples`` and ``merged`` must be 1-D integer tensors with
        one element per id (either may be absent: a state saved before it existed)."""
        saved, merged = state_dict.get(prefix + "samples"), state_dict.get(prefix + "merged")
        for key, t in (("samples", saved), ("merged", merged)):
            if t is not None and (not isinstance(t, Tensor) or t.dim() != 1
                                  or t.is_floating_point() or t.is_complex()):
                return (f"{key} must be a 1-D integer tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if saved is not None and merged is not None and merged.shape != saved.shape:
            return (f"merged must have one count per id, as samples has: got "
                    f"{tuple(merged.shape)} counts for {tuple(saved.shape)} samples")
        return None

    def _load_from_state_dict(  # noqa: ANN001, PLR0913
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        saved = state_dict.get(prefix + "samples")
        merged = state_dict.get(prefix + "merged")
        device = self._samples.device
        problem = self.state_problem(state_dict, prefix)
        if problem is not None:
            errors.append(f"SampleMap {prefix!r}: {problem}")
            return
        if saved is None:  # an older state: every entry's origin is unknown
            self._samples = torch.full((0,), UNKNOWN, dtype=torch.long, device=device)
            self._merged = torch.zeros((0,), dtype=torch.long, device=device)
            self.loaded_without_samples = True
            return
        self._samples = saved.to(device, torch.long).clone()
        self._merged = (torch.zeros_like(self._samples) if merged is None  # saved before
                        else merged.to(device, torch.long).clone())  # merges were counted
        self.loaded_without_samples = False

    def extra_repr(self) -> str:
        known = int((self._samples != UNKNOWN).sum())
        return f"ids={self._samples.shape[0]}, known={known}"
