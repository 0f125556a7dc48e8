"""Growing layers: modules that answer by attention over their own entry store (SPEC §2–3).

A growing layer's forward pass is ordinary PyTorch: differentiable w.r.t. its input, so
gradients flow to earlier layers. In training mode (with grad enabled) it also records
what a learning rule needs — the query, the output computed from the pre-step store, and
(through a hook) the gradient of the loss w.r.t. that output. :class:`rcdl.grower.Grower`
then turns those records into new entries, after ``loss.backward()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.attention import attention, attention_partial
from rcdl.kernels import check_kernel, softmax_scale
from rcdl.rules import Entries, FunctionalSGD
from rcdl.store import EntryStore

__all__ = [
    "GrowingLayer", "GrowingLinear", "GrowingRBF", "GrowingSoftmax", "ParametricSoftmax",
    "growing_layers",
]


@dataclass
class _Record:
    """One training-mode call of a layer: what its rule needs after ``backward()``."""

    q: Tensor  # (B, d_in) the query, detached
    s: Tensor  # (B, d_out) the output from the pre-step store, detached
    n_samples: int  # samples the batch-mean loss averages over (leading dim of the input)
    grad: Tensor | None = None  # (B, d_out) ∂(mean loss)/∂s, set by the hook

    def set_grad(self, grad: Tensor) -> None:
        self.grad = grad.detach() if self.grad is None else self.grad + grad.detach()


class GrowingLayer(nn.Module):
    """Base class: a layer ``d_in → d_out`` over an :class:`EntryStore` and a learning rule.

    Args:
        d_in, d_out: widths. Inputs may have any leading dims ``(..., d_in)``; the first
            one is the sample dimension the loss averages over.
        kernel: ``"linear"``, ``"rbf"`` or ``"softmax"`` (:mod:`rcdl.kernels`).
        temperature: T, with ``τ = T √d_in`` (RBF and softmax).
        rule: the learning rule writing this layer's entries (:mod:`rcdl.rules`).
        key_dim: width of the stored keys, if not ``d_in``.
        capacity: entries to allocate up front (e.g. the number of training samples).
        chunk_size: entries per block of the streaming attention (default: automatic).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        kernel: str,
        temperature: float = 1.0,
        rule,  # noqa: ANN001 - any object with .entries(q, s, grad_mean, n_samples)
        key_dim: int | None = None,
        capacity: int = 0,
        chunk_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.kernel = check_kernel(kernel)
        self.temperature = temperature
        softmax_scale(temperature, d_in)  # validates the temperature
        self.rule = rule
        self.chunk_size = chunk_size
        self.store = EntryStore(
            key_dim or d_in, d_out, capacity=capacity, dtype=dtype, device=device
        )
        self.register_buffer("steps", torch.zeros((), dtype=torch.long, device=device))
        self.name = type(self).__name__  # set to the module path by the Grower
        self._records: list[_Record] = []

    # ---------------------------------------------------------------- forward
    def entry_weights(self) -> Tensor:  # (N,)
        """The per-entry weights handed to the attention (age coefficients, SPEC §3)."""
        ages = getattr(self.rule, "ages", None)
        if ages is None or ages.trivial:
            return self.store.weights
        age = self.steps - self.store.written_at  # (N,)
        return ages.entry(age).to(self.store.dtype)

    def attend(self, q: Tensor) -> Tensor:  # (B, key_dim) -> (B, d_out)
        """Attention from (already prepared) queries over the whole store."""
        return attention(
            q,
            self.store.keys,
            self.store.values,
            self.entry_weights(),
            kernel=self.kernel,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
        )

    def output(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B, d_out)
        """The layer's function ``s(q)`` (subclasses add their parametric part)."""
        return self.attend(q)

    def forward(self, x: Tensor) -> Tensor:  # (..., d_in) -> (..., d_out)
        q = self._check_input(x).reshape(-1, self.d_in)  # (B, d_in)
        s = self.output(q)  # (B, d_out)
        if self.training and torch.is_grad_enabled():
            if not s.requires_grad:  # nothing upstream is trainable: make s the leaf
                s = s.detach().requires_grad_()
            record = _Record(q.detach(), s.detach(), n_samples=x.shape[0])
            s.register_hook(record.set_grad)
            self._records.append(record)
        return s.reshape(*x.shape[:-1], self.d_out)

    def _check_input(self, x: Tensor) -> Tensor:
        where = f"{type(self).__name__} {self.name!r}"
        if x.dim() < 2 or x.shape[-1] != self.d_in:
            raise ValueError(f"{where}: expected input (..., {self.d_in}), got {tuple(x.shape)}")
        if x.shape[0] == 0 or x.numel() == 0:
            raise ValueError(f"{where}: empty batch {tuple(x.shape)}")
        if x.dtype != self.store.dtype:
            raise TypeError(f"{where}: input dtype {x.dtype} != layer dtype {self.store.dtype}")
        if x.device != self.store.device:
            raise ValueError(f"{where}: input on {x.device}, layer on {self.store.device}")
        if not torch.isfinite(x).all():
            raise ValueError(f"{where}: input contains NaN or inf")
        return x

    # ---------------------------------------------------------------- growth
    @torch.no_grad()
    def propose(self) -> Entries | None:
        """The entries this step's records would write, validated (nothing is written)."""
        if not self._records:
            return None
        where = f"{type(self).__name__} {self.name!r}"
        parts = []
        for record in self._records:
            if record.grad is None:
                raise RuntimeError(
                    f"{where} ran forward in training mode but got no gradient: call "
                    "loss.backward() before Grower.step(), and make the loss depend on it"
                )
            if not torch.isfinite(record.grad).all():
                raise ValueError(
                    f"{where}: the output gradient contains NaN or inf; no entry written"
                )
            parts.append(self.make_entries(record))
        keys, values, weights = (torch.cat(p) for p in zip(*parts, strict=True))
        for name, t in (("keys", keys), ("values", values), ("weights", weights)):
            if not torch.isfinite(t).all():
                raise ValueError(f"{where}: the rule produced non-finite {name}; no entry written")
        return keys, values, weights

    def make_entries(self, record: _Record) -> Entries:
        return self.rule.entries(record.q, record.s, record.grad, record.n_samples)

    @torch.no_grad()
    def commit(self, entries: Entries | None) -> None:
        """Append ``entries`` (from :meth:`propose`) as written at the next step."""
        self._records.clear()
        if entries is None:
            return
        self.steps += 1
        self.store.append(*entries, written_at=int(self.steps))

    def discard(self) -> None:
        """Forget this step's records without writing anything."""
        self._records.clear()

    @torch.no_grad()
    def remove_entries(self, mask: Tensor) -> int:
        """Remove the entries where ``mask (N,)`` is True (and any per-entry state that
        subclasses keep beside them); returns how many were removed."""
        return self.store.remove(mask)

    def extra_repr(self) -> str:
        return (
            f"{self.d_in} -> {self.d_out}, kernel={self.kernel}, T={self.temperature}, "
            f"rule={self.rule}, steps={int(self.steps)}"
        )


