"""The forgetting quality of the NeurIPS 2023 machine-unlearning challenge, at a scale two
cores afford (docs/fast_forgetting.md, "Forgetting quality").

Run it with ``rcdl reproduce forgetting-quality`` (see docs/unlearning.md). The challenge
judges an unlearning method by how well an attacker tells, for each forgotten example on its
own, the outputs of many unlearned models from those of many models retrained without the
forget set; this experiment measures that for ``forget``, the fast mode, exact forgetting
and, for a
parametric model, fine-tuning on the retained images.

For each model (one sub-run), with one fixed forget set (a random ``forget_fraction`` of the
training subset, drawn from ``forget_seed``):

- ``N = models_per_side`` originals, seeds ``0 … N−1``, each trained one pass (batch 16) on
  the whole training subset, then unlearned by each method: *forget*
  (:func:`rcdl.memory.forgetting.forget`), *repair* and *repair+keys*
  (:func:`rcdl.memory.repair.forget_and_repair`, with the readout's stored or recomputed
  keys; not for the hybrid) and *exact*
  (:func:`rcdl.train.unlearning.forget_exactly`) for growing models, *fine-tune* (a fresh
  optimizer, one pass over a random ``finetune_fraction`` of the retained images) for
  parametric ones; *original* (no unlearning) is scored too, as the floor;
- ``N`` retrained models, seeds ``N … 2N−1`` (independent of the unlearned ones), each
  trained on its own seed's stream without the forget set.

The output of a model on an example is its cross-entropy loss there. For each forgotten
example and method, the attacks are every threshold on that loss, in both directions (a
logistic regression on one number is one of them); each gives a false-positive rate FPR
(retrained models called unlearned) and a false-negative rate FNR, and

    ε = max over attacks of max(log(1 − δ − FPR) − log FNR, log(1 − δ − FNR) − log FPR),

δ = 0.01, floored at 0; an attack with FPR = FNR = 0 separates the two perfectly (ε = ∞),
one with only one of them 0 is left out (it bounds nothing at this N), as in the challenge.
Each example scores ``2 / 2^n`` with ``n`` the number of the bin edges 0, 0.5, …, 6 at or
below its ε (1 where ε < 0.5); the forgetting quality ``F`` is their mean, and the
challenge's score is ``F · (RA_U / RA_R) · (TA_U / TA_R)`` with RA, TA the mean retained-set
and test accuracies of the unlearned (U) and retrained (R) models.

Since ``N`` unlearned models are compared with ``N`` others, even two sets of retrained
models do not score ``F = 1``: *exact* (which is retraining, on other seeds) shows the ceiling
at this ``N``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.app.cifar import CifarData, cifar_summary, load_subsets
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.models import model_spec
from rcdl.app.recipes import (
    check_unlearning_settings,
    copy_trained,
    fine_tune,
    repaired_copies,
    train_with_learners,
)
from rcdl.app.report import csv_text, markdown_table, write_outputs
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.app.runner import Experiment, Session
from rcdl.memory.forgetting import forget
from rcdl.train.loop import epoch_permutation, predict
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly

__all__ = ["EXPERIMENT", "EXPERIMENT_SPEC", "BIN_EDGES", "DELTA", "ForgettingQualityConfig",
           "example_epsilons", "forgetting_quality", "score_examples"]

EXPERIMENT = "forgetting-quality"
DELTA = 0.01
BIN_EDGES = torch.arange(13) * 0.5  # 0, 0.5, ..., 6


@dataclass(frozen=True)
class ForgettingQualityConfig(ExperimentConfig):
    """Settings of the forgetting-quality experiment (module docstring)."""

    QUICK = {"train_size": 160, "test_size": 80, "models_per_side": 4}

    models: tuple[str, ...] = setting(
        ("gws", "rbf"), "models: growing ones unlearn by forget and exactly, parametric "
        "ones by fine-tuning", metavar="NAME")
    models_per_side: int = setting(64, "N: unlearned models per method and retrained "
                                   "models, each from its own seed", metavar="N")
    forget_fraction: float = setting(0.1, "share of the training images forgotten",
                                     positive=True)
    forget_seed: int = setting(0, "seed of the forget set", minimum=0)
    finetune_fraction: float = setting(0.2, "share of the retained images a parametric "
                                       "model is fine-tuned on (one pass)", positive=True)
    train_size: int | None = setting(1000, "random subset of N training images", metavar="N")
    test_size: int | None = setting(1000, "random subset of N test images", metavar="N")
    batch_size: int = setting(16, "samples per step B", metavar="B")
    eval_batch_size: int = setting(500, "images per prediction batch", metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()

    def check(self) -> None:
        check_unlearning_settings("ForgettingQualityConfig", self.models, self.forget_fraction,
                                  self.finetune_fraction)
        if self.models_per_side < 2:
            raise ValueError("ForgettingQualityConfig: models_per_side must be at least 2")


load_data = partial(load_subsets, "cifar10")


# --------------------------------------------------------------------------- the metric


def example_epsilons(unlearned: Tensor, retrained: Tensor, delta: float = DELTA
                     ) -> Tensor:  # (S,) float64
    """Each example's ε (module docstring) from the outputs ``unlearned (N, S)`` and
    ``retrained (M, S)`` of the two populations of models, over every threshold attack in
    both directions."""
    u, r = unlearned.double(), retrained.double()
    if u.dim() != 2 or r.dim() != 2 or u.shape[1] != r.shape[1]:
        raise ValueError(f"example_epsilons: expected (N, S) and (M, S) outputs, got "
                         f"{tuple(u.shape)} and {tuple(r.shape)}")
    thresholds = torch.cat([u, r]).sort(0).values  # (N+M, S): every split point
    # "unlearned" when the output is above the threshold (and the reverse: 1 - rates)
    fnr = (u[:, None, :] <= thresholds[None]).double().mean(0)  # (T, S)
    fpr = (r[:, None, :] > thresholds[None]).double().mean(0)  # (T, S)
    fpr = torch.cat([fpr, 1 - fpr])
    fnr = torch.cat([fnr, 1 - fnr])
    e1 = torch.log(1 - delta - fpr) - torch.log(fnr)
    e2 = torch.log(1 - delta - fnr) - torch.log(fpr)
    eps = torch.maximum(torch.nan_to_num(e1, nan=-math.inf), torch.nan_to_num(e2, nan=-math.inf))
    eps = torch.where((fpr == 0) & (fnr == 0), math.inf, eps)  # a perfect split
    eps = torch.where((fpr == 0) ^ (fnr == 0), -math.inf, eps)  # bounds nothing: left out
    return eps.max(0).values.clamp_min(0.0)


def score_examples(eps: Tensor) -> Tensor:  # (S,)
    """``2 / 2^n`` with ``n`` the bin edges (0, 0.5, …, 6) at or below each ε."""
    n = (eps[:, None] >= BIN_EDGES.to(eps)[None]).sum(1)  # (S,) 1..13 for ε >= 0
    return 2.0 / 2.0 ** n.double()


def forgetting_quality(unlearned: Tensor, retrained: Tensor, delta: float = DELTA
                       ) -> tuple[float, Tensor]:
    """``F``, the mean example score, and the examples' ε."""
    eps = example_epsilons(unlearned, retrained, delta)
    return float(score_examples(eps).mean()), eps


