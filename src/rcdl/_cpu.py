"""What this process's CPU is, from ``/proc/cpuinfo``: its fields and its feature flags.

One reader for the library (:mod:`rcdl.ops.half` picks the product path of half-precision stores
by the flags) and for the application (:mod:`rcdl.app.rundir` describes the machine a run
used). Every function takes the file's text as ``cpuinfo`` for tests; where ``/proc/cpuinfo``
is unreadable (not Linux) the fields are ``None`` and the flags empty.
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["capped_below_half", "cpuinfo_field", "cpuinfo_flags", "cpuinfo_text"]


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


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) under which it may still use half-precision units
_HALF_ISAS = ("BF16", "FP16", "AMX", "AVX10", "ALL", "DEFAULT")


def capped_below_half(aten_capability: str, onednn_cap: str) -> bool:
    """Whether a process was told to run below the ISA of half-precision products (how
    another machine class is emulated, docs/precision.md): torch's kernels capped below
    AVX512 (``aten_capability``, what ``ATEN_CPU_CAPABILITY`` made of
    ``torch.backends.cpu.get_cpu_capability()``), or oneDNN's GEMMs capped at an ISA without
    bf16, fp16 or AMX (``onednn_cap``, the value of ``ONEDNN_MAX_CPU_ISA``; ``""``: none)."""
    if not aten_capability.upper().startswith("AVX512"):
        return True
    cap = onednn_cap.upper()
    return bool(cap) and not any(isa in cap for isa in _HALF_ISAS)
