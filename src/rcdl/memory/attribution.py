"""Which stored entries an output rests on (docs/attribution.md).

A growing layer's output is a sum over its entries, so each entry's share of it is exact:

- for the kernels that do not normalise (linear, RBF, Laplacian),
  ``s(q) = Σ_j w_j φ(q, k_j) v_j`` and entry ``j``'s share is ``w_j φ(q, k_j) v_j``, with
  ``w_j`` the weight the attention uses (:meth:`~rcdl.nn.layers.GrowingLayer.entry_weights`:
  the stored weight times the age coefficients of weight decay and momentum);
- for the weighted softmax, ``s(q) = Σ_j e^{z_j} ṽ_j / D`` with ``D = Σ_j w_j e^{z_j}``
  (guarded away from 0 as the attention guards it), and the share is ``e^{z_j} ṽ_j / D``.
  ``D`` is the whole store's (every rank's, if it is sharded), so the shares of a gauge
  shift of the logits are unchanged.

The shares sum to the layer's output (``tests/test_attribution.py`` checks it in float64
for every kernel). A half-precision store (bfloat16, float16) is multiplied here on float32
copies of its chunks, the ``"float32"`` product mode of :mod:`rcdl.ops.half`, whatever mode
the layer or the process sets: the shares then sum to the output those products give, to
float32's rounding. Native half products round each chunk's sum over its entries to the
store's dtype (``2⁻⁹`` relative for bfloat16), which no split into entries reproduces, so
:func:`explain` evaluates the model with float32 products too, and its output is theirs
(``tests/test_attribution_modes.py``, every product mode). A layer in top-k retrieval
mode answers over each query's retrieved rows only, which the shares over every entry do
not sum to: every function here refuses it (:func:`refuse_topk`, which
:mod:`rcdl.memory.leave_one_out` calls too).

:func:`entry_contributions` gives the shares projected on a direction per query,
``⟨u_b, share_j(q_b)⟩`` — with ``u`` the gradient of a chosen output with respect to
the layer's output, that is entry ``j``'s first-order contribution to that output through
this layer (exact for the model's last growing layer when the output is its logit).
:func:`explain` runs the backward that gives ``u`` for every growing layer of a model and
returns each layer's top entries, and each training sample's contributions summed over
its entries in every layer (the samples come from :mod:`rcdl.memory.provenance`).

Under sharding (:mod:`rcdl.distributed`) :func:`explain` returns on every rank what one
process over the whole store returns: each rank ranks its own entries, the ranks' top ``k``
candidates per layer are gathered and ranked again (the global top ``k`` is among them),
and each sample's totals are summed over the ranks before its top ``k`` are taken (one
sample's entries may lie on several ranks and layers).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.distributed import model_shard
from rcdl.memory.provenance import UNKNOWN, entry_samples
from rcdl.nn.backends import AttendingLayer, Backend, ShardCollectives, Wrapper, backend_wrapped
from rcdl.nn.layers import GrowingLayer, growing_layers
from rcdl.nn.networks import eval_mode
from rcdl.ops.attention import attend_partial, shares
from rcdl.ops.entries import Entries
from rcdl.ops.kernels import guard_denominator
from rcdl.ops.partials import without_each

__all__ = ["Explanation", "deletion_effects", "entry_contributions", "explain"]

# how attribution multiplies a half-precision store (rcdl.ops.half): on float32 copies of its
# chunks, whose sum over entries is the sum of the shares to float32's rounding
_PRODUCTS = "float32"
# why the shares over every entry are not a top-k layer's (refuse_topk)
_TOPK_SHARES = ("their output rests on each query's k retrieved rows (and, for the softmax, "
                "on those rows' own denominator), which the shares over every entry do not "
                "sum to")


def refuse_topk(where: str, layers: list[tuple[str, GrowingLayer]], why: str) -> None:
    """Refuse what holds for exact attention only: a ValueError naming those of ``layers``
    (``(module path, layer)`` pairs) that attend by top-k retrieval (``layer.retrieval``,
    :mod:`rcdl.retrieval.topk`), saying ``why`` the computation does not hold for them and
    how to proceed; nothing if none does. In evaluation and without gradients such a layer
    answers over each query's ``k`` retrieved rows, not over its whole store, so what is
    computed over the whole store (shares, deletion effects, leave-one-out corrections) is
    not about the output it gives."""
    topk = [name for name, layer in layers if layer.retrieval is not None]
    if topk:
        raise ValueError(
            f"{where}: growing layers {topk} answer by top-k retrieval (layer.retrieval): "
            f"{why}; switch them to exact attention for the call (rcdl.use_exact(model), "
            "then use_topk again; or per layer: mode = layer.retrieval, "
            "layer.retrieval = None, and layer.retrieval = mode after, which keeps its "
            "index)")


def _entries(layer: GrowingLayer) -> Entries:
    """The layer's rows as attribution multiplies them (``_PRODUCTS``)."""
    return layer.entries().replace(half_products=_PRODUCTS)


