"""Single-model attribution, scored against exact retraining.

Run it with ``rcdl reproduce single-model-attribution`` (see docs/attribution.md,
"Single-model attribution"). The standard linear datamodeling
score (``rcdl reproduce attribution``) compares a score with models retrained on random
halves with new seeds, so no score reaches 1: a measured seed ceiling bounds it. The
*single-model* protocol asks a narrower, exact question: for **this** model, trained from its
seed in its order, what would it predict without a small set ``S`` of its training images,
trained from the same seed in the same order? A growing model is retrained without ``S``
exactly and cheaply, so here the ground truth is computed, not estimated, and the ceiling
is 1.

"The same order" can mean two things, and the ``protocol`` setting picks one:

- ``kept`` (the default): every batch as it was, the set's images left out of theirs; every
  other image trains in its original step, beside the same images (what zeroing a sample's
  weight in its batch does in the data-weight formulation of single-model attribution);
- ``re-formed``: the stream without the set, batched again, which is what exact forgetting
  replays (:func:`rcdl.train.unlearning.forget_exactly`, bit for bit the model trained on
  the data without the set). Removing one image then also moves every later batch's
  boundary by one, so every later image is trained beside other images: a change no
  per-image score can follow, and larger than the images' own effect (docs/attribution.md).

For each model and each removal fraction ``f`` (one sub-run): the model is trained one pass
(batch 16, model seed 0) over the training subset; then ``sets`` removal sets ``S_m``
(random ``f``-shares of the training images, drawn from ``set_seed``) are each removed under
the protocol (``kept``: the model retrained with the holes; ``re-formed``: forgotten exactly
from a copy by replaying its log), and each test image's correct-class margin
``f_y(x) − log Σ_{c≠y} e^{f_c(x)}`` is read before and after: ``Δ_m(x)`` is the exact change.

An attribution method gives scores ``τ(x, i)`` (the contribution of training image ``i`` to
the prediction of ``x``); it predicts ``Δ_m(x) ≈ −Σ_{i∈S_m} τ(x, i)``. Its **single-model
LDS** is, for each test image, Spearman's correlation over the sets between the predicted and
the exact change, averaged over the test images. The methods:

- ``shares, all layers``: :func:`rcdl.explain`'s per-sample contributions summed over every
  growing layer (what ``rcdl reproduce attribution`` calls "all layers");
- ``readout shares``: the readout's exact shares alone; ``readout deletion``: minus the exact
  change of the margin's logit when a sample's readout entries alone are deleted (equal to
  the shares for a readout that does not normalise);
- ``readout cascade`` and ``readout one-level``: the shares plus the first-order change of
  every later readout write (:func:`rcdl.memory.cascade.readout_cascade`; a readout that does
  not normalise, trained by per-sample functional SGD: RBF), and that change truncated to one
  later write.

Beside them, three **set-level** references that are not attributions (each computes the
changed model for each set, so it cannot be summed over samples): ``forget`` (the set's
entries deleted, nothing re-trained), ``repair`` and ``repair+keys``
(:func:`rcdl.memory.repair.forget_and_repair`, the readout re-written with its stored or
recomputed keys). Their LDS says how far a method that models only those effects can get.

With ``oracle``, the sum of each removed image's own exact change (one retraining per
image) is scored too: the best any per-image score can do under the protocol (the ceiling of
additive attribution; how far the effects of a set add up).

Each method's cost is its seconds over the training's seconds (one training = 1); a
set-level reference's cost is per set.

**How a removal spreads.** Each sub-run also forgets, one at a time, the single image at
``positions`` evenly spaced places of the stream, and reports the mean ``|Δ(x)|`` over the
test images against the share of the stream trained after it. Where a removal's effect stays
about the same size however many steps follow it (RBF), the effects of a set add up and an
attribution can predict them; where it grows with every later step (gws: a different model
after a few hundred steps), the exact change of a set is dominated by how the perturbation
spread, which no per-sample score summed over the set follows.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.app.cifar import CifarData, cifar_summary, load_subsets
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.experiments.attribution.lds import (
    attribution_scores,
    cascade_scores,
    margins,
    spearman,
)
from rcdl.app.models import build_model, model_spec
from rcdl.app.recipes import copy_trained, repaired_copies, train_with_learners
from rcdl.app.report import csv_text, markdown_table, write_outputs
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.app.runner import Experiment, Session
from rcdl.memory.forgetting import forget
from rcdl.memory.provenance import samples
from rcdl.train.loop import epoch_permutation, train_step
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly

__all__ = ["EXPERIMENT", "EXPERIMENT_SPEC", "PROTOCOLS", "SingleModelConfig", "measure",
           "method_scores", "removal_sets", "single_model_lds", "train_with_holes"]

EXPERIMENT = "single-model-attribution"
MODEL_SEED = 0
# the standard protocol's LDS and its seed ceiling for these models, 5 000 / 500 images
# (results/attribution/unrolled/README.md): shown beside the single-model numbers
STANDARD = {"rbf": {"lds": 0.352, "ceiling": 0.376}, "gws": {"lds": 0.090, "ceiling": 0.105}}
SET_LEVEL = ("forget", "repair", "repair+keys")
PROTOCOLS = {"kept": "every batch as it was, the set's images left out of theirs",
             "re-formed": "the stream without the set, batched again (exact forgetting's "
                          "replay)"}


@dataclass(frozen=True)
class SingleModelConfig(ExperimentConfig):
    """Settings of the single-model attribution experiment (module docstring)."""

    QUICK = {"train_size": 300, "test_size": 40, "sets": 6, "fractions": (0.02, 0.05)}

    models: tuple[str, ...] = setting(("rbf", "gws"), "growing models of the one-epoch "
                                      "comparison", metavar="NAME")
    fractions: tuple[float, ...] = setting((0.005, 0.01, 0.02, 0.05), "shares of the "
                                           "training images each removal set holds",
                                           positive=True, metavar="F")
    protocol: str = setting("kept", "how the model is retrained without a set: kept (every "
                            "batch as it was, the set's images left out) or re-formed (the "
                            "stream without the set batched again, as exact forgetting "
                            "replays it)", choices=PROTOCOLS)
    sets: int = setting(20, "removal sets per fraction (each retrained exactly)", minimum=3,
                        metavar="M")
    set_seed: int = setting(1, "seed of the removal sets", minimum=0)
    train_size: int = setting(2000, "random subset of N training images", metavar="N")
    test_size: int = setting(200, "random subset of N test images (those explained)",
                             metavar="N")
    positions: int = setting(5, "single images forgotten at evenly spaced stream positions "
                             "(how a removal spreads; 0: none), in the first fraction's "
                             "sub-run", minimum=0, metavar="P")
    oracle: bool = setting(False, "also score the sum of each removed image's own exact "
                           "change (one retraining per image: slow)")
    set_level: bool = setting(True, "also score forget, repair and repair+keys on each set "
                              "(set-level references)",
                              flag_help="leave out the set-level references")
    batch_size: int = setting(16, "samples per training step B", metavar="B")
    explain_batch_size: int = setting(50, "images per rcdl.explain call", metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()

    def check(self) -> None:
        for name in self.models:
            if not model_spec(name).growing:
                raise ValueError(f"SingleModelConfig: model {name!r} has no growing layers "
                                 "to explain or replay; use gws, gauge, rbf or laplacian")
        for f in self.fractions:
            if not 0 < f < 1 or round(f * self.train_size) < 1:
                raise ValueError(f"SingleModelConfig: fraction {f:g} of {self.train_size} "
                                 "training images removes no image or all of them")


load_data = partial(load_subsets, "cifar10")


# --------------------------------------------------------------------------- the protocol


def removal_sets(n: int, fraction: float, count: int, seed: int) -> Tensor:  # (M, k) int64
    """``count`` random sets of ``round(fraction · n)`` distinct training indices, drawn one
    after the other from ``seed`` (and the fraction, so each fraction has sets of its own)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + round(fraction * 1_000_000))
    k = max(1, round(fraction * n))
    return torch.stack([torch.randperm(n, generator=gen)[:k].sort().values
                        for _ in range(count)])


