"""The log-size study: what a saved replay log costs on disk (docs/unlearning.md, "What a
snapshot costs").

For each growing model and seed, one sub-run trains the model one pass (batch
``batch_size``) over the first ``train_size`` images of the stored training split (the
one-epoch protocol's order, as ``rcdl reproduce cifar10-1epoch`` reads it; the first
``test_size`` test images are scored once, at the end, and the sizes do not depend on them)
with a replay log (:class:`rcdl.train.replay.ReplayLog`, a snapshot every ``K`` steps and at
step 0, ``K`` from ``log_size_every``: one for all models or one per model), saves the log
(``ReplayLog.save``) and the model's own state (``save_checkpoint`` of its state dict and its
grower's) to temporary files, and records their sizes: the log file, the same log saved
without its snapshots, the file bytes per snapshot (their difference over the snapshots),
the largest snapshot's tensors, the model's state and the optimizer's (the hybrid's Adam
moments). Then forgets one sample from the middle of the stream exactly
(:func:`rcdl.train.unlearning.forget_exactly`, without the scan for left-over keys) and
records the steps replayed and the seconds. Writes ``replay_log_size.json`` into the run
folder.

The hybrid's snapshots copy its stores and Adam moments whole (2–3 MB more each training
step on CIFAR-10), so ``K`` sets its log's size: pick it from that before running.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rcdl.app.cifar import CifarData, load_subsets
from rcdl.app.experiments.unlearning.config import UnlearningConfig, study_runs
from rcdl.app.recipes import train_with_learners
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.app.runner import Session
from rcdl.train.checkpoint import save_checkpoint
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly

__all__ = ["STUDY", "log_size", "report", "sub_runs", "tables"]

STUDY = "log-size"
Leading = tuple[Tensor, Tensor, Tensor, Tensor]  # x_train, y_train, x_test, y_test


def leading_images(cfg: UnlearningConfig) -> Leading:
    """The first ``train_size`` / ``test_size`` images of the stored splits (all: ``None``),
    from the copy the experiment's data was read from (never downloaded)."""
    whole = load_subsets("cifar10", dataclasses.replace(cfg, train_size=None, test_size=None),
                         download=False, whole_in_order=True)
    return (whole.x_train[: cfg.train_size].clone(), whole.y_train[: cfg.train_size].clone(),
            whole.x_test[: cfg.test_size].clone(), whole.y_test[: cfg.test_size].clone())


def _file_bytes(obj: object, folder: str, name: str) -> int:
    """The bytes of ``save_checkpoint(obj)`` in a file of ``folder``, removed afterwards."""
    path = os.path.join(folder, name)
    save_checkpoint(obj, path)
    size = os.path.getsize(path)
    os.remove(path)
    return size


