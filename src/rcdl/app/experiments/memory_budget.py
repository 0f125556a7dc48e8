"""Accuracy against memory: growing layers under a bounded memory (docs/reference.md §8, "Known
limits").

A growing model stores one entry per training sample per layer, so its memory grows
linearly with the data. This experiment bounds it with a :class:`rcdl.memory.MemoryBudget`
and measures what that costs on the one-epoch CIFAR-10 task (docs/reference.md §6, the ``gws`` model
by default): for every eviction policy and every capacity it trains the model once, and it
trains the unbounded model as the reference, on the same data, seed and image order.

Capacities are **entries per layer** (absolute; a softmax layer's 16 initial entries count
toward them), the same in every layer. A capacity at or above ``16 + train_size`` never
evicts. A full store is cut to ``capacity − slack · capacity`` entries at once (eviction
in blocks; see :class:`~rcdl.memory.MemoryBudget`). Policies are
:class:`~rcdl.memory.MemoryBudget` names: ``oldest`` (sliding window), ``newest`` (stop
growing when full), ``contribution``, ``random``, each optionally with ``+merge``.

Run folder::

    config.json         the resolved MemoryBudgetConfig
    environment.json    machine, torch, git revision
    metrics.jsonl       every evaluation of every run, tagged with policy and capacity
    finished.json       each finished run's record, written as it finishes
    summary.json        one record per run (final metrics, entries kept and evicted per
                        layer, bytes, times, history), the data used; ``complete``
    results.md/.csv     the table: policy, capacity, entries kept, evicted, store bytes,
                        test accuracy, test loss, train / eval / wall seconds
    accuracy_vs_capacity.png   final test accuracy against capacity, one line per policy,
                        the unbounded run as a dashed line

Resume: :func:`run_memory_budget` with ``resume=RUN_DIR`` skips the runs that
``finished.json`` holds and trains the others from scratch; the tables are then those of an
uninterrupted sweep. ``metrics.jsonl`` may repeat the evaluations of the run that was
interrupted.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from rcdl.app.cifar import CifarData
from rcdl.app.experiments import cifar10
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
from rcdl.grower import Grower
from rcdl.memory import MemoryBudget
from rcdl.store import format_bytes
from rcdl.training import train_one_pass

__all__ = ["EXPERIMENT", "GROWING_MODELS", "MemoryBudgetConfig", "load_data",
           "run_memory_budget"]  # fmt: skip

EXPERIMENT = "memory-budget"
# the models of rcdl.app.experiments.cifar10 that grow (a Grower to put a budget on)
GROWING_MODELS = tuple(m for m in ("gws", "gauge", "rbf", "hybrid") if m in cifar10.MODELS)
UNBOUNDED = "unbounded"  # the policy column of the reference run
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class MemoryBudgetConfig:
    """Settings of the accuracy-against-capacity sweep.

    The defaults: 19 runs, about 30 minutes on this machine's CPU by estimate (measured
    parts in docs/memory.md); ``quick()`` took 15 s.

    Attributes:
        model: the growing model of :mod:`rcdl.app.experiments.cifar10` (:data:`GROWING_MODELS`).
        train_size, test_size: random subsets of that many images (``None``: all 50 000 /
            10 000); they depend on ``data_seed`` only.
        capacities: entries per layer (each ≥ 1), the initial entries included.
        policies: :meth:`rcdl.memory.MemoryBudget.from_policy` names, each trained at every
            capacity: ``oldest``, ``contribution``, ``random``, optionally ``+merge``.
        unbounded: also train the model without a budget, the reference.
        slack: evict in blocks: a store that exceeds its capacity ``C`` is brought down to
            ``C − round(slack · C)`` entries (:class:`~rcdl.memory.MemoryBudget`'s ``slack``,
            here a fraction of the capacity, ``0 ≤ slack < 1``). ``0`` evicts ``B`` entries at
            every step once full, which compacts the whole store each step.
        seed: the model's initialisation, the image order and the ``random`` policy's draws.
        batch_size: samples per step (docs/reference.md §6: 16).
        eval_every: steps between test evaluations, and also at the end.
        eval_batch_size: test images per prediction batch (docs/reference.md §6: 500).
        data_dir: folder holding ``cifar10.npz`` or the official files (``None`` searches
            ``$RCDL_DATA``, then the cache; see :func:`rcdl.app.cifar.load_cifar`).
        data_seed: seed of the subsets.
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
        dtype: ``"float32"`` or ``"float64"``.
    """

    model: str = "gws"
    train_size: int | None = 10_000
    test_size: int | None = 2_000
    capacities: tuple[int, ...] = (250, 1000, 4000)
    policies: tuple[str, ...] = ("oldest", "newest", "random", "contribution",
                                 "contribution+merge", "newest+merge")
    unbounded: bool = True
    slack: float = 0.125
    seed: int = 0
    batch_size: int = 16
    eval_every: int = 250
    eval_batch_size: int = 500
    data_dir: str | None = None
    data_seed: int = 0
    device: str = "auto"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        # lists (from JSON or argparse) become tuples, paths strings, so configs compare equal
        object.__setattr__(self, "capacities", tuple(self.capacities))
        object.__setattr__(self, "policies", tuple(self.policies))
        if self.data_dir is not None:
            object.__setattr__(self, "data_dir", str(self.data_dir))
        if self.model not in GROWING_MODELS:
            raise ValueError(f"MemoryBudgetConfig: model must be a growing model, one of "
                             f"{', '.join(GROWING_MODELS)}; got {self.model!r}")
        if not self.capacities or not self.policies:
            raise ValueError(f"MemoryBudgetConfig: give at least one capacity and one policy, "
                             f"got capacities={list(self.capacities)}, "
                             f"policies={list(self.policies)}")
        for what in ("capacities", "policies"):
            items = getattr(self, what)
            if len(set(items)) != len(items):
                raise ValueError(f"MemoryBudgetConfig: {what} must not repeat, got {list(items)}")
        for capacity in self.capacities:
            if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
                raise ValueError(f"MemoryBudgetConfig: capacities are entries per layer, ints "
                                 f">= 1; got {capacity!r}")
        for policy in self.policies:
            MemoryBudget.from_policy(1, policy)  # raises for an unknown one
        for what in ("seed", "data_seed"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MemoryBudgetConfig: {what} must be an int >= 0, "
                                 f"got {value!r}")
        for what in ("train_size", "test_size", "batch_size", "eval_every", "eval_batch_size"):
            value = getattr(self, what)
            if value is None and what in ("train_size", "test_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemoryBudgetConfig: {what} must be an int >= 1, "
                                 f"got {value!r}")
        if isinstance(self.slack, bool) or not isinstance(self.slack, int | float) \
                or not 0 <= self.slack < 1:
            raise ValueError(f"MemoryBudgetConfig: slack is a fraction of the capacity, "
                             f"0 <= slack < 1; got {self.slack!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"MemoryBudgetConfig: dtype must be one of {list(_DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"MemoryBudgetConfig: device must be one of {list(_DEVICES)}, "
                             f"got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @classmethod
    def quick(cls, **overrides: Any) -> MemoryBudgetConfig:
        """A smoke-test scale: 480 train / 200 test images, capacities 60 and 240, every
        default policy (seconds per run; the whole sweep in well under a minute)."""
        quick = {"train_size": 480, "test_size": 200, "capacities": (60, 240),
                 "eval_every": 10}  # fmt: skip
        return cls(**{**quick, **overrides})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryBudgetConfig:
        """The config saved as ``config.json`` (unknown keys are an error)."""
        return config_from_dict(cls, d)

    def budgets(self) -> list[MemoryBudget | None]:
        """The runs in training order: the unbounded reference (``None``) first, then every
        policy at every capacity, smallest first."""
        bounded = [MemoryBudget.from_policy(c, p, seed=self.seed,
                                            slack=min(round(self.slack * c), c - 1))
                   for p in self.policies for c in sorted(self.capacities)]
        return ([None] if self.unbounded else []) + bounded


def load_data(cfg: MemoryBudgetConfig, *, download: bool = True) -> CifarData:
    """CIFAR-10 subset as ``cfg`` asks, exactly as :func:`rcdl.app.experiments.cifar10.load_data`
    loads it (same files, standardisation and subsets)."""
    as_cifar10 = cifar10.Cifar10Config(models=(cfg.model,), train_size=cfg.train_size,
                                       test_size=cfg.test_size, data_dir=cfg.data_dir,
                                       data_seed=cfg.data_seed)
    return cifar10.load_data(as_cifar10, download=download)


# --------------------------------------------------------------------------- running


class _RunLog:
    """Hands the trainer's records to ``metrics.jsonl``, tagged with policy and capacity."""

    def __init__(self, run: RunDir, policy: str, capacity: int | None) -> None:
        self.run, self.tags = run, {"policy": policy, "capacity": capacity}

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None:
        self.run.log({**self.tags, **(record or {}), **fields})


