"""Fast forgetting: remove a sample's entries, then re-write the readout's later entries
under the model without them (docs/fast_forgetting.md).

:func:`rcdl.memory.forgetting.forget` removes what the forgotten samples wrote, but every
entry written *after* one of them was fitted to a model that still held it: it corrects an
output that, without the forgotten entries, is no longer the output it corrects. Left as
they are, those entries over-forget (the forgotten images end up below unseen ones) and
cost accuracy. :func:`forget_and_repair` re-writes them where it is cheap: in the readout,
the growing layer whose output is the model's output.

The maths. The readout's entry ``j`` was written at step ``t_j`` from its query ``q_j``
(its key: the rules write ``k_j = q_j``), the readout's output on it before the step,
``s_j = A(q_j; entries of the steps before t_j)``, and the gradient of the batch-mean loss
``ḡ_j = ∂ℓ(s_j, y_j)/∂s_j / n``: ``(ṽ_j, w_j) = rule(q_j, s_j, ḡ_j)``. The keys do not
depend on any value, so with them fixed the readout's entries can be re-written in write
order, from the first step a forgotten sample wrote at: ``s_j`` recomputed over the entries
that remain (those before it already re-written), then the rule applied again with the
label ``y_j``. Where nothing was forgotten this writes what training wrote (a test checks
it in float64). It is training the readout alone again on the keys it stored, the images'
features as the layers below gave them at the time: those layers' own entries, and so the
features, stay as training left them (minus the forgotten samples' entries). That is the
approximation, and why the result is close to retraining but not equal to it
(docs/unlearning.md gives the measured gaps; :func:`rcdl.train.unlearning.forget_exactly`
is the exact mode).

The cost. The kernel values between the re-written queries and the keys before them do
not change as values are re-written, so they are formed ``block`` queries at a time: one
pass of the attention op (:func:`rcdl.ops.attention.attend_partial`) over the rows before
the block, and one matrix product among the block's own rows, whose values are then folded
in step by step (``(rows, block)`` products with ``d_out``-wide values; the partials are
formed, folded and merged by :mod:`rcdl.ops.partials`). Every product runs as the layer's
forward runs it (:class:`rcdl.ops.partials.Products`): a half-precision readout multiplies
the queries rounded to its dtype and rounds each block before it multiplies the values
where training did, so it is re-written with the products training used. A readout of
``N`` entries of width ``d`` costs about ``N² d`` multiply-adds, where training did that
much per layer and three times over (forward, backward, the look-ahead).

Given the training inputs, the readout's keys are recomputed first: each retained
sample's features as the layers below, without the forgotten entries, would have given them
when it was written (every layer attending only to the entries of the steps before its
own, the layers' other entries as training left them; ordinary parameters, such as a
trained ``nn.Linear`` in front, as they are now). The keys a readout stored were its
queries under layers that still held the forgotten samples; after :func:`forget` the layers
below answer differently, so the stored keys no longer match the features a test image
gets. This costs a no-gradient pass of the layers below over the re-written samples, each
``block`` of them one pass of the attention op per layer over the rows before the block.

``steps`` bounds the work: only the first ``steps`` steps from the earliest forgotten
sample's are re-written (nearest first, in time); the later entries stay as written.

What the re-write refuses. It replays the readout's history from the rows it holds, so it
needs every row that a re-written entry's output saw in training, other than the forgotten
ones. A memory budget (:mod:`rcdl.memory.budgets`) that evicted rows breaks this: every
entry written while an evicted row was held was fitted to an output that included it, and
its value is gone, so the re-write would change even what nothing forgotten touched
(docs/fast_forgetting.md). The readout is then refused, as one whose budget
merged rows is, and so are the layers below it when the keys are recomputed. An evicted
row is told apart from a forgotten one by the layer's provenance map: both leave an id
below the store's ``next_id`` that it no longer holds, but
:func:`~rcdl.memory.forgetting.forget` erases the forgotten samples from the map, and an
eviction leaves the map naming the sample. (Rows an undone step removed,
:meth:`~rcdl.nn.layers.GrowingLayer.drop_last_step`, look the same and are refused the
same way.)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.distributed import model_shard
from rcdl.memory.forgetting import ForgetReceipt, forget, sample_index_tensor
from rcdl.memory.provenance import UNKNOWN, entry_samples, merged_counts
from rcdl.nn.backends import AttendingLayer, Backend, backend_wrapped
from rcdl.nn.layers import GrowingLayer, growing_layers
from rcdl.nn.records import Record
from rcdl.ops.attention import attend_partial
from rcdl.ops.entries import Entries
from rcdl.ops.partials import Partial, finalize, fold

__all__ = ["forget_and_repair", "readout_of", "recompute_readout_keys", "repair_refusal",
           "rewrite_readout"]

Loss = Callable[[Tensor, Tensor], Tensor]


def readout_of(model: nn.Module, name: str = "readout") -> GrowingLayer:
    """The growing layer ``name`` (a module path) of ``model`` whose output is the model's
    output: the readout of rcdl's networks (:class:`rcdl.nn.networks.ResidualNet`)."""
    try:
        layer = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{type(model).__name__} has no module {name!r}: name the growing "
                         "layer whose output is the model's output (readout=...)") from None
    if not isinstance(layer, GrowingLayer):
        raise TypeError(f"{type(model).__name__}.{name} is a {type(layer).__name__}, not a "
                        "growing layer: there are no entries to re-write")
    return layer


