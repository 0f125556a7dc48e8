"""Stores sharded over torch.distributed (gloo, spawned processes) train the same model as one
process: every kind of growing network (the hybrid with each gate that reads the store, and
with a bfloat16 store rounded stochastically), world sizes 1–3 (uneven shards, empty shards),
and a save/resume in the middle, compared in float64 to 1e-10."""

import io
import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from rank_pool import RankFailed, run_ranks
from rcdl import (
    MLP,
    AlwaysGrow,
    CapacityGate,
    ClippedSoftmaxRule,
    DistanceGate,
    ErrorScaledGate,
    FunctionalSGD,
    GaugeSoftmaxRule,
    Grower,
    GrowingRBFNet,
    GrowingSoftmaxNet,
    HybridGrower,
    HybridSoftmaxNet,
    growing_layers,
    to_dual_form,
)

pytestmark = pytest.mark.spawns  # processes of its own: one such test at a time

D_IN, D_OUT = 5, 3
BATCHES = [1, 7, 7, 5, 7, 6]  # the first batch leaves most shards empty
RESUME_AT = 3
KINDS = ["gws", "gws-normalized", "gauge", "rbf", "linear", "hybrid", "hybrid-capacity",
         "hybrid-error-scaled", "hybrid-bf16"]
# half-precision stores multiply in bfloat16 chunk by chunk, and how a store is split into
# chunks and shards changes that rounding (docs/precision.md): a sharded bfloat16 run equals
# one process bit for bit only at world size 1, elsewhere to the precision's own error, and
# without a gate, whose decisions are discontinuous in the entries
HALF_KINDS = {"hybrid-bf16"}
HALF_RTOL = 0.05  # relative to the largest output: about bfloat16's own error after 6 steps
HYBRIDS = {"hybrid": DistanceGate(2.2), "hybrid-bf16": AlwaysGrow(),
           # thresholds that rise with the number of entries the layer stores (all ranks')
           "hybrid-capacity": CapacityGate(1.6, capacity=20, penalty=2.0),
           "hybrid-error-scaled": ErrorScaledGate(2.2)}
TIMEOUT = timedelta(seconds=60)


def build(kind):
    torch.manual_seed(0)
    if kind in ("gws", "gws-normalized"):
        rule = ClippedSoftmaxRule(0.3, 2.0, normalize=kind == "gws-normalized")
        net = GrowingSoftmaxNet(D_IN, D_OUT, 1, temperature=1.0, rule=rule, initial_entries=5)
    elif kind == "gauge":
        net = GrowingSoftmaxNet(D_IN, D_OUT, 1, temperature=1.0,
                                rule=GaugeSoftmaxRule(2.0, 0.3, 5.0))
    elif kind == "rbf":
        net = GrowingRBFNet(D_IN, D_OUT, 1, temperature=1.0, rule=FunctionalSGD(0.3))
    elif kind == "linear":
        net = to_dual_form(MLP(D_IN, 8, D_OUT, depth=1), lr=0.1, momentum=0.5)
    else:  # hybrids: a small τ, so the gate writes some samples and refuses others
        store_dtype = torch.bfloat16 if kind == "hybrid-bf16" else None
        net = HybridSoftmaxNet(D_IN, D_OUT, 1, temperature=1.0, initial_entries=4,
                               rule=ClippedSoftmaxRule(1.0, 2.0), trigger=HYBRIDS[kind],
                               store_dtype=store_dtype)
    net = net.double()
    opt = HybridGrower(net, lr=0.05) if kind in HYBRIDS else Grower(net)
    return net, opt


def batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCHES[step], D_IN, generator=gen, dtype=torch.float64)
    return x, torch.tanh(x[:, :D_OUT] * 2)


