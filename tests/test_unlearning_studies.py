"""rcdl reproduce unlearning --studies: each study at a tiny size through the command, and a
default run's folder as it was before the studies existed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rcdl.app.cli import main
from rcdl.app.experiments.unlearning import (
    ForgettingConfig,
    SavedConfig,
    UnlearningConfig,
    saved_form,
)
from rcdl.app.experiments.unlearning import forget_command as forget_command_study
from rcdl.app.experiments.unlearning.forget_command import forgotten_samples

# 32 training images: two steps of 16 (each step of a paper-width model costs a fraction of a
# second on two cores)
TINY = ["--seeds", "0", "--train-size", "32", "--test-size", "16", "--no-progress",
        "--device", "cpu"]


def run(data_dir, out, *flags):
    assert main(["reproduce", "unlearning", *flags, *TINY, "--data-dir", str(data_dir),
                 "--out", str(out)]) == 0
    return json.loads((out / "summary.json").read_text())


def test_a_default_run_saves_the_comparisons_config_and_a_study_run_its_own():
    default = saved_form(UnlearningConfig())
    assert type(default) is ForgettingConfig
    assert "studies" not in dataclasses.asdict(default)
    asked = UnlearningConfig(studies=("exact-cost",))
    assert saved_form(asked) is asked
    assert saved_form(UnlearningConfig(exact_positions=3)).exact_positions == 3
    # a folder saved either way reads back as what was saved
    assert SavedConfig.from_dict(dataclasses.asdict(default)) == default
    assert SavedConfig.from_dict(dataclasses.asdict(asked)) == asked
    partial = {k: v for k, v in dataclasses.asdict(asked).items() if k != "exact_positions"}
    with pytest.raises(ValueError, match="lacks exact_positions"):
        SavedConfig.from_dict(partial)
    with pytest.raises(ValueError, match="one per model"):
        UnlearningConfig(models=("gws", "rbf"), log_size_every=(1, 2, 3))
    with pytest.raises(ValueError, match="0-1"):
        UnlearningConfig(repair_fractions=(0.5, 2.0))
    with pytest.raises(ValueError, match="unknown studies"):
        UnlearningConfig(studies=("speed",))
    with pytest.raises(ValueError, match="measure growing models"):
        UnlearningConfig(studies=("log-size",), models=("mlp-adam",))


def test_exact_cost_equals_retraining_bit_for_bit(data_dir, tmp_path):
    out = tmp_path / "run"
    summary = run(data_dir, out, "--studies", "exact-cost", "--models", "rbf",
                  "--exact-positions", "1")
    assert json.loads((out / "config.json").read_text())["studies"] == ["exact-cost"]
    (result,) = summary["runs"]
    assert (result["study"], result["model"], result["snapshots"]) == ("exact-cost", "rbf", 3)
    requests = result["requests"]
    assert list(requests) == ["random 10 %", "most recent 10 %", "one class (0)",
                              "one image at 0%"]
    retrained = [q for q in requests.values() if "same_predictions" in q]
    assert len(retrained) == 3 and all(q["same_predictions"] for q in retrained)
    assert requests["random 10 %"]["samples"] == 3  # round(0.1 * 32)
    assert requests["most recent 10 %"]["earliest_position"] == 29
    assert "restored step 1, replayed 1 of 2" in requests["most recent 10 %"]["replayed"]
    assert "restored step 0, replayed 2 of 2" in requests["one image at 0%"]["replayed"]
    assert {"exact_forgetting.json", "exact_forgetting.png", "results.md"} <= {
        p.name for p in out.iterdir()}
    assert "in 3 of 3 requests" in (out / "results.md").read_text()


def test_log_size_grows_with_the_snapshots(data_dir, tmp_path):
    out = tmp_path / "run"
    summary = run(data_dir, out, "--studies", "log-size", "--models", "gws", "rbf",
                  "--log-size-every", "1", "2")
    rows = {r["model"]: r for r in summary["runs"]}
    assert (rows["gws"]["snapshots"], rows["rbf"]["snapshots"]) == (3, 2)  # steps 0-2; 0, 2
    assert rows["gws"]["stream_file_bytes"] == rows["rbf"]["stream_file_bytes"]
    assert rows["gws"]["log_file_bytes"] > rows["rbf"]["log_file_bytes"]
    for r in rows.values():
        assert r["log_file_bytes"] > r["stream_file_bytes"]
        assert r["forget"]["position"] == 16  # the second step's first sample
    assert "restored step 1, replayed 1 of 2 steps" in rows["gws"]["forget"]["receipt"]
    assert "restored step 0, replayed 2 of 2 steps" in rows["rbf"]["forget"]["receipt"]
    assert json.loads((out / "replay_log_size.json").read_text())["images"] == 32
    # a resumed study run reads its own config back and skips what finished
    assert main(["reproduce", "unlearning", "--resume", str(out), "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["runs"] == summary["runs"]


@pytest.mark.extra("classical")
def test_repair_budget_at_its_ends_is_forget_and_the_whole_repair(data_dir, tmp_path):
    out = tmp_path / "run"
    # one image forgotten: too few for the attack, whose score (None) would cost seconds
    summary = run(data_dir, out, "--studies", "forgetting", "repair-budget", "--models",
                  "rbf", "--scenarios", "random", "--forget-fraction", "0.03",
                  "--retain-eval-size", "16", "--repair-fractions", "0", "1")
    compared, (budget,) = (
        [r for r in summary["runs"] if r.get("study", "forgetting") == s]
        for s in ("forgetting", "repair-budget"))
    variants = compared[0]["scenarios"]["random"]["variants"]
    (scenario,) = budget["runs"]
    rows = {(v["keys"], v["fraction"]): v for v in scenario["variants"]}
    metrics = ("forget_acc", "retain_acc", "test_acc", "mia")
    same = {("stored", 0.0): "forget", ("recomputed", 0.0): "forget",
            ("stored", 1.0): "repair", ("recomputed", 1.0): "repair+keys"}
    for key, variant in same.items():
        assert {m: rows[key][m] for m in metrics} == {m: variants[variant][m] for m in metrics}
    assert rows["stored", 0.0]["steps"] == 0 and rows["stored", 1.0]["steps"] == scenario["steps"]
    assert {m: scenario["retrain"][m] for m in metrics} == {
        m: variants["retrain"][m] for m in metrics}
    assert {"repair_budget.json", "repair_budget.md", "repair_budget.png", "results.csv",
            "unlearning.png"} <= {p.name for p in out.iterdir()}


def test_forget_command_edits_the_kept_run_as_retraining_would(data_dir, tmp_path,
                                                             monkeypatch):
    # the two commands in this process (a new one costs seconds to import torch)
    monkeypatch.setattr(forget_command_study, "_rcdl", lambda *args: main(list(args)))
    out = tmp_path / "run"
    summary = run(data_dir, out, "--studies", "forget-command", "--models", "gws")
    (result,) = summary["runs"]
    assert result["samples"] == forgotten_samples(32) == [10, 16, 22]
    assert result["same_outputs"] and result["largest_difference"] == 0
    assert result["receipt"] == {"mode": "exact", "samples": [10, 16, 22], "clean": True}
    assert set(result["kept_files"]) == {"gws-seed0.pt", "gws-seed0.log.pt"}
    assert not (out / "forget-command" / "gws-seed0").exists()  # the kept run, removed
    assert (out / "forget_command.json").is_file()