class GrowingLinear(GrowingLayer):
    """The exact dual form of ``nn.Linear`` trained by SGD (SPEC §1, §3).

    ``s(q) = r(t) (W_0 q + b_0) + Σ_j h(a_j) v_j ⟨k_j, [q, 1]⟩`` with keys ``k_j = [q_j, 1]``
    (the bias is the weight of a constant input), values ``v_j = −η ḡ_j`` and the age
    coefficients ``r, h`` of weight decay and momentum (:mod:`rcdl.age`). After any number of
    steps it computes exactly what ``nn.Linear`` trained by ``torch.optim.SGD(lr,
    momentum=momentum, weight_decay=weight_decay)`` on the same batches computes.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        bias: bool = True,
        **kw,
    ) -> None:
        rule = FunctionalSGD(lr, weight_decay, momentum, per_sample=False)
        super().__init__(d_in, d_out, kernel="linear", rule=rule, key_dim=d_in + bias, **kw)
        self.has_bias = bias
        factory = {"dtype": self.store.dtype, "device": self.store.device}
        self.register_buffer("weight0", torch.zeros(d_out, d_in, **factory))
        self.register_buffer("bias0", torch.zeros(d_out, **factory) if bias else None)
        bound = 1 / math.sqrt(d_in)  # nn.Linear's default init
        nn.init.uniform_(self.weight0, -bound, bound)
        if bias:
            nn.init.uniform_(self.bias0, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> GrowingLinear:
        """The dual form of ``linear`` from its current weights (``lr`` etc. in ``kw``)."""
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
        if linear.bias is not None:
            layer.bias0.copy_(linear.bias.detach())
        return layer

    def _augment(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B, d_in + bias)
        return F.pad(q, (0, 1), value=1.0) if self.has_bias else q

    def output(self, q: Tensor) -> Tensor:
        r = self.rule.ages.initial(int(self.steps))
        return r * F.linear(q, self.weight0, self.bias0) + self.attend(self._augment(q))

    def make_entries(self, record: _Record) -> Entries:
        keys, values, weights = super().make_entries(record)
        return self._augment(keys), values, weights


class GrowingRBF(GrowingLayer):
    """Growing RBF layer: ``s(q) = Σ_j h(a_j) exp(−‖q − k_j‖² / (2T√d_in)) v_j`` (SPEC §2).

    Starts empty; each sample appends ``k = q``, ``v = −η g`` with the per-sample gradient
    (the RKHS functional gradient, SPEC §3). SPEC §6 uses T = 10, η = 10.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        temperature: float,
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        **kw,
    ) -> None:
        rule = FunctionalSGD(lr, weight_decay, momentum, per_sample=True)
        super().__init__(d_in, d_out, kernel="rbf", temperature=temperature, rule=rule, **kw)


