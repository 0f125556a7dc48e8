"""The paper's one-epoch CIFAR-10 comparison, its Fig. 2 (docs/reference.md §6).

Run it with ``rcdl reproduce cifar10-1epoch`` (see docs/cifar10.md).

Protocol (docs/reference.md §6): every model sees the training images once, in batches of 16 taken
from a seeded random permutation, and minimises the batch-mean cross-entropy; test accuracy and
test loss on the whole test set are computed from one prediction pass every ``eval_every``
steps and at the end. Images are standardised and flattened to ``d = 3072``
(:mod:`rcdl.app.cifar`). All models share the residual backbone of :mod:`rcdl.networks`.

Models (:data:`MODELS`). Each builder uses the library's networks, rules and optimizers.
None of them reimplements a layer.

====================  ==================================================================
``gws``               growing weighted softmax, L = 2, T = 6, clipped rule β = 3, η = 0.003
``gauge``             gauge-invariant weighted softmax, L = 2, T = 5, α = 10, η = 0.03, β = 100
``rbf``               growing RBF, L = 2, T = 10, η = 10
``mlp-<opt>``         ResNet-MLP (8 blocks) trained by ``sgd``, ``adam``, ``adamw``,
                      ``rmsprop`` or ``muon`` with the tuned settings of :mod:`rcdl.optim`
``hybrid``            hybrid growing weighted softmax, L = 3, T = 5, τ = 50, η = 1, β = 30,
                      entries also trained by Adam 1e−3 (docs/reference.md §4)
``psoftmax-<N>``      parametric softmax, L = 2, T = 3, N entries per layer, Adam 1e−3
                      (docs/reference.md §5; the paper's N are 5000 and 50016)
``knn-l2``,           k-nearest neighbours (k chosen on 10 % of the training set held out),
``knn-cosine``        L2 or cosine distance (:mod:`rcdl.app.classical`)
``svm-linear``        linear SVM (hinge loss, SGD solver, penalty chosen on the held-out 10 %)
``svm-rbf``           RBF SVM through a Nyström map with 2 000 landmarks, then a linear SVM
====================  ==================================================================

The classical baselines are fitted on the whole training set at once and scored once; their
"train" and "eval" seconds are fit and predict times, and they report no test loss.

The growing models write one entry per training sample per layer. They have no
parameters, so :class:`rcdl.grower.Grower` plays the optimizer's part. The hybrid writes
only the samples its distance gate lets through (the table gives its entries as a fraction
of the possible ones) and trains its entries by :class:`rcdl.entry_adam.EntryAdam`.

Run folder (one per invocation, every model and seed in it), besides what every run
writes (:mod:`rcdl.app.runner`; ``environment.json`` is the first session's)::

    metrics.jsonl       every evaluation of every (model, seed), tagged with both
    summary.json        ``runs``: per (model, seed) accuracy, loss, entries, bytes,
                        parameters, seconds and the ``history`` of evaluations; ``models``:
                        per-model rows (:func:`model_rows`); the data; the sessions
    results.md/.csv     the table: accuracy (mean ± sd over seeds), loss, entries, store,
                        parameters, train/eval seconds, the paper's reference
    test_accuracy.png   test accuracy against training samples seen (mean over seeds)
    checkpoints/<model>-seed<k>.*    while that model trains (deleted when it finishes): the
                        checksummed ``.step<N>.pt`` files of the last two checkpoints and the
                        ``.manifest.json`` that commits them (:mod:`rcdl.checkpoint`)

The finished pairs are kept in ``summary.json`` (no ``finished.json``:
:attr:`rcdl.app.runner.Experiment.finished_in_summary`). A resumed run continues an
interrupted pair from its checkpoint to the result of an uninterrupted run
(:func:`rcdl.training.train_one_pass`); ``metrics.jsonl`` may repeat the evaluations made
between the last checkpoint and the interruption.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rcdl.app import rundir
from rcdl.app.cifar import CifarData, cifar_summary, load_subsets
from rcdl.app.classical import fit_classical
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.experiments.cifar10_models import (  # noqa: F401 - importable from here as before
    CLASSES,
    D_IN,
    MODELS,
    PAPER_MODELS,
    Learner,
    ModelSpec,
    Reference,
    build_model,
    hybrid_name,
    hybrid_tau,
    model_spec,
)
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
from rcdl.app.rundir import RunDir, count, describe_machine, read_config
from rcdl.app.runner import Combine, Experiment, Session, run_experiment
from rcdl.checkpoint import remove_checkpoint
from rcdl.distributed import rank_and_world, shard
from rcdl.half import product_mode
from rcdl.hybrid import HybridSoftmax
from rcdl.store import format_bytes
from rcdl.training import Metric, accuracy, train_one_pass

__all__ = [
    "EXPERIMENT", "EXPERIMENT_SPEC", "METRICS", "MODELS", "Cifar10Config", "ModelSpec",
    "Reference", "build_model", "combine_runs", "hybrid_name", "hybrid_tau", "load_data",
    "model_spec", "run_cifar10",
]  # fmt: skip

EXPERIMENT = "cifar10-1epoch"
METRICS: dict[str, Metric] = {  # the first: the progress bar's
    "test_acc": accuracy, "test_loss": F.cross_entropy}
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class Cifar10Config(ExperimentConfig):
    """Settings of the one-epoch comparison; the defaults are the paper's full protocol.

    ``models`` are names :func:`model_spec` knows. The subsets (``train_size``,
    ``test_size``) depend on ``data_seed`` only, so every model and seed sees the same
    images; a seed fixes a model's initialisation and the order of the training images.
    Each parametric baseline updates 75–770 M parameters per step; on two shared CPU cores
    ``--quick``'s ``mlp-adam`` alone took 5.6 minutes here.
    """

    QUICK = {"models": ("gws", "gauge", "rbf", "mlp-adam"), "train_size": 2000,
             "test_size": 1000, "eval_every": 50}  # fmt: skip

    models: tuple[str, ...] = setting(PAPER_MODELS, "models to train, in order",
                                      metavar="NAME", default_text="every model of the paper")
    train_size: int | None = setting(None, "random subset of N training images", metavar="N",
                                     default_text="all 50000")
    test_size: int | None = setting(None, "random subset of N test images", metavar="N",
                                    default_text="all 10000")
    seeds: tuple[int, ...] = setting((0,), "one run per seed, reported as mean ± sd",
                                     minimum=0, metavar="K")
    batch_size: int = setting(16, "samples per step B (docs/reference.md §6)", metavar="B")
    eval_every: int = setting(250, "steps between test evaluations", metavar="STEPS")
    eval_batch_size: int = setting(500, "test images per prediction batch", metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()
    dtype: str = setting("float32", "the models' dtype", choices=_DTYPES)
    store_dtype: str | None = setting(
        None, "keep the growing layers' keys and values in half precision: half the memory, "
        "and several times the speed on CPUs with avx512_bf16 or AMX (docs/precision.md)",
        choices=_STORE_DTYPES, default_text="the model's float32")
    incremental_eval: bool = setting(
        True, "the first layer folds only the entries written since the last evaluation "
        "into cached partials (exact up to rounding; docs/training.md)",
        flag_help="evaluate every layer over its whole store each time")
    checkpoint: bool = setting(
        True, "save each model's state under checkpoints/ while it trains",
        flag_help="write no checkpoints (an interrupted model then restarts from scratch); "
        "saves the disk writes of large stores and optimizer states")
    checkpoint_every: int | None = setting(None, "steps between checkpoints", metavar="STEPS",
                                           default_text="--eval-every")

    def check(self) -> None:
        for name in self.models:
            model_spec(name)  # an unknown name: an error listing the known ones

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_store_dtype(self) -> torch.dtype | None:
        return None if self.store_dtype is None else _STORE_DTYPES[self.store_dtype]


# --------------------------------------------------------------------------- the data


load_data = partial(load_subsets, "cifar10", whole_in_order=True)  # (see load_subsets)


# --------------------------------------------------------------------------- running


def _run_name(model: str, seed: int) -> str:
    return f"{model}-seed{seed}"


def _result_name(result: Mapping[str, Any]) -> str:
    """The sub-run a result in ``summary.json`` belongs to (what a resumed run skips)."""
    return _run_name(result["model"], result["seed"])


def _train(name: str, seed: int, cfg: Cifar10Config, data: tuple,
           session: Session) -> dict[str, Any]:  # fmt: skip
    """Train one (model, seed); returns its result (see ``train_one_pass``) plus identity."""
    if model_spec(name).classical:
        return _fit_classical(name, seed, cfg, data, session)
    world = rank_and_world()[1]
    model, optimizer, grower = build_model(name, seed, device=session.device,
                                           dtype=cfg.torch_dtype,
                                           reserve=math.ceil(len(data[0]) / world),
                                           store_dtype=cfg.torch_store_dtype)  # fmt: skip
    if world > 1:  # under torchrun every growing store is split over the ranks (_start)
        shard(model)
    # every growing layer could write one entry per training sample
    possible = (None if grower is None else
                grower.num_entries_all_ranks() + len(grower.layers) * len(data[0]))
    checkpoint = _checkpoint_path(session.run, name, seed) if cfg.checkpoint else None
    result = train_one_pass(
        model, data, batch_size=cfg.batch_size, seed=seed, optimizer=optimizer, grower=grower,
        loss_fn=F.cross_entropy, metrics=METRICS, eval_every=cfg.eval_every,
        eval_batch_size=cfg.eval_batch_size, device=session.device,
        run=session.log(model=name, seed=seed), name=_run_name(name, seed),
        progress=session.progress, checkpoint_path=checkpoint,
        checkpoint_every=cfg.checkpoint_every, incremental_eval=cfg.incremental_eval,
    )  # fmt: skip
    parameters = sum(p.numel() for p in model.parameters())
    layer_stats = {layer.name: layer.stats() for layer in (grower.layers if grower else [])
                   if isinstance(layer, HybridSoftmax)}  # written / refused per hybrid layer
    return {"model": name, "seed": seed, "parameters": parameters,
            "possible_entries": possible, **result,
            **({"layer_stats": layer_stats} if layer_stats else {})}


def _checkpoint_path(run: RunDir, name: str, seed: int) -> Path:
    """``checkpoints/<model>-seed<s>.pt``, the checkpoint's path: its files are
    ``<model>-seed<s>.step<N>.pt`` (under torchrun ``...rank<r>of<W>.step<N>.pt``) and the
    manifest ``<model>-seed<s>.manifest.json`` that commits them
    (:class:`rcdl.checkpoint.Checkpointer`, which refuses another number of ranks)."""
    return run.file("checkpoints") / f"{_run_name(name, seed)}.pt"


def _remove_checkpoint(run: RunDir, name: str, seed: int) -> None:
    """Delete the checkpoint of a finished (model, seed): this rank's files and, on rank 0,
    the manifest."""
    remove_checkpoint(_checkpoint_path(run, name, seed))


def _fit_classical(name: str, seed: int, cfg: Cifar10Config, data: tuple,
                   session: Session) -> dict[str, Any]:  # fmt: skip
    """Fit a classical baseline on the whole training set; its one evaluation is logged at
    the step count of the one-epoch models, so it sits at the end of their curves."""
    x_train, y_train, x_test, y_test = (t.cpu() for t in data)
    print(f"{_run_name(name, seed)}: fitting {model_spec(name).label} on {len(x_train):,} "
          "images (no progress bar)")
    fitted = fit_classical(name, x_train, y_train, x_test, y_test, seed=seed)
    steps, n = math.ceil(len(x_train) / cfg.batch_size), len(x_train)
    evaluation = {"step": steps, "samples": n, "test_acc": fitted.test_acc, "test_loss": None}
    nbytes = None if fitted.entries is None else x_train.nbytes + y_train.nbytes
    session.log(model=name, seed=seed).log(evaluation, entries=fitted.entries, bytes=nbytes,
                                           train_seconds=fitted.fit_seconds,
                                           eval_seconds=fitted.predict_seconds)  # fmt: skip
    return {"model": name, "seed": seed, "parameters": 0, "possible_entries": None,
            "test_acc": fitted.test_acc, "test_loss": None, "train_loss": None,
            "entries": fitted.entries, "bytes": nbytes, "steps": steps, "samples": n,
            "train_seconds": fitted.fit_seconds, "eval_seconds": fitted.predict_seconds,
            "history": [evaluation], "resumed": False, "settings": fitted.settings}


def _note_if_bfloat16_is_emulated() -> None:
    """Say which product path a bfloat16 store takes on this CPU (rcdl.half,
    docs/precision.md)."""
    if not rundir.native_bfloat16():
        print(f"note: this CPU has neither avx512_bf16 nor AMX, so bfloat16 products are not "
              f"native; product mode {product_mode()!r}: in 'auto' the stores' chunks are "
              "converted to float32 as they are read (half the memory, about float32's speed; "
              "RCDL_HALF_PRODUCTS=native multiplies in bfloat16, much slower here; "
              "docs/precision.md)", file=sys.stderr)


def _sub_runs(cfg: Cifar10Config, data: CifarData, session: Session) -> Iterator:
    """Every model for every seed (models outer), on the same tensors (moved to a CUDA
    device once). A model's checkpoint is deleted once its result is saved (unless the
    option ``keep_checkpoints``), and an emptied ``checkpoints/`` at the end."""
    tensors = tuple(t.to(session.device) if session.device.type == "cuda" else t for t in
                    (data.x_train.to(cfg.torch_dtype), data.y_train,
                     data.x_test.to(cfg.torch_dtype), data.y_test))  # fmt: skip
    keep = session.options.get("keep_checkpoints", False)
    if cfg.store_dtype == "bfloat16" and session.device.type == "cpu" and rank_and_world()[0] == 0:
        _note_if_bfloat16_is_emulated()
    for name in cfg.models:
        for seed in cfg.seeds:
            yield _run_name(name, seed), partial(_train, name, seed, cfg, tensors, session)
            if not keep and not model_spec(name).classical:  # its result is saved by now
                _remove_checkpoint(session.run, name, seed)
    folder = session.run.file("checkpoints")
    if folder.is_dir() and not any(folder.iterdir()):
        with contextlib.suppress(OSError):  # under torchrun another rank may remove it first
            folder.rmdir()


def _start(cfg: Cifar10Config, data: CifarData) -> dict[str, Any]:
    """The data's description; under ``torchrun``, models without growing stores (nothing
    to shard) are refused before the run folder is made."""
    world = rank_and_world()[1]
    flat = [m for m in cfg.models if not model_spec(m).growing]
    if world > 1 and flat:
        raise ValueError(f"under torchrun the growing models' stores are sharded over the "
                         f"{world} ranks; {', '.join(flat)} have no growing stores: run "
                         "them without torchrun")
    return cifar_summary(cfg, data)


def _add_rows(cfg: Cifar10Config, summary: dict[str, Any]) -> None:
    summary["models"] = model_rows(summary["runs"], cfg.models)


def run_cifar10(cfg: Cifar10Config, **kw: Any) -> tuple[RunDir, dict[str, Any]]:
    """:func:`rcdl.app.runner.run_experiment` of the comparison; its option
    ``keep_checkpoints`` keeps each model's last checkpoint after it finishes."""
    return run_experiment(EXPERIMENT_SPEC, cfg, **kw)