@dataclass(eq=False)
class _AttributedProducts(Wrapper):
    """A layer's attention with its store multiplied as attribution multiplies it
    (``_PRODUCTS``): :func:`explain`'s forward pass, whose output its shares sum to."""

    inner: Backend | None

    def attend(self, layer: AttendingLayer, q: Tensor, entries: Entries | None = None,
               stats: list | None = None) -> Tensor:  # (B, d_out)
        assert self.inner is not None
        entries = layer.entries() if entries is None else entries
        return self.inner.attend(layer, q, entries.replace(half_products=_PRODUCTS), stats)


def _check_layer_args(where: str, layer: GrowingLayer, x: Tensor, direction: Tensor) -> None:
    """Inputs ``(B, d_in)`` and a direction ``(B, d_out)`` for ``layer``, or a ValueError."""
    if x.dim() != 2 or x.shape[1] != layer.d_in:
        raise ValueError(f"{where}: expected inputs (B, {layer.d_in}), got {tuple(x.shape)}")
    if direction.shape != (x.shape[0], layer.d_out):
        raise ValueError(f"{where}: expected a direction ({x.shape[0]}, {layer.d_out}), got "
                         f"{tuple(direction.shape)}")


@torch.no_grad()
def entry_contributions(layer: GrowingLayer, x: Tensor, direction: Tensor, *,
                        chunk_size: int | None = None) -> Tensor:  # (B, N)
    """``⟨direction_b, share_j(x_b)⟩`` for every entry ``j`` this process stores in
    ``layer``, exactly (see the module docstring): the attention op's shares
    (:func:`rcdl.ops.attention.shares`). They sum to the layer's output to float32's rounding
    (float64's for a float64 layer); for a half-precision store, to its output with the store
    multiplied on float32 copies of its chunks (the ``"float32"`` product mode, what ``with
    rcdl.ops.half.half_products("float32")`` gives a layer without a mode of its own), which
    native products miss by their rounding of each chunk's sum (module docstring).

    Args:
        layer: a growing layer.
        x: the layer's inputs ``(B, d_in)`` (what its forward pass receives).
        direction: ``(B, d_out)``; the identity's rows give the shares themselves, one
            output coordinate at a time.
        chunk_size: entries per block (default: the layer's; the ``(B, chunk)`` blocks are
            the working memory).

    Raises:
        ValueError: for inputs or a direction of the wrong shape, or a layer in top-k
            retrieval mode (``layer.retrieval``: its output is not the sum over every entry).
    """
    _check_layer_args("entry_contributions", layer, x, direction)
    refuse_topk("entry_contributions", [(layer.name, layer)], _TOPK_SHARES)
    q = layer.query_keys(x.to(layer.store.dtype))  # (B, key_dim)
    entries = _entries(layer)
    if chunk_size is not None:
        entries = entries.replace(chunk_size=chunk_size)
    return shares(q, entries, direction, combiner=layer.shard)


