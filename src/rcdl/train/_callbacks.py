"""What runs beside the training loop's steps: checkpoints, replay snapshots and the log of
each evaluation (``metrics.jsonl`` and the progress bar). The evaluation itself is
:class:`rcdl.train.loop.Evaluator`.

A callback is called after the steps it is :meth:`~Callback.due` at, once the deferred
checks have passed (:func:`rcdl.train.loop.train_one_pass`), in the order the loop lists
them: the evaluation, the replay snapshot, the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from torch import nn

from rcdl.nn.store import format_bytes
from rcdl.train._state import LoopState
from rcdl.train.checkpoint import Checkpointer
from rcdl.train.replay import ReplayLog


class Callback(Protocol):
    """Something the loop runs after some of its steps."""

    def due(self, step: int) -> bool:
        """Whether to run after ``step`` steps (all epochs)."""
        ...

    def __call__(self, step: int, state: LoopState) -> None: ...


class MetricLog(Protocol):
    """Where the loop appends its evaluation records (e.g. a run folder's ``metrics.jsonl``)."""

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None: ...


def store_size(grower: Any) -> tuple[int | None, int | None]:
    """Entries and bytes the grower's stores hold (None without a grower)."""
    if grower is None:
        return None, None
    return grower.num_entries_all_ranks(), grower.nbytes_all_ranks()  # every rank runs this


class SaveCheckpoints:
    """Saves the run (:class:`~rcdl.train.checkpoint.Checkpointer`) every ``checkpoints.every``
    steps before the last of ``steps``."""

    def __init__(self, checkpoints: Checkpointer, steps: int) -> None:
        self.checkpoints, self.steps = checkpoints, steps

    def due(self, step: int) -> bool:
        return self.checkpoints.due(step, self.steps)

    def __call__(self, step: int, state: LoopState) -> None:
        self.checkpoints.save(state)


class TakeSnapshots:
    """Snapshots the model and its learners into a replay log every ``replay.every`` steps
    (:meth:`rcdl.train.replay.ReplayLog.take`)."""

    def __init__(self, replay: ReplayLog, model: nn.Module, learners: list[Any]) -> None:
        self.replay, self.model, self.learners = replay, model, learners

    def due(self, step: int) -> bool:
        return self.replay.due(step)

    def __call__(self, step: int, state: LoopState) -> None:
        self.replay.take(step, self.model, self.learners)


class EvaluationLog:
    """Writes an evaluation where a reader sees it: a record in ``run`` (if given: ``{"model",
    "step", "samples", "epoch", <values>, "train_loss", "entries", "bytes",
    "train_seconds", "eval_seconds"}``) and the first metric, with the grower's entries and
    store size, on the progress bar ``bar``."""

    def __init__(self, name: str, grower: Any, run: MetricLog | None, bar: Any,
                 first: str) -> None:  # fmt: skip
        self.name, self.grower, self.run, self.bar, self.first = name, grower, run, bar, first

    def __call__(self, record: dict[str, Any], state: LoopState) -> None:
        """Log ``record`` (``{"step", "samples", "epoch", <values>}``), just added to
        ``state``'s history."""
        entries, nbytes = store_size(self.grower)
        if self.run is not None:
            self.run.log({
                "model": self.name, **record, "train_loss": state.last_loss,
                "entries": entries, "bytes": nbytes, "train_seconds": state.train_seconds,
                "eval_seconds": state.eval_seconds,
            })  # fmt: skip
        postfix: dict[str, object] = {self.first: f"{record[self.first]:.4g}"}
        if nbytes is not None:  # a grower
            postfix |= {"entries": entries, "store": format_bytes(nbytes)}
        self.bar.set_postfix(postfix, refresh=False)
