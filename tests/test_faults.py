"""Runs that survive faults: each test injects one (bytes flipped, a file cut short or
emptied, a rank killed at each phase of a sharded checkpoint, temporaries left by a kill)
and checks what the run does about it."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from rank_pool import run_ranks
from rcdl import FunctionalSGD, Grower, GrowingRBFNet, GrowingSoftmaxNet
from rcdl.nn.divergence import DivergenceGuard, outputs_after
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.optim._step import propose
from rcdl.train.checkpoint import (
    DamagedCheckpoint,
    checkpoint_files,
    load_checkpoint,
    save_checkpoint,
)
from rcdl.train.loop import train_one_pass
from small_runs import TEACHER_DATA, TEACHER_KW, teacher_net

TIMEOUT = timedelta(seconds=60)
DATA, KW, build = TEACHER_DATA, TEACHER_KW, teacher_net


def reference():
    net, grower = build()
    return train_one_pass(net, DATA, grower=grower, **KW)


def flip(path, count=200, at=0.5):
    """Flip ``count`` bytes in the middle of ``path`` (at fraction ``at`` of its length)."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- checksummed files


@pytest.mark.parametrize("damage", ["flipped", "cut", "empty", "not-rcdl"])
def test_a_damaged_checkpoint_file_is_refused_naming_it(damage, tmp_path):
    path = tmp_path / "state.pt"
    net, _ = build()
    save_checkpoint({"model": net.state_dict()}, path)
    assert load_checkpoint(path)["model"].keys() == net.state_dict().keys()
    if damage == "flipped":
        flip(path, 20)
    elif damage == "cut":
        path.write_bytes(path.read_bytes()[:-300])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        torch.save({"model": net.state_dict()}, path)  # a plain torch file: no checksum
    expected = {"flipped": "SHA-256 does not match", "cut": "SHA-256 does not match",
                "empty": "empty", "not-rcdl": "rcdl checkpoint header"}[damage]
    with pytest.raises(DamagedCheckpoint, match=expected) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


