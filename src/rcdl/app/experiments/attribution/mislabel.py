"""Mislabel detection of the attribution experiment: flip some training labels, train once,
rank the training images by self-influence, by leave-one-out margins and votes, by their
loss and at random (the protocol is in :mod:`rcdl.app.experiments.attribution`'s
docstring)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.app.cifar import CifarData
from rcdl.app.experiments.attribution.config import (
    CURVE,
    FLIP_SEED,
    VOTE_SHARPNESS,
    AttributionConfig,
)
from rcdl.app.experiments.attribution.lds import _every_entry, _label_margin, _logits, _rank
from rcdl.app.experiments.continual.baselines import LabelVote, class_scores
from rcdl.app.recipes import train_model
from rcdl.app.runner import Session
from rcdl.memory.attribution import explain
from rcdl.memory.leave_one_out import leave_one_out
from rcdl.memory.provenance import UNKNOWN, entry_samples
from rcdl.nn.networks import layer_input

__all__ = ["auc", "detection", "flip_labels", "found_in_top", "leave_one_out_margins",
           "leave_one_out_vote_margins", "mislabel_one", "self_influence"]


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
