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
"""

from __future__ import annotations

from torch import nn

from rcdl.layers import GrowingLayer, growing_layers

__all__ = ["Grower"]


class Grower:
    """Writes the entries of every :class:`~rcdl.layers.GrowingLayer` of ``model``.

    The loss must be the mean over the first dimension of each layer's input (the usual
    batch mean); rules that want per-sample gradients multiply back by that size.
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers: list[GrowingLayer] = []
        for name, layer in growing_layers(model):
            layer.name = name or type(layer).__name__
            self.layers.append(layer)
        if not self.layers:
            raise ValueError(f"Grower: {type(model).__name__} has no growing layers")

    def step(self) -> None:
        """Commit the entries recorded since the last step (all layers or none)."""
        proposals = [layer.propose() for layer in self.layers]
        for layer, entries in zip(self.layers, proposals, strict=True):
            layer.commit(entries)

    def discard(self) -> None:
        """Drop the records of this step without writing (e.g. after a skipped batch)."""
        for layer in self.layers:
            layer.discard()

    def reserve(self, entries_per_layer: int) -> None:
        """Preallocate room for this many more entries in every layer's store."""
        for layer in self.layers:
            layer.store.reserve(len(layer.store) + entries_per_layer)

    @property
    def num_entries(self) -> int:
        """Entries stored, all layers."""
        return sum(len(layer.store) for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of the live entries, all layers."""
        return sum(layer.store.nbytes for layer in self.layers)
