"""Online training for growing and parametric models alike: one pass, or several epochs.

A growing model learns by writing entries (``Grower.step`` after ``loss.backward()``); a
parametric model learns by a torch optimizer step; a hybrid does both, optimizer first.
Either way the loop is the same: one pass (docs/reference.md §6) — or ``epochs`` passes
(docs/reference.md §8) — over seeded random permutations of the training set in batches, with the
test metric evaluated every ``eval_every`` steps and at the end of every epoch. A growing model
keeps writing entries in every epoch: ``epochs`` passes over ``N`` samples store ``epochs · N``
entries per layer.

Global step ``s`` is batch ``t = s mod S`` of epoch ``e = s div S`` (``S = ceil(N / B)``
steps per epoch), i.e. ``perm_e[t*B : (t+1)*B]`` with ``perm_e = epoch_permutation(N, seed,
e)`` a pure function of ``(seed, e)``, so a run is fully described by ``(seed, step)`` — the
seam a checkpoint/resume needs.

:func:`train_one_pass` puts the loop together from its pieces: a :class:`LoopConfig` (how it
runs), the :class:`Schedule` of its batches, a :class:`LoopState` (where it stands: the step,
the clocks, the losses and the evaluation records, all a checkpoint holds of the loop), the
steps (:func:`train_step` on each batch), and beside them the callbacks due after some steps,
in this order: the evaluation (:class:`Evaluator`, logged to ``metrics.jsonl`` and the
progress bar), the replay snapshot and the checkpoint.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypedDict, Unpack, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

with warnings.catch_warnings():  # in Jupyter without ipywidgets tqdm.auto falls back to the
    warnings.filterwarnings("ignore", message="IProgress not found")  # text bar: say nothing
    from tqdm.auto import tqdm

from rcdl.memory.forgetting import sample_index_tensor
from rcdl.memory.provenance import samples
from rcdl.nn.backends import disable_eval_cache, enable_eval_cache, start_evaluation
from rcdl.nn.layers import growing_layers
from rcdl.nn.networks import eval_mode
from rcdl.ops.half import products_as
from rcdl.train._callbacks import (
    Callback,
    EvaluationLog,
    MetricLog,
    SaveCheckpoints,
    TakeSnapshots,
    store_size,
)
from rcdl.train._state import LoopState
from rcdl.train.checkpoint import Checkpointer
from rcdl.train.replay import ReplayLog

__all__ = ["Checkpointer", "Evaluator", "GrowerLike", "LoopConfig", "LoopSettings", "LoopState",
           "MetricLog", "Schedule", "accuracy", "epoch_permutation", "evaluate", "predict",
           "train_one_pass", "train_step"]

Metric = Callable[[Tensor, Tensor], Tensor]  # (predictions, targets) -> scalar
# the keys of an evaluation record besides the metrics (see ``train_one_pass``)
_RECORD_KEYS = frozenset({"model", "step", "samples", "epoch", "train_loss", "entries", "bytes",
                          "train_seconds", "eval_seconds"})  # fmt: skip


class GrowerLike(Protocol):
    """What the loop needs from a grower (:class:`rcdl.optim.grower.Grower`,
    :class:`rcdl.optim.hybrid_grower.HybridGrower`)."""

    def num_entries_all_ranks(self) -> int: ...

    def nbytes_all_ranks(self) -> int: ...

    def step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    @property
    def defer_checks(self) -> bool: ...

    def check(self) -> None: ...


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accuracy(logits: Tensor, targets: Tensor) -> Tensor:
    """Fraction of rows whose largest logit is the target class."""
    return (logits.argmax(dim=1) == targets).float().mean()


@torch.no_grad()
def predict(model: nn.Module, x: Tensor, *, batch_size: int = 1000,
            device: torch.device | str = "cpu") -> Tensor:  # (N, D_out) on ``device``
    """``model(x)`` in eval mode, ``batch_size`` rows at a time (each moved to ``device``),
    without gradients; every submodule's mode is restored after (:func:`eval_mode`)."""
    with eval_mode(model):
        return torch.cat([model(xb.to(device)) for xb in x.split(batch_size)])


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    metrics: Mapping[str, Metric],
    *,
    batch_size: int = 1000,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Every ``metric(model(x), y)`` over the whole set, from one prediction pass in eval mode.

    Args:
        x: inputs ``(N, D_in)``; y: targets ``(N, ...)``; both moved to ``device`` per batch.
        metrics: ``{name: (predictions, targets) -> scalar}`` over all ``N`` samples at once.

    Raises:
        ValueError: a metric fails on the predictions and targets (a metric of another
            task: mean squared error against class labels, say), naming it and their shapes.
    """
    preds = predict(model, x, batch_size=batch_size, device=device)  # (N, D_out)
    y = y.to(device)
    values = {}
    for name, fn in metrics.items():
        try:
            values[name] = float(fn(preds, y))
        except (RuntimeError, ValueError, TypeError, IndexError) as err:
            raise ValueError(
                f"the test metric {name!r} ({getattr(fn, '__name__', fn)}) fails on the "
                f"predictions {tuple(preds.shape)} {preds.dtype} and targets "
                f"{tuple(y.shape)} {y.dtype}: {err}. Pass metrics={{name: fn(predictions, "
                "targets)}} that fit the model's outputs and the targets") from err
    return values


def default_metrics(loss_fn: Metric, y_test: Tensor) -> dict[str, Metric]:
    """The test metrics :func:`train_one_pass` measures when given none: ``{"test_mse":
    mse}`` for the default loss (mean squared error); for integer class targets ``(M,)``
    (a classification loss such as cross-entropy) the accuracy and the loss itself,
    ``{"test_acc": accuracy, "test_loss": loss_fn}``; else the loss, ``{"test_loss":
    loss_fn}``."""
    if loss_fn is F.mse_loss:
        return {"test_mse": F.mse_loss}
    if y_test.ndim == 1 and not (y_test.is_floating_point() or y_test.is_complex()):
        return {"test_acc": accuracy, "test_loss": loss_fn}
    return {"test_loss": loss_fn}


@contextmanager
def _eval_caches(layers: list) -> Iterator[None]:  # noqa: ANN001
    """Incremental evaluation for these growing layers while the block runs; then freed."""
    for layer in layers:
        enable_eval_cache(layer)
    try:
        yield
    finally:
        for layer in layers:
            disable_eval_cache(layer)


def epoch_permutation(n: int, seed: int, epoch: int) -> Tensor:
    """The order of the ``n`` training samples in epoch ``epoch`` (0-based), ``(n,)`` int64.

    The ``epoch``-th permutation drawn from a generator seeded with ``seed``: epoch 0 is
    ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` (the one-pass
    order), and every epoch's order is a pure function of ``(seed, epoch)`` that a resumed
    run recomputes. Different seeds give unrelated sequences of orders.
    """
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epoch):  # O(epoch · n): negligible beside one training step
        torch.randperm(n, generator=gen)
    return torch.randperm(n, generator=gen)


@dataclass(frozen=True)
class Schedule:
    """The step arithmetic of ``epochs`` passes over ``n`` samples in batches of
    ``batch_size``: global step ``s`` is batch ``t = s mod S`` of epoch ``e = s div S``
    (``S`` steps per epoch), samples ``perm_e[t·B : (t+1)·B]`` with ``perm_e =
    epoch_permutation(n, seed, e)``, or ``order`` (one epoch of ``n = len(order)``
    positions) where it is given."""

    n: int
    batch_size: int
    epochs: int
    seed: int
    order: Tensor | None = None

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n / self.batch_size)

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def seen(self, step: int) -> int:
        """Samples seen after ``step`` steps, all epochs."""
        done, t = divmod(step, self.steps_per_epoch)
        return done * self.n + min(t * self.batch_size, self.n)

    def batches(self, start: int) -> Iterator[tuple[int, Tensor]]:
        """``(step, sample indices (B,))`` from step ``start`` to the end."""
        perm, perm_epoch = torch.empty(0, dtype=torch.long), None  # set at the first step
        for step in range(start, self.steps):
            epoch, t = divmod(step, self.steps_per_epoch)
            if epoch != perm_epoch:
                perm, perm_epoch = self.permutation(epoch), epoch  # (N,)
            yield step, perm[t * self.batch_size : (t + 1) * self.batch_size]

    def permutation(self, epoch: int) -> Tensor:  # (n,) int64
        """The order of epoch ``epoch``."""
        return epoch_permutation(self.n, self.seed, epoch) if self.order is None else self.order

    def ends_epoch(self, step: int) -> bool:
        """Whether ``step`` steps done is the end of an epoch."""
        return step % self.steps_per_epoch == 0


def _replay_problem(part: Any, replay: ReplayLog | None, schedule: Schedule, batch_size: int,
                    sample_ids: Tensor | None) -> str | None:
    """What makes a checkpoint's replay part other than a log of this run (``None`` if
    nothing): not a log at all, or a log of another stream, batch size, sample ids or
    snapshot interval."""
    problem = ReplayLog.state_problem(part)
    if problem is not None:
        return problem
    if replay is not None and part["every"] != replay.every:
        return f"it snapshots every {part['every']} steps, this run's log every {replay.every}"
    order, ids = part["order"], part["sample_ids"]
    if order is None or part["batch_size"] != batch_size or not torch.equal(
            order, schedule.permutation(0).to(order.device)):
        return "it records another stream or batch size than this run's"
    if (ids is None) != (sample_ids is None) or (
            ids is not None and sample_ids is not None and not torch.equal(
                ids, sample_ids.to(ids.device))):
        return "it records other sample ids than this run's"
    return None


class Evaluator:
    """The evaluation beside the loop, due every ``every`` steps and at the end of every
    epoch: measures the test metrics (and ``on_epoch_end``'s values at epoch ends), records
    them in the loop's state (:meth:`LoopState.record`, the time on the eval clock) and hands
    the record to ``log`` (``metrics.jsonl`` and the progress bar: an ``EvaluationLog``).
    ``cached`` growing layers evaluate incrementally (:func:`train_one_pass`)."""

    def __init__(self, model: nn.Module, test: tuple[Tensor, Tensor],
                 metrics: Mapping[str, Metric], *, schedule: Schedule, every: int,
                 batch_size: int, device: torch.device, name: str,
                 on_epoch_end: Callable[[int], Mapping[str, float]] | None, cached: list,
                 log: Callable[[dict[str, Any], LoopState], None]) -> None:  # fmt: skip
        self.model, self.test, self.metrics, self.schedule = model, test, metrics, schedule
        self.every, self.batch_size, self.device, self.name = every, batch_size, device, name
        self.on_epoch_end, self.cached, self.log = on_epoch_end, cached, log

    def due(self, step: int) -> bool:
        """Whether to evaluate after ``step`` steps: every ``every``, and at epoch ends."""
        return step % self.every == 0 or self.schedule.ends_epoch(step)

    def measure(self, step: int) -> dict[str, float]:
        """The metrics after ``step`` steps, plus ``on_epoch_end``'s at an epoch's end."""
        for layer in self.cached:
            start_evaluation(layer)
        values = evaluate(self.model, *self.test, self.metrics, batch_size=self.batch_size,
                          device=self.device)  # fmt: skip
        if self.on_epoch_end is not None and self.schedule.ends_epoch(step):
            extra = {k: float(v) for k, v in
                     self.on_epoch_end(step // self.schedule.steps_per_epoch).items()}
            taken = _RECORD_KEYS.union(values).intersection(extra)
            if taken:
                raise ValueError(
                    f"{self.name}: on_epoch_end returned {sorted(taken)}, names the loop's "
                    f"records already use ({', '.join(sorted(_RECORD_KEYS.union(values)))})"
                )
            values |= extra
        return values

    def __call__(self, step: int, state: LoopState) -> None:
        """Measure after ``step`` steps, record it in ``state`` and log it."""
        _sync(self.device)
        t0 = time.perf_counter()
        values = self.measure(step)
        _sync(self.device)
        seconds = time.perf_counter() - t0
        samples = self.schedule.seen(step)
        record = {"step": step, "samples": samples, "epoch": samples / self.schedule.n, **values}
        self.log(state.record(record, seconds), state)


@overload
def train_step(model: nn.Module, xb: Tensor, yb: Tensor, loss_fn: Metric,
               optimizer: torch.optim.Optimizer | None = None,
               grower: GrowerLike | None = None, *, sync: Literal[True] = True) -> float: ...
@overload
def train_step(model: nn.Module, xb: Tensor, yb: Tensor, loss_fn: Metric,
               optimizer: torch.optim.Optimizer | None = None,
               grower: GrowerLike | None = None, *, sync: Literal[False]) -> Tensor: ...


def train_step(model: nn.Module, xb: Tensor, yb: Tensor, loss_fn: Metric,
               optimizer: torch.optim.Optimizer | None = None,
               grower: GrowerLike | None = None, *, sync: bool = True) -> float | Tensor:
    """One training step, the learner protocol of :func:`train_one_pass`:
    ``loss = loss_fn(model(xb), yb)``, ``loss.backward()``, then each learner in turn —
    ``optimizer`` first, then ``grower`` — ``step()`` and ``zero_grad()``. Whichever learner
    holds a parameter (an :class:`rcdl.optim.hybrid_grower.HybridGrower` holds the model's ordinary
    parameters too), its gradient is zeroed after the step that used it, so
    ``grower=HybridGrower(m)`` and ``optimizer=EntryAdam(m), grower=Grower(m)`` train alike.

    Returns the loss as a float (a device sync, so clocks are honest). A non-finite loss is
    returned before any backward or step (the caller names the step). With ``sync=False``
    the step reads nothing back: it returns the loss as a detached 0-dim tensor and runs the
    backward and the steps whatever its value (a grower with ``defer_checks`` then refuses
    the step on the device; the caller checks the loss later, as :func:`train_one_pass`
    does at its check points)."""
    loss = loss_fn(model(xb), yb)
    if not sync:
        loss.backward()
        _step_learners(optimizer, grower)
        return loss.detach()
    loss_value = loss.item()
    if not math.isfinite(loss_value):
        return loss_value
    loss.backward()
    _step_learners(optimizer, grower)
    return loss_value


def _step_learners(*learners: torch.optim.Optimizer | GrowerLike | None) -> None:
    for learner in learners:
        if learner is not None:
            learner.step()
            learner.zero_grad(set_to_none=True)


class _DeferredLoss:
    """The training losses of sync-free steps, kept on the device: their sum since the last
    :meth:`settle`, and the first non-finite one with its step, as ``(3,)`` float64
    ``[sum, step, loss]`` (step −1: none). :meth:`settle` reads them in one go."""

    def __init__(self) -> None:
        self.state: Tensor | None = None
        self.count = 0

    def add(self, loss: Tensor, step: int) -> None:
        loss = loss.double()
        if self.state is None:
            self.state = torch.tensor([0.0, -1.0, 0.0], dtype=torch.float64, device=loss.device)
        first_bad = (self.state[1] < 0) & ~loss.isfinite()
        bad = torch.where(first_bad, torch.stack([loss.new_tensor(float(step)), loss]),
                          self.state[1:])
        self.state = torch.cat([(self.state[0] + loss)[None], bad])
        self.count += 1

    def settle(self, name: str, state: LoopState) -> None:
        """Add the losses to ``state`` (:meth:`LoopState.add_loss`); raise
        ``FloatingPointError`` naming the first step whose loss was not finite."""
        if self.state is None:
            return
        total, step, value = self.state.tolist()  # the one read
        self.state = None
        if step >= 0:
            raise FloatingPointError(f"{name}: training loss is {value} at step {int(step)} "
                                     "(found at a deferred check)")
        state.add_loss(total, self.count)
        self.count = 0


def _check_arguments(name: str, data: tuple, optimizer: Any, grower: Any, metrics: Mapping,
                     batch_size: int, eval_every: int, epochs: int) -> None:  # fmt: skip
    if optimizer is None and grower is None:
        raise ValueError(f"{name}: give an optimizer, a grower or both; got neither")
    if batch_size < 1 or eval_every < 1 or epochs < 1:
        raise ValueError(
            f"{name}: batch_size, eval_every and epochs must be >= 1, got {batch_size}, "
            f"{eval_every} and {epochs}"
        )
    if not metrics:
        raise ValueError(f"{name}: give at least one test metric")
    x_train, y_train, x_test, y_test = data
    if len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise ValueError(
            f"{name}: inputs and targets differ in length: train {len(x_train)} vs "
            f"{len(y_train)}, test {len(x_test)} vs {len(y_test)}"
        )
    if len(x_train) == 0 or len(x_test) == 0:
        raise ValueError(f"{name}: empty data set: {len(x_train)} train and {len(x_test)} test "
                         "samples")


def _check_sample_ids(name: str, sample_ids: Tensor, n: int) -> Tensor:  # (N,) int64
    """The caller's ids, checked as forgetting checks sample indices, one per row."""
    if not isinstance(sample_ids, Tensor) or sample_ids.shape != (n,):
        raise ValueError(f"{name}: sample_ids must be an integer tensor ({n},), one id per "
                         f"training row, got {getattr(sample_ids, 'dtype', type(sample_ids))} "
                         f"{tuple(getattr(sample_ids, 'shape', ()))}")
    return sample_index_tensor(sample_ids, f"{name}: sample_ids")


def _check_order(name: str, order: Tensor, n: int, epochs: int) -> Tensor:  # (M,) int64
    if not isinstance(order, Tensor) or order.dim() != 1 or order.is_floating_point() or (
            order.dtype == torch.bool) or order.numel() == 0:
        raise ValueError(f"{name}: order must be a non-empty 1-D integer tensor of positions "
                         f"into x_train, got {getattr(order, 'dtype', type(order))} "
                         f"{tuple(getattr(order, 'shape', ()))}")
    order = order.long().cpu()
    if bool(((order < 0) | (order >= n)).any()) or order.unique().numel() != order.numel():
        raise ValueError(f"{name}: order must hold distinct positions in [0, {n})")
    if epochs != 1:
        raise ValueError(f"{name}: an order is one epoch, got epochs={epochs}")
    return order


@dataclass(frozen=True)
class LoopConfig:
    """How :func:`train_one_pass` runs its steps, evaluations and checkpoints (its arguments
    of the same names, documented there): the batches (``batch_size``, ``seed``,
    ``epochs``), the evaluation cadence (``eval_every`` steps, ``eval_batch_size`` rows per
    prediction batch), the ``device``, the run's ``name`` and progress bar, the checkpoints
    (``checkpoint_path``, every ``checkpoint_every`` steps, default ``eval_every``) and
    incremental evaluation. Given whole as ``train_one_pass(..., config=...)``, or built by
    it from those keywords."""

    batch_size: int
    seed: int = 0
    epochs: int = 1
    eval_every: int = 50
    eval_batch_size: int = 1000
    device: torch.device | str = "cpu"
    name: str = "model"
    progress: bool = True
    checkpoint_path: str | Path | None = None
    checkpoint_every: int | None = None
    incremental_eval: bool = False

    @property
    def save_every(self) -> int:
        """Steps between checkpoints."""
        return self.checkpoint_every or self.eval_every


class LoopSettings(TypedDict, total=False):
    """The keywords of :func:`train_one_pass` that a :class:`LoopConfig` holds, one per
    field (its types; its defaults apply to those not given)."""

    batch_size: int
    seed: int
    epochs: int
    eval_every: int
    eval_batch_size: int
    device: torch.device | str
    name: str
    progress: bool
    checkpoint_path: str | Path | None
    checkpoint_every: int | None
    incremental_eval: bool


def _loop_config(config: LoopConfig | None, settings: LoopSettings) -> LoopConfig:
    """The run's :class:`LoopConfig`: ``config`` as given, else one of the keyword
    ``settings`` (:func:`train_one_pass`); a ``TypeError`` naming the clash where both are
    given, naming what is missing or unknown elsewhere."""
    unknown = sorted(set(settings) - set(LoopSettings.__annotations__))
    if unknown:
        raise TypeError(f"train_one_pass() got unexpected keyword arguments {unknown}")
    if config is None:
        if "batch_size" not in settings:
            raise TypeError("train_one_pass() needs batch_size=..., or the settings whole as "
                            "config=LoopConfig(batch_size=...)")
        return LoopConfig(**settings)
    if not isinstance(config, LoopConfig):
        raise TypeError(f"train_one_pass(): config must be a rcdl.train.loop.LoopConfig, got "
                        f"{type(config).__name__}")
    if settings:
        given = ", ".join(f"{key}={value!r}" for key, value in settings.items())
        raise TypeError(
            f"train_one_pass() got config= and the keywords {given}, which the config "
            f"holds too: give the settings one way (dataclasses.replace(config, "
            f"{next(iter(settings))}=...) changes a setting of a config)")
    return config


class _Steps:
    """The training side of the loop: one :func:`train_step` of the learners on a batch of
    ``train`` (moved to the device), the entries it writes remembering their samples
    (``sample_ids``, default the rows' positions), and its loss added to the loop's state.
    With a grower whose checks are deferred the step reads nothing back: the losses stay on
    the device until :meth:`settle` checks them and the grower's steps."""

    def __init__(self, model: nn.Module, train: tuple[Tensor, Tensor], loss_fn: Metric,
                 optimizer: torch.optim.Optimizer | None, grower: GrowerLike | None,
                 config: LoopConfig, sample_ids: Tensor | None) -> None:  # fmt: skip
        self.model, (self.x, self.y), self.loss_fn = model, train, loss_fn
        self.optimizer, self.grower, self.sample_ids = optimizer, grower, sample_ids
        self.device, self.name = torch.device(config.device), config.name
        self.deferred = grower is not None and grower.defer_checks
        self.losses = _DeferredLoss()

    def __call__(self, step: int, idx: Tensor, state: LoopState) -> None:
        """Train on the samples ``idx`` ``(B,)`` as step ``step``."""
        xb, yb = self.x[idx].to(self.device), self.y[idx].to(self.device)
        ids = idx if self.sample_ids is None else self.sample_ids[idx]
        args = self.model, xb, yb, self.loss_fn, self.optimizer, self.grower
        with samples(self.model, ids):  # the entries written remember their samples
            if self.deferred:  # no read back: the loss is checked at the next settle()
                self.losses.add(train_step(*args, sync=False), step)
            else:
                loss_value = train_step(*args)
                if not math.isfinite(loss_value):
                    raise FloatingPointError(
                        f"{self.name}: training loss is {loss_value} at step {step}")
                state.add_loss(loss_value)

    def settle(self, state: LoopState) -> None:
        """The deferred checks (none unless deferred): the losses, then the grower's."""
        if self.deferred:
            self.losses.settle(self.name, state)
            assert self.grower is not None
            self.grower.check()


def _run(schedule: Schedule, state: LoopState, steps: _Steps, evaluate: Evaluator,
         callbacks: list[Callback], bar: Any) -> None:
    """The loop: an evaluation first (unless ``state`` holds one), then the steps from
    ``state.step`` on, each on the train clock. After a step the deferred checks run where a
    callback is due or the run ends, before anything is recorded or saved; then the
    callbacks due, in their order."""
    if not state.history:
        evaluate(0, state)
    for step, idx in schedule.batches(state.step):
        t0 = time.perf_counter()
        steps(step, idx, state)
        state.advance(step + 1, time.perf_counter() - t0)
        bar.update(len(idx))
        due = [callback for callback in callbacks if callback.due(step + 1)]
        if due or step + 1 == schedule.steps:
            steps.settle(state)
        for callback in due:
            callback(step + 1, state)


def _checkpointer(config: LoopConfig, schedule: Schedule, model: nn.Module,
                  optimizer: torch.optim.Optimizer | None, grower: GrowerLike | None,
                  replay: ReplayLog | None, sample_ids: Tensor | None) -> Checkpointer | None:
    """The run's checkpoints at ``config.checkpoint_path`` (``None`` without one), which
    refuse a checkpoint of another run, loop state or replay stream."""
    if config.checkpoint_path is None:
        return None
    identity = {"name": config.name, "seed": config.seed, "batch_size": config.batch_size,
                "train_samples": schedule.n}  # fmt: skip
    return Checkpointer(
        config.checkpoint_path, config.save_every, identity, model, optimizer, grower,
        loop_problem=LoopState.state_problem, replay=replay,
        replay_problem=lambda part: _replay_problem(part, replay, schedule, config.batch_size,
                                                    sample_ids))


def _resume(config: LoopConfig, schedule: Schedule, checkpoints: Checkpointer | None,
            replay: ReplayLog | None, model: nn.Module, learners: list[Any],
            sample_ids: Tensor | None) -> tuple[LoopState, bool]:
    """The state the loop starts from, and whether it was resumed: the newest usable
    checkpoint's (its model and learners loaded, :meth:`Checkpointer.restore`), else a fresh
    one. A replay log continues the checkpoint's, or starts with a snapshot at step 0."""
    name, path = config.name, config.checkpoint_path
    loop = None if checkpoints is None else checkpoints.restore()
    if loop is not None and loop["step"] > schedule.steps:
        raise ValueError(
            f"{name}: checkpoint {path} is at step {loop['step']}, past the "
            f"{schedule.steps} steps of {config.epochs} epoch(s); delete it or train for more "
            "epochs")
    state = LoopState() if loop is None else LoopState.from_state_dict(loop)
    if replay is not None and state.step != 0:  # resumed: the log from the checkpoint
        # a checkpoint without a log is refused to a run with one before it loads
        # (rcdl.train.checkpoint.Checkpointer): a resumed run has the log's state
        assert checkpoints is not None and checkpoints.replay_state is not None
        replay.load_state_dict(checkpoints.replay_state)  # checked at the restore
    elif replay is not None:
        replay.start(schedule.permutation(0), config.batch_size, sample_ids)
        replay.take(0, model, learners)
    return state, loop is not None


def _summary(state: LoopState, schedule: Schedule, metrics: Mapping[str, Metric],
             grower: GrowerLike | None, resumed: bool) -> dict[str, Any]:
    """What :func:`train_one_pass` returns."""
    final = state.history[-1]
    entries, nbytes = store_size(grower)
    return {
        **{k: final[k] for k in metrics},
        "train_loss": state.last_loss,
        "entries": entries,
        "bytes": nbytes,
        "steps": schedule.steps,
        "samples": schedule.epochs * schedule.n,
        "epochs": schedule.epochs,
        "train_seconds": state.train_seconds,
        "eval_seconds": state.eval_seconds,
        "history": state.history,
        "resumed": resumed,
    }


def train_one_pass(
    model: nn.Module,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    *,
    config: LoopConfig | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    grower: GrowerLike | None = None,
    loss_fn: Metric = F.mse_loss,
    metrics: Mapping[str, Metric] | None = None,
    run: MetricLog | None = None,
    on_epoch_end: Callable[[int], Mapping[str, float]] | None = None,
    sample_ids: Tensor | None = None,
    order: Tensor | None = None,
    replay: ReplayLog | None = None,
    **settings: Unpack[LoopSettings],
) -> dict[str, Any]:
    """Train ``model`` for one pass (or ``epochs`` passes) over the training set; evaluate as
    it goes.

    Each step is :func:`train_step`: ``loss = loss_fn(model(x_b), y_b)`` (a batch mean),
    ``loss.backward()``, then ``optimizer.step()`` and ``optimizer.zero_grad()``, and/or
    ``grower.step()`` and ``grower.zero_grad()`` (at least one must be given; a model
    without parameters is given only a grower).

    How the loop runs (the fields of :class:`LoopConfig`: ``batch_size``, ``seed``,
    ``epochs``, ``eval_every``, ``eval_batch_size``, ``device``, ``name``, ``progress``,
    ``checkpoint_path``, ``checkpoint_every``, ``incremental_eval``) is given either as
    keywords of those names (``batch_size`` required, the others with
    :class:`LoopConfig`'s defaults) or whole as ``config=LoopConfig(...)``, not both: the two
    train alike, bit for bit.

    Args:
        model: maps ``(B, D_in)`` to ``(B, D_out)``; already on ``device``.
        data: ``(x_train, y_train, x_test, y_test)``, ``(N, D_in)``, ``(N, ...)``,
            ``(M, D_in)``, ``(M, ...)``; batches are moved to ``device`` as needed.
        config: the loop's settings whole, in place of their keywords (a caller that
            holds a :class:`LoopConfig` passes it; ``dataclasses.replace`` changes one).
        metrics: ``{name: fn(predictions, targets)}`` on the test set; the first is shown
            in the progress bar. Default (:func:`default_metrics`): ``{"test_mse": mse}``
            with the default loss; the accuracy and the loss, ``{"test_acc", "test_loss"}``,
            for integer class targets; else the loss, ``{"test_loss": loss_fn}``.
        run: if given, every evaluation is appended to its ``metrics.jsonl``.
        on_epoch_end: called as ``on_epoch_end(e)`` right after the evaluation before the
            first step (``e = 0``) and after the last step of each epoch (``e = 1, 2, ...``
            epochs done), e.g. to measure accuracy on the training data; the values it returns
            join that evaluation's record (under names the record does not already use). It
            must not train the model; its time counts as evaluation time.
        sample_ids: ``(N,)`` int64, the index each training row is recorded under as the
            sample that wrote its entries (:mod:`rcdl.memory.provenance`), e.g. its index in
            the full dataset when ``x_train`` is a subset of it; what
            :func:`rcdl.memory.forgetting.forget` is then given. Default: the row's position
            in ``x_train``.
        order: ``(M,)`` int64 positions into ``x_train``: train one epoch over exactly these
            rows in this order (each at most once) instead of the seeded permutation; e.g. a
            run's order with some samples taken out, the run exact forgetting reproduces
            (:func:`rcdl.train.unlearning.forget_exactly`).
        replay: a :class:`rcdl.train.replay.ReplayLog` to record the stream and a snapshot
            every ``replay.every`` steps into, for exact forgetting (one epoch, from step 0).
            With ``checkpoint_path`` each checkpoint holds the log too, and a resumed run
            continues the log its checkpoint holds (one that holds none is refused).

    Keyword Args:
        batch_size (int): samples per step ``B``; the last batch may be smaller.
        seed (int): seeds the permutation of the training set in each epoch
            (:func:`epoch_permutation`).
        eval_every (int): evaluate every this many steps, counted over all epochs (also
            before the first step and after the last step of every epoch).
        name (str): the model's name in logs and the progress bar.
        checkpoint_path (str | Path | None): if given, the loop saves its whole state as a
            checkpoint there every ``checkpoint_every`` steps (default ``eval_every``):
            checksummed files tagged with the step and a manifest ``<stem>.manifest.json``
            that commits them, the last two kept
            (:class:`rcdl.train.checkpoint.Checkpointer`). If a checkpoint is there at the
            start, training resumes from the newest one that reads back whole (saying on
            stderr which it skipped) and ends with the same result as an uninterrupted run
            (batches are a pure function of ``seed`` and the step). The state at a step does
            not depend on ``epochs``, so a run may also be continued for more epochs than it
            was started with. Under ``torchrun`` every rank passes the same path.
        epochs (int): passes over the training set, each in a fresh order (docs/reference.md
            §8); 1 is the one-pass protocol of docs/reference.md §6, unchanged.
        incremental_eval (bool): evaluate each growing layer incrementally: it keeps the
            state of its streaming attention over the test inputs after the last full chunk
            and folds only the chunks from there on at the next evaluation (see
            :func:`rcdl.nn.backends.enable_eval_cache`). The chunks are a full pass's, so
            the evaluations are bit for bit those of a full pass, also after a resume. The
            first growing layer's queries are the test inputs themselves, so its evaluation
            cost stops growing with the store. Off by default: it costs the queries and
            partials of one evaluation in memory. Training is unaffected either way.

    Returns:
        ``{<metric names>, "train_loss", "entries", "bytes", "steps", "samples", "epochs",
        "train_seconds", "eval_seconds", "history", "resumed"}``; ``steps`` and ``samples``
        count all epochs; ``entries``/``bytes`` are ``None`` without a grower; ``history``
        lists ``{"step", "samples", "epoch", <metrics>, <on_epoch_end values>}`` per
        evaluation, where ``samples`` counts all samples seen and ``epoch = samples / N``
        (an integer at the end of an epoch).

    Raises:
        TypeError: ``config`` given together with keywords it holds (naming them), neither
            ``config`` nor ``batch_size`` given, or a keyword ``train_one_pass`` does not take.
        FloatingPointError: if a training loss is not finite (naming the step).
        ValueError: a growth step refused (:meth:`rcdl.optim.grower.Grower.step`), or a test
            metric that fails on the model's outputs and the targets (:func:`evaluate`).

    With a grower whose checks are deferred (``defer_checks``, the default for stores on a
    GPU) a step reads nothing back to the host: the losses are summed on the device, and
    both errors are raised at the next check point (an evaluation, a checkpoint, a replay
    snapshot, the last step), naming the first step at fault, before anything is recorded
    or saved (docs/gpu.md, "Host reads in a step"). Both name the step as this loop
    counts it, also after a resume: the grower counts the steps it takes from 0 and saves
    the count with its state.
    """
    config = _loop_config(config, settings)
    name, batch_size, epochs = config.name, config.batch_size, config.epochs
    metrics = dict(metrics or default_metrics(loss_fn, data[3]))
    _check_arguments(name, data, optimizer, grower, metrics, batch_size, config.eval_every,
                     epochs)
    x_train, y_train, x_test, y_test = data
    if sample_ids is not None:
        sample_ids = _check_sample_ids(name, sample_ids, len(x_train))
    if order is not None:
        order = _check_order(name, order, len(x_train), epochs)
    if replay is not None and epochs != 1:
        raise ValueError(f"{name}: a replay log records one epoch, got epochs={epochs}")
    device = torch.device(config.device)
    schedule = Schedule(len(x_train) if order is None else len(order), batch_size, epochs,
                        config.seed, order)
    checkpoints = _checkpointer(config, schedule, model, optimizer, grower, replay, sample_ids)
    try:
        state, resumed = _resume(config, schedule, checkpoints, replay, model, [optimizer, grower],
                                 sample_ids)
        bar = tqdm(total=epochs * schedule.n, initial=schedule.seen(state.step), unit="sample",
                   desc=name, disable=not config.progress, dynamic_ncols=True)  # fmt: skip
        cached = [layer for _, layer in growing_layers(model)] if config.incremental_eval else []
        evaluator = Evaluator(
            model, (x_test, y_test), metrics, schedule=schedule, every=config.eval_every,
            batch_size=config.eval_batch_size, device=device, name=name,
            on_epoch_end=on_epoch_end, cached=cached,
            log=EvaluationLog(name, grower, run, bar, next(iter(metrics))))
        callbacks: list[Callback] = [evaluator]  # in this order after a step: see _run
        if replay is not None:
            callbacks.append(TakeSnapshots(replay, model, [optimizer, grower]))
        if checkpoints is not None:
            callbacks.append(SaveCheckpoints(checkpoints, schedule.steps))
        model.train()
        steps = _Steps(model, (x_train, y_train), loss_fn, optimizer, grower, config, sample_ids)
        # a resumed run multiplies half-precision stores as the interrupted one did
        products = products_as(None if checkpoints is None else checkpoints.products)
        with bar, _eval_caches(cached), products:
            _run(schedule, state, steps, evaluator, callbacks, bar)
    finally:
        if checkpoints is not None:
            checkpoints.close()  # the lock on the checkpoint path
    return _summary(state, schedule, metrics, grower, resumed)
