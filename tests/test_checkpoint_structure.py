"""What a checkpoint holds is checked before any of it is loaded: a file whose digest
verifies but whose layout is not a checkpoint's is skipped as a damaged one, a load is all
of it or none (model, optimizer, grower), a state entry that is not a tensor of the model's
kind of number is refused, and the lock beside a checkpoint is written into only if it is a
regular file of its own."""

import errno
import json
import os
import re

import pytest
import torch
from torch import nn

from rcdl._io import lock_exclusively
from rcdl.train.checkpoint import (
    Checkpointer,
    CheckpointInUse,
    checkpoint_files,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
)
from rcdl.train.loop import train_one_pass
from small_runs import TEACHER_DATA, TEACHER_KW, teacher_net

DATA, KW, build = TEACHER_DATA, TEACHER_KW, teacher_net


def states(net, grower):
    """Copies of everything a restore may change."""
    return ({k: v.clone() for k, v in net.state_dict().items()}, grower.state_dict())


def same_states(a, b):
    (model_a, grower_a), (model_b, grower_b) = a, b
    return (model_a.keys() == model_b.keys() and grower_a == grower_b
            and all(torch.equal(model_a[k], model_b[k]) for k in model_a))


@pytest.fixture(scope="module")
def reference():
    net, grower = build()
    return train_one_pass(net, DATA, grower=grower, **KW)


@pytest.fixture
def interrupted(tmp_path, interrupt_after):
    """A run stopped after 7 growth steps, checkpointing every 2 (steps 4 and 6 kept);
    returns its checkpoint path."""
    ckpt = tmp_path / "ckpt.pt"
    net, grower = build()
    with pytest.raises(interrupt_after(grower, 7)):
        train_one_pass(net, DATA, grower=grower, checkpoint_path=ckpt, checkpoint_every=2, **KW)
    return ckpt


def rewrite(ckpt, step, change):
    """Replace the checkpoint of ``step`` by ``change(state)``, written with a valid header
    and listed in the manifest with its new digest, as anyone can."""
    file = checkpoint_files(ckpt, step)
    digest = save_checkpoint(change(load_checkpoint(file)), file)
    manifest = ckpt.with_name("ckpt.manifest.json")
    listed = json.loads(manifest.read_text())
    for entry in listed["checkpoints"]:
        if entry["step"] == step:
            entry["sha256"] = [digest]
    manifest.write_text(json.dumps(listed))


def without(key):
    return lambda state: {k: v for k, v in state.items() if k != key}


def replace(part, key, value):
    def change(state):
        state[part][key] = value
        return state

    return change


MALFORMED = {
    "no-run-part": (without("run"), "it has no run part"),
    "run-a-list": (lambda s: s | {"run": ["model"]}, "its run part is a list, not a dict"),
    "model-a-list": (lambda s: s | {"model": list(s["model"].values())},
                     "its model part is a list, not a dict of tensors by name"),
    "model-entry-an-int": (replace("model", "readout.steps", 5),
                           "its model part holds int 5 under 'readout.steps', not a tensor"),
    "loop-step-none": (replace("loop", "step", None),
                       "its loop part is not a dict with an integer step"),
    "loop-of-another-step": (replace("loop", "step", 4),
                             "its loop is at step 4, its name and manifest say 6"),
    "no-grower-part": (without("grower"), "it has no grower part"),
    "grower-steps-of-other-layers": (
        replace("grower", "steps", {"blocks.0": 3, "x": 3}),
        r"grower: its param_groups are for layers \['blocks.0', 'readout'\], its steps for "
        r"\['blocks.0', 'x'\]"),
    "grower-groups-a-string": (replace("grower", "param_groups", "readout"),
                               r"grower\['param_groups'\] is not a list of groups"),
    "grower-without-output-scale": (
        lambda s: s | {"grower": {k: v for k, v in s["grower"].items() if k != "output_scale"}},
        "grower has no output_scale"),
}


@pytest.mark.parametrize("fault", list(MALFORMED))
def test_a_malformed_checkpoint_is_skipped_as_a_damaged_one(fault, interrupted, reference,
                                                            capsys):
    """The newest checkpoint rewritten with a valid header and the wrong layout: the resume
    names it and what is wrong, falls back to the one before, and ends as the uninterrupted
    run (it used to die in a KeyError or TypeError, maybe with the model already loaded)."""
    change, said = MALFORMED[fault]
    rewrite(interrupted, 6, change)
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=interrupted, **KW)
    err = capsys.readouterr().err
    assert "the checkpoint of step 6 is not used: checkpoint" in err
    assert "ckpt.step00000006.pt is damaged: it does not hold what a checkpoint" in err
    assert re.search(said, err), err
    assert "resuming from the checkpoint of step 4" in err
    assert resumed["resumed"] and resumed["history"] == reference["history"]



