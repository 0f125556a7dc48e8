"""Re-run every committed ``--quick`` configuration and compare it with its committed table.

Each configuration in :data:`CONFIGS` is one ``rcdl`` command whose results are committed
under ``results/``, in two files side by side:

- ``<stem>.json``, the expected numbers (machine-readable; written by ``--update``);
- ``<stem>.md``, the table readers see. The part between the ``check-results`` markers is
  rendered from the JSON; prose outside the markers is free text.

For each configuration the checker:

1. checks that the table in the markdown is the one the JSON renders (no run needed);
2. runs the command into the run folder ``<out>/<name>``, adding ``--out``,
   ``--no-progress``, ``--no-download`` and ``--data-dir`` with the folder that holds
   CIFAR-10, found as the ``rcdl`` command finds it (:func:`resolve_data_dir`: the
   checker's ``--data-dir``, then ``$RCDL_DATA``, then the loader's cache folder
   ``~/.cache/rcdl``; docs/data.md). It runs at ``--threads`` threads, by default torch's
   own default on this machine (``$OMP_NUM_THREADS``, else the core count);
3. reads the run's ``summary.json`` and ``config.json`` and compares them with the JSON:
   the run's settings and data must be the same, every committed model must be there (and
   no other), and each number must agree within its tolerance. Timings are recorded and
   shown, never compared. The last lines say how many numbers matched exactly: on another
   machine class, where the tolerances are loose, numbers that all match to every digit
   mean the tight check would have passed too.

The run folders are kept: ``<out>`` is ``--out DIR``, by default
``runs/check-results-<timestamp>/`` in the repository (``runs/`` is git-ignored), and the
checker prints where it is and that it may be deleted. Kept rather than made in a temporary
folder and deleted, because a run folder is the evidence behind the verdict (the run's
``summary.json``, ``metrics.jsonl`` and ``environment.json``): a mismatch can be looked
into, and a good run adopted with ``--update --run-dir``, without running it again, and
a folder that is printed must still be there to be read.

Tolerances depend on the machine (why: docs/results.md). The expected JSON records the
machine class it was made on (:func:`machine_key`: the CPU's widest vector ISA from its
flags, the torch version and the thread count). On one machine class a quick run is
deterministic, so when the class matches the comparison is tight (:data:`TIGHT`: accuracy
±0.1 point, one of 1 000 test images; losses 0.1 % relative). Across CPU types the same
command has moved an accuracy by up to 1.4 points and a loss by up to 16.3 % (gws: 28.7 % /
2.481, 29.30 / 2.483 and 28.80 / 2.361 on three machines; gauge: 31.1 / 2.212 and 29.70 /
2.254 on two, and a loss of 2.477 against 2.129 on a third), so otherwise it is loose
(:data:`LOOSE`: ±2.5 points, 25 % relative) and the checker says so: only large changes
are caught there. Entry counts, store bytes, parameter
counts and seeds are always exact.

Usage (from the repository root; ``make check-results`` runs the first line)::

    python tools/check_results.py                 # check everything; exit 1 on a mismatch
    python tools/check_results.py --list          # the configurations and their commands
    python tools/check_results.py --only cifar10-1epoch --data-dir DIR
    python tools/check_results.py --static        # tables against their JSON only, no runs
    python tools/check_results.py --update        # re-run, rewrite the JSON and the tables
    python tools/check_results.py --only NAME --run-dir RUN   # use a finished run folder
    python tools/check_results.py --threads 1 --out DIR       # one thread, runs in DIR

Exit status: 0 when everything matches (or ``--update`` wrote its files), 1 on a mismatch
or a failed run, 2 on a usage error (unknown name, no CIFAR-10 found, a taken ``--out``).

It is a script beside the other measurement scripts, not a module of ``rcdl``: it depends
on this repository's layout (``results/``, ``runs/``). It runs the ``rcdl`` command line in
a subprocess, so it checks the installed command exactly as a reader would run it, and
takes from the package only the machine class (:mod:`rcdl.app.rundir`) and the data
search (:mod:`rcdl.app.cifar`), so that both are the command's own.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from rcdl.app import rundir
from rcdl.app.cifar import ENV_VAR as DATA_ENV
from rcdl.app.cifar import cache_dir, candidate_paths, find_cifar

REPO = Path(__file__).resolve().parent.parent
RUNS = Path("runs")  # the default parent of the run folders, in the repository
SCHEMA = 1
BEGIN = "<!-- check-results:begin"
END = "<!-- check-results:end -->"


# --------------------------------------------------------------------------- tolerances


@dataclass(frozen=True)
class Tolerance:
    """``|now − committed| <= max(abs, rel · |committed|)``; both 0 means exactly equal."""

    abs: float = 0.0
    rel: float = 0.0

    def allows(self, committed: Any, now: Any) -> bool:
        exact = self.abs == 0 and self.rel == 0
        if exact or not (_is_number(committed) and _is_number(now)):
            return committed == now
        if not (math.isfinite(committed) and math.isfinite(now)):
            return committed == now
        bound = max(self.abs, self.rel * abs(committed))
        return abs(now - committed) <= bound * (1 + 1e-9)  # the bound itself is allowed

    def describe(self) -> str:
        parts = ([f"±{self.abs:g}"] if self.abs else []) + (
            [f"±{100 * self.rel:g} % rel."] if self.rel else [])
        return " or ".join(parts) if parts else "exact"


EXACT = Tolerance()
# The numbers compared, per model row, and how far they may move (docs/results.md), when the
# check runs on the machine class the expected JSON was made on. The run is then
# deterministic (same numbers every time), so these only leave room for what the class does
# not pin down (another CPU model or BLAS code path of the same ISA flipping a near-tied test
# image), and catch any real change: one test image in 1 000, a loss in its 3rd digit.
TIGHT: dict[str, Tolerance] = {
    "seeds": EXACT,
    "test_acc_pct": Tolerance(abs=0.1),  # points; 1 of 1 000 test images
    "test_acc_pct_sd": Tolerance(abs=0.1),
    "test_loss": Tolerance(rel=1e-3),
    "test_loss_sd": Tolerance(abs=1e-3),
    "test_mse": Tolerance(rel=1e-3),  # for regression configurations (none committed yet)
    "entries": EXACT,
    "store_bytes": EXACT,
    "parameters": EXACT,
}
# On another machine class (or an unknown one). Sized from the same quick runs on different
# CPUs (docs/results.md): gws 28.7 % / 2.481, 29.30 / 2.483, 28.80 / 2.361 on three machines,
# gauge 31.1 / 2.212 and 29.70 / 2.254 on two, i.e. accuracy within 1.4 points; the gauge
# model's loss 2.477 on an avx512_bf16 CPU without AMX against 2.129 on the AMX class, where
# the same code reproduces 2.129 exactly: +16.3 %. About 1.5x that margin.
LOOSE: dict[str, Tolerance] = TIGHT | {
    "test_acc_pct": Tolerance(abs=2.5),
    "test_acc_pct_sd": Tolerance(abs=2.5),
    "test_loss": Tolerance(rel=0.25),
    "test_loss_sd": Tolerance(abs=0.25),
    "test_mse": Tolerance(rel=0.25),
}
# Kept beside the compared numbers to render the table; never compared.
INFO = ("possible_entries", "train_seconds", "eval_seconds", "paper")
# Run settings that may differ between the committed run and a check.
PER_RUN_SETTINGS = ("data_dir", "device", "checkpoint", "checkpoint_every")
# Flags the checker adds to a configuration's command (with their values, if any).
ADDED_FLAGS = {"--data-dir": 1, "--out": 1, "--no-progress": 0, "--no-download": 0,
               "--threads": 1}


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


# --------------------------------------------------------------------------- machine class


# The machine class (CPU ISA, torch, threads) is rundir's: one description of a machine for
# run folders and for this check.
X86, ISA_LEVELS = rundir.X86, rundir.ISA_LEVELS
cpu_isa, cpu_model, machine_key = rundir.cpu_isa, rundir.cpu_model, rundir.machine_key


def same_machine(committed: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether two expected files were made on one machine class (so tight tolerances)."""
    key = (committed.get("made") or {}).get("machine_key")
    return key is not None and key == (now.get("made") or {}).get("machine_key")


