"""Running the class-incremental experiment (:mod:`rcdl.app.experiments.continual`): a
model trained on the tasks one after another and measured after each
(:func:`run_sequence`), the raw-pixel classifiers and PEC fitted task by task, the silent
memories of a growing model after the last task, and the sub-runs in order."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from rcdl.app.cifar import CifarData, cifar_summary
from rcdl.app.classical import fit_knn
from rcdl.app.experiments.continual.analysis import (
    entries_by_task,
    own_entries_copy,
    readouts,
    value_mass,
)
from rcdl.app.experiments.continual.baselines import (
    EWC,
    PEC,
    LabelsTrick,
    LabelVote,
    LwF,
    NearestClassMean,
    PlainLoss,
    StreamingLDA,
)
from rcdl.app.experiments.continual.spec import (
    CLASSES,
    REGULARISED,
    ContinualConfig,
    ModelName,
    class_order,
    reads_out,
    task_split,
)
from rcdl.app.models import build_model
from rcdl.app.runner import Session
from rcdl.memory.provenance import samples
from rcdl.nn.layers import growing_layers
from rcdl.train.loop import epoch_permutation, predict, train_step

__all__ = ["continual_one", "iid_one", "run_sequence", "start", "sub_runs"]


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
    trained = ModelName.parse(cfg.regularised_base if name in REGULARISED else name)
    model, optimizer, grower = build_model(trained.network, seed, device=device, reserve=reserve)
    method: PlainLoss = PlainLoss() if trained.labels is None else LabelsTrick(trained.labels)
    if name == "mlp-ewc":
        method = EWC(model, cfg.ewc_lambda, generator=torch.Generator().manual_seed(seed))
    elif name == "mlp-lwf":
        method = LwF(cfg.lwf_alpha, cfg.lwf_temperature)
    return model, optimizer, grower, method


def _readout(name: str, model: nn.Module, data: CifarData, cfg: ContinualConfig) -> nn.Module:
    """What answers the test images: the model, or its :class:`LabelVote` for ``NAME+vote``."""
    if not ModelName.parse(name).vote:
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


def _train_task(model: nn.Module, optimizer: Any, grower: Any, method: PlainLoss,
                data: CifarData, idx: Tensor, batch_size: int,
                device: torch.device) -> tuple[int, float] | None:  # fmt: skip
    """One pass over the training images ``idx (n_t,)`` (global indices, in the order
    seen), ``batch_size`` at a time, each batch one :func:`rcdl.train.loop.train_step` with
    ``method``'s loss; the entries written remember their training image. Stops at a
    non-finite loss and returns ``(step, loss)`` (``None`` when every step was finite)."""
    x, y = data.x_train, data.y_train
    for step, batch in enumerate(idx.split(batch_size)):
        xb, yb = x[batch].to(device), y[batch].to(device)
        with samples(model, batch):  # entries remember their training image
            loss = train_step(model, xb, yb, partial(method.loss, x=xb), optimizer, grower)
        if not math.isfinite(loss):
            return step, loss
    return None


def run_sequence(name: str, seed: int, data: CifarData, tasks: Sequence[Sequence[int]],
                 cfg: ContinualConfig, device: torch.device, *,
                 log: Any = None) -> tuple[nn.Module | None, dict[str, Any]]:  # fmt: skip
    """Model ``name`` trained on ``tasks`` one after another (one task holding every class:
    the i.i.d. run), measured after each. Returns the model (``None`` for a raw-pixel
    classifier) and a JSON-able result: ``matrix`` (``R[i][j]``), ``aware_matrix`` (the same
    with the task-aware head), ``acc`` (final, every test image), ``entries_written`` (per
    task, growing models), ``train_seconds``, ``eval_seconds``."""
    if ModelName.parse(name).kind == "pixels":
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
        if (failed := _train_task(model, optimizer, grower, method, data, idx, cfg.batch_size,
                                  device)) is not None:
            step, loss = failed
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
    """One sub-run: model ``name`` on the tasks of ``order`` from ``seed``
    (:mod:`rcdl.app.experiments.continual`); with the silent memories of a growing model
    and, where ``cfg`` asks for ``readouts`` and the model has an RBF readout, its trained
    readout read out in those ways (:func:`~rcdl.app.experiments.continual.analysis.readouts`)."""
    tasks = task_split(order, cfg.classes_per_task)
    log = session.log(model=name, order=order, seed=seed)
    model, out = run_sequence(name, seed, data, tasks, cfg, session.device, log=log)
    kind = ModelName.parse(name).kind
    result = {"model": name, "order": order, "seed": seed, "kind": kind,
              "tasks": [list(c) for c in tasks], **out}
    chosen = getattr(cfg, "readouts", None)
    if model is not None and chosen is not None and reads_out(name):
        start = time.perf_counter()
        result["readouts"] = readouts(model, data.x_test, data.y_test, data.y_train, tasks,
                                      chosen, cfg.eval_batch_size)
        result["readouts_seconds"] = time.perf_counter() - start
    if model is not None and kind == "growing":
        start = time.perf_counter()
        result["silent"] = _silent_memories(name, model, data, tasks, cfg, session.device)
        result["silent_seconds"] = time.perf_counter() - start
    return result


def iid_one(name: str, seed: int, data: CifarData, cfg: ContinualConfig,
            session: Session) -> dict[str, Any]:  # fmt: skip
    """The i.i.d. reference of model ``name``: one pass over every training image,
    shuffled over all classes; its accuracy on every test image."""
    _, out = run_sequence(name, seed, data, [tuple(range(CLASSES))], cfg, session.device)
    return {"model": name, "order": "iid", "seed": seed, "kind": ModelName.parse(name).kind,
            "acc": out["acc"], "train_seconds": out["train_seconds"],
            "eval_seconds": out["eval_seconds"]}


def sub_runs(cfg: ContinualConfig, data: CifarData, session: Session) -> Iterator:
    for seed in cfg.seeds:
        references = dict.fromkeys(ModelName.parse(m).iid(cfg.regularised_base)
                                   for m in cfg.models)
        for name in references:
            yield f"iid-{name}-seed{seed}", partial(iid_one, name, seed, data, cfg, session)
        for name in cfg.models:
            for order in cfg.orders:
                yield (f"{name}-{order}-seed{seed}",
                       partial(continual_one, name, order, seed, data, cfg, session))


def start(cfg: ContinualConfig, data: CifarData) -> dict[str, Any]:
    return {**cifar_summary(cfg, data), "class_names": list(data.class_names),
            "orders": {order: list(class_order(order)) for order in cfg.orders}}
