"""Learning classes one task after another without replay, and memories that are kept but
no longer retrieved (docs/continual.md).

Run it with ``rcdl reproduce continual``. Split CIFAR-10, class-incremental: the ten classes
in ``T = 10 / classes_per_task`` tasks — ``(0, 1), (2, 3), …, (8, 9)`` in the natural
order ``"0"``, or the classes of a random order (``"random-K"``, a permutation drawn from
``K``, or ten digits naming one) cut into tasks the same way. Each task's training images
are seen once, in batches of 16 (the one-epoch protocol of docs/cifar10.md), in a random
order drawn from the seed; no image of an earlier task is replayed, and the test images
are classified by one 10-way head with no task label.

Models (``models``):

- the growing networks of the one-epoch comparison (``gws``, ``gauge``, ``rbf``,
  ``hybrid``, with their paper settings, :mod:`rcdl.app.experiments.cifar10_models`);
  they learn by writing entries and remove none;
- the ResNet-MLP fine-tuned with ``mlp-sgd`` / ``mlp-adam`` (or any other network of the
  zoo), and with EWC (``mlp-ewc``) and LwF (``mlp-lwf``) on the ResNet-MLP with
  ``regularised_base``'s optimizer (:mod:`rcdl.app.experiments.continual_baselines`, which
  says why they are not Avalanche's);
- any network with the labels trick (``rbf+labels``: the loss over the task's classes
  only, so a growing layer's new entries touch only their logits; ``rbf+batch-labels``:
  over the batch's classes), :class:`~rcdl.app.experiments.continual_baselines.LabelsTrick`;
- any growing network read out by the labels of the samples that wrote its readout's
  entries (``rbf+vote``, ``rbf+labels+vote``): each class's kernel mass at the query, the
  readout's kernel sharpened by ``vote_sharpness``,
  :class:`~rcdl.app.experiments.continual_baselines.LabelVote`;
- PEC (``pec``, Zając et al. 2024): one student per class imitating a frozen random
  teacher, on raw pixels, :class:`~rcdl.app.experiments.continual_baselines.PEC`;
- on raw pixels, classifiers whose result does not depend on the order of the images:
  kNN with the L2 or cosine distance (``knn-l2``, ``knn-cosine``; ``k`` chosen on a
  held-out 10 % of the images seen so far, :func:`rcdl.app.classical.fit_knn`), the
  nearest class mean (``ncm``) and streaming LDA (``slda``).

Measured, for each (model, order, seed) — one sub-run:

- the accuracy matrix ``R[i][j]``: accuracy (percent, 10-way) on the test images of task
  ``j``'s classes after learning task ``i`` (all ``j``; the metrics use ``j ≤ i``), and the
  same with a task-aware head (the argmax over task ``j``'s own classes only);
- the final accuracy on all ten classes; the average incremental accuracy
  (:func:`average_incremental_accuracy`); the backward transfer
  (:func:`backward_transfer`) of both matrices and the forgetting (:func:`forgetting`);
- after the last task, for a growing model, per task, the *silent memories*: how many of
  the entries the task wrote are still stored, and the accuracy on its test images of a
  copy of the model that keeps, in every growing layer, only the entries its training
  images wrote (and the initial entries, which no image wrote): :func:`own_entries_copy`.
  Restriction, not re-weighting: it is exact, takes nothing to tune, and asks one plain
  question — can the task's own entries still classify its images? (docs/continual.md).
  A parametric network has nothing to restrict. And the signed value mass the readout's
  entries put on each class, by the task that wrote them (:func:`value_mass`).

and for each (model, seed) the i.i.d. reference: one pass over the same training images
shuffled over all classes (EWC and LwF: their network and optimizer, which is plain
training with one task). The gap is i.i.d. minus class-incremental final accuracy.

Scale. The whole CIFAR-10 is far beyond two CPU cores: the defaults train networks in 90
class-incremental sub-runs and 21 i.i.d. ones (and fit the raw-pixel classifiers in 36 and
12 more), each full-width ResNet-MLP pass over all 50 000 images. The defaults are 2 000
training and 1 000 test images (random subsets: about 200 training images per class, 25
steps per task); most of their time is the ResNet-MLPs' passes (run times in
docs/continual.md, "Time").
``--train-size all --test-size all`` is the whole CIFAR-10, for a GPU; ``--full`` is that
with the natural order and ``random-1``, seed 0, and the models of :data:`FULL`.
"""

from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from rcdl.app.cifar import CifarData, cifar_summary, load_subsets
from rcdl.app.classical import fit_knn
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.experiments.cifar10_models import build_model, model_spec
from rcdl.app.experiments.continual_baselines import (
    EWC,
    PEC,
    LabelsTrick,
    LabelVote,
    LwF,
    NearestClassMean,
    PlainLoss,
    StreamingLDA,
)
from rcdl.app.report import csv_text, markdown_table, mean_sd, pm, write_outputs
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.app.runner import Experiment, Session
from rcdl.memory.forgetting import forget
from rcdl.memory.provenance import UNKNOWN, entry_samples, samples
from rcdl.nn.layers import growing_layers
from rcdl.train.loop import epoch_permutation, predict, train_step

__all__ = ["ANCHORS", "EXPERIMENT", "EXPERIMENT_SPEC", "ContinualConfig",
           "average_incremental_accuracy", "backward_transfer", "class_order",
           "entries_by_task", "forgetting", "iid_base", "model_kind", "own_entries_copy",
           "rows", "run_sequence", "task_split"]

EXPERIMENT = "continual"
CLASSES = 10
REGULARISED = {"mlp-ewc": "EWC", "mlp-lwf": "LwF"}
PIXELS = {"knn-l2": "kNN, L2", "knn-cosine": "kNN, cosine", "ncm": "nearest class mean",
          "slda": "streaming LDA", "pec": "PEC"}
# the labels trick as a switch of any network: a name's suffix, and the scope it restricts to
LABELS = {"+labels": "task", "+batch-labels": "batch"}
# a growing network read out by its readout entries' labels (continual_baselines.LabelVote)
VOTE = "+vote"
# Split CIFAR-10, class-incremental, 5 tasks (DER, Buzzega et al. 2020, Table 2: ResNet-18,
# 50 epochs per task): final accuracy in percent; and 1-NN on raw pixels
ANCHORS = {"fine-tuning": 19.62, "EWC (online)": 19.49, "SI": 19.48, "LwF": 19.61,
           "1-NN raw pixels": "35–39"}
_RANDOM = re.compile(r"random-([0-9]+)")


# --------------------------------------------------------------------------- tasks


def class_order(order: str) -> tuple[int, ...]:
    """The ten classes in the order the tasks take them: ``"0"`` the natural order,
    ``"random-K"`` a permutation drawn from ``K`` (``torch.randperm`` with seed ``K``), or
    ten distinct digits (``"1032547698"``).

    Raises:
        ValueError: for any other string.
    """
    if order == "0":
        return tuple(range(CLASSES))
    match = _RANDOM.fullmatch(order)
    if match:
        gen = torch.Generator().manual_seed(int(match.group(1)))
        return tuple(torch.randperm(CLASSES, generator=gen).tolist())
    if len(order) == CLASSES and order.isdigit() and len(set(order)) == CLASSES:
        return tuple(int(c) for c in order)
    raise ValueError(f"unknown class order {order!r}: expected '0' (natural), 'random-K' "
                     "(a permutation drawn from K) or the ten digits 0-9 in some order")