def single_model_lds(predicted: Tensor, exact: Tensor) -> float:
    """The mean over test images of Spearman's correlation over the sets between
    ``predicted (M, T)`` and ``exact (M, T)`` (test images where either is constant over
    the sets are left out)."""
    r = spearman(predicted.double(), exact.double())
    r = r[torch.isfinite(r)]
    return float(r.mean()) if r.numel() else float("nan")


def method_scores(model: nn.Module, x: Tensor, y: Tensor, n: int, *, batch_size: int,
                  device: torch.device) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Every method's ``τ (T, n)`` for the test images ``x``, labels ``y`` and the seconds
    each took (the three share variants come from one pass and share its seconds)."""
    start = time.perf_counter()
    found = attribution_scores(model, x, y, n, batch_size=batch_size, device=device)
    shared = time.perf_counter() - start
    scores = {"shares, all layers": found["all layers"], "readout shares": found["readout"],
              "readout deletion": found["readout deletion"]}
    seconds = dict.fromkeys(scores, shared)
    try:
        start = time.perf_counter()
        cascade = cascade_scores(model, x, y, n, device=device)
    except ValueError:
        return scores, seconds  # a normalised readout: no cascade (module docstring)
    took = time.perf_counter() - start
    for variant, label in (("readout, cascade", "readout cascade"),
                           ("readout, one-level", "readout one-level")):
        scores[label], seconds[label] = cascade[variant], took
    return scores, seconds


def train_with_holes(name: str, seed: int, x: Tensor, y: Tensor, removed: Tensor, *,
                     batch_size: int, device: torch.device) -> nn.Module:
    """Model ``name`` trained one pass from ``seed`` in ``seed``'s order, every batch as
    :func:`rcdl.app.recipes.train_with_learners` forms it, with the images ``removed`` left
    out of theirs (a batch left empty is skipped). With nothing removed it is that
    training's model, bit for bit (tests/test_single_model.py)."""
    n = len(y)
    model, optimizer, grower = build_model(name, seed, device=device, reserve=n)
    order = epoch_permutation(n, seed, 0)
    out = torch.zeros(n, dtype=torch.bool)
    out[removed] = True
    for begin in range(0, n, batch_size):
        idx = order[begin:begin + batch_size]
        idx = idx[~out[idx]]  # (b,) the batch without the removed images
        if len(idx):
            with samples(model, idx):
                loss = train_step(model, x[idx].to(device), y[idx].to(device),
                                  F.cross_entropy, optimizer, grower)
            if not math.isfinite(loss):  # train_step skipped the step: say so, as the loop does
                raise FloatingPointError(f"{name} without {len(removed)} images: training "
                                         f"loss is {loss} at step {begin // batch_size}")
    return model


