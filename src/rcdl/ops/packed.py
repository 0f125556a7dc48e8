"""Packed chunks: a store's full chunks kept a second time, in the layout oneDNN's matrix
kernels multiply from, for the products that sum over a chunk's entries, and on request for
the score products too (docs/precision.md, "Packed chunks").

A training step multiplies every chunk of the store twice per pass. The score product
``keys_c @ qᵀ`` sums along a store row, which lies contiguously; the sum over the chunk's
entries, ``left (B, c) @ values_c (c, d)`` (and ``grad (B, c) @ keys_c`` backward), sums
down the rows. oneDNN's kernels take that operand in a blocked layout of their own (for
bfloat16, neighbouring rows interleaved in pairs, which its dot-product instruction
multiplies at once) and re-pack the chunk into it on every call, which at a training batch
is much of the product's cost, in float32 as in bfloat16 (docs/precision.md gives the
figures; ``python benchmarks/bench_sum_products.py`` measures them).

:class:`PackedChunks` keeps each full chunk of a store packed once,
``W_c = pack(rows_cᵀ)`` (``torch.ops.mkldnn._reorder_linear_weight``), and the sum becomes
``left @ rows_c = linear(left, W_c)`` (``torch.ops.mkldnn._linear_pointwise``), with no
re-packing: the same numbers up to the order of the float32 accumulation inside one chunk's
product (the tests compare it with the plain product and with float64). In the mode
``"all"`` the score products ``rows_c @ xᵀ`` (the keys' with the queries, the values' with
the output gradient backward) run from a second packed copy, ``pack(rows_c)``, as well, for
CPUs where oneDNN's product from a packed chunk beats the plain one there too, at the price
of a third copy of the rows.

- **Which products**: those of a chunk of ``chunk`` rows starting at ``begin`` that is full
  (``begin + chunk ≤ N``), for at most :data:`MAX_BATCH` queries (the training batches: a
  larger batch's product is bound by arithmetic and the re-packing is a small part of it),
  where the products run in the store's dtype on a CPU (float32, or bfloat16 with native
  products: :mod:`rcdl.ops.half`), and where oneDNN packs that dtype here (:func:`supported`,
  probed once per dtype: not a bfloat16 store on a CPU, or an emulated class, without
  bfloat16 units).
- **When a chunk is packed**: the first time a pass asks for it, kept until the store's keys
  or values change. Packing costs several products' time, so it pays only for rows read
  many times: a store that only grows packs each chunk once, when it is full. Layers whose
  entries an optimizer moves every step (the hybrid's) do not hand their store's packed
  chunks to the attention (:meth:`rcdl.nn.layers.GrowingLayer.entries`).
- **Same numbers whatever the cache holds**: a full chunk's products run from its packed
  copies whether they were made now or earlier, so results do not depend on what was packed
  before (a resumed run, an evaluation cache or more evaluations between steps give the
  same bits); they differ from the plain products' only in the order of float32 sums.
- **Validity**: the store owns its cache and clears it on every change of its keys or
  values other than an append (:meth:`rcdl.nn.store.EntryStore.touch`: removals, loads,
  rewrites of keys or values, moves), and when it is moved or cast. An append adds rows
  after the full chunks only.
- **The keys' squared norms** of each full chunk, which a distance kernel (RBF, Laplacian)
  adds to every score, are kept in the same cache whatever the mode
  (:meth:`PackedChunks.sq_norms`): the same numbers as formed anew, one per entry.
- **Memory**: a packed chunk takes the bytes of its rows again, so a store whose chunks are
  all packed holds its keys and values twice (three times in the mode ``"all"``;
  :attr:`PackedChunks.nbytes`). Packed copies are never saved (not in the state dict, not in
  a pickle, not in a deep copy) and are dropped with the cache: what
  :func:`rcdl.memory.forgetting.forget` removes is not kept in them.

The mode is ``"auto"`` (pack for the sums where the rules above allow), ``"all"`` (for the
score products too) or ``"off"``: a layer's own (``GrowingLayer(packing=...)``, saved with
it; :attr:`rcdl.ops.entries.Entries.packing`), else the process-wide default :data:`PACKED`
(:class:`rcdl.options.ProcessDefault`), set with :func:`set_packed_chunks`, for a block with
:func:`packed_chunks`, or by the environment variable ``RCDL_PACKED_CHUNKS`` before its first
use. Each call applies the rules once (:func:`packs`, through the call's
:class:`~rcdl.ops.plan.ProductPlan`). A run records the default, the dtypes packed here and
each layer's own mode in ``environment.json``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from rcdl.ops.half import native_products
from rcdl.ops.kernels import row_sq_norms
from rcdl.options import ProcessDefault

__all__ = ["MAX_BATCH", "MODES", "PACKED", "PackedChunks", "packed_chunks", "packed_dtypes",
           "packed_product", "packs", "set_packed_chunks", "supported"]

MODES = ("auto", "all", "off")
MAX_BATCH = 128  # the largest query batch whose sums over entries use packed chunks
_DTYPES = (torch.float32, torch.bfloat16)  # the store dtypes packing was measured for
_HINT = 16  # the batch size a chunk is packed for (the training batch); any batch may use it

PACKED = ProcessDefault("packed chunks mode", "RCDL_PACKED_CHUNKS", MODES, "auto")
# pack the full chunks of stores for the sums ("auto"), the scores too ("all") or never ("off")
set_packed_chunks: Callable[[str], None] = PACKED.set
# with packed_chunks("off"): ... -- the mode for a block, restored after
packed_chunks: Callable[[str], AbstractContextManager[None]] = PACKED.using


def _ops() -> tuple[Any, Any] | None:
    """oneDNN's packing and packed product, where this build of torch has them."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies a CPU store in ``dtype`` here: float32 or
    bfloat16, probed once on a small chunk against the plain product (a bfloat16 store on a
    CPU without bfloat16 units, or capped below them, is refused by oneDNN: ``False``)."""
    ops = _ops()
    if dtype not in _DTYPES or ops is None:
        return False
    pack, linear = ops
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 48, generator=gen).to(dtype)  # (c, d)
    left = torch.randn(3, 64, generator=gen).to(dtype)  # (B, c)
    try:
        out = linear(left, pack(rows.T, _HINT), None, "none", [None], "")
    except RuntimeError:
        return False
    want = left.double() @ rows.double()
    return bool(out.shape == want.shape
                and (out.double() - want).abs().max() <= 1e-2 * want.abs().max())


def packs(mode: str | None, device: torch.device | str, dtype: torch.dtype, batch: int
          ) -> tuple[bool, bool]:
    """Whether the products of ``batch`` queries with a store of ``dtype`` on ``device``,
    multiplied as its rows lie, run from packed chunks under the packing ``mode``
    (``None``: the default :data:`PACKED`): ``(the sums over entries, the score products)``.
    Both only for a training batch (at most :data:`MAX_BATCH` queries) on a CPU where oneDNN
    packs ``dtype`` (:func:`supported`), not in the mode ``"off"``; the scores in the mode
    ``"all"`` only. The rule :func:`rcdl.ops.plan.plan_products` plans each call by."""
    mode = PACKED.resolve(mode)
    if (batch > MAX_BATCH or torch.device(device).type != "cpu" or mode == "off"
            or not supported(dtype)):
        return False, False
    return True, mode == "all"


def packed_dtypes() -> dict[str, bool]:
    """Whether a CPU store of each dtype packing applies to has its chunks packed here,
    under the mode now: oneDNN packs it (:func:`supported`) and the attention multiplies it
    as it lies (a bfloat16 store only with native products, :mod:`rcdl.ops.half`; not on an
    emulated class without them). What a run records in ``environment.json``."""
    on = PACKED.get() != "off"
    return {str(dtype).removeprefix("torch."): on and supported(dtype) and (
        dtype == torch.float32 or native_products(dtype, "cpu")) for dtype in _DTYPES}


def packed_product(x: Tensor, packed: Tensor) -> Tensor:
    """``x @ mᵀ`` for the matrix ``m`` that :class:`PackedChunks` packed, in ``x``'s dtype
    (the rows'): for a sum over entries ``m = rowsᵀ`` and this is ``left (B, c) @ rows``
    ``(B, d)``; for a score product ``m = rows`` and this is ``x (B, d) @ rowsᵀ`` ``(B, c)``."""
    _, linear = _ops()  # type: ignore[misc]  # only called where supported() said so
    return linear(x, packed, None, "none", [None], "")


class PackedChunks:
    """One store's packed chunks (see the module docstring), keyed by the tensor they were packed
    from (``"keys"`` or ``"values"``), the product they serve, the first row and the rows
    per chunk, and its full chunks' key norms (:meth:`sq_norms`). The store that owns it
    calls :meth:`clear` on every change of its keys or values other than an append; the
    compute path asks :meth:`packed` for each full chunk whose products its call's plan packs
    (:func:`packs`), and :meth:`get` asks the rule itself."""

    def __init__(self) -> None:
        self._packs: dict[tuple[str, bool, int, int], Tensor] = {}
        self._norms: dict[tuple[torch.dtype, int, int], Tensor] = {}

    def clear(self) -> None:
        """Drop every packed chunk and kept norm (the store's keys or values changed)."""
        self._packs.clear()
        self._norms.clear()

    def __len__(self) -> int:
        return len(self._packs)

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed chunks (about their rows' bytes each) and the kept
        norms (one number per entry)."""
        return sum(t.numel() * t.element_size()
                   for t in (*self._packs.values(), *self._norms.values()))

    def sq_norms(self, keys: Tensor, begin: int, dtype: torch.dtype) -> Tensor:  # (c,)
        """``‖k_j‖²`` of the store's keys ``keys (c, d)`` (as they lie, the full chunk from
        row ``begin``) as :func:`rcdl.ops.kernels.row_sq_norms` forms them in ``dtype``:
        formed at the first call, then kept (the same numbers)."""
        key = (dtype, begin, keys.shape[0])
        norms = self._norms.get(key)
        if norms is None:
            norms = self._norms[key] = row_sq_norms(keys, dtype)
        return norms

    def get(self, which: str, rows: Tensor, begin: int, batch: int, *,
            scores: bool = False) -> Tensor | None:
        """``rows (c, d)``, the store's rows ``[begin, begin + c)`` of ``which`` (as they lie,
        a full chunk), packed (now, or kept from an earlier call) for a sum over entries
        with ``batch`` queries (``rowsᵀ`` packed), or with ``scores`` for a score product
        (``rows`` packed; the mode ``"all"`` only); ``None`` where the plain product is to be
        used: the mode says so, or the batch or the rows do not qualify. The answer depends
        on these alone, never on what the cache holds."""
        sums, all_products = packs(None, rows.device, rows.dtype, batch)
        if not (all_products if scores else sums):
            return None
        return self.packed(which, rows, begin, scores=scores)

    def packed(self, which: str, rows: Tensor, begin: int, *, scores: bool = False) -> Tensor:
        """``rows (c, d)`` of ``which`` from row ``begin`` (a full chunk of the store, as they
        lie), packed for a sum over entries (or with ``scores`` for a score product): now,
        or kept from an earlier call. Where a call's plan packs them
        (:class:`rcdl.ops.plan.ProductPlan`); :meth:`get` asks the rule first."""
        key = (which, scores, begin, rows.shape[0])
        packed = self._packs.get(key)
        if packed is not None:
            return packed
        pack, _ = _ops()  # type: ignore[misc]
        packed = self._packs[key] = pack(rows if scores else rows.T, _HINT)
        return packed

    # derived data, rebuilt where needed: never copied, pickled or saved with the store
    def __deepcopy__(self, memo: dict[int, Any]) -> PackedChunks:
        return PackedChunks()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"PackedChunks({len(self._packs)} chunks, {self.nbytes} bytes)"
