"""The teacher–student experiment (docs/reference.md §8) end to end at a tiny scale: outputs, the
size-matching rule, the mean ± sd aggregation, and the config's validation."""

import csv
import json

import pytest
import torch

from rcdl.app.experiments.teacher_student import (
    MODELS,
    TeacherStudentConfig,
    build_model,
    make_data,
    run_teacher_student,
)


def _tiny(**overrides):
    settings = {"n_train": 48, "n_test": 24, "d_in": 8, "teacher_width": 16, "mlp_width": 16,
                "seeds": (0, 1), "eval_every": 2, "device": "cpu"}  # fmt: skip
    return TeacherStudentConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    folder, summary = run_teacher_student(_tiny(), out=out, progress=False)
    assert folder.path == out
    return out, summary


def test_run_folder_holds_the_results(run):
    out, summary = run
    for name in ("config.json", "environment.json", "metrics.jsonl", "summary.json",
                 "results.md", "results.csv", "test_mse.png"):  # fmt: skip
        assert (out / name).is_file(), name
    assert (out / "test_mse.png").read_bytes().startswith(b"\x89PNG")
    config = json.loads((out / "config.json").read_text())
    assert TeacherStudentConfig.from_dict(config) == _tiny()
    assert json.loads((out / "summary.json").read_text())["complete"] is True
    assert set(summary["zero_predictor_mse"]) == {"0", "1"}


def test_every_student_sees_the_same_stream_and_is_logged(run):
    out, summary = run
    assert [(r["model"], r["seed"]) for r in summary["runs"]] == [
        (m, s) for s in (0, 1) for m in MODELS
    ]
    for r in summary["runs"]:
        assert r["samples"] == 48 and r["steps"] == 3
        assert [h["samples"] for h in r["history"]] == [0, 32, 48]  # every 2 steps and the end
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2 * 3
    assert {(rec["model"], rec["seed"]) for rec in records} == {
        (m, s) for m in MODELS for s in (0, 1)
    }


def test_parametric_table_matches_the_growing_store(run):
    _, summary = run
    gws, parametric, mlp = summary["runs"][:3]
    assert gws["entries_per_layer"] == [16 + 48] * 3 and gws["parameters"] == 0
    assert gws["entries"] == gws["table_entries"] == 3 * 64
    assert summary["parametric_entries"] == 64
    assert parametric["entries_per_layer"] == gws["entries_per_layer"]
    # two blocks 8 -> 8 and a readout 8 -> 1, each: keys, weighted values, weights
    assert parametric["parameters"] == 2 * 64 * (8 + 8 + 1) + 64 * (8 + 1 + 1)
    assert mlp["entries_per_layer"] is None and mlp["parameters"] > 0


@pytest.mark.parametrize(("overrides", "per_layer"), [
    ({}, 16 + 100), ({"initial_entries": 0}, 100), ({"parametric_entries": 7}, 7),
], ids=["default", "no-initial-entries", "explicit"])  # fmt: skip
def test_size_matching_rule(overrides, per_layer):
    cfg = TeacherStudentConfig(n_train=100, **overrides)
    assert cfg.entries == per_layer
    model, optimizer, grower = build_model("parametric", 0, cfg)
    assert grower is None and isinstance(optimizer, torch.optim.Adam)
    assert [layer.keys.shape[0] for layer in (*model.blocks, model.readout)] == [per_layer] * 3


