"""What every benchmark shares: one timer, one machine line, one store filler, one registry.

- :func:`timeit` is the one timer. It calls ``fn`` ``warmup`` times untimed, then times
  ``repeats`` blocks of ``number`` calls each with torch's benchmark clock
  (``torch.utils.benchmark.utils.timer.timer``, which synchronises an accelerator before it
  reads the time), and returns a ``torch.utils.benchmark.Measurement``: ``.times`` holds the
  seconds per call of every block, ``.median`` and ``.iqr`` their median and interquartile
  range; :func:`spread` writes ``median (min–max)``. Where a script splits one call into
  phases (a training step's forward, backward, updates), it reads the same clock,
  :func:`clock`, at each phase's end.
- :func:`machine_line` is the CPU model and its speed flags (``rcdl.app.rundir.cpu_flags``),
  torch and the thread count: every table of speed figures is printed under it.
- :func:`fill_stores` fills every growing layer of a model with rows that look trained.
- :func:`case` registers a benchmark case: a function of keyword parameters that returns
  ``{figure: seconds}``, with its defaults and the smaller ones of a smoke run.
  ``benchmarks/run.py`` finds every module under ``benchmarks/`` that registers one, runs
  any case by name and compares it against another git revision (``--base REV``).

This module imports nothing of ``rcdl`` at import time: the runner's child processes import
it beside the ``rcdl`` of another revision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.benchmark import Measurement
from torch.utils.benchmark.utils.common import TaskSpec
from torch.utils.benchmark.utils.timer import timer as clock

__all__ = ["CASES", "Case", "case", "clock", "fill_stores", "machine_line", "spread", "timeit"]


def timeit(fn: Callable[[], Any], repeats: int, *, warmup: int = 1, number: int = 1,
           label: str = "") -> Measurement:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` blocks of ``number`` calls.

    Each block reads torch's benchmark clock before and after (it synchronises the
    accelerator first, so queued kernels are counted), and its time over ``number`` is one
    entry of the result's ``.times``: with ``number = 1`` the time of single calls, with more
    the mean of a block of fast calls. ``.median`` is the median of the blocks (``.iqr`` their
    spread, ``min(.times)`` the best block).
    """
    if repeats < 1 or number < 1:
        raise ValueError(f"timeit needs repeats >= 1 and number >= 1, got {repeats}, {number}")
    for _ in range(warmup):
        fn()
    raw = []
    for _ in range(repeats):
        start = clock()
        for _ in range(number):
            fn()
        raw.append(clock() - start)
    spec = TaskSpec(stmt=label or getattr(fn, "__name__", "fn"), setup="pass",
                    num_threads=torch.get_num_threads())
    return Measurement(number_per_run=number, raw_times=raw, task_spec=spec)


def spread(m: Measurement, scale: float = 1.0, digits: int = 3) -> str:
    """``median (min–max)`` of ``m``'s times per call, each times ``scale``."""
    return (f"{scale * m.median:.{digits}f} ({scale * min(m.times):.{digits}f}–"
            f"{scale * max(m.times):.{digits}f})")


def machine_line(device: torch.device | str | None = None) -> str:
    """The CPU's model and speed flags (:data:`rcdl.app.rundir.SPEED_FLAGS` it has), torch
    and its thread count, and a CUDA device's name where ``device`` is one."""
    from rcdl.app.rundir import SPEED_FLAGS, cpu_flags, cpu_model

    flags = " ".join(cpu_flags()) or "none of " + "/".join(SPEED_FLAGS)
    line = (f"{cpu_model()} (flags {flags}), torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")
    if device is not None and torch.device(device).type == "cuda":
        line += f", {torch.cuda.get_device_name(torch.device(device))}"
    return line


def fill_stores(model: torch.nn.Module, entries: int, gen: torch.Generator, *,
                commit: bool = False) -> None:
    """Append ``entries`` rows to every growing layer's store, rows like a trained store's:
    keys of unit RMS (the normalised inputs' scale), values of RMS 0.01, weights 1e-3.

    Rows are drawn from ``gen`` in blocks of 8 192 (no second full-size temporary).
    ``commit=True`` writes them as a learner's step does (``rcdl.optim._step.commit``), so
    that a hybrid layer's Adam moments follow its store; otherwise
    ``store.append(..., written_at=0)``, which every revision the runner compares against has.
    """
    from rcdl import growing_layers

    if commit:  # imported here: the revisions the runner compares against may lack it
        from rcdl.optim import _step
    for _, layer in growing_layers(model):
        store = layer.store
        factory = {"dtype": store.dtype, "device": store.device}
        store.reserve(len(store) + entries)
        for start in range(0, entries, 8192):
            b = min(8192, entries - start)
            keys = torch.randn(b, store.d_in, generator=gen).to(**factory)  # (b, d_in)
            values = (0.01 * torch.randn(b, store.d_out, generator=gen)).to(**factory)
            weights = torch.full((b,), 1e-3, **factory)  # (b,)
            if commit:
                _step.commit(layer, (keys, values, weights))
            else:
                store.append(keys, values, weights, written_at=0)


@dataclasses.dataclass(frozen=True)
class Case:
    """One registered benchmark: ``fn(**params)`` returns ``{figure: seconds}``.

    ``params`` are its defaults, ``quick`` the values that replace them in a smoke run
    (``--quick``), ``doc`` the first line of ``fn``'s docstring, ``module`` where it lives.
    """

    name: str
    fn: Callable[..., dict[str, float]]
    params: dict[str, Any]
    quick: dict[str, Any]
    doc: str
    module: str

    def run(self, quick: bool = False, **params: Any) -> dict[str, float]:
        """The case's figures at its defaults, overridden by ``quick`` and then ``params``."""
        unknown = set(params) - set(self.params)
        if unknown:
            raise ValueError(f"case {self.name!r} has no parameter {sorted(unknown)}; "
                             f"it has {sorted(self.params)}")
        return self.fn(**{**self.params, **(self.quick if quick else {}), **params})


CASES: dict[str, Case] = {}


def case(name: str, *, quick: dict[str, Any] | None = None,
         **params: Any) -> Callable[[Callable[..., dict[str, float]]],
                                    Callable[..., dict[str, float]]]:
    """Register the decorated function as the benchmark case ``name`` with default
    ``params`` (keyword arguments of the function) and the ``quick`` ones of a smoke run.
    Written as ``@case("name", ...)`` at the start of a line: the runner finds the modules
    that hold cases by that text, before it imports any of them."""

    def register(fn: Callable[..., dict[str, float]]) -> Callable[..., dict[str, float]]:
        if name in CASES and CASES[name].module != fn.__module__:
            raise ValueError(f"benchmark case {name!r} is registered twice: in "
                             f"{CASES[name].module} and {fn.__module__}")
        doc = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
        CASES[name] = Case(name, fn, dict(params), dict(quick or {}), doc, fn.__module__)
        return fn

    return register
