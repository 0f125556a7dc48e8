"""The numba kernel of :mod:`rcdl.optim.half_adam`'s fused path (imported on first use;
module-level so that numba's on-disk cache finds it again in the next process)."""

import numba
import numpy as np

from rcdl.ops._widen_kernels import widen_row

_MASK32 = np.uint64(0xFFFFFFFF)
_LOW16 = np.uint64(0xFFFF)
_HIGH16 = np.uint64(0xFFFF0000)
_C1, _C2 = np.uint64(0x7FEB352D), np.uint64(0x846CA68B)  # rcdl.ops.rounding's multipliers
_16 = np.uint64(16)


@numba.njit(parallel=True, cache=True, nogil=True)  # no fastmath: IEEE, as the eager step
def adam_bf16(param, m, v, grad_bits, grad, a, c, row, col, b1, b2):  # noqa: ANN001, ANN201
    """One Adam step on bfloat16 rows ``param (n, w)`` (their bits, uint16), in place, with
    float32 moments ``m``, ``v``, the gradient as bfloat16 bits ``grad_bits (n, w)`` or, where
    that is empty, float32 ``grad (n, w)``, per-row scales ``a``, ``c`` and the rounding noise's row
    and column hashes ``row (n,)``, ``col (w,)`` (uint32): ``rcdl.optim.half_adam._adam_rows``
    element by element, in one pass."""
    n, w = param.shape
    lerp, keep = np.float32(1 - b1), np.float32(1 - b2)
    b2 = np.float32(b2)
    for i in numba.prange(n):
        bits = np.empty(w, np.uint32)  # the row, then the moved row, as float32 bits
        widen_row(param[i], bits)
        moved = bits.view(np.float32)
        g_row = np.empty(w, np.float32)
        if grad_bits.shape[0] > 0:
            widen_row(grad_bits[i], g_row.view(np.uint32))
        else:
            for j in range(w):
                g_row[j] = grad[i, j]
        a_i, c_i, key = a[i], c[i], np.uint64(row[i])
        for j in range(w):
            g = g_row[j]
            # as torch's vectorised lerp_ and addcmul_ round: a fused multiply-add (the
            # product of two float32 numbers is exact in float64)
            m_ij = np.float32(np.float64(m[i, j]) + np.float64(lerp) * np.float64(g - m[i, j]))
            v_ij = np.float32(np.float64(v[i, j] * b2) + np.float64(keep * g) * np.float64(g))
            m[i, j], v[i, j] = m_ij, v_ij
            moved[j] = moved[j] - m_ij / (np.float32(np.sqrt(v_ij)) * a_i + c_i)
            x = key ^ np.uint64(col[j])
            x = (x * _C1) & _MASK32
            x ^= x >> _16
            x = (x * _C2) & _MASK32
            x ^= x >> _16
            rounded = (np.uint64(bits[j]) + (x & _LOW16)) & _HIGH16
            param[i, j] = np.uint16(rounded >> _16)
