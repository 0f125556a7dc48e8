"""The replay log on disk (docs/unlearning.md, "A saved run"): saved and loaded under the rules
of checkpoints, held by each training checkpoint so that an interrupted run resumes and keeps
recording, and enough, with the model and learners loaded from files, for ``forget_exactly``
in a new process to give the bits it gives in the training process. Tens of samples."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rcdl import Grower, GrowingSoftmaxNet, HybridGrower, HybridSoftmaxNet, set_store_dtype
from rcdl.nn.gates import DistanceGate
from rcdl.nn.layers import growing_layers
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.ops.half import products_as
from rcdl.train.checkpoint import (
    DamagedCheckpoint,
    checkpoint_files,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
)
from rcdl.train.loop import train_one_pass
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly, stream_without
from small_runs import assert_same_stores, same

D, CLASSES, N, B = 8, 3, 72, 8
KINDS = ("gws", "hybrid", "bfloat16-store")
GONE = [20, 57]  # stream positions of the forgotten samples: batches 2 and 7


def data(kind="gws"):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N + 16, D, generator=gen, dtype=torch.float64)
    if kind == "bfloat16-store":
        x = x.float()
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x[:N], y[:N], x[N:], y[N:]


def build(kind):
    torch.manual_seed(0)
    if kind == "hybrid":
        model = HybridSoftmaxNet(D, CLASSES, 2, temperature=1.0, trigger=DistanceGate(3.0),
                                 rule=ClippedSoftmaxRule(0.3, 3.0), initial_entries=4).double()
        return model, HybridGrower(model, lr=1e-3)
    model = GrowingSoftmaxNet(D, CLASSES, 2, temperature=1.0, rule=ClippedSoftmaxRule(0.01, 1.0))
    if kind == "gws":
        model = model.double()
    else:
        set_store_dtype(model, torch.bfloat16)
    return model, Grower(model)


def train(kind, model=None, grower=None, **kw):
    if model is None:
        model, grower = build(kind)
    result = train_one_pass(model, data(kind), batch_size=B, seed=3, grower=grower,
                            loss_fn=F.cross_entropy, eval_every=1000, progress=False, **kw)
    return model, grower, result


def forget(kind, model, grower, log):
    return forget_exactly(model, log.stream[GONE].tolist(), replay=log, data=data(kind)[:2],
                          loss_fn=F.cross_entropy, grower=grower)


def assert_same_model(a, b, kind):
    assert_same_stores(a, b)
    for (_, la), (_, lb) in zip(growing_layers(a), growing_layers(b), strict=True):
        assert la.store.next_id == lb.store.next_id
    for (k, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        if not k.endswith(("provenance.samples", "provenance.merged")):  # capacity may differ
            assert same(pa, pb), k
    with torch.no_grad():
        assert torch.equal(a.eval()(data(kind)[2]), b.eval()(data(kind)[2]))


# ----------------------------------------------------------------- a new process


def forget_from_files(folder: Path) -> None:
    """What the new process runs: load each kind's model, grower and log from ``folder``,
    forget exactly, and save the model, grower and log it ends with."""
    for kind in KINDS:
        model, grower = build(kind)
        saved = load_checkpoint(folder / f"{kind}.pt")
        load_model_state(model, saved["model"])
        grower.load_state_dict(saved["grower"])
        log = ReplayLog.load(folder / f"{kind}.log.pt")
        forget(kind, model, grower, log)
        save_checkpoint({"model": model.state_dict(), "grower": grower.state_dict(),
                         "log": log.state_dict()}, folder / f"{kind}.forgotten.pt")


@pytest.fixture(scope="module")
def in_a_new_process(tmp_path_factory):
    """Per kind: the model, grower and log forgotten in the training process, the retrained
    model, and what a new process made of the files saved before that forget."""
    folder = tmp_path_factory.mktemp("saved-run")
    here = {}
    for kind in KINDS:
        log = ReplayLog(every=1)
        model, grower, _ = train(kind, replay=log)
        save_checkpoint({"model": model.state_dict(), "grower": grower.state_dict()},
                        folder / f"{kind}.pt")
        log.save(folder / f"{kind}.log.pt")
        order = stream_without(log, log.stream[GONE].tolist())
        forget(kind, model, grower, log)
        with products_as(log.products):
            retrained = train(kind, order=order)[0]
        here[kind] = (model, grower, log, retrained)
    code = (f"import sys, torch; torch.set_num_threads({torch.get_num_threads()}); "
            f"sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from pathlib import Path; import test_replay_files as t; "
            f"t.forget_from_files(Path({str(folder)!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ), check=False)
    assert done.returncode == 0, done.stderr
    return {kind: (*here[kind], load_checkpoint(folder / f"{kind}.forgotten.pt"))
            for kind in KINDS}


@pytest.mark.spawns
@pytest.mark.parametrize("kind", KINDS)
def test_forget_exactly_in_a_new_process_gives_the_training_process_bits(in_a_new_process,
                                                                         kind):
    model, grower, log, retrained, there = in_a_new_process[kind]
    loaded, _ = build(kind)
    load_model_state(loaded, there["model"])
    assert_same_model(loaded, model, kind)
    assert_same_model(loaded, retrained, kind)
    assert same(there["grower"], grower.state_dict())
    assert same(there["log"], log.state_dict())  # the new run's stream and snapshots


# ----------------------------------------------------------------- files refused


def flip(path, at=0.5):
    raw = bytearray(path.read_bytes())
    raw[int(len(raw) * at)] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture
def trained_log():
    log = ReplayLog(every=1)
    train("gws", replay=log)
    return log


def test_a_damaged_log_file_is_refused_naming_it(trained_log, tmp_path):
    path = tmp_path / "run.log.pt"
    trained_log.save(path)
    assert same(ReplayLog.load(path).state_dict(), trained_log.state_dict())
    flip(path)
    with pytest.raises(DamagedCheckpoint, match=r"run\.log\.pt is damaged: its SHA-256"):
        ReplayLog.load(path)


def _without_learners(s):
    del s["snapshots"][3]["learners"]


def _float_order(s):
    s["order"] = s["order"].double()


def _wrong_step(s):
    s["snapshots"][3]["step"] = 4


def _size_as_text(s):
    s["snapshots"][2]["layers"]["blocks.0"]["size"] = "12"


def _unknown_key(s):
    s["ledger"] = {}


WRONG = {
    "snapshot-without-learners": (_without_learners, r"snapshots\[3\] has no learners"),
    "float-order": (_float_order, r"order is a torch\.float64 tensor .*not a 1-D int64"),
    "snapshot-at-another-step": (_wrong_step, r"snapshots\[3\] is of step 4"),
    "size-as-text": (_size_as_text, r"\['blocks\.0'\]\['size'\] is '12', not an integer"),
    "unknown-key": (_unknown_key, r"keys a replay log does not: ledger"),
}


@pytest.mark.parametrize("wrong", WRONG)
def test_a_log_of_another_structure_is_refused_and_nothing_changes(trained_log, tmp_path,
                                                                   wrong):
    change, message = WRONG[wrong]
    state = copy.deepcopy(trained_log.state_dict())
    change(state)
    path = tmp_path / "run.log.pt"
    save_checkpoint(state, path)
    with pytest.raises(DamagedCheckpoint, match=rf"run\.log\.pt is damaged: it does not hold a "
                                                rf"replay log: .*{message}"):
        ReplayLog.load(path)
    before = copy.deepcopy(trained_log.state_dict())
    with pytest.raises(ValueError, match=rf"{message}.*the log was not changed"):
        trained_log.load_state_dict(state)
    assert same(trained_log.state_dict(), before)


def test_a_log_loaded_for_another_model_is_refused_before_anything_changes(tmp_path):
    log = ReplayLog(every=1)
    train("hybrid", replay=log)
    log.save(tmp_path / "hybrid.log.pt")
    model, grower, _ = train("gws")
    before = copy.deepcopy(model.state_dict())
    loaded = ReplayLog.load(tmp_path / "hybrid.log.pt")
    with pytest.raises(ValueError, match=r"snapshot at step 2 .*a log of another model"):
        forget("gws", model, grower, loaded)
    assert same(model.state_dict(), before)


# ----------------------------------------------------------------- interrupted and resumed


@pytest.fixture
def interrupted_with_log(tmp_path, interrupt_after):
    """A gws run with a log stopped after 7 steps, checkpointing every 2 (steps 4 and 6
    kept); returns the checkpoint path."""
    ckpt = tmp_path / "ckpt.pt"
    model, grower = build("gws")
    with pytest.raises(interrupt_after(grower, 7)):
        train("gws", model, grower, replay=ReplayLog(every=1), checkpoint_path=ckpt,
              checkpoint_every=2)
    return ckpt


def resume_and_compare(ckpt):
    """Resume the run at ``ckpt`` with a new log: it ends with the uninterrupted run's log,
    and forgetting exactly in both gives the same model."""
    full_log = ReplayLog(every=1)
    full_model, full_grower, _ = train("gws", replay=full_log)
    log = ReplayLog(every=1)
    model, grower, result = train("gws", replay=log, checkpoint_path=ckpt)
    assert result["resumed"]
    assert sorted(log.snapshots) == list(range(N // B + 1))
    assert same(log.state_dict(), full_log.state_dict())
    forget("gws", model, grower, log)
    forget("gws", full_model, full_grower, full_log)
    assert_same_model(model, full_model, "gws")
    assert same(log.state_dict(), full_log.state_dict())


def test_a_run_resumed_from_its_checkpoint_keeps_recording_the_same_log(interrupted_with_log,
                                                                         capsys):
    resume_and_compare(interrupted_with_log)
    assert "is not used" not in capsys.readouterr().err


def test_a_checkpoint_whose_log_is_malformed_is_skipped_for_the_one_before(
        interrupted_with_log, capsys):
    ckpt = interrupted_with_log
    newest = checkpoint_files(ckpt, 6)
    state = load_checkpoint(newest)
    state["replay"]["order"] = state["replay"]["order"].double()
    digest = save_checkpoint(state, newest)  # a file that verifies, listed by the manifest
    manifest_path = ckpt.with_name("ckpt.manifest.json")
    manifest = json.loads(manifest_path.read_text())
    manifest["checkpoints"][-1]["sha256"] = [digest]
    manifest_path.write_text(json.dumps(manifest))
    resume_and_compare(ckpt)
    err = capsys.readouterr().err
    assert "step 6 is not used" in err and "its replay part: order is a torch.float64" in err
    assert "resuming from the checkpoint of step 4" in err


def test_a_checkpoint_without_a_log_is_refused_to_a_run_with_one(tmp_path, interrupt_after):
    ckpt = tmp_path / "ckpt.pt"
    model, grower = build("gws")
    with pytest.raises(interrupt_after(grower, 7)):
        train("gws", model, grower, checkpoint_path=ckpt, checkpoint_every=2)
    model, grower = build("gws")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"resumes at step 6 and holds no replay log"):
        train("gws", model, grower, replay=ReplayLog(every=1), checkpoint_path=ckpt)
    after = model.state_dict()  # refused before the model was loaded
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
