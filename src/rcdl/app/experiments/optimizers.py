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
                 decay) and Adam 1e−3 on the biases, as :func:`rcdl.optim.make_optimizer`
``mlp-foof``     residual MLP, :class:`rcdl.dual_optim.FOOF` (momentum 0.85, ema 0.95,
                 refresh every 10 steps) — the Mesa dual form (docs/reference.md §7)
``gws``          growing weighted softmax, 2 blocks, clipped rule β = 3, η = 0.003;
                 learns by growth only and writes one entry per sample per layer in every
                 epoch (``16 + e · N`` entries per layer after ``e`` epochs of ``N`` images)
``rbf``          growing RBF, 2 blocks, functional SGD η = 10; grows likewise (``e · N``)
===============  ==========================================================================

Decisions (measured numbers in docs/optimizer_experiments.md):

- **One input for all.** Every method sees the same images ``P x``: ``x`` the standardised
  flattened image (3072 values), ``P (w, 3072)`` a fixed random Gaussian matrix scaled by
  ``1/√3072`` (the lift of :class:`rcdl.networks.ResidualNet`), drawn from ``data_seed`` and
  applied once to the whole subset. ``width=None`` uses the images as they are (the
  paper's ``w = 3072``). The projection keeps Muon's Newton–Schulz iteration (``O(w³)`` per
  matrix and step) and FOOF's ``(w + 1)²`` Cholesky affordable on a CPU, and gives the
  growing and parametric models the same information.
- **The MLP** is docs/reference.md §6's ResNet-MLP (:class:`rcdl.networks.ResNetMLP`: pre-norm
  residual blocks of Linear ``w → w`` + tanh-GELU, LeCun init, linear readout) with ``mlp_depth``
  blocks at width ``w``. docs/reference.md does not give the paper's MLP sizes for this figure.
- **Growing temperatures** scale with the width: ``T = T_paper · √(w / 3072)`` (gws 6, RBF 10
  at 3072). RMS-normalised queries have ``‖q‖² = w``, so the logits ``⟨q, k⟩ / (T√w)`` and
  RBF exponents ``‖q − k‖² / (2T√w)`` as functions of the cosine between query and key are
  then the paper's; the random projection nearly preserves cosines. (Unscaled, the RBF net
  diverged at ``w = 256`` in a probe.)
- **Learning rates** were chosen by a small sweep at the default width (docs);
  docs/reference.md §6's tuned values are for the 3072-wide, 8-block ResNet-MLP and one epoch, and
  FOOF has none. :meth:`OptimizerComparisonConfig.paper` uses docs/reference.md §6's values where
  they exist.
- **Muon's precision.** ``torch.optim.Muon`` runs Newton–Schulz in bfloat16, which a CPU
  computes about 25× slower than float32 (measured: 0.45 s against 0.018 s for one 256 × 256
  matrix). ``muon_ns_dtype="auto"`` uses :class:`Float32Muon` (the same update, float32
  iteration) on a CPU and ``torch.optim.Muon`` itself on CUDA.
- **Training loss** is the mean of the batch losses over the epoch, each computed before
  that batch's update (for a growing model: before its entries are written). Test accuracy
  and loss are measured on the whole test subset before training and after every epoch.
- **Missing data.** Each data set of ``datasets`` is loaded before any training. One that is
  not found is skipped with a message saying where it was looked for (recorded in
  ``summary.json`` and ``results.md``) unless ``skip_missing=False``; if none is found, the
  run stops with :class:`rcdl.app.cifar.CifarNotFoundError`.

Run folder::

    config.json           the resolved OptimizerComparisonConfig
    environment.json      machine, torch, git revision
    metrics.jsonl         every evaluation of every (dataset, method, seed), tagged with them
    finished.json         each finished (dataset, method, seed)'s result, as it finishes
    summary.json          per-run histories, per-(dataset, method, epoch) rows, verdicts,
                          the data used and the data sets skipped
    results.md/.csv       final and per-epoch numbers per data set (mean ± sd over seeds)
    optimizers_<dataset>.png   training loss and test accuracy against epochs, one line
                          per method

Resume: :func:`run_optimizer_comparison` with ``resume=RUN_DIR`` skips the (dataset,
method, seed) runs that ``finished.json`` holds and trains the others from scratch; the
tables are then those of an uninterrupted run. ``metrics.jsonl`` may repeat the evaluations
of the run that was interrupted.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import Tensor, nn

