"""What this process's CPU is, from ``/proc/cpuinfo``: its fields and its feature flags.

One reader for the library (:mod:`rcdl.ops.half` picks the product path of half-precision stores
by the flags) and for the application (:mod:`rcdl.app.rundir` describes the machine a run
used). Every function takes the file's text as ``cpuinfo`` for tests; where ``/proc/cpuinfo``
is unreadable (not Linux) the fields are ``None`` and the flags empty.
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["cpuinfo_field", "cpuinfo_flags", "cpuinfo_text"]


@functools.cache
def cpuinfo_text() -> str:
    """``/proc/cpuinfo`` (read once; ``""`` where it cannot be read)."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpuinfo_field(name: str, cpuinfo: str | None = None) -> str | None:
    """The first ``name : value`` of ``cpuinfo`` (default: this CPU's), or ``None``."""
    for line in (cpuinfo_text() if cpuinfo is None else cpuinfo).splitlines():
        if line.split(":")[0].strip() == name:
            return line.split(":", 1)[1].strip()
    return None


def cpuinfo_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (``flags`` on x86, ``Features`` on ARM)."""
    text = cpuinfo_text() if cpuinfo is None else cpuinfo
    return frozenset((cpuinfo_field("flags", text) or cpuinfo_field("Features", text)
                      or "").split())
