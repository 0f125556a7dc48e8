"""benchmarks/check_results.py: the comparison of committed quick results with a new run,
on fabricated run summaries (no experiment runs here)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_checker():
    spec = importlib.util.spec_from_file_location("check_results",
                                                  ROOT / "benchmarks" / "check_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_results"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


cr = _load_checker()

CONFIG = cr.QuickConfig(
    name="tiny", args=("reproduce", "cifar10-1epoch", "--quick", "--models", "gws", "mlp-adam"),
    expected="results/tiny/quick.json", table="results/tiny/quick.md", title="Tiny quick run",
    note="Prose a reader wrote.", minutes="1",
)
LOSSY = ("the JPEG-decoded copy of CIFAR-10 (lossy, about 30 dB PSNR from the original "
         "pixels; see docs/data.md)")


def _row(model, acc, loss, entries=None, parameters=0, store=None):
    return {"model": model, "seeds": [0], "test_acc_pct": acc, "test_acc_pct_sd": None,
            "test_loss": loss, "test_loss_sd": None, "entries": entries,
            "possible_entries": entries, "store_bytes": store, "parameters": parameters,
            "train_seconds": 3.0, "eval_seconds": 1.4, "paper_test_acc_pct": 59.18,
            "paper_test_loss": 1.163, "paper_entries": 150048, "paper_seeds_acc_pct": None}


def _summary(gws=(28.7, 2.481), adam=(29.0, 1.998), *, extra=(), complete=True,
             provenance=LOSSY, entries=6048):
    rows = [_row("gws", *gws, entries=entries, store=124_016_256)]
    if adam is not None:
        rows.append(_row("mlp-adam", *adam, parameters=75_552_778))
    rows += [_row(name, 20.0, 2.0) for name in extra]
    return {"experiment": "cifar10-1epoch", "complete": complete, "runs": [],
            "sessions": [{"seconds": 5.0}],
            "data": {"n_train": 2000, "n_test": 1000, "provenance": provenance},
            "models": rows}


RUN_CONFIG = {"models": ["gws", "mlp-adam"], "train_size": 2000, "test_size": 1000,
              "seeds": [0], "batch_size": 16, "eval_every": 50, "data_dir": "/data/a",
              "device": "auto", "checkpoint": True, "checkpoint_every": None}
ENVIRONMENT = {"git_revision": "41c9c3e7df69dc", "git_dirty": False, "cpu_count": 2,
               "num_threads": 1, "torch": "2.13.0+cpu", "started": "2026-11-30T21:48:39+00:00",
               "command": ["/usr/bin/rcdl", *CONFIG.args, "--data-dir", "/data/a",
                           "--no-progress", "--out", "/tmp/run", "--no-download"]}


def _expected(summary, run_config=None, environment=None):
    return cr.expected_from_summary(CONFIG, summary, run_config or RUN_CONFIG,
                                    environment or ENVIRONMENT)


def _whats(mismatches):
    return [(m.model, m.what) for m in mismatches]


# --------------------------------------------------------------------------- compare


def test_a_rerun_within_float_noise_matches():
    committed = _expected(_summary())
    now = _expected(_summary(gws=(28.9, 2.481 * 1.004), adam=(28.8, 1.998 * 0.995)),
                    run_config={**RUN_CONFIG, "data_dir": "/elsewhere", "checkpoint": False},
                    environment={**ENVIRONMENT, "num_threads": 2, "git_dirty": True})
    assert cr.compare(committed, now) == []


def test_a_stale_accuracy_is_flagged():
    mismatches = cr.compare(_expected(_summary()), _expected(_summary(adam=(29.6, 1.998))))
    assert _whats(mismatches) == [("mlp-adam", "test_acc_pct")]
    m = mismatches[0]
    assert (m.committed, m.now, m.tolerance) == (29.0, 29.6, "±0.3")


def test_a_stale_loss_is_flagged_issue_12_gws_row():
    # the committed quick.md had gws 28.7 % / 2.481; the same command later gave 28.80 / 2.361
    mismatches = cr.compare(_expected(_summary()), _expected(_summary(gws=(28.80, 2.361))))
    assert _whats(mismatches) == [("gws", "test_loss")]
    table = cr.format_mismatches(mismatches)
    assert "2.481" in table and "2.361" in table and "-4.8 %" in table and "±1 % rel." in table


def test_a_missing_model_and_an_extra_model_are_flagged():
    mismatches = cr.compare(_expected(_summary()), _expected(_summary(adam=None, extra=["rbf"])))
    assert _whats(mismatches) == [("mlp-adam", "model missing from the new run"),
                                  ("rbf", "model not in the committed table")]


def test_counts_are_exact():
    mismatches = cr.compare(_expected(_summary()), _expected(_summary(entries=6049)))
    assert _whats(mismatches) == [("gws", "entries")]


def test_settings_data_and_completion_are_compared():
    committed = _expected(_summary())
    now = _expected(_summary(complete=False, provenance="the official CIFAR-10 files "
                             "(lossless)"), run_config={**RUN_CONFIG, "eval_every": 25})
    assert _whats(cr.compare(committed, now)) == [
        ("—", "run finished"), ("—", "setting eval_every"), ("—", "data kind")]
    reworded = _expected(_summary(provenance="the JPEG-decoded copy of CIFAR-10 (reworded)"))
    assert cr.compare(committed, reworded) == []


def test_another_command_is_flagged():
    other = {**ENVIRONMENT, "command": ["rcdl", "reproduce", "cifar10-1epoch", "--quick"]}
    mismatches = cr.compare(_expected(_summary()), _expected(_summary(), environment=other))
    assert _whats(mismatches) == [("—", "command")]


def test_cells_the_committed_table_never_had_are_not_compared():
    committed = _expected(_summary())
    for row in committed["models"]:
        row["store_bytes"] = row["parameters"] = None
    now = _expected(_summary())
    for row in now["models"]:
        row["store_bytes"], row["parameters"] = 1, 2
    assert cr.compare(committed, now) == []


@pytest.mark.parametrize(("tolerance", "committed", "now", "ok"), [
    (cr.TOLERANCES["test_acc_pct"], 28.7, 29.0, True),
    (cr.TOLERANCES["test_acc_pct"], 28.7, 29.01, False),
    (cr.TOLERANCES["test_loss"], 2.0, 2.0199, True),
    (cr.TOLERANCES["test_loss"], 2.0, 1.979, False),
    (cr.TOLERANCES["test_loss"], 2.0, float("nan"), False),
    (cr.TOLERANCES["test_loss"], 2.0, None, False),
    (cr.TOLERANCES["entries"], 6048, 6048, True),
    (cr.TOLERANCES["entries"], 6048, 6047, False),
    (cr.TOLERANCES["seeds"], [0], [0, 1], False),
])
def test_tolerances(tolerance, committed, now, ok):
    assert tolerance.allows(committed, now) is ok


def test_timings_are_never_compared():
    assert not set(cr.TOLERANCES) & {"train_seconds", "eval_seconds"}
    now = _expected(_summary())
    now["models"][0]["train_seconds"] = 1e6
    assert cr.compare(_expected(_summary()), now) == []


def test_command_args_drop_the_flags_the_checker_adds():
    assert cr.command_args(ENVIRONMENT["command"]) == list(CONFIG.args)
    assert cr.command_args(["rcdl", "demo", "--quick", "--out=/x"]) == ["demo", "--quick"]


# --------------------------------------------------------------------------- the markdown


def test_table_rendered_from_the_json_and_checked_against_it():
    expected = _expected(_summary())
    text = cr.render_markdown(CONFIG, expected)
    assert text.startswith("# Tiny quick run") and "Prose a reader wrote." in text
    assert "| gws | 28.70 | 2.481 | 6,048 | 124.02 MB | 3.0 | 1.4 | 59.18 % |" in text
    assert cr.check_table(CONFIG, expected, text) == []
    # a re-render keeps the prose around the block, including edits to it
    edited = text.replace("Prose a reader wrote.", "Edited prose.")
    assert cr.render_markdown(CONFIG, expected, edited) == edited
    stale = text.replace("| 28.70 |", "| 28.80 |")
    assert _whats(cr.check_table(CONFIG, expected, stale)) == [
        ("—", "results/tiny/quick.md differs from quick.json")]
    assert len(cr.check_table(CONFIG, expected, "# a hand-written table\n")) == 1
    assert len(cr.check_table(CONFIG, expected, None)) == 1


# --------------------------------------------------------------------------- the command


def _run_folder(path, summary, environment=ENVIRONMENT):
    path.mkdir(parents=True)
    for name, content in (("summary.json", summary), ("config.json", RUN_CONFIG),
                          ("environment.json", environment)):
        (path / name).write_text(json.dumps(content))
    return path


def test_update_then_check_a_run_folder(tmp_path, capsys):
    root, configs = tmp_path / "repo", (CONFIG,)
    unfinished = _run_folder(tmp_path / "unfinished", _summary(complete=False))
    assert cr.main(["--only", "tiny", "--run-dir", str(unfinished), "--update"],
                   configs, root) == 1
    assert not (root / CONFIG.expected).exists()
    run = _run_folder(tmp_path / "run", _summary())
    argv = ["--only", "tiny", "--run-dir", str(run)]
    assert cr.main([*argv, "--update"], configs, root) == 0
    assert json.loads((root / CONFIG.expected).read_text())["models"][0]["test_loss"] == 2.481
    assert cr.main(argv, configs, root) == 0
    assert cr.main(["--static"], configs, root) == 0
    capsys.readouterr()

    stale = _run_folder(tmp_path / "stale", _summary(gws=(28.80, 2.361)))
    assert cr.main(["--only", "tiny", "--run-dir", str(stale)], configs, root) == 1
    out = capsys.readouterr().out
    assert "1 mismatch(es)" in out and "test_loss" in out and "--update" in out


def test_usage_errors(tmp_path, capsys, monkeypatch):
    root, configs = tmp_path / "repo", (CONFIG,)
    assert cr.main(["--only", "nope"], configs, root) == 2
    assert "unknown configuration nope; known: tiny" in capsys.readouterr().err
    other = _run_folder(tmp_path / "other", _summary(), {**ENVIRONMENT, "command": [
        "rcdl", "reproduce", "cifar10-1epoch", "--quick"]})
    assert cr.main(["--only", "tiny", "--run-dir", str(other), "--update"], configs, root) == 2
    assert "was made by `rcdl reproduce cifar10-1epoch --quick`" in capsys.readouterr().err
    # no committed JSON: reported without running anything
    assert cr.main([], configs, root) == 1
    assert "quick.json missing (run --update)" in capsys.readouterr().out


def test_missing_data_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(cr.DATA_ENV, raising=False)
    with pytest.raises(cr.CheckError, match="no data folder at .*the default ../shared/data"):
        cr.resolve_data_dir(None, root=tmp_path / "repo")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(cr.DATA_ENV, str(tmp_path / "empty"))
    with pytest.raises(cr.CheckError, match=r"\$RCDL_DATA\) holds none of cifar10.npz"):
        cr.resolve_data_dir(None)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cifar10.npz").touch()
    assert cr.resolve_data_dir(str(tmp_path / "data")) == (tmp_path / "data").resolve()
    # through the command: exit status 2 before any run
    root = tmp_path / "repo"
    run = _run_folder(tmp_path / "run", _summary())
    assert cr.main(["--only", "tiny", "--run-dir", str(run), "--update"], (CONFIG,), root) == 0
    assert cr.main(["--data-dir", str(tmp_path / "empty")], (CONFIG,), root) == 2
    assert "holds none of" in capsys.readouterr().err


def test_list(capsys):
    assert cr.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "rcdl reproduce cifar10-1epoch --quick" in out and "--data-dir ../shared/data" in out


def test_committed_expected_files_are_well_formed():
    for config in cr.CONFIGS:
        expected = json.loads((ROOT / config.expected).read_text(encoding="utf-8"))
        assert expected["config"] == config.name
        assert expected["args"] == list(config.args)
        assert expected["models"], config.expected
        for row in expected["models"]:
            assert row["test_acc_pct"] is not None and row["test_loss"] is not None, row


FAKE_RCDL = '''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
out.mkdir(parents=True)
spec = json.loads(os.environ["FAKE_RCDL_RUN"])
spec["environment"]["command"] = sys.argv
spec["environment"]["num_threads"] = int(os.environ["OMP_NUM_THREADS"])
for name in ("summary", "config", "environment"):
    (out / f"{name}.json").write_text(json.dumps(spec[name]))
raise SystemExit(spec.get("status", 0))
'''


def test_runs_the_command_in_a_subprocess(tmp_path, capsys, monkeypatch):
    """The whole path through a stand-in ``rcdl`` package that writes a run folder."""
    fake = tmp_path / "fake" / "rcdl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_RCDL)
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    monkeypatch.setattr(cr.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cifar10.npz").touch()
    root, configs = tmp_path / "repo", (CONFIG,)
    argv = ["--data-dir", str(tmp_path / "data"), "--threads", "2"]

    def fake_run(summary, status=0):
        monkeypatch.setenv("FAKE_RCDL_RUN", json.dumps(
            {"summary": summary, "config": RUN_CONFIG, "environment": dict(ENVIRONMENT),
             "status": status}))

    fake_run(_summary())
    assert cr.main([*argv, "--update"], configs, root) == 0
    written = json.loads((root / CONFIG.expected).read_text())
    assert written["args"] == list(CONFIG.args) and written["made"]["threads"] == 2
    assert cr.main(argv, configs, root) == 0
    assert list((tmp_path / "tmp").iterdir()) == []  # a matching run's folder is removed
    capsys.readouterr()

    fake_run(_summary(gws=(28.80, 2.361)))
    assert cr.main(argv, configs, root) == 1
    out = capsys.readouterr().out
    assert "test_loss" in out and "run folder kept at" in out
    fake_run(_summary(), status=3)
    assert cr.main(argv, configs, root) == 1
    assert "run failed (exit status 3)" in capsys.readouterr().out
