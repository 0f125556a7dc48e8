"""The paper's one-epoch CIFAR-10 comparison, its Fig. 2 (docs/reference.md §6).

Run it with ``rcdl reproduce cifar10-1epoch`` (see docs/cifar10.md).

Protocol (docs/reference.md §6): every model sees the training images once, in batches of 16 taken
from a seeded random permutation, and minimises the batch-mean cross-entropy; test accuracy and
test loss on the whole test set are computed from one prediction pass every ``eval_every``
steps and at the end. Images are standardised and flattened to ``d = 3072``
(:mod:`rcdl.app.cifar`). All models share the residual backbone of :mod:`rcdl.networks`.

Models (:data:`MODELS`). Each builder uses the library's networks, rules and optimizers.
None of them reimplements a layer.

====================  ==================================================================
``gws``               growing weighted softmax, L = 2, T = 6, clipped rule β = 3, η = 0.003
``gauge``             gauge-invariant weighted softmax, L = 2, T = 5, α = 10, η = 0.03, β = 100
``rbf``               growing RBF, L = 2, T = 10, η = 10
``mlp-<opt>``         ResNet-MLP (8 blocks) trained by ``sgd``, ``adam``, ``adamw``,
                      ``rmsprop`` or ``muon`` with the tuned settings of :mod:`rcdl.optim`
``hybrid``            hybrid growing weighted softmax, L = 3, T = 5, τ = 50, η = 1, β = 30,
                      entries also trained by Adam 1e−3 (docs/reference.md §4)
``psoftmax-<N>``      parametric softmax, L = 2, T = 3, N entries per layer, Adam 1e−3
                      (docs/reference.md §5; the paper's N are 5000 and 50016)
``knn-l2``,           k-nearest neighbours (k chosen on 10 % of the training set held out),
``knn-cosine``        L2 or cosine distance (:mod:`rcdl.app.classical`)
``svm-linear``        linear SVM (hinge loss, SGD solver, penalty chosen on the held-out 10 %)
``svm-rbf``           RBF SVM through a Nyström map with 2 000 landmarks, then a linear SVM
====================  ==================================================================

The classical baselines are fitted on the whole training set at once and scored once; their
"train" and "eval" seconds are fit and predict times, and they report no test loss.

The growing models write one entry per training sample per layer. They have no
parameters, so :class:`rcdl.grower.Grower` plays the optimizer's part. The hybrid writes
only the samples its distance gate lets through (the table gives its entries as a fraction
of the possible ones) and trains its entries by :class:`rcdl.hybrid.EntryAdam`.

Run folder (one per invocation, every model and seed in it)::

    config.json         the resolved Cifar10Config
    environment.json    machine, torch, git revision of the first session
    metrics.jsonl       every evaluation of every (model, seed), tagged with both
    summary.json        per-(model, seed) results with their histories, per-model rows,
                        the data used, one record per session; ``complete`` says if done
    results.md/.csv     the table: accuracy (mean ± sd over seeds), loss, entries, store,
                        parameters, train/eval seconds, the paper's reference
    test_accuracy.png   test accuracy against training samples seen (mean over seeds)
    checkpoints/<model>-seed<k>.pt   while that model trains (deleted when it finishes)

Resume: :func:`run_cifar10` with ``resume=RUN_DIR`` skips the (model, seed) pairs that
``summary.json`` lists as finished. It continues an interrupted pair from its checkpoint,
and that pair ends with the same result as an uninterrupted run
(:func:`rcdl.training.train_one_pass`). ``metrics.jsonl`` may repeat the evaluations made
between the last checkpoint and the interruption. ``summary.json`` is authoritative.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from fnmatch import fnmatch
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn

from rcdl.app.cifar import CifarData, data_provenance, load_cifar
from rcdl.app.classical import CLASSICAL_MODELS, fit_classical
from rcdl.app.rundir import (
    RunDir,
    atomic_write_json,
    atomic_write_text,
    config_from_dict,
    describe_machine,
    environment_info,
    rank0_run,
    read_config,
    release_memory,
    resolve_device,
    resume_command,
    save_figure,
)
from rcdl.distributed import rank_and_world, shard
from rcdl.grower import Grower
from rcdl.hybrid import AlwaysGrow, DistanceGate, EntryAdam
from rcdl.layers import set_store_dtype
from rcdl.networks import (
    GrowingRBFNet,
    GrowingSoftmaxNet,
    HybridSoftmaxNet,
    ParametricSoftmaxNet,
    ResNetMLP,
)
from rcdl.optim import make_optimizer
from rcdl.rules import ClippedSoftmaxRule, FunctionalSGD, GaugeSoftmaxRule
from rcdl.store import format_bytes
from rcdl.training import accuracy, train_one_pass

__all__ = [
    "EXPERIMENT", "MODELS", "Cifar10Config", "ModelSpec", "Reference", "build_model",
    "combine_runs", "hybrid_name",
    "load_data", "load_run_config", "model_spec", "run_cifar10",
]  # fmt: skip

EXPERIMENT = "cifar10-1epoch"
D_IN, CLASSES = 3072, 10
METRICS = {"test_acc": accuracy, "test_loss": F.cross_entropy}  # first: the progress bar's
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICES = ("auto", "cpu", "cuda")


# --------------------------------------------------------------------------- the models


@dataclass(frozen=True)
class Reference:
    """docs/reference.md §6's numbers for one model (accuracy in percent; ``None`` where none is
    given).

    ``test_acc``, ``test_loss`` and ``entries`` come from the authors' one-seed run. For the
    tuned MLPs, ``seeds_acc = (mean, sd)`` is the accuracy over several seeds.
    """

    test_acc: float | None = None
    test_loss: float | None = None
    entries: int | None = None
    seeds_acc: tuple[float, float] | None = None

    def describe(self) -> str:
        """E.g. ``59.18 %``, ``57.2 ± 0.4 % (seeds)``, ``49.69 % (seeds: 48.2 ± 1.0)``, ``—``."""
        if self.seeds_acc is None:
            return "—" if self.test_acc is None else f"{self.test_acc:.2f} %"
        mean, sd = self.seeds_acc
        if self.test_acc is None:
            return f"{mean:.1f} ± {sd:.1f} % (seeds)"
        return f"{self.test_acc:.2f} % (seeds: {mean:.1f} ± {sd:.1f})"


Learner = tuple[nn.Module, Any, Grower | None]  # (model, optimizer or None, grower or None)
Builder = Callable[[int, torch.device, torch.dtype], Learner]  # (seed, device, dtype)


@dataclass(frozen=True)
class ModelSpec:
    """A model of the comparison: readable label, builder and the paper's numbers.

    A classical baseline (:mod:`rcdl.app.classical`) has no builder: it is fitted on the whole
    training set at once (``classical=True``) and scored once, at the end.
    """

    label: str
    build: Builder | None
    reference: Reference = field(default_factory=Reference)
    classical: bool = False


def _grown(model: nn.Module, device: torch.device, dtype: torch.dtype) -> Learner:
    model = model.to(device=device, dtype=dtype)
    return model, None, Grower(model)


def _gws(seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    rule = ClippedSoftmaxRule(eta=0.003, beta=3.0)
    net = GrowingSoftmaxNet(D_IN, CLASSES, 2, temperature=6.0, rule=rule, seed=seed)
    return _grown(net, device, dtype)


def _gauge(seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    rule = GaugeSoftmaxRule(alpha=10.0, eta=0.03, beta=100.0)
    net = GrowingSoftmaxNet(D_IN, CLASSES, 2, temperature=5.0, rule=rule, seed=seed)
    return _grown(net, device, dtype)


def _rbf(seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    return _grown(GrowingRBFNet(D_IN, CLASSES, 2, temperature=10.0, rule=FunctionalSGD(10.0)),
                  device, dtype)


def _hybrid(tau: float | None, seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    """docs/reference.md §4, §6; ``tau=None`` grows on every sample (:class:`AlwaysGrow`)."""
    rule = ClippedSoftmaxRule(eta=1.0, beta=30.0)
    trigger = AlwaysGrow() if tau is None else DistanceGate(tau)
    net = HybridSoftmaxNet(D_IN, CLASSES, 3, temperature=5.0, rule=rule, trigger=trigger,
                           seed=seed)
    net = net.to(device=device, dtype=dtype)
    return net, EntryAdam(net, lr=1e-3), Grower(net)


def _mlp(optimizer: str, seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    model = ResNetMLP(D_IN, CLASSES, depth=8).to(device=device, dtype=dtype)
    return model, make_optimizer(optimizer, model), None


def _psoftmax(entries: int, seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    model = ParametricSoftmaxNet(D_IN, CLASSES, 2, entries=entries, temperature=3.0)
    model = model.to(device=device, dtype=dtype)
    return model, make_optimizer("adam", model, lr=1e-3), None  # docs/reference.md §5: Adam 1e−3


MODELS: dict[str, ModelSpec] = {
    "gws": ModelSpec("growing weighted softmax (gws)", _gws, Reference(59.18, 1.163, 150_048)),
    "gauge": ModelSpec("gauge-invariant WS", _gauge, Reference(58.33, 1.203, 150_048)),
    "rbf": ModelSpec("growing RBF", _rbf, Reference(58.42, 1.200, 150_000)),
    "hybrid": ModelSpec("hybrid growing WS (τ = 50)", partial(_hybrid, 50.0),
                        Reference(55.12, 1.330, 93_339)),
    "mlp-sgd": ModelSpec("ResNet-MLP, SGD", partial(_mlp, "sgd"), Reference(seeds_acc=(46.3, 2.0))),
    "mlp-adam": ModelSpec("ResNet-MLP, Adam", partial(_mlp, "adam"),
                          Reference(49.69, 1.409, seeds_acc=(48.2, 1.0))),
    "mlp-adamw": ModelSpec("ResNet-MLP, AdamW", partial(_mlp, "adamw"),
                           Reference(seeds_acc=(48.3, 1.0))),
    "mlp-rmsprop": ModelSpec("ResNet-MLP, RMSprop", partial(_mlp, "rmsprop"),
                             Reference(seeds_acc=(49.9, 0.7))),
    "mlp-muon": ModelSpec("ResNet-MLP, Muon", partial(_mlp, "muon"),
                          Reference(seeds_acc=(57.2, 0.4))),
    "psoftmax-5000": ModelSpec("parametric softmax, N = 5000", partial(_psoftmax, 5000),
                               Reference(42.02, 1.634)),
    "psoftmax-50016": ModelSpec("parametric softmax, N = 50016", partial(_psoftmax, 50016),
                                Reference(40.60, 1.672)),
    **{name: ModelSpec(label, None, classical=True)
       for name, (label, _) in CLASSICAL_MODELS.items()},
}  # fmt: skip
_PSOFTMAX = re.compile(r"psoftmax-([1-9][0-9]*)")
_HYBRID = re.compile(r"hybrid-(always|tau([0-9]+(?:\.[0-9]+)?))")


def hybrid_name(tau: float | None) -> str:
    """The model name of the hybrid with threshold ``tau`` (``None``: always grow)."""
    return "hybrid-always" if tau is None else f"hybrid-tau{tau:g}"


def _is_growing(name: str) -> bool:
    """Whether model ``name`` has growing stores (which torchrun shards)."""
    return name in ("gws", "gauge", "rbf", "hybrid") or bool(_HYBRID.fullmatch(name))


def model_spec(name: str) -> ModelSpec:
    """The spec of model ``name``: a key of :data:`MODELS`, ``psoftmax-<N>`` for any N ≥ 1,
    ``hybrid-tau<τ>`` for the hybrid with another threshold, or ``hybrid-always``.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name in MODELS:
        return MODELS[name]
    match = _PSOFTMAX.fullmatch(name)
    if match:
        n = int(match.group(1))
        return ModelSpec(f"parametric softmax, N = {n}", partial(_psoftmax, n))
    match = _HYBRID.fullmatch(name)
    if match:
        tau = None if match.group(1) == "always" else float(match.group(2))
        label = "hybrid growing WS, " + ("always grow" if tau is None else f"τ = {tau:g}")
        reference = MODELS["hybrid"].reference if tau == 50.0 else Reference()
        return ModelSpec(label, partial(_hybrid, tau), reference)
    raise ValueError(
        f"unknown model {name!r}; known: {', '.join(MODELS)} (or psoftmax-<N>, N entries "
        "per layer; hybrid-tau<τ> or hybrid-always)"
    )


