"""rcdl's native attribution measured on CIFAR-10: the linear datamodeling score, mislabel
detection by self-influence, and test images beside the training images they rest on
(docs/attribution.md, "rcdl reproduce attribution").

Run it with ``rcdl reproduce attribution``. Every model is a growing model of the one-epoch
comparison (:mod:`rcdl.app.models`), trained one epoch, batch 16, on a
random CIFAR-10 training subset (docs/cifar10.md). rcdl's score ``τ(x, i)`` of training
image ``i`` for an output ``f(x)`` is :func:`rcdl.memory.attribution.explain`'s per-sample
contribution: the sum, over the entries ``i`` wrote in every growing layer, of their
contribution to ``f(x)`` (the readout's exact shares, first order through earlier layers).

**Linear datamodeling score** (LDS; TRAK, Park et al. 2023; the dattri benchmark). Score
every (test image ``x``, training image ``i``) pair towards ``x``'s correct-class logit with
the model trained on the whole subset (seed 0); retrain ``M = halves`` models on random
halves ``S_m`` of the subset (seeds 100, 101, ...); for each test image, the Spearman
correlation over ``m`` between ``Σ_{i ∈ S_m} τ(x, i)`` and the retrained model's
correct-class margin ``f_y(x) − log Σ_{c ≠ y} e^{f_c(x)}``; LDS is its mean over test
images. Three variants of ``τ`` (:data:`VARIANTS`): summed over every growing layer, the
readout's exact shares alone, and minus the readout's exact deletion effect
(:func:`rcdl.memory.attribution.deletion_effects`).

**Mislabel detection.** Flip the labels of ``flip`` of the training images (to another
class, at random; seed 2), train once (seed 0), and rank the training images by
**self-influence**: the contribution of an image's own entries, in every layer, to its own
(noisy) label's logit. A flipped image can only be fitted by its own entries, so it should
rank high. And by the **leave-one-out margin**: minus the image's label margin when the
model answers it with its own entries deleted from every layer, exactly
(:func:`rcdl.memory.leave_one_out.leave_one_out`): a flipped label that only its own
entries supported loses its margin. By the **leave-one-out label vote**: minus the label's
margin when the labels of the samples that wrote the readout's entries vote, weighed by the
readout's kernel (:class:`~rcdl.app.experiments.continual.baselines.LabelVote`), the image's
own entries left out (:func:`leave_one_out_vote_margins`); and by the mean of its ranks
under the two leave-one-out rankings. Baselines: the trained model's cross-entropy on each
training image, and a random ranking. Measured: the ROC-AUC of telling flipped from clean
images, and the share of the flipped images among the top 10 % and 20 % of each ranking
(inspected).

**Explanations** (``explanations.png``): the first ``shown`` test images, each beside the
``top`` training images with the largest summed contribution to its predicted logit under
each model trained on the whole subset.

Sub-runs, per model, in order (``--resume`` keeps the finished ones); the tensors one
sub-run hands to a later one are files of the run folder:

- ``<model>-lds-full``: train on the whole subset, score every pair, save every half's
  summed scores (``lds-<model>-predicted.pt``) and the shown explanations' images
  (``lds-<model>-shown.pt``);
- ``<model>-lds-halves-<first>``: retrain ``halves_per_sub_run`` models on their halves and
  save their margins (``lds-<model>-margins-<first>.pt``);
- ``<model>-lds``: the Spearman correlations and the LDS;
- ``<model>-mislabel``: mislabel detection.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl._io import atomic_save_torch, save_figure
from rcdl.app.cifar import CifarData, cifar_summary, load_subsets
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.experiments.continual.baselines import LabelVote, class_scores
from rcdl.app.models import model_spec
from rcdl.app.recipes import train_model
from rcdl.app.report import csv_text, markdown_table, write_outputs
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.app.runner import Experiment, Session
from rcdl.memory.attribution import deletion_effects, explain
from rcdl.memory.leave_one_out import leave_one_out
from rcdl.memory.provenance import UNKNOWN, entry_samples
from rcdl.nn.layers import growing_layers
from rcdl.nn.networks import layer_input
from rcdl.train.loop import predict

__all__ = [
    "COLUMNS", "EXPERIMENT", "EXPERIMENT_SPEC", "KRONFLUENCE_FOUND", "LDS_ANCHORS",
    "LDS_TARGETS", "MEASUREMENTS", "MISLABEL_TARGET", "RANKINGS", "TRAK_AUC", "VARIANTS",
    "AttributionConfig",
    "attribution_scores", "auc", "detection", "draw_explanations", "draw_results",
    "flip_labels", "found_in_top", "half_masks", "half_sums", "lds_full", "lds_halves",
    "leave_one_out_margins", "leave_one_out_vote_margins", "lds_score", "load_data",
    "margins", "mislabel_one", "rows", "self_influence", "spearman", "targets",
    "to_pixels", "train_model", "write_report",
]  # fmt: skip

EXPERIMENT = "attribution"
MEASUREMENTS = {"lds": "the linear datamodeling score against models retrained on halves",
                "mislabel": "mislabel detection by self-influence"}  # fmt: skip
VARIANTS = {"all layers": "summed over every growing layer",
            "readout": "the readout's exact shares alone",
            "readout deletion": "minus the exact change of the logit when the sample's "
            "readout entries alone are deleted (the softmax's normaliser shrinks too)"}  # fmt: skip
RANKINGS = {"self-influence": "its own entries' contribution to its own label's logit",
            "leave-one-out margin": "minus its label's margin when the model answers it "
            "with its own entries deleted from every layer (exact, rcdl.memory.leave_one_out)",
            "leave-one-out label vote": "minus its label's margin in the readout's label "
            "vote (the labels of the samples that wrote the readout's entries, weighed by "
            "the readout's kernel at a quarter of its temperature), its own entries left out",
            "leave-one-out, both": "the mean of its ranks by the two leave-one-out rankings",
            "training loss": "the trained model's cross-entropy on it",
            "random": "a random ranking"}  # fmt: skip
# published anchors, other models and data: (what, LDS) from the dattri benchmark
LDS_ANCHORS = (("TRAK-10, MNIST MLP", 0.33), ("TRAK-50, MNIST MLP", 0.45),
               ("TRAK-50, CIFAR-2 ResNet-9", 0.37))  # fmt: skip
# Kronfluence: share of flipped labels found per share inspected (full CIFAR-10, ResNet-9);
# dattri: TRAK's ROC-AUC on CIFAR-10 with a ResNet-9
KRONFLUENCE_FOUND = {0.1: 0.80, 0.2: 0.97}
TRAK_AUC = 0.67
# what rcdl aims at (docs/attribution.md, "Targets"): the LDS of a model's best score, and
# the best ranking's ROC-AUC with the share of the flipped labels in its top 10 %
LDS_TARGETS = {"gws": 0.30, "rbf": 0.45}
MISLABEL_TARGET = (0.80, 0.60)
FULL_SEED, HALVES_SEED, FIRST_HALF_SEED, FLIP_SEED = 0, 1, 100, 2
VOTE_SHARPNESS = 4.0  # the label vote's default (continual.baselines.LabelVote), not tuned here
EVAL_IMAGES = 16  # test images the trainer scores before and after a pass (not reported)
CURVE = tuple(i / 50 for i in range(1, 51))  # shares inspected, for the detection curve


@dataclass(frozen=True)
class AttributionConfig(ExperimentConfig):
    """Settings of the attribution measurements (module docstring). The defaults: 5 000
    training / 500 test images, 50 halves, gws and RBF; ``quick()``: 500 / 50 images and 8
    halves (run times in docs/attribution.md)."""

    QUICK = {"train_size": 500, "test_size": 50, "halves": 8}

    models: tuple[str, ...] = setting(("gws", "rbf"), "growing models of the one-epoch "
                                      "comparison", metavar="NAME")
    measurements: tuple[str, ...] = setting(tuple(MEASUREMENTS), "measurements",
                                            choices=MEASUREMENTS, default_text="both")
    train_size: int = setting(5000, "random subset of N training images", metavar="N")
    test_size: int = setting(500, "random subset of N test images (those the LDS explains)",
                             metavar="N")
    halves: int = setting(50, "models retrained on random halves of the training images "
                          "(LDS)", minimum=2, metavar="M")
    halves_per_sub_run: int = setting(10, "retrained models per sub-run (a resumed run "
                                      "keeps the finished sub-runs)", metavar="K")
    flip: float = setting(0.1, "share of the training labels flipped (mislabel detection), "
                          "below 1", positive=True)
    shown: int = setting(6, "test images in explanations.png", minimum=0, metavar="N")
    top: int = setting(5, "training images beside each test image in explanations.png",
                       metavar="K")
    batch_size: int = setting(16, "samples per training step B", metavar="B")
    explain_batch_size: int = setting(50, "images per rcdl.explain call", metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()

    def check(self) -> None:
        for name in self.models:
            if not model_spec(name).growing:
                raise ValueError(f"AttributionConfig: model {name!r} has no growing layers "
                                 "to explain; use gws, gauge, rbf, laplacian or a hybrid")
        flipped = int(self.flip * self.train_size)
        if "mislabel" in self.measurements and not 0 < flipped < self.train_size:
            raise ValueError(f"AttributionConfig: flip {self.flip:g} of {self.train_size} "
                             f"training images flips {flipped}; mislabel detection needs "
                             "some flipped and some clean")
        if self.shown > self.test_size:
            raise ValueError(f"AttributionConfig: shown ({self.shown}) must be at most "
                             f"test_size ({self.test_size})")


load_data = partial(load_subsets, "cifar10")  # the subsets of cfg (rcdl.app.cifar)


# --------------------------------------------------------------------------- scores


def _logits(model: nn.Module, x: Tensor, device: torch.device | str,
            batch_size: int = 500) -> Tensor:  # (n, C) on the CPU
    return predict(model, x, batch_size=batch_size, device=device).cpu()


def margins(model: nn.Module, x: Tensor, y: Tensor, *, device: torch.device | str = "cpu",
            ) -> Tensor:  # (T,) float64  # fmt: skip
    """Each image's correct-class margin ``f_y(x) − log Σ_{c ≠ y} e^{f_c(x)}``."""
    return _label_margin(_logits(model, x, device), y).double()


