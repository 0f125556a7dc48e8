"""Edits that compose, drawn at random (docs/unlearning.md, "Edits that compose" and "A saved
run"): sequences of edits of a trained model's memory, each checked against what it promises,
and two invariants checked on every draw.

A *draw* (:class:`Draw`) is a growing layer kind (gws, RBF, gauge, the hybrid with a
distance gate and ``HybridGrower``), a store dtype (float64 or bfloat16), a memory budget
(none; 28 entries per layer, evicting the newest rows without slack; or the same merging
them), the replay log's ``every`` (1 or 2), and a sequence of one to four edits, each naming
samples by their position in the run's stream:

- ``fast``: ``rcdl.forget(model, S, learners=[grower], replay=log)``; always succeeds.
- ``repair-values`` / ``repair-keys``: ``forget_and_repair`` of the readout, with the stored
  keys or with keys recomputed from the inputs; refused for the hybrid (an optimizer moves its
  entries) and under a budget (the readout evicted or merged rows). It does not tell the log,
  so every later exact request is refused.
- ``exact``: ``forget_exactly``; refused under a merging budget and after a repair. Where
  the run without the samples diverges (a step refused as diverging), the replay must refuse
  it too, changing nothing, and so must the retraining.
- ``exact-mismatch``: ``forget_exactly`` given fewer data rows than the run had; refused.
- ``save``: ``save_checkpoint`` of the model's and the grower's state dicts and ``log.save``,
  then all three loaded into freshly built objects (a new process, as far as one process can
  be one: torch's global generator is moved elsewhere too).
- ``rewind``: ``rewind`` by one or two steps (its "positions" are the steps): the model of the
  shorter run, whose stream is the first steps of the log's; refused under a merging budget
  and after a repair or an untold undo.
- ``undo``: ``Grower.drop_last_step()``, not told to the log (not for the hybrid, whose
  learner has none); every later exact request or rewind is refused, naming the undo, and so
  is every later repair (the undone step's entries look like evictions to it).

A refused edit must raise the documented ``ValueError`` and leave the model (its state dict
and outputs), the grower's state dict and the log's state dict bit for bit as they were.

The invariants, on every draw:

(a) no key of a forgotten sample (the rows of its entries in every layer, collected before
    the edit that forgets it) is reachable from the model, the grower or the log
    (:func:`rcdl.memory.forgetting.scan_for_rows`), after every edit; nor found among the
    bytes of the files a ``save`` writes, nor of the files the final state is saved to;
(b) after each successful exact request or rewind the model equals, bit for bit, the model
    trained from scratch (``train_one_pass(..., order=...)``) on the run's stream, cut where
    rewinds cut it, without the union of every sample forgotten so far, fast and exact: its
    stores (keys, values, weights, steps, ids, the samples the map names), its other
    parameters and buffers, and its outputs on held-out inputs. A bfloat16 store is compared
    bit for bit too: the replay and the retraining run the same operations in one process, on
    the product path the log recorded.

The model is ``layer → ReLU → layer`` over 5 inputs, 6 hidden and 3 classes, trained with
``train_one_pass`` for one pass of 48 samples in batches of 8 under sample ids that are not
positions (1000 + 3·row), in float64 with the drawn store dtype. :data:`FIXED` holds the cases
of issue 61 (a told fast forget, then an exact request for an earlier sample; the hybrid's
snapshots after a fast forget; an exact request under a merging budget; data that do not match
the log; a repair of a readout a budget evicted from) and a restart between the edits.

``RCDL_EDIT_DRAWS`` (default 24) draws from ``RCDL_EDIT_SEED`` (default 0) run beside them; a
failing draw prints the command that reruns it alone (``RCDL_EDIT_DRAW='<json>'``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rcdl import (
    ClippedSoftmaxRule,
    DistanceGate,
    FunctionalSGD,
    GaugeSoftmaxRule,
    Grower,
    GrowingRBF,
    GrowingSoftmax,
    HybridGrower,
    HybridSoftmax,
    MemoryBudget,
    growing_layers,
)
from rcdl.memory.forgetting import forget, scan_for_rows
from rcdl.memory.provenance import UNKNOWN, entry_samples
from rcdl.memory.repair import forget_and_repair
from rcdl.ops.half import products_as
from rcdl.train.checkpoint import load_checkpoint, load_model_state, save_checkpoint
from rcdl.train.loop import train_one_pass
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly, rewind
from small_runs import same

D_IN, WIDTH, CLASSES, N, B = 5, 6, 3, 48, 8
SAMPLE_IDS = 1000 + 3 * torch.arange(N)  # (N,) the id each training row is recorded under
READOUT = "2"  # the Sequential's last growing layer
KINDS = ("gws", "rbf", "gauge", "hybrid")
STORES = {"float64": None, "bfloat16": torch.bfloat16}
BUDGETS = ("none", "evict", "merge")
OPS = ("fast", "repair-values", "repair-keys", "exact", "exact-mismatch", "save", "rewind",
       "undo")
SAVE = ("save", ())


@dataclass(frozen=True)
class Draw:
    """One model, budget and log, and the edits applied to it (the module docstring)."""

    kind: str
    store: str = "float64"
    budget: str = "none"
    every: int = 1
    edits: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (op, stream positions)
    guards: str = ""  # what a fixed case is there for

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if k != "guards"})

    @classmethod
    def from_json(cls, text: str) -> Draw:
        fields = json.loads(text)
        fields["edits"] = tuple((op, tuple(pos)) for op, pos in fields.get("edits", ()))
        return cls(**fields)

    @property
    def label(self) -> str:
        return "-".join([self.kind, self.store, self.budget, f"every{self.every}",
                         "+".join(op for op, _ in self.edits) or "nothing"])


# --------------------------------------------------------------------------- the fixed cases

FIXED = (
    Draw("gws", edits=(("fast", (41, 44)), ("exact", (20,))),
         guards="1: a told fast forget, then an exact request for an earlier sample"),
    Draw("gws", edits=(("fast", (41, 44)), SAVE, ("exact", (20,))),
         guards="6: the same after a restart (a save, and a load into fresh objects)"),
    Draw("hybrid", edits=(("fast", (17, 18, 22)), ("exact", (35,))),
         guards="2: the hybrid's snapshots after a fast forget"),
    Draw("hybrid", every=2, edits=(("exact", (9,)), ("fast", (30,)), SAVE, ("exact", (3,))),
         guards="2: the hybrid, exact, fast, restart, exact"),
    Draw("gws", budget="merge", edits=(("exact", (20,)),),
         guards="3: an exact request under a merging budget is refused"),
    Draw("hybrid", budget="merge", edits=(("fast", (40,)), ("exact", (20,))),
         guards="3: the hybrid under a merging budget, after a fast forget"),
    Draw("gws", budget="evict", edits=(("fast", (33,)), ("exact", (12, 20))),
         guards="3: an evicting budget composes"),
    Draw("rbf", edits=(("exact-mismatch", (20,)), ("exact", (20,))),
         guards="4: data that do not match the log are refused, nothing changed"),
    Draw("rbf", budget="evict", edits=(("repair-values", (25,)), ("exact", (25,))),
         guards="5: a repair of a readout a budget evicted from is refused"),
    Draw("gauge", edits=(("repair-keys", (30,)), ("exact", (10,))),
         guards="a repair is not told to the log: a later exact request is refused"),
    Draw("gws", store="bfloat16", every=2, edits=(("fast", (7,)), SAVE, ("exact", (26, 40)),
                                                  ("fast", (2,)), ("exact", (45,))),
         guards="a bfloat16 store, restarted between edits"),
    Draw("gws", edits=(("undo", ()), ("exact", (10,))),
         guards="a step undone outside the log: a later exact request is refused"),
    Draw("rbf", every=2, edits=(("fast", (12,)), ("rewind", (1,)), SAVE, ("exact", (3,)),
                                ("rewind", (2,))),
         guards="rewinds through the log, between forgets and a restart"),
    Draw("hybrid", budget="evict", edits=(("rewind", (2,)), ("exact", (20,))),
         guards="the hybrid under an evicting budget, rewound exactly"),
)


# --------------------------------------------------------------------------- random draws


def draw(rng: random.Random) -> Draw:
    """A random draw: its edits name samples not named by an earlier edit of the draw."""
    pool = list(range(N))
    kind = rng.choice(KINDS)
    edits: list[tuple[str, tuple[int, ...]]] = []
    for _ in range(rng.randint(1, 4)):
        op = rng.choices(OPS, weights=(3, 1, 1, 3, 0.5, 1.5, 1.5, 0 if kind == "hybrid" else 1))[0]
        if op in ("save", "undo"):
            edits.append((op, ()))
            continue
        if op == "rewind":
            edits.append((op, (rng.randint(1, 2),)))
            continue
        positions = tuple(sorted(rng.sample(pool, rng.randint(1, 3))))
        pool = [p for p in pool if p not in positions]
        edits.append((op, positions))
    return Draw(kind=kind, store=rng.choice(("float64", "float64", "bfloat16")),
                budget=rng.choice(("none", "none", "evict", "merge")),
                every=rng.choice((1, 2)), edits=tuple(edits))


def drawn() -> list[Draw]:
    if "RCDL_EDIT_DRAW" in os.environ:
        return [Draw.from_json(os.environ["RCDL_EDIT_DRAW"])]
    count = int(os.environ.get("RCDL_EDIT_DRAWS", "24"))
    rng = random.Random(int(os.environ.get("RCDL_EDIT_SEED", "0")))
    return [draw(rng) for _ in range(count)]


# --------------------------------------------------------------------------- the model


def data(x_rows: int = N) -> tuple[torch.Tensor, ...]:
    """``(x_train, y_train, x_test, y_test)``; ``x_rows`` cuts the training rows short."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N + 16, D_IN, generator=gen, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # (N + 16,) three classes
    return x[:x_rows], y[:x_rows], x[N:], y[N:]


