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
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from rcdl.distributed import is_sharded, rank_and_world
from rcdl.io import atomic_save_torch, atomic_write_json
from rcdl.layers import growing_layers
from rcdl.retrieval import load_retrieval_state, retrieval_state
from rcdl.store import format_bytes

__all__ = ["GrowerLike", "accuracy", "epoch_permutation", "evaluate", "train_one_pass"]

Metric = Callable[[Tensor, Tensor], Tensor]  # (predictions, targets) -> scalar
# the keys of an evaluation record besides the metrics (see ``train_one_pass``)
_RECORD_KEYS = frozenset({"model", "step", "samples", "epoch", "train_loss", "entries", "bytes",
                          "train_seconds", "eval_seconds"})  # fmt: skip


class MetricLog(Protocol):
    """Where the loop appends its evaluation records (e.g. a run folder's ``metrics.jsonl``)."""

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None: ...


class GrowerLike(Protocol):
    """What the loop needs from :class:`rcdl.grower.Grower`."""

    num_entries: int
    nbytes: int

    def step(self) -> None: ...


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accuracy(logits: Tensor, targets: Tensor) -> Tensor:
    """Fraction of rows whose largest logit is the target class."""
    return (logits.argmax(dim=1) == targets).float().mean()


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
    """
    was_training = model.training
    model.eval()
    try:
        preds = torch.cat([model(xb.to(device)) for xb in x.split(batch_size)])  # (N, D_out)
        y = y.to(device)
        return {name: float(fn(preds, y)) for name, fn in metrics.items()}
    finally:
        model.train(was_training)


@contextmanager
def _eval_caches(layers: list) -> Iterator[None]:  # noqa: ANN001
    """Incremental evaluation for these growing layers while the block runs; then freed."""
    for layer in layers:
        layer.enable_eval_cache()
    try:
        yield
    finally:
        for layer in layers:
            layer.disable_eval_cache()


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


def _load_checkpoint(path: Path, model, optimizer, grower,  # noqa: ANN001
                     expected: dict[str, Any]) -> dict[str, Any]:
    state = torch.load(path, map_location="cpu", weights_only=False)
    for key, value in expected.items():
        if state["run"].get(key) != value:
            raise ValueError(
                f"checkpoint {path} was written by a different run: {key}={state['run'].get(key)!r}"
                f", this run has {value!r}; delete it or use another checkpoint path"
            )
    model.load_state_dict(state["model"])
    load_retrieval_state(model, state.get("retrieval"))  # top-k indices (docs/retrieval.md)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if grower is not None and state.get("grower") is not None and hasattr(grower, "state_dict"):
        grower.load_state_dict(state["grower"])
    return state["loop"]


def train_one_pass(
    model: nn.Module,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    *,
    batch_size: int,
    seed: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    grower: GrowerLike | None = None,
    loss_fn: Metric = F.mse_loss,
    metrics: Mapping[str, Metric] | None = None,
    eval_every: int = 50,
    eval_batch_size: int = 1000,
    device: torch.device | str = "cpu",
    run: MetricLog | None = None,
    name: str = "model",
    progress: bool = True,
    checkpoint_path: str | Path | None = None,
    checkpoint_every: int | None = None,
    epochs: int = 1,
    on_epoch_end: Callable[[int], Mapping[str, float]] | None = None,
    incremental_eval: bool = False,
) -> dict[str, Any]:
    """Train ``model`` for one pass (or ``epochs`` passes) over the training set; evaluate as
    it goes.

    Each step: ``loss = loss_fn(model(x_b), y_b)`` (a batch mean), ``loss.backward()``, then
    ``optimizer.step()`` and/or ``grower.step()`` (at least one must be given; a model
    without parameters is given only a grower).

    Args:
        model: maps ``(B, D_in)`` to ``(B, D_out)``; already on ``device``.
        data: ``(x_train, y_train, x_test, y_test)``, ``(N, D_in)``, ``(N, ...)``,
            ``(M, D_in)``, ``(M, ...)``; batches are moved to ``device`` as needed.
        batch_size: samples per step ``B``; the last batch may be smaller.
        seed: seeds the permutation of the training set in each epoch
            (:func:`epoch_permutation`).
        metrics: ``{name: fn(predictions, targets)}`` on the test set (default
            ``{"test_mse": mse}``); the first is shown in the progress bar.
        eval_every: evaluate every this many steps, counted over all epochs (also before the
            first step and after the last step of every epoch).
        run: if given, every evaluation is appended to its ``metrics.jsonl``.
        name: the model's name in logs and the progress bar.
        checkpoint_path: if given, the loop saves its whole state there (atomically) every
            ``checkpoint_every`` steps (default ``eval_every``); if the file exists at the
            start, training resumes from it and ends with the same result as an
            uninterrupted run (batches are a pure function of ``seed`` and the step). The
            state at a step does not depend on ``epochs``, so a run may also be continued
            for more epochs than it was started with.
        epochs: passes over the training set, each in a fresh order (docs/reference.md §8); 1 is the
            one-pass protocol of docs/reference.md §6, unchanged.
        on_epoch_end: called as ``on_epoch_end(e)`` right after the evaluation before the
            first step (``e = 0``) and after the last step of each epoch (``e = 1, 2, ...``
            epochs done), e.g. to measure accuracy on the training data; the values it returns
            join that evaluation's record (under names the record does not already use). It
            must not train the model; its time counts as evaluation time.
        incremental_eval: reuse each growing layer's partial results over the entries it held
            at the previous evaluation of the same test inputs, attending only over the
            entries written since (exact up to rounding; see
            :meth:`rcdl.layers.GrowingLayer.enable_eval_cache`). The first growing layer's
            queries are the test inputs themselves, so its evaluation cost stops growing
            with the store. Off by default: the merged partials round differently from one
            pass over the store (float32: about 1e−7 relative), and the cache is not saved in
            checkpoints, so a resumed run's evaluations would not be bit-identical to an
            uninterrupted run's. Training itself is unaffected either way.

    Returns:
        ``{<metric names>, "train_loss", "entries", "bytes", "steps", "samples", "epochs",
        "train_seconds", "eval_seconds", "history", "resumed"}``; ``steps`` and ``samples``
        count all epochs; ``entries``/``bytes`` are ``None`` without a grower; ``history``
        lists ``{"step", "samples", "epoch", <metrics>, <on_epoch_end values>}`` per
        evaluation, where ``samples`` counts all samples seen and ``epoch = samples / N``
        (an integer at the end of an epoch).

    Raises:
        FloatingPointError: if a training loss is not finite (naming the step).
    """
    metrics = dict(metrics or {"test_mse": F.mse_loss})
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
    n = len(x_train)
    if n == 0 or len(x_test) == 0:
        raise ValueError(f"{name}: empty data set: {n} train and {len(x_test)} test samples")
    device = torch.device(device)
    steps_per_epoch = math.ceil(n / batch_size)
    steps = epochs * steps_per_epoch

    def seen(step: int) -> int:  # samples seen after `step` steps, all epochs
        done, t = divmod(step, steps_per_epoch)
        return done * n + min(t * batch_size, n)

    checkpoint_path = None if checkpoint_path is None else Path(checkpoint_path)
    checkpoint_every = checkpoint_every or eval_every
    identity = {"name": name, "seed": seed, "batch_size": batch_size, "train_samples": n}

    # the loop's whole state besides the model and optimizer: what a checkpoint holds
    loop: dict[str, Any] = {
        "step": 0, "history": [], "clock": {"train": 0.0, "eval": 0.0},
        "loss_sum": 0.0, "loss_count": 0, "last_loss": None,
    }  # fmt: skip
    resumed = checkpoint_path is not None and checkpoint_path.exists()
    if resumed:
        loop = _load_checkpoint(checkpoint_path, model, optimizer, grower, identity)
        if loop["step"] > steps:
            raise ValueError(
                f"{name}: checkpoint {checkpoint_path} is at step {loop['step']}, past the "
                f"{steps} steps of {epochs} epoch(s); delete it or train for more epochs"
            )
    first_metric = next(iter(metrics))
    bar = tqdm(
        total=epochs * n,
        initial=seen(loop["step"]),
        unit="sample",
        desc=name,
        disable=not progress,
        dynamic_ncols=True,
    )

    cached = [layer for _, layer in growing_layers(model)] if incremental_eval else []

    def log_eval(step: int) -> dict[str, float]:
        _sync(device)
        t0 = time.perf_counter()
        for layer in cached:
            layer.start_evaluation()
        values = evaluate(model, x_test, y_test, metrics, batch_size=eval_batch_size, device=device)
        if on_epoch_end is not None and step % steps_per_epoch == 0:
            extra = {k: float(v) for k, v in on_epoch_end(step // steps_per_epoch).items()}
            taken = _RECORD_KEYS.union(values).intersection(extra)
            if taken:
                raise ValueError(
                    f"{name}: on_epoch_end returned {sorted(taken)}, names the loop's records "
                    f"already use ({', '.join(sorted(_RECORD_KEYS.union(values)))})"
                )
            values |= extra
        _sync(device)
        loop["clock"]["eval"] += time.perf_counter() - t0
        samples = seen(step)
        loop["history"].append({"step": step, "samples": samples, "epoch": samples / n, **values})
        if loop["loss_count"]:
            loop["last_loss"] = loop["loss_sum"] / loop["loss_count"]
            loop["loss_sum"], loop["loss_count"] = 0.0, 0
        entries = None if grower is None else int(grower.num_entries)
        nbytes = None if grower is None else int(grower.nbytes)
        record = {
            "model": name, "step": step, "samples": samples, "epoch": samples / n, **values,
            "train_loss": loop["last_loss"], "entries": entries, "bytes": nbytes,
            "train_seconds": loop["clock"]["train"], "eval_seconds": loop["clock"]["eval"],
        }  # fmt: skip
        if run is not None:
            run.log(record)
        postfix = {first_metric: f"{values[first_metric]:.4g}"}
        if grower is not None:
            postfix |= {"entries": entries, "store": format_bytes(nbytes)}
        bar.set_postfix(postfix, refresh=False)
        return values

    def save_checkpoint() -> None:
        state = {
            "run": identity,
            "loop": loop,
            "model": model.state_dict(),
            "retrieval": retrieval_state(model),  # None unless top-k retrieval is on
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            "grower": grower.state_dict() if hasattr(grower, "state_dict") else None,
        }
        atomic_save_torch(state, checkpoint_path)
        if sharded:  # one file per rank, and rank 0 lists them in a manifest
            files = [None] * world
            dist.all_gather_object(files, checkpoint_path.name)
            if rank == 0:
                manifest = {"name": name, "step": loop["step"], "world_size": world,
                            "files": files}
                atomic_write_json(manifest, checkpoint_path.with_name(f"{name}.manifest.json"))

    sharded = is_sharded(model)
    rank, world = rank_and_world()
    model.train()
    with bar, _eval_caches(cached):
        if not loop["history"]:
            log_eval(0)
        final = loop["history"][-1]
        perm, perm_epoch = None, None
        for step in range(loop["step"], steps):
            t0 = time.perf_counter()
            epoch, t = divmod(step, steps_per_epoch)
            if epoch != perm_epoch:
                perm, perm_epoch = epoch_permutation(n, seed, epoch), epoch  # (N,)
            idx = perm[t * batch_size : (t + 1) * batch_size]  # (B,)
            xb, yb = x_train[idx].to(device), y_train[idx].to(device)
            loss = loss_fn(model(xb), yb)
            loss_value = loss.item()  # syncs the device, so the train clock is honest
            if not math.isfinite(loss_value):
                raise FloatingPointError(
                    f"{name}: training loss is {loss_value} at step {step}")
            loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if grower is not None:
                grower.step()
            loop["loss_sum"] += loss_value
            loop["loss_count"] += 1
            loop["step"] = step + 1
            loop["clock"]["train"] += time.perf_counter() - t0
            bar.update(len(idx))
            if (step + 1) % eval_every == 0 or (step + 1) % steps_per_epoch == 0:
                final = log_eval(step + 1)
            if (
                checkpoint_path is not None
                and (step + 1) % checkpoint_every == 0
                and step + 1 < steps
            ):
                save_checkpoint()

    return {
        **{k: final[k] for k in metrics},
        "train_loss": loop["last_loss"],
        "entries": None if grower is None else int(grower.num_entries),
        "bytes": None if grower is None else int(grower.nbytes),
        "steps": steps,
        "samples": epochs * n,
        "epochs": epochs,
        "train_seconds": loop["clock"]["train"],
        "eval_seconds": loop["clock"]["eval"],
        "history": loop["history"],
        "resumed": resumed,
    }
