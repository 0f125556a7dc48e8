"""Recipes more than one experiment trains or reports with; experiments import them from
here, never from each other (docs/adding_an_experiment.md).

- Training a model of the one-epoch comparison once over a subset, for the attribution and
  unlearning experiments: :func:`train_model`.
- The multi-epoch methods of the optimizer comparison and the DeltaNet-decay study
  (``rcdl reproduce optimizers``, ``rcdl reproduce deltanet-decay``): their common config
  (:class:`ProjectedConfig`) and input projection (:func:`project`), the training of one
  method for ``epochs`` epochs (:func:`train_method`, :func:`seed_runs`), and the rows,
  tables and figure over epochs (:func:`epoch_rows`, :func:`final_table`,
  :func:`epoch_table`, :func:`plot_curves`).
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.app.cifar import CifarData
from rcdl.app.config import ExperimentConfig
from rcdl.app.models import build_model, model_spec
from rcdl.app.report import markdown_table, mean_sd, pm
from rcdl.app.rundir import RunDir, save_figure
from rcdl.app.runner import Session, TaggedLog
from rcdl.memory.repair import forget_and_repair, repair_refusal
from rcdl.optim.grower import Grower
from rcdl.train.loop import LoopConfig, Metric, accuracy, train_one_pass

__all__ = [
    "PAPER_WIDTH", "Build", "ProjectedConfig", "epoch_rows", "epoch_table", "final_table",
    "plot_curves", "project", "projected_tensors", "random_projection", "seed_runs",
    "train_method", "train_model", "train_with_learners", "copy_trained", "fine_tune",
    "repaired_copies",
    "check_unlearning_settings",
]  # fmt: skip

PAPER_WIDTH = 3072  # the flattened image: the paper's residual stream
_METRICS: dict[str, Metric] = {"test_acc": accuracy, "test_loss": F.cross_entropy}
_HISTORY = ("step", "test_acc", "test_loss", "train_loss", "train_seconds", "entries")


# --------------------------------------------------------------------------- one pass, one model


def train_model(name: str, seed: int, x: Tensor, y: Tensor, evaluation: tuple[Tensor, Tensor],
                *, batch_size: int = 16, device: torch.device | str = "cpu",
                ) -> tuple[nn.Module, dict[str, Any]]:  # fmt: skip
    """Model ``name`` of the one-epoch comparison built from ``seed`` and trained one pass
    over ``x (n, 3072)``, ``y (n,)`` in ``seed``'s order; a growing model's entries remember
    their samples as indices into ``x``. ``evaluation = (x_eval, y_eval)`` is scored
    (``"acc"``) before and after.
    Returns the model and :func:`rcdl.train.loop.train_one_pass`'s result."""
    model, _, _, result = train_with_learners(name, seed, x, y, evaluation,
                                              batch_size=batch_size, device=device)
    return model, result


def _one_pass(batch_size: int, seed: int, device: torch.device | str) -> LoopConfig:
    """How the unlearning recipes train one pass: in ``seed``'s order, nothing evaluated
    on the way (the end's evaluation only), no progress bar."""
    return LoopConfig(batch_size=batch_size, seed=seed, eval_every=10**9, device=device,
                      progress=False)


def train_with_learners(name: str, seed: int, x: Tensor, y: Tensor,
                        evaluation: tuple[Tensor, Tensor], *, batch_size: int = 16,
                        device: torch.device | str = "cpu", **loop: Any,
                        ) -> tuple[nn.Module, Any, Any, dict[str, Any]]:  # fmt: skip
    """:func:`train_model`, also returning the model's optimizer and grower (``None`` where
    it has none), with more :func:`rcdl.train.loop.train_one_pass` arguments (``order``,
    ``replay``)."""
    model, optimizer, grower = build_model(name, seed, device=device, reserve=len(x))
    result = train_one_pass(model, (x, y, *evaluation), config=_one_pass(batch_size, seed, device),
                            optimizer=optimizer, grower=grower, loss_fn=F.cross_entropy,
                            metrics={"acc": accuracy}, **loop)  # fmt: skip
    return model, optimizer, grower, result


# --------------------------------------------------------------------------- unlearning