def by_sample_id(t: torch.Tensor) -> torch.Tensor:
    """``t``'s training rows indexed by sample id (``forget_and_repair``'s labels and inputs:
    indexed as the entries' samples are); zeros elsewhere."""
    out = torch.zeros(int(SAMPLE_IDS.max()) + 1, *t.shape[1:], dtype=t.dtype)
    out[SAMPLE_IDS] = t[:N]
    return out


def _layer(kind: str, store: str, d_in: int, d_out: int, index: int) -> nn.Module:
    dtype = STORES[store]
    if kind == "rbf":
        return GrowingRBF(d_in, d_out, temperature=1.0, rule=FunctionalSGD(0.3),
                          store_dtype=dtype)
    kw = {"temperature": 1.0, "initial_entries": 4, "seed": 10 + index, "store_dtype": dtype}
    if kind == "hybrid":
        return HybridSoftmax(d_in, d_out, rule=ClippedSoftmaxRule(1.0, 2.0),
                             trigger=DistanceGate(1.5), **kw)
    rule = ClippedSoftmaxRule(1.0, 2.0) if kind == "gws" else GaugeSoftmaxRule(2.0, 0.3, 5.0)
    return GrowingSoftmax(d_in, d_out, rule=rule, **kw)


def build(d: Draw) -> tuple[nn.Module, Grower | HybridGrower]:
    """The model and its learner, as a fresh process makes them."""
    torch.manual_seed(0)
    model = nn.Sequential(_layer(d.kind, d.store, D_IN, WIDTH, 0), nn.ReLU(),
                          _layer(d.kind, d.store, WIDTH, CLASSES, 1)).double()
    budget = None if d.budget == "none" else MemoryBudget(
        28, "newest", merge=d.budget == "merge")
    if d.kind == "hybrid":
        return model, HybridGrower(model, lr=0.05, budget=budget)
    return model, Grower(model, budget=budget)


