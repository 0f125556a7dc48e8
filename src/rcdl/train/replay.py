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

The log is saved to a file and loaded back under the rules of checkpoints
(:meth:`ReplayLog.save`, :meth:`ReplayLog.load`; :mod:`rcdl.train.checkpoint`): plain
containers and tensors behind a SHA-256, read without running code, a damaged file refused
naming it and a file that does not hold a log refused naming what is wrong, before anything
is built from it. A training checkpoint holds the log as its ``replay`` part, so a run
interrupted with a log resumes and keeps recording. :func:`~rcdl.train.unlearning.forget_exactly`
in another process, on a model, learners and log loaded from files, gives the bits it gives in
the training process.

The log also records how the run's half-precision products ran (:attr:`ReplayLog.products`,
:func:`rcdl.ops.half.product_record`): the paths differ in the last bits, and the one
``"auto"`` takes for training batches on a CPU without native bfloat16 products is timed once
per process, so a replay sets the recorded one rather than timing again
(docs/precision.md, "Product paths").
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from rcdl._checks import is_count
from rcdl.nn.hybrid import HybridSoftmax
from rcdl.nn.layers import GrowingLayer, growing_layers
from rcdl.nn.sample_map import UNKNOWN
from rcdl.ops.half import product_record, product_record_problem
from rcdl.train.checkpoint import DamagedCheckpoint, load_checkpoint, save_checkpoint

__all__ = ["ReplayLog", "Snapshot"]

FORMAT = 1  # the layout of ReplayLog.state_dict (its "format")
_LOG_KEYS = ("format", "every", "order", "sample_ids", "batch_size", "snapshots", "products",
             "forgotten", "erased")