def task_split(order: str, classes_per_task: int = 2) -> tuple[tuple[int, ...], ...]:
    """The tasks of ``order``: its classes cut into consecutive groups of
    ``classes_per_task`` (``"0"``, 2: ``(0, 1), (2, 3), …, (8, 9)``)."""
    if classes_per_task < 1 or CLASSES % classes_per_task:
        raise ValueError(f"classes_per_task must divide {CLASSES}, got {classes_per_task}")
    classes = class_order(order)
    return tuple(classes[i : i + classes_per_task]
                 for i in range(0, CLASSES, classes_per_task))


# --------------------------------------------------------------------------- metrics


def _lower(matrix: Sequence[Sequence[float | None]]) -> int:
    """The number of tasks ``T`` of a square accuracy matrix (checked)."""
    t = len(matrix)
    if t == 0 or any(len(row) != t for row in matrix):
        raise ValueError(f"expected a square T × T accuracy matrix, got rows of lengths "
                         f"{[len(row) for row in matrix]}")
    return t


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def average_incremental_accuracy(matrix: Sequence[Sequence[float | None]]) -> float | None:
    """Rebuffi et al. (iCaRL, 2017): the mean over the steps ``i`` of the accuracy on every
    class seen so far, ``(1/T) Σ_i (1/i) Σ_{j≤i} R[i][j]`` (tasks of equal test size;
    ``None`` entries, tasks without test images, left out)."""
    t = _lower(matrix)
    return _mean([_mean(matrix[i][: i + 1]) for i in range(t)])


def backward_transfer(matrix: Sequence[Sequence[float | None]]) -> float | None:
    """Lopez-Paz & Ranzato (GEM, 2017): ``(1/(T−1)) Σ_{j<T} (R[T][j] − R[j][j])``, how much
    learning the later tasks changed the accuracy on each earlier one (negative: forgotten;
    ``None`` for one task)."""
    t = _lower(matrix)
    changes: list[float | None] = []
    for j in range(t - 1):
        last, learnt = matrix[-1][j], matrix[j][j]
        changes.append(None if last is None or learnt is None else last - learnt)
    return _mean(changes)


def forgetting(matrix: Sequence[Sequence[float | None]]) -> float | None:
    """Chaudhry et al. (RWalk, 2018): ``(1/(T−1)) Σ_{j<T} max_{i<T} (R[i][j] − R[T][j])``
    over ``i ≥ j``, the drop from each earlier task's best accuracy to its last."""
    t = _lower(matrix)
    drops: list[float | None] = []
    for j in range(t - 1):
        best = [v for i in range(j, t - 1) if (v := matrix[i][j]) is not None]
        last = matrix[-1][j]
        drops.append(None if not best or last is None else max(best) - last)
    return _mean(drops)


# --------------------------------------------------------------------------- the config


def model_kind(name: str) -> str:
    """``"growing"``, ``"parametric"`` (trained by an optimizer; EWC and LwF too) or
    ``"pixels"`` (an order-independent classifier on raw pixels)."""
    if name in PIXELS:
        return "pixels"
    if name in REGULARISED:
        return "parametric"
    trained, vote = label_vote(name)
    if vote:
        if model_kind(trained) != "growing":
            raise ValueError(f"{name!r}: the label vote reads a growing readout's entries "
                             f"(rbf+vote, rbf+labels+vote, ...), not {trained}'s")
        return "growing"
    base, scope = labels_trick(name)
    if VOTE in base:
        raise ValueError(f"{name!r}: write the label vote last (NAME+labels+vote)")
    if scope is not None and (base in PIXELS or base in REGULARISED):
        raise ValueError(f"{name!r}: the labels trick is a switch of a network trained by its "
                         f"loss (gws+labels, rbf+labels, mlp-adam+labels, ...), not of {base}")
    spec = model_spec(base)
    if spec.classical:
        raise ValueError(f"{name!r} is not a baseline of this experiment; the raw-pixel "
                         f"ones are {', '.join(PIXELS)}")
    return "growing" if spec.growing else "parametric"


def label_vote(name: str) -> tuple[str, bool]:
    """``(the model trained, whether it is read out by its labels)``: ``"rbf+labels+vote"``
    is ``("rbf+labels", True)``."""
    return name.removesuffix(VOTE), name.endswith(VOTE)


def labels_trick(name: str) -> tuple[str, str | None]:
    """``(the network, the labels trick's scope or None)`` of model ``name`` (a label vote
    dropped): ``"rbf+labels"`` is ``("rbf", "task")``, ``"rbf+batch-labels"``
    ``("rbf", "batch")``, ``"rbf"`` ``("rbf", None)``."""
    name = label_vote(name)[0]
    for suffix, scope in LABELS.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix), scope
    return name, None


def iid_base(name: str, regularised_base: str) -> str:
    """The model whose i.i.d. one-pass run is ``name``'s reference: EWC and LwF train
    ``regularised_base``'s network with its optimizer (one task: plain training), and the
    labels trick over the task's classes is plain training when one task holds every class
    (``rbf+labels``: ``rbf``'s run). The batch-scoped trick changes i.i.d. training too, so
    it is its own reference. A label vote reads the i.i.d.-trained network the same way
    (``rbf+labels+vote``: ``rbf+vote``'s run)."""
    if name in REGULARISED:
        return regularised_base
    trained, vote = label_vote(name)
    base, scope = labels_trick(trained)
    return (base if scope == "task" else trained) + (VOTE if vote else "")


def _size(text: str) -> int | None:
    """A subset size on the command line: a number, or ``all`` (``None``)."""
    return None if text == "all" else int(text)


