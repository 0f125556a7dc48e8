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

A fast :func:`~rcdl.memory.forgetting.forget` given the log (``replay=log``) tells it which
samples it removed (:attr:`ReplayLog.forgotten`) and which entry ids the sample map stopped
naming (:attr:`ReplayLog.erased`), and drops every snapshot taken after the first forgotten
sample's batch (those snapshots hold a history with the samples in it; a layer snapshotted
whole holds their rows): a later exact request replays the stream without them too. A forget
the log was not told of is detected at :meth:`ReplayLog.restore`, before anything changes:
ids handed out after the snapshot whose sample the map no longer knows, or rows of a whole
snapshot whose sample it no longer knows, would be written or loaded back.

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
from rcdl.nn.sample_map import UNKNOWN
from rcdl.ops.half import product_record

__all__ = ["ReplayLog", "Snapshot"]


@dataclass
class _LayerState:
    size: int  # rows
    next_id: int
    last_id: int  # the id of its last row (-1: none): still there iff no row before it went
    rows: dict[str, Tensor] | None  # the rows themselves, for layers whose entries move
    samples: Tensor | None = None  # (size,) the sample of each of those rows, as then known


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
                return 0 if obj.rows is None else size(obj.rows) + size(obj.samples)
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

    ``forgotten`` holds the samples a fast ``forget(..., replay=log)`` removed that the stream
    still holds (a replay leaves them out, :meth:`keep_only` lets them go), and ``erased`` per
    layer the entry ids whose sample the map stopped naming through such a forget, below the
    ids a restore hands out anew (module docstring).
    """

    every: int = 1
    order: Tensor | None = None  # (N,) positions into x_train, in training order
    sample_ids: Tensor | None = None  # (N_train,) the id of each row (None: its position)
    batch_size: int = 0
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    products: dict[str, str | None] | None = None  # {"mode": ..., "auto_path": ...}
    forgotten: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # (F,)
    erased: dict[str, Tensor] = field(default_factory=dict)  # layer → (E,) entry ids

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
        self.forgotten, self.erased = torch.zeros(0, dtype=torch.long), {}

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
            owners = None if rows is None else layer.provenance.of(rows["ids"])
            last = int(store.ids[-1]) if len(store) else -1
            layers[name] = _LayerState(len(store), store.next_id, last, rows, owners)
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
        self.forgotten = self.forgotten[torch.isin(self.forgotten, self.stream)]
        return self.order

    def savepoint(self) -> tuple[Any, ...]:
        """The log's fields as they are now, for :meth:`roll_back`."""
        return self.order, dict(self.snapshots), self.forgotten, dict(self.erased)

    def roll_back(self, point: tuple[Any, ...]) -> None:
        """Put the log's fields back as :meth:`savepoint` gave them (the same snapshot
        objects: nothing was written into them)."""
        self.order, snapshots, self.forgotten, erased = point
        self.snapshots, self.erased = dict(snapshots), dict(erased)

    def first_step(self, sample_indices: Tensor) -> int | None:
        """The step (batch index) where one of ``sample_indices (S,)`` is first trained in
        the stream (``None``: none is in it)."""
        hit = torch.isin(self.stream, sample_indices).nonzero()
        return None if hit.numel() == 0 else int(hit[0]) // self.batch_size

    def record_forget(self, sample_indices: Tensor, erased: dict[str, Tensor]) -> list[str]:
        """A fast forget removed the samples ``sample_indices (S,)`` and its sample maps stopped
        naming the entry ids ``erased`` (layer → ``(E,)``): note both, and drop every snapshot
        after the first batch that trains one of the samples and every snapshot whose whole
        rows name one; returns the snapshots dropped, named."""
        wanted = sample_indices.to(self.stream.device)
        first = self.first_step(wanted)
        held = wanted[torch.isin(wanted, self.stream)].cpu()  # a replay leaves these out
        self.forgotten = torch.cat([self.forgotten, held]).unique()
        for name, ids in erased.items():
            old = self.erased.get(name, torch.zeros(0, dtype=torch.long))
            self.erased[name] = torch.cat([old, ids.cpu()]).unique()
        dropped = []
        for step in sorted(self.snapshots):
            holds = any(state.samples is not None and bool(
                torch.isin(state.samples, wanted.to(state.samples.device)).any())
                for state in self.snapshots[step].layers.values())
            if holds or (first is not None and step > first):
                del self.snapshots[step]
                dropped.append(f"replay snapshot at step {step}")
        return dropped

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
        a save and load keep them), or if a forget the log was not told of removed rows that
        the restore or the replay would bring back (:meth:`restore_problem`)."""
        problem = self.restore_problem(snap, model)
        if problem is not None:
            raise ValueError(f"ReplayLog.restore: {problem}")
        layers = dict(growing_layers(model))
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
        self.erased = {name: ids[ids < snap.layers[name].next_id]  # later ids: handed out
                       for name, ids in self.erased.items() if name in snap.layers}  # anew


    def restore_problem(self, snap: Snapshot, model: nn.Module) -> str | None:
        """What would make :meth:`restore` of ``snap`` refuse, or make a replay from it
        bring back a forgotten row (``None``: nothing): other layers than the snapshot's; a
        row an append-only layer held at the snapshot gone since; an entry id handed out since
        the snapshot, or a row of a whole snapshot, whose sample the map no longer names
        while the log was not told of its forget."""
        layers = dict(growing_layers(model))
        if set(layers) != set(snap.layers):
            return (f"the snapshot is of layers {sorted(snap.layers)}, the model has "
                    f"{sorted(layers)}")
        told = ("a forget the log was not told of removed them (forget(model, samples) "
                "without replay=): the replay would bring them back. Tell the log: "
                "forget(model, samples, replay=log); or retrain")
        for name, state in snap.layers.items():
            layer: GrowingLayer = layers[name]
            store, where = layer.store, f"layer {name!r}"
            if state.rows is None and state.size and (
                    len(store) < state.size or int(store.ids[state.size - 1]) != state.last_id):
                return (f"{where} lost rows it held at step {snap.step} (a removal, a memory "
                        "budget): exact forgetting replays an append-only history only; "
                        "retrain instead")
            if layer.provenance.loaded_without_samples:
                continue  # the map names no sample: nothing to compare
            if state.rows is not None and state.samples is not None:
                now = layer.provenance.of(state.rows["ids"])
                lost = (state.samples != UNKNOWN) & (now.to(state.samples.device) == UNKNOWN)
                if bool(lost.any()):
                    count = int(lost.sum())
                    return (f"{where}: {count} row{'s' if count != 1 else ''} of its snapshot "
                            f"at step {snap.step} belong to samples the map no longer names; "
                            f"{told}")
            new = torch.arange(state.next_id, store.next_id, device=store.device)
            unknown = new[layer.provenance.of(new) == UNKNOWN]
            erased = self.erased.get(name)
            if erased is not None:
                unknown = unknown[~torch.isin(unknown, erased.to(unknown.device))]
            if unknown.numel():
                count = unknown.numel()
                return (f"{where}: {count} {'entries' if count != 1 else 'entry'} written after "
                        f"step {snap.step} belong to samples the map no longer names; {told}")
        return None


def _named_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The model's parameters and buffers (the stores' rows are neither)."""
    return [(f"param:{k}", p) for k, p in model.named_parameters()] + [
        (f"buffer:{k}", b) for k, b in model.named_buffers()]
