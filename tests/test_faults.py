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

from rcdl import FunctionalSGD, Grower, GrowingRBFNet, GrowingSoftmaxNet
from rcdl.checkpoint import (
    DamagedCheckpoint,
    checkpoint_files,
    load_checkpoint,
    save_checkpoint,
)
from rcdl.data import TeacherConfig, make_teacher_data
from rcdl.rules import ClippedSoftmaxRule
from rcdl.training import train_one_pass

TIMEOUT = timedelta(seconds=60)
DATA = make_teacher_data(TeacherConfig(d_in=5, hidden=8, d_out=2, n_train=64, n_test=16,
                                       dtype="float64"))
KW = {"batch_size": 8, "eval_every": 2, "progress": False, "seed": 1}


def build():
    torch.manual_seed(0)
    net = GrowingRBFNet(5, 2, 1, temperature=1.0, rule=FunctionalSGD(0.3)).double()
    return net, Grower(net)


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


def interrupted(tmp_path, steps):
    """A run stopped after ``steps`` growth steps, checkpointing every 2."""
    ckpt = tmp_path / "ckpt.pt"
    net, grower = build()
    original, calls = grower.step, {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] > steps:
            raise KeyboardInterrupt
        original()

    grower.step = step
    with pytest.raises(KeyboardInterrupt):
        train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, checkpoint_every=2,
                       **KW)
    return ckpt


def test_a_flipped_checkpoint_falls_back_to_the_previous_one_and_says_so(tmp_path, capsys):
    """200 bytes flipped in the newest checkpoint: the run resumes from the one before (the
    last two are kept), says which and why, and ends as the uninterrupted run."""
    expected = reference()
    ckpt = interrupted(tmp_path, 7)  # checkpoints at steps 4 and 6
    flip(checkpoint_files(ckpt, 6))
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, **KW)
    err = capsys.readouterr().err
    assert "ckpt.step00000006.pt is damaged" in err and "SHA-256" in err
    assert "resuming from the checkpoint of step 4" in err
    assert resumed["resumed"] and resumed["history"] == expected["history"]


def test_with_every_checkpoint_damaged_the_run_starts_afresh_and_says_so(tmp_path, capsys):
    expected = reference()
    ckpt = interrupted(tmp_path, 7)
    checkpoint_files(ckpt, 6).write_bytes(b"")  # emptied
    checkpoint_files(ckpt, 4).unlink()  # lost
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, **KW)
    err = capsys.readouterr().err
    assert "is empty" in err and "ckpt.step00000004.pt is missing" in err
    assert "no checkpoint could be read; this run starts from step 0" in err
    assert not resumed["resumed"] and resumed["history"] == expected["history"]


def test_a_damaged_manifest_starts_afresh_and_says_so(tmp_path, capsys):
    expected = reference()
    ckpt = interrupted(tmp_path, 5)
    manifest = ckpt.with_name("ckpt.manifest.json")
    manifest.write_text(manifest.read_text()[:40])  # cut mid-way
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, **KW)
    assert "ckpt.manifest.json is damaged" in capsys.readouterr().err
    assert not resumed["resumed"] and resumed["history"] == expected["history"]


def test_temporaries_of_interrupted_writes_are_removed(tmp_path):
    ckpt = interrupted(tmp_path, 5)
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
    from rcdl import checkpoint
    from rcdl.distributed import shard

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
                real_kept = checkpoint.Checkpointer._kept_files

                def kept(self, rank, world):
                    if json_step(self.manifest) == 6:
                        os._exit(9)
                    return real_kept(self, rank, world)

                checkpoint.Checkpointer._kept_files = kept
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
    result = tmp_path / f"{tag}.pt"
    mp.start_processes(_sharded, args=(2, tmp_path / f"{tag}.init", folder, fault, result),
                       nprocs=2, join=True, start_method="spawn")
    return torch.load(result, weights_only=False)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_rank_killed_at_each_phase_of_a_sharded_checkpoint_resumes(fault, tmp_path):
    """Rank files tagged with their step, the manifest written last by rank 0 after every
    rank's file, older files deleted only after a barrier: a kill at any phase leaves a
    committed checkpoint that every rank holds, and the resumed run ends as the
    uninterrupted one."""
    _, expected = _spawn(tmp_path, "reference", tmp_path / "reference", None)
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
    from rcdl.checkpoint import load_model_state

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


def test_one_step_at_a_huge_learning_rate_can_be_undone():
    """A scheduler sets η = 1e6 for one step: its entries are accepted, and every later step
    is refused as diverging. Grower.drop_last_step() removes that step's entries: the model
    computes what it did before it, and training goes on."""
    net, grower = build()
    batches = [(DATA[0][i : i + 8], DATA[1][i : i + 8]) for i in range(0, 64, 8)]

    def step(x, y):
        F.mse_loss(net.train()(x), y).backward()
        grower.step()

    for x, y in batches[:3]:
        step(x, y)
    with torch.no_grad():
        good = net.eval()(DATA[2])
    grower.param_groups[0]["lr"] = grower.param_groups[1]["lr"] = 1e6
    step(*batches[3])  # accepted: the outputs it is judged on are the pre-step store's
    for group in grower.param_groups:
        group["lr"] = 0.3
    with pytest.raises(ValueError, match="diverging"):
        step(*batches[4])
    assert grower.drop_last_step() == 16  # 8 entries in each of the two layers
    with torch.no_grad():
        assert torch.equal(net.eval()(DATA[2]), good)
    for x, y in batches[4:]:
        step(x, y)  # accepted again
    assert all(int(layer.steps) == 7 for layer in grower.layers)