def _label_margin(scores: Tensor, y: Tensor) -> Tensor:  # (n, C), (n,) -> (n,)
    """``scores_y − log Σ_{c ≠ y} e^{scores_c}`` row by row."""
    correct = scores.gather(1, y[:, None]).squeeze(1)
    return correct - scores.scatter(1, y[:, None], -torch.inf).logsumexp(1)


def _every_entry(model: nn.Module) -> int:
    """A ``k`` for :func:`rcdl.memory.attribution.explain` that keeps every entry and sample."""
    return max(1, sum(len(layer.store) for _, layer in growing_layers(model)))


# --------------------------------------------------------------------------- LDS


def attribution_scores(model: nn.Module, x: Tensor, y: Tensor, n_train: int, *,
                       batch_size: int = 50, device: torch.device | str = "cpu",
                       ) -> dict[str, Tensor]:  # {variant: (T, n_train) float64}  # fmt: skip
    """``τ(x_t, i)`` for every test image ``x (T, 3072)`` and training sample ``i`` towards
    the logit of class ``y (T,)``, one :func:`rcdl.memory.attribution.explain` per batch: summed
    over every growing layer (``"all layers"``), the readout's exact shares alone
    (``"readout"``), and minus the exact change of the logit when a sample's readout
    entries alone are deleted (``"readout deletion"``). Samples without entries score 0."""
    readout_name, readout = growing_layers(model)[-1]
    k = _every_entry(model)
    scores = {v: torch.zeros(len(x), n_train, dtype=torch.float64) for v in VARIANTS}
    owners_all = entry_samples(readout).cpu()  # (N,)
    known_all = owners_all != UNKNOWN
    for begin in range(0, len(x), batch_size):
        xb, yb = x[begin:begin + batch_size], y[begin:begin + batch_size]
        rows = slice(begin, begin + len(xb))
        q = layer_input(model, readout, xb.to(device))  # (b, d)
        u = F.one_hot(yb, readout.d_out).to(q)  # (b, C)
        effect = deletion_effects(readout, q, u).cpu().double()  # (b, N)
        scores["readout deletion"][rows].index_add_(1, owners_all[known_all],
                                                    -effect[:, known_all])
        exp = explain(model, xb.to(device), target=yb.to(device), k=k)
        values, samples = (t.cpu() for t in exp.samples)  # (b, S) each
        scores["all layers"][rows].scatter_(1, samples, values.double())
        values, ids = exp.layers[readout_name]  # (b, N) each, every readout entry
        owners = readout.provenance.of(ids).cpu()  # (b, N)
        known = owners != UNKNOWN
        batch_rows = torch.arange(len(xb))[:, None].expand_as(owners)
        scores["readout"][rows].index_put_((batch_rows[known], owners[known]),
                                           values.cpu()[known].double(), accumulate=True)
    return scores


