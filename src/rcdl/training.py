"""One-pass online training for growing and parametric models alike.

A growing model learns by writing entries (``Grower.step`` after ``loss.backward()``); a
parametric model learns by a torch optimizer step; a hybrid does both, optimizer first.
Either way the loop is the same: one pass over a seeded random permutation of the training
set in batches, with the test metric evaluated every ``eval_every`` steps and at the end.

Batch ``t`` is ``perm[t*B : (t+1)*B]`` with ``perm`` a pure function of ``seed``, so a run is
fully described by ``(seed, step)`` — the seam a checkpoint/resume needs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from rcdl.rundir import RunDir
from rcdl.store import format_bytes

__all__ = ["GrowerLike", "evaluate", "train_one_pass"]

Metric = Callable[[Tensor, Tensor], Tensor]  # (predictions, targets) -> scalar


class GrowerLike(Protocol):
    """What the loop needs from :class:`rcdl.grower.Grower`."""

    num_entries: int
    nbytes: int

    def step(self) -> None: ...


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    metric: Metric = F.mse_loss,
    *,
    batch_size: int = 1000,
    device: torch.device | str = "cpu",
) -> float:
    """``metric(model(x), y)`` over the whole set, predicting in batches, in eval mode.

    Args:
        x: inputs ``(N, D_in)``; y: targets ``(N, ...)``; both moved to ``device`` per batch.
        metric: ``(predictions, targets) -> scalar`` over all ``N`` samples at once.
    """
    was_training = model.training
    model.eval()
    try:
        preds = [model(xb.to(device)) for xb in x.split(batch_size)]  # [(b, D_out)]
        return float(metric(torch.cat(preds), y.to(device)))
    finally:
        model.train(was_training)


def train_one_pass(
    model: nn.Module,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    *,
    batch_size: int,
    seed: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    grower: GrowerLike | None = None,
    loss_fn: Metric = F.mse_loss,
    metric: Metric = F.mse_loss,
    metric_name: str = "test_mse",
    eval_every: int = 50,
    eval_batch_size: int = 1000,
    device: torch.device | str = "cpu",
    run: RunDir | None = None,
    name: str = "model",
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``model`` for one pass over the training set; evaluate as it goes.

    Each step: ``loss = loss_fn(model(x_b), y_b)`` (a batch mean), ``loss.backward()``, then
    ``optimizer.step()`` and/or ``grower.step()`` (at least one must be given; a model
    without parameters is given only a grower).

    Args:
        model: maps ``(B, D_in)`` to ``(B, D_out)``; already on ``device``.
        data: ``(x_train, y_train, x_test, y_test)``, ``(N, D_in)``, ``(N, ...)``,
            ``(M, D_in)``, ``(M, ...)``; batches are moved to ``device`` as needed.
        batch_size: samples per step ``B``; the last batch may be smaller.
        seed: seeds the permutation of the training set.
        eval_every: evaluate every this many steps (also before the first and after the last).
        run: if given, every evaluation is appended to its ``metrics.jsonl``.
        name: the model's name in logs and the progress bar.

    Returns:
        ``{metric_name, "train_loss", "entries", "bytes", "steps", "samples",
        "train_seconds", "eval_seconds", "history"}``; ``entries``/``bytes`` are ``None``
        without a grower; ``history`` lists ``(samples_seen, metric)`` per evaluation.

    Raises:
        FloatingPointError: if a training loss is not finite (naming the step).
    """
    if optimizer is None and grower is None:
        raise ValueError(f"{name}: give an optimizer, a grower or both; got neither")
    if batch_size < 1 or eval_every < 1:
        raise ValueError(
            f"{name}: batch_size and eval_every must be >= 1, got {batch_size} and {eval_every}"
        )
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
    steps = math.ceil(n / batch_size)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # (N,)

    history: list[tuple[int, float]] = []
    clock = {"train": 0.0, "eval": 0.0}
    loss_sum, loss_count = 0.0, 0
    last_loss: float | None = None  # mean training loss since the previous evaluation
    bar = tqdm(total=n, unit="sample", desc=name, disable=not progress, dynamic_ncols=True)

    def log_eval(step: int, seen: int) -> float:
        nonlocal loss_sum, loss_count, last_loss
        _sync(device)
        t0 = time.perf_counter()
        value = evaluate(model, x_test, y_test, metric, batch_size=eval_batch_size, device=device)
        _sync(device)
        clock["eval"] += time.perf_counter() - t0
        history.append((seen, value))
        if loss_count:
            last_loss, loss_sum, loss_count = loss_sum / loss_count, 0.0, 0
        entries = None if grower is None else int(grower.num_entries)
        nbytes = None if grower is None else int(grower.nbytes)
        record = {
            "model": name, "step": step, "samples": seen, metric_name: value,
            "train_loss": last_loss, "entries": entries, "bytes": nbytes,
            "train_seconds": clock["train"], "eval_seconds": clock["eval"],
        }  # fmt: skip
        if run is not None:
            run.log(record)
        postfix = {metric_name: f"{value:.4g}"}
        if grower is not None:
            postfix |= {"entries": entries, "store": format_bytes(nbytes)}
        bar.set_postfix(postfix, refresh=False)
        return value

    model.train()
    with bar:
        log_eval(0, 0)
        for step in range(steps):
            t0 = time.perf_counter()
            idx = perm[step * batch_size : (step + 1) * batch_size]  # (B,)
            xb, yb = x_train[idx].to(device), y_train[idx].to(device)
            loss = loss_fn(model(xb), yb)
            loss_value = loss.item()  # syncs the device, so the train clock is honest
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"{name}: training loss is {loss_value} at step {step}")
            loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if grower is not None:
                grower.step()
            loss_sum, loss_count = loss_sum + loss_value, loss_count + 1
            clock["train"] += time.perf_counter() - t0
            bar.update(len(idx))
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                final = log_eval(step + 1, min((step + 1) * batch_size, n))

    return {
        metric_name: final,
        "train_loss": last_loss,
        "entries": None if grower is None else int(grower.num_entries),
        "bytes": None if grower is None else int(grower.nbytes),
        "steps": steps,
        "samples": n,
        "train_seconds": clock["train"],
        "eval_seconds": clock["eval"],
        "history": history,
    }
