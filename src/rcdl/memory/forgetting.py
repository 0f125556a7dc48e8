"""Forgetting training samples: remove the entries they wrote, everywhere, with a receipt
(docs/attribution.md, "Forgetting samples").

:func:`forget` removes every entry that the given samples wrote in every growing layer of a
model, and with them what was derived from those rows: the store's freed rows are zeroed
(nothing stays in its spare capacity), the layer's evaluation cache and top-k index are
dropped, the sample map stops naming the samples, and the learners given to it drop the
hybrid's Adam moments of those rows. It returns a :class:`ForgetReceipt` that says what was
removed and cleared, and the result of a scan of every tensor reachable from the model and
the learners for a row equal to a forgotten key (:func:`scan_for_rows`).

Given the run's replay log (``replay=``, :class:`rcdl.train.replay.ReplayLog`), it tells the
log what it removed, so that a later :func:`rcdl.train.unlearning.forget_exactly` replays the
stream without these samples too, and the log drops the snapshots that hold a history with
them (docs/unlearning.md, "Edits that compose").

It refuses what it cannot do right: sample indices given as a boolean mask, as floats or
negative; a layer that cannot say which samples wrote its entries; and a step in flight (a
batch recorded but not yet stepped, which would write the forgotten samples again).

This removes the samples' own entries; it is not retraining. Entries written after a
forgotten sample were fitted to a model that held it (docs/attribution.md says where removal
is exact).
"""

from __future__ import annotations

import time
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rcdl.distributed import model_shard
from rcdl.memory.provenance import entry_samples
from rcdl.nn.layers import GrowingLayer, growing_layers
from rcdl.nn.sample_map import UNKNOWN


class _ReplayLike(Protocol):
    """What :func:`forget` needs of a :class:`rcdl.train.replay.ReplayLog` (memory sits
    below train, so it names the log by what it does)."""

    @property
    def stream(self) -> Tensor: ...

    def record_forget(self, sample_indices: Tensor, erased: dict[str, Tensor]) -> list[str]: ...

__all__ = ["ForgetReceipt", "RowScan", "forget", "sample_index_tensor", "scan_for_rows"]


def sample_index_tensor(sample_indices: Tensor | Sequence[int] | Iterable[int],
                        where: str = "forget") -> Tensor:  # (S,) int64
    """``sample_indices`` as a flat int64 tensor, refusing what is not a list of sample
    indices: a boolean mask (it would name samples 0 and 1), floats (they would be
    truncated), negative indices."""
    t = sample_indices if isinstance(sample_indices, Tensor) else torch.as_tensor(
        list(sample_indices) if not hasattr(sample_indices, "__array__") else sample_indices)
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if t.dtype == torch.bool:
        raise TypeError(f"{where}: sample_indices is a boolean mask; pass the indices of the "
                        "samples instead (mask.nonzero().flatten())")
    if t.is_floating_point() or t.is_complex():
        raise TypeError(f"{where}: sample indices must be integers, got {t.dtype}")
    t = t.reshape(-1).long()
    negative = t[t < 0]
    if negative.numel():
        raise ValueError(f"{where}: sample indices must be >= 0, got {negative[:5].tolist()}")
    return t


# --------------------------------------------------------------------------- the scan


@dataclass(frozen=True)
class RowScan:
    """What :func:`scan_for_rows` looked at and found."""

    rows: int  # forgotten rows looked for (zero rows are not: spare capacity is zeros)
    tensors: int  # distinct tensors scanned
    bytes: int  # their bytes
    holders: tuple[str, ...]  # where a forgotten row was still found (paths from the roots)
    seconds: float = 0.0  # wall time of the scan

    @property
    def clean(self) -> bool:
        return not self.holders

    def to_json(self) -> dict[str, Any]:
        return {"rows_looked_for": self.rows, "tensors_scanned": self.tensors,
                "bytes_scanned": self.bytes, "holders": list(self.holders),
                "clean": self.clean, "seconds": self.seconds}


_LEAVES = (str, bytes, int, float, bool, complex, type(None), type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype,
           torch.device, weakref.ref, torch.Generator)


