"""The parametric-vs-growing generalisation experiment (docs/reference.md §8) end to end on a tiny
synthetic CIFAR-10: outputs, per-epoch measurements, table sizes, settings and errors."""

import csv
import json

import numpy as np
import pytest

from rcdl.app.experiments.generalisation import (
    MODELS,
    GeneralisationConfig,
    build_model,
    load_data,
    run_generalisation,
)


def _tiny(data_dir, **overrides):
    settings = {"train_size": 48, "test_size": 24, "epochs": 2, "train_eval_size": 16,
                "seeds": (0, 1), "data_dir": data_dir, "device": "cpu"}  # fmt: skip
    return GeneralisationConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    folder, summary = run_generalisation(_tiny(data_dir), out=out, progress=False,
                                         download=False)  # fmt: skip
    assert folder.path == out
    return out, summary


def test_run_folder_holds_the_results(run):
    out, summary = run
    for name in ("config.json", "environment.json", "metrics.jsonl", "summary.json",
                 "results.md", "results.csv", "generalisation.png"):  # fmt: skip
        assert (out / name).is_file(), name
    assert (out / "generalisation.png").read_bytes().startswith(b"\x89PNG")
    config = json.loads((out / "config.json").read_text())
    assert config["epochs"] == 2 and config["seeds"] == [0, 1] and config["train_size"] == 48
    assert json.loads((out / "summary.json").read_text())["complete"] is True
    assert summary["data"]["n_train"] == 48 and summary["data"]["train_eval_size"] == 16


def test_both_models_are_measured_before_training_and_after_every_epoch(run):
    out, summary = run
    assert [(r["model"], r["seed"]) for r in summary["runs"]] == [
        (m, s) for s in (0, 1) for m in MODELS
    ]
    for r in summary["runs"]:
        assert [h["epoch"] for h in r["history"]] == [0, 1, 2]  # 3 steps per epoch
        for h in r["history"]:
            assert 0 <= h["train_acc"] <= 1 and 0 <= h["test_acc"] <= 1
            assert h["train_set_loss"] > 0 and h["test_loss"] > 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 3 and all("train_acc" in rec for rec in records)
    assert {(rec["model"], rec["seed"]) for rec in records} == {
        (m, s) for m in MODELS for s in (0, 1)
    }


def test_growing_model_keeps_writing_and_parametric_table_matches_its_first_epoch(run):
    _, summary = run
    gws, parametric = summary["runs"][:2]
    assert gws["entries"] == 3 * (16 + 2 * 48) and gws["parameters"] == 0  # 3 layers, 2 epochs
    assert summary["parametric_entries"] == 48 + 16 and parametric["entries"] is None
    # two blocks 3072 -> 3072 and a readout 3072 -> 10, each: keys, weighted values, weights
    table = 64 * (3072 + 3072 + 1)
    assert parametric["parameters"] == 2 * table + 64 * (3072 + 10 + 1)
    rows = {(r["model"], r["epoch"]): r for r in summary["rows"]}
    assert [rows["gws", e]["entries_per_layer"] for e in range(3)] == [16, 64, 112]
    assert rows["parametric", 2]["entries_per_layer"] is None


def test_rows_average_the_seeds_and_gap_is_train_minus_test(run):
    _, summary = run
    assert len(summary["rows"]) == 2 * 3
    for row in summary["rows"]:
        hs = [next(h for h in r["history"] if h["epoch"] == row["epoch"])
              for r in summary["runs"] if r["model"] == row["model"]]  # fmt: skip
        gaps = [100 * (h["train_acc"] - h["test_acc"]) for h in hs]
        assert row["gap_pct"] == pytest.approx(np.mean(gaps))
        assert row["gap_pct_sd"] == pytest.approx(np.std(gaps, ddof=1))
        assert row["seeds"] == [0, 1]
    for name, g in summary["gaps"].items():
        first, last = (next(r["gap_pct"] for r in summary["rows"]
                            if r["model"] == name and r["epoch"] == e) for e in (1, 2))  # fmt: skip
        assert (g["first"], g["last"]) == (first, last)
        assert g["change"] == pytest.approx(last - first)


