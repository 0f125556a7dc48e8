"""`rcdl demo --quick` end to end through the CLI, and the CLI's errors."""

import contextlib
import dataclasses
import io
import json
import re

import pytest

from rcdl._version import __version__
from rcdl.app.cli import main
from rcdl.app.experiments.demo import DemoConfig, reading

MODELS = {"growing RBF", "MLP + SGD", "MLP + Adam"}


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    """The run folder and what the command printed."""
    out, printed = tmp_path_factory.mktemp("demo") / "run", io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["demo", "--quick", "--no-progress", "--out", str(out), "--seed", "3"]) == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def quick_run(quick_demo):
    return quick_demo[0]


@pytest.fixture(scope="module")
def quick_output(quick_demo):
    return quick_demo[1]


def test_demo_writes_a_self_describing_run(quick_run):
    for name in ("config.json", "environment.json", "metrics.jsonl", "summary.json",
                 "results.md", "test_mse.png"):  # fmt: skip
        assert (quick_run / name).is_file(), name
    config = json.loads((quick_run / "config.json").read_text())
    assert config["seed"] == 3 and config["teacher"]["seed"] == 3
    assert (quick_run / "test_mse.png").read_bytes().startswith(b"\x89PNG")


def test_demo_logs_every_model_and_summarises(quick_run):
    records = [json.loads(line) for line in (quick_run / "metrics.jsonl").read_text().splitlines()]
    assert {r["model"] for r in records} == MODELS
    assert all(r["samples"] == 0 for r in records if r["step"] == 0)
    summary = json.loads((quick_run / "summary.json").read_text())
    models = summary["models"]
    assert set(models) == MODELS
    n_train = json.loads((quick_run / "config.json").read_text())["teacher"]["n_train"]
    assert models["growing RBF"]["entries"] > 0 and models["growing RBF"]["parameters"] == 0
    assert models["growing RBF"]["entries"] % n_train == 0  # one entry per sample per layer
    assert models["MLP + Adam"]["entries"] is None and models["MLP + Adam"]["parameters"] > 0
    # the demo learns: the growing net ends at a fraction of its untrained error (measured in
    # the quick run: 0.93 → 0.13; the MLPs, a pass of 8 steps, barely move)
    rbf = models["growing RBF"]
    assert rbf["test_mse"] < 0.3 * rbf["history"][0]["test_mse"]
    table = (quick_run / "results.md").read_text()
    assert all(f"| {name} |" in table for name in MODELS) and "Machine:" in table


def test_the_reading_under_the_table_is_true(quick_run):
    """The line under the table names the models that beat predicting 0 (and only those),
    and, as an MLP is worse, says that the MLPs had too few steps, with their own numbers."""
    summary = json.loads((quick_run / "summary.json").read_text())
    zero, models = summary["zero_predictor_mse"], summary["models"]
    table = (quick_run / "results.md").read_text()
    line = next(line for line in table.splitlines() if line.startswith("Reading: "))
    assert table.index("| MLP + Adam |") < table.index(line) < table.index("Machine:")
    beat = sorted(name for name, r in models.items() if r["test_mse"] < zero)
    assert 0 < len(beat) < len(models)  # at this seed the quick Adam row is worse than zero
    said = line.split(" beat")[0].removeprefix("Reading: ")
    assert sorted(said.replace(" and ", ", ").split(", ")) == beat
    assert f"predicting 0 (test MSE {zero:.4f})" in line
    steps = models["MLP + Adam"]["steps"]
    assert f"At this size the MLP baselines have had {steps} steps" in line
    for name in ("MLP + SGD", "MLP + Adam"):
        r = models[name]
        assert f"{name} {r['history'][0]['test_mse']:.4f} → {r['test_mse']:.4f}" in line


def _result(mse, entries=None, steps=1000):
    return {"test_mse": mse, "entries": entries, "steps": steps,
            "history": [{"test_mse": 1.0}, {"test_mse": mse}]}


def test_the_reading_follows_the_numbers():
    cfg = DemoConfig()
    every = {"growing RBF": _result(0.06, entries=48_000), "MLP + SGD": _result(0.12),
             "MLP + Adam": _result(0.13)}
    assert reading(cfg, every, 0.94) == "Reading: every model beats predicting 0 (test MSE 0.9400)."
    worse = {**every, "MLP + Adam": _result(0.98)}
    line = reading(cfg, worse, 0.94)
    assert line.startswith("Reading: growing RBF and MLP + SGD beat predicting 0 (test MSE "
                           "0.9400); MLP + Adam does not. At this size the MLP baselines "
                           "have had 1000 steps (one pass of 16000 samples in batches of 16)")
    none = reading(cfg, {name: _result(1.5, r["entries"]) for name, r in every.items()}, 0.94)
    assert none.startswith("Reading: no model beats predicting 0")
    one = reading(DemoConfig.quick(seed=5), {"growing RBF": _result(0.1, entries=384)}, 0.94)
    assert one == "Reading: every model beats predicting 0 (test MSE 0.9400)."


