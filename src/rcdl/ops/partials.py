"""The partial sums of the attention and all their algebra (docs/reference.md §2,
docs/architecture.md "The attention op").

The attention over a set of entries is kept as a :class:`Partial` ``(m, num, den, mass)``;
partials of disjoint sets merge exactly, and the partial over all entries gives the output:

- :class:`Products` — how one call's products run (:mod:`rcdl.ops.half`): the queries as the
  products take them, the store's rows as they are read, a block of kernel values, a block
  times the store's rows. Every block below is formed through it, so a half-precision store
  is multiplied wherever its partials are formed as the training forward multiplies it;
- :func:`fold_block` — fold one chunk's ``(c, B)`` block into a running partial, in place
  (the streaming path, :mod:`rcdl.ops.streaming`);
- :func:`block_partial` — the partial over one ``(Q, c)`` block of entries, each query
  seeing all of them or a mask's;
- :func:`merge_partials`, :func:`fold` (a partial with a block's entries merged in),
  :func:`output_with` (an output with added entries' partial merged in: the look-ahead);
- :func:`take_out` — a partial with some entries taken out, one set per query
  (leave-one-out, :mod:`rcdl.memory.leave_one_out`);
- :func:`without_each` — a softmax partial's projected output with each entry taken out
  alone (deletion effects, :mod:`rcdl.memory.attribution`);
- :func:`finalize` — the output from the partial over all entries.

With ``z`` the logits (``κ`` the kernel values for the kernels that do not normalise) and
``ṽ_j = w_j v_j``, over a set ``S`` of entries:

- softmax: ``m = max_{j∈S} z_j``, ``num = Σ_S e^{z_j − m} ṽ_j``,
  ``den = Σ_S w_j e^{z_j − m}``, ``mass = Σ_S |w_j| e^{z_j − m}``, and the output
  ``num / g(den, mass)`` with ``g`` the denominator's guard
  (:func:`rcdl.ops.kernels.guard_denominator`);
- the others: ``num = Σ_S w_j κ_j v_j`` (``m``, ``den``, ``mass`` zeros), the output ``num``.

Two partials merge by rescaling each to the larger ``m``: ``e^{m_a − m}``, ``e^{m_b − m}``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rcdl.ops import packed as packing
from rcdl.ops import widen
from rcdl.ops.half import HALF_DTYPES
from rcdl.ops.kernels import Kernel, check_kernel, guard_denominator, row_sq_norms
from rcdl.ops.plan import ProductPlan

__all__ = ["Partial", "Products", "block_partial", "empty_partial", "finalize", "fold",
           "fold_block", "merge_partials", "output_with", "take_out", "without_each"]

_NEG_INF = float("-inf")


class Partial(NamedTuple):
    """Attention over a subset of the entries, mergeable with other subsets:

    - ``m (B,)``        the largest logit seen (softmax; zeros for the other kernels),
    - ``num (B, d_out)`` ``Σ_j e^{z_j − m} ṽ_j`` (softmax) or ``Σ_j w_j κ(q, k_j) v_j``,
    - ``den (B,)``      ``Σ_j w_j e^{z_j − m}`` (softmax; zeros otherwise),
    - ``mass (B,)``     ``Σ_j |w_j| e^{z_j − m}`` (softmax; zeros otherwise): the scale of the
      denominator's guard (:func:`rcdl.ops.kernels.guard_denominator`).
    """

    m: Tensor  # (B,)
    num: Tensor  # (B, d_out)
    den: Tensor  # (B,)
    mass: Tensor  # (B,)


def empty_partial(q: Tensor, d_out: int, kernel: Kernel) -> Partial:
    """The partial over no entries (``m = −inf`` for the softmax)."""
    b = q.shape[0]
    m = q.new_full((b,), _NEG_INF) if kernel.normalised else q.new_zeros(b)
    return Partial(m, q.new_zeros(b, d_out), q.new_zeros(b), q.new_zeros(b))


def merge_partials(a: Partial, b: Partial) -> Partial:
    """Exact merge of the partials of two disjoint sets of entries (log-sum-exp rescaling)."""
    m = torch.maximum(a.m, b.m)
    scale_a = torch.where(a.m == _NEG_INF, 0.0, torch.exp(a.m - m))  # (B,)
    scale_b = torch.where(b.m == _NEG_INF, 0.0, torch.exp(b.m - m))
    num = a.num * scale_a[:, None] + b.num * scale_b[:, None]
    return Partial(m, num, a.den * scale_a + b.den * scale_b, a.mass * scale_a + b.mass * scale_b)


def output_with(s: Tensor, log_z: Tensor, new: Partial) -> Tensor:  # (B, d_out)
    """The softmax output once entries are added to a store whose output at the queries is
    ``s (B, d_out)`` with log-normaliser ``log_z = m + log den (B,)``, given the added
    entries' partial ``new``: the store's own partial is ``(log_z, s, 1, ·)``, merged with
    ``new`` at ``t = max(log_z, m_new)``:
    ``(s e^{log_z − t} + num_new e^{m_new − t}) / (e^{log_z − t} + den_new e^{m_new − t})``
    (the step's look-ahead, where only the forward's output and normaliser are kept; the
    denominator is not guarded)."""
    top = torch.maximum(log_z, new.m)  # (B,)
    old_w, new_w = torch.exp(log_z - top), torch.exp(new.m - top)  # (B,)
    return (s * old_w[:, None] + new.num * new_w[:, None]) / (old_w + new.den * new_w)[:, None]


def finalize(part: Partial, *, kernel: str | Kernel, eps: float = 1e-6) -> Tensor:  # (B, d_out)
    """Output of the attention from the partial over *all* entries: a new tensor, never one
    of the partial's (a cached partial stays intact whatever is done to the output)."""
    if not check_kernel(kernel).normalised:
        return part.num.clone(memory_format=torch.contiguous_format)
    return (part.num / guard_denominator(part.den, part.mass, eps)[:, None]).contiguous()


