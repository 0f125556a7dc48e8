"""Growing layers: modules that answer by attention over their own entry store
(docs/reference.md §2–3).

A growing layer's forward pass is ordinary PyTorch: differentiable w.r.t. its input, so
gradients flow to earlier layers. In training mode (with grad enabled) it also records
what a learning rule needs — the query, the output computed from the pre-step store, and
(through a hook) the gradient of the loss w.r.t. that output. :class:`rcdl.optim.grower.Grower`
then turns those records into new entries, after ``loss.backward()``.

Which records a step writes is :mod:`rcdl.nn.records`' business (each layer keeps a
:class:`~rcdl.nn.records.Recorder`); in short, only a batch whose backward ran is written, by the
next step, and a training forward pass after an unstepped backward drops that batch. In eval
mode nothing is recorded; if grad is enabled the output still requires grad, and a backward
through it raises an error that names the layer and says to call ``model.train()``. The output
is the layer's own tensor, shared with nothing it keeps (its record, an evaluation cache, the
attention's saved tensors): an in-place op after the layer (``nn.ReLU(inplace=True)``) trains
as its out-of-place twin does.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.nn.backends import (
    Backend,
    EvalCached,
    Exact,
    RetrievalMode,
    ShardCollectives,
    Sharded,
    compose,
    find,
    wrapped,
)
from rcdl.nn.backends import TopK as _TopKBackend
from rcdl.nn.divergence import (
    KEYS,
    VALUES,
    WEIGHTS,
    DivergenceGuard,
    Fault,
    first_fault,
    no_fault,
    raise_first,
)
from rcdl.nn.records import EvalModeOutput, Record, Recorder
from rcdl.nn.rules import FunctionalSGD, LearningRule, NewEntries, Step
from rcdl.nn.sample_map import UNKNOWN, SampleMap
from rcdl.nn.store import EntryStore
from rcdl.ops.attention import attend, attend_partial, attention
from rcdl.ops.entries import Entries
from rcdl.ops.half import PRODUCTS
from rcdl.ops.kernels import Kernel, check_kernel, softmax_scale

__all__ = [
    "GrowingLaplacian", "GrowingLayer", "GrowingLinear", "GrowingRBF", "GrowingSoftmax",
    "ParametricSoftmax", "growing_layers", "set_store_dtype",
]



def _run_eagerly(method: Callable) -> Callable:
    """``method``, never traced by ``torch.compile``: inside a compiled model dynamo breaks
    the graph at its call and runs it eagerly (``torch.compiler.disable``). Importing
    ``torch._dynamo`` costs more than the rest of ``import rcdl``; until something has
    imported it (``torch.compile`` does, before it traces), nothing can be compiling, and
    ``method`` is called directly."""
    disabled = torch._disable_dynamo(method)  # torch's lazy disable, known to dynamo

    @functools.wraps(method)
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return method(*args, **kwargs)
        return disabled(*args, **kwargs)

    return call


class GrowingLayer(nn.Module):
    """Base class: a layer ``d_in → d_out`` over an :class:`EntryStore` and a learning rule.

    Args:
        d_in: input width. Inputs may have any leading dims ``(..., d_in)``; the first
            one is the sample dimension the loss averages over.
        d_out: output width.
        kernel: a :class:`rcdl.ops.kernels.Kernel` or the name of one in
            :data:`rcdl.ops.kernels.KERNELS` (``"linear"``, ``"rbf"``, ``"laplacian"``,
            ``"softmax"``); ``layer.kernel`` is the kernel object.
        temperature: T, with ``τ = T √d_in`` (every kernel but the linear one).
        rule: the learning rule writing this layer's entries
            (:class:`rcdl.nn.rules.LearningRule`).
        key_dim: width of the stored keys, if not ``d_in``.
        capacity: entries to allocate up front (e.g. the number of training samples).
        chunk_size: entries per block of the streaming attention (default: automatic).
        max_output_growth: a step is refused, with an error naming the layer, when the RMS of
            the layer's outputs exceeds this multiple of their RMS at the first step where
            they were non-zero (a diverging layer: learning rate too high or temperature too
            low for the inputs' scale); non-finite outputs are always refused. For linear,
            RBF and growing softmax layers the outputs the step *would leave* on its batch
            are checked too, before it writes (against the inputs' RMS while the store
            answered only zeros), so a single step at a far too high learning rate writes
            nothing. ``None`` turns the scale checks off.
        store_dtype: what the store keeps keys and values as (default: the layer's dtype);
            ``torch.bfloat16`` or ``torch.float16`` halve its bytes, and where the CPU
            multiplies bf16 natively also the attention's time (docs/precision.md).
    """

    steps: Tensor  # buffer (): the growth steps taken so far

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        kernel: str | Kernel,
        temperature: float = 1.0,
        rule: LearningRule,
        key_dim: int | None = None,
        capacity: int = 0,
        chunk_size: int | None = None,
        max_output_growth: float | None = 1e4,
        dtype: torch.dtype | None = None,
        store_dtype: torch.dtype | None = None,
        half_products: str | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.kernel = check_kernel(kernel)
        self.temperature = temperature
        softmax_scale(temperature, d_in)  # validates the temperature
        if not isinstance(rule, LearningRule):
            raise TypeError(f"{type(self).__name__}: rule must be a rcdl.nn.rules.LearningRule "
                            f"(e.g. FunctionalSGD, ClippedSoftmaxRule), got {type(rule).__name__}")
        self.rule = rule
        self.chunk_size = chunk_size
        # how a half-precision store multiplies (rcdl.ops.half; None: the process default)
        self.half_products = None if half_products is None else PRODUCTS.check(half_products)
        # refuses a step that would make the layer diverge (the learners wrap their step in it)
        self.guard = DivergenceGuard(max_output_growth)
        self.store = EntryStore(key_dim or d_in, d_out, capacity=capacity, dtype=dtype,
                                storage_dtype=store_dtype, device=device)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long, device=device))
        self.name = type(self).__name__  # set to the module path by the Grower
        self.recorder = Recorder()  # this step's training-mode calls (rcdl.nn.records)
        self.provenance = SampleMap(device=device)  # entry id -> training sample
        self._proposed_samples: Tensor | None = None  # (B,) of the entries propose() made
        # how the layer attends: a chain of rcdl.nn.backends wrappers, installed by use_shard,
        # use_retrieval and enable_eval_cache (TopK(EvalCached(Exact | Sharded)))
        self.backend: Backend = Exact()

    # ---------------------------------------------------------------- set by other modules
    # What the optimizers and the model-wide switches change in a layer, each through one
    # method of the layer's own: no other module assigns the layer's attributes.
    def bind_name(self, name: str) -> None:
        """The layer's module path in its model, as errors and state dicts name it (set by
        the optimizer that steps it: :class:`~rcdl.optim.grower.Grower`, ``EntryAdam``)."""
        self.name = name or type(self).__name__

    def expect_steps(self) -> None:
        """Say that an optimizer grows this layer (:class:`~rcdl.optim.grower.Grower` calls it):
        from its first batch on, a backward without a ``step()`` before the next training
        forward is warned of (:class:`~rcdl.nn.records.UnsteppedBatchWarning`)."""
        self.recorder.expects_steps = True

    def set_learning_rate(self, lr: float) -> None:
        """Replace the rule by the same rule with learning rate ``lr`` (a scheduler's step,
        through the grower's ``param_groups``)."""
        if lr != self.rule.lr:
            self.rule = self.rule.with_lr(lr)

    def defer_checks(self, deferred: bool) -> None:
        """Say whether the learner reads this layer's check faults at check points rather
        than in each step (:class:`~rcdl.optim.grower.Grower`'s ``defer_checks``): a training
        forward then leaves its inputs' NaN/inf check to the divergence guard, on the device."""
        self.guard = self.guard.replace(deferred=deferred)

    def restore_step_state(self, steps: int, output_scale: float | None) -> None:
        """The step count and the divergence guard's reference scale from a grower's
        state dict."""
        self.steps.fill_(steps)
        self.guard.restore(output_scale)

    @property
    def max_output_growth(self) -> float | None:
        """The divergence guard's limit (:class:`~rcdl.nn.divergence.DivergenceGuard`)."""
        return self.guard.max_output_growth

    @max_output_growth.setter
    def max_output_growth(self, limit: float | None) -> None:
        self.guard = self.guard.replace(max_output_growth=limit)

    @property
    def output_scale(self) -> float | None:
        """The divergence guard's reference scale: the output RMS at the first step that
        wrote (floored), ``None`` before."""
        return self.guard.output_scale

    def use_shard(self, shard: ShardCollectives | None) -> None:
        """Attend over this rank's rows of a store split over ranks (``None``: the whole
        store here): the base of :attr:`backend` becomes :class:`~rcdl.nn.backends.Sharded`
        (:func:`rcdl.distributed.shard` installs it). Drops an evaluation cache."""
        self.backend = compose(self.backend, base=Exact() if shard is None else Sharded(shard),
                               cache=None)

    def use_retrieval(self, mode: RetrievalMode | None) -> None:
        """Attend by a top-k mode (``None``: exact streaming attention again): the outer
        :class:`~rcdl.nn.backends.TopK` of :attr:`backend` (:func:`rcdl.retrieval.topk.use_topk`
        and ``use_exact`` install it)."""
        self.backend = compose(self.backend, mode=mode)

    @property
    def shard(self) -> ShardCollectives | None:
        """The shard of a store split over ranks (:mod:`rcdl.distributed`), else ``None``."""
        sharded = find(self.backend, Sharded)
        return None if sharded is None else sharded.shard

    @shard.setter
    def shard(self, shard: ShardCollectives | None) -> None:  # as use_shard
        self.use_shard(shard)

    @property
    def retrieval(self) -> RetrievalMode | None:
        """The top-k mode the layer attends by (:mod:`rcdl.retrieval.topk`), else ``None``."""
        topk = find(self.backend, _TopKBackend)
        return None if topk is None else topk.mode

    @retrieval.setter
    def retrieval(self, mode: RetrievalMode | None) -> None:  # as use_retrieval
        self.use_retrieval(mode)

    def wrap_backend(self, wrap: Callable[[Backend], Backend]) -> None:
        """Attend through ``wrap(backend)``: a backend of one's own around the current one,
        a dataclass with an ``inner`` field; it stays outermost (docs/architecture.md,
        "Adding a backend")."""
        try:
            self.backend = wrapped(self.backend, wrap)
        except TypeError as err:
            raise TypeError(f"{self.where}: {err}") from None

    # ---------------------------------------------------------------- forward
    def entry_weights(self) -> Tensor:  # (N,)
        """The per-entry weights handed to the attention: the stored weights ``w_j``, times
        the age coefficients ``h(a_j)`` where the rule has weight decay or momentum
        (docs/reference.md §3)."""
        ages = self.rule.ages
        if ages is None or ages.trivial:
            return self.store.weights
        age = self.steps - self.store.written_at  # (N,)
        return self.store.weights * ages.entry(age).to(self.store.dtype)

    def entries(self, keys: Tensor | None = None, values: Tensor | None = None,
                weights: Tensor | None = None) -> Entries:
        """The store's rows as the attention op takes them (:mod:`rcdl.ops.attention`): keys,
        values, :meth:`entry_weights`, and the layer's kernel, temperature, chunk size and
        half-product mode; ``keys``, ``values``, ``weights`` replace the store's (the
        hybrid's trainable leaves). Where keys and values are the store's own and no
        optimizer moves them (not ``trains_entries``), the store's packed chunks go with them
        (:mod:`rcdl.ops.packed`)."""
        store = self.store
        # the store's packed chunks apply to its own rows, where no optimizer moves them
        own_rows = keys is None and values is None and not self.trains_entries
        return Entries(store.keys if keys is None else keys,
                       store.values if values is None else values,
                       self.entry_weights() if weights is None else weights,
                       self.kernel, self.temperature, self.chunk_size,
                       half_products=self.half_products,
                       packed=store.packed_chunks if own_rows else None)

    def attend(self, q: Tensor) -> Tensor:  # (B, key_dim) -> (B, d_out)
        """Attention from (already prepared) queries over the whole store (every rank's
        shard of it, if the store is sharded: :mod:`rcdl.distributed`), through
        :attr:`backend` (top-k where a retrieval mode applies, the evaluation cache for
        no-grad calls, docs/architecture.md)."""
        return self.backend.attend(self, q, None, self._stats)

    # ---------------------------------------------------------------- incremental evaluation
    def enable_eval_cache(self) -> None:
        """Cache this layer's partial results for repeated evaluations on fixed inputs: a
        no-grad call on the queries of the last evaluation folds only the rows written since,
        bit for bit the full answer (:class:`~rcdl.nn.backends.EvalCached`). Not cached:
        sharded stores, age coefficients (weight decay, momentum: every entry's weight changes
        each step) and layers whose entries are trained (``trains_entries``: the hybrid)."""
        ages = self.rule.ages
        self.disable_eval_cache()  # counts the hits of a cache enabled before: reset after
        self._eval_hits = 0
        if self.shard is None and (ages is None or ages.trivial) and not self.trains_entries:
            self.backend = compose(self.backend, cache=EvalCached())

    def disable_eval_cache(self) -> None:
        """Turn the cache off and free it (its hits stay counted in :attr:`eval_cache_hits`)."""
        cache = find(self.backend, EvalCached)
        if cache is not None:
            self._eval_hits += cache.hits
            self.backend = compose(self.backend, cache=None)

    def start_evaluation(self) -> None:
        """Call before each evaluation: the next forward call is the first batch's."""
        cache = find(self.backend, EvalCached)
        if cache is not None:
            cache.start_evaluation()

    @property
    def eval_cache_hits(self) -> int:
        """Cached calls that only attended over new rows, since the cache was enabled."""
        cache = find(self.backend, EvalCached)
        return self._eval_hits + (0 if cache is None else cache.hits)

    _eval_hits = 0
    trains_entries = False  # True where an optimizer moves stored entries (the hybrid)

    _stats: list | None = None  # set during a recording forward of a softmax layer

    def output(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B, d_out)
        """The layer's function ``s(q)`` (subclasses add their parametric part)."""
        return self.attend(q)

    @_run_eagerly  # records and hooks are Python side effects
    def forward(self, x: Tensor) -> Tensor:  # (..., d_in) -> (..., d_out)
        recording = self.training and torch.is_grad_enabled()
        # deferred checks: the guard checks a recorded query for NaN/inf on the device
        q = self._check_input(x, finite=not (recording and self.guard.deferred))
        q = q.reshape(-1, self.d_in)  # (B, d_in)
        if recording:
            self._drop_unstepped()
            if self.kernel.normalised and not self.trains_entries:
                self._stats = []  # the store's normaliser, for the look-ahead check
        try:
            s = self.output(q)  # (B, d_out)
        finally:
            stats, self._stats = self._stats, None
        if recording:
            normaliser = stats[0] if stats is not None and len(stats) == 1 else None
            s = self.recorder.record(q, s, x.shape[0], normaliser)
        elif torch.is_grad_enabled() and not s.requires_grad:  # a backward would only fail
            s = EvalModeOutput.apply(s.detach().requires_grad_(), self.where)
        return s.reshape(*x.shape[:-1], self.d_out)

    @property
    def where(self) -> str:
        """The layer as error messages name it: class and module path."""
        return f"{type(self).__name__} {self.name!r}"

    def _drop_unstepped(self) -> None:
        """Forget records whose backward ran but whose step never came
        (:meth:`rcdl.nn.records.Recorder.drop_unstepped`); subclasses drop what belongs to the
        same batch."""
        self.recorder.drop_unstepped(self.where)

    def _check_input(self, x: Tensor, finite: bool = True) -> Tensor:
        """``x`` after checking its shape, dtype and device, and, if ``finite``, that it holds
        no NaN or inf (a read back to the host)."""
        where = self.where
        if x.dim() == 1 and x.shape[0] == self.d_in:
            raise ValueError(
                f"{where}: got one unbatched sample of shape {tuple(x.shape)}; inputs need a "
                f"batch dimension, (B, {self.d_in}) (for one sample: x.unsqueeze(0)). The first "
                "dimension is the samples the batch-mean loss averages over")
        if x.dim() < 2 or x.shape[-1] != self.d_in:
            raise ValueError(f"{where}: expected input (..., {self.d_in}), got {tuple(x.shape)}")
        if x.shape[0] == 0 or x.numel() == 0:
            raise ValueError(f"{where}: empty batch {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{where}: growing layers take floating-point inputs, got {x.dtype} "
                            f"(convert with x.to({self.store.dtype}))")
        if x.dtype != self.store.dtype:
            raise TypeError(f"{where}: input dtype {x.dtype} != layer dtype {self.store.dtype}")
        if x.device != self.store.device:
            raise ValueError(f"{where}: input on {x.device}, layer on {self.store.device}")
        if finite and not torch.isfinite(x).all():
            raise ValueError(f"{where}: input contains NaN or inf")
        return x

    # ---------------------------------------------------------------- growth
    @property
    def has_pending(self) -> bool:
        """Whether a training-mode forward of this step still waits for its backward."""
        return self.recorder.has_pending

    def ready_records(self) -> list[Record]:
        """The records of this step that backward has reached (what :meth:`propose` writes)."""
        return self.recorder.ready()

    @torch.no_grad()
    def propose(self) -> NewEntries | None:
        """The entries this step's records would write (nothing is written). Raises
        ``ValueError`` naming the layer if the rule produced non-finite entries (a read
        back to the host: the learners call :meth:`proposal` and read the faults of every
        layer at once)."""
        entries, fault = self.proposal()
        raise_first([self], fault[None])
        return entries

    @torch.no_grad()
    def proposal(self) -> tuple[NewEntries | None, Fault]:
        """:meth:`propose`'s entries, with the fault of its finiteness check instead of the
        error (:mod:`rcdl.nn.divergence`: the first of non-finite keys, values, weights;
        code 0 where all are finite), read nothing back. The learners pass the entries
        through the layer's :attr:`guard` before committing them."""
        records = self.ready_records()
        if not records:
            return None, no_fault(self.store.device)
        parts, samples = [], []
        for record in records:
            parts.append(self.make_entries(record))
            rows = record.q.shape[0]
            samples.append(record.samples if record.samples is not None else record.q.new_full(
                (rows,), UNKNOWN, dtype=torch.long))
        keys, values, weights = (torch.cat(p) for p in zip(*parts, strict=True))
        self._proposed_samples = torch.cat(samples)
        zero = weights.new_zeros((), dtype=torch.float64)
        fault = first_fault(*(torch.stack([zero + code, zero, zero]).where(
            ~torch.isfinite(t).all(), 0.0) for code, t in ((KEYS, keys), (VALUES, values),
                                                          (WEIGHTS, weights))))
        return (keys, values, weights), fault

    @torch.no_grad()
    def outputs_after(self, records: list[Record], keys: Tensor, values: Tensor,
                      weights: Tensor) -> Tensor | None:  # (B, d_out)
        """The outputs on the records' queries once ``(keys, values, weights)`` are appended
        (what the divergence guard reads, :meth:`rcdl.nn.divergence.DivergenceGuard.lookahead`;
        ``None`` where they cannot be had cheaply: a softmax forward that recorded no
        normaliser). Where the attention's guard changed a softmax denominator (negative
        weights) there is no cheap answer either: the recorded outputs ``s`` are returned
        in its place, which the divergence guard has already passed (a choice made on the
        device, with no read back). The age coefficients of the existing entries' next step
        are not applied."""
        q = torch.cat([r.q for r in records])  # (B, d_in)
        s = torch.cat([r.s for r in records])  # (B, d_out)
        new_entries = self.entries(keys, values, weights).replace(chunk_size=None)
        if not self.kernel.normalised:
            return s + attend(self.query_keys(q), new_entries)
        if any(r.normaliser is None for r in records):  # none recorded (top-k, the hybrid)
            return None
        m, den = (torch.cat(t) for t in zip(*(r.normaliser for r in records), strict=True))
        cheap = (den > 0).all()  # () False where the guard acted (negative weights)
        log_z = m + torch.log(den)  # (B,) of the pre-step store
        new = attend_partial(q, new_entries)  # the new entries alone
        top = torch.maximum(log_z, new.m)  # (B,)
        old_w, new_w = torch.exp(log_z - top), torch.exp(new.m - top)  # (B,)
        after = (s * old_w[:, None] + new.num * new_w[:, None]) / (
            old_w + new.den * new_w)[:, None]
        return torch.where(cheap, after, s)

    def query_keys(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B, key_dim)
        """Queries as the store's keys see them (the linear dual form appends a 1)."""
        return q

    def divergence_advice(self) -> str:
        """What a refusal for divergence tells the user to change: the rule's own advice
        where it has one (a rule whose step size is not simply its learning rate, such as
        gws's η, says what to change instead), else its learning rate; or the temperature."""
        advice = getattr(self.rule, "divergence_advice", None)
        step = advice() if advice is not None else f"lower the learning rate (rule {self.rule})"
        return f"{step}, or raise the temperature (T = {self.temperature}), or normalise its inputs"

    def make_entries(self, record: Record) -> NewEntries:
        return self.rule.entries(Step(record.q, record.s, record.grad_mean, record.n_samples))

    def num_entries_all_ranks(self) -> int:
        """Entries the layer stores over every rank if its store is sharded (then a
        collective, to call on every rank), else ``len(self.store)`` (this process's)."""
        return self.backend.size(self)

    @torch.no_grad()
    def commit(self, entries: NewEntries | None, ok: Tensor | None = None) -> None:
        """Append ``entries`` as :meth:`propose` returns them (checked finite there, so not
        again here) as written at the next step.

        ``ok`` (a ``()`` bool on the device, or ``None``: passed) is the verdict of a step
        whose checks are deferred (:class:`~rcdl.optim.grower.Grower`'s ``defer_checks``):
        where it is False the step was refused and the grower has zeroed ``entries``. They
        are appended all the same (their number is all the host knows), but the step
        counter advances by ``ok``, not 1, so no entry ages (weight decay, momentum) and
        the zero rows count as written at the last step that passed. Nothing is read back.
        """
        proposed, self._proposed_samples = self._proposed_samples, None
        self.discard()
        self.recorder.stepped = True
        if entries is None:
            return
        if ok is None:
            self.steps += 1
        else:  # a refused step leaves the counter: the entries' ages stay as they were
            self.steps += ok.to(self.steps.dtype)
        count = entries[0].shape[0]  # B, the same on every rank
        ids = self.store.new_ids(count)  # (B,) the batch's ids, the same on every rank
        self.provenance.record(ids, proposed if proposed is not None
                               and proposed.shape[0] == count else None,
                               end=self.store.next_id)
        if self.shard is not None:  # this rank stores its rows of the batch
            keep = self.shard.owned(count, entries[0].device,
                                    offset=int(self.steps) * count)  # (B,) bool
            keys, values, weights = entries
            entries, ids = (keys[keep], values[keep], weights[keep]), ids[keep]
        # checked finite by propose(); the write step as a tensor: no device sync
        self.store.append(*entries, written_at=self.steps, ids=ids, check_finite=False)

    def discard(self) -> None:
        """Forget this step's records without writing anything: records made so far are never
        written, even if their backward runs later."""
        self.recorder.discard()

    @torch.no_grad()
    def remove_entries(self, mask: Tensor) -> int:
        """Remove the entries where ``mask (N,)`` is True; returns how many were removed.
        What the layer keeps derived from its rows goes with them (:meth:`remove_rows`)."""
        return self.remove_rows(mask)[0]

    def remove_rows(self, mask: Tensor) -> tuple[int, list[str]]:
        """:meth:`remove_entries`, also saying what went with the rows, by name: the
        evaluation cache's partials, the top-k mode's index (rebuilt at its next call), and,
        in subclasses, per-step state over the rows (:meth:`release_rows`)."""
        removed = self.store.remove(mask)
        return removed, (self.release_rows() if removed else [])

    def rewrite_rows(self, rows: slice, *, keys: Tensor | None = None,
                     values: Tensor | None = None, weights: Tensor | None = None) -> list[str]:
        """Replace the keys, values and/or weights of the store's rows ``rows``
        (:meth:`rcdl.nn.store.EntryStore.rewrite`) and drop what the layer keeps derived
        from its rows (:meth:`release_rows`); returns what it dropped, by name."""
        self.store.rewrite(rows, keys=keys, values=values, weights=weights)
        return self.release_rows()

    @contextmanager
    def backend_wrapped(self, wrap: Callable[[Backend], Backend]) -> Iterator[None]:
        """Within the block, attend through ``wrap(backend)`` (as :meth:`wrap_backend`);
        the backend of before is back after it."""
        before = self.backend
        self.wrap_backend(wrap)
        try:
            yield
        finally:
            self.backend = before

    @torch.no_grad()
    def take_back_rows(self, size: int, next_id: int) -> None:
        """Take back the rows appended since the store held ``size`` rows and handed out
        ids up to ``next_id`` (the zero rows of a step refused at a deferred check, when a
        memory budget reads the step's verdict): the store and the provenance map as they
        were then (:meth:`rcdl.nn.store.EntryStore.rewind`)."""
        if len(self.store) == size and self.store.next_id == next_id:
            return
        self.release_rows()
        self.store.rewind(size, next_id)
        self.provenance.rewind(next_id)

    def release_rows(self) -> list[str]:
        """Drop what the layer keeps derived from its rows (they changed); returns what it
        dropped, by name."""
        dropped = []
        cache = find(self.backend, EvalCached)
        if cache is not None and cache.slots:
            self._eval_hits += cache.hits  # a fresh cache: nothing of the old partials
            self.backend = compose(self.backend, cache=EvalCached())
            dropped.append("evaluation cache")
        mode = self.retrieval
        if mode is not None and mode.rows_removed():
            dropped.append("top-k index")
        return dropped

    @torch.no_grad()
    def drop_last_step(self) -> int:
        """Undo the last growth step: remove the entries it wrote (``written_at`` is the
        current step; the zero rows of steps refused at a deferred check since, written at
        the same step, go with them) and step the counter back, so the layer computes what
        it did before that step (weight decay and momentum included). Returns how many
        entries went. Not undone: evictions by a memory budget, and the hybrid's Adam moves
        of the other entries."""
        if int(self.steps) == 0:
            return 0
        removed = self.remove_entries(self.store.written_at == self.steps)
        self.steps -= 1
        return removed

    def extra_repr(self) -> str:
        return (
            f"{self.d_in} -> {self.d_out}, kernel={self.kernel}, T={self.temperature}, "
            f"rule={self.rule}, steps={int(self.steps)}"
        )


class GrowingLinear(GrowingLayer):
    """The exact dual form of ``nn.Linear`` trained by SGD (docs/reference.md §1, §3).

    ``s(q) = r(t) (W_0 q + b_0) + Σ_j h(a_j) v_j ⟨k_j, [q, 1]⟩`` with keys ``k_j = [q_j, 1]``
    (the bias is the weight of a constant input), values ``v_j = −η ḡ_j`` and the age
    coefficients ``r, h`` of weight decay and momentum (:mod:`rcdl.nn.age`). With
    ``rule=FunctionalSGD(lr, weight_decay, momentum, per_sample=False)``, after any number of
    steps it computes exactly what ``nn.Linear`` trained by ``torch.optim.SGD(lr,
    momentum=momentum, weight_decay=weight_decay)`` on the same batches computes.

    Example:
        >>> layer = GrowingLinear(8, 3, rule=FunctionalSGD(0.1, per_sample=False))
    """

    rule: FunctionalSGD
    weight0: Tensor  # buffer (d_out, d_in): the initial weight W_0
    bias0: Tensor | None  # buffer (d_out,): the initial bias b_0, None without a bias

    def __init__(self, d_in: int, d_out: int, *, rule: FunctionalSGD, bias: bool = True,
                 **kw) -> None:
        if not isinstance(rule, FunctionalSGD) or rule.per_sample:
            raise TypeError(
                "GrowingLinear is the dual form of SGD on the batch-mean loss: its rule must be "
                f"FunctionalSGD(lr, weight_decay, momentum, per_sample=False), got {rule!r}")
        super().__init__(d_in, d_out, kernel="linear", rule=rule, key_dim=d_in + bias, **kw)
        self.has_bias = bias
        dtype, device = self.store.dtype, self.store.device
        self.register_buffer("weight0", torch.zeros(d_out, d_in, dtype=dtype, device=device))
        bias0 = torch.zeros(d_out, dtype=dtype, device=device) if bias else None
        self.register_buffer("bias0", bias0)
        bound = 1 / math.sqrt(d_in)  # nn.Linear's default init
        nn.init.uniform_(self.weight0, -bound, bound)
        if bias0 is not None:
            nn.init.uniform_(bias0, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> GrowingLinear:
        """The dual form of ``linear`` from its current weights (``rule`` etc. in ``kw``)."""
        w = linear.weight.detach()
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            dtype=w.dtype,
            device=w.device,
            **kw,
        )
        layer.weight0.copy_(w)
        if linear.bias is not None and layer.bias0 is not None:
            layer.bias0.copy_(linear.bias.detach())
        return layer

    def _augment(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B, d_in + bias)
        return F.pad(q, (0, 1), value=1.0) if self.has_bias else q

    query_keys = _augment

    def output(self, q: Tensor) -> Tensor:
        r = self.rule.ages.initial(int(self.steps))
        return r * F.linear(q, self.weight0, self.bias0) + self.attend(self._augment(q))

    def make_entries(self, record: Record) -> NewEntries:
        keys, values, weights = super().make_entries(record)
        return self._augment(keys), values, weights

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """The ``nn.Linear`` computing what this layer computes now, whatever its store size.

        The linear kernel's attention is a sum of rank-one maps (docs/reference.md §1, §3):
        ``s(q) = r(T)(W₀q + b₀) + Σ_j c_j v_j ⟨k_j, [q; 1]⟩`` with ``c_j = w_j h(a_j)`` the
        entry's weight times its age coefficient (weight decay, momentum) and ``r(T)`` the
        initial weight's factor after T steps. So ``W = r(T) W₀ + Σ_j c_j v_j k_jᵀ`` (the
        key's last component gives the bias): one ``(d_out, N) @ (N, d_in + 1)`` product,
        then ``O(d_in d_out)`` per query instead of ``O(N (d_in + d_out))``. Exact up to
        rounding (``tests/test_dual_form.py``); the layer keeps training, the copy does not
        follow it. A sharded store sums its ranks' shares (every rank gets the same layer).
        """
        dtype = self.weight0.dtype
        coef = self.entry_weights().to(dtype)  # (N,) c_j
        keys, values = self.store.keys.to(dtype), self.store.values.to(dtype)
        delta = (values * coef[:, None]).T @ keys  # (d_out, d_in + bias) Σ_j c_j v_j k_jᵀ
        if self.shard is not None:
            delta = self.shard.all_reduce(delta.contiguous())
        r = self.rule.ages.initial(int(self.steps))
        linear = nn.Linear(self.d_in, self.d_out, bias=self.has_bias, dtype=dtype,
                           device=self.weight0.device)
        linear.weight.copy_(r * self.weight0 + delta[:, : self.d_in])
        if self.bias0 is not None:  # has_bias
            linear.bias.copy_(r * self.bias0 + delta[:, self.d_in])
        return linear


class GrowingRBF(GrowingLayer):
    """Growing RBF layer: ``s(q) = Σ_j h(a_j) exp(−‖q − k_j‖² / (2T√d_in)) v_j``
    (docs/reference.md §2).

    Starts empty; with ``rule=FunctionalSGD(lr)`` each sample appends ``k = q``, ``v = −η g``
    with the per-sample gradient (the RKHS functional gradient, docs/reference.md §3).
    docs/reference.md §6 uses T = 10, η = 10.

    Example:
        >>> layer = GrowingRBF(8, 3, temperature=10.0, rule=FunctionalSGD(10.0))
    """

    def __init__(self, d_in: int, d_out: int, *, temperature: float, rule: LearningRule,
                 **kw) -> None:
        super().__init__(d_in, d_out, kernel="rbf", temperature=temperature, rule=rule, **kw)


class GrowingLaplacian(GrowingLayer):
    """Growing Laplacian-kernel layer: ``s(q) = Σ_j h(a_j) exp(−‖q − k_j‖ / (T√d_in)) v_j``
    (:class:`rcdl.ops.kernels.LaplacianKernel`).

    A positive-definite kernel like the RBF, so ``rule=FunctionalSGD(lr)`` is again the
    functional gradient step, ``k = q``, ``v = −η g`` (docs/theory.md). Its tails are heavier
    than the RBF's: an entry still answers queries several length scales away.

    Example:
        >>> layer = GrowingLaplacian(8, 3, temperature=0.5, rule=FunctionalSGD(10.0))
    """

    def __init__(self, d_in: int, d_out: int, *, temperature: float, rule: LearningRule,
                 **kw) -> None:
        super().__init__(d_in, d_out, kernel="laplacian", temperature=temperature, rule=rule,
                         **kw)


class GrowingSoftmax(GrowingLayer):
    """Growing weighted-softmax layer (docs/reference.md §2):
    ``s(q) = Σ_j e^{z_j} ṽ_j / Σ_j w_j e^{z_j}``.

    The store keeps weighted values ``ṽ_j`` and weights ``w_j``; logits are
    ``z_j = ⟨q, k_j⟩ / (T √d_in)``. ``rule`` is :class:`rcdl.nn.rules.ClippedSoftmaxRule` ("gws",
    optionally normalised by ``1/Z``) or :class:`rcdl.nn.rules.GaugeSoftmaxRule`.

    Args:
        initial_entries: the starting database of docs/reference.md §6 — this many entries with
            RMS-normalised random keys and weighted values, weight ``1/initial_entries`` each.
        seed: seed of those initial entries (default: torch's global generator).
    """

    def __init__(self, d_in: int, d_out: int, *, temperature: float, rule: LearningRule,
                 initial_entries: int = 16, seed: int | None = None, **kw) -> None:
        super().__init__(d_in, d_out, kernel="softmax", temperature=temperature, rule=rule,
                         **kw)
        if initial_entries < 0:
            raise ValueError(f"initial_entries must be >= 0, got {initial_entries}")
        if initial_entries == 0 and rule.needs_log_normalizer:
            raise ValueError(
                f"{type(self).__name__}: the 1/Z-normalised rule {rule} divides every entry by "
                "Z(q) = Σ_j w_j e^{⟨q, k_j⟩/τ} of the store, which is 0 for an empty store: "
                "give initial_entries >= 1 (docs/reference.md §6 uses 16)")
        if initial_entries:
            gen = None if seed is None else torch.Generator().manual_seed(seed)
            keys = _rms_normalised(torch.randn(initial_entries, d_in, generator=gen))
            values = _rms_normalised(torch.randn(initial_entries, d_out, generator=gen))
            dtype, device = self.store.dtype, self.store.device
            self.store.append(keys.to(dtype=dtype, device=device),
                              values.to(dtype=dtype, device=device),
                              torch.full((initial_entries,), 1 / initial_entries, dtype=dtype,
                                         device=device))

    @torch.no_grad()
    def log_normalizer(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B,)
        """``log Z(q) = log Σ_j w_j e^{⟨q, k_j⟩/τ}`` over the current store."""
        # the normaliser needs no values: attend with a zero-width slice of them
        part = self.backend.partial(self, q, self.entries(values=self.store.values[:, :0],
                                                          weights=self.store.weights))
        return part.m + torch.log(part.den)

    def make_entries(self, record: Record) -> NewEntries:
        def log_z() -> Tensor:  # (B,) the forward's normaliser, else one pass to find it
            if record.normaliser is None:
                return self.log_normalizer(record.q)
            m, den = record.normaliser
            return m + torch.log(den)

        return self.rule.entries(Step(record.q, record.s, record.grad_mean, record.n_samples,
                                      log_z=log_z))


class ParametricSoftmax(nn.Module):
    """A fixed table of weighted-softmax entries trained as parameters (docs/reference.md §5).

    Same function as :class:`GrowingSoftmax`, but ``keys (N, d_in) ~ N(0, 1)/√d_in``,
    weighted values ``(N, d_out) ~ N(0, 0.02²)`` and weights ``(N,) = 1`` are
    ``nn.Parameter``s updated by an optimizer (Adam 1e−3 in the paper), T = 3.
    """

    def __init__(self, d_in: int, d_out: int, entries: int, *, temperature: float = 3.0,
                 chunk_size: int | None = None) -> None:
        super().__init__()
        softmax_scale(temperature, d_in)
        if entries < 1:
            raise ValueError(f"ParametricSoftmax needs at least one entry, got {entries}")
        self.temperature, self.chunk_size = temperature, chunk_size
        self.keys = nn.Parameter(torch.randn(entries, d_in) / math.sqrt(d_in))
        self.values = nn.Parameter(torch.randn(entries, d_out) * 0.02)
        self.weights = nn.Parameter(torch.ones(entries))

    def forward(self, x: Tensor) -> Tensor:  # (..., d_in) -> (..., d_out)
        q = x.reshape(-1, x.shape[-1])
        s = attention(q, self.keys, self.values, self.weights, kernel="softmax",
                      temperature=self.temperature, chunk_size=self.chunk_size)
        return s.reshape(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        n, d_in = self.keys.shape
        return f"{d_in} -> {self.values.shape[1]}, entries={n}, T={self.temperature}"


def _rms_normalised(x: Tensor) -> Tensor:  # (N, d) rows scaled to unit RMS
    return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True))


def growing_layers(model: nn.Module) -> list[tuple[str, GrowingLayer]]:
    """All growing layers of ``model`` with their module paths."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GrowingLayer)]


def set_store_dtype(model: nn.Module, store_dtype: torch.dtype | None) -> nn.Module:
    """Keep the keys and values of every growing layer of ``model`` as ``store_dtype``
    (``torch.bfloat16``, ``torch.float16``, or ``None`` for the layer's own dtype), converting
    the entries held; returns ``model``. See docs/precision.md."""
    for _, layer in growing_layers(model):
        layer.store.set_storage_dtype(store_dtype)
    return model