def test_saved_config_reads_back(quick_run):
    saved = json.loads((quick_run / "config.json").read_text())
    quick = DemoConfig.quick()
    assert DemoConfig.from_dict(saved) == dataclasses.replace(
        quick, seed=3, teacher=dataclasses.replace(quick.teacher, seed=3))


@pytest.mark.parametrize(("settings", "message"), [
    ({"batch_size": 0}, "DemoConfig: batch_size must be an int >= 1, got 0"),
    ({"rbf_lr": 0.0}, "DemoConfig: rbf_lr must be a finite number > 0"),
    ({"teacher": 3}, "DemoConfig: teacher must be a TeacherConfig, got 3"),
], ids=["batch-size", "rbf-lr", "teacher"])  # fmt: skip
def test_bad_settings_are_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        DemoConfig(**settings)


def test_demo_refuses_to_overwrite_a_run(quick_run, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--quick", "--no-progress", "--out", str(quick_run)])
    assert exc.value.code == 2 and "already holds a finished run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["demo", "--seed", "-1"], ["demo", "--device", "tpu"], ["nope"], []],
    ids=["negative-seed", "unknown-device", "unknown-command", "no-command"],
)
def test_bad_usage_exits_2_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "--help' for its usage" in capsys.readouterr().err


def test_version_and_info(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and __version__ in capsys.readouterr().out
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"rcdl {__version__}" in out and "torch" in out


def test_info_reports_the_machine_class_for_the_threads_asked(capsys):
    import torch

    from rcdl.app.rundir import cpu_isa

    before = torch.get_num_threads()
    try:
        assert main(["info", "--threads", "1"]) == 0
        out = capsys.readouterr().out
        assert "threads: 1\n" in out
        assert f"machine class: {cpu_isa()} / torch {torch.__version__} / 1 thread " in out
        assert "cpu: " in out
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SystemExit) as exc:
        main(["info", "--threads", "0"])
    assert exc.value.code == 2 and "must be an int >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["empty", "another-python", "this-python"])
def test_the_command_the_demo_suggests_runs_from_where_the_user_is(tmp_path, monkeypatch, path):
    """Run as ``venv/bin/python -m rcdl demo`` without activating the venv, ``rcdl`` is not on
    ``PATH``, or is another environment's: the command offered is this interpreter's ``-m
    rcdl``, and it runs; where ``rcdl`` on ``PATH`` is this interpreter's own, it is that."""
    import os
    import shlex
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    from rcdl.app.cli import invocation

    folder = tmp_path / "bin"
    folder.mkdir()
    if path == "another-python":
        (folder / "rcdl").write_text("#!/bin/sh\nexit 3\n")
        (folder / "rcdl").chmod(0o755)
    elif path == "this-python":
        own = Path(sysconfig.get_path("scripts")) / "rcdl"
        if not own.exists():
            pytest.skip("this interpreter has no rcdl script (rcdl is not pip-installed)")
        folder = own.parent
    monkeypatch.setenv("PATH", os.pathsep.join([str(folder), "/usr/bin", "/bin"]))
    command = invocation()
    if path == "this-python":
        assert command == "rcdl"
    else:
        assert shlex.split(command) == [sys.executable, "-m", "rcdl"]
    if path == "empty":  # it runs (the others name the same command, or rcdl itself)
        done = subprocess.run([*shlex.split(command), "--version"], capture_output=True,
                              text=True, timeout=60, env={**os.environ})
        assert done.returncode == 0 and "rcdl" in done.stdout, done.stderr


def test_the_demo_ends_with_the_command_that_runs_from_here(quick_output):
    from rcdl.app.cli import invocation

    last = quick_output.strip().splitlines()[-1]
    assert last.endswith(f": {invocation()} reproduce cifar10-1epoch --help"), last
    listed = quick_output[quick_output.index("Available commands"):]
    named = re.findall(r"`([^`]*) --help`", listed)
    assert len(named) >= 3 and all(f"{c} ".startswith(f"{invocation()} ") for c in named), named