@dataclass
class _Retrainer:
    """The model without a set of images under the config's protocol, and the seconds it
    took (module docstring)."""

    name: str
    data: CifarData
    cfg: SingleModelConfig
    device: torch.device
    trained: tuple
    replay: ReplayLog

    def __call__(self, removed: Tensor) -> tuple[nn.Module, float]:
        x, y = self.data.x_train, self.data.y_train
        start = time.perf_counter()
        if self.cfg.protocol == "kept":
            model = train_with_holes(self.name, MODEL_SEED, x, y, removed,
                                     batch_size=self.cfg.batch_size, device=self.device)
            return model, time.perf_counter() - start
        model, optimizer, grower = copy_trained(self.name, MODEL_SEED, self.trained,
                                                reserve=len(y), device=self.device)
        forget_exactly(model, removed, replay=copy.deepcopy(self.replay), data=(x, y),
                       loss_fn=F.cross_entropy, optimizer=optimizer, grower=grower,
                       device=self.device, scan=False)
        return model, time.perf_counter() - start


def measure(name: str, fraction: float, data: CifarData, cfg: SingleModelConfig,
            session: Session) -> dict[str, Any]:  # fmt: skip
    """One sub-run: model ``name`` trained (with a replay log), each removal set of
    ``fraction`` removed under the protocol, every method's predicted change and the
    set-level references' changes; returns the LDS and seconds per method (module
    docstring)."""
    device = session.device
    x, y, xt, yt = data.x_train, data.y_train, data.x_test, data.y_test
    n = len(y)
    # a short training first, untimed: the first call of a process compiles and allocates
    train_with_learners(name, MODEL_SEED, x[:32], y[:32], (x[:1], y[:1]),
                        batch_size=cfg.batch_size, device=device)
    replay = ReplayLog(every=1)
    start = time.perf_counter()
    trained = train_with_learners(name, MODEL_SEED, x, y, (x[:1], y[:1]),
                                  batch_size=cfg.batch_size, device=device, replay=replay)
    train_seconds = time.perf_counter() - start
    model = trained[0]
    retrain = _Retrainer(name, data, cfg, device, trained, replay)
    base = margins(model, xt, yt, device=device)  # (T,)

    def change(removed: Tensor) -> tuple[Tensor, float]:  # (T,), seconds
        changed, took = retrain(removed)
        return margins(changed, xt, yt, device=device) - base, took

    scores, seconds = method_scores(model, xt, yt, n, batch_size=cfg.explain_batch_size,
                                    device=device)
    sets = removal_sets(n, fraction, cfg.sets, cfg.set_seed)
    exact: list[Tensor] = []
    predicted: dict[str, list[Tensor]] = {k: [] for k in scores}
    set_level: dict[str, list[Tensor]] = {}
    set_seconds: dict[str, float] = {}
    alone: dict[int, Tensor] = {}  # each removed image's own exact change (the oracle)
    retrain_seconds = 0.0
    for removed in sets:
        delta, took = change(removed)
        exact.append(delta)
        retrain_seconds += took
        for key, tau in scores.items():
            predicted[key].append(-tau[:, removed].sum(1))
        if cfg.set_level:
            for key, changed, took in _set_level(model, removed, x, y):
                set_level.setdefault(key, []).append(margins(changed, xt, yt, device=device)
                                                     - base)
                set_seconds[key] = set_seconds.get(key, 0.0) + took
        if cfg.oracle:
            for i in removed.tolist():
                if i not in alone:
                    alone[i] = change(torch.tensor([i]))[0]
            predicted.setdefault("exact single-image changes, summed", []).append(
                torch.stack([alone[i] for i in removed.tolist()]).sum(0))
    exact_t = torch.stack(exact)  # (M, T)
    spread = []
    stream = epoch_permutation(n, MODEL_SEED, 0)
    for p in range(cfg.positions if fraction == cfg.fractions[0] else 0):  # once per model
        at = (p * (n - 1)) // max(1, cfg.positions - 1) if cfg.positions > 1 else 0
        delta, _ = change(stream[at:at + 1])
        spread.append({"position": at, "after": 1 - at / n,
                       "mean_abs_change": float(delta.abs().mean())})
    if cfg.oracle:
        # what scoring every training image so takes: one retraining per image
        seconds["exact single-image changes, summed"] = n * retrain_seconds / len(sets)
    methods = {key: {"lds": single_model_lds(torch.stack(p), exact_t),
                     "seconds": seconds[key],
                     "kind": "oracle" if key.startswith("exact") else "attribution"}
               for key, p in predicted.items()}
    methods |= {key: {"lds": single_model_lds(torch.stack(p), exact_t),
                      "seconds": set_seconds[key] / len(sets), "kind": "set-level"}
                for key, p in set_level.items()}
    return {"model": name, "fraction": fraction, "set_size": int(sets.shape[1]),
            "sets": len(sets), "train_seconds": train_seconds,
            "retrain_seconds": retrain_seconds / len(sets),
            "mean_abs_change": float(exact_t.abs().mean()),
            "mean_abs_margin": float(base.abs().mean()), "spread": spread, "methods": methods}