from rcdl.app.cifar import CifarData, CifarNotFoundError, load_cifar
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
from rcdl.dual_optim import FOOF
from rcdl.grower import Grower
from rcdl.networks import GrowingRBFNet, GrowingSoftmaxNet, ResNetMLP
from rcdl.optim import OptimizerGroup, make_optimizer
from rcdl.rules import ClippedSoftmaxRule, FunctionalSGD
from rcdl.training import accuracy, train_one_pass

__all__ = [
    "DATASETS", "EXPERIMENT", "METHODS", "Float32Muon", "OptimizerComparisonConfig",
    "build_method", "load_datasets", "project", "random_projection",
    "run_optimizer_comparison",
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
PAPER_WIDTH = 3072  # the flattened image: the paper's residual stream
INITIAL_ENTRIES = 16  # the gws model's initial entries per layer (docs/reference.md §6)
_PAPER_TEMPERATURE = {"gws": 6.0, "rbf": 10.0}  # docs/reference.md §6, at width 3072
_CLASSIC = ("mlp-sgd", "mlp-adam", "mlp-rmsprop")  # the optimizers the growing models beat
_METRICS = {"test_acc": accuracy, "test_loss": F.cross_entropy}
_DEVICES = ("auto", "cpu", "cuda")
_NS_DTYPES = ("auto", "float32", "bfloat16")


# --------------------------------------------------------------------------- Muon in float32


class Float32Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton–Schulz iteration computed in float32.

    The update is torch's (momentum ``μ``, learning rate ``γ``, weight decay ``λ``)::

        B ← μ B + (1 − μ) G                  (the momentum buffer, a lerp)
        U = (1 − μ) G + μ B  (Nesterov)  or  B
        O = NS₅(U / ‖U‖_F)                   (quintic Newton–Schulz, coefficients a, b, c)
        W ← (1 − γλ) W − γ · √max(1, rows/cols) · O

    with ``X ← a X + (b A + c A²) X``, ``A = X Xᵀ`` iterated ``ns_steps`` times on the wide
    orientation of ``U``. torch casts ``U`` to bfloat16 for the iteration; a CPU multiplies
    bfloat16 matrices far more slowly than float32 ones, so this class keeps float32 (or the
    parameter's dtype, if wider). Constructor arguments and state are torch's; only
    ``adjust_lr_fn`` ``None``/``"original"`` and ``"match_rms_adamw"`` are accepted.

    References: Jordan 2024 (Muon); docs/reference.md §6, §7.
    """

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        """One Muon step of every matrix with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            a, b, c = group["ns_coefficients"]
            momentum, lr = group["momentum"], float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.ndim != 2:
                    raise ValueError(f"Float32Muon: expected 2-D parameters, got shape "
                                     f"{tuple(p.grad.shape)}")  # fmt: skip
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                x = update.to(torch.promote_types(update.dtype, torch.float32))
                tall = x.shape[0] > x.shape[1]
                if tall:
                    x = x.T
                x = x / x.norm().clamp(min=group["eps"])  # (rows, cols), rows <= cols
                for _ in range(group["ns_steps"]):
                    gram = x @ x.T  # (rows, rows)
                    x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
                if tall:
                    x = x.T
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(x.to(p.dtype), alpha=-lr * _muon_lr_ratio(group["adjust_lr_fn"], p.shape))
        return loss


def _muon_lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Float32Muon: unknown adjust_lr_fn {adjust_lr_fn!r}; known: None, "
                     "'original', 'match_rms_adamw'")  # fmt: skip


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class OptimizerComparisonConfig:
    """Settings of the multi-epoch optimizer comparison (docs/reference.md §8).

    The defaults (5 000 train / 2 000 test images, width 256, a 4-block MLP, 10 epochs,
    3 130 steps, one seed) were chosen from measured step costs on this project's two shared
    CPU cores (one thread): an estimated 17–25 minutes per data set, so under an hour for
    both, dominated by the two growing models (each step attends over every entry written
    so far: 3.7–4.9 µs per entry and step at width 256, 50 000 entries per layer at the
    end) and by Muon (its Newton–Schulz iteration, about 18 ms per 256 × 256 matrix and
    step). Learning rates from a validation sweep at this size (docs). See
    docs/optimizer_experiments.md for the measurements and :meth:`paper` for the paper's
    sizes.

    Attributes:
        datasets: ``"cifar10"`` and/or ``"cifar100"`` (fine labels, 100 classes).
        methods: keys of :data:`METHODS`, in the order of the tables.
        train_size, test_size: random subsets of each data set (``None``: the whole split);
            they depend on ``data_seed`` only, so every method and seed sees the same images.
        epochs: passes over the training subset, each in a fresh order.
        width: ``w``, the width of the fixed random input projection shared by all methods
            (``None``: no projection, ``w = 3072``).
        mlp_depth: residual blocks of the MLP (each one Linear ``w → w``).
        growing_depth: blocks of the growing models (docs/reference.md §6: 2).
        sgd_lr, adam_lr, rmsprop_lr, muon_lr, foof_lr: learning rates of the MLP's
            optimizers (``muon_lr``: Muon's matrices; the biases get Adam 1e−3).
        foof_damping: FOOF's λ added to the diagonal of the input second moment.
        muon_ns_dtype: ``"auto"`` (:class:`Float32Muon` on a CPU, ``torch.optim.Muon`` on
            CUDA), ``"float32"`` (:class:`Float32Muon`) or ``"bfloat16"``
            (``torch.optim.Muon``).
        gws_temperature, rbf_temperature: the growing models' T (``None``: the paper's
            6 and 10 scaled by ``√(w / 3072)``).
        seeds: the comparison runs once per seed (initialisation and orders of the images).
        skip_missing: skip a data set that is not found (saying so) instead of stopping.
        batch_size: samples per step (docs/reference.md §6: 16).
        eval_batch_size: images per prediction batch when measuring.
        data_dir: folder holding the data (see :func:`rcdl.app.cifar.load_cifar`; ``None``
            searches ``$RCDL_DATA``, then the cache).
        data_seed: seed of the subsets and of the input projection.
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
    """

    datasets: tuple[str, ...] = ("cifar10", "cifar100")
    methods: tuple[str, ...] = tuple(METHODS)
    train_size: int | None = 5000
    test_size: int | None = 2000
    epochs: int = 10
    width: int | None = 256
    mlp_depth: int = 4
    growing_depth: int = 2
    sgd_lr: float = 3e-3
    adam_lr: float = 3e-4
    rmsprop_lr: float = 3e-4
    muon_lr: float = 1e-3
    foof_lr: float = 3e-2
    foof_damping: float = 1.0
    muon_ns_dtype: str = "auto"
    gws_temperature: float | None = None
    rbf_temperature: float | None = None
    seeds: tuple[int, ...] = (0,)
    skip_missing: bool = True
    batch_size: int = 16
    eval_batch_size: int = 500
    data_dir: str | None = None
    data_seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        # lists (from JSON or argparse) become tuples, paths strings, so configs compare equal
        for name in ("datasets", "methods", "seeds"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.data_dir is not None:
            object.__setattr__(self, "data_dir", str(self.data_dir))
        _check_choices("datasets", self.datasets, DATASETS)
        _check_choices("methods", self.methods, METHODS)
        for name in ("train_size", "test_size", "width"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        for name in ("epochs", "mlp_depth", "growing_depth", "batch_size", "eval_batch_size"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("sgd_lr", "adam_lr", "rmsprop_lr", "muon_lr", "foof_lr", "foof_damping"):
            _check_positive(name, getattr(self, name))
        for name in ("gws_temperature", "rbf_temperature"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.muon_ns_dtype not in _NS_DTYPES:
            raise ValueError(f"OptimizerComparisonConfig: muon_ns_dtype must be one of "
                             f"{list(_NS_DTYPES)}, got {self.muon_ns_dtype!r}")  # fmt: skip
        _check_seeds(self.seeds, self.data_seed)
        if not isinstance(self.skip_missing, bool):
            raise ValueError(f"OptimizerComparisonConfig: skip_missing must be a bool, got "
                             f"{self.skip_missing!r}")  # fmt: skip
        if self.device not in _DEVICES:
            raise ValueError(f"OptimizerComparisonConfig: device must be one of "
                             f"{list(_DEVICES)}, got {self.device!r}")  # fmt: skip

    @property
    def input_width(self) -> int:
        """``w``: the width every method's input has (3072 without a projection)."""
        return self.width or PAPER_WIDTH

    def temperature(self, method: str) -> float:
        """T of the growing model ``method`` (``"gws"`` or ``"rbf"``)."""
        given = {"gws": self.gws_temperature, "rbf": self.rbf_temperature}[method]
        if given is not None:
            return given
        return _PAPER_TEMPERATURE[method] * math.sqrt(self.input_width / PAPER_WIDTH)

    def lr(self, method: str) -> float:
        """The learning rate of MLP method ``mlp-<optimizer>``."""
        return getattr(self, f"{method.removeprefix('mlp-')}_lr")

    @classmethod
    def quick(cls, **overrides: Any) -> OptimizerComparisonConfig:
        """A smoke-test scale: 300 train / 300 test images, width 64, 2 MLP blocks,
        3 epochs (under a minute per data set on two shared CPU cores, one thread); the
        numbers mean little at this size."""
        quick = {"train_size": 300, "test_size": 300, "width": 64, "mlp_depth": 2, "epochs": 3}
        return cls(**{**quick, **overrides})

    @classmethod
    def paper(cls, **overrides: Any) -> OptimizerComparisonConfig:
        """The paper's scale as far as docs/reference.md states it: the whole data sets (50 000
        train / 10 000 test), no projection (``w = 3072``), docs/reference.md §6's backbones (the
        ResNet-MLP's 8 blocks, the growing models' 2) and docs/reference.md §6's tuned learning
        rates at batch 16 (SGD 1e−3, Adam 1e−4, RMSprop 1e−4, Muon 1e−3). docs/reference.md gives
        neither this figure's MLP sizes nor its number of epochs: the 8-block MLP is
        docs/reference.md §6's one-epoch baseline and the 10 epochs are this project's choice; FOOF
        keeps the default's swept settings. A GPU job: the growing models end with 500 000 entries
        per layer (about 37 GB in float32 for the two of them, one at a time: about 18.5 GB
        each)."""
        paper = {"train_size": None, "test_size": None, "width": None, "mlp_depth": 8,
                 "epochs": 10, "sgd_lr": 1e-3, "adam_lr": 1e-4, "rmsprop_lr": 1e-4,
                 "muon_lr": 1e-3}  # fmt: skip
        return cls(**{**paper, **overrides})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OptimizerComparisonConfig:
        """The config saved as ``config.json`` (unknown keys are an error)."""
        return config_from_dict(cls, d)


def _check_int(what: str, value: Any, *, minimum: int, owner: str = "OptimizerComparisonConfig"
               ) -> None:  # fmt: skip
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {what} must be an int >= {minimum}, got {value!r}")


def _check_positive(what: str, value: Any, owner: str = "OptimizerComparisonConfig") -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}: {what} must be a finite number > 0, got {value!r}")


def _check_choices(what: str, values: tuple, known: Mapping[str, str]) -> None:
    owner = "OptimizerComparisonConfig"
    if not values:
        raise ValueError(f"{owner}: give at least one of {what}: {', '.join(known)}")
    unknown = [v for v in values if v not in known]
    if unknown:
        raise ValueError(f"{owner}: unknown {what} {unknown}; known: {', '.join(known)}")
    if len(set(values)) != len(values):
        raise ValueError(f"{owner}: {what} must not repeat, got {list(values)}")


def _check_seeds(seeds: tuple, data_seed: Any, owner: str = "OptimizerComparisonConfig") -> None:
    if not seeds:
        raise ValueError(f"{owner}: give at least one seed")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{owner}: seeds must not repeat, got {list(seeds)}")
    for seed in seeds:
        _check_int("each seed", seed, minimum=0, owner=owner)
    _check_int("data_seed", data_seed, minimum=0, owner=owner)


# --------------------------------------------------------------------------- the data


def random_projection(d_in: int, width: int, seed: int) -> Tensor:
    """The fixed input projection ``P (width, d_in)``: i.i.d. ``N(0, 1/d_in)`` entries
    from a generator seeded with ``seed`` (the lift of :class:`rcdl.networks.ResidualNet`)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(width, d_in, generator=gen) / math.sqrt(d_in)


def project(data: CifarData, width: int | None, seed: int) -> CifarData:
    """``data`` with every image ``x (3072,)`` replaced by ``P x (width,)``
    (:func:`random_projection`); unchanged when ``width`` is ``None``."""
    if width is None:
        return data
    proj = random_projection(data.x_train.shape[1], width, seed).T  # (3072, w)
    return replace(data, x_train=data.x_train @ proj, x_test=data.x_test @ proj)


def _load_one(name: str, cfg: Any, *, download: bool) -> CifarData:
    """The subsets of data set ``name`` for a config with ``data_dir``, ``train_size``,
    ``test_size`` and ``data_seed``."""
    data = load_cifar(name, cfg.data_dir, download=download)
    for what, size, available in (("train_size", cfg.train_size, len(data.y_train)),
                                  ("test_size", cfg.test_size, len(data.y_test))):  # fmt: skip
        if size is not None and size > available:
            raise ValueError(f"{what} {size} is larger than the {available} images of "
                             f"{data.source}")  # fmt: skip
    return data.subset(cfg.train_size, cfg.test_size, seed=cfg.data_seed)


def load_datasets(
    cfg: OptimizerComparisonConfig, *, download: bool = True, verbose: bool = True
) -> tuple[dict[str, CifarData], dict[str, dict[str, Any]]]:
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
    loaded, missing, searched, briefs = {}, {}, [], []
    for name in cfg.datasets:
        try:
            loaded[name] = _load_one(name, cfg, download=download)
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


# --------------------------------------------------------------------------- the methods


def _muon(model: nn.Module, cfg: OptimizerComparisonConfig, device: torch.device):  # noqa: ANN202
    dtype = cfg.muon_ns_dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "bfloat16":
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
        model = ResNetMLP(width, classes, depth=cfg.mlp_depth).to(device)
        optimizer = name.removeprefix("mlp-")
        if optimizer == "muon":
            return model, _muon(model, cfg, device), None
        if optimizer == "foof":
            return model, FOOF(model, lr=cfg.foof_lr, damping=cfg.foof_damping, ema=0.95,
                               refresh_every=10, momentum=0.85), None  # fmt: skip
        return model, make_optimizer(optimizer, model, lr=cfg.lr(name)), None
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


class _Recorder:
    """Hands the trainer's records to ``metrics.jsonl``, tagged, and keeps them in memory."""

    def __init__(self, run: RunDir, **tags: Any) -> None:
        self.run, self.tags, self.records = run, tags, []

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None:
        rest = {k: v for k, v in {**(record or {}), **fields}.items() if k != "model"}
        record = {**self.tags, **rest}
        self.run.log(record)
        self.records.append(record)


def _history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per evaluation: epoch (an int at an epoch's end), test metrics, the mean training loss
    since the previous evaluation, the training clock and the entries stored."""
    keys = ("step", "test_acc", "test_loss", "train_loss", "train_seconds", "entries")
    epoch = [r["epoch"] for r in records]
    return [{"epoch": int(e) if float(e).is_integer() else e, **{k: r[k] for k in keys}}
            for e, r in zip(epoch, records, strict=True)]  # fmt: skip


def train_method(name: str, seed: int, cfg: Any, build: Any, tensors: tuple, run: RunDir, *,
                 device: torch.device, progress: bool, key: str = "method",
                 **tags: Any) -> dict[str, Any]:  # fmt: skip
    """Train ``build(name, seed)`` (``(model, optimizer, grower)``) for ``cfg.epochs`` epochs
    on ``tensors``, evaluating after every epoch (``cfg`` has ``batch_size``, ``epochs`` and
    ``eval_batch_size``). Records are tagged with ``tags``, ``{key: name}`` and the seed.

    Returns:
        ``{**tags, key: name, "seed", "parameters", <train_one_pass's result>}`` with
        ``history`` one record per evaluation (:func:`_history`).
    """
    n = len(tensors[0])
    model, optimizer, grower = build(name, seed)
    recorder = _Recorder(run, **tags, **{key: name}, seed=seed)
    label = "-".join(map(str, [*tags.values(), name, f"seed{seed}"]))
    result = train_one_pass(
        model, tensors, batch_size=cfg.batch_size, seed=seed, optimizer=optimizer,
        grower=grower, loss_fn=F.cross_entropy, metrics=_METRICS,
        eval_every=math.ceil(n / cfg.batch_size), eval_batch_size=cfg.eval_batch_size,
        device=device, run=recorder, name=label, progress=progress, epochs=cfg.epochs,
    )  # fmt: skip
    result.pop("history")
    parameters = sum(p.numel() for p in model.parameters())
    return {**tags, key: name, "seed": seed, "parameters": parameters, **result,
            "history": _history(recorder.records)}  # fmt: skip


def _train_dataset(name: str, data: CifarData, cfg: OptimizerComparisonConfig,
                   summary: dict[str, Any], run: RunDir, device: torch.device, progress: bool,
                   start: float) -> None:  # fmt: skip
    """Train every (seed, method) on data set ``name`` (or read it back from an earlier
    session), appending each result to ``summary["runs"]`` and saving the summary."""
    data = project(data, cfg.width, cfg.data_seed)
    tensors = tuple(t.to(device) for t in (data.x_train, data.y_train, data.x_test, data.y_test))
    n = len(data.y_train)

    def build(method: str, seed: int):  # noqa: ANN202
        return build_method(method, seed, cfg, data.num_classes, reserve=cfg.epochs * n,
                            device=device)  # fmt: skip

    for seed in cfg.seeds:
        for method in cfg.methods:
            train = partial(train_method, method, seed, cfg, build, tensors, run,
                            device=device, progress=progress, dataset=name)  # fmt: skip
            summary["runs"].append(run.sub_run(f"{name}-{method}-seed{seed}", train))
            summary["seconds"] = time.perf_counter() - start
            run.write_summary(summary)
            release_memory(device)


def run_optimizer_comparison(
    cfg: OptimizerComparisonConfig,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    data: Mapping[str, CifarData] | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    download: bool = True,
) -> tuple[RunDir, dict[str, Any]]:
    """Train every method on every data set found, for every seed, into a new run folder
    or the one at ``resume``; write the report.

    Args:
        cfg: the settings; to resume, the run's own (``rcdl.app.rundir.read_config``), where
            only ``data_dir`` and ``device`` may differ.
        out: the run folder (default ``runs/optimizers-<timestamp>``); it must not already
            hold a run. Not with ``resume``.
        resume: an interrupted run folder: its finished (dataset, method, seed) runs are
            read back, the others trained from scratch.
        data: ``{dataset: subsets}`` already loaded by :func:`load_datasets` (before
            projection; sizes must be the config's); data sets of ``cfg.datasets`` absent
            from it count as missing. Default: load them here.
        device: overrides ``cfg.device``.
        progress: show progress bars.
        download: download a data set when no copy is found.

    Returns:
        The run folder and its summary (the content of ``summary.json``): ``data`` and
        ``skipped`` (per data set), ``runs`` (per (dataset, method, seed): parameters,
        entries, seconds, ``history`` per epoch), ``rows`` (per (dataset, method, epoch),
        mean and sd over seeds, accuracies in percent) and ``verdicts`` (per data set).

    Raises:
        rcdl.app.cifar.CifarNotFoundError: see :func:`load_datasets`.
    """
    start = time.perf_counter()
    device = resolve_device(cfg.device) if device is None else torch.device(device)
    if data is None:
        data, missing = load_datasets(cfg, download=download)
    else:
        data = {k: v for k, v in data.items() if k in cfg.datasets}
        missing = {k: {"message": "not in the data given to run_optimizer_comparison",
                       "searched": []} for k in cfg.datasets if k not in data}  # fmt: skip
        if not data:
            raise ValueError(f"data holds none of the data sets {list(cfg.datasets)}")
    for name, d in data.items():
        sizes, want = (len(d.y_train), len(d.y_test)), (cfg.train_size, cfg.test_size)
        if any(w is not None and s != w for s, w in zip(sizes, want, strict=True)):
            raise ValueError(f"the {name} data has {sizes[0]} train / {sizes[1]} test images, "
                             f"the config asks for {want[0]} / {want[1]}; pass "
                             "load_datasets(cfg) or no data")  # fmt: skip
    run = open_run(EXPERIMENT, cfg, out=out, resume=resume, device=device)
    summary: dict[str, Any] = {
        "experiment": EXPERIMENT, "complete": False, "data": {},
        "skipped": {name: missing[name] for name in cfg.datasets if name in missing},
        "input_width": cfg.input_width, "runs": [],
    }  # fmt: skip
    with run.resumable(f"rcdl reproduce {EXPERIMENT}", cfg.data_dir):
        for name in cfg.datasets:
            if name not in data:
                continue
            d = data[name]
            summary["data"][name] = {**d.describe(), "provenance": data_provenance(d.source),
                                     "data_seed": cfg.data_seed}  # fmt: skip
            _train_dataset(name, d, cfg, summary, run, device, progress, start)

    summary["rows"] = epoch_rows(summary["runs"], cfg.methods, key="method")
    summary["verdicts"] = {name: verdict(summary["rows"], name, cfg.epochs)
                           for name in summary["data"]}  # fmt: skip
    summary["complete"] = True
    summary["seconds"] = time.perf_counter() - start
    report = write_report(run, cfg, summary, device)
    run.write_summary(summary)
    print("\n" + report, end="")
    print(f"Run time {summary['seconds']:.1f} s. Run folder: {run.path}")
    return run, summary


# --------------------------------------------------------------------------- reporting


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def epoch_rows(runs: list[dict[str, Any]], names: tuple[str, ...], *,
               key: str) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (dataset, ``run[key]`` in ``names``, epoch ``0..E``), mean and sd over
    seeds: test accuracy in percent, test loss and the epoch's mean training loss in nats
    (``None`` at epoch 0), training seconds so far, entries stored (growing models)."""
    rows = []
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        for name in names:
            rs = [r for r in runs if r["dataset"] == dataset and r[key] == name]
            if not rs:
                continue
            for at in zip(*(r["history"] for r in rs), strict=True):  # one evaluation, all seeds
                row: dict[str, Any] = {"dataset": dataset, key: name, "epoch": at[0]["epoch"],
                                       "seeds": [r["seed"] for r in rs]}  # fmt: skip
                for field, scale, suffix in (("test_acc", 100, "_pct"), ("test_loss", 1, ""),
                                             ("train_loss", 1, "")):  # fmt: skip
                    values = [scale * h[field] for h in at if h[field] is not None]
                    row[field + suffix], row[f"{field}{suffix}_sd"] = _mean_sd(values)
                row["train_seconds"] = statistics.fmean(h["train_seconds"] for h in at)
                row["entries"] = at[0]["entries"]
                rows.append(row)
    return rows


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
        "best_mlp_optimizer": max(mlps, key=mlps.get) if mlps else None,
        "best_method": max(final, key=final.get),
    }  # fmt: skip
    if classic:
        best = max(classic, key=classic.get)
        out["best_classic_mlp"] = best
        out["growing_beat_classic"] = {m: final[m] > classic[best] for m in ("gws", "rbf")
                                       if m in final}  # fmt: skip
    return out


def _pm(mean: float | None, sd: float | None, digits: int) -> str:
    if mean is None:
        return "—"
    return f"{mean:.{digits}f}" if sd is None else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def final_table(rows: list[dict[str, Any]], dataset: str, epochs: int,
                labels: Mapping[str, str], *, key: str = "method") -> str:  # fmt: skip
    """Markdown: per method, final and best test accuracy, test loss, training loss after
    the first and the last epoch, entries and training seconds."""
    lines = ["| method | | test acc. % (final) | best (epoch) | test loss | train loss, "
             "epoch 1 | train loss, final | entries | train s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name in dict.fromkeys(r[key] for r in rows if r["dataset"] == dataset):
        rs = [r for r in rows if r["dataset"] == dataset and r[key] == name]
        by_epoch = {r["epoch"]: r for r in rs}
        last, first = by_epoch[epochs], by_epoch[1]
        best = max(rs, key=lambda r: r["test_acc_pct"])
        entries = "—" if last["entries"] is None else f"{last['entries']:,}"
        lines.append(
            f"| {name} | {labels[name]} | {_pm(last['test_acc_pct'], last['test_acc_pct_sd'], 2)}"
            f" | {best['test_acc_pct']:.2f} ({best['epoch']:g}) "
            f"| {_pm(last['test_loss'], last['test_loss_sd'], 3)} "
            f"| {_pm(first['train_loss'], first['train_loss_sd'], 3)} "
            f"| {_pm(last['train_loss'], last['train_loss_sd'], 3)} | {entries} "
            f"| {last['train_seconds']:.1f} |"
        )
    return "\n".join(lines)


def epoch_table(rows: list[dict[str, Any]], dataset: str, field: str, digits: int, *,
                key: str = "method") -> str:  # fmt: skip
    """Markdown: ``field`` (mean over seeds) per epoch (rows) and method (columns)."""
    names = list(dict.fromkeys(r[key] for r in rows if r["dataset"] == dataset))
    lines = ["| epoch | " + " | ".join(names) + " |", "|---:" + "|---:" * len(names) + "|"]
    epochs = sorted({r["epoch"] for r in rows if r["dataset"] == dataset})
    for epoch in epochs:
        cells = []
        for name in names:
            r = next(r for r in rows if r["dataset"] == dataset and r[key] == name
                     and r["epoch"] == epoch)  # fmt: skip
            cells.append(_pm(r[field], None, digits))
        lines.append(f"| {epoch:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_csv(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`epoch_rows` as CSV (empty cells where a value does not apply)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = list(rows[0]) if rows else []
    writer.writerow(columns)
    for r in rows:
        cells = [" ".join(map(str, r[k])) if k == "seeds" else r[k] for k in columns]
        writer.writerow(["" if v is None else v for v in cells])
    return buf.getvalue()


def plot_curves(rows: list[dict[str, Any]], path: Path, *, title: str,
                labels: Mapping[str, str], key: str = "method") -> Path:  # fmt: skip
    """Left: the training loss (mean batch loss of each epoch, log scale) against epochs;
    right: test accuracy against epochs (epoch 0: before training); one line per method,
    the mean over seeds with a ± sd band when there are several."""
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    loss_ax, acc_ax = fig.subplots(1, 2)
    for name, label in labels.items():
        rs = sorted((r for r in rows if r[key] == name), key=lambda r: r["epoch"])
        if not rs:
            continue
        color = None
        for ax, field in ((loss_ax, "train_loss"), (acc_ax, "test_acc_pct")):
            pts = [r for r in rs if r[field] is not None]
            xs, ys = [r["epoch"] for r in pts], [r[field] for r in pts]
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=label, color=color)
            color = line.get_color()
            if pts and pts[0][f"{field}_sd"] is not None:
                sd = [r[f"{field}_sd"] for r in pts]
                ax.fill_between(xs, [y - s for y, s in zip(ys, sd, strict=True)],
                                [y + s for y, s in zip(ys, sd, strict=True)], color=color,
                                alpha=0.2)  # fmt: skip
    loss_ax.set(xlabel="epoch", ylabel="training loss (mean over the epoch)", yscale="log",
                title=title)  # fmt: skip
    acc_ax.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    for ax in (loss_ax, acc_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        ax.xaxis.get_major_locator().set_params(integer=True)
    return save_figure(fig, path)



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
    if "growing_beat_classic" in v and v["growing_beat_classic"]:
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
    for name, d in summary["data"].items():
        title = DATASETS[name]
        steps = math.ceil(d["n_train"] / cfg.batch_size)
        parts += [
            f"## {title}",
            f"{d['n_train']:,} train / {d['n_test']:,} test images (random subsets, data seed "
            f"{cfg.data_seed}), {d['num_classes']} classes, {steps:,} steps per epoch. "
            f"Data: {d['source']}, {d['provenance']}.",
            final_table(rows, name, cfg.epochs, METHODS),
            "Test accuracy (%) by epoch (epoch 0: before training):",
            epoch_table(rows, name, "test_acc_pct", 2),
            "Training loss by epoch (mean batch loss over the epoch, before each update):",
            epoch_table([r for r in rows if r["epoch"] >= 1], name, "train_loss", 3),
            _verdict_text(summary["verdicts"][name], name),
        ]  # fmt: skip
        plot_curves([r for r in rows if r["dataset"] == name], run.file(f"optimizers_{name}.png"),
                    title=f"{title}, {d['n_train']:,} training images, w = {cfg.input_width}",
                    labels={m: METHODS[m] for m in cfg.methods})  # fmt: skip
    parts += [
        "Paper (docs/reference.md §8): the weighted-softmax and RBF growing models clearly "
        "beat the SGD/Adam/RMSprop MLPs and drop the training loss fastest; Muon is the best "
        "parametric optimizer on CIFAR-10, Mesa/FOOF on CIFAR-100 (no numbers given).",
        f"Machine: {describe_machine(device)}.\n",
    ]
    report = "\n\n".join(parts)
    atomic_write_text(report, run.file("results.md"))
    atomic_write_text(results_csv(rows), run.file("results.csv"))
    return report
