"""rcdl reproduce continual: the metrics, the tasks, the silent-memory restriction, the
baselines (EWC's Fisher, LwF, NCM, streaming LDA), the command, and that a growing model
does not overwrite what an earlier task taught it."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rcdl import FunctionalSGD, Grower
from rcdl.app.cli import main
from rcdl.app.experiments.continual import (
    ContinualConfig,
    average_incremental_accuracy,
    backward_transfer,
    class_order,
    entries_by_task,
    forgetting,
    own_entries_copy,
    task_split,
)
from rcdl.app.experiments.continual import baselines as cb
from rcdl.memory.provenance import UNKNOWN, entry_samples, samples
from rcdl.nn.layers import growing_layers
from rcdl.nn.networks import MLP, GrowingRBFNet, GrowingSoftmaxNet, ResNetMLP
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.train.loop import train_step
from tiny_nets import tiny_net, train_with_samples

# --------------------------------------------------------------------------- metrics

# R[i][j]: accuracy on task j after task i; task 0 peaks after task 1, not when learnt
MATRIX = [[90.0, 0.0, 0.0],
          [95.0, 80.0, 0.0],
          [20.0, 30.0, 70.0]]  # fmt: skip


def test_average_incremental_accuracy_averages_the_seen_tasks_after_each_step():
    # (90 + (95 + 80) / 2 + (20 + 30 + 70) / 3) / 3
    assert average_incremental_accuracy(MATRIX) == pytest.approx((90 + 87.5 + 40) / 3)


def test_backward_transfer_and_forgetting_differ_where_a_task_peaks_later():
    # BWT: ((20 − 90) + (30 − 80)) / 2; forgetting from each task's best: (95 − 20, 80 − 30)
    assert backward_transfer(MATRIX) == pytest.approx(-60.0)
    assert forgetting(MATRIX) == pytest.approx((75 + 50) / 2)
    kept = [[80.0, 0.0], [85.0, 70.0]]  # learning the second task helped the first
    assert backward_transfer(kept) == pytest.approx(5.0)
    assert forgetting(kept) == pytest.approx(-5.0)


def test_metrics_leave_out_tasks_without_test_images_and_refuse_ragged_matrices():
    matrix = [[90.0, None], [50.0, None]]
    assert average_incremental_accuracy(matrix) == pytest.approx((90 + 50) / 2)
    assert backward_transfer(matrix) == pytest.approx(-40.0)
    assert backward_transfer([[70.0]]) is None
    with pytest.raises(ValueError, match="square"):
        backward_transfer([[1.0, 2.0], [3.0]])


# --------------------------------------------------------------------------- tasks


def test_natural_order_splits_into_consecutive_pairs():
    assert task_split("0") == ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9))
    assert task_split("0", 5) == ((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))
    assert task_split("9876543210")[0] == (9, 8)


def test_random_orders_are_permutations_fixed_by_their_seed():
    one, again, two = class_order("random-1"), class_order("random-1"), class_order("random-2")
    assert sorted(one) == list(range(10)) and one == again and one != two
    assert one != tuple(range(10))


@pytest.mark.parametrize("order", ["1", "random", "random-x", "0123456788", "012345678"])
def test_unknown_orders_are_refused(order):
    with pytest.raises(ValueError, match="class order"):
        class_order(order)


def test_config_refuses_what_the_experiment_cannot_run():
    with pytest.raises(ValueError, match="class order"):
        ContinualConfig(orders=("random",))
    with pytest.raises(ValueError, match="raw-pixel"):
        ContinualConfig(models=("svm-linear",))
    with pytest.raises(ValueError, match="regularised_base"):
        ContinualConfig(regularised_base="gws")
    with pytest.raises(ValueError, match="two tasks"):
        ContinualConfig(classes_per_task=3)


# --------------------------------------------------------------------------- silent memories


def _trained_softmax_net() -> tuple[nn.Module, torch.Tensor]:
    """A growing softmax net (4 initial entries per layer, of no sample) trained on 30
    samples with indices 100..129; returns it and the samples' task (0, 1, 2 by tens)."""
    net = GrowingSoftmaxNet(6, 3, 1, temperature=1.0, rule=ClippedSoftmaxRule(0.1, 3.0),
                            initial_entries=4, seed=0)
    grower = Grower(net)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 6, generator=gen), torch.randint(0, 3, (30,), generator=gen)
    for i in range(0, 30, 5):
        with samples(net, torch.arange(100 + i, 105 + i)):
            train_step(net, x[i:i + 5], y[i:i + 5], F.cross_entropy, grower=grower)
    task_of_sample = torch.full((130,), 99, dtype=torch.long)
    task_of_sample[100:] = torch.arange(30) // 10
    return net, task_of_sample