@torch.no_grad()
def deletion_effects(layer: GrowingLayer, x: Tensor, direction: Tensor,
                     chunk: int = 4096) -> Tensor:  # (B, N)
    """The exact change of ``⟨direction_b, s(x_b)⟩`` when entry ``j`` alone is deleted from
    ``layer``, for every entry this process stores (the counterfactual a share
    approximates to first order):

    - kernels that do not normalise: ``−⟨u_b, w_j κ_j v_j⟩``, minus the share;
    - the weighted softmax, with ``U = ⟨u_b, Σ_i e^{z_i−m} ṽ_i⟩``, ``c_j = e^{z_j−m}
      ⟨u_b, ṽ_j⟩`` and ``g`` the guarded denominator over the weights and weight mass:
      ``(U − c_j) / g(D − w_j e^{z_j−m}, A − |w_j| e^{z_j−m}) − U / g(D, A)``. Deleting an
      entry also shrinks the normaliser, which the share ``c_j / g(D, A)`` leaves out.

    Arguments as :func:`entry_contributions` (``chunk``: entries per block), and the same
    products (:class:`rcdl.ops.partials.Products`; each entry taken out of the partial
    over the whole store by :func:`rcdl.ops.partials.without_each`). Tested against
    deleting each entry in float64.

    Raises:
        ValueError: as :func:`entry_contributions`; under top-k retrieval deleting a
            retrieved row would let the query's ``k+1``-th row in.
    """
    _check_layer_args("deletion_effects", layer, x, direction)
    refuse_topk("deletion_effects", [(layer.name, layer)],
                "deleting one of a query's k retrieved rows lets its (k+1)-th row in (and, "
                "for the softmax, changes the k rows' own denominator), which the effects "
                "over every entry do not follow")
    if not layer.kernel.normalised:
        return -entry_contributions(layer, x, direction)
    q = layer.query_keys(x.to(layer.store.dtype))  # (B, key_dim)
    entries = _entries(layer)
    part = attend_partial(q, entries, combiner=layer.shard)
    u = direction.to(q.dtype)
    whole = guard_denominator(part.den, part.mass, entries.eps)  # (B,)
    big_u = (u * part.num).sum(1, keepdim=True)  # (B, 1)
    products = entries.products(q)  # the products the partial was formed from
    out = []
    for a in range(0, len(entries), chunk):
        rows = entries.rows(slice(a, a + chunk))
        along = u @ rows.values.to(q.dtype).T  # (B, n) ⟨u_b, ṽ_j⟩
        after = without_each(part, big_u, products.dense(rows.keys), along, rows.weights,
                             entries.eps)  # (B, n) ⟨u_b, s_{−j}⟩
        out.append(after - big_u / whole[:, None])
    return torch.cat(out, 1) if out else q.new_zeros(len(q), 0)


@dataclass
class Explanation:
    """The top entries of each growing layer for each explained input.

    ``layers`` maps a layer's module path to ``(contributions (B, k), entry ids (B, k))``,
    largest contribution first; ``samples`` is ``(contributions (B, k), sample indices
    (B, k))``, each training sample's contributions summed over its entries in every layer
    (entries of unknown origin left out; :mod:`rcdl.memory.provenance`), largest first;
    ``target (B,)`` is the explained output coordinate and ``output (B,)`` its value."""

    target: Tensor
    output: Tensor
    layers: dict[str, tuple[Tensor, Tensor]]
    samples: tuple[Tensor, Tensor]


