"""`rcdl reproduce cifar10-1epoch` end to end on a tiny synthetic CIFAR-10: outputs, errors,
and resume-after-interrupt giving the same result as an uninterrupted run."""

import csv
import json

import numpy as np
import pytest

from rcdl.app import cifar
from rcdl.app import models as cifar10_models
from rcdl.app.cli import main
from rcdl.app.experiments.cifar10 import Cifar10Config
from rcdl.app.experiments.cifar10 import combine as cifar10_combine
from rcdl.app.experiments.cifar10 import run as cifar10
from rcdl.app.models import MODELS, build_model, model_spec
from rcdl.nn.networks import ResNetMLP

TINY = ["--train-size", "48", "--test-size", "24", "--eval-every", "2", "--device", "cpu",
        "--no-progress", "--no-download"]  # fmt: skip


def _reproduce(data_dir, *argv):
    return main(["reproduce", "cifar10-1epoch", "--data-dir", str(data_dir), *TINY, *argv])


def _summary(run):
    return json.loads((run / "summary.json").read_text())


def _outcome(summary):
    """What must not depend on interruptions: every run's metrics, history and entries."""
    keep = ("model", "seed", "test_acc", "test_loss", "train_loss", "entries", "history")
    return [{k: r[k] for k in keep} for r in summary["runs"]]


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    models = ["gws", "mlp-sgd", "psoftmax-8"]
    with pytest.MonkeyPatch.context() as mp:  # 1 block instead of 8: its init takes seconds
        mp.setattr(cifar10_models, "ResNetMLP",
                   lambda d_in, d_out, depth: ResNetMLP(d_in, d_out, 1))
        argv = ["--out", str(out), "--models", *models, "--seeds", "0", "1"]
        assert _reproduce(data_dir, *argv) == 0
    return out


def test_run_folder_holds_the_results(run):
    for name in ("config.json", "environment.json", "metrics.jsonl", "summary.json",
                 "results.md", "results.csv", "test_accuracy.png"):  # fmt: skip
        assert (run / name).is_file(), name
    assert (run / "test_accuracy.png").read_bytes().startswith(b"\x89PNG")
    assert not (run / "checkpoints").exists()  # deleted once every model finished
    config = json.loads((run / "config.json").read_text())
    assert config["models"] == ["gws", "mlp-sgd", "psoftmax-8"] and config["seeds"] == [0, 1]
    assert config["train_size"] == 48 and config["batch_size"] == 16


def test_every_model_and_seed_is_trained_and_logged(run):
    summary = _summary(run)
    assert summary["complete"] and summary["data"]["n_train"] == 48
    assert [(r["model"], r["seed"]) for r in summary["runs"]] == [
        (m, s) for m in ("gws", "mlp-sgd", "psoftmax-8") for s in (0, 1)
    ]
    for r in summary["runs"]:
        assert 0 <= r["test_acc"] <= 1 and r["test_loss"] > 0
        assert [h["samples"] for h in r["history"]] == [0, 32, 48]  # 3 steps, eval every 2
    gws = next(r for r in summary["runs"] if r["model"] == "gws")
    assert gws["entries"] == 3 * (16 + 48) and gws["parameters"] == 0  # 3 layers
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6 * 3
    assert {(r["model"], r["seed"]) for r in records} == {
        (r["model"], r["seed"]) for r in summary["runs"]
    }


def test_tables_have_a_row_per_model(run):
    table = (run / "results.md").read_text()
    for name in ("gws", "mlp-sgd", "psoftmax-8"):
        assert f"| {name} | 0 1 |" in table
    assert "59.18 %" in table  # the paper's gws accuracy beside it
    assert "Machine:" in table and "unknown provenance" in table and "not comparable" in table
    rows = list(csv.DictReader((run / "results.csv").read_text().splitlines()))
    assert [r["model"] for r in rows] == ["gws", "mlp-sgd", "psoftmax-8"]
    assert rows[0]["seeds"] == "0 1" and float(rows[0]["paper_test_acc_pct"]) == 59.18
    assert rows[1]["entries"] == "" and float(rows[1]["paper_seeds_acc_pct_mean"]) == 46.3


def test_unknown_model_lists_the_known_ones(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _reproduce(data_dir, "--out", str(tmp_path / "r"), "--models", "gws", "resnet")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unknown model 'resnet'" in err and "mlp-muon" in err
    assert not (tmp_path / "r").exists()


def test_missing_data_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RCDL_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as exc:
        _reproduce(tmp_path, "--out", str(tmp_path / "r"))
    assert exc.value.code == 2 and "CIFAR-10 not found" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--seeds", "-1"], ["--train-size", "0"], ["--quick"],
                                  ["--train-size", "100"]],
                         ids=["negative-seed", "empty-train", "resume-with-quick", "too-big"])