def log_size(name: str, seed: int, every: int, data: Callable[[], Leading],
             cfg: UnlearningConfig, session: Session) -> dict[str, Any]:  # fmt: skip
    """One sub-run (the module docstring): train ``name`` with a replay log, save it and the
    model, forget one sample exactly; a JSON-able result."""
    x, y, x_test, y_test = data()
    log = ReplayLog(every=every)
    model, optimizer, grower, result = train_with_learners(
        name, seed, x, y, (x_test, y_test), batch_size=cfg.batch_size, device=session.device,
        replay=log)
    row: dict[str, Any] = {
        "study": STUDY, "model": name, "seed": seed, "images": len(x), "every": every,
        "snapshots": len(log.snapshots), "train_seconds": result["train_seconds"],
        "log_tensor_bytes": log.nbytes,
        "largest_snapshot_tensor_bytes": max(s.nbytes for s in log.snapshots.values())}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"{name}.log.pt")
        start = time.perf_counter()
        log.save(path)
        row["save_seconds"] = time.perf_counter() - start
        row["log_file_bytes"] = os.path.getsize(path)
        start = time.perf_counter()
        loaded = ReplayLog.load(path)
        row["load_seconds"] = time.perf_counter() - start
        if sorted(loaded.snapshots) != sorted(log.snapshots):
            raise RuntimeError(f"log-size: {name}'s log read back with other snapshots")
        del loaded
        os.remove(path)
        row["stream_file_bytes"] = _file_bytes(log.state_dict() | {"snapshots": {}}, folder,
                                               f"{name}.stream.pt")
        row["bytes_per_snapshot"] = ((row["log_file_bytes"] - row["stream_file_bytes"])
                                     / row["snapshots"])
        state = {"model": model.state_dict(), "grower": grower.state_dict()}
        row["model_state_bytes"] = _file_bytes(state, folder, f"{name}.pt")
        row["optimizer_state_bytes"] = (None if optimizer is None else _file_bytes(
            optimizer.state_dict(), folder, f"{name}.opt.pt"))
    row["entries"] = {layer.name: len(layer.store) for layer in grower.layers}
    # one sample from the middle of the stream, forgotten exactly
    stream = log.stream
    position = len(stream) // 2
    sample = int(stream[position])
    restored = max(s for s in log.snapshots if s <= position // log.batch_size)
    start = time.perf_counter()
    receipt = forget_exactly(model, [sample], replay=log, data=(x, y), loss_fn=F.cross_entropy,
                             optimizer=optimizer, grower=grower, device=session.device,
                             scan=False)
    row["forget"] = {"sample": sample, "position": position, "restored_step": restored,
                     "receipt": next(iter(receipt.released.values()))[0],
                     "seconds": time.perf_counter() - start}
    return row


def sub_runs(cfg: UnlearningConfig, data: CifarData, session: Session) -> Iterator:
    """``log-size-<model>-seed<k>`` for each growing model (seeds outer); the leading
    images are read once, by the first of them that runs."""
    everies = dict(zip(cfg.models, cfg.log_size_every * len(cfg.models) if
                       len(cfg.log_size_every) == 1 else cfg.log_size_every, strict=True))
    leading = cache(partial(leading_images, cfg))
    for key, name, seed in study_runs(STUDY, cfg):
        yield key, partial(log_size, name, seed, everies[name], leading, cfg, session)


def tables(rows: list[dict[str, Any]]) -> str:
    """The sizes' table and the forgetting's, in markdown."""
    lines = ["| model | seed | images | every | snapshots | log file bytes | without snapshots "
             "| bytes per snapshot | largest snapshot (tensors) | model state bytes | "
             "optimizer state bytes | training s | save s | load s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        opt = "—" if r["optimizer_state_bytes"] is None else f"{r['optimizer_state_bytes']:,}"
        lines.append(
            f"| {r['model']} | {r['seed']} | {r['images']:,} | {r['every']} | {r['snapshots']} "
            f"| {r['log_file_bytes']:,} | {r['stream_file_bytes']:,} | "
            f"{r['bytes_per_snapshot']:,.0f} | {r['largest_snapshot_tensor_bytes']:,} | "
            f"{r['model_state_bytes']:,} | {opt} | {r['train_seconds']:.1f} | "
            f"{r['save_seconds']:.1f} | {r['load_seconds']:.1f} |")
    lines += ["", "| model | seed | forgotten sample (stream position) | replay | seconds |",
              "|---|---:|---|---|---:|"]
    for r in rows:
        f = r["forget"]
        lines.append(f"| {r['model']} | {r['seed']} | {f['sample']} ({f['position']}) | "
                     f"{f['receipt']} | {f['seconds']:.1f} |")
    return "\n".join(lines)


def report(run: RunDir, cfg: UnlearningConfig, runs: list[dict[str, Any]],
           summary: dict[str, Any], device: torch.device) -> str:  # fmt: skip
    """Write ``replay_log_size.json``; return the markdown section."""
    images = runs[0]["images"] if runs else 0
    run.write_json("replay_log_size.json", {"machine": describe_machine(device),
                                            "images": images, "rows": runs})
    return (f"## What a saved replay log costs on disk\n\nThe first {images:,} images of the "
            f"stored training split, batch {cfg.batch_size}, one pass; the files written to "
            "a temporary folder and removed (`replay_log_size.json`).\n\n" + tables(runs))
