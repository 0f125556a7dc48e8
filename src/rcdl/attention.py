"""Streaming kernel attention over an entry store (docs/reference.md §2).

The store is visited chunk by chunk along N; each chunk contributes a ``(B, chunk)`` block
of scores and is folded into a running *partial result* ``(m, num, den)``:

- ``m (B,)``        the largest logit seen so far (softmax; 0 for linear and RBF),
- ``num (B, d_out)`` ``Σ_j e^{z_j − m} ṽ_j`` (softmax) or ``Σ_j w_j κ(q, k_j) v_j``,
- ``den (B,)``      ``Σ_j w_j e^{z_j − m}`` (softmax only),
- ``mass (B,)``     ``Σ_j |w_j| e^{z_j − m}`` (softmax only): the scale of the denominator's
  guard (:func:`rcdl.kernels.guard_denominator`).

Two partials over disjoint sets of entries merge exactly (:func:`merge_partials`, the
log-sum-exp rescaling), so a store split into chunks, or into shards on several devices,
gives the same answer as one pass over all of it; :func:`finalize` turns a partial into
the output. No ``(B, N, d)`` tensor is ever formed, and working memory is a few
``(B, chunk)`` blocks.

:func:`attention` wraps this in a custom autograd function with exact gradients w.r.t. the
queries, keys, values and weights. For the backward pass it keeps the ``(B, N)`` kernel
values when they cost less than ``save_fraction`` of the store's bytes (cheap at small B,
the training case), and recomputes them chunk by chunk otherwise (large-B evaluation with
gradients).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol, overload

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from rcdl.half import upcast_chunks
from rcdl.kernels import Kernel, check_kernel, guard_denominator, softmax_scale
from rcdl.store import HALF_DTYPES

__all__ = [
    "Combiner",
    "Partial",
    "attention",
    "attention_backward",
    "attention_partial",
    "default_chunk_size",
    "finalize",
    "merge_partials",
    "nearest_sq_distance",
    "resume_partial",
]

_NEG_INF = float("-inf")


class Partial(NamedTuple):
    """Attention over a subset of the entries, mergeable with other subsets."""

    m: Tensor  # (B,) running max logit (softmax), zeros otherwise
    num: Tensor  # (B, d_out)
    den: Tensor  # (B,)
    mass: Tensor  # (B,) Σ_j |w_j| e^{z_j − m} (softmax), zeros otherwise


class Combiner(Protocol):
    """The hooks :func:`attention` takes when its entries are one part of a store split into
    disjoint parts (the ranks' shards, :mod:`rcdl.distributed`): ``merge`` turns this part's
    partial into the partial over all parts, and ``all_reduce`` sums the query gradient's
    shares of the parts (in place; every part computes its own). This module knows nothing
    else of how the parts are held."""

    def merge(self, part: Partial, kernel: Kernel) -> Partial: ...

    def all_reduce(self, t: Tensor) -> Tensor: ...


def default_chunk_size(batch: int, device: torch.device | str | None = None) -> int:
    """Entries per chunk.

    On CPU: 2048 for small batches, 1024 beyond 128 queries, so that a chunk's keys stay in
    cache (``benchmarks/bench_attention.py`` compares sizes; docs/precision.md). On a GPU
    the cost is kernel launches, not cache misses, so chunks are large: 65 536 entries, whose
    ``(c, B)`` block is 131 MB at B = 500 in float32.
    """
    if device is not None and torch.device(device).type == "cuda":
        return 1 << 16
    return 2048 if batch <= 128 else 1024


def _default_chunk(q: Tensor, keys: Tensor) -> int:
    """:func:`default_chunk_size`, or where a half store's chunks are converted to float32
    (:mod:`rcdl.half`) the rows whose float32 copy stays in cache while it is multiplied:
    2 MiB of them for training batches, 4 MiB for larger ones (at least 256 rows): a larger
    converted chunk leaves the cache before its second product reads it
    (``benchmarks/bench_half_paths.py``; the figures are in docs/precision.md)."""
    rows = default_chunk_size(q.shape[0], q.device)
    if not upcast_chunks(keys.dtype, keys.device):
        return rows
    budget = (1 << 21) if q.shape[0] <= 128 else (1 << 22)
    return max(256, min(rows, budget // (q.element_size() * max(1, keys.shape[1]))))


def _empty_partial(q: Tensor, d_out: int, kernel: Kernel) -> Partial:
    b = q.shape[0]
    m = q.new_full((b,), _NEG_INF) if kernel.normalised else q.new_zeros(b)
    return Partial(m, q.new_zeros(b, d_out), q.new_zeros(b), q.new_zeros(b))


# Blocks are entry-major, (c, B): ``keys_c @ q.T`` reads the store rows contiguously, which
# suits small B on CPU. The products that sum over the chunk's entries (``blockᵀ @ values_c``,
# and ``gradᵀ @ keys_c`` backward) take the block transposed into a contiguous (B, c) copy and
# the store chunk as it lies, rather than ``values_c.T @ block``. For a half-precision store
# and B > 128 (evaluation) the scores are formed as ``q @ keys_c.T`` instead. Each order is
# the faster one where it is used; docs/precision.md gives the measurements.


def _chunk_kernel_values(
    kernel: Kernel, q: Tensor, q_sqnorm: Tensor | None, keys: Tensor, tau: float,
    dtype: torch.dtype,
) -> Tensor:  # (c, B)
    """Unweighted kernel values of one chunk, in ``dtype``; for a normalised kernel the raw
    logits ``z``. ``q`` is in the keys' dtype (the product runs in it, see
    :func:`_sum_over_entries_`)."""
    if keys.dtype in HALF_DTYPES and q.shape[0] > 128:  # see the layout note above
        scores = (q @ keys.T).T.to(dtype)  # (c, B) view of a (B, c) product
    else:
        scores = (keys @ q.T).to(dtype)  # (c, B), no copy when the dtypes agree
    return kernel.values_(scores, q_sqnorm, keys, tau, dtype)


def _sum_over_entries_(acc: Tensor, block: Tensor, rows: Tensor, alpha: float = 1.0) -> Tensor:
    """``acc += alpha · blockᵀ @ rows``: ``acc (B, d)`` accumulates a chunk's ``block (c, B)``
    (in ``acc``'s dtype) times its store ``rows (c, d)``. The block is copied transposed into
    a contiguous ``(B, c)`` operand. For a half-precision store the product runs in the
    rows' dtype (the block rounded to it; the matrix unit accumulates in float32) and is added
    to ``acc`` in its dtype."""
    left = block.T.to(rows.dtype, memory_format=torch.contiguous_format)  # (B, c)
    if rows.dtype == acc.dtype:
        return acc.addmm_(left, rows, alpha=alpha)
    return acc.add_(left @ rows, alpha=alpha)


def _mm_into(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``out = a @ b`` written into ``out`` (rounded to its dtype if it is narrower)."""
    if out.dtype == a.dtype == b.dtype:
        return torch.mm(a, b, out=out)
    return out.copy_(a @ b)


def _fold_chunk(
    kernel: Kernel, part: Partial, block: Tensor, values: Tensor, weights: Tensor
) -> tuple[Partial, Tensor | None]:
    """Fold one chunk's block ``(c, B)`` into ``part``. A normalised kernel (the softmax)
    turns ``block`` into ``e^{z − m_new}`` in place and returns ``m_new``; the others leave
    it as it is."""
    if not kernel.normalised:
        _sum_over_entries_(part.num, block * weights[:, None], values)
        return part, None
    m_new = torch.maximum(part.m, block.amax(dim=0))  # (B,)
    rescale = torch.exp(part.m - m_new)  # (B,), 0 where m was -inf
    block.sub_(m_new).exp_()
    _sum_over_entries_(part.num.mul_(rescale[:, None]), block, values)
    den = part.den.mul_(rescale).add_(weights @ block)
    mass = part.mass.mul_(rescale).add_(weights.abs() @ block)
    return Partial(m_new, part.num, den, mass), m_new


def _check_inputs(q: Tensor, keys: Tensor, values: Tensor, weights: Tensor) -> None:
    if q.dim() != 2 or keys.dim() != 2 or values.dim() != 2 or weights.dim() != 1:
        raise ValueError(
            "attention expects q (B, d_in), keys (N, d_in), values (N, d_out), weights (N,); got "
            f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}, {tuple(weights.shape)}"
        )
    n = keys.shape[0]
    if q.shape[1] != keys.shape[1] or values.shape[0] != n or weights.shape[0] != n:
        raise ValueError(
            f"attention shape mismatch: q {tuple(q.shape)}, keys {tuple(keys.shape)}, "
            f"values {tuple(values.shape)}, weights {tuple(weights.shape)}"
        )
    if weights.dtype != q.dtype or keys.dtype != values.dtype or not (
            keys.dtype == q.dtype or keys.dtype in HALF_DTYPES):
        raise TypeError(
            f"attention: queries are {q.dtype}, keys {keys.dtype}, values {values.dtype}, "
            f"weights {weights.dtype}; weights must match the queries, and keys and values "
            "share one dtype: the queries' or a half precision (bfloat16, float16)")
    for name, t in (("keys", keys), ("values", values), ("weights", weights)):
        if t.device != q.device:
            raise TypeError(f"attention: {name} are on {t.device}, queries on {q.device}")


