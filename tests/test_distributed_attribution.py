"""Attribution and forgetting over a sharded store (rcdl.memory.attribution.explain,
rcdl.memory.forgetting.forget under rcdl.distributed): gloo processes spawned at world sizes
1–3 give the same top entries, top samples and contributions as one process over the whole
store, in float64; forget removes each rank's own rows of the forgotten samples, returns the
totals over the ranks, and leaves each rank exactly one process's remaining entries with the
same ids."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from rank_pool import run_ranks
from rcdl import ClippedSoftmaxRule, FunctionalSGD, Grower, GrowingRBFNet, GrowingSoftmaxNet
from rcdl.memory.attribution import explain
from rcdl.memory.forgetting import forget
from rcdl.memory.provenance import entry_samples, samples
from rcdl.nn.backends import use_shard
from rcdl.nn.layers import growing_layers

pytestmark = pytest.mark.spawns  # processes of its own: one such test at a time

D_IN, CLASSES, WIDTH = 6, 3, 8
BATCHES = [1, 7, 7, 5, 7, 6]  # 33 samples; the first batch leaves most shards empty
KINDS = ["gws", "rbf"]
K = 5  # fewer than one rank's entries: the merge picks among the ranks' candidates
ALL = 1000  # more than the whole store: every entry, every shard padded
FORGOTTEN = [0, 4, 9, 10, 17, 31]  # global sample numbers (their indices are SAMPLE(...))
TOL = {"rtol": 1e-9, "atol": 1e-12}
TIMEOUT = timedelta(seconds=60)


def sample_index(i):
    """The dataset index of the ``i``-th training sample: not the entry ids' numbering."""
    return 1000 + 7 * i


def build(kind):
    torch.manual_seed(0)
    if kind == "gws":
        net = GrowingSoftmaxNet(D_IN, CLASSES, 1, temperature=1.0, width=WIDTH,
                                rule=ClippedSoftmaxRule(0.3, 2.0), initial_entries=4)
    else:
        net = GrowingRBFNet(D_IN, CLASSES, 1, temperature=1.0, width=WIDTH,
                            rule=FunctionalSGD(0.5))
    net = net.double()
    return net, Grower(net)


