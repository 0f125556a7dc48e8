"""Process-wide defaults of the options that objects take (docs/precision.md, "Product
paths" and "The hybrid's half-precision Adam step").

An option that changes how something is computed, not what (which product path a
half-precision store takes, whether the hybrid's Adam pass is compiled), belongs to the
object that computes: a learner takes it as an argument, saves it in its state dict, and a
run writes it to ``environment.json``. Where the object is not given one, it reads the
process-wide default, a :class:`ProcessDefault`: the environment variable sets it once, at
the first read; :meth:`ProcessDefault.set` and ``with default.using(value):`` change it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ProcessDefault"]


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
