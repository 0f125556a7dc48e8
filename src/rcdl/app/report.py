"""What every experiment's report is made of: means ± sd over seeds, markdown tables, CSV,
figures.

An experiment's ``report`` function (:class:`rcdl.app.runner.Experiment`) builds its
markdown from these and hands the files to :func:`write_outputs`, which writes them into
the run folder atomically. A figure is a row of :class:`Panel` s of :class:`Curve` s, drawn
by :func:`plot_panels`.
"""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rcdl._io import atomic_write_text, save_figure

__all__ = ["Curve", "Panel", "csv_text", "group_runs", "markdown_table", "mean_sd",
           "plot_panels", "pm", "write_outputs"]  # fmt: skip


def group_runs(runs: Iterable[Mapping[str, Any]], names: Iterable[str],
               key: str = "model") -> dict[str, list[Mapping[str, Any]]]:  # fmt: skip
    """``{name: the runs whose key is name}`` in the order of ``names`` (e.g. every seed of
    each model), leaving out the names no run has."""
    runs = list(runs)
    groups = {name: [r for r in runs if r[key] == name] for name in names}
    return {name: rs for name, rs in groups.items() if rs}


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


@dataclass(frozen=True)
class Curve:
    """One line of a :class:`Panel`: ``y`` against ``x``.

    Attributes:
        label: its legend entry (``None``: none).
        sd: a ± sd band around ``y``, drawn when every value is known (several seeds; one
            seed's sd is ``None``, :func:`mean_sd`).
        floor: the band's lower edge is at least ``floor · y`` (for a log axis).
        group: curves of one group, in any panel, share the colour of its first curve.
        style: more keywords of ``Axes.plot`` (``marker``, ``linestyle``, ``color``, ...).
    """

    x: Sequence[float]
    y: Sequence[float]
    label: str | None = None
    sd: Sequence[float | None] | None = None
    floor: float | None = None
    group: Hashable = None
    style: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Panel:
    """One set of axes of :func:`plot_panels`: its curves, labels and scales.

    Attributes:
        hlines: horizontal lines, the keywords of ``Axes.axhline`` each.
        integer_x: x ticks on integers only (epochs).
        grid: the grid lines drawn, ``"major"`` or ``"both"`` (a log axis's minor ones).
        legend: the keywords of ``Axes.legend``; ``None``: no legend (nor one without any
            labelled curve).
        decorate: ``decorate(ax)`` adds what is particular to one figure (ticks, notes).
    """

    curves: Sequence[Curve]
    xlabel: str = ""
    ylabel: str = ""
    title: str = ""
    xscale: str = "linear"
    yscale: str = "linear"
    hlines: Sequence[Mapping[str, Any]] = ()
    integer_x: bool = False
    grid: str = "major"
    legend: Mapping[str, Any] | None = field(default_factory=lambda: {"fontsize": "small"})
    decorate: Callable[[Any], Any] | None = None


def plot_panels(path: Path, panels: Sequence[Panel], figsize: tuple[float, float], *,
                figure_legend: Mapping[str, Any] | None = None) -> Path:  # fmt: skip
    """Draw ``panels`` side by side (bands at alpha 0.2, grid at alpha 0.3) and save the
    figure as PNG at ``path``; ``figure_legend``: one legend for the figure (the keywords of
    ``Figure.legend``, e.g. ``loc="outside right upper"``) instead of one per panel."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    colours: dict[Hashable, Any] = {}
    for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        for c in panel.curves:
            known = {"color": colours[c.group]} if c.group in colours else {}
            (line,) = ax.plot(c.x, c.y, label=c.label, **{**known, **c.style})
            if c.group is not None:
                colours.setdefault(c.group, line.get_color())
            sd = [s for s in c.sd or () if s is not None]
            if sd and len(sd) == len(c.sd or ()):  # a band only where every point has one
                low = [y - s if c.floor is None else max(y - s, c.floor * y)
                       for y, s in zip(c.y, sd, strict=True)]  # fmt: skip
                high = [y + s for y, s in zip(c.y, sd, strict=True)]
                ax.fill_between(c.x, low, high, color=line.get_color(), alpha=0.2)
        for hline in panel.hlines:
            ax.axhline(**hline)
        ax.set(xlabel=panel.xlabel, ylabel=panel.ylabel, title=panel.title,
               xscale=panel.xscale, yscale=panel.yscale)  # fmt: skip
        ax.grid(True, which=panel.grid, alpha=0.3)
        if panel.integer_x:
            ax.xaxis.get_major_locator().set_params(integer=True)
        if panel.decorate is not None:
            panel.decorate(ax)
        if panel.legend is not None and ax.get_legend_handles_labels()[0]:
            ax.legend(**panel.legend)
    if figure_legend is not None:
        fig.legend(**figure_legend)
    return save_figure(fig, path)