def copy_trained(name: str, seed: int, trained: tuple, *, reserve: int,
                 device: torch.device | str = "cpu") -> tuple[nn.Module, Any, Any]:
    """A fresh ``(model, optimizer, grower)`` of model ``name`` holding the state of
    ``trained`` (what :func:`train_with_learners` returned, or its first three): what an
    unlearning method works on while the trained one stays as it was. (A ``copy.deepcopy``
    of a torch optimizer keeps only its state dict's parts, so the learners are rebuilt.)"""
    model, optimizer, grower = build_model(name, seed, device=device, reserve=reserve)
    model.load_state_dict(trained[0].state_dict())
    for mine, theirs in ((optimizer, trained[1]), (grower, trained[2])):
        if mine is not None:
            mine.load_state_dict(theirs.state_dict())
    return model, optimizer, grower


def repaired_copies(trained: nn.Module, forget_idx: Tensor, x: Tensor, y: Tensor, *,
                    scan: bool = True) -> Iterator[tuple[str, nn.Module, Any]]:
    """The fast-mode variants of the unlearning experiments, each a copy of ``trained`` with
    ``forget_idx`` forgotten by :func:`rcdl.memory.repair.forget_and_repair`: ``"repair"``
    (the readout's stored keys) and ``"repair+keys"`` (its keys recomputed from ``x``),
    yielded as ``(variant, model, receipt)``; none where the readout cannot be repaired
    (the hybrid)."""
    if repair_refusal(trained) is not None:
        return
    for variant, inputs in (("repair", None), ("repair+keys", x)):
        model = copy.deepcopy(trained)
        receipt = forget_and_repair(model, forget_idx, labels=y, inputs=inputs, scan=scan)
        yield variant, model, receipt


def fine_tune(name: str, seed: int, trained: nn.Module, x: Tensor, y: Tensor, *,
              batch_size: int = 16, device: torch.device | str = "cpu",
              ) -> tuple[nn.Module, dict[str, Any]]:  # fmt: skip
    """The unlearning literature's cheap baseline: a copy of the parametric model ``trained``
    trained one more pass over ``(x, y)`` (some of the retained images) with a fresh
    optimizer of its kind, in ``seed``'s order; returns it and
    :func:`rcdl.train.loop.train_one_pass`'s result."""
    model, optimizer, _ = build_model(name, seed, device=device)
    model.load_state_dict(trained.state_dict())
    result = train_one_pass(model, (x, y, x[:1], y[:1]), config=_one_pass(batch_size, seed, device),
                            optimizer=optimizer, loss_fn=F.cross_entropy,
                            metrics={"acc": accuracy})  # fmt: skip
    return model, result


def check_unlearning_settings(where: str, models: tuple[str, ...], forget_fraction: float,
                              finetune_fraction: float) -> None:
    """Refuse a classical baseline (nothing to unlearn by a pass) and fractions out of
    range: the checks the unlearning experiments share."""
    for name in models:
        if model_spec(name).classical:
            raise ValueError(f"{where}: {name!r} is a classical baseline, not trained by "
                             "passes; use a growing model or an MLP")
    if forget_fraction >= 1 or finetune_fraction > 1:
        raise ValueError(f"{where}: forget_fraction must be below 1 and finetune_fraction at "
                         "most 1")


# --------------------------------------------------------------------------- methods over epochs


@dataclass(frozen=True)
class ProjectedConfig(ExperimentConfig):
    """The base of the configs of :mod:`rcdl.app.experiments.optimizers` and
    :mod:`rcdl.app.experiments.deltanet_decay`: the models see the images through the
    projection of :func:`project` to ``width`` (the optimizers module's docstring, "One
    input for all")."""

    if TYPE_CHECKING:  # fields of the subclasses
        @property
        def width(self) -> int | None: ...

        @property
        def data_seed(self) -> int: ...

    @property
    def input_width(self) -> int:
        """``w``: the width every model's input has (3072 without a projection)."""
        return self.width or PAPER_WIDTH


