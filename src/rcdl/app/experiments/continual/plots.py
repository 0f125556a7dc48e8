"""The class-incremental experiment's figures (:mod:`rcdl.app.experiments.continual`): the
accuracy matrices, the accuracy curves, the silent memories and the readout's value mass.
Plotting libraries are imported inside the functions that draw."""

from __future__ import annotations

import math
from typing import Any

import torch

from rcdl.app.experiments.continual.analysis import mean_known
from rcdl.app.experiments.continual.spec import ModelName

__all__ = ["plot_curves", "plot_mass", "plot_matrices", "plot_silent"]


def plot_matrices(path: Any, matrices: dict[str, list[list[float | None]]]) -> None:
    """Per model, the mean accuracy matrix as a heatmap: row ``i`` after task ``i``,
    column ``j`` task ``j``'s classes (``j ≤ i``), the value written in each cell."""
    from matplotlib.figure import Figure

    from rcdl._io import save_figure

    names = list(matrices)
    cols = min(4, len(names))
    grid = math.ceil(len(names) / cols)
    fig = Figure(figsize=(3.1 * cols, 2.9 * grid), layout="constrained")
    axes = fig.subplots(grid, cols, squeeze=False)
    image = None
    for ax, name in zip(axes.flat, names, strict=False):
        m = matrices[name]
        t = len(m)
        values = torch.full((t, t), float("nan"))
        for i in range(t):
            for j in range(i + 1):
                if (v := m[i][j]) is not None:
                    values[i, j] = v
        image = ax.imshow(values.numpy(), vmin=0, vmax=100, cmap="viridis")
        for i in range(t):
            for j in range(i + 1):
                if (v := m[i][j]) is not None:
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7,
                            color="white" if v < 55 else "black")
        ax.set_xticks(range(t), [str(j + 1) for j in range(t)])
        ax.set_yticks(range(t), [str(i + 1) for i in range(t)])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("task's classes", fontsize=8)
        ax.set_ylabel("after task", fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.set_axis_off()
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="accuracy (%)")
    save_figure(fig, path)


_KIND_STYLE: dict[str, dict[str, Any]] = {
    "growing": {"linestyle": "-", "marker": "o", "linewidth": 2.0},
    "parametric": {"linestyle": "--", "marker": "s"},
    "pixels": {"linestyle": ":", "marker": "^"}}


def plot_curves(path: Any, matrices: dict[str, list[list[float | None]]]) -> None:
    """Left: accuracy on the classes seen so far after each task; right: accuracy on each
    task's classes after the last task (means over orders and seeds). Solid lines: growing
    models; dashed: parametric ones; dotted: the raw-pixel classifiers."""
    from matplotlib import colormaps

    from rcdl.app.report import Curve, Panel, plot_panels

    palette = colormaps["tab10"]  # 10 colours; the line style tells the kinds apart
    seen, last = [], []
    for k, (name, m) in enumerate(matrices.items()):
        t = len(m)
        steps = list(range(1, t + 1))
        style = {**_KIND_STYLE[ModelName.parse(name).kind], "color": palette(k % 10)}
        seen.append(Curve(steps, [mean_known(m[i][: i + 1]) or 0.0 for i in range(t)], name,
                          style=style))
        last.append(Curve(steps, [m[-1][j] or 0.0 for j in range(t)], None, style=style))
    plot_panels(path, [
        Panel(seen, "tasks learned", "accuracy on the classes seen (%)",
              "while learning", integer_x=True, legend=None),
        Panel(last, "task", "accuracy on its classes (%)", "after the last task",
              integer_x=True, legend=None)],
        (10, 4), figure_legend={"loc": "outside right upper", "fontsize": "small"})


def plot_silent(path: Any, silent: list[dict[str, Any]]) -> None:
    """Per model, per task: accuracy on its test images after the last task with the
    whole model (10-way), from its own entries alone (growing models) and with the whole
    model, task-aware; and task-aware just after learning the task."""
    from matplotlib.figure import Figure

    from rcdl._io import save_figure

    names = list(dict.fromkeys(r["model"] for r in silent))
    cols = min(4, max(1, len(names)))
    grid = math.ceil(len(names) / cols) if names else 1
    fig = Figure(figsize=(3.6 * cols, 3.0 * grid), layout="constrained")
    axes = fig.subplots(grid, cols, squeeze=False)
    bars = (("full_acc", "at the end: whole model, 10-way", "#1f77b4"),
            ("own_entries_acc", "at the end: own entries only, 10-way", "#ff7f0e"),
            ("task_aware_acc", "at the end: whole model, task-aware", "#999999"),
            ("learnt_aware_acc", "just after the task: task-aware", "#dddddd"))
    width = 0.8 / len(bars)
    for ax, name in zip(axes.flat, names, strict=False):
        mine = [r for r in silent if r["model"] == name]
        for k, (key, label, colour) in enumerate(bars):
            for i, r in enumerate(mine):
                if r[key] is not None:
                    ax.bar(i + (k - 1.5) * width, r[key], width * 0.95,
                           yerr=r[key + "_sd"] or 0,
                           color=colour, label=label if i == 0 else None)
                if key == "full_acc" and r[key] is not None:  # a 0 % bar is no bar: say it
                    ax.text(i - 1.5 * width, r[key] + 1.5, f"{r[key]:.0f}", ha="center",
                            va="bottom", fontsize=6, color=colour)
        ax.set_xticks(range(len(mine)),
                      [f"{r['task']}" + (" (last)" if r is mine[-1] else "") for r in mine],
                      fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("task", fontsize=8)
        ax.set_ylabel("accuracy on its images (%)", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.set_axis_off()
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center",
                   ncols=2, fontsize="small")
    save_figure(fig, path)


def plot_mass(path: Any, mass: dict[str, list[list[float]]]) -> None:
    """Per growing model, the readout's signed value mass (:func:`value_mass`, mean over
    orders and seeds) as a heatmap: row ``t`` the entries task ``t`` wrote, column ``k``
    the ``k``-th class of the order; red raises a class, blue lowers it. Each panel has its
    own symmetric colour scale (the rules' value scales differ)."""
    from matplotlib.figure import Figure

    from rcdl._io import save_figure

    names = list(mass)
    cols = min(4, max(1, len(names)))
    grid = math.ceil(len(names) / cols) if names else 1
    fig = Figure(figsize=(3.4 * cols, 2.6 * grid), layout="constrained")
    axes = fig.subplots(grid, cols, squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        m = torch.tensor(mass[name])
        top = float(m.abs().max()) or 1.0
        image = ax.imshow(m.numpy(), cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto")
        ax.set_xticks(range(m.shape[1]), [str(k + 1) for k in range(m.shape[1])], fontsize=7)
        ax.set_yticks(range(m.shape[0]), [str(t + 1) for t in range(m.shape[0])], fontsize=7)
        ax.set_xlabel("class (position in the order)", fontsize=8)
        ax.set_ylabel("written by task", fontsize=8)
        ax.set_title(name, fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    for ax in list(axes.flat)[len(names):]:
        ax.set_axis_off()
    save_figure(fig, path)

