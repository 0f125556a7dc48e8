"""Every command's outcome, recorded: what a refactor of the application must not change.

Each case is one ``rcdl`` command line at a tiny size on the shared random CIFAR-10 of
``tests/conftest.py`` (or on no data: the demo and teacher–student). The test runs it
in-process and compares, with the values recorded in ``tests/data/quick_summaries.json``:

- the run folder's file names;
- ``config.json`` (the resolved config);
- ``summary.json`` without timings (any key naming seconds) and without the machine's
  description;
- ``results.csv`` without its timing columns, where the command writes one.

Float results are reproducible on one machine class only (the CPU's widest vector ISA, the
torch version and the thread count; docs/results.md), so the comparison is exact on the
classes the values were recorded on (one thread and two, on the development machine) and
structural elsewhere: the same keys, counts, names
and settings, floats not compared. ``RCDL_RECORD_SUMMARIES=1`` rewrites the file from the
code as it is (run it before a refactor, never to make a failing test pass).

``RCDL_QUICK_DATA=DIR`` runs the real ``--quick`` configurations instead (minutes each, on
the CIFAR-10 copy in ``DIR``), recorded in ``tests/data/quick_summaries_full.json``.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rcdl.app.cli import main

RECORDED = Path(__file__).parent / "data" / "quick_summaries.json"
RECORDED_FULL = Path(__file__).parent / "data" / "quick_summaries_full.json"
FULL_DATA = os.environ.get("RCDL_QUICK_DATA")
RECORD = os.environ.get("RCDL_RECORD_SUMMARIES") == "1"

# --quick with every size cut to the tiny data (64 train / 32 test images)
TINY: dict[str, list[str]] = {
    "demo": ["demo", "--quick", "--device", "cpu"],
    # at the paper's width, Muon's Newton–Schulz iterations cost about 7 TFLOP a step: this
    # case is marked `long` (not in `make test`); the two below make the same checks, the
    # baselines' at width 64 (SMALL_WIDTH)
    "cifar10-1epoch": [
        "reproduce", "cifar10-1epoch", "--quick", "--models", "gws", "gauge", "rbf",
        "hybrid-tau50", "mlp-sgd", "mlp-muon", "psoftmax-40", "--train-size", "48",
        "--test-size", "24", "--eval-every", "2", "--device", "cpu"],
    "cifar10-1epoch-growing": [
        "reproduce", "cifar10-1epoch", "--quick", "--models", "gws", "gauge", "rbf",
        "hybrid-tau50", "--train-size", "48", "--test-size", "24", "--eval-every", "2",
        "--device", "cpu"],
    "cifar10-1epoch-baselines": [
        "reproduce", "cifar10-1epoch", "--quick", "--models", "mlp-sgd", "mlp-muon",
        "psoftmax-40", "--train-size", "48", "--test-size", "24", "--eval-every", "2",
        "--device", "cpu"],
    "cifar10-1epoch-bf16": [
        "reproduce", "cifar10-1epoch", "--quick", "--models", "gws", "--train-size", "32",
        "--test-size", "16", "--eval-every", "1", "--store-dtype", "bfloat16",
        "--no-checkpoint", "--device", "cpu"],
    "hybrid-tau-sweep": [
        "reproduce", "hybrid-tau-sweep", "--quick", "--train-size", "48", "--test-size", "24",
        "--eval-every", "2", "--device", "cpu"],
    "generalisation": [
        "reproduce", "generalisation", "--quick", "--train-size", "32", "--test-size", "16",
        "--epochs", "2", "--train-eval-size", "16", "--device", "cpu"],
    "memory-budget": [
        "reproduce", "memory-budget", "--quick", "--train-size", "48", "--test-size", "24",
        "--capacities", "20", "--policies", "oldest", "random", "contribution+merge",
        "--eval-every", "2", "--device", "cpu"],
    "optimizers": [
        "reproduce", "optimizers", "--quick", "--datasets", "cifar10", "--train-size", "48",
        "--test-size", "24", "--epochs", "2", "--width", "16", "--device", "cpu"],
    "deltanet-decay": [
        "reproduce", "deltanet-decay", "--quick", "--train-size", "48", "--test-size", "24",
        "--epochs", "2", "--width", "16", "--depth", "2", "--device", "cpu"],
    "teacher-student": [
        "reproduce", "teacher-student", "--quick", "--n-train", "48", "--n-test", "24",
        "--seeds", "0", "1", "--device", "cpu"],
    "vit": [
        "reproduce", "vit", "--quick", "--train-size", "48", "--test-size", "24",
        "--eval-every", "2", "--device", "cpu"],
    "attribution": [
        "reproduce", "attribution", "--quick", "--train-size", "48", "--test-size", "24",
        "--halves", "3", "--halves-per-sub-run", "2", "--shown", "2", "--top", "3",
        "--device", "cpu"],
    "unlearning": [
        "reproduce", "unlearning", "--quick", "--models", "gws", "mlp-adam", "--train-size",
        "48", "--test-size", "24", "--retain-eval-size", "24", "--forget-fraction", "0.25",
        "--device", "cpu"],
    "forgetting-quality": [
        "reproduce", "forgetting-quality", "--quick", "--models", "rbf", "mlp-adam",
        "--train-size", "40", "--test-size", "16", "--models-per-side", "2",
        "--device", "cpu"],
    "continual": [
        "reproduce", "continual", "--quick", "--models", "gws", "hybrid", "rbf+labels",
        "mlp-sgd", "mlp-ewc", "mlp-lwf", "knn-cosine", "ncm", "slda", "--train-size", "48",
        "--test-size", "24", "--device", "cpu"],
    "single-model-attribution": [
        "reproduce", "single-model-attribution", "--quick", "--models", "rbf", "--train-size",
        "32", "--test-size", "8", "--fractions", "0.125", "--sets", "3", "--no-set-level",
        "--positions", "2", "--protocol", "re-formed", "--device", "cpu"],
}  # fmt: skip

FULL: dict[str, list[str]] = {
    "demo": ["demo", "--quick", "--device", "cpu"],
    "cifar10-1epoch": ["reproduce", "cifar10-1epoch", "--quick", "--device", "cpu"],
    "hybrid-tau-sweep": ["reproduce", "hybrid-tau-sweep", "--quick", "--device", "cpu"],
    "generalisation": ["reproduce", "generalisation", "--quick", "--device", "cpu"],
    "memory-budget": ["reproduce", "memory-budget", "--quick", "--device", "cpu"],
    "optimizers": ["reproduce", "optimizers", "--quick", "--device", "cpu"],
    "deltanet-decay": ["reproduce", "deltanet-decay", "--quick", "--device", "cpu"],
    "teacher-student": ["reproduce", "teacher-student", "--quick", "--device", "cpu"],
    "vit": ["reproduce", "vit", "--quick", "--device", "cpu"],
    "attribution": ["reproduce", "attribution", "--quick", "--device", "cpu"],
    "unlearning": ["reproduce", "unlearning", "--quick", "--device", "cpu"],
    "forgetting-quality": ["reproduce", "forgetting-quality", "--quick", "--device", "cpu"],
    "continual": ["reproduce", "continual", "--quick", "--device", "cpu"],
    "single-model-attribution": ["reproduce", "single-model-attribution", "--quick",
                                 "--device", "cpu"],
}  # fmt: skip

NO_DATA = {"demo", "teacher-student"}
# commands with no case, and why: every other experiment has one (checked below)
NOT_RECORDED = {"attention-bench": "its results are times, which differ from run to run"}
CASES = FULL if FULL_DATA else TINY
LONG = set() if FULL_DATA else {"cifar10-1epoch"}  # over 15 s: `make test-long` runs them
# the ResNet-MLPs' blocks at this width
# the membership-inference score and the classical baselines need scikit-learn
NEEDS_SKLEARN = {"unlearning", "continual"}
SMALL_WIDTH = {"cifar10-1epoch-baselines": 64, "unlearning": 64, "continual": 64,
               "forgetting-quality": 64}


def _check_results():
    """tools/check_results.py, whose CPU classes this test shares."""
    spec = importlib.util.spec_from_file_location(
        "check_results", Path(__file__).parents[1] / "tools" / "check_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_results", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def machine_class() -> str:
    """The machine class float results reproduce on: the CPU's class as
    ``tools/check_results.py`` tells it (AMX, avx512_bf16, AVX512, AVX2...), torch's
    version and the thread count."""
    isa = _check_results().cpu_isa()
    return f"{isa} / torch {torch.__version__} / {torch.get_num_threads()} threads"


# the machine, the code's revision and the moment: they differ run to run, not outcomes
_NOT_OUTCOMES = ("machine", "environment", "out", "started", "command", "git_revision",
                 "git_dirty", "hostname", "platform", "cpu_flags", "cpu_model", "num_threads",
                 "malloc", "half_products", "half_product_paths", "half_adam",
                 "half_adam_paths", "cpu_capability", "isa_caps", "packed_chunks",
                 "packed_chunk_dtypes")


def _outcome(obj: Any, key: str = "") -> Any:
    """``obj`` without timings (keys naming seconds) or the machine's description."""
    if isinstance(obj, dict):
        return {k: _outcome(v, k) for k, v in obj.items()
                if "seconds" not in k and k not in _NOT_OUTCOMES}
    if isinstance(obj, list):
        return [_outcome(v) for v in obj]
    return obj


