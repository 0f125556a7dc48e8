"""TRAK (the dattri library) on the ResNet-MLP: the same-data peer of rcdl's attribution.

rcdl reads its attribution off the growing layers' entries (``rcdl reproduce attribution``,
:mod:`rcdl.app.experiments.attribution_exp`). This script measures the usual peer on the
same protocol: TRAK (Park et al. 2023), as implemented by dattri, on the ResNet-MLP baseline
(``mlp-adam``: pre-norm residual blocks Linear + tanh-GELU, depth 8, Adam 1e-4), trained one
epoch, batch 16, on the same CIFAR-10 subsets (data seed 0), with the same random halves
(seed 1), the same retraining seeds (100, 101, ...) and the same flipped labels (seed 2).

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
the mean over test images. **Mislabel detection**: flip 10 % of the labels, train the
ensemble on the noisy labels, rank the training images by TRAK self-influence; ROC-AUC and
the share of flipped images found in the top 10 % / 20 % (baselines: the seed-0 model's
loss, a random ranking; the same draws as rcdl's measurement).

Width. At the paper's width (3 072) the MLP has 75.5 M parameters, and TRAK materialises a
per-sample gradient of that size for every training image of every ensemble model. On two CPU
cores that does not fit; ``--width W`` builds the blocks at width ``W`` behind the backbone's
fixed random lift 3072 → W (``ResNetMLP(..., width=W)``; the lift is the same for every
model and is not trained). The default, 192 (298 k parameters), is chosen to fit the whole
measurement at 5 000 / 500 images in 20–30 minutes on the 2-core machine of
results/attribution/lds/trak-mlp.md: featurising a training image (its per-sample gradient
and projection) took about 9 ms at width 192 and 21 ms at 256, and the run featurises
~115 000 images (11 model-passes over the training and test images for the LDS, 11 over the
training images for mislabels): about 20 minutes at 192 (31 there, under other jobs' load),
45 at 256.

Threads: ``--threads 1`` by default. On that machine, shared with other jobs, one thread
trained the MLP for an epoch of 5 000 images in 1 s against 49 s with two (two threads
wait on each other for tiny batch-16 products), and featurised twice as fast.

dattri's gradient path differentiates through one flattened parameter vector sliced into the
model's tensors; on the CPU each slice's backward fills and adds a whole ``(B, p)`` gradient,
so the cost grows with the number of parameter tensors (18 here). :class:`FlatMLP` hands dattri
the same MLP with its parameters as one vector (one slice): the same gradients, ~5× faster.

Run: ``python benchmarks/trak_peer.py --data-dir DIR [--width 192] [--ensemble 10]
[--train-size 5000] [--test-size 500] [--halves 50]`` (``--quick``: 500 / 50 images, 8
halves, an ensemble of 4, projection to 128 dimensions; about two minutes). Needs dattri
(``pip install 'rcdl[peers]'``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from datetime import date
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from rcdl.app.baseline_optim import make_optimizer
from rcdl.app.experiments.attribution_exp import (
    EVAL_IMAGES,
    FIRST_HALF_SEED,
    FULL_SEED,
    auc,
    flip_labels,
    found_in_top,
    half_masks,
    load_data,
    margins,
    spearman,
)
from rcdl.app.rundir import cpu_flags, cpu_model
from rcdl.nn.networks import ResNetMLP
from rcdl.train.loop import accuracy, train_one_pass

D_IN, CLASSES, DEPTH = 3072, 10, 8


def _dattri() -> tuple[Any, Any]:
    """dattri's ``(AttributionTask, TRAKAttributor)``, or exit naming the extra to install."""
    try:
        import dattri.algorithm.trak as trak_module
        from dattri.task import AttributionTask
    except ImportError as err:
        raise SystemExit(f"benchmarks/trak_peer.py runs TRAK from the dattri library, which "
                         f"did not import ({err}); install it with: pip install "
                         "'rcdl[peers]'") from err
    trak_module.tqdm = partial(tqdm, disable=True)  # its per-batch progress bars, in a log
    return AttributionTask, trak_module.TRAKAttributor


