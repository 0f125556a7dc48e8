"""One product plan per call (rcdl.ops.plan): the path, the batch class, the packing and
the chunk rows decided once from the device, the dtypes, the batch and the entries' options;
packing as a per-object option beside ``half_products``; a layer's two options saved in its
state dict (a state without them still loads, strictly, and leaves the layer's own) and
recorded per layer in a run's ``environment.json``."""

import json

import pytest
import torch

from rcdl import ClippedSoftmaxRule, GrowingSoftmax
from rcdl.app.rundir import RunDir
from rcdl.app.runner import Experiment, run_experiment
from rcdl.ops import half, widen
from rcdl.ops import packed as packing
from rcdl.ops.attention import attend
from rcdl.ops.entries import Entries
from rcdl.ops.packed import PackedChunks, packed_chunks
from rcdl.ops.plan import TRAINING_BATCH, default_chunk_size, layer_products, plan_products
from rcdl.train.checkpoint import load_model_state
from small_runs import TinyConfig

BF16, CPU = torch.bfloat16, torch.device("cpu")
needs_packing = pytest.mark.skipif(not packing.supported(torch.float32),
                                   reason="this torch build's oneDNN does not pack float32")


def rows(n, d, dtype=torch.float32, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def avx2_cpu(monkeypatch):
    """This process poses as an AVX2-only CPU (no native bfloat16 products) under the
    ``"auto"`` mode, with auto's path set to float32 chunks."""
    monkeypatch.setattr(half.PRODUCTS, "_value", "auto")
    monkeypatch.setattr(half, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(half, "_set_path", "float32", raising=False)


@pytest.mark.parametrize("batch", [1, 16, TRAINING_BATCH, TRAINING_BATCH + 1, 500])
def test_a_float32_store_is_multiplied_as_it_lies_and_packed_for_training_batches(batch):
    keys = rows(300, 24)
    plan = plan_products(rows(batch, 24), keys, rows(300, 5), packing_mode="auto")
    assert plan.path == "store" and not plan.upcast and not plan.widened
    assert plan.training == (batch <= TRAINING_BATCH)
    assert plan.chunk == default_chunk_size(batch, CPU) == (2048 if plan.training else 1024)
    assert plan.pack_sums == (plan.training and packing.supported(torch.float32))
    assert not plan.pack_scores  # the mode "all" only


def test_a_bfloat16_store_follows_its_mode_and_the_batch(avx2_cpu):
    q, keys, values = rows(16, 1024), rows(600, 1024, BF16), rows(600, 3, BF16)
    plan = plan_products(q, keys, values)  # "auto" without native products: float32 chunks
    assert plan.path == "float32" and not plan.pack_sums
    assert plan.chunk == 512  # a cache-sized float32 copy per chunk: 2 MiB
    assert plan_products(rows(500, 1024), keys, values).chunk == 1024  # float32's rows
    assert plan_products(q, keys, values, half_products="native").path == "store"
    if widen.available():
        widened = plan_products(q, keys, values, half_products="widen")
        assert widened.widened and widened.chunk == 4096
        assert plan_products(rows(half.WIDEN_MAX_BATCH + 1, 1024), keys, values,
                             half_products="widen").path == "float32"
        # widened only for float32 queries over contiguous rows
        assert plan_products(q, keys.T.contiguous().T, values,
                             half_products="widen").path == "float32"
    assert plan_products(q, keys, values, chunk_size=100).chunk == 100


def test_the_products_of_a_call_follow_its_plan(avx2_cpu):
    q = rows(16, 8)
    entries = Entries(rows(40, 8, BF16), rows(40, 3, BF16), torch.ones(40), "softmax",
                      half_products="native")
    products = entries.products(q)
    assert products.plan == entries.plan(q) and products.path == "store"
    assert products.q.dtype == BF16  # rounded to the store's dtype, as natively multiplied


@needs_packing
@pytest.mark.parametrize("mode", ["auto", "all", "off"])
def test_packing_is_an_option_of_the_entries_as_of_the_process(mode):
    """``Entries(packing=mode)`` plans and multiplies as the process default ``mode`` does,
    whatever the default is, bit for bit."""
    n, d, b = 53, 12, 5
    q = rows(b, d, seed=3).requires_grad_()
    entries = Entries(rows(n, d), rows(n, 7, seed=1), torch.rand(n) + 0.1, "softmax",
                      chunk_size=8, packed=PackedChunks())
    own = entries.replace(packing=mode, packed=PackedChunks())
    plan = own.plan(q)
    assert plan.pack_sums == (mode != "off") and plan.pack_scores == (mode == "all")
    with packed_chunks("off" if mode != "off" else "all"):  # another default: not read
        mine = attend(q, own)
        (mine_grad,) = torch.autograd.grad(mine.sum(), q)
    with packed_chunks(mode):
        want = attend(q, entries)
        (want_grad,) = torch.autograd.grad(want.sum(), q)
    assert torch.equal(mine, want) and torch.equal(mine_grad, want_grad)
    assert (len(own.packed) > 0) == (mode != "off")


def test_an_unknown_packing_mode_is_refused():
    with pytest.raises(ValueError, match="packed chunks mode must be one of auto, all, off"):
        Entries(rows(4, 2), rows(4, 1), torch.ones(4), "softmax", packing="sometimes")
    with pytest.raises(ValueError, match="packed chunks mode"):
        GrowingSoftmax(4, 2, temperature=1.0, rule=ClippedSoftmaxRule(0.1, 1.0), packing="never")


def layer(**kw):
    return GrowingSoftmax(4, 2, temperature=1.0, rule=ClippedSoftmaxRule(0.1, 1.0), **kw)


def test_a_layer_saves_its_product_options_and_loads_them():
    saved = layer(half_products="float32", packing="off")
    state = saved.state_dict()
    assert torch.equal(state["_extra_state"], torch.tensor([3, 3]))
    loaded = layer()
    loaded.load_state_dict(state)
    assert (loaded.half_products, loaded.packing) == ("float32", "off")
    entries = loaded.entries()
    assert (entries.half_products, entries.packing) == ("float32", "off")
    default = layer()
    loaded.load_state_dict(default.state_dict())  # the process defaults are saved as such
    assert (loaded.half_products, loaded.packing) == (None, None)


def test_a_state_saved_without_product_options_loads_and_keeps_the_layers_own():
    """A state dict from before layers saved their options loads, strictly (torch's and
    :func:`rcdl.train.checkpoint.load_model_state`), and leaves the options as built."""
    old = {k: v for k, v in layer().state_dict().items() if k != "_extra_state"}
    mine = layer(half_products="native", packing="all")
    mine.load_state_dict(old)
    load_model_state(mine, old)
    assert (mine.half_products, mine.packing) == ("native", "all")
    net = torch.nn.Sequential(layer(packing="off"))
    net.load_state_dict({f"0.{k}": v for k, v in old.items()})
    assert net[0].packing == "off"


def test_a_damaged_saved_option_is_named():
    state = layer().state_dict()
    state["_extra_state"] = torch.tensor([9, 0])
    with pytest.raises(ValueError, match="GrowingSoftmax: the saved product options"):
        layer().load_state_dict(state)


def test_each_layer_records_what_its_calls_ran_under():
    first, second = layer(packing="off"), layer(half_products="float32")
    first.bind_name("net.first")
    second.bind_name("net.second")
    with packed_chunks("all"):
        first(torch.randn(3, 4))
        second(torch.randn(3, 4))
    used = layer_products()
    assert used["net.first"] == {"store_dtype": "float32", "half_products":
                                 half.PRODUCTS.get(), "packing": "off"}
    assert used["net.second"] == {"store_dtype": "float32", "half_products": "float32",
                                  "packing": "all"}


def test_a_run_records_its_layers_products_in_its_environment(tmp_path):
    def train():
        net = layer(half_products="float32", store_dtype=BF16)
        net.bind_name("tiny.layer")
        net.eval()
        with torch.no_grad():
            net(torch.randn(2, 4))
        return {"done": True}

    experiment = Experiment(name="layer-products", config=TinyConfig, help="", description="",
                            sub_runs=lambda cfg, data, session: [("only", train)],
                            report=lambda run, cfg, summary, device: "")
    run, _ = run_experiment(experiment, TinyConfig(), out=tmp_path / "run", progress=False)
    env = json.loads(run.file(RunDir.ENVIRONMENT).read_text())
    assert env["layer_products"] == {"tiny.layer": {
        "store_dtype": "bfloat16", "half_products": "float32",
        "packing": packing.PACKED.get()}}