def _set_level(model: nn.Module, forget_idx: Tensor, x: Tensor, y: Tensor
               ) -> Iterator[tuple[str, nn.Module, float]]:
    """The set-level references (module docstring): each a changed copy of ``model`` and the
    seconds it took."""
    copy_ = copy.deepcopy(model)
    receipt = forget(copy_, forget_idx, scan=False)
    yield "forget", copy_, receipt.seconds
    for key, changed, receipt in repaired_copies(model, forget_idx, x, y, scan=False):
        yield key, changed, receipt.seconds


def _sub_runs(cfg: SingleModelConfig, data: CifarData, session: Session) -> Iterator:
    for name in cfg.models:
        for fraction in cfg.fractions:
            yield f"{name}-{fraction:g}", partial(measure, name, fraction, data, cfg, session)


def _start(cfg: SingleModelConfig, data: CifarData) -> dict[str, Any]:
    return cifar_summary(cfg, data)


# --------------------------------------------------------------------------- reporting


def rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, fraction, method); ``seconds`` the method's (per set for a
    set-level reference), ``train_seconds`` one training's."""
    return [{"model": r["model"], "fraction": r["fraction"], "set_size": r["set_size"],
             "method": key, "kind": m["kind"], "lds": m["lds"], "seconds": m["seconds"],
             "train_seconds": r["train_seconds"]}
            for r in runs for key, m in r["methods"].items()]