class _RunsCode:
    """Pickles as a call of ``os.system``: what a doctored checkpoint would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _doctored(path, obj):
    """``obj`` pickled by torch behind a valid rcdl header: the digest is a checksum, not a
    signature, so anyone can write one."""
    import hashlib
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    path.write_bytes(b"RCDLCKP1" + hashlib.sha256(payload).digest() + payload)
    return hashlib.sha256(payload).hexdigest()


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    from rcdl.train.checkpoint import UnsafeCheckpoint

    marker, path = tmp_path / "ran", tmp_path / "state.pt"
    net, _ = build()
    _doctored(path, {"model": net.state_dict(), "extra": _RunsCode(marker)})
    with pytest.raises(UnsafeCheckpoint, match=r"refused: it asks to build \S*system") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and not marker.exists()
    assert isinstance(err.value, DamagedCheckpoint)  # handled wherever a damaged file is


def test_a_resume_never_runs_a_doctored_checkpoint(interrupted, tmp_path, capsys):
    """The newest checkpoint replaced by one that runs code, its manifest updated to match:
    the resume refuses it, says why, runs nothing and resumes from the one before."""
    import json

    expected = reference()
    ckpt = interrupted(7)  # checkpoints at steps 4 and 6
    marker, newest = tmp_path / "ran", checkpoint_files(ckpt, 6)
    state = load_checkpoint(newest)
    digest = _doctored(newest, state | {"loop": _RunsCode(marker)})
    manifest = ckpt.with_name("ckpt.manifest.json")
    listed = json.loads(manifest.read_text())
    listed["checkpoints"][-1]["sha256"] = [digest]
    manifest.write_text(json.dumps(listed))
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, **KW)
    err = capsys.readouterr().err
    assert "ckpt.step00000006.pt is refused" in err and "could run code" in err
    assert not marker.exists()
    assert resumed["resumed"] and resumed["history"] == expected["history"]


def test_save_checkpoint_refuses_what_could_not_be_loaded_safely(tmp_path):
    from collections import OrderedDict

    path = tmp_path / "state.pt"
    with pytest.raises(TypeError, match=r"\['opt'\]\['rule'\] is a .*ClippedSoftmaxRule"):
        save_checkpoint({"opt": {"rule": ClippedSoftmaxRule(1.0, 2.0)}}, path)
    assert not path.exists()
    plain = {"a": OrderedDict(w=torch.ones(2)), "b": [1, 2.5, "x", None, (True,)],
             "c": {torch.float16, torch.Size([2])}, 3: b"raw"}
    save_checkpoint(plain, path)
    assert load_checkpoint(path)["b"] == plain["b"]


@pytest.fixture
def interrupted(tmp_path, interrupt_after):
    """``interrupted(steps)``: a run stopped after ``steps`` growth steps, checkpointing
    every 2; returns its checkpoint path."""

    def run(steps):
        ckpt = tmp_path / "ckpt.pt"
        net, grower = build()
        with pytest.raises(interrupt_after(grower, steps)):
            train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt,
                           checkpoint_every=2, **KW)
        return ckpt

    return run


def test_a_flipped_checkpoint_falls_back_to_the_previous_one_and_says_so(interrupted, capsys):
    """200 bytes flipped in the newest checkpoint: the run resumes from the one before (the
    last two are kept), says which and why, and ends as the uninterrupted run."""
    expected = reference()
    ckpt = interrupted(7)  # checkpoints at steps 4 and 6
    flip(checkpoint_files(ckpt, 6))
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, **KW)
    err = capsys.readouterr().err
    assert "ckpt.step00000006.pt is damaged" in err and "SHA-256" in err
    assert "resuming from the checkpoint of step 4" in err
    assert resumed["resumed"] and resumed["history"] == expected["history"]


def test_with_every_checkpoint_damaged_the_run_starts_afresh_and_says_so(interrupted, capsys):
    expected = reference()
    ckpt = interrupted(7)
    checkpoint_files(ckpt, 6).write_bytes(b"")  # emptied
    checkpoint_files(ckpt, 4).unlink()  # lost
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, **KW)
    err = capsys.readouterr().err
    assert "is empty" in err and "ckpt.step00000004.pt is missing" in err
    assert "no checkpoint could be read; this run starts from step 0" in err
    assert not resumed["resumed"] and resumed["history"] == expected["history"]


@pytest.mark.parametrize("damage", ["one-byte", "cut", "missing"])
def test_without_a_usable_manifest_the_newest_verifying_step_file_is_used(damage, interrupted,
                                                                         capsys):
    """The manifest lists which files are whole, but each file also verifies on its own: one
    byte of the manifest overwritten, the manifest cut or lost, the run resumes from the
    newest step file that verifies (the newest one, flipped, is skipped and said so), and the
    saves after it delete no file the run still needs."""
    expected = reference()
    ckpt = interrupted(7)  # checkpoints at steps 4 and 6
    manifest = ckpt.with_name("ckpt.manifest.json")
    if damage == "one-byte":
        text = bytearray(manifest.read_bytes())
        text[0] = ord("x")
        manifest.write_bytes(bytes(text))
    elif damage == "cut":
        manifest.write_text(manifest.read_text()[:40])
    else:
        manifest.unlink()
    flip(checkpoint_files(ckpt, 6))
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, **KW)
    err = capsys.readouterr().err
    assert ("manifest.json is damaged" in err) == (damage != "missing")
    assert "checkpoints of steps 4, 6 were found on disk" in err
    assert "step 6 is not used" in err and "resuming from the checkpoint of step 4" in err
    assert resumed["resumed"] and resumed["history"] == expected["history"]


def _checkpointer(path, keep=2):
    from rcdl.train.checkpoint import Checkpointer

    net, grower = build()
    return Checkpointer(path, 2, {"name": "t"}, net, None, grower, keep=keep)


def test_a_failed_manifest_read_during_a_save_deletes_no_checkpoint(tmp_path, monkeypatch):
    """A transient error (EMFILE) reading the manifest once a save has committed: the files
    to keep are those of the manifest just written, held in memory, so every committed file
    stays (before, the failed read kept nothing and deleted every step file)."""
    import json

    path = tmp_path / "ckpt.pt"
    saver = _checkpointer(path)
    assert saver.restore() is None
    saver.save({"step": 2})
    saver.save({"step": 4})
    real = json.loads

    def failing(text, *args, **kwargs):  # every manifest read fails from now on
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(json, "loads", failing)
    saver.save({"step": 6})
    saver.close()
    monkeypatch.setattr(json, "loads", real)
    assert sorted(p.name for p in tmp_path.glob("ckpt.step*")) == [
        "ckpt.step00000004.pt", "ckpt.step00000006.pt"]
    listed = json.loads(path.with_name("ckpt.manifest.json").read_text())
    assert [e["step"] for e in listed["checkpoints"]] == [4, 6]
    reader = _checkpointer(path)
    assert reader.restore() == {"step": 6}
    reader.close()


def test_a_newer_checkpoint_that_verifies_is_not_deleted_by_an_older_save(tmp_path):
    path = tmp_path / "ckpt.pt"
    saver = _checkpointer(path, keep=1)
    saver.restore()
    saver.save({"step": 8})
    saver.close()
    first = _checkpointer(path, keep=1)
    path.with_name("ckpt.manifest.json").unlink()  # the manifest lost
    checkpoint_files(path, 6).write_bytes(b"")  # a damaged one: removed by the next save
    assert first.restore() == {"step": 8}
    first.close()
    again = _checkpointer(path, keep=1)
    again._committed = []  # as a run resumed from an older step: it saves step 2 next
    again.save({"step": 2})
    again.close()
    names = sorted(p.name for p in tmp_path.glob("ckpt.step*"))
    assert names == ["ckpt.step00000002.pt", "ckpt.step00000008.pt"]


def test_the_manifest_records_its_format_and_an_unknown_one_is_refused(tmp_path):
    import json

    from rcdl import __version__

    path = tmp_path / "ckpt.pt"
    saver = _checkpointer(path)
    saver.restore()
    saver.save({"step": 2})
    saver.close()
    manifest = path.with_name("ckpt.manifest.json")
    written = json.loads(manifest.read_text())
    assert written["format"] == 1 and written["rcdl_version"] == __version__
    manifest.write_text(json.dumps(written | {"format": 99, "rcdl_version": "9.0"}))
    with pytest.raises(ValueError, match=r"format 99, written by rcdl 9.0; this rcdl .* reads"):
        _checkpointer(path).restore()
    assert checkpoint_files(path, 2).exists()  # refused, nothing deleted


def _train_on(path, queue):
    """In another process: train with checkpoints at ``path``; put what happened."""
    from rcdl.train.checkpoint import CheckpointInUse

    net, grower = build()
    try:
        train_one_pass(net, DATA, grower=grower, checkpoint_path=path, checkpoint_every=2, **KW)
        queue.put("trained")
    except CheckpointInUse as err:
        queue.put(str(err))


@pytest.mark.spawns
def test_a_second_process_on_the_same_checkpoint_path_is_refused(tmp_path):
    """Two runs given one checkpoint_path would overwrite each other's step files: while one
    holds it, a second process is refused with a message naming the holder; once the first
    ends, the path is free again."""
    path = tmp_path / "ckpt.pt"
    saver = _checkpointer(path)
    saver.restore()  # this process holds the path from here on
    context = mp.get_context("spawn")
    queue = context.Queue()
    other = context.Process(target=_train_on, args=(path, queue))
    other.start()
    said = queue.get(timeout=60)
    other.join(timeout=60)
    assert f"checkpoint {path} is in use by process {os.getpid()}" in said
    assert not checkpoint_files(path, 2).exists()  # it wrote nothing
    saver.close()
    net, grower = build()  # free again (in this process too)
    train_one_pass(net, DATA, grower=grower, checkpoint_path=path, **KW)


def test_a_lock_that_fails_closes_its_descriptor(tmp_path, monkeypatch):
    """flock raising something other than 'busy' (ENOLCK on a network file system, say)
    leaves no descriptor open, and the run folder says which folder could not be locked."""
    import errno
    import fcntl

    from rcdl.app.rundir import RunDir

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    opened = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(fcntl, "flock", refuse)
    run = RunDir.create("t", path=tmp_path / "run")
    with pytest.raises(OSError, match=r"cannot lock .*run .*may not support flock"):
        run.lock()
    assert set(os.listdir("/proc/self/fd")) <= opened


def test_temporaries_of_interrupted_writes_are_removed(interrupted, tmp_path):
    ckpt = interrupted(5)
    stale = [tmp_path / ".ckpt.step00000006.pt.k3j2.tmp", tmp_path / ".ckpt.manifest.json.x.tmp"]
    for path in stale:
        path.write_bytes(b"half a file")
    other = tmp_path / ".other.pt.a.tmp"  # not this checkpoint's: left alone
    other.write_bytes(b"")
    net, grower = build()
    train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, **KW)
    assert not any(p.exists() for p in stale) and other.exists()


# --------------------------------------------------------------------------- sharded commits

FAULTS = ["rank-file", "manifest", "cleanup"]


def _sharded(rank, world, init_file, folder, fault, result_file):
    from rcdl.distributed import shard
    from rcdl.train import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        data = DATA
        if fault is not None:  # die (as SIGKILL would: no cleanup) at one phase of step 6
            if fault == "rank-file" and rank == 1:  # its file of step 6 written, not gathered
                real = checkpoint.save_checkpoint

                def save(obj, path):
                    digest = real(obj, path)
                    if ".step00000006" in str(path):
                        os._exit(9)
                    return digest

                checkpoint.save_checkpoint = save
            if fault == "manifest" and rank == 0:  # every file of step 6 written, no commit
                real_json = checkpoint.atomic_write_json

                def commit(obj, path):
                    if obj.get("step") == 6:
                        os._exit(9)
                    return real_json(obj, path)

                checkpoint.atomic_write_json = commit
            if fault == "cleanup" and rank == 1:  # committed, older files not deleted yet
                real_remove = checkpoint.Checkpointer._remove_older

                def remove(self, step, kept, rank, world):
                    if json_step(self.manifest) == 6:
                        os._exit(9)
                    return real_remove(self, step, kept, rank, world)

                checkpoint.Checkpointer._remove_older = remove
        torch.manual_seed(0)
        net = GrowingSoftmaxNet(5, 2, 1, temperature=1.0, rule=ClippedSoftmaxRule(0.3, 2.0),
                                initial_entries=4).double()
        shard(net)
        result = train_one_pass(net, data, grower=Grower(net), checkpoint_path=folder / "c.pt",
                                checkpoint_every=2, loss_fn=F.mse_loss, **KW)
        if rank == 0:
            torch.save((result["resumed"], result["history"]), result_file)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def json_step(path):
    import json

    return json.loads(path.read_text())["step"]


def _spawn(tmp_path, tag, folder, fault):
    """Two ranks: freshly spawned ones where a rank is to die, else the session's pool."""
    result = tmp_path / f"{tag}.pt"
    args = (2, tmp_path / f"{tag}.init", folder, fault, result)
    if fault is None:
        run_ranks(_sharded, args, world=2)
    else:
        mp.start_processes(_sharded, args=args, nprocs=2, join=True, start_method="spawn")
    return torch.load(result, weights_only=False)


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory):
    """The uninterrupted sharded run's history (spawned once for the three faults)."""
    folder = tmp_path_factory.mktemp("sharded-reference")
    return _spawn(folder, "reference", folder / "run", None)[1]


