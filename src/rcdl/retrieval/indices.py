"""Indices of a store's keys for top-k retrieval (docs/retrieval.md): the
:class:`RetrievalIndex` interface, :class:`ExactIndex` (torch, exact, chunked: the dense
twin) and :class:`FaissIndex` (FAISS flat or HNSW), made by :func:`make_index`; and which
metric serves a kernel (:func:`metric_for`). The attention over what an index finds, and a
layer's retrieval mode, are :mod:`rcdl.retrieval.topk`."""

from __future__ import annotations

from typing import Any, Literal, Protocol, cast, get_args, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from rcdl.ops.kernels import Kernel, check_kernel

__all__ = [
    "BACKENDS", "Backend", "ExactIndex", "FaissIndex", "Metric", "RetrievalIndex",
    "check_count", "make_index", "metric_for",
]  # fmt: skip

# elements of a block of query-key scores in an exact search: 2^22, 16 MB in float32
_BLOCK_ELEMENTS = 1 << 22

Metric = Literal["l2", "ip"]
Backend = Literal["faiss-hnsw", "faiss-flat", "exact"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
_METRICS: tuple[Metric, ...] = get_args(Metric)



def _check_metric(metric: str) -> Metric:
    if metric not in _METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: 'l2' (squared L2 distance, "
                         "smallest first) and 'ip' (inner product, largest first)")
    return metric


def check_count(what: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    return value


def _check_search(q: Tensor, k: int, size: int, dim: int | None) -> None:
    check_count("search: k", k)
    if q.dim() != 2 or (dim is not None and q.shape[1] != dim):
        raise ValueError(f"search: expected queries (B, {dim}), got {tuple(q.shape)}")
    if k > size:
        raise ValueError(f"search: k = {k} is more than the {size} keys the index holds")


def metric_for(kernel: str | Kernel) -> Metric:
    """The index metric whose nearest keys carry a kernel's largest values
    (:attr:`rcdl.ops.kernels.Kernel.index_metric`): ``"l2"`` for RBF and Laplacian, ``"ip"`` for
    the softmax. The linear kernel has none (see :func:`topk_attention`)."""
    metric = check_kernel(kernel).index_metric
    if metric is None:
        raise ValueError(
            f"top-k retrieval does not apply to the {kernel} kernel: its terms ⟨q, k_j⟩ have no "
            "largest few (both signs, no decay). The linear dual form collapses exactly to an "
            "nn.Linear instead: GrowingLinear.to_linear()")
    return cast(Metric, metric)


# --------------------------------------------------------------------------- indices


@runtime_checkable
class RetrievalIndex(Protocol):
    """What an index of a store's keys offers.

    Rows are numbered in the order they were added, from 0: the store's row numbers when
    the index follows a store (:class:`TopK`).
    """

    metric: Metric

    def add(self, keys: Tensor) -> None:
        """Index ``keys (n, d)`` as the next ``n`` rows."""
        ...

    def search(self, q: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The ``k`` best rows for each query ``q (B, d)``: ``(scores (B, k), indices (B, k)
        int64)``, best first, on ``q``'s device. Scores are squared L2 distances (``"l2"``)
        or inner products (``"ip"``); an index that finds fewer than ``k`` rows pads the
        indices with −1. ``k`` must not exceed ``len(self)``."""
        ...

    def reset(self) -> None:
        """Forget every row."""
        ...

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """Bytes the index holds (its copy of the keys and any graph)."""
        ...


class ExactIndex:
    """Exact top-k search in torch, streamed over chunks of the rows: the dense twin of
    :class:`FaissIndex`.

    Scores of query ``q`` and row ``k_j``: ``‖q − k_j‖² = ‖q‖² − 2⟨q, k_j⟩ + ‖k_j‖²`` (``"l2"``,
    smallest first) or ``⟨q, k_j⟩`` (``"ip"``, largest first). Each chunk's ``(B, chunk)``
    block is merged into a running top-k, so memory is one block whatever the rows.
    The rows are kept as a copy in ``dtype`` on the device of the first keys added;
    queries are moved and cast to it.

    Args:
        metric: ``"l2"`` or ``"ip"``.
        dtype: what the rows are kept and compared in (float32 like FAISS; float64 for
            tests that need exact ties).
        chunk_size: rows per block (default: ``2^22 / B``, at least 1024).
    """

    def __init__(self, metric: Metric = "l2", *, dtype: torch.dtype = torch.float32,
                 chunk_size: int | None = None) -> None:
        self.metric = _check_metric(metric)
        self.dtype, self.chunk_size = dtype, chunk_size
        self.reset()

    def reset(self) -> None:
        self._rows: Tensor | None = None  # (capacity, d), the first `size` live
        self.size = 0

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return 0 if self._rows is None else self.size * self._rows[0].nbytes

    def add(self, keys: Tensor) -> None:
        if keys.dim() != 2 or (self._rows is not None and keys.shape[1] != self._rows.shape[1]):
            want = "(n, d)" if self._rows is None else f"(n, {self._rows.shape[1]})"
            raise ValueError(f"ExactIndex.add: expected keys {want}, got {tuple(keys.shape)}")
        if self._rows is None:
            self._rows = keys.new_empty((0, keys.shape[1]), dtype=self.dtype)
        n, end = keys.shape[0], self.size + keys.shape[0]
        if end > self._rows.shape[0]:  # grow geometrically: appends are amortised O(n)
            grown = self._rows.new_empty((max(end, 2 * self._rows.shape[0]), keys.shape[1]))
            grown[: self.size] = self._rows[: self.size]
            self._rows = grown
        self._rows[self.size : end] = keys.detach()
        self.size += n

    def state_dict(self) -> dict[str, Tensor | None]:
        """The rows held, ``{"rows": (n, d)}`` (a copy; ``None`` before the first add)."""
        return {"rows": None if self._rows is None else self._rows[: self.size].clone()}

    def load_state_dict(self, state: dict[str, Tensor | None],
                        device: torch.device | str | None = None) -> None:
        """Replace the rows by those of a :meth:`state_dict`, kept on ``device`` (default:
        where they are)."""
        self.reset()
        rows = state["rows"]
        if rows is not None:
            self.add(rows.to(device or rows.device))

    @torch.no_grad()
    def search(self, q: Tensor, k: int) -> tuple[Tensor, Tensor]:
        dim = None if self._rows is None else self._rows.shape[1]
        _check_search(q, k, self.size, dim)
        assert self._rows is not None  # k >= 1 rows are held: _check_search passed
        rows = self._rows[: self.size]
        q_rows = q.detach().to(rows.device, self.dtype)  # (B, d)
        largest = self.metric == "ip"
        chunk = self.chunk_size or max(1024, _BLOCK_ELEMENTS // q.shape[0])
        best = q_rows.new_empty(q.shape[0], 0)  # (B, ≤k) running best scores
        best_idx = torch.empty(q.shape[0], 0, dtype=torch.long, device=rows.device)
        q_sqnorm = (q_rows * q_rows).sum(1, keepdim=True)  # (B, 1)
        for start in range(0, self.size, chunk):
            k_c = rows[start : start + chunk]  # (c, d)
            scores = q_rows @ k_c.T  # (B, c)
            if not largest:
                scores = (q_sqnorm - 2 * scores + (k_c * k_c).sum(1)).clamp_min_(0.0)
            idx = torch.arange(start, start + k_c.shape[0], device=rows.device)  # (c,)
            best = torch.cat([best, scores], 1)  # (B, ≤k + c)
            best_idx = torch.cat([best_idx, idx.expand(q.shape[0], -1)], 1)
            best, pos = best.topk(min(k, best.shape[1]), dim=1, largest=largest)  # (B, ≤k)
            best_idx = best_idx.gather(1, pos)
        return best.to(q.device), best_idx.to(q.device)


def _import_faiss():  # noqa: ANN202 - the faiss module
    try:
        import faiss
    except ImportError as err:
        raise ImportError(
            "the FAISS retrieval backends need the faiss package: pip install 'rcdl[faiss]' "
            "(faiss-cpu); or use backend='exact'") from err
    return faiss


class FaissIndex:
    """A FAISS index of the keys: flat (exact, brute force in FAISS's BLAS) or HNSW
    (a navigable small-world graph: approximate, ``O(log N)``-ish per query).

    ``"l2"`` uses ``IndexFlatL2`` / ``IndexHNSWFlat``, ``"ip"`` ``IndexFlatIP`` /
    ``IndexHNSWFlat`` with ``METRIC_INNER_PRODUCT``. Keys and queries are cast to float32
    and copied to the CPU (faiss-cpu); results come back on the queries' device. Both kinds
    grow by :meth:`add` without training (an IVF index would need training on a frozen
    store, and is not offered).

    Args:
        metric: ``"l2"`` or ``"ip"``.
        kind: ``"flat"`` or ``"hnsw"``.
        hnsw_m: graph degree ``M`` (memory ``≈ 2 M · 4`` bytes per row beyond the keys).
        ef_search: candidate list length of an HNSW search (raised to ``k`` when smaller):
            larger is slower and recalls more.
        ef_construction: candidate list length while inserting rows.
    """

    def __init__(self, metric: Metric = "l2", *, kind: Literal["flat", "hnsw"] = "hnsw",
                 hnsw_m: int = 32, ef_search: int = 128, ef_construction: int = 40) -> None:
        self._faiss = _import_faiss()
        self.metric = _check_metric(metric)
        if kind not in ("flat", "hnsw"):
            raise ValueError(f"FaissIndex: unknown kind {kind!r}; known: 'flat', 'hnsw'")
        self.kind = kind
        self.hnsw_m = check_count("FaissIndex: hnsw_m", hnsw_m)
        self.ef_search = check_count("FaissIndex: ef_search", ef_search)
        self.ef_construction = check_count("FaissIndex: ef_construction", ef_construction)
        self.reset()

    def reset(self) -> None:
        self._index: Any = None  # a faiss.Index, made at the first add (the width known)

    def _new_index(self, dim: int):  # noqa: ANN202 - a faiss.Index
        faiss = self._faiss
        if self.kind == "flat":
            return faiss.IndexFlatL2(dim) if self.metric == "l2" else faiss.IndexFlatIP(dim)
        metric = faiss.METRIC_L2 if self.metric == "l2" else faiss.METRIC_INNER_PRODUCT
        index = faiss.IndexHNSWFlat(dim, self.hnsw_m, metric)
        index.hnsw.efConstruction = self.ef_construction
        return index

    def __len__(self) -> int:
        return 0 if self._index is None else int(self._index.ntotal)

    @property
    def nbytes(self) -> int:
        if self._index is None:
            return 0
        total = len(self) * self._index.d * 4  # the float32 copy of the keys
        if self.kind == "hnsw":  # graph links (int32), per-row offsets (size_t) and levels
            hnsw = self._index.hnsw
            total += hnsw.neighbors.size() * 4 + hnsw.offsets.size() * 8 + hnsw.levels.size() * 4
        return total

    def add(self, keys: Tensor) -> None:
        if keys.dim() != 2 or (self._index is not None and keys.shape[1] != self._index.d):
            want = "(n, d)" if self._index is None else f"(n, {self._index.d})"
            raise ValueError(f"FaissIndex.add: expected keys {want}, got {tuple(keys.shape)}")
        if self._index is None:
            self._index = self._new_index(keys.shape[1])
        if keys.shape[0]:
            self._index.add(_as_float32_numpy(keys))

    def state_dict(self) -> dict[str, Tensor | None]:
        """The index as FAISS serialises it (the float32 keys and, for HNSW, the graph
        exactly as grown), ``{"faiss": (bytes,) uint8}``; ``None`` before the first add."""
        if self._index is None:
            return {"faiss": None}
        return {"faiss": torch.from_numpy(self._faiss.serialize_index(self._index))}

    def load_state_dict(self, state: dict[str, Tensor | None],
                        device: torch.device | str | None = None) -> None:
        """Replace the index by that of a :meth:`state_dict` (``faiss.deserialize_index``:
        the same graph, no rebuild). ``device`` is ignored: faiss-cpu keeps it on the CPU.

        FAISS draws each inserted row's HNSW level from the graph's own generator, seeded at
        construction and not serialised, one draw per row: the loaded graph draws once per
        row it holds (about 1 µs each), so that rows added later get the levels, and hence
        the links, they would have had in the saved index (tested).

        Raises:
            ValueError: if the saved index is not this ``kind`` by this ``metric``.
        """
        data = state["faiss"]
        if data is None:
            self.reset()
            return
        index = self._faiss.deserialize_index(np.ascontiguousarray(data.cpu().numpy()))
        expected = self._new_index(index.d)
        if type(index) is not type(expected) or index.metric_type != expected.metric_type:
            raise ValueError(f"FaissIndex.load_state_dict: the saved index is a "
                             f"{type(index).__name__} (metric {index.metric_type}), this is a "
                             f"{self.kind!r} index by {self.metric!r}")
        if self.kind == "hnsw":
            levels = index.hnsw.rng
            for _ in range(index.ntotal):
                levels.rand_int()
        self._index = index

    @torch.no_grad()
    def search(self, q: Tensor, k: int) -> tuple[Tensor, Tensor]:
        _check_search(q, k, len(self), None if self._index is None else self._index.d)
        if self.kind == "hnsw":
            self._index.hnsw.efSearch = max(self.ef_search, k)
        scores, indices = self._index.search(_as_float32_numpy(q), k)  # (B, k) each
        return (torch.from_numpy(scores).to(q.device),
                torch.from_numpy(indices).to(device=q.device, dtype=torch.long))


def _as_float32_numpy(x: Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())


def make_index(backend: Backend, metric: Metric, **index_kw: Any) -> ExactIndex | FaissIndex:
    """A fresh index: ``"exact"`` (:class:`ExactIndex`), ``"faiss-flat"`` or
    ``"faiss-hnsw"`` (:class:`FaissIndex`); ``index_kw`` go to its constructor."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown retrieval backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "exact":
        return ExactIndex(metric, **index_kw)
    return FaissIndex(metric, kind="flat" if backend == "faiss-flat" else "hnsw", **index_kw)