# ------------------------------------------------------------------------------ products
class Reader:
    """How chunks of a store tensor (keys or values) are read for their products: as they
    are, or converted to the queries' dtype (``upcast``: a half store on a device without
    native half products, :mod:`rcdl.ops.half`: only the chunk is converted, the store keeps its
    bytes). The converted chunk is written into one buffer per chunk shape, reused from
    chunk to chunk (a fresh chunk-sized allocation each time costs page faults): a chunk
    read is valid until the next read of the same reader."""

    def __init__(self, dtype: torch.dtype, upcast: bool) -> None:
        self.dtype, self.upcast = dtype, upcast
        self.buffers: dict[torch.Size, Tensor] = {}

    def __call__(self, rows: Tensor) -> Tensor:
        if not self.upcast:
            return rows
        buffer = self.buffers.get(rows.shape)
        if buffer is None:
            buffer = self.buffers[rows.shape] = torch.empty(rows.shape, dtype=self.dtype,
                                                            device=rows.device)
        return buffer.copy_(rows)


# Blocks are entry-major, (c, B): ``keys_c @ q.T`` reads the store rows contiguously, which
# suits small B on CPU. The products that sum over the chunk's entries (``blockᵀ @ values_c``,
# and ``gradᵀ @ keys_c`` backward) take the block transposed into a contiguous (B, c) copy and
# the store chunk as it lies, rather than ``values_c.T @ block``. For a half-precision store
# and an evaluation batch (more than rcdl.ops.plan.TRAINING_BATCH queries) the scores are
# formed as ``q @ keys_c.T`` instead. Each order is
# the faster one where it is used; docs/precision.md gives the measurements.


