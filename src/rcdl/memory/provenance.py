"""Which training sample wrote each entry (docs/attribution.md, "Provenance").

Every entry of a growing layer's store has an id (:attr:`rcdl.nn.store.EntryStore.ids`),
handed out in order at each write and the same on every rank of a sharded store; ids follow
their rows through removal, eviction, merging, sharding, half-precision storage and
checkpoints. A layer's :class:`~rcdl.nn.sample_map.SampleMap` maps each id it handed out to
the index of the training sample whose record wrote it, or :data:`UNKNOWN` (initial
entries, entries written without sample indices, and entries of a checkpoint saved before
provenance existed).

What an entry "was written by" stays fixed: the hybrid's Adam step moves an entry but it
keeps its id and so its sample. A merged entry keeps the survivor's sample and counts how
many it absorbed: a memory budget's merge (:func:`rcdl.memory.budgets.merge_into_nearest`) keeps
the surviving entry's id and sample, and the map adds to the survivor's count
(:meth:`~rcdl.nn.sample_map.SampleMap.absorbed`, row-aligned :func:`merged_counts`) one per
merged-away entry plus what that entry had absorbed itself, so (when nothing else was
removed) the counts of the stored entries add up to the entries merged away. The
merged-away entries' samples are not recorded: no entry names them any more, and
:func:`forget` cannot find them.

The sample indices reach the layers from the data: :func:`rcdl.train.loop.train_one_pass`
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

from torch import Tensor, nn

from rcdl.nn.layers import GrowingLayer, growing_layers
from rcdl.nn.sample_map import UNKNOWN

__all__ = ["UNKNOWN", "entry_samples", "merged_counts", "samples"]


@contextmanager
def samples(model: nn.Module, indices: Tensor) -> Iterator[None]:
    """Within the block, the training forward passes of ``model``'s growing layers record
    that their batch rows come from the training samples ``indices (B,)``."""
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
