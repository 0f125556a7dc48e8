"""The streaming compute path of the attention op (docs/reference.md §2, docs/architecture.md
"The attention op"): the reference every other compute path is tested against, and the one
taken wherever no other is registered.

The store is visited chunk by chunk along N; each chunk contributes a ``(c, B)`` block of
scores and is folded into a running :class:`~rcdl.ops.partials.Partial` ``(m, num, den,
mass)`` (:func:`rcdl.ops.partials.fold_block`: the log-sum-exp rescaling for the softmax).
No ``(B, N, d)`` tensor is ever formed, and working memory is a few ``(c, B)`` blocks. The
backward pass streams the same chunks again, or reuses the blocks the forward kept
(:meth:`Streaming.forward`'s ``keep``). The shares (:meth:`Streaming.shares`) are formed
from the same products, rounded as the output's are, so they sum to the output to its own
rounding.

How the products run is the call's :class:`~rcdl.ops.plan.ProductPlan`
(:meth:`rcdl.ops.entries.Entries.plan`), decided once as the forward starts and kept for its
backward: a half-precision store multiplies natively, on float32 copies of each chunk, or
widened in registers inside the products (:mod:`rcdl.ops.half`, :mod:`rcdl.ops.widen`);
where the products run on the rows as they lie and the batch is a training batch, the sums
over a full chunk's entries (and in the packing mode ``"all"`` its score products) run from
the store's packed copies of the chunk (:mod:`rcdl.ops.packed`); and the plan gives the rows
per chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from rcdl.ops import packed as packing
from rcdl.ops import widen
from rcdl.ops.entries import Entries
from rcdl.ops.kernels import Kernel, guard_denominator, row_sq_norms
from rcdl.ops.partials import Partial, Products, empty_partial, fold_block, per_query
from rcdl.ops.plan import ProductPlan, default_chunk_size, plan_products

__all__ = ["STREAMING", "Streaming", "default_chunk_size", "nearest_sq_distance"]


_NARROW_BLOCK_BYTES = 1 << 23  # the float32 product block a half gradient is rounded from


def _mm_into(out: Tensor, a: Tensor, b: Tensor,
             buffers: dict[torch.Size, Tensor] | None = None) -> Tensor:
    """``out = a @ b`` written into ``out``. Where ``out`` is narrower (a half store's entry
    gradients), on CPU, the product is formed into a float32 buffer of at most 8 MiB, a
    block of rows at a time, and each block rounded into ``out``: a fresh ``(c, d)`` float32
    product per chunk (50 MB at 4 096 × 3 072) costs its page faults and a round trip
    through memory (results/speed/LOG.md, "Measured on a real AVX2-only CPU"). ``buffers``
    keeps that buffer from call to call (a pass's, :class:`_Pass`)."""
    if out.dtype == a.dtype == b.dtype:
        return torch.mm(a, b, out=out)
    step = max(16, _NARROW_BLOCK_BYTES // (a.element_size() * max(1, b.shape[1])))
    if out.device.type != "cpu" or step >= a.shape[0]:
        return out.copy_(a @ b)
    buffers = {} if buffers is None else buffers
    shape = torch.Size((step, b.shape[1]))
    buffer = buffers.get(shape)
    if buffer is None:  # a pass's products are all in its queries' dtype
        buffer = buffers[shape] = a.new_empty(shape)
    for start in range(0, a.shape[0], step):
        rows = min(step, a.shape[0] - start)
        out[start:start + rows].copy_(torch.mm(a[start:start + rows], b, out=buffer[:rows]))
    return out


class _Pass(Products):
    """What every pass over the entries for the queries ``q`` shares: the call's ``plan``
    (:meth:`rcdl.ops.entries.Entries.plan`; ``None``: planned now; a backward pass takes its
    forward's) and the products it runs (:class:`~rcdl.ops.partials.Products`), the rows per
    chunk (the plan's) and the store's chunk cache where the products take its rows as they
    lie (:mod:`rcdl.ops.packed`: the keys' norms for any batch, the packed copies where the
    plan packs)."""

    kernel: Kernel

    def __init__(self, q: Tensor, entries: Entries, plan: ProductPlan | None = None) -> None:
        plan = entries.plan(q) if plan is None else plan
        super().__init__(q, entries.keys, entries.values, kernel=entries.kernel,
                         tau=entries.tau(q.shape[1]), plan=plan)
        self.chunk = plan.chunk
        self.products: dict[torch.Size, Tensor] = {}  # _mm_into's buffers, reused per chunk
        # the store's chunk cache where the products take its rows as they lie; its packed
        # copies where the plan packs, its keys' norms for any batch
        self.chunks = entries.packed if plan.path == "store" else None
        self.packed = entries.packed if plan.pack_sums else None

    def _full_chunk(self, rows: Tensor, begin: int | None) -> bool:
        """Whether ``rows`` are a full chunk of the store's own rows (``begin`` ``None``: not
        the store's rows), which its chunk cache may keep things of."""
        return self.chunks is not None and begin is not None and rows.shape[0] == self.chunk

    def packed_rows(self, which: str, rows: Tensor, begin: int | None, scores: bool = False
                    ) -> Tensor | None:
        """The store's chunk ``rows`` of ``which`` (``"keys"``/``"values"``) from row
        ``begin``, packed for a sum over its entries (or with ``scores`` for a score
        product), where it is a full chunk the store packs (else ``None``)."""
        if (self.packed is None or (scores and not self.plan.pack_scores)
                or not self._full_chunk(rows, begin)):
            return None
        assert begin is not None  # checked by _full_chunk
        return self.packed.packed(which, rows, begin, scores=scores)

    def block(self, keys: Tensor, begin: int | None = None) -> Tensor:  # (c, B)
        """A chunk's unweighted kernel values (the softmax's raw logits), in the queries'
        dtype; ``keys`` as read, the store's rows from ``begin`` (where their score product
        may run from a packed copy)."""
        k_sqnorm = None
        if self.kernel.distance and self._full_chunk(keys, begin):
            assert self.chunks is not None and begin is not None  # checked by _full_chunk
            k_sqnorm = self.chunks.sq_norms(keys, begin, self.dtype)  # (c,), kept per chunk
        return self.kernel_values(keys, self.packed_rows("keys", keys, begin, scores=True),
                                  k_sqnorm)

    def scores(self, rows: Tensor, x: Tensor, begin: int | None = None) -> Tensor:  # (c, B)
        """``rows @ xᵀ`` in the queries' dtype: a chunk's store rows (as read) times
        ``x (B, d)`` (in the dtype the products take); the values' rows from ``begin`` (whose
        product may run from a packed copy)."""
        if self.widened:
            return widen.scores(rows, x)[0]
        packed = self.packed_rows("values", rows, begin, scores=True)
        if packed is not None:
            return packing.packed_product(x, packed).T.to(self.dtype)  # (c, B) view
        return (rows @ x.T).to(self.dtype)

    def folds(self, entries: Entries, part: Partial, first_row: int
              ) -> Iterator[tuple[int, Partial, Tensor, Tensor | None]]:
        """The streaming fold from row ``first_row`` on, one chunk at a time: yields
        ``(end row, part, block, m used)`` after each chunk (``part`` is folded in place)."""
        keys, values, weights = entries.keys, entries.values, entries.weights
        for begin in range(first_row, keys.shape[0], self.chunk):
            rows = slice(begin, begin + self.chunk)
            block = self.block(self.read_keys(keys[rows]), begin)
            # the keys' converted chunk is spent once its block is formed: the values take
            # the same buffer (where their shapes agree), so half as much is written per chunk
            part, m_used = fold_block(self.kernel, part, block, self.read_keys(values[rows]),
                                      weights[rows], self.widened,
                                      self.packed_rows("values", values[rows], begin))
            yield begin + self.chunk, part, block, m_used


class Streaming:
    """The streaming compute path: every device, dtype and kernel (see the module
    docstring). Its methods are the compute-path contract of :mod:`rcdl.ops.attention`; the
    queries and entries they get have been checked against each other."""

    name = "streaming"

    def supports(self, q: Tensor, entries: Entries) -> bool:
        return True

    def forward(self, q: Tensor, entries: Entries, *, keep: bool) -> tuple[Partial, Any]:
        """The partial over all the entries (no autograd), and what :meth:`backward` needs
        of this pass: its plan, and with ``keep`` each chunk's block."""
        run = _Pass(q, entries)
        part = empty_partial(q, entries.values.shape[1], entries.kernel)
        saved = []  # per chunk: (block, m used for it) when keep
        for _, folded, block, m_used in run.folds(entries, part, 0):
            part = folded
            if keep:
                saved.append((block, m_used))
        return part, (run.plan, saved if keep else None)

    def resume(self, q: Tensor, entries: Entries, start: tuple[int, Partial] | None
               ) -> tuple[Partial, tuple[int, Partial]]:
        """The partial over all ``N`` rows, folded chunk by chunk exactly as :meth:`forward`
        folds them, but starting from ``start = (row, partial)``: the fold's state after its
        first ``row`` rows (a multiple of the chunk size), as an earlier call returned it.
        Returns the partial over all rows and the state to start from next time,
        ``(r, partial over rows [0, r))`` with ``r`` the last multiple of the chunk size
        ``≤ N``. Every chunk is the same rows, folded in the same order, as in one pass: the
        result is bit for bit :meth:`forward`'s, and a store that only grew is re-attended
        from its last full chunk on (incremental evaluation)."""
        run = _Pass(q, entries)
        chunk, n = run.chunk, len(entries)
        row, given = ((0, empty_partial(q, entries.values.shape[1], entries.kernel))
                      if start is None else start)
        if row % chunk or row > n:
            raise ValueError(f"resume: the start row {row} is not a chunk boundary "
                             f"(chunk {chunk}) within the {n} rows")
        boundary = (n // chunk) * chunk
        state = (row, given)  # what to start from next time, if no full chunk follows
        part = Partial(*(t.clone() for t in given))  # folded in place; the state given stays
        for end, folded, _, _ in run.folds(entries, part, row):
            part = folded
            if end == boundary:  # the last full chunk: keep a copy of the state
                state = (boundary, Partial(*(t.clone() for t in part)))
        return part, state

    def backward(self, grad_out: Tensor, q: Tensor, entries: Entries, out: Tensor, m: Tensor,
                 den: Tensor | None, clamped: Tensor | None, *,
                 needs: tuple[bool, bool, bool, bool], saved: Any
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        """Gradients w.r.t. ``(q, keys, values, weights)`` of the entries given, streamed in
        chunks.

        ``out (B, d_out)``, ``m (B,)``, ``den`` (the guarded denominator, softmax) and
        ``clamped`` (where the guard acted, softmax) describe the attention over *all*
        entries; the entries given may be a subset (a shard). Then ``grad_q`` is this
        subset's share, and the shares of disjoint subsets sum to the whole (what
        :mod:`rcdl.distributed` all-reduces). ``needs`` says which of the four gradients to
        compute (the others are ``None``); ``saved`` is what :meth:`forward` returned."""
        keys, values, weights = entries.keys, entries.values, entries.weights
        kernel = entries.kernel
        plan, saved_blocks = saved
        need_q, need_k, need_v, need_w = needs
        grad_q = q.new_zeros(q.shape) if need_q else None  # (B, d_in)
        grad_k = torch.empty_like(keys) if need_k else None
        grad_v = torch.empty_like(values) if need_v else None
        grad_w = torch.empty_like(weights) if need_w else None
        run = _Pass(q, entries, plan)
        tau, chunk = run.tau, run.chunk
        grad_out_v = grad_out.to(run.q.dtype)  # (B, d_out) for the products with the values
        scale = kernel.scale(tau)  # d(score)/dq = k * scale
        dist_q_coef = q.new_zeros(q.shape[0])  # Σ_j c_j per query (distance kernels only)
        if kernel.normalised:
            assert den is not None and clamped is not None  # given for the softmax kernel
            # s = num / D' with ∂D'/∂z_j = u_j e^{z_j − m}: u_j = w_j where D' = D, and
            # u_j = ±eps |w_j| where the guard acted (D' = ±eps · mass). ⟨g, s⟩ is split into
            # the part multiplying w_j and the part multiplying |w_j|.
            g_dot_s = (grad_out * out).sum(1)  # (B,)
            gs_w = g_dot_s.masked_fill(clamped, 0.0)  # (B,)
            # the guarded terms are added everywhere (zeros where the guard did not act) rather
            # than after asking the device whether it acted anywhere (a host read per step)
            gs_abs = torch.where(clamped, entries.eps * torch.sign(den) * g_dot_s, 0.0)  # (B,)
            inv_den = 1.0 / den  # (B,), 0 where there is no weight mass (den = inf)
        for i, start in enumerate(range(0, keys.shape[0], chunk)):
            rows = slice(start, start + chunk)
            k_c, v_c, w_c = run.read_keys(keys[rows]), run.read_values(values[rows]), weights[rows]
            if saved_blocks is not None:
                block, m_used = saved_blocks[i]
            else:
                block, m_used = run.block(k_c, start), m
                if kernel.normalised:
                    block.sub_(m).exp_()
            g_dot_v = run.scores(v_c, grad_out_v, start)  # (c, B)
            if kernel.normalised:
                # a_j = e^{z_j - m} / D;  ∂s/∂z_j = a_j (ṽ_j − w_j s)
                attn = block * (torch.exp(m_used - m) * inv_den)  # (c, B)
                u_gs = w_c[:, None] * gs_w  # (c, B) u_j ⟨g, s⟩
                u_gs += w_c.abs()[:, None] * gs_abs
                grad_scores = attn * g_dot_v.sub_(u_gs)  # (c, B) wrt z
                if grad_v is not None:  # written in place: no (c, d_out) temporary to copy
                    _mm_into(grad_v[rows], attn, grad_out, run.products)
                if grad_w is not None:
                    grad_w[rows] = -(attn @ gs_w) - torch.sign(w_c) * (attn @ gs_abs)
            else:
                if grad_v is not None:
                    _mm_into(grad_v[rows], block * w_c[:, None], grad_out, run.products)
                if grad_w is not None:
                    grad_w[rows] = (block * g_dot_v).sum(1)
                # (c, B) wrt the kernel values, then wrt ⟨q, k⟩ (over scale): for RBF
                # φ = exp(−|q−k|²/2τ), dφ/dq = φ (k − q)/τ, so the factor is φ
                grad_scores = kernel.grad_factor_(g_dot_v.mul_(w_c[:, None]), block, tau)
            if grad_q is not None:
                run.sum_over_entries_(grad_q, grad_scores, k_c, alpha=scale,
                                      packed=run.packed_rows("keys", k_c, start))
                if kernel.distance:
                    dist_q_coef += grad_scores.sum(0)
            if grad_k is not None:  # the scale folded into the (c, B) factor, not the (c, d)
                _mm_into(grad_k[rows], grad_scores * scale, q, run.products)
                if kernel.distance:  # the −k part of ∂‖q − k‖², in place
                    grad_k[rows].addcmul_(k_c, (grad_scores.sum(1) * -scale)[:, None])
        if grad_q is not None and kernel.distance:  # the −q part of ∂‖q − k‖²: φ (k − q)/τ
            grad_q -= q * (dist_q_coef * scale)[:, None]
        return grad_q, grad_k, grad_v, grad_w

    def shares(self, q: Tensor, entries: Entries, direction: Tensor, whole: Partial
               ) -> Tensor:  # (B, N)
        """``⟨direction_b, share_j(q_b)⟩`` for every entry ``j`` (docs/attribution.md):
        ``w_j κ_j ⟨u_b, v_j⟩`` for the kernels that do not normalise,
        ``e^{z_j − m} ⟨u_b, ṽ_j⟩ / D`` for the softmax, with ``m`` and ``D`` (guarded) those
        of ``whole``, the partial over all entries (every rank's). Each term's kernel factor
        is rounded as the forward rounds it before multiplying the values, and ``⟨u, v_j⟩``
        is taken in the queries' dtype, so the shares sum to the output's projection to the
        output's own rounding."""
        keys, values, weights = entries.keys, entries.values, entries.weights
        kernel = entries.kernel
        run = _Pass(q, entries)
        if kernel.normalised:
            den = guard_denominator(whole.den, whole.mass, entries.eps)  # (B,)
        blocks = []
        for start in range(0, keys.shape[0], run.chunk):
            rows = slice(start, start + run.chunk)
            v_c = run.read_values(values[rows])  # (c, d_out) as the forward multiplies them
            block = run.block(run.read_keys(keys[rows]), start)  # (c, B)
            along = v_c.to(q.dtype) @ direction.T  # (c, B) ⟨u_b, v_j⟩, in the queries' dtype
            if kernel.normalised:
                term = run.as_multiplied(block.sub_(whole.m).exp_(), v_c) / den
            else:
                term = run.as_multiplied(block * weights[rows][:, None], v_c)
            blocks.append((term * along).T)  # (B, c)
        return torch.cat(blocks, dim=1) if blocks else q.new_zeros(q.shape[0], 0)


STREAMING = Streaming()


@torch.no_grad()
def nearest_sq_distance(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    *,
    chunk_size: int | None = None,
    half_products: str | None = None,
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
    plan = plan_products(q, keys, half_products=half_products, chunk_size=chunk_size)
    run = Products(q, keys, plan=plan)  # no kernel: the squared norms are formed
    chunk = plan.chunk
    q_sqnorm = run.q_sqnorm  # (B,)
    assert q_sqnorm is not None
    best = q.new_full((q.shape[0],), float("inf"))  # (B,) min over j of ‖k_j‖² − 2⟨q, k_j⟩
    for start in range(0, keys.shape[0], chunk):
        k_c = run.read_keys(keys[start : start + chunk])  # (c, d)
        if run.widened:
            block, k_sqnorm = widen.scores(k_c, run.q, sqnorm=True)  # (c, B), (c,)
            assert k_sqnorm is not None
        else:
            block = (k_c @ run.q.T).to(q.dtype)  # (c, B)
            k_sqnorm = row_sq_norms(k_c, q.dtype)  # (c,)
        block.mul_(-2).add_(k_sqnorm[:, None])  # ‖k‖² − 2⟨q, k⟩
        best = torch.minimum(best, per_query(block, largest=False))
    return (best + q_sqnorm).clamp_min_(0.0)