def _problems(layer: GrowingLayer) -> list[str]:
    """What keeps the re-write of ``layer`` from being faithful, in words (none: it can)."""
    problems = []
    if layer.trains_entries:
        problems.append("its entries are trained by an optimizer (the hybrid): a write is "
                        "not a function of the step alone")
    if layer.rule.ages is not None and not layer.rule.ages.trivial:
        problems.append("its rule has weight decay or momentum (entries age)")
    if layer.store.d_in != layer.d_in:
        problems.append("its keys are not its queries (the linear dual form's bias column)")
    if layer.retrieval is not None:
        problems.append("it attends by top-k retrieval")
    if layer.recorder.has_pending:
        problems.append("a batch is recorded and not stepped")
    if bool((merged_counts(layer) > 0).any()):
        problems.append("a memory budget merged entries (an entry of several samples)")
    evicted = _evicted(layer)
    if evicted:
        problems.append(_evicted_problem(evicted, "the re-write would not give back what "
                                         "training wrote"))
    return problems


def _evicted(layer: GrowingLayer) -> int:
    """How many entries ``layer`` removed without forgetting their samples (a memory
    budget's evictions): ids below the store's ``next_id`` that it no longer holds and whose
    sample its provenance map still names (:func:`~rcdl.memory.forgetting.forget` erases the
    samples it removes). A store sharded over ranks holds only its own rows: 0."""
    store = layer.store
    if layer.shard is not None or len(store) == store.next_id:
        return 0
    gone = torch.ones(store.next_id, dtype=torch.bool, device=store.device)  # (next_id,)
    gone[store.ids] = False
    missing = gone.nonzero().squeeze(1)  # (M,) ids handed out and not held
    return int((layer.provenance.of(missing) != UNKNOWN).sum())


def _evicted_problem(count: int, harm: str) -> str:
    """Why ``count`` evicted entries are refused (``harm``: what would go wrong), and what to
    do instead."""
    return (f"{count} of its entries were evicted by a memory budget (or removed by an undone "
            "step) without being forgotten, and what was written while they were held was "
            f"fitted to outputs that included them: without them {harm}. "
            "Forget without the re-write (rcdl.forget), or exactly "
            "(rcdl.train.unlearning.forget_exactly with a ReplayLog), or retrain")


def _check_keys_recomputable(model: nn.Module, layer: GrowingLayer) -> None:
    """Refuse to recompute the readout ``layer``'s keys through layers that evicted rows."""
    for _, other in growing_layers(model):
        count = 0 if other is layer else _evicted(other)
        if count:
            raise ValueError(f"forget_and_repair: cannot recompute {layer.where}'s keys "
                             f"through {other.where}: " + _evicted_problem(
                                 count, "the keys would not be the features training stored"))


def _refusal(layer: GrowingLayer) -> str | None:
    """Why the re-write of ``layer`` would be refused, in words (``None``: it would not)."""
    problems = _problems(layer)
    return f"cannot re-write {layer.where}: " + "; ".join(problems) if problems else None


def repair_refusal(model: nn.Module, readout: str = "readout") -> str | None:
    """Why :func:`forget_and_repair` would refuse ``model`` (``None``: it would not)."""
    try:
        return _refusal(readout_of(model, readout))
    except (ValueError, TypeError) as error:
        return str(error)


def _check_repairable(layer: GrowingLayer) -> None:
    """Refuse what the re-write cannot do faithfully, naming it."""
    refusal = _refusal(layer)
    if refusal is not None:
        raise ValueError(f"forget_and_repair: {refusal}")