def test_restriction_keeps_exactly_the_entries_of_the_tasks_samples_and_the_initial_ones():
    net, task_of_sample = _trained_softmax_net()
    keep = torch.arange(110, 120)  # the second task's samples
    restricted, kept = own_entries_copy(net, keep)
    for (name, layer), (_, original) in zip(growing_layers(restricted), growing_layers(net),
                                            strict=True):
        owners = entry_samples(layer)
        assert sorted(owners[owners != UNKNOWN].tolist()) == keep.tolist()
        assert int((owners == UNKNOWN).sum()) == 4  # the initial entries stay
        assert kept[name] == len(layer.store) == 14
        assert len(original.store) == 34  # the model itself is untouched
        # the kept rows are the original's rows, unchanged
        mine = torch.isin(entry_samples(original), keep) | (entry_samples(original) == UNKNOWN)
        torch.testing.assert_close(layer.store.keys, original.store.keys[mine])
    assert entries_by_task(net, task_of_sample, 3) == [20, 20, 20]  # 10 per layer, 2 layers


def test_restriction_to_the_first_task_is_the_model_as_it_was_after_that_task():
    # a growing layer never rewrites an entry, so keeping only the first task's entries
    # (and the initial ones) gives back the network as it stood after the first task:
    # the silent-memory accuracy of task 1 is then exactly R[1][1]
    torch.set_default_dtype(torch.float64)
    try:
        net = GrowingSoftmaxNet(6, 3, 1, temperature=1.0, rule=ClippedSoftmaxRule(0.1, 3.0),
                                initial_entries=4, seed=0)
        grower = Grower(net)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(40, 6, generator=gen), torch.randint(0, 3, (40,), generator=gen)
        probe = torch.randn(16, 6, generator=gen)
        for i in range(0, 40, 5):
            if i == 20:  # the end of the first task
                with torch.no_grad():
                    after_first = net.eval()(probe)
                net.train()
            with samples(net, torch.arange(i, i + 5)):
                train_step(net, x[i:i + 5], y[i:i + 5], F.cross_entropy, grower=grower)
        restricted, _ = own_entries_copy(net, torch.arange(20))
        with torch.no_grad():
            torch.testing.assert_close(restricted.eval()(probe), after_first, rtol=1e-12,
                                       atol=1e-12)
            assert not torch.allclose(net.eval()(probe), after_first)  # the later task told
    finally:
        torch.set_default_dtype(torch.float32)


# --------------------------------------------------------------------------- baselines


def _small_resnet_mlp() -> nn.Module:
    torch.manual_seed(0)
    return ResNetMLP(6, 3, depth=2, width=5).double()


def test_batched_fisher_is_the_per_sample_one():
    model = _small_resnet_mlp()
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    fast = cb.fisher_diagonal(model, x, batch_size=12, generator=torch.Generator().manual_seed(2))
    naive = cb.fisher_diagonal_naive(model, x, generator=torch.Generator().manual_seed(2))
    assert set(fast) == {n for n, _ in model.named_parameters()}
    for name in naive:
        torch.testing.assert_close(fast[name], naive[name], rtol=1e-10, atol=1e-14)
    assert all(p.grad is None for p in model.parameters())  # nothing left behind