def test_tables(run):
    out, _ = run
    table = (out / "results.md").read_text()
    head = "| epoch | gws train % | gws test % | gws gap | gws test loss | parametric train %"
    assert head in table
    assert all(f"\n| {e} | " in table for e in range(3)) and " ± " in table
    assert "- gws: gap" in table and "- parametric: gap" in table
    assert "Machine:" in table and "unknown provenance" in table
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert [(r["model"], r["epoch"]) for r in rows] == [
        (m, str(e)) for m in MODELS for e in range(3)
    ]
    assert rows[0]["seeds"] == "0 1" and rows[-1]["entries_per_layer"] == ""
    assert {"train_acc_pct", "test_acc_pct", "gap_pct", "test_loss"} <= set(rows[0])


def test_same_config_same_numbers(data_dir, tmp_path, run):
    _, reference = run
    cfg = _tiny(data_dir, seeds=(1,))
    _, summary = run_generalisation(cfg, out=tmp_path / "r", progress=False, download=False)
    again = [r["history"] for r in summary["runs"]]
    assert again == [r["history"] for r in reference["runs"] if r["seed"] == 1]


def test_parametric_entries_can_be_set(data_dir):
    cfg = _tiny(data_dir, parametric_entries=5)
    model, optimizer, grower = build_model("parametric", 0, cfg)
    assert cfg.entries == 5 and grower is None
    assert model.readout.keys.shape == (5, 3072) and optimizer.param_groups[0]["lr"] == 1e-3
    model, optimizer, grower = build_model("gws", 0, cfg)
    assert optimizer is None and [len(layer.store) for layer in grower.layers] == [16] * 3
    assert all(layer.store.capacity >= 16 + 2 * 48 for layer in grower.layers)
    with pytest.raises(ValueError, match="unknown model 'mlp'; known: gws, parametric"):
        build_model("mlp", 0, cfg)


def test_quick_and_saved_configs():
    quick = GeneralisationConfig.quick(epochs=2)
    assert (quick.train_size, quick.test_size, quick.epochs) == (200, 200, 2)
    assert quick.entries == 216
    saved = json.loads(json.dumps(GeneralisationConfig(seeds=[0, 3]).__dict__))
    assert GeneralisationConfig.from_dict(saved) == GeneralisationConfig(seeds=(0, 3))
    with pytest.raises(ValueError, match=r"unknown settings \['models'\]"):
        GeneralisationConfig.from_dict({"models": ["gws"]})


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"epochs": 0}, "epochs must be an int >= 1, got 0"),
     ({"train_size": 2.5}, "train_size must be an int >= 1, got 2.5"),
     ({"parametric_entries": 0}, "parametric_entries must be an int >= 1"),
     ({"seeds": ()}, "at least one seed"),
     ({"seeds": (1, 1)}, "seeds must not repeat"),
     ({"seeds": (-1,)}, "each seed must be an int >= 0, got -1"),
     ({"device": "tpu"}, "device must be one of")],
    ids=["no-epochs", "fractional-size", "empty-table", "no-seed", "repeated-seed",
         "negative-seed", "unknown-device"],
)  # fmt: skip
def test_bad_settings_name_the_problem(settings, message):
    with pytest.raises(ValueError, match=message):
        GeneralisationConfig(**settings)


def test_subset_larger_than_the_data_is_refused(data_dir):
    with pytest.raises(ValueError, match="train_size 100 is larger than the 64 images"):
        load_data(_tiny(data_dir, train_size=100), download=False)


def test_data_of_another_size_is_refused(data_dir, tmp_path):
    cfg = _tiny(data_dir)
    data = load_data(_tiny(data_dir, train_size=40), download=False)
    with pytest.raises(ValueError, match="40 train / 24 test images, the config asks for 48"):
        run_generalisation(cfg, data=data, out=tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


def test_cli_quick_flags_reach_the_config(tmp_path, monkeypatch):
    """`rcdl reproduce generalisation` maps its flags onto GeneralisationConfig."""
    from rcdl.app import cli, runner

    seen = {}

    def fake_run(cfg, **kw):
        seen["cfg"], seen["kw"] = cfg, kw

    monkeypatch.setattr(runner, "run_experiment", lambda spec, cfg, **kw: fake_run(cfg, **kw))
    argv = ["reproduce", "generalisation", "--quick", "--epochs", "2", "--seeds", "0", "1",
            "--data-dir", str(tmp_path), "--device", "cpu", "--no-progress"]
    assert cli.main(argv) == 0
    cfg = seen["cfg"]
    assert (cfg.epochs, cfg.seeds, cfg.train_size, cfg.data_dir) == (2, (0, 1), 200,
                                                                      str(tmp_path))
    assert seen["kw"]["progress"] is False