@torch.no_grad()
def attention_partial(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out)
    weights: Tensor,  # (N,)
    *,
    kernel: str | Kernel,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Partial:
    """The partial result of attending from ``q`` to these entries (no autograd)."""
    part, _ = _stream(q, keys, values, weights, check_kernel(kernel), temperature, chunk_size,
                      keep=False)
    return part


def _folds(q, keys, values, weights, kernel, temperature, chunk, part, first_row):
    """The streaming fold from row ``first_row`` on, one chunk at a time: yields
    ``(end row, part, block, m used)`` after each chunk (``part`` is folded in place). The
    callers have checked the inputs (:func:`_check_inputs`)."""
    tau = softmax_scale(temperature, q.shape[1])
    q_keys, q_sqnorm = _queries_as_keys(q, keys, kernel.distance)
    read_keys, read_values = _chunk_reader(q, keys), _chunk_reader(q, values)

    def chunks():  # noqa: ANN202 - a generator of tuples
        folded = part
        for begin in range(first_row, keys.shape[0], chunk):
            rows = slice(begin, begin + chunk)
            block = _chunk_kernel_values(kernel, q_keys, q_sqnorm, read_keys(keys[rows]), tau,
                                         q.dtype)
            folded, m_used = _fold_chunk(kernel, folded, block, read_values(values[rows]),
                                         weights[rows])
            yield begin + chunk, folded, block, m_used

    return chunks()