def half_masks(n: int, count: int, *, seed: int = HALVES_SEED) -> Tensor:  # (count, n) bool
    """The random halves ``S_m`` of ``n`` training samples (``n // 2`` each), drawn one after
    the other from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    masks = torch.zeros(count, n, dtype=torch.bool)
    for m in range(count):
        masks[m, torch.randperm(n, generator=gen)[: n // 2]] = True
    return masks


def half_sums(scores: Mapping[str, Tensor], masks: Tensor) -> Tensor:  # (M, V, T) float64
    """``Σ_{i ∈ S_m} τ(x_t, i)`` for every half ``m`` of ``masks (M, n)``, variant and test
    image (variants in the order of ``scores``)."""
    return torch.stack([torch.stack([s[:, mask].sum(1) for s in scores.values()])
                        for mask in masks])


def _rank(t: Tensor) -> Tensor:  # (n, ...) -> (n, ...) float64
    """Each entry's rank along dimension 0 (0: the lowest; ties in order of appearance)."""
    return t.argsort(0).argsort(0).double()


def spearman(a: Tensor, b: Tensor) -> Tensor:  # (M, T), (M, T) -> (T,)
    """Spearman's rank correlation between the columns of ``a`` and ``b`` (ties ranked in
    order of appearance)."""
    ra, rb = _rank(a), _rank(b)
    ra, rb = ra - ra.mean(0), rb - rb.mean(0)
    return (ra * rb).sum(0) / (ra.norm(dim=0) * rb.norm(dim=0)).clamp_min(1e-12)


def _file(run: RunDir, name: str, written_by: str) -> Path:
    """A tensor file an earlier sub-run wrote; the error says how to write it again."""
    path = run.file(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the sub-run {written_by!r} writes it. Remove {written_by!r} "
            f"from {run.file(RunDir.FINISHED)} and resume, to run it again")
    return path


def _firsts(cfg: AttributionConfig) -> range:
    """The first half of each ``lds-halves`` sub-run."""
    return range(0, cfg.halves, cfg.halves_per_sub_run)


