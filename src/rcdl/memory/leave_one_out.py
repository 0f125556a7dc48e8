"""Leave-one-out predictions of a growing model, exactly, in one forward pass
(docs/attribution.md, "Leave-one-out predictions").

Deleting a training sample's entries changes a growing model's output on an input only
through those entries' terms: no other stored number moves. So the model with sample
``i``'s entries deleted, asked about input ``x_b``, is the model itself with, in every
growing layer, the terms of ``i``'s entries taken out of that layer's attention at
``x_b``'s query. With ``E_b`` the entries of the sample row ``b`` leaves out and the
layer's partial sums over the whole store at the query ``q_b`` (:class:`rcdl.ops.entries.Partial`:
numerator, denominator, weight mass and shift ``m``):

- kernels that do not normalise: ``s_{−E}(q) = s(q) − Σ_{j∈E} w_j κ(q, k_j) v_j``;
- the weighted softmax: ``s_{−E}(q) = (N − Σ_{j∈E} e^{z_j−m} ṽ_j) / g(D − Σ_{j∈E} w_j e^{z_j−m},
  A − Σ_{j∈E} |w_j| e^{z_j−m})``, with ``g`` the attention's guard of the denominator
  (:func:`rcdl.ops.kernels.guard_denominator`) and ``A`` the weight mass it scales by.

The terms are taken out of the partial sums by :func:`rcdl.ops.partials.take_out`, each
formed from the products the layer's forward multiplies (:class:`rcdl.ops.partials.Products`:
a half-precision store's queries and kernel factors rounded where the forward rounds them).
The corrected output of each layer is what the next layer sees, so the result is the
deleted model's output exactly (a float64 test compares it with
:func:`rcdl.memory.forgetting.forget` on a copy, sample by sample), for the price of one
forward pass and, per layer, one kernel value per left-out entry.

Exact attention only: a layer in top-k retrieval mode answers over each query's ``k``
retrieved rows, and deleting one of them lets the query's ``k+1``-th row in, which these
corrections over the whole store do not follow; such a model is refused
(:func:`rcdl.memory.attribution.refuse_topk`).

Typical use: each training image with its own entries left out, ``leave_one_out(model,
x_train, torch.arange(n))``, gives every image's prediction by a model that never stored
it — a label check (docs/attribution.md: flipped labels rank by the leave-one-out margin).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rcdl.distributed import model_shard
from rcdl.memory.attribution import refuse_topk
from rcdl.memory.provenance import UNKNOWN, entry_samples
from rcdl.nn.layers import GrowingLayer, growing_layers
from rcdl.nn.networks import eval_mode
from rcdl.ops.attention import attend_partial
from rcdl.ops.entries import Entries
from rcdl.ops.partials import Partial, finalize, take_out

__all__ = ["leave_one_out", "left_out_attention"]

# why the corrections do not hold for a top-k layer (rcdl.memory.attribution.refuse_topk)
_TOPK_DELETION = ("deleting one of a query's k retrieved rows lets its (k+1)-th row in (and, "
                  "for the softmax, changes the k rows' own denominator), which the "
                  "corrections over the whole store do not follow")


@torch.no_grad()
def left_out_attention(layer: GrowingLayer, q: Tensor, leave: Tensor,
                       ) -> tuple[Tensor, Tensor]:  # (B, d_out) each
    """The layer's attention at the inputs ``q (B, d_in)`` over its whole store, and over
    the store without the entries written by sample ``leave[b] (B,)`` for row ``b``
    (``UNKNOWN``: none left out). Returns ``(whole, left_out)``; the layer's output with
    those entries deleted is its output plus ``left_out − whole`` (module docstring). Refused
    for a layer in top-k retrieval mode (a ValueError)."""
    if leave.shape != (q.shape[0],):
        raise ValueError(f"left_out_attention: expected one sample per row, ({q.shape[0]},), "
                         f"got {tuple(leave.shape)}")
    refuse_topk("left_out_attention", [(layer.name, layer)], _TOPK_DELETION)
    entries: Entries = layer.entries()
    qk = layer.query_keys(q)  # (B, key_dim)
    part: Partial = attend_partial(qk, entries)
    owners = entry_samples(layer).to(leave.device)  # (N,)
    rows, cols = (owners[None, :] == leave[:, None]).nonzero(as_tuple=True)  # pairs (P,)
    keep = leave[rows] != UNKNOWN
    rows, cols = rows[keep].to(q.device), cols[keep].to(q.device)
    # per pair (b, j): κ(q_b, k_j), or the logit z for the softmax, from the products the
    # forward multiplies (the kernel's dense twin mapped over the pairs, one value each)
    products = entries.products(qk)
    kappa = products.pairs(rows, entries.keys[cols])  # (P,)
    left = take_out(part, rows, kappa, entries.values[cols], entries.weights[cols],
                    entries.kernel, products)
    return (finalize(part, kernel=entries.kernel, eps=entries.eps),
            finalize(left, kernel=entries.kernel, eps=entries.eps))


@torch.no_grad()
def leave_one_out(model: nn.Module, x: Tensor, leave: Tensor) -> Tensor:
    """The model's output on ``x (B, d_in)`` with, for row ``b``, every entry that training
    sample ``leave[b]`` wrote deleted from every growing layer (``UNKNOWN`` for a row that
    leaves nothing out), exactly, in one forward pass in eval mode (module docstring).

    Raises:
        ValueError: for a sharded model, a growing layer in top-k retrieval mode (named,
            with how to switch it to exact attention for the call), a growing layer that
            sees several rows per input (tokens), or ``leave`` not one sample per row.
    """
    if model_shard(model, "leave_one_out") is not None:
        raise ValueError("leave_one_out: the model's stores are sharded; gather them into "
                         "one process first (rcdl.distributed)")
    if leave.shape != (x.shape[0],):
        raise ValueError(f"leave_one_out: expected one sample per input, ({x.shape[0]},), "
                         f"got {tuple(leave.shape)}")
    layers = growing_layers(model)
    if not layers:
        raise ValueError(f"leave_one_out: {type(model).__name__} has no growing layers")
    refuse_topk("leave_one_out", layers, _TOPK_DELETION)
    leave = leave.long()

    def correct(name: str):  # noqa: ANN202 - a forward hook
        def hook(layer: nn.Module, args: tuple, out: Tensor) -> Tensor:
            q = args[0]
            if q.dim() != 2 or q.shape[0] != leave.shape[0]:
                raise ValueError(f"leave_one_out: growing layer {name!r} saw inputs of shape "
                                 f"{tuple(q.shape)}; one row per input is needed")
            assert isinstance(layer, GrowingLayer)
            whole, left = left_out_attention(layer, q, leave.to(q.device))
            return out + (left - whole).to(out.dtype)
        return hook

    handles = [layer.register_forward_hook(correct(name)) for name, layer in layers]
    try:
        with eval_mode(model):
            return model(x)
    finally:
        for handle in handles:
            handle.remove()