@dataclass(frozen=True)
class ContinualConfig(ExperimentConfig):
    """Settings of the class-incremental experiment (module docstring; run times in
    docs/continual.md, "Time")."""

    QUICK = {"train_size": 300, "test_size": 300, "seeds": (0,), "orders": ("0",),
             "models": ("gws", "gauge", "rbf", "hybrid", "mlp-adam", "mlp-ewc", "mlp-lwf",
                        "knn-l2", "knn-cosine", "ncm", "slda")}

    models: tuple[str, ...] = setting(
        ("gws", "gauge", "rbf", "rbf+labels", "rbf+vote", "mlp-sgd", "mlp-adam", "mlp-ewc",
         "mlp-lwf", "pec", "knn-l2", "knn-cosine", "ncm", "slda"),
        "models: growing networks, networks of the zoo fine-tuned, either with the labels "
        "trick (NAME+labels: the task's classes, NAME+batch-labels: the batch's), a "
        "growing network read out by its entries' labels (NAME+vote, NAME+labels+vote), "
        "mlp-ewc / mlp-lwf, pec, and the raw-pixel knn-l2, knn-cosine, ncm, slda",
        metavar="NAME")
    orders: tuple[str, ...] = setting(
        ("0", "random-1", "random-2"), "class orders: 0 (natural), random-K (drawn from K) "
        "or ten digits", metavar="ORDER")
    classes_per_task: int = setting(2, "classes per task (divides 10)", metavar="C")
    seeds: tuple[int, ...] = setting((0, 1, 2), "seeds (initialisation, order of the "
                                     "images within each task)", minimum=0, metavar="K")
    train_size: int | None = setting(2000, "random subset of N training images (all: the "
                                     "whole split)", metavar="N", parse=_size)
    test_size: int | None = setting(1000, "random subset of N test images (all: the whole "
                                    "split)", metavar="N", parse=_size)
    batch_size: int = setting(16, "samples per step B", metavar="B")
    eval_batch_size: int = setting(500, "images per prediction batch", metavar="N")
    regularised_base: str = setting("mlp-adam", "the network and optimizer EWC and LwF train "
                                    "(a ResNet-MLP of the zoo)", metavar="NAME")
    ewc_lambda: float = setting(1e8, "EWC's penalty strength λ (1e8: the best final "
                                "accuracy of 1e2-1e9 at the default size; docs/continual.md)",
                                positive=True, metavar="λ")
    lwf_alpha: float = setting(100.0, "LwF's distillation weight λ_o (100: the best final "
                               "accuracy of 1-1000 at the default size; docs/continual.md)",
                               positive=True, metavar="λ_o")
    lwf_temperature: float = setting(2.0, "LwF's temperature T", positive=True, metavar="T")
    vote_sharpness: float = setting(4.0, "NAME+vote: the readout's temperature is divided "
                                    "by s for the label vote (4: chosen on seed 0, orders 0 "
                                    "and random-1; docs/continual.md)", positive=True,
                                    metavar="s")
    slda_shrinkage: float = setting(0.5, "streaming LDA's shrinkage ε towards the identity "
                                    "(0.5: chosen on held-out training images at the "
                                    "default size)", positive=True, metavar="ε")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()

    def check(self) -> None:
        for order in self.orders:
            class_order(order)  # raises for an unknown one
        if CLASSES % self.classes_per_task or self.classes_per_task == CLASSES:
            raise ValueError(f"ContinualConfig: classes_per_task must divide {CLASSES} into "
                             f"two tasks or more, got {self.classes_per_task}")
        for name in self.models:
            model_kind(name)  # raises for an unknown one
        if model_kind(self.regularised_base) != "parametric" or self.regularised_base in (
                REGULARISED):
            raise ValueError(f"ContinualConfig: regularised_base must be a network trained "
                             f"by an optimizer (mlp-adam, mlp-sgd, ...), got "
                             f"{self.regularised_base!r}")
        if self.slda_shrinkage > 1:
            raise ValueError(f"ContinualConfig: slda_shrinkage must be at most 1, got "
                             f"{self.slda_shrinkage}")


load_data = partial(load_subsets, "cifar10")


def _label(name: str, cfg: ContinualConfig) -> str:
    if name in PIXELS:
        return f"{PIXELS[name]} (raw pixels)"
    if name in REGULARISED:
        return f"{model_spec(cfg.regularised_base).label}, {REGULARISED[name]}"
    base, scope = labels_trick(name)
    label = model_spec(base).label
    if scope is not None:
        label += f", labels trick ({scope}'s classes)"
    if label_vote(name)[1]:
        label += f", label vote (s = {cfg.vote_sharpness:g})"
    return label


# --------------------------------------------------------------------------- measuring


def _accuracies(scores: Tensor, y: Tensor, tasks: Sequence[Sequence[int]]) -> dict[str, Any]:
    """From the scores ``(M, 10)`` of the test images ``y (M,)``: the accuracy (percent) on
    every image, on each task's images (10-way), and on each task's images with the argmax
    over its own classes only (task-aware); ``None`` for a task without test images."""
    predicted = scores.argmax(1)  # (M,)

    def pct(right: Tensor) -> float | None:
        return 100 * right.float().mean().item() if len(right) else None

    per_task, aware = [], []
    for classes in tasks:
        mine = torch.isin(y, torch.tensor(classes))
        per_task.append(pct(predicted[mine] == y[mine]))
        own = torch.tensor(classes)[scores[mine][:, list(classes)].argmax(1)]
        aware.append(pct(own == y[mine]))
    return {"acc": pct(predicted == y), "per_task": per_task, "task_aware": aware}


def _scores(model: nn.Module, x: Tensor, batch_size: int, device: torch.device) -> Tensor:
    """The model's logits ``(M, 10)`` on ``x``, in eval mode, on the CPU."""
    return predict(model, x, batch_size=batch_size, device=device).float().cpu()


def _learner(name: str, seed: int, cfg: ContinualConfig, device: torch.device,
             reserve: int) -> tuple[nn.Module, Any, Any, PlainLoss]:  # fmt: skip
    """``(model, optimizer, grower, loss)`` of model ``name`` built from ``seed``."""
    base, scope = labels_trick(cfg.regularised_base if name in REGULARISED else name)
    model, optimizer, grower = build_model(base, seed, device=device, reserve=reserve)
    method: PlainLoss = PlainLoss() if scope is None else LabelsTrick(scope)
    if name == "mlp-ewc":
        method = EWC(model, cfg.ewc_lambda, generator=torch.Generator().manual_seed(seed))
    elif name == "mlp-lwf":
        method = LwF(cfg.lwf_alpha, cfg.lwf_temperature)
    return model, optimizer, grower, method


def _readout(name: str, model: nn.Module, data: CifarData, cfg: ContinualConfig) -> nn.Module:
    """What answers the test images: the model, or its :class:`LabelVote` for ``NAME+vote``."""
    if not label_vote(name)[1]:
        return model
    device = next(iter(model.buffers())).device
    return LabelVote(model, data.y_train.to(device), cfg.vote_sharpness)


def _task_order(n: int, seed: int, task: int) -> Tensor:  # (n,)
    """The order task ``task``'s ``n`` images are seen in (the i.i.d. run, ``task = -1``,
    is :func:`rcdl.train.loop.epoch_permutation`'s one-pass order)."""
    return epoch_permutation(n, seed if task < 0 else 7919 * (seed + 1) + task, 0)


def _record(out: dict[str, Any], measured: dict[str, Any]) -> None:
    """Add one evaluation (:func:`_accuracies`, after a task) to a sequence's result: a row
    of each matrix, and the accuracy on every test image (the last one is the final)."""
    out["matrix"].append(measured["per_task"])
    out["aware_matrix"].append(measured["task_aware"])
    out["acc"] = measured["acc"]


def _store_entries(model: nn.Module) -> int:
    return sum(len(layer.store) for _, layer in growing_layers(model))


