"""Adam on the entries of a hybrid network's stores (docs/reference.md §4).

The entries are rows of growing stores, not ``nn.Parameter``s. As ``torch.optim.Adam`` keeps
its parameters' moments, :class:`EntryAdam` keeps the entries' moments, one
:class:`EntryMoments` per :class:`~rcdl.nn.hybrid.HybridSoftmax` layer, aligned with the layer's
rows by entry id: rows written since the last step get zero moments, removed rows lose
theirs (the store's ``version`` says when rows went). :meth:`EntryMoments.step` is the Adam
step itself, in place and in cache-sized blocks, with stochastic rounding for a
half-precision store (:mod:`rcdl.ops.rounding`, :mod:`rcdl.optim.half_adam`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import NoReturn, overload

import torch
from torch import Tensor, nn

from rcdl.nn.hybrid import HybridSoftmax, hybrid_layers
from rcdl.nn.store import EntryStore
from rcdl.optim.half_adam import ADAM_MODE, adam_path, adam_rows

__all__ = ["EntryAdam", "EntryMoments", "adam_block_elements"]


def adam_block_elements(device: torch.device | str, numel: int) -> int:
    """Numbers per block of :meth:`EntryMoments.step`: 2¹⁸ (1 MB in float32, cache sized) on
    CPU; the whole tensor (``numel``) on a GPU, where each pass over a block is a kernel
    launch and cache-sized blocks would mean thousands of launches per step."""
    return max(1, numel) if torch.device(device).type == "cuda" else 1 << 18


class EntryMoments:
    """Adam's state for the entries of one :class:`~rcdl.nn.hybrid.HybridSoftmax` layer: the
    first and second moments ``m``, ``v`` of (keys, weighted values, weights), two
    stores (:class:`~rcdl.nn.store.EntryStore`) in the layer's dtype holding the layer's rows with
    their ids, and ``steps``, the Adam steps taken. Each moment row's ``written_at`` is
    ``steps`` when its entry first met the optimizer, so every entry has its own bias
    correction, that of a parameter created when it was written.

    :meth:`sync` aligns the moments with the layer's rows; :meth:`step` and the optimizer's
    state dict call it first, so growth, budgets, forgetting and sharding need not tell the
    optimizer anything.
    """

    SATURATION_CHECK_EVERY = 64  # Adam steps between scans of a float16 store for ±65 504

    def __init__(self, layer: HybridSoftmax) -> None:
        self.layer = layer
        store = layer.store
        self.m, self.v = (EntryStore(store.d_in, store.d_out, persistent=False,
                                     dtype=store.dtype, device=store.device) for _ in range(2))
        self.steps = torch.zeros((), dtype=torch.long, device=store.device)
        self._structure = store.version - store.moves  # the rows' layout last aligned with
        self._saturation_warned = False  # a float16 store's entries reached ±65 504 (warned)
        self.sync()

    def __len__(self) -> int:
        return len(self.m)

    @torch.no_grad()
    def sync(self) -> None:
        """Align the moments with the layer's rows: follow its dtype and device, drop the
        moments of removed rows, give rows written since zero moments (``written_at`` =
        ``steps``). Rows only ever append after the others, so after removals the moments
        held are the first rows of the store; a store replaced wholesale (a load) restarts
        every moment at zero."""
        store = self.layer.store
        if self.m.dtype != store.dtype or self.m.device != store.device:
            for moments in (self.m, self.v):
                moments.to(device=store.device, dtype=store.dtype)
            self.steps = self.steps.to(store.device)
        structure = store.version - store.moves
        if structure != self._structure:  # rows removed, cleared or loaded
            self._structure = structure
            gone = ~torch.isin(self.m.ids, store.ids)  # (M,)
            if bool(gone.any()):
                for moments in (self.m, self.v):
                    moments.remove(gone)
            n = len(self.m)
            if n > len(store) or not torch.equal(self.m.ids, store.ids[:n]):
                self.m.clear()
                self.v.clear()
        n, total = len(self.m), len(store)
        if n < total:
            dtype, device, count = store.dtype, store.device, total - n
            for moments in (self.m, self.v):
                moments.append(torch.zeros(count, store.d_in, dtype=dtype, device=device),
                               torch.zeros(count, store.d_out, dtype=dtype, device=device),
                               torch.zeros(count, dtype=dtype, device=device),
                               written_at=self.steps, ids=store.ids[n:],
                               check_finite=False)  # zeros: nothing to read back

    def state(self) -> dict:
        """``{adam_steps, m, v}``: the step count and both moments' rows, row-aligned with
        the layer's store (as :meth:`~rcdl.nn.store.EntryStore.rows` gives them)."""
        self.sync()
        return {"adam_steps": int(self.steps), "m": self.m.rows(), "v": self.v.rows()}

    def load(self, saved: dict) -> None:
        """Take back a :meth:`state` (row-aligned with the layer's store, checked by the
        caller): each moment row gets the id of the store row it belongs to."""
        ids = self.layer.store.ids.clone()
        self.steps.fill_(saved["adam_steps"])
        for moments, key in ((self.m, "m"), (self.v, "v")):
            moments.load_rows({**saved[key], "ids": ids})
        store = self.layer.store
        self._structure = store.version - store.moves

    @torch.no_grad()
    def step(self, lr: float, betas: tuple[float, float], eps: float,
             chunk_elements: int | None = None, half_adam: str | None = None) -> None:
        """One Adam step on every entry of the layer, if backward left gradients on them
        since the last step (docs/reference.md §4).

        Per entry ``j`` with its own step count ``t_j`` (steps since it was written), for
        each of its key ``(d_in,)``, weighted value ``(d_out,)`` and weight, with gradient
        ``g`` (zero where none came): ``m ← β₁m + (1−β₁)g``, ``v ← β₂v + (1−β₂)g²``,
        ``θ ← θ − lr · (m / (1−β₁^{t_j})) / (√(v / (1−β₂^{t_j})) + ε)``.

        Computed as ``θ ← θ − m / (a_j √v + c_j)``: the same quotient with numerator and
        denominator divided by the step size ``lr / (1−β₁^{t_j})``, so that the per-entry bias
        corrections become two ``(N,)`` scales, ``a_j = (1−β₁^{t_j}) / (lr √(1−β₂^{t_j}))``
        and ``c_j = ε (1−β₁^{t_j}) / lr`` (computed in float64). The step is bound by memory
        traffic: it reads θ, m, v, g and writes θ, m, v, once each. Rows are visited in blocks
        of about ``chunk_elements`` numbers (default :func:`adam_block_elements`: 1 MB in
        float32 on CPU) so that the seven element-wise passes over a block (``lerp_``;
        ``mul_``, ``addcmul_``; ``sqrt``, ``mul_``, ``add_``; ``addcdiv_``) run in cache, and
        one scratch block is the only temporary. On a GPU the default block is the whole
        tensor (each pass is one kernel launch). The dense rule it is checked against is in
        ``tests/test_hybrid.py``.

        With a half-precision store (``store_dtype``) the moments stay in the layer's dtype
        and the moved keys and values are rounded to the store's dtype *stochastically*
        (:func:`rcdl.ops.rounding.round_stochastically`): an Adam step is often smaller than half
        a bfloat16 ulp, and rounding to nearest would drop it every time. The random bits
        are :func:`rcdl.ops.rounding.rounding_noise` of ``(layer.rounding_seed, Adam step, entry
        id)``, so a resumed or sharded run rounds exactly as one uninterrupted process does. A
        float16 entry moved past ±65 504 (float16's largest finite number) saturates there
        instead of becoming ``inf``, with a ``RuntimeWarning`` (once per layer, looked for at
        the first Adam step and every ``SATURATION_CHECK_EVERY`` after) naming the entry and
        suggesting bfloat16 or float32. ``half_adam`` says how that pass runs: eager, fused
        or compiled (:mod:`rcdl.optim.half_adam`; ``None``: the process-wide default).
        """
        grads = self.layer.take_entry_grads()
        if grads is None:
            return
        self.sync()
        store = self.layer.store
        n = len(store)
        b1, b2 = betas
        self.steps += 1
        t = (self.steps - self.m.written_at).to(torch.float64)  # (N,) >= 1
        bias1, bias2 = 1 - b1**t, 1 - b2**t  # (N,)
        a = (bias1 / (lr * bias2.sqrt())).to(store.dtype)  # (N,)
        c = (eps * bias1 / lr).to(store.dtype)  # (N,)
        groups = ((store.keys, self.m.keys, self.v.keys, grads[0]),
                  (store.values, self.m.values, self.v.values, grads[1]),
                  (store.weights, self.m.weights, self.v.weights, grads[2]))
        ids, seed = store.ids, self.layer.rounding_seed
        half_elements = store.keys.numel() + store.values.numel()
        for stream, (param, m, v, grad) in enumerate(groups):
            if grad is None:  # a zero gradient: the moments still decay and θ still moves
                grad = param.new_zeros(()).expand_as(param)
            block = chunk_elements or adam_block_elements(param.device, param.numel())
            rows_per_chunk = max(1, block // math.prod(param.shape[1:]))
            shape = (-1,) + (1,) * (param.dim() - 1)  # per-entry scales broadcast over a row
            half = param.dtype != m.dtype
            path = adam_path(half_elements, param.dtype, param.device, half_adam) if half else ""
            if path in ("compiled", "fused"):  # one loop: no temporaries to keep in cache
                rows_per_chunk = n
            scratch = None if half else m.new_empty((min(rows_per_chunk, n), *param.shape[1:]))
            for start in range(0, n, rows_per_chunk):
                rows = slice(start, start + rows_per_chunk)
                if half:  # round the moved entries without bias (rcdl.optim.half_adam)
                    adam_rows(
                        param[rows], m[rows], v[rows], grad[rows], a[rows], c[rows],
                        ids=ids[rows], seed=seed, step=self.steps, stream=stream,
                        b1=b1, b2=b2, compiled=path == "compiled", fused=path == "fused")
                    continue
                g, m_c, v_c = grad[rows].to(m.dtype), m[rows], v[rows]
                assert scratch is not None  # made for a float store
                denom = scratch[: g.shape[0]]
                m_c.lerp_(g, 1 - b1)
                v_c.mul_(b2).addcmul_(g, g, value=1 - b2)
                torch.sqrt(v_c, out=denom).mul_(a[rows].view(shape)).add_(c[rows].view(shape))
                param[rows].addcdiv_(m_c, denom, value=-1.0)
        if (store.keys.dtype == torch.float16 and not self._saturation_warned
                and self.steps % self.SATURATION_CHECK_EVERY == 1):
            self._warn_saturated()  # a scan of the store: not every step
        store.moved()  # every entry moved: cached partials over them are stale

    def _warn_saturated(self) -> None:
        """Warn (once) if the Adam step left keys or values of a float16 store at its largest
        finite number, where stochastic rounding saturates instead of writing ``inf``. An
        entry stays there while Adam pushes it outward, so a scan at the first Adam step and
        every ``SATURATION_CHECK_EVERY`` after finds it at the price of one pass in 64."""
        store = self.layer.store
        largest = torch.finfo(store.keys.dtype).max
        at_edge = ((store.keys.abs() == largest).any(1)
                   | (store.values.abs() == largest).any(1))  # (N,)
        count = int(at_edge.sum())  # one device sync, float16 stores only
        if not count:
            return
        self._saturation_warned = True
        first = int(store.ids[at_edge][0])
        warnings.warn(
            f"{self.layer.where}: the Adam step moved keys or values of {count} of its entries "
            f"(the first: id {first}) to ±{largest:g}, the largest finite {store.keys.dtype}; "
            "they are kept there (rounding saturates instead of writing inf), so whatever "
            "Adam moves beyond it is lost. Keep this store in torch.bfloat16 (float32's range) "
            "or float32 (store_dtype=)", RuntimeWarning, stacklevel=4)


class EntryAdam(torch.optim.Optimizer):
    """Adam on the entries of every :class:`HybridSoftmax` layer of ``model``
    (docs/reference.md §4), plus Adam on the model's ordinary parameters, if it has any (one
    parameter group, so a ``torch.optim.lr_scheduler`` scheduler drives both).

    Step it after ``loss.backward()`` and before :meth:`rcdl.optim.grower.Grower.step`, or let
    :class:`HybridGrower` do both. :meth:`state_dict` holds what a resumed run needs: the
    hyperparameters, every entry's moments and step count (row-aligned with the model's
    stores, so load the model first), and the ordinary parameters' Adam state.

    ``half_adam`` (``"auto"``, ``"eager"``, ``"compiled"``; ``None``: the process-wide
    default, :data:`rcdl.optim.half_adam.ADAM_MODE`) says how the pass over a half-precision store
    runs (:mod:`rcdl.optim.half_adam`); it is a hyperparameter of the group, saved in the state
    dict (a state saved without it keeps the learner's own).
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9,
                 0.999), eps: float = 1e-8, half_adam: str | None = None) -> None:
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0:
            raise ValueError(f"EntryAdam: need lr > 0, 0 <= betas < 1, eps > 0; got lr={lr}, "
                             f"betas={betas}, eps={eps}")
        if half_adam is not None:
            ADAM_MODE.check(half_adam)
        self.layers = hybrid_layers(model)
        if not self.layers:
            raise ValueError(f"EntryAdam: {type(model).__name__} has no HybridSoftmax layers")
        for name, layer in self.layers:
            layer.bind_name(name)
        # the entries' Adam state, one per layer, as torch.optim.Adam keeps its moments
        self.moments = {name: EntryMoments(layer) for name, layer in self.layers}
        params = [p for p in model.parameters() if p.requires_grad]
        super().__init__([{"params": params, "name": "entries and parameters (Adam)"}],
                         {"lr": lr, "betas": tuple(betas), "eps": eps, "half_adam": half_adam})
        self.param_adam = torch.optim.Adam(params, lr=lr, betas=betas, eps=eps) if params else None

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    @overload
    def step(self, closure: None = None, *, allowed: Tensor | None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float], *,
             allowed: Tensor | None = None) -> NoReturn: ...  # refused

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *,
             allowed: Tensor | None = None) -> None:
        """One Adam step on every entry with a gradient, then on the ordinary parameters.

        Refused (``ValueError`` naming the layer; every entry gradient dropped, nothing
        moved) if an entry gradient is NaN or inf.

        Args:
            allowed: a ``()`` bool on the device, or ``None``: where it is False the step
                is skipped, as if refused but without an error (nothing moves: no entry,
                moment, Adam step count or parameter; the gradients are dropped). It is
                read with the finiteness check, in the same read:
                :class:`~rcdl.optim.hybrid_grower.HybridGrower` gives the verdict of
                deferred growth checks on the step's records.
        """
        if closure is not None:
            raise TypeError("EntryAdam.step() takes no closure")
        skipped = [layer.where for _, layer in self.layers if layer.adam_update_lost()]
        if skipped:
            for _, layer in self.layers:
                layer.drop_entry_grads()
            raise RuntimeError(
                f"EntryAdam.step(): Grower.step() ran before this step and dropped the entry "
                f"gradients of {', '.join(skipped)}, so that batch's Adam update is lost: step "
                "EntryAdam before the Grower (rcdl.HybridGrower does both in order)")
        group = self.param_groups[0]
        finite = torch.stack([layer.entry_grads_finite() for _, layer in self.layers])
        permitted = True
        if allowed is None:
            all_finite = bool(finite.all())
        else:  # one read for both
            *flags, permitted = torch.cat([finite, allowed.to(finite.device)[None]]).tolist()
            all_finite = all(flags)
        if not all_finite:
            bad = [layer.where for (_, layer), ok in zip(self.layers, finite.tolist(),
                                                         strict=True) if not ok]
            self.zero_grad()
            raise ValueError(f"EntryAdam: NaN or inf in the entry gradients of {', '.join(bad)};"
                             " no entry moved and the gradients are dropped")
        if not permitted:
            self.zero_grad()
            return
        for name, _ in self.layers:  # half_adam None: the process-wide default
            self.moments[name].step(group["lr"], group["betas"], group["eps"],
                                    half_adam=group["half_adam"])
        if self.param_adam is not None:
            for inner in self.param_adam.param_groups:
                inner.update(lr=group["lr"], betas=group["betas"], eps=group["eps"])
            self.param_adam.step()

    def sync(self) -> None:
        """Align every layer's moments with its rows now (:meth:`EntryMoments.sync`: the
        moments of removed rows go, zeroed) rather than at the next step or state dict;
        :func:`rcdl.memory.forgetting.forget` calls it for the learners it is given."""
        for moments in self.moments.values():
            moments.sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the entries' gradients (they live on per-step leaves) and the parameters'."""
        for _, layer in self.layers:
            layer.drop_entry_grads()
        if self.param_adam is not None:
            self.param_adam.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        layers = {name: self.moments[name].state() for name, _ in self.layers}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"param_groups": [group], "layers": layers,
                "param_adam": None if self.param_adam is None else self.param_adam.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` (after the model's own ``load_state_dict``). Everything is
        checked before anything changes."""
        names = {name for name, _ in self.layers}
        saved_mode = state.get("param_groups", [{}])[0].get("half_adam")
        if saved_mode is not None:
            try:
                ADAM_MODE.check(saved_mode)
            except ValueError as e:
                raise ValueError(f"EntryAdam.load_state_dict: half_adam {saved_mode!r}: "
                                 f"{e}") from None
        if set(state.get("layers", {})) != names:
            raise ValueError(f"EntryAdam.load_state_dict: the state is for layers "
                             f"{sorted(state.get('layers', {}))}, this model has {sorted(names)}")
        for name, layer in self.layers:
            for key in ("m", "v"):
                rows = state["layers"][name][key]["keys"].shape[0]
                if rows != len(layer.store):
                    raise ValueError(
                        f"EntryAdam.load_state_dict: {layer.where} stores {len(layer.store)} "
                        f"entries but the state has moments for {rows}: load the model's "
                        "state saved with it first")
        for name, layer in self.layers:
            self.moments[name].load(state["layers"][name])
            layer.drop_entry_grads()
        group = self.param_groups[0]
        group.update({k: v for k, v in state["param_groups"][0].items() if k != "params"})
        group["betas"] = tuple(group["betas"])
        if self.param_adam is not None and state["param_adam"] is not None:
            self.param_adam.load_state_dict(state["param_adam"])