def plot(path: Path, runs: list[dict[str, Any]]) -> None:
    """Per model, each method's single-model LDS against the removal fraction (set-level
    references dashed, the oracle dotted; one colour per method in every panel), with the
    standard protocol's LDS and seed ceiling as grey lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in runs))
    methods = list(dict.fromkeys(k for r in runs for k in r["methods"]))
    fractions = sorted({100 * r["fraction"] for r in runs})
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.6), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        mine = sorted((r for r in runs if r["model"] == name), key=lambda r: r["fraction"])
        for i, key in enumerate(methods):
            points = [(100 * r["fraction"], r["methods"][key]["lds"]) for r in mine
                      if key in r["methods"]]
            if not points:
                continue
            kind = next(r["methods"][key]["kind"] for r in mine if key in r["methods"])
            style = {"attribution": "o-", "oracle": "^:"}.get(kind, "s--")
            ax.plot(*zip(*points, strict=True), style, color=f"C{i}", label=key)
        if name in STANDARD:
            ax.axhline(STANDARD[name]["lds"], color="grey", lw=0.8, ls=":",
                       label="standard LDS (all layers)")
            ax.axhline(STANDARD[name]["ceiling"], color="black", lw=0.8, ls=":",
                       label="standard protocol's seed ceiling")
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_xscale("log")
        ax.set_xticks(fractions, [f"{f:g}" for f in fractions])
        ax.minorticks_off()
        ax.set_ylim(min(-0.05, ax.get_ylim()[0]), 1.05)
        ax.set_xlabel("removal set, % of the training images")
        ax.set_ylabel("single-model LDS")
        ax.set_title(name)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # every method and line once, whichever panel drew it
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_spread(path: Path, runs: list[dict[str, Any]]) -> None:
    """Per model, the mean |Δ margin| of removing one image against the share of the stream
    trained after it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4))
    for i, r in enumerate(r for r in runs if r["spread"]):
        points = sorted((s["after"], s["mean_abs_change"]) for s in r["spread"])
        ax.plot(*zip(*points, strict=True), "o-", color=f"C{i}",
                label=f"{r['model']} (mean |margin| {r['mean_abs_margin']:.2f})")
    ax.set_yscale("log")
    ax.set_xlabel("share of the stream trained after the removed image")
    ax.set_ylabel("mean |Δ margin| over the test images")
    ax.set_title("How one removal spreads through later training", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run: RunDir, cfg: SingleModelConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv`` and ``single_model_lds.png``; return the
    markdown."""
    runs = summary["runs"]
    body = [(r["model"], f"{100 * r['fraction']:g} % ({r['set_size']})", key, m["kind"],
             f"{m['lds']:+.3f}", f"{m['seconds'] / r['train_seconds']:.3g}")
            for r in runs for key, m in r["methods"].items()]
    costs = [(r["model"], f"{100 * r['fraction']:g} %", f"{r['train_seconds']:.3g}",
              f"{r['retrain_seconds']:.3g}", f"{r['mean_abs_change']:.3g}") for r in runs]
    if runs:
        plot(run.path / "single_model_lds.png", runs)
    spread = [(r["model"], s["position"], f"{s['after']:.2f}", f"{s['mean_abs_change']:.3g}",
               f"{r['mean_abs_margin']:.3g}") for r in runs for s in r["spread"]]
    if spread:
        plot_spread(run.path / "spread.png", runs)
    d = summary["data"]
    standard = "; ".join(f"{k}: LDS {v['lds']:.3f}, seed ceiling {v['ceiling']:.3f}"
                         for k, v in STANDARD.items() if k in cfg.models)
    markdown = "\n\n".join([
        "# Single-model attribution against exact retraining",
        f"{d['n_train']:,} training / {d['n_test']:,} test CIFAR-10 images (random subsets, "
        f"data seed {cfg.data_seed}; JPEG-decoded); one pass, batch {cfg.batch_size}, model "
        f"seed {MODEL_SEED}; {cfg.sets} removal sets per fraction (set seed {cfg.set_seed}), "
        f"the model retrained without each from the same seed in the same order (protocol "
        f"{cfg.protocol}: {PROTOCOLS[cfg.protocol]}). LDS: per test image, Spearman's "
        "correlation over the sets between the predicted and the exact change of the "
        "correct-class margin, averaged (1: every set's effect ranked right). cost: the "
        "method's seconds over one training's (set-level references: per set; the oracle: "
        "one retraining per training image).",
        markdown_table(("model", "removed", "method", "kind", "LDS", "cost (trainings)"),
                       body, "lllrrr"),
        "The runs: training and retraining seconds (per set), and the mean |Δ margin| "
        "the sets cause.",
        markdown_table(("model", "removed", "train s", "retrain s", "mean abs change"), costs,
                       "llrrr"),
        "How one removal spreads (spread.png): the exact change of removing the single image "
        "at a stream position, mean |Δ margin| over the test images, against the share of "
        "the stream trained after it.",
        markdown_table(("model", "position", "trained after", "mean abs change",
                        "mean abs margin"), spread, "lrrrr"),
        f"The standard protocol (models retrained on random halves with new seeds, "
        f"5 000 / 500 images; results/attribution/unrolled/): {standard}.",
        f"Data: {d['source']}, {d['provenance']}.",
        f"Machine: {describe_machine(device)}.\n"])
    return write_outputs(run, markdown, csv_text(rows(runs)))


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=SingleModelConfig,
    help="the single-model protocol: each attribution method's predicted effect of removing "
    "small random sets of training images against exact replay (docs/attribution.md)",
    description="Trains each growing model one pass on a CIFAR-10 subset with a replay log, "
    "forgets random removal sets (0.5-5 % of the training images) exactly by replay, and "
    "scores attribution methods (rcdl.explain's shares, the readout's deletion effects, the "
    "readout cascade) by their single-model linear datamodeling score against the exact "
    "changes, beside set-level references (forget, repair). See docs/attribution.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_data, start=_start,
)  # fmt: skip

