"""The class-incremental experiment's report (:mod:`rcdl.app.experiments.continual`):
``results.md`` (the tables, the silent memories, the value masses and the verdict),
``results.csv`` and the figures of :mod:`~rcdl.app.experiments.continual.plots`."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from rcdl.app.experiments.continual.analysis import KEPT_TARGET
from rcdl.app.experiments.continual.plots import plot_curves, plot_mass, plot_matrices, plot_silent
from rcdl.app.experiments.continual.spec import (
    READOUTS,
    ContinualConfig,
    class_order,
    task_split,
)
from rcdl.app.report import csv_text, markdown_table, pm, write_outputs
from rcdl.app.rundir import RunDir, describe_machine

__all__ = ["ANCHORS", "write_report"]

# Split CIFAR-10, class-incremental, 5 tasks (DER, Buzzega et al. 2020, Table 2: ResNet-18,
# 50 epochs per task): final accuracy in percent; and 1-NN on raw pixels
ANCHORS = {"fine-tuning": 19.62, "EWC (online)": 19.49, "SI": 19.48, "LwF": 19.61,
           "1-NN raw pixels": "35–39"}


def _main_table(rows_: list[dict[str, Any]]) -> str:
    body = [(f"{r['model']} ({r['label']})", pm(r["acc"], r["acc_sd"], 1),
             pm(r["aia"], r["aia_sd"], 1), pm(r["bwt"], r["bwt_sd"], 1),
             pm(r["aware_bwt"], r["aware_bwt_sd"], 1),
             pm(r["forgetting"], r["forgetting_sd"], 1), pm(r["iid_acc"], r["iid_acc_sd"], 1),
             pm(r["gap"], r["gap_sd"], 1), pm(r["kept"], r["kept_sd"], 0),
             pm(r["train_seconds"], None, ".3g"), pm(r["eval_seconds"], None, ".3g"))
            for r in rows_ if r["order"] == "all"]
    return markdown_table(("model", "final acc %", "avg incremental acc %", "BWT (pp)",
                           "task-aware BWT (pp)", "forgetting (pp)", "i.i.d. one pass %",
                           "gap (pp)", "kept % of i.i.d.", "train s", "eval s"), body)


def _order_table(cfg: ContinualConfig, rows_: list[dict[str, Any]]) -> str:
    by = {(r["model"], r["order"]): r for r in rows_}
    body = [(name, *(pm(by[name, o]["acc"], by[name, o]["acc_sd"], 1)
                     if (name, o) in by else "—" for o in cfg.orders))
            for name in cfg.models if (name, "all") in by]
    return markdown_table(("model", *(f"{o}: {''.join(map(str, class_order(o)))}"
                                      for o in cfg.orders)), body)


def _silent_table(silent: list[dict[str, Any]]) -> str:
    body = [(r["model"], r["task"],
             "—" if r["stored_pct"] is None else
             f"{r['entries_stored']:,.0f} of {r['entries_written']:,.0f}",
             pm(r["learnt_acc"], r["learnt_acc_sd"], 1),
             pm(r["learnt_aware_acc"], r["learnt_aware_acc_sd"], 1),
             pm(r["full_acc"], r["full_acc_sd"], 1),
             pm(r["task_aware_acc"], r["task_aware_acc_sd"], 1),
             "— (nothing to restrict)" if r["own_entries_acc"] is None and r["stored_pct"] is None
             else pm(r["own_entries_acc"], r["own_entries_acc_sd"], 1)) for r in silent]
    return markdown_table(("model", "task", "entries stored", "just after it, 10-way %",
                           "just after it, task-aware %", "at the end, 10-way %",
                           "at the end, task-aware %", "at the end, own entries only, "
                           "10-way %"), body)


def _verdict_lines(verdicts: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, v in verdicts.items():
        parts = []
        if v["above_mlps"] is not None:
            parts.append(f"{'above' if v['above_mlps'] else 'NOT above'} every MLP method "
                         f"(best: {v['best_mlp']})")
        if v["above_knn"] is not None:
            parts.append(f"{'above' if v['above_knn'] else 'NOT above'} raw-pixel kNN and "
                         f"streaming LDA (best: {v['best_knn']})")
        if v.get("above_pec") is not None:
            parts.append(f"{'above' if v['above_pec'] else 'NOT above'} PEC")
        if v["kept"] is not None:
            parts.append(f"keeps {v['kept']:.0f} % of its i.i.d. accuracy "
                         f"({'at least' if v['most_kept'] else 'NOT'} {KEPT_TARGET:.0f} %)")
        lines.append(f"- **{name}** ({v['acc']:.1f} %): " + "; ".join(parts) + ".")
    return "\n".join(lines) or "No growing model was run."


def _protocol(cfg: ContinualConfig, d: dict[str, Any]) -> str:
    """The report's first paragraph: the data, the tasks, the protocol and the columns."""
    tasks = task_split("0", cfg.classes_per_task)
    return (
        f"{d['n_train']:,} training / {d['n_test']:,} test CIFAR-10 images (random subsets, "
        f"data seed {cfg.data_seed}); {len(tasks)} tasks of {cfg.classes_per_task} classes, "
        f"one pass over each task's images, batch {cfg.batch_size}, no replay, one 10-way "
        f"head, no task label at test time. Orders: {', '.join(cfg.orders)}; seeds "
        f"{' '.join(map(str, cfg.seeds))}; mean ± sd over every (order, seed). *final*: "
        "accuracy on every test image after the last task; *avg incremental*: the mean over "
        "the tasks of the accuracy on the classes seen so far; *BWT*: mean change on each "
        "earlier task from just after learning it to the end (negative: forgotten); "
        "*task-aware BWT*: the same with the argmax over each task's own classes (what is "
        "lost within a task, not to the competition with later classes); *forgetting*: "
        "mean drop from each earlier task's best to its last accuracy; "
        "*i.i.d.*: one pass over the same images shuffled over all classes (EWC and LwF: "
        f"{cfg.regularised_base}'s); *gap*: i.i.d. minus final; *kept*: final / i.i.d.; "
        "seconds per class-incremental run (kNN's fits count as evaluation).")