def run_sequence(name: str, seed: int, data: CifarData, tasks: Sequence[Sequence[int]],
                 cfg: ContinualConfig, device: torch.device, *,
                 log: Any = None) -> tuple[nn.Module | None, dict[str, Any]]:  # fmt: skip
    """Model ``name`` trained on ``tasks`` one after another (one task holding every class:
    the i.i.d. run), measured after each. Returns the model (``None`` for a raw-pixel
    classifier) and a JSON-able result: ``matrix`` (``R[i][j]``), ``aware_matrix`` (the same
    with the task-aware head), ``acc`` (final, every test image), ``entries_written`` (per
    task, growing models), ``train_seconds``, ``eval_seconds``."""
    if model_kind(name) == "pixels":
        return None, _pixels_sequence(name, seed, data, tasks, cfg)
    x, y = data.x_train, data.y_train
    model, optimizer, grower, method = _learner(name, seed, cfg, device, reserve=len(y))
    scorer = _readout(name, model, data, cfg)
    out: dict[str, Any] = {"matrix": [], "aware_matrix": [], "entries_written": [],
                           "train_seconds": 0.0, "eval_seconds": 0.0}
    seen: list[int] = []
    for t, classes in enumerate(tasks):
        idx = torch.isin(y, torch.tensor(classes)).nonzero().squeeze(1)  # (n_t,) global
        idx = idx[_task_order(len(idx), seed, -1 if len(tasks) == 1 else t)]
        before, start = _store_entries(model), time.perf_counter()
        method.start_task(classes)
        for step, batch in enumerate(idx.split(cfg.batch_size)):
            xb, yb = x[batch].to(device), y[batch].to(device)
            with samples(model, batch):  # entries remember their training image
                loss = train_step(model, xb, yb, partial(method.loss, x=xb), optimizer, grower)
            if not math.isfinite(loss):
                raise FloatingPointError(f"{name} (seed {seed}): loss {loss} at step {step} "
                                         f"of task {t} (classes {list(classes)})")
        seen += list(classes)
        if t < len(tasks) - 1:  # what EWC and LwF keep serves the tasks still to come
            method.after_task(model, x[idx].to(device), seen)
        out["train_seconds"] += time.perf_counter() - start
        out["entries_written"].append(_store_entries(model) - before)
        start = time.perf_counter()
        measured = _accuracies(_scores(scorer, data.x_test, cfg.eval_batch_size, device),
                               data.y_test, tasks)
        out["eval_seconds"] += time.perf_counter() - start
        _record(out, measured)
        if log is not None:
            log.log(task=t, classes=list(classes), acc=measured["acc"],
                    per_task=measured["per_task"], entries=_store_entries(model))
    return model, out


def _knn_scores(x: Tensor, y: Tensor, x_test: Tensor, metric: str, seed: int) -> Tensor:
    """kNN votes ``(M, 10)`` (one-hot of the prediction): ``k`` chosen by
    :func:`rcdl.app.classical.fit_knn` on a held-out part of ``(x, y)`` (the test images
    play no part in it), then the same vote over the ``k`` nearest of every image."""
    from sklearn.neighbors import NearestNeighbors

    from rcdl.app.classical import _vote

    k = fit_knn(x, y, x_test[:1], y[:1], metric=metric, seed=seed).settings["k"]
    knn = NearestNeighbors(n_neighbors=k, algorithm="brute",
                           metric={"l2": "euclidean", "cosine": "cosine"}[metric])
    neighbours = knn.fit(x.numpy()).kneighbors(x_test.numpy(), return_distance=False)
    predicted = torch.from_numpy(_vote(y.numpy()[neighbours], k, CLASSES))
    return torch.nn.functional.one_hot(predicted.long(), CLASSES).float()


def _pixels_sequence(name: str, seed: int, data: CifarData, tasks: Sequence[Sequence[int]],
                     cfg: ContinualConfig) -> dict[str, Any]:  # fmt: skip
    """:func:`run_sequence` for a raw-pixel classifier: kNN is fitted on the images of
    every task so far (in the subset's order, so that the last fit is the i.i.d. one); NCM
    and streaming LDA add each task's images to their sums."""
    x, y, d = data.x_train, data.y_train, data.x_train.shape[1]
    model: NearestClassMean | StreamingLDA | None = None
    if name == "ncm":
        model = NearestClassMean(d, CLASSES)
    elif name == "slda":
        model = StreamingLDA(d, CLASSES, cfg.slda_shrinkage)
    elif name == "pec":
        return _pec_sequence(seed, data, tasks, cfg)
    out: dict[str, Any] = {"matrix": [], "aware_matrix": [], "train_seconds": 0.0,
                           "eval_seconds": 0.0}
    seen: list[int] = []
    for classes in tasks:
        seen += list(classes)
        start = time.perf_counter()
        if model is not None:
            mine = torch.isin(y, torch.tensor(classes))
            model.update(x[mine], y[mine])
            out["train_seconds"] += time.perf_counter() - start
            start = time.perf_counter()
            scores = model.scores(data.x_test)
        else:
            mine = torch.isin(y, torch.tensor(seen))
            scores = _knn_scores(x[mine], y[mine], data.x_test, name.removeprefix("knn-"),
                                 seed)
        out["eval_seconds"] += time.perf_counter() - start
        measured = _accuracies(scores, data.y_test, tasks)
        _record(out, measured)
    return out


_TEACHER: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}


def _pec_sequence(seed: int, data: CifarData, tasks: Sequence[Sequence[int]],
                  cfg: ContinualConfig) -> dict[str, Any]:  # fmt: skip
    """:func:`run_sequence` for :class:`PEC`: each task's images once, one at a time (the
    paper's batch size), in the order the networks see them; scored after each task. The
    frozen teacher's outputs on the training and test images depend only on the seed, so
    the sub-runs of one seed share them (computed once per process)."""
    pec = PEC(CLASSES, seed=seed)
    key = (seed, id(data.x_train), id(data.x_test))
    start = time.perf_counter()
    if key not in _TEACHER:
        _TEACHER.clear()  # one seed's at a time
        _TEACHER[key] = (pec.targets(data.x_train), pec.targets(data.x_test))
    h_train, h_test = _TEACHER[key]
    out: dict[str, Any] = {"matrix": [], "aware_matrix": [], "train_seconds": 0.0,
                           "eval_seconds": 0.0, "teacher_seconds": time.perf_counter() - start}
    x, y = data.x_train, data.y_train
    for t, classes in enumerate(tasks):
        idx = torch.isin(y, torch.tensor(classes)).nonzero().squeeze(1)
        idx = idx[_task_order(len(idx), seed, -1 if len(tasks) == 1 else t)]
        start = time.perf_counter()
        pec.update(x[idx], y[idx], targets=h_train[idx])
        out["train_seconds"] += time.perf_counter() - start
        start = time.perf_counter()
        scores = pec.scores(data.x_test, targets=h_test)
        out["eval_seconds"] += time.perf_counter() - start
        _record(out, _accuracies(scores, data.y_test, tasks))
    return out