def _label(budget: MemoryBudget | None) -> str:
    return UNBOUNDED if budget is None else f"{budget.policy}-{budget.capacity}"


def _train(cfg: MemoryBudgetConfig, budget: MemoryBudget | None, data: tuple, run: RunDir,
           device: torch.device, progress: bool) -> dict[str, Any]:
    """Train the model once under ``budget`` (``None``: unbounded); returns its record."""
    start = time.perf_counter()
    n_train = len(data[0])
    # room for the whole pass, or for the budget plus one step's entries: memory stays bounded
    reserve = n_train if budget is None else min(n_train, budget.capacity + cfg.batch_size)
    model, optimizer, _ = cifar10.build_model(cfg.model, cfg.seed, device=device,
                                              dtype=cfg.torch_dtype, reserve=reserve)
    grower = Grower(model, budget=budget)
    initial = grower.num_entries
    policy = UNBOUNDED if budget is None else budget.policy
    capacity = None if budget is None else budget.capacity
    result = train_one_pass(
        model, data, batch_size=cfg.batch_size, seed=cfg.seed, optimizer=optimizer,
        grower=grower, loss_fn=F.cross_entropy, metrics=cifar10.METRICS,
        eval_every=cfg.eval_every, eval_batch_size=cfg.eval_batch_size, device=device,
        run=_RunLog(run, policy, capacity), name=_label(budget), progress=progress,
    )  # fmt: skip
    return {
        "policy": policy, "capacity": capacity, "seed": cfg.seed,
        "initial_entries": initial,
        "entries_per_layer": {layer.name: len(layer.store) for layer in grower.layers},
        "evicted": grower.num_evicted, "evicted_per_layer": dict(grower.evicted),
        "reserved_bytes": sum(layer.store.reserved_nbytes for layer in grower.layers),
        **result, "wall_seconds": time.perf_counter() - start,
    }  # fmt: skip


