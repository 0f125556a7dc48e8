"""Multi-epoch optimizer comparison on CIFAR-10 and CIFAR-100 (docs/reference.md §8).

Run it with ``rcdl reproduce optimizers`` (see docs/optimizer_experiments.md).

The paper's claims (docs/reference.md §8): on CIFAR-10 and CIFAR-100 MLPs, the weighted-softmax and
RBF growing models, trained by their plain functional-gradient rules, clearly beat MLPs trained
by SGD, Adam and RMSprop and drop the training loss fastest; among parametric optimizers
Muon is best on CIFAR-10 and Mesa/FOOF on CIFAR-100. Methods (:data:`METHODS`), all trained
for ``epochs`` passes over the same subset, in the same orders, with batch 16:

===============  ==========================================================================
``mlp-sgd``      residual MLP (below), SGD, momentum 0.85
``mlp-adam``     residual MLP, Adam
``mlp-rmsprop``  residual MLP, RMSprop, alpha 0.9, eps 1e−8
``mlp-muon``     residual MLP, Muon on the matrices (momentum 0.95, Nesterov, no weight
                 decay) and Adam 1e−3 on the biases, as
                 :func:`rcdl.app.baseline_optim.make_optimizer`
``mlp-foof``     residual MLP, :class:`rcdl.optim.dual_optim.FOOF` (momentum 0.85, ema 0.95,
                 refresh every 10 steps) — the Mesa dual form (docs/reference.md §7)
``gws``          growing weighted softmax, 2 blocks, clipped rule β = 3, η = 0.003;
                 learns by growth only and writes one entry per sample per layer in every
                 epoch (``16 + e · N`` entries per layer after ``e`` epochs of ``N`` images)
``rbf``          growing RBF, 2 blocks, functional SGD η = 10; grows likewise (``e · N``)
===============  ==========================================================================

Decisions (measured numbers in docs/optimizer_experiments.md):

- **One input for all.** Every method sees the same images ``P x``: ``x`` the standardised
  flattened image (3072 values), ``P (w, 3072)`` a fixed random Gaussian matrix scaled by
  ``1/√3072`` (the lift of :class:`rcdl.nn.networks.ResidualNet`), drawn from ``data_seed`` and
  applied once to the whole subset. ``width=None`` uses the images as they are (the
  paper's ``w = 3072``). The projection keeps Muon's Newton–Schulz iteration (``O(w³)`` per
  matrix and step) and FOOF's ``(w + 1)²`` Cholesky affordable on a CPU, and gives the
  growing and parametric models the same information.
- **The MLP** is docs/reference.md §6's ResNet-MLP (:class:`rcdl.nn.networks.ResNetMLP`: pre-norm
  residual blocks of Linear ``w → w`` + tanh-GELU, LeCun init, linear readout) with ``mlp_depth``
  blocks at width ``w``. docs/reference.md does not give the paper's MLP sizes for this figure.
- **Growing temperatures** scale with the width: ``T = T_paper · √(w / 3072)`` (gws 6, RBF 10
  at 3072). RMS-normalised queries have ``‖q‖² = w``, so the logits ``⟨q, k⟩ / (T√w)`` and
  RBF exponents ``‖q − k‖² / (2T√w)`` as functions of the cosine between query and key are
  then the paper's; the random projection nearly preserves cosines. (Unscaled, the RBF net
  diverged at ``w = 256`` in a probe.)
- **Learning rates** were chosen by a small sweep at the default width (docs);
  docs/reference.md §6's tuned values are for the 3072-wide, 8-block ResNet-MLP and one epoch
  (``paper()`` uses them), and FOOF has none.
- **Muon's precision.** ``torch.optim.Muon`` runs Newton–Schulz in bfloat16, which a CPU
  computes far more slowly than float32 (docs/optimizer_experiments.md gives the timing).
  ``muon_ns_dtype="auto"`` uses :class:`Float32Muon` (the same update, float32
  iteration) on a CPU and ``torch.optim.Muon`` itself on CUDA.
- **Training loss** is the mean of the batch losses over the epoch, each computed before
  that batch's update (for a growing model: before its entries are written). Test accuracy
  and loss are measured on the whole test subset before training and after every epoch.
- **Missing data.** Each data set of ``datasets`` is loaded before any training; one that is
  not found is skipped, saying where it was looked for, unless ``skip_missing=False``
  (:func:`load_datasets`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rcdl.app.baseline_optim import Float32Muon, OptimizerGroup, make_optimizer
from rcdl.app.cifar import CifarData, CifarNotFoundError, cifar_summary, load_subsets
from rcdl.app.config import data_dir_setting, device_setting, setting
from rcdl.app.recipes import (
    PAPER_WIDTH,
    ProjectedConfig,
    epoch_rows,
    epoch_table,
    final_table,
    plot_curves,
    project,
    projected_tensors,
    random_projection,
    seed_runs,
    train_method,
)
from rcdl.app.report import csv_text, write_outputs
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.app.runner import Experiment, Session, run_experiment
from rcdl.nn.networks import GrowingRBFNet, GrowingSoftmaxNet, ResNetMLP
from rcdl.nn.rules import ClippedSoftmaxRule, FunctionalSGD
from rcdl.optim.dual_optim import FOOF
from rcdl.optim.grower import Grower

__all__ = [
    "DATASETS", "EXPERIMENT", "EXPERIMENT_SPEC", "METHODS",
    "OptimizerComparisonConfig", "ProjectedConfig", "build_method", "load_datasets",
    "project", "projected_tensors", "random_projection",
    "run_optimizer_comparison", "seed_runs", "train_method",
]  # fmt: skip

EXPERIMENT = "optimizers"
DATASETS = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}
METHODS = {
    "mlp-sgd": "residual MLP, SGD",
    "mlp-adam": "residual MLP, Adam",
    "mlp-rmsprop": "residual MLP, RMSprop",
    "mlp-muon": "residual MLP, Muon",
    "mlp-foof": "residual MLP, FOOF (Mesa)",
    "gws": "growing weighted softmax (gws)",
    "rbf": "growing RBF",
}
INITIAL_ENTRIES = 16  # the gws model's initial entries per layer (docs/reference.md §6)
_PAPER_TEMPERATURE = {"gws": 6.0, "rbf": 10.0}  # docs/reference.md §6, at width 3072
_CLASSIC = ("mlp-sgd", "mlp-adam", "mlp-rmsprop")  # the optimizers the growing models beat


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class OptimizerComparisonConfig(ProjectedConfig):
    """Settings of the multi-epoch optimizer comparison (docs/reference.md §8).

    The defaults (5 000 train / 2 000 test images, width 256, a 4-block MLP, 10 epochs,
    3 130 steps, one seed) were chosen from measured step costs (docs/optimizer_experiments.md):
    the time is dominated by the two growing models (each step attends over every entry
    written so far, 50 000 per layer at the end) and by Muon's Newton–Schulz iteration.

    ``quick()``: a smoke test; the numbers mean little.

    ``paper()``: the paper's scale as far as docs/reference.md states it: the whole data
    sets, no projection, §6's backbones (the ResNet-MLP's 8 blocks, its one-epoch baseline;
    the growing models' 2) and §6's tuned learning rates at batch 16. The 10 epochs are this
    project's choice, and FOOF keeps the default's swept settings. A GPU job: the growing
    models end with 500 000 entries per layer (about 18.5 GB each in float32, one at a time).
    """

    QUICK = {"train_size": 300, "test_size": 300, "width": 64, "mlp_depth": 2, "epochs": 3}
    PAPER = {"train_size": None, "test_size": None, "width": None, "mlp_depth": 8,
             "epochs": 10, "sgd_lr": 1e-3, "adam_lr": 1e-4, "rmsprop_lr": 1e-4,
             "muon_lr": 1e-3}  # fmt: skip

    datasets: tuple[str, ...] = setting(tuple(DATASETS), "data sets; a missing one is "
                                        "reported and skipped", choices=DATASETS)
    methods: tuple[str, ...] = setting(tuple(METHODS), "methods", choices=METHODS,
                                       default_text="all")
    train_size: int | None = setting(5000, "training images", metavar="N")
    test_size: int | None = setting(2000, "test images", metavar="N")
    epochs: int = setting(10, "epochs", metavar="E")
    width: int | None = setting(256, "projected input width", metavar="W")
    mlp_depth: int = setting(4, "residual blocks of the MLP (each one Linear w → w)",
                             metavar="L")
    growing_depth: int = setting(2, "blocks of the growing models (docs/reference.md §6)",
                                 metavar="L")
    sgd_lr: float = setting(3e-3, "learning rate of mlp-sgd (momentum 0.85)", positive=True,
                            metavar="LR")
    adam_lr: float = setting(3e-4, "learning rate of mlp-adam", positive=True, metavar="LR")
    rmsprop_lr: float = setting(3e-4, "learning rate of mlp-rmsprop", positive=True,
                                metavar="LR")
    muon_lr: float = setting(1e-3, "learning rate of mlp-muon's matrices (its biases get "
                             "Adam 1e-3)", positive=True, metavar="LR")
    foof_lr: float = setting(3e-2, "learning rate of mlp-foof", positive=True, metavar="LR")
    foof_damping: float = setting(1.0, "FOOF's λ, added to the diagonal of the input second "
                                  "moment", positive=True)
    muon_ns_dtype: str = setting(
        "auto", "precision of Muon's Newton–Schulz iteration: float32 (Float32Muon), "
        "bfloat16 (torch.optim.Muon) or auto (float32 on a CPU, bfloat16 on CUDA)",
        choices=("auto", "float32", "bfloat16"))
    gws_temperature: float | None = setting(None, "T of the gws model", positive=True,
                                            metavar="T", default_text="6 · √(w / 3072)")
    rbf_temperature: float | None = setting(None, "T of the RBF model", positive=True,
                                            metavar="T", default_text="10 · √(w / 3072)")
    seeds: tuple[int, ...] = setting((0,), "seeds", minimum=0, metavar="K")
    skip_missing: bool = setting(True, "skip a data set that is not found (saying so) "
                                 "instead of stopping", flag_help="stop when a data set of "
                                 "--datasets is not found")
    batch_size: int = setting(16, "samples per step (docs/reference.md §6)", metavar="B")
    eval_batch_size: int = setting(500, "images per prediction batch when measuring",
                                   metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets and of the input projection", minimum=0)
    device: str = device_setting()

    def temperature(self, method: str) -> float:
        """T of the growing model ``method`` (``"gws"`` or ``"rbf"``): the one given, else
        the paper's scaled by ``√(w / 3072)``."""
        given = {"gws": self.gws_temperature, "rbf": self.rbf_temperature}[method]
        if given is not None:
            return given
        return _PAPER_TEMPERATURE[method] * math.sqrt(self.input_width / PAPER_WIDTH)


