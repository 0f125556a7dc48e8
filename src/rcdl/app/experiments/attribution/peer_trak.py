"""TRAK (the dattri library) on the ResNet-MLP: the same-data peer of rcdl's attribution, the
option ``trak`` of ``rcdl reproduce attribution`` (docs/attribution.md).

It measures the usual peer on rcdl's protocol: TRAK (Park et al. 2023), as implemented by
dattri, on the ResNet-MLP baseline (``mlp-adam``: pre-norm residual blocks Linear +
tanh-GELU, depth 8, Adam 1e-4), trained one epoch, batch 16, on the same CIFAR-10 subsets,
with the same random halves (seed 1), the same retraining seeds (100, 101, ...) and the
same flipped labels (seed 2). Everything runs on the CPU, as dattri's projector does here.

TRAK with an ensemble of ``M`` models ``θ_m`` (seeds 0 .. M−1, each trained on the whole
training subset): with ``f(z; θ) = f_y(z) − log Σ_{c≠y} e^{f_c(z)}`` the correct-class
margin, ``φ_m(z) = P_mᵀ ∇_θ f(z; θ_m) / √p`` its gradient projected to ``k`` dimensions by a
random Gaussian ``P_m (p, k)``, ``Φ_m (n, k)`` the training images' features and
``Q_m = diag(1 − p_y(z_i; θ_m))``,

    τ(x, ·) = [ (1/M) Σ_m φ_m(x) (Φ_mᵀ Φ_m)⁻¹ Φ_mᵀ ] · (1/M) Σ_m Q_m         (1, n)

(dattri's ``TRAKAttributor``: the ensemble averages the kernel products and ``Q``
separately). TRAK-1 is the seed-0 model alone; TRAK-M all ``M``. Self-influence (mislabel
detection) is ``τ(z_i, i)``, the diagonal, with ``z_i``'s own (noisy) label.

**LDS**: for each test image, the Spearman correlation over the halves ``S_m`` between
``Σ_{i∈S_m} τ(x, i)`` and the margin of an MLP retrained (one epoch, batch 16) on ``S_m``;
the mean over test images. **Mislabel detection**: flip the labels rcdl's measurement
flips, train the ensemble on the noisy labels, rank the training images by TRAK
self-influence; baselines: the seed-0 model's loss, the random ranking of rcdl's
measurement (the same draws).

Width. At the paper's width (3 072) the MLP has 75.5 M parameters, and TRAK materialises a
per-sample gradient of that size for every training image of every ensemble model, which
does not fit a small CPU machine; the blocks run at width ``W`` = 192 (298 k parameters)
behind the backbone's fixed random lift 3072 → W (``ResNetMLP(..., width=W)``; the lift is
the same for every model and is not trained). Why 192, and why one thread
(``--threads 1``: batch-16 products are too small for two threads to share), with the times
that decided both: results/attribution/lds/trak-mlp.md.

dattri's gradient path differentiates through one flattened parameter vector sliced into the
model's tensors; on the CPU each slice's backward fills and adds a whole ``(B, p)`` gradient,
so the cost grows with the number of parameter tensors (18 here). :class:`FlatMLP` hands dattri
the same MLP with its parameters as one vector (one slice): the same gradients, one slice's
cost (the speed-up: results/attribution/lds/trak-mlp.md).

This module imports without dattri; :func:`require_dattri` says how to install it.

Sub-runs (option ``trak``, the peer named ``mlp-adam-w192``), after rcdl's models:

- ``<peer>-lds-full``: the ensemble trained on the whole subset, TRAK-1 and TRAK-M scores
  summed over each half (``lds-<peer>-predicted.pt``);
- ``<peer>-lds-halves-<first>``: MLPs retrained on their halves (``lds-<peer>-margins-*.pt``);
- ``<peer>-lds``: the LDS of TRAK-1 and TRAK-M;
- ``<peer>-mislabel``: TRAK-1 and TRAK-M self-influence, the loss and random.
"""

from __future__ import annotations

