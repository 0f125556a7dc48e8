"""How a half-precision store's products run: natively, or on float32 copies of each chunk
(docs/precision.md, "Product paths").

A store kept in bfloat16 (or float16) halves its bytes. Its products with the queries can run
in that dtype, which is fast where the hardware multiplies it natively (CPUs with
``avx512_bf16`` or AMX, GPUs) and slow where it is emulated (an AVX2-only CPU: oneDNN then
converts element by element; docs/precision.md). The other path converts each chunk of the store to
float32 as it is read, so only a chunk-sized buffer is float32, and multiplies in float32:
the store's memory saving stays, and the speed is float32's plus one conversion pass.

The mode is ``"auto"`` (the default: native where the device multiplies the dtype natively,
float32 chunks elsewhere), ``"native"`` or ``"float32"``: the process-wide default
:data:`PRODUCTS` (:class:`rcdl.options.ProcessDefault`), set with :func:`set_half_products`,
for a block with :func:`half_products`, or by the environment variable
``RCDL_HALF_PRODUCTS`` before its first use. A run records it, and the path each half dtype
takes under it (:func:`product_path`), in ``environment.json``. The two paths give the same
results up to rounding: the float32 path multiplies the stored (rounded) keys and values by
the unrounded queries, the native one by queries rounded to the store's dtype.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from rcdl._cpu import cpuinfo_flags
from rcdl.options import ProcessDefault

__all__ = ["HALF_DTYPES", "MODES", "PRODUCTS", "half_products", "native_products", "product_mode",
           "product_path", "set_half_products", "upcast_chunks"]

MODES = ("auto", "native", "float32")
HALF_DTYPES = (torch.bfloat16, torch.float16)  # the storage dtypes narrower than float32
# the CPU flags under which oneDNN multiplies each half dtype natively
_NATIVE_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16"},
                 torch.float16: {"avx512_fp16", "amx_fp16"}}


PRODUCTS = ProcessDefault("half-precision product mode", "RCDL_HALF_PRODUCTS", MODES, "auto")
# set how half-precision stores multiply: "auto", "native" or "float32"
set_half_products: Callable[[str], None] = PRODUCTS.set
# the mode set now ("auto" unless changed)
product_mode: Callable[[], str] = PRODUCTS.get
# with half_products("float32"): ... -- the mode for a block, restored after
half_products: Callable[[str], AbstractContextManager[None]] = PRODUCTS.using


@functools.cache  # parsed once: the attention asks on every call with a half store
def _cpu_flags() -> frozenset[str]:  # a seam for tests that pose as another CPU
    return cpuinfo_flags()


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) under which it may still use half-precision units
_HALF_ISAS = ("BF16", "FP16", "AMX", "AVX10", "ALL", "DEFAULT")


@functools.cache
def _aten_capability() -> str:  # fixed when torch starts (ATEN_CPU_CAPABILITY is read then)
    return torch.backends.cpu.get_cpu_capability()


def _capped_below_half() -> bool:
    """Whether the process was told to run below the ISA of half-precision products (how
    another machine class is emulated, docs/precision.md): ATen's kernels capped below
    AVX512 (``ATEN_CPU_CAPABILITY``), or oneDNN's GEMMs capped at an ISA without bf16, fp16
    or AMX (``ONEDNN_MAX_CPU_ISA``, read at oneDNN's first use)."""
    if not _aten_capability().startswith("AVX512"):
        return True
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return bool(cap) and not any(isa in cap for isa in _HALF_ISAS)


def native_products(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` multiplies ``dtype`` natively: any GPU; a CPU with the flags of
    :data:`_NATIVE_FLAGS` (read once from ``/proc/cpuinfo``; none where it is unreadable),
    unless the process is capped below them (:func:`_capped_below_half`: an emulated
    machine class takes the path a real CPU of that class takes)."""
    if torch.device(device).type != "cpu":
        return True
    return bool(_NATIVE_FLAGS.get(dtype, set()) & _cpu_flags()) and not _capped_below_half()


def upcast_chunks(dtype: torch.dtype, device: torch.device | str,
                  mode: str | None = None) -> bool:
    """Whether the attention converts each chunk of a store in ``dtype`` on ``device`` to
    float32 before its products: by ``mode`` (``None``: the default :data:`PRODUCTS`), and
    for ``"auto"`` :func:`native_products`."""
    mode = PRODUCTS.resolve(mode)
    if dtype not in HALF_DTYPES or mode == "native":
        return False
    return mode == "float32" or not native_products(dtype, device)


def product_path(dtype: torch.dtype, device: torch.device | str,
                 mode: str | None = None) -> str:
    """The path a store in ``dtype`` on ``device`` takes now: ``"native"``, ``"float32
    chunks"``, or ``"store dtype"`` for a store that is not half precision (what a run
    records in ``environment.json``)."""
    if dtype not in HALF_DTYPES:
        return "store dtype"
    return "float32 chunks" if upcast_chunks(dtype, device, mode) else "native"