def test_bad_settings_exit_2(data_dir, tmp_path, argv, capsys):
    if argv == ["--quick"]:
        argv = ["--quick", "--resume", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        _reproduce(data_dir, *argv)
    assert exc.value.code == 2 and "--help' for its usage" in capsys.readouterr().err


def test_interrupted_run_resumes_to_the_same_result(data_dir, tmp_path, monkeypatch):
    models = ["gws", "psoftmax-8", "rbf"]
    reference = tmp_path / "reference"
    assert _reproduce(data_dir, "--out", str(reference), "--models", *models) == 0

    # kill the run at psoftmax-8's third step: after its step-2 checkpoint, before rbf
    real_train = cifar10.train_one_pass

    def interrupted(model, data, **kw):
        if kw["name"] == "psoftmax-8-seed0":
            step, calls = kw["optimizer"].step, {"n": 0}

            def stop():
                calls["n"] += 1
                if calls["n"] == 3:
                    raise KeyboardInterrupt
                step()

            kw["optimizer"].step = stop
        return real_train(model, data, **kw)

    run = tmp_path / "run"
    monkeypatch.setattr(cifar10, "train_one_pass", interrupted)
    assert _reproduce(data_dir, "--out", str(run), "--models", *models) == 130
    assert (run / "checkpoints" / "psoftmax-8-seed0.manifest.json").is_file()
    assert [r["model"] for r in _summary(run)["runs"]] == ["gws"]

    trained = []

    def spy(model, data, **kw):
        trained.append(kw["name"])
        return real_train(model, data, **kw)

    monkeypatch.setattr(cifar10, "train_one_pass", spy)
    argv = ["reproduce", "cifar10-1epoch", "--resume", str(run), "--data-dir", str(data_dir),
            "--no-progress", "--device", "cpu", "--no-download"]  # fmt: skip
    assert main(argv) == 0
    assert trained == ["psoftmax-8-seed0", "rbf-seed0"]  # gws was not retrained
    summary = _summary(run)
    assert summary["complete"] and len(summary["sessions"]) == 2
    assert [r["resumed"] for r in summary["runs"]] == [False, True, False]
    assert _outcome(summary) == _outcome(_summary(reference))
    assert not (run / "checkpoints").exists()


def test_keep_checkpoints(data_dir, tmp_path):
    out = tmp_path / "run"
    assert _reproduce(data_dir, "--out", str(out), "--models", "rbf", "--keep-checkpoints") == 0
    manifest = json.loads((out / "checkpoints" / "rbf-seed0.manifest.json").read_text())
    assert [e["step"] for e in manifest["checkpoints"]] == [2]  # 3 steps, every 2
    assert all((out / "checkpoints" / f).is_file() for f in manifest["files"])


def test_resume_refuses_a_changed_config(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "cifar10-1epoch", "--resume", str(tmp_path), "--models", "gws"])
    assert exc.value.code == 2 and "drop --models" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # no run there
        main(["reproduce", "cifar10-1epoch", "--resume", str(tmp_path / "none")])
    assert exc.value.code == 2 and "holds no run" in capsys.readouterr().err


def test_registry_builds_the_spec_models():
    """The settings of docs/reference.md §6, read back from the built objects (no training, small
    tables)."""
    assert set(MODELS) >= {"gws", "gauge", "rbf", "mlp-muon", "psoftmax-5000", "psoftmax-50016"}
    model, opt, grower = build_model("gauge", 0, reserve=10)
    layers = grower.layers
    assert opt is None and len(layers) == 3 and layers[0].temperature == 5.0
    assert (layers[0].rule.alpha, layers[0].rule.eta, layers[0].rule.beta) == (10, 0.03, 100)
    assert all(layer.store.capacity >= 16 + 10 for layer in layers)
    model, opt, grower = build_model("psoftmax-4", 0)
    assert grower is None and opt.param_groups[0]["lr"] == 1e-3
    assert model_spec("psoftmax-50016").reference.test_acc == 40.60
    with pytest.raises(ValueError, match="unknown model 'psoftmax-0'"):
        model_spec("psoftmax-0")
    assert "psoftmax-50016" not in Cifar10Config.quick().models


