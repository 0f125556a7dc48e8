"""What the attention op runs over and what a pass over part of it leaves
(docs/architecture.md, "The attention op").

- :class:`Entries`: the rows attended over, ``keys (N, key_dim)``, ``values (N, d_out)``,
  ``weights (N,)``, with how they are attended over: the kernel, the temperature ``T``
  (``τ = T √key_dim``), the chunk size, the softmax denominator's guard ``eps`` and the
  half-precision product mode. A layer hands its store to the op as one
  (:meth:`rcdl.nn.layers.GrowingLayer.entries`).
- :class:`Partial`: the attention over a subset of the entries, ``(m, num, den, mass)``;
  partials of disjoint subsets merge exactly (:func:`merge_partials`), and
  :func:`finalize` turns the partial over all entries into the output (docs/reference.md §2).

This module computes nothing over a store; the compute paths (:mod:`rcdl.ops.streaming`, or
one registered with :func:`rcdl.ops.attention.register_path`) do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rcdl.ops.half import HALF_DTYPES
from rcdl.ops.kernels import Kernel, check_kernel, guard_denominator, softmax_scale
from rcdl.ops.packed import PackedChunks

__all__ = ["Entries", "Partial", "empty_partial", "finalize", "merge_partials"]

_NEG_INF = float("-inf")


@dataclass(frozen=True, eq=False)
class Entries:
    """The entries one attention call runs over, and how.

    ``kernel`` is a :class:`~rcdl.ops.kernels.Kernel` or the name of one; ``chunk_size`` the rows
    a streaming path folds at a time (``None``: the path's default); ``eps`` the softmax
    denominator's floor relative to the weight mass (:func:`rcdl.ops.kernels.guard_denominator`);
    ``half_products`` how a half-precision store multiplies (``"auto"``, ``"native"``,
    ``"float32"``; ``None``: the process default :data:`rcdl.ops.half.PRODUCTS`); ``packed``
    the store's packed chunks (:mod:`rcdl.ops.packed`) where ``keys`` and ``values`` are that
    store's rows, all of them and in order (``None``: the plain products). Entries over other
    tensors or rows (:meth:`rows`, :meth:`replace` of keys or values) leave it out.

    The tensors are checked against each other when the op receives them with the queries
    (:meth:`check`), not here: a layer builds one per call from its own store.
    """

    keys: Tensor  # (N, key_dim)
    values: Tensor  # (N, d_out)
    weights: Tensor  # (N,)
    kernel: Kernel
    temperature: float = 1.0
    chunk_size: int | None = None
    eps: float = 1e-6
    half_products: str | None = None
    packed: PackedChunks | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel", check_kernel(self.kernel))
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")

    def __len__(self) -> int:
        return self.keys.shape[0]

    def replace(self, **changes: object) -> Entries:
        """These entries with some fields changed (other rows, another chunk size, ...); new
        keys or values drop the packed chunks unless ``packed`` is given too."""
        if ("keys" in changes or "values" in changes) and "packed" not in changes:
            changes["packed"] = None
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def rows(self, index: slice | Tensor) -> Entries:
        """The entries ``index`` selects (a slice or a row index), settings unchanged."""
        return self.replace(keys=self.keys[index], values=self.values[index],
                            weights=self.weights[index])

    def settings(self) -> dict[str, Any]:
        """Everything but the tensors: ``Entries(keys, values, weights, **settings)``
        rebuilds these entries over other rows."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("keys", "values", "weights")}

    def tau(self, key_dim: int) -> float:
        """``τ = T √key_dim`` (:func:`rcdl.ops.kernels.softmax_scale`)."""
        return softmax_scale(self.temperature, key_dim)

    def check(self, q: Tensor) -> None:
        """Raise a ``ValueError``/``TypeError`` naming what does not fit between the queries
        ``q (B, key_dim)`` and these entries: shapes, dtypes, devices."""
        keys, values, weights = self.keys, self.values, self.weights
        if q.dim() != 2 or keys.dim() != 2 or values.dim() != 2 or weights.dim() != 1:
            raise ValueError(
                "attention expects q (B, d_in), keys (N, d_in), values (N, d_out), weights (N,); "
                f"got {tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}, "
                f"{tuple(weights.shape)}")
        n = keys.shape[0]
        if q.shape[1] != keys.shape[1] or values.shape[0] != n or weights.shape[0] != n:
            raise ValueError(
                f"attention shape mismatch: q {tuple(q.shape)}, keys {tuple(keys.shape)}, "
                f"values {tuple(values.shape)}, weights {tuple(weights.shape)}")
        if weights.dtype != q.dtype or keys.dtype != values.dtype or not (
                keys.dtype == q.dtype or keys.dtype in HALF_DTYPES):
            raise TypeError(
                f"attention: queries are {q.dtype}, keys {keys.dtype}, values {values.dtype}, "
                f"weights {weights.dtype}; weights must match the queries, and keys and "
                "values share one dtype: the queries' or a half precision (bfloat16, float16)")
        for name, t in (("keys", keys), ("values", values), ("weights", weights)):
            if t.device != q.device:
                raise TypeError(f"attention: {name} are on {t.device}, queries on {q.device}")


class Partial(NamedTuple):
    """Attention over a subset of the entries, mergeable with other subsets:

    - ``m (B,)``        the largest logit seen (softmax; zeros for the other kernels),
    - ``num (B, d_out)`` ``Σ_j e^{z_j − m} ṽ_j`` (softmax) or ``Σ_j w_j κ(q, k_j) v_j``,
    - ``den (B,)``      ``Σ_j w_j e^{z_j − m}`` (softmax; zeros otherwise),
    - ``mass (B,)``     ``Σ_j |w_j| e^{z_j − m}`` (softmax; zeros otherwise): the scale of the
      denominator's guard (:func:`rcdl.ops.kernels.guard_denominator`).
    """

    m: Tensor  # (B,)
    num: Tensor  # (B, d_out)
    den: Tensor  # (B,)
    mass: Tensor  # (B,)


def empty_partial(q: Tensor, d_out: int, kernel: Kernel) -> Partial:
    """The partial over no entries (``m = −inf`` for the softmax)."""
    b = q.shape[0]
    m = q.new_full((b,), _NEG_INF) if kernel.normalised else q.new_zeros(b)
    return Partial(m, q.new_zeros(b, d_out), q.new_zeros(b), q.new_zeros(b))


def merge_partials(a: Partial, b: Partial) -> Partial:
    """Exact merge of the partials of two disjoint sets of entries (log-sum-exp rescaling)."""
    m = torch.maximum(a.m, b.m)
    scale_a = torch.where(a.m == _NEG_INF, 0.0, torch.exp(a.m - m))  # (B,)
    scale_b = torch.where(b.m == _NEG_INF, 0.0, torch.exp(b.m - m))
    num = a.num * scale_a[:, None] + b.num * scale_b[:, None]
    return Partial(m, num, a.den * scale_a + b.den * scale_b, a.mass * scale_a + b.mass * scale_b)


def finalize(part: Partial, *, kernel: str | Kernel, eps: float = 1e-6) -> Tensor:  # (B, d_out)
    """Output of the attention from the partial over *all* entries: a new tensor, never one
    of the partial's (a cached partial stays intact whatever is done to the output)."""
    if not check_kernel(kernel).normalised:
        return part.num.clone(memory_format=torch.contiguous_format)
    return (part.num / guard_denominator(part.den, part.mass, eps)[:, None]).contiguous()
