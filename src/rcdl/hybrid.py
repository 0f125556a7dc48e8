"""The hybrid growing network (docs/reference.md §4): entries trained by Adam, growth gated by
distance.

A :class:`HybridSoftmax` layer is a :class:`rcdl.layers.GrowingSoftmax` whose stored keys,
weighted values and weights are *also* trained, jointly, by one Adam step per batch
(:class:`rcdl.entry_adam.EntryAdam`, lr 1e−3). After the Adam step, a sample writes its gws
entry only if its query is farther than τ from every stored key of that layer
(:class:`DistanceGate`); other
growth triggers are :class:`AlwaysGrow`, :class:`CapacityGate` and :class:`ErrorScaledGate`
(all in :mod:`rcdl.gates`, importable from here too).

One training step: :class:`rcdl.hybrid_grower.HybridGrower` drives it, in the only valid order::

    opt = HybridGrower(model, lr=1e-3)
    loss = F.cross_entropy(model(x), y)     # the forward records q, s and (by a hook) ḡ
    loss.backward()                         # gradients w.r.t. every stored entry, too
    opt.step()                              # EntryAdam moves the entries, then gated writes
    opt.zero_grad()                         # as for any optimizer: the parameters' gradients

(The two halves also exist alone, :class:`~rcdl.entry_adam.EntryAdam` and
:class:`rcdl.grower.Grower`. In the wrong order the growth step drops the entries'
gradients, and the next ``EntryAdam.step()`` raises an error saying so instead of silently
skipping the update.)

Entries are plain rows of the layer's :class:`~rcdl.store.EntryStore`, not ``nn.Parameter``s:
the store grows, and a growing parameter list does not fit ``torch.optim``. In training mode
the forward pass attends over fresh leaf tensors that share the store's memory, so
``backward()`` leaves the entries' gradients on them; Adam's moments live beside the
entries in two more stores (same rows, so growth and removal keep them aligned, and they
are saved by the optimizer's ``state_dict``, as ``torch.optim.Adam`` saves its moments, not by
the model's). Each entry carries its own Adam step count, so its bias correction is that of
a parameter created when it was written.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from rcdl.gates import (
    DistanceGate,
    GrowthTrigger,
    default_tau,
)
from rcdl.half_adam import adam_rows, use_compiled
from rcdl.layers import GrowingSoftmax
from rcdl.records import Record
from rcdl.rules import LearningRule, NewEntries
from rcdl.store import EntryStore

__all__ = [
    "GrowthStalledWarning", "HybridSoftmax", "adam_block_elements", "hybrid_layers",
]  # fmt: skip


class GrowthStalledWarning(UserWarning):
    """A hybrid layer's trigger has refused every sample for many steps (the layer is not
    learning from its data): usually a distance threshold too large for its queries."""


# --------------------------------------------------------------------------- the layer


class HybridSoftmax(GrowingSoftmax):
    """Weighted-softmax layer whose entries are trained by Adam and grown by a trigger
    (docs/reference.md §4).

    ``s(q) = Σ_j e^{z_j} ṽ_j / Σ_j w_j e^{z_j}`` as in :class:`~rcdl.layers.GrowingSoftmax`;
    ``k_j``, ``ṽ_j`` and ``w_j`` all receive gradients in training mode. Trained weights may
    turn negative and the denominator small: the attention's guard keeps outputs finite.

    Args:
        rule: the rule proposing entries
            (docs/reference.md §6: ``ClippedSoftmaxRule(eta=1, beta=30)``).
        trigger: which proposed entries are written (default
            ``DistanceGate(default_tau(d_in))``, τ = 50 · √(d_in / 3072): the paper's τ = 50 at
            its width, the same fraction of ``‖q‖ = √d_in`` at any other). If it refuses every
            sample of the first ``STALL_STEPS`` (100) steps, a :class:`GrowthStalledWarning`
            says so, with the distances it saw.
        seed: seeds the initial entries (default: torch's global generator) and the
            stochastic rounding of a half-precision store (:mod:`rcdl.rounding`; default: a
            number drawn from torch's global generator). Saved with the model as the buffer
            ``rounding_seed``.
        max_output_growth: a step is refused, with an error naming the layer and saying
            which of the rule's η and β to change, once the RMS of the layer's outputs
            exceeds this multiple of their RMS at the first step (default 100, where other
            growing layers use 1e4; ``None`` turns the check off). With non-negative
            weights a weighted softmax outputs a weighted mean of its entries' values
            ``v_j = ṽ_j / w_j``, so its outputs grow only where the rule writes values far
            beyond the store's (they scale as β/η, docs/reference.md §3) or entries of
            zero weight pile up in the numerator: a hundredfold growth is such a run, not
            learning (docs/reference.md §4 compares runs that learn and runs that do not).

    Other arguments as :class:`~rcdl.layers.GrowingSoftmax` (docs/reference.md §6: T = 5).

    Statistics (buffers, saved with the model): ``entries_written``, ``entries_refused``.
    """

    trains_entries = True  # EntryAdam moves every entry: no cached evaluation partials
    STALL_STEPS = 100  # growth steps without a single write before GrowthStalledWarning
    # buffers (): Adam steps taken, entries written and refused, the rounding seed
    adam_steps: Tensor
    entries_written: Tensor
    entries_refused: Tensor
    rounding_seed: Tensor

    def __init__(self, d_in: int, d_out: int, *, temperature: float, rule: LearningRule,
                 trigger: GrowthTrigger | None = None, initial_entries: int = 16,
                 seed: int | None = None, max_output_growth: float | None = 100.0,
                 **kw) -> None:
        super().__init__(d_in, d_out, temperature=temperature, rule=rule,
                         initial_entries=initial_entries, seed=seed,
                         max_output_growth=max_output_growth, **kw)
        if rule.needs_log_normalizer:
            raise ValueError(
                "HybridSoftmax: the 1/Z-normalised rule needs Z(q) > 0, but Adam may drive "
                "stored weights negative (Z ≤ 0, log Z undefined); use the clipped gws rule "
                "(ClippedSoftmaxRule(normalize=False)) as the paper does (docs/reference.md §4)")
        self.trigger: GrowthTrigger = (
            DistanceGate(default_tau(d_in)) if trigger is None else trigger)
        dtype, device = self.store.dtype, self.store.device
        # Adam's first and second moments of (keys, weighted values, weights), row-aligned
        # with the store; their ``written_at`` is the layer's Adam step count at the write.
        # They are optimizer state: EntryAdam.state_dict() saves them, the model's does not.
        self.adam_m = EntryStore(self.store.d_in, d_out, persistent=False, dtype=dtype,
                                 device=device)
        self.adam_v = EntryStore(self.store.d_in, d_out, persistent=False, dtype=dtype,
                                 device=device)
        self.register_buffer("adam_steps", torch.zeros((), dtype=torch.long,
                                                       device=self.store.device), persistent=False)
        for name in ("entries_written", "entries_refused"):
            self.register_buffer(name, torch.zeros((), dtype=torch.long,
                                                   device=self.store.device))
        rounding_seed = int(torch.randint(1 << 62, ())) if seed is None else seed
        self.register_buffer("rounding_seed", torch.tensor(rounding_seed, dtype=torch.long))
        self._zero_moments(len(self.store))
        self._leaves: tuple[Tensor, Tensor, Tensor] | None = None
        self._refused = 0  # refused by the trigger in the pending proposal
        self._dry_steps = 0  # growth steps in a row that wrote nothing (host-side count)
        self._last_sq_distance: Tensor | None = None  # (B,) of the last gated batch
        self._adam_skipped = False  # a growth step dropped entry gradients Adam never used
        self._saturation_warned = False  # a float16 store's entries reached ±65 504 (warned)

    # ---------------------------------------------------------------- forward
    def attend(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B, d_out)
        """In training (grad enabled), attention over the trainable :meth:`entry_leaves`:
        over all of them, or, with a top-k mode that applies in training
        (``use_topk(model, k, train=True)``), over each query's top-k rows found by its index,
        so that the leaves' gradients are zero outside the rows gathered (docs/retrieval.md,
        "Training the hybrid with top-k"). Otherwise as :class:`GrowingSoftmax`."""
        if not (self.training and torch.is_grad_enabled()):
            return super().attend(q)
        return self.backend.attend(self, q, self.entries(*self.entry_leaves()), self._stats)

    def entry_leaves(self) -> tuple[Tensor, Tensor, Tensor]:
        """Leaf tensors sharing the store's live rows, on which backward leaves the entries'
        gradients (made once per step, reused if the layer runs twice in a step)."""
        n = len(self.store)
        if self._leaves is None or self._leaves[0].shape[0] != n:
            store = self.store
            self._leaves = (store.keys.detach().requires_grad_(),
                            store.values.detach().requires_grad_(),
                            store.weights.detach().requires_grad_())
        return self._leaves

    def _drop_unstepped(self) -> None:
        if self.ready_records():  # the entries' gradients belong to the same dropped batch
            self._leaves = None
        super()._drop_unstepped()

    def adam_update_lost(self) -> bool:
        """Whether a growth step dropped entry gradients that no Adam step had used (the
        steps ran in the wrong order; ``EntryAdam.step`` then refuses, saying so)."""
        return self._adam_skipped

    def drop_entry_grads(self) -> None:
        """Forget the entries' gradients of this step (their leaves), and a lost update."""
        self._leaves = None
        self._adam_skipped = False

    @property
    def has_entry_grads(self) -> bool:
        """Whether backward has left gradients on the entries that no Adam step used yet."""
        return self._leaves is not None and any(t.grad is not None for t in self._leaves)

    def entry_grads_finite(self) -> Tensor:  # () bool, no device sync
        """Whether every entry gradient waiting for the Adam step is finite."""
        grads = [] if self._leaves is None else [t.grad for t in self._leaves]
        sums = [g.sum() for g in grads if g is not None]  # a NaN/inf anywhere makes a sum so
        return torch.stack(sums).isfinite().all() if sums else torch.tensor(True)

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        # .to() / .double() / .cuda() replace the store's tensors: leaves made before would be
        # views of the old ones, so they are dropped (a step in flight loses its gradients)
        self._leaves = None
        return super()._apply(fn, *args, **kwargs)

    # ---------------------------------------------------------------- Adam on entries
    @torch.no_grad()
    def adam_step(self, lr: float, betas: tuple[float, float], eps: float,
                  chunk_elements: int | None = None, half_adam: str | None = None) -> None:
        """One Adam step on every entry that received a gradient since the last step
        (docs/reference.md §4).

        Per entry ``j`` with its own step count ``t_j`` (steps since it was written), for
        each of its key ``(d_in,)``, weighted value ``(d_out,)`` and weight, with gradient
        ``g``: ``m ← β₁m + (1−β₁)g``, ``v ← β₂v + (1−β₂)g²``,
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
        tensor (each pass is one kernel launch). The dense
        rule it is checked against is in ``tests/test_hybrid.py``.

        With a half-precision store (``store_dtype``) the moments stay in the layer's dtype
        and the moved keys and values are rounded to the store's dtype *stochastically*
        (:func:`rcdl.rounding.round_stochastically`): an Adam step is often smaller than half
        a bfloat16 ulp, and rounding to nearest would drop it every time. The random bits
        are :func:`rcdl.rounding.rounding_noise` of ``(rounding_seed, Adam step, entry id)``,
        so a resumed or sharded run rounds exactly as one uninterrupted process does. A
        float16 entry moved past ±65 504 (float16's largest finite number) saturates there
        instead of becoming ``inf``, with a ``RuntimeWarning`` (once per layer, looked for at
        the first Adam step and every ``SATURATION_CHECK_EVERY`` after) naming the entry and
        suggesting bfloat16 or float32. ``half_adam`` says whether that pass is compiled
        (:mod:`rcdl.half_adam`; ``None``: the process-wide default).
        """
        leaves, self._leaves = self._leaves, None
        if leaves is None or all(t.grad is None for t in leaves):
            return
        n = leaves[0].shape[0]
        if n != len(self.store):
            raise RuntimeError(f"HybridSoftmax {self.name!r}: the store changed between the "
                               "forward pass and the Adam step; step Adam before the Grower")
        b1, b2 = betas
        self.adam_steps += 1
        t = (self.adam_steps - self.adam_m.written_at).to(torch.float64)  # (N,) >= 1
        bias1, bias2 = 1 - b1**t, 1 - b2**t  # (N,)
        a = (bias1 / (lr * bias2.sqrt())).to(self.store.dtype)  # (N,)
        c = (eps * bias1 / lr).to(self.store.dtype)  # (N,)
        groups = ((self.store.keys, self.adam_m.keys, self.adam_v.keys, leaves[0].grad),
                  (self.store.values, self.adam_m.values, self.adam_v.values, leaves[1].grad),
                  (self.store.weights, self.adam_m.weights, self.adam_v.weights, leaves[2].grad))
        ids, seed = self.store.ids, self.rounding_seed
        half_elements = self.store.keys.numel() + self.store.values.numel()
        for stream, (param, m, v, grad) in enumerate(groups):
            if grad is None:  # a zero gradient: the moments still decay and θ still moves
                grad = param.new_zeros(()).expand_as(param)
            block = chunk_elements or adam_block_elements(param.device, param.numel())
            rows_per_chunk = max(1, block // math.prod(param.shape[1:]))
            shape = (-1,) + (1,) * (param.dim() - 1)  # per-entry scales broadcast over a row
            half = param.dtype != m.dtype
            compiled = half and use_compiled(half_elements, half_adam)
            if compiled:  # one fused loop: no temporaries to keep in cache, one call
                rows_per_chunk = n
            scratch = None if half else m.new_empty((min(rows_per_chunk, n), *param.shape[1:]))
            for start in range(0, n, rows_per_chunk):
                rows = slice(start, start + rows_per_chunk)
                if half:  # round the moved entries without bias (rcdl.half_adam)
                    adam_rows(
                        param[rows], m[rows], v[rows], grad[rows], a[rows], c[rows],
                        ids=ids[rows], seed=seed, step=self.adam_steps, stream=stream,
                        b1=b1, b2=b2, compiled=compiled)
                    continue
                g, m_c, v_c = grad[rows].to(m.dtype), m[rows], v[rows]
                assert scratch is not None  # made for a float store
                denom = scratch[: g.shape[0]]
                m_c.lerp_(g, 1 - b1)
                v_c.mul_(b2).addcmul_(g, g, value=1 - b2)
                torch.sqrt(v_c, out=denom).mul_(a[rows].view(shape)).add_(c[rows].view(shape))
                param[rows].addcdiv_(m_c, denom, value=-1.0)
        if (self.store.keys.dtype == torch.float16 and not self._saturation_warned
                and self.adam_steps % self.SATURATION_CHECK_EVERY == 1):
            self._warn_saturated()  # a scan of the store: not every step
        self.store.moved()  # every entry moved: cached partials over them are stale

    SATURATION_CHECK_EVERY = 64  # Adam steps between scans of a float16 store for ±65 504

    def _warn_saturated(self) -> None:
        """Warn (once) if the Adam step left keys or values of a float16 store at its largest
        finite number, where stochastic rounding saturates instead of writing ``inf``. An
        entry stays there while Adam pushes it outward, so a scan at the first Adam step and
        every ``SATURATION_CHECK_EVERY`` after finds it at the price of one pass in 64."""
        largest = torch.finfo(self.store.keys.dtype).max
        at_edge = ((self.store.keys.abs() == largest).any(1)
                   | (self.store.values.abs() == largest).any(1))  # (N,)
        count = int(at_edge.sum())  # one device sync, float16 stores only
        if not count:
            return
        self._saturation_warned = True
        first = int(self.store.ids[at_edge][0])
        warnings.warn(
            f"{self.where}: the Adam step moved keys or values of {count} of its entries (the "
            f"first: id {first}) to ±{largest:g}, the largest finite {self.store.keys.dtype}; "
            "they are kept there (rounding saturates instead of writing inf), so whatever "
            "Adam moves beyond it is lost. Keep this store in torch.bfloat16 (float32's range) "
            "or float32 (store_dtype=)", RuntimeWarning, stacklevel=4)

    # ---------------------------------------------------------------- growth
    def make_entries(self, record: Record) -> NewEntries:
        keys, values, weights = super().make_entries(record)
        errors = (record.grad_mean * record.n_samples).norm(dim=1)  # (B,) per-sample ‖g‖
        sq_distance = None
        if self.trigger.needs_distance:
            sq_distance = self.backend.nearest_sq_distance(self, record.q)  # (B,) all ranks
            self._last_sq_distance = sq_distance
        size = self.num_entries_all_ranks() if getattr(self.trigger, "needs_size", True) else 0
        accept = self.trigger.accept(sq_distance, size, errors)  # (B,) bool
        self._last_accept = accept
        self._refused += int((~accept).sum())
        return keys[accept], values[accept], weights[accept]

    _last_accept: Tensor | None = None

    def kept_rows(self) -> Tensor | None:  # (B,) bool
        return self._last_accept

    def propose(self) -> NewEntries | None:
        self._refused = 0
        return super().propose()

    def discard(self) -> None:
        super().discard()
        self._leaves = None

    @torch.no_grad()
    def commit(self, entries: NewEntries | None) -> None:
        written = 0 if entries is None else int(entries[0].shape[0])  # all ranks together
        if self.has_entry_grads:  # Grower.step() ran before EntryAdam.step()
            self._adam_skipped = True
        stored = len(self.store)
        super().commit(entries)
        self._leaves = None
        self._zero_moments(len(self.store) - stored)  # the rows this rank stored
        self.entries_written += written
        self.entries_refused += self._refused
        self._refused = 0
        self._dry_steps = 0 if written else self._dry_steps + 1
        if self._dry_steps == self.STALL_STEPS and int(self.entries_written) == 0:
            self._warn_stalled()

    def _warn_stalled(self) -> None:
        seen = ""
        if self._last_sq_distance is not None and self._last_sq_distance.numel():
            d = self._last_sq_distance.float().clamp_min(0).sqrt().median()
            seen = (f" (the last batch's queries were a median {float(d):.3g} from their "
                    "nearest key)")
        warnings.warn(
            f"{self.where} has written no entry in {self.STALL_STEPS} steps: its trigger "
            f"{self.trigger} refused every sample{seen}. A distance threshold is in the units "
            f"of the layer's queries (‖q‖ = √d = {math.sqrt(self.store.d_in):.3g} after the "
            f"networks' RMS norm); the default for this width is "
            f"DistanceGate({default_tau(self.store.d_in):.3g}) (rcdl.gates.default_tau)",
            GrowthStalledWarning, stacklevel=2)

    def _zero_moments(self, count: int) -> None:
        dtype, device = self.store.dtype, self.store.device
        for moments in (self.adam_m, self.adam_v):
            moments.append(torch.zeros(count, self.store.d_in, dtype=dtype, device=device),
                           torch.zeros(count, self.d_out, dtype=dtype, device=device),
                           torch.zeros(count, dtype=dtype, device=device),
                           written_at=int(self.adam_steps))

    @torch.no_grad()
    def remove_entries(self, mask: Tensor) -> int:
        self._leaves = None
        self.adam_m.remove(mask)
        self.adam_v.remove(mask)
        return self.store.remove(mask)

    def stats(self) -> dict[str, int]:
        """Entries written and refused so far, entries stored and their bytes."""
        return {"written": int(self.entries_written), "refused": int(self.entries_refused),
                "entries": len(self.store), "bytes": self.store.nbytes}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, trigger={self.trigger}"


def adam_block_elements(device: torch.device | str, numel: int) -> int:
    """Numbers per block of :meth:`HybridSoftmax.adam_step`: 2¹⁸ (1 MB in float32, cache
    sized) on CPU; the whole tensor (``numel``) on a GPU, where each pass over a block is a
    kernel launch and cache-sized blocks would mean thousands of launches per step."""
    return max(1, numel) if torch.device(device).type == "cuda" else 1 << 18


def hybrid_layers(model: nn.Module) -> list[tuple[str, HybridSoftmax]]:
    """All hybrid layers of ``model`` with their module paths."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, HybridSoftmax)]