def test_rows_and_curves_average_the_seeds(run):
    out, summary = run
    for row in summary["rows"]:
        values = [r["test_mse"] for r in summary["runs"] if r["model"] == row["model"]]
        assert row["test_mse"] == pytest.approx(sum(values) / 2)
        assert row["test_mse_sd"] == pytest.approx(abs(values[0] - values[1]) / 2**0.5)
        curve = summary["curves"][row["model"]]
        assert curve["samples"] == [0, 32, 48] and curve["mean"][-1] == pytest.approx(
            row["test_mse"])
    v = summary["verdict"]
    assert v["seeds"] == [0, 1] and set(v["gws_better_on"]) <= {0, 1}
    mse = {(r["model"], r["seed"]): r["test_mse"] for r in summary["runs"]}
    assert v["per_seed_ratio"] == pytest.approx([mse["gws", s] / mse["parametric", s]
                                                 for s in (0, 1)])  # fmt: skip
    assert v["gws_better_on"] == [s for s in (0, 1) if mse["gws", s] < mse["parametric", s]]
    table = (out / "results.md").read_text()
    assert all(f"| {label} | " in table for label in MODELS.values())
    assert " ± " in table and "Machine:" in table and "size-matched" in table
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert [r["model"] for r in rows] == list(MODELS) and rows[2]["entries_per_layer"] == ""


def test_seed_fixes_the_task_and_the_students():
    cfg = _tiny()
    a, b, c = make_data(cfg, 0), make_data(cfg, 0), make_data(cfg, 1)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert not (a[1] == c[1]).all()
    for name in MODELS:
        m0, m1 = build_model(name, 3, cfg)[0], build_model(name, 3, cfg)[0]
        assert all((p == q).all() for p, q in zip(m0.state_dict().values(),
                                                  m1.state_dict().values(), strict=True))


def test_quick_and_from_dict():
    quick = TeacherStudentConfig.quick(seeds=[4])
    assert quick.n_train < TeacherStudentConfig().n_train and quick.seeds == (4,)
    assert TeacherStudentConfig.from_dict({"seeds": [1, 2]}).seeds == (1, 2)
    with pytest.raises(ValueError, match=r"unknown settings \['epochs'\]"):
        TeacherStudentConfig.from_dict({"epochs": 2})


@pytest.mark.parametrize(("overrides", "message"), [
    ({"n_train": 0}, "n_train must be an int >= 1"),
    ({"d_in": 2.0}, "d_in must be an int >= 1"),
    ({"teacher_depth": True}, "teacher_depth must be an int >= 1"),
    ({"initial_entries": -1}, "initial_entries must be an int >= 0"),
    ({"parametric_entries": 0}, "parametric_entries must be an int >= 1"),
    ({"temperature": 0.0}, "temperature must be a finite number > 0"),
    ({"eta": float("nan")}, "eta must be a finite number > 0"),
    ({"parametric_lr": -1e-3}, "parametric_lr must be a finite number > 0"),
    ({"noise": -0.1}, "noise must be a finite number >= 0"),
    ({"teacher_act": "gelu"}, "teacher_act must be one of"),
    ({"seeds": ()}, "at least one seed"),
    ({"seeds": (1, 1)}, "must not repeat"),
    ({"seeds": (-1,)}, "each seed must be an int >= 0"),
    ({"device": "tpu"}, "device must be one of"),
], ids=lambda v: v if isinstance(v, str) else next(iter(v)))  # fmt: skip
def test_config_rejects_bad_settings(overrides, message):
    with pytest.raises(ValueError, match=message):
        TeacherStudentConfig(**overrides)


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match="unknown model 'rbf'; known: gws, parametric, mlp"):
        build_model("rbf", 0, _tiny())


def test_cli_flags_reach_the_config(monkeypatch):
    """`rcdl reproduce teacher-student` maps its flags onto TeacherStudentConfig."""
    from rcdl.app import cli, runner

    seen = {}
    monkeypatch.setattr(runner, "run_experiment",
                        lambda spec, cfg, **kw: seen.update(cfg=cfg, kw=kw))
    argv = ["reproduce", "teacher-student", "--quick", "--seeds", "3", "4", "--beta", "2",
            "--device", "cpu", "--no-progress"]
    assert cli.main(argv) == 0
    assert seen["cfg"].seeds == (3, 4) and seen["cfg"].beta == 2.0
    assert "download" not in seen["kw"]
