"""The forgetting comparison, the default study: for each model and seed, the original
model, then for each forget set its unlearned and retrained versions, measured (the
package docstring, docs/unlearning.md and docs/fast_forgetting.md)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.app.cifar import CifarData, cifar_summary
from rcdl.app.experiments.unlearning.config import SCENARIOS, ForgettingConfig
from rcdl.app.models import model_spec
from rcdl.app.recipes import copy_trained, fine_tune, repaired_copies, train_with_learners
from rcdl.app.runner import Session
from rcdl.memory.forgetting import forget
from rcdl.train.loop import epoch_permutation, predict
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly

__all__ = ["MIA_SPLITS", "Scenario", "Sets", "exactly_forgotten", "forget_indices", "measure",
           "mia_score", "per_sample_losses", "scenario_of", "start", "sub_runs", "train",
           "unlearn_one"]

MIA_SPLITS = 10


# --------------------------------------------------------------------------- measuring


def forget_indices(scenario: str, y_train: Tensor, cfg: ForgettingConfig,
                   seed: int) -> Tensor:  # (F,) int64, sorted
    """The training images a scenario forgets: a random ``forget_fraction`` of them (drawn
    from ``seed``), or every image of ``forget_class``."""
    if scenario == "class":
        return (y_train == cfg.forget_class).nonzero().squeeze(1)
    if scenario != "random":
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    n = len(y_train)
    size = max(1, round(cfg.forget_fraction * n))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(10_000 + seed))
    return order[:size].sort().values


def per_sample_losses(model: nn.Module, x: Tensor, y: Tensor, *, batch_size: int = 500,
                      device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Per-sample cross-entropy losses ``(n,)`` and whether each prediction is right
    ``(n,)`` (bool), in eval mode, on the CPU."""
    logits = predict(model, x, batch_size=batch_size, device=device).float()  # (n, C)
    y = y.to(logits.device)
    losses = F.cross_entropy(logits, y, reduction="none")
    return losses.cpu(), (logits.argmax(1) == y).cpu()


def mia_score(member_losses: Tensor, other_losses: Tensor, *, seed: int = 0,
              splits: int = MIA_SPLITS) -> float:
    """The simple membership-inference attack of the machine-unlearning challenge's
    starting kit: the mean accuracy, over ``splits`` stratified random splits (half held
    out), of a logistic regression telling ``member_losses`` from ``other_losses`` by the
    loss alone. Both sets are cut to the smaller one's size first (a random subset), so
    0.5 is chance."""
    try:
        from sklearn.linear_model import LogisticRegression
        from sklearn.model_selection import StratifiedShuffleSplit, cross_val_score
    except ImportError as error:  # the classical extra
        raise ImportError("the membership-inference score needs scikit-learn: pip install "
                          "'rcdl[classical]'") from error
    n = min(len(member_losses), len(other_losses))
    if n < 2:
        raise ValueError(f"mia_score: need at least 2 losses on each side, got "
                         f"{len(member_losses)} and {len(other_losses)}")
    g = torch.Generator().manual_seed(seed)
    a = member_losses[torch.randperm(len(member_losses), generator=g)[:n]]
    b = other_losses[torch.randperm(len(other_losses), generator=g)[:n]]
    features = torch.cat([a, b]).double().numpy()[:, None]  # (2n, 1)
    labels = torch.cat([torch.ones(n), torch.zeros(n)]).long().numpy()
    cv = StratifiedShuffleSplit(n_splits=splits, test_size=0.5, random_state=seed)
    scores = cross_val_score(LogisticRegression(), features, labels, cv=cv,
                             scoring="accuracy")
    return float(scores.mean())


@dataclass
class Sets:
    """The images one scenario is measured on."""

    forget_x: Tensor
    forget_y: Tensor
    retain_x: Tensor  # the evaluated subset of the retained images
    retain_y: Tensor
    test_x: Tensor
    test_y: Tensor
    mia_test: Tensor  # (T,) bool: the test images the attack compares the forget set with


