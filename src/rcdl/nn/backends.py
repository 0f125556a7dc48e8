"""How a growing layer attends: one backend object, composed of wrappers
(docs/architecture.md, "Backends").

A layer answers every question about its store through ``layer.backend``:

- ``attend(layer, q, entries, stats)`` — the differentiable attention from queries ``q``
  over ``entries`` (an :class:`~rcdl.ops.entries.Entries`; ``None``: the layer's,
  :meth:`rcdl.nn.layers.GrowingLayer.entries`);
- ``partial(layer, q, entries)`` — the partial ``(m, num, den, mass)`` over them, no autograd;
- ``nearest_sq_distance(layer, q)`` — each query's squared distance to its nearest key;
- ``size(layer)`` — the entries stored.

Every answer is about the *whole* store, over every rank if it is sharded, so a gate or a rule
that asks the backend reads the global store by construction. The backends:

- :class:`Exact` — the attention op over this process's rows (the base);
- :class:`Sharded` — the base of a store split over ranks: partials merged over the ranks,
  the query gradient's shares summed, distances and sizes reduced;
- :class:`EvalCached` — incremental evaluation: a no-grad call on the same queries as the
  last evaluation folds only the rows written since (bit for bit the full answer);
- :class:`TopK` — approximate attention over each query's top-k rows, where its mode applies
  (:mod:`rcdl.retrieval.topk`); anything else goes to the backend it wraps.

Every backend computes through the attention op (:mod:`rcdl.ops.attention`), which picks the
compute path. They compose as ``TopK(EvalCached(Exact | Sharded))`` in one room, the layer's
:class:`LayerBackend`, and only the functions over a layer at the end of this module rebuild
it: :func:`use_shard`, :func:`use_retrieval` (:func:`rcdl.distributed.shard` and
:func:`rcdl.retrieval.topk.use_topk` call those), :func:`wrap_backend` and
:func:`backend_wrapped`, the evaluation cache's :func:`enable_eval_cache`,
:func:`disable_eval_cache` and :func:`start_evaluation`, and :func:`release_rows` when rows
change. A new backend is one class with these four methods and an ``inner``; it wraps another
without the others knowing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from rcdl.nn.store import EntryStore
from rcdl.ops.attention import attend, attend_partial, nearest_sq_distance, resume
from rcdl.ops.entries import Entries, Partial, finalize
from rcdl.ops.kernels import Kernel

__all__ = ["AttendingLayer", "Backend", "EvalCached", "Exact", "LayerBackend", "RetrievalMode",
           "ShardCollectives", "Sharded", "TopK", "Wrapper", "backend_wrapped", "compose",
           "disable_eval_cache", "enable_eval_cache", "eval_cache_hits", "find",
           "release_rows", "retrieval_of", "shard_of", "start_evaluation", "use_retrieval",
           "use_shard", "wrap_backend", "wrapped"]

class AttendingLayer(Protocol):
    """What a backend reads of the layer it answers for (a
    :class:`rcdl.nn.layers.GrowingLayer` is one): its store, and the store's rows as the
    attention op takes them (the per-entry weights with their age coefficients, the kernel
    and the layer's settings)."""

    @property
    def store(self) -> EntryStore: ...

    @property
    def kernel(self) -> Kernel: ...

    @property
    def backend(self) -> LayerBackend: ...

    def entries(self, keys: Tensor | None = None, values: Tensor | None = None,
                weights: Tensor | None = None) -> Entries: ...


class ShardCollectives(Protocol):
    """What :class:`Sharded`, the layers and the model-wide functions ask of the shard of a
    store split over ranks (:class:`rcdl.distributed.Shard` is one): its place in the group
    and its collectives."""

    @property
    def group(self) -> Any: ...  # torch.distributed.ProcessGroup | None

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, t: Tensor) -> Tensor: ...

    def merge(self, part: Partial, kernel: Kernel) -> Partial: ...

    def nearest_sq_distance(self, local: Tensor) -> Tensor: ...

    def all_reduce(self, t: Tensor, op: Any = ...) -> Tensor: ...

    def owned(self, count: int, device: torch.device, offset: int = 0) -> Tensor: ...