# --------------------------------------------------------------------------- the models


@dataclass
class _Scored:
    losses: Tensor  # (S,) on the forget set
    retain_acc: float
    test_acc: float
    seconds: float


def _score(model: nn.Module, data: CifarData, forget_idx: Tensor, retain_idx: Tensor,
           cfg: ForgettingQualityConfig, device: torch.device, seconds: float) -> _Scored:
    def run(x: Tensor) -> Tensor:
        return predict(model, x, batch_size=cfg.eval_batch_size, device=device).float().cpu()

    x, y = data.x_train, data.y_train
    losses = F.cross_entropy(run(x[forget_idx]), y[forget_idx], reduction="none")
    retain = (run(x[retain_idx]).argmax(1) == y[retain_idx]).float().mean().item()
    test = (run(data.x_test).argmax(1) == data.y_test).float().mean().item()
    return _Scored(losses, 100 * retain, 100 * test, seconds)


def measure_model(name: str, data: CifarData, cfg: ForgettingQualityConfig,
                  session: Session) -> dict[str, Any]:  # fmt: skip
    """One sub-run: ``N`` originals unlearned by each method, ``N`` retrained models, and
    the forgetting quality of each method (module docstring)."""
    device, growing = session.device, model_spec(name).growing
    x, y = data.x_train, data.y_train
    n = len(y)
    gen = torch.Generator().manual_seed(10_000 + cfg.forget_seed)
    forget_idx = torch.randperm(n, generator=gen)[: max(1, round(cfg.forget_fraction * n))]
    forget_idx = forget_idx.sort().values
    keep = torch.ones(n, dtype=torch.bool)
    keep[forget_idx] = False
    retain_idx = keep.nonzero().squeeze(1)
    scored: dict[str, list[_Scored]] = {}
    for k in range(cfg.models_per_side):
        replay = ReplayLog(every=1) if growing else None
        trained = train_with_learners(name, k, x, y, (x[:1], y[:1]), batch_size=cfg.batch_size,
                                      device=device, **({"replay": replay} if replay else {}))
        model, optimizer, grower, result = trained
        scored.setdefault("original", []).append(
            _score(model, data, forget_idx, retain_idx, cfg, device, 0.0))
        if replay is not None:
            copy_ = copy.deepcopy(model)
            receipt = forget(copy_, forget_idx, scan=False)
            scored.setdefault("forget", []).append(
                _score(copy_, data, forget_idx, retain_idx, cfg, device, receipt.seconds))
            for method, copy_, receipt in repaired_copies(model, forget_idx, x, y, scan=False):
                scored.setdefault(method, []).append(
                    _score(copy_, data, forget_idx, retain_idx, cfg, device, receipt.seconds))
            copy_, c_opt, c_grower = copy_trained(name, k, trained, reserve=n, device=device)
            start = time.perf_counter()
            forget_exactly(copy_, forget_idx, replay=copy.deepcopy(replay), data=(x, y),
                           loss_fn=F.cross_entropy, optimizer=c_opt, grower=c_grower,
                           device=device, scan=False)
            scored.setdefault("exact", []).append(
                _score(copy_, data, forget_idx, retain_idx, cfg, device,
                       time.perf_counter() - start))
        else:
            g = torch.Generator().manual_seed(20_000 + k)
            part = retain_idx[torch.randperm(len(retain_idx), generator=g)
                              [: max(1, math.ceil(cfg.finetune_fraction * len(retain_idx)))]]
            copy_, res = fine_tune(name, k, model, x[part], y[part],
                                   batch_size=cfg.batch_size, device=device)
            scored.setdefault("fine-tune", []).append(
                _score(copy_, data, forget_idx, retain_idx, cfg, device, res["train_seconds"]))
        del model, optimizer, grower, copy_
        seed = cfg.models_per_side + k  # retrained models: seeds of their own
        stream = epoch_permutation(n, seed, 0)
        retrained, *_, res = train_with_learners(name, seed, x, y, (x[:1], y[:1]),
                                                 batch_size=cfg.batch_size, device=device,
                                                 order=stream[keep[stream]])
        scored.setdefault("retrain", []).append(
            _score(retrained, data, forget_idx, retain_idx, cfg, device, res["train_seconds"]))
        del retrained
    return _summarise(name, scored, len(forget_idx))