# --------------------------------------------------------------------------- the data


Datasets = tuple[dict[str, CifarData], dict[str, dict[str, Any]]]  # (loaded, missing)


def load_datasets(cfg: OptimizerComparisonConfig, *, download: bool = True,
                  verbose: bool = True) -> Datasets:  # fmt: skip
    """The subsets of every data set of ``cfg``, before projection, and the ones missing.

    Returns:
        ``({name: data}, {name: {"message", "searched"}})``: the loaded subsets, and for
        each data set not found the loader's message and the paths it tried. A missing data
        set is announced on stderr when ``verbose``.

    Raises:
        rcdl.app.cifar.CifarNotFoundError: a data set is missing and ``cfg.skip_missing`` is
            False, or none of them is found; the message says where each was looked for.
        rcdl.app.cifar.CorruptDataError, ValueError: from the loader, or a subset too large.
    """
    loaded: dict[str, CifarData] = {}
    missing: dict[str, dict[str, Any]] = {}
    searched, briefs = [], []
    for name in cfg.datasets:
        try:
            loaded[name] = load_subsets(name, cfg, download=download)
        except CifarNotFoundError as e:
            searched += e.searched
            if not cfg.skip_missing:
                raise CifarNotFoundError(
                    f"{DATASETS[name]} is one of this comparison's data sets (datasets="
                    f"{' '.join(cfg.datasets)}) but was not found; provide it, or drop it from "
                    f"the data sets (skip_missing=True skips it).\n{e}", e.searched,
                    brief=e.brief) from e
            missing[name] = {"message": str(e), "searched": [str(p) for p in e.searched]}
            briefs.append(e.brief)
            if verbose:
                print(f"{e.brief}; the comparison runs without it.\n", file=sys.stderr)
    if not loaded:
        raise CifarNotFoundError(
            "none of this comparison's data sets was found:\n\n"
            + "\n\n".join(m["message"] for m in missing.values()), searched,
            brief="\n".join(briefs))  # fmt: skip
    return loaded, missing


