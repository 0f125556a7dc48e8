"""Which training sample wrote each entry (docs/attribution.md, "Provenance").

Every entry of a growing layer's store has an id (:attr:`rcdl.store.EntryStore.ids`),
handed out in order at each write and the same on every rank of a sharded store; ids follow
their rows through removal, eviction, merging, sharding, half-precision storage and
checkpoints. A layer's :class:`SampleMap` maps each id it handed out to the index of the
training sample whose record wrote it, or :data:`UNKNOWN` (initial entries, entries written
without sample indices, and entries of a checkpoint saved before provenance existed).

What an entry "was written by" stays fixed: the hybrid's Adam step moves an entry but it
keeps its id and so its sample. A merged entry keeps the survivor's sample and counts how
many it absorbed: a memory budget's merge (:func:`rcdl.memory.merge_into_nearest`) keeps
the surviving entry's id and sample, and the map adds to the survivor's count
(:meth:`SampleMap.absorbed`, row-aligned :func:`merged_counts`) one per merged-away entry
plus what that entry had absorbed itself, so (when nothing else was removed) the counts of
the stored entries add up to the entries merged away. The merged-away entries' samples are
not recorded: no entry names them any more, and :func:`forget` cannot find them.

The sample indices reach the layers from the data: :func:`rcdl.training.train_one_pass`
passes each batch's indices; in a loop of your own, wrap the training forward pass in
``with samples(model, idx):`` (``idx (B,)`` int64, one per sample of the batch). The map
costs 16 bytes per id handed out, its sample and its merge count (beside an entry of 24 KB
at width 3 072 in float32).

Under sharding (:mod:`rcdl.distributed`) every rank's map records every id of a step (the
rows then go to their ranks), so :func:`entry_samples` answers for this rank's rows;
:func:`forget`, called on every rank, removes each rank's rows and returns totals over the
ranks; merge counts are kept by the rank that merged (budgets are per shard).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from rcdl.layers import GrowingLayer

__all__ = ["UNKNOWN", "SampleMap", "entry_samples", "forget", "merged_counts", "samples"]

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

    def _cover(self, ids: Tensor) -> None:
        """Grow both maps to hold ``ids`` (new ids: unknown sample, nothing merged)."""
        needed = int(ids.max()) + 1
        have = self._samples.shape[0]
        if needed <= have:
            return
        size, device = max(needed, 2 * have), self._samples.device
        samples = torch.full((size,), UNKNOWN, dtype=torch.long, device=device)
        merged = torch.zeros((size,), dtype=torch.long, device=device)
        samples[:have], merged[:have] = self._samples, self._merged
        self._samples, self._merged = samples, merged

    def record(self, ids: Tensor, samples: Tensor | None) -> None:
        """Entries ``ids (B,)`` were written by ``samples (B,)`` (``None``: unknown)."""
        if ids.numel() == 0:
            return
        self._cover(ids)
        if samples is not None:
            self._samples[ids] = samples.to(self._samples.device, torch.long)

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
        absorbed others. :func:`rcdl.memory.merge_into_nearest` calls it."""
        if into.shape != merged.shape or into.dim() != 1:
            raise ValueError(f"SampleMap.absorb: expected ids into (E,) and merged (E,), got "
                             f"{tuple(into.shape)} and {tuple(merged.shape)}")
        if into.numel() == 0:
            return
        self._cover(torch.cat([into, merged]))
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


@contextmanager
def samples(model: nn.Module, indices: Tensor) -> Iterator[None]:
    """Within the block, the training forward passes of ``model``'s growing layers record
    that their batch rows come from the training samples ``indices (B,)``."""
    from rcdl.layers import growing_layers

    layers = [layer for _, layer in growing_layers(model)]
    for layer in layers:
        layer.recorder.set_samples(indices)
    try:
        yield
    finally:
        for layer in layers:
            layer.recorder.set_samples(None)


def entry_samples(layer: GrowingLayer) -> Tensor:  # (N,) int64
    """The training sample that wrote each entry this process stores in the growing
    ``layer``, row-aligned with its store (:data:`UNKNOWN` where not known)."""
    return layer.provenance.of(layer.store.ids)


def merged_counts(layer: GrowingLayer) -> Tensor:  # (N,) int64
    """How many entries were merged into each entry this process stores in the growing
    ``layer`` (by a memory budget with ``merge=True``), row-aligned with its store: 0 for an
    entry that absorbed none; the entry still carries only its own sample
    (:func:`entry_samples`)."""
    return layer.provenance.absorbed(layer.store.ids)


@torch.no_grad()
def forget(model: nn.Module, sample_indices: Tensor | list[int]) -> dict[str, int]:
    """Remove every entry that the training samples ``sample_indices`` wrote, in every
    growing layer of ``model`` (with what the layer keeps beside its rows: the hybrid's Adam
    moments); returns how many entries each layer removed.

    Under sharding (:mod:`rcdl.distributed`) call it on every rank with the same samples:
    each rank removes its own rows, and the counts returned are the totals over every rank
    (one ``all_reduce``), the same on every rank and the same as one process's over the
    whole store. Unsharded, nothing is communicated and the counts are this process's.

    This is not exact unlearning: entries written after a forgotten sample carry its
    influence through their keys (computed by layers that held its entries) and their
    values (gradients taken under a model it affected); and a sample whose entry a memory
    budget merged into another's is held by that entry, which carries the survivor's sample
    (:func:`merged_counts` says how many each absorbed). docs/attribution.md says where it
    is exact."""
    from rcdl.distributed import model_shard
    from rcdl.layers import growing_layers

    shard = model_shard(model, "forget")  # None: nothing to communicate
    layers = growing_layers(model)
    wanted = torch.as_tensor(sample_indices, dtype=torch.long).reshape(-1)
    removed = {}
    for name, layer in layers:
        owners = entry_samples(layer)  # (N,)
        mask = torch.isin(owners, wanted.to(owners.device)) & (owners != UNKNOWN)
        removed[name] = layer.remove_entries(mask) if bool(mask.any()) else 0
    if shard is None:
        return removed
    local = torch.tensor(list(removed.values()), device=layers[0][1].store.device)  # (L,)
    return dict(zip(removed, shard.all_reduce(local).tolist(), strict=True))
