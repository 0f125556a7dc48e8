"""How a half-precision store's products run: natively, or on float32 copies of each chunk
(docs/precision.md, "Product paths").

A store kept in bfloat16 (or float16) halves its bytes. Its products with the queries can run
in that dtype, which is fast where the hardware multiplies it natively (CPUs with
``avx512_bf16`` or AMX, GPUs) and slow where it is emulated (an AVX2-only CPU: oneDNN then
converts element by element; docs/precision.md). The other path converts each chunk of the store to
float32 as it is read, so only a chunk-sized buffer is float32, and multiplies in float32:
the store's memory saving stays, and the speed is float32's plus one conversion pass.

The mode is ``"auto"`` (the default: native where the device multiplies the dtype natively,
float32 chunks elsewhere), ``"native"`` or ``"float32"``; set it with :func:`set_half_products`,
for a block with :func:`half_products`, or with the environment variable
``RCDL_HALF_PRODUCTS`` before the first import. The two paths give the same results up to
rounding: the float32 path multiplies the stored (rounded) keys and values by the unrounded
queries, the native one by queries rounded to the store's dtype.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rcdl._cpu import cpuinfo_flags

__all__ = ["MODES", "half_products", "native_products", "product_mode", "set_half_products",
           "upcast_chunks"]

MODES = ("auto", "native", "float32")
HALF = (torch.bfloat16, torch.float16)
# the CPU flags under which oneDNN multiplies each half dtype natively
_NATIVE_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16"},
                 torch.float16: {"avx512_fp16", "amx_fp16"}}


def _check(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"half-precision product mode must be one of {', '.join(MODES)}, "
                         f"got {mode!r}")
    return mode


_mode = _check(os.environ.get("RCDL_HALF_PRODUCTS", "auto"))


def set_half_products(mode: str) -> None:
    """Set how half-precision stores multiply: ``"auto"``, ``"native"`` or ``"float32"``."""
    global _mode
    _mode = _check(mode)


def product_mode() -> str:
    """The mode set now (``"auto"`` unless changed)."""
    return _mode


@contextmanager
def half_products(mode: str) -> Iterator[None]:
    """``with half_products("float32"): ...`` — the mode for a block, restored after."""
    before = _mode
    set_half_products(mode)
    try:
        yield
    finally:
        set_half_products(before)


def _cpu_flags() -> frozenset[str]:  # a seam for tests that pose as another CPU
    return cpuinfo_flags()


def native_products(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` multiplies ``dtype`` natively: any GPU; a CPU with the flags of
    :data:`_NATIVE_FLAGS` (read once from ``/proc/cpuinfo``; none where it is unreadable)."""
    if torch.device(device).type != "cpu":
        return True
    return bool(_NATIVE_FLAGS.get(dtype, set()) & _cpu_flags())


def upcast_chunks(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the attention converts each chunk of a store in ``dtype`` on ``device`` to
    float32 before its products (the mode, and for ``"auto"`` :func:`native_products`)."""
    if dtype not in HALF or _mode == "native":
        return False
    return _mode == "float32" or not native_products(dtype, device)