def to_pixels(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Standardised rows ``x (B, 3072)`` (HWC, :func:`rcdl.app.cifar.standardize`) back to
    images ``(B, 32, 32, 3)`` uint8."""
    images = x.reshape(-1, 32, 32, 3) * torch.tensor(std) + torch.tensor(mean)
    return (images * 255).round().clamp(0, 255).to(torch.uint8)


def _shown(model: nn.Module, data: CifarData, cfg: AttributionConfig,
           device: torch.device) -> tuple[list[dict[str, Any]], dict[str, Tensor]]:  # fmt: skip
    """The first ``cfg.shown`` test images explained towards their predicted class: their
    top ``cfg.top`` training samples (JSON) and the images (uint8)."""
    if cfg.shown == 0:
        return [], {}
    x = data.x_test[: cfg.shown]
    exp = explain(model, x.to(device), k=cfg.top)
    values, samples = (t.cpu() for t in exp.samples)  # (S, k) each
    predicted = exp.target.cpu()
    shown = [{"test_index": t, "label": int(data.y_test[t]), "predicted": int(predicted[t]),
              "samples": samples[t].tolist(), "sample_labels": data.y_train[samples[t]].tolist(),
              "contributions": values[t].tolist()} for t in range(cfg.shown)]  # fmt: skip
    top = to_pixels(data.x_train[samples.reshape(-1)], data.mean, data.std)
    return shown, {"test": to_pixels(x, data.mean, data.std),
                   "top": top.reshape(cfg.shown, samples.shape[1], 32, 32, 3)}


def lds_full(name: str, cfg: AttributionConfig, data: CifarData,
             session: Session) -> dict[str, Any]:  # fmt: skip
    """Sub-run ``<name>-lds-full``: the model trained on the whole subset; its score of
    every (test, training) pair summed over each half (``lds-<name>-predicted.pt``, ``(M,
    V, T)``), its test accuracy, and the shown explanations (``lds-<name>-shown.pt``)."""
    device = session.device
    x, y, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    start = time.perf_counter()
    model, _ = train_model(name, FULL_SEED, x, y, (x_test[:EVAL_IMAGES], y_test[:EVAL_IMAGES]),
                           batch_size=cfg.batch_size, device=device)  # fmt: skip
    train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    scores = attribution_scores(model, x_test, y_test, len(x),
                                batch_size=cfg.explain_batch_size, device=device)
    explain_seconds = (time.perf_counter() - start) / len(x_test)
    predicted = half_sums(scores, half_masks(len(x), cfg.halves))  # (M, V, T)
    atomic_save_torch(predicted, session.run.file(f"lds-{name}-predicted.pt"))
    test_acc = 100 * float((_logits(model, x_test, device).argmax(1) == y_test).double().mean())
    shown, pixels = _shown(model, data, cfg, device)
    atomic_save_torch(pixels, session.run.file(f"lds-{name}-shown.pt"))
    return {"model": name, "measurement": "lds-full", "test_acc": test_acc,
            "train_seconds": train_seconds, "explain_seconds_per_image": explain_seconds,
            "shown": shown}  # fmt: skip


def lds_halves(name: str, first: int, cfg: AttributionConfig, data: CifarData,
               session: Session) -> dict[str, Any]:  # fmt: skip
    """Sub-run ``<name>-lds-halves-<first>``: models ``first, first + 1, ...`` (at most
    ``cfg.halves_per_sub_run``) retrained on their halves from seeds ``100 + m``; their
    test margins go to ``lds-<name>-margins-<first>.pt`` ``(K, T)``."""
    x, y, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    masks = half_masks(len(x), cfg.halves)
    last = min(first + cfg.halves_per_sub_run, cfg.halves)
    found, seconds = [], []
    for m in range(first, last):
        start = time.perf_counter()
        model, _ = train_model(name, FIRST_HALF_SEED + m, x[masks[m]], y[masks[m]],
                               (x_test[:EVAL_IMAGES], y_test[:EVAL_IMAGES]),
                               batch_size=cfg.batch_size, device=session.device)
        seconds.append(time.perf_counter() - start)
        found.append(margins(model, x_test, y_test, device=session.device))
        if session.progress:
            print(f"{name}: model {m + 1}/{cfg.halves} retrained in {seconds[-1]:.1f} s",
                  flush=True)
    atomic_save_torch(torch.stack(found), session.run.file(f"lds-{name}-margins-{first}.pt"))
    return {"model": name, "measurement": "lds-halves", "first": first, "last": last,
            "retrain_seconds": seconds}  # fmt: skip


def lds_score(name: str, cfg: AttributionConfig, session: Session) -> dict[str, Any]:
    """Sub-run ``<name>-lds``: per test image, the Spearman correlation over the halves of
    the predicted sums and the retrained margins; the LDS (their mean) and their sd."""
    run = session.run
    predicted = torch.load(_file(run, f"lds-{name}-predicted.pt", f"{name}-lds-full"),
                           weights_only=True)
    margin = torch.cat([torch.load(_file(run, f"lds-{name}-margins-{first}.pt",
                                         f"{name}-lds-halves-{first}"), weights_only=True)
                        for first in _firsts(cfg)])  # (M, T)
    variants = {}
    for v, variant in enumerate(VARIANTS):
        per_image = spearman(predicted[:, v], margin)  # (T,)
        valid = per_image[torch.isfinite(per_image)]
        variants[variant] = {"lds": float(valid.mean()), "test_images": len(valid),
                             "sd": float(valid.std()) if len(valid) > 1 else None}
    return {"model": name, "measurement": "lds", "halves": len(margin), "variants": variants}


# --------------------------------------------------------------------------- mislabels


def auc(scores: Tensor, positive: Tensor) -> float:
    """ROC-AUC of ``scores (n,)`` (higher: more likely positive) for ``positive (n,)``
    bool, by the rank-sum formula (ties ranked in order of appearance)."""
    ranks = _rank(scores.double()) + 1  # 1 = lowest
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"auc: need positives and negatives, got {n_pos} and {n_neg}")
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def found_in_top(scores: Tensor, positive: Tensor, share: float) -> float:
    """The share of the positives among the top ``share`` of ``scores`` (inspected)."""
    top = scores.argsort(descending=True)[: int(share * len(scores))]
    return float(positive[top].sum() / positive.sum())


def detection(scores: Tensor, flipped: Tensor) -> dict[str, Any]:
    """How well ranking by ``scores`` finds the ``flipped`` labels: ROC-AUC, the share found
    in the top 10 % and 20 %, and at every share of :data:`CURVE`."""
    return {"roc_auc": auc(scores, flipped), "found_top10": found_in_top(scores, flipped, 0.1),
            "found_top20": found_in_top(scores, flipped, 0.2),
            "curve": [found_in_top(scores, flipped, s) for s in CURVE]}  # fmt: skip


def leave_one_out_margins(model: nn.Module, x: Tensor, y: Tensor, *,
                          batch_size: int = 500, device: torch.device | str = "cpu",
                          ) -> Tensor:  # (n,) float64  # fmt: skip
    """Each training image's label margin ``f_y − log Σ_{c ≠ y} e^{f_c}`` when the model
    answers it with the image's own entries deleted from every growing layer, exactly
    (:func:`rcdl.memory.leave_one_out.leave_one_out`; ``x`` in the order the model's
    samples are indexed)."""
    out = torch.zeros(len(x), dtype=torch.float64)
    for begin in range(0, len(x), batch_size):
        rows = torch.arange(begin, min(len(x), begin + batch_size))
        logits = leave_one_out(model, x[rows].to(device), rows.to(device)).cpu()  # (b, C)
        out[rows] = _label_margin(logits, y[rows]).double()
    return out


def leave_one_out_vote_margins(model: nn.Module, x: Tensor, y: Tensor, *,
                               sharpness: float = VOTE_SHARPNESS, batch_size: int = 500,
                               device: torch.device | str = "cpu") -> Tensor:  # (n,) float64
    """Each training image's label margin ``score_y − log Σ_{c ≠ y} e^{score_c}`` under the
    readout's label vote (:class:`rcdl.app.experiments.continual.baselines.LabelVote`:
    ``score_c = log Σ_{j : y_j = c} φ(q, k_j; τ / s)`` over the readout's entries, ``y_j``
    the label, ``y``, of the sample that wrote entry ``j``) with the entries the image wrote
    left out: what the labels of the other stored samples near it in the readout's input
    say. ``x`` in the order the model's samples are indexed; a class with no entry left
    scores ``−∞``."""
    vote = LabelVote(model, y, sharpness=sharpness)
    owners = entry_samples(vote.readout).cpu()  # (N,)
    known = owners != UNKNOWN
    owners, labels = owners[known], y[owners[known]]  # (N',)
    out = torch.zeros(len(x), dtype=torch.float64)
    for begin in range(0, len(x), batch_size):
        rows = torch.arange(begin, min(len(x), begin + batch_size))
        with torch.no_grad():
            q = layer_input(model, vote.readout, x[rows].to(device))
            log_phi = vote.log_kernel(q)[:, known.to(q.device)].double().cpu()  # (b, N')
        log_phi = log_phi.masked_fill(owners[None, :] == rows[:, None], -torch.inf)
        out[rows] = _label_margin(class_scores(log_phi, labels, vote.classes), y[rows])
    return out


def self_influence(model: nn.Module, x: Tensor, y: Tensor, *, batch_size: int = 50,
                   device: torch.device | str = "cpu") -> Tensor:  # (n,) float64  # fmt: skip
    """Each training image's own entries' contribution, in every layer, to the logit of its
    label ``y`` (``x`` in the order the model's samples are indexed)."""
    k = _every_entry(model)
    out = torch.zeros(len(x), dtype=torch.float64)
    for begin in range(0, len(x), batch_size):
        rows = torch.arange(begin, min(len(x), begin + batch_size))
        values, owners = (t.cpu() for t in explain(model, x[rows].to(device),
                                                     target=y[rows].to(device), k=k).samples)
        own = owners == rows[:, None]  # (b, S): each row's own training sample
        out[rows] = (values.double() * own).sum(1)
    return out


def flip_labels(y: Tensor, share: float, classes: int, *, seed: int = FLIP_SEED,
                ) -> tuple[Tensor, Tensor, torch.Generator]:  # fmt: skip
    """``y (n,)`` with ``int(share · n)`` labels, drawn from ``seed``, moved to another
    class at random; the mask of those ``(n,)``; and the generator, to draw on from (the
    random ranking)."""
    n = len(y)
    gen = torch.Generator().manual_seed(seed)
    flipped = torch.zeros(n, dtype=torch.bool)
    flipped[torch.randperm(n, generator=gen)[: int(share * n)]] = True
    count = int(flipped.sum())
    noisy = y.clone()
    noisy[flipped] = (y[flipped] + torch.randint(1, classes, (count,), generator=gen)) % classes
    return noisy, flipped, gen


def mislabel_one(name: str, cfg: AttributionConfig, data: CifarData,
                 session: Session) -> dict[str, Any]:  # fmt: skip
    """Sub-run ``<name>-mislabel``: flip ``cfg.flip`` of the labels, train once, rank the
    training images by self-influence, their loss and at random (module docstring)."""
    device, x = session.device, data.x_train
    n = len(x)
    y, flipped, gen = flip_labels(data.y_train, cfg.flip, data.num_classes)
    count = int(flipped.sum())
    start = time.perf_counter()
    model, result = train_model(name, 0, x, y, (data.x_test, data.y_test),
                                batch_size=cfg.batch_size, device=device)
    train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    influence = self_influence(model, x, y, batch_size=cfg.explain_batch_size, device=device)
    explain_seconds = (time.perf_counter() - start) / n
    start = time.perf_counter()
    held_out = -leave_one_out_margins(model, x, y, device=device)
    loo_seconds = (time.perf_counter() - start) / n
    start = time.perf_counter()
    voted = -leave_one_out_vote_margins(model, x, y, device=device)
    vote_seconds = (time.perf_counter() - start) / n
    loss = F.cross_entropy(_logits(model, x, device), y, reduction="none")
    rankings = {"self-influence": influence, "leave-one-out margin": held_out,
                "leave-one-out label vote": voted,
                "leave-one-out, both": _rank(held_out) + _rank(voted),
                "training loss": loss,
                "random": torch.rand(n, generator=gen)}
    return {"model": name, "measurement": "mislabel", "flipped": count,
            "test_acc": 100 * result["acc"], "train_seconds": train_seconds,
            "explain_seconds_per_image": explain_seconds,
            "leave_one_out_seconds_per_image": loo_seconds,
            "vote_seconds_per_image": vote_seconds,
            "rankings": {r: detection(s, flipped) for r, s in rankings.items()}}  # fmt: skip


# --------------------------------------------------------------------------- the run


def _sub_runs(cfg: AttributionConfig, data: CifarData, session: Session) -> Iterator:
    for name in cfg.models:
        if "lds" in cfg.measurements:
            yield f"{name}-lds-full", partial(lds_full, name, cfg, data, session)
            for first in _firsts(cfg):
                yield (f"{name}-lds-halves-{first}",
                       partial(lds_halves, name, first, cfg, data, session))
            yield f"{name}-lds", partial(lds_score, name, cfg, session)
        if "mislabel" in cfg.measurements:
            yield f"{name}-mislabel", partial(mislabel_one, name, cfg, data, session)


def _start(cfg: AttributionConfig, data: CifarData) -> dict[str, Any]:
    return {**cifar_summary(cfg, data), "class_names": list(data.class_names)}


COLUMNS = ("measurement", "model", "scores", "train_images", "lds", "lds_sd", "test_images",
           "halves", "roc_auc", "found_top10", "found_top20", "flipped", "test_acc",
           "retrain_seconds", "explain_seconds_per_image")  # fmt: skip


def rows(runs: Sequence[Mapping[str, Any]], train_images: int) -> list[dict[str, Any]]:
    """One row per (model, LDS variant) and per (model, mislabel ranking), with the columns
    of :data:`COLUMNS` (``None`` where a column does not apply)."""
    out = []
    for run in runs:
        name, kind = run["model"], run["measurement"]
        base = {c: None for c in COLUMNS} | {"measurement": kind, "model": name,
                                             "train_images": train_images}
        if kind == "lds":
            full = next(r for r in runs if r["model"] == name and r["measurement"] == "lds-full")
            retrain = [s for r in runs if r["model"] == name and r["measurement"] == "lds-halves"
                       for s in r["retrain_seconds"]]
            for variant, v in run["variants"].items():
                out.append(base | {"scores": variant, "lds": v["lds"], "lds_sd": v["sd"],
                                   "test_images": v["test_images"], "halves": run["halves"],
                                   "test_acc": full["test_acc"],
                                   "retrain_seconds": statistics.fmean(retrain),
                                   "explain_seconds_per_image":
                                       full["explain_seconds_per_image"]})  # fmt: skip
        elif kind == "mislabel":
            for ranking, d in run["rankings"].items():
                out.append(base | {"scores": ranking, "roc_auc": d["roc_auc"],
                                   "found_top10": d["found_top10"],
                                   "found_top20": d["found_top20"], "flipped": run["flipped"],
                                   "test_acc": run["test_acc"],
                                   "explain_seconds_per_image":
                                       run["explain_seconds_per_image"]})  # fmt: skip
    return out


def _finish(cfg: AttributionConfig, summary: dict[str, Any]) -> None:
    summary["rows"] = rows(summary["runs"], summary["data"]["n_train"])


# --------------------------------------------------------------------------- reporting


def draw_explanations(path: Path, shown: Mapping[str, list[dict[str, Any]]],
                      pixels: Mapping[str, Mapping[str, Tensor]],
                      class_names: Sequence[str]) -> Path:  # fmt: skip
    """``explanations.png``: each shown test image (its class) beside, per model, its top
    training images (their label and contribution to the predicted logit, green where the
    label is the predicted class) and the class the model predicted."""
    from matplotlib.figure import Figure

    models = list(shown)
    count = len(shown[models[0]])
    top = max(len(row["samples"]) for rows_ in shown.values() for row in rows_)
    fig = Figure(figsize=(1.2 + 1.15 * top * len(models) + 0.5 * len(models),
                          0.6 + 1.45 * count), layout="constrained")  # fmt: skip
    parts: Any = fig.subfigures(1, 1 + len(models), width_ratios=[1.2] + [top + 0.4] * len(models),
                           wspace=0.02)  # fmt: skip
    parts[0].suptitle("test image", fontsize=10)
    tests = parts[0].subplots(count, 1, squeeze=False)[:, 0]
    for t, ax in enumerate(tests):
        ax.imshow(pixels[models[0]]["test"][t].numpy(), interpolation="nearest")
        ax.set_title(f"true: {class_names[shown[models[0]][t]['label']]}", fontsize=8)
        ax.set_axis_off()
    for part, name in zip(parts[1:], models, strict=True):
        part.suptitle(f"{name}: the {top} training images contributing most to the "
                      "predicted logit", fontsize=10)  # fmt: skip
        grid = part.subplots(count, top, squeeze=False)
        for t, row in enumerate(shown[name]):
            right = row["predicted"] == row["label"]
            for j, ax in enumerate(grid[t]):
                ax.set_xticks([])
                ax.set_yticks([])
                if j >= len(row["samples"]):
                    ax.set_axis_off()
                    continue
                ax.imshow(pixels[name]["top"][t, j].numpy(), interpolation="nearest")
                label = row["sample_labels"][j]
                ax.set_title(f"{class_names[label]}\n{row['contributions'][j]:+.3g}",
                             fontsize=7, color="tab:green" if label == row["predicted"]
                             else "dimgray")  # fmt: skip
            grid[t, 0].set_ylabel(f"predicts\n{class_names[row['predicted']]}", fontsize=8,
                                  color="tab:green" if right else "tab:red")
    fig.supxlabel("Above each training image: its label (green: the class the model "
                  "predicted) and its summed contribution to the predicted logit "
                  "(rcdl.explain)", fontsize=8)
    return save_figure(fig, path)


def draw_results(path: Path, rows_: Sequence[Mapping[str, Any]],
                 runs: Sequence[Mapping[str, Any]]) -> Path:  # fmt: skip
    """``attribution.png``: the LDS of each model and variant beside the published anchors,
    and the share of flipped labels found against the share inspected, per ranking."""
    from matplotlib.figure import Figure

    lds = [r for r in rows_ if r["measurement"] == "lds"]
    mislabel = [r for r in runs if r["measurement"] == "mislabel"]
    panels = int(bool(lds)) + int(bool(mislabel))
    fig = Figure(figsize=(5.5 * panels, 4.2), layout="constrained")
    axes = iter(fig.subplots(1, panels, squeeze=False)[0])
    if lds:
        ax = next(axes)
        models = list(dict.fromkeys(r["model"] for r in lds))
        fills = ("tab:purple", "tab:olive", "tab:cyan")
        for v, (variant, fill) in enumerate(zip(VARIANTS, fills, strict=True)):
            bars = [next((r for r in lds if r["model"] == m and r["scores"] == variant), None)
                    for m in models]  # fmt: skip
            ax.bar([i + (v - 1) * 0.27 for i in range(len(models))],
                   [b["lds"] if b else 0 for b in bars], 0.26, label=variant, color=fill)
        for (what, value), style in zip(LDS_ANCHORS, (":", "--", "-."), strict=True):
            ax.axhline(value, color="black", lw=0.9, ls=style, label=f"{what}: {value}")
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xticks(range(len(models)), models)
        ax.set(ylabel="LDS (mean Spearman over test images)",
               title="Linear datamodeling score (anchors: dattri, other models and data)")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    if mislabel:
        ax = next(axes)
        styles: dict[str, tuple[Any, float]] = {  # (line style, width) per ranking
            "self-influence": ((0, (1, 1.5)), 1.6), "leave-one-out margin": ("-.", 1.2),
            "leave-one-out label vote": ((0, (6, 2)), 1.2), "leave-one-out, both": ("-", 2.2),
            "training loss": ((0, (2, 3)), 0.8), "random": (":", 0.7)}
        for run in mislabel:
            colour: str | None = None
            for ranking, d in run["rankings"].items():
                style, width = styles.get(ranking, ("-", 1.0))
                (line,) = ax.plot([0, *CURVE], [0, *d["curve"]], ls=style, lw=width,
                                  color=colour, label=f"{run['model']}, {ranking}")
                colour = line.get_color()
        found = KRONFLUENCE_FOUND
        ax.plot(list(found), list(found.values()), "k*", markersize=9,
                label="Kronfluence (full CIFAR-10, ResNet-9)")
        ax.plot([0, 1], [0, 1], color="gray", lw=0.6)
        ax.set(xlabel="share of the training images inspected",
               ylabel="share of the flipped labels found", xlim=(0, 1), ylim=(0, 1.02),
               title="Mislabel detection: images inspected in ranking order")
        ax.title.set_fontsize(9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def _num(value: float | None, spec: str) -> str:
    return "—" if value is None else f"{value:{spec}}"


def targets(rows_: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per model and measurement: its best score or ranking against
    :data:`LDS_TARGETS` and :data:`MISLABEL_TARGET`, met or not."""
    lines = []
    for name in dict.fromkeys(r["model"] for r in rows_):
        lds = [r for r in rows_ if r["model"] == name and r["measurement"] == "lds"]
        if lds and name in LDS_TARGETS:
            best = max(lds, key=lambda r: r["lds"])
            goal = LDS_TARGETS[name]
            lines.append(f"- {name}, LDS: best {best['lds']:.3f} ({VARIANTS[best['scores']]}) "
                         f"against the target {goal:.2f}: "
                         f"{'met' if best['lds'] >= goal else 'not met'}")
        flips = [r for r in rows_ if r["model"] == name and r["measurement"] == "mislabel"
                 and r["scores"] != "random"]
        if flips:
            best = max(flips, key=lambda r: r["roc_auc"])
            auc_goal, top_goal = MISLABEL_TARGET
            met = best["roc_auc"] >= auc_goal and best["found_top10"] >= top_goal
            lines.append(f"- {name}, mislabels: best ROC-AUC {best['roc_auc']:.3f} "
                         f"({best['scores']}), {100 * best['found_top10']:.0f} % of the flipped "
                         f"labels in its top 10 %, against ROC-AUC {auc_goal:.2f} with "
                         f"{100 * top_goal:.0f} %: {'met' if met else 'not met'}")
    return lines


def write_report(run: RunDir, cfg: AttributionConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv``, ``explanations.png`` and ``attribution.png``;
    return the markdown."""
    d, rows_, runs = summary["data"], summary["rows"], summary["runs"]
    copy = d["provenance"].split(" (", 1)[0]  # e.g. "the JPEG-decoded copy of CIFAR-10"
    parts = [
        "# rcdl's native attribution on CIFAR-10",
        f"{d['n_train']:,} training / {d['n_test']:,} test CIFAR-10 images (random subsets, "
        f"data seed {cfg.data_seed}). Data: {d['provenance']}. Every model is trained one "
        f"epoch, batch {cfg.batch_size}; a training image's score for an output is the sum "
        "of its entries' contributions to it (`rcdl.explain`).",
    ]
    lds = [r for r in rows_ if r["measurement"] == "lds"]
    if lds:
        table = markdown_table(
            ("model", "scores", "LDS", "sd over test images", "test images",
             "s per retrained model", "s per explained test image"),
            [(r["model"], VARIANTS[r["scores"]], f"{r['lds']:.3f}", _num(r["lds_sd"], ".3f"),
              r["test_images"], f"{r['retrain_seconds']:.2f}",
              f"{r['explain_seconds_per_image']:.4f}") for r in lds], "llrrrrr")  # fmt: skip
        anchors = ", ".join(f"{what} {value}" for what, value in LDS_ANCHORS)
        parts += [
            "## Linear datamodeling score",
            f"Scores towards each test image's correct-class logit from the model trained "
            f"on every training image; {cfg.halves} models retrained on random halves "
            f"(seeds {FIRST_HALF_SEED}–{FIRST_HALF_SEED + cfg.halves - 1}); per test image, "
            "the Spearman correlation over the halves between the half's summed scores and "
            "the retrained model's correct-class margin; LDS is its mean.",
            table,
            f"Published anchors (dattri benchmark; other models and data, TRAK not run "
            f"here): {anchors}. The numbers above are on {copy}.",
        ]
    flips = [r for r in runs if r["measurement"] == "mislabel"]
    if flips:
        table = markdown_table(
            ("model", "ranking", "ROC-AUC", "flipped found in the top 10 %", "in the top 20 %"),
            [(r["model"], r["scores"], f"{r['roc_auc']:.3f}", f"{r['found_top10']:.3f}",
              f"{r['found_top20']:.3f}") for r in rows_ if r["measurement"] == "mislabel"],
            "llrrr")  # fmt: skip
        models = "; ".join(f"{r['model']}: {r['flipped']:,} labels flipped, test accuracy "
                           f"{r['test_acc']:.1f} % (clean test labels), self-influence "
                           f"{r['explain_seconds_per_image']:.4f} s per training image, "
                           "leave-one-out "
                           f"{r.get('leave_one_out_seconds_per_image', float('nan')):.4f} s, "
                           "label vote "
                           f"{r.get('vote_seconds_per_image', float('nan')):.4f} s"
                           for r in flips)  # fmt: skip
        found = KRONFLUENCE_FOUND
        parts += [
            "## Mislabel detection",
            f"{100 * cfg.flip:g} % of the training labels flipped to another class at random "
            f"(seed {FLIP_SEED}); one model trained on them; the training images ranked by "
            "self-influence (their own entries' contribution to their own label's logit), "
            "by minus their label's margin with their own entries deleted (leave-one-out), "
            "by minus their label's margin in the readout's label vote with their own "
            "entries left out, by the mean of those two ranks, "
            f"by the trained model's loss on them, and at random. {models}.",
            table,
            f"Anchors (other models, more data): Kronfluence finds "
            f"{100 * found[0.1]:.0f} % / {100 * found[0.2]:.0f} % of the flipped labels in the "
            f"top 10 % / 20 % (full CIFAR-10, ResNet-9); dattri's TRAK on a CIFAR-10 "
            f"ResNet-9 has ROC-AUC {TRAK_AUC}. The numbers above are on "
            f"{copy}.",
        ]
    if verdicts := targets(rows_):
        parts += ["## Targets", "\n".join(verdicts)]
    figures: dict[str, Any] = {}
    shown = {r["model"]: r["shown"] for r in runs if r["measurement"] == "lds-full"
             and r["shown"]}  # fmt: skip
    if shown:
        pixels = {name: torch.load(_file(run, f"lds-{name}-shown.pt", f"{name}-lds-full"),
                                   weights_only=True) for name in shown}
        figures["explanations.png"] = partial(draw_explanations, shown=shown, pixels=pixels,
                                              class_names=summary["class_names"])
        parts.append(f"`explanations.png`: the first {cfg.shown} test images, each beside "
                     f"the {cfg.top} training images contributing most to its predicted "
                     "logit under each model.")
    if lds or flips:
        figures["attribution.png"] = partial(draw_results, rows_=rows_, runs=runs)
        parts.append("`attribution.png`: the LDS beside its anchors, and the share of the "
                     "flipped labels found against the share of the images inspected.")
    parts.append(f"Data: {d['source']}, {d['provenance']}.\nMachine: "
                 f"{describe_machine(device)}.\n")
    return write_outputs(run, "\n\n".join(parts), csv_text(rows_, COLUMNS), figures)


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=AttributionConfig,
    help="rcdl's native attribution: the linear datamodeling score, mislabel detection by "
    "self-influence, and test images beside the training images they rest on "
    "(docs/attribution.md)",
    description="Measures rcdl.explain's per-sample attribution on CIFAR-10 for each growing "
    "model: the linear datamodeling score against models retrained on random halves, and "
    "mislabel detection by self-influence against the training loss and random. Writes "
    "results.md, results.csv, explanations.png (test images beside the training images "
    "they rest on) and attribution.png. See docs/attribution.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_data, start=_start,
    finish=_finish,
)  # fmt: skip