class Products:
    """How the products of one call of queries ``q (B, key_dim)`` with a store's
    ``keys (N, key_dim)`` and ``values (N, d_out)`` run, by the call's ``plan``
    (:func:`rcdl.ops.plan.plan_products`): the queries as the products take them
    (``q``: in the keys' dtype where the products run on the store as it lies, else as
    given), their squared norms for a distance ``kernel`` (``kernel`` ``None``: always, for
    distances alone), ``τ``, and the readers of the store's chunks. ``dtype`` is the
    queries': every block is in it.

    A half-precision store multiplied natively (``path`` ``"store"``) multiplies queries
    rounded to its dtype, and each block is rounded to it before multiplying the values;
    converted to float32 (``"float32"``) or widened in registers (``"widen"``) it multiplies
    the unrounded queries and blocks. Built by :meth:`rcdl.ops.entries.Entries.products`."""

    def __init__(self, q: Tensor, keys: Tensor, values: Tensor | None = None,
                 kernel: Kernel | None = None, tau: float = 1.0, *, plan: ProductPlan) -> None:
        self.plan = plan
        self.kernel, self.tau, self.dtype = kernel, tau, q.dtype
        # (B, key_dim), q itself if dtypes agree or the store is converted or widened
        self.q = q if self.upcast or self.widened else q.to(keys.dtype)
        # (B,) formed as the keys' are (each square in the queries' dtype)
        distance = kernel is None or kernel.distance
        self.q_sqnorm = row_sq_norms(self.q, q.dtype) if distance else None
        self.read_keys, self.read_values = Reader(q.dtype, self.upcast), Reader(q.dtype,
                                                                                self.upcast)

    @property
    def path(self) -> str:
        """The plan's product path: ``"store"``, ``"float32"`` or ``"widen"``."""
        return self.plan.path

    @property
    def upcast(self) -> bool:
        """Whether the store's chunks are converted to the queries' dtype (the plan's)."""
        return self.plan.upcast

    @property
    def widened(self) -> bool:
        """Whether the store's chunks are widened in registers (the plan's)."""
        return self.plan.widened

    def kernel_values(self, keys: Tensor, packed: Tensor | None = None,
                      k_sqnorm: Tensor | None = None) -> Tensor:  # (c, B)
        """Unweighted kernel values of one chunk ``keys (c, key_dim)`` (as read), in the
        queries' dtype; for a normalised kernel the raw logits ``z``. ``packed``: the keys
        packed for the score product (:mod:`rcdl.ops.packed`), which then runs from there (a
        ``(c, B)`` view of a ``(B, c)`` product); ``k_sqnorm``: the keys' squared norms, where
        kept."""
        kernel, q, dtype = self.kernel, self.q, self.dtype
        assert kernel is not None  # a plan for distances alone forms no kernel block
        if packed is not None:
            scores = packing.packed_product(q, packed).T.to(dtype)  # (c, B) view
            return _values(kernel, scores, self.q_sqnorm, keys, self.tau, dtype, k_sqnorm)
        if self.widened:
            scores, k_sqnorm = widen.scores(keys, q, sqnorm=kernel.distance)
            if kernel.distance:
                return kernel.values_(scores, self.q_sqnorm, keys, self.tau, dtype,
                                      k_sqnorm=k_sqnorm)
            return kernel.values_(scores, self.q_sqnorm, keys, self.tau, dtype)
        if keys.dtype in HALF_DTYPES and not self.plan.training:  # the layout note above
            scores = (q @ keys.T).T.to(dtype)  # (c, B) view of a (B, c) product
        else:
            scores = (keys @ q.T).to(dtype)  # (c, B), no copy when the dtypes agree
        return _values(kernel, scores, self.q_sqnorm, keys, self.tau, dtype, k_sqnorm)

    def dense(self, keys: Tensor) -> Tensor:  # (B, c)
        """The kernel's dense twin (:meth:`rcdl.ops.kernels.Kernel.dense`) between the
        queries and ``keys (c, key_dim)`` (as stored), on the numbers the products multiply
        (the queries rounded where the products round them), in the queries' dtype."""
        assert self.kernel is not None
        return self.kernel.dense(self.q.to(self.dtype), keys.to(self.dtype), self.tau)

    def pairs(self, rows: Tensor, keys: Tensor) -> Tensor:  # (P,)
        """The kernel's dense twin for pairs: query ``rows[p]`` against ``keys[p]``
        (``rows (P,)``, ``keys (P, key_dim)`` as stored), as :meth:`dense` forms them."""
        kernel, tau = self.kernel, self.tau
        assert kernel is not None
        if not len(rows):
            return keys.new_zeros(0, dtype=self.dtype)
        pair = torch.vmap(lambda a, b: kernel.dense(a[None], b[None], tau)[0, 0])
        return pair(self.q.to(self.dtype)[rows], keys.to(self.dtype))

    def sum_over_entries_(self, acc: Tensor, block: Tensor, rows: Tensor, alpha: float = 1.0,
                          packed: Tensor | None = None) -> Tensor:
        """``acc += alpha · blockᵀ @ rows`` (:func:`_sum_over_entries_`) as this call's
        products run it."""
        return _sum_over_entries_(acc, block, rows, alpha, self.widened, packed)

    def as_multiplied(self, block: Tensor, rows: Tensor) -> Tensor:
        """``block`` rounded as it is rounded before multiplying ``rows`` (as read): to their
        dtype and back where they are half and not widened; else ``block`` itself. A term
        formed from it is the term the output sums."""
        return _as_multiplied(block, rows, self.widened)

    def times_rows(self, left: Tensor, rows: Tensor) -> Tensor:  # (Q, d)
        """``left (Q, c) @ rows (c, d)`` in ``left``'s dtype, as the products multiply a
        block by the store's ``rows`` (as stored): rounded to their dtype and multiplied in
        it where they are half and multiplied as they lie, else on their copy in ``left``'s
        dtype."""
        if self.path == "store" and rows.dtype in HALF_DTYPES and rows.dtype != left.dtype:
            return (left.to(rows.dtype) @ rows).to(left.dtype)
        return left @ rows.to(left.dtype)


