"""The half-precision product path is a recorded decision, not a timing (rcdl.ops.half,
docs/precision.md "Product paths"): on a CPU without native bfloat16 products, ``"auto"``
widens a training batch's products in registers or converts chunks to float32 as
``widen_pays`` timed it once per process, and the two paths differ in the last bits. A run
records the choice in ``environment.json`` and a replay log with the run; a resumed run and
an exact forget take the recorded one, so they equal the uninterrupted run and the retraining
bit for bit even where a new process's timing says otherwise.

A "process" here is the state a process starts in: no path set, and ``widen_pays`` answering
as its timing would (monkeypatched, one way in the first process and the other in the next).
"""

import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from rcdl import Grower, GrowingSoftmaxNet
from rcdl.app.rundir import RunDir
from rcdl.app.runner import Experiment, run_experiment
from rcdl.memory.provenance import entry_samples
from rcdl.nn.layers import growing_layers, set_store_dtype
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.ops import half
from rcdl.ops.attention import attention
from rcdl.train.loop import accuracy, train_one_pass
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly, stream_without
from small_runs import TinyConfig

pytestmark = pytest.mark.extra("fast-cpu")

BF16, CPU = torch.bfloat16, torch.device("cpu")


@pytest.fixture
def avx2_cpu(monkeypatch):
    """This process poses as an AVX2-only CPU (no native bfloat16 products) under the
    ``"auto"`` mode, with no product path set yet."""
    monkeypatch.setattr(half.PRODUCTS, "_value", "auto")
    monkeypatch.setattr(half, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(half, "_set_path", None, raising=False)


def new_process(monkeypatch, widen_is_faster: bool) -> None:
    """What a new process starts with: no path set, and a timing that answers as given."""
    monkeypatch.setattr(half, "_set_path", None, raising=False)
    monkeypatch.setattr(half, "widen_pays", lambda: widen_is_faster)


# --------------------------------------------------------------------------- a resumed run


def training_call(seed: int, interrupt: set[int]) -> dict:
    """One training batch's forward and query gradient over a bfloat16 store, and the path
    its products took; a seed in ``interrupt`` is interrupted (once)."""
    if seed in interrupt:
        interrupt.discard(seed)
        raise KeyboardInterrupt
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(16, 24, generator=gen).requires_grad_()
    keys = torch.randn(120, 24, generator=gen).to(BF16)
    values = torch.randn(120, 5, generator=gen).to(BF16)
    weights = torch.rand(120, generator=gen) + 0.1
    out = attention(q, keys, values, weights, kernel="softmax")
    (grad,) = torch.autograd.grad(out.square().sum(), q)
    return {"path": half.chunk_products(BF16, CPU, 16), "out": out.tolist(),
            "grad": grad.tolist()}


def tiny_experiment(interrupt: set[int]) -> Experiment:
    def sub_runs(cfg, data, session):
        for seed in (0, 1):
            yield f"seed{seed}", partial(training_call, seed, interrupt)

    return Experiment(name="product-path", config=TinyConfig, help="", description="",
                      sub_runs=sub_runs, report=lambda run, cfg, summary, device: "")


def test_a_resumed_run_takes_the_path_its_first_session_recorded(avx2_cpu, monkeypatch,
                                                                 tmp_path):
    new_process(monkeypatch, widen_is_faster=True)
    _, whole = run_experiment(tiny_experiment(set()), TinyConfig(), out=tmp_path / "whole",
                              progress=False)
    assert [r["path"] for r in whole["runs"]] == ["widen", "widen"]

    new_process(monkeypatch, widen_is_faster=True)
    with pytest.raises(KeyboardInterrupt):  # the first session ends after seed0
        run_experiment(tiny_experiment({1}), TinyConfig(), out=tmp_path / "cut",
                       progress=False)

    new_process(monkeypatch, widen_is_faster=False)  # here the timing says float32
    _, resumed = run_experiment(tiny_experiment(set()), TinyConfig(), resume=tmp_path / "cut",
                                progress=False)
    assert resumed["runs"] == whole["runs"]  # seed1 trained now, on the recorded path
    assert half.chunk_products(BF16, CPU, 16) == "float32"  # the process's own, after the run
    env = json.loads((tmp_path / "cut" / "environment.json").read_text())
    assert env["half_products"] == "auto" and env["half_products_auto"] == "widen"

    # the two paths do differ in bits: a new run in this process takes float32 and differs
    _, fresh = run_experiment(tiny_experiment(set()), TinyConfig(), out=tmp_path / "fresh",
                              progress=False)
    assert [r["path"] for r in fresh["runs"]] == ["float32", "float32"]
    assert fresh["runs"][1]["out"] != whole["runs"][1]["out"]


def test_the_record_is_read_back_and_a_damaged_one_is_named(avx2_cpu, monkeypatch, tmp_path):
    from rcdl.ops.half import products_as

    new_process(monkeypatch, widen_is_faster=False)
    run = RunDir.create("tiny", path=tmp_path / "run")
    assert run.product_record() == {"mode": "auto", "auto_path": "float32"}
    new_process(monkeypatch, widen_is_faster=True)
    with products_as(run.product_record()):
        assert half.chunk_products(BF16, CPU, 16) == "float32"
    assert half.chunk_products(BF16, CPU, 16) == "widen"  # restored: this process's timing
    env = json.loads(run.file("environment.json").read_text())
    run.write_json("environment.json", {**env, "half_products_auto": "fastest"})
    with pytest.raises(ValueError, match=r"environment.json records half-precision products"):
        run.product_record()
    (tmp_path / "old").mkdir()
    assert RunDir(tmp_path / "old").product_record() is None  # nothing recorded: nothing set


# --------------------------------------------------------------------------- an exact forget

D, CLASSES, N, B = 16, 3, 48, 8


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N + 16, D, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x[:N], y[:N], x[N:], y[N:]


def train(**kw):
    """A weighted-softmax net with bfloat16 stores, trained one pass in batches of 8."""
    torch.manual_seed(0)
    model = GrowingSoftmaxNet(D, CLASSES, 2, temperature=1.0,
                              rule=ClippedSoftmaxRule(0.01, 1.0))
    set_store_dtype(model, BF16)
    grower = Grower(model)
    train_one_pass(model, data(), batch_size=B, seed=3, grower=grower,
                   loss_fn=F.cross_entropy, eval_every=1000, progress=False,
                   metrics={"acc": accuracy}, **kw)
    return model, grower


def same_model(a, b) -> bool:
    for (_, la), (_, lb) in zip(growing_layers(a), growing_layers(b), strict=True):
        for field in ("keys", "values", "weights", "ids"):
            if not torch.equal(getattr(la.store, field), getattr(lb.store, field)):
                return False
        if not torch.equal(entry_samples(la), entry_samples(lb)):
            return False
    with torch.no_grad():
        return torch.equal(a.eval()(data()[2]), b.eval()(data()[2]))


def test_an_exact_forget_replays_on_the_path_the_run_recorded(avx2_cpu, monkeypatch):
    new_process(monkeypatch, widen_is_faster=True)  # the training process
    log = ReplayLog(every=2)
    model, grower = train(replay=log)
    gone = log.stream[[20, 27]].tolist()  # seen in batches 2 and 3
    retrained, _ = train(order=stream_without(log, gone))

    new_process(monkeypatch, widen_is_faster=False)  # a later process forgets
    with half.half_products("float32"):  # the paths differ: float32 chunks give another model
        other_path, _ = train(order=stream_without(log, gone))
    assert not same_model(other_path, retrained)
    forget_exactly(model, gone, replay=log, data=data()[:2], loss_fn=F.cross_entropy,
                   grower=grower)
    assert same_model(model, retrained)
    assert half.chunk_products(BF16, CPU, B) == "float32"  # this process's own, after it
    assert log.products == {"mode": "auto", "auto_path": "widen"}
    # a retraining in this process, on the recorded path, equals them
    from rcdl.ops.half import products_as

    with products_as(log.products):
        again, _ = train(order=stream_without(log, gone))
    assert same_model(again, retrained)


# --------------------------------------------------------------------------- a checkpoint


def test_train_one_pass_resumes_from_its_checkpoint_on_the_recorded_path(
        avx2_cpu, monkeypatch, tmp_path, interrupt_after):
    """A loop of one's own (train_one_pass with a checkpoint, no run folder): the checkpoint
    records the path and the resume takes it, ending as the uninterrupted run."""
    new_process(monkeypatch, widen_is_faster=True)
    whole, _ = train()

    new_process(monkeypatch, widen_is_faster=True)  # the first process: widened
    ckpt = tmp_path / "ckpt.pt"
    torch.manual_seed(0)
    model = GrowingSoftmaxNet(D, CLASSES, 2, temperature=1.0, rule=ClippedSoftmaxRule(0.01, 1.0))
    set_store_dtype(model, BF16)
    grower = Grower(model)
    with pytest.raises(interrupt_after(grower, 3)):
        train_one_pass(model, data(), batch_size=B, seed=3, grower=grower,
                       loss_fn=F.cross_entropy, eval_every=1000, progress=False,
                       metrics={"acc": accuracy}, checkpoint_path=ckpt, checkpoint_every=2)

    new_process(monkeypatch, widen_is_faster=False)  # the next one would take float32
    with half.half_products("float32"):  # which gives another model
        other_path, _ = train()
    assert not same_model(other_path, whole)
    resumed, _ = train(checkpoint_path=ckpt, checkpoint_every=2)
    assert same_model(resumed, whole)
    assert half.chunk_products(BF16, CPU, B) == "float32"  # this process's own, after it
