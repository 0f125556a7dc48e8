"""The Triton kernels of :mod:`rcdl.ops.triton_attention`, which states their maths, chooses
their blocks and launches them. This module imports triton, so it is imported on first use
only (``TRITON_INTERPRET`` is read when the kernels below are defined).

Names: ``b`` indexes queries, ``j`` entries; a block of scores is ``(BLOCK_B, BLOCK_N)``,
query-major. Every product and sum runs in the queries' dtype (``q_ptr``'s: float32 or
float64): a tile of a half-precision store is converted to it as it is loaded, and float32
products are exact float32 (``input_precision="ieee"``, no TF32). Row offsets into the store
are int64 (a store may hold more than 2³¹ numbers). Every accumulator is a register tile of
one program; no program reads what another writes.
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
        if KERNEL == RBF:
            phi = tl.exp(-sq / (2.0 * tau))
        else:
            phi = tl.exp(-tl.sqrt(tl.maximum(sq, 0.0)) / tau)
    return phi, sq


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
def attention_forward(q_ptr, k_ptr, v_ptr, w_ptr, stats_ptr, num_ptr, B, N, D, DV, ROWS, tau,
                      KERNEL: tl.constexpr, DISTANCE: tl.constexpr, BLOCK_B: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    """The partial ``(m, num, den, mass)`` of one split of the entries (rows
    ``[s·ROWS, (s+1)·ROWS)``) for one block of queries and one block of value columns;
    grid ``(value-column blocks, splits, query blocks)``. Writes ``m, den, mass`` to
    ``stats_ptr (3, S, B)`` (the first column block) and ``num`` to ``num_ptr (S, B, DV)``.
    The softmax folds each block of entries with the log-sum-exp rescaling."""
    col_block, split, q_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_splits = tl.num_programs(1)
    dtype = q_ptr.dtype.element_ty
    q_rows = q_block * BLOCK_B + tl.arange(0, BLOCK_B)
    q_mask = q_rows < B
    cols = col_block * BLOCK_V + tl.arange(0, BLOCK_V)
    in_cols = cols < DV
    q_sq = tl.zeros((BLOCK_B,), dtype)
    if DISTANCE:
        q_sq = _sq_norms(q_ptr, q_rows, q_mask, D, BLOCK_B, BLOCK_D)
    if KERNEL == SOFTMAX:
        m = tl.full((BLOCK_B,), float("-inf"), dtype)
    else:
        m = tl.zeros((BLOCK_B,), dtype)
    den = tl.zeros((BLOCK_B,), dtype)
    mass = tl.zeros((BLOCK_B,), dtype)
    num = tl.zeros((BLOCK_B, BLOCK_V), dtype)
    first = split * ROWS
    end = tl.minimum(first + ROWS, N)
    for start in range(first, end, BLOCK_N):
        k_rows = start + tl.arange(0, BLOCK_N)
        k_mask = k_rows < end
        phi, _ = _kernel_values(q_ptr, k_ptr, q_rows, q_mask, q_sq, k_rows, k_mask, D, tau,
                                KERNEL, DISTANCE, BLOCK_B, BLOCK_N, BLOCK_D)
        w = tl.load(w_ptr + k_rows, mask=k_mask, other=0.0)  # (BLOCK_N,)
        if KERNEL == SOFTMAX:
            z = tl.where(k_mask[None, :], phi, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: the block has an entry
            rescale = tl.exp(m - m_new)  # 0 on the first block (m = −inf)
            p = tl.exp(z - m_new[:, None])  # e^{z − m_new}, 0 outside the block
            den = den * rescale + tl.sum(p * w[None, :], axis=1)
            mass = mass * rescale + tl.sum(p * tl.abs(w)[None, :], axis=1)
            num = num * rescale[:, None]
            m = m_new
        else:
            p = tl.where(k_mask[None, :], phi * w[None, :], 0.0)  # w_j φ_bj
        vt = tl.load(v_ptr + k_rows.to(tl.int64)[:, None] * DV + cols[None, :],
                     mask=k_mask[:, None] & in_cols[None, :], other=0.0).to(dtype)
        num += tl.dot(p, vt, input_precision="ieee")
    tl.store(num_ptr + (split * B + q_rows)[:, None].to(tl.int64) * DV + cols[None, :], num,
             mask=q_mask[:, None] & in_cols[None, :])
    if col_block == 0:
        tl.store(stats_ptr + split * B + q_rows, m, mask=q_mask)
        tl.store(stats_ptr + (n_splits + split) * B + q_rows, den, mask=q_mask)
        tl.store(stats_ptr + (2 * n_splits + split) * B + q_rows, mass, mask=q_mask)


@triton.jit
def attention_grad_queries(q_ptr, k_ptr, v_ptr, w_ptr, g_ptr, stats_ptr, out_ptr,
                           B, N, D, DV, ROWS, tau, scale, KERNEL: tl.constexpr,
                           DISTANCE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    """One split's share of ``∂L/∂q`` for one block of queries and one block of key columns,
    ``scale Σ_j c_bj k_j`` (distance kernels: ``− scale q_b Σ_j c_bj``), into
    ``out_ptr (S, B, D)``; grid ``(key-column blocks, splits, query blocks)``."""
    col_block, split, q_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dtype = q_ptr.dtype.element_ty
    q_rows = q_block * BLOCK_B + tl.arange(0, BLOCK_B)
    q_mask = q_rows < B
    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    in_cols = cols < D
    q_sq = tl.zeros((BLOCK_B,), dtype)
    if DISTANCE:
        q_sq = _sq_norms(q_ptr, q_rows, q_mask, D, BLOCK_B, BLOCK_D)
    grad = tl.zeros((BLOCK_B, BLOCK_D), dtype)
    c_sum = tl.zeros((BLOCK_B,), dtype)  # Σ_j c_bj (distance kernels)
    first = split * ROWS
    end = tl.minimum(first + ROWS, N)
    for start in range(first, end, BLOCK_N):
        k_rows = start + tl.arange(0, BLOCK_N)
        k_mask = k_rows < end
        phi, sq = _kernel_values(q_ptr, k_ptr, q_rows, q_mask, q_sq, k_rows, k_mask, D, tau,
                                 KERNEL, DISTANCE, BLOCK_B, BLOCK_N, BLOCK_D)
        gv = _values_dot_grads(v_ptr, g_ptr, q_rows, q_mask, k_rows, k_mask, DV,
                               BLOCK_B, BLOCK_N, BLOCK_V)
        w = tl.load(w_ptr + k_rows, mask=k_mask, other=0.0)
        _, c, _ = _coefficients(phi, sq, gv, w, stats_ptr, q_rows, q_mask, k_mask, B, KERNEL)
        kt = tl.load(k_ptr + k_rows.to(tl.int64)[:, None] * D + cols[None, :],
                     mask=k_mask[:, None] & in_cols[None, :], other=0.0).to(dtype)
        grad += tl.dot(c, kt, input_precision="ieee")
        c_sum += tl.sum(c, axis=1)
    grad = grad * scale
    if DISTANCE:  # the −q part of ∂‖q − k‖²
        qt = tl.load(q_ptr + q_rows[:, None] * D + cols[None, :],
                     mask=q_mask[:, None] & in_cols[None, :], other=0.0)
        grad -= qt * (c_sum * scale)[:, None]
    tl.store(out_ptr + (split * B + q_rows)[:, None].to(tl.int64) * D + cols[None, :], grad,
             mask=q_mask[:, None] & in_cols[None, :])


@triton.jit
def attention_grad_entries(q_ptr, k_ptr, v_ptr, w_ptr, g_ptr, stats_ptr,
                           grad_k_ptr, grad_v_ptr, grad_w_ptr, B, N, D, DV, tau, scale,
                           KERNEL: tl.constexpr, DISTANCE: tl.constexpr, NEED_K: tl.constexpr,
                           NEED_V: tl.constexpr, NEED_W: tl.constexpr, BLOCK_B: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    """``∂L/∂k_j`` (key columns ``[c·BLOCK_D, (c+1)·BLOCK_D)``), ``∂L/∂v_j`` (value columns
    ``[c·BLOCK_V, (c+1)·BLOCK_V)``) and, for ``c = 0``, ``∂L/∂w_j``, for one block of entries,
    summed over all the queries; grid ``(column blocks c, entry blocks)``. ``∂L/∂k_j =
    scale Σ_b c_bj q_b`` (distance kernels: ``− scale k_j Σ_b c_bj``), ``∂L/∂v_j =
    Σ_b p_bj g_b``, ``∂L/∂w_j = Σ_b dw_bj``. Written in the queries' dtype."""
    col_block, n_block = tl.program_id(0), tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    k_rows = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = k_rows < N
    k_offsets = k_rows.to(tl.int64)
    key_cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    in_key_cols = key_cols < D
    value_cols = col_block * BLOCK_V + tl.arange(0, BLOCK_V)
    in_value_cols = value_cols < DV
    w = tl.load(w_ptr + k_rows, mask=k_mask, other=0.0)
    grad_k = tl.zeros((BLOCK_N, BLOCK_D), dtype)
    grad_v = tl.zeros((BLOCK_N, BLOCK_V), dtype)
    grad_w = tl.zeros((BLOCK_N,), dtype)
    c_sum = tl.zeros((BLOCK_N,), dtype)  # Σ_b c_bj (distance kernels)
    for q_start in range(0, B, BLOCK_B):
        q_rows = q_start + tl.arange(0, BLOCK_B)
        q_mask = q_rows < B
        q_sq = tl.zeros((BLOCK_B,), dtype)
        if DISTANCE:
            q_sq = _sq_norms(q_ptr, q_rows, q_mask, D, BLOCK_B, BLOCK_D)
        phi, sq = _kernel_values(q_ptr, k_ptr, q_rows, q_mask, q_sq, k_rows, k_mask, D, tau,
                                 KERNEL, DISTANCE, BLOCK_B, BLOCK_N, BLOCK_D)
        gv = _values_dot_grads(v_ptr, g_ptr, q_rows, q_mask, k_rows, k_mask, DV,
                               BLOCK_B, BLOCK_N, BLOCK_V)
        p, c, dw = _coefficients(phi, sq, gv, w, stats_ptr, q_rows, q_mask, k_mask, B, KERNEL)
        if NEED_K:
            qt = tl.load(q_ptr + q_rows[:, None] * D + key_cols[None, :],
                         mask=q_mask[:, None] & in_key_cols[None, :], other=0.0)
            grad_k += tl.dot(tl.trans(c), qt, input_precision="ieee")
            c_sum += tl.sum(c, axis=0)
        if NEED_V:
            gt = tl.load(g_ptr + q_rows[:, None] * DV + value_cols[None, :],
                         mask=q_mask[:, None] & in_value_cols[None, :], other=0.0)
            grad_v += tl.dot(tl.trans(p), gt, input_precision="ieee")
        if NEED_W:
            grad_w += tl.sum(dw, axis=0)
    if NEED_K:
        grad_k = grad_k * scale
        if DISTANCE:  # the −k part of ∂‖q − k‖²
            kt = tl.load(k_ptr + k_offsets[:, None] * D + key_cols[None, :],
                         mask=k_mask[:, None] & in_key_cols[None, :], other=0.0).to(dtype)
            grad_k -= kt * (c_sum * scale)[:, None]
        tl.store(grad_k_ptr + k_offsets[:, None] * D + key_cols[None, :], grad_k,
                 mask=k_mask[:, None] & in_key_cols[None, :])
    if NEED_V:
        tl.store(grad_v_ptr + k_offsets[:, None] * DV + value_cols[None, :], grad_v,
                 mask=k_mask[:, None] & in_value_cols[None, :])
    if NEED_W and col_block == 0:
        tl.store(grad_w_ptr + k_rows, grad_w, mask=k_mask)