def _csv_outcome(text: str) -> list[dict[str, str]]:
    rows = list(csv.DictReader(io.StringIO(text)))
    return [{k: v for k, v in row.items() if "seconds" not in k and not k.endswith("_s")}
            for row in rows]


def _run(name: str, argv: list[str], data_dir: Path, out: Path) -> dict[str, Any]:
    data = [] if name in NO_DATA else ["--data-dir", str(FULL_DATA or data_dir)]
    assert main([*argv, *data, "--out", str(out), "--no-progress"]) == 0
    config = json.loads((out / "config.json").read_text())
    config.pop("data_dir", None)
    summary = json.loads((out / "summary.json").read_text())
    result = {"files": sorted(p.name for p in out.iterdir() if p.name != "checkpoints"),
              "config": config, "summary": _outcome(summary)}
    if (out / "results.csv").exists():
        result["csv"] = _csv_outcome((out / "results.csv").read_text())
    text = json.dumps(result)  # paths differ between runs: the data's and the run's
    for folder, alias in ((Path(FULL_DATA or data_dir).resolve(), "DATA"), (out, "RUN")):
        text = text.replace(str(folder), alias)
    return json.loads(text)


def _same_structure(recorded: Any, now: Any, where: str = "") -> None:
    """Equal except for floats, which need only be floats (another machine class)."""
    if isinstance(recorded, float) or isinstance(now, float):  # both numbers, not None
        numbers = [isinstance(x, int | float) and not isinstance(x, bool) for x in (recorded, now)]
        assert all(numbers), f"{where}: {recorded!r} became {now!r}"
        return
    if isinstance(recorded, str) and _floatish(recorded):
        return  # a CSV cell holding a float
    if isinstance(recorded, dict):
        assert isinstance(now, dict) and set(recorded) == set(now), where
        for k in recorded:
            _same_structure(recorded[k], now[k], f"{where}.{k}")
    elif isinstance(recorded, list):
        assert isinstance(now, list) and len(recorded) == len(now), where
        for i, (a, b) in enumerate(zip(recorded, now, strict=True)):
            _same_structure(a, b, f"{where}[{i}]")
    else:
        assert recorded == now, f"{where}: {recorded!r} != {now!r}"