def _summarise(name: str, scored: dict[str, list[_Scored]], forget_size: int
               ) -> dict[str, Any]:
    retrained = scored["retrain"]
    r_losses = torch.stack([s.losses for s in retrained])  # (N, S)
    ra_r = sum(s.retain_acc for s in retrained) / len(retrained)
    ta_r = sum(s.test_acc for s in retrained) / len(retrained)
    retrain_s = sum(s.seconds for s in retrained) / len(retrained)
    methods = {}
    for method, runs in scored.items():
        if method == "retrain":
            continue
        quality, eps = forgetting_quality(torch.stack([s.losses for s in runs]), r_losses)
        ra_u = sum(s.retain_acc for s in runs) / len(runs)
        ta_u = sum(s.test_acc for s in runs) / len(runs)
        bins = (eps[:, None] >= BIN_EDGES.double()[None]).sum(1)
        methods[method] = {
            "F": quality, "score": quality * (ra_u / ra_r) * (ta_u / ta_r),
            "retain_acc": ra_u, "test_acc": ta_u,
            "seconds": sum(s.seconds for s in runs) / len(runs),
            "eps_median": float(eps.median()), "eps_bins": torch.bincount(
                bins, minlength=len(BIN_EDGES) + 1).tolist()}
    return {"model": name, "models_per_side": len(retrained), "forget_size": forget_size,
            "retrain": {"retain_acc": ra_r, "test_acc": ta_r, "seconds": retrain_s},
            "methods": methods}


