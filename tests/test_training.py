"""The training loop: evaluations, logging, learners, errors, epochs, resume."""

import pytest
import torch
from torch import nn

from rcdl.app.data import TeacherConfig, make_teacher_data
from rcdl.app.rundir import RunDir
from rcdl.nn.networks import GrowingRBFNet
from rcdl.nn.rules import FunctionalSGD
from rcdl.optim.grower import Grower
from rcdl.train.loop import epoch_permutation, evaluate, train_one_pass

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
    model = GrowingRBFNet(4, 1, 1, temperature=1.0, rule=FunctionalSGD(0.1))
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


@pytest.mark.parametrize("kind", ["grower", "adam"])
def test_interrupted_run_resumes_to_the_same_result(interrupt_after, tmp_path, kind):
    def build():
        torch.manual_seed(0)
        if kind == "grower":
            model = GrowingRBFNet(4, 1, 1, temperature=1.0, rule=FunctionalSGD(0.1))
            return model, {"grower": Grower(model)}
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        return model, {"optimizer": torch.optim.Adam(model.parameters(), lr=1e-2)}

    kw = {"batch_size": 4, "eval_every": 3, "progress": False, "seed": 3}
    model, learner = build()
    reference = train_one_pass(model, DATA, **learner, **kw)

    ckpt = tmp_path / "ckpt.pt"
    model, learner = build()
    stopped = interrupt_after(next(iter(learner.values())), 7)
    with pytest.raises(stopped):
        train_one_pass(model, DATA, **learner, checkpoint_path=ckpt, checkpoint_every=2, **kw)
    assert ckpt.with_name("ckpt.manifest.json").exists()  # steps 4 and 6 kept, 2 deleted
    assert sorted(p.name for p in tmp_path.glob("ckpt.step*")) == ["ckpt.step00000004.pt",
                                                                   "ckpt.step00000006.pt"]
    model, learner = build()  # a fresh process: nothing but the checkpoint survives
    resumed = train_one_pass(model, DATA, **learner, checkpoint_path=ckpt, **kw)
    assert resumed["resumed"] and not reference["resumed"]
    assert resumed["history"] == reference["history"]
    assert resumed["test_mse"] == reference["test_mse"]
    assert resumed["entries"] == reference["entries"]


def test_checkpoint_of_another_run_is_refused(interrupt_after, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stopped = interrupt_after(opt, 4)
    with pytest.raises(stopped):
        train_one_pass(model, DATA, batch_size=8, optimizer=opt, progress=False,
                       checkpoint_path=ckpt, checkpoint_every=2)  # fmt: skip
    model = _linear()
    with pytest.raises(ValueError, match="different run: seed=0"):
        train_one_pass(model, DATA, batch_size=8, seed=5, progress=False, checkpoint_path=ckpt,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.05))  # fmt: skip


# --------------------------------------------------------------------------- several epochs