def own_entries_copy(model: nn.Module, keep: Tensor) -> tuple[nn.Module, dict[str, int]]:
    """A deep copy of ``model`` whose growing layers keep only the entries written by the
    training samples ``keep`` (indices) and those of unknown origin (initial entries): in
    the copy, :func:`rcdl.memory.forgetting.forget` removes every other sample's entries; with the
    entries each layer kept."""
    restricted = copy.deepcopy(model)
    layers = growing_layers(restricted)
    owners = torch.cat([entry_samples(layer) for _, layer in layers]).unique()  # (S,)
    others = owners[~torch.isin(owners, keep.to(owners.device)) & (owners != UNKNOWN)]
    forget(restricted, others, scan=False)  # the entries of unknown origin stay
    return restricted, {name: len(layer.store) for name, layer in layers}


def entries_by_task(model: nn.Module, task_of_sample: Tensor, tasks: int) -> list[int]:
    """How many stored entries (over every growing layer) each task's training samples
    wrote; ``task_of_sample (n,)`` maps a sample index to its task."""
    counts = torch.zeros(tasks, dtype=torch.long)
    for _, layer in growing_layers(model):
        owners = entry_samples(layer).cpu()
        counts += torch.bincount(task_of_sample[owners[owners != UNKNOWN]], minlength=tasks)
    return counts.tolist()


def value_mass(model: nn.Module, task_of_sample: Tensor,
               tasks: Sequence[Sequence[int]]) -> list[list[float]]:  # fmt: skip
    """The signed value mass the readout's entries put on each class, by the task whose
    images wrote them: ``M[t][k] = Σ_{j written by task t} v_j[c_k]`` over the readout's
    (the last growing layer's) stored values, ``c_k`` the ``k``-th class of the order
    (the classes of task 1 first). A plain growing readout's write is ``v = −η g`` with
    ``g = softmax(s) − onehot(y)``: positive on the sample's class, negative on the
    classes the model then predicted (docs/continual.md, "Why the retrieval fails")."""
    _, readout = growing_layers(model)[-1]
    owners = entry_samples(readout).cpu()
    values = readout.store.values.detach().double().cpu()  # (N, C)
    known = owners != UNKNOWN
    task = task_of_sample[owners[known]]  # (N_known,)
    order = [c for classes in tasks for c in classes]
    mass = torch.zeros(len(tasks), len(order), dtype=torch.float64)
    mass.index_add_(0, task, values[known][:, order])
    return mass.tolist()


