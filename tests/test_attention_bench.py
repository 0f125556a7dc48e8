"""``rcdl reproduce attention-bench``: the framework's smallest experiment (the example of
docs/adding_an_experiment.md). Its numbers are timings, so the test checks what it measured
and wrote, not the values."""

import json

import pytest
import torch

from rcdl.app.cli import main
from rcdl.app.experiments.attention_bench import AttentionBenchConfig, measure


def test_command_measures_every_configuration_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["reproduce", "attention-bench", "--quick", "--sizes", "300", "--batches", "4", "8",
            "--width", "32", "--store-dtypes", "float32", "bfloat16", "--device", "cpu",
            "--no-progress"]  # fmt: skip
    assert main([*argv, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert [(r["store_dtype"], r["B"], r["N"]) for r in runs] == [
        ("float32", 4, 300), ("float32", 8, 300), ("bfloat16", 4, 300), ("bfloat16", 8, 300)]
    assert all(r["attention_seconds"] > 0 and r["ratio"] > 0 for r in runs)
    assert {"results.md", "results.csv", "finished.json", "config.json"} <= {
        p.name for p in out.iterdir()}
    assert "| bfloat16 | 8 | 300 |" in (out / "results.md").read_text()
    capsys.readouterr()
    assert main(["reproduce", "attention-bench", "--resume", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.count("finished in an earlier session, skipped") == 4


def test_config_checks_and_measure_directly():
    with pytest.raises(ValueError, match="unknown store_dtypes"):
        AttentionBenchConfig(store_dtypes=("float8",))
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        AttentionBenchConfig(temperature=0.0)
    row = measure(AttentionBenchConfig.quick(width=16, repeats=1), "float32", 2, 50,
                  torch.device("cpu"))  # fmt: skip
    assert row["N"] == 50 and row["products_seconds"] > 0