def batch(step):
    gen = torch.Generator().manual_seed(200 + step)
    x = torch.randn(BATCHES[step], D_IN, generator=gen, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    start = sum(BATCHES[:step])
    return x, y, sample_index(torch.arange(start, start + len(x)))


def train(net, grower, steps):
    for step in steps:
        x, y, idx = batch(step)
        grower.zero_grad()
        with samples(net, idx):
            F.cross_entropy(net(x), y).backward()
        grower.step()


def queries():
    return torch.randn(4, D_IN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def as_tables(exp):
    """An explanation as plain tensors (picklable, comparable)."""
    return {"target": exp.target, "output": exp.output, "layers": dict(exp.layers),
            "samples": exp.samples}


def stores(net):
    """Every layer's rows ``[id, written_at, sample, key, value, weight]`` on this process."""
    out = {}
    for name, layer in growing_layers(net):
        s = layer.store
        out[name] = torch.cat([s.ids[:, None].double(), s.written_at[:, None].double(),
                               entry_samples(layer)[:, None].double(), s.keys.double(),
                               s.values.double(), s.weights[:, None].double()], 1)
    return out


def run(net, grower):
    """What both the single process and every rank compute, in the same order."""
    train(net, grower, [0])
    first = as_tables(explain(net, queries(), k=K))  # one entry per layer (+ initial ones)
    train(net, grower, range(1, len(BATCHES)))
    top, everything = (as_tables(explain(net, queries(), k=k)) for k in (K, ALL))
    removed = forget(net, sample_index(torch.tensor(FORGOTTEN)))
    after, after_all = (as_tables(explain(net, queries(), k=k)) for k in (K, ALL))
    with torch.no_grad():
        out = net.eval()(queries())
    return {"first": first, "top": top, "all": everything, "removed": removed,
            "after": after, "after_all": after_all, "stores": stores(net), "out": out}


@pytest.fixture(scope="module")
def references():
    return {kind: run(*build(kind)) for kind in KINDS}


def _worker(rank, world, init_file, result_file):
    from rcdl.distributed import shard

    torch.set_num_threads(1)  # up to three ranks on two cores: no oversubscription
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        results = {}
        for kind in KINDS:
            net, grower = build(kind)
            shard(net)
            results[kind] = run(net, grower)
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            torch.save(gathered, result_file)
    finally:
        dist.destroy_process_group()


def _lookup(table, keys):
    """``table = (values (B, n), keys (B, n))``: the value of each of ``keys (B, k)``."""
    values, known = table
    out = torch.empty(keys.shape, dtype=values.dtype)
    for b in range(keys.shape[0]):
        row = dict(zip(known[b].tolist(), values[b].tolist(), strict=True))
        out[b] = torch.tensor([row[int(key)] for key in keys[b]], dtype=values.dtype)
    return out


def assert_same_top(got, want, table, what):
    """``got`` and ``want`` are ``(values (B, k), keys (B, k))``, largest first; ``table``
    is one process's value for every key. Equal keys where the value is not tied with its
    neighbours in the whole ranking; under a tie the order may differ, so each key must
    carry its own value."""
    (got_v, got_k), (want_v, want_k) = got, want
    assert got_k.shape == want_k.shape, what
    assert_close(got_v, want_v, **TOL, msg=lambda m: f"{what}: {m}")
    assert_close(_lookup(table, got_k), got_v, **TOL, msg=lambda m: f"{what}: {m}")
    ranked = table[0].sort(dim=1, descending=True).values  # (B, n)
    gaps = (ranked[:, 1:] - ranked[:, :-1]).abs() > 1e-9  # (B, n - 1)
    untied = torch.ones_like(ranked, dtype=torch.bool)
    untied[:, 1:] &= gaps
    untied[:, :-1] &= gaps
    untied = untied[:, : got_k.shape[1]]
    assert bool(untied.any()), what  # the comparison of keys is not vacuous
    assert torch.equal(got_k[untied], want_k[untied]), what
    for b in range(got_k.shape[0]):
        assert len(set(got_k[b].tolist())) == got_k.shape[1], what  # no key twice


def assert_same_explanation(got, want, full, what):
    """``full`` is one process's explanation with every entry and sample (k = all)."""
    assert torch.equal(got["target"], want["target"]), what
    assert_close(got["output"], want["output"], **TOL)
    assert got["layers"].keys() == want["layers"].keys(), what
    for name in want["layers"]:
        assert_same_top(got["layers"][name], want["layers"][name], full["layers"][name],
                        f"{what}, layer {name!r}")
    assert_same_top(got["samples"], want["samples"], full["samples"], f"{what}, samples")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_explain_and_forget_equal_one_process(world, references, tmp_path):
    result_file = tmp_path / "result.pt"
    run_ranks(_worker, (world, tmp_path / "init", result_file), world=world)
    ranks = torch.load(result_file, weights_only=False)
    forgotten = sample_index(torch.tensor(FORGOTTEN))
    for kind in KINDS:
        want = references[kind]
        assert want["removed"] == {name: len(FORGOTTEN) for name in want["stores"]}, kind
        assert want["all"]["samples"][1].shape[1] == sum(BATCHES), kind  # every sample, once
        for rank, results in enumerate(ranks):
            got, what = results[kind], f"{kind}, rank {rank} of {world}"
            # every rank returns the whole store's explanation
            assert_same_explanation(got["top"], want["top"], want["all"], f"{what}, top {K}")
            assert_same_explanation(got["all"], want["all"], want["all"], f"{what}, all")
            # after one sample: empty shards, and k above the layers' sizes (so k = all)
            assert_same_explanation(got["first"], want["first"], want["first"],
                                    f"{what}, step 0")
            # forget: the totals over the ranks, and one process's remaining entries
            assert got["removed"] == want["removed"], what
            for name, expected in want["stores"].items():
                mine = got["stores"][name]
                rows = torch.searchsorted(expected[:, 0].contiguous(), mine[:, 0].contiguous())
                assert torch.equal(expected[rows, 0], mine[:, 0]), (what, name)  # same ids
                assert_close(mine, expected[rows], rtol=1e-10, atol=1e-10)
                assert not bool(torch.isin(mine[:, 2], forgotten.double()).any()), (what, name)
            assert_close(got["out"], want["out"], rtol=1e-10, atol=1e-10)
            # and the explanation of what remains
            assert_same_explanation(got["after"], want["after"], want["after_all"],
                                    f"{what}, after forget")
            assert not bool(torch.isin(got["after_all"]["samples"][1], forgotten).any()), what
        for name, expected in want["stores"].items():  # every remaining entry, on one rank
            ids = torch.cat([results[kind]["stores"][name][:, 0] for results in ranks])
            assert torch.equal(ids.sort().values, expected[:, 0]), (kind, name)


def test_unsharded_explain_and_forget_communicate_nothing(monkeypatch):
    """One process over the whole store: no collective is called (none is initialised)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a collective was called without sharding")

    for name in ("all_reduce", "all_gather", "all_gather_object"):
        monkeypatch.setattr(dist, name, refuse)
    net, grower = build("gws")
    train(net, grower, range(3))
    exp = explain(net, queries(), k=K)
    assert exp.samples[0].shape == (4, K)
    assert forget(net, sample_index(torch.tensor([0, 1]))) == {"blocks.0": 2, "readout": 2}


@pytest.mark.parametrize("call", ["explain", "forget"])
def test_a_model_sharded_in_part_is_refused(call):
    """A total over ranks of a model whose layers are sharded in part would count the
    unsharded layers once per rank: refused, naming the layers, before anything changes."""
    from rcdl.distributed import Shard

    net, grower = build("rbf")
    train(net, grower, range(2))
    use_shard(net.readout, Shard(None, 0, 2))  # as if sharded by hand, one layer only
    sizes = [len(layer.store) for _, layer in growing_layers(net)]
    with pytest.raises(ValueError, match=rf"{call}: the growing layers \['blocks.0'\] of "
                                         r"GrowingRBFNet are not sharded as the others"):
        if call == "explain":
            explain(net, queries())
        else:
            forget(net, [sample_index(0)])
    assert sizes == [len(layer.store) for _, layer in growing_layers(net)]
