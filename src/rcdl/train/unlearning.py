"""Exact forgetting: the model that training without the forgotten samples would have given
(docs/unlearning.md).

"Training without them" is the same run with those samples taken out of its stream: the same
order for every other sample, in batches of the same size, so every batch before the first
forgotten sample is unchanged and every batch after it is re-formed. That run is what
:func:`rcdl.train.loop.train_one_pass` makes when given ``order=`` that stream.

:func:`forget_exactly` makes it without starting over: it restores the newest snapshot of the
run's :class:`~rcdl.train.replay.ReplayLog` at or before the batch of the earliest forgotten
sample and replays the steps from there. The result is the retrained model bit for bit (the
same floating-point operations in the same order), at the cost of the steps replayed: a
forgotten sample seen late costs little, one seen in the first batch a whole retraining. The
same operations include the half-precision product path: the replay takes the one the run
recorded (:attr:`ReplayLog.products <rcdl.train.replay.ReplayLog>`), whatever a timing in
this process would choose, and a retraining to compare with takes it too
(``with rcdl.ops.half.products_as(replay.products): train_one_pass(...)``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rcdl.distributed import model_shard
from rcdl.memory.forgetting import ForgetReceipt, sample_index_tensor, scan_for_rows
from rcdl.memory.provenance import entry_samples, samples
from rcdl.nn.layers import growing_layers
from rcdl.ops.half import products_as
from rcdl.train.loop import Metric, train_step
from rcdl.train.replay import ReplayLog

__all__ = ["forget_exactly", "stream_without"]


def stream_without(replay: ReplayLog, sample_indices: Tensor | Sequence[int]) -> Tensor:
    """The run's order (positions into ``x_train``) with the samples ``sample_indices`` taken
    out: what ``train_one_pass(..., order=...)`` retrains on."""
    wanted = sample_index_tensor(sample_indices, "stream_without")
    assert replay.order is not None
    return replay.order[~torch.isin(replay.stream, wanted)]


def forget_exactly(model: nn.Module, sample_indices: Tensor | Sequence[int], *,
                   replay: ReplayLog, data: tuple[Tensor, Tensor], loss_fn: Metric,
                   optimizer: Any = None, grower: Any = None,
                   device: torch.device | str = "cpu", scan: bool = True) -> ForgetReceipt:
    """Turn ``model`` (and its learners) into the model trained on ``replay``'s stream
    without the samples ``sample_indices``; returns a
    :class:`~rcdl.memory.forgetting.ForgetReceipt`.

    Args:
        replay: the log ``train_one_pass(..., replay=replay)`` filled while training
            ``model``; it then describes the new run (its stream without the samples, its
            snapshots up to the restored one and those taken while replaying).
        data: ``(x_train, y_train)`` as given to ``train_one_pass``.
        loss_fn: as given to ``train_one_pass``.
        optimizer: as given to ``train_one_pass`` (``None``: none).
        grower: as given to ``train_one_pass`` (``None``: none).
        device: as given to ``train_one_pass``.
        scan: scan the model, the learners and the log for a forgotten key afterwards
            (:func:`rcdl.memory.forgetting.scan_for_rows`).

    The receipt's ``removed`` (and ``map_erased``) count, per layer, the entries the
    forgotten samples had written; ``released`` says, per layer, the steps replayed;
    ``checkpoints`` the snapshots dropped (they held a future that changed). One process:
    a model sharded over ranks is refused.

    Raises:
        ValueError: for indices that are not sample indices, or a model whose stores
            changed otherwise than by training since the snapshot (a removal, a budget).
    """
    start = time.perf_counter()
    wanted = sample_index_tensor(sample_indices, "forget_exactly")
    if model_shard(model, "forget_exactly") is not None:
        raise ValueError("forget_exactly: the model's stores are sharded over ranks; exact "
                         "forgetting replays one process's run")
    x_train, y_train = data
    learners = [optimizer, grower]
    layers = growing_layers(model)
    keep = ~torch.isin(replay.stream, wanted)  # (N,) by stream position
    counts: dict[str, int] = {}
    gone_keys = []
    for name, layer in layers:
        mask = torch.isin(entry_samples(layer), wanted.to(layer.store.device))
        counts[name] = int(mask.sum())
        if scan and bool(mask.any()):
            gone_keys.append(layer.store.keys[mask].clone())
    if bool(keep.all()):
        return ForgetReceipt(counts, int(wanted.unique().numel()), time.perf_counter() - start,
                             {name: ["nothing to replay"] for name, _ in layers})
    batch = replay.batch_size
    first_step = int((~keep).nonzero()[0]) // batch  # the first batch that changes
    snap = replay.newest_at_or_before(first_step)
    dropped = [f"replay snapshot at step {s}" for s in sorted(replay.snapshots) if s > snap.step]
    replay.restore(snap, model, learners)  # checked first: refused, nothing changed
    order = replay.keep_only(keep)
    ids = order if replay.sample_ids is None else replay.sample_ids[order]
    device = torch.device(device)
    model.train()
    steps = -(-len(order) // batch)
    with products_as(replay.products):  # the run's product path, not this process's timing
        for step in range(snap.step, steps):
            rows = order[step * batch : (step + 1) * batch]
            xb, yb = x_train[rows].to(device), y_train[rows].to(device)
            with samples(model, ids[step * batch : (step + 1) * batch]):
                loss = train_step(model, xb, yb, loss_fn, optimizer, grower)
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"forget_exactly: training loss is {loss} at step {step}")
            if replay.due(step + 1):
                replay.take(step + 1, model, learners)
    seconds = time.perf_counter() - start
    found = None
    if scan:
        roots = {"model": model, "replay": replay} | {
            f"learners[{i}]": x for i, x in enumerate(learners) if x is not None}
        found = scan_for_rows(roots, gone_keys)
    replayed = f"restored step {snap.step}, replayed {steps - snap.step} of {steps} steps"
    return ForgetReceipt(counts, int(wanted.unique().numel()), seconds,
                         {name: [replayed] for name, _ in layers}, counts,
                         [type(x).__name__ for x in learners if x is not None], dropped, found)
