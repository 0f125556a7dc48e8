"""`rcdl forget RUN_DIR`: a deletion request against a run folder of `rcdl reproduce
cifar10-1epoch --keep-models --replay-every 1` (docs/unlearning.md, "A deletion request"):
exact mode gives the retrained model's predictions bit for bit, fast mode removes the
samples' entries, every file scan is clean and the receipt lists the files touched, and
each bad input is refused with its message and no file changed."""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rcdl.app.cli import main
from rcdl.app.experiments.cifar10 import data_digest
from rcdl.app.experiments.cifar10.config import Cifar10Config, load_data
from rcdl.app.models import build_model
from rcdl.app.rundir import read_config
from rcdl.memory.provenance import entry_samples
from rcdl.nn.layers import growing_layers
from rcdl.ops.half import products_as
from rcdl.train.checkpoint import load_checkpoint, load_model_state
from rcdl.train.loop import train_one_pass
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import stream_without

TINY = ["--train-size", "48", "--test-size", "24", "--eval-every", "2", "--device", "cpu",
        "--no-progress", "--no-download"]  # fmt: skip
FORGET = [3, 40]  # sample 3 in a late batch or an early one, depending on the order; 40 too


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A finished run of gws and rbf, seed 0, with kept models and replay logs."""
    out = tmp_path_factory.mktemp("runs") / "run"
    argv = ["reproduce", "cifar10-1epoch", "--data-dir", str(data_dir), *TINY, "--out",
            str(out), "--models", "gws", "rbf", "--keep-models", "--replay-every", "1",
            "--keep-checkpoints"]
    assert main(argv) == 0
    return out


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the trained run folder, for one test to change."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _digests(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _forget(run, *argv):
    return main(["forget", str(run), *argv])


def _receipts(run):
    return [json.loads(line) for line in (run / "forget_receipts.jsonl").read_text().splitlines()]


def _load(run, name, seed=0):
    cfg = read_config(run, Cifar10Config)
    saved = load_checkpoint(run / "models" / f"{name}-seed{seed}.pt")
    model, _, grower = build_model(name, seed, dtype=cfg.torch_dtype)
    load_model_state(model, saved["state"])
    grower.load_state_dict(saved["grower"])
    return model, saved


def _tensors(data_dir):
    cfg = Cifar10Config(data_dir=str(data_dir), train_size=48, test_size=24)
    data = load_data(cfg, download=False)
    return data.x_train.float(), data.y_train, data.x_test.float(), data.y_test


def test_the_run_keeps_its_models_and_logs(trained, data_dir):
    names = sorted(p.name for p in (trained / "models").iterdir())
    assert names == ["gws-seed0.log.pt", "gws-seed0.pt", "rbf-seed0.log.pt", "rbf-seed0.pt"]
    saved = load_checkpoint(trained / "models" / "gws-seed0.pt")
    x, y, _, _ = _tensors(data_dir)
    assert saved["data_sha256"] == data_digest(x, y) and saved["optimizer"] is None
    log = ReplayLog.load(trained / "models" / "gws-seed0.log.pt")
    assert log.every == 1 and len(log.stream) == 48 and sorted(log.snapshots) == [0, 1, 2, 3]


def test_exact_mode_gives_the_retrained_models_predictions(run, data_dir):
    before = ReplayLog.load(run / "models" / "gws-seed0.log.pt")
    assert _forget(run, "--samples", ",".join(map(str, FORGET)), "--mode", "exact") == 0
    x, y, x_test, y_test = _tensors(data_dir)
    for name in ("gws", "rbf"):
        model, _ = _load(run, name)
        retrained, _, grower = build_model(name, 0)
        with products_as(before.products):
            train_one_pass(retrained, (x, y, x_test, y_test), batch_size=16, seed=0,
                           grower=grower, loss_fn=F.cross_entropy, eval_every=10**6,
                           progress=False, order=stream_without(before, FORGET))
        model.eval()
        retrained.eval()
        with torch.no_grad():
            assert torch.equal(model(x_test), retrained(x_test)), name
    receipt = _receipts(run)[-1]
    assert receipt["mode"] == "exact" and receipt["samples"] == FORGET and receipt["clean"]
    log = ReplayLog.load(run / "models" / "gws-seed0.log.pt")
    assert not torch.isin(log.stream, torch.tensor(FORGET)).any()


def test_fast_mode_removes_the_samples_entries(run):
    model, _ = _load(run, "gws")
    assert all(torch.isin(entry_samples(layer), torch.tensor(FORGET)).sum() == 2
               for _, layer in growing_layers(model))
    assert _forget(run, "--samples", "3 40") == 0
    receipt = _receipts(run)[-1]
    assert [m["model"] for m in receipt["models"]] == ["gws", "rbf"]
    for name, kept in zip(("gws", "rbf"), receipt["models"], strict=True):
        model, _ = _load(run, name)
        for _, layer in growing_layers(model):
            assert not torch.isin(entry_samples(layer), torch.tensor(FORGET)).any()
        assert sum(kept["receipt"]["removed"].values()) == 2 * len(growing_layers(model))
        log = ReplayLog.load(run / "models" / f"{name}-seed0.log.pt")
        assert sorted(log.forgotten.tolist()) == FORGET


@pytest.mark.parametrize("mode", ["fast", "repair", "exact"])
def test_the_scan_is_clean_and_the_receipt_lists_the_files(run, mode, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("# the request\n3\n40, 3\n")
    assert (run / "checkpoints").is_dir()  # --keep-checkpoints: they hold the samples
    before = _digests(run)
    assert _forget(run, "--samples", str(ids), "--mode", mode) == 0
    receipt = _receipts(run)[-1]
    assert receipt["clean"] and receipt["file_scan"]["clean"]
    assert receipt["file_scan"]["keys_looked_for"] > 0
    after = _digests(run)
    assert set(receipt["file_scan"]["files"]) == set(after) - {"forget_receipts.jsonl"}
    touched = {f["path"]: f["sha256"] for f in receipt["files_touched"]}
    assert touched["models/gws-seed0.pt"] == after["models/gws-seed0.pt"]
    assert (touched.get("models/gws-seed0.log.pt") == after["models/gws-seed0.log.pt"]) \
        == (mode != "repair")
    removed = {p for p, digest in touched.items() if digest is None}
    assert removed == {p for p in before if p.startswith("checkpoints/")}
    assert not (run / "checkpoints").exists()
    changed = {p for p in before if before[p] != after.get(p)}
    assert changed == set(touched)  # nothing else changed


def test_a_model_left_out_makes_the_scan_say_so(run):
    """Forgetting from gws alone leaves the images in rbf's file: not clean."""
    assert _forget(run, "--samples", "3", "--model", "gws") == 1
    receipt = _receipts(run)[-1]
    assert not receipt["clean"] and "models/rbf-seed0.pt" in receipt["file_scan"]["hits"]