@dataclass
class Scenario:
    """One scenario's forget set, the retained images, the images it is measured on, and
    the generator that drew the evaluated retained subset (it draws on for the fine-tune
    part)."""

    forget_idx: Tensor  # (F,)
    keep: Tensor  # (N,) bool: the retained images
    retain_idx: Tensor  # (R,)
    sets: Sets
    generator: torch.Generator


def scenario_of(scenario: str, data: CifarData, cfg: ForgettingConfig, seed: int) -> Scenario:
    """The forget set of ``scenario`` for ``seed``, and a random ``retain_eval_size`` subset
    of the retained images drawn from ``20 000 + seed``; the attack compares the forget set
    with every test image (random) or the forgotten class's."""
    x, y = data.x_train, data.y_train
    forget_idx = forget_indices(scenario, y, cfg, seed)
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[forget_idx] = False
    retain_idx = keep.nonzero().squeeze(1)  # (R,)
    g = torch.Generator().manual_seed(20_000 + seed)
    evaluated = retain_idx[torch.randperm(len(retain_idx), generator=g)[: cfg.retain_eval_size]]
    mia_test = (torch.ones_like(data.y_test, dtype=torch.bool) if scenario == "random"
                else data.y_test == cfg.forget_class)
    sets = Sets(x[forget_idx], y[forget_idx], x[evaluated], y[evaluated], data.x_test,
                data.y_test, mia_test)
    return Scenario(forget_idx, keep, retain_idx, sets, g)


def measure(model: nn.Module, sets: Sets, cfg: ForgettingConfig, seed: int,
            device: torch.device) -> dict[str, float | None]:
    """Accuracy on the forget, retained and test images (percent) and the MIA score."""
    run = partial(per_sample_losses, model, batch_size=cfg.eval_batch_size, device=device)
    forget_loss, forget_right = run(sets.forget_x, sets.forget_y)
    _, retain_right = run(sets.retain_x, sets.retain_y)
    test_loss, test_right = run(sets.test_x, sets.test_y)
    others = test_loss[sets.mia_test]
    return {"forget_acc": 100 * forget_right.float().mean().item(),
            "retain_acc": 100 * retain_right.float().mean().item(),
            "test_acc": 100 * test_right.float().mean().item(),
            # None where a side has under 2 images (a tiny test set's class)
            "mia": (mia_score(forget_loss, others, seed=seed)
                    if min(len(forget_loss), len(others)) >= 2 else None)}


def train(name: str, seed: int, x: Tensor, y: Tensor, cfg: ForgettingConfig,
          session: Session, **loop: Any) -> tuple[nn.Module, Any, Any, float]:  # fmt: skip
    """Model ``name`` trained one pass over ``(x, y)`` from ``seed``
    (:func:`rcdl.app.recipes.train_with_learners`, nothing evaluated; ``loop``: ``order``,
    ``replay``), with its learners and training seconds. The entries remember their samples
    as indices into ``x``."""
    model, optimizer, grower, result = train_with_learners(
        name, seed, x, y, (x[:1], y[:1]), batch_size=cfg.batch_size, device=session.device,
        **loop)
    return model, optimizer, grower, result["train_seconds"]


def exactly_forgotten(name: str, seed: int, trained: tuple, replay: ReplayLog,
                      forget_idx: Tensor, x: Tensor, y: Tensor,
                      device: torch.device) -> tuple[nn.Module, Any]:  # fmt: skip
    """A copy of the trained ``(model, optimizer, grower)`` with ``forget_idx`` forgotten
    exactly (the log copied too), and the receipt."""
    model, optimizer, grower = copy_trained(name, seed, trained, reserve=len(x), device=device)
    receipt = forget_exactly(model, forget_idx, replay=copy.deepcopy(replay), data=(x, y),
                             loss_fn=F.cross_entropy, optimizer=optimizer, grower=grower,
                             device=device)
    return model, receipt