def test_registry_builds_the_hybrid_of_spec_6():
    model, opt, grower = build_model("hybrid", 0, reserve=4)
    layers = grower.layers
    assert len(layers) == 4 and all(layer.temperature == 5.0 for layer in layers)
    assert layers[0].trigger.tau == 50.0
    assert (layers[0].rule.eta, layers[0].rule.beta) == (1.0, 30.0)
    assert opt.lr == 1e-3 and len(opt.layers) == 4
    _, _, grower = build_model("hybrid-tau62.5", 0)
    assert {layer.trigger.tau for layer in grower.layers} == {62.5}
    _, _, grower = build_model("hybrid-always", 0)
    assert not any(layer.trigger.needs_distance for layer in grower.layers)
    assert model_spec("hybrid-tau50").reference.test_acc == 55.12
    assert model_spec("hybrid-always").reference.test_acc is None
    with pytest.raises(ValueError, match="unknown model 'hybrid-tau'"):
        model_spec("hybrid-tau")


@pytest.mark.extra("classical")
def test_classical_baselines_join_the_table(data_dir, tmp_path):
    out = tmp_path / "run"
    assert _reproduce(data_dir, "--out", str(out), "--models", "knn-cosine", "svm-linear") == 0
    summary = _summary(out)
    knn = next(r for r in summary["runs"] if r["model"] == "knn-cosine")
    assert knn["entries"] == 48 and knn["test_loss"] is None and knn["settings"]["k"] >= 1
    assert knn["history"][-1]["step"] == 3  # 48 images / batch 16
    table = (out / "results.md").read_text()
    assert "| knn-cosine |" in table and "| svm-linear |" in table
    with pytest.raises(ValueError, match="classical baseline"):
        build_model("svm-rbf", 0)


@pytest.fixture(scope="module")
def second_run(data_dir, tmp_path_factory):
    """Another invocation with the same protocol: rbf, seed 0."""
    out = tmp_path_factory.mktemp("runs") / "second"
    assert _reproduce(data_dir, "--out", str(out), "--models", "rbf", "--seeds", "0") == 0
    return out


def test_combine_merges_runs_into_one_table(run, second_run, tmp_path):
    out = tmp_path / "combined"
    folder, combined = cifar10_combine.combine_runs([second_run, run], out)
    assert [row["model"] for row in combined["models"]] == ["gws", "rbf", "mlp-sgd",
                                                            "psoftmax-8"]  # registry order
    assert [s["models"] for s in combined["combined_from"]] == [
        ["rbf"], ["gws", "mlp-sgd", "psoftmax-8"]]
    by_source = {(r["model"], r["seed"]): r["source"] for r in combined["runs"]}
    assert by_source[("rbf", 0)] == str(second_run) and by_source[("gws", 1)] == str(run)
    gws = next(r for r in _summary(run)["models"] if r["model"] == "gws")
    assert next(r for r in combined["models"] if r["model"] == "gws") == gws
    for name in ("summary.json", "results.md", "results.csv", "test_accuracy.png"):
        assert (folder / name).is_file(), name
    report = (folder / "results.md").read_text()
    assert "| rbf | 0 |" in report and str(second_run) in report and "48 train" in report


def test_combine_keeps_only_the_named_models(run, second_run, tmp_path):
    folder, combined = cifar10_combine.combine_runs([run, second_run], tmp_path / "combined",
                                            models=["rbf", "gws"])
    assert [row["model"] for row in combined["models"]] == ["gws", "rbf"]
    assert {r["model"] for r in combined["runs"]} == {"gws", "rbf"}
    assert [s["models"] for s in combined["combined_from"]] == [["gws"], ["rbf"]]
    with pytest.raises(ValueError, match="gauge finished in none of"):
        cifar10_combine.combine_runs([run, second_run], tmp_path / "missing",
                                     models=["gws", "gauge"])


def test_combine_refuses_a_pair_finished_twice(run, tmp_path):
    with pytest.raises(ValueError, match="gws seed 0 finished in both"):
        cifar10_combine.combine_runs([run, run], tmp_path / "combined")


def test_combine_refuses_another_protocol(run, second_run, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(second_run, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "eval_every": 3}))
    with pytest.raises(ValueError, match="another protocol.*eval_every"):
        cifar10_combine.combine_runs([run, other], tmp_path / "combined")


