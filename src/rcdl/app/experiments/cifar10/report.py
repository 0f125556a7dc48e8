"""The one-epoch CIFAR-10 comparison's report: per-model rows averaged over seeds, the
markdown and CSV tables and the accuracy figure of a run folder or a combined table
(``results.md``, ``results.csv``, ``test_accuracy.png``; docs/cifar10.md)."""

from __future__ import annotations

import math
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rcdl.app.experiments.cifar10.config import Cifar10Config
from rcdl.app.models import model_spec
from rcdl.app.report import (
    Curve,
    Panel,
    csv_text,
    group_runs,
    markdown_table,
    mean_sd,
    plot_panels,
    pm,
    write_outputs,
)
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.nn.store import format_bytes

__all__ = ["model_rows", "plot_accuracy", "results_csv", "results_table", "write_report",
           "write_table"]


def model_rows(runs: list[dict[str, Any]], models: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per model, its runs' numbers averaged over seeds (accuracy in percent)."""
    rows = []
    for name, rs in group_runs(runs, models).items():
        acc, acc_sd = mean_sd([100 * r["test_acc"] for r in rs])
        loss, loss_sd = mean_sd([r["test_loss"] for r in rs if r["test_loss"] is not None])
        ref = model_spec(name).reference
        rows.append({
            "model": name, "seeds": [r["seed"] for r in rs],
            "test_acc_pct": acc, "test_acc_pct_sd": acc_sd,
            "test_loss": loss, "test_loss_sd": loss_sd,
            "entries": rs[0]["entries"], "possible_entries": rs[0].get("possible_entries"),
            "store_bytes": rs[0]["bytes"],
            "parameters": rs[0]["parameters"],
            "train_seconds": statistics.fmean(r["train_seconds"] for r in rs),
            "eval_seconds": statistics.fmean(r["eval_seconds"] for r in rs),
            "paper_test_acc_pct": ref.test_acc, "paper_test_loss": ref.test_loss,
            "paper_entries": ref.entries,
            "paper_seeds_acc_pct": None if ref.seeds_acc is None else list(ref.seeds_acc),
        })  # fmt: skip
    return rows


def results_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`model_rows`."""
    header = ["model", "seeds", "test acc. %", "test loss", "entries", "store", "parameters",
              "train s", "eval s", "paper (docs/reference.md §6)"]
    cells = []
    for r in rows:
        entries = "—" if r["entries"] is None else f"{r['entries']:,}"
        possible = r.get("possible_entries")
        if possible and r["entries"] is not None and r["entries"] < possible:
            entries += f" ({100 * r['entries'] / possible:.1f} % of {possible:,})"
        store = "—" if r["store_bytes"] is None else format_bytes(r["store_bytes"])
        cells.append([
            r["model"], " ".join(map(str, r["seeds"])),
            pm(r["test_acc_pct"], r["test_acc_pct_sd"], 2),
            pm(r["test_loss"], r["test_loss_sd"], 3), entries, store, f"{r['parameters']:,}",
            f"{r['train_seconds']:.1f}", f"{r['eval_seconds']:.1f}",
            model_spec(r["model"]).reference.describe(),
        ])  # fmt: skip
    return markdown_table(header, cells, align="ll" + "r" * 7 + "l")


def results_csv(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`model_rows` as CSV (empty cells where a value does not apply), the
    paper's mean ± sd over seeds in two columns."""
    flat = []
    for r in rows:
        mean, sd = r["paper_seeds_acc_pct"] or (None, None)
        flat.append({**{k: v for k, v in r.items() if k != "paper_seeds_acc_pct"},
                     "paper_seeds_acc_pct_mean": mean, "paper_seeds_acc_pct_sd": sd})
    return csv_text(flat)


def plot_accuracy(runs: list[dict[str, Any]], models: tuple[str, ...], path: Path, *,
                  title: str, full_data: bool) -> Path:
    """Test accuracy against training samples seen, one line per model (mean over seeds,
    a band of ± sd with several seeds); with the full data, the paper's final accuracies
    as stars at the end."""
    curves = []
    for name, rs in group_runs(runs, models).items():
        n = min(len(r["history"]) for r in rs)
        samples = [rs[0]["history"][i]["samples"] for i in range(n)]
        acc = [mean_sd([100 * r["history"][i]["test_acc"] for r in rs]) for i in range(n)]
        means = [m for m, _ in acc if m is not None]  # all: every point has runs
        curves.append(Curve(samples, means, name, sd=[sd for _, sd in acc],
                            group=name, style={"marker": "."}))
        ref = model_spec(name).reference.test_acc
        if full_data and ref is not None:
            curves.append(Curve([samples[-1]], [ref], group=name, style={
                "marker": "*", "markersize": 10, "linestyle": "none"}))
    return plot_panels(path, [Panel(curves, "training samples seen", "test accuracy (%)", title,
                                    legend={"fontsize": "small", "ncols": 2})], (7.2, 4.6))


_TABLE_NOTE = (
    "Accuracy and loss: mean ± sd over seeds. Entries and store: all layers at the end. "
    "Train and eval seconds: mean per seed. Paper: the authors' one-seed run on one GPU, "
    "with full data (\"seeds\": the tuned baselines' mean ± sd over seeds)."
)


def write_table(run: RunDir, cfg: Cifar10Config, summary: dict[str, Any],
                  models: tuple[str, ...], seeds: list[int], *, combined: bool,
                  tail: str) -> str:  # fmt: skip
    """``results.md`` (sizes, schedule and seeds; the table; ``tail``), ``results.csv`` and
    ``test_accuracy.png`` of a run or of a combined table; returns the markdown."""
    d = summary["data"]
    full = d["n_train"] == 50_000 and d["n_test"] == 10_000
    scale = ("the full splits" if full else
             f"random subsets (data seed {cfg.data_seed}); not comparable with the paper's "
             "full-data numbers")
    steps = math.ceil(d["n_train"] / cfg.batch_size)
    stores = "" if cfg.store_dtype is None else f" with {cfg.store_dtype} stores"
    report = (
        f"# CIFAR-10, one epoch (the paper's Fig. 2, docs/reference.md §6)"
        f"{', combined' if combined else ''}\n\n"
        f"{d['n_train']:,} train / {d['n_test']:,} test images ({scale}). One pass, batch "
        f"{cfg.batch_size} ({steps:,} steps), cross-entropy, {cfg.dtype}{stores}. Test accuracy "
        f"and loss on all {d['n_test']:,} test images every {cfg.eval_every} "
        f"step{'s' if cfg.eval_every > 1 else ''} and at the end. Seeds: "
        f"{' '.join(map(str, seeds))}.\n\n"
        f"{results_table(summary['models'])}\n\n{_TABLE_NOTE}\n\n"
        f"Data: {d['source']}, {d['provenance']}.\n{tail}"
    )
    title = f"CIFAR-10, one epoch, {d['n_train']:,} training images{stores}"
    return write_outputs(run, report, results_csv(summary["models"]), {
        "test_accuracy.png": partial(plot_accuracy, summary["runs"], models, title=title,
                                     full_data=full)})


def write_report(run: RunDir, cfg: Cifar10Config, summary: dict[str, Any],
                 device: torch.device) -> str:
    """Write ``results.md``, ``results.csv`` and ``test_accuracy.png``; return the markdown."""
    return write_table(run, cfg, summary, cfg.models, list(cfg.seeds), combined=False,
                         tail=f"Machine: {describe_machine(device)}.\n")