def _values(kernel: Kernel, scores: Tensor, q_sqnorm: Tensor | None, keys: Tensor, tau: float,
            dtype: torch.dtype, k_sqnorm: Tensor | None) -> Tensor:  # (c, B)
    """``kernel.values_``, handing over the keys' squared norms only where they are had (a
    kernel that is not a distance kernel need not take them, docs/architecture.md)."""
    if k_sqnorm is None:
        return kernel.values_(scores, q_sqnorm, keys, tau, dtype)
    return kernel.values_(scores, q_sqnorm, keys, tau, dtype, k_sqnorm=k_sqnorm)


def _sum_over_entries_(acc: Tensor, block: Tensor, rows: Tensor, alpha: float = 1.0,
                       widened: bool = False, packed: Tensor | None = None) -> Tensor:
    """``acc += alpha · blockᵀ @ rows``: ``acc (B, d)`` accumulates a chunk's ``block (c, B)``
    (in ``acc``'s dtype) times its store ``rows (c, d)``. The block is copied transposed into
    a contiguous ``(B, c)`` operand. For a half-precision store the product runs in the
    rows' dtype (the block rounded to it; the matrix unit accumulates in float32) and is added
    to ``acc`` in its dtype; ``widened`` bfloat16 rows are widened in registers instead
    (:mod:`rcdl.ops.widen`: the block is not rounded). ``packed``: the rows as
    :mod:`rcdl.ops.packed` packed them, multiplied from there (the same rounding of the
    block; the product's own float32 accumulation may run in another order)."""
    if widened:
        return widen.sum_over_entries_(acc, block, rows, alpha)
    left = block.T.to(rows.dtype, memory_format=torch.contiguous_format)  # (B, c)
    if packed is not None:
        return acc.add_(packing.packed_product(left, packed), alpha=alpha)
    if rows.dtype == acc.dtype:
        return acc.addmm_(left, rows, alpha=alpha)
    return acc.add_(left @ rows, alpha=alpha)