@pytest.mark.spawns
@pytest.mark.parametrize("fault", FAULTS)
def test_a_rank_killed_at_each_phase_of_a_sharded_checkpoint_resumes(fault, tmp_path,
                                                                     sharded_reference):
    """Rank files tagged with their step, the manifest written last by rank 0 after every
    rank's file, older files deleted only after a barrier: a kill at any phase leaves a
    committed checkpoint that every rank holds, and the resumed run ends as the
    uninterrupted one."""
    expected = sharded_reference
    folder = tmp_path / "run"
    folder.mkdir()
    with pytest.raises(mp.ProcessExitedException):
        _spawn(tmp_path, "killed", folder, fault)
    resumed, history = _spawn(tmp_path, "resumed", folder, None)
    assert resumed and history == expected


# --------------------------------------------------------------------------- bad steps, bad states


def test_a_refused_load_leaves_the_whole_model_as_it_was():
    """NaN in the second layer's keys: load_model_state refuses before loading anything, so
    the first layer keeps its entries too (model.load_state_dict would have loaded it)."""
    from rcdl.train.checkpoint import load_model_state

    net, grower = build()
    x, y = DATA[0][:8], DATA[1][:8]
    F.mse_loss(net.train()(x), y).backward()
    grower.step()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    fresh, _ = build()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    state["readout.store.keys"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="readout.store.*NaN or inf; .*nothing was|nothing was"):
        load_model_state(fresh, state)
    after = fresh.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    state["readout.store.keys"][0, 0] = 0.0
    load_model_state(fresh, state)  # a clean state loads
    assert torch.equal(fresh.state_dict()["blocks.0.store.keys"], state["blocks.0.store.keys"])