def _given_datasets(cfg: OptimizerComparisonConfig, data: Mapping[str, CifarData]) -> Datasets:
    """``data`` passed to :func:`run_optimizer_comparison` as :func:`load_datasets` would
    give it: the data sets of ``cfg`` it holds (each of the config's sizes), and the others
    as missing."""
    loaded = {name: data[name] for name in cfg.datasets if name in data}
    if not loaded:
        raise ValueError(f"data holds none of the data sets {list(cfg.datasets)}")
    for name, d in loaded.items():  # the runner's check_sizes knows one data set only
        sizes, want = (len(d.y_train), len(d.y_test)), (cfg.train_size, cfg.test_size)
        if any(w is not None and s != w for s, w in zip(sizes, want, strict=True)):
            raise ValueError(f"the {name} data has {sizes[0]} train / {sizes[1]} test images, "
                             f"the config asks for {want[0]} / {want[1]}; pass "
                             "load_datasets(cfg) or no data")  # fmt: skip
    missing = {name: {"message": "not in the data given to run_optimizer_comparison",
                      "searched": []} for name in cfg.datasets if name not in data}  # fmt: skip
    return loaded, missing


# --------------------------------------------------------------------------- the methods


def _muon(model: nn.Module, cfg: OptimizerComparisonConfig, device: torch.device):  # noqa: ANN202
    dtype = cfg.muon_ns_dtype
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return make_optimizer("muon", model, lr=cfg.muon_lr)  # torch.optim.Muon itself
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in params if p.ndim == 2]
    others = [p for p in params if p.ndim != 2]
    muon = Float32Muon(matrices, lr=cfg.muon_lr, weight_decay=0.0, momentum=0.95, nesterov=True)
    return OptimizerGroup(muon, torch.optim.Adam(others, lr=1e-3) if others else None)