@dataclass(frozen=True)
class PeerConfig:
    """The measurement's settings (module docstring); ``--quick`` gives :data:`QUICK`."""

    data_dir: str | None = None
    width: int = 192  # the blocks' width behind the fixed lift 3072 → width
    ensemble: int = 10  # models of TRAK-M (seeds 0 .. M−1)
    train_size: int = 5000
    test_size: int = 500
    halves: int = 50  # MLPs retrained on random halves (the LDS's ground truth)
    flip: float = 0.1  # share of training labels flipped (mislabel detection)
    proj_dim: int = 512  # TRAK's projection dimension k (dattri's default)
    grad_batch: int = 500  # images per per-sample-gradient batch (memory: B × p floats)
    threads: int = 1  # torch threads (module docstring: one was faster on 2 shared cores)
    measurements: tuple[str, ...] = ("lds", "mislabel")

    def __post_init__(self) -> None:
        if not 0 < self.proj_dim < self.train_size:
            raise ValueError(f"PeerConfig: proj_dim ({self.proj_dim}) must be positive and "
                             f"below train_size ({self.train_size}), or TRAK's kernel "
                             "Φᵀ Φ (proj_dim × proj_dim) is singular")
        if self.ensemble < 1 or self.halves < 2:
            raise ValueError(f"PeerConfig: need ensemble >= 1 and halves >= 2, got "
                             f"{self.ensemble} and {self.halves}")


QUICK = {"train_size": 500, "test_size": 50, "halves": 8, "ensemble": 4, "proj_dim": 128}


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
        return torch.func.functional_call(self.mlp, params, (x,))


# --------------------------------------------------------------------------- TRAK


def _loader(x: Tensor, y: Tensor, batch: int) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def trak_attributor(models: list[ResNetMLP], cfg: PeerConfig) -> Any:
    """dattri's ``TRAKAttributor`` over the ensemble ``models`` (one checkpoint each), with
    the correct-class margin as both the training and the test function."""
    attribution_task, trak = _dattri()
    lifts = [m.lift for m in models]
    if any(not torch.equal(lifts[0], lift) for lift in lifts[1:]):
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


# --------------------------------------------------------------------------- measurements


def _ensemble(cfg: PeerConfig, x: Tensor, y: Tensor, x_eval: Tensor, y_eval: Tensor,
              what: str) -> tuple[list[ResNetMLP], list[float], list[float]]:  # fmt: skip
    models, accs, seconds = [], [], []
    for m in range(cfg.ensemble):
        model, acc, s = train_mlp(FULL_SEED + m, x, y, x_eval, y_eval, cfg.width)
        models.append(model)
        accs.append(acc)
        seconds.append(s)
        print(f"{what}: ensemble model {m + 1}/{cfg.ensemble} (seed {FULL_SEED + m}) trained "
              f"in {s:.1f} s, test accuracy {acc:.2f} %", flush=True)
    return models, accs, seconds


def measure_lds(cfg: PeerConfig, data: SimpleNamespace) -> list[dict[str, Any]]:
    """TRAK-1 and TRAK-M's LDS against MLPs retrained on the halves (module docstring)."""
    x, y, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    n, t = len(x), len(x_test)
    models, accs, train_s = _ensemble(cfg, x, y, x_test, y_test, "lds")
    scores, costs = {}, {}
    for size in sorted({1, cfg.ensemble}):
        name = f"TRAK-{size}"
        scores[name], cache_s, attribute_s = trak_scores(models[:size], x, y, x_test, y_test,
                                                         cfg)
        costs[name] = {"train_s": sum(train_s[:size]), "cache_s": cache_s,
                       "attribute_s": attribute_s}
        print(f"lds: {name}: training images featurised in {cache_s:.1f} s, {t} test images "
              f"attributed in {attribute_s:.1f} s", flush=True)
    masks = half_masks(n, cfg.halves)  # (M, n), the halves of rcdl's measurement
    actual, retrain_s = [], []
    for m in range(cfg.halves):
        model, _, s = train_mlp(FIRST_HALF_SEED + m, x[masks[m]], y[masks[m]],
                                x_test[:EVAL_IMAGES], y_test[:EVAL_IMAGES], cfg.width)
        retrain_s.append(s)
        actual.append(margins(model, x_test, y_test))
        print(f"lds: half {m + 1}/{cfg.halves} retrained in {s:.1f} s", flush=True)
    margin = torch.stack(actual)  # (M, T)
    rows = []
    for name, tau in scores.items():
        predicted = torch.stack([tau[:, mask].sum(1) for mask in masks])  # (M, T)
        per_image = spearman(predicted, margin)  # (T,)
        valid = per_image[torch.isfinite(per_image)]
        cost = costs[name]
        total = cost["train_s"] + cost["cache_s"] + cost["attribute_s"]
        rows.append({"scores": name, "lds": float(valid.mean()), "sd": float(valid.std()),
                     "test_images": len(valid), "test_acc": statistics.fmean(accs),
                     "retrain_s": statistics.fmean(retrain_s),
                     "per_image_s": cost["attribute_s"] / t, "total_s": total,
                     "total_per_image_s": total / t, **cost})  # fmt: skip
    return rows