def test_epoch_zero_is_the_one_pass_order():
    one_pass = torch.randperm(50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(epoch_permutation(50, 3, 0), one_pass)
    orders = [epoch_permutation(50, 3, e) for e in range(3)]
    assert torch.equal(epoch_permutation(50, 3, 2), orders[2])  # a pure function of (seed, e)
    assert not torch.equal(orders[0], orders[1]) and not torch.equal(orders[1], orders[2])
    assert all(torch.equal(o.sort().values, torch.arange(50)) for o in orders)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        epoch_permutation(50, 3, -1)


def test_first_epoch_of_several_is_the_one_pass_run():
    def fit(epochs):
        model = _linear()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return train_one_pass(model, DATA, batch_size=8, seed=2, optimizer=opt, eval_every=3,
                              epochs=epochs, progress=False)  # fmt: skip

    one, three = fit(1), fit(3)
    # 7 steps per epoch; evaluations every 3 steps (counted over all epochs) and at epoch ends
    assert [h["step"] for h in three["history"]] == [0, 3, 6, 7, 9, 12, 14, 15, 18, 21]
    assert [h["epoch"] for h in three["history"] if h["epoch"] == int(h["epoch"])] == [0, 1, 2, 3]
    assert three["history"][:4] == one["history"]
    assert (three["steps"], three["samples"], three["epochs"]) == (21, 150, 3)
    assert three["test_mse"] < one["test_mse"]


def test_growing_model_writes_entries_every_epoch():
    model = GrowingRBFNet(4, 1, 1, temperature=1.0, rule=FunctionalSGD(0.1))
    r = train_one_pass(model, DATA, batch_size=8, grower=Grower(model), epochs=3, progress=False)
    assert r["entries"] == 3 * 2 * 50


def test_on_epoch_end_adds_train_metrics_at_epoch_ends():
    model = _linear()
    x_train, y_train = DATA[0], DATA[1]
    calls = []

    def train_mse(epoch):
        calls.append(epoch)
        return evaluate(model, x_train, y_train, {"train_mse": nn.functional.mse_loss})

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    r = train_one_pass(model, DATA, batch_size=8, optimizer=opt, eval_every=3, epochs=2,
                       on_epoch_end=train_mse, progress=False)  # fmt: skip
    assert calls == [0, 1, 2]
    with_train = [h["epoch"] for h in r["history"] if "train_mse" in h]
    assert with_train == [0.0, 1.0, 2.0]
    assert r["history"][-1]["train_mse"] < r["history"][0]["train_mse"]


@pytest.mark.parametrize("kind", ["grower", "adam"])
@pytest.mark.parametrize("stop", [8, 16], ids=["checkpoint-in-epoch-1", "checkpoint-in-epoch-2"])
def test_run_interrupted_in_a_later_epoch_resumes_to_the_same_result(interrupt_after, tmp_path,
                                                                    kind, stop):
    """7 steps per epoch, checkpoints every 3 steps: stopping after 8 steps resumes from the
    step-6 checkpoint across the epoch boundary; after 16, from step 15 in epoch 3."""

    def build():
        torch.manual_seed(0)
        if kind == "grower":
            model = GrowingRBFNet(4, 1, 1, temperature=1.0, rule=FunctionalSGD(0.1))
            return model, {"grower": Grower(model)}
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        return model, {"optimizer": torch.optim.Adam(model.parameters(), lr=1e-2)}

    def fit(model, learner, **extra):
        def train_mse(epoch):
            return evaluate(model, DATA[0], DATA[1], {"train_mse": nn.functional.mse_loss})

        kw = {"batch_size": 8, "eval_every": 4, "seed": 3, "epochs": 3, "progress": False}
        return train_one_pass(model, DATA, **learner, **kw, on_epoch_end=train_mse, **extra)

    reference = fit(*build())
    ckpt = tmp_path / "ckpt.pt"
    model, learner = build()
    stopped = interrupt_after(next(iter(learner.values())), stop)
    with pytest.raises(stopped):
        fit(model, learner, checkpoint_path=ckpt, checkpoint_every=3)
    resumed = fit(*build(), checkpoint_path=ckpt)
    assert resumed["resumed"]
    assert resumed["history"] == reference["history"]
    assert resumed["entries"] == reference["entries"]


def test_checkpoint_past_the_last_epoch_is_refused(interrupt_after, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stopped = interrupt_after(opt, 11)
    with pytest.raises(stopped):
        train_one_pass(model, DATA, batch_size=8, optimizer=opt, epochs=3, progress=False,
                       checkpoint_path=ckpt, checkpoint_every=10)  # fmt: skip
    model = _linear()
    with pytest.raises(ValueError, match="at step 10, past the 7 steps of 1 epoch"):
        train_one_pass(model, DATA, batch_size=8, progress=False, checkpoint_path=ckpt,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.05))  # fmt: skip


def test_epochs_must_be_positive():
    with pytest.raises(ValueError, match="epochs must be >= 1, got 8, 50 and 0"):
        train_one_pass(_linear(), DATA, batch_size=8, epochs=0, progress=False,
                       optimizer=torch.optim.SGD(_linear().parameters(), lr=0.1))  # fmt: skip


# --------------------------------------------------------------------------- the loop's pieces


def test_schedule_steps_cover_every_sample_once_per_epoch():
    from rcdl.train.loop import Schedule, epoch_permutation

    schedule = Schedule(n=10, batch_size=4, epochs=2, seed=3)
    assert (schedule.steps_per_epoch, schedule.steps) == (3, 6)
    assert [schedule.seen(s) for s in range(7)] == [0, 4, 8, 10, 14, 18, 20]
    batches = list(schedule.batches(0))
    assert [s for s, _ in batches] == list(range(6))
    for epoch in range(2):
        order = torch.cat([idx for s, idx in batches if s // 3 == epoch])
        assert torch.equal(order, epoch_permutation(10, 3, epoch))
    later = list(schedule.batches(4))  # a resumed loop starts mid-epoch with the same batches
    assert all(torch.equal(a[1], b[1]) for a, b in zip(later, batches[4:], strict=True))
    assert [schedule.ends_epoch(s) for s in range(7)] == [True, False, False, True, False,
                                                          False, True]


def test_checkpointer_saves_between_steps_only_and_refuses_another_run(tmp_path):
    from rcdl.train.loop import Checkpointer

    model = nn.Linear(2, 1)
    saver = Checkpointer(tmp_path / "c.pt", 2, {"name": "m", "seed": 0}, model, None, None)
    assert [s for s in range(1, 7) if saver.due(s, 6)] == [2, 4]  # never after the last step
    assert saver.restore() is None
    saver.save({"step": 2, "history": []})
    saver.close()  # each holds a lock on the path from its first restore or save
    other = Checkpointer(tmp_path / "c.pt", 2, {"name": "m", "seed": 1}, nn.Linear(2, 1), None,
                         None)  # fmt: skip
    with pytest.raises(ValueError, match="different run: seed=0"):
        other.restore()
    other.close()
    fresh = nn.Linear(2, 1)
    again = Checkpointer(tmp_path / "c.pt", 2, {"name": "m", "seed": 0}, fresh, None, None)
    assert again.restore() == {"step": 2, "history": []}
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.parametrize("call", ["predict", "evaluate", "explain"])
def test_evaluation_restores_every_submodules_own_mode(call):
    """A BatchNorm frozen with .eval() inside a model in training mode stays frozen after an
    evaluation (model.train(was_training) put it back in training mode)."""
    import torch.nn.functional as F

    from rcdl import explain
    from rcdl.train.loop import predict

    torch.manual_seed(0)
    net = GrowingRBFNet(4, 1, 1, temperature=1.0, rule=FunctionalSGD(0.5))
    model = nn.Sequential(nn.BatchNorm1d(4), net)
    grower = Grower(model)
    x, y = DATA[0][:8], DATA[1][:8]
    F.mse_loss(model(x), y).backward()
    grower.step()
    model[0].eval()  # frozen statistics, the rest trains
    if call == "predict":
        predict(model, x)
    elif call == "evaluate":
        evaluate(model, x, y, {"mse": F.mse_loss})
    else:
        explain(model, x, target=torch.zeros(8, dtype=torch.long), k=2)
    assert model.training and net.training and not model[0].training


def _classification_task(n_train: int = 256):
    """Two Gaussian blobs per class, 4 classes in 8 dimensions: a growing RBF net learns
    them in one pass."""
    gen = torch.Generator().manual_seed(0)
    centres = 3 * torch.randn(4, 8, generator=gen)
    y = torch.randint(0, 4, (n_train + 128,), generator=gen)
    x = centres[y] + torch.randn(n_train + 128, 8, generator=gen)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def test_a_classification_loss_is_scored_by_accuracy_and_itself_by_default():
    """``loss_fn=F.cross_entropy`` and no ``metrics=``: the test set is scored by accuracy
    and cross-entropy, not by the regression default (which cannot compare logits (M, 4)
    with labels (M,))."""
    import torch.nn.functional as F

    data = _classification_task()
    net = GrowingRBFNet(8, 4, 1, temperature=2.0, rule=FunctionalSGD(1.0))
    result = train_one_pass(net, data, batch_size=16, grower=Grower(net),
                            loss_fn=F.cross_entropy, eval_every=8, progress=False)
    assert list(result["history"][-1])[3:] == ["test_acc", "test_loss"]
    assert result["test_acc"] > 0.8 > result["history"][0]["test_acc"]  # it learns
    logits = net.eval()(data[2])
    assert result["test_loss"] == pytest.approx(F.cross_entropy(logits, data[3]).item(),
                                                rel=1e-5)


def test_a_metric_that_does_not_fit_the_outputs_names_metrics():
    import torch.nn.functional as F

    data = _classification_task(64)
    net = GrowingRBFNet(8, 4, 1, temperature=2.0, rule=FunctionalSGD(1.0))
    with pytest.raises(ValueError, match=r"test metric 'test_mse'.*\(128, 4\).*\(128,\).*"
                                         r"metrics="), \
            pytest.warns(UserWarning, match="target size"):  # torch's, before it fails
        train_one_pass(net, data, batch_size=16, grower=Grower(net), loss_fn=F.cross_entropy,
                       metrics={"test_mse": F.mse_loss}, progress=False)
