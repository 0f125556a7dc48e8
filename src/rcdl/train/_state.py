"""The training loop's state: what it counts, times and records besides the model and its
learners, and what a checkpoint holds of it (its ``loop`` part)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_NUMBER: tuple[type, ...] = (int, float)


@dataclass
class LoopState:
    """Where a run stands: ``step`` steps done (all epochs); ``history``, the evaluation
    records so far; the seconds spent training (``train_seconds``) and evaluating
    (``eval_seconds``); and the training losses of the steps since the last evaluation,
    ``loss_sum`` over ``loss_count`` steps, whose mean becomes ``last_loss`` (the
    ``train_loss`` a record reports) at the next evaluation.

    A checkpoint holds it as :meth:`state_dict`, ``{"step", "history", "clock": {"train",
    "eval"}, "loss_sum", "loss_count", "last_loss"}``; a resumed run continues from
    :meth:`load_state_dict` as if it had never stopped. The loop changes it only through
    its methods.
    """

    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    loss_sum: float = 0.0
    loss_count: int = 0
    last_loss: float | None = None
    # the loaded state dict (None: a fresh state), whose keys, their order and any this rcdl
    # does not know :meth:`state_dict` keeps, so a resumed run saves its loop as it was saved
    _loaded: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def advance(self, step: int, seconds: float) -> None:
        """``step`` steps are done, the last of them in ``seconds``."""
        self.step = step
        self.train_seconds += seconds

    def add_loss(self, total: float, count: int = 1) -> None:
        """``count`` more training losses, summing to ``total``."""
        self.loss_sum += total
        self.loss_count += count

    def record(self, entry: dict[str, Any], seconds: float) -> dict[str, Any]:
        """Append the evaluation record ``entry``, measured in ``seconds``; the mean of the
        training losses since the last record becomes ``last_loss`` (kept as it was if there
        were none). Returns ``entry``."""
        self.eval_seconds += seconds
        self.history.append(entry)
        if self.loss_count:
            self.last_loss = self.loss_sum / self.loss_count
            self.loss_sum, self.loss_count = 0.0, 0
        return entry

    def state_dict(self) -> dict[str, Any]:
        """The state as a checkpoint holds it (plain numbers, lists and dicts). After
        :meth:`load_state_dict`, the loaded dict with these values: its own keys (the same
        objects), in its order, with any this rcdl does not know."""
        clock = {"train": self.train_seconds, "eval": self.eval_seconds}
        state = {"step": self.step, "history": self.history, "clock": clock,
                 "loss_sum": self.loss_sum, "loss_count": self.loss_count,
                 "last_loss": self.last_loss}  # fmt: skip
        if self._loaded is None:
            return state
        loaded = dict(self._loaded)
        loaded.update(state)  # a key already there keeps its place and its object
        loaded["clock"] = dict(self._loaded["clock"])
        loaded["clock"].update(clock)
        return loaded

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict`'s layout, checked whole first).

        Raises:
            ValueError: naming what in ``state`` is not what the loop keeps (nothing changed).
        """
        problem = self.state_problem(state)
        if problem is not None:
            raise ValueError(f"the training loop's state: {problem}")
        self.step, self.history = state["step"], state["history"]
        self.train_seconds, self.eval_seconds = state["clock"]["train"], state["clock"]["eval"]
        self.loss_sum, self.loss_count = state["loss_sum"], state["loss_count"]
        self.last_loss = state["last_loss"]
        self._loaded = state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LoopState:
        """A state that continues from ``state`` (:meth:`load_state_dict`)."""
        loop = cls()
        loop.load_state_dict(state)
        return loop

    @staticmethod
    def state_problem(state: Any) -> str | None:
        """What makes ``state`` other than what :meth:`state_dict` writes (``None`` if
        nothing): a checkpoint whose loop part has one is skipped as a damaged one."""
        if not isinstance(state, dict):
            return f"it is a {type(state).__name__}, not a dict"
        kinds: dict[str, type | tuple[type, ...]] = {
            "step": int, "history": list, "clock": dict, "loss_sum": _NUMBER, "loss_count": int,
            "last_loss": (*_NUMBER, type(None))}  # fmt: skip
        for key, kind in kinds.items():
            value = state.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                return f"{key} is {type(value).__name__}, not what the training loop keeps"
        if not all(isinstance(state["clock"].get(k), _NUMBER) for k in ("train", "eval")):
            return "clock does not hold the train and eval seconds"
        if not all(isinstance(r, dict) and isinstance(r.get("step"), int)
                   for r in state["history"]):
            return "history is not a list of evaluation records"
        return None
