"""Keep freed memory inside the process instead of handing it back to the OS (glibc only).

On Linux, glibc's ``malloc`` serves every block above its mmap threshold (32 MB at most) with
fresh pages from ``mmap`` and unmaps them again on ``free``. The first write to a fresh page
faults, at a cost proportional to the bytes touched (``results/speed/bench_hybrid.md``).
A training step allocates such blocks every step: the gradient of a 3072 × 3072 weight is
38 MB, Adam's temporaries are as large, and the hybrid layer's entry gradients are
``(N, 3072)``. So every step pays the faults again, unless :func:`keep_freed_memory` keeps
the pages (docs/cifar10.md gives its effect on a ResNet-MLP step at the paper's width, with
the machine and command).

What it does: ``mallopt(M_MMAP_MAX, 0)`` (large blocks come from the heap, where freed ones
are reused) and ``mallopt(M_TRIM_THRESHOLD, 2**31 − 1)`` (freed heap stays with the process).
The price: the process keeps its peak memory until it exits, and the heap may fragment
somewhat more. The ``rcdl`` command calls it before running anything (not the library, and
not ``rcdl.app.cli.main``, which the tests call in-process). ``RCDL_MALLOC=system`` in the
environment turns it off. The setting is recorded in every run's ``environment.json``.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["allocator_setting", "keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int
_state = {"setting": "system default"}


def keep_freed_memory() -> bool:
    """Tune glibc's ``malloc`` as described above; returns whether it was tuned.

    Does nothing (and returns False) on other C libraries, when ``RCDL_MALLOC=system`` is
    set, or when ``mallopt`` refuses a setting.
    """
    if os.environ.get("RCDL_MALLOC", "").lower() == "system":
        _state["setting"] = "system default (RCDL_MALLOC=system)"
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)):
        return False
    _state["setting"] = "glibc: no mmap for large blocks, freed memory kept (rcdl.app.allocator)"
    return True


def allocator_setting() -> str:
    """How this process's ``malloc`` is set up, for ``environment.json``."""
    return _state["setting"]
