"""What every experiment's report is made of: means ± sd over seeds, markdown tables, CSV.

An experiment's ``report`` function (:class:`rcdl.app.runner.Experiment`) builds its
markdown from these and hands the files to :func:`write_outputs`, which writes them into
the run folder atomically.
"""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rcdl.io import atomic_write_text

__all__ = ["csv_text", "markdown_table", "mean_sd", "pm", "write_outputs"]


def mean_sd(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample sd of ``values``: ``sd`` is ``None`` for one value, both for none."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def pm(mean: float | None, sd: float | None, spec: int | str = 2) -> str:
    """``"mean ± sd"`` (``"mean"`` without an sd, ``"—"`` without a mean); ``spec`` is a
    number of decimals or a format spec such as ``".3g"``."""
    if mean is None:
        return "—"
    fmt = f".{spec}f" if isinstance(spec, int) else spec
    return f"{mean:{fmt}}" if sd is None else f"{mean:{fmt}} ± {sd:{fmt}}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]],
                   align: str | None = None) -> str:  # fmt: skip
    """A markdown table; ``align`` has one letter per column, ``l`` (``---``) or ``r``
    (``---:``; the default for every column but the first)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = "|".join("---:" if a == "r" else "---" for a in align)
    lines = [f"| {' | '.join(header)} |", f"|{rule}|"]
    lines += [f"| {' | '.join(str(cell) for cell in row)} |" for row in rows]
    return "\n".join(lines)


def csv_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """``rows`` as CSV (columns: ``columns``, else the first row's keys); lists become
    space-separated cells and ``None`` empty ones."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = list(columns if columns is not None else (rows[0] if rows else []))
    writer.writerow(columns)
    for row in rows:
        cells = [row.get(k) for k in columns]
        writer.writerow(["" if v is None else " ".join(map(str, v)) if isinstance(v, list | tuple)
                         else v for v in cells])
    return buf.getvalue()


def write_outputs(run: Any, markdown: str, csv: str | None = None,
                  figures: Mapping[str, Callable[[Path], Any]] | None = None) -> str:
    """Write ``results.md``, ``results.csv`` (when given) and each figure (``{file name:
    draw(path)}``) into the run folder; returns the markdown."""
    atomic_write_text(markdown, run.file("results.md"))
    if csv is not None:
        atomic_write_text(csv, run.file("results.csv"))
    for name, draw in (figures or {}).items():
        draw(run.file(name))
    return markdown
