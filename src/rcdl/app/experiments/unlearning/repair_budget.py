"""The repair-budget study: the gap between fast forgetting and retraining against its time
budget (docs/fast_forgetting.md).

For each model whose readout a rule writes (gws, RBF; not the hybrid) and seed, one
sub-run trains the model one pass on the training subset and, for each forget set
(``scenarios``, as the forgetting comparison draws them), retrains it on the same stream
without the forgotten images; then, each time from a copy of the trained model, runs
:func:`rcdl.memory.repair.forget_and_repair` re-writing only the first share ``f`` of the
readout's steps from the earliest forgotten image's (``repair_fractions``; ``f = 0`` is
:func:`rcdl.memory.forgetting.forget` alone, ``f = 1`` the whole fast mode), with the
readout's stored keys and with its keys recomputed from the training images. Measures the
seconds and the forget-set, retained-set and test accuracy and the attack score of every
variant (as the forgetting comparison does). Writes ``repair_budget.json``,
``repair_budget.md`` (the mean gaps to retraining over seeds) and ``repair_budget.png``
(each gap against the seconds) into the run folder.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rcdl._io import atomic_write_text
from rcdl.app.cifar import CifarData
from rcdl.app.experiments.unlearning.config import UnlearningConfig, study_runs
from rcdl.app.experiments.unlearning.run import measure, scenario_of, train
from rcdl.app.models import build_model, model_spec
from rcdl.app.rundir import RunDir
from rcdl.app.runner import Session
from rcdl.memory.provenance import entry_samples
from rcdl.memory.repair import forget_and_repair, readout_of, repair_refusal
from rcdl.train.loop import epoch_permutation

__all__ = ["STUDY", "repair_budget", "report", "steps_after", "sub_runs", "table"]

STUDY = "repair-budget"
METRICS = ("forget_acc", "retain_acc", "test_acc", "mia")


def steps_after(model: nn.Module, forgotten: torch.Tensor) -> int:
    """The readout's steps from the earliest one a forgotten image wrote at."""
    layer = readout_of(model)
    written = layer.store.written_at
    first = written[torch.isin(entry_samples(layer), forgotten)].min()
    return int(written[written >= first].unique().numel())


def repair_budget(name: str, seed: int, data: CifarData, cfg: UnlearningConfig,
                  session: Session) -> dict[str, Any]:  # fmt: skip
    """One sub-run (the module docstring); a JSON-able result whose ``runs`` are one per
    scenario: the retrained model's measures, the readout's steps after the earliest
    forgotten image, and each (keys, fraction) variant's."""
    device = session.device
    x, y = data.x_train, data.y_train
    model, _, _, train_seconds = train(name, seed, x, y, cfg, session)
    stream = epoch_permutation(len(y), seed, 0)  # the original's order
    out: dict[str, Any] = {"study": STUDY, "model": name, "seed": seed,
                           "train_seconds": train_seconds, "runs": []}
    for scenario in cfg.scenarios:
        chosen = scenario_of(scenario, data, cfg, seed)
        gone, keep, sets = chosen.forget_idx, chosen.keep, chosen.sets
        retrained, _, _, again = train(name, seed, x, y, cfg, session,
                                       order=stream[keep[stream]])
        run: dict[str, Any] = {"model": name, "seed": seed, "scenario": scenario,
                               "retrain": {**measure(retrained, sets, cfg, seed, device),
                                           "seconds": again},
                               "steps": steps_after(model, gone), "variants": []}
        del retrained
        for keys in ("stored", "recomputed"):
            for fraction in cfg.repair_fractions:
                steps = math.ceil(fraction * run["steps"])
                copy_ = copy.deepcopy(model)
                receipt = forget_and_repair(copy_, gone, labels=y, steps=steps,
                                            inputs=x if keys == "recomputed" else None,
                                            scan=False)
                run["variants"].append({"keys": keys, "fraction": fraction, "steps": steps,
                                        "seconds": receipt.seconds,
                                        **measure(copy_, sets, cfg, seed, device)})
        out["runs"].append(run)
    return out


def sub_runs(cfg: UnlearningConfig, data: CifarData, session: Session) -> Iterator:
    """``repair-budget-<model>-seed<k>`` for each model the fast mode repairs (a growing
    model whose readout a rule writes: not the hybrid), seeds outer."""
    repairable = {name for name in cfg.models if model_spec(name).growing
                  and repair_refusal(build_model(name, 0)[0]) is None}
    for key, name, seed in study_runs(STUDY, cfg, repairable):
        yield key, partial(repair_budget, name, seed, data, cfg, session)


def _mean(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):+.1f} ± {sd:.1f}"