# --------------------------------------------------------------------------- configurations


def cifar10_rows(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The per-model rows of a ``cifar10-1epoch`` run's ``summary.json`` (its ``models``),
    as the expected file keeps them: compared numbers, then the table's other cells."""
    rows = []
    for r in summary.get("models") or []:
        row = {"model": r["model"]}
        row |= {k: r.get(k) for k in TIGHT if k != "test_mse"}
        row |= {k: r.get(k) for k in INFO if k != "paper"}
        row["paper"] = _paper(r.get("paper_test_acc_pct"), r.get("paper_seeds_acc_pct"))
        rows.append(row)
    return rows


def _paper(acc: float | None, seeds: Sequence[float] | None) -> str:
    """The paper's figure as the table shows it, e.g. ``59.18 %``, ``46.3 ± 2.0 % (seeds)``."""
    if seeds:
        mean, sd = seeds
        return (f"{mean:.1f} ± {sd:.1f} % (seeds)" if acc is None
                else f"{acc:.2f} % (seeds: {mean:.1f} ± {sd:.1f})")
    return "—" if acc is None else f"{acc:.2f} %"


@dataclass(frozen=True)
class QuickConfig:
    """One committed quick configuration.

    Args:
        name: what ``--only`` takes.
        args: the ``rcdl`` arguments, without ``--data-dir``, ``--out`` and ``--no-progress``
            (the checker adds them; they do not change the numbers).
        expected: the expected-numbers JSON, relative to the repository root.
        table: the markdown holding the rendered table, relative to the repository root.
        title: the markdown's heading when ``--update`` writes it afresh.
        note: prose below the generated block when ``--update`` writes the file afresh.
        rows: turns the run's ``summary.json`` into the model rows that are compared.
        needs_data: the command reads CIFAR-10 (``--data-dir`` is passed).
    """

    name: str
    args: tuple[str, ...]
    expected: str
    table: str
    title: str
    note: str
    rows: Callable[[Mapping[str, Any]], list[dict[str, Any]]] = cifar10_rows
    needs_data: bool = True

    def command(self, data_dir: str | None = None) -> str:
        """The command as a reader types it (with ``--data-dir`` when ``data_dir`` is given;
        without, ``rcdl`` looks in ``$RCDL_DATA`` and its cache folder)."""
        extra = ("--data-dir", data_dir) if self.needs_data and data_dir else ()
        return shlex.join(("rcdl", *self.args, *extra))


CONFIGS: tuple[QuickConfig, ...] = (
    QuickConfig(
        name="cifar10-1epoch",
        args=("reproduce", "cifar10-1epoch", "--quick", "--models", "gws", "gauge", "rbf",
              "hybrid-tau50", "mlp-sgd", "mlp-adam", "mlp-adamw", "mlp-rmsprop",
              "psoftmax-5000"),
        expected="results/cifar10/1epoch/quick.json",
        table="results/cifar10/1epoch/quick.md",
        title="One-epoch CIFAR-10, quick configuration (2 000 train / 1 000 test images)",
        note=(
            "125 steps of batch 16 on a random 2 000-image subset of the JPEG-decoded copy of "
            "CIFAR-10 (lossy, about 30 dB PSNR from the original pixels; docs/data.md), "
            "evaluation on 1 000 random test images every 50 steps; the full "
            "protocol is docs/reference.md §6. At this size the numbers only show that every "
            "model trains through the command; they are not comparable with the paper's "
            "full-data figures (given for orientation). `psoftmax-5000` is still at chance "
            "after 125 steps (test loss ln 10 ≈ 2.303): its row shows that it runs, not that "
            "it learns. `hybrid-tau50` is the paper's hybrid (τ = 50, the model `hybrid`).\n\n"
            "`mlp-muon` is not in this configuration. `torch.optim.Muon`'s Newton–Schulz "
            "orthogonalisation of eight 3072 × 3072 updates costs about 7 TFLOP per step, "
            "over a minute per step on the 2-core CPU by that count.\n\n"
            "These numbers belong to the machine class above. On another CPU type the same "
            "command gives other numbers with no code change (accuracy up to 1.4 points, "
            "loss up to 5 % apart so far; docs/results.md). `make check-results` re-runs the "
            "command and compares it with `quick.json`: tightly on this machine class, "
            "loosely elsewhere. Timings are this run's and are not compared."
        ),
    ),
)


# --------------------------------------------------------------------------- expected numbers


def expected_from_summary(config: QuickConfig, summary: Mapping[str, Any],
                          run_config: Mapping[str, Any] | None = None,
                          environment: Mapping[str, Any] | None = None,
                          threads: int | None = None, isa: str | None = None,
                          cpu: str | None = None) -> dict[str, Any]:
    """The content of the expected JSON for a finished run (its summary, config.json and
    environment.json), made on a CPU of class ``isa`` (:func:`cpu_isa`) and model ``cpu``."""
    environment = environment or {}
    threads = threads if threads is not None else environment.get("num_threads")
    sessions = summary.get("sessions") or [{}]
    data = summary.get("data") or {}
    revision = environment.get("git_revision")
    recorded = environment.get("command")
    return {
        "schema": SCHEMA,
        "config": config.name,
        "args": list(config.args) if not recorded else command_args(recorded),
        "command": config.command(),
        "made": {
            "date": (environment.get("started") or _dt.date.today().isoformat())[:10],
            "git_revision": revision[:10] if revision else None,
            "git_dirty": environment.get("git_dirty"),
            "platform": environment.get("platform"),
            "cpu": cpu,
            "cpu_count": environment.get("cpu_count"),
            "isa": isa,
            "threads": threads,
            "torch": environment.get("torch"),
            "machine_key": machine_key(isa, environment.get("torch"), threads),
            "seconds": sum(s.get("seconds") or 0 for s in sessions) or None,
        },
        "complete": summary.get("complete"),
        "run_config": {k: v for k, v in (run_config or {}).items()
                       if k not in PER_RUN_SETTINGS},
        "data": {"n_train": data.get("n_train"), "n_test": data.get("n_test"),
                 "kind": data_kind(data.get("provenance")),
                 "provenance": data.get("provenance")},
        "models": config.rows(summary),
    }


def command_args(argv: Sequence[str]) -> list[str]:
    """The configuration's arguments in a run's recorded ``sys.argv``: without the program
    and the flags the checker adds (:data:`ADDED_FLAGS`)."""
    out, rest = [], list(argv[1:])
    while rest:
        arg = rest.pop(0)
        if arg in ADDED_FLAGS:
            del rest[:ADDED_FLAGS[arg]]
        elif not any(arg.startswith(f + "=") for f, n in ADDED_FLAGS.items() if n):
            out.append(arg)
    return out


def data_kind(provenance: str | None) -> str | None:
    """What data a run read, from its summary's provenance sentence: the part before the
    first parenthesis, e.g. ``the JPEG-decoded copy of CIFAR-10`` or ``the official
    CIFAR-10 files`` (the rest of the sentence is commentary that may be reworded)."""
    return None if provenance is None else provenance.split("(")[0].split(";")[0].strip()


def expected_from_run(config: QuickConfig, run_dir: Path,
                      threads: int | None = None) -> dict[str, Any]:
    """:func:`expected_from_summary` of the run folder ``run_dir``, taken to be made on this
    machine (a run's environment.json records no CPU flags)."""
    summary = _read_json(run_dir / "summary.json")
    run_config = _read_json(run_dir / "config.json", missing_ok=True)
    environment = _read_json(run_dir / "environment.json", missing_ok=True)
    return expected_from_summary(config, summary, run_config, environment, threads,
                                 isa=cpu_isa(), cpu=cpu_model())


def _read_json(path: Path, missing_ok: bool = False) -> Any:
    if missing_ok and not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckError(f"{path}: not found (the run wrote no summary: did it fail?)") \
            from None
    except json.JSONDecodeError as e:
        raise CheckError(f"{path}: not valid JSON ({e})") from None


def write_expected(expected: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(expected, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- comparing


@dataclass(frozen=True)
class Mismatch:
    """One disagreement between the committed numbers and a new run (or a table)."""

    config: str
    model: str
    what: str
    committed: Any = None
    now: Any = None
    tolerance: str = ""


def compare(committed: Mapping[str, Any], now: Mapping[str, Any],
            tolerances: Mapping[str, Tolerance] | None = None) -> list[Mismatch]:
    """Every disagreement between the committed expected numbers and a new run's (both in
    the shape :func:`expected_from_summary` gives). A committed value of ``None`` is not
    compared (e.g. a cell the committed table never had). ``tolerances`` default to
    :data:`TIGHT` when both were made on one machine class (:func:`same_machine`), else
    :data:`LOOSE`."""
    if tolerances is None:
        tolerances = TIGHT if same_machine(committed, now) else LOOSE
    name = committed.get("config", "?")
    out: list[Mismatch] = []
    if list(committed.get("args") or []) != list(now.get("args") or []):
        out.append(Mismatch(name, "—", "command", _shell(committed.get("args")),
                            _shell(now.get("args"))))
    if now.get("complete") is False:
        out.append(Mismatch(name, "—", "run finished", committed.get("complete", True), False))
    mine, theirs = committed.get("run_config") or {}, now.get("run_config") or {}
    for key, value in mine.items():
        if key not in PER_RUN_SETTINGS and theirs.get(key) != value:
            out.append(Mismatch(name, "—", f"setting {key}", value, theirs.get(key)))
    mine, theirs = committed.get("data") or {}, now.get("data") or {}
    for key, value in mine.items():
        if key != "provenance" and value is not None and theirs.get(key) != value:
            out.append(Mismatch(name, "—", f"data {key}", value, theirs.get(key)))
    rows = {r["model"]: r for r in now.get("models") or []}
    expected_models = [r["model"] for r in committed.get("models") or []]
    for model in expected_models:
        if model not in rows:
            out.append(Mismatch(name, model, "model missing from the new run", "row", None))
    for model, key, value, new, tolerance in _numbers(committed, now, tolerances):
        if not tolerance.allows(value, new):
            out.append(Mismatch(name, model, key, value, new, tolerance.describe()))
    for model in rows:
        if model not in expected_models:
            out.append(Mismatch(name, model, "model not in the committed table", None, "row"))
    return out


def _numbers(committed: Mapping[str, Any], now: Mapping[str, Any],
             tolerances: Mapping[str, Tolerance]
             ) -> Iterator[tuple[str, str, Any, Any, Tolerance]]:
    """``(model, key, committed value, new value, tolerance)`` for every number of the model
    rows that :func:`compare` compares: the committed rows also in the new run, the keys of
    ``tolerances`` whose committed value is not ``None``."""
    rows = {r["model"]: r for r in now.get("models") or []}
    for row in committed.get("models") or []:
        if row["model"] not in rows:
            continue
        for key, tolerance in tolerances.items():
            if row.get(key) is not None:
                yield row["model"], key, row[key], rows[row["model"]].get(key), tolerance


@dataclass(frozen=True)
class Tally:
    """How the compared numbers of one or more configurations agreed: ``exact`` of the
    ``compared`` ones matched to every digit, ``within`` more within their tolerance."""

    compared: int = 0
    exact: int = 0
    within: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.compared + other.compared, self.exact + other.exact,
                     self.within + other.within)

    def describe(self) -> str:
        """E.g. ``all 58 numbers matched exactly``, ``40 of 58 numbers matched exactly, 18
        within tolerance``, ``... 2 did not``."""
        if self.compared and self.exact == self.compared:
            return f"all {self.compared} numbers matched exactly"
        text = f"{self.exact} of {self.compared} numbers matched exactly, {self.within} within " \
            "tolerance"
        failed = self.compared - self.exact - self.within
        return text + (f", {failed} did not" if failed else "")


def tally(committed: Mapping[str, Any], now: Mapping[str, Any],
          tolerances: Mapping[str, Tolerance] | None = None) -> Tally:
    """The numbers :func:`compare` compares (same default tolerances), counted by how they
    agreed: exactly equal, within tolerance, or not."""
    if tolerances is None:
        tolerances = TIGHT if same_machine(committed, now) else LOOSE
    compared = exact = within = 0
    for _, _, value, new, tolerance in _numbers(committed, now, tolerances):
        compared += 1
        if value == new:
            exact += 1
        elif tolerance.allows(value, new):
            within += 1
    return Tally(compared, exact, within)


def _describe(tolerances: Mapping[str, Tolerance]) -> str:
    return (f"accuracy {tolerances['test_acc_pct'].describe()} points, "
            f"losses {tolerances['test_loss'].describe()}")


def machine_note(committed: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """What the check can catch here: one line when the machine class matches, a warning
    when it does not."""
    name = committed.get("config", "?")
    mine = (committed.get("made") or {}).get("machine_key")
    here = (now.get("made") or {}).get("machine_key") or "unknown"
    if same_machine(committed, now):
        return (f"{name}: same machine class as {name}'s expected JSON ({here}): the run is "
                f"deterministic here, tight tolerances ({_describe(TIGHT)}).")
    made = "a machine class it does not record" if mine is None else f"class {mine}"
    then, here_made = committed.get("made") or {}, now.get("made") or {}
    if mine is None:
        tight = ""
    elif (then.get("isa"), then.get("torch")) == (here_made.get("isa"), here_made.get("torch")) \
            and then.get("threads") is not None:  # only the thread count differs
        tight = f"For a tight check, run it with --threads {then['threads']}. "
    else:
        tight = f"For a tight check, run it on a machine of class {mine}. "
    return (f"{name}: MACHINE DIFFERS. The expected JSON was made on {made}; this check "
            f"runs on {here}. Quick numbers move between CPU types, so it compares with "
            f"loose tolerances ({_describe(LOOSE)}) and catches only large changes. {tight}"
            f"To make a class the reference, run `--update` on a machine of that class once "
            f"the code is known good, and commit (docs/results.md).")


def _shell(args: Sequence[str] | None) -> str | None:
    return None if args is None else shlex.join(args)


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.6g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, list):
        return " ".join(map(str, value))
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def format_mismatches(mismatches: Sequence[Mismatch]) -> str:
    """A fixed-width table of the mismatches, with the difference where both are numbers."""
    header = ("config", "model", "what", "committed", "now", "difference", "tolerance")
    lines = []
    for m in mismatches:
        diff = ""
        if _is_number(m.committed) and _is_number(m.now):
            diff = f"{m.now - m.committed:+.4g}"
            if m.committed and "rel" in m.tolerance:
                diff += f" ({100 * (m.now - m.committed) / abs(m.committed):+.1f} %)"
        lines.append((m.config, m.model, m.what, _fmt(m.committed), _fmt(m.now), diff,
                      m.tolerance))
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines, strict=True)]
    rule = "  ".join("-" * w for w in widths)
    rows = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in (header, *lines)]
    return "\n".join([rows[0], rule, *rows[1:]])


