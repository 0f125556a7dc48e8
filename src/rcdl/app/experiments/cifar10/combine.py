"""One table from several runs of the one-epoch CIFAR-10 comparison
(``rcdl reproduce cifar10-1epoch --combine``; docs/cifar10.md): full-scale models are long
on a CPU, so the comparison is made over several invocations and machines."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rcdl.app.experiments.cifar10.config import EXPERIMENT, Cifar10Config
from rcdl.app.experiments.cifar10.report import model_rows, write_table
from rcdl.app.models import MODELS, hybrid_tau
from rcdl.app.rundir import RunDir, count, read_config

__all__ = ["combine_runs", "finished_runs"]


# settings that may differ between runs combined into one table (the rest is the protocol)
_PER_RUN_SETTINGS = ("models", "seeds", "data_dir", "device", "checkpoint", "checkpoint_every",
                     "incremental_eval")


def finished_runs(run_dir: Path) -> tuple[Cifar10Config | None, dict[str, Any]]:
    """The config and summary of ``run_dir``; an error if no (model, seed) pair finished.

    A folder written by :func:`combine_runs` (a ``summary.json`` with ``combined_from`` and no
    ``config.json``, e.g. a committed table) has no config: ``(None, summary)``."""
    path = run_dir / RunDir.SUMMARY
    summary = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    if summary and "combined_from" in summary and not (run_dir / RunDir.CONFIG).is_file():
        return None, summary
    cfg = read_config(run_dir, Cifar10Config)
    if summary is None:
        raise FileNotFoundError(f"{run_dir}: no {RunDir.SUMMARY}, so no model finished there")
    if not summary.get("runs"):
        raise ValueError(f"{run_dir}: no model finished there ({path} lists no runs)")
    return cfg, summary


def _protocol(cfg: Cifar10Config, data: Mapping[str, Any]) -> dict[str, Any]:
    """What must agree between runs for their numbers to share a table."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in _PER_RUN_SETTINGS
                and not (k == "bf16_effect" and v is None)}  # a plain run's, either class
    return {**settings, "n_train": data["n_train"], "n_test": data["n_test"],
            "provenance": data.get("provenance")}


def _table_position(model: str) -> tuple[int, int]:
    """Where a model goes in a combined table: registry order, ``hybrid-*`` beside
    ``hybrid`` and ``psoftmax-<N>`` beside the parametric softmaxes, others last."""
    names = list(MODELS)
    if model in MODELS:
        return names.index(model), 0
    if hybrid_tau(model)[0]:
        return names.index("hybrid"), 1
    if model.startswith("psoftmax-"):
        return names.index("psoftmax-50016"), 1
    return len(names), 0


def _merge(loaded: list[tuple[Path, Cifar10Config | None, dict[str, Any]]],
           protocol: dict[str, Any], first_folder: Path,
           models: list[str] | tuple[str, ...] | None) -> tuple[list[dict[str, Any]], list]:
    """The runs of ``loaded`` (``(folder, config, summary)`` each, :func:`finished_runs`)
    kept by ``models`` (``None``: all), each with its source folder, and the sources'
    records; an error for a folder of another protocol or a (model, seed) pair finished in
    two folders."""
    runs: list[dict[str, Any]] = []
    origin: dict[tuple[str, int], Path] = {}
    sources = []
    for folder, cfg, summary in loaded:
        # a combined table (no config) states its protocol; its runs keep their sources
        theirs = ({"store_dtype": None, **summary["protocol"]} if cfg is None  # older tables
                  else _protocol(cfg, summary["data"]))
        if theirs != protocol:
            diff = {k: (protocol.get(k), theirs.get(k)) for k in {**protocol, **theirs}
                    if protocol.get(k) != theirs.get(k)}
            raise ValueError(f"combine: {folder} used another protocol than {first_folder} "
                             f"(theirs first, then this one's): {diff}")
        kept = [r for r in summary["runs"] if models is None or r["model"] in models]
        for r in kept:
            key = (r["model"], r["seed"])
            if key in origin:
                raise ValueError(f"combine: {r['model']} seed {r['seed']} finished in both "
                                 f"{origin[key]} and {folder}; leave one of them out")
            origin[key] = folder
            runs.append({**r, "source": r["source"] if cfg is None else str(folder)})
        if cfg is None:
            for src in summary["combined_from"]:
                still = [m for m in src["models"]
                         if any(r["source"] == src["path"] and r["model"] == m for r in runs)]
                if still:
                    sources.append({**src, "models": still})
            continue
        environment = folder / RunDir.ENVIRONMENT
        sources.append({
            "path": str(folder),
            "models": list(dict.fromkeys(r["model"] for r in kept)),
            "sessions": summary.get("sessions", []),
            "environment": (json.loads(environment.read_text(encoding="utf-8"))
                            if environment.is_file() else None),
        })  # fmt: skip
    return runs, sources


