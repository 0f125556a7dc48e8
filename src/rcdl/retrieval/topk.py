"""Approximate retrieval: attention over each query's top-k entries, found by an index
(docs/retrieval.md).

Exact streaming attention (:mod:`rcdl.ops.attention`) reads every entry for every query:
``O(N d)`` per query. Where most of a query's kernel mass sits on a few entries, an index
of the keys can find them in sublinear time and the attention can run over those alone
(how far that holds for a given model is measured, not assumed: docs/retrieval.md).
With ``κ_j`` the kernel value of entry ``j`` and ``τ = T √d_in``:

- RBF, ``κ_j = exp(−‖q − k_j‖² / (2τ))``: ``κ`` decreases with the L2 distance, so the
  ``k`` nearest keys are exactly the ``k`` largest kernel values. The output
  ``Σ_{j∈K} w_j κ_j v_j`` is computed exactly over them.
- weighted softmax, ``κ_j = e^{z_j}``, ``z_j = ⟨q, k_j⟩ / τ``: the index returns
  ``c ≥ k`` candidates by inner product; they are rescored exactly by
  ``t_j = z_j + log |w_j|`` (the log of entry ``j``'s share ``|w_j| e^{z_j}`` of the
  softmax mass), the ``k`` best are kept, and the output is the weighted softmax over them,
  ``Σ_{j∈K} e^{z_j} ṽ_j / Σ_{j∈K} w_j e^{z_j}`` (denominator guarded as in
  :func:`rcdl.ops.kernels.guard_denominator`).

Both kernels share the rescoring step (for RBF ``t_j = log κ_j + log |w_j|``); with the
default ``c = k`` it keeps every candidate.

Pieces:

- :class:`~rcdl.retrieval.indices.RetrievalIndex`, the interface an index offers;
  :class:`~rcdl.retrieval.indices.ExactIndex` (torch, exact, chunked: the dense twin) and
  :class:`~rcdl.retrieval.indices.FaissIndex` (FAISS flat or HNSW), in
  :mod:`rcdl.retrieval.indices`.
- :func:`topk_attention`, the attention over the retrieved entries, with a per-query
  estimate of the mass it left out; :func:`recall_at_k` to measure an index.
- :class:`TopK`, a layer's retrieval mode (``layer.retrieval``), which keeps an index in
  step with the layer's store; :func:`use_topk` / :func:`use_exact` switch a whole model;
  :func:`retrieval_state` / :func:`load_retrieval_state` carry the indices in a checkpoint.

Example:
    >>> from rcdl.retrieval.topk import use_topk, use_exact
    >>> model = use_topk(model, 256, backend="faiss-hnsw")  # doctest: +SKIP
    >>> logits = model.eval()(x_test)                       # doctest: +SKIP
    >>> use_exact(model)                                    # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import math
import weakref
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.nn.backends import use_retrieval
from rcdl.nn.layers import GrowingLayer, growing_layers
from rcdl.nn.store import EntryStore
from rcdl.ops.entries import Entries
from rcdl.ops.kernels import Kernel, check_kernel, guard_denominator, softmax_scale
from rcdl.retrieval.indices import (
    Backend,
    ExactIndex,
    FaissIndex,
    RetrievalIndex,
    check_count,
    make_index,
    metric_for,
)

__all__ = [
    "TopK", "TopKOutput", "load_retrieval_state", "recall_at_k", "retrieval_state",
    "topk_attention", "use_exact", "use_topk",
]  # fmt: skip

# elements of the gathered (b, c, d) blocks per block of queries: 2^22, 16 MB in float32
_BLOCK_ELEMENTS = 1 << 22
# index settings that only steer a search: they may differ between a save and its resume
_SEARCH_SETTINGS = ("ef_search", "chunk_size")


# --------------------------------------------------------------------------- attention


class TopKOutput(NamedTuple):
    """What :func:`topk_attention` returns."""

    out: Tensor  # (B, d_out) the attention over the kept entries
    left_out: Tensor  # (B,) estimated fraction of the kernel mass outside them (no grad)
    indices: Tensor  # (B, k) int64 the kept entries, by rescored value; −1: none found


def topk_attention(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out)
    weights: Tensor,  # (N,)
    *,
    kernel: str | Kernel,
    temperature: float = 1.0,
    index: RetrievalIndex,
    k: int,
    candidates: int | None = None,
    eps: float = 1e-6,
    stale_index: bool = False,
) -> TopKOutput:
    """Kernel attention from ``q`` over each query's top-k entries, retrieved by ``index``.

    ``index`` must hold the rows of ``keys``, in order, under :func:`metric_for`'s metric for
    ``kernel``; with ``stale_index=True`` it may hold older versions of them (a :class:`TopK`
    index between two refreshes): it then only chooses the candidates, which are always
    compared again with the ``keys`` given. With ``κ_j`` the kernel value (``e^{z_j}``,
    ``z_j = ⟨q, k_j⟩/τ``, for the softmax; ``exp(−‖q − k_j‖²/(2τ))`` for RBF) and
    ``τ = T √d_in``:

    1. the index returns ``c`` candidates ``S`` per query, the rows of largest ``κ`` if it
       is exact (``c = candidates``, default ``k``: no rescoring; docs/retrieval.md
       measures why a larger candidate set rescored down to ``k`` is not the default);
    2. each candidate is rescored by ``t_j = log κ_j + log |w_j|``, the log of its term in
       the kernel mass ``M = Σ_j |w_j| κ_j``. ``κ_j`` comes from the index's own scores
       when they are in ``q``'s dtype and no gradient is needed (the index compared the
       same vectors); otherwise (and always with ``stale_index``) the keys are gathered,
       cast to ``q``'s dtype and compared again. Entries of negative weight (a trained
       hybrid store) rank by magnitude and keep their sign below; zero weights rank last;
    3. the ``k`` best candidates ``K`` are kept, and the kernel's exact formula runs over them:
       RBF ``Σ_{j∈K} w_j κ_j v_j``; softmax ``Σ_{j∈K} e^{z_j} ṽ_j / Σ_{j∈K} w_j e^{z_j}``
       (guarded as :func:`rcdl.ops.kernels.guard_denominator`). With ``k ≥ N`` this is the exact
       attention, whatever the index. Gradients flow to ``q`` (and to ``keys``, ``values``,
       ``weights`` if they require grad) through the gathered rows; the choice of ``K`` is
       piecewise constant and has none.

    The left-out estimate, per query, is ``ρ̂ = Ê / (Σ_{j∈K} |w_j| κ_j + Ê)`` with
    ``Ê = Σ_{j∈S∖K} |w_j| κ_j + (N − c) · max_j |w_j| · min_{i∈S} κ_i``: the candidates
    dropped, exactly, plus a bound on the rows never retrieved. If the index is exact,
    every row outside ``S`` has ``κ_j ≤ min_S κ``, so ``Ê`` bounds the left-out mass and
    ``ρ̂`` is an **upper bound** on the true fraction ``Σ_{j∉K} |w_j| κ_j / M``. With an
    approximate index (HNSW) a missed row may exceed ``min_S κ``: ``ρ̂`` is then only an
    estimate, and may be low. ``ρ̂ = 0`` when everything is kept. ``M`` is the softmax
    denominator's mass: an entry of zero weight (gws writes ``w = 0`` for about half its
    samples) adds ``e^{z_j} ṽ_j`` to the numerator and is not counted in it.

    Raises:
        ValueError: for the linear kernel (collapse it with ``GrowingLinear.to_linear()``),
            ``k`` or ``candidates`` not an int ``≥ 1`` (or ``candidates < k``), or an index
            not holding the ``N`` keys.
    """
    kernel = check_kernel(kernel)
    metric = metric_for(kernel)
    check_count("topk_attention: k", k)
    if candidates is not None and check_count("topk_attention: candidates", candidates) < k:
        raise ValueError(f"topk_attention: candidates ({candidates}) must be >= k ({k})")
    if index.metric != metric:
        raise ValueError(f"topk_attention: the {kernel} kernel needs an index by {metric!r}, "
                         f"got one by {index.metric!r}")
    n = keys.shape[0]
    if len(index) != n:
        raise ValueError(f"topk_attention: the index holds {len(index)} rows, the store {n}: "
                         "keep it in step with the store (TopK does)")
    tau = softmax_scale(temperature, q.shape[1])
    if n == 0:  # an empty store answers 0, like the exact attention
        return TopKOutput(q.new_zeros(q.shape[0], values.shape[1]) + 0 * q.sum(),
                          q.new_zeros(q.shape[0]),
                          torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device))
    k = min(k, n)
    c = min(candidates or k, n)
    scores, found = index.search(q, c)  # (B, c) best first; row −1 where none was found
    scores, found = scores.to(q.device), found.to(keys.device)
    w_max = weights.detach().abs().max()  # () for the bound on rows never retrieved
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad)
    # else the index's scores serve: it compared these very vectors
    gather_keys = needs_grad or stale_index or scores.dtype != q.dtype
    per_query = c * (1 + 2 * keys.shape[1] * gather_keys)  # elements of the blocks formed
    if values.dtype != q.dtype:
        per_query += k * values.shape[1]  # a half-precision store's values are gathered
    rows = max(1, _BLOCK_ELEMENTS // per_query)
    parts = [
        _attend_candidates(q[i : i + rows], scores[i : i + rows], found[i : i + rows], keys,
                           values, weights, kernel=kernel, tau=tau, k=k, w_max=w_max, eps=eps,
                           gather_keys=gather_keys)
        for i in range(0, q.shape[0], rows)
    ]
    return TopKOutput(*(torch.cat(p) for p in zip(*parts, strict=True)))


def _log_kernel(kernel: Kernel, q: Tensor, scores: Tensor, rows: Tensor, keys: Tensor,
                tau: float, gather_keys: bool) -> Tensor:  # (b, c)
    """``log κ`` of the candidates ``rows (b, c)``: ``z = ⟨q, k⟩/τ`` (softmax) or
    ``−‖q − k‖²/(2τ)`` (RBF).

    Unless ``gather_keys``, from the index's ``scores (b, c)`` (inner products or squared
    distances of the same vectors, in ``q``'s dtype). Otherwise (a gradient is needed, or
    the index compared in another dtype) the keys are gathered, cast to ``q``'s dtype and
    compared again: ``‖q − k‖² = ‖q‖² − 2⟨q, k⟩ + ‖k‖²`` as in :mod:`rcdl.ops.attention`.
    """
    if not gather_keys:
        return kernel.log_kernel(scores, tau)
    k_c = keys[rows].to(q.dtype)  # (b, c, d)
    dots = torch.bmm(k_c, q[:, :, None])[:, :, 0]  # (b, c) ⟨q, k_j⟩
    if kernel.index_metric == "ip":
        return kernel.log_kernel(dots, tau)
    sq_dist = (q * q).sum(1, keepdim=True) - 2 * dots + (k_c * k_c).sum(2)  # (b, c)
    return kernel.log_kernel(sq_dist, tau)


def _attend_candidates(
    q: Tensor,  # (b, d_in)
    scores: Tensor,  # (b, c) the index's scores of the candidates
    found: Tensor,  # (b, c) int64 candidate rows, −1 for none
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out)
    weights: Tensor,  # (N,)
    *,
    kernel: Kernel,
    tau: float,
    k: int,
    w_max: Tensor,
    eps: float,
    gather_keys: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # out (b, d_out), left_out (b,), kept rows (b, k)
    """Rescore one block of queries' candidates, keep the best ``k`` and attend over them."""
    n = keys.shape[0]
    valid = found >= 0  # (b, c)
    rows = found.clamp_min(0)
    log_kappa = _log_kernel(kernel, q, scores, rows, keys, tau, gather_keys)
    log_kappa = log_kappa.masked_fill(~valid, -math.inf)  # (b, c)
    w = weights[rows].masked_fill(~valid, 0.0)  # (b, c)
    with torch.no_grad():
        score = log_kappa + w.abs().log()  # (b, c) t_j = log(|w_j| κ_j), −inf for w_j = 0
        pos = score.topk(k, dim=1).indices  # (b, k) the kept candidates, best first
        left_out = _left_out(score, log_kappa, valid, pos, n, w_max)  # (b,)
    kept = found.gather(1, pos)  # (b, k)
    log_kappa_k, w_k = log_kappa.gather(1, pos), w.gather(1, pos)  # (b, k)
    if not kernel.normalised:
        out = _sum_rows(w_k * log_kappa_k.exp(), kept.clamp_min(0), values)  # Σ w_j κ_j v_j
        return out, left_out, kept
    m = log_kappa_k.detach().amax(1, keepdim=True)  # (b, 1) shift; −inf only if none found
    e = (log_kappa_k - torch.where(m.isfinite(), m, 0.0)).exp()  # (b, k) e^{z_j − m}
    num = _sum_rows(e, kept.clamp_min(0), values)  # (b, d_out) Σ e^{z_j − m} ṽ_j
    den = guard_denominator((e * w_k).sum(1), (e * w_k.abs()).sum(1), eps)  # (b,)
    return num / den[:, None], left_out, kept


