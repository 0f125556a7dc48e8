"""Products of a bfloat16 store widened to float32 in registers, for CPUs that cannot
multiply bfloat16 natively (docs/precision.md, "Product paths").

A bfloat16 number is the upper half of a float32 one: widening it is a 16-bit shift. On a
CPU without ``avx512_bf16`` or AMX, the ``"float32"`` product path (:mod:`rcdl.ops.half`)
widens each chunk of the store into a float32 buffer and then multiplies that buffer: one
extra pass over every chunk, not small next to the products at training batches
(docs/precision.md gives the figures). The two kernels here widen a few rows at a time into
an L1-sized block and multiply it at once, so the store is read once, in half the bytes of a
float32 store:

- :func:`scores` — ``out = widen(rows) @ xᵀ``, ``(c, B)``, and optionally each row's squared
  norm ``‖widen(rows_i)‖²`` (what a distance kernel needs, in float32);
- :func:`sum_over_entries_` — ``acc += α · blockᵀ @ widen(rows)``, ``(B, d)``.

They are compiled by numba (the ``fast-cpu`` extra) on first use for the CPU they run on and
run on the threads :func:`rcdl.options.set_threads` set (numba's pool takes torch's count
when it starts, and follows ``set_threads`` after); without numba, :func:`available` is
``False`` and the attention takes the float32-chunk path. Results equal the float32-chunk
path's up to the order of float32 summation (the tests compare the two). The machine class
numba compiles for follows an emulated class's caps, or ``NUMBA_CPU_NAME`` and
``NUMBA_CPU_FEATURES`` where set (:func:`_numba_target`; docs/precision.md, "Emulating
another machine class").
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

from rcdl._cpu import capped_below_half, cpuinfo_flags
from rcdl.options import numba_threads

__all__ = ["as_bits", "available", "queries_per_pass", "scores", "sum_over_entries_"]


_FULL_WIDTH = "-prefer-256-bit"  # LLVM's tuning for Intel's AVX512 CPUs keeps 256-bit vectors


def _numba_target() -> None:
    """Choose the CPU numba compiles for (it reads ``NUMBA_CPU_NAME`` and
    ``NUMBA_CPU_FEATURES`` once, when it is imported: this runs before).

    - Where the process is capped below this CPU's ISA (an emulated machine class,
      :func:`rcdl._cpu.capped_below_half`): a CPU of that class with that CPU's own
      features, not this one's (numba adds the host's features to the name it is given:
      AVX512 on a "Haswell"): Haswell (AVX2) where torch's kernels are capped below
      AVX512, Skylake-AVX512 (no bfloat16 instructions) where only oneDNN is capped.
    - On an AVX512 CPU (this one or the emulated one): 512-bit vectors. LLVM's tuning for
      Intel's AVX512 CPUs prefers 256-bit ones, which halves the peak FMA rate of a CPU
      with full-width 512-bit FMA units where the products are bound by the arithmetic.

    Nothing is changed where the user set either variable."""
    if (os.environ.get("NUMBA_CPU_NAME") or "NUMBA_CPU_FEATURES" in os.environ
            or "avx512f" not in cpuinfo_flags()):
        return  # the user's choice, or a CPU below AVX512 as it is: numba's own
    aten = torch.backends.cpu.get_cpu_capability()
    if capped_below_half(aten, os.environ.get("ONEDNN_MAX_CPU_ISA", "")):
        avx512 = aten.startswith("AVX512")
        os.environ["NUMBA_CPU_NAME"] = "skylake-avx512" if avx512 else "haswell"
        os.environ["NUMBA_CPU_FEATURES"] = _FULL_WIDTH if avx512 else ""
    else:
        try:
            from llvmlite import binding
        except ImportError:  # no numba either: the kernels are not available
            return
        host = binding.get_host_cpu_features().flatten()
        os.environ["NUMBA_CPU_FEATURES"] = f"{host},{_FULL_WIDTH}" if host else _FULL_WIDTH


def _wide_registers() -> bool:
    """Whether numba compiles for a CPU with AVX512's thirty-two vector registers (its
    target, as :func:`_numba_target` left it): the score kernel then takes the queries four
    at a time rather than two (sixteen accumulators; on AVX2's sixteen registers they
    spill). A user's own ``NUMBA_CPU_NAME`` counts only where its features name
    ``+avx512f`` or the name ``avx512``."""
    name = os.environ.get("NUMBA_CPU_NAME", "")
    features = os.environ.get("NUMBA_CPU_FEATURES")
    if features is not None and "+avx512f" in features.split(","):
        return True
    if name:
        return "avx512" in name
    return features is None and "avx512f" in cpuinfo_flags()


@functools.cache
def _kernels() -> dict[str, Any] | None:
    """The compiled kernels by name, or ``None`` where numba is not installed."""
    _numba_target()
    try:
        import numba
        import numpy as np

        from rcdl.ops import _widen_kernels as kernels
    except ImportError:
        return None
    numba_threads()  # the pool starts here, on torch's count, not inside a kernel call
    return {"scores": kernels.scores_kernel, "sum": kernels.sum_kernel, "np": np,
            "numba": numba, "four": _wide_registers()}


def queries_per_pass() -> int:
    """How many queries the score kernel takes per pass over four rows here: 4 where numba
    compiles for AVX512's registers, else 2 (what a run records with the product path)."""
    k = _kernels()
    return 4 if k is not None and k["four"] else 2


