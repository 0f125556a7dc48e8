"""How one attention call's products run, decided once per call (docs/precision.md,
"Product paths" and "Packed chunks").

A call of queries ``q (B, key_dim)`` over a store's ``keys (N, key_dim)`` and
``values (N, d_out)`` multiplies chunk after chunk of the store. How it multiplies them
depends on the device, the store's and the queries' dtypes, the batch, and two options of
the entries (of the layer that holds the store): ``half_products``, how a half-precision
store multiplies (:mod:`rcdl.ops.half`), and ``packing``, whether a store's full chunks are
multiplied from packed copies (:mod:`rcdl.ops.packed`); ``None`` takes each option's process
default. :func:`plan_products` decides all of it at the start of the call, as a
:class:`ProductPlan`; the compute path (:mod:`rcdl.ops.streaming`), the products
(:class:`rcdl.ops.partials.Products`) and the packed chunks read the plan and decide nothing
again.

Two batch sizes divide the calls:

- a **training batch**, at most :data:`TRAINING_BATCH` queries: the sums over a chunk's
  entries run from the store's packed chunks where packing applies, a half store's
  chunks converted to float32 are cache-sized, and a half store's score blocks are formed
  entry-major (``keys_c @ qᵀ``); larger batches are bound by arithmetic, and take float32's
  chunk rows and the query-major order (``q @ keys_cᵀ``);
- a bfloat16 store's products may be **widened in registers** for at most
  :data:`rcdl.ops.half.WIDEN_MAX_BATCH` queries (:func:`rcdl.ops.half.chunk_products`).

A growing layer holds its two options, saves them in its state dict
(:func:`options_tensor`; a state saved without them leaves the layer's own) and notes what
its calls ran under (:func:`record_layer`), which a run writes per layer to its
``environment.json`` (:func:`layer_products`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rcdl.ops import packed as packing
from rcdl.ops.half import PRODUCTS, chunk_products

__all__ = ["PATHS", "TRAINING_BATCH", "ProductPlan", "clear_layer_products",
           "default_chunk_size", "layer_products", "options_from", "options_tensor",
           "plan_products", "record_layer"]

TRAINING_BATCH = packing.MAX_BATCH  # the largest query batch planned as a training batch
PATHS = ("store", "float32", "widen")  # how a chunk is multiplied (ProductPlan.path)


@dataclass(frozen=True)
class ProductPlan:
    """How one call's products run (see the module docstring).

    - ``path``: ``"store"`` (the rows as they lie: not half precision, or multiplied
      natively), ``"float32"`` (each chunk converted to the queries' dtype) or ``"widen"``
      (bfloat16 rows widened in registers, :mod:`rcdl.ops.widen`);
    - ``training``: a training batch (at most :data:`TRAINING_BATCH` queries);
    - ``pack_sums``, ``pack_scores``: the sums over a full chunk's entries, and its score
      products, run from the store's packed copies of the chunk (where the entries carry a
      store's packed chunks, :attr:`rcdl.ops.entries.Entries.packed`);
    - ``chunk``: the rows folded at a time.
    """

    path: str
    training: bool
    pack_sums: bool
    pack_scores: bool
    chunk: int

    @property
    def upcast(self) -> bool:
        """Each chunk is converted to float32 before its products."""
        return self.path == "float32"

    @property
    def widened(self) -> bool:
        """Bfloat16 rows are widened in registers inside the products."""
        return self.path == "widen"


def default_chunk_size(batch: int, device: torch.device | str | None = None) -> int:
    """Entries per chunk.

    On CPU: 2048 for training batches, 1024 beyond :data:`TRAINING_BATCH` queries, so that a
    chunk's keys stay in cache (``benchmarks/bench_attention.py`` compares sizes;
    docs/precision.md). On a GPU the cost is kernel launches, not cache misses, so chunks
    are large: 65 536 entries, whose ``(c, B)`` block is 131 MB at B = 500 in float32.
    """
    if device is not None and torch.device(device).type == "cuda":
        return 1 << 16
    return 2048 if batch <= TRAINING_BATCH else 1024


def _chunk_rows(q: Tensor, keys: Tensor, path: str, training: bool,
                chunk_size: int | None) -> int:
    """``chunk_size``, else :func:`default_chunk_size`, except for a half store whose chunks
    are converted to float32 (``path`` ``"float32"``) and a training batch: the rows whose
    float32 copy stays in cache while it is multiplied, 2 MiB of them (at least 256 rows; a
    larger converted chunk leaves the cache before its second product reads it), and for
    one widened in registers (``"widen"``): 4 096 rows, nothing being copied, so that fewer
    calls cross into the kernels. A larger batch's converted chunks have float32's rows: its
    products are bound by arithmetic, and each chunk's sum over entries reads and writes the
    whole ``(B, d)`` accumulator, so fewer, longer chunks pay more than a cache-sized copy
    (``benchmarks/bench_half_paths.py``; docs/precision.md)."""
    if chunk_size is not None:
        return chunk_size
    if path == "widen":
        return 4096
    rows = default_chunk_size(q.shape[0], q.device)
    if path != "float32" or not training:
        return rows
    return max(256, min(rows, (1 << 21) // (q.element_size() * max(1, keys.shape[1]))))


def plan_products(q: Tensor, keys: Tensor, values: Tensor | None = None, *,
                  half_products: str | None = None, packing_mode: str | None = None,
                  chunk_size: int | None = None) -> ProductPlan:
    """The plan of one call of ``q (B, key_dim)`` over ``keys (N, key_dim)`` and ``values
    (N, d_out)`` (``None``: distances alone), under the entries' ``half_products`` and
    ``packing_mode`` (``None``: the process defaults :data:`rcdl.ops.half.PRODUCTS`,
    :data:`rcdl.ops.packed.PACKED`) and ``chunk_size`` (``None``: the path's rows).

    The path is :func:`rcdl.ops.half.chunk_products`'s for the store's dtype, device and the
    batch, except that rows are widened only for float32 queries over contiguous rows
    (else converted to float32). Packed chunks serve the products that run on the rows as
    they lie, for a training batch on a CPU, where oneDNN packs the dtype
    (:func:`rcdl.ops.packed.packs`)."""
    batch = q.shape[0]
    training = batch <= TRAINING_BATCH
    path = chunk_products(keys.dtype, keys.device, batch, half_products)
    if path == "widen" and not (q.dtype == torch.float32 and keys.is_contiguous()
                                and (values is None or values.is_contiguous())):
        path = "float32"
    sums = scores = False
    if path == "store":
        sums, scores = packing.packs(packing_mode, keys.device, keys.dtype, batch)
    return ProductPlan(path, training, sums, scores,
                       _chunk_rows(q, keys, path, training, chunk_size))



# ------------------------------------------------------------------- a layer's options
_HALF_CHOICES = (None, *PRODUCTS.choices)  # code 0: the process default
_PACK_CHOICES = (None, *packing.PACKED.choices)


def options_tensor(half_products: str | None, packing_mode: str | None) -> Tensor:  # (2,)
    """A layer's product options as its state dict saves them: ``[h, p]`` (int64), the
    index of ``half_products`` in ``(None, *rcdl.ops.half.MODES)`` and of ``packing_mode``
    in ``(None, *rcdl.ops.packed.MODES)`` (0: the process default)."""
    return torch.tensor([_HALF_CHOICES.index(half_products), _PACK_CHOICES.index(packing_mode)])


def options_from(saved: object, where: str) -> tuple[str | None, str | None]:
    """``(half_products, packing)`` from :func:`options_tensor`'s form; ``ValueError``
    naming ``where`` (the layer) for anything else."""
    if (not isinstance(saved, Tensor) or saved.shape != (2,) or saved.is_floating_point()
            or not 0 <= int(saved[0]) < len(_HALF_CHOICES)
            or not 0 <= int(saved[1]) < len(_PACK_CHOICES)):
        raise ValueError(f"{where}: the saved product options are {saved!r}, expected an "
                         f"integer tensor [half_products, packing] of codes below "
                         f"{len(_HALF_CHOICES)} and {len(_PACK_CHOICES)}")
    return _HALF_CHOICES[int(saved[0])], _PACK_CHOICES[int(saved[1])]


# layer name -> (store dtype, half_products, packing) as the layer's last call ran them
_LAYERS: dict[str, tuple[torch.dtype, str, str]] = {}


def record_layer(name: str, dtype: torch.dtype, half_products: str | None,
                 packing_mode: str | None) -> None:
    """Note, once per forward of the layer, that ``name`` attends over a store of ``dtype``
    under these options
    (``None`` resolved to the process default now): what :func:`layer_products` reports."""
    _LAYERS[name] = (dtype, PRODUCTS.resolve(half_products), packing.PACKED.resolve(packing_mode))


def layer_products() -> dict[str, dict[str, str]]:
    """Each layer that attended since :func:`clear_layer_products`, by name: its store's
    dtype and the half-product and packing modes its products ran under (its own, else the
    process default then): what a run records per layer in ``environment.json``."""
    return {name: {"store_dtype": str(dtype).removeprefix("torch."), "half_products": half,
                   "packing": pack} for name, (dtype, half, pack) in sorted(_LAYERS.items())}


def clear_layer_products() -> None:
    """Forget the layers :func:`layer_products` reports (a new run starts)."""
    _LAYERS.clear()
