"""The memory-budget sweep end to end on a tiny synthetic CIFAR-10: outputs, the invariants
of every run, and config errors."""

import csv
import json

import pytest

from rcdl.app.experiments.memory_budget import (
    MemoryBudgetConfig,
    load_data,
    run_memory_budget,
)


@pytest.fixture(scope="module")
def sweep(data_dir, tmp_path_factory):
    cfg = MemoryBudgetConfig(train_size=48, test_size=24, capacities=(40, 20),
                             policies=("oldest", "contribution+merge"), eval_every=2,
                             slack=0.0, data_dir=str(data_dir), device="cpu")  # fmt: skip
    out = tmp_path_factory.mktemp("runs") / "run"
    run, summary = run_memory_budget(cfg, out=out, progress=False)
    return cfg, run, summary


def test_run_folder_holds_the_results(sweep):
    cfg, run, summary = sweep
    for name in ("config.json", "environment.json", "metrics.jsonl", "summary.json",
                 "results.md", "results.csv", "accuracy_vs_capacity.png"):  # fmt: skip
        assert run.file(name).is_file(), name
    assert run.file("accuracy_vs_capacity.png").read_bytes().startswith(b"\x89PNG")
    saved = json.loads(run.file("config.json").read_text())
    assert MemoryBudgetConfig.from_dict(saved) == cfg
    assert json.loads(run.file("summary.json").read_text())["complete"] is True


def test_every_run_keeps_its_budget(sweep):
    _, _, summary = sweep
    runs = summary["runs"]
    # unbounded first, then each policy at each capacity, smallest first
    assert [(r["policy"], r["capacity"]) for r in runs] == [
        ("unbounded", None), ("oldest", 20), ("oldest", 40),
        ("contribution+merge", 20), ("contribution+merge", 40),
    ]  # fmt: skip
    written = 3 * (16 + 48)  # 3 layers: 16 initial entries each, one per training image
    for r in runs:
        assert r["entries"] + r["evicted"] == written
        assert 0 <= r["test_acc"] <= 1 and r["test_loss"] > 0
        assert [h["samples"] for h in r["history"]] == [0, 32, 48]  # 3 steps, eval every 2
        if r["capacity"] is None:
            assert r["evicted"] == 0 and r["entries"] == written
        else:
            assert r["entries_per_layer"] == dict.fromkeys(
                ("blocks.0", "blocks.1", "readout"), r["capacity"])
            assert sum(r["evicted_per_layer"].values()) == r["evicted"]
    bytes_by_capacity = {r["capacity"]: r["bytes"] for r in runs if r["policy"] == "oldest"}
    assert bytes_by_capacity[20] * 2 == bytes_by_capacity[40]
    records = [json.loads(line) for line in
               sweep[1].file("metrics.jsonl").read_text().splitlines()]
    assert len(records) == 5 * 3  # 3 evaluations per run
    assert {(r["policy"], r["capacity"]) for r in records} == {
        (r["policy"], r["capacity"]) for r in runs}


def test_tables_have_a_row_per_run(sweep):
    _, run, _ = sweep
    table = run.file("results.md").read_text()
    assert "| unbounded | — | 192 | 0 |" in table
    assert "| oldest | 20 | 60 | 132 |" in table
    assert "| contribution+merge | 40 | 120 | 72 |" in table
    assert "Machine:" in table and "unknown provenance" in table
    rows = list(csv.DictReader(run.file("results.csv").read_text().splitlines()))
    assert [(r["policy"], r["capacity"]) for r in rows][:2] == [("unbounded", ""),
                                                               ("oldest", "20")]
    assert rows[0]["largest_layer"] == "64" and rows[1]["largest_layer"] == "20"
    assert set(rows[0]) == {"policy", "capacity", "entries", "largest_layer", "evicted",
                            "store_bytes",
                            "test_acc_pct", "test_loss", "train_seconds", "eval_seconds",
                            "wall_seconds"}  # fmt: skip
    assert 0 <= float(rows[1]["test_acc_pct"]) <= 100


def test_load_data_subsets_like_cifar10(data_dir):
    data = load_data(MemoryBudgetConfig(train_size=10, test_size=5, data_dir=str(data_dir)))
    assert data.x_train.shape == (10, 3072) and data.x_test.shape == (5, 3072)
    with pytest.raises(ValueError, match="train_size 100 is larger than the 64 images"):
        load_data(MemoryBudgetConfig(train_size=100, data_dir=str(data_dir)))


def test_quick_is_small():
    quick = MemoryBudgetConfig.quick(seed=2)
    assert quick.train_size <= 500 and max(quick.capacities) < quick.train_size
    assert quick.seed == 2 and quick.policies == MemoryBudgetConfig().policies
    assert len(quick.budgets()) == 1 + len(quick.policies) * len(quick.capacities)
    assert quick.budgets()[0] is None


def test_slack_is_a_fraction_of_each_capacity():
    cfg = MemoryBudgetConfig(capacities=(1000, 8, 1), policies=("oldest",), slack=0.25,
                             unbounded=False)
    assert [(b.capacity, b.slack) for b in cfg.budgets()] == [(1, 0), (8, 2), (1000, 250)]


@pytest.mark.parametrize(("settings", "message"), [
    ({"model": "mlp-adam"}, "model must be one of \\['gws', 'gauge', 'rbf', 'hybrid'\\]"),
    ({"capacities": ()}, "give at least one"),
    ({"policies": []}, "give at least one"),
    ({"capacities": (10, 10)}, "capacities must not repeat"),
    ({"capacities": (0,)}, "must be an int >= 1, got 0"),
    ({"capacities": (0.5,)}, "must be an int >= 1, got 0.5"),
    ({"policies": ("lru",)}, "unknown eviction policy 'lru'"),
    ({"policies": ("oldest+zip",)}, "unknown policy 'oldest\\+zip'"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"slack": 1.0}, "slack is a fraction of the capacity"),
    ({"slack": -0.1}, "slack must be a finite number >= 0"),
    ({"train_size": 0}, "train_size must be an int >= 1"),
    ({"eval_every": 0}, "eval_every must be an int >= 1"),
    ({"device": "tpu"}, "device must be one of"),
    ({"dtype": "float16"}, "dtype must be one of"),
], ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))  # fmt: skip
def test_bad_settings_are_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        MemoryBudgetConfig(**settings)


def test_unknown_saved_setting_is_an_error():
    with pytest.raises(ValueError, match="unknown settings \\['budget'\\]"):
        MemoryBudgetConfig.from_dict({"budget": 3})


def test_cli_flags_reach_the_config(tmp_path, monkeypatch):
    """`rcdl reproduce memory-budget` maps its flags onto MemoryBudgetConfig."""
    from rcdl.app import cli, runner

    seen = {}
    monkeypatch.setattr(runner, "run_experiment",
                        lambda spec, cfg, **kw: seen.update(cfg=cfg, kw=kw))
    argv = ["reproduce", "memory-budget", "--quick", "--capacities", "30", "90", "--policies",
            "oldest", "contribution+merge", "--no-unbounded", "--slack", "0.25", "--data-dir",
            str(tmp_path), "--device", "cpu", "--no-progress"]
    assert cli.main(argv) == 0
    cfg = seen["cfg"]
    assert cfg.capacities == (30, 90) and cfg.policies == ("oldest", "contribution+merge")
    assert (cfg.unbounded, cfg.slack, cfg.train_size) == (False, 0.25, 480)
