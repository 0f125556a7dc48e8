"""Parametric vs growing generalisation over several epochs (docs/reference.md §8).

Run it with ``rcdl reproduce generalisation`` (see docs/generalisation.md).

The paper's claim (docs/reference.md §8): the same architecture with its key/value tables trained as
ordinary weights fits the training data more slowly and shows a growing train–test gap; the
growing model shows no such gap. Two models, same backbone (docs/reference.md §6: residual stream of
the flattened image, L = 2 pre-norm blocks 3072 → 3072 and a readout 3072 → 10, all
weighted-softmax layers), trained for ``epochs`` passes over the same CIFAR-10 subset:

==============  ===========================================================================
``gws``         growing weighted softmax, T = 6, clipped rule β = 3, η = 0.003, 16 initial
                entries per layer; learns by growth only (:class:`rcdl.optim.grower.Grower`, no
                optimizer) and keeps writing one entry per sample per layer in *every*
                epoch: ``16 + e · N`` entries per layer after ``e`` epochs of ``N`` images
``parametric``  parametric softmax (docs/reference.md §5), T = 3, a fixed table of ``P`` entries per
                layer (keys, weighted values, weights) trained by Adam 1e−3
==============  ===========================================================================

These are the ``gws`` and ``psoftmax-<P>`` models of :mod:`rcdl.app.experiments.cifar10`, built
here by :func:`build_model` from the same library pieces.

Decisions:

- **Table size.** ``P`` defaults to ``N + 16``: the growing model's size after one epoch
  (``N`` written entries plus 16 initial ones per layer). Both models then hold the same
  number of entries per layer after the first epoch; from there the growing model keeps
  growing and the parametric one keeps its size. T = 3 and Adam 1e−3 are docs/reference.md §5's.
- **Orders.** Each epoch is a fresh permutation of the training subset, a pure function of
  ``(seed, epoch)``; epoch 0 is the one-pass order of docs/reference.md §6
  (:func:`rcdl.train.loop.epoch_permutation`). Both models see the same orders.
- **Measurements.** Before training and after every epoch: test accuracy and test loss on
  the whole test subset, and train accuracy and train loss on a fixed random sample of at
  most ``train_eval_size`` images of the training subset (all of it by default when it is
  small); the gap is train accuracy minus test accuracy, in percentage points. All from
  prediction passes in eval mode (nothing is written while measuring).
- **Scale.** A CIFAR-10 subset: the growing model's cost grows with the square of
  ``epochs · N`` (every step attends over all entries so far), the parametric model's with
  ``epochs · N²`` (its table has ``N + 16`` entries); see :class:`GeneralisationConfig`.

Run folder, besides what every run writes (:mod:`rcdl.app.runner`)::

    metrics.jsonl        every evaluation of every (model, seed), tagged with both
    summary.json         per-(model, seed) histories, per-(model, epoch) rows, the gaps
    results.md/.csv      train and test accuracy, gap, losses per epoch (mean ± sd over seeds)
    generalisation.png   train and test accuracy vs epoch for both models, and the gap
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rcdl.app.cifar import CifarData, cifar_summary, load_subsets
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
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
from rcdl.app.runner import Experiment, Session, run_experiment
from rcdl.nn.networks import GrowingSoftmaxNet, ParametricSoftmaxNet
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.optim.grower import Grower
from rcdl.train.loop import Metric, accuracy, evaluate, train_one_pass

__all__ = [
    "EXPERIMENT", "EXPERIMENT_SPEC", "MODELS", "GeneralisationConfig", "build_model", "load_data",
    "run_generalisation",
]  # fmt: skip

EXPERIMENT = "generalisation"
D_IN, CLASSES, DEPTH = 3072, 10, 2
MODELS = {"gws": "growing weighted softmax (gws)", "parametric": "parametric softmax"}
INITIAL_ENTRIES = 16  # the growing model's initial entries per layer (docs/reference.md §6)
_TEST_METRICS: dict[str, Metric] = {"test_acc": accuracy, "test_loss": F.cross_entropy}
# on the fixed training sample; not "train_loss", the trainer's running mean of batch losses
_TRAIN_METRICS: dict[str, Metric] = {"train_acc": accuracy, "train_set_loss": F.cross_entropy}


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class GeneralisationConfig(ExperimentConfig):
    """Settings of the parametric-vs-growing comparison (docs/reference.md §8).

    The defaults (1 000 train / 1 000 test images, 15 epochs, 945 steps, one seed) were
    chosen from measured step costs (docs/generalisation.md gives them and the run times).
    The growing model's step attends over every entry written so far (15 016 per layer at
    the end), so its cost grows with the square of the steps; the parametric one (a
    1 016-entry table per layer, 15.6 M parameters) costs the same every Adam step. The
    parametric model needs several hundred Adam steps at lr 1e−3 to leave chance level, so
    the budget goes to steps (epochs) rather than to images. ``--quick``: 200 train / 200
    test images, 3 epochs, a smoke test; the numbers mean little at this size.
    """

    QUICK = {"train_size": 200, "test_size": 200, "epochs": 3}

    train_size: int = setting(1000, "training images, a random subset that depends on "
                              "--data-seed only (both models and every seed see it)",
                              metavar="N")
    test_size: int = setting(1000, "test images (a random subset)", metavar="N")
    epochs: int = setting(15, "passes over the subset, each in a fresh order", metavar="E")
    seeds: tuple[int, ...] = setting((0,), "seeds; each fixes both models' initialisation "
                                     "and the orders of the training images", minimum=0,
                                     metavar="K")
    train_eval_size: int = setting(2000, "training images on which train accuracy is "
                                   "measured (capped at the subset)", metavar="N")
    parametric_entries: int | None = setting(
        None, "table size of the parametric model per layer", metavar="N",
        default_text="train size + 16, the growing model's size after one epoch")
    batch_size: int = setting(16, "samples per step B (docs/reference.md §6)", metavar="B")
    eval_batch_size: int = setting(500, "images per prediction batch when measuring",
                                   metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets and of the train-accuracy sample",
                             minimum=0)
    device: str = device_setting()

    @property
    def entries(self) -> int:
        """Entries ``P`` per layer of the parametric model."""
        return self.parametric_entries or self.train_size + INITIAL_ENTRIES


# --------------------------------------------------------------------------- the data


load_data = partial(load_subsets, "cifar10")  # the subsets of cfg (rcdl.app.cifar)


# --------------------------------------------------------------------------- running


def build_model(
    name: str, seed: int, cfg: GeneralisationConfig, *, device: torch.device | str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer | None, Grower | None]:
    """Model ``name`` of :data:`MODELS` (the module docstring's table) with its learner,
    reproducibly from ``seed``: the growing model's initial entries are seeded from ``seed``
    and its grower has room for ``cfg.epochs · cfg.train_size`` more entries per layer; the
    parametric one is initialised from torch's global generator seeded with ``seed``.

    Returns:
        ``(model, optimizer or None, grower or None)``, the model on ``device``.
    """
    torch.manual_seed(seed)
    if name == "gws":
        rule = ClippedSoftmaxRule(eta=0.003, beta=3.0)
        model: nn.Module = GrowingSoftmaxNet(D_IN, CLASSES, DEPTH, temperature=6.0, rule=rule,
                                             initial_entries=INITIAL_ENTRIES, seed=seed
                                             ).to(device)
        grower = Grower(model)
        grower.reserve(cfg.epochs * cfg.train_size)
        return model, None, grower
    if name == "parametric":
        model = ParametricSoftmaxNet(D_IN, CLASSES, DEPTH, entries=cfg.entries,
                                     temperature=3.0).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), None
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def _train(name: str, seed: int, cfg: GeneralisationConfig, tensors: tuple, fit: tuple,
           session: Session) -> dict[str, Any]:  # fmt: skip
    """Train one (model, seed) for ``cfg.epochs`` epochs; its result plus its identity."""
    n, device = len(tensors[0]), session.device
    model, optimizer, grower = build_model(name, seed, cfg, device=device)
    x_fit, y_fit = fit

    def train_metrics(epoch: int) -> dict[str, float]:
        return evaluate(model, x_fit, y_fit, _TRAIN_METRICS, batch_size=cfg.eval_batch_size,
                        device=device)  # fmt: skip

    result = train_one_pass(
        model, tensors, batch_size=cfg.batch_size, seed=seed, optimizer=optimizer,
        grower=grower, loss_fn=F.cross_entropy, metrics=_TEST_METRICS,
        eval_every=math.ceil(n / cfg.batch_size), eval_batch_size=cfg.eval_batch_size,
        device=device, run=session.log(model=name, seed=seed), name=f"{name}-seed{seed}",
        progress=session.progress, epochs=cfg.epochs, on_epoch_end=train_metrics,
    )  # fmt: skip
    parameters = sum(p.numel() for p in model.parameters())
    return {"model": name, "seed": seed, "parameters": parameters, **result}


def _sub_runs(cfg: GeneralisationConfig, data: CifarData, session: Session) -> Iterator:
    """Both models for every seed, on the same tensors and training sample."""
    tensors = tuple(t.to(session.device)
                    for t in (data.x_train, data.y_train, data.x_test, data.y_test))
    sample = torch.Generator().manual_seed(cfg.data_seed)  # the fixed train-accuracy sample
    idx = torch.randperm(cfg.train_size, generator=sample)[:cfg.train_eval_size]
    idx = idx.to(session.device)
    fit = (tensors[0][idx], tensors[1][idx])  # (K, 3072), (K,)
    for seed in cfg.seeds:
        for name in MODELS:
            yield f"{name}-seed{seed}", partial(_train, name, seed, cfg, tensors, fit, session)


def _start(cfg: GeneralisationConfig, data: CifarData) -> dict[str, Any]:
    summary = cifar_summary(cfg, data)
    summary["data"]["train_eval_size"] = min(cfg.train_eval_size, cfg.train_size)
    return {**summary, "parametric_entries": cfg.entries}


def _finish(cfg: GeneralisationConfig, summary: dict[str, Any]) -> None:
    summary["rows"] = epoch_rows(summary["runs"], cfg.epochs)
    summary["gaps"] = gap_change(summary["rows"], cfg.epochs)


def run_generalisation(cfg: GeneralisationConfig, **kw: Any) -> tuple[RunDir, dict[str, Any]]:
    """Train both models for every seed (:func:`rcdl.app.runner.run_experiment`).

    The summary adds ``parametric_entries``, ``rows`` (per (model, epoch), averaged over
    seeds, accuracies in percent) and ``gaps`` (per model: the gap after the first and the
    last epoch); each of ``runs`` holds parameters, entries, seconds and the ``history`` of
    every evaluation."""
    return run_experiment(EXPERIMENT_SPEC, cfg, **kw)


# --------------------------------------------------------------------------- reporting


def epoch_rows(runs: list[dict[str, Any]], epochs: int) -> list[dict[str, Any]]:
    """One row per (model, epoch ``0..epochs``), mean and sd over seeds; accuracies and the
    gap (train minus test accuracy) in percent, losses in nats (``train_set_loss``: the
    cross-entropy on the fixed training sample, in eval mode)."""
    rows = []
    for name, rs in group_runs(runs, MODELS).items():
        for epoch in range(epochs + 1):
            at = [next(h for h in r["history"] if h["epoch"] == epoch) for r in rs]
            row: dict[str, Any] = {"model": name, "epoch": epoch,
                                   "seeds": [r["seed"] for r in rs]}  # fmt: skip
            for key, scale in (("train_acc", 100), ("test_acc", 100), ("gap", 100),
                               ("train_set_loss", 1), ("test_loss", 1)):  # fmt: skip
                values = [scale * (h["train_acc"] - h["test_acc"] if key == "gap" else h[key])
                          for h in at]  # fmt: skip
                suffix = "_pct" if scale == 100 else ""
                row[f"{key}{suffix}"], row[f"{key}{suffix}_sd"] = mean_sd(values)
            n = rs[0]["samples"] // rs[0]["epochs"]
            row["entries_per_layer"] = (INITIAL_ENTRIES + epoch * n if rs[0]["entries"]
                                        is not None else None)  # fmt: skip
            rows.append(row)
    return rows


def gap_change(rows: list[dict[str, Any]], epochs: int) -> dict[str, dict[str, float]]:
    """Per model: the gap (percentage points) after the first and the last epoch, and its
    change between them."""
    gaps = {}
    for name, rs in group_runs(rows, MODELS).items():
        first, last = (next(r["gap_pct"] for r in rs if r["epoch"] == e) for e in (1, epochs))
        gaps[name] = {"first": first, "last": last, "change": last - first}
    return gaps


def results_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`epoch_rows`: one line per epoch, both models side by
    side (train acc., test acc., gap, test loss)."""
    names = list(group_runs(rows, MODELS))
    at = {(r["model"], r["epoch"]): r for r in rows}
    columns = (("train %", "train_acc_pct", 2), ("test %", "test_acc_pct", 2),
               ("gap", "gap_pct", 2), ("test loss", "test_loss", 3))  # fmt: skip
    header = ["epoch", *(f"{m} {title}" for m in names for title, _, _ in columns)]
    lines = [[epoch, *(pm(at[m, epoch][key], at[m, epoch][f"{key}_sd"], digits)
                       for m in names for _, key, digits in columns)]
             for epoch in sorted({r["epoch"] for r in rows})]  # fmt: skip
    return markdown_table(header, lines, align="r" * len(header))


def plot_generalisation(rows: list[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Left: train (dashed) and test (solid) accuracy vs epoch, one colour per model. Right:
    the train–test gap vs epoch (a ± sd band with several seeds)."""
    acc, gap = [], []
    for name, rs in group_runs(sorted(rows, key=lambda r: r["epoch"]), MODELS).items():
        label, epochs = MODELS[name], [r["epoch"] for r in rs]
        acc += [Curve(epochs, [r["test_acc_pct"] for r in rs], f"{label}, test", group=name,
                      style={"marker": "o"}),
                Curve(epochs, [r["train_acc_pct"] for r in rs], f"{label}, train", group=name,
                      style={"marker": "o", "linestyle": "--"})]  # fmt: skip
        gap.append(Curve(epochs, [r["gap_pct"] for r in rs], label,
                         sd=[r["gap_pct_sd"] for r in rs], group=name, style={"marker": "o"}))
    return plot_panels(path, [
        Panel(acc, "epoch", "accuracy (%)", title, integer_x=True),
        Panel(gap, "epoch", "train − test accuracy (points)", "generalisation gap",
              hlines=[{"y": 0, "color": "grey", "linewidth": 0.8}], integer_x=True),
    ], figsize=(10, 4.2))  # fmt: skip


def write_report(run: RunDir, cfg: GeneralisationConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv`` and ``generalisation.png``; return the markdown."""
    d, rows, gaps = summary["data"], summary["rows"], summary["gaps"]
    steps = math.ceil(d["n_train"] / cfg.batch_size)
    protocol = (
        f"{d['n_train']:,} train / {d['n_test']:,} test CIFAR-10 images (random subsets, data "
        f"seed {cfg.data_seed}). {cfg.epochs} epochs, each a fresh order of the training "
        f"images, batch {cfg.batch_size} ({steps:,} steps per epoch), cross-entropy. Train "
        f"accuracy and loss on a fixed sample of {d['train_eval_size']:,} training images, test "
        f"accuracy and loss on all {d['n_test']:,} test images, before training and after "
        f"every epoch. Seeds: {' '.join(map(str, cfg.seeds))}."
    )
    models = []
    for name, rs in group_runs(summary["runs"], MODELS).items():
        size = (f"{INITIAL_ENTRIES} + {d['n_train']:,} entries per layer and epoch, "
                f"{rs[0]['entries']:,} in all at the end, no parameters, no optimizer"
                if name == "gws" else
                f"{cfg.entries:,} entries per layer, {rs[0]['parameters']:,} parameters, "
                "Adam 1e−3")  # fmt: skip
        seconds = statistics.fmean(x["train_seconds"] for x in rs)
        models.append(f"- **{name}**: {MODELS[name]}; {size}; {seconds:.1f} s training per "
                      "seed.")
    verdict = "\n".join(
        f"- {name}: gap {g['first']:+.2f} points after epoch 1, {g['last']:+.2f} after epoch "
        f"{cfg.epochs} (change {g['change']:+.2f})."
        for name, g in gaps.items()
    )
    report = "\n\n".join([
        "# Parametric vs growing generalisation (docs/reference.md §8)", protocol,
        "\n".join(models),
        results_table(rows),
        "Accuracies in percent and losses in nats, mean ± sd over seeds; gap = train minus "
        "test accuracy, in percentage points. Epoch 0: before training.",
        verdict,
        "The paper reports a widening gap for the parametric model and none for the growing "
        "one (docs/reference.md §8; it gives no numbers).",
        f"Data: {d['source']}, {d['provenance']}.\nMachine: {describe_machine(device)}.\n",
    ])  # fmt: skip
    title = f"CIFAR-10, {d['n_train']:,} training images, {cfg.epochs} epochs"
    return write_outputs(run, report, csv_text(rows), {
        "generalisation.png": partial(plot_generalisation, rows, title=title)})


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=GeneralisationConfig,
    help="parametric vs growing softmax networks over several epochs: train and test "
    "accuracy and their gap (docs/reference.md §8)",
    description="The growing gws network (writing entries every epoch) against the same "
    "architecture with its key/value/weight tables trained as parameters by Adam, over "
    "several epochs on a CIFAR-10 subset. Writes results.md, results.csv and "
    "generalisation.png. See docs/generalisation.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_data, start=_start,
    finish=_finish,
)  # fmt: skip