def _trained_state(depth):
    torch.manual_seed(0)
    net = GrowingRBFNet(5, 2, depth, temperature=1.0, rule=FunctionalSGD(0.3)).double()
    grower = Grower(net)
    F.mse_loss(net.train()(DATA[0][:8]), DATA[1][:8]).backward()
    grower.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("fault", ["deeper-model", "merged-length", "samples-float",
                                   "next-id-float"])
def test_load_model_state_refuses_every_fault_before_loading_anything(fault):
    """A state of a deeper model (unexpected keys), a provenance map whose merge counts do
    not match its ids, float sample ids, a float next_id: each is refused before any module
    loads (torch's load_state_dict loads the matching modules and raises at the end)."""
    from rcdl.train.checkpoint import load_model_state

    state = _trained_state(2 if fault == "deeper-model" else 1)
    if fault == "merged-length":
        state["readout.provenance.merged"] = torch.zeros(3, dtype=torch.long)
    elif fault == "samples-float":
        state["readout.provenance.samples"] = state["readout.provenance.samples"].double()
    elif fault == "next-id-float":
        state["readout.store.next_id"] = torch.tensor(8.0)
    fresh, _ = build()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    expected = {"deeper-model": r"unexpected keys .*blocks\.1\.store\.keys",
                "merged-length": "merged must have one count per id",
                "samples-float": "samples must be a 1-D integer tensor",
                "next-id-float": "next_id is torch.float32"}[fault]
    with pytest.raises(ValueError, match=f"nothing was: .*{expected}"):
        load_model_state(fresh, state)
    after = fresh.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert len(fresh.blocks[0].store) == 0