def build_model(name: str, seed: int, *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, reserve: int = 0,
                store_dtype: torch.dtype | None = None) -> Learner:
    """Build model ``name`` with its learner, reproducibly from ``seed``.

    torch's global generator is seeded with ``seed`` first (the MLP and parametric-softmax
    initialisations draw from it). The growing softmax nets seed their 16 initial entries
    from ``seed`` too. A grower reserves ``reserve`` more entries per layer, so its stores
    never reallocate during a pass over that many samples. ``store_dtype`` (e.g.
    ``torch.bfloat16``) is what the growing layers keep keys and values as
    (:func:`rcdl.layers.set_store_dtype`; other models ignore it).

    Returns:
        ``(model, optimizer or None, grower or None)``, the model on ``device`` in ``dtype``.
    """
    spec = model_spec(name)
    if spec.classical:
        raise ValueError(f"{name!r} is a classical baseline, fitted by rcdl.app.classical, "
                         "not built")
    torch.manual_seed(seed)
    model, optimizer, grower = spec.build(seed, torch.device(device), dtype)
    if store_dtype is not None:
        set_store_dtype(model, store_dtype)
    if grower is not None and reserve:
        grower.reserve(reserve)
    return model, optimizer, grower


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class Cifar10Config:
    """Settings of the one-epoch comparison; the defaults are the paper's full protocol.

    Attributes:
        models: names from :data:`MODELS` (or ``psoftmax-<N>``), trained in this order.
        train_size, test_size: random subsets of that many images (``None``: all 50 000 /
            10 000); the subsets depend on ``data_seed`` only, so every model and seed
            sees the same images.
        seeds: each model is trained once per seed. The seed fixes the initialisation and
            the order of the training images.
        batch_size: samples per step ``B`` (docs/reference.md §6: 16).
        eval_every: steps between test evaluations (docs/reference.md §6: 250), and also at the end.
        eval_batch_size: test images per prediction batch (docs/reference.md §6: 500).
        data_dir: folder holding ``cifar10.npz`` or the official files (see
            :func:`rcdl.app.cifar.load_cifar`; ``None`` searches ``$RCDL_DATA``, then the cache).
        data_seed: seed of the subsets.
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
        dtype: ``"float32"`` (the paper's) or ``"float64"``.
        store_dtype: ``None`` (stores in ``dtype``, exact) or ``"bfloat16"`` / ``"float16"``:
            growing layers keep keys and values in half precision (docs/precision.md).
        incremental_eval: evaluate each growing layer whose test queries stay fixed (the
            first) over the entries written since the last evaluation only, merged with the
            cached partials (exact up to rounding; docs/training.md).
        checkpoint: save each model's state under ``checkpoints/`` while it trains.
        checkpoint_every: steps between checkpoints (``None``: ``eval_every``).
    """

    models: tuple[str, ...] = tuple(MODELS)
    train_size: int | None = None
    test_size: int | None = None
    seeds: tuple[int, ...] = (0,)
    batch_size: int = 16
    eval_every: int = 250
    eval_batch_size: int = 500
    data_dir: str | None = None
    data_seed: int = 0
    device: str = "auto"
    dtype: str = "float32"
    store_dtype: str | None = None
    incremental_eval: bool = True
    checkpoint: bool = True
    checkpoint_every: int | None = None

    def __post_init__(self) -> None:
        # lists (from JSON or argparse) become tuples, paths strings, so configs compare equal
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "seeds", tuple(self.seeds))
        if self.data_dir is not None:
            object.__setattr__(self, "data_dir", str(self.data_dir))
        if not self.models:
            raise ValueError("Cifar10Config: give at least one model")
        for name in self.models:
            model_spec(name)
        _unique("models", self.models)
        if not self.seeds:
            raise ValueError("Cifar10Config: give at least one seed")
        _unique("seeds", self.seeds)
        for seed in (*self.seeds, self.data_seed):
            if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise ValueError(f"Cifar10Config: seeds must be ints >= 0, got {seed!r}")
        for what in ("train_size", "test_size", "checkpoint_every"):
            _positive(what, getattr(self, what), optional=True)
        for what in ("batch_size", "eval_every", "eval_batch_size"):
            _positive(what, getattr(self, what))
        if self.dtype not in _DTYPES:
            raise ValueError(f"Cifar10Config: dtype must be one of {list(_DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.store_dtype is not None and self.store_dtype not in _STORE_DTYPES:
            raise ValueError(f"Cifar10Config: store_dtype must be None or one of "
                             f"{list(_STORE_DTYPES)}, got {self.store_dtype!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"Cifar10Config: device must be one of {list(_DEVICES)}, "
                             f"got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_store_dtype(self) -> torch.dtype | None:
        return None if self.store_dtype is None else _STORE_DTYPES[self.store_dtype]

    @classmethod
    def quick(cls, **overrides: Any) -> Cifar10Config:
        """A smoke-test scale: 2 000 train / 1 000 test images, evaluations every 50 steps.

        By default it runs the three growing models and ``mlp-adam``. Each parametric
        baseline updates 75–770 M parameters per step; on two shared CPU cores ``mlp-adam``
        alone took 5.6 minutes here (``--models`` adds the others).
        """
        quick = {
            "models": ("gws", "gauge", "rbf", "mlp-adam"),
            "train_size": 2000, "test_size": 1000, "eval_every": 50,
        }  # fmt: skip
        return cls(**{**quick, **overrides})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cifar10Config:
        """The config saved as ``config.json`` (unknown keys are an error)."""
        return config_from_dict(cls, d)


def _unique(what: str, items: tuple) -> None:
    if len(set(items)) != len(items):
        raise ValueError(f"Cifar10Config: {what} must not repeat, got {list(items)}")


def _positive(what: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Cifar10Config: {what} must be an int >= 1, got {value!r}")


def load_run_config(run_dir: str | Path) -> Cifar10Config:
    """The config of the run in ``run_dir`` (its ``config.json``), for resuming it."""
    return read_config(run_dir, Cifar10Config)


# --------------------------------------------------------------------------- the data


def load_data(cfg: Cifar10Config, *, download: bool = True) -> CifarData:
    """CIFAR-10 from ``cfg.data_dir`` (or the usual places), subset as ``cfg`` asks.

    Raises:
        rcdl.app.cifar.CifarNotFoundError, rcdl.app.cifar.CorruptDataError: from the loader.
        ValueError: if a subset is larger than the split.
    """
    data = load_cifar("cifar10", cfg.data_dir, download=download)
    if cfg.train_size is None and cfg.test_size is None:
        return data
    for what, size, available in (("train_size", cfg.train_size, len(data.y_train)),
                                  ("test_size", cfg.test_size, len(data.y_test))):
        if size is not None and size > available:
            raise ValueError(f"{what} {size} is larger than the {available} images of "
                             f"{data.source}")
    return data.subset(cfg.train_size, cfg.test_size, seed=cfg.data_seed)


# --------------------------------------------------------------------------- running


class _ModelLog:
    """Hands the trainer's records to the run's ``metrics.jsonl``, tagged with model and seed."""

    def __init__(self, run: RunDir, model: str, seed: int) -> None:
        self.run, self.model, self.seed = run, model, seed

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None:
        rest = {k: v for k, v in {**(record or {}), **fields}.items() if k != "model"}
        self.run.log({"model": self.model, "seed": self.seed, **rest})


def _run_name(model: str, seed: int) -> str:
    return f"{model}-seed{seed}"


def _train(name: str, seed: int, cfg: Cifar10Config, data: tuple, run: RunDir,
           device: torch.device, progress: bool) -> dict[str, Any]:
    """Train one (model, seed); returns its result (see ``train_one_pass``) plus identity."""
    if model_spec(name).classical:
        return _fit_classical(name, seed, cfg, data, run)
    rank, world = rank_and_world()
    model, optimizer, grower = build_model(name, seed, device=device, dtype=cfg.torch_dtype,
                                           reserve=math.ceil(len(data[0]) / world),
                                           store_dtype=cfg.torch_store_dtype)
    if world > 1:  # under torchrun: every growing store is split over the ranks
        if grower is None:
            raise ValueError(f"{name} has no growing layers to shard over the {world} ranks; "
                             "run it without torchrun")
        shard(model)
    # every growing layer could write one entry per training sample
    possible = None if grower is None else grower.num_entries + len(grower.layers) * len(data[0])
    checkpoint = _checkpoint_path(run, name, seed) if cfg.checkpoint else None
    result = train_one_pass(
        model, data, batch_size=cfg.batch_size, seed=seed, optimizer=optimizer, grower=grower,
        loss_fn=F.cross_entropy, metrics=METRICS, eval_every=cfg.eval_every,
        eval_batch_size=cfg.eval_batch_size, device=device, run=_ModelLog(run, name, seed),
        name=_run_name(name, seed), progress=progress, checkpoint_path=checkpoint,
        checkpoint_every=cfg.checkpoint_every, incremental_eval=cfg.incremental_eval,
    )  # fmt: skip
    parameters = sum(p.numel() for p in model.parameters())
    layer_stats = {layer.name: layer.stats() for layer in (grower.layers if grower else [])
                   if hasattr(layer, "stats")}  # written / refused per hybrid layer
    return {"model": name, "seed": seed, "parameters": parameters,
            "possible_entries": possible, **result,
            **({"layer_stats": layer_stats} if layer_stats else {})}


def _checkpoint_path(run: RunDir, name: str, seed: int) -> Path:
    """``checkpoints/<model>-seed<s>.pt``; under torchrun one file per rank,
    ``...rank<r>of<W>.pt``, listed by rank 0 in ``<model>-seed<s>.manifest.json``. A
    checkpoint left by another number of ranks is refused."""
    rank, world = rank_and_world()
    stem = _run_name(name, seed)
    folder = run.file("checkpoints")
    mine = f"{stem}.pt" if world == 1 else f"{stem}.rank{rank}of{world}.pt"
    allowed = mine if world == 1 else f"{stem}.rank*of{world}.pt"
    left = [p.name for p in (folder / f"{stem}.pt", *folder.glob(f"{stem}.rank*of*.pt"))
            if p.exists() and not fnmatch(p.name, allowed)]
    manifest = folder / f"{stem}.manifest.json"
    with contextlib.suppress(FileNotFoundError):  # rank 0 may be removing it
        if json.loads(manifest.read_text(encoding="utf-8"))["world_size"] != world:
            left.insert(0, manifest.name)
    if left:
        raise ValueError(f"{stem}: its checkpoint {left[0]} was written by another number of "
                         f"processes than this run's {world}; resume with the same torchrun "
                         "--nproc-per-node (a plain .pt file: without torchrun)")
    return folder / mine


def _fit_classical(name: str, seed: int, cfg: Cifar10Config, data: tuple,
                   run: RunDir) -> dict[str, Any]:
    """Fit a classical baseline on the whole training set; its one evaluation is logged at
    the step count of the one-epoch models, so it sits at the end of their curves."""
    x_train, y_train, x_test, y_test = (t.cpu() for t in data)
    print(f"{_run_name(name, seed)}: fitting {model_spec(name).label} on {len(x_train):,} "
          "images (no progress bar)")
    fitted = fit_classical(name, x_train, y_train, x_test, y_test, seed=seed)
    steps, n = math.ceil(len(x_train) / cfg.batch_size), len(x_train)
    evaluation = {"step": steps, "samples": n, "test_acc": fitted.test_acc, "test_loss": None}
    nbytes = None if fitted.entries is None else x_train.nbytes + y_train.nbytes
    _ModelLog(run, name, seed).log(evaluation, entries=fitted.entries, bytes=nbytes,
                                   train_seconds=fitted.fit_seconds,
                                   eval_seconds=fitted.predict_seconds)
    return {"model": name, "seed": seed, "parameters": 0, "possible_entries": None,
            "test_acc": fitted.test_acc, "test_loss": None, "train_loss": None,
            "entries": fitted.entries, "bytes": nbytes, "steps": steps, "samples": n,
            "train_seconds": fitted.fit_seconds, "eval_seconds": fitted.predict_seconds,
            "history": [evaluation], "resumed": False, "settings": fitted.settings}


def run_cifar10(
    cfg: Cifar10Config,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    data: CifarData | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    keep_checkpoints: bool = False,
    download: bool = True,
    experiment: str = EXPERIMENT,
) -> tuple[RunDir, dict[str, Any]]:
    """Run the comparison into a new run folder, or continue the one at ``resume``.

    Args:
        cfg: the settings; to resume, the run's own (:func:`load_run_config`), where only
            ``data_dir`` and ``device`` may differ.
        out: the new run folder (default ``runs/cifar10-1epoch-<timestamp>``); not with
            ``resume``.
        resume: an interrupted run folder. Finished (model, seed) pairs are skipped and an
            interrupted one continues from its checkpoint.
        data: the data already loaded by :func:`load_data` (default: load it here).
        device: overrides ``cfg.device``.
        keep_checkpoints: keep each model's last checkpoint after it finishes.
        experiment: the ``rcdl reproduce`` subcommand named in the resume command printed
            on Ctrl-C (the τ sweep runs through here too).

    Returns:
        The run folder and its summary (the content of ``summary.json``).
    """
    start = time.perf_counter()
    device = resolve_device(cfg.device) if device is None else torch.device(device)
    if resume is not None and out is not None:
        raise ValueError("give either out (a new run) or resume (an existing one), not both")
    if data is None:
        data = load_data(cfg, download=download)
    rank, world = rank_and_world()  # under torchrun, rank 0 writes the run folder
    if world > 1:
        flat = [m for m in cfg.models if not _is_growing(m)]
        if flat:
            raise ValueError(f"under torchrun the growing models' stores are sharded over the "
                             f"{world} ranks; {', '.join(flat)} have no growing stores: run "
                             "them without torchrun")
    if resume is None:
        run = rank0_run(partial(RunDir.create, EXPERIMENT, path=out, config=cfg, device=device))
        summary = {"experiment": EXPERIMENT, "complete": False, "runs": [], "sessions": []}
    else:
        run = rank0_run(partial(RunDir, resume))
        summary = _resumable_summary(run, cfg)
    progress = progress and rank == 0
    session = {**environment_info(device), "world_size": world, "seconds": None}
    summary["sessions"].append(session)
    summary["data"] = {**data.describe(), "provenance": data_provenance(data.source),
                       "data_seed": cfg.data_seed}
    tensors = tuple(t.to(device) if device.type == "cuda" else t for t in
                    (data.x_train.to(cfg.torch_dtype), data.y_train,
                     data.x_test.to(cfg.torch_dtype), data.y_test))  # fmt: skip

    finished = {(r["model"], r["seed"]) for r in summary["runs"]}
    try:
        for name in cfg.models:
            for seed in cfg.seeds:
                if (name, seed) in finished:
                    print(f"{_run_name(name, seed)}: finished in an earlier session, skipped")
                else:
                    summary["runs"].append(
                        _train(name, seed, cfg, tensors, run, device, progress)
                    )
                    summary["models"] = model_rows(summary["runs"], cfg.models)
                    session["seconds"] = time.perf_counter() - start
                    run.write_summary(summary)
                    release_memory(device)
                if not keep_checkpoints and not model_spec(name).classical:
                    _checkpoint_path(run, name, seed).unlink(missing_ok=True)
                    if rank == 0:
                        run.file(f"checkpoints/{_run_name(name, seed)}.manifest.json").unlink(
                            missing_ok=True)
    except KeyboardInterrupt:
        command = resume_command(f"rcdl reproduce {experiment}", run.path, cfg.data_dir)
        print(f"\nInterrupted. Continue with: {command}", file=sys.stderr)
        raise
    checkpoints = run.file("checkpoints")
    if checkpoints.is_dir() and not any(checkpoints.iterdir()):
        with contextlib.suppress(OSError):  # under torchrun another rank may remove it first
            checkpoints.rmdir()

    summary["models"] = model_rows(summary["runs"], cfg.models)
    summary["complete"] = True
    session["seconds"] = time.perf_counter() - start
    if rank != 0:
        return run, summary
    report = write_report(run, cfg, summary, device)
    run.write_summary(summary)
    print("\n" + report, end="")
    print(f"Session time {session['seconds']:.1f} s. Run folder: {run.path}")
    return run, summary


def _resumable_summary(run: RunDir, cfg: Cifar10Config) -> dict[str, Any]:
    """The summary to continue, after checking ``cfg`` is the run's own."""
    saved = load_run_config(run.path)
    mine, theirs = asdict(replace(cfg, data_dir=None, device="auto")), asdict(
        replace(saved, data_dir=None, device="auto"))
    if mine != theirs:
        diff = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs[k]}
        raise ValueError(f"{run.path}: the config differs from the saved one (saved, given): "
                         f"{diff}")
    path = run.file(RunDir.SUMMARY)
    if not path.exists():  # interrupted during its first model
        return {"experiment": EXPERIMENT, "complete": False, "runs": [], "sessions": []}
    summary = json.loads(path.read_text(encoding="utf-8"))
    summary["runs"] = [r for r in summary["runs"]
                       if r["model"] in cfg.models and r["seed"] in cfg.seeds]
    summary.setdefault("sessions", [])
    return summary


# --------------------------------------------------------------------------- reporting


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def model_rows(runs: list[dict[str, Any]], models: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per model, its runs' numbers averaged over seeds (accuracy in percent)."""
    rows = []
    for name in models:
        rs = [r for r in runs if r["model"] == name]
        if not rs:
            continue
        acc, acc_sd = _mean_sd([100 * r["test_acc"] for r in rs])
        losses = [r["test_loss"] for r in rs if r["test_loss"] is not None]
        loss, loss_sd = _mean_sd(losses) if losses else (None, None)
        ref = model_spec(name).reference
        rows.append({
            "model": name, "seeds": [r["seed"] for r in rs],
            "test_acc_pct": acc, "test_acc_pct_sd": acc_sd,
            "test_loss": loss, "test_loss_sd": loss_sd,
            "entries": rs[0]["entries"], "possible_entries": rs[0].get("possible_entries"),
            "store_bytes": rs[0]["bytes"],
            "parameters": rs[0]["parameters"],
            "train_seconds": statistics.fmean(r["train_seconds"] for r in rs),
            "eval_seconds": statistics.fmean(r["eval_seconds"] for r in rs),
            "paper_test_acc_pct": ref.test_acc, "paper_test_loss": ref.test_loss,
            "paper_entries": ref.entries,
            "paper_seeds_acc_pct": None if ref.seeds_acc is None else list(ref.seeds_acc),
        })  # fmt: skip
    return rows


def _pm(mean: float, sd: float | None, digits: int) -> str:
    return f"{mean:.{digits}f}" if sd is None else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def results_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`model_rows`."""
    lines = [
        "| model | seeds | test acc. % | test loss | entries | store | parameters | train s "
        "| eval s | paper (docs/reference.md §6) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        entries = "—" if r["entries"] is None else f"{r['entries']:,}"
        possible = r.get("possible_entries")
        if possible and r["entries"] is not None and r["entries"] < possible:
            entries += f" ({100 * r['entries'] / possible:.1f} % of {possible:,})"
        store = "—" if r["store_bytes"] is None else format_bytes(r["store_bytes"])
        lines.append(
            f"| {r['model']} | {' '.join(map(str, r['seeds']))} "
            f"| {_pm(r['test_acc_pct'], r['test_acc_pct_sd'], 2)} "
            f"| {'—' if r['test_loss'] is None else _pm(r['test_loss'], r['test_loss_sd'], 3)} "
            f"| {entries} | {store} "
            f"| {r['parameters']:,} | {r['train_seconds']:.1f} | {r['eval_seconds']:.1f} "
            f"| {model_spec(r['model']).reference.describe()} |"
        )
    return "\n".join(lines)


def results_csv(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`model_rows` as CSV (empty cells where a value does not apply)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = [k for k in rows[0] if k != "paper_seeds_acc_pct"] if rows else []
    writer.writerow([*columns, "paper_seeds_acc_pct_mean", "paper_seeds_acc_pct_sd"])
    for r in rows:
        seeds_acc = r["paper_seeds_acc_pct"] or [None, None]
        cells = [" ".join(map(str, r[k])) if k == "seeds" else r[k] for k in columns]
        writer.writerow(["" if v is None else v for v in (*cells, *seeds_acc)])
    return buf.getvalue()


def plot_accuracy(runs: list[dict[str, Any]], models: tuple[str, ...], path: Path, *,
                  title: str, full_data: bool) -> Path:
    """Test accuracy against training samples seen, one line per model (mean over seeds,
    a band of ± sd with several seeds); with the full data, the paper's final accuracies
    as stars at the end."""
    fig = Figure(figsize=(7.2, 4.6), layout="constrained")
    ax = fig.add_subplot()
    for name in models:
        histories = [r["history"] for r in runs if r["model"] == name]
        if not histories:
            continue
        n = min(map(len, histories))
        samples = [histories[0][i]["samples"] for i in range(n)]
        accs = [[100 * h[i]["test_acc"] for h in histories] for i in range(n)]
        mean = [statistics.fmean(a) for a in accs]
        (line,) = ax.plot(samples, mean, marker=".", label=name)
        if len(histories) > 1:
            sd = [statistics.stdev(a) for a in accs]
            ax.fill_between(samples, [m - s for m, s in zip(mean, sd, strict=True)],
                            [m + s for m, s in zip(mean, sd, strict=True)],
                            color=line.get_color(), alpha=0.2)
        ref = model_spec(name).reference.test_acc
        if full_data and ref is not None:
            ax.plot([samples[-1]], [ref], marker="*", markersize=10, color=line.get_color(),
                    linestyle="none")
    ax.set(xlabel="training samples seen", ylabel="test accuracy (%)", title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", ncols=2)
    return save_figure(fig, path)



_TABLE_NOTE = (
    "Accuracy and loss: mean ± sd over seeds. Entries and store: all layers at the end. "
    "Train and eval seconds: mean per seed. Paper: the authors' one-seed run on one GPU, "
    "with full data (\"seeds\": the tuned baselines' mean ± sd over seeds)."
)


def _protocol_text(cfg: Cifar10Config, d: Mapping[str, Any], seeds: list[int]) -> str:
    """The sentence on sizes, schedule and seeds above a results table."""
    full = d["n_train"] == 50_000 and d["n_test"] == 10_000
    scale = ("the full splits" if full else
             f"random subsets (data seed {cfg.data_seed}); not comparable with the paper's "
             "full-data numbers")
    steps = math.ceil(d["n_train"] / cfg.batch_size)
    stores = "" if cfg.store_dtype is None else f" with {cfg.store_dtype} stores"
    return (
        f"{d['n_train']:,} train / {d['n_test']:,} test images ({scale}). One pass, batch "
        f"{cfg.batch_size} ({steps:,} steps), cross-entropy, {cfg.dtype}{stores}. Test accuracy "
        f"and loss on all {d['n_test']:,} test images every {cfg.eval_every} "
        f"step{'s' if cfg.eval_every > 1 else ''} and at the end. Seeds: "
        f"{' '.join(map(str, seeds))}."
    )


def write_report(run: RunDir, cfg: Cifar10Config, summary: dict[str, Any],
                 device: torch.device) -> str:
    """Write ``results.md``, ``results.csv`` and ``test_accuracy.png``; return the markdown."""
    d = summary["data"]
    report = (
        f"# CIFAR-10, one epoch (the paper's Fig. 2, docs/reference.md §6)\n\n"
        f"{_protocol_text(cfg, d, list(cfg.seeds))}\n\n"
        f"{results_table(summary['models'])}\n\n{_TABLE_NOTE}\n\n"
        f"Data: {d['source']}, {d['provenance']}.\n"
        f"Machine: {describe_machine(device)}.\n"
    )
    _write_outputs(run.path, report, summary, cfg.models)
    return report


def _write_outputs(folder: Path, report: str, summary: dict[str, Any],
                   models: tuple[str, ...]) -> None:
    """``results.md`` (the given report), ``results.csv`` and ``test_accuracy.png``."""
    d = summary["data"]
    full = d["n_train"] == 50_000 and d["n_test"] == 10_000
    atomic_write_text(report, folder / "results.md")
    atomic_write_text(results_csv(summary["models"]), folder / "results.csv")
    title = f"CIFAR-10, one epoch, {d['n_train']:,} training images"
    plot_accuracy(summary["runs"], models, folder / "test_accuracy.png", title=title,
                  full_data=full)


# --------------------------------------------------------------------------- combining runs

# settings that may differ between runs combined into one table (the rest is the protocol)
_PER_RUN_SETTINGS = ("models", "seeds", "data_dir", "device", "checkpoint", "checkpoint_every",
                     "incremental_eval")


def _finished_runs(run_dir: Path) -> tuple[Cifar10Config | None, dict[str, Any]]:
    """The config and summary of ``run_dir``; an error if no (model, seed) pair finished.

    A folder written by :func:`combine_runs` (a ``summary.json`` with ``combined_from`` and no
    ``config.json``, e.g. a committed table) has no config: ``(None, summary)``."""
    path = run_dir / RunDir.SUMMARY
    if not (run_dir / RunDir.CONFIG).is_file() and path.is_file():
        summary = json.loads(path.read_text(encoding="utf-8"))
        if "combined_from" in summary:
            return None, summary
    cfg = load_run_config(run_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no {RunDir.SUMMARY}, so no model finished there")
    summary = json.loads(path.read_text(encoding="utf-8"))
    if not summary.get("runs"):
        raise ValueError(f"{run_dir}: no model finished there ({path} lists no runs)")
    return cfg, summary


def _protocol(cfg: Cifar10Config, data: Mapping[str, Any]) -> dict[str, Any]:
    """What must agree between runs for their numbers to share a table."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in _PER_RUN_SETTINGS}
    return {**settings, "n_train": data["n_train"], "n_test": data["n_test"],
            "provenance": data.get("provenance")}


def _table_position(model: str) -> tuple[int, int]:
    """Where a model goes in a combined table: registry order, ``hybrid-*`` beside
    ``hybrid`` and ``psoftmax-<N>`` beside the parametric softmaxes, others last."""
    names = list(MODELS)
    if model in MODELS:
        return names.index(model), 0
    if _HYBRID.fullmatch(model):
        return names.index("hybrid"), 1
    if model.startswith("psoftmax-"):
        return names.index("psoftmax-50016"), 1
    return len(names), 0


def combine_runs(run_dirs: list[str | Path], out: str | Path,
                 models: list[str] | tuple[str, ...] | None = None,
                 ) -> tuple[Path, dict[str, Any]]:
    """One table and figure from the finished (model, seed) pairs of several run folders.

    Full-scale models take an hour each on a CPU, so the comparison is made over several
    invocations (and sessions, and machines). This merges their ``summary.json`` files
    after checking that they share the protocol (sizes, batch, evaluation schedule, dtype,
    data seed and data provenance); a (model, seed) pair finished in two folders is an
    error. Unfinished pairs of an interrupted run are not in its summary and are ignored.
    ``models`` keeps only those models (each must have finished in some folder). A folder
    that is itself a combined table (one written here, e.g. a committed one) may be a source
    too: its runs keep their own sources, so a new model can be added to a table whose
    original run folders are gone.

    Writes into ``out``: ``summary.json`` (the runs, per-model rows and, per source
    folder, its path, models, sessions and environment), ``results.md``, ``results.csv``
    and ``test_accuracy.png``. Models are ordered as in :data:`MODELS` (``hybrid-*`` and
    other ``psoftmax-<N>`` beside their kin), then by first appearance.
    """
    if not run_dirs:
        raise ValueError("combine: give at least one run folder")
    folders = [Path(p) for p in run_dirs]
    loaded = [(folder, *_finished_runs(folder)) for folder in folders]
    with_config = [entry for entry in loaded if entry[1] is not None]
    if not with_config:
        raise ValueError("combine: give at least one run folder (not only combined tables): "
                         "its config describes the protocol")
    first_folder, first_cfg, first_summary = with_config[0]
    protocol = _protocol(first_cfg, first_summary["data"])
    runs: list[dict[str, Any]] = []
    origin: dict[tuple[str, int], Path] = {}
    sources = []
    for folder, cfg, summary in loaded:
        # a combined table (no config) states its protocol; its runs keep their sources
        theirs = ({"store_dtype": None, **summary["protocol"]} if cfg is None  # older tables
                  else _protocol(cfg, summary["data"]))
        if theirs != protocol:
            diff = {k: (protocol[k], theirs[k]) for k in protocol if protocol[k] != theirs[k]}
            raise ValueError(f"combine: {folder} used another protocol than {first_folder} "
                             f"(theirs first, then this one's): {diff}")
        for r in summary["runs"]:
            if models is not None and r["model"] not in models:
                continue
            key = (r["model"], r["seed"])
            if key in origin:
                raise ValueError(f"combine: {r['model']} seed {r['seed']} finished in both "
                                 f"{origin[key]} and {folder}; leave one of them out")
            origin[key] = folder
            runs.append({**r, "source": r["source"] if cfg is None else str(folder)})
        if cfg is None:
            for src in summary["combined_from"]:
                kept = [m for m in src["models"]
                        if any(r["source"] == src["path"] and r["model"] == m for r in runs)]
                if kept:
                    sources.append({**src, "models": kept})
            continue
        environment = folder / RunDir.ENVIRONMENT
        sources.append({
            "path": str(folder),
            "models": list(dict.fromkeys(r["model"] for r in summary["runs"]
                                         if models is None or r["model"] in models)),
            "sessions": summary.get("sessions", []),
            "environment": (json.loads(environment.read_text(encoding="utf-8"))
                            if environment.is_file() else None),
        })  # fmt: skip
    present = list(dict.fromkeys(r["model"] for r in runs))
    missing = [m for m in models or () if m not in present]
    if missing:
        raise ValueError(f"combine: {', '.join(missing)} finished in none of "
                         f"{', '.join(str(f) for f in folders)}")
    models = tuple(sorted(present, key=_table_position))
    combined = {"experiment": EXPERIMENT, "combined_from": sources,
                "data": first_summary["data"], "protocol": protocol, "runs": runs,
                "models": model_rows(runs, models)}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(combined, folder / RunDir.SUMMARY)
    report = _combined_report(first_cfg, combined, [r["seed"] for r in runs])
    _write_outputs(folder, report, combined, models)
    return folder, combined


def _combined_report(cfg: Cifar10Config, combined: dict[str, Any], seeds: list[int]) -> str:
    d = combined["data"]
    lines = []
    for source in combined["combined_from"]:
        sessions = source["sessions"]
        machines = sorted({f"{s.get('cpu_count')} CPUs, {s.get('num_threads')} threads, "
                           f"{s.get('device')}" for s in sessions})
        revisions = sorted({(s.get("git_revision") or "?")[:10] for s in sessions})
        minutes = sum(s.get("seconds") or 0 for s in sessions) / 60
        lines.append(f"- `{source['path']}`: {', '.join(source['models'])}; "
                     f"{len(sessions)} session(s), {minutes:.0f} min in all; "
                     f"{'; '.join(machines)}; git {', '.join(revisions)}")
    return (
        f"# CIFAR-10, one epoch (the paper's Fig. 2, docs/reference.md §6), combined\n\n"
        f"{_protocol_text(cfg, d, sorted(set(seeds)))}\n\n"
        f"{results_table(combined['models'])}\n\n{_TABLE_NOTE}\n\n"
        f"Data: {d['source']}, {d['provenance']}.\n\n"
        "Combined from these run folders (`rcdl reproduce cifar10-1epoch --combine`):\n"
        + "\n".join(lines) + "\n"
    )
