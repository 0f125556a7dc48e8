"""The linear datamodeling score (LDS) of the attribution experiment: the scores of the model
trained on the whole subset, the models retrained on halves, their Spearman correlations;
and, as options, the readout cascade's scores and the seed ceiling (the protocols are in
:mod:`rcdl.app.experiments.attribution`'s docstring)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl._io import atomic_save_torch
from rcdl.app.cifar import CifarData
from rcdl.app.experiments.attribution.config import (
    CASCADE_VARIANTS,
    EVAL_IMAGES,
    FIRST_HALF_SEED,
    FULL_SEED,
    HALVES_SEED,
    SECOND_SEED,
    VARIANTS,
    AttributionConfig,
)
from rcdl.app.recipes import train_model
from rcdl.app.rundir import RunDir
from rcdl.app.runner import Session
from rcdl.memory.attribution import deletion_effects, explain
from rcdl.memory.cascade import readout_cascade
from rcdl.memory.provenance import UNKNOWN, entry_samples
from rcdl.nn.layers import growing_layers
from rcdl.nn.networks import layer_input
from rcdl.train.loop import predict

__all__ = ["attribution_scores", "cascade_scores", "half_masks", "half_sums", "lds_cascade",
           "lds_ceiling", "lds_full", "lds_halves", "lds_score", "margins", "spearman",
           "to_pixels"]  # fmt: skip


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
    seconds, last = _retrain_halves(name, first, cfg, data, session, FIRST_HALF_SEED,
                                    f"lds-{name}-margins-{first}.pt")
    return {"model": name, "measurement": "lds-halves", "first": first, "last": last,
            "retrain_seconds": seconds}  # fmt: skip


def lds_halves_again(name: str, first: int, cfg: AttributionConfig, data: CifarData,
                     session: Session) -> dict[str, Any]:  # fmt: skip
    """Sub-run ``<name>-lds-again-<first>`` (option ``seed_ceiling``): the halves of
    :func:`lds_halves` retrained a second time, from seeds ``1000 + m``; their test margins
    go to ``lds-<name>-again-<first>.pt`` ``(K, T)``."""
    seconds, last = _retrain_halves(name, first, cfg, data, session, SECOND_SEED,
                                    f"lds-{name}-again-{first}.pt")
    return {"model": name, "measurement": "lds-again", "first": first, "last": last,
            "retrain_seconds": seconds}  # fmt: skip


def _retrain_halves(name: str, first: int, cfg: AttributionConfig, data: CifarData,
                    session: Session, first_seed: int, file: str,
                    ) -> tuple[list[float], int]:  # fmt: skip
    """Retrain models ``first, ...`` on their halves from seeds ``first_seed + m``, save
    their test margins ``(K, T)`` as ``file``; their seconds and the last model's index + 1."""
    x, y, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    masks = half_masks(len(x), cfg.halves)
    last = min(first + cfg.halves_per_sub_run, cfg.halves)
    found, seconds = [], []
    for m in range(first, last):
        start = time.perf_counter()
        model, _ = train_model(name, first_seed + m, x[masks[m]], y[masks[m]],
                               (x_test[:EVAL_IMAGES], y_test[:EVAL_IMAGES]),
                               batch_size=cfg.batch_size, device=session.device)
        seconds.append(time.perf_counter() - start)
        found.append(margins(model, x_test, y_test, device=session.device))
        if session.progress:
            again = "" if first_seed == FIRST_HALF_SEED else f" (seed {first_seed + m})"
            print(f"{name}: model {m + 1}/{cfg.halves} retrained{again} in "
                  f"{seconds[-1]:.1f} s", flush=True)
    atomic_save_torch(torch.stack(found), session.run.file(file))
    return seconds, last


def _margins(name: str, cfg: AttributionConfig, run: RunDir, kind: str = "margins",
             sub_run: str = "halves") -> Tensor:  # (M, T)
    """The retrained margins the ``<name>-lds-<sub_run>-<first>`` sub-runs saved."""
    return torch.cat([torch.load(_file(run, f"lds-{name}-{kind}-{first}.pt",
                                       f"{name}-lds-{sub_run}-{first}"), weights_only=True)
                      for first in _firsts(cfg)])