def _gap(row: dict[str, Any], base: dict[str, Any], metric: str) -> float | None:
    """``row``'s metric minus the retrained model's (``None`` where the attack had too few
    images to score)."""
    if row[metric] is None or base[metric] is None:
        return None
    return row[metric] - base[metric]


def table(runs: list[dict[str, Any]]) -> str:
    """Mean gap to retraining (± sd over seeds) per model, scenario, keys and fraction
    (``runs``: one per (model, seed, scenario))."""
    lines = ["| model | scenario | keys | fraction | Δ forget | Δ retain | Δ test | Δ MIA | "
             "seconds | retrain s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    groups: dict[tuple, list] = {}
    for run in runs:
        for row in run["variants"]:
            key = (run["model"], run["scenario"], row["keys"], row["fraction"])
            groups.setdefault(key, []).append((row, run["retrain"]))
    for (model, scenario, keys, fraction), pairs in groups.items():
        gap = {m: [g for r, base in pairs if (g := _gap(r, base, m)) is not None]
               for m in METRICS}
        mia = f"{statistics.mean(gap['mia']):+.3f}" if gap["mia"] else "—"
        lines.append(
            f"| {model} | {scenario} | {keys} | {fraction:.2f} | {_mean(gap['forget_acc'])} | "
            f"{_mean(gap['retain_acc'])} | {_mean(gap['test_acc'])} | {mia} | "
            f"{statistics.mean(r['seconds'] for r, _ in pairs):.2f} | "
            f"{statistics.mean(b['seconds'] for _, b in pairs):.1f} |")
    return "\n".join(lines)


def report(run: RunDir, cfg: UnlearningConfig, results: list[dict[str, Any]],
           summary: dict[str, Any], device: torch.device) -> str:  # fmt: skip
    """Write ``repair_budget.json``, ``.md`` and ``.png``; return the markdown section."""
    runs = [r for result in results for r in result["runs"]]
    run.write_json("repair_budget.json", {"runs": runs})
    text = table(runs)
    atomic_write_text(text + "\n", run.file("repair_budget.md"))
    plot(runs, run.file("repair_budget.png"))
    return ("## Fast forgetting's gap to retraining against its time budget\n\n"
            "Each row: `rcdl.forget_and_repair` re-writing the first share f of the "
            "readout's steps from the earliest forgotten image's (f = 0: `rcdl.forget` "
            "alone), with its stored or recomputed keys; gaps are unlearned minus "
            "retrained, accuracy in points, mean ± sd over seeds (`repair_budget.md`, "
            "`.json`, `.png`).\n\n" + text)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Per model and scenario (columns), each gap to retraining (rows) against the seconds
    the fast mode took, one line per choice of keys, means over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys((r["model"], r["scenario"]) for r in runs))
    labels = {"forget_acc": "Δ forget-set acc (points)", "retain_acc": "Δ retained acc",
              "test_acc": "Δ test acc", "mia": "Δ MIA"}
    fig, axes = plt.subplots(len(METRICS), max(1, len(cells)),
                             figsize=(4.2 * max(1, len(cells)), 10), squeeze=False)
    for col, (model, scenario) in enumerate(cells):
        mine = [r for r in runs if (r["model"], r["scenario"]) == (model, scenario)]
        retrain_s = statistics.mean(r["retrain"]["seconds"] for r in mine)
        fractions = sorted({v["fraction"] for r in mine for v in r["variants"]})
        for row_i, metric in enumerate(METRICS):
            ax = axes[row_i][col]
            for keys, colour in (("stored", "#17becf"), ("recomputed", "#bcbd22")):
                xs, ys = [], []
                for f in fractions:
                    pairs = [(v, r["retrain"]) for r in mine for v in r["variants"]
                             if v["keys"] == keys and v["fraction"] == f]
                    gaps = [g for v, b in pairs if (g := _gap(v, b, metric)) is not None]
                    if gaps:
                        xs.append(statistics.mean(v["seconds"] for v, _ in pairs))
                        ys.append(statistics.mean(gaps))
                ax.plot(xs, ys, "o-", color=colour, label=f"{keys} keys")
            band = 0.02 if metric == "mia" else 1.0
            ax.axhspan(-band, band, color="#2ca02c", alpha=0.15, label="target")
            ax.axhline(0, color="black", lw=0.8)
            ax.axvline(retrain_s / 10, color="#d62728", ls=":", label="retrain / 10")
            ax.set_ylabel(labels[metric])
            if row_i == 0:
                ax.set_title(f"{model}, {scenario} (retrain {retrain_s:.1f} s)", fontsize=9)
            if row_i == len(METRICS) - 1:
                ax.set_xlabel("seconds")
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