LOOP_FAULTS = {
    "no-history": (lambda loop: {k: v for k, v in loop.items() if k != "history"},
                   "history is NoneType"),
    "clock-a-list": (lambda loop: loop | {"clock": [0.0, 0.0]}, "clock is list"),
    "history-of-strings": (lambda loop: loop | {"history": ["step 2"]},
                           "history is not a list of evaluation records"),
}


@pytest.mark.parametrize("fault", list(LOOP_FAULTS))
def test_a_training_loop_state_it_did_not_write_is_skipped(fault, interrupted, reference,
                                                           capsys):
    """train_one_pass checks the loop state its checkpoints hold (it used to die in
    ``KeyError: 'history'``) and falls back to the checkpoint before."""
    change, said = LOOP_FAULTS[fault]
    rewrite(interrupted, 6, lambda s: s | {"loop": change(s["loop"])})
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=interrupted, **KW)
    err = capsys.readouterr().err
    assert f"it does not hold what a checkpoint of this run holds: its loop part: {said}" in err
    assert resumed["resumed"] and resumed["history"] == reference["history"]


def test_with_every_checkpoint_malformed_the_run_starts_afresh(interrupted, reference, capsys):
    for step in (4, 6):
        rewrite(interrupted, step, without("model"))
    net, grower = build()
    resumed = train_one_pass(net, DATA, grower=grower, checkpoint_path=interrupted, **KW)
    err = capsys.readouterr().err
    assert err.count("it has no model part") == 2
    assert "no checkpoint could be read; this run starts from step 0" in err
    assert not resumed["resumed"] and resumed["history"] == reference["history"]


def test_a_caller_states_its_own_loop_layout(interrupted):
    """The loop part is the caller's: a check it gives refuses a loop it did not write, and
    that checkpoint is skipped as a damaged one."""
    rewrite(interrupted, 6, lambda s: s | {"loop": {"step": 6}})

    def loop_problem(loop):
        return None if isinstance(loop.get("history"), list) else "no history list"

    net, grower = build()
    identity = {"name": "model", "seed": 1, "batch_size": 8, "train_samples": 64}
    saver = Checkpointer(interrupted, 2, identity, net, None, grower, loop_problem=loop_problem)
    try:
        assert saver.restore()["step"] == 4
    finally:
        saver.close()


def test_a_grower_that_refuses_its_part_leaves_the_model_as_it_was(interrupted):
    """A well-formed checkpoint whose grower part is for other layers: the grower refuses it
    after the model's part would have loaded; the error names the file, and the model and
    grower are as they were (before, the model kept the checkpoint's entries)."""
    def other_layers(state):
        grower = state["grower"]
        rename = {"blocks.0": "a", "readout": "b"}
        grower["param_groups"] = [g | {"layer": rename[g["layer"]]}
                                  for g in grower["param_groups"]]
        for key in ("steps", "output_scale", "evicted"):
            grower[key] = {rename[k]: v for k, v in grower[key].items()}
        return state

    rewrite(interrupted, 6, other_layers)
    net, grower = build()
    before = states(net, grower)
    identity = {"name": "model", "seed": 1, "batch_size": 8, "train_samples": 64}
    saver = Checkpointer(interrupted, 2, identity, net, None, grower)
    try:
        with pytest.raises(ValueError, match=r"checkpoint .*ckpt.step00000006.pt was not loaded "
                                             r"\(the model and learners are as they were\): "
                                             r"Grower.load_state_dict"):
            saver.restore()
    finally:
        saver.close()
    assert same_states(before, states(net, grower))
    assert len(net.readout.store) == 0


def _linear_run(path, lr=0.1):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, optimizer, Checkpointer(path, 1, {"name": "m"}, model, optimizer, None)


def _sgd_step(model, optimizer):
    model(torch.ones(4, 3)).square().sum().backward()
    optimizer.step()


def test_an_optimizer_that_refuses_its_part_leaves_the_model_as_it_was(tmp_path):
    """torch's optimizer refuses a part of another number of groups only after the model's
    part was loaded: the model is put back."""
    model, optimizer, saver = _linear_run(tmp_path / "ckpt.pt")
    _sgd_step(model, optimizer)
    saver.save({"step": 1})
    saver.close()

    def two_groups(state):
        groups = state["optimizer"]["param_groups"]
        state["optimizer"]["param_groups"] = [groups[0] | {"params": [0]},
                                              groups[0] | {"params": [1]}]
        return state

    rewrite(tmp_path / "ckpt.pt", 1, two_groups)
    fresh, fresh_optimizer, again = _linear_run(tmp_path / "ckpt.pt")
    weight = fresh.weight.detach().clone()
    try:
        with pytest.raises(ValueError, match="was not loaded .*parameter groups"):
            again.restore()
    finally:
        again.close()
    assert torch.equal(fresh.weight, weight) and not fresh_optimizer.state