_LAYER_KEYS = ("size", "next_id", "last_id", "rows", "samples")
_SNAPSHOT_KEYS = ("step", "layers", "tensors", "learners")


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

    # ---------------------------------------------------------------- files
    def state_dict(self) -> dict[str, Any]:
        """The whole log as plain containers and tensors (``format``, ``every``, ``order``,
        ``sample_ids``, ``batch_size``, ``snapshots`` by step, ``products``, ``forgotten``,
        ``erased``): what :meth:`save` writes and a training checkpoint holds as its
        ``replay`` part. It shares its tensors with the log (nothing writes into them)."""
        return {
            "format": FORMAT, "every": self.every, "order": self.order,
            "sample_ids": self.sample_ids, "batch_size": self.batch_size,
            "snapshots": {step: _snapshot_state(snap) for step, snap in self.snapshots.items()},
            "products": None if self.products is None else dict(self.products),
            "forgotten": self.forgotten, "erased": dict(self.erased),
        }

    @staticmethod
    def state_problem(state: Any) -> str | None:
        """What makes ``state`` other than what :meth:`state_dict` gives (a key missing or
        unknown, a value of another type, a tensor of another shape or dtype, a snapshot at
        another step than its key or of other layers than the others), or ``None``. Whether
        the snapshots fit a model is checked when one is restored (:meth:`restore_problem`)."""
        return _log_problem(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make this log the one ``state`` (:meth:`state_dict`) describes, checked whole
        first: a state that does not hold a log is refused with a ``ValueError`` naming what
        is wrong, and the log is left as it was."""
        problem = _log_problem(state)
        if problem is not None:
            raise ValueError(f"ReplayLog.load_state_dict: {problem}; the log was not changed")
        self.every, self.batch_size = state["every"], state["batch_size"]
        self.order, self.sample_ids = state["order"], state["sample_ids"]
        self.snapshots = {step: _snapshot(part) for step, part in state["snapshots"].items()}
        self.products = None if state["products"] is None else dict(state["products"])
        self.forgotten, self.erased = state["forgotten"], dict(state["erased"])

    def save(self, path: str | os.PathLike) -> str:
        """Write the log to ``path`` as a checksummed file
        (:func:`rcdl.train.checkpoint.save_checkpoint`, atomically); returns its SHA-256."""
        return save_checkpoint(self.state_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike, map_location: Any = "cpu") -> ReplayLog:
        """The log :meth:`save` wrote to ``path``, verified by its digest and read without
        running code (:func:`rcdl.train.checkpoint.load_checkpoint`).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            DamagedCheckpoint: the file is damaged or asks to build code (it names the
                file), or it verifies but does not hold a log (naming what is wrong).
        """
        state = load_checkpoint(path, map_location=map_location)
        problem = _log_problem(state)
        if problem is not None:
            raise DamagedCheckpoint(path, f"it does not hold a replay log: {problem}")
        log = cls(every=state["every"])
        log.load_state_dict(state)
        return log

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
        the restore or the replay would bring back (:meth:`restore_problem`). A snapshot
        taken when the hybrid layers held the counts of their writes as buffers hands them
        to the learners (:func:`_old_counts`)."""
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
        old = _old_counts(snap, model)
        for key, saved in snap.tensors.items():
            if not any(key in counts for counts in old.values()):
                own[key].copy_(saved)
        for name, layer in growing_layers(model):  # an older snapshot's counts: the learner's
            if isinstance(layer, HybridSoftmax):
                layer.keep_old_counts({key.rsplit(".", 1)[-1]: value
                                       for key, value in old.get(name, {}).items()})
        for learner, state_dict in zip(learners, snap.learners, strict=True):
            if learner is not None and state_dict is not None:
                learner.load_state_dict(copy.deepcopy(state_dict))
        for step in [s for s in self.snapshots if s > snap.step]:
            del self.snapshots[step]
        self.erased = {name: ids[ids < snap.layers[name].next_id]  # later ids: handed out
                       for name, ids in self.erased.items() if name in snap.layers}  # anew


    def steps_problem(self, model: nn.Module) -> str | None:
        """Unless ``model`` has taken the steps of the whole stream (``None``): which layer
        has not, and why that blocks a replay. A layer that took ``c`` steps when the newest
        snapshot was taken, at step ``t`` of a stream of ``S`` steps, has taken ``c + S - t``
        now; fewer mean a step undone outside the log (``Grower.drop_last_step``), which a
        replay to the stream's end would train back in, or a run that has not finished. A
        layer whose step count never moved (not trained in the run) is not counted."""
        if self.order is None or not self.snapshots:
            return None
        total = -(-len(self.order) // self.batch_size)
        newest = self.snapshots[max(self.snapshots)]
        oldest = self.snapshots[min(self.snapshots)]
        for name, layer in growing_layers(model):
            key = f"buffer:{name}.steps" if name else "buffer:steps"
            if key not in newest.tensors or key not in oldest.tensors:
                continue
            then, first, now = (int(newest.tensors[key]), int(oldest.tensors[key]),
                                int(layer.steps))
            if now == then == first and newest.step > oldest.step:
                continue  # a layer the run does not step
            expected = then + total - newest.step
            if now != expected:
                return (f"layer {name!r} has taken {now} steps where the log's stream of "
                        f"{total} steps makes {expected}: a step undone outside the log "
                        "(Grower.drop_last_step), or a run that has not finished; a replay "
                        "would train steps the model did not take. Undo steps through the "
                        "log: rewind(model, steps, replay=log, ...)")
        return None

    def restore_problem(self, snap: Snapshot, model: nn.Module) -> str | None:
        """What would make :meth:`restore` of ``snap`` refuse, or make a replay from it
        bring back a forgotten row (``None``: nothing): other layers, parameters or buffers
        than the snapshot's (a log of another model, say one loaded from another run's file); a
        row an append-only layer held at the snapshot gone since; an entry id handed out since
        the snapshot, or a row of a whole snapshot, whose sample the map no longer names
        while the log was not told of its forget."""
        layers = dict(growing_layers(model))
        if set(layers) != set(snap.layers):
            return (f"the snapshot is of layers {sorted(snap.layers)}, the model has "
                    f"{sorted(layers)}")
        own = dict(_named_tensors(model))
        old = set().union(*_old_counts(snap, model).values())
        tensors = {k: v for k, v in snap.tensors.items() if k not in old}
        if set(own) != set(tensors):
            return (f"the snapshot at step {snap.step} holds the parameters and buffers "
                    f"{sorted(tensors)}, the model has {sorted(own)}: a log of another "
                    "model")
        for key, saved in tensors.items():
            if saved.shape != own[key].shape or saved.dtype != own[key].dtype:
                return (f"the snapshot at step {snap.step} holds {key} as {saved.dtype} "
                        f"{tuple(saved.shape)}, the model has {own[key].dtype} "
                        f"{tuple(own[key].shape)}: a log of another model")
        for name, state in snap.layers.items():
            if (state.rows is not None) != layers[name].trains_entries:
                kept, model_s = ("move", "only append") if state.rows is not None else (
                    "only append", "move")
                return (f"layer {name!r}: the snapshot at step {snap.step} is of a layer whose "
                        f"entries {kept}, the model's {model_s}: a log of another model")
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


def _old_counts(snap: Snapshot, model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """The write counts ``snap`` holds as buffers of ``model``'s hybrid layers (by layer,
    then by the snapshot's key): a snapshot taken when the layers held them
    (:attr:`rcdl.nn.hybrid.HybridSoftmax.OLD_COUNTS`), where the learners' states now do. A
    restore hands them to the layers (:meth:`~rcdl.nn.hybrid.HybridSoftmax.keep_old_counts`)
    for their learner to take."""
    own = {k for k, _ in _named_tensors(model)}
    found = {}
    for name, layer in growing_layers(model):
        if isinstance(layer, HybridSoftmax):
            keys = [f"buffer:{name}.{old}" if name else f"buffer:{old}"
                    for old in layer.OLD_COUNTS]
            counts = {k: snap.tensors[k] for k in keys if k in snap.tensors and k not in own}
            if counts:
                found[name] = counts
    return found


# --------------------------------------------------------------------------- the log as a file


def _snapshot_state(snap: Snapshot) -> dict[str, Any]:
    layers = {name: {"size": st.size, "next_id": st.next_id, "last_id": st.last_id,
                     "rows": st.rows, "samples": st.samples} for name, st in snap.layers.items()}
    return {"step": snap.step, "layers": layers, "tensors": dict(snap.tensors),
            "learners": list(snap.learners)}


def _snapshot(part: dict[str, Any]) -> Snapshot:
    layers = {name: _LayerState(**{key: st[key] for key in _LAYER_KEYS})
              for name, st in part["layers"].items()}
    return Snapshot(part["step"], layers, dict(part["tensors"]), list(part["learners"]))


def _ids_problem(value: Any, where: str, length: int | None = None) -> str | None:
    """Unless ``value`` is a 1-D int64 tensor (of ``length`` elements, if given): what it is."""
    if not isinstance(value, Tensor) or value.dtype != torch.long or value.dim() != 1:
        shown = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                 if isinstance(value, Tensor) else f"a {type(value).__name__}")
        return f"{where} is {shown}, not a 1-D int64 tensor"
    if length is not None and value.numel() != length:
        return f"{where} holds {value.numel()} ids, not {length}"
    return None


def _keys_problem(part: Any, keys: tuple[str, ...], where: str) -> str | None:
    if not isinstance(part, dict):
        return f"{where} is a {type(part).__name__}, not a dict"
    missing = [k for k in keys if k not in part]
    unknown = sorted(str(k) for k in part if k not in keys)
    if missing:
        return f"{where} has no {', '.join(missing)}"
    if unknown:
        return f"{where} holds keys a replay log does not: {', '.join(unknown)}"
    return None


def _log_problem(state: Any) -> str | None:
    """:meth:`ReplayLog.state_problem`."""
    problem = _keys_problem(state, _LOG_KEYS, "the log")
    if problem is not None:
        return problem
    if state["format"] != FORMAT:
        return f"its format is {state['format']!r}; this rcdl reads format {FORMAT}"
    every, batch = state["every"], state["batch_size"]
    if not is_count(every, 1):
        return f"every is {every!r}, not an integer >= 1"
    if not is_count(batch):
        return f"batch_size is {batch!r}, not an integer >= 0"
    order, ids = state["order"], state["sample_ids"]
    if order is None:
        if ids is not None or state["snapshots"]:
            return "it records no stream (order None) but holds sample ids or snapshots"
    else:
        problem = _ids_problem(order, "order")
        if problem is None and batch < 1:
            problem = f"batch_size is {batch} with a stream recorded"
        if problem is None and ids is not None:
            problem = _ids_problem(ids, "sample_ids")
        if problem is not None:
            return problem
        rows = None if ids is None else len(ids)
        if order.numel() and (int(order.min()) < 0 or (rows is not None
                                                       and int(order.max()) >= rows)):
            return f"order holds positions outside the {rows} sample ids"
    products = state["products"]
    if products is not None and (problem := product_record_problem(products)):
        return f"products {problem}"
    problem = _ids_problem(state["forgotten"], "forgotten")
    if problem is not None:
        return problem
    erased = state["erased"]
    if not isinstance(erased, dict):
        return f"erased is a {type(erased).__name__}, not a dict of ids by layer"
    for name, value in erased.items():
        problem = (None if isinstance(name, str) else f"erased is keyed by {name!r}, not a "
                   "layer name") or _ids_problem(value, f"erased[{name!r}]")
        if problem is not None:
            return problem
    snapshots = state["snapshots"]
    if not isinstance(snapshots, dict):
        return f"snapshots is a {type(snapshots).__name__}, not a dict of snapshots by step"
    steps = None if order is None else -(-len(order) // batch)
    layers: set[str] | None = None
    for step, part in snapshots.items():
        where = f"snapshots[{step!r}]"
        if not is_count(step) or step % every or (steps is not None and step > steps):
            return (f"{where}: a snapshot is kept at a step that is a multiple of every "
                    f"({every}) in 0..{steps}")
        problem = _snapshot_problem(part, step, where)
        if problem is not None:
            return problem
        if layers is not None and set(part["layers"]) != layers:
            return f"{where} is of layers {sorted(part['layers'])}, others of {sorted(layers)}"
        layers = set(part["layers"])
    return None


def _snapshot_problem(part: Any, step: int, where: str) -> str | None:
    problem = _keys_problem(part, _SNAPSHOT_KEYS, where)
    if problem is not None:
        return problem
    if part["step"] != step:
        return f"{where} is of step {part['step']!r}"
    if not isinstance(part["layers"], dict):
        return f"{where}['layers'] is a {type(part['layers']).__name__}, not a dict by layer"
    for name, layer in part["layers"].items():
        at = f"{where}['layers'][{name!r}]"
        problem = _keys_problem(layer, _LAYER_KEYS, at) if isinstance(name, str) else (
            f"{where}['layers'] is keyed by {name!r}, not a layer name")
        if problem is not None:
            return problem
        for key, least in (("size", 0), ("next_id", 0), ("last_id", -1)):
            if not is_count(layer[key], least):
                return f"{at}[{key!r}] is {layer[key]!r}, not an integer >= {least}"
        rows, owners = layer["rows"], layer["samples"]
        if rows is None:
            if owners is not None:
                return f"{at} holds the samples of rows it does not hold"
            continue
        if not isinstance(rows, dict) or not all(
                isinstance(k, str) and isinstance(v, Tensor) for k, v in rows.items()):
            return f"{at}['rows'] is not None or a dict of tensors by name"
        problem = (_ids_problem(rows.get("ids"), f"{at}['rows']['ids']", layer["size"])
                   or (None if owners is None
                       else _ids_problem(owners, f"{at}['samples']", layer["size"])))
        if problem is not None:
            return problem
    tensors = part["tensors"]
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in tensors.items()):
        return f"{where}['tensors'] is not a dict of tensors by name"
    learners = part["learners"]
    if not isinstance(learners, list) or not all(x is None or isinstance(x, dict)
                                                 for x in learners):
        return f"{where}['learners'] is not a list of state dicts (or None)"
    return None
