"""DeltaNet-style decay against multiplicative weight decay and none (docs/reference.md §7, §8).

Run it with ``rcdl reproduce deltanet-decay`` (see docs/optimizer_experiments.md).

The paper's finding (docs/reference.md §8): a 10-layer residual MLP trained for 2000 epochs on
CIFAR-10 improves from 67 % to 74 % test accuracy with DeltaNet decay, where multiplicative weight
decay barely helps. Three variants (:data:`VARIANTS`) of the same SGD, from the same
initialisation, over the same orders of the same images:

================  =========================================================================
``none``          ``torch.optim.SGD(lr, momentum)``
``weight-decay``  ``torch.optim.SGD(lr, momentum, weight_decay=λ_wd)``: every step shrinks
                  every direction of ``W`` (coupled: ``λ_wd W`` joins the gradient)
``deltanet``      :class:`rcdl.dual_optim.DeltaNetDecay` ``(lr, momentum, decay=λ_dn)``:
                  ``W̃ ← W̃ − lr · m − λ_dn W̃ X̃ᵀX̃ / B`` shrinks ``W̃`` only along the
                  directions the current batch's inputs span (docs/reference.md §7, a derived
                  reading)
================  =========================================================================

The model is docs/reference.md §6's ResNet-MLP (:class:`rcdl.networks.ResNetMLP`) with
``depth = 10`` residual blocks (each one Linear ``w → w`` + tanh-GELU; "10-layer" is read as ten
blocks, plus the linear readout), on the images seen through the fixed random projection of
:mod:`rcdl.app.experiments.optimizers` (``width=None``: the 3072 pixel values).

Decisions:

- **What the paper's run is** (:meth:`DeltaNetDecayConfig.paper`): the whole of CIFAR-10,
  width 3072, 10 blocks, 2000 epochs. docs/reference.md states neither its batch size, learning
  rate, momentum nor decay rates; ``paper()`` keeps this module's (batch 64, SGD lr 0.03,
  momentum 0.9 and the decay rates below) and the report says so.
- **The reduced default** cuts the training set to 2 000 images, the width to 256 and the
  epochs to 150 (4 800 steps at batch 64), so that the three variants run in an estimated
  10–15 minutes on two shared CPU cores (docs/optimizer_experiments.md). The regime is the
  paper's: far more passes than needed to fit the training subset (the training loss
  reaches about 1e−4), so what is measured is what a decay does to an over-fitting network.
- **Rates** were chosen by a sweep on 2 000 *other* training images with 1 000 more as
  validation (never the test set; docs): lr 0.03 for ``none`` among {0.003, 0.01, 0.03},
  then ``λ_wd`` among {1e−4, 1e−3, 1e−2} and ``λ_dn`` among {1e−5, 1e−4, 1e−3, 1e−2}.
  DeltaNet decay lowered the validation accuracy at every rate, the more the larger the
  rate; ``λ_dn = 1e−5`` is the least harmful. With RMS-normalised block inputs the
  second moment ``X̃ᵀX̃ / B`` has mean eigenvalue about 1 and a top one near 70 (measured
  at the first block), so ``λ_dn`` shrinks a typical input direction by ``λ_dn`` and the
  dominant one by about ``70 λ_dn`` per step; SGD's coupled weight decay shrinks every
  direction by about ``lr · λ_wd / (1 − momentum)``.
- **Measurements.** Test accuracy and loss on the whole test subset before training and
  after every epoch; the training loss is the mean batch loss of each epoch (before each
  update). The verdict compares final test accuracies (one seed by default: run several
  seeds to see the spread).

Run folder::

    config.json, environment.json, metrics.jsonl (every evaluation, tagged with variant and seed)
    finished.json    each finished (variant, seed)'s result, written as it finishes
    summary.json     per-run histories, per-(variant, epoch) rows, the verdict
    results.md/.csv  final numbers and a per-epoch excerpt; every epoch in the CSV
    deltanet_decay.png   training loss and test accuracy against epochs, the three variants

Resume: :func:`run_deltanet_decay` with ``resume=RUN_DIR`` skips the (variant, seed) runs
that ``finished.json`` holds and trains the others from scratch; the tables are then those
of an uninterrupted run. ``metrics.jsonl`` may repeat the evaluations of the run that was
interrupted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rcdl.app.cifar import CifarData
from rcdl.app.experiments.cifar10 import data_provenance
from rcdl.app.experiments.optimizers import (
    PAPER_WIDTH,
    _check_int,
    _check_positive,
    _check_seeds,
    _load_one,
    epoch_rows,
    epoch_table,
    final_table,
    plot_curves,
    project,
    results_csv,
    train_method,
)
from rcdl.app.rundir import (
    RunDir,
    atomic_write_text,
    config_from_dict,
    describe_machine,
    open_run,
    release_memory,
    resolve_device,
)
from rcdl.dual_optim import DeltaNetDecay
from rcdl.networks import ResNetMLP

__all__ = [
    "EXPERIMENT", "PAPER", "VARIANTS", "DeltaNetDecayConfig", "build_variant", "load_data",
    "run_deltanet_decay",
]  # fmt: skip

EXPERIMENT = "deltanet-decay"
CLASSES = 10
VARIANTS = {
    "none": "no decay (SGD)",
    "weight-decay": "multiplicative weight decay (SGD weight_decay)",
    "deltanet": "DeltaNet decay (DeltaNetDecay)",
}
# docs/reference.md §8: test accuracy (%) after 2000 epochs
PAPER = {"none": 67.0, "deltanet": 74.0}
_OWNER = "DeltaNetDecayConfig"
_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeltaNetDecayConfig:
    """Settings of the DeltaNet-decay experiment (docs/reference.md §8).

    Defaults: the reduced run (2 000 train / 2 000 test CIFAR-10 images, width 256,
    150 epochs at batch 64, 4 800 steps); an estimated 10–15 minutes on this project's two
    shared CPU cores, one thread (docs/optimizer_experiments.md). Rates from a validation
    sweep (module docstring). :meth:`paper` gives the paper's run.

    Attributes:
        variants: keys of :data:`VARIANTS`, in the order of the tables.
        train_size, test_size: random CIFAR-10 subsets (``None``: the whole split); they
            depend on ``data_seed`` only.
        epochs: passes over the training subset, each in a fresh order.
        width: ``w`` of the fixed random input projection (``None``: 3072, no projection).
        depth: residual blocks of the MLP (docs/reference.md §8: 10).
        lr, momentum: the SGD all three variants share (heavy ball, PyTorch's convention).
        weight_decay: ``λ_wd`` of the ``weight-decay`` variant (``torch.optim.SGD``'s).
        deltanet_decay: ``λ_dn`` of the ``deltanet`` variant (not multiplied by ``lr``).
        batch_size: samples per step.
        seeds: the experiment runs once per seed (initialisation and orders).
        eval_batch_size: images per prediction batch when measuring.
        data_dir: folder holding ``cifar10.npz`` or the official files (``None``: search
            ``$RCDL_DATA``, then the cache).
        data_seed: seed of the subsets and of the input projection.
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
    """

    variants: tuple[str, ...] = tuple(VARIANTS)
    train_size: int | None = 2000
    test_size: int | None = 2000
    epochs: int = 150
    width: int | None = 256
    depth: int = 10
    lr: float = 3e-2
    momentum: float = 0.9
    weight_decay: float = 1e-4
    deltanet_decay: float = 1e-5
    batch_size: int = 64
    seeds: tuple[int, ...] = (0,)
    eval_batch_size: int = 500
    data_dir: str | None = None
    data_seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("variants", "seeds"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.data_dir is not None:
            object.__setattr__(self, "data_dir", str(self.data_dir))
        if not self.variants:
            raise ValueError(f"{_OWNER}: give at least one variant: {', '.join(VARIANTS)}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"{_OWNER}: unknown variants {unknown}; known: {', '.join(VARIANTS)}")
        if len(set(self.variants)) != len(self.variants):
            raise ValueError(f"{_OWNER}: variants must not repeat, got {list(self.variants)}")
        for name in ("train_size", "test_size", "width"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1, owner=_OWNER)
        for name in ("epochs", "depth", "batch_size", "eval_batch_size"):
            _check_int(name, getattr(self, name), minimum=1, owner=_OWNER)
        for name in ("lr", "weight_decay", "deltanet_decay"):
            _check_positive(name, getattr(self, name), owner=_OWNER)
        if isinstance(self.momentum, bool) or not isinstance(self.momentum, int | float) \
                or not 0 <= self.momentum < 1:
            raise ValueError(f"{_OWNER}: momentum must be in [0, 1), got {self.momentum!r}")
        _check_seeds(self.seeds, self.data_seed, owner=_OWNER)
        if self.device not in _DEVICES:
            raise ValueError(f"{_OWNER}: device must be one of {list(_DEVICES)}, got "
                             f"{self.device!r}")  # fmt: skip

    @property
    def input_width(self) -> int:
        """``w``: the MLP's width (3072 without a projection)."""
        return self.width or PAPER_WIDTH

    @classmethod
    def quick(cls, **overrides: Any) -> DeltaNetDecayConfig:
        """A smoke-test scale: 300 train / 300 test images, width 64, 10 blocks, 5 epochs
        (about 20 s on two shared CPU cores, one thread); the numbers mean little."""
        quick = {"train_size": 300, "test_size": 300, "width": 64, "epochs": 5}
        return cls(**{**quick, **overrides})

    @classmethod
    def paper(cls, **overrides: Any) -> DeltaNetDecayConfig:
        """The paper's run (docs/reference.md §8): the whole of CIFAR-10 (50 000 / 10 000 images),
        the 3072 pixel values without projection, 10 residual blocks, 2000 epochs.
        docs/reference.md gives no batch size, learning rate, momentum or decay rates: those stay
        this module's (batch 64, i.e. 1.56 M steps per variant; rates swept at width 256, not 3072).
        A GPU job of days."""
        paper = {"train_size": None, "test_size": None, "width": None, "epochs": 2000}
        return cls(**{**paper, **overrides})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeltaNetDecayConfig:
        """The config saved as ``config.json`` (unknown keys are an error)."""
        return config_from_dict(cls, d)


def load_data(cfg: DeltaNetDecayConfig, *, download: bool = True) -> CifarData:
    """The CIFAR-10 subsets of ``cfg`` (before projection).

    Raises:
        rcdl.app.cifar.CifarNotFoundError, rcdl.app.cifar.CorruptDataError: from the loader.
        ValueError: if a subset is larger than the split.
    """
    return _load_one("cifar10", cfg, download=download)


def build_variant(name: str, seed: int, cfg: DeltaNetDecayConfig, *,
                  device: torch.device | str = "cpu") -> tuple[nn.Module, Any, None]:  # fmt: skip
    """The MLP and the optimizer of variant ``name``, reproducibly from ``seed`` (torch's
    global generator is seeded with it before the initialisation).

    Returns:
        ``(model, optimizer, None)``, the model ``(B, w) → (B, 10)`` on ``device``.
    """
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    torch.manual_seed(seed)
    model = ResNetMLP(cfg.input_width, CLASSES, depth=cfg.depth).to(device)
    params = list(model.parameters())
    if name == "none":
        optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    elif name == "weight-decay":
        optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                                    weight_decay=cfg.weight_decay)  # fmt: skip
    else:
        optimizer = DeltaNetDecay(model, lr=cfg.lr, decay=cfg.deltanet_decay,
                                  momentum=cfg.momentum)  # fmt: skip
    return model, optimizer, None


def run_deltanet_decay(
    cfg: DeltaNetDecayConfig,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    data: CifarData | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    download: bool = True,
) -> tuple[RunDir, dict[str, Any]]:
    """Train every variant for every seed into a new run folder, or continue the one at
    ``resume``; write the report.

    Args:
        cfg: the settings; to resume, the run's own (``rcdl.app.rundir.read_config``), where
            only ``data_dir`` and ``device`` may differ.
        out: the run folder (default ``runs/deltanet-decay-<timestamp>``); it must not
            already hold a run. Not with ``resume``.
        resume: an interrupted run folder: its finished (variant, seed) runs are read back,
            the others trained from scratch.
        data: the subsets already loaded by :func:`load_data` (before projection; their
            sizes must be the config's). Default: load them here.
        device: overrides ``cfg.device``.
        progress: show progress bars.
        download: download CIFAR-10 when no copy is found.

    Returns:
        The run folder and its summary (the content of ``summary.json``): ``runs`` (per
        (variant, seed): parameters, seconds, ``history`` per epoch), ``rows`` (per
        (variant, epoch), mean and sd over seeds, accuracy in percent) and ``verdict``.
    """
    start = time.perf_counter()
    device = resolve_device(cfg.device) if device is None else torch.device(device)
    if data is None:
        data = load_data(cfg, download=download)
    sizes, want = (len(data.y_train), len(data.y_test)), (cfg.train_size, cfg.test_size)
    if any(w is not None and s != w for s, w in zip(sizes, want, strict=True)):
        raise ValueError(f"the data has {sizes[0]} train / {sizes[1]} test images, the config "
                         f"asks for {want[0]} / {want[1]}; pass load_data(cfg) or no data")
    run = open_run(EXPERIMENT, cfg, out=out, resume=resume, device=device)
    summary: dict[str, Any] = {
        "experiment": EXPERIMENT, "complete": False,
        "data": {**data.describe(), "provenance": data_provenance(data.source),
                 "data_seed": cfg.data_seed},
        "input_width": cfg.input_width, "runs": [],
    }  # fmt: skip
    data = project(data, cfg.width, cfg.data_seed)
    tensors = tuple(t.to(device) for t in (data.x_train, data.y_train, data.x_test, data.y_test))

    def build(name: str, seed: int) -> tuple[nn.Module, Any, None]:
        return build_variant(name, seed, cfg, device=device)

    with run.resumable(f"rcdl reproduce {EXPERIMENT}", cfg.data_dir):
        for seed in cfg.seeds:
            for name in cfg.variants:
                train = partial(train_method, name, seed, cfg, build, tensors, run,
                                device=device, progress=progress, key="variant",
                                dataset="cifar10")  # fmt: skip
                summary["runs"].append(run.sub_run(f"{name}-seed{seed}", train))
                summary["seconds"] = time.perf_counter() - start
                run.write_summary(summary)
                release_memory(device)

    summary["rows"] = epoch_rows(summary["runs"], cfg.variants, key="variant")
    summary["verdict"] = verdict(summary["rows"], cfg.epochs)
    summary["complete"] = True
    summary["seconds"] = time.perf_counter() - start
    report = write_report(run, cfg, summary, device)
    run.write_summary(summary)
    print("\n" + report, end="")
    print(f"Run time {summary['seconds']:.1f} s. Run folder: {run.path}")
    return run, summary


# --------------------------------------------------------------------------- reporting


def verdict(rows: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    """Final test accuracy (percent) per variant and whether DeltaNet decay beats both
    controls (``None`` unless all three variants ran)."""
    final = {r["variant"]: r["test_acc_pct"] for r in rows if r["epoch"] == epochs}
    out: dict[str, Any] = {"final_test_acc_pct": final, "deltanet_beats_both": None}
    if set(VARIANTS) <= set(final):
        controls = max(final["none"], final["weight-decay"])
        out["deltanet_beats_both"] = final["deltanet"] > controls
        out["margin_pct"] = final["deltanet"] - controls
    return out


def shown_epochs(epochs: int, count: int = 10) -> list[int]:
    """About ``count`` evenly spaced epochs from 0 to ``epochs`` (both included)."""
    return sorted({round(epochs * k / count) for k in range(count + 1)})


def write_report(run: RunDir, cfg: DeltaNetDecayConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv`` and ``deltanet_decay.png``; return the markdown."""
    d, v = summary["data"], summary["verdict"]
    rows = summary["rows"]
    steps = math.ceil(d["n_train"] / cfg.batch_size)
    width = (f"a fixed random projection of the pixels to w = {cfg.width}"
             if cfg.width is not None else "the 3,072 pixel values")  # fmt: skip
    shown = set(shown_epochs(cfg.epochs))
    excerpt = [r for r in rows if r["epoch"] in shown]
    if v["deltanet_beats_both"] is None:
        conclusion = "Not all three variants ran: no verdict."
    else:
        conclusion = (
            f"DeltaNet decay {'beats' if v['deltanet_beats_both'] else 'does not beat'} both "
            f"controls on final test accuracy (margin {v['margin_pct']:+.2f} points over the "
            f"better control; seeds: {' '.join(map(str, cfg.seeds))}).")  # fmt: skip
    parts = [
        "# DeltaNet decay vs weight decay vs none (docs/reference.md §8)",
        f"{d['n_train']:,} train / {d['n_test']:,} test CIFAR-10 images (random subsets, data "
        f"seed {cfg.data_seed}) seen through {width}. ResNet-MLP with {cfg.depth} blocks at "
        f"width {cfg.input_width}; {cfg.epochs} epochs, batch {cfg.batch_size} ({steps:,} steps "
        f"per epoch), cross-entropy; SGD lr {cfg.lr:g}, momentum {cfg.momentum:g} for all; "
        f"weight decay λ = {cfg.weight_decay:g}; DeltaNet decay λ = {cfg.deltanet_decay:g}. "
        "docs/reference.md gives no batch size, learning rate, momentum or decay rate for "
        "this experiment: these are this project's, chosen on a validation split at width "
        "256.",
        final_table(rows, "cifar10", cfg.epochs, VARIANTS, key="variant"),
        "Test accuracy (%) at selected epochs (every epoch in results.csv):",
        epoch_table(excerpt, "cifar10", "test_acc_pct", 2, key="variant"),
        "Training loss (mean batch loss of the epoch) at selected epochs:",
        epoch_table([r for r in excerpt if r["epoch"] >= 1], "cifar10", "train_loss", 4,
                    key="variant"),
        conclusion,
        "Paper (docs/reference.md §8; whole CIFAR-10, 2000 epochs, width 3072): "
        f"{PAPER['none']:.0f} % without decay, {PAPER['deltanet']:.0f} % with DeltaNet "
        "decay; multiplicative weight decay barely helps.",
        f"Data: {d['source']}, {d['provenance']}.\nMachine: {describe_machine(device)}.\n",
    ]  # fmt: skip
    report = "\n\n".join(parts)
    atomic_write_text(report, run.file("results.md"))
    atomic_write_text(results_csv(rows), run.file("results.csv"))
    plot_curves(rows, run.file("deltanet_decay.png"), key="variant",
                title=f"CIFAR-10, {d['n_train']:,} training images, w = {cfg.input_width}, "
                f"{cfg.depth} blocks", labels={m: VARIANTS[m] for m in cfg.variants})
    return report
