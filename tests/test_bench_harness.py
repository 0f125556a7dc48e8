"""benchmarks/harness.py and benchmarks/run.py: the one timer counts the calls it is asked
for and reports each block's time per call; a case runs at its defaults, its smoke-run sizes
and what it is given, and refuses a parameter it does not take; the runner finds every case
by its registration line and sweeps a parameter; the store filler appends the rows asked
for, through the store or through a learner's commit."""

import importlib
import itertools
import sys
from pathlib import Path

import pytest
import torch

from rcdl import ClippedSoftmaxRule, GrowingSoftmaxNet, growing_layers

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import the harness as a sibling module
harness = importlib.import_module("harness")
runner = importlib.import_module("run")
sys.path.remove(str(BENCHMARKS))  # no script shadows another test's imports


def test_timeit_calls_warmup_plus_repeats_times_number(monkeypatch):
    """Each block reads the clock before and after its ``number`` calls: with a clock that
    ticks one second a read, every block takes a second and each call a third of it."""
    monkeypatch.setattr(harness, "clock", itertools.count().__next__)
    calls = []
    m = harness.timeit(lambda: calls.append(1), 4, warmup=2, number=3)
    assert len(calls) == 2 + 4 * 3
    assert m.times == pytest.approx([1 / 3] * 4) and m.median == pytest.approx(1 / 3)
    assert harness.spread(m, 1e3) == "333.333 (333.333–333.333)"


@pytest.mark.parametrize("repeats, number", [(0, 1), (1, 0)], ids=["no-repeat", "no-call"])
def test_timeit_refuses_empty_timings(repeats, number):
    with pytest.raises(ValueError, match="repeats >= 1 and number >= 1"):
        harness.timeit(lambda: None, repeats, number=number)


def test_a_case_runs_at_defaults_quick_sizes_and_given_values():
    @harness.case("test-double", quick={"x": 2}, x=5, scale=1.0)
    def double(x: int, scale: float) -> dict[str, float]:
        """Twice ``x``."""
        return {"double": 2 * x * scale}

    try:
        c = harness.CASES["test-double"]
        assert c.doc == "Twice ``x``."
        assert c.run() == {"double": 10.0}
        assert c.run(quick=True) == {"double": 4.0}
        assert c.run(quick=True, x=7, scale=0.5) == {"double": 7.0}
        with pytest.raises(ValueError, match="has no parameter"):
            c.run(y=1)
        figures = runner.run_cases([c], {"x": 3}, quick=False)
        assert figures == {"double": 6.0}
        twice = runner.run_cases([c, c], {}, quick=True)  # a figure named twice is prefixed
        assert twice == {"double": 4.0, "test-double: double": 4.0}
        with pytest.raises(SystemExit, match="takes y"):
            runner.run_cases([c], {"y": 3}, quick=False)
    finally:
        del harness.CASES["test-double"]


def test_the_runner_finds_every_registered_case_by_its_line():
    files = runner.case_files()
    assert files["attention"].name == files["model"].name == "ab_revisions.py"
    assert {"attention-gemm", "half-path", "roofline", "triad", "extremes"} <= set(files)


def test_set_values_sweep_in_the_order_given():
    combos = runner.combinations(["store-dtype=float32,bfloat16", "entries=2000"])
    assert combos == [{"store_dtype": "float32", "entries": 2000},
                      {"store_dtype": "bfloat16", "entries": 2000}]
    assert runner.combinations([]) == [{}]
    assert runner.parse_value("0.5") == 0.5 and runner.parse_value("None") is None
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        runner.combinations(["entries"])


@pytest.mark.parametrize("commit", [False, True], ids=["append", "commit"])
def test_fill_stores_appends_the_rows_asked_for(commit):
    torch.manual_seed(0)
    net = GrowingSoftmaxNet(8, 3, 2, temperature=1.0, rule=ClippedSoftmaxRule(0.1, 3.0))
    before = [len(layer.store) for _, layer in growing_layers(net)]
    harness.fill_stores(net, 10, torch.Generator().manual_seed(0), commit=commit)
    for n, (_, layer) in zip(before, growing_layers(net), strict=True):
        assert len(layer.store) == n + 10
        assert torch.allclose(layer.store.weights[n:], torch.full((10,), 1e-3))


def test_the_machine_line_names_the_cpu_flags_and_torch():
    line = harness.machine_line()
    assert "flags" in line and f"torch {torch.__version__}" in line