def _lds(predicted: Tensor, margin: Tensor, names: Sequence[str]) -> dict[str, Any]:
    """``{name: {lds, test_images, sd}}`` of the predicted sums ``(M, V, T)`` (variants in
    the order of ``names``) against the retrained margins ``(M, T)``: per test image the
    Spearman correlation over the halves, the LDS their mean over the finite ones."""
    variants = {}
    for v, variant in enumerate(names):
        per_image = spearman(predicted[:, v], margin)  # (T,)
        valid = per_image[torch.isfinite(per_image)]
        variants[variant] = {"lds": float(valid.mean()), "test_images": len(valid),
                             "sd": float(valid.std()) if len(valid) > 1 else None}
    return variants


def lds_score(name: str, cfg: AttributionConfig, session: Session) -> dict[str, Any]:
    """Sub-run ``<name>-lds``: per test image, the Spearman correlation over the halves of
    the predicted sums and the retrained margins; the LDS (their mean) and their sd."""
    run = session.run
    predicted = torch.load(_file(run, f"lds-{name}-predicted.pt", f"{name}-lds-full"),
                           weights_only=True)
    margin = _margins(name, cfg, run)  # (M, T)
    return {"model": name, "measurement": "lds", "halves": len(margin),
            "variants": _lds(predicted, margin, list(VARIANTS))}


# --------------------------------------------------------------------------- options


def cascade_scores(model: nn.Module, x: Tensor, y: Tensor, n_train: int, *,
                   device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """``{"readout, one-level", "readout, cascade"}``: ``(T, n_train)`` float64, each
    training sample's readout entries' :func:`rcdl.readout_cascade` towards the logit of
    class ``y (T,)`` for every test image ``x (T, 3072)``, truncated to one later write and
    whole; samples without entries score 0. All test images in one call (its working
    memory is a few ``(N, C, T)`` float64 tensors).

    Raises:
        ValueError: the model's readout normalises or was not written as the cascade
            models it (:func:`rcdl.readout_cascade`).
    """
    readout = growing_layers(model)[-1][1]
    q = layer_input(model, readout, x.to(device))  # (T, d)
    found = readout_cascade(readout, q, F.one_hot(y.to(device), readout.d_out))
    owners = entry_samples(readout).cpu()  # (N,)
    known = owners != UNKNOWN
    out = {}
    for variant, key in zip(CASCADE_VARIANTS, ("one_level", "cascade"), strict=True):
        scores = torch.zeros(len(x), n_train, dtype=torch.float64)
        out[variant] = scores.index_add_(1, owners[known], found[key].cpu()[:, known])
    return out


def lds_cascade(name: str, cfg: AttributionConfig, data: CifarData,
                session: Session) -> dict[str, Any]:  # fmt: skip
    """Sub-run ``<name>-lds-cascade`` (option ``cascade``): the model of ``<name>-lds-full``
    trained again (the same seed and data: the same model), its :func:`cascade_scores`
    summed over each half and correlated with the retrained margins as :func:`lds_score`
    does. A readout the cascade does not model (a softmax) gives ``refused``, its reason."""
    device = session.device
    x, y, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    base = {"model": name, "measurement": "lds-cascade"}
    model, _ = train_model(name, FULL_SEED, x, y, (x_test[:EVAL_IMAGES], y_test[:EVAL_IMAGES]),
                           batch_size=cfg.batch_size, device=device)  # fmt: skip
    start = time.perf_counter()
    try:
        scores = cascade_scores(model, x_test, y_test, len(x), device=device)
    except ValueError as err:
        return base | {"refused": str(err)}
    seconds = (time.perf_counter() - start) / len(x_test)
    margin = _margins(name, cfg, session.run)  # (M, T)
    predicted = half_sums(scores, half_masks(len(x), cfg.halves))  # (M, 2, T)
    return base | {"halves": len(margin), "cascade_seconds_per_image": seconds,
                   "variants": _lds(predicted, margin, list(CASCADE_VARIANTS))}


def lds_ceiling(name: str, cfg: AttributionConfig, session: Session) -> dict[str, Any]:
    """Sub-run ``<name>-lds-ceiling`` (option ``seed_ceiling``): the LDS of the second
    retraining's margins (``<name>-lds-again-*``) against the first's, as if they were a
    score: how far the half alone determines a retrained margin."""
    margin = _margins(name, cfg, session.run)  # (M, T)
    again = _margins(name, cfg, session.run, "again", "again")  # (M, T)
    return {"model": name, "measurement": "lds-ceiling", "halves": len(margin),
            "variants": _lds(again[:, None], margin, ["seed ceiling"])}