def build_method(
    name: str, seed: int, cfg: OptimizerComparisonConfig, classes: int, *,
    reserve: int = 0, device: torch.device | str = "cpu",
) -> tuple[nn.Module, Any, Grower | None]:  # fmt: skip
    """Method ``name`` of :data:`METHODS` with its learner, reproducibly from ``seed``.

    torch's global generator is seeded with ``seed`` first (the MLP's initialisation); the
    gws model's initial entries are seeded from ``seed``. Every model maps ``(B, w)`` to
    ``(B, classes)``, ``w = cfg.input_width``. A growing model's grower reserves
    ``reserve`` more entries per layer.

    Returns:
        ``(model, optimizer or None, grower or None)``, the model on ``device``.
    """
    device = torch.device(device)
    width = cfg.input_width
    torch.manual_seed(seed)
    if name.startswith("mlp-") and name in METHODS:
        model: nn.Module = ResNetMLP(width, classes, depth=cfg.mlp_depth).to(device)
        optimizer = name.removeprefix("mlp-")
        if optimizer == "muon":
            return model, _muon(model, cfg, device), None
        if optimizer == "foof":
            return model, FOOF(model, lr=cfg.foof_lr, damping=cfg.foof_damping, ema=0.95,
                               refresh_every=10, momentum=0.85), None  # fmt: skip
        return model, make_optimizer(optimizer, model, lr=getattr(cfg, f"{optimizer}_lr")), None
    if name == "gws":
        rule = ClippedSoftmaxRule(eta=0.003, beta=3.0)
        model = GrowingSoftmaxNet(width, classes, cfg.growing_depth, rule=rule,
                                  temperature=cfg.temperature("gws"),
                                  initial_entries=INITIAL_ENTRIES, seed=seed)  # fmt: skip
    elif name == "rbf":
        model = GrowingRBFNet(width, classes, cfg.growing_depth,
                              temperature=cfg.temperature("rbf"), rule=FunctionalSGD(10.0))
    else:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    model = model.to(device)
    grower = Grower(model)
    if reserve:
        grower.reserve(reserve)
    return model, None, grower


# --------------------------------------------------------------------------- running


def _sub_runs(cfg: OptimizerComparisonConfig, data: Datasets, session: Session) -> Iterator:
    """For each data set found, in the order of ``cfg.datasets``: every (seed, method)."""
    loaded, _ = data
    for name, d in loaded.items():
        build = partial(build_method, cfg=cfg, classes=d.num_classes,
                        reserve=cfg.epochs * len(d.y_train), device=session.device)
        tensors = projected_tensors(d, cfg, session.device)
        yield from seed_runs(train_method, cfg.methods, cfg, build, tensors, session,
                             prefix=f"{name}-", dataset=name)  # fmt: skip


def _start(cfg: OptimizerComparisonConfig, data: Datasets) -> dict[str, Any]:
    loaded, missing = data  # both in the order of cfg.datasets
    return {"data": {name: cifar_summary(cfg, d)["data"] for name, d in loaded.items()},
            "skipped": missing, "input_width": cfg.input_width}  # fmt: skip