def test_a_single_step_at_a_huge_learning_rate_writes_nothing():
    """A scheduler sets η = 1e6 for one step: the outputs that step would leave on its batch
    are checked before it writes, so it is refused and writes nothing; the next steps, at
    η = 0.3 again, train as if that batch had been skipped."""
    batches = [(DATA[0][i : i + 8], DATA[1][i : i + 8]) for i in range(0, 64, 8)]

    def step(net, grower, x, y):
        F.mse_loss(net.train()(x), y).backward()
        grower.step()

    net, grower = build()
    for x, y in batches[:3]:
        step(net, grower, x, y)
    for group in grower.param_groups:
        group["lr"] = 1e6
    with pytest.raises(ValueError, match=r"this step would raise the output RMS .* no entry "
                                         r"written"):
        step(net, grower, *batches[3])
    for group in grower.param_groups:
        group["lr"] = 0.3
    for x, y in batches[4:]:
        step(net, grower, x, y)
    skipped, skipping = build()
    for x, y in batches[:3] + batches[4:]:
        step(skipped, skipping, x, y)
    with torch.no_grad():
        assert torch.equal(net.eval()(DATA[2]), skipped.eval()(DATA[2]))


def test_the_last_step_can_be_undone():
    """Grower.drop_last_step(): the last step's entries go and the step counters step back;
    the model computes exactly what it did before that step (gws, whose steps the look-ahead
    check does not cover, and RBF with momentum, whose entries' weights depend on the count)."""
    for kind in ("gws", "rbf-momentum"):
        torch.manual_seed(0)
        if kind == "gws":
            net = GrowingSoftmaxNet(5, 2, 1, temperature=1.0, rule=ClippedSoftmaxRule(0.3, 2.0),
                                    initial_entries=4).double()
        else:
            net = GrowingRBFNet(5, 2, 1, temperature=1.0,
                                rule=FunctionalSGD(0.2, momentum=0.5)).double()
        grower = Grower(net)
        for i in range(0, 32, 8):
            F.mse_loss(net.train()(DATA[0][i : i + 8]), DATA[1][i : i + 8]).backward()
            grower.step()
            if i == 16:
                with torch.no_grad():
                    before = net.eval()(DATA[2])
        assert grower.drop_last_step() == 16  # 8 entries in each of the two layers
        with torch.no_grad():
            assert torch.equal(net.eval()(DATA[2]), before), kind
        assert all(int(layer.steps) == 3 for layer in grower.layers)