def held_out():
    return torch.randn(9, D_IN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def train(net, opt, steps):
    from rcdl.memory.provenance import samples

    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        with samples(net, 1000 * step + torch.arange(len(x))):  # the rows' sample indices
            F.mse_loss(net(x), y).backward()
        opt.step()


def stores(net):
    """Every layer's entries as rows ``[id, written_at, sample, key, value, weight]``."""
    from rcdl.memory.provenance import entry_samples

    out = {}
    for name, layer in growing_layers(net):
        s = layer.store
        out[name] = torch.cat([s.ids[:, None].double(), s.written_at[:, None].double(),
                               entry_samples(layer)[:, None].double(),
                               s.keys.double(), s.values.double(), s.weights[:, None]], 1)
    return out


def single_process(kind):
    net, opt = build(kind)
    train(net, opt, range(len(BATCHES)))
    with torch.no_grad():
        return stores(net), net.eval()(held_out())


def _save(*objects):
    buffer = io.BytesIO()
    torch.save([o.state_dict() for o in objects], buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _worker(rank, world, init_file, result_file):
    from rcdl.distributed import shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        results = {}
        for kind in KINDS:
            net, opt = build(kind)
            shard(net)
            train(net, opt, range(RESUME_AT))
            saved = _save(net, opt)  # one state per rank: its shard
            net, opt = build(kind)  # a fresh process would do this, then load
            shard(net)
            net.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            train(net, opt, range(RESUME_AT, len(BATCHES)))
            local = stores(net)
            gathered = [None] * world
            dist.all_gather_object(gathered, local)
            with torch.no_grad():
                out = net.eval()(held_out())
            sizes = [len(layer.store) for _, layer in growing_layers(net)]
            results[kind] = {"shards": gathered, "out": out, "sizes": sizes}
        all_sizes = [None] * world
        dist.all_gather_object(all_sizes, {k: r["sizes"] for k, r in results.items()})
        if rank == 0:
            torch.save({"results": results, "sizes": all_sizes}, result_file)
    finally:
        dist.destroy_process_group()


def canonical(tables):
    """The rows of every shard, by entry id (the same ids as one process's)."""
    table = torch.cat(tables)
    return table[table[:, 0].argsort()]


@pytest.fixture(scope="module")
def references():
    return {kind: single_process(kind) for kind in KINDS}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_training_equals_one_process(world, references, tmp_path):
    result_file = tmp_path / "result.pt"
    run_ranks(_worker, (world, tmp_path / "init", result_file), world=world)
    saved = torch.load(result_file, weights_only=False)
    for kind in KINDS:
        expected_stores, expected_out = references[kind]
        got = saved["results"][kind]
        assert all(bool((t[:, 2] >= 0).any()) for t in expected_stores.values()), kind
        if kind in HALF_KINDS and world > 1:
            tol = HALF_RTOL * float(expected_out.abs().max())
            assert_close(got["out"], expected_out, rtol=0, atol=tol, msg=kind)
            for name, expected in expected_stores.items():
                merged = canonical([shards[name] for shards in got["shards"]])
                # ids, steps and samples
                assert torch.equal(merged[:, :3], expected[:, :3]), (kind, name)
            continue
        assert_close(got["out"], expected_out, rtol=1e-10, atol=1e-10, msg=kind)
        for name, expected in expected_stores.items():
            merged = canonical([shards[name] for shards in got["shards"]])
            assert_close(merged, expected, rtol=1e-10, atol=1e-10,
                         msg=lambda m, kind=kind, name=name: f"{kind} {name}: {m}")
    if world == 3:  # uneven shards: rows split i mod 3 differ by at most one per batch
        for kind in KINDS:
            per_rank = [sizes[kind] for sizes in saved["sizes"]]
            assert len({tuple(s) for s in per_rank}) > 1 or kind == "linear", kind


def test_shard_needs_an_initialised_process_group():
    from rcdl.distributed import shard

    net, _ = build("rbf")
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard(net)


@pytest.mark.parametrize("kind", sorted(set(HYBRIDS) - HALF_KINDS))
def test_the_hybrid_cases_exercise_their_gates(kind):
    net, opt = build(kind)
    train(net, opt, range(len(BATCHES)))
    counts = opt.state_dict()["grower"]["growth"]  # the learner's, by layer
    assert len(counts) == len(growing_layers(net))
    assert all(c["written"] > 0 and c["refused"] > 0 for c in counts.values())


def test_the_capacity_case_depends_on_the_store_size():
    """Its gate reads the layer's size: a gate fed half the size (one of two shards) writes
    other samples, as the gate of a shard did before it read the size of all shards."""
    from rcdl.nn.hybrid import HybridSoftmax

    full, _ = build("hybrid-capacity")
    train(full, _, range(len(BATCHES)))
    halved, opt = build("hybrid-capacity")
    original = HybridSoftmax.num_entries_all_ranks
    for _, layer in growing_layers(halved):
        layer.num_entries_all_ranks = (lambda layer=layer: original(layer) // 2)
    train(halved, opt, range(len(BATCHES)))
    assert stores(full).keys() == stores(halved).keys()
    assert any(len(a) != len(b) for a, b in zip(stores(full).values(), stores(halved).values(),
                                                strict=True))


def _budget_worker(rank, world, init_file, result_file):
    from rcdl import MemoryBudget
    from rcdl.distributed import shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        net, _ = build("gws")
        shard(net)
        grower = Grower(net, budget=MemoryBudget(6, "contribution", merge=True))
        sizes = []
        for step in range(len(BATCHES)):
            train(net, grower, [step])
            sizes.append([len(layer.store) for layer in grower.layers])
        totals = grower.entries_per_layer_all_ranks()
        counts = {"local": grower.local_num_entries, "all": grower.num_entries_all_ranks(),
                  "bytes": (grower.local_nbytes, grower.nbytes_all_ranks())}
        refused = []  # the plain counts name both kinds instead of guessing (and hanging)
        for read in (lambda: grower.num_entries, lambda: grower.nbytes,
                     grower.entries_per_layer):
            try:
                read()
            except RuntimeError as error:
                refused.append(str(error))
        gathered = [None] * world
        dist.all_gather_object(gathered, {"sizes": sizes, "totals": totals, "counts": counts,
                                          "refused": refused, "evicted": grower.num_evicted})
        if rank == 0:
            torch.save(gathered, result_file)
    finally:
        dist.destroy_process_group()


def test_memory_budgets_are_per_shard(tmp_path):
    """Each rank keeps at most ``capacity`` entries of its shard (choosing among its own)."""
    result_file = tmp_path / "budget.pt"
    run_ranks(_budget_worker, (2, tmp_path / "init", result_file), world=2)
    ranks = torch.load(result_file, weights_only=False)
    for r in ranks:
        assert all(size <= 6 for sizes in r["sizes"] for size in sizes)
        assert r["totals"] == [12, 12]  # 6 per shard, both shards full by the end
        assert r["counts"]["local"] == 12 and r["counts"]["all"] == 24
        assert 2 * r["counts"]["bytes"][0] == r["counts"]["bytes"][1]
        assert len(r["refused"]) == 3 and all("ambiguous once the stores are sharded" in e
                                              and "_all_ranks()" in e for e in r["refused"])
    written = 2 * (5 + sum(BATCHES))  # initial entries and one per sample, both layers
    assert sum(r["evicted"] for r in ranks) == written - 24


# --------------------------------------------------------------------------- the experiment


def _experiment_cfg(data_dir):
    from rcdl.app.experiments.cifar10 import Cifar10Config

    return Cifar10Config(models=("gws", "hybrid-tau50"), train_size=48, test_size=24,
                         eval_every=2, dtype="float64", data_dir=str(data_dir), device="cpu")


def _experiment_worker(rank, world, init_file, data_dir, out):
    from rcdl.app.experiments.cifar10 import run_cifar10

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        run_cifar10(_experiment_cfg(data_dir), out=out, progress=False, download=False,
                    keep_checkpoints=True)
    finally:
        dist.destroy_process_group()


def test_the_cifar10_experiment_sharded_over_two_ranks_equals_one_process(data_dir, tmp_path):
    """What ``torchrun --nproc-per-node 2 -m rcdl reproduce cifar10-1epoch`` runs: rank 0
    writes the run folder (recording the world size); the histories equal one process's."""
    import json

    from rcdl.app.experiments.cifar10 import run_cifar10

    _, single = run_cifar10(_experiment_cfg(data_dir), out=tmp_path / "single",
                            progress=False, download=False)
    out = tmp_path / "sharded"
    run_ranks(_experiment_worker, (2, tmp_path / "init", data_dir, out), world=2)
    sharded = json.loads((out / "summary.json").read_text())
    assert sharded["sessions"][-1]["world_size"] == 2
    manifest = json.loads((out / "checkpoints" / "gws-seed0.manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 2
    assert manifest["files"] == ["gws-seed0.rank0of2.step00000002.pt",
                                 "gws-seed0.rank1of2.step00000002.pt"]
    assert all((out / "checkpoints" / f).is_file() for f in manifest["files"])
    for mine, theirs in zip(sharded["runs"], single["runs"], strict=True):
        assert mine["entries"] == theirs["entries"] and mine["bytes"] == theirs["bytes"]
        for a, b in zip(mine["history"], theirs["history"], strict=True):
            assert a["step"] == b["step"] and a["test_acc"] == b["test_acc"]
            assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-10, abs=1e-10)


def test_a_checkpoint_of_another_world_size_is_refused(tmp_path):
    """Read off the manifest before any file: resume with the same number of processes."""
    from rcdl.train.loop import Checkpointer

    net, grower = build("rbf")
    (tmp_path / "ckpt.manifest.json").write_text(json.dumps(
        {"world_size": 2, "checkpoints": [{"step": 2, "files": ["a", "b"], "sha256": []}]}))
    with pytest.raises(ValueError, match=r"another number of processes \(2\) than this run's 1"):
        Checkpointer(tmp_path / "ckpt.pt", 1, {"name": "m"}, net, None, grower).restore()


def _mismatch_worker(rank, world, init_file, what):
    from rcdl.distributed import shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        temperature, seed = (1.0 + rank, 0) if what == "settings" else (1.0, rank)
        rule = ClippedSoftmaxRule(0.3, 2.0)
        net = GrowingSoftmaxNet(D_IN, D_OUT, 1, temperature=temperature, rule=rule, seed=seed)
        net.readout.store.reserve(100 * (rank + 1))  # capacity may differ: not a difference
        shard(net)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("what", "named"), [("settings", "T=2.0"),
                                             ("entries", "entries and parameters")])
def test_ranks_with_different_models_are_refused(what, named, tmp_path):
    """Another temperature, or the same settings with other initial entries (another seed):
    the error names what differs."""
    with pytest.raises(RankFailed,
                       match=rf"models of ranks \[1\] differ(.|\n)*{named}"):
        run_ranks(_mismatch_worker, (2, tmp_path / "init", what), world=2)


def test_rows_rotate_over_the_ranks_from_step_to_step():
    """With the step as offset every rank fills, even when the batch is smaller than the
    world (16 samples over 64 ranks) or not a multiple of it (16 over 3)."""
    from rcdl.distributed import Shard

    for world, steps in ((64, 4), (3, 3)):
        counts = torch.zeros(world, dtype=torch.long)
        for step in range(1, steps + 1):
            for rank in range(world):
                owned = Shard(None, rank, world).owned(16, "cpu", offset=16 * step)
                counts[rank] += int(owned.sum())
        assert counts.sum() == 16 * steps and counts.max() - counts.min() <= 1, counts


def test_experiments_not_yet_sharded_refuse_torchrun(monkeypatch, capsys):
    from rcdl.app.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        main(["reproduce", "generalisation", "--quick"])
    assert exit_.value.code == 2
    assert "does not run under torchrun yet" in capsys.readouterr().err


def test_a_grower_state_from_another_shard_layout_is_refused():
    from rcdl.distributed import Shard

    net, grower = build("rbf")
    train(net, grower, range(2))
    state = grower.state_dict()
    assert state["shard"] is None
    other, other_grower = build("rbf")
    for _, layer in growing_layers(other):
        layer.shard = Shard(None, 1, 3)
    with pytest.raises(ValueError, match="saved by one process, this grower is rank 1 of 3"):
        other_grower.load_state_dict(state)


def _one_path_worker(rank, world, init_file, folder, result_file):
    from rcdl.distributed import shard
    from rcdl.train.loop import train_one_pass

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        x, y = batch(1)
        gen = torch.Generator().manual_seed(3)
        x_train = torch.randn(40, D_IN, generator=gen, dtype=torch.float64)
        data = (x_train, torch.tanh(2 * x_train[:, :D_OUT]), x, y)
        outs = []
        for _ in range(2):  # the second run resumes from the checkpoint the first left
            net, grower = build("gws")
            shard(net)
            result = train_one_pass(net, data, batch_size=8, grower=grower, progress=False,
                                    eval_every=2, checkpoint_path=folder / "ckpt.pt")
            outs.append((result["resumed"], result["test_mse"]))
        if rank == 0:
            torch.save(outs, result_file)
    finally:
        dist.destroy_process_group()


def test_a_sharded_checkpointer_given_one_path_writes_one_file_per_rank(tmp_path):
    """Every rank passes ``ckpt.pt``: each writes its own ``ckpt.rank<r>of2.pt`` (one file
    would keep one shard and lose the other), the manifest lists both, and a run that
    resumes from them ends as the uninterrupted run did."""
    import json

    folder, result_file = tmp_path / "run", tmp_path / "result.pt"
    folder.mkdir()
    run_ranks(_one_path_worker, (2, tmp_path / "init", folder, result_file), world=2)
    manifest = json.loads((folder / "ckpt.manifest.json").read_text())
    assert manifest["files"] == ["ckpt.rank0of2.step00000004.pt", "ckpt.rank1of2.step00000004.pt"]
    assert [e["step"] for e in manifest["checkpoints"]] == [2, 4]
    kept = {f for e in manifest["checkpoints"] for f in e["files"]}
    assert {p.name for p in folder.glob("ckpt.*.pt")} == kept
    (first_resumed, first), (resumed, second) = torch.load(result_file)
    assert not first_resumed and resumed
    assert second == pytest.approx(first, rel=1e-12)


def test_different_checkpoint_paths_on_the_ranks_are_refused(monkeypatch, tmp_path):
    from rcdl.distributed import Shard
    from rcdl.train import checkpoint

    net, grower = build("rbf")
    for _, layer in growing_layers(net):
        layer.shard = Shard(None, 0, 3)
    given = ["a.pt", "a.pt", "b.pt"]
    monkeypatch.setattr(checkpoint, "rank_and_world", lambda: (0, 3))
    monkeypatch.setattr(checkpoint.dist, "all_gather_object",
                        lambda out, obj: out.__setitem__(slice(None), given))
    ckpt = checkpoint.Checkpointer(tmp_path / "a.pt", 1, {"name": "m"}, net, None, grower)
    with pytest.raises(ValueError, match="the ranks were given different paths"):
        ckpt.restore()