def _damage(run, name):
    path = run / "models" / name
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _other_experiment(run):
    env = json.loads((run / "environment.json").read_text())
    (run / "environment.json").write_text(json.dumps({**env, "experiment": "unlearning"}))


@pytest.mark.parametrize(("argv", "prepare", "message"), [
    (["--samples", "3,48"], None, "sample indices [48] are out of range"),
    (["--samples", "3,x"], None, "'x', which is not a sample index"),
    (["--samples", "-1"], None, "'-1', which is not a sample index"),
    (["--samples", "3", "--model", "mlp-sgd"], None, "trained no model 'mlp-sgd'"),
    (["--samples", "3"], _other_experiment, "holds a run of unlearning"),
    (["--samples", "3"], lambda r: shutil.rmtree(r / "models"), "holds no kept model"),
    (["--samples", "3"], lambda r: _damage(r, "rbf-seed0.pt"), "is damaged"),
    (["--samples", "3"], lambda r: _damage(r, "gws-seed0.log.pt"), "is damaged"),
    (["--samples", "3", "--mode", "exact"],
     lambda r: (r / "models" / "rbf-seed0.log.pt").unlink(), "holds none for rbf-seed0.pt"),
    (["--samples", "3", "--mode", "exact", "--data-dir", "OTHER"], None,
     "do not match the data"),
], ids=["out-of-range", "not-an-index", "negative", "unknown-model", "other-experiment",
        "no-kept-models", "damaged-model", "damaged-log", "exact-without-log",
        "other-data"])
def test_bad_input_is_refused_and_changes_nothing(run, argv, prepare, message, tmp_path,
                                                  capsys):
    if prepare is not None:
        prepare(run)
    if "OTHER" in argv:
        other = tmp_path / "other"
        other.mkdir()
        rng = np.random.default_rng(1)
        np.savez(other / "cifar10.npz",
                 x_train=rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8),
                 y_train=rng.integers(0, 10, 64).astype(np.int64),
                 x_test=rng.integers(0, 256, (32, 32, 32, 3), dtype=np.uint8),
                 y_test=rng.integers(0, 10, 32).astype(np.int64),
                 class_names=np.array([str(i) for i in range(10)]))
        argv = [str(other) if a == "OTHER" else a for a in argv]
    before = _digests(run)
    with pytest.raises(SystemExit) as exc:
        _forget(run, *argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err
    assert _digests(run) == before