def _sum_rows(coef: Tensor, rows: Tensor, table: Tensor) -> Tensor:  # (b, d)
    """``Σ_j coef[b, j] · table[rows[b, j]]`` for coefficients ``coef (b, k)`` and row numbers
    ``rows (b, k)``. ``F.embedding_bag`` reads each row once, without the ``(b, k, d)`` copy
    that a gather and a batched product would write and read again (docs/retrieval.md
    compares the two); a half-precision table is gathered and cast instead."""
    if table.dtype == coef.dtype:
        return F.embedding_bag(rows, table, per_sample_weights=coef, mode="sum")
    return torch.bmm(coef[:, None, :], table[rows].to(coef.dtype))[:, 0]


def _left_out(score: Tensor, log_kappa: Tensor, valid: Tensor, pos: Tensor, n: int,
              w_max: Tensor) -> Tensor:  # (b,)
    """``ρ̂ = Ê / (Σ_K |w| κ + Ê)`` of :func:`topk_attention`, in log space: every term is
    taken relative to ``max_S κ · max |w|``, which bounds them all."""
    if not w_max > 0:  # no weight mass anywhere: nothing to leave out
        return score.new_zeros(score.shape[0])
    found = valid.any(1)  # (b,) a query whose search found nothing left everything out
    max_kappa = log_kappa.amax(1).masked_fill(~found, 0.0)  # (b,)
    terms = (score - (max_kappa + w_max.log())[:, None]).exp()  # (b, c) |w_j| κ_j, scaled
    kept = torch.zeros_like(valid).scatter_(1, pos, True)  # (b, c) the kept candidates
    kept_mass = terms.masked_fill(~kept, 0.0).sum(1)  # (b,)
    dropped = terms.masked_fill(kept, 0.0).sum(1)  # (b,) candidates rescored out
    unseen = n - valid.sum(1)  # (b,) rows the index never returned
    min_kappa = log_kappa.masked_fill(~valid, math.inf).amin(1).masked_fill(~found, 0.0)
    bound = unseen * (min_kappa - max_kappa).exp()  # (b,) (N − c) max|w| min_S κ, scaled
    left = dropped + bound
    total = kept_mass + left
    return torch.where(found, torch.where(total > 0, left / total, 0.0), 1.0)


