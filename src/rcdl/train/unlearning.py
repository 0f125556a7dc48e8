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

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rcdl.distributed import model_shard
from rcdl.memory.forgetting import ForgetReceipt, sample_index_tensor, scan_for_rows
from rcdl.memory.provenance import entry_samples, samples
from rcdl.nn.layers import growing_layers
from rcdl.ops.half import products_as
from rcdl.train.loop import Metric, train_step
from rcdl.train.replay import ReplayLog, Snapshot

__all__ = ["Rewound", "forget_exactly", "rewind", "stream_without"]


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
    without the samples ``sample_indices`` and those a fast ``forget(..., replay=replay)``
    removed before (:attr:`ReplayLog.forgotten <rcdl.train.replay.ReplayLog>`); returns a
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
    samples ``sample_indices`` had written (those a fast forget removed before are gone
    already); ``samples`` counts them and the earlier ones the replay left out;
    ``released`` says, per layer, the steps replayed; ``checkpoints`` the snapshots dropped
    (they held a future that changed). One process: a model sharded over ranks is refused.

    All or nothing: everything is checked before anything changes (the data against the
    log, the budgets, the snapshot), and if the replay fails part-way (a refused step, a
    non-finite loss) the model, its learners and the log are put back as they were before
    the call and the error is raised with a note saying so.

    Raises:
        ValueError: for indices that are not sample indices; data that do not match the
            log; a learner whose memory budget merges; a model whose stores changed
            otherwise than by training since the snapshot (a removal the log was not told
            of, an eviction of rows the snapshot held).
        FloatingPointError: a non-finite training loss while replaying (nothing changed).
    """
    start = time.perf_counter()
    wanted = sample_index_tensor(sample_indices, "forget_exactly")
    learners = _checked_request("forget_exactly", model, replay, data, optimizer, grower)
    layers = growing_layers(model)
    earlier = replay.forgotten[~torch.isin(replay.forgotten, wanted)]  # (F,) told forgets
    keep = ~torch.isin(replay.stream, torch.cat([wanted, earlier]))  # (N,) by stream position
    counts: dict[str, int] = {}
    gone_keys = []
    for name, layer in layers:
        mask = torch.isin(entry_samples(layer), wanted.to(layer.store.device))
        counts[name] = int(mask.sum())
        if scan and bool(mask.any()):
            gone_keys.append(layer.store.keys[mask].clone())
    left_out = int(torch.cat([wanted, earlier]).unique().numel())
    if bool(keep.all()):
        return ForgetReceipt(counts, left_out, time.perf_counter() - start,
                             {name: ["nothing to replay"] for name, _ in layers})
    batch = replay.batch_size
    first_step = int((~keep).nonzero()[0]) // batch  # the first batch that changes
    snap, dropped = _snapshot_for("forget_exactly", replay, model, first_step)
    steps = _replay_or_put_back("forget_exactly", model, learners, replay, snap, keep, data,
                                loss_fn, optimizer, grower, device)
    seconds = time.perf_counter() - start
    found = None
    if scan:
        roots = {"model": model, "replay": replay} | {
            f"learners[{i}]": x for i, x in enumerate(learners) if x is not None}
        found = scan_for_rows(roots, gone_keys)
    replayed = f"restored step {snap.step}, replayed {steps - snap.step} of {steps} steps"
    if earlier.numel():
        replayed += f", without {earlier.numel()} samples forgotten before by forget"
    return ForgetReceipt(counts, left_out, seconds, {name: [replayed] for name, _ in layers},
                         counts, [type(x).__name__ for x in learners if x is not None],
                         dropped, found)


@dataclass(frozen=True)
class Rewound:
    """What :func:`rewind` did.

    Attributes:
        step: the steps the model has now taken of the log's stream.
        restored: the step of the snapshot restored.
        replayed: the steps trained again from it (``step - restored``).
        dropped: the snapshots dropped (they held steps after ``step``), named
            ``"replay snapshot at step s"``.
        seconds: wall time.
    """

    step: int
    restored: int
    replayed: int
    dropped: list[str]
    seconds: float


def rewind(model: nn.Module, steps: int, *, replay: ReplayLog, data: tuple[Tensor, Tensor],
           loss_fn: Metric, optimizer: Any = None, grower: Any = None,
           device: torch.device | str = "cpu") -> Rewound:
    """Turn ``model`` (and its learners) into the model after the first ``steps`` steps of
    ``replay``'s stream: step undo and rewind through the log (docs/unlearning.md, "Step undo
    and rewind"). ``rewind(model, k - 1, ...)`` after ``k`` steps undoes the last one.

    The stream is the log's without the samples a fast ``forget(..., replay=replay)`` removed
    (:attr:`ReplayLog.forgotten <rcdl.train.replay.ReplayLog>`), in batches of the run's
    size: the result is, bit for bit, the model ``train_one_pass(..., order=...)`` makes on
    the first ``steps · batch_size`` positions of that stream. It restores the newest
    snapshot at or before ``steps`` and trains the steps from there (none where a snapshot
    was taken at ``steps``: ``every = 1`` makes an undo a restore), so it is exact for every
    layer the log can replay, the hybrid's and those under an evicting budget included, where
    :meth:`rcdl.optim.grower.Grower.drop_last_step` does not undo the hybrid's Adam moves or
    a budget's evictions. The log then describes the shorter run: its stream is cut after
    ``steps`` batches and the snapshots after them are dropped, so a later
    :func:`forget_exactly` replays that run.

    Arguments as for :func:`forget_exactly`. All or nothing, as there: everything is checked
    first, and a replay that fails part-way leaves the model, its learners and the log as
    they were.

    Raises:
        ValueError: ``steps`` not an integer in ``0..`` the stream's steps; data that do not
            match the log; a learner whose memory budget merges; a model whose memory changed
            since the snapshot otherwise than through the log.
        FloatingPointError: a non-finite training loss while replaying (nothing changed).
    """
    start = time.perf_counter()
    learners = _checked_request("rewind", model, replay, data, optimizer, grower)
    kept = ~torch.isin(replay.stream, replay.forgotten.to(replay.stream.device))  # (N,)
    batch = replay.batch_size
    total = -(-int(kept.sum()) // batch)
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= total:
        raise ValueError(f"rewind: steps must be an integer in 0..{total} (the steps of the "
                         f"log's stream), got {steps!r}")
    keep = kept & (kept.cumsum(0) <= steps * batch)  # (N,) the first steps' positions
    snap, dropped = _snapshot_for("rewind", replay, model, steps)
    if bool(keep.all()):
        return Rewound(steps, steps, 0, [], time.perf_counter() - start)
    _replay_or_put_back("rewind", model, learners, replay, snap, keep, data, loss_fn,
                        optimizer, grower, device)
    return Rewound(steps, snap.step, steps - snap.step, dropped, time.perf_counter() - start)


def _checked_request(who: str, model: nn.Module, replay: ReplayLog,
                     data: tuple[Tensor, Tensor], optimizer: Any, grower: Any) -> list[Any]:
    """What every replay request checks before it looks at its samples or steps: one
    process, data that match the log, no merging budget. Returns the learners."""
    if model_shard(model, who) is not None:
        raise ValueError(f"{who}: the model's stores are sharded over ranks; a replay runs "
                         "one process's run")
    _check_data(replay, *data, who)
    learners = [optimizer, grower]
    _check_budgets(learners, who)
    return learners


def _snapshot_for(who: str, replay: ReplayLog, model: nn.Module, step: int
                  ) -> tuple[Snapshot, list[str]]:
    """The newest snapshot at or before ``step``, checked against ``model`` (nothing changes
    where it is refused), and the later snapshots the replay will drop, named."""
    snap = replay.newest_at_or_before(step)
    problem = replay.restore_problem(snap, model) or replay.steps_problem(model)
    if problem is not None:
        raise ValueError(f"{who}: {problem}")
    return snap, [f"replay snapshot at step {s}" for s in sorted(replay.snapshots)
                  if s > snap.step]


def _replay_or_put_back(who: str, model: nn.Module, learners: list[Any], replay: ReplayLog,
                        snap: Snapshot, keep: Tensor, data: tuple[Tensor, Tensor],
                        loss_fn: Metric, optimizer: Any, grower: Any,
                        device: torch.device | str) -> int:
    """:func:`_replay`, or, where it fails part-way, everything put back as it was."""
    before = _State(model, learners, replay)
    try:
        return _replay(model, learners, replay, snap, keep, data, loss_fn, optimizer, grower,
                       torch.device(device), who)
    except BaseException as err:
        before.put_back()
        err.add_note(f"{who}: the model, its learners and the replay log are as they were "
                     "before the call")
        raise


def _replay(model: nn.Module, learners: list[Any], replay: ReplayLog, snap: Snapshot,
            keep: Tensor, data: tuple[Tensor, Tensor], loss_fn: Metric, optimizer: Any,
            grower: Any, device: torch.device, who: str) -> int:
    """Restore ``snap``, cut the stream to the positions ``keep (N,)`` and train its steps
    from the snapshot's on; returns the new stream's steps."""
    x_train, y_train = data
    replay.restore(snap, model, learners)  # checked first: refused, nothing changed
    order = replay.keep_only(keep)
    ids = order if replay.sample_ids is None else replay.sample_ids[order]
    batch = replay.batch_size
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
                    f"{who}: training loss is {loss} at step {step} of the replay")
            if replay.due(step + 1):
                replay.take(step + 1, model, learners)
    return steps


def _check_data(replay: ReplayLog, x_train: Tensor, y_train: Tensor, who: str) -> None:
    """Refuse data that cannot be the run's: inputs and labels of different lengths, fewer
    rows than the log's stream indexes, or another count than the run's sample ids."""
    order = replay.order
    if order is None:
        raise ValueError(f"{who}: the replay log holds no run (give it to "
                         "train_one_pass)")
    if len(x_train) != len(y_train):
        raise ValueError(f"{who}: data has {len(x_train)} inputs and {len(y_train)} "
                         "labels; give the (x_train, y_train) the run was trained on")
    if replay.sample_ids is not None and len(replay.sample_ids) != len(x_train):
        raise ValueError(f"{who}: data holds {len(x_train)} rows, the run's sample "
                         f"ids name {len(replay.sample_ids)}; give the (x_train, y_train) the "
                         "run was trained on")
    if order.numel() and int(order.max()) >= len(x_train):
        position = int((order >= len(x_train)).nonzero()[0])
        raise ValueError(f"{who}: data holds {len(x_train)} rows, but the log's stream "
                         f"trains row {int(order[position])} at position {position}; give the "
                         "(x_train, y_train) the run was trained on")


def _check_budgets(learners: list[Any], who: str) -> None:
    """Refuse a learner whose memory budget merges: a merge changes older rows in place,
    which a snapshot of row counts does not undo, so the replay would not be the retrained
    model. Eviction without merging keeps exactness (a snapshot's rows stay as written, or
    their loss is detected)."""
    for learner in learners:
        for grower in (learner, getattr(learner, "grower", None)):  # a HybridGrower's own
            budget = getattr(grower, "budget", None)
            if budget is not None and budget.merge:
                names = [layer.name for layer in getattr(grower, "layers", [])]
                raise ValueError(
                    f"{who}: the memory budget of {type(learner).__name__} merges "
                    f"evicted entries into kept ones (MemoryBudget(..., merge=True)) in layers "
                    f"{names}: a merge changes older rows in place, which the replay log's "
                    "snapshots do not undo, so the replay would not be the retrained model. "
                    "Train with a budget without merge (merge=False) to forget exactly, or "
                    "retrain on stream_without(log, samples)")


class _State:
    """The model (its state dict: stores, sample maps, parameters, buffers; and its mode),
    the learners' state dicts and the log's fields, copied, to put back after a failure."""

    def __init__(self, model: nn.Module, learners: list[Any], replay: ReplayLog) -> None:
        self.model, self.learners, self.replay = model, learners, replay
        self.training = model.training
        self.model_state = copy.deepcopy(model.state_dict())
        self.learner_states = [None if x is None else copy.deepcopy(x.state_dict())
                               for x in learners]
        self.log = replay.savepoint()

    @torch.no_grad()
    def put_back(self) -> None:
        for learner in self.learners:
            if learner is not None:
                learner.zero_grad(set_to_none=True)  # drop a batch recorded, not stepped
        self.model.load_state_dict(self.model_state)
        for _, layer in growing_layers(self.model):
            layer.release_rows()  # caches and indices of the rows that failed
        for learner, state in zip(self.learners, self.learner_states, strict=True):
            if learner is not None and state is not None:
                learner.load_state_dict(copy.deepcopy(state))
        self.model.train(self.training)
        self.replay.roll_back(self.log)