def _finish(cfg: OptimizerComparisonConfig, summary: dict[str, Any]) -> None:
    summary["rows"] = epoch_rows(summary["runs"], key="method")
    summary["verdicts"] = {name: verdict(summary["rows"], name, cfg.epochs)
                           for name in summary["data"]}  # fmt: skip


def run_optimizer_comparison(cfg: OptimizerComparisonConfig, *,
                             data: Mapping[str, CifarData] | None = None,
                             **kw: Any) -> tuple[RunDir, dict[str, Any]]:  # fmt: skip
    """Train every method on every data set found, for every seed
    (:func:`rcdl.app.runner.run_experiment`, whose keywords ``kw`` are).

    Args:
        data: ``{dataset: subsets}`` already loaded by :func:`load_datasets` (before
            projection; sizes must be the config's); data sets of ``cfg.datasets`` absent
            from it count as missing. Default: load them here.

    The summary adds ``data`` and ``skipped`` (per data set), ``input_width``, ``rows`` (per
    (dataset, method, epoch), mean and sd over seeds, accuracies in percent) and
    ``verdicts`` (per data set); each of ``runs`` (per (dataset, method, seed)) holds
    parameters, entries, seconds and the ``history`` per epoch.

    Raises:
        rcdl.app.cifar.CifarNotFoundError: see :func:`load_datasets`.
    """
    spec = EXPERIMENT_SPEC
    if data is not None:  # several data sets: checked here, not by the runner's check_sizes
        given = _given_datasets(cfg, data)
        spec = replace(spec, load_data=lambda cfg, download=True: given)
    return run_experiment(spec, cfg, **kw)


# --------------------------------------------------------------------------- reporting


def verdict(rows: list[dict[str, Any]], dataset: str, epochs: int) -> dict[str, Any]:
    """The claims of docs/reference.md §8 checked on one data set's rows: do the growing models beat
    the SGD/Adam/RMSprop MLPs on final test accuracy; which method has the lowest training loss
    after the first and the last epoch; which MLP optimizer is best."""
    at = {e: {r["method"]: r for r in rows if r["dataset"] == dataset and r["epoch"] == e}
          for e in (1, epochs)}  # fmt: skip
    final = {m: r["test_acc_pct"] for m, r in at[epochs].items()}
    classic = {m: a for m, a in final.items() if m in _CLASSIC}
    mlps = {m: a for m, a in final.items() if m.startswith("mlp-")}
    out: dict[str, Any] = {
        "final_test_acc_pct": final,
        "lowest_train_loss_epoch1": min(at[1], key=lambda m: at[1][m]["train_loss"]),
        "lowest_train_loss_final": min(at[epochs], key=lambda m: at[epochs][m]["train_loss"]),
        "best_mlp_optimizer": max(mlps, key=mlps.__getitem__) if mlps else None,
        "best_method": max(final, key=final.__getitem__),
    }  # fmt: skip
    if classic:
        best = max(classic, key=classic.__getitem__)
        out["best_classic_mlp"] = best
        out["growing_beat_classic"] = {m: final[m] > classic[best] for m in ("gws", "rbf")
                                       if m in final}  # fmt: skip
    return out


def _where(missing: Mapping[str, Any]) -> str:
    """One sentence saying where a missing data set was looked for."""
    paths = [Path(p) for p in missing["searched"]]
    if not paths:
        return missing["message"] + "."
    names = " / ".join(dict.fromkeys(p.name for p in paths))
    folders = ", ".join(dict.fromkeys(str(p.parent) for p in paths))
    return (f"not found (looked for {names} in {folders}; the loader's full message is in "
            "summary.json).")


def _verdict_text(v: dict[str, Any], dataset: str) -> str:
    lines = []
    if v.get("growing_beat_classic"):
        best = v["best_classic_mlp"]
        for m, beat in v["growing_beat_classic"].items():
            lines.append(f"- {m} {'beats' if beat else 'does not beat'} the best of the "
                         f"SGD/Adam/RMSprop MLPs ({best}, {v['final_test_acc_pct'][best]:.2f} %) "
                         f"on final test accuracy ({v['final_test_acc_pct'][m]:.2f} %).")
    lines.append(f"- Lowest training loss after epoch 1: {v['lowest_train_loss_epoch1']}; "
                 f"after the last epoch: {v['lowest_train_loss_final']}.")
    if v["best_mlp_optimizer"] is not None:
        paper = {"cifar10": "Muon", "cifar100": "FOOF (Mesa)"}[dataset]
        lines.append(f"- Best MLP optimizer on final test accuracy: {v['best_mlp_optimizer']} "
                     f"(paper: {paper}).")
    lines.append(f"- Best method overall: {v['best_method']}.")
    return "\n".join(lines)