def random_projection(d_in: int, width: int, seed: int) -> Tensor:
    """The fixed input projection ``P (width, d_in)``: i.i.d. ``N(0, 1/d_in)`` entries
    from a generator seeded with ``seed`` (the lift of :class:`rcdl.nn.networks.ResidualNet`)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(width, d_in, generator=gen) / math.sqrt(d_in)


def project(data: CifarData, width: int | None, seed: int) -> CifarData:
    """``data`` with every image ``x (3072,)`` replaced by ``P x (width,)``
    (:func:`random_projection`); unchanged when ``width`` is ``None``."""
    if width is None:
        return data
    proj = random_projection(data.x_train.shape[1], width, seed).T  # (3072, w)
    return replace(data, x_train=data.x_train @ proj, x_test=data.x_test @ proj)


def projected_tensors(data: CifarData, cfg: ProjectedConfig, device: torch.device) -> tuple:
    """``(x_train (N, w), y_train (N,), x_test (M, w), y_test (M,))`` on ``device``: ``data``
    seen through the projection of ``cfg`` (:func:`project`, seeded with ``cfg.data_seed``)."""
    data = project(data, cfg.width, cfg.data_seed)
    return tuple(t.to(device) for t in (data.x_train, data.y_train, data.x_test, data.y_test))

class _Recorder(TaggedLog):
    """A :class:`rcdl.app.runner.TaggedLog` that drops the trainer's ``model`` label (the
    tags name the run) and keeps the run's ``history``, per evaluation: epoch (an int at an
    epoch's end), test metrics, the mean training loss since the previous evaluation, the
    training clock and the entries stored."""

    def __init__(self, run: RunDir, **tags: Any) -> None:
        super().__init__(run, **tags)
        self.history: list[dict[str, Any]] = []

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None:
        rest = {k: v for k, v in {**(record or {}), **fields}.items() if k != "model"}
        super().log(rest)
        epoch = int(rest["epoch"]) if float(rest["epoch"]).is_integer() else rest["epoch"]
        self.history.append({"epoch": epoch, **{k: rest[k] for k in _HISTORY}})


Build = Callable[[str, int], tuple[nn.Module, Any, Grower | None]]


def train_method(name: str, seed: int, cfg: Any, build: Build, tensors: tuple,
                 session: Session, *, key: str = "method",
                 **tags: Any) -> dict[str, Any]:  # fmt: skip
    """Train ``build(name, seed)`` (``(model, optimizer, grower)``) for ``cfg.epochs`` epochs
    on ``tensors``, evaluating after every epoch (``cfg`` has ``batch_size``, ``epochs`` and
    ``eval_batch_size``). Records are tagged with ``tags``, ``{key: name}`` and the seed.

    Returns:
        ``{**tags, key: name, "seed", "parameters", <train_one_pass's result>}`` with
        ``history`` one record per evaluation (:class:`_Recorder`).
    """
    model, optimizer, grower = build(name, seed)
    recorder = _Recorder(session.run, **tags, **{key: name}, seed=seed)
    label = "-".join(map(str, [*tags.values(), name, f"seed{seed}"]))
    result = train_one_pass(
        model, tensors, batch_size=cfg.batch_size, seed=seed, optimizer=optimizer,
        grower=grower, loss_fn=F.cross_entropy, metrics=_METRICS,
        eval_every=math.ceil(len(tensors[0]) / cfg.batch_size),
        eval_batch_size=cfg.eval_batch_size, device=session.device, run=recorder, name=label,
        progress=session.progress, epochs=cfg.epochs,
    )  # fmt: skip
    result.pop("history")  # the trainer's; the recorder's has the training loss and clock
    parameters = sum(p.numel() for p in model.parameters())
    return {**tags, key: name, "seed": seed, "parameters": parameters, **result,
            "history": recorder.history}  # fmt: skip


def seed_runs(train: Callable[..., dict[str, Any]], names: tuple[str, ...], cfg: Any,
              build: Build, tensors: tuple, session: Session, *, prefix: str = "",
              key: str = "method", **tags: Any) -> Iterator:  # fmt: skip
    """The sub-runs ``(prefix + "<name>-seed<seed>", train)`` of every seed of ``cfg``, and
    within a seed every one of ``names``; each calls ``train(name, seed, cfg, build,
    tensors, session, key=key, **tags)`` (:func:`train_method`, passed in so that each
    experiment module's own name for it is the one called)."""
    for seed in cfg.seeds:
        for name in names:
            yield f"{prefix}{name}-seed{seed}", partial(train, name, seed, cfg, build, tensors,
                                                        session, key=key, **tags)  # fmt: skip


def epoch_rows(runs: list[dict[str, Any]], *, key: str) -> list[dict[str, Any]]:
    """One row per (dataset, ``run[key]``, epoch ``0..E``), mean and sd over seeds, in the
    order of ``runs``: test accuracy in percent, test loss and the epoch's mean training
    loss in nats (``None`` at epoch 0), training seconds so far, entries stored (growing
    models)."""
    over_seeds: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        over_seeds.setdefault((r["dataset"], r[key]), []).append(r)
    rows = []
    for (dataset, name), rs in over_seeds.items():
        for at in zip(*(r["history"] for r in rs), strict=True):  # one evaluation, all seeds
            row: dict[str, Any] = {"dataset": dataset, key: name, "epoch": at[0]["epoch"],
                                   "seeds": [r["seed"] for r in rs]}  # fmt: skip
            for field, scale, suffix in (("test_acc", 100, "_pct"), ("test_loss", 1, ""),
                                         ("train_loss", 1, "")):  # fmt: skip
                values = [scale * h[field] for h in at if h[field] is not None]
                row[field + suffix], row[f"{field}{suffix}_sd"] = mean_sd(values)
            row["train_seconds"] = statistics.fmean(h["train_seconds"] for h in at)
            row["entries"] = at[0]["entries"]
            rows.append(row)
    return rows

def final_table(rows: list[dict[str, Any]], epochs: int, labels: Mapping[str, str], *,
                key: str = "method") -> str:  # fmt: skip
    """Markdown of one data set's rows: per method, final and best test accuracy, test loss,
    training loss after the first and the last epoch, entries and training seconds."""
    # the label column has no header: "| |", which markdown_table would write "|  |"
    lines = ["| method | | test acc. % (final) | best (epoch) | test loss | train loss, "
             "epoch 1 | train loss, final | entries | train s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name in dict.fromkeys(r[key] for r in rows):
        rs = [r for r in rows if r[key] == name]
        by_epoch = {r["epoch"]: r for r in rs}
        first, last = by_epoch[1], by_epoch[epochs]
        best = max(rs, key=lambda r: r["test_acc_pct"])
        cells = [name, labels[name], pm(last["test_acc_pct"], last["test_acc_pct_sd"]),
                 f"{best['test_acc_pct']:.2f} ({best['epoch']:g})",
                 pm(last["test_loss"], last["test_loss_sd"], 3),
                 pm(first["train_loss"], first["train_loss_sd"], 3),
                 pm(last["train_loss"], last["train_loss_sd"], 3),
                 "—" if last["entries"] is None else f"{last['entries']:,}",
                 f"{last['train_seconds']:.1f}"]  # fmt: skip
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def epoch_table(rows: list[dict[str, Any]], field: str, digits: int, *,
                key: str = "method") -> str:  # fmt: skip
    """Markdown of one data set's rows: ``field`` (mean over seeds) per epoch (rows) and
    method (columns); epochs without a value (the training loss at epoch 0) are left out."""
    names = list(dict.fromkeys(r[key] for r in rows))
    table = []
    for epoch in sorted({r["epoch"] for r in rows if r[field] is not None}):
        at = {r[key]: r[field] for r in rows if r["epoch"] == epoch}
        table.append([f"{epoch:g}", *(pm(at[n], None, digits) for n in names)])
    return markdown_table(["epoch", *names], table, "r" * (len(names) + 1))


def plot_curves(rows: list[dict[str, Any]], path: Path, *, title: str,
                labels: Mapping[str, str], key: str = "method") -> Path:  # fmt: skip
    """Left: the training loss (mean batch loss of each epoch, log scale) against epochs;
    right: test accuracy against epochs (epoch 0: before training); one line per method,
    the mean over seeds with a ± sd band when there are several."""
    from matplotlib.figure import Figure  # only where a figure is drawn: `rcdl --help` skips it

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