class RetrievalMode(Protocol):
    """What :class:`TopK` asks of a top-k mode (:class:`rcdl.retrieval.topk.TopK` is one):
    whether it applies to this call of the layer, and its attention."""

    def applies(self, layer: Any) -> bool: ...

    def attend(self, layer: Any, q: Tensor, entries: Entries | None = None) -> Tensor: ...

    def rows_removed(self) -> bool:
        """The layer removed rows: drop whatever the mode keeps of them (an index); whether
        it held any."""


class Backend(Protocol):
    """What a layer asks of the object it attends through (see the module docstring)."""

    inner: Backend | None

    def attend(self, layer: AttendingLayer, q: Tensor, entries: Entries | None = None,
               stats: list | None = None) -> Tensor: ...

    def partial(self, layer: AttendingLayer, q: Tensor, entries: Entries) -> Partial: ...

    def nearest_sq_distance(self, layer: AttendingLayer, q: Tensor) -> Tensor: ...

    def size(self, layer: AttendingLayer) -> int: ...


def find(backend: Backend | None, kind: type) -> Any:
    """The first backend of type ``kind`` in the chain from ``backend`` inwards, or ``None``."""
    while backend is not None:
        if isinstance(backend, kind):
            return backend
        backend = backend.inner
    return None


_KEEP: Any = object()  # compose(): this part of the chain as it is


def compose(backend: Backend, *, base: Backend | None = _KEEP,
            cache: EvalCached | None = _KEEP, mode: RetrievalMode | None = _KEEP) -> Backend:
    """The chain ``TopK(mode, EvalCached(base))`` rebuilt from ``backend`` with the parts named
    here replaced (``None``: left out; omitted: kept), inside the wrappers of :func:`wrapped`
    (kept, outermost, in their order). The base is a :class:`Sharded` one for a split store
    (itself over an :class:`Exact` one), else an :class:`Exact` one."""
    own = []  # the wrappers of one's own, outermost first
    node: Backend | None = backend
    while node is not None and not isinstance(node, TopK | EvalCached | Sharded | Exact):
        own.append(node)
        node = node.inner
    if base is _KEEP:
        base = find(backend, Sharded) or find(backend, Exact)
    assert base is not None  # every chain ends in one
    if cache is _KEEP:
        cache = find(backend, EvalCached)
    if mode is _KEEP:
        topk = find(backend, TopK)
        mode = None if topk is None else topk.mode
    chain: Backend = base
    if cache is not None:  # the same cache state, over the new base
        chain = dataclasses.replace(cache, inner=chain)
    if mode is not None:
        chain = TopK(mode, chain)
    for wrapper in reversed(own):
        chain = dataclasses.replace(wrapper, inner=chain)  # type: ignore[type-var]
    return chain


def wrapped(backend: Backend, wrap: Callable[[Backend], Backend]) -> Backend:
    """``wrap(backend)``, checked to be a backend :func:`compose` can rebuild under: a
    dataclass whose ``inner`` is ``backend`` (docs/architecture.md, "Adding a backend")."""
    outer = wrap(backend)
    if not (dataclasses.is_dataclass(outer) and getattr(outer, "inner", None) is backend):
        raise TypeError("wrap_backend needs a dataclass backend whose inner is the backend it "
                        f"wraps, got {type(outer).__name__}")
    return outer