def test_a_malformed_optimizer_part_is_skipped(tmp_path, capsys):
    model, optimizer, saver = _linear_run(tmp_path / "ckpt.pt")
    for step in (1, 2):
        _sgd_step(model, optimizer)
        saver.save({"step": step})
    saver.close()
    rewrite(tmp_path / "ckpt.pt", 2, replace("optimizer", "param_groups", {"lr": 0.1}))
    fresh, _, again = _linear_run(tmp_path / "ckpt.pt")
    try:
        assert again.restore() == {"step": 1}
    finally:
        again.close()
    assert "optimizer['param_groups'] is not a list of groups" in capsys.readouterr().err


# --------------------------------------------------------------------------- load_model_state


def _sequential(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))


@pytest.mark.parametrize("fault", ["an-int", "a-list", "an-integer-tensor",
                                   "a-floating-count"])
def test_load_model_state_refuses_a_value_of_another_type_before_loading_anything(fault):
    """``state["0.bias"] = 5``: torch loads the other parameters, then raises; an integer
    tensor for a floating parameter (or the reverse) torch casts without a word. Each is
    refused, naming the key, with nothing loaded."""
    state = {k: v + 1 for k, v in _sequential(0).state_dict().items()}
    key, value, said = {
        "an-int": ("0.bias", 5, "0.bias: int 5, not a tensor"),
        "a-list": ("0.bias", [1.0, 2.0], r"0.bias: list \[1.0, 2.0\], not a tensor"),
        "an-integer-tensor": ("0.bias", torch.tensor([1, 2]),
                              "0.bias: torch.int64, the model has torch.float32"),
        "a-floating-count": ("1.num_batches_tracked", torch.tensor(3.0),
                             "1.num_batches_tracked: torch.float32, the model has torch.int64"),
    }[fault]
    state[key] = value
    model = _sequential(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"Sequential: the state cannot be loaded, nothing "
                                         f"was: {said}"):
        load_model_state(model, state)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_load_model_state_refuses_a_state_that_is_not_a_dict():
    with pytest.raises(ValueError, match="the state is a list, not a dict of tensors"):
        load_model_state(_sequential(0), [torch.zeros(2)])


def test_a_non_tensor_in_a_growing_store_is_named_not_crashed_on():
    """A store checks its own rows; a row that is not a tensor is named (its check used to
    fail with AttributeError: 'int' object has no attribute 'dim')."""
    net, _ = build()
    state = net.state_dict() | {"readout.store.keys": 5}
    with pytest.raises(ValueError, match="readout.store.keys: int 5, not a tensor"):
        load_model_state(build()[0], state)


# --------------------------------------------------------------------------- the lock


def _special(kind, lock, target):
    if kind == "symlink":
        lock.symlink_to(target)
    elif kind == "dangling-symlink":
        lock.symlink_to(target.with_name("made-through-the-link.txt"))
    elif kind == "hard-link":
        os.link(target, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "hard-link", "fifo", "folder"])
def test_a_lock_that_is_a_link_or_no_regular_file_is_refused_and_nothing_written(kind,
                                                                                 tmp_path):
    """``ckpt.lock`` linked to a user's file: the run used to follow the link and replace
    the file with its holder line. Now it is refused, naming the lock, before any write."""
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's notes\n")
    lock = tmp_path / "ckpt.lock"
    _special(kind, lock, notes)
    net, grower = build()
    said = {"symlink": f"is a symbolic link to {notes}",
            "dangling-symlink": "is a symbolic link to",
            "hard-link": "is a regular file with 2 names",
            "fifo": "is a FIFO", "folder": "is a folder"}[kind]
    with pytest.raises(OSError, match=f"the lock file {lock} {said}") as err:
        train_one_pass(net, DATA, grower=grower, checkpoint_path=tmp_path / "ckpt.pt", **KW)
    assert err.value.errno == (errno.ELOOP if "symlink" in kind else errno.EPERM)
    assert notes.read_text() == "a user's notes\n"
    assert not (tmp_path / "made-through-the-link.txt").exists()
    assert not checkpoint_files(tmp_path / "ckpt.pt", 2).exists()


def test_a_held_lock_names_its_holder_and_is_free_again_once_released(tmp_path):
    """A held lock's holder is read from the descriptor that found it held (never by its
    name again), and a second checkpointer on the path says who holds it."""
    path = tmp_path / "ckpt.pt"
    net, grower = build()
    first = Checkpointer(path, 2, {"name": "m"}, net, None, grower)
    first.restore()
    holder = (tmp_path / "ckpt.lock").read_text()
    assert holder.startswith(f"process {os.getpid()} on ")
    second = Checkpointer(path, 2, {"name": "m"}, build()[0], None, None)
    try:
        said = f"is in use by {re.escape(holder.strip())}: two runs"
        with pytest.raises(CheckpointInUse, match=said):
            second.restore()
    finally:
        first.close()
    fd = lock_exclusively(tmp_path / "ckpt.lock", create=True)  # free again, a regular file
    assert fd is not None
    os.close(fd)
