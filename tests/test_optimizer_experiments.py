"""The multi-epoch optimizer comparison and the DeltaNet-decay experiment (docs/reference.md §8) end
to end on a tiny synthetic CIFAR-10: outputs, per-epoch measurements, a missing CIFAR-100, settings
and errors; and Float32Muon against torch.optim.Muon."""

import csv
import json

import numpy as np
import pytest
import torch
from torch import nn

from rcdl.app.baseline_optim import Float32Muon, OptimizerGroup
from rcdl.app.cifar import CifarNotFoundError
from rcdl.app.experiments.deltanet_decay import (
    VARIANTS,
    DeltaNetDecayConfig,
    build_variant,
    run_deltanet_decay,
)
from rcdl.app.experiments.deltanet_decay import load_data as load_decay_data
from rcdl.app.experiments.optimizers import (
    METHODS,
    OptimizerComparisonConfig,
    build_method,
    load_datasets,
    project,
    random_projection,
    run_optimizer_comparison,
)
from rcdl.nn.networks import ResidualNet
from rcdl.optim.dual_optim import FOOF, DeltaNetDecay

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck")  # fmt: skip


def _write_npz(path, classes, n_train=64, n_test=32):
    rng = np.random.default_rng(len(classes))
    np.savez(
        path,
        x_train=rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
        y_train=rng.integers(0, len(classes), n_train).astype(np.int64),
        x_test=rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8),
        y_test=rng.integers(0, len(classes), n_test).astype(np.int64),
        class_names=np.array(classes),
    )


