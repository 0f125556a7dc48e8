"""Re-run every committed ``--quick`` configuration and compare it with its committed table.

Each configuration in :data:`CONFIGS` is one ``rcdl`` command whose results are committed
under ``results/``, in two files side by side:

- ``<stem>.json``, the expected numbers (machine-readable; written by ``--update``);
- ``<stem>.md``, the table readers see. The part between the ``check-results`` markers is
  rendered from the JSON; prose outside the markers is free text.

For each configuration the checker:

1. checks that the table in the markdown is the one the JSON renders (no run needed);
2. runs the command into a temporary run folder, with ``--data-dir`` (from ``--data-dir``,
   else ``$RCDL_DATA``, else ``../shared/data`` beside the repository), ``--no-progress``
   and ``--out``;
3. reads the run's ``summary.json`` and ``config.json`` and compares them with the JSON:
   the run's settings and data must be the same, every committed model must be there (and
   no other), and each number must agree within its tolerance. Timings are recorded and
   shown, never compared.

Tolerances depend on the machine (why: docs/results.md). The expected JSON records the
machine class it was made on (:func:`machine_key`: the CPU's widest vector ISA from its
flags, the torch version and the thread count). On one machine class a quick run is
deterministic, so when the class matches the comparison is tight (:data:`TIGHT`: accuracy
±0.1 point, one of 1 000 test images; losses 0.1 % relative). Across CPU types the same
command has moved an accuracy by up to 1.4 points and a loss by up to 4.9 % (gws: 28.7 % /
2.481, 29.30 / 2.483 and 28.80 / 2.361 on three machines; gauge: 31.1 / 2.212 and 29.70 /
2.254 on two), so otherwise it is loose (:data:`LOOSE`: ±2.5 points, 8 % relative) and the
checker says so: only large changes are caught there. Entry counts, store bytes, parameter
counts and seeds are always exact.

Usage (from the repository root; ``make check-results`` runs the first line)::

    python benchmarks/check_results.py                 # check everything; exit 1 on a mismatch
    python benchmarks/check_results.py --list          # the configurations and their commands
    python benchmarks/check_results.py --only cifar10-1epoch --data-dir DIR
    python benchmarks/check_results.py --static        # tables against their JSON only, no runs
    python benchmarks/check_results.py --update        # re-run, rewrite the JSON and the tables
    python benchmarks/check_results.py --only NAME --run-dir RUN   # use a finished run folder

Exit status: 0 when everything matches (or ``--update`` wrote its files), 1 on a mismatch
or a failed run, 2 on a usage error (unknown name, missing data).

It is a script beside the other measurement scripts, not a module of ``rcdl``: it depends
on this repository's layout (``results/``, the shared data folder) and only drives the
``rcdl`` command line in a subprocess, so it imports nothing from the package and checks
the installed command exactly as a reader would run it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rcdl.app import rundir

REPO = Path(__file__).resolve().parent.parent
DATA_ENV = "RCDL_DATA"
DEFAULT_DATA = Path("..") / "shared" / "data"  # relative to the repository root
CIFAR10_FILES = ("cifar10.npz", "cifar-10-batches-py", "cifar-10-python.tar.gz")
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
# gauge 31.1 / 2.212 and 29.70 / 2.254 on two, i.e. accuracy within 1.4 points and loss within
# 4.9 %; these leave a margin of about 1.6-1.8x over that.
LOOSE: dict[str, Tolerance] = TIGHT | {
    "test_acc_pct": Tolerance(abs=2.5),
    "test_acc_pct_sd": Tolerance(abs=2.5),
    "test_loss": Tolerance(rel=0.08),
    "test_loss_sd": Tolerance(abs=0.08),
    "test_mse": Tolerance(rel=0.08),
}
# Kept beside the compared numbers to render the table; never compared.
INFO = ("possible_entries", "train_seconds", "eval_seconds", "paper")
# Run settings that may differ between the committed run and a check.
PER_RUN_SETTINGS = ("data_dir", "device", "checkpoint", "checkpoint_every")
# Flags the checker adds to a configuration's command (with their values, if any).
ADDED_FLAGS = {"--data-dir": 1, "--out": 1, "--no-progress": 0, "--no-download": 0}


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
        minutes: the run time to expect on the 2-core development VM.
        rows: turns the run's ``summary.json`` into the model rows that are compared.
        needs_data: the command reads CIFAR-10 (``--data-dir`` is passed).
    """

    name: str
    args: tuple[str, ...]
    expected: str
    table: str
    title: str
    note: str
    minutes: str
    rows: Callable[[Mapping[str, Any]], list[dict[str, Any]]] = cifar10_rows
    needs_data: bool = True

    def command(self, data_dir: str | None = "../shared/data") -> str:
        """The command as a reader types it."""
        extra = ("--data-dir", data_dir) if self.needs_data and data_dir else ()
        return shlex.join(("rcdl", *self.args, *extra))