@pytest.mark.parametrize("kind", ["rbf", "linear", "gws", "gauge"])
def test_the_look_ahead_predicts_the_outputs_the_step_leaves(kind):
    """Dense twin of the look-ahead check: the outputs it predicts on a batch equal the
    layer's outputs on that batch after the step (float64)."""
    from rcdl import GaugeSoftmaxRule, GrowingLinear, GrowingRBF, GrowingSoftmax

    torch.manual_seed(0)
    if kind == "rbf":
        layer = GrowingRBF(5, 2, temperature=1.0, rule=FunctionalSGD(0.3))
    elif kind == "linear":
        layer = GrowingLinear(5, 2, rule=FunctionalSGD(0.3, per_sample=False))
    elif kind == "gws":
        layer = GrowingSoftmax(5, 2, temperature=1.0, rule=ClippedSoftmaxRule(0.3, 2.0))
    else:
        layer = GrowingSoftmax(5, 2, temperature=1.0, rule=GaugeSoftmaxRule(2.0, 0.3, 5.0))
    layer = layer.double()
    grower = Grower(layer)
    for i in (0, 8):
        x, y = DATA[0][i : i + 8], DATA[1][i : i + 8]
        F.mse_loss(layer.train()(x), y).backward()
        records = layer.recorder.ready()
        predicted = outputs_after(layer, records, *propose(layer))
        grower.step()
        with torch.no_grad():
            torch.testing.assert_close(layer.eval()(x), predicted, rtol=1e-12, atol=1e-12)


def test_a_step_with_huge_values_writes_nothing_in_a_softmax_layer():
    """The softmax normalises by the weights, so it is the values' step β that can blow the
    outputs up (gws: ṽ = −βg): a step at β = 1e8 is refused before it writes, judged from
    the normaliser the forward recorded; the same layer at β = 2 steps."""
    for beta, refused in ((1e8, True), (2.0, False)):
        torch.manual_seed(0)
        net = GrowingSoftmaxNet(5, 2, 1, temperature=1.0, rule=ClippedSoftmaxRule(0.3, beta),
                                initial_entries=4).double()
        grower = Grower(net)
        F.mse_loss(net.train()(DATA[0][:8]), DATA[1][:8]).backward()
        if refused:
            with pytest.raises(ValueError, match="this step would raise the output RMS"):
                grower.step()
            assert [len(layer.store) for layer in grower.layers] == [4, 4]
        else:
            grower.step()
            assert [len(layer.store) for layer in grower.layers] == [12, 12]


@pytest.mark.extra("classical")
def test_a_sharp_kernel_whose_first_answers_are_tiny_is_not_refused_as_diverging():
    """A sharp RBF net's first outputs are its kernel's far tail (about 1e−7 here); measured
    against them, ordinary growth looked like divergence. The reference scale is floored at
    1e−3 of the inputs' RMS (GrowingLayer.SCALE_FLOOR), and the net learns (digits: 97 %)."""
    from sklearn import datasets

    x, y = (torch.as_tensor(a) for a in datasets.load_digits(return_X_y=True))
    x = ((x - x.mean(0)) / x.std(0).clamp_min(1e-6)).float()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:1000], order[1000:1400]
    net = GrowingRBFNet(64, 10, 2, temperature=0.5, rule=FunctionalSGD(3.0))
    grower = Grower(net)
    for rows in train.split(16):
        grower.zero_grad()
        F.cross_entropy(net(x[rows]), y[rows]).backward()
        grower.step()
    floor = DivergenceGuard.SCALE_FLOOR
    # the blocks' first answers were below the floor (RMS-normalised inputs: RMS 1)
    assert all(grower.guards[layer.name].output_scale == pytest.approx(floor, rel=1e-5)
               for layer in net.blocks)
    with torch.no_grad():
        accuracy = (net.eval()(x[test]).argmax(1) == y[test]).float().mean()
    assert accuracy > 0.9