def run_memory_budget(
    cfg: MemoryBudgetConfig,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    data: CifarData | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    download: bool = True,
) -> tuple[RunDir, dict[str, Any]]:
    """Train the model under every (policy, capacity) of ``cfg``, and unbounded, into a new
    run folder or the one at ``resume``.

    Args:
        cfg: the settings; to resume, the run's own (``rcdl.app.rundir.read_config``), where
            only ``data_dir`` and ``device`` may differ.
        out: the run folder (default ``runs/memory-budget-<timestamp>``); not with
            ``resume``.
        resume: an interrupted run folder: its finished runs are read back, the others
            trained from scratch.
        data: the data already loaded by :func:`load_data` (default: load it here).
        device: overrides ``cfg.device``.
        download: allow the loader to download CIFAR-10 when no local copy is found.

    Returns:
        The run folder and its summary (the content of ``summary.json``).
    """
    start = time.perf_counter()
    device = resolve_device(cfg.device) if device is None else torch.device(device)
    if data is None:
        data = load_data(cfg, download=download)
    run = open_run(EXPERIMENT, cfg, out=out, resume=resume, device=device)
    summary: dict[str, Any] = {
        "experiment": EXPERIMENT, "complete": False, "model": cfg.model, "runs": [],
        "data": {**data.describe(), "provenance": cifar10.data_provenance(data.source),
                 "data_seed": cfg.data_seed},
        "seconds": None,
    }  # fmt: skip
    tensors = tuple(t.to(device) if device.type == "cuda" else t for t in
                    (data.x_train.to(cfg.torch_dtype), data.y_train,
                     data.x_test.to(cfg.torch_dtype), data.y_test))  # fmt: skip
    with run.resumable(f"rcdl reproduce {EXPERIMENT}", cfg.data_dir):
        for budget in cfg.budgets():
            train = partial(_train, cfg, budget, tensors, run, device, progress)
            summary["runs"].append(run.sub_run(_label(budget), train))
            summary["seconds"] = time.perf_counter() - start
            run.write_summary(summary)
            release_memory(device)
    summary["complete"] = True
    summary["seconds"] = time.perf_counter() - start
    report = write_report(run, cfg, summary, device)
    run.write_summary(summary)
    print("\n" + report, end="")
    print(f"Total time {summary['seconds']:.1f} s. Run folder: {run.path}")
    return run, summary


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
    lines = [
        "| policy | capacity / layer | entries kept | evicted | store | test acc. % | test loss "
        "| train s | eval s | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        capacity = "—" if r["capacity"] is None else f"{r['capacity']:,}"
        lines.append(
            f"| {r['policy']} | {capacity} | {r['entries']:,} | {r['evicted']:,} "
            f"| {format_bytes(r['store_bytes'])} | {r['test_acc_pct']:.2f} "
            f"| {r['test_loss']:.3f} | {r['train_seconds']:.1f} | {r['eval_seconds']:.1f} "
            f"| {r['wall_seconds']:.1f} |"
        )
    return "\n".join(lines)


def results_csv(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`result_rows` as CSV (an empty capacity for the unbounded run)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(_COLUMNS)
    for r in rows:
        writer.writerow(["" if r[k] is None else r[k] for k in _COLUMNS])
    return buf.getvalue()


def plot_accuracy_vs_capacity(rows: list[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Final test accuracy against capacity (log scale), one line per policy; the unbounded
    run as a dashed line and a star at its final entries per layer."""
    fig = Figure(figsize=(8.4, 4.6), layout="constrained")
    ax = fig.add_subplot()
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["capacity"] is not None))
    for policy in policies:
        points = sorted((r["capacity"], r["test_acc_pct"]) for r in rows
                        if r["policy"] == policy)
        ax.plot(*zip(*points, strict=True), marker="o", label=policy)
    ticks = {r["capacity"] for r in rows if r["capacity"] is not None}
    for r in rows:
        if r["capacity"] is None:
            label = f"unbounded ({r['largest_layer']:,} entries per layer)"
            ax.axhline(r["test_acc_pct"], color="black", linestyle="--", linewidth=1)
            ax.plot([r["largest_layer"]], [r["test_acc_pct"]], marker="*", markersize=12,
                    color="black", linestyle="none", label=label)
            ticks.add(r["largest_layer"])
    ax.set_xscale("log")
    ax.set_xticks(sorted(ticks), [f"{t:,}" for t in sorted(ticks)])
    ax.minorticks_off()
    ax.set(xlabel="capacity (entries per layer)", ylabel="test accuracy (%)", title=title)
    ax.grid(True, alpha=0.3)
    fig.legend(fontsize="small", loc="outside right upper")
    return save_figure(fig, path)



def write_report(run: RunDir, cfg: MemoryBudgetConfig, summary: dict[str, Any],
                 device: torch.device) -> str:
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
    atomic_write_text(report, run.file("results.md"))
    atomic_write_text(results_csv(rows), run.file("results.csv"))
    title = f"{cfg.model}, one epoch of {d['n_train']:,} CIFAR-10 images"
    plot_accuracy_vs_capacity(rows, run.file("accuracy_vs_capacity.png"), title=title)
    return report
