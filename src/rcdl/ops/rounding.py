"""Stochastic rounding to half precision, with noise that is a function of the entry.

An Adam step on a half-precision store (docs/precision.md) is often smaller than half an
ulp of bfloat16, so rounding to nearest would drop it every time. :func:`round_stochastically`
rounds to one of the two neighbours at random instead, unbiased: ``E[result] = x``.

Where the random bits come from decides what a run can promise. Drawn from torch's global
generator, they depend on everything else that drew from it before — so a resumed run (a
fresh process, its generator elsewhere) and a sharded one (each rank holding other rows) round
differently from the run they should equal. :func:`rounding_noise` is *counter-based*
instead (the idea of Philox and of JAX's keyed generators): the bits of element ``c`` of
entry ``i`` at Adam step ``t`` are a fixed hash of ``(seed, stream, t, id_i, c)``, where
``id_i`` is the entry's id (:attr:`rcdl.nn.store.EntryStore.ids`: the same on every rank and after
a resume). Nothing needs saving, and any layout of the rows over processes draws the same
bits for the same entry.

The hash is 32-bit integer mixing (xor-shifts and multiplications by odd constants, those of
the "lowbias32" finaliser of C. Wellons' hash search), evaluated with torch's integer ops, so
it runs element-wise on any device.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["noise_keys", "round_stochastically", "rounding_noise"]

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio, odd: spreads consecutive counters apart
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # the two odd multipliers of the finaliser


def _mix_(x: Tensor) -> Tensor:
    """Mix the 32-bit values held in the int64 tensor ``x``, in place (a bijection of
    ``[0, 2^32)``). Products overflow int64 and wrap; masking keeps their low 32 bits."""
    x.bitwise_xor_(x >> 16).mul_(_C1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(_C2).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def _as_int32(x: Tensor) -> Tensor:
    """The int64 values ``x`` in ``[0, 2^32)`` as the int32 tensors with the same bits."""
    return (x - ((x >> 31) << 32)).to(torch.int32)


def _shift_right_(x: Tensor, bits: int) -> Tensor:
    """``x >>> bits`` of int32 bit patterns (torch's ``>>`` fills with the sign bit)."""
    return (x >> bits).bitwise_and_((1 << (32 - bits)) - 1)


def rounding_noise(*, seed: int | Tensor, step: int | Tensor, ids: Tensor, width: int,
                   stream: int = 0) -> Tensor:  # (N, width) int32
    """32 random bits (an int32 bit pattern) for each of ``width`` elements of the entries
    ``ids (N,)``: ``h(seed, stream, step, id, column)``, a pure function of its arguments.

    Args:
        seed: the layer's rounding seed (an int, or a 0-dim integer tensor).
        step: the Adam step (likewise; tensors cost no device sync).
        ids: the entries' ids (int64).
        width: elements per entry (the columns of the tensor rounded).
        stream: tells apart tensors rounded at the same step (keys 0, values 1).

    Each row depends on its id alone, so removing, reordering or splitting rows over
    processes leaves every other row's bits as they were. Rows and columns get full hashes
    (int64 arithmetic, exact); an element mixes its row's and its column's in two int32
    multiply–xorshift rounds, the cost that matters (about ten cheap passes over the block).
    """
    row, col = noise_keys(seed=seed, step=step, ids=ids, width=width, stream=stream)
    x = row[:, None] ^ col[None, :]  # (N, width)
    x.mul_(_C1 - (1 << 32)).bitwise_xor_(_shift_right_(x, 16))  # int32 products wrap
    return x.mul_(_C2 - (1 << 32)).bitwise_xor_(_shift_right_(x, 16))


def noise_keys(*, seed: int | Tensor, step: int | Tensor, ids: Tensor, width: int,
               stream: int = 0) -> tuple[Tensor, Tensor]:  # (N,), (width,) int32
    """The full hashes of :func:`rounding_noise`'s rows and columns (int32 bit patterns):
    element ``(i, c)``'s bits are ``row_i ^ col_c`` mixed by two int32 multiply–xorshift
    rounds with the finaliser's multipliers (a fused kernel may do that part itself:
    :mod:`rcdl.optim.half_adam`)."""
    seed, step = (torch.as_tensor(t, dtype=torch.long, device=ids.device) for t in (seed, step))
    base = _mix_(_mix_(_mix_(seed & _MASK32) ^ ((seed >> 32) & _MASK32)) ^ stream)  # ()
    row = _mix_((step & _MASK32) ^ base)  # () the step's key
    row = _mix_((ids & _MASK32) ^ row)  # (N,)
    row = _mix_(row ^ ((ids >> 32) & _MASK32))
    columns = torch.arange(width, dtype=torch.long, device=ids.device)
    col = _mix_(((columns * _GOLDEN) & _MASK32) ^ base)  # (width,)
    return _as_int32(row), _as_int32(col)


def round_stochastically(x: Tensor, dtype: torch.dtype, noise: Tensor | None = None) -> Tensor:
    """``x`` rounded to the narrower ``dtype``, to one of its two neighbours there at random:
    to the farther one with probability ``|x − nearest| / |farther − nearest|``, so that the
    result is unbiased, ``E[result] = x``. Small updates then move a half-precision value
    on average, where rounding to nearest would drop every one below half an ulp.

    ``noise`` (int32 bit patterns of ``x``'s shape, uniform: :func:`rounding_noise`)
    supplies the random bits; without it they are drawn from torch's global generator.

    float32 to bfloat16 (a bfloat16 is the top 16 bits of a float32) adds 16 random bits
    below the kept ones and truncates: the magnitude rounds up exactly when the random
    number exceeds what truncation drops, with that probability (cheaper than the general
    path, which finds both neighbours with ``nextafter``; docs/precision.md).

    A finite ``x`` beyond the largest finite number of ``dtype`` (65 504 for float16) rounds
    to that number with its sign: it saturates, where a cast would give ``inf`` (float16 has
    no finite neighbour above it, so ``[65 504, 65 520)`` already rounded down). ``inf`` and
    NaN stay what they are. (bfloat16 has float32's range, so only float32 numbers within
    0.4 % of float32's largest could round up to ``inf`` on the fast path.)"""
    if x.dtype == torch.float32 and dtype == torch.bfloat16:
        bits = x.view(torch.int32)  # sign and magnitude: adding grows the magnitude
        low = torch.randint_like(bits, 0, 1 << 16) if noise is None else noise & 0xFFFF
        return (bits + low).bitwise_and_(-(1 << 16)).view(torch.float32).to(dtype)
    nearest = x.to(dtype)
    largest = torch.finfo(dtype).max
    if largest < torch.finfo(x.dtype).max:  # a narrower range: finite x may overflow to inf
        # tested on x itself: a compiled kernel may keep the cast value in x's dtype
        overflow = x.isfinite() & (x.abs() > largest)
        nearest = torch.where(overflow, torch.where(x > 0, largest, -largest).to(dtype), nearest)
    error = x - nearest.to(x.dtype)  # |error| <= half the gap, except where x saturated
    toward = torch.where(error > 0, torch.inf, -torch.inf).to(dtype)
    farther = torch.nextafter(nearest, toward)
    gap = farther.to(x.dtype) - nearest.to(x.dtype)  # 0 only where error is 0
    p_farther = torch.where(gap != 0, error / gap, 0.0)  # in [0, 1/2]; 0 where farther is inf
    if noise is None:
        uniform = torch.rand_like(x)
    else:  # the top 24 bits as a number in [0, 1), exact in float32 and wider
        uniform = _shift_right_(noise, 8).to(x.dtype) * 2.0**-24
    return torch.where(uniform < p_farther, farther, nearest)
