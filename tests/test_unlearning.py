"""rcdl reproduce unlearning: forget sets, the membership-inference score, and the command."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from rcdl.app.cli import main
from rcdl.app.experiments.unlearning import (
    UnlearningConfig,
    combine_runs,
    forget_indices,
    mia_score,
    rows,
)


def test_random_forget_set_is_the_share_asked_for_drawn_from_the_seed():
    y = torch.arange(200) % 10
    cfg = UnlearningConfig(forget_fraction=0.1)
    a, b, c = (forget_indices("random", y, cfg, seed) for seed in (0, 0, 1))
    assert len(a) == 20 and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, a.sort().values) and len(a.unique()) == 20


def test_class_forget_set_is_every_image_of_the_class():
    y = torch.tensor([3, 0, 3, 1, 3])
    idx = forget_indices("class", y, UnlearningConfig(forget_class=3), 0)
    assert idx.tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="unknown scenario"):
        forget_indices("half", y, UnlearningConfig(), 0)


@pytest.mark.extra("classical")
def test_mia_is_chance_on_one_distribution_and_certain_on_separated_ones():
    g = torch.Generator().manual_seed(0)
    same = mia_score(torch.rand(400, generator=g), torch.rand(400, generator=g))
    assert 0.4 < same < 0.6
    apart = mia_score(torch.rand(300, generator=g), 2 + torch.rand(500, generator=g))
    assert apart > 0.99


def test_config_refuses_what_cannot_be_forgotten():
    with pytest.raises(ValueError, match="classical"):
        UnlearningConfig(models=("knn-l2",))
    with pytest.raises(ValueError, match="below 1"):
        UnlearningConfig(forget_fraction=1.0)
    with pytest.raises(ValueError, match="0-9"):
        UnlearningConfig(forget_class=10)


@pytest.mark.extra("classical")
def test_the_command_forgets_what_the_samples_wrote_and_reports(data_dir, tmp_path,
                                                               monkeypatch):
    from rcdl.app import models as zoo

    # the ResNet-MLP's blocks at width 64 (at the paper's 3 072 its trainings take minutes)
    monkeypatch.setattr(zoo, "ResNetMLP", functools.partial(zoo.ResNetMLP, width=64))
    out = tmp_path / "run"
    main(["reproduce", "unlearning", "--quick", "--models", "rbf", "mlp-sgd",
          "--train-size", "64", "--test-size", "32", "--retain-eval-size", "32",
          "--forget-fraction", "0.25", "--data-dir", str(data_dir), "--out", str(out),
          "--no-progress", "--device", "cpu"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"]
    assert {"results.md", "results.csv", "unlearning.png"} <= {p.name for p in out.iterdir()}
    by_model = {r["model"]: r for r in summary["runs"]}
    rbf = by_model["rbf"]["scenarios"]["random"]
    assert rbf["forget_size"] == 16
    forgotten = rbf["variants"]["forget"]
    # one entry per forgotten image in each of the RBF net's three layers
    assert forgotten["removed"] == {name: 16 for name in forgotten["removed"]}
    assert len(forgotten["removed"]) == 3
    # random labels: the original recalls its training images through their own entries,
    # and forgetting them takes that recall away, as retraining without them does
    original, retrained = rbf["variants"]["original"], rbf["variants"]["retrain"]
    assert original["forget_acc"] > forgotten["forget_acc"] + 30
    assert abs(forgotten["forget_acc"] - retrained["forget_acc"]) < 30
    # exact forgetting is retraining on the stream without the images, bit for bit
    for scenario in ("random", "class"):
        variants = by_model["rbf"]["scenarios"][scenario]["variants"]
        assert variants["exact"]["equals_retrain"]
        assert {k: variants["exact"][k] for k in ("forget_acc", "retain_acc", "test_acc")} == {
            k: variants["retrain"][k] for k in ("forget_acc", "retain_acc", "test_acc")}
        assert variants["exact"]["receipt"]["scan"]["clean"]
        # the fast mode: removed everywhere, the readout re-written, nothing left
        for fast in ("repair", "repair+keys"):
            receipt = variants[fast]["receipt"]
            assert receipt["removed"] == variants["forget"]["receipt"]["removed"]
            assert any("re-wrote" in note for note in receipt["released"]["readout"])
            assert receipt["scan"]["clean"]
        assert any("recomputed" in note
                   for note in variants["repair+keys"]["receipt"]["released"]["readout"])
    assert "bit for bit as *retrain* did in 2 of 2" in (out / "results.md").read_text()
    assert set(by_model["mlp-sgd"]["scenarios"]["class"]["variants"]) == {
        "original", "fine-tune", "retrain"}
    cfg = UnlearningConfig.from_dict(json.loads((out / "config.json").read_text()))
    table = rows(cfg, summary["runs"])
    assert {(r["scenario"], r["model"], r["variant"]) for r in table} >= {
        ("random", "rbf", "forget"), ("class", "mlp-sgd", "fine-tune")}
    assert "MIA" in (out / "results.md").read_text()


@pytest.mark.extra("classical")
def test_combine_merges_seeds_run_apart_and_refuses_a_seed_twice(data_dir, tmp_path):
    common = ["--quick", "--models", "gws", "--scenarios", "random", "--train-size", "48",
              "--test-size", "24", "--retain-eval-size", "24", "--data-dir", str(data_dir),
              "--no-progress", "--device", "cpu"]
    for seed in (0, 1):
        main(["reproduce", "unlearning", *common, "--seeds", str(seed), "--out",
              str(tmp_path / f"s{seed}")])
    out = tmp_path / "both"
    assert main(["reproduce", "unlearning", "--combine", str(tmp_path / "s0"),
                 str(tmp_path / "s1"), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(r["seed"] for r in summary["runs"]) == [0, 1]
    assert {r["seeds"] for r in summary["rows"]} == {2}
    assert "Combined from these run folders" in (out / "results.md").read_text()
    with pytest.raises(ValueError, match="gws seed 0 finished in both"):
        combine_runs([tmp_path / "s0", tmp_path / "s0"], tmp_path / "twice")