def test_combine_needs_a_finished_model(run, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((run / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no model finished"):
        cifar10_combine.combine_runs([run, empty], tmp_path / "combined")


def test_combine_from_the_command_line(run, second_run, tmp_path, capsys):
    out = tmp_path / "combined"
    argv = ["reproduce", "cifar10-1epoch", "--combine", str(run), str(second_run)]
    assert main([*argv, "--out", str(out)]) == 0
    assert "Combined 7 runs" in capsys.readouterr().out
    assert (out / "results.md").is_file()
    for extra, message in (([], "needs --out"),
                           (["--out", str(tmp_path / "x"), "--seeds", "1"], "drop --seeds"),
                           (["--out", str(tmp_path / "x"), "--no-checkpoint"],
                            "drop --no-checkpoint")):
        with pytest.raises(SystemExit) as exc:
            main([*argv, *extra])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_provenance_recognises_the_same_arrays_saved_again(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8),
              "y_train": np.arange(4), "x_test": rng.integers(0, 256, (2, 32, 32, 3),
                                                              dtype=np.uint8),
              "y_test": np.arange(2)}  # fmt: skip
    np.savez_compressed(tmp_path / "a.npz", **arrays)
    np.savez(tmp_path / "b.npz", **arrays, extra=np.zeros(3))
    np.savez(tmp_path / "c.npz", **{**arrays, "y_test": np.array([1, 0])})
    digest = cifar._array_digest
    assert digest(tmp_path / "a.npz") == digest(tmp_path / "b.npz") is not None
    assert digest(tmp_path / "c.npz") != digest(tmp_path / "a.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    assert digest(tmp_path / "bad.npz") is None
    assert "unknown provenance" in cifar.data_provenance(tmp_path / "a.npz")


def test_a_combined_table_can_be_a_source(run, second_run, tmp_path):
    """A model run later joins a committed table whose own run folders are gone."""
    first, _ = cifar10_combine.combine_runs([run], tmp_path / "first", models=["gws", "mlp-sgd"])
    _, direct = cifar10_combine.combine_runs([second_run, run], tmp_path / "direct",
                                     models=["rbf", "gws", "mlp-sgd"])
    _, layered = cifar10_combine.combine_runs([second_run, first], tmp_path / "layered")
    assert layered["models"] == direct["models"]
    assert layered["combined_from"] == direct["combined_from"]
    assert sorted(layered["runs"], key=str) == sorted(direct["runs"], key=str)
    with pytest.raises(ValueError, match="not only combined tables"):
        cifar10_combine.combine_runs([first], tmp_path / "alone")


# --------------------------------------------------------------------------- speed modes


def test_bfloat16_stores_halve_the_bytes_and_are_recorded(data_dir, tmp_path, monkeypatch,
                                                           capsys):  # fmt: skip
    from rcdl.app import rundir

    monkeypatch.setattr(rundir, "native_bfloat16", lambda: False)  # as on an AVX2-only CPU
    full, half = tmp_path / "full", tmp_path / "half"
    assert _reproduce(data_dir, "--models", "rbf", "--out", str(full)) == 0
    assert _reproduce(data_dir, "--models", "rbf", "--out", str(half),
                      "--store-dtype", "bfloat16") == 0
    assert "neither avx512_bf16 nor AMX" in capsys.readouterr().err
    row_full, row_half = _summary(full)["models"][0], _summary(half)["models"][0]
    assert row_half["entries"] == row_full["entries"] == 3 * 48
    # keys (3 x 3072) and values (3072, 3072, 10) in 2 bytes instead of 4; weights and steps alike
    assert row_full["store_bytes"] - row_half["store_bytes"] == 48 * 2 * (3 * 3072 + 2 * 3072 + 10)
    assert json.loads((half / "config.json").read_text())["store_dtype"] == "bfloat16"
    assert "float32 with bfloat16 stores" in (half / "results.md").read_text()
    # a table mixes no store dtypes: they are part of the protocol
    with pytest.raises(ValueError, match="another protocol.*store_dtype"):
        cifar10_combine.combine_runs([full, half], tmp_path / "combined")


def test_incremental_evaluation_is_the_default_and_can_be_turned_off(data_dir, tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    assert _reproduce(data_dir, "--models", "gws", "--out", str(on)) == 0
    assert _reproduce(data_dir, "--models", "gws", "--out", str(off),
                      "--no-incremental-eval") == 0
    assert json.loads((on / "config.json").read_text())["incremental_eval"] is True
    assert json.loads((off / "config.json").read_text())["incremental_eval"] is False
    history_on = [h["test_acc"] for h in _summary(on)["runs"][0]["history"]]
    history_off = [h["test_acc"] for h in _summary(off)["runs"][0]["history"]]
    assert history_on == pytest.approx(history_off, abs=1e-6)  # merged partials: rounding


def test_store_dtype_must_be_a_half_precision():
    with pytest.raises(ValueError, match="store_dtype must be one of"):
        Cifar10Config(store_dtype="int8")


def test_a_hybrid_in_a_half_store_is_told_what_it_costs(capsys):
    from rcdl.app.experiments.cifar10 import run as cifar10

    for dtype in ("bfloat16", "float16"):
        cifar10._note_if_hybrid_in_half(("gws", "hybrid"), dtype)
        assert "The hybrid's accuracy with a bfloat16 store" in capsys.readouterr().err
    for models, dtype in ((("gws", "rbf"), "bfloat16"), (("hybrid",), "float32"),
                          (("hybrid",), None)):
        cifar10._note_if_hybrid_in_half(models, dtype)
        assert capsys.readouterr().err == ""
