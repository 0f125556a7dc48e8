"""The Triton kernels of :mod:`rcdl.ops.triton_attention`, which states their maths, chooses
their blocks and launches them. This module imports triton, so it is imported on first use
only (``TRITON_INTERPRET`` is read when the kernels below are defined).

Names: ``b`` indexes queries, ``j`` entries; a block of scores is ``(BLOCK_B, BLOCK_N)``,
query-major. Every product and sum runs in the queries' dtype (``q_ptr``'s: float32 or
float64): a tile of a half-precision store is converted to it as it is loaded, and float32
products are exact float32 (``input_precision="ieee"``, no TF32). Row offsets into the store
are int64 (a store may hold more than 2³¹ numbers). Every accumulator is a register tile of
one program. A program may write a scratch tensor of ``(B, N)`` coefficients (a score, a
probability) and read it back after a barrier; no program reads what another program writes
within a launch. Each kernel's docstring says how often it reads each row of the keys and the
values: :mod:`rcdl.ops.triton_traffic` models every load and store of every launch, and
tests/test_triton_traffic.py counts them under the interpreter.
"""

import triton
import triton.language as tl

# the kernels' codes (rcdl.ops.triton_attention.KERNEL_CODES)
LINEAR = tl.constexpr(0)
RBF = tl.constexpr(1)
LAPLACIAN = tl.constexpr(2)
SOFTMAX = tl.constexpr(3)


