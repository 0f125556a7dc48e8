"""The entry store: the growing database a layer answers from (docs/reference.md §2).

One store per layer holds N entries, each a key ``k_j (d_in,)``, a value ``v_j (d_out,)``
(the *weighted* value ``ṽ_j = w_j v_j`` for the weighted softmax), a scalar weight ``w_j``,
the step at which the entry was written (for the age coefficients of docs/reference.md §3)
and its id: the entry's number in the order the layer wrote its entries, the same whichever
process holds it (a sharded store, :mod:`rcdl.distributed`) and after any removal or resume.

Storage is a set of capacity-sized buffers of which the first ``N`` rows are live.
Appending B entries is amortised O(B): when the capacity runs out it grows geometrically
(or to exactly what :meth:`EntryStore.reserve` asked for), so no step copies the whole
store. The store is an ``nn.Module`` so that ``.to()``, ``.double()`` and ``state_dict()``
of the enclosing layer carry it along; the state dict holds only the live rows.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rcdl.ops.packed import PackedChunks

__all__ = ["EntryStore", "format_bytes"]



def check_storage_dtype(storage_dtype: torch.dtype | None) -> None:
    """Raise ``ValueError`` unless ``storage_dtype`` is ``None`` or a floating dtype."""
    if storage_dtype is not None and not (isinstance(storage_dtype, torch.dtype)
                                          and storage_dtype.is_floating_point):
        raise ValueError(f"storage_dtype must be a floating torch.dtype such as torch.bfloat16 "
                         f"or None, got {storage_dtype!r}")


def format_bytes(n: float) -> str:
    """Human-readable byte count, e.g. ``1.23 GB`` (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class EntryStore(nn.Module):
    """A growable table of (key, value, weight, written_at, id) entries.

    Args:
        d_in: key width.
        d_out: value width.
        capacity: rows allocated up front (grow later as needed).
        growth: factor by which the capacity grows when an append does not fit (> 1).
        dtype: of the weights, and of what :meth:`append` takes and the attention
            computes in (``written_at`` and ``ids`` are always int64).
        device: of the same tensors (the weights, what :meth:`append` takes, the attention).
        storage_dtype: what keys and values are stored as (default ``dtype``). A half
            precision (``torch.bfloat16``, ``torch.float16``) halves the store's bytes: appended
            rows are rounded to it, the attention multiplies in it and accumulates in
            ``dtype`` (docs/precision.md). It is kept across ``.to(dtype)``/``.double()`` of
            the enclosing module (only the weights follow); ``.to(device)`` moves everything.
        persistent: if False, the store is left out of the enclosing module's
            ``state_dict()`` (and ignored by ``load_state_dict``): for per-entry state that an
            optimizer saves in its own state dict (the hybrid's Adam moments).

    Views ``keys (N, d_in)``, ``values (N, d_out)``, ``weights (N,)``, ``written_at (N,)``,
    ``ids (N,)`` are slices of the buffers: they are invalidated by the next append that
    reallocates.

    Ids: :meth:`new_ids` hands out the next ``count`` numbers (``next_id`` counts them, and is
    saved in the state dict); :meth:`append` numbers its rows so unless given ``ids``. A
    sharded layer takes the ids of the whole batch on every rank and appends its own rows
    with theirs, so that an entry's id does not depend on the process holding it.

    ``version`` counts the changes other than appends (removals, clears, loads and in-place
    edits, which must call :meth:`touch` or :meth:`moved`): a cache of partial results over
    the first ``n`` rows (:func:`rcdl.nn.backends.enable_eval_cache`) stays valid
    while it is unchanged, because an append only adds rows after them. ``moves`` counts the
    changes that only moved rows in place (:meth:`moved`: the hybrid's Adam step), so that
    a reader can tell them from the rest, ``version − moves``: a top-k index keeps its
    keys across a few moves (:class:`rcdl.retrieval.topk.TopK`), never across a removal.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        capacity: int = 0,
        growth: float = 1.5,
        dtype: torch.dtype | None = None,
        storage_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        persistent: bool = True,
    ) -> None:
        super().__init__()
        self.persistent = persistent
        if d_in <= 0 or d_out <= 0:
            raise ValueError(f"EntryStore widths must be positive, got d_in={d_in}, d_out={d_out}")
        if growth <= 1:
            raise ValueError(f"EntryStore growth factor must be > 1, got {growth}")
        if capacity < 0:
            raise ValueError(f"EntryStore capacity must be >= 0, got {capacity}")
        self.d_in, self.d_out, self.growth = d_in, d_out, growth
        dtype = dtype or torch.get_default_dtype()
        check_storage_dtype(storage_dtype)
        self._storage_dtype = storage_dtype  # None: keys and values follow the weights' dtype
        self.size = 0
        self.version = 0  # bumped by every change other than an append (see touch)
        self.moves = 0  # of which in-place moves of rows (see moved)
        self._keys = torch.zeros(capacity, d_in, dtype=storage_dtype or dtype, device=device)
        self._values = torch.zeros(capacity, d_out, dtype=storage_dtype or dtype, device=device)
        self._weights = torch.zeros(capacity, dtype=dtype, device=device)
        self._written_at = torch.zeros(capacity, dtype=torch.long, device=device)
        self._ids = torch.zeros(capacity, dtype=torch.long, device=device)
        self.next_id = 0  # the id the next new entry gets
        self._packed = PackedChunks()  # full chunks packed, and the keys' norms (ops.packed)

    _BUFFERS = ("_keys", "_values", "_weights", "_written_at", "_ids")

    # Buffers are kept as plain attributes of capacity size; ``_apply`` and the state-dict
    # hooks below make them behave like module buffers, trimmed to the live rows.

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - torch signature
        super()._apply(fn, recurse)
        for name in self._BUFFERS:
            setattr(self, name, fn(getattr(self, name)))
        if self._storage_dtype is not None:  # a half-precision store stays half (exact)
            self._keys = self._keys.to(self._storage_dtype)
            self._values = self._values.to(self._storage_dtype)
        self._packed.clear()  # moved or cast: packed again from the new rows
        return self

    def set_storage_dtype(self, storage_dtype: torch.dtype | None) -> None:
        """Store keys and values as ``storage_dtype`` from now on (``None``: as the weights),
        converting the rows held (rounding them when the new dtype is narrower)."""
        check_storage_dtype(storage_dtype)
        self._storage_dtype = storage_dtype
        target = storage_dtype or self.dtype
        self._keys, self._values = self._keys.to(target), self._values.to(target)
        self.touch()

    # ---------------------------------------------------------------- views and sizes
    @property
    def keys(self) -> Tensor:  # (N, d_in)
        return self._keys[: self.size]

    @property
    def values(self) -> Tensor:  # (N, d_out)
        return self._values[: self.size]

    @property
    def weights(self) -> Tensor:  # (N,)
        return self._weights[: self.size]

    @property
    def written_at(self) -> Tensor:  # (N,)
        return self._written_at[: self.size]

    @property
    def ids(self) -> Tensor:  # (N,)
        return self._ids[: self.size]

    @property
    def packed_chunks(self) -> PackedChunks:
        """The store's chunk cache (:mod:`rcdl.ops.packed`): its full chunks packed for the
        products that sum over entries, and their keys' squared norms; valid until the next
        change of keys or values other than an append."""
        return self._packed

    @property
    def capacity(self) -> int:
        return self._keys.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: what :meth:`append` takes and the attention computes in."""
        return self._weights.dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        """What keys and values are stored as (``dtype`` unless a half precision was set)."""
        return self._keys.dtype

    @property
    def device(self) -> torch.device:
        return self._keys.device

    def __len__(self) -> int:
        return self.size

    def _row_bytes(self) -> int:
        row_bytes = (self.d_in + self.d_out) * self._keys.element_size()
        return (row_bytes + self._weights.element_size() + self._written_at.element_size()
                + self._ids.element_size())

    @property
    def nbytes(self) -> int:
        """Bytes held by the live entries."""
        return self.size * self._row_bytes()

    @property
    def reserved_nbytes(self) -> int:
        """Bytes allocated, live or not (capacity × row size)."""
        return self.capacity * self._row_bytes()

    def extra_repr(self) -> str:
        storage = f"storage_dtype={self.storage_dtype}, " if self._storage_dtype else ""
        packed = self._packed.nbytes
        return (
            f"N={self.size}, d_in={self.d_in}, d_out={self.d_out}, dtype={self.dtype}, {storage}"
            f"{format_bytes(self.nbytes)} used / {format_bytes(self.reserved_nbytes)} reserved"
            + (f", {format_bytes(packed)} packed" if packed else "")
        )

    # ---------------------------------------------------------------- growth
    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` entries in total (never shrinks)."""
        if capacity <= self.capacity:
            return
        n = self.size
        for name in self._BUFFERS:
            old = getattr(self, name)
            new = old.new_zeros((capacity, *old.shape[1:]))  # spare rows hold nothing
            new[:n] = old[:n]
            setattr(self, name, new)

    def append(
        self,
        keys: Tensor,
        values: Tensor,
        weights: Tensor | None = None,
        written_at: int | Tensor = 0,
        *,
        ids: Tensor | None = None,
        check_finite: bool = True,
    ) -> None:
        """Append B entries: ``keys (B, d_in)``, ``values (B, d_out)``, ``weights (B,)``.

        ``weights`` defaults to ones, ``ids (B,)`` (int64) to the next B of :meth:`new_ids`.
        The three floating tensors are in the store's ``dtype``; keys and values are rounded
        to ``storage_dtype`` as they are written. Everything is validated before
        anything is written, so a refused append leaves the store unchanged. Non-finite
        entries are refused, and so are entries that overflow the storage dtype (float16).
        ``check_finite=False`` skips the finiteness test (one device sync) where the storage
        dtype cannot overflow, for callers that have just made it
        (:func:`rcdl.optim._step.propose`).
        """
        b = keys.shape[0] if keys.dim() == 2 else -1
        if weights is None:
            weights = torch.ones(max(b, 0), dtype=self.dtype, device=self.device)
        written_at = torch.as_tensor(written_at, dtype=torch.long, device=self.device)
        written_at = written_at.expand(max(b, 0)) if written_at.dim() == 0 else written_at
        self._check_entries(keys, values, weights, written_at)
        if ids is not None and (ids.shape != (max(b, 0),) or ids.dtype != torch.long):
            raise ValueError(f"EntryStore.append: ids must be an int64 tensor of shape ({b},), "
                             f"got {ids.dtype} {tuple(ids.shape)}")
        if b == 0:
            return
        keys, values = self._finite_rows(keys, values, weights, check_finite)
        ids = self.new_ids(b) if ids is None else ids.to(self.device)
        if self.size + b > self.capacity:
            self.reserve(max(self.size + b, int(self.capacity * self.growth) + 1))
        rows = slice(self.size, self.size + b)
        self._keys[rows] = keys
        self._values[rows] = values
        self._weights[rows] = weights
        self._written_at[rows] = written_at
        self._ids[rows] = ids
        self.size += b

    def new_ids(self, count: int) -> Tensor:  # (count,) int64
        """The ids of the next ``count`` entries written (``next_id`` onwards), taken: the
        next call continues after them."""
        ids = torch.arange(self.next_id, self.next_id + count, device=self.device)
        self.next_id += count
        return ids

    def _finite_rows(self, keys: Tensor, values: Tensor, weights: Tensor,
                     check_finite: bool) -> tuple[Tensor, Tensor]:
        """Keys and values rounded to the storage dtype, after checking (one device sync)
        that they and the weights are finite. A store with a narrower exponent range than
        its weights (float16) checks even when the caller already did: rows can overflow.
        (bfloat16 has float32's range; only numbers within 0.4 % of float32's largest could
        round up to inf there.)"""
        stored = keys.to(self._keys.dtype), values.to(self._keys.dtype)  # no copy if equal
        overflow_possible = torch.finfo(self._keys.dtype).max < torch.finfo(self.dtype).max / 2
        if not (check_finite or overflow_possible):
            return stored
        checked = {"keys": stored[0], "values": stored[1], "weights": weights}
        finite = torch.stack([torch.isfinite(t).all() for t in checked.values()]).tolist()
        for (name, ok), given in zip(zip(checked, finite, strict=True), (keys, values, weights),
                                     strict=True):
            if ok:
                continue
            if bool(torch.isfinite(given).all()):
                raise ValueError(f"EntryStore.append: {name} overflow the storage dtype "
                                 f"{self.storage_dtype}; nothing written")
            raise ValueError(f"EntryStore.append: {name} contain NaN or inf; nothing written")
        return stored

    def _check_entries(self, keys: Tensor, values: Tensor, weights: Tensor,
                       written_at: Tensor) -> None:
        expected = {"keys": (-1, self.d_in), "values": (-1, self.d_out), "weights": (-1,)}
        given = {"keys": keys, "values": values, "weights": weights}
        b = keys.shape[0] if keys.dim() == 2 else None
        for name, tensor in given.items():
            shape = expected[name]
            ok = tensor.dim() == len(shape) and all(
                s == -1 or s == t for s, t in zip(shape, tensor.shape, strict=True)
            )
            if not ok or (b is not None and tensor.shape[0] != b):
                want = tuple("B" if s == -1 else s for s in shape)
                raise ValueError(
                    f"EntryStore.append: {name} must have shape {want} with the same B for all, "
                    f"got {tuple(tensor.shape)} (keys {tuple(keys.shape)})"
                )
            if tensor.dtype != self.dtype:
                raise TypeError(
                    f"EntryStore.append: {name} dtype {tensor.dtype} != store dtype {self.dtype}"
                )
            if tensor.device != self.device:
                raise ValueError(
                    f"EntryStore.append: {name} on {tensor.device}, store on {self.device}"
                )
        if written_at.shape != (b,):
            raise ValueError(f"EntryStore.append: written_at must have shape ({b},)")

    # ---------------------------------------------------------------- removal
    def remove(self, mask: Tensor) -> int:
        """Remove the entries where ``mask (N,)`` is True, keeping order; returns the count.
        The rows freed at the end are zeroed: nothing of a removed entry stays in the
        store's spare capacity (which ``torch.save`` of the module and ``copy.deepcopy``
        carry)."""
        if mask.shape != (self.size,) or mask.dtype != torch.bool:
            raise ValueError(
                f"EntryStore.remove: mask must be a bool tensor of shape ({self.size},), "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )
        if not bool(mask.any()):  # nothing to move
            return 0
        keep = (~mask).nonzero().squeeze(1).to(self.device)  # (N_keep,)
        n_keep = keep.numel()
        for name in self._BUFFERS:
            buf = getattr(self, name)
            buf[:n_keep] = buf[: self.size].index_select(0, keep)
            buf[n_keep : self.size].zero_()
        removed = self.size - n_keep
        self.size = n_keep
        self.touch()
        return removed

    def rewrite(self, rows: slice, *, keys: Tensor | None = None, values: Tensor | None = None,
                weights: Tensor | None = None) -> None:
        """Replace the keys, values and/or weights of the live rows ``rows`` (a slice) in
        place; ids and write steps stay. ``keys (R, d_in)``, ``values (R, d_out)``,
        ``weights (R,)`` are in the store's ``dtype`` and finite (keys and values are rounded
        to ``storage_dtype``); all are checked before anything is written."""
        n = len(range(*rows.indices(self.size)))
        new = {"_keys": (keys, (n, self.d_in)), "_values": (values, (n, self.d_out)),
               "_weights": (weights, (n,))}
        checked = {}
        for name, (t, shape) in new.items():
            if t is None:
                continue
            what = name[1:]
            if t.shape != shape:
                raise ValueError(f"EntryStore.rewrite: {n} rows take {what} {shape}, got "
                                 f"{tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"EntryStore.rewrite: {what} must be {self.dtype}, got {t.dtype}")
            t = t.to(getattr(self, name).dtype)
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"EntryStore.rewrite: non-finite {what} (or {what} that "
                                 f"overflow {t.dtype}); nothing rewritten")
            checked[name] = t
        for name, t in checked.items():
            getattr(self, name)[: self.size][rows] = t
        if checked:
            self.version += 1  # as touch(), but new weights alone keep the packed chunks
            if keys is not None or values is not None:
                self._packed.clear()

    def touch(self) -> None:
        """Record an in-place change of stored rows (what appends do not do); the packed
        chunks (:attr:`packed_chunks`) are dropped (:meth:`rewrite` of weights alone keeps
        them)."""
        self.version += 1
        self._packed.clear()

    def moved(self) -> None:
        """Record that stored keys, values or weights were moved in place, no row added,
        removed or reordered (an optimizer's step over the entries): a change like
        :meth:`touch`'s, also counted in ``moves``."""
        self.version += 1
        self.moves += 1
        self._packed.clear()

    def compact(self) -> None:
        """Release the unused capacity (capacity becomes N)."""
        for name in self._BUFFERS:
            setattr(self, name, getattr(self, name)[: self.size].clone())

    def rewind(self, size: int, next_id: int) -> None:
        """Go back to the first ``size`` rows and hand out ids from ``next_id`` again (the rows
        after are zeroed): the store as it was when it held ``size`` rows, if it only grew
        since (exact forgetting restores a snapshot so, :mod:`rcdl.train.replay`)."""
        if not 0 <= size <= self.size or next_id < 0:
            raise ValueError(f"EntryStore.rewind: need 0 <= size <= {self.size} and next_id >= "
                             f"0, got size={size}, next_id={next_id}")
        for name in self._BUFFERS:
            getattr(self, name)[size : self.size].zero_()
        self.size, self.next_id = size, next_id
        self.touch()

    def clear(self) -> None:
        """Remove every entry (the rows are zeroed, as :meth:`remove` does)."""
        for name in self._BUFFERS:
            getattr(self, name)[: self.size].zero_()
        self.size = 0
        self.touch()

    # ---------------------------------------------------------------- state dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.persistent:
            return
        for name, tensor in self.rows().items():
            destination[prefix + name] = tensor
        destination[prefix + "next_id"] = torch.tensor(self.next_id)

    _ROWS = ("keys", "values", "weights", "written_at", "ids")

    def rows(self) -> dict[str, Tensor]:
        """The live rows as ``{keys, values, weights, written_at, ids}`` (copies): what the
        state dict holds besides ``next_id``, and what :meth:`load_rows` takes back."""
        return {name: getattr(self, name).clone() for name in self._ROWS}

    def load_rows(self, rows: dict[str, Tensor], next_id: int | None = None) -> None:
        """Replace the entries by ``rows`` (as :meth:`rows` gives them), checked first: a
        refused load (``ValueError``) leaves the store as it was. ``next_id`` (default: the
        store's) moves past the largest id loaded."""
        missing = [name for name in self._ROWS if name not in rows]
        if missing:
            raise ValueError(f"EntryStore.load_rows: rows lack {', '.join(missing)}")
        problem = self._checkpoint_problem(*(rows[name] for name in self._ROWS))
        if problem is not None:
            raise ValueError(f"EntryStore.load_rows: {problem}")
        ids = rows["ids"]
        next_id = max(self.next_id if next_id is None else next_id,
                      int(ids.max()) + 1 if ids.numel() else 0)
        self._replace(*(rows[name] for name in self._ROWS), next_id=next_id)

    def _replace(self, keys: Tensor, values: Tensor, weights: Tensor, written_at: Tensor,
                 ids: Tensor, *, next_id: int) -> None:
        """Replace the rows by checked ones (copies cast to the store's dtypes and device)."""
        n = keys.shape[0]
        self.clear()
        self.reserve(n)
        for buf, rows in ((self._keys, keys), (self._values, values), (self._weights, weights),
                          (self._written_at, written_at), (self._ids, ids)):
            buf[:n] = rows  # copy_ casts (rounds to a half storage dtype) and moves
        self.size, self.next_id = n, next_id

    def _load_from_state_dict(  # noqa: ANN001, PLR0913
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        if not self.persistent:
            return
        names = (*self._ROWS, "next_id")
        present = [prefix + n in state_dict for n in names]
        if not all(present):
            missing_keys.extend(prefix + n for n, p in zip(names, present, strict=True) if not p)
            return
        problem = self.state_problem(state_dict, prefix)
        if problem is not None:  # refused before anything changes: the store stays as it was
            errors.append(f"EntryStore {prefix!r}: {problem}")
            return
        rows = [state_dict[prefix + n] for n in self._ROWS]
        next_id = state_dict[prefix + "next_id"]
        self._replace(*rows, next_id=int(next_id))

    def state_keys(self) -> tuple[str, ...]:
        """The keys (relative to the store's prefix) its state dict part holds."""
        return (*self._ROWS, "next_id") if self.persistent else ()

    def state_problem(self, state_dict: dict[str, Tensor], prefix: str = "") -> str | None:
        """What would make :meth:`load_state_dict` refuse the rows of ``state_dict`` under
        ``prefix`` (``None`` if nothing): the check a whole model runs on every store before
        it loads any (:func:`rcdl.train.checkpoint.load_model_state`)."""
        if not self.persistent:
            return None
        names = (*self._ROWS, "next_id")
        missing = [prefix + n for n in names if prefix + n not in state_dict]
        if missing:
            return f"missing {', '.join(missing)}"
        problem = self._checkpoint_problem(*(state_dict[prefix + n] for n in self._ROWS))
        next_id = state_dict[prefix + "next_id"]
        if problem is None and (not isinstance(next_id, Tensor) or next_id.dim() != 0
                                or next_id.is_floating_point()):
            problem = (f"checkpoint next_id is {getattr(next_id, 'dtype', type(next_id))} "
                       f"{tuple(getattr(next_id, 'shape', ()))}, expected an integer scalar")
        return problem

    def _checkpoint_problem(self, keys: Tensor, values: Tensor, weights: Tensor,
                            written_at: Tensor, ids: Tensor) -> str | None:
        """What is wrong with a checkpoint's entries, or ``None`` if they can be loaded."""
        n = keys.shape[0] if keys.dim() == 2 else -1
        if keys.shape[1:] != (self.d_in,) or values.shape[1:] != (self.d_out,) or n < 0:
            return (f"checkpoint has keys {tuple(keys.shape)} and values {tuple(values.shape)}, "
                    f"this store expects (N, {self.d_in}) and (N, {self.d_out})")
        if (values.shape[0] != n or weights.shape != (n,) or written_at.shape != (n,)
                or ids.shape != (n,)):
            return (f"checkpoint rows disagree: keys {tuple(keys.shape)}, values "
                    f"{tuple(values.shape)}, weights {tuple(weights.shape)}, written_at "
                    f"{tuple(written_at.shape)}, ids {tuple(ids.shape)}")
        for name, t in (("keys", keys), ("values", values), ("weights", weights)):
            if not t.is_floating_point():
                return f"checkpoint {name} have dtype {t.dtype}, expected a floating dtype"
            if not torch.isfinite(t).all():
                return f"checkpoint {name} contain NaN or inf"
        for name, t in (("written_at", written_at), ("ids", ids)):
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                return f"checkpoint {name} has dtype {t.dtype}, expected integers"
        return None
