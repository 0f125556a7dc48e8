"""Which training sample wrote each entry (docs/attribution.md, "Provenance").

Every entry of a growing layer's store has an id (:attr:`rcdl.store.EntryStore.ids`),
handed out in order at each write and the same on every rank of a sharded store; ids follow
their rows through removal, eviction, merging, sharding, half-precision storage and
checkpoints. A layer's :class:`SampleMap` maps each id it handed out to the index of the
training sample whose record wrote it, or :data:`UNKNOWN` (initial entries, entries written
without sample indices, and entries of a checkpoint saved before provenance existed).

What an entry "was written by" stays fixed: the hybrid's Adam step moves an entry but it
keeps its id and so its sample; a memory budget's merge keeps the surviving entry's id (and
its sample); the merged-away entries' samples are no longer represented by any entry.

The sample indices reach the layers from the data: :func:`rcdl.training.train_one_pass`
passes each batch's indices; in a loop of your own, wrap the training forward pass in
``with samples(model, idx):`` (``idx (B,)`` int64, one per sample of the batch). The map
costs 8 bytes per id handed out (beside an entry of 24 KB at width 3 072 in float32).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from rcdl.layers import GrowingLayer

__all__ = ["UNKNOWN", "SampleMap", "entry_samples", "forget", "samples"]

UNKNOWN = -1  # the sample of an entry of unknown origin


class SampleMap(nn.Module):
    """Entry id → training-sample index for one layer (:data:`UNKNOWN` where not known).

    Saved in the layer's state dict as ``samples`` (one int64 per id handed out); a state
    dict without it (saved before provenance existed) loads with every sample unknown."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self._samples = torch.full((0,), UNKNOWN, dtype=torch.long, device=device)
        self.loaded_without_samples = False  # the last load had no provenance to load

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - torch signature
        self._samples = fn(self._samples)
        return super()._apply(fn, recurse)

    def record(self, ids: Tensor, samples: Tensor | None) -> None:
        """Entries ``ids (B,)`` were written by ``samples (B,)`` (``None``: unknown)."""
        if ids.numel() == 0:
            return
        needed = int(ids.max()) + 1
        if needed > self._samples.shape[0]:
            grown = torch.full((max(needed, 2 * self._samples.shape[0]),), UNKNOWN,
                               dtype=torch.long, device=self._samples.device)
            grown[: self._samples.shape[0]] = self._samples
            self._samples = grown
        if samples is not None:
            self._samples[ids] = samples.to(self._samples.device, torch.long)

    def of(self, ids: Tensor) -> Tensor:  # (...,) int64
        """The samples that wrote the entries ``ids`` (:data:`UNKNOWN` where not known)."""
        known = ids < self._samples.shape[0]
        out = torch.full_like(ids, UNKNOWN)
        out[known] = self._samples.to(ids.device)[ids[known]]
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "samples"] = self._samples.clone()

    def _load_from_state_dict(  # noqa: ANN001, PLR0913
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        saved = state_dict.get(prefix + "samples")
        if saved is None:  # an older state: every entry's origin is unknown
            self._samples = torch.full((0,), UNKNOWN, dtype=torch.long,
                                       device=self._samples.device)
            self.loaded_without_samples = True
            return
        if saved.dim() != 1 or saved.is_floating_point():
            errors.append(f"SampleMap {prefix!r}: samples must be a 1-D integer tensor, got "
                          f"{saved.dtype} {tuple(saved.shape)}")
            return
        self._samples = saved.to(self._samples.device, torch.long).clone()
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


@torch.no_grad()
def forget(model: nn.Module, sample_indices: Tensor | list[int]) -> dict[str, int]:
    """Remove every entry that the training samples ``sample_indices`` wrote, in every
    growing layer of ``model`` (with what the layer keeps beside its rows: the hybrid's Adam
    moments); returns how many entries each layer removed from this process's store (under
    sharding, each rank removes its own rows: call it on every rank).

    This is not exact unlearning: entries written after a forgotten sample carry its
    influence through their keys (computed by layers that held its entries) and their
    values (gradients taken under a model it affected). docs/attribution.md says where it is
    exact."""
    from rcdl.layers import growing_layers

    wanted = torch.as_tensor(sample_indices, dtype=torch.long).reshape(-1)
    removed = {}
    for name, layer in growing_layers(model):
        owners = entry_samples(layer)  # (N,)
        mask = torch.isin(owners, wanted.to(owners.device)) & (owners != UNKNOWN)
        removed[name] = layer.remove_entries(mask) if bool(mask.any()) else 0
    return removed