def train(d: Draw, log: ReplayLog | None = None, order: torch.Tensor | None = None):  # noqa: ANN201
    model, grower = build(d)
    train_one_pass(model, data(), batch_size=B, seed=3, grower=grower,
                   loss_fn=F.cross_entropy, eval_every=1000, progress=False,
                   sample_ids=SAMPLE_IDS, order=order, replay=log)
    return model, grower


# --------------------------------------------------------------------------- state


def outputs(model: nn.Module) -> torch.Tensor:
    training = model.training
    with torch.no_grad():
        out = model.eval()(data()[2])
    model.train(training)
    return out


def everything(model: nn.Module, grower, log: ReplayLog) -> dict:  # noqa: ANN001
    """What a refused edit must leave as it was."""
    return {"model": copy.deepcopy(model.state_dict()), "outputs": outputs(model),
            "grower": copy.deepcopy(grower.state_dict()),
            "log": copy.deepcopy(log.state_dict())}


def differences(before: dict, after: dict) -> list[str]:
    return [key for key in before if not same(before[key], after[key])]


def keys_of(model: nn.Module, sample_ids: list[int]) -> list[torch.Tensor]:
    """The keys of the entries the samples wrote, per layer (each ``(R, d)``)."""
    wanted = torch.tensor(sample_ids)
    out = []
    for _, layer in growing_layers(model):
        mask = torch.isin(entry_samples(layer), wanted)
        if bool(mask.any()):
            out.append(layer.store.keys[mask].detach().clone())
    return out