def measure_mislabel(cfg: PeerConfig, data: SimpleNamespace) -> list[dict[str, Any]]:
    """Mislabel detection by TRAK-1 and TRAK-M self-influence, against the seed-0 model's
    loss and random, on the labels rcdl's measurement flips (module docstring)."""
    x, n = data.x_train, len(data.x_train)
    # the labels attribution_exp.mislabel_one flips
    y, flipped, gen = flip_labels(data.y_train, cfg.flip, CLASSES)
    count = int(flipped.sum())
    models, accs, train_s = _ensemble(cfg, x, y, data.x_test, data.y_test, "mislabel")
    rankings: dict[str, tuple[Tensor, float]] = {}
    for size in sorted({1, cfg.ensemble}):
        influence, seconds = trak_self_influence(models[:size], x, y, cfg)
        rankings[f"TRAK-{size} self-influence"] = (influence, sum(train_s[:size]) + seconds)
        print(f"mislabel: TRAK-{size} self-influence of {n} images in {seconds:.1f} s",
              flush=True)
    with torch.no_grad():
        loss = F.cross_entropy(models[0](x), y, reduction="none")
    rankings["training loss (seed-0 MLP)"] = (loss, train_s[0])
    rankings["random"] = (torch.rand(n, generator=gen), 0.0)
    return [{"ranking": name, "roc_auc": auc(s, flipped),
             "top10": found_in_top(s, flipped, 0.1), "top20": found_in_top(s, flipped, 0.2),
             "total_s": seconds, "flipped": count, "test_acc": accs[0]}
            for name, (s, seconds) in rankings.items()]  # fmt: skip


# --------------------------------------------------------------------------- the run


def _revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, cwd=os.path.dirname(__file__))
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = PeerConfig()
    parser.add_argument("--data-dir", default=None)
    for field in ("width", "ensemble", "train_size", "test_size", "halves", "proj_dim",
                  "grad_batch", "threads"):
        parser.add_argument("--" + field.replace("_", "-"), type=int,
                            default=getattr(defaults, field))
    parser.add_argument("--flip", type=float, default=defaults.flip)
    parser.add_argument("--measurements", nargs="+", choices=("lds", "mislabel"),
                        default=list(defaults.measurements))
    parser.add_argument("--quick", action="store_true",
                        help="500 / 50 images, 8 halves, an ensemble of 4, projection dim 128")
    args = vars(parser.parse_args())
    quick = args.pop("quick")
    args["measurements"] = tuple(args["measurements"])
    if quick:
        args.update(QUICK)
    cfg = PeerConfig(**args)
    torch.set_num_threads(cfg.threads)
    _dattri()  # fail before the data load and any training if it is missing
    data = load_data(SimpleNamespace(data_dir=cfg.data_dir, train_size=cfg.train_size,
                                     test_size=cfg.test_size, data_seed=0))
    params = sum(p.numel() for p in ResNetMLP(D_IN, CLASSES, DEPTH, width=cfg.width)
                 .parameters())  # fmt: skip
    print(f"# {date.today()}, revision {_revision()}; {cpu_model()} "
          f"({' '.join(cpu_flags())}), {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; "
          f"{platform.python_version()}", flush=True)
    print(f"# ResNet-MLP, Adam, one epoch batch 16, blocks' width {cfg.width} behind the fixed "
          f"lift 3072 -> {cfg.width} ({params:,} trained parameters); {len(data.x_train)} "
          f"train / {len(data.x_test)} test images of the JPEG-decoded CIFAR-10 copy (lossy); "
          f"config {asdict(cfg)}", flush=True)
    start = time.perf_counter()
    if "lds" in cfg.measurements:
        rows = measure_lds(cfg, data)
        print("\n| scores | LDS | sd over test images | test images | ensemble's test acc. | "
              "s per retrained MLP | s per explained test image (attribute) | total s "
              "(ensemble training + featurising + attribute) | total s per test image |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['scores']} | {r['lds']:.3f} | {r['sd']:.3f} | {r['test_images']} | "
                  f"{r['test_acc']:.2f} % | {r['retrain_s']:.1f} | {r['per_image_s']:.3f} | "
                  f"{r['total_s']:.0f} ({r['train_s']:.0f} + {r['cache_s']:.0f} + "
                  f"{r['attribute_s']:.0f}) | {r['total_per_image_s']:.2f} |", flush=True)
        print()
    if "mislabel" in cfg.measurements:
        rows = measure_mislabel(cfg, data)
        print(f"\n# mislabel: {rows[0]['flipped']} of {len(data.x_train)} labels flipped; "
              f"seed-0 MLP's test accuracy {rows[0]['test_acc']:.2f} % (clean test labels)")
        print("| ranking | ROC-AUC | flipped found in top 10 % | in top 20 % | total s "
              "(training included) |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['ranking']} | {r['roc_auc']:.3f} | {r['top10']:.3f} | "
                  f"{r['top20']:.3f} | {r['total_s']:.0f} |", flush=True)
        print()
    print(f"# whole run {time.perf_counter() - start:.0f} s; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
