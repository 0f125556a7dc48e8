"""``rcdl reproduce attribution``: the linear datamodeling score, mislabel detection and the
explanations figure, at tiny sizes; on an easy synthetic CIFAR-10 where the truth is known,
the measurements find it."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from rcdl.app.cifar import CIFAR10_MEAN, CIFAR10_STD, standardize
from rcdl.app.cli import main
from rcdl.app.experiments import attribution as attribution_exp
from rcdl.app.experiments.attribution import (
    COLUMNS,
    AttributionConfig,
    auc,
    found_in_top,
    half_masks,
    spearman,
    to_pixels,
)

PNG = b"\x89PNG\r\n\x1a\n"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck")  # fmt: skip


@pytest.fixture(scope="module")
def easy_dir(tmp_path_factory):
    """A CIFAR-10 in the npz layout whose classes are easy to tell apart: each image is its
    class's random pattern plus noise (200 train / 40 test images)."""
    folder = tmp_path_factory.mktemp("easy")
    rng = np.random.default_rng(1)
    patterns = rng.integers(0, 256, (10, 32, 32, 3))

    def images(n):
        y = rng.permutation(np.arange(n) % 10)
        x = np.clip(patterns[y] + rng.normal(0, 40, (n, 32, 32, 3)), 0, 255)
        return x.astype(np.uint8), y.astype(np.int64)

    (x_train, y_train), (x_test, y_test) = images(200), images(40)
    np.savez(folder / "cifar10.npz", x_train=x_train, y_train=y_train, x_test=x_test,
             y_test=y_test, class_names=np.array(CLASSES))
    return folder


def run(out, data, *flags):
    argv = ["reproduce", "attribution", "--quick", *flags, "--data-dir", str(data), "--out",
            str(out), "--device", "cpu", "--no-progress", "--no-download"]
    assert main(argv) == 0
    return json.loads((out / "summary.json").read_text())


def lds_of(summary, model):
    return next(r["variants"] for r in summary["runs"]
                if r["model"] == model and r["measurement"] == "lds")


# --------------------------------------------------------------------------- the command