def unshared(rows: list[torch.Tensor], model: nn.Module, gone: set[int]
             ) -> list[torch.Tensor]:
    """``rows`` without those equal, bit for bit, to the key of an entry the model holds for a
    sample not forgotten: in a bfloat16 store the readout's keys are ReLU features rounded to
    8 bits, and two samples' keys with one non-zero coordinate can coincide (a long run found
    such rows); such a row is a retained sample's key as much as a forgotten one's."""
    kept = []
    for _, layer in growing_layers(model):
        owners = entry_samples(layer)
        named = (owners != UNKNOWN) & ~torch.isin(owners, torch.tensor(sorted(gone)))
        kept.append(layer.store.keys[named].detach())
    out = []
    for r in rows:
        for k in kept:
            if k.shape[-1] == r.shape[-1] and k.dtype == r.dtype and len(k):
                r = r[~(r[:, None, :] == k[None]).all(-1).any(1)]
        out.append(r)
    return out


def model_differences(a: nn.Module, b: nn.Module) -> list[str]:
    """Where ``a`` and ``b`` differ (their stores by field, their other state, outputs)."""
    problems = []
    for (name, la), (_, lb) in zip(growing_layers(a), growing_layers(b), strict=True):
        for field in ("ids", "written_at", "keys", "values", "weights"):
            x, y = getattr(la.store, field), getattr(lb.store, field)
            if not same(x, y):
                problems.append(f"layer {name!r}: {field} differ ({tuple(x.shape)} vs "
                                f"{tuple(y.shape)})")
        if not same(entry_samples(la), entry_samples(lb)):
            problems.append(f"layer {name!r}: the samples the map names differ")
        if la.store.next_id != lb.store.next_id:
            problems.append(f"layer {name!r}: next_id {la.store.next_id} != "
                            f"{lb.store.next_id}")
    sa, sb = a.state_dict(), b.state_dict()
    for key in sa:  # a map's capacity may differ
        if not key.endswith(("provenance.samples", "provenance.merged")) and not same(
                sa[key], sb.get(key)):
            problems.append(f"state {key!r} differs")
    if not same(outputs(a), outputs(b)):
        problems.append("outputs on held-out inputs differ")
    return problems


def files_holding(folder: Path, rows: list[torch.Tensor]) -> list[str]:
    """The files under ``folder`` that hold one of the rows, bit for bit: read back
    (``load_checkpoint``, verified) and scanned tensor by tensor as rows of their last
    dimension, or, for a row none of whose coordinates is zero, anywhere among the file's
    bytes. (A row of mostly zeros, such as a bfloat16 ReLU feature with one non-zero
    coordinate, also occurs in the bytes of unrelated sparse tensors, across their rows.)"""
    dense = [row.contiguous().view(torch.uint8).numpy().tobytes()
             for r in rows for row in r.reshape(-1, r.shape[-1]) if bool((row != 0).all())]
    held = []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        raw = path.read_bytes()
        if any(w in raw for w in dense) or not scan_for_rows(
                {path.name: load_checkpoint(path)}, rows).clean:
            held.append(path.name)
    return held