# --------------------------------------------------------------------------- reporting


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


def _write_report(run: RunDir, cfg: Cifar10Config, summary: dict[str, Any],
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
    return _write_report(run, cfg, summary, cfg.models, list(cfg.seeds), combined=False,
                         tail=f"Machine: {describe_machine(device)}.\n")




# --------------------------------------------------------------------------- combining runs

# settings that may differ between runs combined into one table (the rest is the protocol)
_PER_RUN_SETTINGS = ("models", "seeds", "data_dir", "device", "checkpoint", "checkpoint_every",
                     "incremental_eval")


def _finished_runs(run_dir: Path) -> tuple[Cifar10Config | None, dict[str, Any]]:
    """The config and summary of ``run_dir``; an error if no (model, seed) pair finished.

    A folder written by :func:`combine_runs` (a ``summary.json`` with ``combined_from`` and no
    ``config.json``, e.g. a committed table) has no config: ``(None, summary)``."""
    path = run_dir / RunDir.SUMMARY
    summary = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    if summary and "combined_from" in summary and not (run_dir / RunDir.CONFIG).is_file():
        return None, summary
    cfg = read_config(run_dir, Cifar10Config)
    if summary is None:
        raise FileNotFoundError(f"{run_dir}: no {RunDir.SUMMARY}, so no model finished there")
    if not summary.get("runs"):
        raise ValueError(f"{run_dir}: no model finished there ({path} lists no runs)")
    return cfg, summary


def _protocol(cfg: Cifar10Config, data: Mapping[str, Any]) -> dict[str, Any]:
    """What must agree between runs for their numbers to share a table."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in _PER_RUN_SETTINGS}
    return {**settings, "n_train": data["n_train"], "n_test": data["n_test"],
            "provenance": data.get("provenance")}


def _table_position(model: str) -> tuple[int, int]:
    """Where a model goes in a combined table: registry order, ``hybrid-*`` beside
    ``hybrid`` and ``psoftmax-<N>`` beside the parametric softmaxes, others last."""
    names = list(MODELS)
    if model in MODELS:
        return names.index(model), 0
    if hybrid_tau(model)[0]:
        return names.index("hybrid"), 1
    if model.startswith("psoftmax-"):
        return names.index("psoftmax-50016"), 1
    return len(names), 0


def combine_runs(run_dirs: list[str | Path], out: str | Path,
                 models: list[str] | tuple[str, ...] | None = None,
                 ) -> tuple[Path, dict[str, Any]]:
    """One table and figure from the finished (model, seed) pairs of several run folders.

    Full-scale models take an hour each on a CPU, so the comparison is made over several
    invocations, sessions and machines. This merges their ``summary.json`` files after
    checking that they share the protocol (:func:`_protocol`); a (model, seed) pair finished
    in two folders is an error, an unfinished one is not in its summary. ``models`` keeps
    only those models (each must have finished in some folder). A combined table written
    here may be a source too: its runs keep their own sources, so a model can be added to a
    table whose original run folders are gone.

    Writes into ``out``: ``summary.json`` (the runs, per-model rows and, per source folder,
    its path, models, sessions and environment), ``results.md``, ``results.csv`` and
    ``test_accuracy.png``; models ordered by :func:`_table_position`, then as found.
    """
    if not run_dirs:
        raise ValueError("combine: give at least one run folder")
    loaded = [(Path(p), *_finished_runs(Path(p))) for p in run_dirs]
    first = next(((folder, cfg, summary) for folder, cfg, summary in loaded if cfg is not None),
                 None)
    if first is None:
        raise ValueError("combine: give at least one run folder (not only combined tables): "
                         "its config describes the protocol")
    first_folder, first_cfg, first_summary = first
    protocol = _protocol(first_cfg, first_summary["data"])
    runs: list[dict[str, Any]] = []
    origin: dict[tuple[str, int], Path] = {}
    sources = []
    for folder, cfg, summary in loaded:
        # a combined table (no config) states its protocol; its runs keep their sources
        theirs = ({"store_dtype": None, **summary["protocol"]} if cfg is None  # older tables
                  else _protocol(cfg, summary["data"]))
        if theirs != protocol:
            diff = {k: (protocol[k], theirs[k]) for k in protocol if protocol[k] != theirs[k]}
            raise ValueError(f"combine: {folder} used another protocol than {first_folder} "
                             f"(theirs first, then this one's): {diff}")
        kept = [r for r in summary["runs"] if models is None or r["model"] in models]
        for r in kept:
            key = (r["model"], r["seed"])
            if key in origin:
                raise ValueError(f"combine: {r['model']} seed {r['seed']} finished in both "
                                 f"{origin[key]} and {folder}; leave one of them out")
            origin[key] = folder
            runs.append({**r, "source": r["source"] if cfg is None else str(folder)})
        if cfg is None:
            for src in summary["combined_from"]:
                still = [m for m in src["models"]
                         if any(r["source"] == src["path"] and r["model"] == m for r in runs)]
                if still:
                    sources.append({**src, "models": still})
            continue
        environment = folder / RunDir.ENVIRONMENT
        sources.append({
            "path": str(folder),
            "models": list(dict.fromkeys(r["model"] for r in kept)),
            "sessions": summary.get("sessions", []),
            "environment": (json.loads(environment.read_text(encoding="utf-8"))
                            if environment.is_file() else None),
        })  # fmt: skip
    present = list(dict.fromkeys(r["model"] for r in runs))
    missing = [m for m in models or () if m not in present]
    if missing:
        raise ValueError(f"combine: {', '.join(missing)} finished in none of "
                         f"{', '.join(str(f) for f, _, _ in loaded)}")
    models = tuple(sorted(present, key=_table_position))
    combined = {"experiment": EXPERIMENT, "combined_from": sources,
                "data": first_summary["data"], "protocol": protocol, "runs": runs,
                "models": model_rows(runs, models)}
    Path(out).mkdir(parents=True, exist_ok=True)
    run = RunDir(out)
    run.write_summary(combined)
    _write_report(run, first_cfg, combined, models, sorted({r["seed"] for r in runs}),
                  combined=True, tail=_sources_text(combined))
    return run.path, combined


def _sources_text(combined: dict[str, Any]) -> str:
    """The combined table's list of its source folders: models, sessions, machines, code."""
    lines = []
    for source in combined["combined_from"]:
        sessions = source["sessions"]
        machines = sorted({f"{s.get('cpu_count')} CPUs, {count(s.get('num_threads'), 'thread')}, "
                           f"{s.get('device')}" for s in sessions})
        revisions = sorted({(s.get("git_revision") or "?")[:10] for s in sessions})
        minutes = sum(s.get("seconds") or 0 for s in sessions) / 60
        lines.append(f"- `{source['path']}`: {', '.join(source['models'])}; "
                     f"{len(sessions)} session(s), {minutes:.0f} min in all; "
                     f"{'; '.join(machines)}; git {', '.join(revisions)}")
    return ("\nCombined from these run folders (`rcdl reproduce cifar10-1epoch --combine`):\n"
            + "\n".join(lines) + "\n")


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=Cifar10Config,
    help="the paper's Fig. 2: growing and parametric models, one epoch of CIFAR-10 "
    "(docs/reference.md §6)",
    description="One epoch of CIFAR-10, batch 16, for the growing models (gws, gauge, rbf, "
    "hybrid; hybrid-tau<τ> and hybrid-always for other thresholds; laplacian, not in the "
    "paper, only when named), the ResNet-MLP baselines "
    "(mlp-sgd, mlp-adam, mlp-adamw, mlp-rmsprop, mlp-muon) and the parametric-softmax "
    "baselines (psoftmax-5000, psoftmax-50016; any psoftmax-<N>). Writes a run folder with "
    "results.md, results.csv and test_accuracy.png. See docs/cifar10.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_data, start=_start,
    update=_add_rows, shards=True, sessions=True, finished_in_summary=_result_name,
    options={"keep_checkpoints": "keep each model's last checkpoint after it finishes"},
    combine=Combine(combine_runs, keep=("models",), show=True),
)  # fmt: skip
