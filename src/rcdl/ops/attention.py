"""The attention op: kernel attention from queries over stored entries, one function per
question, every caller through it (docs/reference.md §2, docs/architecture.md "The
attention op").

With ``entries`` an :class:`~rcdl.ops.entries.Entries` (keys, values, weights, kernel,
temperature, chunk size, guard, half-product and packing modes; each call's products are
planned once from them, :class:`~rcdl.ops.plan.ProductPlan`):

- :func:`attend` — the differentiable output ``(B, d_out)``; gradients w.r.t. the queries
  and each of the entries' tensors that requires one (first order);
- :func:`attend_partial` — the partial ``(m, num, den, mass)`` (no autograd), the form in
  which partials of disjoint entries merge;
- :func:`resume` — the same partial, continued from the state an earlier call left
  (incremental evaluation);
- :func:`shares` — each entry's share of the output, projected on a direction per query
  (attribution), from the same products as the output.

``attend``, ``attend_partial`` and ``shares`` take a ``combiner`` where the entries are
one part of a store split into disjoint parts (the ranks' shards): the partials of all
parts are merged before the output, and the query gradient's shares are summed over the
parts. The exact backend, the sharded backend, the evaluation cache, the layers' step
look-ahead and attribution all call these; none computes attention itself.

**Compute paths.** The work is done by a compute path: :data:`rcdl.ops.streaming.STREAMING`
(every device, dtype and kernel; the reference) unless a path registered with
:func:`register_path` for the queries' device type, the keys' dtype and the kernel accepts
the call (:class:`ComputePath`: ``supports``, ``forward``, ``backward``, and optionally
``resume`` and ``shares``). A fused CPU or GPU kernel is one file that defines a path and
registers it; the tests compare it with the streaming path and the dense twin
(:func:`rcdl.ops.kernels.naive_attention`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from rcdl.ops.entries import Entries, Partial, finalize, merge_partials
from rcdl.ops.kernels import Kernel, check_kernel, guard_denominator
from rcdl.ops.streaming import STREAMING, default_chunk_size, nearest_sq_distance

__all__ = [
    "Combiner", "ComputePath", "Entries", "Partial", "attend", "attend_partial", "attention",
    "attention_partial", "default_chunk_size", "finalize", "merge_partials",
    "nearest_sq_distance", "path_for", "register_path", "resume", "shares",
    "unregister_path",
]  # fmt: skip


class Combiner(Protocol):
    """The hooks the op takes when its entries are one part of a store split into disjoint
    parts (the ranks' shards, :mod:`rcdl.distributed`): ``merge`` turns this part's partial
    into the partial over all parts, and ``all_reduce`` sums the query gradient's shares of
    the parts (in place; every part computes its own). The op knows nothing else of how the
    parts are held."""

    def merge(self, part: Partial, kernel: Kernel) -> Partial: ...

    def all_reduce(self, t: Tensor) -> Tensor: ...


class ComputePath(Protocol):
    """What computes the op (see the module docstring; :class:`rcdl.ops.streaming.Streaming` is
    the reference). The queries ``q (B, key_dim)`` and ``entries`` it gets have been checked
    against each other (:meth:`rcdl.ops.entries.Entries.check`).

    - ``supports(q, entries)`` — whether it takes this call (shapes, sizes, settings);
    - ``forward(q, entries, keep=...)`` — the partial over all the entries and whatever its
      ``backward`` needs (with ``keep``, it may keep intermediate blocks to save work);
    - ``backward(grad_out, q, entries, out, m, den, clamped, needs=..., saved=...)`` — the
      gradients w.r.t. ``(q, keys, values, weights)`` that ``needs`` asks for, given the
      output, max logit, guarded denominator and guard mask *over all parts*.

    A path may also define ``resume(q, entries, start)`` (:meth:`Streaming.resume
    <rcdl.ops.streaming.Streaming.resume>`; without it every call is a full pass, and the
    evaluation cache never hits) and ``shares(q, entries, direction, whole)`` (without it
    the streaming path's shares are used: they then match the output to this path's
    rounding, not its own)."""

    name: str

    def supports(self, q: Tensor, entries: Entries) -> bool: ...

    def forward(self, q: Tensor, entries: Entries, *, keep: bool) -> tuple[Partial, Any]: ...

    def backward(self, grad_out: Tensor, q: Tensor, entries: Entries, out: Tensor, m: Tensor,
                 den: Tensor | None, clamped: Tensor | None, *,
                 needs: tuple[bool, bool, bool, bool], saved: Any
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]: ...


# (device type, keys' dtype, kernel name) -> the paths registered for it, newest first
_PATHS: dict[tuple[str, torch.dtype, str], list[ComputePath]] = {}


def register_path(path: ComputePath, *, device: str, dtypes: Iterable[torch.dtype],
                  kernels: Iterable[str | Kernel]) -> ComputePath:
    """Let ``path`` compute the op for queries on a ``device`` type (``"cpu"``, ``"cuda"``)
    over keys of any of ``dtypes`` with any of ``kernels``, where its ``supports`` accepts
    the call. The newest registration is asked first; returns ``path``."""
    for dtype in dtypes:
        for kernel in kernels:
            key = (torch.device(device).type, dtype, check_kernel(kernel).name)
            _PATHS.setdefault(key, []).insert(0, path)
    return path


def unregister_path(path: ComputePath) -> None:
    """Remove every registration of ``path``."""
    for paths in _PATHS.values():
        while path in paths:
            paths.remove(path)


def path_for(q: Tensor, entries: Entries) -> ComputePath:
    """The compute path that takes this call: the newest registered one for its device,
    dtype and kernel whose ``supports`` accepts it, else the streaming path."""
    for path in _PATHS.get((q.device.type, entries.keys.dtype, entries.kernel.name), ()):
        if path.supports(q, entries):
            return path
    return STREAMING


class _Attention(torch.autograd.Function):
    """The differentiable op: ``keys``, ``values``, ``weights`` are ``entries``' own
    tensors, passed again so that autograd sees them."""

    @staticmethod
    def forward(ctx, q, keys, values, weights, entries, path, combiner, stats,  # noqa: ANN001
                save_fraction):
        b, n = q.shape[0], keys.shape[0]
        store_bytes = keys.numel() * keys.element_size() + values.numel() * values.element_size()
        keep = any(ctx.needs_input_grad[:4]) and b * n * q.element_size() <= (
            save_fraction * store_bytes)
        part, saved = path.forward(q, entries, keep=keep)
        if combiner is not None:  # these entries are one part: merge the partials of all
            part = combiner.merge(part, entries.kernel)
        out = finalize(part, kernel=entries.kernel, eps=entries.eps)
        # the softmax backward needs the final max, the guarded denominator and where the
        # guard acted (there the denominator is ±eps·mass instead of Σ_j w_j e^{z_j − m})
        den = clamped = None
        if entries.kernel.normalised:
            den = guard_denominator(part.den, part.mass, entries.eps)  # (B,)
            clamped = part.den.abs() < entries.eps * part.mass  # (B,) bool
            if stats is not None:  # the normaliser over all entries, for the caller
                stats.append((part.m.clone(), part.den.clone()))
        ctx.settings = entries.settings()
        ctx.path, ctx.combiner, ctx.saved = path, combiner, saved
        # the output is recomputed from num backward, not saved: an in-place op on it (an
        # nn.ReLU(inplace=True) after the layer) then leaves the backward what it needs
        ctx.save_for_backward(q, keys, values, weights, part.num, part.m, den, clamped)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # grad_out (B, d_out)
        q, keys, values, weights, num, m, den, clamped = ctx.saved_tensors
        entries = Entries(keys, values, weights, **ctx.settings)
        out = num / den[:, None] if entries.kernel.normalised else num  # (B, d_out)
        grad_q, *entry_grads = ctx.path.backward(
            grad_out, q, entries, out, m, den, clamped, needs=ctx.needs_input_grad[:4],
            saved=ctx.saved)
        if grad_q is not None and ctx.combiner is not None:  # each part holds its share
            grad_q = ctx.combiner.all_reduce(grad_q.contiguous())
        return (grad_q, *entry_grads, None, None, None, None, None)


def attend(q: Tensor, entries: Entries, *, combiner: Combiner | None = None,
           stats: list[tuple[Tensor, Tensor]] | None = None, save_fraction: float = 0.05,
           path: ComputePath | None = None) -> Tensor:  # (B, d_out)
    """Kernel attention from ``q (B, key_dim)`` over ``entries``, differentiable w.r.t. the
    queries and the entries' tensors.

    Args:
        combiner: the entries are one part of a store split into parts (see the module
            docstring).
        stats: if given (a list), the softmax kernel appends ``(m, den)`` over all entries
            (all parts): ``log Σ_j w_j e^{z_j} = m + log den``.
        save_fraction: a path may keep the ``(B, N)`` kernel values for the backward when
            they take at most this fraction of the bytes of the keys and values.
        path: the compute path to run, unasked (``None``: :func:`path_for`'s choice); how a
            path is compared with another on the same call.
    """
    entries.check(q)
    return _Attention.apply(q, entries.keys, entries.values, entries.weights, entries,
                            path_for(q, entries) if path is None else path, combiner, stats,
                            save_fraction)


@torch.no_grad()
def attend_partial(q: Tensor, entries: Entries, *, combiner: Combiner | None = None
                   ) -> Partial:
    """The partial result of attending from ``q`` over ``entries`` (over all parts with a
    ``combiner``), without autograd."""
    entries.check(q)
    part, _ = path_for(q, entries).forward(q, entries, keep=False)
    return part if combiner is None else combiner.merge(part, entries.kernel)


@torch.no_grad()
def resume(q: Tensor, entries: Entries, start: Any = None) -> tuple[Partial, Any]:
    """The partial over all of ``entries``, continued from ``start``, the state a previous
    call returned for the same queries over a prefix of these rows (``None``: from the
    first row). Returns the partial and the state to continue from next time (``None`` where
    the path does not resume: then every call is a full pass). A resumed partial is bit for
    bit a full pass's (:meth:`rcdl.ops.streaming.Streaming.resume`)."""
    entries.check(q)
    path = path_for(q, entries)
    if not hasattr(path, "resume"):
        return path.forward(q, entries, keep=False)[0], None
    return path.resume(q, entries, start)


@torch.no_grad()
def shares(q: Tensor, entries: Entries, direction: Tensor, *,
           combiner: Combiner | None = None) -> Tensor:  # (B, N)
    """``⟨direction_b, share_j(q_b)⟩`` for every entry ``j`` of ``entries``, where the shares
    ``share_j`` sum over the entries (of all parts, with a ``combiner``) to the output
    (docs/attribution.md). ``direction`` is ``(B, d_out)``; they are formed from the products
    the output is formed from (:meth:`rcdl.ops.streaming.Streaming.shares`)."""
    entries.check(q)
    if direction.shape != (q.shape[0], entries.values.shape[1]):
        raise ValueError(f"shares: expected a direction ({q.shape[0]}, "
                         f"{entries.values.shape[1]}), got {tuple(direction.shape)}")
    path = path_for(q, entries)
    whole = None
    if entries.kernel.normalised:  # the normaliser over every part
        whole = attend_partial(q, entries.replace(values=entries.values[:, :0]),
                               combiner=combiner)
    compute = path if hasattr(path, "shares") else STREAMING
    return compute.shares(q, entries, direction.to(q.dtype), whole)


def attention(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out)
    weights: Tensor,  # (N,)
    *,
    kernel: str | Kernel,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    eps: float = 1e-6,
    save_fraction: float = 0.05,
    shard: Combiner | None = None,
    stats: list[tuple[Tensor, Tensor]] | None = None,
) -> Tensor:  # (B, d_out)
    """:func:`attend` on tensors: kernel attention from queries ``q`` over the entries
    ``(keys, values, weights)``.

    The kernels are those of :mod:`rcdl.ops.kernels` (a :class:`~rcdl.ops.kernels.Kernel` or the
    name of one in :data:`~rcdl.ops.kernels.KERNELS`), with ``τ = temperature · √d_in``.
    Differentiable w.r.t. all four tensors (first order).

    Args:
        chunk_size: entries per block (default: :func:`default_chunk_size`).
        eps: floor on the magnitude of the softmax denominator ``Σ_j w_j e^{z_j}``, relative
            to the weight mass ``Σ_j |w_j| e^{z_j}`` (:func:`rcdl.ops.kernels.guard_denominator`).
        save_fraction: keep the ``(B, N)`` kernel values for backward when they take at most
            this fraction of the bytes of ``keys`` and ``values``; otherwise recompute.
        shard: if given (a :class:`Combiner`, e.g. :class:`rcdl.distributed.Shard`), the
            entries are one part of a store split into parts (this rank's shard of a store
            split over ranks): :func:`attend`'s ``combiner``.
        stats: if given (a list), the softmax kernel appends ``(m, den)`` over all entries
            (merged over the ranks): ``log Σ_j w_j e^{z_j} = m + log den``.

    Example:
        >>> q, k, v = torch.randn(4, 8), torch.randn(100, 8), torch.randn(100, 3)
        >>> attention(q, k, v, torch.ones(100), kernel="softmax").shape
        torch.Size([4, 3])
    """
    entries = Entries(keys, values, weights, check_kernel(kernel), temperature, chunk_size, eps)
    return attend(q, entries, combiner=shard, stats=stats, save_fraction=save_fraction)


def attention_partial(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out)
    weights: Tensor,  # (N,)
    *,
    kernel: str | Kernel,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Partial:
    """:func:`attend_partial` on tensors: the partial result of attending from ``q`` to
    these entries (no autograd)."""
    return attend_partial(q, Entries(keys, values, weights, check_kernel(kernel), temperature,
                                     chunk_size))