@pytest.fixture(scope="module")
def isolated(tmp_path_factory):
    """No $RCDL_DATA and an empty cache folder: only the folders a test names hold data."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RCDL_DATA", raising=False)
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, isolated):
    """A random CIFAR-10 in the npz layout (64 train / 32 test images), and no CIFAR-100."""
    folder = tmp_path_factory.mktemp("data")
    _write_npz(folder / "cifar10.npz", CLASSES)
    return folder


def _tiny(data_dir, **overrides):
    settings = {"train_size": 48, "test_size": 24, "epochs": 2, "width": 16, "data_dir": data_dir,
                "device": "cpu"}  # fmt: skip
    return OptimizerComparisonConfig.quick(**{**settings, **overrides})


# --------------------------------------------------------------------------- the comparison


@pytest.fixture(scope="module")
def comparison(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "optimizers"
    folder, summary = run_optimizer_comparison(_tiny(data_dir), out=out, progress=False,
                                               download=False)  # fmt: skip
    assert folder.path == out
    return out, summary


def test_comparison_run_folder_holds_the_results(comparison):
    out, summary = comparison
    for name in ("config.json", "environment.json", "metrics.jsonl", "summary.json",
                 "results.md", "results.csv", "optimizers_cifar10.png"):  # fmt: skip
        assert (out / name).is_file(), name
    assert (out / "optimizers_cifar10.png").read_bytes().startswith(b"\x89PNG")
    assert not (out / "optimizers_cifar100.png").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["datasets"] == ["cifar10", "cifar100"] and config["width"] == 16
    assert json.loads((out / "summary.json").read_text())["complete"] is True
    assert summary["input_width"] == 16 and list(summary["data"]) == ["cifar10"]


def test_missing_cifar100_is_skipped_and_said_where_it_was_looked_for(comparison, data_dir):
    out, summary = comparison
    why = summary["skipped"]["cifar100"]
    assert why["message"].startswith("CIFAR-100 not found. Looked for, in this order:")
    assert "not attempted (download=False)" in why["message"]
    assert why["searched"][:3] == [str(data_dir / name) for name in (
        "cifar100.npz", "cifar-100-python", "cifar-100-python.tar.gz")]
    report = (out / "results.md").read_text()
    assert ("**CIFAR-100 was skipped**: not found (looked for cifar100.npz / cifar-100-python / "
            f"cifar-100-python.tar.gz in {data_dir}, ") in report


def test_every_method_is_measured_before_training_and_after_every_epoch(comparison):
    out, summary = comparison
    assert [r["method"] for r in summary["runs"]] == list(METHODS)
    for r in summary["runs"]:
        assert r["dataset"] == "cifar10" and r["seed"] == 0 and r["epochs"] == 2
        assert [h["epoch"] for h in r["history"]] == [0, 1, 2]  # 3 steps per epoch
        assert r["history"][0]["train_loss"] is None
        for h in r["history"]:
            assert 0 <= h["test_acc"] <= 1 and h["test_loss"] > 0
        assert all(h["train_loss"] > 0 for h in r["history"][1:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == len(METHODS) * 3
    assert {(rec["dataset"], rec["method"], rec["seed"]) for rec in records} == {
        ("cifar10", m, 0) for m in METHODS
    }


def test_growing_models_keep_writing_and_mlps_have_parameters(comparison):
    _, summary = comparison
    runs = {r["method"]: r for r in summary["runs"]}
    # 2 blocks + readout; gws starts with 16 entries per layer, RBF empty; 2 epochs of 48
    assert runs["gws"]["entries"] == 3 * (16 + 2 * 48) and runs["gws"]["parameters"] == 0
    assert runs["rbf"]["entries"] == 3 * 2 * 48
    assert [h["entries"] for h in runs["rbf"]["history"]] == [0, 3 * 48, 3 * 2 * 48]
    mlp = 2 * (16 * 16 + 16) + 16 * 10 + 10  # quick(): 2 blocks at width 16, readout
    for m in METHODS:
        if m.startswith("mlp-"):
            assert runs[m]["parameters"] == mlp and runs[m]["entries"] is None


def test_comparison_tables_and_verdict(comparison):
    out, summary = comparison
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert [(r["dataset"], r["method"], r["epoch"]) for r in rows] == [
        ("cifar10", m, str(e)) for m in METHODS for e in range(3)
    ]
    assert rows[0]["train_loss"] == "" and rows[1]["train_loss"] != ""
    report = (out / "results.md").read_text()
    assert "## CIFAR-10" in report and "| mlp-muon | residual MLP, Muon |" in report
    assert "Best MLP optimizer on final test accuracy:" in report and "(paper: Muon)" in report
    assert "Machine:" in report
    v = summary["verdicts"]["cifar10"]
    assert set(v["growing_beat_classic"]) == {"gws", "rbf"}
    assert v["best_classic_mlp"] in ("mlp-sgd", "mlp-adam", "mlp-rmsprop")
    assert v["best_mlp_optimizer"].startswith("mlp-") and v["best_method"] in METHODS


def test_cifar100_runs_with_100_classes_when_present(tmp_path, isolated):
    _write_npz(tmp_path / "cifar100.npz", tuple(f"class{i}" for i in range(100)))
    cfg = _tiny(tmp_path, datasets=("cifar100",), methods=("mlp-foof", "gws"), epochs=1)
    _, summary = run_optimizer_comparison(cfg, out=tmp_path / "r", progress=False,
                                          download=False)  # fmt: skip
    assert summary["skipped"] == {} and summary["data"]["cifar100"]["num_classes"] == 100
    assert [r["method"] for r in summary["runs"]] == ["mlp-foof", "gws"]
    assert "(paper: FOOF (Mesa))" in (tmp_path / "r" / "results.md").read_text()


def test_missing_cifar100_stops_the_run_when_not_skipped(data_dir, tmp_path):
    cfg = _tiny(data_dir, skip_missing=False)
    with pytest.raises(CifarNotFoundError, match="CIFAR-100 is one of this comparison's data "
                       "sets") as info:  # fmt: skip
        run_optimizer_comparison(cfg, out=tmp_path / "r", progress=False, download=False)
    assert str(data_dir / "cifar100.npz") in str(info.value)
    assert data_dir / "cifar100.npz" in info.value.searched
    assert not (tmp_path / "r").exists()  # nothing trained, no run folder


def test_no_data_set_found_is_an_error(tmp_path, isolated):
    cfg = _tiny(tmp_path / "empty")
    with pytest.raises(CifarNotFoundError, match="none of this comparison's data sets was found"):
        load_datasets(cfg, download=False, verbose=False)


def test_same_config_same_numbers(data_dir, tmp_path, comparison):
    _, reference = comparison
    cfg = _tiny(data_dir, methods=("mlp-muon", "rbf"), datasets=("cifar10",))
    _, summary = run_optimizer_comparison(cfg, out=tmp_path / "r", progress=False,
                                          download=False)  # fmt: skip
    again = {r["method"]: [h["test_acc"] for h in r["history"]] for r in summary["runs"]}
    assert again == {r["method"]: [h["test_acc"] for h in r["history"]]
                     for r in reference["runs"] if r["method"] in again}  # fmt: skip


def test_methods_are_built_as_documented(data_dir):
    cfg = _tiny(data_dir)
    model, opt, grower = build_method("mlp-foof", 0, cfg, 10)
    assert isinstance(opt, FOOF) and grower is None and model.blocks[0].in_features == 16
    assert opt.param_groups[0]["lr"] == cfg.foof_lr
    assert opt.defaults["damping"] == cfg.foof_damping == 1.0
    _, opt, _ = build_method("mlp-muon", 0, cfg, 10)
    assert isinstance(opt, OptimizerGroup) and isinstance(opt.optimizers[0], Float32Muon)
    _, opt, _ = build_method("mlp-muon", 0, _tiny(data_dir, muon_ns_dtype="bfloat16"), 10)
    assert type(opt.optimizers[0]) is torch.optim.Muon
    _, opt, _ = build_method("mlp-sgd", 0, cfg, 10)
    assert opt.param_groups[0]["lr"] == cfg.sgd_lr and opt.param_groups[0]["momentum"] == 0.85
    model, opt, grower = build_method("gws", 3, cfg, 100, reserve=50)
    assert opt is None and model.readout.d_out == 100
    assert [len(layer.store) for layer in grower.layers] == [16] * 3
    assert model.blocks[0].temperature == pytest.approx(6 * (16 / 3072) ** 0.5)
    model, _, grower = build_method("rbf", 0, cfg, 10)
    assert grower.num_entries == 0 and model.blocks[0].temperature == pytest.approx(
        10 * (16 / 3072) ** 0.5)
    with pytest.raises(ValueError, match="unknown method 'mlp-lbfgs'; known: mlp-sgd"):
        build_method("mlp-lbfgs", 0, cfg, 10)


def test_projection_is_the_residual_nets_lift(data_dir):
    lift = ResidualNet(3072, 10, 1, make_block=lambda w: nn.Identity(),
                       make_readout=lambda w, o: nn.Linear(w, o), width=16, seed=5).lift
    assert torch.equal(random_projection(3072, 16, 5), lift)
    data = load_datasets(_tiny(data_dir, datasets=("cifar10",)), download=False)[0]["cifar10"]
    projected = project(data, 16, 5)
    assert projected.x_train.shape == (48, 16) and projected.x_test.shape == (24, 16)
    torch.testing.assert_close(projected.x_test, data.x_test @ lift.T)
    assert project(data, None, 5) is data


def test_comparison_configs():
    default = OptimizerComparisonConfig()
    assert (default.train_size, default.test_size, default.width, default.epochs) == (
        5000, 2000, 256, 10)
    assert default.datasets == ("cifar10", "cifar100") and default.methods == tuple(METHODS)
    assert default.temperature("gws") == pytest.approx(6 / 12**0.5)
    paper = OptimizerComparisonConfig.paper()
    assert (paper.train_size, paper.test_size, paper.width, paper.mlp_depth) == (
        None, None, None, 8)
    assert paper.input_width == 3072 and paper.temperature("rbf") == 10.0
    assert (paper.sgd_lr, paper.adam_lr, paper.rmsprop_lr, paper.muon_lr) == (
        1e-3, 1e-4, 1e-4, 1e-3)
    quick = OptimizerComparisonConfig.quick(epochs=1)
    assert (quick.train_size, quick.width, quick.mlp_depth, quick.epochs) == (300, 64, 2, 1)
    saved = json.loads(json.dumps(OptimizerComparisonConfig(seeds=[0, 3]).__dict__))
    assert OptimizerComparisonConfig.from_dict(saved) == OptimizerComparisonConfig(seeds=(0, 3))
    with pytest.raises(ValueError, match=r"unknown settings \['models'\]"):
        OptimizerComparisonConfig.from_dict({"models": ["gws"]})


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"datasets": ("mnist",)}, r"unknown datasets \['mnist'\]; known: cifar10, cifar100"),
     ({"datasets": ()}, "give at least one of datasets"),
     ({"methods": ("mlp-lbfgs",)}, r"unknown methods \['mlp-lbfgs'\]; known: mlp-sgd"),
     ({"methods": ("gws", "gws")}, "methods must not repeat"),
     ({"epochs": 0}, "epochs must be an int >= 1, got 0"),
     ({"width": 0}, "width must be an int >= 1, got 0"),
     ({"train_size": True}, "train_size must be an int >= 1, got True"),
     ({"sgd_lr": 0.0}, "sgd_lr must be a finite number > 0, got 0.0"),
     ({"foof_damping": float("nan")}, "foof_damping must be a finite number > 0"),
     ({"gws_temperature": -1.0}, "gws_temperature must be a finite number > 0"),
     ({"muon_ns_dtype": "float16"}, "muon_ns_dtype must be one of"),
     ({"seeds": (1, 1)}, "seeds must not repeat"),
     ({"skip_missing": "yes"}, "skip_missing must be a bool"),
     ({"device": "tpu"}, "device must be one of")],
    ids=["unknown-dataset", "no-dataset", "unknown-method", "repeated-method", "no-epochs",
         "zero-width", "bool-size", "zero-lr", "nan-damping", "negative-temperature",
         "unknown-dtype", "repeated-seed", "non-bool-skip", "unknown-device"],
)  # fmt: skip
def test_bad_comparison_settings_name_the_problem(settings, message):
    with pytest.raises(ValueError, match=message):
        OptimizerComparisonConfig(**settings)


def test_data_of_another_size_is_refused(data_dir, tmp_path):
    data, _ = load_datasets(_tiny(data_dir, train_size=40, datasets=("cifar10",)),
                            download=False)  # fmt: skip
    with pytest.raises(ValueError, match="cifar10 data has 40 train / 24 test images, the "
                       "config asks for 48"):  # fmt: skip
        run_optimizer_comparison(_tiny(data_dir), data=data, out=tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- Float32Muon


@pytest.mark.parametrize("shape", [(6, 4), (4, 6)], ids=["tall", "wide"])
def test_float32_muon_matches_torch_muon(shape):
    """Same update as torch.optim.Muon; only the Newton–Schulz precision differs (torch's
    runs in bfloat16), so the two agree to bfloat16 accuracy and their momenta exactly."""
    torch.manual_seed(0)
    start = torch.randn(*shape)
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    kw = {"lr": 0.1, "weight_decay": 0.01, "momentum": 0.9, "nesterov": True}
    opts = [Float32Muon([ours], **kw), torch.optim.Muon([theirs], **kw)]
    for _ in range(3):
        grad = torch.randn(*shape)
        for p, opt in zip((ours, theirs), opts, strict=True):
            p.grad = grad.clone()
            opt.step()
    torch.testing.assert_close(opts[0].state[ours]["momentum_buffer"],
                               opts[1].state[theirs]["momentum_buffer"])  # fmt: skip
    ours_moved, theirs_moved = ours.detach() - start, theirs.detach() - start
    assert theirs_moved.norm() > 0.3  # three steps of lr · √max(1, rows/cols) · NS(U)
    assert (ours_moved - theirs_moved).norm() < 0.03 * theirs_moved.norm()  # bfloat16-close


def test_float32_muon_leaves_parameters_without_gradient():
    p, q = nn.Parameter(torch.ones(3, 3)), nn.Parameter(torch.ones(3, 3))
    opt = Float32Muon([p, q], lr=0.1)
    p.grad = torch.eye(3)
    opt.step()
    assert torch.equal(q, torch.ones(3, 3)) and not torch.equal(p, torch.ones(3, 3))


# --------------------------------------------------------------------------- DeltaNet decay


def _decay(data_dir, **overrides):
    settings = {"train_size": 48, "test_size": 24, "epochs": 3, "width": 16, "batch_size": 16,
                "data_dir": data_dir, "device": "cpu"}  # fmt: skip
    return DeltaNetDecayConfig.quick(**{**settings, **overrides})


@pytest.fixture(scope="module")
def decay_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "decay"
    _, summary = run_deltanet_decay(_decay(data_dir), out=out, progress=False, download=False)
    return out, summary


def test_decay_run_folder_holds_the_results(decay_run):
    out, summary = decay_run
    for name in ("config.json", "environment.json", "metrics.jsonl", "summary.json",
                 "results.md", "results.csv", "deltanet_decay.png"):  # fmt: skip
        assert (out / name).is_file(), name
    assert (out / "deltanet_decay.png").read_bytes().startswith(b"\x89PNG")
    assert json.loads((out / "summary.json").read_text())["complete"] is True
    assert [r["variant"] for r in summary["runs"]] == list(VARIANTS)
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert [(r["variant"], r["epoch"]) for r in rows] == [
        (v, str(e)) for v in VARIANTS for e in range(4)
    ]
    report = (out / "results.md").read_text()
    assert "| deltanet | DeltaNet decay (DeltaNetDecay) |" in report
    assert "67 % without decay, 74 % with DeltaNet decay" in report and "Machine:" in report
    assert "controls on final test accuracy (margin" in report


def test_variants_start_equal_and_decay_changes_the_training(decay_run):
    _, summary = decay_run
    runs = {r["variant"]: r for r in summary["runs"]}
    starts = {v: (r["history"][0]["test_acc"], r["history"][0]["test_loss"])
              for v, r in runs.items()}  # fmt: skip
    assert len(set(starts.values())) == 1  # same initialisation, same predictions
    finals = {v: r["history"][-1]["test_loss"] for v, r in runs.items()}
    assert len(set(finals.values())) == 3
    for r in runs.values():
        assert [h["epoch"] for h in r["history"]] == [0, 1, 2, 3]
        assert r["parameters"] == 10 * (16 * 16 + 16) + 16 * 10 + 10  # 10 blocks + readout
    v = summary["verdict"]
    assert set(v["final_test_acc_pct"]) == set(VARIANTS)
    assert v["deltanet_beats_both"] == (v["margin_pct"] > 0)


def test_decay_variants_are_built_as_documented(data_dir):
    cfg = _decay(data_dir)
    _, none, _ = build_variant("none", 0, cfg)
    _, wd, _ = build_variant("weight-decay", 0, cfg)
    model, dn, _ = build_variant("deltanet", 0, cfg)
    assert type(none) is torch.optim.SGD and none.param_groups[0]["weight_decay"] == 0
    assert wd.param_groups[0]["weight_decay"] == cfg.weight_decay
    assert wd.param_groups[0]["momentum"] == cfg.momentum == 0.9
    assert isinstance(dn, DeltaNetDecay) and dn.defaults["decay"] == cfg.deltanet_decay
    assert len(model.blocks) == 10
    with pytest.raises(ValueError, match="unknown variant 'adamw'; known: none"):
        build_variant("adamw", 0, cfg)


def test_decay_configs():
    default = DeltaNetDecayConfig()
    assert (default.train_size, default.width, default.depth, default.epochs) == (
        2000, 256, 10, 150)
    paper = DeltaNetDecayConfig.paper()
    assert (paper.train_size, paper.test_size, paper.width, paper.depth, paper.epochs) == (
        None, None, None, 10, 2000)
    assert paper.input_width == 3072
    quick = DeltaNetDecayConfig.quick()
    assert (quick.train_size, quick.width, quick.depth, quick.epochs) == (300, 64, 10, 5)
    saved = json.loads(json.dumps(DeltaNetDecayConfig(seeds=[2]).__dict__))
    assert DeltaNetDecayConfig.from_dict(saved) == DeltaNetDecayConfig(seeds=(2,))
    with pytest.raises(ValueError, match=r"unknown settings \['decay'\]"):
        DeltaNetDecayConfig.from_dict({"decay": 1.0})


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"variants": ("adamw",)}, r"unknown variants \['adamw'\]; known: none"),
     ({"variants": ()}, "give at least one of variants: none, weight-decay, deltanet"),
     ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1.0"),
     ({"momentum": -0.1}, "momentum must be a finite number >= 0, got -0.1"),
     ({"lr": -1e-3}, "lr must be a finite number > 0"),
     ({"deltanet_decay": 0}, "deltanet_decay must be a finite number > 0, got 0"),
     ({"depth": 0}, "depth must be an int >= 1, got 0"),
     ({"seeds": (-1,)}, "each seed must be an int >= 0, got -1")],
    ids=["unknown-variant", "no-variant", "momentum-one", "negative-momentum", "negative-lr",
         "zero-decay", "no-depth", "negative-seed"],
)  # fmt: skip
def test_bad_decay_settings_name_the_problem(settings, message):
    with pytest.raises(ValueError, match=f"DeltaNetDecayConfig: {message}"):
        DeltaNetDecayConfig(**settings)


def test_decay_data_of_another_size_is_refused(data_dir, tmp_path):
    data = load_decay_data(_decay(data_dir, train_size=40), download=False)
    with pytest.raises(ValueError, match="40 train / 24 test images, the config asks for 48"):
        run_deltanet_decay(_decay(data_dir), data=data, out=tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


def test_cli_flags_reach_the_configs(monkeypatch):
    """`rcdl reproduce optimizers` / `deltanet-decay` map their flags onto the configs."""
    from rcdl.app import cli, runner

    seen = {}
    key = {"optimizers": "opt", "deltanet-decay": "dn"}
    monkeypatch.setattr(runner, "run_experiment",
                        lambda spec, cfg, **kw: seen.update({key[spec.name]: cfg}))
    common = ["--device", "cpu", "--no-progress"]
    assert cli.main(["reproduce", "optimizers", "--quick", "--methods", "gws", "mlp-adam",
                     "--no-projection", *common]) == 0
    assert seen["opt"].methods == ("gws", "mlp-adam") and seen["opt"].width is None
    assert cli.main(["reproduce", "deltanet-decay", "--quick", "--epochs", "2",
                     "--deltanet-decay", "1e-3", *common]) == 0
    assert (seen["dn"].epochs, seen["dn"].deltanet_decay) == (2, 1e-3)