def _stream(q, keys, values, weights, kernel, temperature, chunk_size, keep):
    _check_inputs(q, keys, values, weights)  # before the shapes are read below
    chunk = chunk_size or _default_chunk(q, keys)
    part = _empty_partial(q, values.shape[1], kernel)
    saved = []  # per chunk: (block, m used for it) when keep
    for _, folded, block, m_used in _folds(q, keys, values, weights, kernel, temperature,
                                           chunk, part, 0):
        part = folded
        if keep:
            saved.append((block, m_used))
    return part, saved


@torch.no_grad()
def resume_partial(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out)
    weights: Tensor,  # (N,)
    *,
    kernel: str | Kernel,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    start: tuple[int, Partial] | None = None,
) -> tuple[Partial, tuple[int, Partial]]:
    """The partial over all ``N`` rows, folded chunk by chunk exactly as
    :func:`attention_partial` folds them, but starting from ``start = (row, partial)``: the
    fold's state after its first ``row`` rows (a multiple of the chunk size), as an earlier
    call returned it. Returns the partial over all rows and the state to start from next
    time, ``(r, partial over rows [0, r))`` with ``r`` the last multiple of the chunk size
    ``≤ N``. Every chunk is the same rows, folded in the same order, as in one pass over
    the store: the result is bit for bit :func:`attention_partial`'s, and a store that only
    grew is re-attended from its last full chunk on (incremental evaluation)."""
    kernel = check_kernel(kernel)
    _check_inputs(q, keys, values, weights)  # before the shapes are read below
    chunk = chunk_size or _default_chunk(q, keys)
    n = keys.shape[0]
    row, given = (0, _empty_partial(q, values.shape[1], kernel)) if start is None else start
    if row % chunk or row > n:
        raise ValueError(f"resume_partial: the start row {row} is not a chunk boundary "
                         f"(chunk {chunk}) within the {n} rows")
    boundary = (n // chunk) * chunk
    state = (row, given)  # what to start from next time, if no full chunk follows
    part = Partial(*(t.clone() for t in given))  # folded in place; the state given stays
    for end, folded, _, _ in _folds(q, keys, values, weights, kernel, temperature, chunk,
                                    part, row):
        part = folded
        if end == boundary:  # the last full chunk: keep a copy of the state
            state = (boundary, Partial(*(t.clone() for t in part)))
    return part, state


@overload
def _queries_as_keys(q: Tensor, keys: Tensor, sqnorm: Literal[True]) -> tuple[Tensor, Tensor]: ...
@overload
def _queries_as_keys(q: Tensor, keys: Tensor, sqnorm: bool) -> tuple[Tensor, Tensor | None]: ...
def _queries_as_keys(q: Tensor, keys: Tensor, sqnorm: bool) -> tuple[Tensor, Tensor | None]:
    """The queries in the dtype the products run in (the keys', or the queries' own where a
    half store's chunks are read as float32: :mod:`rcdl.half`), and for a distance kernel
    (``sqnorm``) their squared norms (of those rounded queries, so that
    ``|q|² − 2⟨q, k⟩ + |k|²`` is the distance of the vectors multiplied)."""
    upcast = upcast_chunks(keys.dtype, keys.device)
    q_keys = q if upcast else q.to(keys.dtype)  # (B, d_in), q itself when the dtypes agree
    q_sqnorm = (q_keys * q_keys).sum(1, dtype=q.dtype) if sqnorm else None  # (B,)
    return q_keys, q_sqnorm


def _chunk_reader(q: Tensor, store: Tensor):  # noqa: ANN202 - Tensor -> Tensor
    """How chunks of ``store`` (keys or values) are read for their products: as they are, or
    converted to the queries' dtype (a half store on a device without native half products,
    :mod:`rcdl.half`: only the chunk is converted, the store keeps its bytes). The converted
    chunk is written into one buffer per chunk shape, reused from chunk to chunk (a fresh
    chunk-sized allocation each time costs page faults): a chunk read is valid until the
    next read of the same reader."""
    if not upcast_chunks(store.dtype, store.device):
        return lambda rows: rows
    buffers: dict[torch.Size, Tensor] = {}

    def read(rows: Tensor) -> Tensor:
        buffer = buffers.get(rows.shape)
        if buffer is None:
            buffer = buffers[rows.shape] = torch.empty(rows.shape, dtype=q.dtype,
                                                       device=rows.device)
        return buffer.copy_(rows)

    return read


def merge_partials(a: Partial, b: Partial) -> Partial:
    """Exact merge of the partials of two disjoint sets of entries (log-sum-exp rescaling)."""
    m = torch.maximum(a.m, b.m)
    scale_a = torch.where(a.m == _NEG_INF, 0.0, torch.exp(a.m - m))  # (B,)
    scale_b = torch.where(b.m == _NEG_INF, 0.0, torch.exp(b.m - m))
    num = a.num * scale_a[:, None] + b.num * scale_b[:, None]
    return Partial(m, num, a.den * scale_a + b.den * scale_b, a.mass * scale_a + b.mass * scale_b)


def finalize(part: Partial, *, kernel: str | Kernel, eps: float = 1e-6) -> Tensor:  # (B, d_out)
    """Output of the attention from the partial over *all* entries: a new tensor, never one
    of the partial's (a cached partial stays intact whatever is done to the output)."""
    if not check_kernel(kernel).normalised:
        return part.num.clone(memory_format=torch.contiguous_format)
    return (part.num / guard_denominator(part.den, part.mass, eps)[:, None]).contiguous()


class _StreamingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keys, values, weights, kernel, temperature, chunk_size, eps,  # noqa: ANN001
                save_fraction, shard, stats):
        b, n = q.shape[0], keys.shape[0]
        store_bytes = keys.numel() * keys.element_size() + values.numel() * values.element_size()
        needs_grad = any(ctx.needs_input_grad[:4])
        keep = needs_grad and b * n * q.element_size() <= save_fraction * store_bytes
        chunk = chunk_size or _default_chunk(q, keys)
        part, saved = _stream(q, keys, values, weights, kernel, temperature, chunk, keep)
        if shard is not None:  # these entries are one shard: merge the partials of all ranks
            part = shard.merge(part, kernel)
        out = finalize(part, kernel=kernel, eps=eps)
        ctx.kernel, ctx.chunk, ctx.shard = kernel, chunk, shard
        ctx.tau = softmax_scale(temperature, q.shape[1])
        ctx.saved_blocks = saved if keep else None
        # the softmax backward needs the final max, the guarded denominator and where the
        # guard acted (there the denominator is ±eps·mass instead of Σ_j w_j e^{z_j − m})
        den = clamped = None
        if kernel.normalised:
            den = guard_denominator(part.den, part.mass, eps)  # (B,)
            clamped = part.den.abs() < eps * part.mass  # (B,) bool
            if stats is not None:  # the normaliser over all entries, for the caller
                stats.append((part.m.clone(), part.den.clone()))
        ctx.eps = eps
        # the output is recomputed from num backward, not saved: an in-place op on it (an
        # nn.ReLU(inplace=True) after the layer) then leaves the backward what it needs
        ctx.save_for_backward(q, keys, values, weights, part.num, part.m, den, clamped)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # grad_out (B, d_out)
        q, keys, values, weights, num, m, den, clamped = ctx.saved_tensors
        out = num / den[:, None] if ctx.kernel.normalised else num  # (B, d_out)
        grad_q, *entry_grads = attention_backward(
            grad_out, q, keys, values, weights, out, m, den, clamped, kernel=ctx.kernel,
            tau=ctx.tau, chunk=ctx.chunk,
            eps=ctx.eps, needs=ctx.needs_input_grad[:4], saved_blocks=ctx.saved_blocks)
        if grad_q is not None and ctx.shard is not None:  # each rank holds its shard's share
            grad_q = ctx.shard.all_reduce(grad_q.contiguous())
        return (grad_q, *entry_grads, None, None, None, None, None, None, None)