def combine_runs(run_dirs: list[str | Path], out: str | Path,
                 models: list[str] | tuple[str, ...] | None = None,
                 ) -> tuple[Path, dict[str, Any]]:
    """One table and figure from the finished (model, seed) pairs of several run folders.

    Full-scale models are long on a CPU, so the comparison is made over several
    invocations, sessions and machines. This merges their ``summary.json`` files after
    checking that they share the protocol (:func:`_protocol`); a (model, seed) pair finished
    in two folders is an error, an unfinished one is not in its summary. ``models`` keeps
    only those models (each must have finished in some folder). A combined table written
    here may be a source too: its runs keep their own sources, so a model can be added to a
    table whose original run folders are gone.

    Writes into ``out``: ``summary.json`` (the runs, per-model rows and, per source folder,
    its path, models, sessions and environment), ``results.md``, ``results.csv`` and
    ``test_accuracy.png``; models ordered by :func:`_table_position`, then as found.
    """
    if not run_dirs:
        raise ValueError("combine: give at least one run folder")
    loaded = [(Path(p), *finished_runs(Path(p))) for p in run_dirs]
    first = next(((folder, cfg, summary) for folder, cfg, summary in loaded if cfg is not None),
                 None)
    if first is None:
        raise ValueError("combine: give at least one run folder (not only combined tables): "
                         "its config describes the protocol")
    first_folder, first_cfg, first_summary = first
    protocol = _protocol(first_cfg, first_summary["data"])
    runs, sources = _merge(loaded, protocol, first_folder, models)
    present = list(dict.fromkeys(r["model"] for r in runs))
    missing = [m for m in models or () if m not in present]
    if missing:
        raise ValueError(f"combine: {', '.join(missing)} finished in none of "
                         f"{', '.join(str(f) for f, _, _ in loaded)}")
    models = tuple(sorted(present, key=_table_position))
    combined = {"experiment": EXPERIMENT, "combined_from": sources,
                "data": first_summary["data"], "protocol": protocol, "runs": runs,
                "models": model_rows(runs, models)}
    Path(out).mkdir(parents=True, exist_ok=True)
    run = RunDir(out)
    run.write_summary(combined)
    write_table(run, first_cfg, combined, models, sorted({r["seed"] for r in runs}),
                  combined=True, tail=_sources_text(combined))
    return run.path, combined


def _sources_text(combined: dict[str, Any]) -> str:
    """The combined table's list of its source folders: models, sessions, machines, code."""
    lines = []
    for source in combined["combined_from"]:
        sessions = source["sessions"]
        machines = sorted({f"{s.get('cpu_count')} CPUs, {count(s.get('num_threads'), 'thread')}, "
                           f"{s.get('device')}" for s in sessions})
        revisions = sorted({(s.get("git_revision") or "?")[:10] for s in sessions})
        minutes = sum(s.get("seconds") or 0 for s in sessions) / 60
        lines.append(f"- `{source['path']}`: {', '.join(source['models'])}; "
                     f"{len(sessions)} session(s), {minutes:.0f} min in all; "
                     f"{'; '.join(machines)}; git {', '.join(revisions)}")
    return ("\nCombined from these run folders (`rcdl reproduce cifar10-1epoch --combine`):\n"
            + "\n".join(lines) + "\n")
