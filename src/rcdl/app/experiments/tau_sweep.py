"""The hybrid network's τ sweep, the paper's Fig. 5 (docs/reference.md §4, §8).

Run it with ``rcdl reproduce hybrid-tau-sweep`` (see docs/hybrid.md).

The hybrid growing network writes a sample's entry only if its query is farther than τ from
every stored key of the layer (:class:`rcdl.hybrid.DistanceGate`). Sweeping τ from "always
grow" to thresholds that keep a few percent of the samples trades the final database size
against accuracy; the paper reports a smooth, graceful decline and no collapse. The pure
growing gws network and parametric-softmax networks trained on the same images are the
reference points.

Every model is trained by the one-epoch protocol of :mod:`rcdl.app.experiments.cifar10` (same
batches, evaluation and run folder; the models are ``hybrid-always``, ``hybrid-tau<τ>`` and
the references), so a sweep is a :class:`~rcdl.app.experiments.cifar10.Cifar10Config` plus two
outputs of its own in the run folder::

    tau_sweep.md / .csv          τ, entries stored (and their fraction of the possible),
                                 test accuracy, test loss, wall time; then the references
    entries_vs_accuracy.png      test accuracy against final entries stored

On the scale: in the residual stream of docs/reference.md §6 every query is RMS-normalised, so its
norm is √3072 ≈ 55.4 and distances lie in [0, 111]. On 2 000 CIFAR-10 training images the
nearest earlier image (first layer, before any Adam step) is farther than 30 / 50 / 60 / 70
for about 94 / 39 / 7 / 0.3 % of the samples, hence the default thresholds.
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from rcdl.app.cifar import CifarData
from rcdl.app.experiments.cifar10 import (
    _HYBRID,
    Cifar10Config,
    _finished_runs,
    combine_runs,
    hybrid_name,
    load_run_config,
    model_spec,
    run_cifar10,
)
from rcdl.app.rundir import RunDir, atomic_write_text, save_figure
from rcdl.store import format_bytes

__all__ = ["TauSweepConfig", "combine_sweep", "run_tau_sweep", "sweep_rows",
           "write_sweep_report"]

EXPERIMENT = "hybrid-tau-sweep"


@dataclass(frozen=True)
class TauSweepConfig:
    """Settings of the τ sweep.

    Attributes:
        taus: distance thresholds; ``None`` is "always grow". The paper's model is τ = 50.
        references: other models of the one-epoch comparison trained on the same images
            (any name :func:`rcdl.app.experiments.cifar10.model_spec` knows).
        train_size, test_size: CIFAR-10 subsets (``None``: the full 50 000 / 10 000). The
            default 2 000 / 1 000 took 14.5 minutes on one CPU thread here.
        eval_every, seed, data_dir, device, dtype, checkpoint: as in
            :class:`~rcdl.app.experiments.cifar10.Cifar10Config`.
    """

    taus: tuple[float | None, ...] = (None, 30.0, 40.0, 50.0, 55.0, 60.0, 65.0, 70.0)
    references: tuple[str, ...] = ("gws", "psoftmax-5000")
    train_size: int | None = 2000
    test_size: int | None = 1000
    eval_every: int = 25
    seed: int = 0
    data_dir: str | None = None
    device: str = "auto"
    dtype: str = "float32"
    checkpoint: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "taus", tuple(self.taus))
        object.__setattr__(self, "references", tuple(self.references))
        if not self.taus:
            raise ValueError("TauSweepConfig: give at least one tau")
        for tau in self.taus:
            if tau is not None and not (isinstance(tau, int | float) and 0 <= tau < float("inf")):
                raise ValueError(f"TauSweepConfig: taus must be finite numbers >= 0 or None "
                                 f"(always grow), got {tau!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"TauSweepConfig: seed must be an int >= 0, got {self.seed!r}")
        self.comparison()  # validates the rest

    @classmethod
    def quick(cls, **overrides: Any) -> TauSweepConfig:
        """A smoke-test scale: 3 thresholds and gws on 300 / 200 images (about a minute)."""
        quick = {"taus": (None, 50.0, 65.0), "references": ("gws",), "train_size": 300,
                 "test_size": 200, "eval_every": 5}
        return cls(**{**quick, **overrides})

    def comparison(self) -> Cifar10Config:
        """The one-epoch comparison this sweep runs."""
        models = tuple(hybrid_name(tau) for tau in self.taus) + self.references
        return Cifar10Config(models=models, train_size=self.train_size,
                             test_size=self.test_size, seeds=(self.seed,),
                             eval_every=self.eval_every, data_dir=self.data_dir,
                             device=self.device, dtype=self.dtype,
                             checkpoint=self.checkpoint)


def run_tau_sweep(
    cfg: TauSweepConfig | None = None,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    data: CifarData | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    download: bool = True,
) -> tuple[RunDir, dict[str, Any]]:
    """Run the sweep into a new run folder (default ``runs/hybrid-tau-sweep-<timestamp>``),
    or continue the interrupted one at ``resume`` (finished models are kept).

    Returns:
        The run folder and its summary (``summary.json``, plus the sweep's rows).
    """
    if resume is not None:
        comparison = load_run_config(resume)
        if cfg is not None:
            comparison = cfg.comparison()  # run_cifar10 checks it is the run's own
    else:
        comparison = (cfg or TauSweepConfig()).comparison()
        if out is None:
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            out = Path("runs") / f"{EXPERIMENT}-{stamp}"
    run, summary = run_cifar10(comparison, out=out, resume=resume, data=data, device=device,
                               progress=progress, download=download, experiment=EXPERIMENT)
    rows = sweep_rows(summary)
    summary["tau_sweep"] = rows
    run.write_summary(summary)
    report = write_sweep_report(run, rows, summary)
    print("\n" + report, end="")
    return run, summary


def combine_sweep(
    run_dirs: list[str | Path],
    out: str | Path,
    *,
    taus: tuple[float | None, ...] | None = None,
    references: tuple[str, ...] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """One sweep table and figure from the finished models of several run folders.

    A full-size sweep takes hours per threshold on a CPU, so its thresholds and reference
    models may come from different invocations, sessions or machines: any run folders of
    the one-epoch comparison with the same protocol (:func:`~rcdl.app.experiments.cifar10.
    combine_runs` checks it). ``taus`` keeps the hybrids of those thresholds and
    ``references`` those other models; ``None`` keeps every one found.

    Writes the combined comparison (``summary.json``, ``results.md``, ``results.csv``,
    ``test_accuracy.png``) plus ``tau_sweep.md``, ``tau_sweep.csv`` and
    ``entries_vs_accuracy.png`` into ``out``.
    """
    hybrids = None if taus is None else [hybrid_name(t) for t in taus]

    def wanted(name: str) -> bool:  # None: every model of that kind
        names = hybrids if _tau_of(name)[0] else references
        return names is None or name in names

    # the names found, filtered; named ones found nowhere stay, so combine_runs reports them
    present = dict.fromkeys(r["model"] for folder in run_dirs
                            for r in _finished_runs(Path(folder))[1]["runs"])
    named = [*(hybrids or ()), *(references or ())]
    models = [m for m in present if wanted(m)] + [m for m in named if m not in present]
    folder, summary = combine_runs(run_dirs, out, models=models)
    rows = sweep_rows(summary)
    summary["tau_sweep"] = rows
    run = RunDir(folder)
    run.write_summary(summary)
    print("\n" + write_sweep_report(run, rows, summary), end="")
    return folder, summary


def _tau_of(model: str) -> tuple[bool, float | None]:
    """(is a hybrid of the sweep, its τ or None for always grow)."""
    match = _HYBRID.fullmatch(model)
    if match is None:
        return (model == "hybrid", 50.0 if model == "hybrid" else None)
    return True, None if match.group(1) == "always" else float(match.group(2))


def sweep_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model of the summary: the hybrids sorted from "always grow" to the largest
    τ, then the references."""
    rows = []
    for r in summary["models"]:
        is_hybrid, tau = _tau_of(r["model"])
        possible = r.get("possible_entries")
        rows.append({
            "model": r["model"], "label": model_spec(r["model"]).label,
            "hybrid": is_hybrid, "tau": tau, "entries": r["entries"],
            "possible_entries": possible,
            "stored_fraction": (r["entries"] / possible if possible and r["entries"] is not None
                                else None),
            "store_bytes": r["store_bytes"], "test_acc_pct": r["test_acc_pct"],
            "test_loss": r["test_loss"], "train_seconds": r["train_seconds"],
            "eval_seconds": r["eval_seconds"],
        })  # fmt: skip
    hybrids = sorted((r for r in rows if r["hybrid"]),
                     key=lambda r: -1.0 if r["tau"] is None else r["tau"])
    return hybrids + [r for r in rows if not r["hybrid"]]


def _cell(value: Any, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def write_sweep_report(run: RunDir, rows: list[dict[str, Any]],
                       summary: dict[str, Any]) -> str:
    """Write ``tau_sweep.md``, ``tau_sweep.csv`` and ``entries_vs_accuracy.png``."""
    d = summary["data"]
    lines = [
        "# Hybrid τ sweep (the paper's Fig. 5, docs/reference.md §4)\n",
        f"{d['n_train']:,} train / {d['n_test']:,} test CIFAR-10 images, one pass, batch 16; "
        "hybrid network of docs/reference.md §6 (3 blocks + readout, T = 5, η = 1, β = 30, "
        "Adam 1e−3 on every entry) with the distance gate at τ.\n",
        "| model | τ | entries stored | of possible | store | test acc. % | test loss "
        "| train s | eval s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tau = "always" if r["hybrid"] and r["tau"] is None else _cell(r["tau"], "g")
        fraction = ("—" if r["stored_fraction"] is None
                    else f"{100 * r['stored_fraction']:.1f} %")
        store = "—" if r["store_bytes"] is None else format_bytes(r["store_bytes"])
        lines.append(
            f"| {r['label']} | {tau} | {_cell(r['entries'], ',')} | {fraction} | {store} "
            f"| {r['test_acc_pct']:.2f} | {r['test_loss']:.3f} | {r['train_seconds']:.1f} "
            f"| {r['eval_seconds']:.1f} |"
        )
    lines.append(f"\nData: {d['source']}, {d['provenance']}.\n")
    report = "\n".join(lines)
    atomic_write_text(report, run.file("tau_sweep.md"))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = [k for k in rows[0] if k != "label"] if rows else []
    writer.writerow(columns)
    for r in rows:
        writer.writerow(["" if r[k] is None else r[k] for k in columns])
    atomic_write_text(buf.getvalue(), run.file("tau_sweep.csv"))
    _plot(rows, run.file("entries_vs_accuracy.png"),
          title=f"Hybrid τ sweep, CIFAR-10, {d['n_train']:,} training images")
    return report


def _plot(rows: list[dict[str, Any]], path: Path, *, title: str) -> Path:
    fig = Figure(figsize=(7.2, 4.6), layout="constrained")
    ax = fig.add_subplot()
    hybrids = [r for r in rows if r["hybrid"]]
    if hybrids:
        ax.plot([r["entries"] for r in hybrids], [r["test_acc_pct"] for r in hybrids],
                marker="o", label="hybrid (τ sweep)")
        for r in hybrids:
            label = "always" if r["tau"] is None else f"τ={r['tau']:g}"
            ax.annotate(label, (r["entries"], r["test_acc_pct"]), textcoords="offset points",
                        xytext=(4, 4), fontsize="small")
    for marker, r in zip("s^vDP*X", (r for r in rows if not r["hybrid"]), strict=False):
        entries = r["entries"]
        if entries is None:  # a parametric model: its table size, all layers
            ax.axhline(r["test_acc_pct"], linestyle="--", linewidth=1, color="gray")
            ax.annotate(r["label"], (0, r["test_acc_pct"]), xycoords=("axes fraction", "data"),
                        xytext=(4, 3), textcoords="offset points", fontsize="small")
        else:
            ax.plot([entries], [r["test_acc_pct"]], marker=marker, linestyle="none",
                    markersize=9, label=r["label"])
    ax.set(xlabel="entries stored at the end (all layers)", ylabel="test accuracy (%)",
           title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return save_figure(fig, path)