def recall_at_k(approx: Tensor, exact: Tensor) -> float:
    """Mean over queries of ``|A ∩ E| / |E|``, where ``A`` and ``E`` are a query's rows in
    ``approx (B, k)`` and ``exact (B, k')`` (int64; −1 entries are ignored): the fraction of
    the true top rows that the approximate search found."""
    if approx.dim() != 2 or exact.dim() != 2 or approx.shape[0] != exact.shape[0]:
        raise ValueError(f"recall_at_k: expected (B, k) and (B, k') row indices, got "
                         f"{tuple(approx.shape)} and {tuple(exact.shape)}")
    truth = exact.sort(1).values  # (B, k') sorted for searchsorted
    pos = torch.searchsorted(truth, approx.contiguous()).clamp_max_(truth.shape[1] - 1)
    hit = (truth.gather(1, pos) == approx) & (approx >= 0)  # (B, k)
    relevant = (exact >= 0).sum(1).clamp_min(1)  # (B,)
    return float((hit.sum(1) / relevant).mean())


# --------------------------------------------------------------------------- the layer mode


class TopK:
    """A growing layer's top-k retrieval mode: set as ``layer.retrieval`` (by
    :func:`use_topk`), it answers :meth:`rcdl.nn.layers.GrowingLayer.attend` (and the hybrid's
    training forward, :meth:`rcdl.nn.hybrid.HybridSoftmax.attend`) by :func:`topk_attention`
    over an index that follows the layer's store (docs/retrieval.md).

    How the index follows the store: at each call the rows appended since the last call (a
    growth step's batch) are added to it (:meth:`RetrievalIndex.add`); it is rebuilt from the
    whole store when the store is another one, lost rows, or changed otherwise
    (``store.version``: removals by a memory budget, a loaded state dict, a storage dtype
    change). An optimizer that moves the stored rows in place (the hybrid's Adam, every step)
    says so to the store (:meth:`rcdl.nn.store.EntryStore.moved`, counted in ``store.moves``);
    the index follows the ``R``-th such move
    (``refresh_every``) by a rebuild at the next call and keeps its keys between: it then
    searches keys up to ``R − 1`` moves old. The rows it finds are rescored and attended over
    with their current keys, values and weights, so staleness changes which rows are
    chosen, never the attention over them. ``R = 1`` (default) rebuilds after every move.

    Saving: :meth:`state_dict` / :meth:`load_state_dict` (for a model, :func:`retrieval_state`
    / :func:`load_retrieval_state`) carry the index itself, so a resumed run goes on with the
    same index: for HNSW the graph exactly as it was grown step by step, where a rebuild in
    one pass gives another graph. A loaded index is adopted at the next call only if the
    layer's store is then the one it was saved with (same row count, same SHA-256 of the
    keys); otherwise it is rebuilt from the store (counted in ``rebuilds``). A
    ``copy.deepcopy`` or pickle of the model drops the index and rebuilds it likewise.

    Args:
        k: entries each query attends to.
        backend: ``"faiss-hnsw"``, ``"faiss-flat"`` or ``"exact"`` (:func:`make_index`).
        candidates: rows retrieved and rescored down to ``k`` (default ``k``).
        train: also in training mode with grad enabled (each query then attends to its
            top-k entries only, and the output recorded for the rule is that one). By
            default the mode applies only in eval mode or under ``torch.no_grad()``.
        refresh_every: ``R``, the in-place moves of the stored rows after which the index is
            rebuilt (see above).
        index_kw: passed to the index (``hnsw_m``, ``ef_search``, ...).

    Statistics: ``calls``, ``rebuilds``, ``rows_added`` (rows added without a rebuild),
    ``restores`` (saved indices adopted), ``left_out`` (mean of the last call's left-out
    estimate), and :meth:`stats`.
    """

    def __init__(self, k: int, *, backend: Backend = "faiss-hnsw",
                 candidates: int | None = None, train: bool = False, refresh_every: int = 1,
                 **index_kw: Any) -> None:
        self.k = check_count("TopK: k", k)
        if candidates is not None and check_count("TopK: candidates", candidates) < k:
            raise ValueError(f"TopK: candidates ({candidates}) must be >= k ({k})")
        self.refresh_every = check_count("TopK: refresh_every", refresh_every)
        make_index(backend, "l2", **index_kw)  # fail now on bad settings, not at a forward
        self.backend, self.candidates, self.train = backend, candidates, train
        self.index_kw = index_kw
        self.calls = self.rebuilds = self.rows_added = self.restores = 0
        self._last_left_out: Tensor | None = None
        self._saved: dict[str, Any] | None = None  # a loaded state, adopted at the next call
        self._rebuild_due = False  # rows_removed dropped an index the next call rebuilds
        self._forget_index()

    def _forget_index(self) -> None:
        self.index: ExactIndex | FaissIndex | None = None  # made by make_index
        self._store: weakref.ref[EntryStore] | None = None  # the store indexed
        self._layout = -1  # its version less its moves when indexed: changed -> rebuild
        self._moves_seen = 0  # its moves at the last call
        self._rows = 0  # its rows indexed
        self._stale = 0  # in-place moves of its rows the index had not followed then

    def rows_removed(self) -> bool:
        """The layer removed rows: drop the index and a loaded state not yet adopted (both
        may hold the removed keys); the next call rebuilds from the store, and
        :meth:`state_dict` until then saves no index. Returns whether there was either."""
        held = self.index is not None or self._saved is not None
        self._saved = None
        # counted when the next call rebuilds (a second call before then changes nothing)
        self._rebuild_due = self._rebuild_due or self.index is not None
        self._forget_index()
        return held

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles rebuild the index
        state = self.__dict__.copy()
        state.update(index=None, _store=None, _layout=-1, _moves_seen=0, _rows=0, _stale=0)
        return state

    def applies(self, layer: GrowingLayer) -> bool:
        """Whether this call of ``layer`` uses top-k: in eval mode or without grad, and in
        training too if ``train``."""
        return self.train or not (layer.training and torch.is_grad_enabled())

    def _kept_staleness(self, store: EntryStore) -> int | None:
        """The moves the index would lag behind ``store`` by if kept at the next call, or
        ``None`` if that call must rebuild it: another store, rows lost, a change other than
        appends and in-place moves (:meth:`rcdl.nn.store.EntryStore.moved`), or
        ``refresh_every`` moves not followed."""
        if self.index is None or self._store is None or self._store() is not store:
            return None
        stale = self._stale + self._moves_since(store)
        if (self._rows > len(store) or store.version - store.moves != self._layout
                or stale >= self.refresh_every):
            return None
        return stale

    def sync(self, layer: GrowingLayer) -> RetrievalIndex:
        """Bring the index up to ``layer``'s store: adopt a loaded index, add new rows, or
        rebuild (see the class docstring)."""
        store = layer.store
        if self._saved is not None:
            self._restore(layer, self._saved)
        stale = self._kept_staleness(store)  # None without an index
        rebuild, index = stale is None, self.index
        if stale is None or index is None:  # rebuild
            if index is not None or self._rebuild_due:
                self.rebuilds += 1
                self._rebuild_due = False
            index = make_index(self.backend, metric_for(layer.kernel), **self.index_kw)
            self.index = index
            self._store, self._rows, stale = weakref.ref(store), 0, 0
        self._layout, self._moves_seen = store.version - store.moves, store.moves
        self._stale = stale
        if len(store) > self._rows:
            index.add(store.keys[self._rows :])
            if not rebuild:
                self.rows_added += len(store) - self._rows
            self._rows = len(store)
        return index

    def attend(self, layer: GrowingLayer, q: Tensor, entries: Entries | None = None) -> Tensor:
        """``layer``'s attention from ``q (B, key_dim)`` over each query's top-k entries:
        ``(B, d_out)``. ``entries`` (an :class:`~rcdl.ops.entries.Entries`) are what is attended
        over, rows of the store (default: ``layer.entries()``, the store's rows with their
        entry weights; the hybrid passes its trainable leaves, which then get gradients
        through the gathered rows only)."""
        if layer.kernel.index_metric is None:
            raise ValueError(f"{layer.where}: top-k retrieval does not apply to the "
                             f"{layer.kernel} kernel; collapse the layer exactly with "
                             "GrowingLinear.to_linear()")
        if layer.shard is not None:
            raise ValueError(f"{layer.where}: its store is sharded over ranks; top-k retrieval "
                             "needs the whole store in one process")
        index = self.sync(layer)
        entries = layer.entries() if entries is None else entries
        result = topk_attention(q, entries.keys, entries.values, entries.weights,
                                kernel=entries.kernel, temperature=entries.temperature,
                                index=index, k=self.k, candidates=self.candidates,
                                eps=entries.eps, stale_index=self._stale > 0)
        self.calls += 1
        self._last_left_out = result.left_out.mean()  # kept as a tensor: no device sync
        return result.out

    # ---------------------------------------------------------------- checkpoints
    def _build_settings(self) -> dict[str, Any]:
        """The index settings that shape what it holds (not those of a search only)."""
        return {k: v for k, v in self.index_kw.items() if k not in _SEARCH_SETTINGS}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume this mode's index: the backend and build
        settings, and, if the next call would keep the index, the index
        (:meth:`FaissIndex.state_dict`: FAISS's serialisation as a uint8 tensor;
        :meth:`ExactIndex.state_dict`: its rows), its metric, the rows it covers, the moves
        it lags by, and the row count and SHA-256 of the keys of the store it was saved with.
        Costs one serialisation of the index and one pass over the keys."""
        if self._saved is not None:  # loaded and not used yet: still the state to resume
            return self._saved
        state: dict[str, Any] = {"backend": self.backend, "build": self._build_settings(),
                                 "index": None}
        store = None if self._store is None else self._store()
        stale = None if store is None else self._kept_staleness(store)
        if stale is None or store is None or self.index is None:  # nothing indexed, or
            return state  # the next call rebuilds anyway
        return state | {"index": self.index.state_dict(), "metric": self.index.metric,
                        "rows": self._rows, "stale": stale, "store_rows": len(store),
                        "store_keys_sha256": _keys_digest(store.keys)}

    def _check_state(self, state: dict[str, Any], where: str = "TopK") -> None:
        """Raise ``ValueError`` (prefixed by ``where``) unless ``state`` is a
        :meth:`state_dict` of this backend with the same build settings."""
        if state["backend"] != self.backend or state["build"] != self._build_settings():
            raise ValueError(
                f"{where}: the saved index is {state['backend']!r} with {state['build']}, this "
                f"mode is {self.backend!r} with {self._build_settings()}: use_topk with the "
                "saved run's backend and index settings (ef_search may differ)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a :meth:`state_dict`: the current index is dropped, and the saved one
        is adopted at the next call if the layer's store is then the one it was saved with
        (load the model's state saved with it, before or after this); otherwise the index
        is rebuilt from the store. Raises ``ValueError`` (nothing changed) if the state is
        of another backend or build settings."""
        self._check_state(state)
        self._forget_index()
        self._saved = None if state["index"] is None else state

    def _restore(self, layer: GrowingLayer, saved: dict[str, Any]) -> None:
        """Adopt the loaded index ``saved`` if ``layer``'s store is the one it was saved
        with."""
        self._saved = None
        store = layer.store
        if (saved["store_rows"] != len(store) or saved["metric"] != metric_for(layer.kernel)
                or saved["store_keys_sha256"] != _keys_digest(store.keys)):
            self.rebuilds += 1  # the store moved on since the save: sync rebuilds from it
            return
        index = make_index(self.backend, saved["metric"], **self.index_kw)
        index.load_state_dict(saved["index"], device=store.device)
        self.index, self._store = index, weakref.ref(store)
        self._layout, self._moves_seen = store.version - store.moves, store.moves
        self._rows, self._stale = saved["rows"], saved["stale"]
        self.restores += 1

    def _moves_since(self, store: EntryStore | None) -> int:
        """In-place moves of the indexed ``store`` since the last call (0 without one)."""
        return 0 if store is None else store.moves - self._moves_seen

    # ---------------------------------------------------------------- reporting
    @property
    def left_out(self) -> float | None:
        """Mean left-out estimate of the last call (``None`` before the first)."""
        return None if self._last_left_out is None else float(self._last_left_out)

    def stats(self) -> dict[str, Any]:
        return {"k": self.k, "backend": self.backend, "candidates": self.candidates,
                "refresh_every": self.refresh_every, "calls": self.calls,
                "rebuilds": self.rebuilds, "rows_added": self.rows_added,
                "restores": self.restores, "rows_indexed": self._rows,
                "stale_moves": self._stale + self._moves_since(
                    None if self._store is None else self._store()),
                "index_bytes": 0 if self.index is None else self.index.nbytes,
                "left_out": self.left_out}

    def __repr__(self) -> str:
        return (f"TopK(k={self.k}, backend={self.backend!r}, candidates={self.candidates}, "
                f"train={self.train}, refresh_every={self.refresh_every})")