def _silent_memories(name: str, model: nn.Module, data: CifarData,
                     tasks: Sequence[Sequence[int]], cfg: ContinualConfig,
                     device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Per task: the entries its images wrote that are stored after the last task, and the
    accuracy (10-way) on its test images of :func:`own_entries_copy` with its images."""
    task_of_class = torch.empty(CLASSES, dtype=torch.long)
    for t, classes in enumerate(tasks):
        task_of_class[list(classes)] = t
    task_of_sample = task_of_class[data.y_train]  # (n,)
    own = []
    for t in range(len(tasks)):
        restricted, _ = own_entries_copy(model, (task_of_sample == t).nonzero().squeeze(1))
        scores = _scores(_readout(name, restricted, data, cfg), data.x_test,
                         cfg.eval_batch_size, device)
        own.append(_accuracies(scores, data.y_test, tasks)["per_task"][t])
        del restricted
    return {"own_entries": own,
            "entries_stored": entries_by_task(model, task_of_sample, len(tasks)),
            "value_mass": value_mass(model, task_of_sample, tasks)}


def continual_one(name: str, order: str, seed: int, data: CifarData, cfg: ContinualConfig,
                  session: Session) -> dict[str, Any]:  # fmt: skip
    """One sub-run: model ``name`` on the tasks of ``order`` from ``seed`` (module
    docstring); with the silent memories of a growing model."""
    tasks = task_split(order, cfg.classes_per_task)
    log = session.log(model=name, order=order, seed=seed)
    model, out = run_sequence(name, seed, data, tasks, cfg, session.device, log=log)
    result = {"model": name, "order": order, "seed": seed, "kind": model_kind(name),
              "tasks": [list(c) for c in tasks], **out}
    if model is not None and model_kind(name) == "growing":
        start = time.perf_counter()
        result["silent"] = _silent_memories(name, model, data, tasks, cfg, session.device)
        result["silent_seconds"] = time.perf_counter() - start
    return result


def iid_one(name: str, seed: int, data: CifarData, cfg: ContinualConfig,
            session: Session) -> dict[str, Any]:  # fmt: skip
    """The i.i.d. reference of model ``name``: one pass over every training image,
    shuffled over all classes; its accuracy on every test image."""
    _, out = run_sequence(name, seed, data, [tuple(range(CLASSES))], cfg, session.device)
    return {"model": name, "order": "iid", "seed": seed, "kind": model_kind(name),
            "acc": out["acc"], "train_seconds": out["train_seconds"],
            "eval_seconds": out["eval_seconds"]}


def _sub_runs(cfg: ContinualConfig, data: CifarData, session: Session) -> Iterator:
    for seed in cfg.seeds:
        references = dict.fromkeys(iid_base(m, cfg.regularised_base) for m in cfg.models)
        for name in references:
            yield f"iid-{name}-seed{seed}", partial(iid_one, name, seed, data, cfg, session)
        for name in cfg.models:
            for order in cfg.orders:
                yield (f"{name}-{order}-seed{seed}",
                       partial(continual_one, name, order, seed, data, cfg, session))


def _start(cfg: ContinualConfig, data: CifarData) -> dict[str, Any]:
    return {**cifar_summary(cfg, data), "class_names": list(data.class_names),
            "orders": {order: list(class_order(order)) for order in cfg.orders}}


# --------------------------------------------------------------------------- reporting

METRICS = ("acc", "aia", "bwt", "aware_bwt", "forgetting", "iid_acc", "gap", "kept")


def _per_run(run: dict[str, Any], iid: dict[int, float | None]) -> dict[str, float | None]:
    """One class-incremental run's metrics, against the i.i.d. accuracy of its seed."""
    reference = iid.get(run["seed"])
    final = run["acc"]
    return {"acc": final, "aia": average_incremental_accuracy(run["matrix"]),
            "bwt": backward_transfer(run["matrix"]),
            "aware_bwt": backward_transfer(run["aware_matrix"]),
            "forgetting": forgetting(run["matrix"]),
            "iid_acc": reference,
            "gap": None if reference is None else reference - final,
            "kept": None if not reference else 100 * final / reference}


def _iid(cfg: ContinualConfig, runs: list[dict[str, Any]], name: str) -> dict[int, Any]:
    base = iid_base(name, cfg.regularised_base)
    return {r["seed"]: r["acc"] for r in runs if r["order"] == "iid" and r["model"] == base}


def rows(cfg: ContinualConfig, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, order), and one per model over every order (``order="all"``):
    each metric's mean and sd over the runs (seeds × orders)."""
    out = []
    for name in cfg.models:
        iid = _iid(cfg, runs, name)
        for order in ("all", *cfg.orders):
            done = [r for r in runs if r["model"] == name and r["order"] != "iid"
                    and order in ("all", r["order"])]
            if not done:
                continue
            measured = [_per_run(r, iid) for r in done]
            row: dict[str, Any] = {"model": name, "label": _label(name, cfg),
                                   "kind": model_kind(name), "order": order, "runs": len(done)}
            for metric in METRICS:
                row[metric], row[metric + "_sd"] = mean_sd(
                    [v for m in measured if (v := m[metric]) is not None])
            row["train_seconds"], _ = mean_sd([r["train_seconds"] for r in done])
            row["eval_seconds"], _ = mean_sd([r["eval_seconds"] for r in done])
            out.append(row)
    return out


def _mean_matrix(done: list[dict[str, Any]], key: str = "matrix") -> list[list[float | None]]:
    """The element-wise mean of the runs' matrices (by task position)."""
    t = len(done[0][key])
    return [[_mean([r[key][i][j] for r in done]) for j in range(t)] for i in range(t)]


def silent_rows(cfg: ContinualConfig, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model trained by passes and task position: the accuracy on the task's images
    just after learning it (10-way and task-aware), after the last task with the whole
    model (the same two) and, for a growing model, from its own entries alone, and the
    share of its entries still stored (means over seeds and orders)."""
    out = []
    for name in cfg.models:
        done = [r for r in runs if r["model"] == name and r["order"] != "iid"
                and r["kind"] != "pixels"]
        if not done:
            continue
        grown = [r for r in done if "silent" in r]  # growing models: their own entries
        for t in range(len(done[0]["tasks"])):
            row: dict[str, Any] = {"model": name, "task": t + 1, "runs": len(done)}
            for key, values in (
                    ("learnt_acc", [r["matrix"][t][t] for r in done]),
                    ("learnt_aware_acc", [r["aware_matrix"][t][t] for r in done]),
                    ("full_acc", [r["matrix"][-1][t] for r in done]),
                    ("task_aware_acc", [r["aware_matrix"][-1][t] for r in done]),
                    ("own_entries_acc", [r["silent"]["own_entries"][t] for r in grown])):
                row[key], row[key + "_sd"] = mean_sd([v for v in values if v is not None])
            written = [r["entries_written"][t] for r in grown]
            stored = [r["silent"]["entries_stored"][t] for r in grown]
            out.append({**row, "entries_written": _mean(written),
                        "entries_stored": _mean(stored),
                        "stored_pct": 100 * sum(stored) / sum(written) if sum(written) else None})
    return out


KEPT_TARGET = 90.0  # percent of its own i.i.d. one-pass accuracy (docs/continual.md)


def verdict(rows_: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per growing model, over every order and seed: is its final accuracy above every
    non-replay MLP method's and above raw-pixel kNN and streaming LDA (the best of them,
    ``best_knn``), is it above PEC (where PEC was run), and does it keep
    :data:`KEPT_TARGET` percent of its i.i.d. accuracy?"""
    overall = [r for r in rows_ if r["order"] == "all"]
    mlps = [r for r in overall if r["kind"] == "parametric"]
    knns = [r for r in overall if r["model"].startswith("knn-") or r["model"] == "slda"]
    best_mlp = max(mlps, key=lambda r: r["acc"], default=None)
    best_knn = max(knns, key=lambda r: r["acc"], default=None)
    pec = next((r for r in overall if r["model"] == "pec"), None)
    out = {}
    for r in overall:
        if r["kind"] != "growing":
            continue
        out[r["model"]] = {
            "acc": r["acc"], "kept": r["kept"],
            "above_mlps": None if best_mlp is None else r["acc"] > best_mlp["acc"],
            "best_mlp": None if best_mlp is None else best_mlp["model"],
            "above_knn": None if best_knn is None else r["acc"] > best_knn["acc"],
            "best_knn": None if best_knn is None else best_knn["model"],
            "above_pec": None if pec is None else r["acc"] > pec["acc"],
            "most_kept": None if r["kept"] is None else r["kept"] >= KEPT_TARGET}
    return out


def _finish(cfg: ContinualConfig, summary: dict[str, Any]) -> None:
    runs = summary["runs"]
    summary["rows"] = rows(cfg, runs)
    summary["silent"] = silent_rows(cfg, runs)
    summary["verdict"] = verdict(summary["rows"])
    summary["value_mass"] = {
        name: [[_mean([r["silent"]["value_mass"][t][k] for r in done]) or 0.0
                for k in range(len(done[0]["silent"]["value_mass"][0]))]
               for t in range(len(done[0]["silent"]["value_mass"]))]
        for name in cfg.models
        if (done := [r for r in runs if r["model"] == name and r["order"] != "iid"
                     and "value_mass" in r.get("silent", {})])}
    summary["matrices"] = {
        name: _mean_matrix(done) for name in cfg.models
        if (done := [r for r in runs if r["model"] == name and r["order"] != "iid"])}


def _main_table(rows_: list[dict[str, Any]]) -> str:
    body = [(f"{r['model']} ({r['label']})", pm(r["acc"], r["acc_sd"], 1),
             pm(r["aia"], r["aia_sd"], 1), pm(r["bwt"], r["bwt_sd"], 1),
             pm(r["aware_bwt"], r["aware_bwt_sd"], 1),
             pm(r["forgetting"], r["forgetting_sd"], 1), pm(r["iid_acc"], r["iid_acc_sd"], 1),
             pm(r["gap"], r["gap_sd"], 1), pm(r["kept"], r["kept_sd"], 0),
             pm(r["train_seconds"], None, ".3g"), pm(r["eval_seconds"], None, ".3g"))
            for r in rows_ if r["order"] == "all"]
    return markdown_table(("model", "final acc %", "avg incremental acc %", "BWT (pp)",
                           "task-aware BWT (pp)", "forgetting (pp)", "i.i.d. one pass %",
                           "gap (pp)", "kept % of i.i.d.", "train s", "eval s"), body)


def _order_table(cfg: ContinualConfig, rows_: list[dict[str, Any]]) -> str:
    by = {(r["model"], r["order"]): r for r in rows_}
    body = [(name, *(pm(by[name, o]["acc"], by[name, o]["acc_sd"], 1)
                     if (name, o) in by else "—" for o in cfg.orders))
            for name in cfg.models if (name, "all") in by]
    return markdown_table(("model", *(f"{o}: {''.join(map(str, class_order(o)))}"
                                      for o in cfg.orders)), body)


def _silent_table(silent: list[dict[str, Any]]) -> str:
    body = [(r["model"], r["task"],
             "—" if r["stored_pct"] is None else
             f"{r['entries_stored']:,.0f} of {r['entries_written']:,.0f}",
             pm(r["learnt_acc"], r["learnt_acc_sd"], 1),
             pm(r["learnt_aware_acc"], r["learnt_aware_acc_sd"], 1),
             pm(r["full_acc"], r["full_acc_sd"], 1),
             pm(r["task_aware_acc"], r["task_aware_acc_sd"], 1),
             "— (nothing to restrict)" if r["own_entries_acc"] is None and r["stored_pct"] is None
             else pm(r["own_entries_acc"], r["own_entries_acc_sd"], 1)) for r in silent]
    return markdown_table(("model", "task", "entries stored", "just after it, 10-way %",
                           "just after it, task-aware %", "at the end, 10-way %",
                           "at the end, task-aware %", "at the end, own entries only, "
                           "10-way %"), body)


def _verdict_lines(verdicts: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, v in verdicts.items():
        parts = []
        if v["above_mlps"] is not None:
            parts.append(f"{'above' if v['above_mlps'] else 'NOT above'} every MLP method "
                         f"(best: {v['best_mlp']})")
        if v["above_knn"] is not None:
            parts.append(f"{'above' if v['above_knn'] else 'NOT above'} raw-pixel kNN and "
                         f"streaming LDA (best: {v['best_knn']})")
        if v.get("above_pec") is not None:
            parts.append(f"{'above' if v['above_pec'] else 'NOT above'} PEC")
        if v["kept"] is not None:
            parts.append(f"keeps {v['kept']:.0f} % of its i.i.d. accuracy "
                         f"({'at least' if v['most_kept'] else 'NOT'} {KEPT_TARGET:.0f} %)")
        lines.append(f"- **{name}** ({v['acc']:.1f} %): " + "; ".join(parts) + ".")
    return "\n".join(lines) or "No growing model was run."


def write_report(run: RunDir, cfg: ContinualConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv`` and the figures ``continual_matrix.png``,
    ``continual_curves.png`` and ``silent_memories.png``; return the markdown."""
    d, rows_, silent = summary["data"], summary["rows"], summary["silent"]
    tasks = task_split("0", cfg.classes_per_task)
    parts = [
        "# Class-incremental Split CIFAR-10, no replay",
        f"{d['n_train']:,} training / {d['n_test']:,} test CIFAR-10 images (random subsets, "
        f"data seed {cfg.data_seed}); {len(tasks)} tasks of {cfg.classes_per_task} classes, "
        f"one pass over each task's images, batch {cfg.batch_size}, no replay, one 10-way "
        f"head, no task label at test time. Orders: {', '.join(cfg.orders)}; seeds "
        f"{' '.join(map(str, cfg.seeds))}; mean ± sd over every (order, seed). *final*: "
        "accuracy on every test image after the last task; *avg incremental*: the mean over "
        "the tasks of the accuracy on the classes seen so far; *BWT*: mean change on each "
        "earlier task from just after learning it to the end (negative: forgotten); "
        "*task-aware BWT*: the same with the argmax over each task's own classes (what is "
        "lost within a task, not to the competition with later classes); *forgetting*: "
        "mean drop from each earlier task's best to its last accuracy; "
        "*i.i.d.*: one pass over the same images shuffled over all classes (EWC and LwF: "
        f"{cfg.regularised_base}'s); *gap*: i.i.d. minus final; *kept*: final / i.i.d.; "
        "seconds per class-incremental run (kNN's fits count as evaluation).",
        _main_table(rows_),
        "## Final accuracy per class order (%)",
        _order_table(cfg, rows_),
        "## Silent memories: kept, but retrieved?",
        "Per task (by position in its order): the entries its training images wrote that "
        "are still stored after the last task (every growing layer); the accuracy on its "
        "test images just after learning it and after the last task, with the whole model "
        "(10-way, and task-aware: the argmax over its own classes); and after the last task "
        "with a copy of the model whose growing layers keep only the entries its images "
        "wrote (plus the initial ones), 10-way. A parametric network has nothing to "
        "restrict.",
        _silent_table(silent),
        "## Where each task's readout values point",
        "The signed value mass of the readout's stored entries, by the task whose images "
        "wrote them (rows) and the class (columns, in the order's position: task 1's two "
        "classes first), mean over every (order, seed): `value_mass.png`. A plain readout "
        "writes `v = −η g`: each entry raises its own class and lowers the classes the "
        "model predicted when it was written, the earlier tasks' ones; under the labels "
        "trick a task's entries touch only its own classes.",
        _mass_table(summary.get("value_mass", {})),
        "## Verdict",
        "Goal: the best growing model above every non-replay MLP method, above raw-pixel "
        f"kNN and streaming LDA, keeping at least {KEPT_TARGET:.0f} % of its own i.i.d. "
        "accuracy; and, the strongest rehearsal-free peer, PEC (where it was run).",
        _verdict_lines(summary["verdict"]),
        "Anchors (Split CIFAR-10 class-incremental, 5 tasks, ResNet-18, 50 epochs per task, "
        "DER, Buzzega et al. 2020): fine-tuning 19.62 %, online EWC 19.49 %, SI 19.48 %, "
        "LwF 19.61 %; 1-NN on raw pixels about 35–39 % on the whole CIFAR-10. kNN, NCM and "
        "streaming LDA do not depend on the order: their class-incremental accuracy is "
        "their i.i.d. one.",
        f"Data: {d['source']}, {d['provenance']}.\nMachine: {describe_machine(device)}.\n",
    ]
    markdown = "\n\n".join(parts)
    table = ([{"table": "models", **r} for r in rows_]
             + [{"table": "silent memories", **r} for r in silent])
    columns = list(dict.fromkeys(k for r in table for k in r))  # both tables' columns
    return write_outputs(run, markdown, csv_text(table, columns), {
        "continual_matrix.png": partial(plot_matrices, matrices=summary["matrices"]),
        "continual_curves.png": partial(plot_curves, matrices=summary["matrices"]),
        "silent_memories.png": partial(plot_silent, silent=silent),
        **({"value_mass.png": partial(plot_mass, mass=summary["value_mass"])}
           if summary.get("value_mass") else {})})


def _mass_table(mass: dict[str, list[list[float]]]) -> str:
    if not mass:
        return "No growing model was run."
    width = len(next(iter(mass.values()))[0])
    body = [(name, t + 1, *(f"{v:+.1f}" for v in row))
            for name, m in mass.items() for t, row in enumerate(m)]
    return markdown_table(("model", "written by task", *(f"class {k + 1}"
                                                          for k in range(width))), body)


# --------------------------------------------------------------------------- figures


def plot_matrices(path: Any, matrices: dict[str, list[list[float | None]]]) -> None:
    """Per model, the mean accuracy matrix as a heatmap: row ``i`` after task ``i``,
    column ``j`` task ``j``'s classes (``j ≤ i``), the value written in each cell."""
    from matplotlib.figure import Figure

    from rcdl._io import save_figure

    names = list(matrices)
    cols = min(4, len(names))
    grid = math.ceil(len(names) / cols)
    fig = Figure(figsize=(3.1 * cols, 2.9 * grid), layout="constrained")
    axes = fig.subplots(grid, cols, squeeze=False)
    image = None
    for ax, name in zip(axes.flat, names, strict=False):
        m = matrices[name]
        t = len(m)
        values = torch.full((t, t), float("nan"))
        for i in range(t):
            for j in range(i + 1):
                if (v := m[i][j]) is not None:
                    values[i, j] = v
        image = ax.imshow(values.numpy(), vmin=0, vmax=100, cmap="viridis")
        for i in range(t):
            for j in range(i + 1):
                if (v := m[i][j]) is not None:
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7,
                            color="white" if v < 55 else "black")
        ax.set_xticks(range(t), [str(j + 1) for j in range(t)])
        ax.set_yticks(range(t), [str(i + 1) for i in range(t)])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("task's classes", fontsize=8)
        ax.set_ylabel("after task", fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.set_axis_off()
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="accuracy (%)")
    save_figure(fig, path)


_KIND_STYLE: dict[str, dict[str, Any]] = {
    "growing": {"linestyle": "-", "marker": "o", "linewidth": 2.0},
    "parametric": {"linestyle": "--", "marker": "s"},
    "pixels": {"linestyle": ":", "marker": "^"}}


def plot_curves(path: Any, matrices: dict[str, list[list[float | None]]]) -> None:
    """Left: accuracy on the classes seen so far after each task; right: accuracy on each
    task's classes after the last task (means over orders and seeds). Solid lines: growing
    models; dashed: parametric ones; dotted: the raw-pixel classifiers."""
    from matplotlib import colormaps

    from rcdl.app.report import Curve, Panel, plot_panels

    palette = colormaps["tab10"]  # 10 colours; the line style tells the kinds apart
    seen, last = [], []
    for k, (name, m) in enumerate(matrices.items()):
        t = len(m)
        steps = list(range(1, t + 1))
        style = {**_KIND_STYLE[model_kind(name)], "color": palette(k % 10)}
        seen.append(Curve(steps, [_mean(m[i][: i + 1]) or 0.0 for i in range(t)], name,
                          style=style))
        last.append(Curve(steps, [m[-1][j] or 0.0 for j in range(t)], None, style=style))
    plot_panels(path, [
        Panel(seen, "tasks learned", "accuracy on the classes seen (%)",
              "while learning", integer_x=True, legend=None),
        Panel(last, "task", "accuracy on its classes (%)", "after the last task",
              integer_x=True, legend=None)],
        (10, 4), figure_legend={"loc": "outside right upper", "fontsize": "small"})


def plot_silent(path: Any, silent: list[dict[str, Any]]) -> None:
    """Per model, per task: accuracy on its test images after the last task with the
    whole model (10-way), from its own entries alone (growing models) and with the whole
    model, task-aware; and task-aware just after learning the task."""
    from matplotlib.figure import Figure

    from rcdl._io import save_figure

    names = list(dict.fromkeys(r["model"] for r in silent))
    cols = min(4, max(1, len(names)))
    grid = math.ceil(len(names) / cols) if names else 1
    fig = Figure(figsize=(3.6 * cols, 3.0 * grid), layout="constrained")
    axes = fig.subplots(grid, cols, squeeze=False)
    bars = (("full_acc", "at the end: whole model, 10-way", "#1f77b4"),
            ("own_entries_acc", "at the end: own entries only, 10-way", "#ff7f0e"),
            ("task_aware_acc", "at the end: whole model, task-aware", "#999999"),
            ("learnt_aware_acc", "just after the task: task-aware", "#dddddd"))
    width = 0.8 / len(bars)
    for ax, name in zip(axes.flat, names, strict=False):
        mine = [r for r in silent if r["model"] == name]
        for k, (key, label, colour) in enumerate(bars):
            for i, r in enumerate(mine):
                if r[key] is not None:
                    ax.bar(i + (k - 1.5) * width, r[key], width * 0.95,
                           yerr=r[key + "_sd"] or 0,
                           color=colour, label=label if i == 0 else None)
                if key == "full_acc" and r[key] is not None:  # a 0 % bar is no bar: say it
                    ax.text(i - 1.5 * width, r[key] + 1.5, f"{r[key]:.0f}", ha="center",
                            va="bottom", fontsize=6, color=colour)
        ax.set_xticks(range(len(mine)),
                      [f"{r['task']}" + (" (last)" if r is mine[-1] else "") for r in mine],
                      fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("task", fontsize=8)
        ax.set_ylabel("accuracy on its images (%)", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.set_axis_off()
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center",
                   ncols=2, fontsize="small")
    save_figure(fig, path)


def plot_mass(path: Any, mass: dict[str, list[list[float]]]) -> None:
    """Per growing model, the readout's signed value mass (:func:`value_mass`, mean over
    orders and seeds) as a heatmap: row ``t`` the entries task ``t`` wrote, column ``k``
    the ``k``-th class of the order; red raises a class, blue lowers it. Each panel has its
    own symmetric colour scale (the rules' value scales differ)."""
    from matplotlib.figure import Figure

    from rcdl._io import save_figure

    names = list(mass)
    cols = min(4, max(1, len(names)))
    grid = math.ceil(len(names) / cols) if names else 1
    fig = Figure(figsize=(3.4 * cols, 2.6 * grid), layout="constrained")
    axes = fig.subplots(grid, cols, squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        m = torch.tensor(mass[name])
        top = float(m.abs().max()) or 1.0
        image = ax.imshow(m.numpy(), cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto")
        ax.set_xticks(range(m.shape[1]), [str(k + 1) for k in range(m.shape[1])], fontsize=7)
        ax.set_yticks(range(m.shape[0]), [str(t + 1) for t in range(m.shape[0])], fontsize=7)
        ax.set_xlabel("class (position in the order)", fontsize=8)
        ax.set_ylabel("written by task", fontsize=8)
        ax.set_title(name, fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    for ax in list(axes.flat)[len(names):]:
        ax.set_axis_off()
    save_figure(fig, path)


# --full: the full-scale protocol (docs/continual.md, "Running it")
FULL = {"train_size": None, "test_size": None, "orders": ("0", "random-1"), "seeds": (0,),
        "models": ("gws", "rbf", "gws+labels", "rbf+labels", "rbf+vote", "rbf+labels+vote",
                   "pec", "knn-l2", "knn-cosine", "ncm", "slda")}

EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=ContinualConfig,
    help="class-incremental Split CIFAR-10 without replay: growing models against "
    "fine-tuned, EWC and LwF MLPs and raw-pixel kNN / NCM / SLDA, and the silent memories "
    "(docs/continual.md)",
    description="Learns CIFAR-10's classes two at a time (five tasks, natural and random "
    "class orders), one pass over each task's images, no replay, one 10-way head. Reports "
    "the accuracy matrix, final and average incremental accuracy, backward transfer and "
    "forgetting, each model's gap to its i.i.d. one-pass accuracy on the same images, and, "
    "for the growing models, whether an earlier task's entries are still stored and "
    "whether they alone still classify its images. See docs/continual.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_data, start=_start,
    finish=_finish, switches={"full": (
        "the whole CIFAR-10 (all 50 000 / 10 000 images), the natural order and random-1, "
        "seed 0: the growing models with and without the labels trick and the label vote, "
        "PEC and the "
        "raw-pixel classifiers (the MLPs stay at the reduced scale; docs/continual.md)",
        FULL)},
)  # fmt: skip