def attention_backward(
    grad_out: Tensor,  # (B, d_out)
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out)
    weights: Tensor,  # (N,)
    out: Tensor,  # (B, d_out) the attention's output over *all* entries
    m: Tensor,  # (B,) the max logit over all entries (softmax; zeros otherwise)
    den: Tensor | None,  # (B,) the guarded denominator over all entries (softmax)
    clamped: Tensor | None,  # (B,) bool, where the guard acted (softmax)
    *,
    kernel: str | Kernel,
    tau: float,
    chunk: int,
    eps: float,
    needs: tuple[bool, bool, bool, bool],
    saved_blocks: list | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients w.r.t. ``(q, keys, values, weights)`` of the entries given, streamed in chunks.

    ``out``, ``m``, ``den`` and ``clamped`` describe the attention over *all* entries; the
    entries given may be a subset (a shard). Then ``grad_q`` is this subset's share, and the
    shares of disjoint subsets sum to the whole (what :mod:`rcdl.distributed` all-reduces).
    ``needs`` says which of the four gradients to compute (the others are ``None``).
    """
    need_q, need_k, need_v, need_w = needs
    grad_q = q.new_zeros(q.shape) if need_q else None  # (B, d_in)
    grad_k = torch.empty_like(keys) if need_k else None
    grad_v = torch.empty_like(values) if need_v else None
    grad_w = torch.empty_like(weights) if need_w else None
    kernel = check_kernel(kernel)
    q_keys, q_sqnorm = _queries_as_keys(q, keys, kernel.distance)
    read_keys, read_values = _chunk_reader(q, keys), _chunk_reader(q, values)
    grad_out_v = grad_out.to(q_keys.dtype)  # (B, d_out) for the products with the values
    scale = kernel.scale(tau)  # d(score)/dq = k * scale
    dist_q_coef = q.new_zeros(q.shape[0])  # Σ_j c_j per query (distance kernels only)
    if kernel.normalised:
        assert den is not None and clamped is not None  # given for the softmax kernel
        # s = num / D' with ∂D'/∂z_j = u_j e^{z_j − m}: u_j = w_j where D' = D, and
        # u_j = ±eps |w_j| where the guard acted (D' = ±eps · mass). ⟨g, s⟩ is split into
        # the part multiplying w_j and the part multiplying |w_j|.
        g_dot_s = (grad_out * out).sum(1)  # (B,)
        gs_w = g_dot_s.masked_fill(clamped, 0.0)  # (B,)
        # on a GPU, take the guarded branch always (it adds zeros where the guard did not
        # act) rather than wait for the device to say whether it acted anywhere
        any_clamped = clamped.is_cuda or bool(clamped.any())
        if any_clamped:
            gs_abs = torch.where(clamped, eps * torch.sign(den) * g_dot_s, 0.0)  # (B,)
        inv_den = 1.0 / den  # (B,), 0 where there is no weight mass (den = inf)
    for i, start in enumerate(range(0, keys.shape[0], chunk)):
        rows = slice(start, start + chunk)
        k_c, v_c, w_c = read_keys(keys[rows]), read_values(values[rows]), weights[rows]
        if saved_blocks is not None:
            block, m_used = saved_blocks[i]
        else:
            block = _chunk_kernel_values(kernel, q_keys, q_sqnorm, k_c, tau, q.dtype)
            m_used = m
            if kernel.normalised:
                block.sub_(m).exp_()
        g_dot_v = (v_c @ grad_out_v.T).to(q.dtype)  # (c, B)
        if kernel.normalised:
            # a_j = e^{z_j - m} / D;  ∂s/∂z_j = a_j (ṽ_j − w_j s)
            attn = block * (torch.exp(m_used - m) * inv_den)  # (c, B)
            u_gs = w_c[:, None] * gs_w  # (c, B) u_j ⟨g, s⟩
            if any_clamped:
                u_gs += w_c.abs()[:, None] * gs_abs
            grad_scores = attn * g_dot_v.sub_(u_gs)  # (c, B) wrt z
            if grad_v is not None:  # written in place: no (c, d_out) temporary to copy
                _mm_into(grad_v[rows], attn, grad_out)
            if grad_w is not None:
                grad_w[rows] = -(attn @ gs_w)
                if any_clamped:
                    grad_w[rows] -= torch.sign(w_c) * (attn @ gs_abs)
        else:
            if grad_v is not None:
                _mm_into(grad_v[rows], block * w_c[:, None], grad_out)
            if grad_w is not None:
                grad_w[rows] = (block * g_dot_v).sum(1)
            # (c, B) wrt the kernel values, then wrt ⟨q, k⟩ (over scale): for RBF
            # φ = exp(−|q−k|²/2τ), dφ/dq = φ (k − q)/τ, so the factor is φ
            grad_scores = kernel.grad_factor_(g_dot_v.mul_(w_c[:, None]), block, tau)
        if grad_q is not None:
            _sum_over_entries_(grad_q, grad_scores, k_c, alpha=scale)
            if kernel.distance:
                dist_q_coef += grad_scores.sum(0)
        if grad_k is not None:
            _mm_into(grad_k[rows], grad_scores, q).mul_(scale)
            if kernel.distance:  # the −k part of ∂‖q − k‖²
                grad_k[rows] -= k_c * (grad_scores.sum(1) * scale)[:, None]
    if grad_q is not None and kernel.distance:  # the −q part of ∂‖q − k‖²: φ (k − q)/τ
        grad_q -= q * (dist_q_coef * scale)[:, None]
    return grad_q, grad_k, grad_v, grad_w


def attention(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out)
    weights: Tensor,  # (N,)
    *,
    kernel: str | Kernel,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    eps: float = 1e-6,
    save_fraction: float = 0.05,
    shard: Combiner | None = None,
    stats: list[tuple[Tensor, Tensor]] | None = None,
) -> Tensor:  # (B, d_out)
    """Kernel attention from queries ``q`` over the entries ``(keys, values, weights)``.

    The kernels are those of :mod:`rcdl.kernels` (a :class:`~rcdl.kernels.Kernel` or the
    name of one in :data:`~rcdl.kernels.KERNELS`), with ``τ = temperature · √d_in``.
    Differentiable w.r.t. all four tensors (first order).

    Args:
        chunk_size: entries per block (default: :func:`default_chunk_size`).
        eps: floor on the magnitude of the softmax denominator ``Σ_j w_j e^{z_j}``, relative
            to the weight mass ``Σ_j |w_j| e^{z_j}`` (:func:`rcdl.kernels.guard_denominator`).
        save_fraction: keep the ``(B, N)`` kernel values for backward when they take at most
            this fraction of the bytes of ``keys`` and ``values``; otherwise recompute.
        shard: if given (a :class:`Combiner`, e.g. :class:`rcdl.distributed.Shard`), the
            entries are one part of a store split into parts (this rank's shard of a store
            split over ranks): the partials of all parts are merged before the output, and
            the query gradient's shares are summed over the parts.
        stats: if given (a list), the softmax kernel appends ``(m, den)`` over all entries
            (merged over the ranks): ``log Σ_j w_j e^{z_j} = m + log den``.

    Example:
        >>> q, k, v = torch.randn(4, 8), torch.randn(100, 8), torch.randn(100, 3)
        >>> attention(q, k, v, torch.ones(100), kernel="softmax").shape
        torch.Size([4, 3])
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _StreamingAttention.apply(
        q, keys, values, weights, check_kernel(kernel), temperature, chunk_size, eps,
        save_fraction, shard,
        stats)