def available() -> bool:
    """Whether the widening kernels can run here (numba is installed)."""
    return _kernels() is not None


def as_bits(t: Tensor) -> Any:  # numpy uint16 view of a bfloat16 CPU tensor's bits
    """A bfloat16 CPU tensor's bits as a numpy ``uint16`` array (no copy), for a numba
    kernel."""
    return t.detach().view(torch.int16).numpy().view("uint16")


def _check(rows: Tensor, *others: Tensor) -> dict[str, Any]:
    k = _kernels()
    if k is None:
        raise RuntimeError("rcdl.ops.widen needs numba: pip install 'rcdl[fast-cpu]'")
    if rows.dtype != torch.bfloat16 or rows.device.type != "cpu" or not rows.is_contiguous():
        raise ValueError(f"widen: the store rows must be a contiguous bfloat16 CPU tensor, got "
                         f"{rows.dtype} on {rows.device}")
    for t in others:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"widen: the other operands must be float32 CPU tensors, got "
                             f"{t.dtype} on {t.device}")
    return k


def scores(rows: Tensor, x: Tensor, *, sqnorm: bool = False, queries: int | None = None
           ) -> tuple[Tensor, Tensor | None]:  # (c, B), (c,)
    """``widen(rows) @ xᵀ`` for bfloat16 ``rows (c, d)`` and float32 ``x (B, d)``, and with
    ``sqnorm`` the rows' squared norms ``Σ_j widen(rows)_{ij}²``, both float32. ``queries``:
    how many queries each pass over four rows takes, 4 or 2 (``None``: 4 where numba
    compiles for AVX512's registers, else 2); either way float32 products of the same
    numbers, summed in an order that may differ in the last bits."""
    k = _check(rows, x)
    if queries not in (None, 2, 4):
        raise ValueError(f"widen.scores: queries must be 2 or 4, got {queries}")
    four = k["four"] if queries is None else queries == 4
    x = x.contiguous()
    out = torch.empty(rows.shape[0], x.shape[0])  # (c, B)
    norms = torch.empty(rows.shape[0] if sqnorm else 0)  # (c,)
    k["scores"](as_bits(rows), x.detach().numpy(), out.numpy(), norms.numpy(), sqnorm, four)
    return out, (norms if sqnorm else None)


def sum_over_entries_(acc: Tensor, block: Tensor, rows: Tensor, alpha: float = 1.0) -> Tensor:
    """``acc += α · blockᵀ @ widen(rows)`` in place: float32 ``acc (B, d)`` and
    ``block (c, B)``, bfloat16 ``rows (c, d)``. Returns ``acc``."""
    k = _check(rows, acc, block)
    if not acc.is_contiguous():
        raise ValueError("widen.sum_over_entries_: acc must be contiguous")
    # the thread count is passed in: a kernel that asks numba for it is not cached on disk
    k["sum"](acc.detach().numpy(), block.detach().contiguous().numpy(), as_bits(rows),
             k["np"].float32(alpha), k["numba"].get_num_threads())
    return acc