import importlib
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from rcdl._io import atomic_save_torch
from rcdl.app.baseline_optim import make_optimizer
from rcdl.app.cifar import CifarData
from rcdl.app.experiments.attribution.config import (
    EVAL_IMAGES,
    FIRST_HALF_SEED,
    FULL_SEED,
    AttributionConfig,
)
from rcdl.app.experiments.attribution.lds import (
    _file,
    _firsts,
    _lds,
    _margins,
    half_masks,
    half_sums,
    margins,
)
from rcdl.app.experiments.attribution.mislabel import detection, flip_labels
from rcdl.app.runner import Session
from rcdl.nn.networks import ResNetMLP
from rcdl.train.loop import accuracy, train_one_pass

__all__ = ["FlatMLP", "PeerConfig", "peer_config", "require_dattri", "trak_attributor",
           "trak_lds", "trak_lds_full", "trak_lds_halves", "trak_mislabel", "trak_scores",
           "trak_self_influence", "train_mlp"]  # fmt: skip

D_IN, CLASSES, DEPTH = 3072, 10, 8


def require_dattri() -> tuple[Any, Any]:
    """dattri's ``(AttributionTask, TRAKAttributor)``.

    Raises:
        ValueError: dattri does not import; the message names the extra that installs it.
    """
    try:  # by name: the type checker runs without the extra
        trak_module = importlib.import_module("dattri.algorithm.trak")
        attribution_task = importlib.import_module("dattri.task").AttributionTask
    except ImportError as err:
        raise ValueError(f"the TRAK peer (rcdl reproduce attribution --trak) runs TRAK from "
                         f"the dattri library, which did not import ({err}); install the "
                         "peers extra: pip install 'rcdl[peers]'") from err
    # its per-batch progress bars, in a log: the module's own name for tqdm, replaced
    setattr(trak_module, "tqdm", partial(tqdm, disable=True))  # noqa: B010
    return attribution_task, trak_module.TRAKAttributor


@dataclass(frozen=True)
class PeerConfig:
    """The peer's settings (module docstring); :func:`peer_config` gives a run's."""

    width: int = 192  # the blocks' width behind the fixed lift 3072 → width
    ensemble: int = 10  # models of TRAK-M (seeds 0 .. M−1)
    train_size: int = 5000
    test_size: int = 500
    halves: int = 50  # MLPs retrained on random halves (the LDS's ground truth)
    flip: float = 0.1  # share of training labels flipped (mislabel detection)
    proj_dim: int = 512  # TRAK's projection dimension k (dattri's default)
    grad_batch: int = 500  # images per per-sample-gradient batch (memory: B × p floats)

    def __post_init__(self) -> None:
        if not 0 < self.proj_dim < self.train_size:
            raise ValueError(f"PeerConfig: proj_dim ({self.proj_dim}) must be positive and "
                             f"below train_size ({self.train_size}), or TRAK's kernel "
                             "Φᵀ Φ (proj_dim × proj_dim) is singular")
        if self.ensemble < 1 or self.halves < 2:
            raise ValueError(f"PeerConfig: need ensemble >= 1 and halves >= 2, got "
                             f"{self.ensemble} and {self.halves}")

    @property
    def model(self) -> str:
        """The peer's name in the rows and sub-runs: the MLP and its blocks' width."""
        return f"mlp-adam-w{self.width}"