def test_fisher_refuses_parameters_outside_linear_layers():
    model = nn.Sequential(nn.Linear(3, 2))
    model.register_parameter("scale", nn.Parameter(torch.ones(2)))
    with pytest.raises(ValueError, match="scale"):
        cb.fisher_diagonal(model, torch.randn(4, 3))


def test_ewc_penalty_is_the_sum_of_one_penalty_per_task(monkeypatch):
    model = _small_resnet_mlp()
    gen = torch.Generator().manual_seed(3)
    fishers = [{n: torch.rand(p.shape, generator=gen, dtype=p.dtype)
                for n, p in model.named_parameters()} for _ in range(2)]
    fishers[1]["readout.bias"].zero_()  # a parameter the second task says nothing about
    calls = iter(fishers)
    monkeypatch.setattr(cb, "fisher_diagonal", lambda *a, **k: next(calls))
    ewc = cb.EWC(model, lam=3.0)
    assert float(ewc.penalty()) == 0.0
    anchors = []
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        anchors.append({n: p.detach().clone() for n, p in model.named_parameters()})
        ewc.after_task(model, torch.zeros(1, 6, dtype=torch.float64), [0])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    params = dict(model.named_parameters())
    explicit = sum(1.5 * (f[n] * (params[n] - a[n]).square()).sum()
                   for f, a in zip(fishers, anchors, strict=True) for n in params)
    grad = torch.autograd.grad(ewc.penalty(), list(params.values()))
    reference = torch.autograd.grad(explicit, list(params.values()))
    for g, r in zip(grad, reference, strict=True):
        torch.testing.assert_close(g, r)


def test_lwf_adds_soft_cross_entropy_on_the_old_classes_only_after_a_task():
    model = _small_resnet_mlp()
    x = torch.randn(5, 6, dtype=torch.float64)
    y = torch.tensor([2, 2, 1, 2, 1])
    lwf = cb.LwF(alpha=0.5, temperature=2.0)
    logits = model(x)
    assert torch.equal(lwf.loss(logits, y, x), F.cross_entropy(logits, y))
    lwf.after_task(model, x, [0, 1])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    logits = model(x)
    target = (lwf.old(x)[:, :2] / 2).softmax(1)  # the frozen copy, not the model
    soft = -(target * (logits[:, :2] / 2).log_softmax(1)).sum(1).mean()
    torch.testing.assert_close(lwf.loss(logits, y, x), F.cross_entropy(logits, y) + 0.5 * soft)
    assert not any(p.requires_grad for p in lwf.old.parameters())


