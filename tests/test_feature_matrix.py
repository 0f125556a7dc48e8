"""Every feature composes with every other: random combinations against the single-process
float64 reference.

A *case* draws one value of every switch (:class:`Case`): the kind of growing layer and its
learning rule (linear dual form, RBF, gws, normalised gws, gauge, hybrid; with weight decay
and momentum for two of them), the hybrid's gate (none, distance, capacity, error-scaled)
and learner (``HybridGrower`` or ``EntryAdam`` + ``Grower``), the grower's checks
(immediate, or deferred to check points as on a GPU: drawn from a generator of its own), the
store's dtype (float64, bfloat16, float16), the attention's chunk size (the layer's own, or
3 or 5 rows: a bfloat16 store's full chunks are then packed where the CPU multiplies
bfloat16 natively, for the sums over entries or for the score products too, rcdl.ops.packed;
drawn from a generator of its own), the world size (1–3, spawned gloo processes), top-k
retrieval with ``k ≥ N`` (exact, FAISS flat or HNSW; in training or not; the index refreshed
every step or every third), the evaluation cache, a save through
:class:`rcdl.train.loop.Checkpointer` and a resume into freshly built objects at a random
step, evaluation passes between steps (whose outputs are then changed in place, as a user's
post-processing may), an ``nn.Linear`` in front, an in-place ReLU between the two growing
layers, a memory budget, the initial entries, forgetting some samples part-way
(``rcdl.memory.forgetting.forget`` with the learners, on every rank, or
``rcdl.forget_and_repair`` with stored or recomputed keys where the readout allows it; the
reference forgets them too; drawn from a generator of its own so that the other switches'
draws stay as they were), and the stored weights split as ``w = 1/2``, ``v = 2(−ηg)`` (the
same function; not with float16 stores, where doubling a subnormal value rounds otherwise).

It trains a two-layer network ``[Linear] → layer → ReLU → layer`` for six steps (batch sizes
1, 7, 7, 5, 7, 6: the first leaves most shards empty) with
:func:`rcdl.train.loop.train_step`, and compares with the *reference* of the same model —
one process, exact attention, no cache, no resume, out-of-place ReLU, ``EntryAdam`` +
``Grower``, unit weights, evaluated after every step:

- the stores, gathered from every rank and ordered by entry id, to 1e-10;
- the outputs on held-out inputs after the last step, to 1e-10;
- the outputs of every evaluation pass, to 1e-10;
- whether the stores hold packed chunks after the final evaluation: some exactly where a
  chunk size over a bfloat16 store with native products asks for them, none for the hybrid
  (whose entries Adam moves) or a float64 store.

**Half-precision stores** are compared with the reference over the same rounded numbers
(the one-process run with the same half store). Where nothing changes how the products are
formed (one process, exact attention in training) the stores and final outputs must agree
to 1e-10 too: rounding at append, stochastic rounding keyed on entry ids
(:mod:`rcdl.ops.rounding`) and resumes are exact. Where the products are formed otherwise —
shards or top-k in training change how the store is split into blocks, and bfloat16
products round per block (docs/precision.md) — the stores must hold the same entry ids and
the outputs must agree within ``HALF_FACTOR`` (10) times the largest gap between the half
and the float64 store in the reference up to that step, plus ``HALF_ULPS`` (2) ulps of the
half dtype at the output's scale (a run of 300 draws found layout effects up to 5.6 times
that gap: the two are different draws of the same rounding noise); such
cases are drawn without the switches whose decisions are discontinuous in the entries (gates,
evicting by contribution, merging). Evaluation passes through a cache or top-k over a half
store are compared within the same tolerance.

A reference that refuses a step as diverging (some draws are numerically extreme) must be
matched by the same refusal, except where the case trains through top-k, which the
look-ahead divergence check does not cover (docs/faults.md).

Some combinations are refused with a clear error, and the test checks that they are: top-k
over a sharded store, a normalised gws layer without initial entries, merging budgets on
linear or age-weighted layers. A memory budget is per shard under sharding (docs/memory.md),
not what one process does, so budgets are drawn at world size 1 only.

The CI run takes the fixed cases of :data:`FIXED` (at least one per defect of the seams it
guards) and ``RCDL_MATRIX_DRAWS`` random draws (default 48) from ``RCDL_MATRIX_SEED``
(default 0). A longer run: ``RCDL_MATRIX_DRAWS=2000 RCDL_MATRIX_SEED=1 pytest
tests/test_feature_matrix.py``. A failing case prints its configuration and the command that
reruns it alone (``RCDL_MATRIX_CASE='<json>' pytest tests/test_feature_matrix.py -k
replay``). Hypothesis is not used: one spawn per world size serves all its cases, which
shrinking one failing example at a time would not.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rank_pool import run_ranks
from rcdl import (
    AlwaysGrow,
    CapacityGate,
    ClippedSoftmaxRule,
    DistanceGate,
    EntryAdam,
    ErrorScaledGate,
    FunctionalSGD,
    GaugeSoftmaxRule,
    Grower,
    GrowingLaplacian,
    GrowingLinear,
    GrowingRBF,
    GrowingSoftmax,
    HybridGrower,
    HybridSoftmax,
    MemoryBudget,
    growing_layers,
    use_exact,
    use_topk,
)
from rcdl.memory.forgetting import forget
from rcdl.memory.provenance import samples
from rcdl.memory.repair import forget_and_repair
from rcdl.nn.backends import disable_eval_cache, enable_eval_cache, start_evaluation
from rcdl.train.loop import Checkpointer, train_step

pytestmark = pytest.mark.spawns  # processes of its own: one such test at a time

try:
    import faiss  # noqa: F401
except ImportError:
    faiss = None

D_IN, WIDTH, D_OUT = 5, 6, 3
BATCHES = (1, 7, 7, 5, 7, 6)
FORGOTTEN = (0, 12, 14, 21, 33)  # sample ids (10·step + row) the forget switch removes
STEPS = len(BATCHES)
TOLERANCE = 1e-10
HALF_FACTOR, HALF_ULPS = 10.0, 2.0
TIMEOUT = timedelta(seconds=60)

KINDS = ("linear", "linear-momentum", "rbf", "rbf-decay", "laplacian", "gws", "gws-normalized",
         "gauge", "hybrid")
SOFTMAX_KINDS = ("gws", "gws-normalized", "gauge", "hybrid")
AGED_KINDS = ("linear-momentum", "rbf-decay")
GATES = ("none", "distance", "capacity", "error-scaled")
STORES = {"float64": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("exact", "faiss-flat", "faiss-hnsw")
POLICIES = ("oldest", "newest", "contribution", "random")


@dataclass(frozen=True)
class Case:
    """One combination of switches (see the module docstring)."""

    kind: str
    gate: str = "none"  # hybrid only
    store: str = "float64"
    world: int = 1
    topk: tuple | None = None  # (backend, in training, refresh_every)
    cache: bool = False
    resume_at: int | None = None  # save and resume after this many steps
    evals: tuple[int, ...] = ()  # evaluate after these many steps (0: before training)
    front: bool = False  # an nn.Linear in front
    inplace: bool = False  # the ReLU between the layers in place
    learner: str = "adam+grower"  # hybrid only: or "hybrid-grower"
    budget: tuple | None = None  # (capacity, policy, merge, slack); world size 1 only
    split: bool = False  # linear and RBF kinds: weights 1/2, values doubled
    initial: int = 4  # softmax kinds: initial entries per layer
    forget_at: int | None = None  # forget FORGOTTEN after this many steps (learners synced)
    repair: str = ""  # with forget_at: "values" or "keys", rcdl.forget_and_repair instead
    chunk: int | None = None  # rows per attention chunk (default: the layer's own)
    pack: str = "auto"  # rcdl.ops.packed's mode: "auto" (the sums), "all" (the scores too)
    defer: bool = False  # the grower's checks deferred to the check points (defer_checks)
    guards: str = ""  # the defect a fixed case is there for

    def to_json(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "guards"}
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str) -> Case:
        fields = json.loads(text)
        for name in ("topk", "budget", "evals"):
            if fields.get(name) is not None:
                fields[name] = tuple(fields[name])
        return cls(**fields)


# --------------------------------------------------------------------------- the fixed cases

FIXED = (
    Case("hybrid", gate="capacity", world=2, guards="1: CapacityGate under sharding"),
    Case("hybrid", gate="capacity", world=3, resume_at=2, evals=(1, 4),
         guards="1: CapacityGate under sharding, resumed"),
    Case("hybrid", gate="error-scaled", world=2, front=True,
         guards="1: ErrorScaledGate under sharding"),
    Case("hybrid", gate="distance", store="bfloat16", resume_at=3,
         guards="2: bfloat16 hybrid resumed bit-identically"),
    Case("hybrid", store="bfloat16", world=2, resume_at=2,
         guards="2: bfloat16 hybrid sharded, same rounding noise per entry"),
    Case("hybrid", gate="distance", store="float16", resume_at=4, learner="hybrid-grower",
         guards="2: float16 hybrid resumed, general rounding path"),
    Case("hybrid", gate="distance", front=True, learner="hybrid-grower",
         guards="3: HybridGrower zeroes the parameters' gradients"),
    Case("hybrid", gate="distance", front=True, learner="hybrid-grower", world=2,
         resume_at=3, guards="3: HybridGrower with parameters, sharded and resumed"),
    Case("hybrid", gate="distance", topk=("exact", False, 3), evals=(1, 2, 3, 4, 5),
         guards="4: evaluation through a stale index"),
    Case("hybrid", topk=("exact", True, 3), evals=(2, 3, 5), resume_at=4,
         guards="4: training and evaluation through a stale index, resumed"),
    Case("rbf", cache=True, evals=(0, 1, 2, 3, 4, 5), guards="5: the cache's own partials"),
    Case("linear", cache=True, evals=(1, 2, 4), guards="5: the cache, linear kernel"),
    Case("gws", cache=True, evals=(1, 2, 3), budget=(12, "contribution", True, 2),
         guards="5: the cache after evictions and merges"),
    Case("gws", world=2, resume_at=3, guards="6: a sharded checkpoint given one path"),
    Case("rbf", world=3, resume_at=1, cache=True, evals=(2,),
         guards="6: a sharded checkpoint given one path, three ranks"),
    Case("rbf-decay", split=True, evals=(2, 4), guards="7: stored weights with age coefficients"),
    Case("linear-momentum", split=True, world=2, guards="7: split weights, sharded"),
    Case("gws-normalized", initial=0, guards="8: refused at construction"),
    Case("rbf", inplace=True, front=True, guards="9: in-place activation, RBF"),
    Case("gws", inplace=True, evals=(3,), guards="9: in-place activation, gws"),
    Case("hybrid", gate="distance", inplace=True, learner="hybrid-grower",
         guards="9: in-place activation, hybrid"),
    Case("rbf", topk=("faiss-hnsw", False, 1), evals=(2, 5), guards="10: FAISS HNSW"),
    Case("hybrid", gate="distance", topk=("faiss-hnsw", True, 1), resume_at=3,
         guards="10: FAISS HNSW in training, its graph replayed after a resume"),
    Case("gauge", topk=("faiss-flat", True, 1), evals=(4,), guards="10: FAISS flat"),
    Case("rbf", store="bfloat16", budget=(12, "oldest", True, 0), cache=True, evals=(3,),
         guards="merging into a half-precision RBF store (found by a long run)"),
    Case("rbf", topk=("exact", False, 1), world=2, guards="refused: top-k over shards"),
    Case("linear", budget=(10, "oldest", True, 0), guards="refused: merging a linear layer"),
    Case("gws", forget_at=3, repair="keys", cache=True, evals=(2, 4),
         guards="fast forgetting, keys recomputed, the cache released"),
    Case("rbf", store="bfloat16", forget_at=2, repair="values", front=True,
         guards="fast forgetting, a half store and a trained layer in front"),
    Case("gauge", forget_at=4, repair="keys", resume_at=2, inplace=True,
         guards="fast forgetting after a resume, in-place activation"),
    Case("laplacian", forget_at=4, budget=(14, "oldest", False, 0),
         guards="fast forgetting after evictions"),
    Case("gws", store="bfloat16", chunk=3, forget_at=3, cache=True, evals=(2, 4),
         guards="packed chunks dropped when samples are forgotten"),
    Case("rbf", store="bfloat16", chunk=5, budget=(12, "oldest", False, 3), evals=(1, 3, 5),
         resume_at=4, pack="all",
         guards="packed chunks dropped at every eviction, rebuilt after a resume"),
    Case("gauge", store="bfloat16", chunk=3, world=2, resume_at=3, evals=(2,), pack="all",
         guards="packed chunks per shard, the scores' too"),
    Case("hybrid", store="bfloat16", chunk=3, resume_at=2, evals=(1, 3),
         guards="packed chunks: none for entries an optimizer moves"),
    Case("rbf", chunk=3, split=True, cache=True, evals=(1, 2, 4),
         guards="chunks of three over a float64 store (never packed)"),
    Case("rbf-decay", world=2, resume_at=3, evals=(2, 4), defer=True,
         guards="deferred checks: the step counters advance by the verdict, sharded, resumed"),
    Case("hybrid", gate="distance", learner="hybrid-grower", budget=(12, "oldest", False, 2),
         resume_at=2, defer=True,
         guards="deferred checks: the hybrid's Adam and a budget take the verdict"),
)


# --------------------------------------------------------------------------- random cases


def draw(rng: random.Random) -> Case:
    """A random case; half stores whose products are formed otherwise than in the reference
    are drawn without the switches whose decisions are discontinuous in the entries."""
    kind = rng.choice(KINDS)
    hybrid, softmax = kind == "hybrid", kind in SOFTMAX_KINDS
    world = rng.choice((1, 1, 2, 3))
    store = rng.choice(("float64", "float64", "bfloat16", "float16"))
    topk = None
    if kind not in ("linear", "linear-momentum") and rng.random() < 0.35:
        backends = BACKENDS if faiss is not None else ("exact",)
        topk = (rng.choice(backends), rng.random() < 0.5, rng.choice((1, 1, 3)))
        if world > 1 and rng.random() < 0.7:
            world = 1  # top-k over shards is refused: draw that sometimes, not mostly
    budget = None
    if world == 1 and rng.random() < 0.3:
        budget = (rng.choice((10, 14)), rng.choice(POLICIES), rng.random() < 0.3,
                  rng.choice((0, 3)))
    gate = rng.choice(GATES) if hybrid else "none"
    layout_changes = world > 1 or (topk is not None and topk[1])
    if store != "float64" and layout_changes:
        gate = "none"
        if budget is not None:
            budget = (budget[0], rng.choice(("oldest", "newest", "random")), False, budget[3])
    evals = tuple(sorted(rng.sample(range(STEPS + 1), rng.randint(0, 3))))
    return Case(
        kind=kind, gate=gate, store=store, world=world, topk=topk, cache=rng.random() < 0.4,
        resume_at=rng.randint(1, STEPS - 1) if rng.random() < 0.5 else None, evals=evals,
        front=rng.random() < 0.3, inplace=rng.random() < 0.3,
        learner=rng.choice(("adam+grower", "hybrid-grower")) if hybrid else "adam+grower",
        budget=budget,
        # doubling a value rounds exactly in bfloat16, not among float16's subnormals (< 6e-5)
        split=(kind in ("linear", "linear-momentum", "rbf", "rbf-decay", "laplacian")
               and store != "float16"
               and rng.random() < 0.3),
        initial=rng.choice((0, 4, 4)) if softmax else 4)


def drawn_cases() -> list[Case]:
    count = int(os.environ.get("RCDL_MATRIX_DRAWS", "48"))
    seed = int(os.environ.get("RCDL_MATRIX_SEED", "0"))
    rng, forgets = random.Random(seed), random.Random(seed + 10_000)  # the second one: the
    cases = []  # forget switch, drawn apart so that the other switches' draws stay as they were
    chunks = random.Random(seed + 20_000)  # the chunk switch, drawn apart likewise
    defers = random.Random(seed + 30_000)  # and the deferred checks
    for _ in range(count):
        case = draw(rng)
        if chunks.random() < 0.3 and chunk_compatible(case):
            case = dataclasses.replace(case, chunk=chunks.choice((3, 5)),
                                       pack=chunks.choice(("auto", "all")))
        if forgets.random() < 0.3:
            case = dataclasses.replace(case, forget_at=forgets.randint(2, STEPS - 1))
            if repairable(case):
                case = dataclasses.replace(case, repair=forgets.choice(("", "values", "keys")))
        if defers.random() < 0.3:
            case = dataclasses.replace(case, defer=True)
        cases.append(case)
    return cases


def chunk_compatible(case: Case) -> bool:
    """Whether a chunk size may be drawn for ``case``: a half store's products are then
    formed otherwise than the reference's, so not with the switches :func:`draw` leaves out
    for those (gates, evicting by contribution, merging)."""
    if case.store == "float64":
        return True
    return case.gate == "none" and (case.budget is None or (
        case.budget[1] != "contribution" and not case.budget[2]))


def repairable(case: Case) -> bool:
    """Whether ``forget_and_repair`` takes the case's readout: one a rule writes with its
    queries as keys, unsharded, without top-k, ageing or a memory budget (a readout a budget
    evicted from or merged into is refused: tests/test_repair_budget.py)."""
    return (case.kind in ("rbf", "laplacian", "gws", "gws-normalized", "gauge")
            and case.world == 1 and case.topk is None and case.budget is None)


def expected_refusal(case: Case) -> str | None:
    """The error (a regex) a refused combination must raise, or None."""
    if case.kind == "gws-normalized" and case.initial == 0:
        return "initial_entries"
    if case.topk is not None and case.world > 1:
        return "sharded over ranks"
    if case.budget is not None and case.budget[2] and (
            case.kind.startswith("linear") or case.kind in AGED_KINDS):
        return "merg"
    return None


def layouts_differ(case: Case) -> bool:
    """Whether training forms the products otherwise than the reference does (chunks of
    another size: a half store's products round per chunk, and are packed where its dtype's
    products are native, rcdl.ops.packed)."""
    return case.world > 1 or (case.topk is not None and case.topk[1]) or case.chunk is not None


def expected_packed(case: Case) -> bool:
    """Whether the final evaluation (9 queries) leaves some of the store's full chunks packed
    (rcdl.ops.packed): chunks of the case's size over a half store whose products run natively
    here, in a layer whose entries no optimizer moves (not the hybrid). A float64 store is
    never packed."""
    from rcdl.ops.packed import packed_dtypes

    return (case.chunk is not None and case.store == "bfloat16" and case.kind != "hybrid"
            and packed_dtypes()["bfloat16"])


def reference_of(case: Case, store: str | None = None) -> Case:
    return Case(kind=case.kind, gate=case.gate, store=store or case.store, front=case.front,
                budget=case.budget, initial=case.initial, evals=tuple(range(STEPS + 1)),
                forget_at=case.forget_at, repair=case.repair)


# --------------------------------------------------------------------------- the model


class SplitSGD(FunctionalSGD):
    """FunctionalSGD writing ``w = 1/2`` and ``v = 2 (−ηg)``: the same ``w·v`` exactly."""

    def entries(self, step):  # noqa: ANN001, ANN201
        keys, values, weights = super().entries(step)
        return keys, 2 * values, weights / 2


def _gate(name: str):  # noqa: ANN202
    return {"none": AlwaysGrow(), "distance": DistanceGate(1.5),
            "capacity": CapacityGate(1.2, capacity=20, penalty=2.0),
            "error-scaled": ErrorScaledGate(1.5)}[name]


def _layer(case: Case, d_in: int, d_out: int, index: int) -> nn.Module:
    common = {"store_dtype": STORES[case.store], "chunk_size": case.chunk}
    sgd = SplitSGD if case.split else FunctionalSGD
    if case.kind == "linear":
        return GrowingLinear(d_in, d_out, rule=sgd(0.1, per_sample=False), **common)
    if case.kind == "linear-momentum":
        rule = sgd(0.1, weight_decay=0.01, momentum=0.5, per_sample=False)
        return GrowingLinear(d_in, d_out, rule=rule, **common)
    if case.kind == "rbf":
        return GrowingRBF(d_in, d_out, temperature=1.0, rule=sgd(0.3), **common)
    if case.kind == "rbf-decay":
        rule = sgd(0.2, weight_decay=0.05, momentum=0.3)
        return GrowingRBF(d_in, d_out, temperature=1.0, rule=rule, **common)
    if case.kind == "laplacian":
        return GrowingLaplacian(d_in, d_out, temperature=0.5, rule=sgd(0.3), **common)
    kw = {"temperature": 1.0, "initial_entries": case.initial, "seed": 10 + index, **common}
    if case.kind == "hybrid":
        return HybridSoftmax(d_in, d_out, rule=ClippedSoftmaxRule(1.0, 2.0),
                             trigger=_gate(case.gate), **kw)
    rule = {"gws": ClippedSoftmaxRule(0.3, 2.0),
            "gws-normalized": ClippedSoftmaxRule(0.3, 2.0, normalize=True),
            "gauge": GaugeSoftmaxRule(2.0, 0.3, 5.0)}[case.kind]
    return GrowingSoftmax(d_in, d_out, rule=rule, **kw)


def build(case: Case):  # noqa: ANN201
    """The model, its learners and the checkpointable pieces, as a fresh process makes them."""
    torch.manual_seed(0)
    parts = [nn.Linear(D_IN, D_IN)] if case.front else []
    parts += [_layer(case, D_IN, WIDTH, 0), nn.ReLU(inplace=case.inplace),
              _layer(case, WIDTH, D_OUT, 1)]
    model = nn.Sequential(*parts).double()
    if case.world > 1:
        from rcdl.distributed import shard

        shard(model)
    if case.topk is not None:
        backend, train, refresh = case.topk
        index_kw = {"dtype": torch.float64} if backend == "exact" else {}
        use_topk(model, 10_000, backend=backend, train=train, refresh_every=refresh,
                 **index_kw)
    budget = None
    if case.budget is not None:
        capacity, policy, merge, slack = case.budget
        budget = MemoryBudget(capacity, policy, merge=merge, slack=slack)
    optimizer, grower = None, None
    if case.kind == "hybrid" and case.learner == "hybrid-grower":
        grower = HybridGrower(model, lr=0.05, budget=budget, defer_checks=case.defer)
    elif case.kind == "hybrid":
        optimizer = EntryAdam(model, lr=0.05)
        grower = Grower(model, budget=budget, defer_checks=case.defer)
    else:
        grower = Grower(model, budget=budget, defer_checks=case.defer)
        if case.front:
            optimizer = torch.optim.SGD(model[0].parameters(), lr=0.05)
    if case.cache:
        for _, layer in growing_layers(model):
            enable_eval_cache(layer)
    return model, optimizer, grower


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCHES[step], D_IN, generator=gen, dtype=torch.float64)
    return x, torch.tanh(2 * x[:, :D_OUT])


def all_samples() -> tuple[torch.Tensor, torch.Tensor]:
    """Every step's inputs and targets, by sample id (10·step + row)."""
    inputs = torch.zeros(10 * STEPS, D_IN, dtype=torch.float64)
    targets = torch.zeros(10 * STEPS, D_OUT, dtype=torch.float64)
    for step in range(STEPS):
        x, y = batch(step)
        inputs[10 * step : 10 * step + len(x)], targets[10 * step : 10 * step + len(x)] = x, y
    return inputs, targets


