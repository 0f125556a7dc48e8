"""Checks of values read back from saved state (checkpoints, replay logs, learners' state
dicts), shared so that each kind of value is judged one way."""

from __future__ import annotations

from typing import Any

__all__ = ["is_count"]


def is_count(value: Any, least: int = 0) -> bool:
    """Whether ``value`` is an ``int`` of at least ``least`` (a ``bool`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