class Exact:
    """The attention op over the rows this process stores (:mod:`rcdl.ops.attention`)."""

    inner: Backend | None = None

    def attend(self, layer: AttendingLayer, q: Tensor, entries: Entries | None = None,
               stats: list | None = None) -> Tensor:  # (B, d_out)
        return attend(q, layer.entries() if entries is None else entries, stats=stats)

    def partial(self, layer: AttendingLayer, q: Tensor, entries: Entries) -> Partial:
        return attend_partial(q, entries)

    def nearest_sq_distance(self, layer: AttendingLayer, q: Tensor) -> Tensor:  # (B,)
        entries = layer.entries(weights=layer.store.weights)  # keys only: no age weights
        return nearest_sq_distance(q, entries.keys, chunk_size=entries.chunk_size,
                                   half_products=entries.half_products)

    def size(self, layer: AttendingLayer) -> int:
        return len(layer.store)


@dataclass(eq=False)
class Sharded:
    """The base of a store split over ranks (:class:`rcdl.distributed.Shard`): each rank
    attends over its rows through the attention op with the shard as its combiner (the
    partials merged, the query gradient's shares summed over the ranks), and nearest
    distances and sizes are reduced over the ranks by the shard's collectives."""

    shard: ShardCollectives
    inner: Backend | None = field(default_factory=Exact)

    def attend(self, layer: AttendingLayer, q: Tensor, entries: Entries | None = None,
               stats: list | None = None) -> Tensor:  # (B, d_out)
        return attend(q, layer.entries() if entries is None else entries,
                      combiner=self.shard, stats=stats)

    def partial(self, layer: AttendingLayer, q: Tensor, entries: Entries) -> Partial:
        return attend_partial(q, entries, combiner=self.shard)

    def nearest_sq_distance(self, layer: AttendingLayer, q: Tensor) -> Tensor:  # (B,)
        assert self.inner is not None
        return self.shard.nearest_sq_distance(self.inner.nearest_sq_distance(layer, q))

    def size(self, layer: AttendingLayer) -> int:
        count = torch.tensor([len(layer.store)], dtype=torch.long, device=layer.store.device)
        return int(self.shard.all_reduce(count)[0])


class Wrapper:
    """A backend that changes how a layer attends and passes every other question (the
    partial, the nearest distance, the size) to the backend it wraps, ``inner``."""

    inner: Backend | None

    def partial(self, layer: AttendingLayer, q: Tensor, entries: Entries) -> Partial:
        assert self.inner is not None
        return self.inner.partial(layer, q, entries)

    def nearest_sq_distance(self, layer: AttendingLayer, q: Tensor) -> Tensor:
        assert self.inner is not None
        return self.inner.nearest_sq_distance(layer, q)

    def size(self, layer: AttendingLayer) -> int:
        assert self.inner is not None
        return self.inner.size(layer)


@dataclass
class _CachedPartial:
    """One evaluation batch's state for the next evaluation (see :class:`EvalCached`)."""

    q: Tensor  # (B, key_dim) the batch's queries
    rows: int  # the fold's state covers rows [0, rows): a multiple of the chunk size
    version: int  # the store's version when cached: unchanged iff it only grew since
    part: Partial  # the fold's state after those rows