def write_report(run: RunDir, cfg: OptimizerComparisonConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv`` and one ``optimizers_<dataset>.png`` per data
    set; return the markdown."""
    rows = summary["rows"]
    width = (f"a fixed random projection of the 3,072 pixel values to w = {cfg.width}"
             if cfg.width is not None else "the 3,072 pixel values (no projection)")
    lrs = (f"SGD {cfg.sgd_lr:g} (momentum 0.85), Adam {cfg.adam_lr:g}, RMSprop "
           f"{cfg.rmsprop_lr:g}, Muon {cfg.muon_lr:g} (Newton–Schulz in "
           f"{cfg.muon_ns_dtype if cfg.muon_ns_dtype != 'auto' else 'auto precision'}), FOOF "
           f"{cfg.foof_lr:g} (damping {cfg.foof_damping:g}, momentum 0.85)")  # fmt: skip
    parts = [
        "# Multi-epoch optimizer comparison (docs/reference.md §8)",
        f"Every method sees {width}, {cfg.epochs} epochs (each a fresh order), batch "
        f"{cfg.batch_size}, cross-entropy. MLP: ResNet-MLP with {cfg.mlp_depth} blocks at width "
        f"{cfg.input_width}; learning rates {lrs}. Growing models: {cfg.growing_depth} blocks, "
        f"gws T = {cfg.temperature('gws'):.3g} (β = 3, η = 0.003), RBF T = "
        f"{cfg.temperature('rbf'):.3g} (η = 10), written every epoch. Seeds: "
        f"{' '.join(map(str, cfg.seeds))}.",
    ]  # fmt: skip
    for name, why in summary["skipped"].items():
        parts.append(f"**{DATASETS[name]} was skipped**: {_where(why)}")
    figures = {}
    for name, d in summary["data"].items():
        title = DATASETS[name]
        dataset_rows = [r for r in rows if r["dataset"] == name]
        steps = math.ceil(d["n_train"] / cfg.batch_size)
        parts += [
            f"## {title}",
            f"{d['n_train']:,} train / {d['n_test']:,} test images (random subsets, data seed "
            f"{cfg.data_seed}), {d['num_classes']} classes, {steps:,} steps per epoch. "
            f"Data: {d['source']}, {d['provenance']}.",
            final_table(dataset_rows, cfg.epochs, METHODS),
            "Test accuracy (%) by epoch (epoch 0: before training):",
            epoch_table(dataset_rows, "test_acc_pct", 2),
            "Training loss by epoch (mean batch loss over the epoch, before each update):",
            epoch_table(dataset_rows, "train_loss", 3),
            _verdict_text(summary["verdicts"][name], name),
        ]  # fmt: skip
        figures[f"optimizers_{name}.png"] = partial(
            plot_curves, dataset_rows,
            title=f"{title}, {d['n_train']:,} training images, w = {cfg.input_width}",
            labels={m: METHODS[m] for m in cfg.methods})  # fmt: skip
    parts += [
        "Paper (docs/reference.md §8): the weighted-softmax and RBF growing models clearly "
        "beat the SGD/Adam/RMSprop MLPs and drop the training loss fastest; Muon is the best "
        "parametric optimizer on CIFAR-10, Mesa/FOOF on CIFAR-100 (no numbers given).",
        f"Machine: {describe_machine(device)}.\n",
    ]
    return write_outputs(run, "\n\n".join(parts), csv_text(rows), figures)


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=OptimizerComparisonConfig,
    help="several epochs of MLPs trained by SGD, Adam, RMSprop, Muon and FOOF beside the "
    "growing gws and RBF networks, CIFAR-10 and CIFAR-100 (docs/reference.md §7, §8)",
    description="MLPs trained by SGD, Adam, RMSprop, Muon and FOOF beside the growing gws "
    "and RBF networks (plain functional-gradient rules, writing every epoch), several "
    "epochs on CIFAR-10 and, when its files are found, CIFAR-100; all see the same fixed "
    "random projection of the pixels to --width dimensions. Writes results.md, "
    "results.csv and the training-loss and test-accuracy figures. See "
    "docs/optimizer_experiments.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_datasets, start=_start,
    finish=_finish,
    switches={"no_projection": ("the raw 3 072 pixels (the paper's setting)", {"width": None})},
)  # fmt: skip
