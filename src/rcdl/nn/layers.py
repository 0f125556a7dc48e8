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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.nn.backends import (
    LayerBackend,
    release_rows,
    retrieval_of,
    shard_of,
    use_retrieval,
    use_shard,
)
from rcdl.nn.records import EvalModeOutput, Record, Recorder
from rcdl.nn.rules import FunctionalSGD, LearningRule, NewEntries, Step
from rcdl.nn.sample_map import SampleMap
from rcdl.nn.store import EntryStore
from rcdl.ops.attention import attention
from rcdl.ops.entries import Entries
from rcdl.ops.half import PRODUCTS
from rcdl.ops.kernels import Kernel, check_kernel, softmax_scale
from rcdl.ops.packed import PACKED
from rcdl.ops.plan import options_from, options_tensor, record_layer

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

    A growing layer is a store, a kernel, a rule, a backend and a forward: it answers. What
    writes it is the learner's (:mod:`rcdl.optim._step`: propose, commit, undo a step; the
    divergence guard, :mod:`rcdl.nn.divergence`); how it attends is composed by the
    functions of :mod:`rcdl.nn.backends` (``use_shard``, ``use_retrieval``, the evaluation
    cache, ``wrap_backend``).

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
            nothing. ``None`` turns the scale checks off. The learner's divergence guard
            reads it at every step (:class:`~rcdl.nn.divergence.DivergenceGuard`).
        store_dtype: what the store keeps keys and values as (default: the layer's dtype);
            ``torch.bfloat16`` or ``torch.float16`` halve its bytes, and where the CPU
            multiplies bf16 natively also the attention's time (docs/precision.md).
        half_products: how a half store multiplies (:mod:`rcdl.ops.half`); ``None``: the
            process default. Saved in the state dict; each call plans by it.
        packing: whether full chunks multiply from packed copies (:mod:`rcdl.ops.packed`), as above.
    """

    steps: Tensor  # buffer (): the growth steps taken so far
    trains_entries = False  # True where an optimizer moves stored entries (the hybrid)
    _stats: list | None = None  # set during a recording forward of a softmax layer

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
        packing: str | None = None,
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
        if max_output_growth is not None and not max_output_growth > 1:
            raise ValueError(f"max_output_growth must be > 1 or None, got {max_output_growth}")
        self.rule = rule
        self.chunk_size = chunk_size
        # how the products run (rcdl.ops.plan; None: the process defaults), saved with it
        self.half_products = None if half_products is None else PRODUCTS.check(half_products)
        self.packing = None if packing is None else PACKED.check(packing)
        self.max_output_growth = max_output_growth  # the divergence guard's limit
        self.store = EntryStore(key_dim or d_in, d_out, capacity=capacity, dtype=dtype,
                                storage_dtype=store_dtype, device=device)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long, device=device))
        self.name = type(self).__name__  # set to the module path by the Grower
        self.recorder = Recorder()  # this step's training-mode calls (rcdl.nn.records)
        self.provenance = SampleMap(device=device)  # entry id -> training sample
        # how the layer attends: the chain of rcdl.nn.backends wrappers, composed there
        self.backend = LayerBackend()

    # the shard of a store split over ranks and the top-k mode, read and set through
    # rcdl.nn.backends (else None)
    shard = property(shard_of, use_shard)
    retrieval = property(retrieval_of, use_retrieval)

    # ---------------------------------------------------------------- written by learners
    def bind_name(self, name: str) -> None:
        """The layer's module path in its model, as errors and state dicts name it (set by
        the optimizer that steps it: :class:`~rcdl.optim.grower.Grower`, ``EntryAdam``)."""
        self.name = name or type(self).__name__

    def set_learning_rate(self, lr: float) -> None:
        """Replace the rule by the same rule with learning rate ``lr`` (a scheduler's step,
        through the grower's ``param_groups``)."""
        if lr != self.rule.lr:
            self.rule = self.rule.with_lr(lr)

    def count_steps(self, by: Tensor | int = 1) -> None:
        """Advance the growth step counter by ``by`` (a ``()`` tensor on the device: nothing
        is read back; ``-1`` steps it back): the counter the age coefficients read."""
        self.steps += by

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
        product options; ``keys``, ``values``, ``weights`` replace the store's (the
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
                       packed=store.packed_chunks if own_rows else None, packing=self.packing)

    def get_extra_state(self) -> Tensor:  # (2,) the product options, rcdl.ops.plan's codes
        return options_tensor(self.half_products, self.packing)

    def set_extra_state(self, state: object) -> None:
        self.half_products, self.packing = options_from(state, self.name)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:  # noqa: ANN001, ANN002
        state_dict.setdefault(prefix + "_extra_state", self.get_extra_state())  # none saved: keep
        super()._load_from_state_dict(state_dict, prefix, *args)

    def attend(self, q: Tensor) -> Tensor:  # (B, key_dim) -> (B, d_out)
        """Attention from (already prepared) queries over the whole store (every rank's
        shard of it, if the store is sharded: :mod:`rcdl.distributed`), through
        :attr:`backend` (top-k where a retrieval mode applies, the evaluation cache for
        no-grad calls, docs/architecture.md)."""
        return self.backend.attend(self, q, None, self._stats)

    def output(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B, d_out)
        """The layer's function ``s(q)`` (subclasses add their parametric part)."""
        return self.attend(q)

    @_run_eagerly  # records and hooks are Python side effects
    def forward(self, x: Tensor) -> Tensor:  # (..., d_in) -> (..., d_out)
        recording = self.training and torch.is_grad_enabled()
        # deferred checks: the guard checks a recorded query for NaN/inf on the device
        q = self._check_input(x, finite=not (recording and self.recorder.deferred))
        q = q.reshape(-1, self.d_in)  # (B, d_in)
        record_layer(self.name, self.store.keys.dtype, self.half_products, self.packing)
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

    # ---------------------------------------------------------------- the rule's view
    def query_keys(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B, key_dim)
        """Queries as the store's keys see them (the linear dual form appends a 1)."""
        return q

    def make_entries(self, record: Record) -> NewEntries:
        """The rule's entries for ``record``'s rows, as the store keeps them."""
        return self.rule.entries(Step(record.q, record.s, record.grad_mean, record.n_samples))

    def num_entries_all_ranks(self) -> int:
        """Entries the layer stores over every rank if its store is sharded (then a
        collective, to call on every rank), else ``len(self.store)`` (this process's)."""
        return self.backend.size(self)

    # ---------------------------------------------------------------- rows changed
    @torch.no_grad()
    def remove_entries(self, mask: Tensor, released: list[str] | None = None) -> int:
        """Remove the entries where ``mask (N,)`` is True; returns how many were removed.
        What the layer keeps derived from its rows goes with them (:meth:`release_rows`),
        named in ``released`` where a list is given. The one door every removal takes: a
        budget's eviction, a shard's split, an undone step, a forget."""
        removed = self.store.remove(mask)
        if removed:
            (released if released is not None else []).extend(self.release_rows())
        return removed

    def rewrite_rows(self, rows: slice, *, keys: Tensor | None = None,
                     values: Tensor | None = None, weights: Tensor | None = None) -> list[str]:
        """Replace the keys, values and/or weights of the store's rows ``rows``
        (:meth:`rcdl.nn.store.EntryStore.rewrite`) and drop what the layer keeps derived
        from its rows (:meth:`release_rows`); returns what it dropped, by name."""
        self.store.rewrite(rows, keys=keys, values=values, weights=weights)
        return self.release_rows()

    def release_rows(self) -> list[str]:
        """Drop what the layer keeps derived from its rows (they changed): the backend's
        (:func:`rcdl.nn.backends.release_rows`) and, in subclasses, their own; returns what
        it dropped, by name."""
        return release_rows(self)

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