CONFIGS: tuple[QuickConfig, ...] = (
    QuickConfig(
        name="cifar10-1epoch",
        args=("reproduce", "cifar10-1epoch", "--quick", "--models", "gws", "gauge", "rbf",
              "hybrid-tau50", "mlp-sgd", "mlp-adam", "mlp-adamw", "mlp-rmsprop",
              "psoftmax-5000"),
        expected="results/cifar10-1epoch/quick.json",
        table="results/cifar10-1epoch/quick.md",
        title="One-epoch CIFAR-10, quick configuration (2 000 train / 1 000 test images)",
        note=(
            "125 steps of batch 16 on a random 2 000-image subset of the JPEG-decoded copy of "
            "CIFAR-10 in `../shared/data` (lossy, about 30 dB PSNR from the original pixels; "
            "docs/data.md), evaluation on 1 000 random test images every 50 steps; the full "
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
        minutes="6",  # 5.4 min on the 2-core VM, beside another job: the 4 MLPs and
        # psoftmax-5000 about 40-60 s each, gws, gauge, rbf a few s, hybrid-tau50 ~13 s
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
    for row in committed.get("models") or []:
        model = row["model"]
        if model not in rows:
            out.append(Mismatch(name, model, "model missing from the new run", "row", None))
            continue
        for key, tolerance in tolerances.items():
            value = row.get(key)
            if value is None:
                continue
            new = rows[model].get(key)
            if not tolerance.allows(value, new):
                out.append(Mismatch(name, model, key, value, new, tolerance.describe()))
    for model in rows:
        if model not in expected_models:
            out.append(Mismatch(name, model, "model not in the committed table", None, "row"))
    return out


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
    tight = ("" if mine is None else f"For a tight check, run it on a machine of class "
             f"{mine}. ")
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
        f"{BEGIN} generated by benchmarks/check_results.py --update from "
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


def resolve_data_dir(given: str | None, root: Path = REPO) -> Path:
    """``--data-dir``, else ``$RCDL_DATA``, else ``../shared/data`` beside ``root``; an
    error if it holds no CIFAR-10 copy."""
    if given:
        where, how = Path(given), "--data-dir"
    elif os.environ.get(DATA_ENV):
        where, how = Path(os.environ[DATA_ENV]), f"${DATA_ENV}"
    else:
        where, how = root / DEFAULT_DATA, "the default ../shared/data"
    where = where.expanduser().resolve()
    if not where.is_dir():
        raise CheckError(f"no data folder at {where} ({how}). Give --data-dir DIR or set "
                         f"{DATA_ENV} to a folder holding {' or '.join(CIFAR10_FILES)} "
                         f"(see docs/data.md); the checker never downloads.")
    if not any((where / name).exists() for name in CIFAR10_FILES):
        raise CheckError(f"{where} ({how}) holds none of {', '.join(CIFAR10_FILES)}. Give "
                         f"--data-dir DIR or set {DATA_ENV} (see docs/data.md).")
    return where


def run_config(config: QuickConfig, out: Path, data_dir: Path | None, threads: int) -> int:
    """Run the configuration's command into ``out``; returns its exit status."""
    args = [*config.args, "--no-progress", "--out", str(out)]
    if config.needs_data:
        args += ["--data-dir", str(data_dir), "--no-download"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    print(f"== {config.name}: {config.command(str(data_dir) if data_dir else None)} "
          f"({threads} thread{'s' if threads != 1 else ''}; about {config.minutes} min)",
          flush=True)
    return subprocess.run([sys.executable, "-m", "rcdl", *args], env=env, cwd=REPO).returncode


def _default_threads() -> int:
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


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
    p.add_argument("--data-dir", metavar="DIR", help=f"CIFAR-10 folder (default: ${DATA_ENV}, "
                   f"then {DEFAULT_DATA} beside the repository)")
    p.add_argument("--run-dir", metavar="RUN", help="compare (or --update from) this finished "
                   "run folder instead of running; needs exactly one --only NAME")
    p.add_argument("--threads", type=int, default=_default_threads(), metavar="N",
                   help="OMP_NUM_THREADS of the runs (default: $OMP_NUM_THREADS, else 1)")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary run folders (kept anyway on a mismatch)")
    return p


def _list(configs: Sequence[QuickConfig], root: Path) -> None:
    for c in configs:
        state = "committed" if (root / c.expected).is_file() else "missing: run --update"
        print(f"{c.name}\n    command:  {c.command()}\n    expected: {c.expected} ({state})"
              f"\n    table:    {c.table}\n    time:     about {c.minutes} min on 2 CPU cores")


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
    if args.threads < 1:
        raise CheckError("--threads must be >= 1")
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
    data_dir = resolve_data_dir(args.data_dir, root) if needs_data else None

    for c in to_run:
        keep = args.keep or bool(args.run_dir)
        out = Path(args.run_dir) if args.run_dir else \
            Path(tempfile.mkdtemp(prefix=f"check-{c.name}-")) / "run"
        if not args.run_dir:
            status = run_config(c, out, data_dir, args.threads)
            if status != 0:
                problems.append(Mismatch(c.name, "—", f"run failed (exit status {status}); "
                                         f"folder {out}"))
                continue
        now = expected_from_run(c, out, None if args.run_dir else args.threads)
        if args.run_dir and now["args"] != list(c.args):
            raise CheckError(f"{out} was made by `rcdl {shlex.join(now['args'])}`, not by "
                             f"{c.name}'s `{c.command(None)}`")
        old_json = committed[c.name]
        if args.update:  # list every move beyond float noise on one machine class
            found = [] if old_json is None else compare(old_json, now, TIGHT)
        else:
            print(machine_note(old_json, now), flush=True)
            if not same_machine(old_json, now):
                loose.append(c.name)
            found = compare(old_json, now)
        if args.update and now.get("complete") is False:
            problems.append(Mismatch(c.name, "—", f"run did not finish; nothing written; "
                                     f"folder {out}"))
            print(f"{c.name}: run folder kept at {out}")
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
            keep = keep or bool(found)
        if keep:
            print(f"{c.name}: run folder kept at {out}")
        else:
            shutil.rmtree(out.parent, ignore_errors=True)
    if args.update:
        return 1 if problems else 0
    return _report(problems, len(chosen), ran=True, loose=loose)


def _report(problems: Sequence[Mismatch], count: int, ran: bool,
            loose: Sequence[str] = ()) -> int:
    if problems:
        print(f"\n{len(problems)} mismatch(es) against the committed results:\n")
        print(format_mismatches(problems))
        print("\nIf the change is intended, regenerate with "
              "`python benchmarks/check_results.py --update [--only NAME]` (docs/results.md).")
        if loose:
            print(f"Compared loosely, on another machine class than the expected JSON's: "
                  f"{', '.join(loose)}.")
        return 1
    what = "re-run and match" if ran else "tables match their expected JSON"
    print(f"\nAll {count} committed quick configuration(s) {what}.")
    if loose:
        print(f"Only loosely for {', '.join(loose)}: this machine's class differs from the "
              f"one recorded, so only large changes would have been caught (see above).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