@dataclass(eq=False)
class EvalCached(Wrapper):
    """Incremental evaluation (:func:`enable_eval_cache`).

    Evaluation repeats the same test queries between training steps, and a step only appends
    entries. The ``k``-th no-grad call after :meth:`start_evaluation` keeps its queries and
    the state ``(m, num, den, mass)`` of the streaming fold after the store's last full chunk;
    the ``k``-th call of the next evaluation, if its queries are the same and the store only
    grew since (same ``store.version``), folds only the chunks from there on
    (:func:`rcdl.ops.attention.resume`). The chunks are the ones a full pass folds, in the
    same order, so the result is bit for bit a full evaluation's: a resumed run, whose cache
    starts empty, evaluates exactly as the uninterrupted one. Otherwise it attends over
    everything and caches anew; where the queries changed between evaluations (a layer after
    a growing one) it stops caching. Calls with gradients, or over other entries than the
    store's, go to ``inner``. Costs the queries and the partials of one evaluation in memory.
    """

    inner: Backend | None = field(default_factory=Exact)
    slots: dict[int, _CachedPartial] | None = field(default_factory=dict)  # None: stopped
    calls: int = 0
    hits: int = 0

    def start_evaluation(self) -> None:
        self.calls = 0

    def attend(self, layer: AttendingLayer, q: Tensor, entries: Entries | None = None,
               stats: list | None = None) -> Tensor:  # (B, d_out)
        assert self.inner is not None
        if self.slots is None or entries is not None or torch.is_grad_enabled():
            return self.inner.attend(layer, q, entries, stats)
        slot, self.calls = self.calls, self.calls + 1
        store, cached = layer.store, self.slots.get(slot)
        if cached is not None and not torch.equal(cached.q, q):  # queries move: stop caching
            self.slots = None
            return self.inner.attend(layer, q, None, stats)
        start = None
        if cached is not None and cached.version == store.version and cached.rows <= len(store):
            start = (cached.rows, cached.part)  # fold the chunks from its last full one on
            self.hits += 1
        entries = layer.entries()
        part, state = resume(q, entries, start)
        if state is not None:  # None: the compute path does not resume, nothing to keep
            self.slots[slot] = _CachedPartial(q.clone(), state[0], store.version, state[1])
        return finalize(part, kernel=entries.kernel, eps=entries.eps)


@dataclass(eq=False)
class TopK(Wrapper):
    """Approximate attention over each query's top-k rows where ``mode`` applies
    (:class:`rcdl.retrieval.topk.TopK`: evaluation, or training too with ``train=True``);
    everything else goes to ``inner``."""

    mode: RetrievalMode
    inner: Backend | None = field(default_factory=Exact)

    def attend(self, layer: AttendingLayer, q: Tensor, entries: Entries | None = None,
               stats: list | None = None) -> Tensor:  # (B, d_out)
        assert self.inner is not None
        if self.mode.applies(layer):
            return self.mode.attend(layer, q, entries)
        return self.inner.attend(layer, q, entries, stats)


# --------------------------------------------------------------------------- the layer's room
@dataclass(eq=False)
class LayerBackend:
    """The backend a layer attends through (``layer.backend``): the chain of :func:`compose`,
    ``TopK(EvalCached(Exact | Sharded))`` inside the wrappers of one's own, answering every
    question of :class:`Backend` by its outermost node. The functions below rebuild
    :attr:`chain`; ``hits`` counts the evaluation cache hits of caches since dropped."""

    chain: Backend = field(default_factory=Exact)
    hits: int = 0

    @property
    def inner(self) -> Backend:
        return self.chain

    def attend(self, layer: AttendingLayer, q: Tensor, entries: Entries | None = None,
               stats: list | None = None) -> Tensor:  # (B, d_out)
        return self.chain.attend(layer, q, entries, stats)

    def partial(self, layer: AttendingLayer, q: Tensor, entries: Entries) -> Partial:
        return self.chain.partial(layer, q, entries)

    def nearest_sq_distance(self, layer: AttendingLayer, q: Tensor) -> Tensor:  # (B,)
        return self.chain.nearest_sq_distance(layer, q)

    def size(self, layer: AttendingLayer) -> int:
        return self.chain.size(layer)


def shard_of(layer: AttendingLayer) -> ShardCollectives | None:
    """The shard of ``layer``'s store split over ranks (:mod:`rcdl.distributed`), else
    ``None`` (``layer.shard``)."""
    sharded = find(layer.backend.chain, Sharded)
    return None if sharded is None else sharded.shard


def retrieval_of(layer: AttendingLayer) -> RetrievalMode | None:
    """The top-k mode ``layer`` attends by (:mod:`rcdl.retrieval.topk`), else ``None``
    (``layer.retrieval``)."""
    topk = find(layer.backend.chain, TopK)
    return None if topk is None else topk.mode