def _as_multiplied(block: Tensor, rows: Tensor, widened: bool = False) -> Tensor:  # (c, B)
    """``block`` rounded as :func:`_sum_over_entries_` rounds it before multiplying ``rows``
    (to their dtype, and back; not at all where they are ``widened``), so that a share
    formed from it is the term the output sums."""
    if widened or rows.dtype == block.dtype:
        return block
    return block.to(rows.dtype).to(block.dtype)


_NARROW = 32  # queries below which a block's per-query extremes are taken with max/min


def per_query(block: Tensor, largest: bool) -> Tensor:  # (B,)
    """The largest (else smallest) of a block ``(c, B)``'s entries, per query. For a block
    of fewer than 32 queries (a training batch) ATen's ``amax``/``amin`` over the outer
    dimension run several times slower than ``max``/``min``, which return the same numbers;
    from 32 on, ``amax``/``amin`` are as fast or faster (``benchmarks/bench_extremes.py``
    times both, on torch's AVX2 and AVX512 kernels alike)."""
    if block.shape[1] < _NARROW:
        return (block.max(dim=0) if largest else block.min(dim=0)).values
    return block.amax(dim=0) if largest else block.amin(dim=0)


# ------------------------------------------------------------------------------- folding
def fold_block(kernel: Kernel, part: Partial, block: Tensor, values: Tensor, weights: Tensor,
               widened: bool = False, packed: Tensor | None = None
               ) -> tuple[Partial, Tensor | None]:
    """Fold one chunk's block ``(c, B)`` of kernel values (softmax: logits) with its
    ``values (c, d_out)`` (as read) and ``weights (c,)`` into ``part``, in place:

    ``m' = max(m, max_j z_j)``, ``num' = e^{m − m'} num + Σ_j e^{z_j − m'} ṽ_j``, and ``den``,
    ``mass`` alike (softmax); ``num' = num + Σ_j w_j κ_j v_j`` (the others).

    A normalised kernel (the softmax) turns ``block`` into ``e^{z − m'}`` in place and
    returns ``m'``; the others leave it as it is. ``widened``: the values are bfloat16
    widened in registers; ``packed``: the values packed (:func:`_sum_over_entries_`)."""
    if not kernel.normalised:
        _sum_over_entries_(part.num, block * weights[:, None], values, widened=widened,
                           packed=packed)
        return part, None
    m_new = torch.maximum(part.m, per_query(block, largest=True))  # (B,)
    rescale = torch.exp(part.m - m_new)  # (B,), 0 where m was -inf
    block.sub_(m_new).exp_()
    _sum_over_entries_(part.num.mul_(rescale[:, None]), block, values, widened=widened,
                       packed=packed)
    den = part.den.mul_(rescale).add_(weights @ block)
    mass = part.mass.mul_(rescale).add_(weights.abs() @ block)
    return Partial(m_new, part.num, den, mass), m_new


def block_partial(phi: Tensor, values: Tensor, weights: Tensor, kernel: Kernel,
                  seen: Tensor | None = None, products: Products | None = None
                  ) -> Partial:
    """The partial over the entries ``values (c, d_out)``, ``weights (c,)`` (as stored),
    given their kernel values ``phi (Q, c)`` (normalised kernels: logits) for ``Q``
    queries; ``seen (Q, c)`` bool: which entries each query sees (``None``: all). The
    block's product with the values runs as ``products`` runs it
    (:meth:`Products.times_rows`; ``None``: in ``phi``'s dtype)."""
    times = (lambda left, rows: left @ rows.to(left.dtype)) if products is None else (
        products.times_rows)
    q = phi.shape[0]
    if not kernel.normalised:
        w = weights if seen is None else weights * seen
        return Partial(phi.new_zeros(q), times(phi * w, values), phi.new_zeros(q),
                       phi.new_zeros(q))
    if seen is not None:
        phi = phi.masked_fill(~seen, _NEG_INF)
    m = phi.max(1).values  # (Q,) -inf where a query sees none
    e = torch.exp(phi - torch.where(m == _NEG_INF, 0.0, m)[:, None])  # (Q, c)
    return Partial(m, times(e, values), e @ weights, e @ weights.abs())


