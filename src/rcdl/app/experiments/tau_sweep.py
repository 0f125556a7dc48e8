"""The hybrid network's τ sweep, the paper's Fig. 5 (docs/reference.md §4, §8).

Run it with ``rcdl reproduce hybrid-tau-sweep`` (see docs/hybrid.md).

The hybrid growing network writes a sample's entry only if its query is farther than τ from
every stored key of the layer (:class:`rcdl.nn.hybrid.DistanceGate`). Sweeping τ from "always
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

Its :data:`EXPERIMENT_SPEC` is the comparison's with a config, rows and report of its own;
``config.json`` holds the comparison's config (:meth:`TauSweepConfig.comparison`), the one a
resumed sweep continues with.

On the scale: in the residual stream of docs/reference.md §6 every query is RMS-normalised, so its
norm is √3072 ≈ 55.4 and distances lie in [0, 111]. On 2 000 CIFAR-10 training images the
nearest earlier image (first layer, before any Adam step) is farther than 30 / 50 / 60 / 70
for about 94 / 39 / 7 / 0.3 % of the samples, hence the default thresholds.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.experiments import cifar10
from rcdl.app.experiments.cifar10 import report as cifar10_report
from rcdl.app.experiments.cifar10.combine import combine_runs, finished_runs
from rcdl.app.experiments.cifar10.config import DTYPES, Cifar10Config
from rcdl.app.models import hybrid_name, hybrid_tau, model_spec
from rcdl.app.report import csv_text, markdown_table
from rcdl.app.rundir import RunDir, atomic_write_text, read_config, save_figure
from rcdl.app.runner import Combine, run_experiment
from rcdl.nn.store import format_bytes

__all__ = ["EXPERIMENT_SPEC", "TauSweepConfig", "combine_sweep", "run_tau_sweep",
           "sweep_rows", "write_sweep_report"]  # fmt: skip

EXPERIMENT = "hybrid-tau-sweep"


def parse_tau(text: str) -> float | None:
    """A threshold on the command line: a number (the config checks it), or ``always``
    (``None``)."""
    if text == "always":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'always': {text!r}") from None


@dataclass(frozen=True)
class TauSweepConfig(ExperimentConfig):
    """Settings of the τ sweep: a one-epoch comparison (:meth:`comparison`) of the hybrid at
    each threshold beside the reference models, one seed.

    The defaults are 2 000 / 1 000 images; ``--quick`` is a smoke test (run times in
    docs/hybrid.md, "Cost").
    """

    QUICK = {"taus": (None, 50.0, 65.0), "references": ("gws",), "train_size": 300,
             "test_size": 200, "eval_every": 5}  # fmt: skip

    # None is "always grow" (a tuple of floats may hold None); the paper's model is τ = 50
    taus: tuple[float, ...] = setting(
        (None, 30.0, 40.0, 50.0, 55.0, 60.0, 65.0, 70.0), "thresholds, 'always' for always grow",
        metavar="TAU", parse=parse_tau, default_text="always 30 40 50 55 60 65 70")
    references: tuple[str, ...] = setting(
        ("gws", "psoftmax-5000"), "other models of cifar10-1epoch to train on the same images",
        metavar="NAME")
    train_size: int | None = setting(2000, "training images", metavar="N")
    test_size: int | None = setting(1000, "test images", metavar="N")
    eval_every: int = setting(25, "steps between test evaluations", metavar="STEPS")
    seed: int = setting(0, "seed of the models and data order", minimum=0)
    data_dir: str | None = data_dir_setting()
    device: str = device_setting()
    dtype: str = setting("float32", "the models' dtype", choices=DTYPES)
    checkpoint: bool = setting(
        True, "save each model's state under checkpoints/ while it trains",
        flag_help="write no checkpoints (an interrupted model restarts from scratch)")

    def check(self) -> None:
        self.comparison()  # the models must be known, and distinct

    def comparison(self) -> Cifar10Config:
        """The one-epoch comparison this sweep runs."""
        models = tuple(hybrid_name(tau) for tau in self.taus) + self.references
        return Cifar10Config(models=models, train_size=self.train_size,
                             test_size=self.test_size, seeds=(self.seed,),
                             eval_every=self.eval_every, data_dir=self.data_dir,
                             device=self.device, dtype=self.dtype,
                             checkpoint=self.checkpoint)


def run_tau_sweep(cfg: TauSweepConfig | Cifar10Config | None = None, *,
                  resume: str | Path | None = None,
                  **kw: Any) -> tuple[RunDir, dict[str, Any]]:  # fmt: skip
    """:func:`rcdl.app.runner.run_experiment` of the sweep (``cfg=None``: the default, or
    the saved comparison of the run at ``resume``). The summary is the one-epoch
    comparison's (:func:`~rcdl.app.experiments.cifar10.run_cifar10`) plus the sweep's rows
    ``tau_sweep`` (:func:`sweep_rows`)."""
    if cfg is None:
        cfg = TauSweepConfig() if resume is None else read_config(resume, Cifar10Config)
    return run_experiment(EXPERIMENT_SPEC, cfg, resume=resume, **kw)


def _start(cfg: Cifar10Config, data: Any) -> dict[str, Any]:
    """The comparison's; the summary says the folder is one (``combine_runs`` reads it)."""
    start = cifar10.EXPERIMENT_SPEC.start
    assert start is not None  # the comparison's summary starts with the data's description
    return {**start(cfg, data), "experiment": cifar10.EXPERIMENT}