def _sub_runs(cfg: ForgettingQualityConfig, data: CifarData, session: Session) -> Iterator:
    for name in cfg.models:
        yield name, partial(measure_model, name, data, cfg, session)


def _start(cfg: ForgettingQualityConfig, data: CifarData) -> dict[str, Any]:
    return cifar_summary(cfg, data)


# --------------------------------------------------------------------------- reporting


def write_report(run: RunDir, cfg: ForgettingQualityConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md`` and ``results.csv``; return the markdown."""
    rows, body = [], []
    for r in summary["runs"]:
        ret = r["retrain"]
        for method, m in r["methods"].items():
            rows.append({"model": r["model"], "method": method, **{
                k: m[k] for k in ("F", "score", "retain_acc", "test_acc", "seconds",
                                  "eps_median")}})
            body.append((r["model"], method, f"{m['F']:.3f}", f"{m['score']:.3f}",
                         f"{m['eps_median']:.2f}", f"{m['retain_acc']:.1f}",
                         f"{m['test_acc']:.1f}", f"{m['seconds']:.3g}"))
        body.append((r["model"], "retrain (reference)", "", "", "", f"{ret['retain_acc']:.1f}",
                     f"{ret['test_acc']:.1f}", f"{ret['seconds']:.3g}"))
    d = summary["data"]
    first = summary["runs"][0] if summary["runs"] else {}
    markdown = "\n\n".join([
        "# Forgetting quality (the NeurIPS 2023 unlearning challenge's metric)",
        f"{d['n_train']:,} training / {d['n_test']:,} test CIFAR-10 images (random subsets, "
        f"data seed {cfg.data_seed}; JPEG-decoded); one pass, batch {cfg.batch_size}; a fixed "
        f"forget set of {first.get('forget_size', '?')} images (a random "
        f"{cfg.forget_fraction:.0%}); N = {cfg.models_per_side} unlearned models per method "
        f"(seeds 0–{cfg.models_per_side - 1}) against N retrained ones (seeds "
        f"{cfg.models_per_side}–{2 * cfg.models_per_side - 1}). F: the mean example score "
        "2/2^n over the forget set (1: no attack tells the two populations apart); score: "
        "F × retained-accuracy ratio × test-accuracy ratio (unlearned / retrained); ε: "
        "the examples' median privacy degree; seconds: the unlearning step's mean (the "
        "retraining's for the reference).",
        markdown_table(("model", "method", "F", "score", "median ε", "retain acc %",
                        "test acc %", "seconds"), body, "llrrrrrr"),
        f"Data: {d['source']}, {d['provenance']}.",
        f"Machine: {describe_machine(device)}.\n"])
    return write_outputs(run, markdown, csv_text(rows))


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=ForgettingQualityConfig,
    help="the unlearning challenge's forgetting quality of forget, exact forgetting and "
    "fine-tuning, from N unlearned and N retrained models (docs/unlearning.md)",
    description="Trains N models per method from their own seeds on a CIFAR-10 subset and "
    "unlearns a fixed random 10 % of it (growing models by rcdl.forget and by exact "
    "forgetting, parametric ones by fine-tuning), trains N more without it, and scores each "
    "method by the NeurIPS 2023 machine-unlearning challenge's forgetting quality: how well "
    "threshold attacks on each forgotten example's loss tell unlearned from retrained "
    "models. See docs/unlearning.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_data, start=_start,
)  # fmt: skip
