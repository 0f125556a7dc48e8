"""rcdl reproduce single-model-attribution: removal sets forgotten exactly by replay, and every
method's single-model LDS against those exact changes."""

from __future__ import annotations

import json

import pytest
import torch

from rcdl.app.cli import main
from rcdl.app.experiments.single_model import (
    SingleModelConfig,
    method_scores,
    removal_sets,
    single_model_lds,
    train_with_holes,
)
from rcdl.app.recipes import train_with_learners
from rcdl.nn.layers import growing_layers

PNG = b"\x89PNG"


def test_removal_sets_are_distinct_draws_of_the_fraction():
    sets = removal_sets(200, 0.05, 6, seed=1)  # (6, 10)
    assert sets.shape == (6, 10)
    assert all(len(s.unique()) == 10 and int(s.max()) < 200 for s in sets)
    assert len({tuple(s.tolist()) for s in sets}) == 6
    assert torch.equal(sets, removal_sets(200, 0.05, 6, seed=1))  # reproducible
    assert not torch.equal(removal_sets(200, 0.02, 6, seed=1)[:, :4], sets[:, :4])


def test_the_lds_is_one_for_the_exact_changes_and_minus_one_reversed():
    exact = torch.randn(8, 5, dtype=torch.float64)  # (M, T)
    assert single_model_lds(exact, exact) == pytest.approx(1.0)
    assert single_model_lds(2 * exact + 1, exact) == pytest.approx(1.0)  # ranks only
    assert single_model_lds(-exact, exact) == pytest.approx(-1.0)


def test_a_fraction_that_removes_nothing_is_refused():
    with pytest.raises(ValueError, match="removes no image"):
        SingleModelConfig(train_size=50, fractions=(0.001,)).check()
    with pytest.raises(ValueError, match="no growing layers"):
        SingleModelConfig(models=("mlp-adam",)).check()


def test_the_command_scores_every_method_against_exact_replay(data_dir, tmp_path):
    out = tmp_path / "run"
    argv = ["reproduce", "single-model-attribution", "--quick", "--models", "rbf",
            "--train-size", "32", "--test-size", "16", "--fractions", "0.0625", "--sets", "3",
            "--positions", "2", "--oracle", "--data-dir", str(data_dir), "--out", str(out),
            "--device", "cpu", "--no-progress", "--no-download"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["model"]: r for r in summary["runs"]}
    assert set(runs) == {"rbf"}
    r = runs["rbf"]
    assert r["set_size"] == 2 and r["sets"] == 3 and r["mean_abs_change"] > 0
    assert all(-1 <= m["lds"] <= 1 and m["seconds"] > 0 for m in r["methods"].values())
    assert "readout cascade" in runs["rbf"]["methods"]
    assert {"forget", "repair", "repair+keys"} <= set(runs["rbf"]["methods"])
    # removing a set lowers the margins of the test images its entries supported: the
    # readout's shares predict the exact changes better than chance on RBF
    assert runs["rbf"]["methods"]["readout cascade"]["lds"] > 0.2
    # the first and the last image of the stream, each forgotten alone
    assert [(p["position"], p["after"]) for p in r["spread"]] == [(0, 1.0), (31, 1 - 31 / 32)]
    assert all(p["mean_abs_change"] > 0 for p in r["spread"])
    for figure in ("single_model_lds.png", "spread.png"):
        assert (out / figure).read_bytes().startswith(PNG)
    # with the batches kept, an RBF net's removal effects add up: the sum of each image's
    # own exact change predicts the set's
    assert r["methods"]["exact single-image changes, summed"]["lds"] > 0.9
    assert "| rbf | 6.25 % (2) | readout cascade |" in (out / "results.md").read_text()


@pytest.mark.parametrize("name", ["rbf", "gws"])
def test_training_with_no_holes_is_the_one_pass_training(name):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3072, generator=gen), torch.randint(0, 10, (40,), generator=gen)
    model = train_with_learners(name, 0, x, y, (x[:1], y[:1]))[0]
    again = train_with_holes(name, 0, x, y, torch.tensor([], dtype=torch.long),
                             batch_size=16, device=torch.device("cpu"))
    holed = train_with_holes(name, 0, x, y, torch.tensor([3]), batch_size=16,
                             device=torch.device("cpu"))
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert sum(len(layer.store) for _, layer in growing_layers(holed)) < sum(
        len(layer.store) for _, layer in growing_layers(model))


def test_a_normalised_readout_gets_no_cascade():
    """The cascade needs a readout that does not normalise: gws's is a weighted softmax."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3072, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    model, *_ = train_with_learners("gws", 0, x, y, (x[:1], y[:1]))
    scores, seconds = method_scores(model, x[:4], y[:4], 16, batch_size=4,
                                    device=torch.device("cpu"))
    assert set(scores) == set(seconds) == {"shares, all layers", "readout shares",
                                           "readout deletion"}
    assert all(s.shape == (4, 16) for s in scores.values())


def test_a_non_finite_loss_while_retraining_with_holes_is_refused(monkeypatch):
    """A step with a non-finite loss is skipped by train_step; the retraining says so rather
    than return a model that silently missed it."""
    from rcdl.app.experiments import single_model

    monkeypatch.setattr(single_model, "train_step", lambda *args: float("nan"))
    x, y = torch.randn(20, 3072), torch.randint(0, 10, (20,))
    with pytest.raises(FloatingPointError, match="rbf without 1 images: training loss is nan"):
        train_with_holes("rbf", 0, x, y, torch.tensor([2]), batch_size=16,
                         device=torch.device("cpu"))
