"""Accuracy against memory: growing layers under a bounded memory (docs/reference.md §8, "Known
limits").

Run it with ``rcdl reproduce memory-budget`` (see docs/memory.md).

A growing model stores one entry per training sample per layer, so its memory grows
linearly with the data. This experiment bounds it with a :class:`rcdl.memory.budgets.MemoryBudget`
and measures what that costs on the one-epoch CIFAR-10 task (docs/reference.md §6, the ``gws`` model
by default): for every eviction policy and every capacity it trains the model once, and it
trains the unbounded model as the reference, on the same data, seed and image order.

Capacities are **entries per layer** (absolute; a softmax layer's 16 initial entries count
toward them), the same in every layer. A capacity at or above ``16 + train_size`` never
evicts. A full store is cut to ``capacity − slack · capacity`` entries at once (eviction
in blocks; see :class:`~rcdl.memory.budgets.MemoryBudget`). Policies are
:class:`~rcdl.memory.budgets.MemoryBudget` names: ``oldest`` (sliding window), ``newest`` (stop
growing when full), ``contribution``, ``random``, each optionally with ``+merge``.

Run folder, besides what every run writes (:mod:`rcdl.app.runner`)::

    metrics.jsonl       every evaluation of every run, tagged with policy and capacity
    summary.json        one record per run (final metrics, entries kept and evicted per
                        layer, bytes, times, history), the data used; ``complete``
    results.md/.csv     the table: policy, capacity, entries kept, evicted, store bytes,
                        test accuracy, test loss, train / eval / wall seconds
    accuracy_vs_capacity.png   final test accuracy against capacity, one line per policy,
                        the unbounded run as a dashed line
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import rcdl.app.experiments.cifar10.config as cifar10_config
from rcdl.app import models as cifar10_models
from rcdl.app.cifar import CifarData, cifar_summary
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.report import Curve, Panel, csv_text, markdown_table, plot_panels, write_outputs
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.app.runner import Experiment, Session, run_experiment
from rcdl.memory.budgets import MemoryBudget
from rcdl.nn.store import format_bytes
from rcdl.optim.grower import Grower
from rcdl.train.loop import train_one_pass

__all__ = ["EXPERIMENT", "EXPERIMENT_SPEC", "GROWING_MODELS", "MemoryBudgetConfig", "load_data",
           "run_memory_budget"]  # fmt: skip

EXPERIMENT = "memory-budget"
# the models of rcdl.app.experiments.cifar10 that grow (a Grower to put a budget on)
GROWING_MODELS = tuple(m for m in ("gws", "gauge", "rbf", "hybrid") if m in cifar10_models.MODELS)
UNBOUNDED = "unbounded"  # the policy column of the reference run
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class MemoryBudgetConfig(ExperimentConfig):
    """Settings of the accuracy-against-capacity sweep.

    The defaults: 19 runs (run times in docs/memory.md); ``--quick`` (480 train / 200 test
    images, capacities 60 and 240, every default policy) is a smoke test.

    ``policies`` are :meth:`rcdl.memory.budgets.MemoryBudget.from_policy` names, each trained at
    every capacity. ``slack`` is :class:`~rcdl.memory.budgets.MemoryBudget`'s, as a fraction of the
    capacity: a store that exceeds its capacity ``C`` is brought down to
    ``C − round(slack · C)`` entries; ``0`` evicts ``B`` entries at every step once full,
    which compacts the whole store each step.
    """

    QUICK = {"train_size": 480, "test_size": 200, "capacities": (60, 240), "eval_every": 10}

    model: str = setting("gws", "the growing model", choices=GROWING_MODELS)
    train_size: int | None = setting(10_000, "training images", metavar="N")
    test_size: int | None = setting(2_000, "test images", metavar="N")
    capacities: tuple[int, ...] = setting((250, 1000, 4000), "entries per layer, initial "
                                          "entries included", metavar="N")
    policies: tuple[str, ...] = setting(
        ("oldest", "newest", "random", "contribution", "contribution+merge", "newest+merge"),
        "eviction policies, optionally with +merge", metavar="NAME")
    unbounded: bool = setting(True, "also train the model without a budget, the reference",
                              flag_help="skip the unbounded reference run")
    slack: float = setting(0.125, "a full store is cut to (1 − F) × capacity at once, so "
                           "evictions happen every few steps", metavar="F")
    seed: int = setting(0, "seed of the model, data order and the random policy", minimum=0)
    batch_size: int = setting(16, "samples per step (docs/reference.md §6)", metavar="B")
    eval_every: int = setting(250, "steps between test evaluations", metavar="STEPS")
    eval_batch_size: int = setting(500, "test images per prediction batch", metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()
    dtype: str = setting("float32", "the model's and the data's dtype", choices=tuple(_DTYPES))

    def check(self) -> None:
        """Every policy is a known one; ``slack < 1``."""
        for policy in self.policies:
            MemoryBudget.from_policy(1, policy)  # raises for an unknown one
        if self.slack >= 1:
            raise ValueError(f"MemoryBudgetConfig: slack is a fraction of the capacity, "
                             f"0 <= slack < 1; got {self.slack!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def budgets(self) -> list[MemoryBudget | None]:
        """The runs in training order: the unbounded reference (``None``) first, then every
        policy at every capacity, smallest first."""
        bounded = [MemoryBudget.from_policy(c, p, seed=self.seed,
                                            slack=min(round(self.slack * c), c - 1))
                   for p in self.policies for c in sorted(self.capacities)]
        return ([None] if self.unbounded else []) + bounded


def load_data(cfg: MemoryBudgetConfig, *, download: bool = True) -> CifarData:
    """CIFAR-10 subset as ``cfg`` asks, exactly as the one-epoch comparison loads it
    (:func:`rcdl.app.experiments.cifar10.config.load_data`: same files, standardisation and
    subsets)."""
    as_cifar10 = cifar10_config.Cifar10Config(models=(cfg.model,), train_size=cfg.train_size,
                                              test_size=cfg.test_size, data_dir=cfg.data_dir,
                                              data_seed=cfg.data_seed)
    return cifar10_config.load_data(as_cifar10, download=download)


# --------------------------------------------------------------------------- running


def _label(budget: MemoryBudget | None) -> str:
    return UNBOUNDED if budget is None else f"{budget.policy}-{budget.capacity}"


def _train(cfg: MemoryBudgetConfig, budget: MemoryBudget | None, data: tuple,
           session: Session) -> dict[str, Any]:  # fmt: skip
    """Train the model once under ``budget`` (``None``: unbounded); returns its record."""
    start = time.perf_counter()
    n_train = len(data[0])
    # room for the whole pass, or for the budget plus one step's entries: memory stays bounded
    reserve = n_train if budget is None else min(n_train, budget.capacity + cfg.batch_size)
    model, optimizer, _ = cifar10_models.build_model(cfg.model, cfg.seed, device=session.device,
                                                     dtype=cfg.torch_dtype, reserve=reserve)
    grower = Grower(model, budget=budget)
    initial = grower.num_entries
    policy = UNBOUNDED if budget is None else budget.policy
    capacity = None if budget is None else budget.capacity
    result = train_one_pass(
        model, data, batch_size=cfg.batch_size, seed=cfg.seed, optimizer=optimizer,
        grower=grower, loss_fn=F.cross_entropy, metrics=cifar10_config.METRICS,
        eval_every=cfg.eval_every, eval_batch_size=cfg.eval_batch_size, device=session.device,
        run=session.log(policy=policy, capacity=capacity), name=_label(budget),
        progress=session.progress,
    )  # fmt: skip
    return {
        "policy": policy, "capacity": capacity, "seed": cfg.seed,
        "initial_entries": initial,
        "entries_per_layer": {layer.name: len(layer.store) for layer in grower.layers},
        "evicted": grower.num_evicted, "evicted_per_layer": dict(grower.evicted),
        "reserved_bytes": sum(layer.store.reserved_nbytes for layer in grower.layers),
        **result, "wall_seconds": time.perf_counter() - start,
    }  # fmt: skip


def _sub_runs(cfg: MemoryBudgetConfig, data: CifarData, session: Session) -> Iterator:
    """Every budget of :meth:`MemoryBudgetConfig.budgets`, on the same tensors in ``dtype``
    (moved to the device once when it is a GPU)."""
    on_gpu = session.device.type == "cuda"
    tensors = tuple(t.to(session.device) if on_gpu else t for t in
                    (data.x_train.to(cfg.torch_dtype), data.y_train,
                     data.x_test.to(cfg.torch_dtype), data.y_test))  # fmt: skip
    for budget in cfg.budgets():
        yield _label(budget), partial(_train, cfg, budget, tensors, session)


def _start(cfg: MemoryBudgetConfig, data: CifarData) -> dict[str, Any]:
    return {"model": cfg.model, **cifar_summary(cfg, data)}


def run_memory_budget(cfg: MemoryBudgetConfig, **kw: Any) -> tuple[RunDir, dict[str, Any]]:
    """Train the model under every (policy, capacity) of ``cfg``, and unbounded
    (:func:`rcdl.app.runner.run_experiment`).

    The summary adds ``model`` and the ``data`` used; each of ``runs`` holds the final
    metrics, entries kept and evicted per layer, bytes, times and the ``history``."""
    return run_experiment(EXPERIMENT_SPEC, cfg, **kw)


# --------------------------------------------------------------------------- reporting

_COLUMNS = ("policy", "capacity", "entries", "largest_layer", "evicted", "store_bytes",
            "test_acc_pct", "test_loss", "train_seconds", "eval_seconds",
            "wall_seconds")  # fmt: skip


def result_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run (accuracy in percent; capacity ``None`` for the unbounded run;
    ``entries`` over all layers, ``largest_layer`` the entries of the fullest layer)."""
    return [{
        "policy": r["policy"], "capacity": r["capacity"], "entries": r["entries"],
        "largest_layer": max(r["entries_per_layer"].values()),
        "evicted": r["evicted"], "store_bytes": r["bytes"],
        "test_acc_pct": 100 * r["test_acc"], "test_loss": r["test_loss"],
        "train_seconds": r["train_seconds"], "eval_seconds": r["eval_seconds"],
        "wall_seconds": r["wall_seconds"],
    } for r in runs]  # fmt: skip