def _blocks(steps: Tensor, block: int) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` of about ``block`` rows over rows grouped by ``steps (R,)``
    (sorted), never splitting a step."""
    bounds = torch.cat([(steps[1:] != steps[:-1]).nonzero().squeeze(1) + 1,
                        torch.tensor([len(steps)])]).tolist()
    out, start = [], 0
    for end in bounds:
        if end - start >= block:
            out.append((start, end))
            start = end
    if start < len(steps):
        out.append((start, len(steps)))
    return out


def _span(layer: GrowingLayer, from_step: int, steps: int | None) -> tuple[int, int, int]:
    """The rows ``[r0, r1)`` of ``layer`` written at ``from_step`` or later, in the first
    ``steps`` such steps (``None``: all), and how many steps they are."""
    written = layer.store.written_at  # (N,)
    if len(written) > 1 and not bool((written[1:] >= written[:-1]).all()):
        raise ValueError(f"forget_and_repair: {layer.where}'s rows are not in write order")
    r0 = int(torch.searchsorted(written, torch.tensor(from_step, device=written.device)))
    todo = written[r0:].unique()
    if steps is not None:
        todo = todo[: max(steps, 0)]
    if todo.numel() == 0:
        return r0, r0, 0
    return r0, int(torch.searchsorted(written, todo[-1], right=True)), int(todo.numel())


def _owners(layer: GrowingLayer, r0: int, r1: int, known: int, what: str) -> Tensor:  # (R,)
    """The samples that wrote rows ``[r0, r1)``, checked to be known and below ``known``
    (the samples ``what`` is given for)."""
    owners = entry_samples(layer)[r0:r1]
    if bool((owners == UNKNOWN).any()):
        raise ValueError(f"forget_and_repair: {layer.where} has entries whose sample is "
                         f"unknown among those to re-write: their {what} cannot be found")
    if owners.numel() and int(owners.max()) >= known:
        raise ValueError(f"forget_and_repair: an entry of sample {int(owners.max())}, but "
                         f"{what} for {known} samples")
    return owners


@torch.no_grad()
def rewrite_readout(layer: GrowingLayer, labels: Tensor, *, from_step: int,
                    steps: int | None = None, loss_fn: Loss = F.cross_entropy,
                    batch_sizes: dict[int, int] | None = None,
                    block: int = 512) -> tuple[int, int]:  # fmt: skip
    """Re-write, in write order, the entries of ``layer`` written at step ``from_step`` or
    later (the first ``steps`` of those steps; ``None``: all), each from the layer's output
    over the entries before its step (module docstring); returns ``(entries, steps)``
    re-written.

    Args:
        labels: ``(n_train,)`` the training labels, indexed by the sample that wrote an entry.
        loss_fn: the batch-mean loss of training, ``loss_fn(outputs, labels)``.
        batch_sizes: per step, the samples its loss averaged over in training (default: the
            entries the step still has); the rule's batch-mean units use it.
        block: queries whose kernel values are formed at once.
    """
    _check_repairable(layer)
    store = layer.store
    r0, r1, done = _span(layer, from_step, steps)
    if done == 0:
        return 0, 0
    owners = _owners(layer, r0, r1, len(labels), "labels")
    entries = layer.entries()
    dtype, kernel = store.dtype, layer.kernel
    keys = entries.keys  # (N, d) in the storage dtype
    values = entries.values[:r1].clone()  # (r1, d_out) the re-written ones replace these
    weights = entries.weights[:r1].clone()  # (r1,)
    labels = labels.to(store.device)
    row_steps = store.written_at[r0:r1]
    for a, b in _blocks(row_steps.cpu(), block):
        a, b = r0 + a, r0 + b
        q = keys[a:b].to(dtype)  # (Q, d) the block's queries: their keys
        before = attend_partial(q, entries.replace(keys=keys[:a], values=values[:a],
                                                   weights=weights[:a]))
        among_products = entries.rows(slice(a, b)).products(q)  # as training multiplied them
        among = among_products.kernel_values(among_products.read_keys(keys[a:b])).T  # (Q, Q)
        block_steps = row_steps[a - r0 : b - r0]
        for lo, hi in _blocks(block_steps.cpu(), 1):  # one step at a time
            rows = slice(a + lo, a + hi)
            part = Partial(*(t[lo:hi] for t in before))
            if lo > 0:  # the block's earlier steps, already re-written
                part = fold(part, among[lo:hi, :lo], values[a : a + lo],
                            weights[a : a + lo], kernel, products=among_products)
            s = finalize(part, kernel=kernel, eps=entries.eps)  # (rows, d_out)
            n = (batch_sizes or {}).get(int(block_steps[lo]), hi - lo)
            new_keys, new_values, new_weights = layer.make_entries(_record(
                q[lo:hi], s, labels[owners[rows.start - r0 : rows.stop - r0]], loss_fn, n,
                part, kernel.normalised))
            if not torch.equal(new_keys, q[lo:hi]):
                raise ValueError(f"forget_and_repair: {layer.where}'s rule writes keys other "
                                 "than its queries; the re-write assumes k = q")
            values[rows] = new_values.to(values.dtype)
            weights[rows] = new_weights
    layer.rewrite_rows(slice(r0, r1), values=values[r0:r1].to(dtype), weights=weights[r0:r1])
    return r1 - r0, done


class _Stop(Exception):  # noqa: N818 - not an error: the readout's query is all we want
    """Raised by the readout's pre-hook to end a forward pass once its query is known."""

    def __init__(self, q: Tensor) -> None:
        super().__init__()
        self.q = q


@dataclass
class _QuerySteps:
    """The write step of each query row of the current pass (shared by the layers)."""

    steps: Tensor | None = None  # (Q,) int64


@dataclass(eq=False)
class _Causal:
    """A backend under which each query row attends only to the rows written before its
    step (:attr:`_QuerySteps.steps`), no autograd: the layer as it was when that row's sample
    was written, less the rows removed since."""

    rows: _QuerySteps
    inner: Backend | None

    def attend(self, layer: AttendingLayer, q: Tensor, entries: Entries | None = None,
               stats: list | None = None) -> Tensor:  # (Q, d_out)
        steps = self.rows.steps
        assert steps is not None
        if torch.is_grad_enabled() or q.shape[0] != steps.shape[0]:
            raise RuntimeError(f"forget_and_repair: a {type(layer).__name__} was called with "
                               f"{q.shape[0]} query rows for {steps.shape[0]} samples (or "
                               "with autograd on): the recomputed keys need one row per sample")
        e = layer.entries() if entries is None else entries
        written = layer.store.written_at
        n0 = int(torch.searchsorted(written, steps.min()))  # rows every query sees
        n1 = int(torch.searchsorted(written, steps.max()))  # rows some query sees
        part = attend_partial(q, e.rows(slice(0, n0)))
        if n1 > n0:
            rows = e.rows(slice(n0, n1))
            products = rows.products(q)  # as the forward multiplies them
            phi = products.kernel_values(products.read_keys(rows.keys)).T  # (Q, c)
            seen = written[n0:n1][None, :] < steps[:, None]  # (Q, c)
            part = fold(part, phi, rows.values, rows.weights, e.kernel, seen, products)
        return finalize(part, kernel=layer.kernel, eps=e.eps)

    def partial(self, layer: AttendingLayer, q: Tensor, entries: Entries) -> Partial:
        raise NotImplementedError("the recomputing pass asks layers for outputs only")

    def nearest_sq_distance(self, layer: AttendingLayer, q: Tensor) -> Tensor:
        raise NotImplementedError("the recomputing pass asks layers for outputs only")

    def size(self, layer: AttendingLayer) -> int:
        return len(layer.store)


@torch.no_grad()
def recompute_readout_keys(model: nn.Module, layer: GrowingLayer, inputs: Tensor, *,
                           from_step: int, steps: int | None = None,
                           block: int = 512) -> int:  # fmt: skip
    """Replace the keys of the readout ``layer``'s entries written at step ``from_step`` or
    later (the first ``steps`` of those steps; ``None``: all) by each sample's features as
    ``model``'s layers would give them at its write step: every growing layer attending only
    to its rows written before that step (module docstring). ``inputs (n_train, ...)`` are
    the training inputs, indexed by sample. Returns the keys replaced."""
    _check_keys_recomputable(model, layer)
    r0, r1, done = _span(layer, from_step, steps)
    if done == 0:
        return 0
    owners = _owners(layer, r0, r1, len(inputs), "inputs")
    device = layer.store.device
    row_steps = layer.store.written_at[r0:r1]
    keys = torch.empty(r1 - r0, layer.store.d_in, dtype=layer.store.dtype, device=device)
    current = _QuerySteps()

    def stop(module: nn.Module, args: tuple) -> None:
        raise _Stop(args[0])

    was_training = model.training
    with ExitStack() as stack:
        for _, other in growing_layers(model):
            if other is not layer:
                stack.enter_context(backend_wrapped(other, lambda b: _Causal(current, b)))
        stack.callback(layer.register_forward_pre_hook(stop).remove)
        stack.callback(model.train, was_training)
        model.eval()
        for a, b in _blocks(row_steps.cpu(), block):
            current.steps = row_steps[a:b]
            try:
                model(inputs[owners[a:b].cpu()].to(device))
            except _Stop as found:
                q = found.q.reshape(b - a, -1)
            else:
                raise RuntimeError(f"forget_and_repair: {type(model).__name__}'s forward "
                                   f"never called {layer.where}")
            keys[a:b] = layer.query_keys(q).to(keys.dtype)
    layer.rewrite_rows(slice(r0, r1), keys=keys)
    return r1 - r0


def _record(q: Tensor, s: Tensor, y: Tensor, loss_fn: Loss, n_samples: int, part: Partial,
            normalised: bool) -> Record:
    """What the layer's rule would have seen of a training step with outputs ``s``:
    ``∂(mean loss)/∂s``, in units of a batch of ``n_samples``."""
    with torch.enable_grad():
        s_leaf = s.detach().requires_grad_()
        (grad,) = torch.autograd.grad(loss_fn(s_leaf, y), s_leaf)
    grad = grad * (s.shape[0] / n_samples)
    normaliser = (part.m, part.den) if normalised else None
    return Record(q, s, n_samples, 0, grad=grad, normaliser=normaliser)


def forget_and_repair(model: nn.Module, sample_indices: Tensor | Sequence[int], *,
                      labels: Tensor, loss_fn: Loss = F.cross_entropy,
                      inputs: Tensor | None = None, readout: str = "readout",
                      steps: int | None = None, block: int = 512,
                      learners: Iterable[Any] = (), scan: bool = True) -> ForgetReceipt:
    """Forget the training samples ``sample_indices`` (:func:`rcdl.memory.forgetting.forget`,
    in every growing layer), then re-write the readout's entries written from the earliest
    forgotten sample's step on (module docstring); returns the
    :class:`~rcdl.memory.forgetting.ForgetReceipt`, whose ``released`` says, for the
    readout, what was re-written, and whose ``seconds`` count both parts.

    Args:
        labels: ``(n_train,)`` the training labels, indexed as the entries' samples are.
        loss_fn: the batch-mean loss the model was trained with.
        inputs: ``(n_train, ...)`` the training inputs, indexed as the entries' samples are:
            given, the readout's keys are recomputed first (:func:`recompute_readout_keys`);
            ``None``: the stored keys stay.
        readout: the module path of the growing layer whose output is the model's output.
        steps: re-write only this many steps from the first one a forgotten sample wrote
            at (``None``: every later step): the time budget.
        block: queries whose kernel values are formed at once.
        learners: as for :func:`~rcdl.memory.forgetting.forget`.
        scan: as for :func:`~rcdl.memory.forgetting.forget`.

    One process (a sharded model is refused); the readout must store its queries as keys,
    step only by its rule (not the hybrid's Adam) and have no ageing rule, top-k
    retrieval, merged entries or entries a memory budget evicted (nor, with ``inputs``,
    may the layers below have evicted any): each is refused before anything changes,
    naming the layer (module docstring, "What the re-write refuses").
    """
    start = time.perf_counter()
    wanted = sample_index_tensor(sample_indices, "forget_and_repair")
    if model_shard(model, "forget_and_repair") is not None:
        raise ValueError("forget_and_repair: the model's stores are sharded over ranks; the "
                         "re-write runs in one process")
    layer = readout_of(model, readout)
    _check_repairable(layer)
    if inputs is not None:
        _check_keys_recomputable(model, layer)
    owners = entry_samples(layer)
    written = layer.store.written_at
    hit = torch.isin(owners, wanted.to(owners.device)) & (owners != UNKNOWN)
    steps_, counts = written[owners != UNKNOWN].unique(return_counts=True)
    batch_sizes = dict(zip(steps_.tolist(), counts.tolist(), strict=True))
    first = int(written[hit].min()) if bool(hit.any()) else None
    if first is not None:  # checked before anything is removed
        r0, r1, _ = _span(layer, first, steps)
        _owners(layer, r0, r1, len(labels), "labels")
        if inputs is not None:
            _owners(layer, r0, r1, len(inputs), "inputs")
    receipt = forget(model, wanted, learners=learners, scan=scan)
    if first is None:
        return receipt
    notes = []
    if inputs is not None:
        count = recompute_readout_keys(model, layer, inputs, from_step=first, steps=steps,
                                       block=block)
        notes.append(f"recomputed {count} keys from step {first}")
    entries, done = rewrite_readout(layer, labels, from_step=first, steps=steps,
                                    loss_fn=loss_fn, batch_sizes=batch_sizes, block=block)
    released = dict(receipt.released)
    released[readout] = [*released.get(readout, []), *notes,
                      f"re-wrote {entries} entries of {done} steps from step {first}"]
    return dataclasses.replace(receipt, released=released,
                               seconds=time.perf_counter() - start)