def explain(model: nn.Module, x: Tensor, target: Tensor | None = None, k: int = 10
            ) -> Explanation:
    """For each input, each growing layer's ``k`` entries with the largest first-order
    contribution to output ``target`` (default: the predicted class), from one backward
    pass: the contribution of entry ``j`` of layer ``l`` is ``⟨∂f/∂s_l, share_j^l⟩``
    (:func:`entry_contributions`), summed over the rows an input puts through the layer
    when it puts several (a ViT's tokens, ``(B, S, d)``). For the model's last growing
    layer, when the model's output is that layer's output, this is the entry's exact
    share of ``f``; for earlier layers it is first order in the share. The model is
    evaluated in eval mode (nothing is recorded or written) and restored to its mode
    after, with half-precision stores multiplied on float32 copies of their chunks (the
    ``"float32"`` product mode, whatever the mode set): ``output`` is that forward pass's,
    the one the shares sum to (native half products would round each chunk's sum; the
    module docstring). Refused for a model with a layer in top-k retrieval mode.

    Sharded over ranks (:func:`rcdl.distributed.shard`), call it on every rank with the
    same ``x``: every rank returns the explanation one process over the whole store gives
    (see the module docstring). Beside the forward and backward passes' own, the
    collectives are, per layer, an ``all_reduce`` of its size, the softmax's merged
    partial and two ``all_gather`` of ``(B, k)`` candidates; for the samples, an
    ``all_reduce`` of a count, an ``all_gather`` of each rank's sample indices and an
    ``all_reduce`` of the ``(B, S)`` totals over the ``S`` samples of all ranks.
    Unsharded, nothing is communicated."""
    layers = growing_layers(model)
    if not layers:
        raise ValueError(f"explain: {type(model).__name__} has no growing layers")
    shard = model_shard(model, "explain")  # None: one process holds every entry
    refuse_topk("explain", layers, _TOPK_SHARES)
    inputs: dict[str, Tensor] = {}
    outputs: dict[str, Tensor] = {}
    calls: dict[str, int] = {}

    def keep_input(name: str):  # noqa: ANN202 - a forward pre-hook
        def hook(module: nn.Module, args: tuple) -> None:
            calls[name] = calls.get(name, 0) + 1
            inputs[name] = args[0].detach()
        return hook

    def keep_output(name: str):  # noqa: ANN202 - a forward hook
        def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
            outputs[name] = out
            # what the model does next gets a copy: an in-place op after the layer (an
            # activation with inplace=True) must not move the node whose gradient we take
            return out.clone()
        return hook

    handles = [h for name, layer in layers for h in (
        layer.register_forward_pre_hook(keep_input(name)),
        layer.register_forward_hook(keep_output(name)))]
    try:
        with torch.enable_grad(), eval_mode(model), ExitStack() as products:
            for _, layer in layers:  # the products the shares are formed from
                products.enter_context(backend_wrapped(layer, _AttributedProducts))
            x = x.detach().requires_grad_()  # the layers' outputs then carry a graph
            logits = model(x)  # (B, C)
            chosen = logits.argmax(dim=1) if target is None else target.to(logits.device)
            f = logits.gather(1, chosen[:, None]).squeeze(1)  # (B,)
    finally:
        for handle in handles:
            handle.remove()
    twice = {name: n for name, n in calls.items() if n > 1}
    if twice:
        raise ValueError(
            "explain: " + ", ".join(f"growing layer {name!r} was called {n} times"
                                    for name, n in twice.items())
            + " in one forward pass (weight tying?); an entry's contribution is defined "
            "for one call of its layer, so explain needs each growing layer called once")
    called = [name for name, _ in layers if name in outputs and outputs[name].requires_grad]
    # torch.autograd.grad: the gradients of f at the layers' outputs only; no .grad is
    # left on any parameter (a training step after explain must not see one)
    grads = dict(zip(called, torch.autograd.grad(
        f.sum(), [outputs[name] for name in called], allow_unused=True), strict=True)
        ) if called else {}
    found = {}
    batch = x.shape[0]
    per_sample: list[tuple[Tensor, Tensor]] = []  # (contributions (B, n), samples (n,))
    for name, layer in layers:
        grad = grads.get(name)
        if grad is None:  # the same on every rank: the backward is replicated
            continue
        total = layer.num_entries_all_ranks()  # every rank's (a collective when sharded)
        if total == 0:
            continue
        q = inputs[name].reshape(-1, layer.d_in)  # (B·S, d_in): S rows per input
        contrib = entry_contributions(layer, q, grad.reshape(-1, layer.d_out))  # (B·S, N)
        if len(q) != batch:  # tokens (a ViT): an entry's contribution to an input's output
            # is the sum over the rows that input put through the layer
            if len(q) % batch:
                raise ValueError(f"explain: growing layer {name!r} saw {len(q)} rows for "
                                 f"{batch} inputs; expected a whole number of rows per input")
            contrib = contrib.view(batch, len(q) // batch, -1).sum(1)  # (B, N)
        found[name] = _top_entries(contrib, layer.store.ids, min(k, total), shard)
        owners = entry_samples(layer).to(contrib.device)  # (N,)
        known = owners != UNKNOWN
        per_sample.append((contrib[:, known], owners[known]))
    samples = _top_samples(per_sample, x.shape[0], k, shard)
    return Explanation(chosen, f.detach(), found, samples)


def _top_entries(contrib: Tensor, ids: Tensor, k: int, shard: ShardCollectives | None
                 ) -> tuple[Tensor, Tensor]:  # (B, k) each
    """The ``k`` largest of ``contrib (B, N)`` per row and their entry ids ``ids (N,)``;
    ``k`` is at most the entries of every rank. When sharded: each rank's top ``k``, padded
    to ``k`` with ``−inf`` and id ``-1``, gathered, and the top ``k`` of the ``W · k``
    candidates (at least ``k`` of them real)."""
    top = contrib.topk(min(k, contrib.shape[1]), dim=1)
    if shard is None:
        return top.values, ids[top.indices]
    pad = k - top.values.shape[1]  # a shard with fewer than k entries
    values = shard.all_gather(F.pad(top.values, (0, pad), value=float("-inf")))  # (W, B, k)
    chosen = shard.all_gather(F.pad(ids[top.indices], (0, pad), value=-1))  # (W, B, k)
    batch = contrib.shape[0]
    values = values.transpose(0, 1).reshape(batch, -1)  # (B, W·k)
    chosen = chosen.transpose(0, 1).reshape(batch, -1)  # (B, W·k)
    best = values.topk(k, dim=1)  # never the padding: at least k candidates are real
    return best.values, chosen.gather(1, best.indices)


def _top_samples(parts: list[tuple[Tensor, Tensor]], batch: int, k: int,
                 shard: ShardCollectives | None) -> tuple[Tensor, Tensor]:  # (B, k) each
    """Each sample's contributions summed over its entries in every layer (and, when
    sharded, over every rank), top ``k``."""
    empty = torch.zeros(batch, 0)
    if not parts:  # the same on every rank
        return empty, empty.long()
    owners = torch.cat([o for _, o in parts])  # (M,)
    contrib = torch.cat([c for c, _ in parts], dim=1)  # (B, M)
    unique, slot = owners.unique(return_inverse=True)  # (S,), (M,)
    totals = contrib.new_zeros(batch, unique.numel()).index_add_(1, slot, contrib)  # (B, S)
    if shard is not None:
        unique, totals = _sum_over_ranks(unique, totals, shard)  # every rank joins
    if unique.numel() == 0:  # no entry of known origin (on any rank)
        return empty, empty.long()
    top = totals.topk(min(k, unique.numel()), dim=1)
    return top.values, unique[top.indices]


def _sum_over_ranks(unique: Tensor, totals: Tensor, shard: ShardCollectives
                    ) -> tuple[Tensor, Tensor]:  # (U,), (B, U)
    """Each rank's per-sample totals ``(B, S_r)`` over its samples ``unique (S_r,)``, summed
    over the ranks on the union ``(U,)`` of every rank's samples (sorted)."""
    count = torch.tensor([unique.numel()], device=unique.device)
    longest = int(shard.all_reduce(count, dist.ReduceOp.MAX)[0])
    if longest == 0:  # no rank holds an entry of known origin
        return unique, totals
    everyone = shard.all_gather(F.pad(unique, (0, longest - unique.numel()), value=UNKNOWN))
    union = everyone[everyone != UNKNOWN].unique()  # (U,) sorted, the same on every rank
    summed = totals.new_zeros(totals.shape[0], union.numel())  # (B, U)
    summed.index_copy_(1, torch.searchsorted(union, unique), totals)
    return union, shard.all_reduce(summed)
