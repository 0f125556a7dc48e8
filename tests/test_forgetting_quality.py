"""The unlearning challenge's forgetting quality (rcdl.app.experiments.forgetting_quality):
the metric on populations with known answers, and the command, where the original model's
memory of the forgotten images is seen and exact forgetting's is not."""

import json
import math

import pytest
import torch

from rcdl.app.cli import main
from rcdl.app.experiments.forgetting_quality import (
    example_epsilons,
    forgetting_quality,
    score_examples,
)


def populations(shift=0.0, n=64, s=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, s, generator=g) + shift, torch.randn(n, s, generator=g)


def test_the_metric_scores_one_for_identical_outputs_and_falls_as_they_part():
    u, r = populations()
    assert forgetting_quality(u, u.clone())[0] == 1.0
    same, _ = forgetting_quality(u, r)  # one distribution, sampling noise only
    shifted, _ = forgetting_quality(*populations(1.0))
    apart, eps = forgetting_quality(*populations(100.0))
    assert 0.2 < same < 0.5 and shifted < same / 3
    assert apart == 2.0 / 2**13 and bool(torch.isinf(eps).all())  # perfectly separated


def test_epsilon_matches_the_formula_for_one_threshold():
    # one example, 4 models a side: unlearned losses above every retrained one but one
    u = torch.tensor([[5.0], [6.0], [7.0], [0.5]])
    r = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    eps = example_epsilons(u, r)
    # the threshold 4 calls 3 of 4 unlearned right (FNR 1/4) and no retrained wrong (FPR 0):
    # left out; the threshold 3: FPR 1/4, FNR 1/4 -> log(0.74) - log(0.25)
    best = math.log(1 - 0.01 - 0.25) - math.log(0.25)
    assert eps.item() == pytest.approx(best)
    assert score_examples(torch.tensor([0.0, 0.49, 0.5, 1.2, math.inf])).tolist() == [
        1.0, 1.0, 0.5, 0.25, 2.0 / 2**13]


def test_the_command_scores_exact_forgetting_above_the_original(data_dir, tmp_path):
    out = tmp_path / "run"
    main(["reproduce", "forgetting-quality", "--quick", "--models", "rbf", "--train-size",
          "64", "--test-size", "32", "--models-per-side", "6", "--data-dir", str(data_dir),
          "--out", str(out), "--no-progress", "--device", "cpu"])
    summary = json.loads((out / "summary.json").read_text())
    methods = summary["runs"][0]["methods"]
    assert set(methods) == {"original", "forget", "repair", "repair+keys", "exact"}
    assert methods["original"]["F"] < methods["repair"]["F"]
    # the original still holds the forgotten images' entries: attacks see it at once
    assert methods["original"]["F"] < methods["exact"]["F"]
    assert methods["forget"]["seconds"] < methods["exact"]["seconds"]
    assert "forgetting quality" in (out / "results.md").read_text().lower()