def _floatish(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return "." in text or "e" in text or math.isnan(value)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.long] * (name in LONG)
                 + [pytest.mark.extra("classical")] * (name in NEEDS_SKLEARN))
    for name in CASES])
def test_command_outcome_is_unchanged(name, data_dir, tmp_path, monkeypatch):
    path = RECORDED_FULL if FULL_DATA else RECORDED
    if name in SMALL_WIDTH:
        from rcdl.app import models as zoo
        monkeypatch.setattr(zoo, "ResNetMLP", functools.partial(zoo.ResNetMLP,
                                                                width=SMALL_WIDTH[name]))
    now = _run(name, CASES[name], data_dir, tmp_path / "run")
    if RECORD:
        book = json.loads(path.read_text()) if path.exists() else {}
        book.setdefault(machine_class(), {})[name] = now
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(book, indent=1, sort_keys=True) + "\n")
        return
    if not path.exists():
        pytest.skip(f"{path} not recorded")
    book = json.loads(path.read_text())  # {machine class: {case: outcome}}
    now = json.loads(json.dumps(now))  # tuples as lists, as recorded
    if name in book.get(machine_class(), {}):
        assert now == _outcome(book[machine_class()][name])
        return
    recorded = [cases[name] for cases in book.values() if name in cases]
    if not recorded:
        pytest.skip(f"{name} is not recorded in {path}")
    _same_structure(_outcome(recorded[0]), now, name)


@pytest.mark.parametrize(("cases", "where"), [(TINY, "TINY"), (FULL, "FULL")])
def test_every_experiment_has_a_recorded_case(cases, where):
    """Each command the experiments' package finds is among the cases, so its outcome is
    recorded from its first commit on (docs/adding_an_experiment.md)."""
    from rcdl.app.experiments import COMMANDS

    covered = {argv[1] for argv in cases.values() if argv[0] == "reproduce"}
    missing = sorted(set(COMMANDS) - covered - set(NOT_RECORDED))
    assert not missing, (
        f"tests/test_quick_summaries.py: {where} has no case running `rcdl reproduce` "
        f"{missing}; add one ({'at a tiny size, ' if where == 'TINY' else ''}"
        "'NAME': ['reproduce', 'NAME', '--quick', ...]) and record it with "
        "RCDL_RECORD_SUMMARIES=1 pytest tests/test_quick_summaries.py -k NAME")
    unknown = sorted((covered | set(NOT_RECORDED)) - set(COMMANDS))
    assert not unknown, f"tests/test_quick_summaries.py: {where} names unknown commands {unknown}"