def _readouts_section(summary: dict[str, Any]) -> list[str]:
    """The section of the readouts (``--readouts``): one row per model and readout."""
    if not summary.get("readouts"):
        return []
    words = {**{k: v.split(":")[0] for k, v in READOUTS.items()},
             "task_identified": "task identified (task inference's first step)"}
    body = [(r["model"], words.get(r["readout"], r["readout"]), r["runs"],
             pm(r["acc"], r["acc_sd"], 1)) for r in summary["readouts"]]
    return [
        "## Other readouts of the trained readout",
        "After the last task, the test images read out of the trained RBF readout's stored "
        "entries in other ways, nothing trained again, no image replayed (`readouts.json`; "
        "results/continual/LOG.md, \"What did not help\"): "
        + "; ".join(READOUTS.values()) + ". Final accuracy %, mean ± sd over every (order, "
        "seed).",
        markdown_table(("model", "readout", "runs", "final acc %"), body)]


def _readouts_json(cfg: ContinualConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """``readouts.json``: per model and readout, the final accuracy of every (order, seed)
    in the order of the sub-runs."""
    results: dict[str, dict[str, list[float]]] = {}
    for r in summary["readouts"]:
        results.setdefault(r["model"], {})[r["readout"]] = r["values"]
    return {"train_size": summary["data"]["n_train"], "test_size": summary["data"]["n_test"],
            "orders": list(cfg.orders), "seeds": list(cfg.seeds), "results": results}


def write_report(run: RunDir, cfg: ContinualConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv`` and the figures ``continual_matrix.png``,
    ``continual_curves.png`` and ``silent_memories.png`` (and, with ``--readouts``,
    ``readouts.json``); return the markdown."""
    d, rows_, silent = summary["data"], summary["rows"], summary["silent"]
    parts = [
        "# Class-incremental Split CIFAR-10, no replay",
        _protocol(cfg, d),
        _main_table(rows_),
        "## Final accuracy per class order (%)",
        _order_table(cfg, rows_),
        "## Silent memories: kept, but retrieved?",
        "Per task (by position in its order): the entries its training images wrote that "
        "are still stored after the last task (every growing layer); the accuracy on its "
        "test images just after learning it and after the last task, with the whole model "
        "(10-way, and task-aware: the argmax over its own classes); and after the last task "
        "with a copy of the model whose growing layers keep only the entries its images "
        "wrote (plus the initial ones), 10-way. A parametric network has nothing to "
        "restrict.",
        _silent_table(silent),
        "## Where each task's readout values point",
        "The signed value mass of the readout's stored entries, by the task whose images "
        "wrote them (rows) and the class (columns, in the order's position: task 1's two "
        "classes first), mean over every (order, seed): `value_mass.png`. A plain readout "
        "writes `v = −η g`: each entry raises its own class and lowers the classes the "
        "model predicted when it was written, the earlier tasks' ones; under the labels "
        "trick a task's entries touch only its own classes.",
        _mass_table(summary.get("value_mass", {})),
        "## Verdict",
        "Goal: the best growing model above every non-replay MLP method, above raw-pixel "
        f"kNN and streaming LDA, keeping at least {KEPT_TARGET:.0f} % of its own i.i.d. "
        "accuracy; and, the strongest rehearsal-free peer, PEC (where it was run).",
        _verdict_lines(summary["verdict"]),
        *_readouts_section(summary),
        "Anchors (Split CIFAR-10 class-incremental, 5 tasks, ResNet-18, 50 epochs per task, "
        "DER, Buzzega et al. 2020): fine-tuning 19.62 %, online EWC 19.49 %, SI 19.48 %, "
        "LwF 19.61 %; 1-NN on raw pixels about 35–39 % on the whole CIFAR-10. kNN, NCM and "
        "streaming LDA do not depend on the order: their class-incremental accuracy is "
        "their i.i.d. one.",
        f"Data: {d['source']}, {d['provenance']}.\nMachine: {describe_machine(device)}.\n",
    ]
    markdown = "\n\n".join(parts)
    if summary.get("readouts"):
        run.write_json("readouts.json", _readouts_json(cfg, summary))
    table = ([{"table": "models", **r} for r in rows_]
             + [{"table": "silent memories", **r} for r in silent])
    columns = list(dict.fromkeys(k for r in table for k in r))  # both tables' columns
    return write_outputs(run, markdown, csv_text(table, columns), {
        "continual_matrix.png": partial(plot_matrices, matrices=summary["matrices"]),
        "continual_curves.png": partial(plot_curves, matrices=summary["matrices"]),
        "silent_memories.png": partial(plot_silent, silent=silent),
        **({"value_mass.png": partial(plot_mass, mass=summary["value_mass"])}
           if summary.get("value_mass") else {})})


def _mass_table(mass: dict[str, list[list[float]]]) -> str:
    if not mass:
        return "No growing model was run."
    width = len(next(iter(mass.values()))[0])
    body = [(name, t + 1, *(f"{v:+.1f}" for v in row))
            for name, m in mass.items() for t, row in enumerate(m)]
    return markdown_table(("model", "written by task", *(f"class {k + 1}"
                                                          for k in range(width))), body)
