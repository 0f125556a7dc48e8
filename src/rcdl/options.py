"""Process-wide defaults of the options that objects take (docs/precision.md, "Product
paths" and "The hybrid's half-precision Adam step").

An option that changes how something is computed, not what (which product path a
half-precision store takes, whether the hybrid's Adam pass is compiled), belongs to the
object that computes: a learner takes it as an argument, saves it in its state dict, and a
run writes it to ``environment.json``. Where the object is not given one, it reads the
process-wide default, a :class:`ProcessDefault`: the environment variable sets it once, at
the first read; :meth:`ProcessDefault.set` and ``with default.using(value):`` change it.

The CPU threads are the one option of the process itself (a thread pool is the process's):
:func:`set_threads` is the one place that sets them, for torch and for numba's kernels
(:mod:`rcdl.ops.widen`, the fused Adam step) alike; ``rcdl ... --threads N`` calls it before
anything runs. A measurement that depends on the count (:func:`rcdl.ops.half.widen_pays`)
is kept per count.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["ProcessDefault", "numba_threads", "set_threads", "threads"]


class ProcessDefault:
    """The default of an option with the values ``choices``: the environment variable
    ``env`` when set, else ``fallback`` (read at the first use, so setting the variable
    before then is enough); a bad value is refused with an error naming the option."""

    def __init__(self, what: str, env: str, choices: tuple[str, ...], fallback: str) -> None:
        self.what, self.env, self.choices = what, env, choices
        self._value: str | None = None
        self.check(fallback)
        self.fallback = fallback

    def check(self, value: str) -> str:
        """``value`` if it is one of the choices, else ``ValueError``."""
        if value not in self.choices:
            raise ValueError(f"{self.what} must be one of {', '.join(self.choices)}, "
                             f"got {value!r}")
        return value

    def get(self) -> str:
        """The default now."""
        if self._value is None:
            self._value = self.check(os.environ.get(self.env, self.fallback))
        return self._value

    def resolve(self, value: str | None) -> str:
        """An object's own ``value`` (checked), or the default where it has none."""
        return self.get() if value is None else self.check(value)

    def set(self, value: str) -> None:
        """Make ``value`` the default for the rest of the process."""
        self._value = self.check(value)

    @contextmanager
    def using(self, value: str) -> Iterator[None]:
        """``with default.using(value): ...`` — the default for a block, restored after."""
        before = self.get()
        self.set(value)
        try:
            yield
        finally:
            self._value = before

    def __repr__(self) -> str:
        return f"ProcessDefault({self.what!r}, ${self.env}, {self.get()!r})"


def threads() -> int:
    """The CPU threads rcdl computes with: torch's count (:func:`set_threads` sets it)."""
    return torch.get_num_threads()


def set_threads(count: int) -> None:
    """Compute with ``count`` CPU threads from now on: torch's intra-op threads and, where
    numba's kernels have started their pool, numba's (:func:`numba_threads`); a pool that
    starts later follows the count then. Set it before the work it is for: a thread count
    that changes mid-run changes nothing computed, only how fast."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"set_threads: the thread count must be an integer >= 1, got "
                         f"{count!r}")
    torch.set_num_threads(count)
    if "numba" in sys.modules:
        numba_threads()


def numba_threads() -> int:
    """Make numba's thread count torch's (at most the pool's size, ``NUMBA_NUM_THREADS``), and
    return it. Starting numba's OpenMP pool resets the process's OpenMP thread count, so
    torch's is read first and put back after."""
    import numba

    count = torch.get_num_threads()
    numba.get_num_threads()  # starts the pool, if it has not started
    torch.set_num_threads(count)
    n = min(count, numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n