def _finish(cfg: Cifar10Config, summary: dict[str, Any]) -> None:
    summary["tau_sweep"] = sweep_rows(summary)


def write_report(run: RunDir, cfg: Cifar10Config, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """The comparison's report (:func:`rcdl.app.experiments.cifar10.report.write_report`), then the
    sweep's (:func:`write_sweep_report`)."""
    comparison = cifar10_report.write_report(run, cfg, summary, device)
    return comparison + "\n" + write_sweep_report(run, summary["tau_sweep"], summary)


def combine_sweep(
    run_dirs: list[str | Path],
    out: str | Path,
    *,
    taus: tuple[float | None, ...] | None = None,
    references: tuple[str, ...] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """One sweep table and figure from the finished models of several run folders.

    A full-size sweep is long on a CPU, so its thresholds and reference
    models may come from different invocations, sessions or machines: any run folders of
    the one-epoch comparison with the same protocol (:func:`~rcdl.app.experiments.cifar10.
    combine_runs` checks it). ``taus`` keeps the hybrids of those thresholds and
    ``references`` those other models; ``None`` keeps every one found.

    Writes what ``combine_runs`` writes plus ``tau_sweep.md``, ``tau_sweep.csv`` and
    ``entries_vs_accuracy.png`` into ``out``.
    """
    hybrids = None if taus is None else [hybrid_name(t) for t in taus]

    def wanted(name: str) -> bool:  # None: every model of that kind
        names = hybrids if hybrid_tau(name)[0] else references
        return names is None or name in names

    # the names found, filtered; named ones found nowhere stay, so combine_runs reports them
    present = dict.fromkeys(r["model"] for folder in run_dirs
                            for r in finished_runs(Path(folder))[1]["runs"])
    named = [*(hybrids or ()), *(references or ())]
    models = [m for m in present if wanted(m)] + [m for m in named if m not in present]
    folder, summary = combine_runs(run_dirs, out, models=models)
    rows = sweep_rows(summary)
    summary["tau_sweep"] = rows
    run = RunDir(folder)
    run.write_summary(summary)
    print("\n" + write_sweep_report(run, rows, summary), end="")
    return folder, summary


def sweep_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model of the summary: the hybrids sorted from "always grow" to the largest
    τ, then the references."""
    rows = []
    for r in summary["models"]:
        is_hybrid, tau = hybrid_tau(r["model"])
        possible = r.get("possible_entries")
        rows.append({
            "model": r["model"], "label": model_spec(r["model"]).label,
            "hybrid": is_hybrid, "tau": tau, "entries": r["entries"],
            "possible_entries": possible,
            "stored_fraction": (r["entries"] / possible if possible and r["entries"] is not None
                                else None),
            **{k: r[k] for k in ("store_bytes", "test_acc_pct", "test_loss", "train_seconds",
                                 "eval_seconds")},
        })  # fmt: skip
    hybrids = sorted((r for r in rows if r["hybrid"]),
                     key=lambda r: -1.0 if r["tau"] is None else r["tau"])
    return hybrids + [r for r in rows if not r["hybrid"]]


def _cell(value: Any, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def write_sweep_report(run: RunDir, rows: list[dict[str, Any]],
                       summary: dict[str, Any]) -> str:
    """Write ``tau_sweep.md``, ``tau_sweep.csv`` and ``entries_vs_accuracy.png``; return
    the markdown."""
    d = summary["data"]
    header = ["model", "τ", "entries stored", "of possible", "store", "test acc. %",
              "test loss", "train s", "eval s"]
    cells = []
    for r in rows:
        tau = "always" if r["hybrid"] and r["tau"] is None else _cell(r["tau"], "g")
        fraction = ("—" if r["stored_fraction"] is None
                    else f"{100 * r['stored_fraction']:.1f} %")
        store = "—" if r["store_bytes"] is None else format_bytes(r["store_bytes"])
        cells.append([r["label"], tau, _cell(r["entries"], ","), fraction, store,
                      f"{r['test_acc_pct']:.2f}", _cell(r["test_loss"], ".3f"),
                      f"{r['train_seconds']:.1f}", f"{r['eval_seconds']:.1f}"])
    report = "\n".join([
        "# Hybrid τ sweep (the paper's Fig. 5, docs/reference.md §4)\n",
        f"{d['n_train']:,} train / {d['n_test']:,} test CIFAR-10 images, one pass, batch 16; "
        "hybrid network of docs/reference.md §6 (3 blocks + readout, T = 5, η = 1, β = 30, "
        "Adam 1e−3 on every entry) with the distance gate at τ.\n",
        markdown_table(header, cells),
        f"\nData: {d['source']}, {d['provenance']}.\n",
    ])  # fmt: skip
    atomic_write_text(report, run.file("tau_sweep.md"))
    atomic_write_text(csv_text(rows, [k for k in rows[0] if k != "label"] if rows else []),
                      run.file("tau_sweep.csv"))
    _plot(rows, run.file("entries_vs_accuracy.png"),
          title=f"Hybrid τ sweep, CIFAR-10, {d['n_train']:,} training images")
    return report


def _plot(rows: list[dict[str, Any]], path: Path, *, title: str) -> Path:
    from matplotlib.figure import Figure  # only where a figure is drawn: `rcdl --help` skips it

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


EXPERIMENT_SPEC = replace(
    cifar10.EXPERIMENT_SPEC, name=EXPERIMENT, config=TauSweepConfig,
    help="the paper's Fig. 5: the hybrid network over a range of distance thresholds τ, "
    "entries stored against accuracy (docs/reference.md §4)",
    description="The hybrid growing network (docs/reference.md §4, §6) trained for one epoch "
    "with each distance threshold τ, beside the pure growing gws network and a "
    "parametric-softmax network on the same images. Writes the one-epoch comparison's run "
    "folder plus tau_sweep.md, tau_sweep.csv and entries_vs_accuracy.png. See docs/hybrid.md.",
    saved_config=Cifar10Config, to_saved=TauSweepConfig.comparison, start=_start,
    finish=_finish, report=write_report,
    combine=Combine(combine_sweep, keep=("taus", "references")),
    switches={"full": ("the paper's scale: all 50 000 / 10 000 images (for a GPU; run "
                       "times in docs/hybrid.md)",
                       {"train_size": None, "test_size": None, "eval_every": 250})},
)  # fmt: skip