@torch.no_grad()
def nearest_sq_distance(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    *,
    chunk_size: int | None = None,
) -> Tensor:  # (B,)
    """``min_j ‖q − k_j‖²`` for every query, streamed over chunks of the keys
    (docs/reference.md §4).

    Each chunk costs one ``(c, B)`` score block, ``‖k‖² − 2⟨q, k⟩``, folded into a running
    minimum; ``‖q‖²`` is added at the end. No ``(B, N, d)`` tensor is formed. An empty store
    gives ``+inf``. The result is clamped at 0 (the expansion can round slightly below).
    """
    if q.dim() != 2 or keys.dim() != 2 or q.shape[1] != keys.shape[1]:
        raise ValueError(f"nearest_sq_distance expects q (B, d) and keys (N, d), got "
                         f"{tuple(q.shape)} and {tuple(keys.shape)}")
    chunk = chunk_size or _default_chunk(q, keys)
    q_keys, q_sqnorm = _queries_as_keys(q, keys, True)
    read = _chunk_reader(q, keys)
    best = q.new_full((q.shape[0],), float("inf"))  # (B,) min over j of ‖k_j‖² − 2⟨q, k_j⟩
    for start in range(0, keys.shape[0], chunk):
        k_c = read(keys[start : start + chunk])  # (c, d)
        k_sqnorm = (k_c * k_c).sum(1, dtype=q.dtype)  # (c,)
        block = (k_c @ q_keys.T).to(q.dtype).mul_(-2).add_(k_sqnorm[:, None])  # (c, B)
        best = torch.minimum(best, block.amin(0))
    return (best + q_sqnorm).clamp_min_(0.0)
