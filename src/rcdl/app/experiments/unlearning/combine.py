"""``rcdl reproduce unlearning --combine``: one report of the forgetting comparison from the
finished sub-runs of several run folders."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from rcdl.app.experiments.unlearning.config import (
    EXPERIMENT,
    ForgettingConfig,
    SavedConfig,
    study_of,
)
from rcdl.app.experiments.unlearning.report import rows, write_report
from rcdl.app.rundir import RunDir, read_config

__all__ = ["combine_runs", "forgetting_only"]


def forgetting_only(cfg: ForgettingConfig) -> ForgettingConfig:
    """The forgetting comparison's settings of ``cfg`` (those of :class:`ForgettingConfig`)."""
    return ForgettingConfig(**{f.name: getattr(cfg, f.name)
                               for f in dataclasses.fields(ForgettingConfig)})


# settings that may differ between runs combined into one table (the rest is the protocol)
_PER_RUN = ("models", "seeds", "data_dir", "device")


def combine_runs(run_dirs: list[str | Path], out: str | Path) -> tuple[Path, dict[str, Any]]:
    """One report from the finished (model, seed) sub-runs of several run folders
    (``rcdl reproduce unlearning --combine RUN_DIR ... --out DIR``): seeds or models run in
    separate invocations, or an interrupted run's finished part. The folders must share the
    protocol (every setting of the comparison but the models, seeds, data folder and device,
    and the data); a (model, seed) finished in two of them is an error. Only the forgetting
    comparison's sub-runs are combined (the other studies' are left out). Writes
    ``summary.json`` (with each source folder and its environment), ``results.md``,
    ``results.csv`` and ``unlearning.png`` into ``out``."""
    if not run_dirs:
        raise ValueError("combine: give at least one run folder")
    runs: list[dict[str, Any]] = []
    origin: dict[tuple[str, int], Path] = {}
    sources, first = [], None
    for folder in map(Path, run_dirs):
        cfg = forgetting_only(read_config(folder, SavedConfig))
        run = RunDir(folder)
        finished = {name: r for name, r in run.finished().items()
                    if study_of(r) == "forgetting"}
        summary_path = folder / RunDir.SUMMARY
        if not finished or not summary_path.is_file():
            raise ValueError(f"combine: no (model, seed) of the forgetting comparison "
                             f"finished in {folder}")
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
