"""ViT on CIFAR-10 with RCDL feed-forward blocks against the standard ViT (docs/reference.md §8).

Run it with ``rcdl reproduce vit`` (see docs/vit.md).

The paper's finding (docs/reference.md §8): after one epoch on CIFAR-10, a standard ViT reaches
48.4 % and the same ViT with its feed-forward blocks replaced by (hybrid) weighted-softmax RCDL
layers reaches 54.4 %. docs/reference.md does not give the paper's ViT size, patching, optimiser or
RCDL settings; the ones here are this project's choices (:class:`ViTConfig`). Two models, built
by :mod:`rcdl.vit` from the same parts and the same initial random numbers for the shared
parts (patch embedding, position embedding, class token, attention, norms, head):

========  ==============================================================================
``mlp``   the standard ViT: FFN ``Linear(d, 4d) → GELU → Linear(4d, d)``; Adam
``rcdl``  every FFN an :class:`rcdl.vit.RCDLFeedForward`: a hybrid weighted-softmax layer
          ``d → d`` (:class:`rcdl.hybrid.HybridSoftmax`) on the RMS-normalised token, whose
          entries are trained by Adam and grown, one entry per token that the distance gate
          lets through (τ = ``tau_rel · √d``); :class:`rcdl.hybrid.EntryAdam` trains the
          entries and the ordinary parameters with the same learning rate
========  ==============================================================================

Protocol: one pass over a random permutation of the training images (the same order for
both models: it depends on the seed only), batch 16, batch-mean cross-entropy, test accuracy
and loss every ``eval_every`` steps and at the end (docs/reference.md §6's protocol on tokens).

Run folder::

    config.json          the resolved ViTConfig
    environment.json     machine, torch, git revision
    metrics.jsonl        every evaluation of every (model, seed), with the store sizes
    finished.json        each finished (model, seed)'s result, written as it finishes
    summary.json         per-(model, seed) results, histories and per-layer store statistics
    results.md/.csv      accuracy, loss, entries, store bytes, parameters, times
    vit.png              test accuracy and store size against training images seen

Resume: :func:`run_vit` with ``resume=RUN_DIR`` skips the (model, seed) pairs that
``finished.json`` holds and trains the others from scratch; the tables are then those of an
uninterrupted run. ``metrics.jsonl`` may repeat the evaluations of the pair that was
interrupted.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn

from rcdl.app.cifar import CifarData, load_cifar
from rcdl.app.experiments.cifar10 import data_provenance
from rcdl.app.rundir import (
    RunDir,
    atomic_write_text,
    config_from_dict,
    describe_machine,
    open_run,
    release_memory,
    resolve_device,
    save_figure,
)
from rcdl.grower import Grower
from rcdl.hybrid import EntryAdam, hybrid_layers
from rcdl.rules import ClippedSoftmaxRule
from rcdl.training import accuracy, train_one_pass
from rcdl.vit import ViT, mlp_vit, rcdl_vit

__all__ = ["EXPERIMENT", "MODELS", "PAPER", "ViTConfig", "build_model", "load_data", "run_vit"]

EXPERIMENT = "vit"
MODELS = {"mlp": "ViT, MLP feed-forward blocks", "rcdl": "ViT, RCDL feed-forward blocks"}
# docs/reference.md §8: one epoch, full CIFAR-10, test accuracy in %
PAPER = {"mlp": 48.4, "rcdl": 54.4}
_METRICS = {"test_acc": accuracy, "test_loss": F.cross_entropy}
_DEVICES = ("auto", "cpu", "cuda")
_POOLS = ("cls", "mean")


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class ViTConfig:
    """Settings of the ViT comparison (docs/reference.md §8).

    The defaults follow the paper's protocol (one pass over all 50 000 training images, all
    10 000 test images) with a ViT small enough for this project's two shared CPU cores:
    patch 8 (17 tokens), width 64, 4 blocks; both models together in an estimated 15
    minutes at one thread (docs/vit.md). :meth:`quick` is a smoke test; :meth:`paper` a
    larger ViT (the paper's ViT size is not given in docs/reference.md).

    Attributes:
        models: names from :data:`MODELS`, trained in this order.
        train_size, test_size: random subsets of that many images (``None``: all 50 000 /
            10 000); they depend on ``data_seed`` only.
        seeds: each model is trained once per seed; a seed fixes the initialisation (the
            same for the shared parts of both models) and the order of the images.
        patch_size: ``p``; ``(32 / p)²`` patch tokens per image, plus the class token.
        width, depth, heads: ``d``, transformer blocks, attention heads.
        pool: ``"cls"`` (class token) or ``"mean"`` (mean over the tokens).
        mlp_ratio: hidden width of the standard FFN, ``mlp_ratio · d``.
        temperature: T of the RCDL layers; logits are ``⟨q, k⟩ / (T √d)`` with
            ``‖q‖ = √d``, so they range over ``±√d / T`` (4 at the defaults).
        tau_rel: the distance gate's threshold relative to the token norm,
            ``τ = tau_rel · √d`` (docs/reference.md §6's τ = 50 at d = 3072 is 0.90 √d).
        eta, beta: the gws rule's η and β (per-sample units, docs/reference.md §3).
        initial_entries: entries each RCDL layer starts with (docs/reference.md §6: 16).
        ffn_scale: fixed scale γ of the RCDL FFN's output.
        lr: Adam's learning rate for both models (entries and parameters alike).
        batch_size: images per step (docs/reference.md §6: 16).
        eval_every: steps between test evaluations (also at the start and the end).
        eval_batch_size: test images per prediction batch.
        data_dir: folder holding ``cifar10.npz`` or the official files (``None``: search
            ``$RCDL_DATA``, then the cache).
        data_seed: seed of the subsets.
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
    """

    models: tuple[str, ...] = tuple(MODELS)
    train_size: int | None = None
    test_size: int | None = None
    seeds: tuple[int, ...] = (0,)
    patch_size: int = 8
    width: int = 64
    depth: int = 4
    heads: int = 4
    pool: str = "cls"
    mlp_ratio: int = 4
    temperature: float = 2.0
    tau_rel: float = 1.0
    eta: float = 10.0
    beta: float = 0.3
    initial_entries: int = 16
    ffn_scale: float = 1.0
    lr: float = 1e-3
    batch_size: int = 16
    eval_every: int = 500
    eval_batch_size: int = 250
    data_dir: str | None = None
    data_seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        # lists (from JSON or argparse) become tuples, paths strings, so configs compare equal
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "seeds", tuple(self.seeds))
        if self.data_dir is not None:
            object.__setattr__(self, "data_dir", str(self.data_dir))
        if not self.models:
            raise ValueError("ViTConfig: give at least one model")
        for name in self.models:
            if name not in MODELS:
                raise ValueError(f"ViTConfig: unknown model {name!r}; known: {', '.join(MODELS)}")
        for what, items in (("models", self.models), ("seeds", self.seeds)):
            if len(set(items)) != len(items):
                raise ValueError(f"ViTConfig: {what} must not repeat, got {list(items)}")
        if not self.seeds:
            raise ValueError("ViTConfig: give at least one seed")
        for seed in (*self.seeds, self.data_seed):
            _check_int("seeds and data_seed", seed, minimum=0)
        for what in ("train_size", "test_size"):
            if getattr(self, what) is not None:
                _check_int(what, getattr(self, what), minimum=1)
        for what in ("patch_size", "width", "depth", "heads", "mlp_ratio", "batch_size",
                     "eval_every", "eval_batch_size"):  # fmt: skip
            _check_int(what, getattr(self, what), minimum=1)
        _check_int("initial_entries", self.initial_entries, minimum=0)
        if 32 % self.patch_size:
            raise ValueError(f"ViTConfig: patch_size must divide 32, got {self.patch_size}")
        if self.width % self.heads:
            raise ValueError(f"ViTConfig: heads ({self.heads}) must divide width ({self.width})")
        if self.pool not in _POOLS:
            raise ValueError(f"ViTConfig: pool must be one of {list(_POOLS)}, got {self.pool!r}")
        for what in ("temperature", "ffn_scale", "lr"):
            _check_float(what, getattr(self, what), positive=True)
        for what in ("tau_rel", "eta", "beta"):
            _check_float(what, getattr(self, what), positive=False)
        if self.device not in _DEVICES:
            raise ValueError(f"ViTConfig: device must be one of {list(_DEVICES)}, "
                             f"got {self.device!r}")

    @property
    def tau(self) -> float:
        """The distance gate's threshold ``τ = tau_rel · √d``."""
        return self.tau_rel * math.sqrt(self.width)

    @property
    def tokens(self) -> int:
        """Tokens per image: the patches, plus the class token with ``pool="cls"``."""
        return (32 // self.patch_size) ** 2 + (self.pool == "cls")

    @classmethod
    def quick(cls, **overrides: Any) -> ViTConfig:
        """A smoke-test scale: 500 train / 200 test images, width 32, two blocks (seconds;
        the numbers mean little at this size)."""
        quick = {"train_size": 500, "test_size": 200, "width": 32, "depth": 2, "heads": 2,
                 "eval_every": 10}  # fmt: skip
        return cls(**{**quick, **overrides})

    @classmethod
    def paper(cls, **overrides: Any) -> ViTConfig:
        """A larger run on all of CIFAR-10 (50 000 / 10 000 images): patch 4 (65 tokens),
        width 128, 6 blocks, 4 heads, T scaled with the width so that ``√d / T`` stays 4.

        docs/reference.md does not give the paper's ViT size; this is a common small CIFAR ViT, not
        the paper's model. It needs a GPU (hours on this project's CPUs; see docs/vit.md).
        """
        paper = {"train_size": None, "test_size": None, "patch_size": 4, "width": 128,
                 "depth": 6, "heads": 4, "temperature": math.sqrt(128) / 4}  # fmt: skip
        return cls(**{**paper, **overrides})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ViTConfig:
        """The config saved as ``config.json`` (unknown keys are an error)."""
        return config_from_dict(cls, d)


def _check_int(what: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ViTConfig: {what} must be an int >= {minimum}, got {value!r}")


def _check_float(what: str, value: Any, *, positive: bool) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, int | float)
          and math.isfinite(value) and (value > 0 if positive else value >= 0))  # fmt: skip
    if not ok:
        raise ValueError(f"ViTConfig: {what} must be a finite number "
                         f"{'> 0' if positive else '>= 0'}, got {value!r}")


# --------------------------------------------------------------------------- data and models


def load_data(cfg: ViTConfig, *, download: bool = True) -> CifarData:
    """CIFAR-10 from ``cfg.data_dir`` (or the usual places), subset as ``cfg`` asks.

    Raises:
        rcdl.app.cifar.CifarNotFoundError, rcdl.app.cifar.CorruptDataError: from the loader.
        ValueError: if a subset is larger than the split.
    """
    data = load_cifar("cifar10", cfg.data_dir, download=download)
    for what, size, available in (("train_size", cfg.train_size, len(data.y_train)),
                                  ("test_size", cfg.test_size, len(data.y_test))):  # fmt: skip
        if size is not None and size > available:
            raise ValueError(f"{what} {size} is larger than the {available} images of "
                             f"{data.source}")
    return data.subset(cfg.train_size, cfg.test_size, seed=cfg.data_seed)


def build_model(name: str, seed: int, cfg: ViTConfig, *, device: torch.device | str = "cpu"
                ) -> tuple[ViT, Any, Grower | None]:  # fmt: skip
    """Model ``name`` of :data:`MODELS` with its learner, reproducibly from ``seed``.

    torch's global generator is seeded with ``seed`` first, and :class:`rcdl.vit.ViT` builds
    its FFNs after the shared parts, so both models start from the same shared parameters.
    ``mlp``: ``torch.optim.Adam(lr)``, no grower. ``rcdl``: the RCDL layers' initial entries
    are seeded from ``seed``; :class:`rcdl.hybrid.EntryAdam` (lr) and a
    :class:`rcdl.grower.Grower`.

    Returns:
        ``(model, optimizer, grower or None)``, the model on ``device``.
    """
    vit_kw = {"patch_size": cfg.patch_size, "width": cfg.width, "depth": cfg.depth,
              "heads": cfg.heads, "pool": cfg.pool}  # fmt: skip
    torch.manual_seed(seed)
    if name == "mlp":
        model = mlp_vit(mlp_ratio=cfg.mlp_ratio, **vit_kw).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=cfg.lr), None
    if name == "rcdl":
        rule = ClippedSoftmaxRule(eta=cfg.eta, beta=cfg.beta)
        model = rcdl_vit(temperature=cfg.temperature, rule=rule, tau=cfg.tau,
                         scale=cfg.ffn_scale, initial_entries=cfg.initial_entries, seed=seed,
                         **vit_kw).to(device)  # fmt: skip
        return model, EntryAdam(model, lr=cfg.lr), Grower(model)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


# --------------------------------------------------------------------------- running


class _ModelLog:
    """Hands the trainer's records to ``metrics.jsonl``, tagged with model and seed and with
    the entries each RCDL layer holds at that evaluation."""

    def __init__(self, run: RunDir, model: str, seed: int, net: nn.Module) -> None:
        self.run, self.model, self.seed = run, model, seed
        self.layers = [layer for _, layer in hybrid_layers(net)]
        self.sizes: list[dict[str, Any]] = []  # {samples, entries_per_layer} per evaluation

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None:
        rest = {k: v for k, v in {**(record or {}), **fields}.items() if k != "model"}
        if self.layers:
            rest["entries_per_layer"] = [len(layer.store) for layer in self.layers]
            self.sizes.append({"samples": rest["samples"],
                               "entries_per_layer": rest["entries_per_layer"]})
        self.run.log({"model": self.model, "seed": self.seed, **rest})


def _train(name: str, seed: int, cfg: ViTConfig, tensors: tuple, run: RunDir,
           device: torch.device, progress: bool) -> dict[str, Any]:  # fmt: skip
    """Train one (model, seed) for one pass; its result, identity and store statistics."""
    model, optimizer, grower = build_model(name, seed, cfg, device=device)
    log = _ModelLog(run, name, seed, model)
    result = train_one_pass(
        model, tensors, batch_size=cfg.batch_size, seed=seed, optimizer=optimizer,
        grower=grower, loss_fn=F.cross_entropy, metrics=_METRICS, eval_every=cfg.eval_every,
        eval_batch_size=cfg.eval_batch_size, device=device, run=log, name=f"{name}-seed{seed}",
        progress=progress,
    )  # fmt: skip
    out = {"model": name, "seed": seed,
           "parameters": sum(p.numel() for p in model.parameters()), **result}  # fmt: skip
    if grower is not None:
        tokens = len(tensors[0]) * cfg.tokens  # tokens seen per layer: the possible entries
        out["layers"] = [{"name": layer.name, **layer.stats(), "possible": tokens}
                         for _, layer in hybrid_layers(model)]  # fmt: skip
        out["sizes"] = log.sizes
    return out


def run_vit(
    cfg: ViTConfig,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    data: CifarData | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    download: bool = True,
) -> tuple[RunDir, dict[str, Any]]:
    """Train every model of ``cfg`` for every seed into a new run folder, or continue the
    one at ``resume``; write the report.

    Args:
        cfg: the settings; to resume, the run's own (``rcdl.app.rundir.read_config``), where
            only ``data_dir`` and ``device`` may differ.
        out: the run folder (default ``runs/vit-<timestamp>``); it must not already hold a
            run. Not with ``resume``.
        resume: an interrupted run folder: its finished (model, seed) pairs are read back,
            the others trained from scratch.
        data: the subsets already loaded by :func:`load_data` (default: load them here);
            their sizes must be the config's.
        device: overrides ``cfg.device``.
        progress: show progress bars.
        download: download CIFAR-10 when no copy is found.

    Returns:
        The run folder and its summary (the content of ``summary.json``): ``runs`` (per
        (model, seed): accuracy, loss, parameters, entries, bytes, seconds, ``history`` of
        every evaluation and, for ``rcdl``, ``layers`` (per layer: entries written, refused,
        stored, bytes, possible) and ``sizes`` (entries per layer at every evaluation)) and
        ``rows`` (per model, mean and sd over seeds).
    """
    start = time.perf_counter()
    device = resolve_device(cfg.device) if device is None else torch.device(device)
    if data is None:
        data = load_data(cfg, download=download)
    sizes = (len(data.y_train), len(data.y_test))
    asked = (cfg.train_size, cfg.test_size)
    if any(want is not None and want != have for want, have in zip(asked, sizes, strict=True)):
        raise ValueError(f"the data has {sizes[0]} train / {sizes[1]} test images, the config "
                         f"asks for {asked[0]} / {asked[1]}; pass load_data(cfg) or no data")
    run = open_run(EXPERIMENT, cfg, out=out, resume=resume, device=device)
    summary: dict[str, Any] = {
        "experiment": EXPERIMENT, "complete": False,
        "data": {**data.describe(), "provenance": data_provenance(data.source),
                 "data_seed": cfg.data_seed},
        "tau": cfg.tau, "tokens_per_image": cfg.tokens, "runs": [],
    }  # fmt: skip
    tensors = tuple(t.to(device) for t in (data.x_train, data.y_train, data.x_test, data.y_test))
    with run.resumable(f"rcdl reproduce {EXPERIMENT}", cfg.data_dir):
        for seed in cfg.seeds:
            for name in cfg.models:
                train = partial(_train, name, seed, cfg, tensors, run, device, progress)
                summary["runs"].append(run.sub_run(f"{name}-seed{seed}", train))
                summary["seconds"] = time.perf_counter() - start
                run.write_summary(summary)
                release_memory(device)
    summary["rows"] = model_rows(summary["runs"], cfg.models)
    summary["complete"] = True
    summary["seconds"] = time.perf_counter() - start
    report = write_report(run, cfg, summary, device)
    run.write_summary(summary)
    print("\n" + report, end="")
    print(f"Run time {summary['seconds']:.1f} s. Run folder: {run.path}")
    return run, summary


# --------------------------------------------------------------------------- reporting


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def model_rows(runs: list[dict[str, Any]], models: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per model: test accuracy (%) and loss as mean and sd over seeds, the mean
    entries (all layers), store bytes, parameters and seconds, and the paper's accuracy."""
    rows = []
    for name in models:
        rs = [r for r in runs if r["model"] == name]
        if not rs:
            continue
        row: dict[str, Any] = {"model": name, "seeds": [r["seed"] for r in rs]}
        for key, scale in (("test_acc", 100), ("test_loss", 1)):
            suffix = "_pct" if scale == 100 else ""
            row[f"{key}{suffix}"], row[f"{key}{suffix}_sd"] = _mean_sd([scale * r[key]
                                                                        for r in rs])
        for key in ("entries", "bytes"):
            row[key] = None if rs[0][key] is None else statistics.fmean(r[key] for r in rs)
        row["entries_per_layer"] = (
            [statistics.fmean(r["layers"][i]["entries"] for r in rs)
             for i in range(len(rs[0]["layers"]))] if "layers" in rs[0] else None
        )  # fmt: skip
        row["stored_fraction"] = (
            statistics.fmean(sum(x["entries"] for x in r["layers"])
                             / sum(x["possible"] for x in r["layers"]) for r in rs)
            if "layers" in rs[0] else None
        )  # fmt: skip
        row["parameters"] = rs[0]["parameters"]
        for key in ("train_seconds", "eval_seconds"):
            row[key] = statistics.fmean(r[key] for r in rs)
        row["paper_acc_pct"] = PAPER[name]
        rows.append(row)
    return rows


def _pm(mean: float, sd: float | None, digits: int) -> str:
    return f"{mean:.{digits}f}" if sd is None else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def results_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`model_rows`."""
    lines = ["| model | test acc. % | test loss | entries (all layers) | per layer | store | "
             "parameters | train s | eval s | paper |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        entries = "—" if r["entries"] is None else f"{r['entries']:,.0f}"
        per_layer = ("—" if r["entries_per_layer"] is None else
                     " / ".join(f"{n:,.0f}" for n in r["entries_per_layer"]))  # fmt: skip
        store = "—" if r["bytes"] is None else f"{r['bytes'] / 2**20:.1f} MiB"
        lines.append(
            f"| {MODELS[r['model']]} | {_pm(r['test_acc_pct'], r['test_acc_pct_sd'], 2)} | "
            f"{_pm(r['test_loss'], r['test_loss_sd'], 3)} | {entries} | {per_layer} | {store} | "
            f"{r['parameters']:,} | {r['train_seconds']:.0f} | {r['eval_seconds']:.0f} | "
            f"{r['paper_acc_pct']:.1f} % |"
        )
    return "\n".join(lines)


def results_csv(runs: list[dict[str, Any]]) -> str:
    """One line per (model, seed): accuracy, loss, entries, bytes, parameters, seconds."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = ["model", "seed", "test_acc", "test_loss", "train_loss", "entries",
               "entries_per_layer", "bytes", "parameters", "train_seconds", "eval_seconds"]
    writer.writerow(columns)
    for r in runs:
        per_layer = " ".join(str(x["entries"]) for x in r["layers"]) if "layers" in r else None
        cells = {**r, "entries_per_layer": per_layer}
        writer.writerow(["" if cells[k] is None else cells[k] for k in columns])
    return buf.getvalue()


def plot_vit(runs: list[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Left: test accuracy against training images seen, one line per (model, seed). Right:
    entries per RCDL layer against training images seen."""
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    acc_ax, size_ax = fig.subplots(1, 2)
    for r in runs:
        label = f"{r['model']}, seed {r['seed']}"
        acc_ax.plot([h["samples"] for h in r["history"]],
                    [100 * h["test_acc"] for h in r["history"]], marker="o", label=label)
        if "sizes" in r:
            xs = [s["samples"] for s in r["sizes"]]
            for i in range(len(r["layers"])):
                size_ax.plot(xs, [s["entries_per_layer"][i] for s in r["sizes"]], marker=".",
                             label=f"seed {r['seed']}, block {i}")  # fmt: skip
    acc_ax.set(xlabel="training images seen", ylabel="test accuracy (%)", title=title)
    size_ax.set(xlabel="training images seen", ylabel="entries stored",
                title="RCDL feed-forward stores")
    for ax in (acc_ax, size_ax):
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    return save_figure(fig, path)



def write_report(run: RunDir, cfg: ViTConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv`` and ``vit.png``; return the markdown."""
    d = summary["data"]
    steps = math.ceil(d["n_train"] / cfg.batch_size)
    protocol = (
        f"{d['n_train']:,} train / {d['n_test']:,} test CIFAR-10 images (data seed "
        f"{cfg.data_seed}). One pass, batch {cfg.batch_size} ({steps:,} steps), the same order "
        f"for both models, cross-entropy, Adam lr {cfg.lr:g}. Seeds: "
        f"{' '.join(map(str, cfg.seeds))}."
    )
    model = (
        f"ViT: patch {cfg.patch_size} ({cfg.tokens} tokens per image, pool {cfg.pool!r}), "
        f"width d = {cfg.width}, {cfg.depth} pre-norm blocks, {cfg.heads} heads. Standard FFN: "
        f"{cfg.width} → {cfg.mlp_ratio * cfg.width} → {cfg.width}, GELU. RCDL FFN: hybrid "
        f"weighted softmax {cfg.width} → {cfg.width} on RMSNorm(LN(x)) (‖q‖ = √d = "
        f"{math.sqrt(cfg.width):.2f}), T = {cfg.temperature:g}, gws η = {cfg.eta:g}, "
        f"β = {cfg.beta:g}, {cfg.initial_entries} initial entries, distance gate τ = "
        f"{cfg.tau_rel:g} √d = {cfg.tau:.2f}, output scale {cfg.ffn_scale:g}."
    )
    stores = []
    for r in summary["runs"]:
        if "layers" in r:
            cells = ", ".join(f"{x['entries']:,} ({100 * x['entries'] / x['possible']:.2f} %)"
                              for x in r["layers"])  # fmt: skip
            stores.append(f"- seed {r['seed']}: entries per block {cells} of "
                          f"{r['layers'][0]['possible']:,} tokens seen per block.")
    report = "\n\n".join([
        "# ViT with RCDL feed-forward blocks on CIFAR-10 (docs/reference.md §8)", protocol, model,
        results_table(summary["rows"]),
        "Accuracy in percent, loss in nats (mean ± sd over seeds); entries and store: the "
        "RCDL layers' stored entries and their bytes at the end. The paper's numbers "
        "(docs/reference.md §8) are for one epoch on all of CIFAR-10 with a ViT whose size is "
        "not given there.",
        "\n".join(["Store sizes at the end (fraction of the tokens that wrote an entry):",
                   *stores]) if stores else "",
        f"Data: {d['source']}, {d['provenance']}.\nMachine: {describe_machine(device)}.\n",
    ])  # fmt: skip
    atomic_write_text(report, run.file("results.md"))
    atomic_write_text(results_csv(summary["runs"]), run.file("results.csv"))
    title = f"CIFAR-10, {d['n_train']:,} training images, one pass"
    plot_vit(summary["runs"], run.file("vit.png"), title=title)
    return report
