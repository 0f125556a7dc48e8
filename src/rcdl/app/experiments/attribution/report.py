"""The attribution experiment's report: its rows, ``results.md``, ``results.csv``,
``explanations.png`` and ``attribution.png``."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rcdl._io import save_figure
from rcdl.app.experiments.attribution.config import (
    CURVE,
    FIRST_HALF_SEED,
    FLIP_SEED,
    KRONFLUENCE_FOUND,
    LDS_ANCHORS,
    LDS_TARGETS,
    MISLABEL_TARGET,
    SECOND_SEED,
    TRAK_AUC,
    AttributionConfig,
    score_text,
)
from rcdl.app.experiments.attribution.lds import _file
from rcdl.app.report import csv_text, markdown_table, write_outputs
from rcdl.app.rundir import RunDir, describe_machine

__all__ = ["COLUMNS", "draw_explanations", "draw_results", "rows", "targets", "write_report"]

COLUMNS = ("measurement", "model", "scores", "train_images", "lds", "lds_sd", "test_images",
           "halves", "roc_auc", "found_top10", "found_top20", "flipped", "test_acc",
           "retrain_seconds", "explain_seconds_per_image")  # fmt: skip


def rows(runs: Sequence[Mapping[str, Any]], train_images: int) -> list[dict[str, Any]]:
    """One row per (model, LDS score) and per (model, mislabel ranking), with the columns
    of :data:`COLUMNS` (``None`` where a column does not apply). The options' LDS scores
    (the cascade's, the seed ceiling) follow the model's three; a refused cascade has no
    row (the report notes it)."""
    out = []
    for run in runs:
        name, kind = run["model"], run["measurement"]
        base = {c: None for c in COLUMNS} | {"measurement": kind, "model": name,
                                             "train_images": train_images}
        if kind in ("lds", "lds-cascade", "lds-ceiling") and "variants" in run:
            full = next(r for r in runs if r["model"] == name and r["measurement"] == "lds-full")
            halves = "lds-again" if kind == "lds-ceiling" else "lds-halves"
            retrain = [s for r in runs if r["model"] == name and r["measurement"] == halves
                       for s in r["retrain_seconds"]]
            explained = {"lds": full["explain_seconds_per_image"],
                         "lds-cascade": run.get("cascade_seconds_per_image")}.get(kind)
            for variant, v in run["variants"].items():
                # the TRAK peer's lds-full gives each score's seconds: {score: seconds}
                per_image = (explained.get(variant) if isinstance(explained, dict)
                             else explained)
                out.append(base | {"measurement": "lds", "scores": variant, "lds": v["lds"],
                                   "lds_sd": v["sd"], "test_images": v["test_images"],
                                   "halves": run["halves"], "test_acc": full["test_acc"],
                                   "retrain_seconds": statistics.fmean(retrain),
                                   "explain_seconds_per_image": per_image})  # fmt: skip
        elif kind == "mislabel":
            for ranking, d in run["rankings"].items():
                out.append(base | {"scores": ranking, "roc_auc": d["roc_auc"],
                                   "found_top10": d["found_top10"],
                                   "found_top20": d["found_top20"], "flipped": run["flipped"],
                                   "test_acc": run["test_acc"],
                                   "explain_seconds_per_image":
                                       run["explain_seconds_per_image"]})  # fmt: skip
    return out


# --------------------------------------------------------------------------- reporting


def draw_explanations(path: Path, shown: Mapping[str, list[dict[str, Any]]],
                      pixels: Mapping[str, Mapping[str, Tensor]],
                      class_names: Sequence[str]) -> Path:  # fmt: skip
    """``explanations.png``: each shown test image (its class) beside, per model, its top
    training images (their label and contribution to the predicted logit, green where the
    label is the predicted class) and the class the model predicted."""
    from matplotlib.figure import Figure

    models = list(shown)
    count = len(shown[models[0]])
    top = max(len(row["samples"]) for rows_ in shown.values() for row in rows_)
    fig = Figure(figsize=(1.2 + 1.15 * top * len(models) + 0.5 * len(models),
                          0.6 + 1.45 * count), layout="constrained")  # fmt: skip
    parts: Any = fig.subfigures(1, 1 + len(models), width_ratios=[1.2] + [top + 0.4] * len(models),
                           wspace=0.02)  # fmt: skip
    parts[0].suptitle("test image", fontsize=10)
    tests = parts[0].subplots(count, 1, squeeze=False)[:, 0]
    for t, ax in enumerate(tests):
        ax.imshow(pixels[models[0]]["test"][t].numpy(), interpolation="nearest")
        ax.set_title(f"true: {class_names[shown[models[0]][t]['label']]}", fontsize=8)
        ax.set_axis_off()
    for part, name in zip(parts[1:], models, strict=True):
        part.suptitle(f"{name}: the {top} training images contributing most to the "
                      "predicted logit", fontsize=10)  # fmt: skip
        grid = part.subplots(count, top, squeeze=False)
        for t, row in enumerate(shown[name]):
            right = row["predicted"] == row["label"]
            for j, ax in enumerate(grid[t]):
                ax.set_xticks([])
                ax.set_yticks([])
                if j >= len(row["samples"]):
                    ax.set_axis_off()
                    continue
                ax.imshow(pixels[name]["top"][t, j].numpy(), interpolation="nearest")
                label = row["sample_labels"][j]
                ax.set_title(f"{class_names[label]}\n{row['contributions'][j]:+.3g}",
                             fontsize=7, color="tab:green" if label == row["predicted"]
                             else "dimgray")  # fmt: skip
            grid[t, 0].set_ylabel(f"predicts\n{class_names[row['predicted']]}", fontsize=8,
                                  color="tab:green" if right else "tab:red")
    fig.supxlabel("Above each training image: its label (green: the class the model "
                  "predicted) and its summed contribution to the predicted logit "
                  "(rcdl.explain)", fontsize=8)
    return save_figure(fig, path)


def draw_results(path: Path, rows_: Sequence[Mapping[str, Any]],
                 runs: Sequence[Mapping[str, Any]]) -> Path:  # fmt: skip
    """``attribution.png``: the LDS of each model and variant beside the published anchors,
    and the share of flipped labels found against the share inspected, per ranking."""
    from matplotlib.figure import Figure

    lds = [r for r in rows_ if r["measurement"] == "lds"]
    mislabel = [r for r in runs if r["measurement"] == "mislabel"]
    panels = int(bool(lds)) + int(bool(mislabel))
    fig = Figure(figsize=(5.5 * panels, 4.2), layout="constrained")
    axes = iter(fig.subplots(1, panels, squeeze=False)[0])
    if lds:
        ax = next(axes)
        models = list(dict.fromkeys(r["model"] for r in lds))
        variants = list(dict.fromkeys(r["scores"] for r in lds))  # the three, then options'
        fills = ("tab:purple", "tab:olive", "tab:cyan", "tab:brown", "tab:pink", "tab:gray",
                 "tab:orange", "tab:red")
        step = 0.27 if len(variants) <= 3 else 0.84 / len(variants)  # between bars' centres
        for v, (variant, fill) in enumerate(zip(variants, fills, strict=False)):
            bars = [next((r for r in lds if r["model"] == m and r["scores"] == variant), None)
                    for m in models]  # fmt: skip
            ax.bar([i + (v - (len(variants) - 1) / 2) * step for i in range(len(models))],
                   [b["lds"] if b else 0 for b in bars], step - 0.01, label=variant,
                   color=fill)
        for (what, value), style in zip(LDS_ANCHORS, (":", "--", "-."), strict=True):
            ax.axhline(value, color="black", lw=0.9, ls=style, label=f"{what}: {value}")
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xticks(range(len(models)), models)
        ax.set(ylabel="LDS (mean Spearman over test images)",
               title="Linear datamodeling score (anchors: dattri, other models and data)")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    if mislabel:
        ax = next(axes)
        styles: dict[str, tuple[Any, float]] = {  # (line style, width) per ranking
            "self-influence": ((0, (1, 1.5)), 1.6), "leave-one-out margin": ("-.", 1.2),
            "leave-one-out label vote": ((0, (6, 2)), 1.2), "leave-one-out, both": ("-", 2.2),
            "training loss": ((0, (2, 3)), 0.8), "random": (":", 0.7)}
        for run in mislabel:
            colour: str | None = None
            for ranking, d in run["rankings"].items():
                style, width = styles.get(ranking, ("-", 1.0))
                (line,) = ax.plot([0, *CURVE], [0, *d["curve"]], ls=style, lw=width,
                                  color=colour, label=f"{run['model']}, {ranking}")
                colour = line.get_color()
        found = KRONFLUENCE_FOUND
        ax.plot(list(found), list(found.values()), "k*", markersize=9,
                label="Kronfluence (full CIFAR-10, ResNet-9)")
        ax.plot([0, 1], [0, 1], color="gray", lw=0.6)
        ax.set(xlabel="share of the training images inspected",
               ylabel="share of the flipped labels found", xlim=(0, 1), ylim=(0, 1.02),
               title="Mislabel detection: images inspected in ranking order")
        ax.title.set_fontsize(9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def _num(value: float | None, spec: str) -> str:
    return "—" if value is None else f"{value:{spec}}"


def targets(rows_: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per model and measurement: its best score or ranking against
    :data:`LDS_TARGETS` and :data:`MISLABEL_TARGET`, met or not (rcdl's models; the seed
    ceiling and the TRAK peer are not scores of theirs)."""
    lines = []
    for name in dict.fromkeys(r["model"] for r in rows_):
        if name.startswith("mlp-"):  # the TRAK peer's MLP (option trak): not rcdl's aims
            continue
        lds = [r for r in rows_ if r["model"] == name and r["measurement"] == "lds"
               and r["scores"] != "seed ceiling"]  # a bound, not a score
        if lds and name in LDS_TARGETS:
            best = max(lds, key=lambda r: r["lds"])
            goal = LDS_TARGETS[name]
            lines.append(f"- {name}, LDS: best {best['lds']:.3f} ({score_text(best['scores'])}) "
                         f"against the target {goal:.2f}: "
                         f"{'met' if best['lds'] >= goal else 'not met'}")
        flips = [r for r in rows_ if r["model"] == name and r["measurement"] == "mislabel"
                 and r["scores"] != "random"]
        if flips:
            best = max(flips, key=lambda r: r["roc_auc"])
            auc_goal, top_goal = MISLABEL_TARGET
            met = best["roc_auc"] >= auc_goal and best["found_top10"] >= top_goal
            lines.append(f"- {name}, mislabels: best ROC-AUC {best['roc_auc']:.3f} "
                         f"({best['scores']}), {100 * best['found_top10']:.0f} % of the flipped "
                         f"labels in its top 10 %, against ROC-AUC {auc_goal:.2f} with "
                         f"{100 * top_goal:.0f} %: {'met' if met else 'not met'}")
    return lines


def _option_notes(cfg: AttributionConfig, runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the options added to the LDS table, and the cascades a readout refused."""
    notes = []
    cascades = [r for r in runs if r["measurement"] == "lds-cascade"]
    if any("variants" in r for r in cascades):
        notes.append("The readout cascade (option `cascade`, `rcdl.readout_cascade`, "
                     "docs/attribution.md): each sample's readout shares with the first-order "
                     "change of the readout's later writes, to one later write (one-level) "
                     "and through every later write (cascade), keys held fixed; from the "
                     "full model trained again, its seconds per test image the cascade's.")
    notes += [f"No readout cascade for {r['model']}: {r['refused']}" for r in cascades
              if "refused" in r]
    if any(r["measurement"] == "lds-ceiling" for r in runs):
        notes.append(f"The seed ceiling (option `seed_ceiling`): each half retrained a second "
                     f"time (seeds {SECOND_SEED}–{SECOND_SEED + cfg.halves - 1}), those "
                     "margins scored by LDS against the first retraining's; no score of the "
                     "half alone can predict the part of a retrained margin the seed decides.")
    peers = [r for r in runs if r["measurement"] == "lds-full" and "peer" in r]
    notes += [f"{r['model']}: {r['peer']}" for r in peers]
    return notes


def _mislabel_text(r: Mapping[str, Any]) -> str:
    """A mislabel run's flips, accuracy and seconds, for the report's paragraph."""
    if r.get("peer"):
        return (f"{r['model']} (the TRAK peer): {r['flipped']:,} labels flipped, the seed-0 "
                f"MLP's test accuracy {r['test_acc']:.1f} %, TRAK self-influence "
                f"{r['explain_seconds_per_image']:.4f} s per training image (the whole "
                "ensemble's, training aside)")
    return (f"{r['model']}: {r['flipped']:,} labels flipped, test accuracy "
            f"{r['test_acc']:.1f} % (clean test labels), self-influence "
            f"{r['explain_seconds_per_image']:.4f} s per training image, leave-one-out "
            f"{r.get('leave_one_out_seconds_per_image', float('nan')):.4f} s, label vote "
            f"{r.get('vote_seconds_per_image', float('nan')):.4f} s")


def write_report(run: RunDir, cfg: AttributionConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv``, ``explanations.png`` and ``attribution.png``;
    return the markdown."""
    d, rows_, runs = summary["data"], summary["rows"], summary["runs"]
    copy = d["provenance"].split(" (", 1)[0]  # e.g. "the JPEG-decoded copy of CIFAR-10"
    parts = [
        "# rcdl's native attribution on CIFAR-10",
        f"{d['n_train']:,} training / {d['n_test']:,} test CIFAR-10 images (random subsets, "
        f"data seed {cfg.data_seed}). Data: {d['provenance']}. Every model is trained one "
        f"epoch, batch {cfg.batch_size}; a training image's score for an output is the sum "
        "of its entries' contributions to it (`rcdl.explain`).",
    ]
    lds = [r for r in rows_ if r["measurement"] == "lds"]
    if lds:
        table = markdown_table(
            ("model", "scores", "LDS", "sd over test images", "test images",
             "s per retrained model", "s per explained test image"),
            [(r["model"], score_text(r["scores"]), f"{r['lds']:.3f}",
              _num(r["lds_sd"], ".3f"), r["test_images"], f"{r['retrain_seconds']:.2f}",
              _num(r["explain_seconds_per_image"], ".4f")) for r in lds],
            "llrrrrr")  # fmt: skip
        anchors = ", ".join(f"{what} {value}" for what, value in LDS_ANCHORS)
        peer = any(r["scores"].startswith("TRAK-") for r in lds)
        parts += [
            "## Linear datamodeling score",
            f"Scores towards each test image's correct-class logit from the model trained "
            f"on every training image; {cfg.halves} models retrained on random halves "
            f"(seeds {FIRST_HALF_SEED}–{FIRST_HALF_SEED + cfg.halves - 1}); per test image, "
            "the Spearman correlation over the halves between the half's summed scores and "
            "the retrained model's correct-class margin; LDS is its mean.",
            table,
            *_option_notes(cfg, runs),
            f"Published anchors (dattri benchmark; other models and data"
            f"{'' if peer else ', TRAK not run here'}): {anchors}. The numbers above are on "
            f"{copy}.",
        ]
    flips = [r for r in runs if r["measurement"] == "mislabel"]
    if flips:
        table = markdown_table(
            ("model", "ranking", "ROC-AUC", "flipped found in the top 10 %", "in the top 20 %"),
            [(r["model"], r["scores"], f"{r['roc_auc']:.3f}", f"{r['found_top10']:.3f}",
              f"{r['found_top20']:.3f}") for r in rows_ if r["measurement"] == "mislabel"],
            "llrrr")  # fmt: skip
        models = "; ".join(_mislabel_text(r) for r in flips)
        found = KRONFLUENCE_FOUND
        parts += [
            "## Mislabel detection",
            f"{100 * cfg.flip:g} % of the training labels flipped to another class at random "
            f"(seed {FLIP_SEED}); one model trained on them; the training images ranked by "
            "self-influence (their own entries' contribution to their own label's logit), "
            "by minus their label's margin with their own entries deleted (leave-one-out), "
            "by minus their label's margin in the readout's label vote with their own "
            "entries left out, by the mean of those two ranks, "
            f"by the trained model's loss on them, and at random. {models}.",
            table,
            f"Anchors (other models, more data): Kronfluence finds "
            f"{100 * found[0.1]:.0f} % / {100 * found[0.2]:.0f} % of the flipped labels in the "
            f"top 10 % / 20 % (full CIFAR-10, ResNet-9); dattri's TRAK on a CIFAR-10 "
            f"ResNet-9 has ROC-AUC {TRAK_AUC}. The numbers above are on "
            f"{copy}.",
        ]
    if verdicts := targets(rows_):
        parts += ["## Targets", "\n".join(verdicts)]
    figures: dict[str, Any] = {}
    shown = {r["model"]: r["shown"] for r in runs if r["measurement"] == "lds-full"
             and r["shown"]}  # fmt: skip
    if shown:
        pixels = {name: torch.load(_file(run, f"lds-{name}-shown.pt", f"{name}-lds-full"),
                                   weights_only=True) for name in shown}
        figures["explanations.png"] = partial(draw_explanations, shown=shown, pixels=pixels,
                                              class_names=summary["class_names"])
        parts.append(f"`explanations.png`: the first {cfg.shown} test images, each beside "
                     f"the {cfg.top} training images contributing most to its predicted "
                     "logit under each model.")
    if lds or flips:
        figures["attribution.png"] = partial(draw_results, rows_=rows_, runs=runs)
        parts.append("`attribution.png`: the LDS beside its anchors, and the share of the "
                     "flipped labels found against the share of the images inspected.")
    parts.append(f"Data: {d['source']}, {d['provenance']}.\nMachine: "
                 f"{describe_machine(device)}.\n")
    return write_outputs(run, "\n\n".join(parts), csv_text(rows_, COLUMNS), figures)
