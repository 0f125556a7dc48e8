"""The one-pass training loop: evaluations, logging, learners, errors."""

import pytest
import torch
from torch import nn

from rcdl.data import TeacherConfig, make_teacher_data
from rcdl.grower import Grower
from rcdl.networks import GrowingRBFNet
from rcdl.rundir import RunDir
from rcdl.training import train_one_pass

DATA = make_teacher_data(TeacherConfig(d_in=4, hidden=8, depth=1, n_train=50, n_test=20))


def _linear():
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def test_parametric_model_learns_and_logs_each_evaluation(tmp_path):
    run = RunDir.create("t", path=tmp_path)
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    r = train_one_pass(model, DATA, batch_size=8, optimizer=opt, eval_every=3, run=run,
                       name="lin", progress=False)  # fmt: skip
    # 7 steps (the last one of 2 samples): evaluations before, after steps 3 and 6, at the end
    assert [h["samples"] for h in r["history"]] == [0, 24, 48, 50]
    assert r["steps"] == 7 and r["entries"] is None and r["bytes"] is None
    assert r["test_mse"] < r["history"][0]["test_mse"]
    records = run.read_metrics()
    assert [rec["step"] for rec in records] == [0, 3, 6, 7]
    assert records[0]["train_loss"] is None and records[-1]["model"] == "lin"


def test_growing_model_writes_one_entry_per_sample_per_layer():
    model = GrowingRBFNet(4, None, 1, 1, temperature=1.0, lr=0.5)
    r = train_one_pass(model, DATA, batch_size=8, grower=Grower(model), progress=False)
    assert r["entries"] == 2 * 50 and r["bytes"] > 0
    assert sum(p.numel() for p in model.parameters()) == 0


def test_same_seed_same_run():
    runs = [
        train_one_pass(m, DATA, batch_size=8, seed=1, progress=False,
                       optimizer=torch.optim.Adam(m.parameters(), lr=1e-2))
        for m in (_linear(), _linear())
    ]  # fmt: skip
    assert runs[0]["history"] == runs[1]["history"]


def test_needs_a_learner():
    with pytest.raises(ValueError, match="optimizer, a grower or both"):
        train_one_pass(_linear(), DATA, batch_size=8, progress=False)


def test_divergence_names_the_step():
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=1e30)
    with pytest.raises(FloatingPointError, match="at step"):
        train_one_pass(model, DATA, batch_size=8, optimizer=opt, progress=False)


class _Interrupt(Exception):
    pass


def _stop_after(learner, steps):
    """Make ``learner.step`` raise after ``steps`` calls (a simulated kill)."""
    original, calls = learner.step, {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] > steps:
            raise _Interrupt
        original()

    learner.step = step


@pytest.mark.parametrize("kind", ["grower", "adam"])
def test_interrupted_run_resumes_to_the_same_result(tmp_path, kind):
    def build():
        torch.manual_seed(0)
        if kind == "grower":
            model = GrowingRBFNet(4, None, 1, 1, temperature=1.0, lr=0.5)
            return model, {"grower": Grower(model)}
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        return model, {"optimizer": torch.optim.Adam(model.parameters(), lr=1e-2)}

    kw = {"batch_size": 4, "eval_every": 3, "progress": False, "seed": 3}
    model, learner = build()
    reference = train_one_pass(model, DATA, **learner, **kw)

    ckpt = tmp_path / "ckpt.pt"
    model, learner = build()
    _stop_after(next(iter(learner.values())), 7)
    with pytest.raises(_Interrupt):
        train_one_pass(model, DATA, **learner, checkpoint_path=ckpt, checkpoint_every=2, **kw)
    assert ckpt.exists()
    model, learner = build()  # a fresh process: nothing but the checkpoint survives
    resumed = train_one_pass(model, DATA, **learner, checkpoint_path=ckpt, **kw)
    assert resumed["resumed"] and not reference["resumed"]
    assert resumed["history"] == reference["history"]
    assert resumed["test_mse"] == reference["test_mse"]
    assert resumed["entries"] == reference["entries"]


def test_checkpoint_of_another_run_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _stop_after(opt, 4)
    with pytest.raises(_Interrupt):
        train_one_pass(model, DATA, batch_size=8, optimizer=opt, progress=False,
                       checkpoint_path=ckpt, checkpoint_every=2)
    model = _linear()
    with pytest.raises(ValueError, match="different run: seed=0"):
        train_one_pass(model, DATA, batch_size=8, seed=5, progress=False, checkpoint_path=ckpt,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