def _blobs(n: int = 60, d: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    return torch.randn(n, d, generator=gen, dtype=torch.float64) + 2 * y[:, None], y


def test_streaming_lda_is_order_independent_and_is_lda_with_the_pooled_covariance():
    x, y = _blobs()
    a, b = cb.StreamingLDA(5, 4, shrinkage=0.2), cb.StreamingLDA(5, 4, shrinkage=0.2)
    for part in (y == 0, y != 0):  # class 0 first, then the rest
        a.update(x[part], y[part])
    for i in reversed(range(0, 60, 7)):  # small batches, backwards
        b.update(x[i:i + 7], y[i:i + 7])
    torch.testing.assert_close(a.scores(x), b.scores(x))
    means = torch.stack([x[y == c].mean(0) for c in range(3)])
    centred = x - means[y]
    cov = 0.8 * centred.T @ centred / 60 + 0.2 * torch.eye(5, dtype=torch.float64)
    w = torch.linalg.solve(cov, means.T).T
    expected = x @ w.T - 0.5 * (w * means).sum(1)
    torch.testing.assert_close(a.scores(x)[:, :3], expected)
    assert torch.isinf(a.scores(x)[:, 3]).all()  # class 3 was never seen


def test_nearest_class_mean_picks_the_nearest_mean_among_the_seen_classes():
    x, y = _blobs()
    ncm = cb.NearestClassMean(5, 4)
    ncm.update(x[y < 2], y[y < 2])
    means = torch.stack([x[y == c].mean(0) for c in range(2)])
    torch.testing.assert_close(ncm.scores(x)[:, :2], -torch.cdist(x, means).square())
    assert set(ncm.scores(x).argmax(1).tolist()) <= {0, 1}


# --------------------------------------------------------------------------- behaviour


def _two_tasks(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]]:  # fmt: skip
    """Four well-separated blobs around random centres in 8 dimensions; task 1 holds
    classes 0, 1, task 2 classes 2, 3: (x_train, y_train, x_test, y_test) per task."""
    gen = torch.Generator().manual_seed(seed)
    centres = 2 * torch.randn(4, 8, generator=gen)

    def draw(n: int, classes: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tensor(classes).repeat(n // 2)
        return centres[y] + 0.3 * torch.randn(n, 8, generator=gen), y

    return [(*draw(96, c), *draw(40, c)) for c in ((0, 1), (2, 3))]


def _task_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def test_a_growing_net_keeps_the_first_task_where_an_sgd_mlp_loses_it():
    tasks = _two_tasks()
    torch.manual_seed(0)
    rbf = GrowingRBFNet(8, 4, 1, temperature=0.5, rule=FunctionalSGD(1.0))
    mlp = MLP(8, 32, 4, depth=2)
    grower, sgd = Grower(rbf), torch.optim.SGD(mlp.parameters(), lr=0.1)
    after_first = {}
    for t, (x, y, *_) in enumerate(tasks):
        for i in range(0, len(x), 8):  # one pass, batch 8
            train_step(rbf, x[i:i + 8], y[i:i + 8], F.cross_entropy, grower=grower)
            train_step(mlp, x[i:i + 8], y[i:i + 8], F.cross_entropy, optimizer=sgd)
        if t == 0:
            after_first = {m: _task_accuracy(net, *tasks[0][2:])
                           for m, net in (("rbf", rbf), ("mlp", mlp))}
    assert after_first == {"rbf": 1.0, "mlp": 1.0}  # both learnt the first task
    for net in (rbf, mlp):
        assert _task_accuracy(net, *tasks[1][2:]) == 1.0  # and the second
    assert _task_accuracy(rbf, *tasks[0][2:]) == 1.0  # the growing net still knows the first
    # the MLP's answers moved to task 2's classes: here all of them (seeds 1-4 of the
    # blobs: one of the two classes, accuracy 0.5)
    assert _task_accuracy(mlp, *tasks[0][2:]) <= 0.5
    assert len(rbf.blocks[0].store) == 192  # every sample's entry, none overwritten


# --------------------------------------------------------------------------- the command


@pytest.mark.extra("classical")
def test_the_command_runs_every_kind_of_model_and_reports(data_dir, tmp_path, monkeypatch):
    from rcdl.app import models as zoo

    # the ResNet-MLP's blocks at width 64 (at the paper's 3 072 its trainings take minutes)
    monkeypatch.setattr(zoo, "ResNetMLP", functools.partial(zoo.ResNetMLP, width=64))
    out = tmp_path / "run"
    main(["reproduce", "continual", "--quick", "--models", "gws", "mlp-ewc", "knn-l2",
          "ncm", "rbf+labels+vote", "--orders", "0", "random-1", "--train-size", "64",
          "--test-size", "32", "--data-dir", str(data_dir), "--out", str(out),
          "--no-progress", "--device", "cpu"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"]
    assert {"results.md", "results.csv", "continual_matrix.png", "continual_curves.png",
            "silent_memories.png"} <= {p.name for p in out.iterdir()}
    runs = {(r["model"], r["order"]): r for r in summary["runs"]}
    # the i.i.d. references: EWC and LwF share mlp-adam's; the labels trick over the task
    # is plain training when one task holds every class, read out by the same vote
    assert {m for m, o in runs if o == "iid"} == {"gws", "mlp-adam", "knn-l2", "ncm",
                                                   "rbf+vote"}
    gws = runs["gws", "random-1"]
    assert gws["tasks"] == [list(t) for t in task_split("random-1")]
    assert len(gws["matrix"]) == 5 and all(len(row) == 5 for row in gws["matrix"])
    # the task-aware head can only turn a wrong 10-way answer right, never the reverse
    for row, aware in zip(gws["matrix"], gws["aware_matrix"], strict=True):
        assert all(a >= r for r, a in zip(row, aware, strict=True) if r is not None)
    # a growing model removes nothing: every entry a task wrote is still stored
    assert gws["silent"]["entries_stored"] == gws["entries_written"]
    assert sum(gws["entries_written"]) == 3 * 64  # one entry per image in each of 3 layers
    assert "silent" not in runs["mlp-ewc", "0"]
    for name in ("knn-l2", "ncm"):  # the order changes nothing
        assert runs[name, "0"]["acc"] == runs[name, "random-1"]["acc"] == runs[name, "iid"]["acc"]
    cfg = ContinualConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert cfg.orders == ("0", "random-1")
    rows = {(r["model"], r["order"]): r for r in summary["rows"]}
    assert rows["knn-l2", "all"]["gap"] == 0 and rows["gws", "all"]["runs"] == 2
    assert rows["ncm", "all"]["aware_bwt"] == 0  # a class mean never moves
    assert {r["model"] for r in summary["silent"]} == {"gws", "mlp-ewc", "rbf+labels+vote"}
    voted = runs["rbf+labels+vote", "0"]
    assert voted["silent"]["entries_stored"] == voted["entries_written"]
    assert "Silent memories" in (out / "results.md").read_text()


# --------------------------------------------------------------------------- the labels trick


def test_restricted_cross_entropy_is_the_cross_entropy_of_the_kept_logits_only():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.tensor([3, 7, 7, 3, 3, 7])
    classes = torch.tensor([7, 3])
    loss = cb.restricted_cross_entropy(logits, y, classes)
    kept = logits[:, [3, 7]]
    expected = F.cross_entropy(kept, (y == 7).long())
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, logits)
    outside = torch.ones(10, dtype=torch.bool)
    outside[[3, 7]] = False
    assert torch.equal(grad[:, outside], torch.zeros(6, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="not all among the classes"):
        cb.restricted_cross_entropy(logits, torch.tensor([3, 1, 7, 3, 3, 7]), classes)


def test_labels_trick_over_every_class_is_plain_cross_entropy_and_needs_its_task():
    logits, y = torch.randn(5, 10, dtype=torch.float64), torch.tensor([0, 4, 9, 2, 2])
    trick = cb.LabelsTrick("task")
    with pytest.raises(RuntimeError, match="start_task"):
        trick.loss(logits, y, logits)
    trick.start_task(range(10))
    torch.testing.assert_close(trick.loss(logits, y, logits), F.cross_entropy(logits, y))
    batch = cb.LabelsTrick("batch").loss(logits, y, logits)  # the batch holds 0, 2, 4, 9
    torch.testing.assert_close(batch, cb.restricted_cross_entropy(logits, y, y.unique()))
    with pytest.raises(ValueError, match="scope"):
        cb.LabelsTrick("epoch")


@pytest.mark.parametrize("kind", ["rbf", "gws"])
def test_a_restricted_write_leaves_every_other_class_untouched(kind):
    """float64: a step under the labels trick writes readout values that are exactly zero
    outside the task's classes; for the RBF readout (a plain kernel sum) the logits of
    every other class, as a function of the readout's input, are exactly unchanged."""
    net = tiny_net(kind, 8, 6)
    x, y = torch.randn(32, 8, dtype=torch.float64), torch.randint(0, 6, (32,))
    grower = train_with_samples(net, x[:16], y[:16], 4)  # a first task over every class
    trick = cb.LabelsTrick("task")
    trick.start_task((2, 5))
    probe = torch.randn(20, 8, dtype=torch.float64)  # readout inputs
    others = [0, 1, 3, 4]
    with torch.no_grad():
        before = net.readout(probe)[:, others]
    n = len(net.readout.store)
    xb = torch.randn(8, 8, dtype=torch.float64)
    yb = torch.tensor([2, 5, 5, 2, 2, 5, 2, 5])
    train_step(net, xb, yb, functools.partial(trick.loss, x=xb), grower=grower)
    written = net.readout.store.values[n:]  # (8, 6)
    assert len(written) == 8
    assert torch.equal(written[:, others], torch.zeros(8, 4, dtype=torch.float64))
    assert written[:, [2, 5]].abs().sum() > 0
    if kind == "rbf":
        with torch.no_grad():
            torch.testing.assert_close(net.readout(probe)[:, others], before, rtol=0, atol=0)


def test_labels_trick_names_and_their_iid_references():
    from rcdl.app.experiments.continual import ModelName

    assert ModelName.parse("rbf+labels") == ModelName("rbf", labels="task")
    assert ModelName.parse("gws+batch-labels") == ModelName("gws", labels="batch")
    assert ModelName.parse("hybrid+labels").kind == "growing"
    assert ModelName.parse("mlp-adam+labels").kind == "parametric"
    # one task of every class: plain
    assert ModelName.parse("rbf+labels").iid("mlp-adam") == "rbf"
    assert ModelName.parse("rbf+batch-labels").iid("mlp-adam") == "rbf+batch-labels"
    with pytest.raises(ValueError, match="labels trick"):
        ModelName.parse("slda+labels")
    with pytest.raises(ValueError, match="unknown model"):
        ModelName.parse("nope+labels")


def test_value_mass_sums_the_readout_values_each_task_wrote_per_class():
    from rcdl.app.experiments.continual import value_mass

    tasks = _two_tasks()
    torch.manual_seed(0)
    net = GrowingRBFNet(8, 4, 1, temperature=0.5, rule=FunctionalSGD(1.0)).double()
    grower = Grower(net)
    trick = cb.LabelsTrick("task")
    offset = 0
    for (x, y, *_), classes in zip(tasks, ((0, 1), (2, 3)), strict=True):
        trick.start_task(classes)
        for i in range(0, len(x), 8):
            ids = torch.arange(offset + i, offset + i + len(x[i:i + 8]))
            with samples(net, ids):
                xb = x[i:i + 8].double()
                train_step(net, xb, y[i:i + 8], functools.partial(trick.loss, x=xb),
                           grower=grower)
        offset += len(x)
    task_of_sample = torch.cat([torch.zeros(96, dtype=torch.long),
                                torch.ones(96, dtype=torch.long)])
    mass = torch.tensor(value_mass(net, task_of_sample, ((0, 1), (2, 3))),
                        dtype=torch.float64)  # (2, 4)
    values = net.readout.store.values
    torch.testing.assert_close(mass.sum(0), values.sum(0))
    assert torch.equal(mass[0, 2:], torch.zeros(2, dtype=torch.float64))  # restricted writes
    assert torch.equal(mass[1, :2], torch.zeros(2, dtype=torch.float64))
    # each task's entries raise one class and lower the other by the same amount
    torch.testing.assert_close(mass.sum(1), torch.zeros(2, dtype=torch.float64))
    assert (mass[0, :2].abs() > 0).all()


def test_labels_trick_keeps_the_first_task_in_the_ten_way_head():
    """Plain writes lower task 1's classes when task 2 is learnt (their entries' values
    point away from what the model then predicted); under the labels trick they do not."""
    tasks = _two_tasks(seed=3)
    scores = {}
    for name, loss in (("plain", cb.PlainLoss()), ("labels", cb.LabelsTrick("task"))):
        torch.manual_seed(0)
        net = GrowingRBFNet(8, 4, 1, temperature=4.0, rule=FunctionalSGD(1.0))
        grower = Grower(net)
        for (x, y, *_), classes in zip(tasks, ((0, 1), (2, 3)), strict=True):
            loss.start_task(classes)
            for i in range(0, len(x), 8):
                xb = x[i:i + 8]
                train_step(net, xb, y[i:i + 8], functools.partial(loss.loss, x=xb),
                           grower=grower)
        scores[name] = _task_accuracy(net, *tasks[0][2:])
    assert scores["labels"] == 1.0
    assert scores["labels"] > scores["plain"]


# --------------------------------------------------------------------------- PEC


def test_pec_learns_each_class_from_its_own_images_and_scores_only_trained_classes():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 32, 32, 3, generator=gen)  # one pattern per class, plus noise

    def draw(classes: torch.Tensor) -> torch.Tensor:
        noise = 0.3 * torch.randn(len(classes), 32, 32, 3, generator=gen)
        return (base[classes] + noise).reshape(len(classes), -1)

    pec = cb.PEC(4, seed=0, channels=4, teacher_multiplier=4, out_dim=16, lr=3e-3)
    first = torch.tensor([0, 1] * 12)[torch.randperm(24, generator=gen)]
    pec.update(draw(first), first, batch_size=2)
    before = [{k: v.clone() for k, v in s.state_dict().items()} for s in pec.students]
    pec.update(draw(torch.full((12,), 2)), torch.full((12,), 2))
    for c in (0, 1, 3):  # a later class moves only its own student
        assert all(torch.equal(v, before[c][k]) for k, v in pec.students[c].state_dict().items())
    yt = torch.tensor([0, 1, 2] * 8)
    xt = draw(yt)
    scores = pec.scores(xt)
    assert torch.isinf(scores[:, 3]).all() and torch.isfinite(scores[:, :3]).all()
    assert (scores.argmax(1) == yt).float().mean() > 0.9
    torch.testing.assert_close(pec.scores(xt, targets=pec.targets(xt)), scores)


# --------------------------------------------------------------------------- the label vote


@pytest.mark.parametrize("kind", ["rbf", "gws"])
def test_label_vote_is_the_log_class_kernel_mass_of_the_entries_samples_wrote(kind):
    """float64: ``score_c(q) = log Σ_{j: y_j = c} φ(q, k_j; τ/s)`` over the readout's
    entries that a sample wrote, by a loop; restricting the store restricts the vote."""
    net = tiny_net(kind, 8, 4)
    x, y = torch.randn(24, 8, dtype=torch.float64), torch.tensor([0, 1, 3] * 8)
    train_with_samples(net, x, y, 6)
    vote = cb.LabelVote(net, y, sharpness=3.0)
    probe = torch.randn(5, 8, dtype=torch.float64)
    with torch.no_grad():
        got = vote(probe)
    captured = []
    hook = net.readout.register_forward_pre_hook(lambda m, a: captured.append(a[0]))
    with torch.no_grad():
        net(probe)
    hook.remove()
    q = captured[0]
    layer = net.readout
    tau = layer.temperature * 8 ** 0.5 / 3.0
    owners = entry_samples(layer)
    expected = torch.full((5, 4), -torch.inf, dtype=torch.float64)
    for c in (0, 1, 3):
        mass = torch.zeros(5, dtype=torch.float64)
        for j in range(len(layer.store)):
            if owners[j] == UNKNOWN or y[owners[j]] != c:
                continue  # the softmax store's initial entries do not vote
            k = layer.store.keys[j]
            if kind == "rbf":
                mass += torch.exp(-((q - k) ** 2).sum(1) / (2 * tau))
            else:
                mass += torch.exp(q @ k / tau)
        expected[:, c] = mass.log()
    torch.testing.assert_close(got, expected)
    assert torch.isinf(got[:, 2]).all()  # no sample of class 2
    restricted, _ = own_entries_copy(net, torch.tensor([0, 3, 6]))  # class-0 samples only
    with torch.no_grad():
        kept = cb.LabelVote(restricted, y, sharpness=3.0)(probe)
    assert torch.isfinite(kept[:, 0]).all() and torch.isinf(kept[:, 1:]).all()


def test_label_vote_names_and_refusals():
    from rcdl.app.experiments.continual import ModelName

    name = ModelName.parse("rbf+labels+vote")
    assert name == ModelName("rbf", labels="task", vote=True)
    assert str(name) == "rbf+labels+vote"
    assert name.kind == "growing"
    assert name.iid("mlp-adam") == "rbf+vote"  # the i.i.d. rbf, voted
    assert ModelName.parse("rbf+batch-labels+vote").iid("mlp-adam") == "rbf+batch-labels+vote"
    for bad, match in (("mlp-adam+vote", "growing readout"), ("knn-l2+vote", "growing"),
                       ("rbf+vote+labels", "label vote last"), ("rbf+vote+vote", "once")):
        with pytest.raises(ValueError, match=match):
            ModelName.parse(bad)
    with pytest.raises(ValueError, match="no growing readout"):
        cb.LabelVote(MLP(8, 16, 4), torch.zeros(3))
    net = GrowingRBFNet(8, 4, 1, temperature=0.5, rule=FunctionalSGD(1.0))
    with pytest.raises(ValueError, match="sharpness"):
        cb.LabelVote(net, torch.zeros(3), sharpness=0.0)


def test_label_vote_keeps_the_first_task_where_the_learnt_values_lose_it():
    """Learnt class by class, the plain RBF net's values push task 1's classes down; the
    vote of the same entries' labels still answers task 1's images."""
    tasks = _two_tasks(seed=3)
    torch.manual_seed(0)
    net = GrowingRBFNet(8, 4, 1, temperature=4.0, rule=FunctionalSGD(1.0))
    grower = Grower(net)
    offset = 0
    for x, y, *_ in tasks:
        for i in range(0, len(x), 8):
            with samples(net, torch.arange(offset + i, offset + i + 8)):
                train_step(net, x[i:i + 8], y[i:i + 8], F.cross_entropy, grower=grower)
        offset += len(x)
    labels = torch.cat([tasks[0][1], tasks[1][1]])
    vote = cb.LabelVote(net, labels)
    x1, y1 = tasks[0][2:]
    assert _task_accuracy(vote, x1, y1) == 1.0
    assert _task_accuracy(vote, *tasks[1][2:]) == 1.0
    assert _task_accuracy(net, x1, y1) < 1.0


def test_pec_teacher_blocked_over_channels_is_the_dense_network():
    """float64: the channel-blocked forward (what PEC's targets use) against the network."""
    torch.manual_seed(0)
    net = cb._pec_network(12, 7, 5).double().eval()
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)  # a non-trivial affine map of the normalisation
        net[1].bias.uniform_(-0.5, 0.5)
        images = torch.randn(3, 3, 32, 32, dtype=torch.float64)
        dense = net(images)
        for block in (1, 5, 12, 50):
            torch.testing.assert_close(cb.pec_forward_blocked(net, images, block), dense)


def test_the_full_preset_gives_way_to_the_flags_given():
    """`--full --orders 0 --models rbf+vote`: the preset fills the config, the flags given
    win."""
    from types import SimpleNamespace

    from rcdl.app.cli import _settings, config_flags
    from rcdl.app.experiments.continual import EXPERIMENT_SPEC

    args = SimpleNamespace(full=True, **{f.name: None
                                         for f in config_flags(EXPERIMENT_SPEC.config)})
    args.orders, args.models = ("0",), ("rbf+vote",)
    got = _settings(args, EXPERIMENT_SPEC)
    assert got["orders"] == ("0",) and got["models"] == ("rbf+vote",)
    assert got["train_size"] is None and got["test_size"] is None and got["seeds"] == (0,)
