"""The growth step: after ``loss.backward()``, every growing layer writes its entries.

This plays the part of ``optimizer.step()`` for growing layers (SPEC §3)::

    grower = Grower(model)
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)   # batch-mean loss
        loss.backward()
        grower.step()

Within a step every layer's entries are computed from the pre-step stores (the outputs
and gradients recorded during this forward/backward pass), all layers are validated
first, and only then are the entries committed together: a refused step (NaN/inf in a
gradient, say) leaves every store unchanged.

With a :class:`~rcdl.memory.MemoryBudget` the grower also keeps memory bounded: once every
layer has committed, it chooses the entries each layer must drop to stay within the budget
(all layers' choices are made before any entry is removed), merges them into their nearest
kept entries if the budget says so, and removes them through
:meth:`~rcdl.layers.GrowingLayer.remove_entries`. Between steps no store holds more than
``budget.capacity`` entries; :attr:`Grower.evicted` counts what each layer dropped.
"""

from __future__ import annotations

from torch import nn

from rcdl.layers import GrowingLayer, growing_layers
from rcdl.memory import MemoryBudget

__all__ = ["Grower"]


class Grower:
    """Writes the entries of every :class:`~rcdl.layers.GrowingLayer` of ``model``.

    The loss must be the mean over the first dimension of each layer's input (the usual
    batch mean); rules that want per-sample gradients multiply back by that size.

    Args:
        model: a module holding at least one growing layer.
        budget: if given, every layer is brought back to at most ``budget.capacity``
            entries after each step (:mod:`rcdl.memory`); ``None`` lets the stores grow.

    Attributes:
        evicted: ``{layer name: entries evicted so far}`` (all zeros without a budget).
    """

    def __init__(self, model: nn.Module, budget: MemoryBudget | None = None) -> None:
        if budget is not None and not isinstance(budget, MemoryBudget):
            raise TypeError(f"Grower: budget must be a rcdl.memory.MemoryBudget or None, "
                            f"got {type(budget).__name__}")
        self.layers: list[GrowingLayer] = []
        for name, layer in growing_layers(model):
            layer.name = name or type(layer).__name__
            self.layers.append(layer)
        if not self.layers:
            raise ValueError(f"Grower: {type(model).__name__} has no growing layers")
        if budget is not None:
            for layer in self.layers:
                budget.check(layer)
        self.budget = budget
        self.evicted: dict[str, int] = {layer.name: 0 for layer in self.layers}

    def step(self) -> None:
        """Commit the entries recorded since the last step (all layers or none), then evict
        down to the budget, if any."""
        proposals = [layer.propose() for layer in self.layers]
        for layer, entries in zip(self.layers, proposals, strict=True):
            layer.commit(entries)
        if self.budget is not None:
            masks = [self.budget.evict_mask(layer) for layer in self.layers]  # (N,) each
            for layer, mask in zip(self.layers, masks, strict=True):
                self.evicted[layer.name] += self.budget.apply(layer, mask)

    def discard(self) -> None:
        """Drop the records of this step without writing (e.g. after a skipped batch)."""
        for layer in self.layers:
            layer.discard()

    def reserve(self, entries_per_layer: int) -> None:
        """Preallocate room for this many more entries in every layer's store."""
        for layer in self.layers:
            layer.store.reserve(len(layer.store) + entries_per_layer)

    @property
    def num_evicted(self) -> int:
        """Entries evicted by the budget so far, all layers."""
        return sum(self.evicted.values())

    @property
    def num_entries(self) -> int:
        """Entries stored, all layers."""
        return sum(len(layer.store) for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of the live entries, all layers."""
        return sum(layer.store.nbytes for layer in self.layers)