@triton.jit
def _sq_norms(q_ptr, q_rows, q_mask, D, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """``‖q_b‖²`` for a block of query rows: ``(BLOCK_B,)``."""
    acc = tl.zeros((BLOCK_B,), q_ptr.dtype.element_ty)
    for c in range(0, D, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        qt = tl.load(q_ptr + q_rows[:, None] * D + cols[None, :],
                     mask=q_mask[:, None] & (cols < D)[None, :], other=0.0)
        acc += tl.sum(qt * qt, axis=1)
    return acc


@triton.jit
def _kernel_values(q_ptr, k_ptr, q_rows, q_mask, q_sq, k_rows, k_mask, D, tau,
                   KERNEL: tl.constexpr, DISTANCE: tl.constexpr, BLOCK_B: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The block's kernel values ``φ_bj`` (the softmax: logits ``z_bj = ⟨q_b, k_j⟩ / τ``) and
    ``‖q_b − k_j‖²`` (distance kernels; else zeros), both ``(BLOCK_B, BLOCK_N)``: the dot
    products over the key dimension in chunks of ``BLOCK_D``, then the kernel's formula."""
    dtype = q_ptr.dtype.element_ty
    dots = tl.zeros((BLOCK_B, BLOCK_N), dtype)
    k_sq = tl.zeros((BLOCK_N,), dtype)
    k_offsets = k_rows.to(tl.int64) * D
    for c in range(0, D, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        in_cols = cols < D
        qt = tl.load(q_ptr + q_rows[:, None] * D + cols[None, :],
                     mask=q_mask[:, None] & in_cols[None, :], other=0.0)  # (BLOCK_B, BLOCK_D)
        kt = tl.load(k_ptr + k_offsets[:, None] + cols[None, :],
                     mask=k_mask[:, None] & in_cols[None, :], other=0.0).to(dtype)
        dots += tl.dot(qt, tl.trans(kt), input_precision="ieee")
        if DISTANCE:
            k_sq += tl.sum(kt * kt, axis=1)
    sq = tl.zeros((BLOCK_B, BLOCK_N), dtype)
    if KERNEL == LINEAR:
        phi = dots
    elif KERNEL == SOFTMAX:
        phi = dots / tau
    else:
        sq = q_sq[:, None] - 2.0 * dots + k_sq[None, :]  # ‖q − k‖²
        phi = _phi(sq, tau, KERNEL)
    return phi, sq


@triton.jit
def _phi(arg, tau, KERNEL: tl.constexpr):
    """The kernel values from the block's argument: ``⟨q, k⟩`` (linear), the logits
    ``z = ⟨q, k⟩ / τ`` (softmax, returned as they are) or ``‖q − k‖²`` (distance kernels),
    the number the scratch of scores keeps per pair."""
    if KERNEL == RBF:
        phi = tl.exp(-arg / (2.0 * tau))
    elif KERNEL == LAPLACIAN:
        phi = tl.exp(-tl.sqrt(tl.maximum(arg, 0.0)) / tau)
    else:
        phi = arg
    return phi


@triton.jit
def _values_dot_grads(v_ptr, g_ptr, q_rows, q_mask, k_rows, k_mask, DV,
                      BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """``⟨g_b, v_j⟩`` for the block: ``(BLOCK_B, BLOCK_N)``, over the value columns in chunks."""
    dtype = g_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype)
    v_offsets = k_rows.to(tl.int64) * DV
    for c in range(0, DV, BLOCK_V):
        cols = c + tl.arange(0, BLOCK_V)
        in_cols = cols < DV
        gt = tl.load(g_ptr + q_rows[:, None] * DV + cols[None, :],
                     mask=q_mask[:, None] & in_cols[None, :], other=0.0)  # (BLOCK_B, BLOCK_V)
        vt = tl.load(v_ptr + v_offsets[:, None] + cols[None, :],
                     mask=k_mask[:, None] & in_cols[None, :], other=0.0).to(dtype)
        acc += tl.dot(gt, tl.trans(vt), input_precision="ieee")
    return acc


@triton.jit
def _coefficients(phi, sq, gv, w, stats_ptr, q_rows, q_mask, k_mask, B, KERNEL: tl.constexpr):
    """Per pair of the block, from its kernel values ``phi`` (logits for the softmax), squared
    distances ``sq``, ``gv = ⟨g_b, v_j⟩`` and the entries' weights ``w``:

    - ``p``: the coefficient of ``v_j`` in the output ``s_b`` (``∂L/∂v_j = Σ_b p_bj g_b``),
    - ``c``: ``∂L/∂(the kernel's argument)``, over its ``scale`` (``∂L/∂q_b = scale Σ_j c_bj k_j``
      and for distance kernels ``− scale q_b Σ_j c_bj``),
    - ``dw``: the pair's term of ``∂L/∂w_j = Σ_b dw_bj``,

    zero outside the block's valid rows. The softmax reads per query ``m``, ``1/D'``,
    ``⟨g, s⟩`` where the guard did not act, and ``eps·sign(D')·⟨g, s⟩`` where it did, rows
    ``0..3`` of ``stats_ptr (4, B)``."""
    valid = q_mask[:, None] & k_mask[None, :]
    if KERNEL == SOFTMAX:
        m = tl.load(stats_ptr + q_rows, mask=q_mask, other=0.0)
        inv_den = tl.load(stats_ptr + B + q_rows, mask=q_mask, other=0.0)
        gs_w = tl.load(stats_ptr + 2 * B + q_rows, mask=q_mask, other=0.0)
        gs_abs = tl.load(stats_ptr + 3 * B + q_rows, mask=q_mask, other=0.0)
        a = tl.where(valid, tl.exp(phi - m[:, None]) * inv_den[:, None], 0.0)  # attention
        sign_w = tl.where(w > 0, 1.0, tl.where(w < 0, -1.0, 0.0))
        p = a
        c = a * (gv - w[None, :] * gs_w[:, None] - tl.abs(w)[None, :] * gs_abs[:, None])
        dw = -a * (gs_w[:, None] + sign_w[None, :] * gs_abs[:, None])
    else:
        phi = tl.where(valid, phi, 0.0)
        p = phi * w[None, :]
        dw = phi * gv
        c = w[None, :] * gv  # ∂L/∂φ
        if KERNEL == RBF:  # ∂φ/∂⟨q, k⟩ = φ / τ
            c = c * phi
        elif KERNEL == LAPLACIAN:  # ∂φ/∂⟨q, k⟩ = φ / (τ ‖q − k‖), 0 at q = k
            dist = tl.sqrt(tl.maximum(sq, 0.0))
            c = tl.where(dist > 0, c * phi / tl.where(dist > 0, dist, 1.0), 0.0)
        c = tl.where(valid, c, 0.0)
    return p, c, dw


@triton.jit
def attention_forward(q_ptr, k_ptr, v_ptr, w_ptr, scores_ptr, stats_ptr, num_ptr,
                      B, N, D, DV, ROWS, tau, KERNEL: tl.constexpr, DISTANCE: tl.constexpr,
                      BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """The partial ``(m, num, den, mass)`` of one split of the entries (rows
    ``[s·ROWS, (s+1)·ROWS)``) for one block of queries, over every value column; grid
    ``(query blocks, splits)`` (the query blocks of a split side by side, so that their reads
    of its rows meet in L2). Two passes over the split's blocks of entries:

    1. the scores over the full key width (the dot products in chunks of ``BLOCK_D``
       columns): for the softmax the logits ``z_bj`` with the split's ``m``, ``den`` and
       ``mass`` folded block by block with the log-sum-exp rescaling; each block's kernel
       argument (:func:`_phi`: ``z_bj``, ``⟨q_b, k_j⟩`` or ``‖q_b − k_j‖²``) goes to the
       program's own columns of ``scores_ptr (B, N)``, which the backward may read again;
    2. after a barrier, per chunk of ``BLOCK_V`` value columns, ``num_b = Σ_j p_bj v_j``
       with ``p_bj = e^{z_bj − m_b}`` for the softmax (its weights are in ``ṽ``), else
       ``w_j φ_bj``, the scores read back from the scratch.

    Each row of the keys and of the values is read once per block of queries (the weights
    once more per chunk of value columns, but for the softmax). Writes
    ``m, den, mass`` to ``stats_ptr (3, S, B)`` and ``num`` to ``num_ptr (S, B, DV)``."""
    q_block, split = tl.program_id(0), tl.program_id(1)
    n_splits = tl.num_programs(1)
    dtype = q_ptr.dtype.element_ty
    q_rows = q_block * BLOCK_B + tl.arange(0, BLOCK_B)
    q_mask = q_rows < B
    scores_rows = q_rows.to(tl.int64)[:, None] * N
    q_sq = tl.zeros((BLOCK_B,), dtype)
    if DISTANCE:
        q_sq = _sq_norms(q_ptr, q_rows, q_mask, D, BLOCK_B, BLOCK_D)
    if KERNEL == SOFTMAX:
        m = tl.full((BLOCK_B,), float("-inf"), dtype)
    else:
        m = tl.zeros((BLOCK_B,), dtype)
    den = tl.zeros((BLOCK_B,), dtype)
    mass = tl.zeros((BLOCK_B,), dtype)
    first = split * ROWS
    end = tl.minimum(first + ROWS, N)
    for start in range(first, end, BLOCK_N):  # pass 1: the scores, each key row read once
        k_rows = start + tl.arange(0, BLOCK_N)
        k_mask = k_rows < end
        phi, sq = _kernel_values(q_ptr, k_ptr, q_rows, q_mask, q_sq, k_rows, k_mask, D, tau,
                                 KERNEL, DISTANCE, BLOCK_B, BLOCK_N, BLOCK_D)
        if KERNEL == SOFTMAX:
            w = tl.load(w_ptr + k_rows, mask=k_mask, other=0.0)  # (BLOCK_N,)
            z = tl.where(k_mask[None, :], phi, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: the block has an entry
            rescale = tl.exp(m - m_new)  # 0 on the first block (m = −inf)
            p = tl.exp(z - m_new[:, None])  # e^{z − m_new}, 0 outside the block
            den = den * rescale + tl.sum(p * w[None, :], axis=1)
            mass = mass * rescale + tl.sum(p * tl.abs(w)[None, :], axis=1)
            m = m_new
        kept = sq if DISTANCE else phi
        tl.store(scores_ptr + scores_rows + k_rows[None, :], kept,
                 mask=q_mask[:, None] & k_mask[None, :])
    tl.debug_barrier()  # the scratch written above is read below by other threads
    for c in range(0, DV, BLOCK_V):  # pass 2: the values, each row read once
        cols = c + tl.arange(0, BLOCK_V)
        in_cols = cols < DV
        num = tl.zeros((BLOCK_B, BLOCK_V), dtype)
        for start in range(first, end, BLOCK_N):
            k_rows = start + tl.arange(0, BLOCK_N)
            k_mask = k_rows < end
            valid = q_mask[:, None] & k_mask[None, :]
            kept = tl.load(scores_ptr + scores_rows + k_rows[None, :], mask=valid, other=0.0)
            if KERNEL == SOFTMAX:
                p = tl.where(valid, tl.exp(kept - m[:, None]), 0.0)
            else:  # w_j φ_bj
                w = tl.load(w_ptr + k_rows, mask=k_mask, other=0.0)
                p = tl.where(valid, _phi(kept, tau, KERNEL) * w[None, :], 0.0)
            vt = tl.load(v_ptr + k_rows.to(tl.int64)[:, None] * DV + cols[None, :],
                         mask=k_mask[:, None] & in_cols[None, :], other=0.0).to(dtype)
            num += tl.dot(p, vt, input_precision="ieee")
        tl.store(num_ptr + (split * B + q_rows)[:, None].to(tl.int64) * DV + cols[None, :],
                 num, mask=q_mask[:, None] & in_cols[None, :])
    tl.store(stats_ptr + split * B + q_rows, m, mask=q_mask)
    tl.store(stats_ptr + (n_splits + split) * B + q_rows, den, mask=q_mask)
    tl.store(stats_ptr + (2 * n_splits + split) * B + q_rows, mass, mask=q_mask)


@triton.jit
def attention_grad_queries(q_ptr, k_ptr, v_ptr, w_ptr, g_ptr, stats_ptr, scores_ptr, c_ptr,
                           p_ptr, dw_ptr, out_ptr, B, N, D, DV, ROWS, tau, scale,
                           KERNEL: tl.constexpr, DISTANCE: tl.constexpr, SAVED: tl.constexpr,
                           NEED_Q: tl.constexpr, NEED_K: tl.constexpr,
                           NEED_V: tl.constexpr, NEED_W: tl.constexpr, SHARES: tl.constexpr,
                           BLOCK_B: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    """The backward's coefficients of one split of the entries for one block of queries, and
    that split's share of ``∂L/∂q``; grid ``(query blocks, splits)``. Two passes:

    1. per block of entries, the scores (``SAVED``: read from ``scores_ptr (B, N)``, where
       :func:`attention_forward` left them; else over the full key width) and
       ``gv = ⟨g_b, v_j⟩`` over the full value width, then :func:`_coefficients`: ``c``
       (to ``c_ptr (B, N)`` where ``NEED_Q`` or ``NEED_K``), ``p`` (to ``p_ptr (B, N)``
       where ``NEED_V``; with ``SHARES``, ``p_bj gv_bj`` instead: the entries' shares of the
       output projected on ``g``) and ``dw`` (to ``dw_ptr (B, N)`` where ``NEED_W``), for
       :func:`attention_grad_entries`;
    2. where ``NEED_Q``, after a barrier, per chunk of ``BLOCK_D`` key columns,
       ``scale Σ_j c_bj k_j`` (distance kernels: ``− scale q_b Σ_j c_bj``) into
       ``out_ptr (S, B, D)``.

    Each row of the values is read once per block of queries, each row of the keys once
    where ``NEED_Q`` and once more unless ``SAVED``: with the forward's scores kept and only
    the query gradient asked for, the backward reads the store once."""
    q_block, split = tl.program_id(0), tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    q_rows = q_block * BLOCK_B + tl.arange(0, BLOCK_B)
    q_mask = q_rows < B
    coef_rows = q_rows.to(tl.int64)[:, None] * N
    q_sq = tl.zeros((BLOCK_B,), dtype)
    if DISTANCE and not SAVED:
        q_sq = _sq_norms(q_ptr, q_rows, q_mask, D, BLOCK_B, BLOCK_D)
    c_sum = tl.zeros((BLOCK_B,), dtype)  # Σ_j c_bj (distance kernels)
    first = split * ROWS
    end = tl.minimum(first + ROWS, N)
    for start in range(first, end, BLOCK_N):  # pass 1: the coefficients
        k_rows = start + tl.arange(0, BLOCK_N)
        k_mask = k_rows < end
        valid = q_mask[:, None] & k_mask[None, :]
        if SAVED:
            arg = tl.load(scores_ptr + coef_rows + k_rows[None, :], mask=valid, other=0.0)
            phi = _phi(arg, tau, KERNEL)
            sq = arg if DISTANCE else tl.zeros((BLOCK_B, BLOCK_N), dtype)
        else:
            phi, sq = _kernel_values(q_ptr, k_ptr, q_rows, q_mask, q_sq, k_rows, k_mask, D,
                                     tau, KERNEL, DISTANCE, BLOCK_B, BLOCK_N, BLOCK_D)
        gv = _values_dot_grads(v_ptr, g_ptr, q_rows, q_mask, k_rows, k_mask, DV,
                               BLOCK_B, BLOCK_N, BLOCK_V)
        w = tl.load(w_ptr + k_rows, mask=k_mask, other=0.0)
        p, c, dw = _coefficients(phi, sq, gv, w, stats_ptr, q_rows, q_mask, k_mask, B, KERNEL)
        if NEED_Q or NEED_K:
            tl.store(c_ptr + coef_rows + k_rows[None, :], c, mask=valid)
        if NEED_V:
            tl.store(p_ptr + coef_rows + k_rows[None, :], p * gv if SHARES else p, mask=valid)
        if NEED_W:
            tl.store(dw_ptr + coef_rows + k_rows[None, :], dw, mask=valid)
        c_sum += tl.sum(c, axis=1)
    if NEED_Q:
        tl.debug_barrier()  # the scratch written above is read below by other threads
        for col in range(0, D, BLOCK_D):  # pass 2: ∂L/∂q, each key row read once more
            cols = col + tl.arange(0, BLOCK_D)
            in_cols = cols < D
            grad = tl.zeros((BLOCK_B, BLOCK_D), dtype)
            for start in range(first, end, BLOCK_N):
                k_rows = start + tl.arange(0, BLOCK_N)
                k_mask = k_rows < end
                c = tl.load(c_ptr + coef_rows + k_rows[None, :],
                            mask=q_mask[:, None] & k_mask[None, :], other=0.0)
                kt = tl.load(k_ptr + k_rows.to(tl.int64)[:, None] * D + cols[None, :],
                             mask=k_mask[:, None] & in_cols[None, :], other=0.0).to(dtype)
                grad += tl.dot(c, kt, input_precision="ieee")
            grad = grad * scale
            if DISTANCE:  # the −q part of ∂‖q − k‖²
                qt = tl.load(q_ptr + q_rows[:, None] * D + cols[None, :],
                             mask=q_mask[:, None] & in_cols[None, :], other=0.0)
                grad -= qt * (c_sum * scale)[:, None]
            tl.store(out_ptr + (split * B + q_rows)[:, None].to(tl.int64) * D + cols[None, :],
                     grad, mask=q_mask[:, None] & in_cols[None, :])


@triton.jit
def attention_grad_entries(q_ptr, k_ptr, g_ptr, c_ptr, p_ptr, dw_ptr,
                           grad_k_ptr, grad_v_ptr, grad_w_ptr, B, N, D, DV, scale,
                           DISTANCE: tl.constexpr, NEED_K: tl.constexpr, NEED_V: tl.constexpr,
                           NEED_W: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    """``∂L/∂k_j``, ``∂L/∂v_j`` and ``∂L/∂w_j`` for one block of entries, summed over all the
    queries, from the coefficients :func:`attention_grad_queries` wrote (``c``, ``p``, ``dw``,
    each ``(B, N)``); grid ``(entry blocks,)``. ``∂L/∂k_j = scale Σ_b c_bj q_b`` (distance
    kernels: ``− scale k_j Σ_b c_bj``) per chunk of ``BLOCK_D`` key columns,
    ``∂L/∂v_j = Σ_b p_bj g_b`` per chunk of ``BLOCK_V`` value columns,
    ``∂L/∂w_j = Σ_b dw_bj``. The values are not read; the keys are read once by the distance
    kernels (for their ``−k_j`` part) and not at all by the others. Accumulated in the
    queries' dtype, written in the gradients' (the store's: a half store's gradients rounded
    to nearest as they are stored)."""
    n_block = tl.program_id(0)
    dtype = q_ptr.dtype.element_ty
    k_rows = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = k_rows < N
    k_offsets = k_rows.to(tl.int64)
    if NEED_K:
        c_sum = tl.zeros((BLOCK_N,), dtype)  # Σ_b c_bj, complete after the first chunk
        for col in range(0, D, BLOCK_D):
            key_cols = col + tl.arange(0, BLOCK_D)
            in_key_cols = key_cols < D
            grad_k = tl.zeros((BLOCK_N, BLOCK_D), dtype)
            for q_start in range(0, B, BLOCK_B):
                q_rows = q_start + tl.arange(0, BLOCK_B)
                q_mask = q_rows < B
                c = tl.load(c_ptr + q_rows.to(tl.int64)[:, None] * N + k_rows[None, :],
                            mask=q_mask[:, None] & k_mask[None, :], other=0.0)
                qt = tl.load(q_ptr + q_rows[:, None] * D + key_cols[None, :],
                             mask=q_mask[:, None] & in_key_cols[None, :], other=0.0)
                grad_k += tl.dot(tl.trans(c), qt, input_precision="ieee")
                if col == 0:
                    c_sum += tl.sum(c, axis=0)
            grad_k = grad_k * scale
            if DISTANCE:  # the −k part of ∂‖q − k‖²
                kt = tl.load(k_ptr + k_offsets[:, None] * D + key_cols[None, :],
                             mask=k_mask[:, None] & in_key_cols[None, :], other=0.0).to(dtype)
                grad_k -= kt * (c_sum * scale)[:, None]
            tl.store(grad_k_ptr + k_offsets[:, None] * D + key_cols[None, :],
                     grad_k.to(grad_k_ptr.dtype.element_ty),
                     mask=k_mask[:, None] & in_key_cols[None, :])
    if NEED_V:
        for col in range(0, DV, BLOCK_V):
            value_cols = col + tl.arange(0, BLOCK_V)
            in_value_cols = value_cols < DV
            grad_v = tl.zeros((BLOCK_N, BLOCK_V), dtype)
            for q_start in range(0, B, BLOCK_B):
                q_rows = q_start + tl.arange(0, BLOCK_B)
                q_mask = q_rows < B
                p = tl.load(p_ptr + q_rows.to(tl.int64)[:, None] * N + k_rows[None, :],
                            mask=q_mask[:, None] & k_mask[None, :], other=0.0)
                gt = tl.load(g_ptr + q_rows[:, None] * DV + value_cols[None, :],
                             mask=q_mask[:, None] & in_value_cols[None, :], other=0.0)
                grad_v += tl.dot(tl.trans(p), gt, input_precision="ieee")
            tl.store(grad_v_ptr + k_offsets[:, None] * DV + value_cols[None, :],
                     grad_v.to(grad_v_ptr.dtype.element_ty),
                     mask=k_mask[:, None] & in_value_cols[None, :])
    if NEED_W:
        grad_w = tl.zeros((BLOCK_N,), dtype)
        for q_start in range(0, B, BLOCK_B):
            q_rows = q_start + tl.arange(0, BLOCK_B)
            q_mask = q_rows < B
            dw = tl.load(dw_ptr + q_rows.to(tl.int64)[:, None] * N + k_rows[None, :],
                         mask=q_mask[:, None] & k_mask[None, :], other=0.0)
            grad_w += tl.sum(dw, axis=0)
        tl.store(grad_w_ptr + k_rows, grad_w, mask=k_mask)