# --------------------------------------------------------------------------- the markdown


def _wrap_command(command: str, width: int = 88) -> str:
    """The command on indented lines of at most ``width`` characters, ``\\``-continued."""
    lines, line = [], "    "
    for word in command.split(" "):
        if len(line) + len(word) + 2 > width and line.strip():
            lines.append(line.rstrip() + " \\")
            line = "        "
        line += word + " "
    lines.append(line.rstrip())
    return "\n".join(lines)


def _bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _pm(mean: float | None, sd: float | None, digits: int) -> str:
    if mean is None:
        return "—"
    return f"{mean:.{digits}f}" + ("" if sd is None else f" ± {sd:.{digits}f}")


def render_block(config: QuickConfig, expected: Mapping[str, Any]) -> str:
    """The generated part of the markdown: how the run was made, then its table."""
    made = expected.get("made") or {}
    rev = made.get("git_revision") or "?"
    where = ", ".join(x for x in (
        made.get("cpu"),
        f"{made['cpu_count']} CPUs" if made.get("cpu_count") else None,
        f"{made['threads']} thread{'s' if made['threads'] != 1 else ''}"
        if made.get("threads") else None,
        f"torch {made['torch']}" if made.get("torch") else None,
        f"git {rev}{' + uncommitted changes' if made.get('git_dirty') else ''}",
    ) if x)
    data = expected.get("data") or {}
    key = made.get("machine_key")
    lines = [
        f"{BEGIN} generated by tools/check_results.py --update from "
        f"{Path(config.expected).name}; edit outside the markers only -->",
        f"Command (run {made.get('date') or '?'}; {where}):",
        "",
        _wrap_command(expected.get("command") or config.command()),
        "",
        f"Data: {data.get('provenance') or data.get('kind') or '?'}.",
        "",
        ("Machine class: not recorded, so `make check-results` compares loosely "
         "everywhere." if key is None else
         f"Machine class: `{key}`. `make check-results` compares tightly on this class "
         f"and loosely elsewhere (docs/results.md)."),
        "",
        "| model | test acc. % | test loss | entries | store | train s | eval s "
        "| paper, full data |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in expected.get("models") or []:
        entries = "—" if r.get("entries") is None else f"{r['entries']:,}"
        possible = r.get("possible_entries")
        if possible and r.get("entries") is not None and r["entries"] < possible:
            entries += f" ({100 * r['entries'] / possible:.1f} %)"
        seconds = ["—" if r.get(k) is None else f"{r[k]:.1f}"
                   for k in ("train_seconds", "eval_seconds")]
        lines.append(
            f"| {r['model']} | {_pm(r.get('test_acc_pct'), r.get('test_acc_pct_sd'), 2)} "
            f"| {_pm(r.get('test_loss'), r.get('test_loss_sd'), 3)} | {entries} "
            f"| {_bytes(r.get('store_bytes'))} | {seconds[0]} | {seconds[1]} "
            f"| {r.get('paper') or '—'} |"
        )
    lines.append(END)
    return "\n".join(lines)


def _block_span(text: str) -> tuple[int, int] | None:
    start = text.find(BEGIN)
    end = text.find(END, start + 1) if start >= 0 else -1
    return None if start < 0 or end < 0 else (start, end + len(END))


def render_markdown(config: QuickConfig, expected: Mapping[str, Any],
                    old: str | None = None) -> str:
    """The markdown file: ``old`` with its generated block replaced, or (no block in it)
    a new file with the title, the block and the configuration's note."""
    block = render_block(config, expected)
    span = None if old is None else _block_span(old)
    if span is not None:
        return old[:span[0]] + block + old[span[1]:]
    return f"# {config.title}\n\n{block}\n\n{config.note}\n"


def check_table(config: QuickConfig, expected: Mapping[str, Any],
                text: str | None) -> list[Mismatch]:
    """The committed markdown must hold the block the expected JSON renders."""
    if text is None:
        return [Mismatch(config.name, "—", f"{config.table} missing", "file", None)]
    span = _block_span(text)
    if span is None:
        return [Mismatch(config.name, "—", f"{config.table}: no generated table (markers)",
                         "generated table", "hand-written")]
    if text[span[0]:span[1]] != render_block(config, expected):
        return [Mismatch(config.name, "—", f"{config.table} differs from "
                         f"{Path(config.expected).name}", "rendered table", "edited table")]
    return []


# --------------------------------------------------------------------------- running


class CheckError(Exception):
    """A problem that stops the check before any comparison (exit status 2)."""


def _data_folders(given: str | None) -> list[tuple[Path, str]]:
    """The folders the loader searches for CIFAR-10 (:func:`rcdl.app.cifar.candidate_paths`,
    in its order), each with where it came from."""
    names = {cache_dir(): "the loader's cache folder"}
    if os.environ.get(DATA_ENV):
        names[Path(os.environ[DATA_ENV]).expanduser()] = f"${DATA_ENV}"
    if given is not None:
        names[Path(given).expanduser()] = "--data-dir"  # the first of a folder named twice
    folders = dict.fromkeys(path.parent for path in candidate_paths("cifar10", given))
    return [(folder, names.get(folder, "?")) for folder in folders]


def resolve_data_dir(given: str | None) -> Path:
    """The folder holding CIFAR-10, found as the ``rcdl`` command finds it
    (:func:`rcdl.app.cifar.find_cifar`): ``--data-dir``, then ``$RCDL_DATA``, then the
    loader's cache folder. An error names every folder searched when none holds a copy;
    the checker never downloads (a run it compares reads what is there)."""
    names = [path.name + ("/" if i == 1 else "")
             for i, path in enumerate(candidate_paths("cifar10", given)[:3])]
    wanted = f"{', '.join(names[:-1])} or {names[-1]}"
    if given is not None and not Path(given).expanduser().is_dir():
        raise CheckError(f"--data-dir {given} is not a folder: give the folder that holds "
                         f"{wanted} (docs/data.md)")
    found = find_cifar("cifar10", given)
    if found is not None:
        return found.parent.resolve()
    folders = _data_folders(given)
    where = [f"{folder} ({how})" for folder, how in folders]
    searched = where[0] if len(where) == 1 else f"{', '.join(where[:-1])} or {where[-1]}"
    unset = "" if os.environ.get(DATA_ENV) else f"; ${DATA_ENV} is not set"
    raise CheckError(f"CIFAR-10 not found: no {wanted} in {searched}{unset}. Give "
                     f"--data-dir DIR or set {DATA_ENV}=DIR, where DIR holds one of them, or "
                     f"put the official archive {names[-1]} in {cache_dir()} (docs/data.md). "
                     "The checker never downloads.")


def data_source(given: str | None, data_dir: Path) -> str:
    """Where :func:`resolve_data_dir` found ``data_dir``: ``--data-dir``, ``$RCDL_DATA`` or
    the loader's cache folder."""
    return next((how for folder, how in _data_folders(given)
                 if folder.expanduser().resolve() == data_dir), "?")


def committed_time(expected: Mapping[str, Any] | None) -> str | None:
    """How long the committed run took, with the machine it ran on (from the expected
    JSON's ``made``), e.g. ``6.1 min on Intel(R) Xeon(R) Processor, 2 CPUs, 1 thread``."""
    made = (expected or {}).get("made") or {}
    if not made.get("seconds"):
        return None
    machine = ", ".join(x for x in (
        made.get("cpu"),
        f"{made['cpu_count']} CPUs" if made.get("cpu_count") else None,
        rundir.count(made["threads"], "thread") if made.get("threads") else None,
    ) if x) or "a machine not recorded"
    return f"{made['seconds'] / 60:.1f} min on {machine}"


def run_config(config: QuickConfig, out: Path, data_dir: Path | None, threads: int,
               expected: Mapping[str, Any] | None = None) -> int:
    """Run the configuration's command into ``out`` at ``threads`` threads; returns its exit
    status. ``expected`` (the committed JSON) gives the run time it took when made."""
    args = [*config.args, "--no-progress", "--out", str(out)]
    if config.needs_data:
        args += ["--data-dir", str(data_dir), "--no-download"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    took = committed_time(expected)
    print(f"== {config.name}: {config.command(str(data_dir) if data_dir else None)} "
          f"({rundir.count(threads, 'thread')}"
          f"{f'; the committed run took {took}' if took else ''})", flush=True)
    return subprocess.run([sys.executable, "-m", "rcdl", *args], env=env, cwd=REPO).returncode


def machine_line(threads: int, given: bool) -> str:
    """This machine and the thread count the runs use, for the check's first line."""
    key = machine_key(cpu_isa(), torch.__version__, threads)
    how = "--threads" if given else "torch's default here; --threads N to change it"
    return (f"Machine: {cpu_model()}, {rundir.count(os.cpu_count(), 'CPU')}, "
            f"{rundir.count(threads, 'thread')} ({how}); machine class {key}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Re-run every committed --quick configuration under results/ and compare "
        "its numbers with the committed expected JSON and table (docs/results.md).")
    p.add_argument("--only", nargs="+", metavar="NAME", help="check only these (see --list)")
    p.add_argument("--list", action="store_true", help="list the configurations and stop")
    p.add_argument("--update", action="store_true", help="re-run and rewrite the expected "
                   "JSON and the table's generated block from the new run")
    p.add_argument("--static", action="store_true", help="only check that each table is the "
                   "one its JSON renders (no runs, no data)")
    p.add_argument("--data-dir", metavar="DIR", help="the folder holding CIFAR-10; searched "
                   f"first, then ${DATA_ENV}, then the loader's cache folder {cache_dir()}, as "
                   "rcdl does (docs/data.md)")
    p.add_argument("--run-dir", metavar="RUN", help="compare (or --update from) this finished "
                   "run folder instead of running; needs exactly one --only NAME")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads of the runs "
                   "(OMP_NUM_THREADS; default: torch's default here, from $OMP_NUM_THREADS or "
                   "the core count). The thread count is part of the machine class: the "
                   "check is tight only at the expected JSON's count")
    p.add_argument("--out", metavar="DIR", help="the folder for the run folders, one per "
                   "configuration (DIR/NAME), kept afterwards (default: "
                   f"{RUNS}/check-results-<timestamp> in the repository)")
    # the run folders are always kept now; accepted so that older command lines still run
    p.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    return p


def _list(configs: Sequence[QuickConfig], root: Path) -> None:
    for c in configs:
        state = "committed" if (root / c.expected).is_file() else "missing: run --update"
        expected = _read_json(root / c.expected, missing_ok=True)
        took = committed_time(expected) or "not recorded"
        print(f"{c.name}\n    command:  {c.command()}\n    expected: {c.expected} ({state})"
              f"\n    table:    {c.table}\n    time:     {took} (the committed run)")


def main(argv: Sequence[str] | None = None, configs: Sequence[QuickConfig] = CONFIGS,
         root: Path = REPO) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args, configs, root)
    except CheckError as e:
        print(f"check_results: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace, configs: Sequence[QuickConfig], root: Path) -> int:
    names = [c.name for c in configs]
    unknown = [n for n in args.only or () if n not in names]
    if unknown:
        raise CheckError(f"unknown configuration {', '.join(unknown)}; known: "
                         f"{', '.join(names)}")
    chosen = [c for c in configs if not args.only or c.name in args.only]
    if args.list:
        _list(chosen, root)
        return 0
    threads_given = args.threads is not None
    threads = args.threads if threads_given else torch.get_num_threads()
    if threads < 1:
        raise CheckError(f"--threads must be >= 1, got {threads}")
    if args.run_dir and len(chosen) != 1:
        raise CheckError("--run-dir compares one run folder: give --only NAME with it")
    if args.static and (args.update or args.run_dir):
        raise CheckError("--static runs nothing; drop --update and --run-dir")

    committed: dict[str, dict[str, Any] | None] = {}
    problems: list[Mismatch] = []
    loose: list[str] = []
    for c in chosen:
        path = root / c.expected
        committed[c.name] = _read_json(path) if path.is_file() else None
        if committed[c.name] is None and not args.update:
            problems.append(Mismatch(c.name, "—", f"{c.expected} missing (run --update)"))
        elif committed[c.name] is not None and not args.update:
            table = root / c.table
            text = table.read_text(encoding="utf-8") if table.is_file() else None
            problems += check_table(c, committed[c.name], text)
    if args.static:
        return _report(problems, len(chosen), ran=False)
    missing_expected = {m.config for m in problems if m.what.endswith("(run --update)")}
    to_run = [c for c in chosen if c.name not in missing_expected]  # else nothing to compare
    needs_data = any(c.needs_data for c in to_run) and not args.run_dir
    data_dir = resolve_data_dir(args.data_dir) if needs_data else None
    runs = None  # the parent of this check's run folders, when it runs anything
    if to_run and not args.run_dir:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        runs = Path(args.out).resolve() if args.out else root / RUNS / f"check-results-{stamp}"
        if runs.exists() and not runs.is_dir():
            raise CheckError(f"--out {runs} is a file, not a folder: give --out a new folder "
                             "for the run folders")
        taken = [str(runs / c.name) for c in to_run if (runs / c.name).exists()]
        if taken:
            raise CheckError(f"--out {runs} already holds {', '.join(taken)}: choose another "
                             "--out (or delete those folders)")
        print(machine_line(threads, threads_given), flush=True)
        if data_dir is not None:
            print(f"Data: CIFAR-10 from {data_dir} ({data_source(args.data_dir, data_dir)})",
                  flush=True)
        print(f"Run folders: {runs}/NAME (kept afterwards)", flush=True)

    tallies: dict[str, Tally] = {}
    for c in to_run:
        out = Path(args.run_dir) if args.run_dir else cast(Path, runs) / c.name
        if not args.run_dir:
            status = run_config(c, out, data_dir, threads, committed[c.name])
            if status != 0:
                problems.append(Mismatch(c.name, "—", f"run failed (exit status {status}); "
                                         f"folder {out}"))
                continue
        now = expected_from_run(c, out, None if args.run_dir else threads)
        if args.run_dir and now["args"] != list(c.args):
            raise CheckError(f"{out} was made by `rcdl {shlex.join(now['args'])}`, not by "
                             f"{c.name}'s `{c.command(None)}`")
        old_json = committed[c.name]
        if args.update:  # list every move beyond float noise on one machine class
            found = [] if old_json is None else compare(old_json, now, TIGHT)
        else:
            assert old_json is not None  # a configuration without one is not run
            print(machine_note(old_json, now), flush=True)
            if not same_machine(old_json, now):
                loose.append(c.name)
            found = compare(old_json, now)
        if args.update and now.get("complete") is False:
            problems.append(Mismatch(c.name, "—", f"run did not finish; nothing written; "
                                     f"folder {out}"))
            continue
        if args.update:
            write_expected(now, root / c.expected)
            table = root / c.table
            old = table.read_text(encoding="utf-8") if table.is_file() else None
            table.write_text(render_markdown(c, now, old), encoding="utf-8")
            was = None if old_json is None else (old_json.get("made") or {}).get("machine_key")
            print(f"{c.name}: wrote {c.expected} and {c.table}; machine class "
                  f"{now['made']['machine_key'] or 'unknown'}"
                  + ("" if old_json is None or was == now["made"]["machine_key"] else
                     f" (was {was or 'not recorded'})")
                  + (f"; {len(found)} number(s) moved beyond the tight tolerances:\n"
                     f"{format_mismatches(found)}" if found else "; no number moved"))
        else:
            problems += found
            tallies[c.name] = tally(cast(dict[str, Any], old_json), now)
    if runs is not None and runs.is_dir():
        print(f"\nRun folders kept in {runs} (one per configuration); delete the folder "
              "when you no longer need it.")
    if args.update:
        return 1 if problems else 0
    return _report(problems, len(chosen), ran=True, loose=loose, tallies=tallies)


def _report(problems: Sequence[Mismatch], count: int, ran: bool,
            loose: Sequence[str] = (), tallies: Mapping[str, Tally] | None = None) -> int:
    tallies = tallies or {}
    total = sum(tallies.values(), Tally())
    loose_total = sum((t for name, t in tallies.items() if name in loose), Tally())
    if problems:
        print(f"\n{len(problems)} mismatch(es) against the committed results:\n")
        print(format_mismatches(problems))
        if total.compared:
            print(f"\nOf the numbers compared: {total.describe()}.")
        print("\nIf the change is intended, regenerate with "
              "`python tools/check_results.py --update [--only NAME]` (docs/results.md).")
        if loose:
            print(f"Compared loosely, on another machine class than the expected JSON's: "
                  f"{', '.join(loose)}.")
        return 1
    what = "re-run and match" if ran else "tables match their expected JSON"
    numbers = f": {total.describe()}" if total.compared else ""
    print(f"\nAll {count} committed quick configuration(s) {what}{numbers}.")
    if loose and loose_total.compared and loose_total.exact == loose_total.compared:
        print(f"{', '.join(loose)} compared with loose tolerances, as this machine's class "
              f"differs from the one recorded, yet {loose_total.describe()}: the tight "
              "tolerances hold too.")
    elif loose:
        print(f"Only loosely for {', '.join(loose)}: this machine's class differs from the "
              f"one recorded, so only large changes would have been caught (see above).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
