"""What exact forgetting keeps of a one-pass training run: the stream and snapshots
(docs/unlearning.md).

A :class:`ReplayLog` given to :func:`rcdl.train.loop.train_one_pass` records the order the
samples were trained in and, every ``every`` steps, a snapshot of the model and its learners.
:func:`rcdl.train.unlearning.forget_exactly` restores the newest snapshot before the earliest
forgotten sample and replays the rest of the stream without the forgotten samples, which is
the run that training on that stream from the start would have made.

A growing layer whose entries only ever append (the RBF and weighted-softmax layers under a
:class:`~rcdl.optim.grower.Grower`) is snapshotted by its row count alone: its rows at step
``s`` are the first rows of its store now, and restoring is a rewind
(:meth:`rcdl.nn.store.EntryStore.rewind`). Layers whose entries move (the hybrid's, under
Adam) are snapshotted whole. The model's ordinary parameters and buffers and the learners'
state dicts are copied at every snapshot. So for gws and RBF a snapshot costs a few bytes per
layer and ``every = 1`` is affordable; for the hybrid each costs its stores and moments.

The log also records how the run's half-precision products ran (:attr:`ReplayLog.products`,
:func:`rcdl.ops.half.product_record`): the paths differ in the last bits, and the one
``"auto"`` takes for training batches on a CPU without native bfloat16 products is timed once
per process, so a replay sets the recorded one rather than timing again
(docs/precision.md, "Product paths").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from rcdl.nn.layers import GrowingLayer, growing_layers
from rcdl.ops.half import product_record

__all__ = ["ReplayLog", "Snapshot"]


@dataclass
class _LayerState:
    size: int  # rows
    next_id: int
    last_id: int  # the id of its last row (-1: none): still there iff no row before it went
    rows: dict[str, Tensor] | None  # the rows themselves, for layers whose entries move


@dataclass
class Snapshot:
    """The training state after ``step`` steps (see the module docstring)."""

    step: int
    layers: dict[str, _LayerState]
    tensors: dict[str, Tensor]  # the model's parameters and buffers, by name
    learners: list[dict[str, Any] | None]  # each learner's state_dict (None: no learner)

    @property
    def nbytes(self) -> int:
        """Bytes the snapshot holds in tensors."""
        def size(obj: Any) -> int:
            if isinstance(obj, Tensor):
                return obj.numel() * obj.element_size()
            if isinstance(obj, dict):
                return sum(size(v) for v in obj.values())
            if isinstance(obj, list | tuple):
                return sum(size(v) for v in obj)
            if isinstance(obj, _LayerState):
                return 0 if obj.rows is None else size(obj.rows)
            return 0
        return size(self.layers) + size(self.tensors) + size(self.learners)


@dataclass
class ReplayLog:
    """The stream of a one-pass run and its snapshots (module docstring).

    Args:
        every: a snapshot every this many steps (and at step 0). Forgetting replays from the
            newest snapshot at or before the batch of the earliest forgotten sample, so a
            smaller ``every`` replays fewer steps at the cost of more snapshots
            (:attr:`nbytes`).

    ``products`` is how the run's half-precision products ran
    (:func:`rcdl.ops.half.product_record`, taken as the run starts): a replay runs them so
    (:func:`rcdl.ops.half.products_as`), and so must a retraining it is compared with.
    """

    every: int = 1
    order: Tensor | None = None  # (N,) positions into x_train, in training order
    sample_ids: Tensor | None = None  # (N_train,) the id of each row (None: its position)
    batch_size: int = 0
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    products: dict[str, str | None] | None = None  # {"mode": ..., "auto_path": ...}

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"ReplayLog: every must be an integer >= 1, got {self.every!r}")

    # ---------------------------------------------------------------- recording
    def start(self, order: Tensor, batch_size: int, sample_ids: Tensor | None) -> None:
        """A run from step 0 over ``order`` in batches of ``batch_size`` begins (with this
        process's half-precision products, recorded)."""
        self.order, self.batch_size = order.clone(), batch_size
        self.sample_ids = None if sample_ids is None else sample_ids.clone()
        self.snapshots = {}
        self.products = product_record()

    def due(self, step: int) -> bool:
        return step % self.every == 0

    @torch.no_grad()
    def take(self, step: int, model: nn.Module, learners: list[Any]) -> None:
        """Snapshot ``model`` and ``learners`` (``None`` entries allowed) after ``step``
        steps."""
        layers = {}
        for name, layer in growing_layers(model):
            store = layer.store
            rows = store.rows() if layer.trains_entries else None
            last = int(store.ids[-1]) if len(store) else -1
            layers[name] = _LayerState(len(store), store.next_id, last, rows)
        tensors = {k: v.detach().clone() for k, v in _named_tensors(model)}
        states = [None if x is None else copy.deepcopy(x.state_dict()) for x in learners]
        self.snapshots[step] = Snapshot(step, layers, tensors, states)

    @property
    def stream(self) -> Tensor:  # (N,) int64
        """The sample id trained at each position of the stream."""
        if self.order is None:
            raise ValueError("ReplayLog: no run recorded yet (give it to train_one_pass)")
        return self.order if self.sample_ids is None else self.sample_ids[self.order]

    def keep_only(self, keep: Tensor) -> Tensor:  # (M,) positions
        """The stream from now on is the positions where ``keep (N,)`` (bool, by stream
        position) is True, in their order; returns it."""
        if self.order is None:
            raise ValueError("ReplayLog: no run recorded yet (give it to train_one_pass)")
        self.order = self.order[keep]
        return self.order

    @property
    def nbytes(self) -> int:
        """Bytes the snapshots hold (the stream's order is beside them: 8 per sample)."""
        return sum(s.nbytes for s in self.snapshots.values())

    # ---------------------------------------------------------------- restoring
    def newest_at_or_before(self, step: int) -> Snapshot:
        steps = [s for s in self.snapshots if s <= step]
        if not steps:
            raise ValueError(f"ReplayLog: no snapshot at or before step {step}")
        return self.snapshots[max(steps)]

    @torch.no_grad()
    def restore(self, snap: Snapshot, model: nn.Module, learners: list[Any]) -> None:
        """Put ``model`` and ``learners`` back to ``snap``, and drop the snapshots after it
        (they hold a future that is about to change). Checked first: nothing changes if a
        row a layer held at the snapshot has gone since (ids only grow along a store's rows,
        so the snapshot's last row is still in its place exactly when none before it went;
        a save and load keep them)."""
        layers = dict(growing_layers(model))
        if set(layers) != set(snap.layers):
            raise ValueError(f"ReplayLog.restore: the snapshot is of layers "
                             f"{sorted(snap.layers)}, the model has {sorted(layers)}")
        for name, state in snap.layers.items():
            store = layers[name].store
            if state.rows is None and state.size and (
                    len(store) < state.size or int(store.ids[state.size - 1]) != state.last_id):
                raise ValueError(
                    f"ReplayLog.restore: layer {name!r} lost rows it held at step {snap.step} "
                    "(a removal, a memory budget): exact forgetting replays an append-only "
                    "history only; retrain instead")
        for name, state in snap.layers.items():
            layer: GrowingLayer = layers[name]
            layer.release_rows()
            if state.rows is None:
                layer.store.rewind(state.size, state.next_id)
            else:
                layer.store.load_rows(state.rows, next_id=state.next_id)
            layer.provenance.rewind(state.next_id)
        own = dict(_named_tensors(model))
        for key, saved in snap.tensors.items():
            own[key].copy_(saved)
        for learner, state_dict in zip(learners, snap.learners, strict=True):
            if learner is not None and state_dict is not None:
                learner.load_state_dict(copy.deepcopy(state_dict))
        for step in [s for s in self.snapshots if s > snap.step]:
            del self.snapshots[step]


def _named_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The model's parameters and buffers (the stores' rows are neither)."""
    return [(f"param:{k}", p) for k, p in model.named_parameters()] + [
        (f"buffer:{k}", b) for k, b in model.named_buffers()]
