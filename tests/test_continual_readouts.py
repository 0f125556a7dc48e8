"""rcdl reproduce continual --readouts: the trained RBF readout read out in other ways
(rcdl.app.experiments.continual.analysis.readouts), its table, its JSON and its config."""

from __future__ import annotations

import functools
import json

import pytest

from rcdl.app.cli import main
from rcdl.app.experiments.continual import ContinualConfig, ReadoutsConfig
from rcdl.app.experiments.continual.spec import READOUTS, saved_config


def _run(data_dir, out, *extra):  # noqa: ANN001, ANN002, ANN202
    assert main(["reproduce", "continual", "--models", "rbf", "--orders", "0", "--seeds", "0",
                 "--classes-per-task", "5", "--train-size", "48", "--test-size", "24",
                 "--data-dir", str(data_dir), "--out", str(out), "--no-progress", "--device",
                 "cpu", *extra]) == 0
    return (json.loads((out / "summary.json").read_text()),
            json.loads((out / "config.json").read_text()))


def test_readouts_read_the_trained_readout_and_are_recorded(data_dir, tmp_path, monkeypatch):
    from rcdl.app import models as zoo

    # the RBF net's hidden layers at width 64 (the readout is the same kind of layer)
    monkeypatch.setattr(zoo, "GrowingRBFNet", functools.partial(zoo.GrowingRBFNet, width=64))
    summary, config = _run(data_dir, tmp_path / "readouts", "--readouts", *READOUTS)
    run = next(r for r in summary["runs"] if r["order"] == "0")
    read = run["readouts"]
    assert set(read) == {*READOUTS, "task_identified"}
    # as trained is the model's own answer: the final accuracy the run recorded
    assert read["as-trained"] == run["acc"]
    assert all(0 <= v <= 100 for v in read.values())
    assert "readouts" not in next(r for r in summary["runs"] if r["order"] == "iid")
    assert config["readouts"] == list(READOUTS)  # the resolved config names them
    assert type(ContinualConfig.from_dict(config)) is ReadoutsConfig  # resumed as asked
    saved = json.loads((tmp_path / "readouts" / "readouts.json").read_text())
    assert saved["results"]["rbf"]["sharper-kernel"] == [read["sharper-kernel"]]
    assert {r["readout"] for r in summary["readouts"]} == set(read)
    assert "Other readouts of the trained readout" in (
        tmp_path / "readouts" / "results.md").read_text()


def test_readouts_need_an_rbf_readout_and_a_plain_config_saves_without_them():
    with pytest.raises(ValueError, match="no model of .'gws'. has one"):
        ReadoutsConfig(models=("gws",), readouts=("task-inference",))
    with pytest.raises(ValueError, match="unknown readouts"):
        ReadoutsConfig(models=("rbf",), readouts=("nearest",))
    assert type(saved_config(ReadoutsConfig(models=("rbf",)))) is ContinualConfig
    asked = ReadoutsConfig(models=("rbf+labels",), readouts=("as-trained",))
    assert saved_config(asked) is asked
