"""Forgetting training samples against retraining without them (docs/attribution.md,
"Forgetting: measured").

Run it with ``rcdl reproduce unlearning``. Every entry of a growing layer was written by one
training sample (:mod:`rcdl.memory.provenance`), so :func:`rcdl.memory.forgetting.forget` removes a
sample's entries in milliseconds. Retraining from scratch without the samples is the gold
standard any unlearning method is judged against; this experiment puts the two side by side.

For each model and seed, one sub-run:

1. trains the model one epoch (batch 16, the one-epoch protocol of docs/cifar10.md) on the
   whole training subset: the *original*;
2. for each forget set (``scenarios``): ``random``, a random ``forget_fraction`` of the
   training images (drawn from the seed), and ``class``, every training image of class
   ``forget_class``:

   - *forget* (growing models): the original with :func:`rcdl.memory.forgetting.forget` applied,
     timed;
   - *repair* (growing models whose readout a rule writes: not the hybrid): the original
     with :func:`rcdl.memory.repair.forget_and_repair` applied, timed (the readout's
     later entries re-written on its stored keys); *repair+keys*: the same with the
     readout's keys recomputed first from the training images;
   - *exact* (growing models): the original with
     :func:`rcdl.train.unlearning.forget_exactly` applied (restore the snapshot before the
     earliest forgotten image, replay the rest of the stream without them), timed; it must
     equal *retrain* bit for bit, and the run checks that its test predictions do;
   - *fine-tune* (the parametric baseline): the original trained further, with a fresh
     optimizer of its kind, on a random ``finetune_fraction`` of the retained images (one
     pass over them), timed: the cheap approximate method of the unlearning literature;
   - *retrain*: the same model trained from the same seed on the original's stream with the
     forgotten images taken out (every other image in the same order, batches re-formed).

Measured for each variant: accuracy on the forget set, on the retained set (at most
``retain_eval_size`` of its images, a random subset) and on the test set, and a
membership-inference score (:func:`mia_score`), the simple attack of the starting kit of
the NeurIPS 2023 machine-unlearning challenge: a logistic regression on per-sample
cross-entropy losses, told forget-set images from test images, its accuracy
averaged over 10 stratified random splits (half the pairs held out each time), on equal
numbers of each (the larger set subsampled). For the ``class`` scenario the test images are
those of the forgotten class, so that the attack sees one class on both sides. A
perfect unlearner scores what the retrained model scores (about 0.5 when the forgotten
images look like unseen ones), not 0.5 by construction.

Anchors (the starting kit, CIFAR-10, ResNet-18, forgetting a random subset): MIA 0.579 for
the original model, 0.512 after fine-tuning on the retained set, 0.502 for the retrained
one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.app.cifar import CifarData, cifar_summary, load_subsets
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.models import model_spec
from rcdl.app.recipes import (
    check_unlearning_settings,
    copy_trained,
    fine_tune,
    repaired_copies,
    train_with_learners,
)
from rcdl.app.report import csv_text, markdown_table, mean_sd, pm, write_outputs
from rcdl.app.rundir import RunDir, describe_machine, read_config
from rcdl.app.runner import Combine, Experiment, Session
from rcdl.memory.forgetting import forget
from rcdl.train.loop import epoch_permutation, predict
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly

__all__ = ["ANCHORS", "EXPERIMENT", "EXPERIMENT_SPEC", "SCENARIOS", "UnlearningConfig",
           "combine_runs", "forget_indices", "mia_score", "per_sample_losses", "unlearn_one"]

EXPERIMENT = "unlearning"
SCENARIOS = {"random": "a random share of the training images",
             "class": "every training image of one class"}
# the NeurIPS 2023 machine-unlearning challenge's starting kit (CIFAR-10, ResNet-18, a
# random forget set): the simple MIA's accuracy
ANCHORS = {"original": 0.579, "fine-tune": 0.512, "retrain": 0.502}
MIA_SPLITS = 10


@dataclass(frozen=True)
class UnlearningConfig(ExperimentConfig):
    """Settings of the unlearning experiment (module docstring). Most of a default run's
    time is the ResNet-MLP's three trainings (run times in results/attribution/LOG.md, "Measured:
    forgetting against retraining")."""

    QUICK = {"models": ("gws", "rbf"), "train_size": 1000, "test_size": 500, "seeds": (0,),
             "retain_eval_size": 500}

    models: tuple[str, ...] = setting(
        ("gws", "rbf", "mlp-adam"), "models: growing ones are forgotten by rcdl.forget, "
        "parametric ones fine-tuned on the retained images", metavar="NAME")
    scenarios: tuple[str, ...] = setting(tuple(SCENARIOS), "forget sets", choices=SCENARIOS)
    forget_fraction: float = setting(0.1, "share of the training images the random "
                                     "scenario forgets", positive=True)
    forget_class: int = setting(0, "the class the class scenario forgets (0: airplane)",
                                minimum=0)
    finetune_fraction: float = setting(0.2, "share of the retained images a parametric "
                                       "model is fine-tuned on (one pass)", positive=True)
    train_size: int | None = setting(5000, "random subset of N training images",
                                     metavar="N")
    test_size: int | None = setting(5000, "random subset of N test images", metavar="N")
    retain_eval_size: int = setting(5000, "retained images the accuracy on them is "
                                    "measured on (a random subset)", metavar="N")
    seeds: tuple[int, ...] = setting((0, 1, 2), "seeds (initialisation, order, random "
                                     "forget set)", minimum=0, metavar="K")
    batch_size: int = setting(16, "samples per step B", metavar="B")
    replay_every: int = setting(1, "exact forgetting: a snapshot of a growing model every K "
                                "training steps (replays up to K - 1 extra steps)", metavar="K")
    eval_batch_size: int = setting(500, "images per prediction batch", metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()

    def check(self) -> None:
        check_unlearning_settings("UnlearningConfig", self.models, self.forget_fraction,
                                  self.finetune_fraction)
        if self.forget_class >= 10:
            raise ValueError(f"UnlearningConfig: forget_class must be a CIFAR-10 class, "
                             f"0-9, got {self.forget_class}")


load_data = partial(load_subsets, "cifar10")


# --------------------------------------------------------------------------- measuring


def forget_indices(scenario: str, y_train: Tensor, cfg: UnlearningConfig,
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
class _Sets:
    """The images one scenario is measured on."""

    forget_x: Tensor
    forget_y: Tensor
    retain_x: Tensor  # the evaluated subset of the retained images
    retain_y: Tensor
    test_x: Tensor
    test_y: Tensor
    mia_test: Tensor  # (T,) bool: the test images the attack compares the forget set with


def _measure(model: nn.Module, sets: _Sets, cfg: UnlearningConfig, seed: int,
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


def _train(name: str, seed: int, x: Tensor, y: Tensor, cfg: UnlearningConfig,
           session: Session, **loop: Any) -> tuple[nn.Module, Any, Any, float]:  # fmt: skip
    """Model ``name`` trained one pass over ``(x, y)`` from ``seed``
    (:func:`rcdl.app.recipes.train_with_learners`, nothing evaluated; ``loop``: ``order``,
    ``replay``), with its learners and training seconds. The entries remember their samples
    as indices into ``x``."""
    model, optimizer, grower, result = train_with_learners(
        name, seed, x, y, (x[:1], y[:1]), batch_size=cfg.batch_size, device=session.device,
        **loop)
    return model, optimizer, grower, result["train_seconds"]


def _exactly_forgotten(name: str, seed: int, trained: tuple, replay: ReplayLog,
                       forget_idx: Tensor, x: Tensor, y: Tensor,
                       device: torch.device) -> tuple[nn.Module, Any]:  # fmt: skip
    """A copy of the trained ``(model, optimizer, grower)`` with ``forget_idx`` forgotten
    exactly (the log copied too), and the receipt."""
    model, optimizer, grower = copy_trained(name, seed, trained, reserve=len(x), device=device)
    receipt = forget_exactly(model, forget_idx, replay=copy.deepcopy(replay), data=(x, y),
                             loss_fn=F.cross_entropy, optimizer=optimizer, grower=grower,
                             device=device)
    return model, receipt


def unlearn_one(name: str, seed: int, data: CifarData, cfg: UnlearningConfig,
                session: Session) -> dict[str, Any]:  # fmt: skip
    """One sub-run: the original model, then for each scenario its unlearned and retrained
    versions, measured (module docstring). Returns a JSON-able result."""
    growing = model_spec(name).growing
    device = session.device
    x, y = data.x_train, data.y_train
    replay = ReplayLog(every=cfg.replay_every) if growing else None
    original, *learners, original_seconds = _train(
        name, seed, x, y, cfg, session, **({"replay": replay} if replay is not None else {}))
    stream = epoch_permutation(len(y), seed, 0)  # the original's order
    out: dict[str, Any] = {"model": name, "seed": seed, "growing": growing,
                           "original_train_seconds": original_seconds, "scenarios": {}}
    for scenario in cfg.scenarios:
        forget_idx = forget_indices(scenario, y, cfg, seed)
        keep = torch.ones(len(y), dtype=torch.bool)
        keep[forget_idx] = False
        retain_idx = keep.nonzero().squeeze(1)  # (R,)
        g = torch.Generator().manual_seed(20_000 + seed)
        evaluated = retain_idx[torch.randperm(len(retain_idx), generator=g)
                               [: cfg.retain_eval_size]]
        mia_test = (torch.ones_like(data.y_test, dtype=torch.bool) if scenario == "random"
                    else data.y_test == cfg.forget_class)
        sets = _Sets(x[forget_idx], y[forget_idx], x[evaluated], y[evaluated],
                     data.x_test, data.y_test, mia_test)
        variants: dict[str, dict[str, Any]] = {
            "original": {**_measure(original, sets, cfg, seed, device),
                         "seconds": original_seconds}}
        exact_logits = None
        if growing:
            copy_ = copy.deepcopy(original)
            receipt = forget(copy_, forget_idx)
            variants["forget"] = {**_measure(copy_, sets, cfg, seed, device),
                                  "seconds": receipt.seconds, "removed": dict(receipt),
                                  "receipt": receipt.to_json()}
            for variant, copy_, receipt in repaired_copies(original, forget_idx, x, y):
                variants[variant] = {**_measure(copy_, sets, cfg, seed, device),
                                     "seconds": receipt.seconds, "receipt": receipt.to_json()}
            assert replay is not None
            copy_, receipt = _exactly_forgotten(name, seed, (original, *learners), replay,
                                                forget_idx, x, y, device)
            exact_logits = predict(copy_, data.x_test, batch_size=cfg.eval_batch_size,
                                   device=device)
            variants["exact"] = {**_measure(copy_, sets, cfg, seed, device),
                                 "seconds": receipt.seconds,
                                 "replayed": next(iter(receipt.released.values()))[0],
                                 "receipt": receipt.to_json()}
        else:
            part = retain_idx[torch.randperm(len(retain_idx), generator=g)
                              [: max(1, math.ceil(cfg.finetune_fraction * len(retain_idx)))]]
            copy_, result = fine_tune(name, seed, original, x[part], y[part],
                                      batch_size=cfg.batch_size, device=device)
            variants["fine-tune"] = {**_measure(copy_, sets, cfg, seed, device),
                                     "seconds": result["train_seconds"], "images": len(part)}
        del copy_
        retrained, _, _, seconds = _train(name, seed, x, y, cfg, session,
                                          order=stream[keep[stream]])
        variants["retrain"] = {**_measure(retrained, sets, cfg, seed, device),
                               "seconds": seconds}
        if exact_logits is not None:  # exact forgetting is retraining, bit for bit
            variants["exact"]["equals_retrain"] = bool(torch.equal(exact_logits, predict(
                retrained, data.x_test, batch_size=cfg.eval_batch_size, device=device)))
        del retrained
        out["scenarios"][scenario] = {"forget_size": len(forget_idx),
                                      "mia_test_size": int(mia_test.sum()),
                                      "variants": variants}
    return out


def _sub_runs(cfg: UnlearningConfig, data: CifarData, session: Session) -> Iterator:
    for seed in cfg.seeds:
        for name in cfg.models:
            yield f"{name}-seed{seed}", partial(unlearn_one, name, seed, data, cfg, session)


def _start(cfg: UnlearningConfig, data: CifarData) -> dict[str, Any]:
    return {**cifar_summary(cfg, data), "forget_class_name": data.class_names[cfg.forget_class]}


# --------------------------------------------------------------------------- reporting

METRICS = ("forget_acc", "retain_acc", "test_acc", "mia", "seconds")


def rows(cfg: UnlearningConfig, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (scenario, model, variant): each metric's mean and sd over seeds."""
    out = []
    for scenario in cfg.scenarios:
        for name in cfg.models:
            done = [r["scenarios"][scenario] for r in runs
                    if r["model"] == name and scenario in r["scenarios"]]
            if not done:
                continue
            for variant in done[0]["variants"]:
                row: dict[str, Any] = {"scenario": scenario, "model": name,
                                       "variant": variant, "seeds": len(done),
                                       "forget_size": done[0]["forget_size"]}
                for metric in METRICS:
                    values = [d["variants"][variant][metric] for d in done]
                    row[metric], row[metric + "_sd"] = mean_sd(
                        [v for v in values if v is not None])
                out.append(row)
    return out


def _finish(cfg: UnlearningConfig, summary: dict[str, Any]) -> None:
    summary["rows"] = rows(cfg, summary["runs"])


def _table(rows_: list[dict[str, Any]], scenario: str) -> str:
    body = [(r["model"], r["variant"], r["seeds"], pm(r["forget_acc"], r["forget_acc_sd"], 1),
             pm(r["retain_acc"], r["retain_acc_sd"], 1), pm(r["test_acc"], r["test_acc_sd"], 1),
             pm(r["mia"], r["mia_sd"], 3), pm(r["seconds"], r["seconds_sd"], ".3g"))
            for r in rows_ if r["scenario"] == scenario]
    return markdown_table(("model", "variant", "seeds", "forget acc %", "retain acc %",
                           "test acc %", "MIA", "seconds"), body, "llrrrrrr")


def plot(path: Any, rows_: list[dict[str, Any]], scenarios: tuple[str, ...]) -> None:
    """Per scenario (columns), the forget-set accuracy, the test accuracy and the MIA score
    (rows) of each (model, variant), mean and sd over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("forget_acc", "forget-set accuracy (%)"), ("test_acc", "test accuracy (%)"),
               ("mia", "MIA accuracy"))
    fig, axes = plt.subplots(len(metrics), len(scenarios), figsize=(5.5 * len(scenarios), 9),
                             squeeze=False)
    colours = {"original": "#888888", "forget": "#1f77b4", "repair": "#17becf",
               "repair+keys": "#bcbd22", "exact": "#9467bd",
               "fine-tune": "#ff7f0e", "retrain": "#2ca02c"}
    for col, scenario in enumerate(scenarios):
        mine = [r for r in rows_ if r["scenario"] == scenario]
        models = list(dict.fromkeys(r["model"] for r in mine))
        for row_i, (metric, label) in enumerate(metrics):
            ax = axes[row_i][col]
            labelled: set[str] = set()
            for i, model in enumerate(models):
                bars = [r for r in mine if r["model"] == model]
                for j, r in enumerate(bars):
                    first = r["variant"] not in labelled
                    labelled.add(r["variant"])
                    ax.bar(i + (j - (len(bars) - 1) / 2) * 0.14, r[metric] or 0, 0.13,
                           yerr=r[metric + "_sd"] or 0, color=colours.get(r["variant"]),
                           label=r["variant"] if first else None)
            ax.set_xticks(range(len(models)), models)
            ax.set_ylabel(label)
            if metric == "mia":
                ax.axhline(0.5, color="black", lw=0.8, ls=":")
                ax.set_ylim(0.4, max(0.75, max((r["mia"] or 0 for r in mine), default=0) + 0.05))
            if row_i == 0:
                ax.set_title(f"{scenario}: {SCENARIOS[scenario]}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run: RunDir, cfg: UnlearningConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv`` and ``unlearning.png``; return the markdown."""
    d, rows_ = summary["data"], summary["rows"]
    parts = [
        "# Forgetting training samples against retraining without them",
        f"{d['n_train']:,} training / {d['n_test']:,} test CIFAR-10 images (random subsets, "
        f"data seed {cfg.data_seed}; JPEG-decoded); one epoch, batch {cfg.batch_size}; seeds "
        f"{' '.join(map(str, cfg.seeds))} (mean ± sd). Growing models: *forget*, "
        "`rcdl.forget` removes the forgotten images' entries; *repair*, "
        "`rcdl.forget_and_repair` removes them and re-writes the readout's later entries "
        "(*repair+keys*: its keys recomputed first from the training images); *exact*, "
        "`rcdl.train.unlearning.forget_exactly` restores the snapshot before the earliest "
        f"forgotten image (one every {cfg.replay_every} step(s)) and replays the rest. "
        "Parametric ones: fine-tuned with a fresh optimizer on "
        f"{cfg.finetune_fraction:.0%} of the retained images. *retrain*: trained from the "
        "same seed on the original's stream without the forgotten images. Seconds: training "
        "for *original* and *retrain*, the unlearning step for *forget*, *repair*, *exact* and "
        "*fine-tune*. MIA: the accuracy of "
        f"a logistic regression on per-sample losses, forget set against test images, "
        f"{MIA_SPLITS} stratified splits; a perfect unlearner matches *retrain*.",
    ]
    for scenario in cfg.scenarios:
        size = next((r["forget_size"] for r in rows_ if r["scenario"] == scenario), 0)
        what = (f"a random {cfg.forget_fraction:.0%} of the training images ({size:,} images)"
                if scenario == "random" else
                f"every training image of class {cfg.forget_class}, "
                f"{summary.get('forget_class_name', '?')} ({size:,} images; the MIA compares "
                "them with the test images of that class)")
        parts += [f"## Forgetting {what}", _table(rows_, scenario)]
    exact = [v["variants"]["exact"] for r in summary["runs"] for v in r["scenarios"].values()
             if "exact" in v["variants"]]
    if exact:
        equal = sum(bool(e.get("equals_retrain")) for e in exact)
        parts.append(f"*exact* predicted the test images bit for bit as *retrain* did in "
                     f"{equal} of {len(exact)} (model, scenario, seed) runs.")
    parts += [
        "Anchor (the NeurIPS 2023 unlearning challenge's starting kit, CIFAR-10, ResNet-18, "
        f"a random forget set): MIA {ANCHORS['original']} original, {ANCHORS['fine-tune']} "
        f"fine-tuned, {ANCHORS['retrain']} retrained.",
        f"Data: {d['source']}, {d['provenance']}.",
    ]
    if "combined_from" in summary:  # rcdl reproduce unlearning --combine
        lines = []
        for source in summary["combined_from"]:
            env = source.get("environment") or {}
            lines.append(f"- `{source['path']}`: {', '.join(source['runs'])}; "
                         f"{env.get('cpu_model', '?')} ({' '.join(env.get('cpu_flags', []))}), "
                         f"{env.get('num_threads', '?')} threads, torch "
                         f"{env.get('torch', '?')}, git {(env.get('git_revision') or '?')[:10]}")
        parts.append("Combined from these run folders (`rcdl reproduce unlearning "
                     "--combine`):\n" + "\n".join(lines) + "\n")
    else:
        parts.append(f"Machine: {describe_machine(device)}.\n")
    markdown = "\n\n".join(parts)
    return write_outputs(run, markdown, csv_text(rows_), {
        "unlearning.png": partial(plot, rows_=rows_, scenarios=cfg.scenarios)})


# --------------------------------------------------------------------------- combining

# settings that may differ between runs combined into one table (the rest is the protocol)
_PER_RUN = ("models", "seeds", "data_dir", "device")


def combine_runs(run_dirs: list[str | Path], out: str | Path) -> tuple[Path, dict[str, Any]]:
    """One report from the finished (model, seed) sub-runs of several run folders
    (``rcdl reproduce unlearning --combine RUN_DIR ... --out DIR``): seeds or models run in
    separate invocations, or an interrupted run's finished part. The folders must share the
    protocol (every setting but the models, seeds, data folder and device, and the data);
    a (model, seed) finished in two of them is an error. Writes ``summary.json`` (with each
    source folder and its environment), ``results.md``, ``results.csv`` and
    ``unlearning.png`` into ``out``."""
    if not run_dirs:
        raise ValueError("combine: give at least one run folder")
    runs: list[dict[str, Any]] = []
    origin: dict[tuple[str, int], Path] = {}
    sources, first = [], None
    for folder in map(Path, run_dirs):
        cfg = read_config(folder, UnlearningConfig)
        run = RunDir(folder)
        finished, summary_path = run.finished(), folder / RunDir.SUMMARY
        if not finished or not summary_path.is_file():
            raise ValueError(f"combine: no (model, seed) finished in {folder}")
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        protocol = ({k: v for k, v in dataclasses.asdict(cfg).items() if k not in _PER_RUN},
                    {k: summary["data"].get(k) for k in ("n_train", "n_test", "provenance")})
        if first is None:
            first = (folder, cfg, summary, protocol)
        elif protocol != first[3]:
            raise ValueError(f"combine: {folder} used another protocol than {first[0]}: "
                             f"{protocol} against {first[3]}")
        for result in finished.values():
            key = (result["model"], result["seed"])
            if key in origin:
                raise ValueError(f"combine: {key[0]} seed {key[1]} finished in both "
                                 f"{origin[key]} and {folder}; leave one of them out")
            origin[key] = folder
            runs.append({**result, "source": str(folder)})
        environment = folder / RunDir.ENVIRONMENT
        sources.append({"path": str(folder),
                        "runs": [f"{r['model']}-seed{r['seed']}" for r in finished.values()],
                        "environment": (json.loads(environment.read_text(encoding="utf-8"))
                                        if environment.is_file() else None)})
    assert first is not None
    _, cfg, summary, _ = first
    cfg = dataclasses.replace(
        cfg, models=tuple(dict.fromkeys(r["model"] for r in runs)),
        seeds=tuple(sorted({r["seed"] for r in runs})))
    combined = {"experiment": EXPERIMENT, "complete": True, "combined_from": sources,
                "data": summary["data"], "forget_class_name": summary.get("forget_class_name"),
                "runs": runs, "rows": rows(cfg, runs)}
    Path(out).mkdir(parents=True, exist_ok=True)
    target = RunDir(out)
    target.write_summary(combined)
    target.write_json(RunDir.CONFIG, dataclasses.asdict(cfg))
    write_report(target, cfg, combined, torch.device("cpu"))
    return target.path, combined


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=UnlearningConfig,
    help="forgetting training samples (rcdl.forget) against retraining without them and "
    "fine-tuning an MLP, with a membership-inference score (docs/attribution.md)",
    description="Trains each model one epoch on a CIFAR-10 subset, then forgets a random "
    "10 % of the training images and, separately, one whole class: growing models by "
    "removing the images' entries (rcdl.forget), parametric ones by fine-tuning on the "
    "retained images; and retrains each model without them. Reports accuracy on the "
    "forget, retained and test images, a membership-inference score and the seconds "
    "each took. See docs/attribution.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_data, start=_start,
    finish=_finish, combine=Combine(combine_runs, show=True),
)  # fmt: skip
