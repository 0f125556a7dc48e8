"""The numba kernels of :mod:`rcdl.ops.widen` (imported by it on first use, after it has
chosen the CPU numba compiles for). Module-level functions, so that numba's on-disk cache
finds them again in the next process."""

import functools

import numba
import numpy as np

_ROWS = 4  # rows widened together: 4 float32 rows of width 1 024 are 16 KiB, within L1
_SUM_ROWS = 8  # rows summed into the accumulator at once
_COLUMNS = 256  # columns of a strip of rows widened at once in sum_kernel (8 KiB)

_jit = functools.partial(numba.njit, parallel=True, fastmath=True, boundscheck=False,
                        cache=True, nogil=True)
_SHIFT = np.uint32(16)  # a bfloat16's bits are the upper half of a float32's


@numba.njit(inline="always", cache=True)
def widen_row(src, dst):  # noqa: ANN001, ANN201 - dst (w,) uint32 = float32 bits of src (w,)
    for j in range(src.shape[0]):
        dst[j] = np.uint32(src[j]) << _SHIFT


@numba.njit(fastmath=True, inline="always", cache=True)
def dot(a, b):  # noqa: ANN001, ANN201 - ⟨a, b⟩ of two float32 rows
    s = np.float32(0)
    for j in range(a.shape[0]):
        s += a[j] * b[j]
    return s


@numba.njit(fastmath=True, inline="always", cache=True)
def dot4x2(f, x, b0, d):  # noqa: ANN001, ANN202 - the 8 dot products of 4 rows, 2 queries
    # eight accumulators and six operands fit AVX2's sixteen vector registers; four queries
    # (sixteen accumulators) spill
    s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = np.float32(0)
    f0, f1, f2, f3 = f[0], f[1], f[2], f[3]
    x0, x1 = x[b0], x[b0 + 1]
    for j in range(d):
        a0, a1 = x0[j], x1[j]
        k0, k1, k2, k3 = f0[j], f1[j], f2[j], f3[j]
        s00 += k0 * a0
        s01 += k0 * a1
        s10 += k1 * a0
        s11 += k1 * a1
        s20 += k2 * a0
        s21 += k2 * a1
        s30 += k3 * a0
        s31 += k3 * a1
    return s00, s01, s10, s11, s20, s21, s30, s31


@numba.njit(fastmath=True, inline="always", cache=True)
def dot4x4(f, x, b0, d):  # noqa: ANN001, ANN202 - the 16 dot products of 4 rows, 4 queries
    # sixteen accumulators and eight operands fit AVX512's thirty-two vector registers (not
    # AVX2's sixteen): half the loads per product of dot4x2
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0)
    s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = np.float32(0)
    f0, f1, f2, f3 = f[0], f[1], f[2], f[3]
    x0, x1, x2, x3 = x[b0], x[b0 + 1], x[b0 + 2], x[b0 + 3]
    for j in range(d):
        a0, a1, a2, a3 = x0[j], x1[j], x2[j], x3[j]
        k0, k1, k2, k3 = f0[j], f1[j], f2[j], f3[j]
        s00 += k0 * a0
        s01 += k0 * a1
        s02 += k0 * a2
        s03 += k0 * a3
        s10 += k1 * a0
        s11 += k1 * a1
        s12 += k1 * a2
        s13 += k1 * a3
        s20 += k2 * a0
        s21 += k2 * a1
        s22 += k2 * a2
        s23 += k2 * a3
        s30 += k3 * a0
        s31 += k3 * a1
        s32 += k3 * a2
        s33 += k3 * a3
    return (s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33)


@_jit
def scores_kernel(rows, x, out, sqnorm, want_norm, four):  # noqa: ANN001, ANN202
    # out (c, B) = widen(rows (c, d)) @ x (B, d)ᵀ; sqnorm (c,) the rows' squared norms; four:
    # take the queries four at a time (where the vector registers hold dot4x4's operands)
    c, d = rows.shape
    batch = x.shape[0]
    for t in numba.prange((c + _ROWS - 1) // _ROWS):
        i0 = t * _ROWS
        m = min(_ROWS, c - i0)
        bits = np.zeros((_ROWS, d), np.uint32)
        for r in range(m):
            widen_row(rows[i0 + r], bits[r])
        f = bits.view(np.float32)  # (4, d) the widened rows, zero past the last
        if want_norm:
            for r in range(m):
                sqnorm[i0 + r] = dot(f[r], f[r])
        b0 = 0
        while four and b0 + 4 <= batch:
            s16 = dot4x4(f, x, b0, d)
            for r in range(m):
                for k in range(4):
                    out[i0 + r, b0 + k] = s16[4 * r + k]
            b0 += 4
        while b0 + 2 <= batch:
            s8 = dot4x2(f, x, b0, d)
            for r in range(m):
                out[i0 + r, b0] = s8[2 * r]
                out[i0 + r, b0 + 1] = s8[2 * r + 1]
            b0 += 2
        for b in range(b0, batch):  # the last query of an odd batch
            for r in range(m):
                out[i0 + r, b] = dot(f[r], x[b])


@_jit
def sum_kernel(acc, block, rows, alpha, threads):  # noqa: ANN001, ANN202
    # acc (B, d) += alpha · block (c, B)ᵀ @ widen(rows (c, d)). Each of ``threads`` threads
    # sums a contiguous range of rows into an accumulator of its own (streamed in order, as
    # the prefetcher likes), a strip of _COLUMNS columns at a time; the partial sums are
    # added to acc at the end, in thread order (the result depends on the thread count, not
    # on the scheduling).
    c, d = rows.shape
    batch = acc.shape[0]
    per = -(-c // threads)
    per = -(-per // _SUM_ROWS) * _SUM_ROWS  # rows per thread, whole groups of eight
    parts = np.zeros((threads, batch, d), np.float32)
    for t in numba.prange(threads):
        lo, hi = t * per, min(c, (t + 1) * per)
        mine = parts[t]
        bits = np.zeros((_SUM_ROWS, _COLUMNS), np.uint32)
        f = bits.view(np.float32)  # (8, w) the widened rows, zero past the last
        coef = np.zeros((_SUM_ROWS, batch), np.float32)  # (8, B) their block rows · α
        f0, f1, f2, f3, f4, f5, f6, f7 = f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]
        for i0 in range(lo, hi, _SUM_ROWS):
            m = min(_SUM_ROWS, hi - i0)
            for r in range(m):
                for b in range(batch):
                    coef[r, b] = alpha * block[i0 + r, b]
            for r in range(m, _SUM_ROWS):
                bits[r, :] = 0
                coef[r, :] = 0
            for j0 in range(0, d, _COLUMNS):
                w = min(_COLUMNS, d - j0)
                for r in range(m):
                    widen_row(rows[i0 + r, j0 : j0 + w], bits[r])
                for b in range(batch):
                    a0, a1, a2, a3 = coef[0, b], coef[1, b], coef[2, b], coef[3, b]
                    a4, a5, a6, a7 = coef[4, b], coef[5, b], coef[6, b], coef[7, b]
                    out = mine[b, j0 : j0 + w]
                    for j in range(w):
                        out[j] += ((a0 * f0[j] + a1 * f1[j]) + (a2 * f2[j] + a3 * f3[j])
                                   + ((a4 * f4[j] + a5 * f5[j]) + (a6 * f6[j] + a7 * f7[j])))
    for t in range(threads):
        acc += parts[t]