def save(model: nn.Module, grower, log: ReplayLog, folder: Path) -> None:  # noqa: ANN001
    save_checkpoint({"model": model.state_dict(), "grower": grower.state_dict()},
                    folder / "model.pt")
    log.save(folder / "log.pt")


def load(d: Draw, folder: Path):  # noqa: ANN201
    model, grower = build(d)
    saved = load_checkpoint(folder / "model.pt")
    load_model_state(model, saved["model"])
    grower.load_state_dict(saved["grower"])
    torch.manual_seed(1234)  # the global generator is not where the training run left it
    return model, grower, ReplayLog.load(folder / "log.pt")


# --------------------------------------------------------------------------- one draw


def expected_refusal(d: Draw, op: str, repaired: bool, undone: bool) -> str | None:
    """The error (a regex) the edit ``op`` must be refused with, or ``None``."""
    if op == "exact-mismatch":
        return r"forget_exactly: data holds \d+ rows"
    if op.startswith("repair") and (d.kind == "hybrid" or d.budget != "none" or undone):
        return r"forget_and_repair: cannot re-write"
    if op in ("exact", "rewind") and d.budget == "merge":
        return r"merge=True"
    if op in ("exact", "rewind") and repaired:
        return r"not told of|lost rows it held"
    if op in ("exact", "rewind") and undone:
        return r"undone outside the log|lost rows it held"
    return None