def _keys_digest(keys: Tensor) -> str:
    """SHA-256 of ``keys (N, d)``: their shape, dtype and bytes (which store an index was
    saved with)."""
    data = keys.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{tuple(data.shape)} {data.dtype}".encode())
    digest.update(data.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def use_topk(model: nn.Module, k: int, *, backend: Backend = "faiss-hnsw",
             candidates: int | None = None, train: bool = False, refresh_every: int = 1,
             **index_kw: Any) -> nn.Module:
    """Give every growing RBF and softmax layer of ``model`` its own :class:`TopK` mode
    (``layer.retrieval``); returns ``model``. Linear-kernel layers are left exact (collapse
    them with ``GrowingLinear.to_linear()``). Arguments as :class:`TopK`.

    Raises:
        ValueError: if ``model`` has no growing RBF or softmax layer, or one of them is
            sharded over ranks (nothing is changed then).
    """
    chosen = []
    for name, layer in growing_layers(model):
        if layer.kernel.index_metric is None:  # the linear kernel: no top-k
            continue
        if layer.shard is not None:
            raise ValueError(f"use_topk: {type(layer).__name__} {name!r} is sharded over ranks "
                             "(rcdl.distributed); top-k retrieval needs the whole store in one "
                             "process")
        chosen.append(layer)
    if not chosen:
        raise ValueError(f"use_topk: {type(model).__name__} has no growing RBF or softmax "
                         "layer to retrieve from (linear layers collapse exactly: "
                         "GrowingLinear.to_linear())")
    modes = [TopK(k, backend=backend, candidates=candidates, train=train,
                  refresh_every=refresh_every, **index_kw)
             for _ in chosen]  # validated before any layer changes
    for layer, mode in zip(chosen, modes, strict=True):
        use_retrieval(layer, mode)
    return model


def use_exact(model: nn.Module) -> nn.Module:
    """Turn top-k retrieval off in every growing layer of ``model`` (exact streaming
    attention again, indices freed); returns ``model``."""
    for _, layer in growing_layers(model):
        use_retrieval(layer, None)
    return model


def retrieval_state(model: nn.Module) -> dict[str, dict[str, Any]] | None:
    """The :meth:`TopK.state_dict` of each growing layer of ``model`` in top-k mode, by
    module path; ``None`` if there is none (a model without top-k adds nothing to a
    checkpoint). Save it beside ``model.state_dict()``, which it does not change."""
    state = {name: layer.retrieval.state_dict() for name, layer in growing_layers(model)
             if isinstance(layer.retrieval, TopK)}
    return state or None


def load_retrieval_state(model: nn.Module, state: dict[str, dict[str, Any]] | None) -> None:
    """Give ``model``'s top-k modes the indices of a :func:`retrieval_state`
    (:meth:`TopK.load_state_dict`: each is adopted at its layer's next call if the store is
    then the one saved with it, else rebuilt). Call :func:`use_topk` first, with the saved
    run's backend and index settings. ``None`` changes nothing.

    Raises:
        ValueError: naming the layer, if a layer of ``state`` is not in ``model`` or not in
            top-k mode, or its mode has another backend or build settings; nothing is
            changed then.
    """
    if not state:
        return
    layers = dict(growing_layers(model))
    checked: list[tuple[TopK, dict[str, Any]]] = []
    for name, saved in state.items():
        mode = getattr(layers.get(name), "retrieval", None)
        where = f"load_retrieval_state: layer {name!r}"
        if not isinstance(mode, TopK):
            found = "is not in" if name not in layers else "has no top-k mode in"
            raise ValueError(f"{where} of the saved state {found} {type(model).__name__}: "
                             "call use_topk(model, ...) as the saved run did before loading")
        mode._check_state(saved, where)
        checked.append((mode, saved))
    for mode, saved in checked:
        mode.load_state_dict(saved)
