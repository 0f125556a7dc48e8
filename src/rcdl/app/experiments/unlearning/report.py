"""The unlearning experiment's report: the forgetting comparison's table, CSV and figure
(rows over seeds), and a section per other study the run measured, each of which writes its
own files (its module's ``report``)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from rcdl.app.experiments.unlearning import (
    exact_cost,
    forget_command,
    log_size,
    repair_budget,
)
from rcdl.app.experiments.unlearning.config import (
    SCENARIOS,
    ForgettingConfig,
    full,
    study_of,
)
from rcdl.app.experiments.unlearning.run import MIA_SPLITS
from rcdl.app.report import csv_text, markdown_table, mean_sd, pm, write_outputs
from rcdl.app.rundir import RunDir, describe_machine

__all__ = ["ANCHORS", "METRICS", "STUDY_MODULES", "finish", "plot", "rows", "write_report"]

# the NeurIPS 2023 machine-unlearning challenge's starting kit (CIFAR-10, ResNet-18, a
# random forget set): the simple MIA's accuracy
ANCHORS = {"original": 0.579, "fine-tune": 0.512, "retrain": 0.502}
# the studies other than the forgetting comparison, by name: their modules
STUDY_MODULES = {module.STUDY: module
                 for module in (exact_cost, forget_command, log_size, repair_budget)}

METRICS = ("forget_acc", "retain_acc", "test_acc", "mia", "seconds")


def rows(cfg: ForgettingConfig, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (scenario, model, variant) of the forgetting comparison: each metric's
    mean and sd over seeds (the other studies' results in ``runs`` are left out)."""
    runs = [r for r in runs if study_of(r) == "forgetting"]
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


def finish(cfg: ForgettingConfig, summary: dict[str, Any]) -> None:
    """The summary's ``rows`` (:func:`rows`), once every sub-run finished."""
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


def _forgetting_parts(cfg: ForgettingConfig, summary: dict[str, Any]) -> list[str]:
    """The forgetting comparison's report, in parts: its title, protocol and tables."""
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
    exact = [v["variants"]["exact"] for r in summary["runs"] if study_of(r) == "forgetting"
             for v in r["scenarios"].values()
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
    return parts


def write_report(run: RunDir, cfg: ForgettingConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write the report of each study the run measured: for the forgetting comparison
    ``results.md``, ``results.csv`` and ``unlearning.png``, for the others their own files
    and a section of ``results.md``; return the markdown."""
    studies = full(cfg).studies
    parts = (_forgetting_parts(cfg, summary) if "forgetting" in studies else
             ["# Unlearning studies", f"Data: {summary['data']['source']}, "
              f"{summary['data']['provenance']}."])
    for study in studies:
        if study != "forgetting":
            results = [r for r in summary["runs"] if study_of(r) == study]
            parts.append(STUDY_MODULES[study].report(run, full(cfg), results, summary, device))
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
    if "forgetting" not in studies:
        return write_outputs(run, markdown)
    rows_ = summary["rows"]
    return write_outputs(run, markdown, csv_text(rows_), {
        "unlearning.png": partial(plot, rows_=rows_, scenarios=cfg.scenarios)})