def _reachable_tensors(roots: Mapping[str, Any], limit: int = 1_000_000
                       ) -> Iterator[tuple[str, Tensor]]:
    """Every tensor reachable from ``roots`` through attributes, containers and gradients,
    once each, with the path it was first reached by."""
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = list(roots.items())[::-1]
    while stack and len(seen) < limit:
        path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            yield path, obj
            if obj.is_leaf and obj.requires_grad and obj.grad is not None:
                stack.append((path + ".grad", obj.grad))
            continue
        if isinstance(obj, Mapping):
            items = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
            items += [(f"{path}.key", k) for k in obj if isinstance(k, Tensor)]
        elif isinstance(obj, list | tuple | set | frozenset):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        else:
            attrs = dict(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        attrs[name] = getattr(obj, name)
            items = [(f"{path}.{k}", v) for k, v in attrs.items()]
        stack.extend(reversed(items))


def _words(rows: Tensor) -> Tensor:  # (R, W) int16: each row's bytes
    return rows.contiguous().view(torch.int16)


def scan_for_rows(roots: Mapping[str, Any], rows: Iterable[Tensor]) -> RowScan:
    """Look, in every tensor reachable from ``roots`` (name → object: a model, an optimizer,
    anything), for a row equal, bit for bit, to one of ``rows`` (each ``(R, d)``: rows of
    width ``d`` in their own dtype). A tensor is read as rows of its last dimension; those
    of another width or dtype are not compared. All-zero rows are not looked for. Each row
    is hashed from a fixed sample of its 16-bit words and the hash matches are compared
    whole, so the scan reads every tensor once."""
    start = time.perf_counter()
    wanted: dict[tuple[int, torch.dtype], Tensor] = {}
    for r in rows:
        r = r.detach().reshape(-1, r.shape[-1]).cpu()
        if r.element_size() < 2:
            continue
        r = r[(r != 0).any(1)]
        if r.numel():
            key = (r.shape[1], r.dtype)
            wanted[key] = torch.cat([wanted[key], r]) if key in wanted else r
    gen = torch.Generator().manual_seed(0)
    probes = {}
    for (d, dtype), r in wanted.items():
        words = _words(r)
        cols = torch.randperm(words.shape[1], generator=gen)[:64]
        coef = torch.randint(1, 1 << 20, (cols.numel(),), generator=gen)
        probes[(d, dtype)] = (words, cols, coef, (words[:, cols].long() * coef).sum(1))
    holders, count, nbytes, seen_storages = [], 0, 0, set[tuple]()
    for path, t in _reachable_tensors(roots):
        if t.is_sparse or t.numel() == 0 or t.dim() == 0:
            continue
        if t.is_mkldnn:  # a packed copy (rcdl.ops.packed): no storage to name; read densely
            storage: tuple = (id(t), t.dtype, t.shape[-1])  # t stays reachable from roots
            t = t.to_dense()
        else:
            storage = (t.untyped_storage().data_ptr(), t.dtype, t.shape[-1])
        count += 1
        nbytes += t.numel() * t.element_size()
        probe = probes.get((t.shape[-1], t.dtype))
        if probe is None or storage in seen_storages:
            continue
        seen_storages.add(storage)
        words, cols, coef, hashes = probe
        found = False
        for chunk in t.detach().reshape(-1, t.shape[-1]).split(8192):
            cw = _words(chunk.cpu())
            hit = torch.isin((cw[:, cols].long() * coef).sum(1), hashes)
            if bool(hit.any()) and bool((cw[hit][:, None, :] == words[None]).all(-1).any()):
                found = True
                break
        if found:
            holders.append(path)
    return RowScan(sum(len(r) for r in wanted.values()), count, nbytes, tuple(holders),
                   time.perf_counter() - start)


# --------------------------------------------------------------------------- forgetting


@dataclass(frozen=True, eq=False)
class ForgetReceipt(Mapping[str, int]):
    """What :func:`forget` did. As a mapping it is ``{layer: entries removed}`` (totals over
    the ranks of a sharded store), so ``forget(...) == {"": 2}`` reads as before.

    Attributes:
        removed: entries removed, per layer (module path).
        samples: distinct sample indices asked to forget.
        released: per layer, what it dropped that was derived from its rows (evaluation
            cache, top-k index, the hybrid's per-step gradient leaves).
        map_erased: per layer, entry ids whose sample the map no longer names (every id
            those samples wrote, whichever rank holds the row).
        learners: the learners that dropped their state of the removed rows (the hybrid's
            Adam moments), by type.
        checkpoints: what was dropped that held a history with the samples: replay-log
            snapshots, named ``"replay snapshot at step s"`` (:func:`forget` given
            ``replay=``, :func:`rcdl.train.unlearning.forget_exactly`), and checkpoint files
            removed by callers that manage them.
        scan: the scan for the forgotten keys (:func:`scan_for_rows`), this process's.
        seconds: wall time of the removal (the scan's is ``scan.seconds``).
    """

    removed: dict[str, int]
    samples: int
    seconds: float = 0.0
    released: dict[str, list[str]] = field(default_factory=dict)
    map_erased: dict[str, int] = field(default_factory=dict)
    learners: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    scan: RowScan | None = None

    def __getitem__(self, layer: str) -> int:
        return self.removed[layer]

    def __iter__(self) -> Iterator[str]:
        return iter(self.removed)

    def __len__(self) -> int:
        return len(self.removed)

    def to_json(self) -> dict[str, Any]:
        """The receipt as JSON types (what ``rcdl reproduce unlearning`` writes)."""
        return {"removed": dict(self.removed), "samples": self.samples, "seconds": self.seconds,
                "released": {k: list(v) for k, v in self.released.items()},
                "map_erased": dict(self.map_erased), "learners": list(self.learners),
                "checkpoints": list(self.checkpoints),
                "scan": None if self.scan is None else self.scan.to_json()}


def _check_can_forget(layers: list[tuple[str, GrowingLayer]]) -> None:
    """Refuse a step in flight and a layer that cannot name its entries' samples."""
    for name, layer in layers:
        where = f"forget: {type(layer).__name__} {name or '(the model)'!r}"
        if layer.recorder.has_pending or layer.recorder.ready():
            raise RuntimeError(
                f"{where} holds a training batch recorded since the last step(): stepping it "
                "would write the forgotten samples again. Call the learner's step() (or its "
                "zero_grad() to drop the batch) before forget")
        if len(layer.store) and not layer.provenance.names_samples():
            raise ValueError(
                f"{where} stores {len(layer.store)} entries but knows the sample of none (it "
                "was trained without sample indices, or loaded from a state dict saved "
                "without provenance): forget cannot find what to remove. train_one_pass "
                "passes the indices; in a loop of one's own wrap the training forward in "
                "rcdl.memory.provenance.samples(model, idx)")


@torch.no_grad()
def forget(model: nn.Module, sample_indices: Tensor | Sequence[int], *,
           learners: Iterable[Any] = (), scan: bool = True,
           replay: _ReplayLike | None = None) -> ForgetReceipt:
    """Remove every entry that the training samples ``sample_indices`` wrote, in every
    growing layer of ``model``, and everything derived from those rows; returns a
    :class:`ForgetReceipt` (as a mapping: how many entries each layer removed).

    Args:
        sample_indices: the samples' indices, as the training recorded them (integers >= 0;
            a boolean mask, floats and negative indices are refused).
        learners: the optimizers stepping ``model`` (``EntryAdam``, ``HybridGrower``): each
            drops its state of the removed rows now (the hybrid's Adam moments). Without
            them an ``EntryAdam`` drops it at its next step or ``state_dict()``.
        scan: scan every tensor reachable from ``model`` and ``learners`` for a row equal to
            a forgotten key (:func:`scan_for_rows`; reads each tensor once) and put the
            result in the receipt (with ``replay``, the log's snapshots are scanned too).
        replay: the run's :class:`~rcdl.train.replay.ReplayLog`, if it keeps one: it records
            the samples (a later ``forget_exactly`` replays the stream without them) and drops
            the snapshots taken after the first batch that trained one of them, and any
            whose stored rows name one; the receipt's ``checkpoints`` names them. Without
            it, a later ``forget_exactly`` with this log refuses.

    Under sharding (:mod:`rcdl.distributed`) call it on every rank with the same samples:
    each rank removes its own rows, and the counts returned are the totals over every rank
    (one ``all_reduce``); the scan is each rank's own.

    Raises:
        TypeError, ValueError: for indices that are not sample indices, and for a layer
            that cannot say which samples wrote its entries.
        RuntimeError: between a backward and its step (a batch recorded, not stepped).
    """
    wanted = sample_index_tensor(sample_indices)
    shard = model_shard(model, "forget")  # None: nothing to communicate
    layers = growing_layers(model)
    learners = list(learners)
    _check_can_forget(layers)
    if replay is not None:
        if shard is not None:
            raise ValueError("forget: replay= with a model sharded over ranks; a replay log "
                             "records one process's run")
        replay.stream  # noqa: B018 - refuses a log with no run recorded, before any change
    start = time.perf_counter()
    removed: dict[str, int] = {}
    released: dict[str, list[str]] = {}
    erased: dict[str, int] = {}
    erased_ids: dict[str, Tensor] = {}
    gone_keys: list[Tensor] = []
    for name, layer in layers:
        owners = entry_samples(layer)  # (N,)
        mask = torch.isin(owners, wanted.to(owners.device)) & (owners != UNKNOWN)
        if scan and bool(mask.any()):
            gone_keys.append(layer.store.keys[mask].clone())
        if replay is not None:  # every id the map names one of the samples for, kept or not
            handed = torch.arange(layer.store.next_id, device=owners.device)
            named = layer.provenance.of(handed)
            erased_ids[name] = handed[torch.isin(named, wanted.to(named.device))
                                      & (named != UNKNOWN)]
        removed[name] = layer.remove_entries(mask, released.setdefault(name, []))
        erased[name] = layer.provenance.erase(wanted)
    synced = []
    for learner in learners:
        if callable(getattr(learner, "sync", None)):
            learner.sync()
            synced.append(type(learner).__name__)
    if shard is not None:
        local = torch.tensor(list(removed.values()), device=layers[0][1].store.device)
        removed = dict(zip(removed, shard.all_reduce(local).tolist(), strict=True))
    dropped = [] if replay is None else replay.record_forget(wanted, erased_ids)
    seconds, found = time.perf_counter() - start, None
    if scan:
        roots: dict[str, Any] = {"model": model} | {
            f"learners[{i}]": x for i, x in enumerate(learners)}
        if replay is not None:
            roots["replay"] = replay
        found = scan_for_rows(roots, gone_keys)
    return ForgetReceipt(removed, int(wanted.unique().numel()), seconds, released, erased,
                         synced, dropped, found)