def use_shard(layer: AttendingLayer, shard: ShardCollectives | None) -> None:
    """Attend over this rank's rows of a store split over ranks (``None``: the whole store
    here): the base of the chain becomes :class:`Sharded` (:func:`rcdl.distributed.shard`
    installs it). Drops an evaluation cache."""
    layer.backend.chain = compose(layer.backend.chain,
                                  base=Exact() if shard is None else Sharded(shard), cache=None)


def use_retrieval(layer: AttendingLayer, mode: RetrievalMode | None) -> None:
    """Attend by a top-k mode (``None``: exact streaming attention again): the outer
    :class:`TopK` of the chain (:func:`rcdl.retrieval.topk.use_topk` and ``use_exact``
    install it)."""
    layer.backend.chain = compose(layer.backend.chain, mode=mode)


def wrap_backend(layer: AttendingLayer, wrap: Callable[[Backend], Backend]) -> None:
    """Attend through ``wrap(backend)``: a backend of one's own around the current one, a
    dataclass with an ``inner`` field; it stays outermost (docs/architecture.md, "Adding a
    backend")."""
    try:
        layer.backend.chain = wrapped(layer.backend.chain, wrap)
    except TypeError as err:
        raise TypeError(f"{type(layer).__name__} {getattr(layer, 'name', '')!r}: {err}") from None


@contextmanager
def backend_wrapped(layer: AttendingLayer, wrap: Callable[[Backend], Backend]) -> Iterator[None]:
    """Within the block, ``layer`` attends through ``wrap(backend)`` (as :func:`wrap_backend`);
    the backend of before is back after it."""
    before = layer.backend.chain
    wrap_backend(layer, wrap)
    try:
        yield
    finally:
        layer.backend.chain = before


def enable_eval_cache(layer: Any) -> None:
    """Cache ``layer``'s partial results for repeated evaluations on fixed inputs: a no-grad
    call on the queries of the last evaluation folds only the rows written since, bit for bit
    the full answer (:class:`EvalCached`). Not cached: sharded stores, age coefficients
    (weight decay, momentum: every entry's weight changes each step) and layers whose entries
    are trained (``trains_entries``: the hybrid)."""
    ages = layer.rule.ages
    disable_eval_cache(layer)  # counts the hits of a cache enabled before: reset after
    layer.backend.hits = 0
    if shard_of(layer) is None and (ages is None or ages.trivial) and not layer.trains_entries:
        layer.backend.chain = compose(layer.backend.chain, cache=EvalCached())


def disable_eval_cache(layer: AttendingLayer) -> None:
    """Turn ``layer``'s evaluation cache off and free it (its hits stay counted in
    :func:`eval_cache_hits`)."""
    cache = find(layer.backend.chain, EvalCached)
    if cache is not None:
        layer.backend.hits = layer.backend.hits + cache.hits
        layer.backend.chain = compose(layer.backend.chain, cache=None)


def start_evaluation(layer: AttendingLayer) -> None:
    """Call before each evaluation: ``layer``'s next forward call is the first batch's."""
    cache = find(layer.backend.chain, EvalCached)
    if cache is not None:
        cache.start_evaluation()


def eval_cache_hits(layer: AttendingLayer) -> int:
    """``layer``'s cached calls that only attended over new rows, since the cache was
    enabled."""
    cache = find(layer.backend.chain, EvalCached)
    return layer.backend.hits + (0 if cache is None else cache.hits)


def release_rows(layer: AttendingLayer) -> list[str]:
    """Drop what ``layer``'s backend keeps derived from its rows (they changed): the
    evaluation cache's partials and the top-k mode's index (rebuilt at its next call);
    returns what it dropped, by name."""
    dropped = []
    cache = find(layer.backend.chain, EvalCached)
    if cache is not None and cache.slots:
        # a fresh cache: nothing of the old partials
        layer.backend.hits = layer.backend.hits + cache.hits
        layer.backend.chain = compose(layer.backend.chain, cache=EvalCached())
        dropped.append("evaluation cache")
    mode = retrieval_of(layer)
    if mode is not None and mode.rows_removed():
        dropped.append("top-k index")
    return dropped