def peer_config(cfg: AttributionConfig) -> PeerConfig:
    """The peer's settings for a run of the attribution experiment: its sizes, halves and
    flips, TRAK's projection to 512 dimensions (to half the training images where they are
    fewer than 1 024, so that ``Φᵀ Φ`` stays invertible) and the other defaults."""
    return PeerConfig(train_size=cfg.train_size, test_size=cfg.test_size, halves=cfg.halves,
                      flip=cfg.flip, proj_dim=min(PeerConfig.proj_dim, cfg.train_size // 2))


# --------------------------------------------------------------------------- the MLP


def train_mlp(seed: int, x: Tensor, y: Tensor, x_eval: Tensor, y_eval: Tensor, width: int,
              ) -> tuple[ResNetMLP, float, float]:  # fmt: skip
    """The ResNet-MLP (``mlp-adam`` at blocks' width ``width``) built from ``seed`` and trained
    one pass, batch 16, over ``x (n, 3072)``, ``y (n,)`` in ``seed``'s order, as
    ``rcdl.app.models.build_model("mlp-adam", seed)`` and the attribution
    experiment's trainer do. Returns the model, its accuracy on ``(x_eval, y_eval)`` and the
    training seconds."""
    torch.manual_seed(seed)
    model = ResNetMLP(D_IN, CLASSES, depth=DEPTH, width=width)
    optimizer = make_optimizer("adam", model)
    start = time.perf_counter()
    result = train_one_pass(model, (x, y, x_eval, y_eval), batch_size=16, seed=seed,
                            optimizer=optimizer, loss_fn=F.cross_entropy,
                            metrics={"acc": accuracy}, eval_every=10**9, progress=False)
    return model.eval(), 100 * float(result["acc"]), time.perf_counter() - start


class FlatMLP(nn.Module):
    """``mlp`` with its trainable parameters as one vector ``flat (p,)``: the same function,
    handed to dattri so that its flattened-parameter gradients take one slice (module
    docstring). ``mlp``'s buffers (the fixed lift) are its own, not this module's."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "mlp", mlp)  # not a submodule: its parameters live in flat
        named = list(mlp.named_parameters())
        self.names = [name for name, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for _, p in named]))

    def forward(self, x: Tensor) -> Tensor:  # (B, 3072) -> (B, C)
        parts = self.flat.split([shape.numel() for shape in self.shapes])
        params = {n: v.view(s) for n, v, s in zip(self.names, parts, self.shapes, strict=True)}
        mlp: nn.Module = self.mlp  # type: ignore[assignment]  # set in __init__, not a submodule
        return torch.func.functional_call(mlp, params, (x,))


# --------------------------------------------------------------------------- TRAK


def _loader(x: Tensor, y: Tensor, batch: int) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def trak_attributor(models: list[ResNetMLP], cfg: PeerConfig) -> Any:
    """dattri's ``TRAKAttributor`` over the ensemble ``models`` (one checkpoint each), with
    the correct-class margin as both the training and the test function."""
    attribution_task, trak = require_dattri()
    lifts = [m.lift for m in models]
    if any(a is not b and (a is None or b is None or not torch.equal(a, b))
           for a, b in zip(lifts, lifts[1:], strict=False)):
        raise ValueError("trak_attributor: the models' fixed lifts differ; FlatMLP keeps the "
                         "first model's")
    template = FlatMLP(models[0])
    one_hot = torch.arange(CLASSES)

    def margin(params: dict[str, Tensor], data: tuple[Tensor, Tensor]) -> Tensor:  # ()
        x, y = data  # (3072,), ()
        logits = torch.func.functional_call(template, params, (x[None],))[0]  # (C,)
        correct = one_hot == y  # no indexing by y: vmap cannot
        return (logits * correct).sum() - logits.masked_fill(correct, -torch.inf).logsumexp(0)

    def probability(params: dict[str, Tensor], data: tuple[Tensor, Tensor]) -> Tensor:  # ()
        x, y = data
        logits = torch.func.functional_call(template, params, (x[None],))[0]
        return (logits.softmax(0) * (one_hot == y)).sum()

    task = attribution_task(loss_func=margin, model=template, target_func=margin,
                            checkpoints=[FlatMLP(m).state_dict() for m in models])
    projector = {"proj_dim": cfg.proj_dim, "proj_max_batch_size": 32, "proj_seed": 0,
                 "device": "cpu"}
    return trak(task, probability, projector_kwargs=projector, device="cpu")


def trak_scores(models: list[ResNetMLP], x: Tensor, y: Tensor, x_test: Tensor,
                y_test: Tensor, cfg: PeerConfig) -> tuple[Tensor, float, float]:  # fmt: skip
    """``τ(x_t, i)`` for every test image and training image, ``(T, n)`` float64, towards
    the test image's correct-class margin; and the seconds spent featurising the training
    images (``cache``) and attributing the test images."""
    attributor = trak_attributor(models, cfg)
    start = time.perf_counter()
    attributor.cache(_loader(x, y, cfg.grad_batch))
    cache_s = time.perf_counter() - start
    start = time.perf_counter()
    scores = attributor.attribute(_loader(x_test, y_test, cfg.grad_batch))  # (n, T)
    if scores.shape != (len(x), len(x_test)):
        raise ValueError(f"trak_scores: dattri returned scores of shape {tuple(scores.shape)}"
                         f", expected (train, test) = ({len(x)}, {len(x_test)})")
    _check_finite(scores, "trak_scores")
    return scores.T.double(), cache_s, time.perf_counter() - start


def trak_self_influence(models: list[ResNetMLP], x: Tensor, y: Tensor, cfg: PeerConfig,
                        ) -> tuple[Tensor, float]:  # fmt: skip
    """``τ(z_i, i)`` for every training image (its own label), ``(n,)`` float64, and the
    seconds it took. dattri 0.3.0's ``self_attribute`` works from a loader (not after
    ``cache``) and returns them as a column ``(n, 1)``."""
    attributor = trak_attributor(models, cfg)
    start = time.perf_counter()
    influence = attributor.self_attribute(_loader(x, y, cfg.grad_batch)).reshape(-1)  # (n,)
    if influence.shape != (len(x),):
        raise ValueError(f"trak_self_influence: dattri returned {influence.numel()} scores "
                         f"for {len(x)} training images")
    _check_finite(influence, "trak_self_influence")
    return influence.double(), time.perf_counter() - start


def _check_finite(scores: Tensor, where: str) -> None:
    bad = int((~torch.isfinite(scores)).sum())
    if bad:
        raise ValueError(f"{where}: dattri's TRAK gave {bad} non-finite scores of "
                         f"{scores.numel()}; a smaller --proj-dim may help")


# --------------------------------------------------------------------------- sub-runs


def _ensemble(peer: PeerConfig, x: Tensor, y: Tensor, x_eval: Tensor, y_eval: Tensor,
              what: str, session: Session,
              ) -> tuple[list[ResNetMLP], list[float], list[float]]:  # fmt: skip
    models, accs, seconds = [], [], []
    for m in range(peer.ensemble):
        model, acc, s = train_mlp(FULL_SEED + m, x, y, x_eval, y_eval, peer.width)
        models.append(model)
        accs.append(acc)
        seconds.append(s)
        if session.progress:
            print(f"{peer.model} {what}: ensemble model {m + 1}/{peer.ensemble} (seed "
                  f"{FULL_SEED + m}) trained in {s:.1f} s, test accuracy {acc:.2f} %",
                  flush=True)
    return models, accs, seconds


def _names(peer: PeerConfig) -> list[str]:
    """TRAK-1 and TRAK-M (one name if M is 1)."""
    return [f"TRAK-{size}" for size in sorted({1, peer.ensemble})]


def trak_lds_full(cfg: AttributionConfig, data: CifarData, session: Session) -> dict[str, Any]:
    """Sub-run ``<peer>-lds-full``: the ensemble trained on the whole subset; TRAK-1 and
    TRAK-M's scores summed over each half (``lds-<peer>-predicted.pt``, ``(M, 2, T)``);
    their costs."""
    require_dattri()
    peer = peer_config(cfg)
    x, y, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    models, accs, train_s = _ensemble(peer, x, y, x_test, y_test, "lds", session)
    scores, explained, totals = {}, {}, {}
    for name in _names(peer):
        size = int(name[5:])
        scores[name], cache_s, attribute_s = trak_scores(models[:size], x, y, x_test, y_test,
                                                         peer)
        explained[name] = attribute_s / len(x_test)
        totals[name] = sum(train_s[:size]) + cache_s + attribute_s
    predicted = half_sums(scores, half_masks(len(x), cfg.halves))  # (M, V, T)
    atomic_save_torch(predicted, session.run.file(f"lds-{peer.model}-predicted.pt"))
    return {"model": peer.model, "measurement": "lds-full", "test_acc": statistics.fmean(accs),
            "train_seconds": sum(train_s), "explain_seconds_per_image": explained,
            "total_seconds": totals, "shown": [],
            "peer": f"TRAK from dattri (projection to {peer.proj_dim} dimensions) on the "
            f"ResNet-MLP, Adam, blocks of width {peer.width} behind the fixed lift; scored "
            "against MLPs retrained on the same halves; TRAK-1 the seed-0 model, "
            f"TRAK-{peer.ensemble} the ensemble of seeds 0–{peer.ensemble - 1}; s per "
            "explained test image: attributing once the training images are featurised"}


def trak_lds_halves(first: int, cfg: AttributionConfig, data: CifarData,
                    session: Session) -> dict[str, Any]:  # fmt: skip
    """Sub-run ``<peer>-lds-halves-<first>``: MLPs ``first, ...`` retrained on their halves
    from seeds ``100 + m``; their test margins go to ``lds-<peer>-margins-<first>.pt``."""
    peer = peer_config(cfg)
    x, y, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    masks = half_masks(len(x), cfg.halves)
    last = min(first + cfg.halves_per_sub_run, cfg.halves)
    found, seconds = [], []
    for m in range(first, last):
        model, _, s = train_mlp(FIRST_HALF_SEED + m, x[masks[m]], y[masks[m]],
                                x_test[:EVAL_IMAGES], y_test[:EVAL_IMAGES], peer.width)
        seconds.append(s)
        found.append(margins(model, x_test, y_test))
    atomic_save_torch(torch.stack(found),
                      session.run.file(f"lds-{peer.model}-margins-{first}.pt"))
    return {"model": peer.model, "measurement": "lds-halves", "first": first, "last": last,
            "retrain_seconds": seconds}  # fmt: skip


def trak_lds(cfg: AttributionConfig, session: Session) -> dict[str, Any]:
    """Sub-run ``<peer>-lds``: the LDS of TRAK-1 and TRAK-M against the retrained MLPs."""
    peer = peer_config(cfg)
    predicted = torch.load(_file(session.run, f"lds-{peer.model}-predicted.pt",
                                 f"{peer.model}-lds-full"), weights_only=True)
    margin = _margins(peer.model, cfg, session.run)  # (M, T)
    return {"model": peer.model, "measurement": "lds", "halves": len(margin),
            "variants": _lds(predicted, margin, _names(peer))}


def trak_mislabel(cfg: AttributionConfig, data: CifarData, session: Session) -> dict[str, Any]:
    """Sub-run ``<peer>-mislabel``: mislabel detection by TRAK-1 and TRAK-M self-influence,
    against the seed-0 MLP's loss and random, on the labels rcdl's measurement flips."""
    require_dattri()
    peer = peer_config(cfg)
    x, n = data.x_train, len(data.x_train)
    y, flipped, gen = flip_labels(data.y_train, cfg.flip, CLASSES)
    models, accs, train_s = _ensemble(peer, x, y, data.x_test, data.y_test, "mislabel",
                                      session)
    rankings: dict[str, Tensor] = {}
    seconds = 0.0
    for name in _names(peer):
        size = int(name[5:])
        rankings[f"{name} self-influence"], seconds = trak_self_influence(models[:size], x, y,
                                                                          peer)
    with torch.no_grad():
        rankings["training loss"] = F.cross_entropy(models[0](x), y, reduction="none")
    rankings["random"] = torch.rand(n, generator=gen)
    return {"model": peer.model, "measurement": "mislabel", "flipped": int(flipped.sum()),
            "test_acc": accs[0], "train_seconds": sum(train_s),
            "explain_seconds_per_image": seconds / n, "peer": True,
            "rankings": {r: detection(s, flipped) for r, s in rankings.items()}}  # fmt: skip


def sub_runs(cfg: AttributionConfig, data: CifarData, session: Session) -> Any:
    """The peer's sub-runs, ``(name, train)`` in order (module docstring)."""
    require_dattri()  # before any sub-run: say what to install at once
    peer = peer_config(cfg).model
    if "lds" in cfg.measurements:
        yield f"{peer}-lds-full", partial(trak_lds_full, cfg, data, session)
        for first in _firsts(cfg):
            yield (f"{peer}-lds-halves-{first}",
                   partial(trak_lds_halves, first, cfg, data, session))
        yield f"{peer}-lds", partial(trak_lds, cfg, session)
    if "mislabel" in cfg.measurements:
        yield f"{peer}-mislabel", partial(trak_mislabel, cfg, data, session)