def unlearn_one(name: str, seed: int, data: CifarData, cfg: ForgettingConfig,
                session: Session) -> dict[str, Any]:  # fmt: skip
    """One sub-run: the original model, then for each scenario its unlearned and retrained
    versions, measured (the package docstring). Returns a JSON-able result."""
    growing = model_spec(name).growing
    device = session.device
    x, y = data.x_train, data.y_train
    replay = ReplayLog(every=cfg.replay_every) if growing else None
    original, *learners, original_seconds = train(
        name, seed, x, y, cfg, session, **({"replay": replay} if replay is not None else {}))
    stream = epoch_permutation(len(y), seed, 0)  # the original's order
    out: dict[str, Any] = {"model": name, "seed": seed, "growing": growing,
                           "original_train_seconds": original_seconds, "scenarios": {}}
    for scenario in cfg.scenarios:
        chosen = scenario_of(scenario, data, cfg, seed)
        forget_idx, keep, retain_idx, sets = (chosen.forget_idx, chosen.keep,
                                              chosen.retain_idx, chosen.sets)
        g = chosen.generator
        variants: dict[str, dict[str, Any]] = {
            "original": {**measure(original, sets, cfg, seed, device),
                         "seconds": original_seconds}}
        exact_logits = None
        if growing:
            copy_ = copy.deepcopy(original)
            receipt = forget(copy_, forget_idx)
            variants["forget"] = {**measure(copy_, sets, cfg, seed, device),
                                  "seconds": receipt.seconds, "removed": dict(receipt),
                                  "receipt": receipt.to_json()}
            for variant, copy_, receipt in repaired_copies(original, forget_idx, x, y):
                variants[variant] = {**measure(copy_, sets, cfg, seed, device),
                                     "seconds": receipt.seconds, "receipt": receipt.to_json()}
            assert replay is not None
            copy_, receipt = exactly_forgotten(name, seed, (original, *learners), replay,
                                               forget_idx, x, y, device)
            exact_logits = predict(copy_, data.x_test, batch_size=cfg.eval_batch_size,
                                   device=device)
            variants["exact"] = {**measure(copy_, sets, cfg, seed, device),
                                 "seconds": receipt.seconds,
                                 "replayed": next(iter(receipt.released.values()))[0],
                                 "receipt": receipt.to_json()}
        else:
            part = retain_idx[torch.randperm(len(retain_idx), generator=g)
                              [: max(1, math.ceil(cfg.finetune_fraction * len(retain_idx)))]]
            copy_, result = fine_tune(name, seed, original, x[part], y[part],
                                      batch_size=cfg.batch_size, device=device)
            variants["fine-tune"] = {**measure(copy_, sets, cfg, seed, device),
                                     "seconds": result["train_seconds"], "images": len(part)}
        del copy_
        retrained, _, _, seconds = train(name, seed, x, y, cfg, session,
                                          order=stream[keep[stream]])
        variants["retrain"] = {**measure(retrained, sets, cfg, seed, device),
                               "seconds": seconds}
        if exact_logits is not None:  # exact forgetting is retraining, bit for bit
            variants["exact"]["equals_retrain"] = bool(torch.equal(exact_logits, predict(
                retrained, data.x_test, batch_size=cfg.eval_batch_size, device=device)))
        del retrained
        out["scenarios"][scenario] = {"forget_size": len(forget_idx),
                                      "mia_test_size": int(sets.mia_test.sum()),
                                      "variants": variants}
    return out


def sub_runs(cfg: ForgettingConfig, data: CifarData, session: Session) -> Iterator:
    """The comparison's sub-runs, ``<model>-seed<k>`` (seeds outer), for the runner."""
    for seed in cfg.seeds:
        for name in cfg.models:
            yield f"{name}-seed{seed}", partial(unlearn_one, name, seed, data, cfg, session)


def start(cfg: ForgettingConfig, data: CifarData) -> dict[str, Any]:
    """The summary's keys known before training: the data, the forgotten class's name."""
    return {**cifar_summary(cfg, data), "forget_class_name": data.class_names[cfg.forget_class]}
