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


def test_a_damaged_manifest_starts_afresh_and_says_so(interrupted, capsys):
    expected = reference()
    ckpt = interrupted(5)
    manifest = ckpt.with_name("ckpt.manifest.json")
    manifest.write_text(manifest.read_text()[:40])  # cut mid-way
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, **KW)
    assert "ckpt.manifest.json is damaged" in capsys.readouterr().err
    assert not resumed["resumed"] and resumed["history"] == expected["history"]


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


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory):
    """The uninterrupted sharded run's history (spawned once for the three faults)."""
    folder = tmp_path_factory.mktemp("sharded-reference")
    return _spawn(folder, "reference", folder / "run", None)[1]


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
        records = layer.ready_records()
        predicted = layer.outputs_after(records, *layer.propose())
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


def test_a_sharp_kernel_whose_first_answers_are_tiny_is_not_refused_as_diverging():
    """A sharp RBF net's first outputs are its kernel's far tail (about 1e−7 here); measured
    against them, ordinary growth looked like divergence. The reference scale is floored at
    1e−3 of the inputs' RMS (GrowingLayer.SCALE_FLOOR), and the net learns (digits: 97 %)."""
    datasets = pytest.importorskip("sklearn.datasets")
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
    floor = net.readout.SCALE_FLOOR
    # the blocks' first answers were below the floor (RMS-normalised inputs: RMS 1)
    assert all(layer.output_scale == pytest.approx(floor, rel=1e-5) for layer in net.blocks)
    with torch.no_grad():
        accuracy = (net.eval()(x[test]).argmax(1) == y[test]).float().mean()
    assert accuracy > 0.9
