"""rcdl reproduce cifar10-1epoch --bf16-effect: the hybrid's bfloat16 diagnostics
(rcdl.app.experiments.cifar10.bf16_effects) change its training for one run only, are
undone after it, and are recorded in the run's config."""

from __future__ import annotations

import json

import pytest

from rcdl.app.cli import main
from rcdl.app.experiments.cifar10 import Cifar10Config, DiagnosticConfig
from rcdl.app.experiments.cifar10.bf16_effects import (
    HALF_STORE,
    VARIANTS,
    bf16_effect,
    compare_entry_grads,
)
from rcdl.app.experiments.cifar10.config import saved_config


def _library_functions() -> dict[str, object]:
    """Every function a variant may replace, as the library defines it."""
    import rcdl.ops.plan as plan
    import rcdl.optim.entry_adam as entry_adam
    import rcdl.optim.half_adam as half_adam
    import rcdl.train.loop as loop
    from rcdl.nn.hybrid import HybridSoftmax
    from rcdl.optim.entry_adam import EntryMoments
    from rcdl.optim.hybrid_grower import HybridGrower

    return {"evaluate": loop.evaluate, "adam_rows": entry_adam.adam_rows,
            "rounding_noise": half_adam.rounding_noise, "half_adam": half_adam.half_adam_mode(),
            "default_chunk_size": plan.default_chunk_size,
            "take_entry_grads": vars(HybridSoftmax)["take_entry_grads"],
            "entry_leaves": vars(HybridSoftmax)["entry_leaves"],
            "moments_step": vars(EntryMoments)["step"], "grower_step": vars(HybridGrower)["step"]}


@pytest.mark.parametrize("variant", [*VARIANTS, "float32-perturbed-once-step3-seed2"])
def test_each_variant_changes_the_library_within_its_block_and_undoes_it(variant):
    before = _library_functions()
    with bf16_effect(variant):
        during = _library_functions()
    assert during != before  # the variant replaced something
    assert _library_functions() == before  # and put it back
    with pytest.raises(RuntimeError, match="stop"), bf16_effect(variant):
        raise RuntimeError("stop")  # a failed run undoes it too
    assert _library_functions() == before


def test_the_chunk_variant_changes_the_chunks_the_planner_takes():
    import rcdl.ops.plan as plan

    with bf16_effect("float32-chunks-1000"):
        assert plan.default_chunk_size(16) == 1000  # a training batch
        assert plan.default_chunk_size(500) == 1024  # an evaluation batch, as before
    assert plan.default_chunk_size(16) == 2048


def test_variants_are_checked_against_the_store_and_the_models():
    with pytest.raises(ValueError, match="unknown bf16_effect 'sr-everything'"):
        DiagnosticConfig(models=("hybrid",), bf16_effect="sr-everything", checkpoint=False)
    with pytest.raises(ValueError, match="acts on a bfloat16 store: give --store-dtype"):
        DiagnosticConfig(models=("hybrid",), bf16_effect=HALF_STORE[0], checkpoint=False)
    with pytest.raises(ValueError, match="acts on a float32 store"):
        DiagnosticConfig(models=("hybrid",), bf16_effect="sr-keys", store_dtype="bfloat16",
                         checkpoint=False)
    with pytest.raises(ValueError, match="train only hybrids .* not gws"):
        DiagnosticConfig(models=("hybrid", "gws"), bf16_effect="sr-keys", checkpoint=False)
    with pytest.raises(ValueError, match="give --no-checkpoint"):
        DiagnosticConfig(models=("hybrid",), bf16_effect="sr-keys")
    assert type(saved_config(DiagnosticConfig())) is Cifar10Config  # config.json as before


def test_a_variant_run_differs_from_the_plain_one_and_is_recorded(data_dir, tmp_path):
    def run(out, *extra):  # noqa: ANN001, ANN002, ANN202
        assert main(["reproduce", "cifar10-1epoch", "--models", "hybrid-tau0", "--train-size",
                     "16", "--test-size", "8", "--eval-every", "1", "--no-checkpoint",
                     "--data-dir", str(data_dir), "--out", str(tmp_path / out),
                     "--no-progress", "--device", "cpu", *extra]) == 0
        summary = json.loads((tmp_path / out / "summary.json").read_text())
        return summary["runs"][0], json.loads((tmp_path / out / "config.json").read_text())

    plain, plain_config = run("plain")
    nearest, config = run("nearest", "--bf16-effect", "nearest-forward", "--entry-grads")
    assert "bf16_effect" not in plain_config  # a plain run saves the config it always did
    assert config["bf16_effect"] == "nearest-forward" and config["entry_grads"]
    assert type(Cifar10Config.from_dict(config)) is DiagnosticConfig  # resumed as started
    assert [h["test_loss"] for h in nearest["history"]] != [
        h["test_loss"] for h in plain["history"]]  # the stored entries were rounded
    assert nearest["entries"] == plain["entries"]  # the same samples written
    grads = tmp_path / "nearest" / "entry_grads" / "hybrid-tau0-seed0.jsonl"
    rows = [json.loads(line) for line in grads.read_text().splitlines()]
    assert rows and {"layer", "step", "keys", "values"} <= set(rows[0])
    assert "energy B/A" in compare_entry_grads(str(grads), str(grads))
