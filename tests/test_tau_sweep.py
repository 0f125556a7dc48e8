"""`rcdl reproduce hybrid-tau-sweep` on a tiny synthetic CIFAR-10: outputs and errors."""

import csv
import json

import numpy as np
import pytest

from rcdl.app.cli import main
from rcdl.app.experiments.tau_sweep import TauSweepConfig

TINY = ["--train-size", "48", "--test-size", "24", "--eval-every", "2", "--device", "cpu",
        "--no-progress", "--no-download"]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(1)
    np.savez(folder / "cifar10.npz",
             x_train=rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8),
             y_train=rng.integers(0, 10, 64).astype(np.int64),
             x_test=rng.integers(0, 256, (32, 32, 32, 3), dtype=np.uint8),
             y_test=rng.integers(0, 10, 32).astype(np.int64),
             class_names=np.array([f"c{i}" for i in range(10)]))
    return folder


@pytest.fixture(scope="module")
def sweep(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "sweep"
    argv = ["reproduce", "hybrid-tau-sweep", "--data-dir", str(data_dir), *TINY, "--out",
            str(out), "--taus", "75", "always", "0", "--references", "gws"]
    assert main(argv) == 0
    return out


def test_sweep_writes_its_table_and_figure(sweep):
    for name in ("tau_sweep.md", "tau_sweep.csv", "entries_vs_accuracy.png", "results.md",
                 "summary.json", "config.json"):
        assert (sweep / name).is_file(), name
    rows = list(csv.DictReader((sweep / "tau_sweep.csv").read_text().splitlines()))
    # hybrids sorted from always grow to the largest tau, then the reference
    assert [r["model"] for r in rows] == ["hybrid-always", "hybrid-tau0", "hybrid-tau75", "gws"]
    entries = {r["model"]: int(r["entries"]) for r in rows}
    possible = 4 * (16 + 48)
    assert entries["hybrid-always"] == possible
    assert entries["hybrid-tau0"] == possible  # distinct random images: every distance > 0
    assert entries["hybrid-tau75"] < possible
    assert "always" in (sweep / "tau_sweep.md").read_text()


def test_sweep_summary_counts_written_and_refused_per_layer(sweep):
    summary = json.loads((sweep / "summary.json").read_text())
    run = next(r for r in summary["runs"] if r["model"] == "hybrid-tau75")
    for stats in run["layer_stats"].values():
        assert stats["written"] + stats["refused"] == 48
        assert stats["entries"] == 16 + stats["written"]


@pytest.mark.parametrize("argv", [["--taus", "-1"], ["--taus", "x"], ["--references", "nope"]])
def test_bad_sweep_settings_exit_2(data_dir, tmp_path, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "hybrid-tau-sweep", "--data-dir", str(data_dir), *TINY,
              "--out", str(tmp_path / "r"), *argv])
    assert exc.value.code == 2


def test_config_rejects_bad_taus():
    with pytest.raises(ValueError, match="each tau must be a finite number"):
        TauSweepConfig(taus=(float("nan"),))
    assert TauSweepConfig().comparison().models[0] == "hybrid-always"


@pytest.fixture(scope="module")
def second_sweep(data_dir, tmp_path_factory):
    """Another invocation with the same protocol and no checkpoints: τ = 40, psoftmax-8."""
    out = tmp_path_factory.mktemp("runs") / "second"
    argv = ["reproduce", "hybrid-tau-sweep", "--data-dir", str(data_dir), *TINY, "--out",
            str(out), "--taus", "40", "--references", "psoftmax-8", "--no-checkpoint"]
    assert main(argv) == 0
    return out


def test_no_checkpoint_is_recorded_and_writes_none(second_sweep):
    assert json.loads((second_sweep / "config.json").read_text())["checkpoint"] is False
    assert not (second_sweep / "checkpoints").exists()


def test_combine_merges_sweeps_and_picks_models(sweep, second_sweep, tmp_path, capsys):
    out = tmp_path / "combined"
    argv = ["reproduce", "hybrid-tau-sweep", "--combine", str(sweep), str(second_sweep),
            "--out", str(out), "--taus", "always", "40", "--references", "gws", "psoftmax-8"]
    assert main(argv) == 0
    assert "Combined 4 runs" in capsys.readouterr().out
    rows = list(csv.DictReader((out / "tau_sweep.csv").read_text().splitlines()))
    assert [r["model"] for r in rows] == ["hybrid-always", "hybrid-tau40", "gws", "psoftmax-8"]
    for name in ("entries_vs_accuracy.png", "tau_sweep.md", "results.md", "summary.json"):
        assert (out / name).is_file(), name
    assert len(json.loads((out / "summary.json").read_text())["tau_sweep"]) == 4
    # no filter: every finished model of both folders
    assert main([*argv[:5], "--out", str(tmp_path / "all")]) == 0
    rows = list(csv.DictReader((tmp_path / "all" / "tau_sweep.csv").read_text().splitlines()))
    assert len(rows) == 6


@pytest.mark.parametrize(("extra", "message"), [
    ([], "needs --out"),
    (["--out", "x", "--train-size", "8"], "drop --train-size"),
    (["--out", "x", "--full"], "drop --full"),
    (["--out", "x", "--taus", "12"], "hybrid-tau12 finished in none of"),
])  # fmt: skip
def test_combine_errors_exit_2(sweep, tmp_path, monkeypatch, extra, message, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "hybrid-tau-sweep", "--combine", str(sweep), *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err
