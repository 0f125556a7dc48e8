"""Run registered benchmark cases, here or against another git revision (A B A B …).

A case is a function registered with ``@case("name", ...)`` (``benchmarks/harness.py``) in
any module of ``benchmarks/``; it returns ``{figure: seconds}``, timed with the harness's
one timer. The runner finds the modules that register cases by that line, imports only those
it needs, and prints every figure in milliseconds beside the CPU model and flags.

- ``--list``: every case, its parameters and defaults, and its module.
- ``CASE ... [--set NAME=VALUE ...] [--rounds R]``: the cases here, ``R`` rounds taking
  turns; a table of median (min–max) over the rounds. ``--set NAME=V1,V2`` sweeps: one table
  per combination of the values.
- ``--base REV [--pairs P]``: this checkout (``new``, with its uncommitted changes) against
  ``REV`` (``old``, checked out into a temporary git worktree), in fresh processes taking
  turns, ``new old`` then ``old new``, so that a drift of the machine's speed hits both
  sides alike; every side imports ``rcdl`` from its tree's ``src/`` and runs this checkout's
  cases. For each figure it prints both medians and every pair's ratio new / old (median
  [min, max]; below 1: this checkout is faster).
- ``--quick``: every case at the small sizes of a smoke run.
- ``--json PATH``: also write every figure measured (seconds) to PATH.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASE_LINE = re.compile(r'^@(?:harness\.)?case\(\s*"([^"]+)"', re.MULTILINE)

# The scripts whose measurements the runner also serves, and the runner's command for each.
EQUIVALENTS = """\
the A/B of revisions (benchmarks/ab_revisions.py, same flags, still works):
  python benchmarks/ab_revisions.py --base REV [--model M] [--entries N]
      [--store-dtypes float32 bfloat16] [--pairs P] [--steps S] [--repeats R]
  is
  python benchmarks/run.py attention model --base REV --pairs P --set model=M
      --set entries=N --set store_dtype=float32,bfloat16 --set steps=S --set repeats=R
  (--figures attention or model keeps one of the two cases; --quick is --quick --pairs 1).
Every other script in benchmarks/ keeps its own command and flags (benchmarks/README.md)."""


def case_files() -> dict[str, Path]:
    """``{case name: module file}`` of every ``@case("name"`` line under ``benchmarks/``."""
    found: dict[str, Path] = {}
    for path in sorted(HERE.glob("*.py")):
        for name in CASE_LINE.findall(path.read_text(encoding="utf-8")):
            found[name] = path
    return found


def load_cases(names: Sequence[str]) -> list[harness.Case]:
    """The registered cases ``names``, importing the modules that register them."""
    files = case_files()
    missing = [n for n in names if n not in harness.CASES and n not in files]
    if missing:
        raise SystemExit(f"no benchmark case {', '.join(missing)}; known: "
                         f"{', '.join(sorted(files))} (--list describes them)")
    for name in names:
        if name not in harness.CASES:
            path = files[name]
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module
            spec.loader.exec_module(module)
    return [harness.CASES[n] for n in names]


def parse_value(text: str) -> Any:  # noqa: ANN401 - int, float, bool, None or str
    """``--set`` values: ints, floats, ``True``/``False``/``None``, else the text."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def combinations(settings: Sequence[str]) -> list[dict[str, Any]]:
    """Every combination of ``NAME=V1,V2`` settings, in the order given."""
    names, choices = [], []
    for item in settings:
        name, sep, values = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--set expects NAME=VALUE[,VALUE...], got {item!r}")
        names.append(name.replace("-", "_"))
        choices.append([parse_value(v) for v in values.split(",")])
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*choices)]


def run_cases(cases: Sequence[harness.Case], params: dict[str, Any],
              quick: bool) -> dict[str, float]:
    """Every case's figures in this process, each given the ``params`` it takes (a figure
    named as one of an earlier case's is prefixed with its case's name)."""
    unknown = set(params) - {p for c in cases for p in c.params}
    if unknown:
        raise SystemExit(f"no case of {', '.join(c.name for c in cases)} takes "
                         f"{', '.join(sorted(unknown))}")
    figures: dict[str, float] = {}
    for c in cases:
        got = c.run(quick, **{k: v for k, v in params.items() if k in c.params})
        figures |= {f"{c.name}: {k}" if k in figures else k: v for k, v in got.items()}
    return figures


def _title(params: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in params.items())