def test_the_command_writes_tables_and_figures_and_resumes(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    summary = run(out, data_dir, "--train-size", "64", "--test-size", "32", "--halves", "3",
                  "--halves-per-sub-run", "2", "--shown", "3", "--top", "4")
    assert summary["complete"]
    names = [f"{m}-{s}" for m in ("gws", "rbf")
             for s in ("lds-full", "lds-halves-0", "lds-halves-2", "lds", "mislabel")]
    assert list(json.loads((out / "finished.json").read_text())) == names
    for figure in ("explanations.png", "attribution.png"):
        assert (out / figure).read_bytes().startswith(PNG)
    for name in ("gws", "rbf"):
        assert torch.load(out / f"lds-{name}-margins-2.pt").shape == (1, 32)  # the 3rd half
        assert torch.load(out / f"lds-{name}-predicted.pt").shape == (3, 3, 32)
        variants = lds_of(summary, name)
        assert set(variants) == {"all layers", "readout", "readout deletion"}
        assert all(-1 <= v["lds"] <= 1 and v["test_images"] == 32 for v in variants.values())
    full = next(r for r in summary["runs"] if r["measurement"] == "lds-full")
    assert len(full["shown"]) == 3
    for row in full["shown"]:  # the top training images, largest contribution first
        assert len(row["samples"]) == 4 and row["contributions"] == sorted(
            row["contributions"], reverse=True)
    mislabel = next(r for r in summary["runs"] if r["measurement"] == "mislabel")
    assert mislabel["flipped"] == 6 and set(mislabel["rankings"]) == set(
        attribution_exp.RANKINGS)
    report = (out / "results.md").read_text()
    for text in ("## Linear datamodeling score", "## Mislabel detection", "TRAK-10, MNIST MLP 0.33",
                 "TRAK-50, MNIST MLP 0.45", "TRAK-50, CIFAR-2 ResNet-9 0.37", "80 % / 97 %",
                 "ROC-AUC 0.67", summary["data"]["provenance"], "## Targets",
                 "- gws, LDS: best", "against the target 0.30", "- rbf, mislabels: best ROC-AUC"):
        assert text in report, text
    with open(out / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == COLUMNS
    assert [(r["measurement"], r["model"], r["scores"]) for r in table][:4] == [
        ("lds", "gws", "all layers"), ("lds", "gws", "readout"),
        ("lds", "gws", "readout deletion"), ("mislabel", "gws", "self-influence")]
    capsys.readouterr()
    assert main(["reproduce", "attribution", "--resume", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.count("finished in an earlier session, skipped") == 10


def test_an_interrupted_run_resumes_to_the_numbers_of_an_uninterrupted_one(
        data_dir, tmp_path, monkeypatch):
    flags = ("--models", "rbf", "--measurements", "lds", "--train-size", "48", "--test-size",
             "24", "--halves", "4", "--halves-per-sub-run", "2", "--shown", "0")
    whole = run(tmp_path / "whole", data_dir, *flags)
    real = attribution_exp.lds_halves

    def interrupted(name, first, *args):
        if first == 2:
            raise KeyboardInterrupt
        return real(name, first, *args)

    monkeypatch.setattr(attribution_exp, "lds_halves", interrupted)
    out = tmp_path / "interrupted"
    argv = ["reproduce", "attribution", "--quick", *flags, "--data-dir", str(data_dir),
            "--out", str(out), "--device", "cpu", "--no-progress", "--no-download"]
    assert main(argv) == 130
    assert list(json.loads((out / "finished.json").read_text())) == [
        "rbf-lds-full", "rbf-lds-halves-0"]
    monkeypatch.setattr(attribution_exp, "lds_halves", real)
    assert main(["reproduce", "attribution", "--resume", str(out), "--no-progress"]) == 0
    resumed = json.loads((out / "summary.json").read_text())
    assert lds_of(resumed, "rbf") == lds_of(whole, "rbf")
    assert not (out / "explanations.png").exists()  # --shown 0: nothing to show


def test_rbf_scores_predict_retraining_where_the_classes_are_easy(easy_dir, tmp_path):
    """Each test image's margin rests on the training images of its class: how many of
    them a half holds is what RBF's summed scores see."""
    summary = run(tmp_path / "run", easy_dir, "--models", "rbf", "--measurements", "lds",
                  "--train-size", "200", "--test-size", "40", "--halves", "8",
                  "--halves-per-sub-run", "8", "--shown", "2")
    for variant in lds_of(summary, "rbf").values():
        assert variant["lds"] > 0.2, variant
    full = next(r for r in summary["runs"] if r["measurement"] == "lds-full")
    for row in full["shown"]:  # an easy image rests on training images of its class
        assert row["predicted"] == row["label"]
        assert row["sample_labels"][0] == row["label"]


def test_self_influence_finds_flipped_labels_where_the_classes_are_easy(easy_dir, tmp_path):
    summary = run(tmp_path / "run", easy_dir, "--models", "rbf", "--measurements",
                  "mislabel", "--train-size", "200", "--test-size", "40", "--shown", "0")
    (result,) = summary["runs"]
    assert result["flipped"] == 20
    found = result["rankings"]
    assert found["self-influence"]["roc_auc"] > 0.8
    assert found["self-influence"]["roc_auc"] > found["random"]["roc_auc"] + 0.2
    assert found["self-influence"]["found_top20"] > 0.5
    assert found["self-influence"]["curve"][-1] == 1.0  # everything inspected: all found


# --------------------------------------------------------------------------- the pieces


def test_spearman_auc_and_found_in_top_on_known_rankings():
    a = torch.tensor([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0], [4.0, 0.0]])  # (M, T)
    assert spearman(a, a).tolist() == pytest.approx([1.0, 1.0])
    assert spearman(a, a[:, [1, 0]]).tolist() == pytest.approx([-1.0, -1.0])
    scores = torch.tensor([0.9, 0.8, 0.1, 0.2, 0.3])
    positive = torch.tensor([True, True, False, False, False])
    assert auc(scores, positive) == 1.0 and auc(-scores, positive) == 0.0
    assert found_in_top(scores, positive, 0.2) == 0.5
    with pytest.raises(ValueError, match="positives and negatives"):
        auc(scores, torch.zeros(5, dtype=torch.bool))


def test_halves_are_half_of_the_samples_and_drawn_from_the_seed():
    masks = half_masks(11, 6)
    assert masks.shape == (6, 11) and masks.sum(1).tolist() == [5] * 6
    assert torch.equal(masks, half_masks(11, 6)) and not torch.equal(masks, half_masks(11, 6,
                                                                                       seed=2))
    assert torch.equal(half_masks(11, 3), masks[:3])  # a sub-run's halves are the run's


def test_to_pixels_undoes_standardisation():
    images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    x = standardize(images, CIFAR10_MEAN, CIFAR10_STD)
    assert torch.equal(to_pixels(x, CIFAR10_MEAN, CIFAR10_STD), torch.from_numpy(images))


def test_config_refuses_what_cannot_be_measured():
    with pytest.raises(ValueError, match="no growing layers"):
        AttributionConfig(models=("mlp-adam",))
    with pytest.raises(ValueError, match="flips 0"):
        AttributionConfig(train_size=5, flip=0.1)
    AttributionConfig(train_size=5, flip=0.1, measurements=("lds",))  # no flips needed
    with pytest.raises(ValueError, match="shown"):
        AttributionConfig(test_size=4)


@pytest.mark.parametrize("kind", ["rbf", "gws"])
def test_readout_deletion_scores_are_minus_the_logits_change_from_deleting(kind):
    """float64: a sample's "readout deletion" score is minus the change of the explained
    logit when its readout entries alone are deleted; for RBF it equals the readout's share."""
    import copy

    from tiny_nets import tiny_net, train_with_samples

    net = tiny_net(kind, 6, 3, gws_rule=(0.5, 2.0))
    train_with_samples(net, torch.randn(16, 6, dtype=torch.float64), torch.arange(16) % 3, 4)
    probe, target = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    scores = attribution_exp.attribution_scores(net, probe, target, 16)
    net.eval()
    with torch.no_grad():
        base = net(probe).gather(1, target[:, None]).squeeze(1)
    for i in (0, 5, 13):
        deleted = copy.deepcopy(net)
        owners = deleted.readout.provenance.of(deleted.readout.store.ids)
        deleted.readout.remove_entries(owners == i)
        with torch.no_grad():
            after = deleted(probe).gather(1, target[:, None]).squeeze(1)
        torch.testing.assert_close(scores["readout deletion"][:, i], base - after)
    if kind == "rbf":
        torch.testing.assert_close(scores["readout deletion"], scores["readout"])


def test_targets_say_met_or_not_met_for_the_best_score():
    rows = [{"model": "rbf", "measurement": "lds", "scores": "readout", "lds": 0.46},
            {"model": "rbf", "measurement": "lds", "scores": "all layers", "lds": 0.40},
            {"model": "gws", "measurement": "lds", "scores": "readout", "lds": 0.10},
            {"model": "gws", "measurement": "mislabel", "scores": "random", "roc_auc": 0.99,
             "found_top10": 0.99},
            {"model": "gws", "measurement": "mislabel", "scores": "training loss",
             "roc_auc": 0.85, "found_top10": 0.50}]
    assert attribution_exp.targets(rows) == [
        "- rbf, LDS: best 0.460 (the readout's exact shares alone) against the target 0.45: met",
        "- gws, LDS: best 0.100 (the readout's exact shares alone) against the target 0.30: "
        "not met",
        "- gws, mislabels: best ROC-AUC 0.850 (training loss), 50 % of the flipped labels in "
        "its top 10 %, against ROC-AUC 0.80 with 60 %: not met"]


@pytest.mark.parametrize("kind", ["rbf", "gws"])
def test_leave_one_out_vote_is_the_vote_of_a_readout_without_the_images_entries(kind):
    import copy

    from rcdl.app.experiments.continual.baselines import LabelVote
    from rcdl.memory.provenance import entry_samples
    from tiny_nets import tiny_net, train_with_samples

    torch.manual_seed(3)
    x, y = torch.randn(18, 6, dtype=torch.float64), torch.randint(0, 3, (18,))
    net = tiny_net(kind, 6, 3)
    train_with_samples(net, x, y, batch=3)
    found = attribution_exp.leave_one_out_vote_margins(net, x, y, sharpness=2.0, batch_size=7)
    for i in range(len(x)):
        without = copy.deepcopy(net)
        without.readout.store.remove(entry_samples(without.readout) == i)
        scores = LabelVote(without, y, sharpness=2.0)(x[i:i + 1])[0].double()  # (C,)
        others = torch.cat([scores[:y[i]], scores[y[i] + 1:]])
        torch.testing.assert_close(found[i], scores[y[i]] - others.logsumexp(0))


# --------------------------------------------------------------------------- the options


def test_the_cascade_option_adds_its_lds_for_rbf_and_notes_gws_refused(data_dir, tmp_path):
    """``--cascade``: the readout cascade's two scores join RBF's LDS (one more sub-run,
    the default ones unchanged); gws's softmax readout is refused with its reason."""
    out = tmp_path / "run"
    summary = run(out, data_dir, "--cascade", "--measurements", "lds", "--train-size", "24",
                  "--test-size", "12", "--halves", "2", "--shown", "0")
    assert list(json.loads((out / "finished.json").read_text())) == [
        f"{m}-{s}" for m in ("gws", "rbf") for s in ("lds-full", "lds-halves-0", "lds",
                                                     "lds-cascade")]
    cascade = {r["model"]: r for r in summary["runs"] if r["measurement"] == "lds-cascade"}
    assert "does not normalise" in cascade["gws"]["refused"]
    variants = cascade["rbf"]["variants"]
    assert set(variants) == set(attribution_exp.CASCADE_VARIANTS)
    assert all(-1 <= v["lds"] <= 1 and v["test_images"] <= 12 for v in variants.values())
    rbf = [r["scores"] for r in summary["rows"] if r["model"] == "rbf"]
    assert rbf == [*attribution_exp.VARIANTS, *attribution_exp.CASCADE_VARIANTS]
    assert [r["scores"] for r in summary["rows"] if r["model"] == "gws"] == list(
        attribution_exp.VARIANTS)
    report = (out / "results.md").read_text()
    assert "No readout cascade for gws" in report and "rcdl.readout_cascade" in report


def test_the_seed_ceiling_option_retrains_each_half_with_a_second_seed(data_dir, tmp_path):
    out = tmp_path / "run"
    summary = run(out, data_dir, "--seed-ceiling", "--models", "rbf", "--measurements", "lds",
                  "--train-size", "32", "--test-size", "16", "--halves", "3",
                  "--halves-per-sub-run", "2", "--shown", "0")
    assert list(json.loads((out / "finished.json").read_text())) == [
        "rbf-lds-full", "rbf-lds-halves-0", "rbf-lds-halves-2", "rbf-lds-again-0",
        "rbf-lds-again-2", "rbf-lds", "rbf-lds-ceiling"]
    first = torch.cat([torch.load(out / f"lds-rbf-margins-{k}.pt") for k in (0, 2)])
    again = torch.cat([torch.load(out / f"lds-rbf-again-{k}.pt") for k in (0, 2)])
    assert first.shape == again.shape == (3, 16) and not torch.equal(first, again)
    (ceiling,) = [r for r in summary["rows"] if r["scores"] == "seed ceiling"]
    found = spearman(again, first)
    assert ceiling["lds"] == pytest.approx(float(found[torch.isfinite(found)].mean()))
    assert "The seed ceiling" in (out / "results.md").read_text()


def test_the_trak_option_names_the_extra_when_dattri_is_missing(data_dir, tmp_path,
                                                                 monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "dattri", None)  # as if not installed
    argv = ["reproduce", "attribution", "--quick", "--trak", "--models", "rbf",
            "--measurements", "lds", "--train-size", "32", "--test-size", "16", "--halves",
            "2", "--shown", "0", "--data-dir", str(data_dir), "--out", str(tmp_path / "run"),
            "--device", "cpu", "--no-progress", "--no-download"]
    assert main(argv) != 0
    assert "pip install 'rcdl[peers]'" in capsys.readouterr().err