def results_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`result_rows`."""
    header = ("policy", "capacity / layer", "entries kept", "evicted", "store", "test acc. %",
              "test loss", "train s", "eval s", "wall s")  # fmt: skip
    return markdown_table(header, [[
        r["policy"], "—" if r["capacity"] is None else f"{r['capacity']:,}",
        f"{r['entries']:,}", f"{r['evicted']:,}", format_bytes(r["store_bytes"]),
        f"{r['test_acc_pct']:.2f}", f"{r['test_loss']:.3f}", f"{r['train_seconds']:.1f}",
        f"{r['eval_seconds']:.1f}", f"{r['wall_seconds']:.1f}",
    ] for r in rows])  # fmt: skip


def plot_accuracy_vs_capacity(rows: list[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Final test accuracy against capacity (log scale), one line per policy; the unbounded
    run as a dashed line and a star at its final entries per layer."""
    bounded = [r for r in rows if r["capacity"] is not None]
    unbounded = [r for r in rows if r["capacity"] is None]
    curves = []
    for policy in dict.fromkeys(r["policy"] for r in bounded):
        points = sorted((r["capacity"], r["test_acc_pct"]) for r in bounded
                        if r["policy"] == policy)  # fmt: skip
        capacities, accuracies = zip(*points, strict=True)
        curves.append(Curve(capacities, accuracies, policy, style={"marker": "o"}))
    curves += [Curve([r["largest_layer"]], [r["test_acc_pct"]],
                     f"unbounded ({r['largest_layer']:,} entries per layer)",
                     style={"marker": "*", "markersize": 12, "color": "black",
                            "linestyle": "none"}) for r in unbounded]  # fmt: skip
    ticks = sorted({r["capacity"] for r in bounded} | {r["largest_layer"] for r in unbounded})

    def label_ticks(ax: Any) -> None:  # every capacity, written out
        ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
        ax.minorticks_off()

    return plot_panels(path, [Panel(
        curves, "capacity (entries per layer)", "test accuracy (%)", title, xscale="log",
        hlines=[{"y": r["test_acc_pct"], "color": "black", "linestyle": "--", "linewidth": 1}
                for r in unbounded], legend=None, decorate=label_ticks,
    )], figsize=(8.4, 4.6), figure_legend={"fontsize": "small", "loc": "outside right upper"})


