"""How a half-precision store's products run: natively, or on float32 copies of each chunk
(docs/precision.md, "Product paths").

A store kept in bfloat16 (or float16) halves its bytes. Its products with the queries can run
in that dtype, which is fast where the hardware multiplies it natively (CPUs with
``avx512_bf16`` or AMX, GPUs) and slow where it is emulated (an AVX2-only CPU: oneDNN then
converts element by element; docs/precision.md). The other path converts each chunk of the store to
float32 as it is read, so only a chunk-sized buffer is float32, and multiplies in float32:
the store's memory saving stays, and the speed is float32's plus one conversion pass.

A third path, for bfloat16 stores on CPUs without native products and the training batches
(at most :data:`WIDEN_MAX_BATCH` queries), widens a few rows at a time in registers inside
the products themselves (:mod:`rcdl.ops.widen`, numba: the ``fast-cpu`` extra), so the store
is read once, in half of float32's bytes. Larger batches are bound by the products, not by
the store's bytes, and take the float32-chunk path.

The mode is ``"auto"`` (the default: native where the device multiplies the dtype natively;
elsewhere widened in registers for training batches where :func:`widen_pays` measured it
faster at the first call, float32 chunks otherwise), ``"native"``, ``"float32"`` or
``"widen"`` (widened in registers for training batches of bfloat16 stores, where numba is
installed; float32 chunks otherwise): the process-wide default
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
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from rcdl import _cpu
from rcdl._cpu import cpuinfo_flags
from rcdl.options import ProcessDefault

__all__ = ["HALF_DTYPES", "MODES", "PRODUCTS", "WIDEN_MAX_BATCH", "capped_below_half",
           "chunk_products", "half_products", "native_products", "product_mode", "product_path",
           "set_half_products", "upcast_chunks", "widen_pays"]

MODES = ("auto", "native", "float32", "widen")
WIDEN_MAX_BATCH = 64  # the largest query batch whose products are widened in registers
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


@functools.cache
def _aten_capability() -> str:  # fixed when torch starts (ATEN_CPU_CAPABILITY is read then)
    return torch.backends.cpu.get_cpu_capability()


def capped_below_half() -> bool:
    """Whether the process was told to run below the ISA of half-precision products (how
    another machine class is emulated, docs/precision.md): ATen's kernels capped below
    AVX512 (``ATEN_CPU_CAPABILITY``), or oneDNN's GEMMs capped at an ISA without bf16, fp16
    or AMX (``ONEDNN_MAX_CPU_ISA``, read at oneDNN's first use)."""
    return _cpu.capped_below_half(_aten_capability(), os.environ.get("ONEDNN_MAX_CPU_ISA", ""))


def native_products(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` multiplies ``dtype`` natively: any GPU; a CPU with the flags of
    :data:`_NATIVE_FLAGS` (read once from ``/proc/cpuinfo``; none where it is unreadable),
    unless the process is capped below them (:func:`capped_below_half`: an emulated
    machine class takes the path a real CPU of that class takes)."""
    if torch.device(device).type != "cpu":
        return True
    return bool(_NATIVE_FLAGS.get(dtype, set()) & _cpu_flags()) and not capped_below_half()


@functools.cache
def widen_pays() -> bool:
    """Whether widening in registers (:mod:`rcdl.ops.widen`) is faster here than converting
    chunks to float32, for a training batch: measured once per process on one chunk of
    1 024 bfloat16 rows of width 1 024 and 16 queries (both products of a chunk, the best of
    five interleaved tries each; the kernels are compiled first). ``False`` where numba is
    not installed."""
    from rcdl.ops import widen

    if not widen.available():
        return False
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(1024, 1024, generator=gen).bfloat16()  # (c, d)
    x = torch.randn(16, 1024, generator=gen)  # (B, d)
    acc, buffer = torch.zeros(16, 1024), torch.empty(1024, 1024)

    def widened() -> None:
        block, _ = widen.scores(rows, x)
        widen.sum_over_entries_(acc, block, rows)

    def converted() -> None:
        block = buffer.copy_(rows) @ x.T
        acc.addmm_(block.T.contiguous(), buffer.copy_(rows))

    best = {widened: float("inf"), converted: float("inf")}
    widened()  # compiles, or loads the compiled kernels
    for _ in range(5):
        for fn in best:
            start = time.perf_counter()
            fn()
            best[fn] = min(best[fn], time.perf_counter() - start)
    return best[widened] < best[converted]


def chunk_products(dtype: torch.dtype, device: torch.device | str, batch: int,
                   mode: str | None = None) -> str:
    """How the products of a store in ``dtype`` on ``device`` with ``batch`` queries run:
    ``"store"`` (as the store lies: not half precision, or native products), ``"float32"``
    (each chunk converted to float32) or ``"widen"`` (widened in registers,
    :mod:`rcdl.ops.widen`), by ``mode`` (``None``: the default :data:`PRODUCTS`)."""
    mode = PRODUCTS.resolve(mode)
    if dtype not in HALF_DTYPES or mode == "native":
        return "store"
    if mode == "auto" and native_products(dtype, device):
        return "store"
    widenable = (dtype == torch.bfloat16 and torch.device(device).type == "cpu"
                 and batch <= WIDEN_MAX_BATCH)
    if widenable and mode != "float32":
        from rcdl.ops import widen

        if widen.available() and (mode == "widen" or widen_pays()):
            return "widen"
    return "float32"


def upcast_chunks(dtype: torch.dtype, device: torch.device | str,
                  mode: str | None = None) -> bool:
    """Whether the attention converts each chunk of a store in ``dtype`` on ``device`` to
    float32 before its products, for a batch too large to widen in registers: by ``mode``
    (``None``: the default :data:`PRODUCTS`), and for ``"auto"`` :func:`native_products`."""
    return chunk_products(dtype, device, WIDEN_MAX_BATCH + 1, mode) == "float32"


def product_path(dtype: torch.dtype, device: torch.device | str,
                 mode: str | None = None) -> str:
    """The path a store in ``dtype`` on ``device`` takes now: ``"native"``, ``"float32
    chunks"``, ``"widened in registers (training batches, Q queries per score pass), float32
    chunks"`` (Q: :func:`rcdl.ops.widen.queries_per_pass`), or ``"store
    dtype"`` for a store that is not half precision (what a run records in
    ``environment.json``)."""
    if dtype not in HALF_DTYPES:
        return "store dtype"
    if not upcast_chunks(dtype, device, mode):
        return "native"
    if chunk_products(dtype, device, 1, mode) == "widen":
        from rcdl.ops import widen

        return (f"widened in registers (training batches, {widen.queries_per_pass()} queries "
                f"per score pass), float32 chunks")
    return "float32 chunks"