def run_draw(d: Draw, folder: Path, outcomes: list[str] | None = None) -> list[str]:
    """Apply the draw's edits; what went otherwise than promised (empty: nothing). Each
    edit's outcome is appended to ``outcomes`` (``"exact: done"``, ``"fast: refused"``)."""
    outcomes = [] if outcomes is None else outcomes
    log = ReplayLog(every=d.every)
    model, grower = train(d, log)
    order, stream = log.order.clone(), log.stream.clone()  # the run as trained
    alive = torch.ones(len(order), dtype=torch.bool)  # (N,) the positions rewinds kept
    gone: set[int] = set()  # every sample forgotten so far
    gone_keys: list[torch.Tensor] = []
    repaired = undone = False
    problems: list[str] = []
    x_train, y_train = data()[:2]
    for i, (op, positions) in enumerate(d.edits):
        where = f"edit {i} ({op} {list(positions)})"
        if op == "save":
            outcomes.append("save: done")
            save(model, grower, log, folder)
            held = files_holding(folder, unshared(gone_keys, model, gone))
            if held:
                problems.append(f"{where}: the files {held} hold a forgotten key")
            model, grower, log = load(d, folder)
            continue
        if op == "undo":
            grower.drop_last_step()
            undone = True
            outcomes.append("undo: done")
            continue
        ids = [] if op == "rewind" else stream[list(positions)].tolist()
        keys = keys_of(model, ids)
        refusal = expected_refusal(d, op, repaired, undone)
        left = alive & ~torch.isin(stream, torch.tensor(sorted(gone), dtype=torch.long))
        target = max(0, -(-int(left.sum()) // B) - positions[0]) if op == "rewind" else 0
        before = everything(model, grower, log)
        try:
            if op == "fast":
                receipt = forget(model, ids, learners=[grower], replay=log)
            elif op.startswith("repair"):
                inputs = by_sample_id(x_train) if op == "repair-keys" else None
                receipt = forget_and_repair(model, ids, labels=by_sample_id(y_train),
                                            loss_fn=F.cross_entropy, readout=READOUT,
                                            learners=[grower], inputs=inputs)
            elif op == "rewind":
                receipt = None
                rewind(model, target, replay=log, data=(x_train, y_train),
                       loss_fn=F.cross_entropy, grower=grower)
            else:
                cut = N - 8 if op == "exact-mismatch" else N
                receipt = forget_exactly(model, ids, replay=log,
                                         data=(x_train[:cut], y_train[:cut]),
                                         loss_fn=F.cross_entropy, grower=grower)
        except ValueError as err:
            changed = differences(before, everything(model, grower, log))
            if changed:
                problems.append(f"{where}: refused, but changed {changed}")
            if refusal is None and op in ("exact", "rewind") and "diverging" in str(err):
                outcomes.append(f"{op}: diverged")  # the run without them diverges: so must
                try:  # the retraining
                    with products_as(log.products):
                        train(d, order=order[alive & ~torch.isin(stream, torch.tensor(
                            sorted(gone | set(ids)), dtype=torch.long))])
                    problems.append(f"{where}: the replay refused a step, the retraining "
                                    f"did not: {err}")
                except ValueError as again:
                    if "diverging" not in str(again):
                        problems.append(f"{where}: the retraining refused otherwise: {again}")
            elif refusal is None:
                problems.append(f"{where}: refused unexpectedly: {err}")
            elif not re.search(refusal, str(err)):
                problems.append(f"{where}: refused with {str(err)!r}, expected {refusal!r}")
            else:
                outcomes.append(f"{op}: refused")
            if problems:
                return problems
            continue
        if refusal is not None:
            return [*problems, f"{where}: ran, expected a refusal matching {refusal!r}"]
        outcomes.append(f"{op}: done")
        gone |= set(ids)
        gone_keys += keys
        scan = scan_for_rows({"model": model, "grower": grower, "log": log},
                             unshared(gone_keys, model, gone))
        if not scan.clean:
            problems.append(f"{where}: forgotten keys still held by {list(scan.holders)}")
        own = scan_for_rows({"model": model, "grower": grower}, unshared(keys, model, gone))
        if receipt is not None and receipt.scan is not None and receipt.scan.clean and (
                not own.clean):
            problems.append(f"{where}: the receipt's scan says clean, the keys it forgot are "
                            f"held by {list(own.holders)}")
        repaired |= op.startswith("repair")
        if op == "rewind":
            alive = left & (left.cumsum(0) <= target * B)
        if op in ("exact", "rewind"):
            keep = alive & ~torch.isin(stream, torch.tensor(sorted(gone), dtype=torch.long))
            with products_as(log.products):
                retrained, _ = train(d, order=order[keep])
            problems += [f"{where}: not the model retrained without {len(gone)} samples: {p}"
                         for p in model_differences(model, retrained)]
        if problems:
            return problems
    save(model, grower, log, folder)
    held = files_holding(folder, unshared(gone_keys, model, gone))
    if held:
        problems.append(f"after the last edit: the files {held} hold a forgotten key")
    return problems


def check(d: Draw, folder: Path) -> None:
    problems = run_draw(d, folder)
    assert not problems, (
        f"{d.guards or d.label}:\n  " + "\n  ".join(problems) + "\n  rerun it alone: "
        f"RCDL_EDIT_DRAW='{d.to_json()}' python -m pytest tests/test_edit_sequences.py -k drawn")


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("d", FIXED, ids=[d.guards.split(":")[0] + "-" + d.label for d in FIXED])
def test_fixed_sequences(d, tmp_path):
    check(d, tmp_path)


@pytest.mark.parametrize("d", drawn(), ids=lambda d: d.label)
def test_drawn_sequences(d, tmp_path):
    check(d, tmp_path)


def test_the_draws_cover_every_switch():
    cases = [*FIXED, *drawn()] if "RCDL_EDIT_DRAW" not in os.environ else list(FIXED)
    assert {d.kind for d in cases} == set(KINDS)
    assert {d.store for d in cases} == set(STORES)
    assert {d.budget for d in cases} == set(BUDGETS)
    assert {d.every for d in cases} == {1, 2}
    assert {op for d in cases for op, _ in d.edits} == set(OPS)
    assert all(1 <= len(d.edits) <= 5 for d in cases)


def test_a_draw_survives_json():
    for d in FIXED:
        assert dataclasses.replace(d, guards="") == Draw.from_json(d.to_json())