def write_report(run: RunDir, cfg: MemoryBudgetConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv`` and ``accuracy_vs_capacity.png``; return the
    markdown."""
    d = summary["data"]
    steps = math.ceil(d["n_train"] / cfg.batch_size)
    rows = result_rows(summary["runs"])
    report = (
        f"# Accuracy against memory: `{cfg.model}` under a memory budget (docs/reference.md §8)\n\n"
        f"{d['n_train']:,} train / {d['n_test']:,} test CIFAR-10 images (data seed "
        f"{cfg.data_seed}), one pass, batch {cfg.batch_size} ({steps:,} steps), seed "
        f"{cfg.seed}, {cfg.dtype}. Each bounded run keeps at most *capacity* entries in "
        "every layer after each step (the initial entries included), evicting by its "
        "policy (docs/memory.md); the unbounded run is the reference.\n\n"
        f"{results_table(rows)}\n\n"
        "Entries kept and store: all layers at the end. Evicted: all layers, whole run "
        "(with `+merge`, folded into the nearest kept entry rather than dropped). Train "
        "seconds cover forward, backward, growth and eviction; wall seconds include building "
        "the model and the evaluations.\n\n"
        f"Data: {d['source']}, {d['provenance']}.\n"
        f"Machine: {describe_machine(device)}.\n"
    )
    title = f"{cfg.model}, one epoch of {d['n_train']:,} CIFAR-10 images"
    return write_outputs(run, report, csv_text(rows, _COLUMNS), {
        "accuracy_vs_capacity.png": partial(plot_accuracy_vs_capacity, rows, title=title)})


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=MemoryBudgetConfig,
    help="growing networks under a memory budget: accuracy against capacity for several "
    "eviction policies (docs/reference.md §8, known limits)",
    description="One epoch of a growing model on a CIFAR-10 subset with every layer's "
    "store capped at a capacity, for each eviction policy, beside the unbounded model. "
    "Writes results.md, results.csv and accuracy_vs_capacity.png. See docs/memory.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_data, start=_start,
)  # fmt: skip