class GrowingSoftmax(GrowingLayer):
    """Growing weighted-softmax layer (SPEC §2): ``s(q) = Σ_j e^{z_j} ṽ_j / Σ_j w_j e^{z_j}``.

    The store keeps weighted values ``ṽ_j`` and weights ``w_j``; logits are
    ``z_j = ⟨q, k_j⟩ / (T √d_in)``. ``rule`` is :class:`rcdl.rules.ClippedSoftmaxRule` ("gws",
    optionally the exact ``1/Z`` rule) or :class:`rcdl.rules.GaugeSoftmaxRule`.

    Args:
        initial_entries: the starting database of SPEC §6 — this many entries with
            RMS-normalised random keys and weighted values, weight ``1/initial_entries`` each.
        seed: seed of those initial entries (default: torch's global generator).
    """

    def __init__(self, d_in: int, d_out: int, *, temperature: float, rule,  # noqa: ANN001
                 initial_entries: int = 16, seed: int | None = None, **kw) -> None:
        super().__init__(d_in, d_out, kernel="softmax", temperature=temperature, rule=rule,
                         **kw)
        if initial_entries < 0:
            raise ValueError(f"initial_entries must be >= 0, got {initial_entries}")
        if initial_entries:
            gen = None if seed is None else torch.Generator().manual_seed(seed)
            keys = _rms_normalised(torch.randn(initial_entries, d_in, generator=gen))
            values = _rms_normalised(torch.randn(initial_entries, d_out, generator=gen))
            factory = {"dtype": self.store.dtype, "device": self.store.device}
            self.store.append(keys.to(**factory), values.to(**factory),
                              torch.full((initial_entries,), 1 / initial_entries, **factory))

    @torch.no_grad()
    def log_normalizer(self, q: Tensor) -> Tensor:  # (B, d_in) -> (B,)
        """``log Z(q) = log Σ_j w_j e^{⟨q, k_j⟩/τ}`` over the current store."""
        # the normaliser needs no values: attend with a zero-width slice of them
        part = attention_partial(q, self.store.keys, self.store.values[:, :0], self.store.weights,
                                 kernel="softmax", temperature=self.temperature,
                                 chunk_size=self.chunk_size)
        return part.m + torch.log(part.den)

    def make_entries(self, record: _Record) -> Entries:
        log_z = self.log_normalizer(record.q) if self.rule.needs_log_normalizer else None
        return self.rule.entries(record.q, record.s, record.grad, record.n_samples, log_z)


class ParametricSoftmax(nn.Module):
    """A fixed table of weighted-softmax entries trained as parameters (SPEC §5).

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