def held_out() -> torch.Tensor:
    return torch.randn(9, D_IN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def evaluate(model: nn.Module) -> torch.Tensor:
    """One evaluation pass; the output handed out is then changed in place."""
    for _, layer in growing_layers(model):
        start_evaluation(layer)
    model.eval()
    with torch.no_grad():
        out = model(held_out())
        seen = out.clone()
        out.mul_(-3.0).add_(1e3)  # a user's in-place post-processing
    model.train()
    return seen


def stores(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every layer's rows ``[id, written_at, key, value, weight]`` in float64, by id, over
    every rank. A linear or RBF layer's function depends on ``w_j v_j`` alone: its rows hold
    ``[id, written_at, key, w v, 1]``, so that split weights compare equal."""
    local = {}
    for name, layer in growing_layers(model):
        s = layer.store
        values, weights = s.values.double(), s.weights.double()
        if not layer.kernel.normalised:
            values, weights = values * weights[:, None], torch.ones_like(weights)
        local[name] = torch.cat([s.ids[:, None].double(), s.written_at[:, None].double(),
                                 s.keys.double(), values, weights[:, None]], 1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        local = {name: torch.cat([g[name] for g in gathered]) for name in local}
    return {name: t[t[:, 0].argsort()] for name, t in local.items()}


def run(case: Case, folder: Path) -> dict:
    """Train ``case``; ``{"refused": message}`` if a switch refused the combination."""
    from rcdl.ops.packed import packed_chunks

    with packed_chunks(case.pack):
        return _run(case, folder)


def _run(case: Case, folder: Path) -> dict:
    try:
        model, optimizer, grower = build(case)
    except ValueError as err:
        return {"refused": str(err)}
    evals = {}
    for step in range(STEPS + 1):
        if case.defer and (step in case.evals or step in (STEPS, case.resume_at,
                                                          case.forget_at)):
            grower.check()  # a check point, as the training loop has them
        if step in case.evals:
            evals[step] = evaluate(model)
        if step == STEPS:
            break
        if step == case.resume_at:
            model, optimizer, grower = _save_and_resume(case, folder, step, model, optimizer,
                                                        grower)
        if step == case.forget_at and case.repair:
            inputs, labels = all_samples()
            forget_and_repair(model, FORGOTTEN, labels=labels, loss_fn=F.mse_loss,
                              inputs=inputs if case.repair == "keys" else None,
                              readout=str(len(model) - 1), scan=False,
                              learners=[x for x in (optimizer, grower) if x is not None])
        elif step == case.forget_at:
            forget(model, FORGOTTEN, learners=[x for x in (optimizer, grower) if x is not None],
                   scan=False)
        x, y = batch(step)
        with samples(model, 10 * step + torch.arange(len(x))):  # sample ids: 10·step + row
            train_step(model.train(), x, y, F.mse_loss, optimizer, grower)
    use_exact(model)
    for _, layer in growing_layers(model):
        disable_eval_cache(layer)
    with torch.no_grad():
        final = model.eval()(held_out())
    packed = sum(len(layer.store.packed_chunks) for _, layer in growing_layers(model))
    return {"stores": stores(model), "final": final, "evals": evals, "packed": packed}


def _save_and_resume(case, folder, step, model, optimizer, grower):  # noqa: ANN001, ANN202
    """Save through a Checkpointer (every rank given the same path), then build everything
    anew, as a fresh process would, with torch's global generator somewhere else."""
    identity = {"name": "matrix", "seed": 0}
    Checkpointer(folder / "ckpt.pt", 1, identity, model, optimizer, grower).save({"step": step})
    del model, optimizer, grower
    model, optimizer, grower = build(case)
    loop = Checkpointer(folder / "ckpt.pt", 1, identity, model, optimizer, grower).restore()
    assert loop == {"step": step}
    torch.manual_seed(1000 + step)  # the global generator is not where the first run left it
    return model, optimizer, grower


# --------------------------------------------------------------------------- comparison


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def compare(case: Case, got: dict, ref: dict, ref64: dict | None) -> list[str]:
    """What differs between ``got`` and the reference (an empty list when nothing does)."""
    refusal = expected_refusal(case)
    if refusal is not None:
        if "refused" not in got:
            return [f"expected a refusal matching {refusal!r}, but the case ran"]
        import re

        ok = re.search(refusal, got["refused"])
        return [] if ok else [f"refused with {got['refused']!r}, expected {refusal!r}"]
    if "refused" in got:
        return [f"refused unexpectedly: {got['refused']}"]
    if "diverged" in ref:  # the reference refused a step: so must the case
        if ref["diverged"] in got.get("error", ""):
            return []
        if case.topk is not None and case.topk[1]:  # no look-ahead check through top-k
            return []
        return [f"the reference refused a step ({ref['diverged']}), the case did not"]
    if "error" in got:
        return [f"raised: {got['error']}"]
    problems = []
    half = case.store != "float64"

    def tolerance(step: int | None) -> float:
        """HALF_FACTOR times the largest half-vs-float64 gap of the reference up to this
        step, plus HALF_ULPS ulps of the half dtype at the output's scale."""
        if not half:
            return TOLERANCE
        last = STEPS if step is None else step
        gap = max(_max_diff(ref["evals"][t], ref64["evals"][t]) for t in range(last + 1))
        if step is None:
            gap = max(gap, _max_diff(ref["final"], ref64["final"]))
        out = ref["final"] if step is None else ref["evals"][step]
        ulp = torch.finfo(STORES[case.store]).eps
        return HALF_FACTOR * gap + HALF_ULPS * ulp * float(out.abs().max())

    approximate = half and layouts_differ(case)
    # with shards, a rank's share of the rows may not fill a chunk: only "none" is certain
    if bool(got["packed"]) != expected_packed(case) and (case.world == 1 or got["packed"]):
        problems.append(f"{got['packed']} packed chunks after the final evaluation, expected "
                        f"{'some' if expected_packed(case) else 'none'}")
    for name, want in ref["stores"].items():
        have = got["stores"][name]
        if have.shape[0] != want.shape[0] or not torch.equal(have[:, :2], want[:, :2]):
            problems.append(f"{name}: entries (id, step) {have[:, :2].tolist()} != "
                            f"{want[:, :2].tolist()}")
        elif not approximate and _max_diff(have, want) > TOLERANCE:
            problems.append(f"{name}: stores differ by {_max_diff(have, want):.3g}")
    final_tol = tolerance(None) if approximate else TOLERANCE
    if _max_diff(got["final"], ref["final"]) > final_tol:
        problems.append(f"final outputs differ by {_max_diff(got['final'], ref['final']):.3g} "
                        f"(tolerance {final_tol:.3g})")
    eval_approximate = half and (approximate or case.cache or case.topk is not None)
    for step, out in got["evals"].items():
        tol = tolerance(step) if eval_approximate else TOLERANCE
        if _max_diff(out, ref["evals"][step]) > tol:
            problems.append(f"evaluation after step {step} differs by "
                            f"{_max_diff(out, ref['evals'][step]):.3g} (tolerance {tol:.3g})")
    return problems


def references(cases: list[Case]) -> dict[Case, tuple[dict, dict | None]]:
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for case in cases:
            if expected_refusal(case) is not None:
                out[case] = ({}, None)
                continue
            try:
                ref = run(reference_of(case), Path(folder))
                ref64 = run(reference_of(case, "float64"), Path(folder)) \
                    if case.store != "float64" else None
            except ValueError as err:  # a refused step: the model itself diverges
                ref, ref64 = {"diverged": str(err).split(";")[0]}, None
            out[case] = (ref, ref64)
    return out


def _run_all(cases: list[Case], folder: Path) -> list[dict]:
    results = []
    for i, case in enumerate(cases):
        case_folder = folder / f"case{i}"
        if not dist.is_initialized() or dist.get_rank() == 0:
            case_folder.mkdir(parents=True, exist_ok=True)
        if dist.is_initialized():
            try:
                dist.barrier()
            except RuntimeError as err:  # a rank left the previous case early, or hung in it
                raise RuntimeError(f"rank {dist.get_rank()}: the ranks fell out of step in the "
                                   f"case before case {i}: {cases[i - 1].to_json()}") from err
        try:
            results.append(run(case, case_folder))
        except Exception:  # noqa: BLE001 - reported with the case
            results.append({"error": traceback.format_exc(limit=4)})
    return results


def _worker(rank: int, world: int, init_file: Path, folder: Path, cases_json: list[str],
            result_file: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        torch.set_num_threads(1)
        results = _run_all([Case.from_json(c) for c in cases_json], folder)
        if rank == 0:
            torch.save(results, result_file)
    finally:
        dist.destroy_process_group()


def run_cases(cases: list[Case], world: int, folder: Path) -> list[dict]:
    """Every case (all of world size ``world``), in this process or in spawned ranks."""
    if world == 1:
        return _run_all(cases, folder)
    result_file = folder / "results.pt"
    run_ranks(_worker, (world, folder / "init", folder, [c.to_json() for c in cases],
                        result_file), world=world)
    return torch.load(result_file, weights_only=False)


def check(cases: list[Case], world: int, folder: Path) -> None:
    refs = references(cases)
    failures = []
    for case, got in zip(cases, run_cases(cases, world, folder), strict=True):
        problems = compare(case, got, *refs[case])
        if problems:
            failures.append(
                f"{case.guards or 'drawn case'}: {'; '.join(problems)}\n  rerun it alone: "
                f"RCDL_MATRIX_CASE='{case.to_json()}' python -m pytest "
                "tests/test_feature_matrix.py -k replay")
    assert not failures, f"{len(failures)} of {len(cases)} cases differ:\n" + "\n".join(failures)


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_combination_equals_the_one_process_reference(world, tmp_path):
    cases = [c for c in (*FIXED, *drawn_cases()) if c.world == world]
    assert cases
    check(cases, world, tmp_path)


def test_the_fixed_cases_guard_every_seam_defect():
    guarded = {case.guards.split(":")[0] for case in FIXED}
    assert {str(n) for n in range(1, 11)} <= guarded
    assert all(case.world == 1 or case.budget is None for case in (*FIXED, *drawn_cases()))


def test_the_draws_cover_every_switch():
    cases = [*FIXED, *drawn_cases()]
    assert {c.kind for c in cases} == set(KINDS)
    assert {c.gate for c in cases if c.kind == "hybrid"} == set(GATES)
    assert {c.store for c in cases} == set(STORES)
    assert {c.world for c in cases} == {1, 2, 3}
    assert {c.topk[0] for c in cases if c.topk} >= {"exact"}
    for switch in ("cache", "front", "inplace", "split"):
        assert {getattr(c, switch) for c in cases} == {False, True}, switch
    assert any(c.resume_at for c in cases) and any(c.evals for c in cases)
    assert any(c.budget for c in cases) and any(expected_refusal(c) for c in cases)
    assert {c.world for c in cases if c.forget_at} == {1, 2, 3}
    assert {c.repair for c in cases if c.forget_at} == {"", "values", "keys"}
    assert {c.chunk for c in cases} == {None, 3, 5}
    assert {c.pack for c in cases if c.chunk} == {"auto", "all"}
    assert {c.store for c in cases if c.chunk} >= {"float64", "bfloat16"}
    assert {c.defer for c in cases} == {False, True}
    assert {c.world for c in cases if c.defer} == {1, 2, 3}
    assert {c.kind for c in cases if c.defer} >= {"hybrid", "rbf-decay"}


@pytest.mark.skipif("RCDL_MATRIX_CASE" not in os.environ,
                    reason="set RCDL_MATRIX_CASE to the JSON of a case to rerun it")
def test_replay_one_case(tmp_path):
    case = Case.from_json(os.environ["RCDL_MATRIX_CASE"])
    print(case)
    check([case], case.world, tmp_path)


def test_a_case_survives_json():
    for case in FIXED:
        assert dataclasses.replace(case, guards="") == Case.from_json(case.to_json())
    assert math.isfinite(HALF_FACTOR) and HALF_ULPS > 0
