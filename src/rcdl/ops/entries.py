"""What the attention op runs over and what a pass over part of it leaves
(docs/architecture.md, "The attention op").

- :class:`Entries`: the rows attended over, ``keys (N, key_dim)``, ``values (N, d_out)``,
  ``weights (N,)``, with how they are attended over: the kernel, the temperature ``T``
  (``τ = T √key_dim``), the chunk size, the softmax denominator's guard ``eps``, the
  half-precision product mode and the packing mode. A layer hands its store to the op as one
  (:meth:`rcdl.nn.layers.GrowingLayer.entries`).
- :class:`~rcdl.ops.partials.Partial`: the attention over a subset of the entries,
  ``(m, num, den, mass)``, with its algebra (merge, fold, take out, finalize) in
  :mod:`rcdl.ops.partials`; :meth:`Entries.plan` decides how a call's products run, once
  (:class:`~rcdl.ops.plan.ProductPlan`), and :meth:`Entries.products` runs them so.

This module computes nothing over a store; the compute paths (:mod:`rcdl.ops.streaming`, or
one registered with :func:`rcdl.ops.attention.register_path`) do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rcdl.ops.half import HALF_DTYPES
from rcdl.ops.kernels import Kernel, check_kernel, softmax_scale
from rcdl.ops.packed import PACKED, PackedChunks
from rcdl.ops.partials import Partial, Products, empty_partial, finalize, merge_partials
from rcdl.ops.plan import ProductPlan, plan_products

# the partials' names stay importable from here, where the op's data is
__all__ = ["Entries", "Partial", "empty_partial", "finalize", "merge_partials"]


@dataclass(frozen=True, eq=False)
class Entries:
    """The entries one attention call runs over, and how.

    ``kernel`` is a :class:`~rcdl.ops.kernels.Kernel` or the name of one; ``chunk_size`` the rows
    a streaming path folds at a time (``None``: the path's default); ``eps`` the softmax
    denominator's floor relative to the weight mass (:func:`rcdl.ops.kernels.guard_denominator`);
    ``half_products`` how a half-precision store multiplies (``"auto"``, ``"native"``,
    ``"float32"``, ``"widen"``; ``None``: the process default :data:`rcdl.ops.half.PRODUCTS`);
    ``packed`` the store's packed chunks (:mod:`rcdl.ops.packed`) where ``keys`` and
    ``values`` are that store's rows, all of them and in order (``None``: the plain
    products); entries over other tensors or rows (:meth:`rows`, :meth:`replace` of keys or
    values) leave it out. ``packing`` is the mode those chunks are used in (``"auto"``,
    ``"all"``, ``"off"``; ``None``: the process default :data:`rcdl.ops.packed.PACKED`).

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
    packing: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel", check_kernel(self.kernel))
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.packing is not None:
            PACKED.check(self.packing)

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

    def plan(self, q: Tensor) -> ProductPlan:
        """How the products of the queries ``q (B, key_dim)`` with these entries run, decided
        once for the call (:func:`rcdl.ops.plan.plan_products`): by the store's dtype and
        device, the queries' dtype, the batch, and these entries' ``half_products``,
        ``packing`` and ``chunk_size``."""
        return plan_products(q, self.keys, self.values, half_products=self.half_products,
                             packing_mode=self.packing, chunk_size=self.chunk_size)

    def products(self, q: Tensor, plan: ProductPlan | None = None) -> Products:
        """The products of the queries ``q (B, key_dim)`` with these entries, as the
        attention's forward runs them (:class:`~rcdl.ops.partials.Products`) by ``plan``
        (``None``: :meth:`plan`'s)."""
        return Products(q, self.keys, self.values, kernel=self.kernel,
                        tau=self.tau(q.shape[1]), plan=self.plan(q) if plan is None else plan)

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
