"""ViT on CIFAR-10 with RCDL feed-forward blocks against the standard ViT (docs/reference.md §8).

Run it with ``rcdl reproduce vit`` (see docs/vit.md).

The paper's finding (docs/reference.md §8): after one epoch on CIFAR-10, a standard ViT reaches
48.4 % and the same ViT with its feed-forward blocks replaced by (hybrid) weighted-softmax RCDL
layers reaches 54.4 %. docs/reference.md does not give the paper's ViT size, patching, optimiser or
RCDL settings; the ones here are this project's choices (:class:`ViTConfig`). Two models, built
by :mod:`rcdl.nn.vit` from the same parts and the same initial random numbers for the shared
parts (patch embedding, position embedding, class token, attention, norms, head):

========  ==============================================================================
``mlp``   the standard ViT: FFN ``Linear(d, 4d) → GELU → Linear(4d, d)``; Adam
``rcdl``  every FFN an :class:`rcdl.nn.vit.RCDLFeedForward`: a hybrid weighted-softmax layer
          ``d → d`` (:class:`rcdl.nn.hybrid.HybridSoftmax`) on the RMS-normalised token, whose
          entries are trained by Adam and grown, one entry per token that the distance gate
          lets through (τ = ``tau_rel · √d``); :class:`rcdl.optim.entry_adam.EntryAdam` trains the
          entries and the ordinary parameters with the same learning rate
========  ==============================================================================

Protocol: one pass over a random permutation of the training images (the same order for
both models: it depends on the seed only), batch 16, batch-mean cross-entropy, test accuracy
and loss every ``eval_every`` steps and at the end (docs/reference.md §6's protocol on tokens).

Run folder, besides what every run writes (:mod:`rcdl.app.runner`)::

    metrics.jsonl        every evaluation of every (model, seed), with the store sizes
    summary.json         per-(model, seed) results, histories and per-layer store statistics
    results.md/.csv      accuracy, loss, entries, store bytes, parameters, times
    vit.png              test accuracy and store size against training images seen
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping
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
from rcdl.app.runner import Experiment, Session, TaggedLog, run_experiment
from rcdl.nn.hybrid import hybrid_layers
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.nn.vit import ViT, mlp_vit, rcdl_vit
from rcdl.optim.entry_adam import EntryAdam
from rcdl.optim.grower import Grower
from rcdl.train.loop import Metric, accuracy, train_one_pass

__all__ = ["EXPERIMENT", "EXPERIMENT_SPEC", "MODELS", "PAPER", "ViTConfig", "build_model",
           "load_data", "run_vit"]  # fmt: skip

EXPERIMENT = "vit"
MODELS = {"mlp": "ViT, MLP feed-forward blocks", "rcdl": "ViT, RCDL feed-forward blocks"}
# docs/reference.md §8: one epoch, full CIFAR-10, test accuracy in % (ViTConfig.PAPER is
# the paper-scale settings)
PAPER = {"mlp": 48.4, "rcdl": 54.4}
_METRICS: dict[str, Metric] = {"test_acc": accuracy, "test_loss": F.cross_entropy}
_CSV_COLUMNS = ("model", "seed", "test_acc", "test_loss", "train_loss", "entries",
                "entries_per_layer", "bytes", "parameters", "train_seconds",
                "eval_seconds")  # fmt: skip


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class ViTConfig(ExperimentConfig):
    """Settings of the ViT comparison (docs/reference.md §8).

    The defaults follow the paper's protocol (one pass over all 50 000 training images, all
    10 000 test images) with a ViT small enough for a CPU: patch 8 (17 tokens), width 64,
    4 blocks (run times in docs/vit.md). The patch side must divide 32 and the heads the
    width.

    ``--quick`` (:meth:`quick`): 500 train / 200 test images, width 32, two blocks, two
    heads, an evaluation every 10 steps: a smoke test (the numbers mean little at this
    size). ``--paper`` (:meth:`paper`): all of CIFAR-10 (50 000 / 10 000 images),
    patch 4 (65 tokens), width 128, 6 blocks, 4 heads, T scaled with the width so that
    ``√d / T`` stays 4. docs/reference.md does not give the paper's ViT size; this is a
    common small CIFAR ViT, not the paper's model. It needs a GPU (docs/vit.md).
    """

    QUICK = {"train_size": 500, "test_size": 200, "width": 32, "depth": 2, "heads": 2,
             "eval_every": 10}  # fmt: skip
    PAPER = {"train_size": None, "test_size": None, "patch_size": 4, "width": 128,
             "depth": 6, "heads": 4, "temperature": math.sqrt(128) / 4}  # fmt: skip

    models: tuple[str, ...] = setting(tuple(MODELS), "models to train, in this order, once "
                                      "per seed", choices=tuple(MODELS))
    train_size: int | None = setting(None, "training images, a random subset that depends on "
                                     "--data-seed only", metavar="N", default_text="all")
    test_size: int | None = setting(None, "test images (a random subset)", metavar="N",
                                    default_text="all")
    seeds: tuple[int, ...] = setting((0,), "seeds; each fixes the initialisation (the same "
                                     "for the shared parts of both models) and the order of "
                                     "the images", minimum=0, metavar="K")
    patch_size: int = setting(8, "patch side p in pixels: (32 / p)² patch tokens per image, "
                              "plus the class token", metavar="P")
    width: int = setting(64, "token width d", metavar="D")
    depth: int = setting(4, "transformer blocks", metavar="L")
    heads: int = setting(4, "attention heads", metavar="H")
    pool: str = setting("cls", "cls (the class token) or mean (the mean over the tokens)",
                        choices=("cls", "mean"))
    mlp_ratio: int = setting(4, "hidden width of the standard FFN, in units of the width",
                             metavar="R")
    temperature: float = setting(2.0, "softmax temperature T of the RCDL layers; logits "
                                 "⟨q, k⟩ / (T √d) with ‖q‖ = √d range over ±√d / T",
                                 positive=True, metavar="T")
    tau_rel: float = setting(1.0, "growth threshold in units of √width: τ = tau_rel · √d",
                             metavar="R")
    eta: float = setting(10.0, "gws rule η of the RCDL layers (per-sample units)")
    beta: float = setting(0.3, "gws rule β of the RCDL layers")
    initial_entries: int = setting(16, "entries each RCDL layer starts with", minimum=0,
                                   metavar="N")
    ffn_scale: float = setting(1.0, "fixed scale γ of the RCDL FFN's output", positive=True)
    lr: float = setting(1e-3, "Adam learning rate, both models (entries and parameters "
                        "alike)", positive=True)
    batch_size: int = setting(16, "images per step B (docs/reference.md §6)", metavar="B")
    eval_every: int = setting(500, "steps between test evaluations (also at the start and "
                              "the end)", metavar="STEPS")
    eval_batch_size: int = setting(250, "test images per prediction batch", metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()

    def check(self) -> None:
        """The patches tile the 32-pixel image and the heads split the width."""
        if 32 % self.patch_size:
            raise ValueError(f"ViTConfig: patch_size must divide 32, got {self.patch_size}")
        if self.width % self.heads:
            raise ValueError(f"ViTConfig: heads ({self.heads}) must divide width ({self.width})")

    @property
    def tau(self) -> float:
        """The distance gate's threshold ``τ = tau_rel · √d``."""
        return self.tau_rel * math.sqrt(self.width)

    @property
    def tokens(self) -> int:
        """Tokens per image: the patches, plus the class token with ``pool="cls"``."""
        return (32 // self.patch_size) ** 2 + (self.pool == "cls")


# --------------------------------------------------------------------------- data and models


load_data = partial(load_subsets, "cifar10")  # the subsets of cfg (rcdl.app.cifar)


def build_model(name: str, seed: int, cfg: ViTConfig, *, device: torch.device | str = "cpu"
                ) -> tuple[ViT, Any, Grower | None]:  # fmt: skip
    """Model ``name`` of :data:`MODELS` with its learner, reproducibly from ``seed``.

    torch's global generator is seeded with ``seed`` first, and :class:`rcdl.nn.vit.ViT` builds
    its FFNs after the shared parts, so both models start from the same shared parameters.
    ``mlp``: ``torch.optim.Adam(lr)``, no grower. ``rcdl``: the RCDL layers' initial entries
    are seeded from ``seed``; :class:`rcdl.optim.entry_adam.EntryAdam` (lr) and a
    :class:`rcdl.optim.grower.Grower`.

    Returns:
        ``(model, optimizer, grower or None)``, the model on ``device``.
    """
    vit_kw: dict[str, Any] = {"patch_size": cfg.patch_size, "width": cfg.width,
                              "depth": cfg.depth, "heads": cfg.heads, "pool": cfg.pool}
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


class _StoreLog(TaggedLog):
    """A :class:`rcdl.app.runner.TaggedLog` that also records the entries each RCDL layer of
    ``net`` holds at every evaluation: in each record (``entries_per_layer``) and in
    :attr:`sizes` (``{samples, entries_per_layer}`` per evaluation, for the summary)."""

    def __init__(self, run: RunDir, net: nn.Module, **tags: Any) -> None:
        super().__init__(run, **tags)
        self.layers = [layer for _, layer in hybrid_layers(net)]
        self.sizes: list[dict[str, Any]] = []

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None:
        record = {**(record or {}), **fields}
        if self.layers:
            record["entries_per_layer"] = [len(layer.store) for layer in self.layers]
            self.sizes.append({"samples": record["samples"],
                               "entries_per_layer": record["entries_per_layer"]})
        super().log(record)


def _train(name: str, seed: int, cfg: ViTConfig, tensors: tuple,
           session: Session) -> dict[str, Any]:  # fmt: skip
    """Train one (model, seed) for one pass; its result, identity and store statistics."""
    model, optimizer, grower = build_model(name, seed, cfg, device=session.device)
    log = _StoreLog(session.run, model, model=name, seed=seed)
    result = train_one_pass(
        model, tensors, batch_size=cfg.batch_size, seed=seed, optimizer=optimizer,
        grower=grower, loss_fn=F.cross_entropy, metrics=_METRICS, eval_every=cfg.eval_every,
        eval_batch_size=cfg.eval_batch_size, device=session.device, run=log,
        name=f"{name}-seed{seed}", progress=session.progress,
    )  # fmt: skip
    out = {"model": name, "seed": seed,
           "parameters": sum(p.numel() for p in model.parameters()), **result}  # fmt: skip
    if grower is not None:
        tokens = len(tensors[0]) * cfg.tokens  # tokens seen per layer: the possible entries
        out["layers"] = [{"name": layer.name, **grower.growth[layer.name].state_dict(),
                          **layer.stats(), "possible": tokens}
                         for _, layer in hybrid_layers(model)]  # fmt: skip
        out["sizes"] = log.sizes
    return out


def _sub_runs(cfg: ViTConfig, data: CifarData, session: Session) -> Iterator:
    """Every model of ``cfg`` for every seed, on the same tensors."""
    tensors = tuple(t.to(session.device)
                    for t in (data.x_train, data.y_train, data.x_test, data.y_test))
    for seed in cfg.seeds:
        for name in cfg.models:
            yield f"{name}-seed{seed}", partial(_train, name, seed, cfg, tensors, session)


def _start(cfg: ViTConfig, data: CifarData) -> dict[str, Any]:
    return {**cifar_summary(cfg, data), "tau": cfg.tau, "tokens_per_image": cfg.tokens}


def _finish(cfg: ViTConfig, summary: dict[str, Any]) -> None:
    summary["rows"] = model_rows(summary["runs"], cfg.models)


def run_vit(cfg: ViTConfig, **kw: Any) -> tuple[RunDir, dict[str, Any]]:
    """Train every model of ``cfg`` for every seed (:func:`rcdl.app.runner.run_experiment`).

    The summary adds ``tau``, ``tokens_per_image`` and ``rows`` (per model, mean and sd over
    seeds); each of ``runs`` (per (model, seed)) holds accuracy, loss, parameters, entries,
    bytes, seconds, the ``history`` of every evaluation and, for ``rcdl``, ``layers`` (per
    layer: entries written, refused, stored, bytes, possible) and ``sizes`` (entries per
    layer at every evaluation)."""
    return run_experiment(EXPERIMENT_SPEC, cfg, **kw)


# --------------------------------------------------------------------------- reporting


def model_rows(runs: list[dict[str, Any]], models: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per model: test accuracy (%) and loss as mean and sd over seeds, the mean
    entries (all layers), store bytes, parameters and seconds, and the paper's accuracy."""
    rows = []
    for name, rs in group_runs(runs, models).items():
        row: dict[str, Any] = {"model": name, "seeds": [r["seed"] for r in rs]}
        row["test_acc_pct"], row["test_acc_pct_sd"] = mean_sd([100 * r["test_acc"] for r in rs])
        row["test_loss"], row["test_loss_sd"] = mean_sd([r["test_loss"] for r in rs])
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


def results_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`model_rows`."""
    header = ("model", "test acc. %", "test loss", "entries (all layers)", "per layer", "store",
              "parameters", "train s", "eval s", "paper")  # fmt: skip
    lines = []
    for r in rows:
        entries = "—" if r["entries"] is None else f"{r['entries']:,.0f}"
        per_layer = ("—" if r["entries_per_layer"] is None else
                     " / ".join(f"{n:,.0f}" for n in r["entries_per_layer"]))  # fmt: skip
        store = "—" if r["bytes"] is None else f"{r['bytes'] / 2**20:.1f} MiB"
        lines.append((MODELS[r["model"]], pm(r["test_acc_pct"], r["test_acc_pct_sd"], 2),
                      pm(r["test_loss"], r["test_loss_sd"], 3), entries, per_layer, store,
                      f"{r['parameters']:,}", f"{r['train_seconds']:.0f}",
                      f"{r['eval_seconds']:.0f}", f"{r['paper_acc_pct']:.1f} %"))  # fmt: skip
    return markdown_table(header, lines, align="lrrrlrrrrr")


def results_csv(runs: list[dict[str, Any]]) -> str:
    """One line per (model, seed): accuracy, loss, entries (all layers and per layer),
    bytes, parameters, seconds."""
    return csv_text([{**r, "entries_per_layer": [x["entries"] for x in r["layers"]]
                      if "layers" in r else None} for r in runs], _CSV_COLUMNS)  # fmt: skip


def plot_vit(runs: list[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Left: test accuracy against training images seen, one line per (model, seed). Right:
    entries per RCDL layer against training images seen."""
    acc = [Curve([h["samples"] for h in r["history"]], [100 * h["test_acc"] for h in r["history"]],
                 f"{r['model']}, seed {r['seed']}", style={"marker": "o"}) for r in runs]
    sizes = [Curve([s["samples"] for s in r["sizes"]],
                   [s["entries_per_layer"][i] for s in r["sizes"]],
                   f"seed {r['seed']}, block {i}", style={"marker": "."})
             for r in runs if "sizes" in r for i in range(len(r["layers"]))]  # fmt: skip
    return plot_panels(path, [
        Panel(acc, "training images seen", "test accuracy (%)", title),
        Panel(sizes, "training images seen", "entries stored", "RCDL feed-forward stores"),
    ], figsize=(10, 4.2))  # fmt: skip


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
    title = f"CIFAR-10, {d['n_train']:,} training images, one pass"
    return write_outputs(run, report, results_csv(summary["runs"]), {
        "vit.png": partial(plot_vit, summary["runs"], title=title)})


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=ViTConfig,
    help="a small ViT with MLP feed-forward blocks against the same ViT with hybrid RCDL "
    "feed-forward blocks, one epoch of CIFAR-10 (docs/reference.md §8)",
    description="One epoch of CIFAR-10 for a small ViT with MLP feed-forward blocks and the "
    "same ViT whose feed-forward blocks are hybrid weighted-softmax RCDL layers (entries "
    "trained by Adam, growth gated at τ = tau_rel·√width), same data order. Writes "
    "results.md, results.csv and vit.png. See docs/vit.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_data, start=_start,
    finish=_finish,
)  # fmt: skip
