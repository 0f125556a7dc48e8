"""One runner for every experiment: device, data, run folder, sub-runs, resume, report.

An experiment is declared once, as an :class:`Experiment`: its name and config class, and
the few functions that are its own: which sub-runs it has and how one trains
(``sub_runs``), what its summary adds before and after training (``start``, ``finish``),
and its report (``report``). :func:`run_experiment` does everything else, the same way for
all of them:

1. resolve the device (``cfg.device`` unless given) and load the data (unless given; a
   given data set must have the config's sizes);
2. open the run folder: a new one (``out``, default ``runs/<name>-<timestamp>``) or the
   interrupted one at ``resume``, whose saved config must equal ``cfg`` except for
   ``data_dir`` and ``device`` (:func:`rcdl.app.rundir.open_run`); under ``torchrun`` rank 0
   writes it (:func:`rcdl.app.rundir.rank0_run`). Every process of every session of the run
   then runs half-precision products as the folder's ``environment.json`` recorded when the
   run started (:meth:`rcdl.app.rundir.RunDir.product_record`), not as a timing in this
   process would choose (docs/precision.md, "Product paths");
3. train each sub-run through :meth:`rcdl.app.rundir.RunDir.sub_run`, which saves its
   result in ``finished.json`` at once, so a resumed run skips it (an experiment may keep
   them in its summary instead: ``finished_in_summary``); the summary is rewritten after
   each one (with what ``update`` adds), and an interrupt prints the command that
   continues the run;
4. ``finish`` the summary (tables' rows, verdicts), write the report, print it (under
   ``torchrun``: rank 0 alone).

What every run folder holds, whatever the experiment::

    config.json        the resolved config (the one ``--resume`` continues with)
    environment.json   the experiment, machine, torch, threads, git revision, command line,
                       the compute paths taken (rewritten after each sub-run)
    finished.json      each finished sub-run's result, written as it finishes
    summary.json       ``experiment``, ``complete``, ``runs`` and what the experiment adds
    metrics.jsonl      the trainer's evaluation records, tagged by the sub-run
    results.md         the report (and, per experiment, results.csv and figures)

A resumed run trains the unfinished sub-runs from scratch, so its tables are those of an
uninterrupted run; ``metrics.jsonl`` may repeat the evaluations of the sub-run that was
interrupted.

The command line (:mod:`rcdl.app.cli`) builds each experiment's flags from its config and
calls :func:`run_experiment`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rcdl.app.rundir import (
    RunDir,
    collecting_new_objects,
    environment_info,
    open_run,
    rank0_run,
    release_memory,
    resolve_device,
    to_jsonable,
)
from rcdl.distributed import rank_and_world
from rcdl.ops.half import product_mode, products_as

__all__ = ["Combine", "Experiment", "Session", "TaggedLog", "check_sizes",
           "run_experiment"]  # fmt: skip

SubRuns = Iterable[tuple[str, Callable[[], Mapping[str, Any]]]]


class TaggedLog:
    """Hands the trainer's records to the run's ``metrics.jsonl`` with ``tags`` first (e.g.
    ``model`` and ``seed``), replacing any field of the record the tags name."""

    def __init__(self, run: RunDir, **tags: Any) -> None:
        self.run, self.tags = run, tags

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None:
        rest = {k: v for k, v in {**(record or {}), **fields}.items() if k not in self.tags}
        self.run.log({**self.tags, **rest})


@dataclass(frozen=True)
class Session:
    """What a sub-run needs from the runner: the run folder, the device, whether to show
    progress bars (under ``torchrun``: on rank 0 only), and the run's options (those of
    :attr:`Experiment.options` given to :func:`run_experiment`)."""

    run: RunDir
    device: torch.device
    progress: bool
    options: Mapping[str, Any] = field(default_factory=dict)

    def log(self, **tags: Any) -> TaggedLog:
        """A log for the trainer that tags each record (e.g. ``log(model=name, seed=0)``)."""
        return TaggedLog(self.run, **tags)


@dataclass(frozen=True)
class Combine:
    """How ``rcdl reproduce NAME --combine RUN_DIR ... --out DIR`` merges finished runs.

    Attributes:
        runs: ``runs(run_dirs, out, **picks) -> (folder, combined summary)``.
        keep: the settings that pick what to combine, given to ``runs`` by name; any other
            flag that sets a run is refused beside ``--combine``.
        show: print the combined ``results.md``.
    """

    runs: Callable[..., tuple[Path, dict[str, Any]]]
    keep: tuple[str, ...] = ()
    show: bool = False


@dataclass(frozen=True)
class Experiment:
    """An experiment: what the runner and the command line need to know of it.

    Attributes:
        name: the command (``rcdl reproduce NAME``) and the run folders' prefix.
        config: its :class:`rcdl.app.config.ExperimentConfig` subclass.
        help: one line for ``rcdl reproduce --help``.
        description: the command's ``--help`` text.
        sub_runs: ``sub_runs(cfg, data, session)`` yields ``(name, train)`` in training
            order; ``train()`` returns the sub-run's result (a JSON-able dict).
        report: ``report(run, cfg, summary, device)`` writes the tables and figures and
            returns the markdown.
        load_data: ``load_data(cfg, download=)``; ``None`` for an experiment without data
            files (its data is made by ``sub_runs``).
        start: ``start(cfg, data)``, the summary's keys known before training (e.g. the
            data's description, :func:`rcdl.app.cifar.cifar_summary`; default: none).
        finish: ``finish(cfg, summary)`` adds what is computed from all sub-runs (rows,
            verdicts) to the summary.
        switches: extra on/off flags, ``{flag name: (help, settings it sets)}``.
        shards: under ``torchrun`` the growing stores are sharded over the ranks (else a
            multi-process launch is refused).
        options: on/off options of running it that are not settings (not saved in
            ``config.json``, free to change on resume), ``{name: help}``; given to
            :func:`run_experiment` as keywords, they reach the sub-runs as
            :attr:`Session.options` (e.g. ``keep_checkpoints``).
        update: ``update(cfg, summary)`` adds what the sub-runs finished so far give (e.g.
            per-model rows) before every write of ``summary.json``, so an interrupted run's
            summary has them too; the call after the last sub-run comes before ``finish``.
        sessions: the summary lists every session that worked on the run, ``sessions``: its
            environment (:func:`rcdl.app.rundir.environment_info`), ``world_size`` and
            ``seconds``; a resumed run adds one to the saved list. ``seconds`` is then per
            session only.
        finished_in_summary: ``name(result)``, the name of a finished sub-run from its
            result. When given, the finished sub-runs are kept in ``summary.json`` alone
            (no ``finished.json``, the one-epoch comparison's layout since its first runs):
            a resumed run reads them back from the saved summary's ``runs``.
        saved_config: the class of the run folder's ``config.json`` when it is not
            ``config``: a new run saves ``to_saved(cfg)`` and trains with it, and a resumed
            run is given the saved one (the τ sweep saves the one-epoch comparison it runs).
        to_saved: turns a ``config`` into a ``saved_config``.
        combine: if given, ``--combine RUN_DIR ...`` merges finished runs into one table
            (:class:`Combine`).
    """

    name: str
    config: type
    help: str
    description: str
    sub_runs: Callable[[Any, Any, Session], SubRuns]
    report: Callable[[RunDir, Any, dict[str, Any], torch.device], str]
    load_data: Callable[..., Any] | None = None
    start: Callable[[Any, Any], Mapping[str, Any]] | None = None
    finish: Callable[[Any, dict[str, Any]], None] | None = None
    switches: Mapping[str, tuple[str, Mapping[str, Any]]] = field(default_factory=dict)
    shards: bool = False
    options: Mapping[str, str] = field(default_factory=dict)
    update: Callable[[Any, dict[str, Any]], None] | None = None
    sessions: bool = False
    finished_in_summary: Callable[[Mapping[str, Any]], str] | None = None
    saved_config: type | None = None
    to_saved: Callable[[Any], Any] | None = None
    combine: Combine | None = None

    def run(self, cfg: Any, **kw: Any) -> tuple[RunDir, dict[str, Any]]:
        """:func:`run_experiment` of this experiment with ``cfg``."""
        return run_experiment(self, cfg, **kw)


def check_sizes(cfg: Any, data: Any) -> None:
    """A data set passed in must have the sizes the config asks for (``None``: all)."""
    sizes = (len(data.y_train), len(data.y_test))
    asked = (cfg.train_size, cfg.test_size)
    if any(want is not None and want != have for want, have in zip(asked, sizes, strict=True)):
        raise ValueError(f"the data has {sizes[0]} train / {sizes[1]} test images, the config "
                         f"asks for {asked[0]} / {asked[1]}; pass load_data(cfg) or no data")


def run_experiment(
    experiment: Experiment,
    cfg: Any,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    data: Any = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    download: bool = True,
    **options: Any,
) -> tuple[RunDir, dict[str, Any]]:
    """Run ``experiment`` with ``cfg`` into a new run folder, or continue the one at
    ``resume``; write and print the report.

    Args:
        cfg: the settings; to resume, the run's own (:func:`rcdl.app.rundir.read_config`),
            where only ``data_dir`` and ``device`` may differ.
        out: the run folder (default ``runs/<name>-<timestamp>``); it must not already hold
            a run. Not with ``resume``.
        resume: an interrupted run folder: its finished sub-runs are read back, the others
            trained from scratch.
        data: the data already loaded by the experiment's ``load_data`` (default: load it
            here); its sizes must be the config's.
        device: overrides ``cfg.device``.
        progress: show progress bars.
        download: download the data set when no copy is found.
        options: the experiment's :attr:`Experiment.options` (e.g. ``keep_checkpoints``).

    Returns:
        The run folder and its summary (the content of ``summary.json``): ``experiment``,
        ``complete``, what ``start`` gave, ``runs`` (each sub-run's result, in order), what
        ``update`` and ``finish`` added, and ``seconds`` (or ``sessions``). Under
        ``torchrun`` only rank 0 writes the report.
    """
    began = time.perf_counter()
    unknown = sorted(set(options) - set(experiment.options))
    if unknown:
        raise TypeError(f"{experiment.name} has no option {', '.join(unknown)} (its options: "
                        f"{', '.join(experiment.options) or 'none'})")
    if experiment.to_saved is not None and isinstance(cfg, experiment.config):
        cfg = experiment.to_saved(cfg)
    device = resolve_device(cfg.device) if device is None else torch.device(device)
    if experiment.load_data is not None:
        if data is None:
            data = experiment.load_data(cfg, download=download)
        else:
            check_sizes(cfg, data)
    given = {} if experiment.start is None else experiment.start(cfg, data)
    summary: dict[str, Any] = {"experiment": experiment.name, "complete": False, **given,
                               "runs": []}  # fmt: skip
    run = rank0_run(partial(open_run, experiment.name, cfg, out=out, resume=resume,
                            device=device))  # fmt: skip
    if rank_and_world()[0] == 0:
        run.lock()  # one process at a time in a run folder (released when this one ends)
    try:  # from here on a failure says what failed and prints the command that continues
        with run.resumable(f"rcdl reproduce {experiment.name}", getattr(cfg, "data_dir", None)):
            products = run.product_record()
            if resume is not None and products is not None and (
                    products["mode"] != product_mode()) and rank_and_world()[0] == 0:
                print(f"{run.path} was started with half-precision products "
                      f"{products['mode']!r}: it continues with them (this process's default "
                      f"is {product_mode()!r})")
            with products_as(products):
                return _run_in(experiment, cfg, run, summary, resume, data, device, progress,
                               began, options)
    finally:
        if rank_and_world()[0] == 0:
            run.unlock()


def _run_in(experiment: Experiment, cfg: Any, run: RunDir, summary: dict[str, Any],
            resume: str | Path | None, data: Any, device: torch.device, progress: bool,
            began: float, options: Mapping[str, Any]) -> tuple[RunDir, dict[str, Any]]:
    """:func:`run_experiment` once the run folder is open (and locked)."""
    rank, world = rank_and_world()
    if resume is not None and rank == 0:  # what an interrupted invocation may have left
        run.remove_temporaries()
        run.repair_metrics()
    saved = _saved_summary(run) if resume is not None else {}
    clock: dict[str, Any] = summary  # where the seconds of this invocation of the run go
    if experiment.sessions:
        clock = {**environment_info(device), "world_size": world, "seconds": None}
        summary["sessions"] = [*saved.get("sessions", []), clock]
    finished = None  # finished.json (RunDir.sub_run)
    if experiment.finished_in_summary is not None:
        finished = {experiment.finished_in_summary(r): r for r in saved.get("runs", [])}
    session = Session(run, device, progress and rank == 0, dict(options))
    # the session is recorded as it starts: a kill before the first sub-run finishes leaves
    # it listed (and a finished sub-run kept in the summary stays there meanwhile)
    run.write_summary({**summary, "runs": saved.get("runs", []) if finished is not None else []})
    with collecting_new_objects():
        for name, train in experiment.sub_runs(cfg, data, session):
            summary["runs"].append(_sub_run(run, name, train, finished))
            if experiment.update is not None:
                experiment.update(cfg, summary)
            clock["seconds"] = time.perf_counter() - began
            run.write_summary(summary)
            run.record_paths()
            release_memory(device)
    if experiment.finish is not None:  # (update ran after the last sub-run)
        experiment.finish(cfg, summary)
        run.record_paths()
    summary["complete"] = True
    clock["seconds"] = time.perf_counter() - began
    if rank != 0:
        return run, summary
    report = experiment.report(run, cfg, summary, device)
    run.write_summary(summary)
    run.remove_temporaries()
    print("\n" + report, end="")
    print(f"{'Session' if experiment.sessions else 'Run'} time {clock['seconds']:.1f} s. "
          f"Run folder: {run.path}")
    return run, summary


def _saved_summary(run: RunDir) -> dict[str, Any]:
    """The ``summary.json`` an earlier session of ``run`` wrote (``{}`` if none did).

    Raises:
        ValueError: the file is damaged; the message names it and what to do.
    """
    path = run.file(RunDir.SUMMARY)
    if not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is damaged ({e}): it lists the sub-runs finished so far; "
                         "restore it, or move it away to train them again") from e
    if not isinstance(saved, dict):
        raise ValueError(f"{path} is damaged: expected a JSON object")
    return saved


def _sub_run(run: RunDir, name: str, train: Callable[[], Mapping[str, Any]],
             finished: Mapping[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """:meth:`RunDir.sub_run`, or, for an experiment that keeps its finished sub-runs in its
    summary (``finished``, by name), the same with them: read back, or trained now."""
    if finished is None:
        return run.sub_run(name, train)
    if name in finished:
        print(f"{name}: finished in an earlier session, skipped")
        return finished[name]
    return json.loads(json.dumps(to_jsonable(train())))  # its JSON form, as when read back