def run_here(cases: Sequence[harness.Case], combos: list[dict[str, Any]], rounds: int,
             quick: bool, title: Callable[[dict[str, Any]], str] = _title) -> list[dict]:
    """The cases in this process, ``rounds`` times taking turns, one table per combination."""
    print(f"# {harness.machine_line()}; {rounds} round(s)")
    report = []
    for params in combos:
        runs = [run_cases(cases, params, quick) for _ in range(rounds)]
        if title(params):
            print(f"\n## {title(params)}")
        print("| figure | ms: median (min–max) over rounds |\n|---|---|")
        for key in runs[0]:
            ms = [1e3 * r[key] for r in runs]
            print(f"| {key} | {statistics.median(ms):.2f} ({min(ms):.2f}–{max(ms):.2f}) |",
                  flush=True)
        report.append({"params": params, "runs": runs})
    return report


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def compare_revisions(cases: Sequence[harness.Case], combos: list[dict[str, Any]], base: str,
                      pairs: int, quick: bool, describe: str = "",
                      title: Callable[[dict[str, Any]], str] = _title) -> list[dict]:
    """This checkout against ``base``, ``pairs`` interleaved pairs of fresh processes per
    combination of parameters: a table of medians and per-pair ratios for each."""
    rev, head = _git("rev-parse", "--short", base), _git("rev-parse", "--short", "HEAD")
    print(f"# new: this checkout (HEAD {head}, with its uncommitted changes); old: {rev}")
    print(f"# {harness.machine_line()}; {describe}{pairs} pairs per combination, interleaved")
    report = []
    with tempfile.TemporaryDirectory(prefix="rcdl-ab-") as tmp:
        old_tree = Path(tmp) / "old"
        _git("worktree", "add", "--detach", "-q", str(old_tree), rev)
        try:
            trees = {"new": ROOT / "src", "old": old_tree / "src"}
            for params in combos:
                results: dict[str, list[dict[str, float]]] = {"new": [], "old": []}
                for pair in range(pairs):
                    for side in ("new", "old") if pair % 2 == 0 else ("old", "new"):
                        results[side].append(_child(cases, params, quick, trees[side], tmp))
                print(f"\n## {title(params)}" if title(params) else "")
                print("| figure | new ms (median) | old ms (median) | new / old per pair: "
                      "median [min, max] |")
                print("|---|---|---|---|")
                for key in results["new"][0]:
                    new = [r[key] for r in results["new"]]
                    old = [r[key] for r in results["old"]]
                    ratios = [a / b for a, b in zip(new, old, strict=True)]
                    print(f"| {key} | {1e3 * statistics.median(new):.1f} | "
                          f"{1e3 * statistics.median(old):.1f} | "
                          f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, "
                          f"{max(ratios):.3f}] |", flush=True)
                report.append({"params": params, "new": results["new"], "old": results["old"]})
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(old_tree)], check=False)
    return report


def _child(cases: Sequence[harness.Case], params: dict[str, Any], quick: bool, src: Path,
           tmp: str) -> dict[str, float]:
    """The cases' figures in a fresh process that imports ``rcdl`` from ``src``."""
    out = Path(tmp) / "child.json"
    command = [sys.executable, __file__, *(c.name for c in cases), "--child", str(out),
               "--params", json.dumps(params)] + (["--quick"] if quick else [])
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(src)})
    result = json.loads(out.read_text())
    if not Path(result["rcdl"]).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"the child imported rcdl from {result['rcdl']}, not from {src}")
    return result["figures"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=EQUIVALENTS,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", help="registered case names (--list)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE[,VALUE]",
                        help="a case parameter; several values sweep it (repeatable)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds here (not with --base)")
    parser.add_argument("--base", metavar="REV", help="compare against this git revision")
    parser.add_argument("--pairs", type=int, default=4, help="A B pairs per combination")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # out file: one side's figures
    parser.add_argument("--params", default="{}", help=argparse.SUPPRESS)  # the child's, JSON
    args = parser.parse_args(argv)
    if args.list:
        for name, path in sorted(case_files().items()):
            c = load_cases([name])[0]
            defaults = ", ".join(f"{k}={v}" for k, v in c.params.items())
            print(f"{name} ({path.name}): {c.doc}\n    {defaults}")
        return
    if not args.cases:
        parser.error("name at least one case (--list names them)")
    cases = load_cases(args.cases)
    if args.child:
        import rcdl

        figures = run_cases(cases, json.loads(args.params), args.quick)
        Path(args.child).write_text(json.dumps({"rcdl": rcdl.__file__, "figures": figures}))
        return
    combos = combinations(args.set)
    if args.base:
        report = compare_revisions(cases, combos, args.base, args.pairs, args.quick)
    else:
        report = run_here(cases, combos, args.rounds, args.quick)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": harness.machine_line(), "cases": args.cases,
                                         "results": report}, indent=1))


if __name__ == "__main__":
    main()
