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
elsewhere, for training batches, :func:`auto_path`'s choice between widening in registers and
float32 chunks, float32 chunks for larger batches), ``"native"``, ``"float32"`` or
``"widen"`` (widened in registers for training batches of bfloat16 stores, where numba is
installed; float32 chunks otherwise): a layer's own (``GrowingLayer(half_products=...)``,
saved with it; :attr:`rcdl.ops.entries.Entries.half_products`), else the process-wide default
:data:`PRODUCTS` (:class:`rcdl.options.ProcessDefault`), set with :func:`set_half_products`,
for a block with :func:`half_products`, or by the environment variable
``RCDL_HALF_PRODUCTS`` before its first use. :func:`chunk_products` is the rule; each
attention call applies it once, in its plan (:mod:`rcdl.ops.plan`). A run records the
default, the path each half dtype takes under it (:func:`product_path`) and each layer's
mode in ``environment.json``. The paths give the same
results up to rounding: the float32 path multiplies the stored (rounded) keys and values by
the unrounded queries, the native one by queries rounded to the store's dtype, and the
widened one sums the float32 path's products in another order.

**Which path is a recorded decision.** ``"auto"``'s choice for training batches is timed
(:func:`widen_pays`), and a timing may come out either way where the two paths run within a
few per cent of each other, while the paths differ in the last bits. So the choice is
recorded with what must be repeated bit for bit (:func:`product_record`: a run's
``environment.json``, a :class:`~rcdl.train.replay.ReplayLog`) and set from that record
before the repetition runs (:func:`products_as`: a resumed run, an exact forget), never timed
again.
"""

from __future__ import annotations

import functools
import os
import reprlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from rcdl import _cpu
from rcdl._cpu import cpuinfo_flags
from rcdl.options import ProcessDefault, threads

__all__ = ["AUTO_PATHS", "HALF_DTYPES", "MODES", "PRODUCTS", "WIDEN_MAX_BATCH", "auto_path",
           "capped_below_half", "chunk_products", "half_products", "native_products",
           "product_mode", "product_path", "product_record", "product_record_problem",
           "products_as", "set_auto_path",
           "set_half_products", "upcast_chunks", "widen_pays"]

MODES = ("auto", "native", "float32", "widen")
AUTO_PATHS = ("widen", "float32")  # auto's choices for a training batch without native products
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


def widen_pays() -> bool:
    """Whether widening in registers (:mod:`rcdl.ops.widen`) is faster here than converting
    chunks to float32, for a training batch, at this process's thread count
    (:func:`rcdl.options.threads`): measured once per count (:func:`widen_pays_at`). It
    answers :func:`auto_path` only where no path was set: a timing is no record (see the
    module docstring)."""
    return widen_pays_at(threads())


@functools.cache
def widen_pays_at(count: int) -> bool:
    """:func:`widen_pays` at ``count`` threads (the process's count: the call times what runs
    now), measured once per count on one chunk of 1 024 bfloat16 rows of width 1 024 and 16
    queries (both products of a chunk, the best of five interleaved tries each; the kernels
    are compiled first). ``False`` where numba is not installed."""
    if count != threads():
        raise ValueError(f"widen_pays_at({count}) times what runs now, at {threads()} threads: "
                         "set the count first (rcdl.options.set_threads)")
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


_set_path: str | None = None  # auto's path for training batches where set (else timed)


def auto_path() -> str:
    """What ``"auto"`` does with a training batch (at most :data:`WIDEN_MAX_BATCH` queries)
    of a bfloat16 store on a CPU without native products: ``"widen"`` (widened in registers,
    where numba is installed) or ``"float32"`` (float32 chunks). The one set
    (:func:`set_auto_path`, :func:`products_as`: a resumed run or an exact replay sets the one
    it recorded), else ``"widen"`` where :func:`widen_pays` measured it faster at its first
    call in this process. Either way fixed for the process (or the block) from then on."""
    if _set_path is not None:
        return _set_path
    return "widen" if widen_pays() else "float32"


def set_auto_path(path: str) -> None:
    """Make ``path`` (one of :data:`AUTO_PATHS`) :func:`auto_path`'s answer for the rest of
    the process, whatever a timing would say."""
    global _set_path
    if path not in AUTO_PATHS:
        raise ValueError(f"auto's path for training batches must be one of "
                         f"{', '.join(AUTO_PATHS)}, got {path!r}")
    _set_path = path


def product_record() -> dict[str, str | None]:
    """How this process's half-precision products run, as what must be repeated bit for bit
    records it (a run's ``environment.json``, a :class:`~rcdl.train.replay.ReplayLog`):
    ``{"mode": the default mode (:data:`PRODUCTS`), "auto_path": auto's path for training
    batches}``. The path is decided now (:func:`auto_path`, timed at most once per process)
    where it can be taken: under ``"auto"`` on a CPU without native bfloat16 products; else
    it is ``None``."""
    mode = PRODUCTS.get()
    needed = mode == "auto" and not native_products(torch.bfloat16, "cpu")
    return {"mode": mode, "auto_path": auto_path() if needed else None}


def product_record_problem(record: Any) -> str | None:
    """What makes ``record`` other than a :func:`product_record` (``None``: nothing): a
    dict of exactly ``"mode"`` (one of :data:`MODES`) and ``"auto_path"`` (``None`` or one
    of :data:`AUTO_PATHS`). Every reader of a saved record checks it so."""
    if (isinstance(record, dict) and set(record) == {"mode", "auto_path"}
            and record["mode"] in MODES and record["auto_path"] in (None, *AUTO_PATHS)):
        return None
    return (f"{reprlib.repr(record)} is not a product record (mode one of "
            f"{', '.join(MODES)}; auto_path None or one of {', '.join(AUTO_PATHS)})")


@contextmanager
def products_as(record: Mapping[str, str | None] | None) -> Iterator[None]:
    """``with products_as(record): ...`` — half-precision products in the block run as
    ``record`` (:func:`product_record`'s form) says: its mode, and its auto path where it has
    one (whatever a timing here says); both restored after. ``None``: as they run now.

    Example (a retraining that an exact forget must equal, in another process)::

        with products_as(replay.products):
            train_one_pass(model, data, order=stream_without(replay, gone), ...)
    """
    global _set_path
    if record is None:
        yield
        return
    mode, path = PRODUCTS.check(str(record.get("mode"))), record.get("auto_path")
    before = _set_path
    if path is not None:
        set_auto_path(path)
    try:
        with PRODUCTS.using(mode):
            yield
    finally:
        if path is not None:
            _set_path = before


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

        if widen.available() and (mode == "widen" or auto_path() == "widen"):
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