def fold(part: Partial, phi: Tensor, values: Tensor, weights: Tensor, kernel: Kernel,
         seen: Tensor | None = None, products: Products | None = None) -> Partial:
    """``part`` with the entries of :func:`block_partial`'s arguments merged in."""
    if not kernel.normalised:  # nothing to rescale: the numerators add
        return part._replace(num=part.num + block_partial(phi, values, weights, kernel, seen,
                                                          products).num)
    return merge_partials(part, block_partial(phi, values, weights, kernel, seen, products))


# --------------------------------------------------------------------------- taking out
def take_out(part: Partial, rows: Tensor, phi: Tensor, values: Tensor, weights: Tensor,
             kernel: Kernel, products: Products | None = None) -> Partial:
    """``part`` (over ``B`` queries) with entries taken out, one pair at a time: pair ``p``
    takes the entry of kernel value ``phi[p]`` (softmax: logit), ``values[p] (d_out,)`` (as
    stored) and ``weights[p]`` out of query row ``rows[p]`` (``rows (P,)``). Returns a new
    partial with ``part``'s ``m``:

    ``num_b − Σ_{p: rows_p = b} e^{z_p − m_b} ṽ_p`` and ``den``, ``mass`` alike (softmax);
    ``num_b − Σ_p w_p κ_p v_p`` (the others). Each term's kernel factor is rounded as the
    ``products`` round it before multiplying the values (:meth:`Products.as_multiplied`;
    ``None``: not at all), so the term is the one the forward sums."""
    read = values if products is None else products.read_values(values)  # (P, d_out)
    values, weights = values.to(part.num.dtype), weights.to(part.num.dtype)
    if not kernel.normalised:  # the terms w_j κ_j v_j taken away
        factor = weights * phi  # (P,)
        if products is not None:
            factor = products.as_multiplied(factor, read)
        return part._replace(num=part.num.clone().index_add_(0, rows, -factor[:, None]
                                                             * values))
    e = (phi - part.m[rows]).exp()  # (P,) e^{z_j − m}
    factor = e if products is None else products.as_multiplied(e, read)
    num = part.num.clone().index_add_(0, rows, -factor[:, None] * values)
    den = part.den.clone().index_add_(0, rows, -weights * e)
    mass = part.mass.clone().index_add_(0, rows, -weights.abs() * e)
    return Partial(part.m, num, den, mass)


def without_each(part: Partial, projected: Tensor, phi: Tensor, along: Tensor,
                 weights: Tensor, eps: float) -> Tensor:  # (B, n)
    """``⟨u_b, s_{−j}(q_b)⟩`` for every query ``b`` and every entry ``j`` of a block, each
    taken out alone, from the softmax partial over all entries: ``(U_b − c_bj) /
    g(D_b − w_j e_bj, A_b − |w_j| e_bj)`` with ``e_bj = e^{z_bj − m_b}`` (``phi (B, n)``:
    the logits), ``c_bj = e_bj ⟨u_b, ṽ_j⟩`` (``along (B, n)``: ``⟨u_b, ṽ_j⟩``),
    ``U_b = ⟨u_b, num_b⟩`` (``projected (B, 1)``) and ``g`` the denominator's guard."""
    e = (phi - part.m[:, None]).exp()  # (B, n)
    w = weights.to(phi.dtype)[None, :]  # (1, n)
    c = e * along  # (B, n)
    den = guard_denominator(part.den[:, None] - w * e, part.mass[:, None] - w.abs() * e, eps)
    return (projected - c) / den
