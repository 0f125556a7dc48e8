"""Kernels of growing layers and their dense reference twin (docs/reference.md §2).

With ``τ = T √d_in`` and per-entry weights ``w_j``:

- ``linear``    (dual form):   ``s(q) = Σ_j w_j ⟨q, k_j⟩ v_j``
- ``rbf``       (growing RBF): ``s(q) = Σ_j w_j exp(−‖q − k_j‖² / (2τ)) v_j``
- ``laplacian``: ``s(q) = Σ_j w_j exp(−‖q − k_j‖ / τ) v_j``, a positive-definite kernel like
  the RBF (the functional-gradient rule of docs/theory.md applies to it unchanged)
- ``softmax`` (weighted softmax over weighted values ``ṽ_j = w_j v_j``):
  ``s(q) = Σ_j e^{z_j} ṽ_j / Σ_j w_j e^{z_j}`` with ``z_j = ⟨q, k_j⟩ / τ``.

Each kernel is an object (:class:`Kernel`) in the registry :data:`KERNELS`, by name. The
streaming attention (:mod:`rcdl.ops.attention`), top-k retrieval (:mod:`rcdl.retrieval.topk`),
bounded memory (:mod:`rcdl.memory.budgets`) and the layers ask the object, never the name, for
what differs between kernels. Adding a kernel is one class here (docs/architecture.md,
"Adding a kernel"); the tests parametrised over :data:`KERNELS` then cover it.

For the linear and RBF kernels the weights are per-entry multipliers (the age
coefficients of docs/reference.md §3; ones when there is no decay or momentum). For the softmax they
enter the denominator only, because the stored values are already weighted.

The softmax denominator ``D = Σ_j w_j e^{z_j − m}`` (``m`` any shift, in practice the largest
logit) is kept at least ``eps · M`` away from zero with its sign, where
``M = Σ_j |w_j| e^{z_j − m} ≥ |D|`` is the weight mass: trained entries (the hybrid network,
docs/reference.md §4) may make ``D`` vanish or go negative, and the output must stay finite. Because
the floor scales with ``e^{−m}`` like ``D`` and the numerator, ``m`` cancels from the guarded
output too, so the guarded function is a function of the entries alone and its gradient is
exact in both regimes (:func:`guard_denominator`). With non-negative weights (the growing
rules) ``M = D`` and the guard never acts. A store with no weight mass at all (``M = 0``:
empty, or every weight zero) answers 0.

:func:`naive_attention` is the dense few-line twin of the streaming attention in
:mod:`rcdl.ops.attention`; tests compare the two on outputs and every gradient.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

__all__ = [
    "KERNELS", "Kernel", "LaplacianKernel", "LinearKernel", "RBFKernel", "SoftmaxKernel",
    "check_kernel", "guard_denominator", "naive_attention", "register_kernel", "row_sq_norms",
    "sdpa_softmax_attention", "softmax_scale",
]  # fmt: skip


class Kernel:
    """What the streaming attention, retrieval, memory and the layers need of a kernel
    ``φ(q, k)``, as a function of the dot product ``s = ⟨q, k⟩`` and, for a *distance*
    kernel, of ``‖q‖²`` and ``‖k‖²`` (``φ = f(‖q − k‖²)``, ``‖q − k‖² = ‖q‖² − 2s + ‖k‖²``).

    A kernel is *normalised* (the softmax) when the layer's output is
    ``Σ_j e^{z_j} ṽ_j / Σ_j w_j e^{z_j}`` with logits ``z_j``; otherwise it is
    ``Σ_j w_j φ_j v_j``. Instances are stateless and compare equal to their name, so
    ``layer.kernel == "rbf"`` keeps working.

    Per chunk of ``c`` entries and ``B`` queries (all blocks are ``(c, B)``, entry-major):

    - :meth:`values_` turns the chunk's dot products into kernel values (normalised kernels:
      logits), in place;
    - :meth:`grad_factor_` turns ``∂L/∂φ`` into ``∂L/∂s / scale`` in place, given the
      block of kernel values; the attention then applies :meth:`scale` (``∂s``'s factor,
      ``1/τ`` or 1) and, for distance kernels, the ``−q Σ_j c_j`` and ``−k Σ_b c_b`` terms of
      ``∂‖q − k‖²``.

    For the tests, :meth:`dense` is the kernel's dense ``(B, N)`` reference. For retrieval,
    :attr:`index_metric` is the index whose nearest keys carry the largest kernel values
    (``None``: no top-k) and :meth:`log_kernel` the log-kernel of an index score. For bounded
    memory, :attr:`bounded` says ``0 < φ ≤ 1`` (an entry's contribution is at most
    ``|w_j| ‖v_j‖``).
    """

    name: ClassVar[str]
    normalised: ClassVar[bool] = False
    distance: ClassVar[bool] = False
    bounded: ClassVar[bool] = True
    index_metric: ClassVar[str | None] = None

    def scale(self, tau: float) -> float:
        """``∂(argument of f)/∂⟨q, k⟩`` as a factor: ``1/τ``, or 1 for the linear kernel."""
        return 1.0 / tau

    def values_(self, scores: Tensor, q_sqnorm: Tensor | None, keys: Tensor, tau: float,
                dtype: torch.dtype, k_sqnorm: Tensor | None = None) -> Tensor:  # (c, B)
        """The chunk's kernel values from its dot products ``scores (c, B)`` (in ``dtype``,
        written in place); ``q_sqnorm (B,)`` for distance kernels, ``keys (c, d)`` the
        chunk's keys. A distance kernel also takes ``k_sqnorm (c,)``, the keys' squared
        norms where the caller has them (a product path that widens half-precision keys
        forms them in float32 as it multiplies)."""
        raise NotImplementedError

    def grad_factor_(self, grad: Tensor, block: Tensor, tau: float) -> Tensor:  # (c, B)
        """``grad = ∂L/∂φ`` times ``(∂φ/∂s) / scale``, in place; ``block`` holds ``φ``."""
        raise NotImplementedError

    def dense(self, q: Tensor, keys: Tensor, tau: float) -> Tensor:  # (B, N)
        """Dense reference: kernel values (normalised kernels: logits) of every pair."""
        raise NotImplementedError

    def log_kernel(self, index_score: Tensor, tau: float) -> Tensor:
        """``log φ`` from an index's score: an inner product (``"ip"``) or a squared
        distance (``"l2"``), as :attr:`index_metric` says."""
        raise NotImplementedError(f"the {self.name} kernel has no top-k retrieval")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return other == self.name
        return isinstance(other, Kernel) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_NORM_BLOCK_BYTES = 1 << 22  # the float32 copy a half store's rows are widened into


def row_sq_norms(rows: Tensor, dtype: torch.dtype) -> Tensor:  # (n,)
    """``Σ_j rows_ij²`` per row of ``rows (n, d)``, accumulated in ``dtype``. Rows already in
    ``dtype`` are squared and summed as they are. Half rows are widened to ``dtype`` first,
    so no square is rounded to their dtype, and on CPU a block of at most 4 MiB at a time
    into one reused buffer: squaring a half chunk in its own dtype makes an ``(n, d)``
    temporary whose pass costs more than the score product over the same rows
    (``benchmarks/bench_sum_products.py``), and widening a whole chunk at once allocates a
    fresh chunk-sized copy per call, whose page faults cost several times the norms."""
    if rows.dtype == dtype:
        return (rows * rows).sum(1)
    if rows.device.type != "cpu":
        return torch.linalg.vector_norm(rows, dim=1, dtype=dtype).square_()
    n, d = rows.shape
    step = max(16, _NORM_BLOCK_BYTES // (dtype.itemsize * max(1, d)))
    out = rows.new_empty(n, dtype=dtype)  # (n,)
    buffer = rows.new_empty((min(step, n), d), dtype=dtype)  # (≤ step, d)
    for start in range(0, n, step):
        m = min(step, n - start)
        torch.linalg.vector_norm(buffer[:m].copy_(rows[start:start + m]), dim=1,
                                 out=out[start:start + m])
    return out.square_()


def _sq_distances_(scores: Tensor, q_sqnorm: Tensor | None, keys: Tensor,
                   dtype: torch.dtype, k_sqnorm: Tensor | None = None) -> Tensor:  # (c, B)
    """``2⟨q, k⟩ − ‖q‖² − ‖k‖² = −‖q − k‖²`` built in place on the dot products; ``‖k‖²``
    from ``keys`` unless given."""
    assert q_sqnorm is not None  # computed for distance kernels (attention._queries_as_keys)
    if k_sqnorm is None:
        k_sqnorm = row_sq_norms(keys, dtype)  # (c,)
    return scores.mul_(2).sub_(q_sqnorm).sub_(k_sqnorm[:, None])


def _dense_sq_distances(q: Tensor, keys: Tensor) -> Tensor:  # (B, N)
    return ((q[:, None, :] - keys[None, :, :]) ** 2).sum(-1)


class LinearKernel(Kernel):
    """``φ = ⟨q, k⟩``: the dual form of a linear layer (docs/reference.md §1). Unbounded and
    of both signs, so it has no top-k retrieval (it collapses exactly to ``nn.Linear``)."""

    name = "linear"
    bounded = False

    def scale(self, tau: float) -> float:
        return 1.0

    def values_(self, scores: Tensor, q_sqnorm: Tensor | None, keys: Tensor, tau: float,
                dtype: torch.dtype, k_sqnorm: Tensor | None = None) -> Tensor:
        return scores

    def grad_factor_(self, grad: Tensor, block: Tensor, tau: float) -> Tensor:
        return grad

    def dense(self, q: Tensor, keys: Tensor, tau: float) -> Tensor:
        return q @ keys.T


class RBFKernel(Kernel):
    """``φ = exp(−‖q − k‖² / (2τ))``; ``∂φ/∂⟨q, k⟩ = φ/τ``."""

    name = "rbf"
    distance = True
    index_metric = "l2"

    def values_(self, scores: Tensor, q_sqnorm: Tensor | None, keys: Tensor, tau: float,
                dtype: torch.dtype, k_sqnorm: Tensor | None = None) -> Tensor:
        # exp(-(|q|^2 - 2 q.k + |k|^2) / (2 tau)), built in place on the score block
        return _sq_distances_(scores, q_sqnorm, keys, dtype, k_sqnorm).div_(2 * tau).exp_()

    def grad_factor_(self, grad: Tensor, block: Tensor, tau: float) -> Tensor:
        return grad.mul_(block)

    def dense(self, q: Tensor, keys: Tensor, tau: float) -> Tensor:
        return torch.exp(-_dense_sq_distances(q, keys) / (2 * tau))

    def log_kernel(self, index_score: Tensor, tau: float) -> Tensor:
        return index_score.clamp_min(0.0) / (-2 * tau)


class LaplacianKernel(Kernel):
    """``φ = exp(−‖q − k‖ / τ)``; ``∂φ/∂⟨q, k⟩ = φ / (τ ‖q − k‖)``.

    ``φ`` is not differentiable where ``q = k`` (a query at a stored key); the gradient
    there is taken as 0 (a subgradient). The backward pass recovers ``‖q − k‖ = −τ log φ``
    from the block it keeps; where ``φ`` underflows to 0 the factor is 0, as it should be.
    """

    name = "laplacian"
    distance = True
    index_metric = "l2"

    def values_(self, scores: Tensor, q_sqnorm: Tensor | None, keys: Tensor, tau: float,
                dtype: torch.dtype, k_sqnorm: Tensor | None = None) -> Tensor:
        neg_sq = _sq_distances_(scores, q_sqnorm, keys, dtype, k_sqnorm)  # −‖q − k‖²
        return neg_sq.neg_().clamp_min_(0.0).sqrt_().div_(-tau).exp_()

    def grad_factor_(self, grad: Tensor, block: Tensor, tau: float) -> Tensor:
        dist = block.log().mul_(-tau)  # (c, B) ‖q − k‖, +inf where φ = 0
        return grad.mul_(torch.where(dist > 0, block / dist, 0.0))

    def dense(self, q: Tensor, keys: Tensor, tau: float) -> Tensor:
        return torch.exp(-_dense_sq_distances(q, keys).sqrt() / tau)

    def log_kernel(self, index_score: Tensor, tau: float) -> Tensor:
        return index_score.clamp_min(0.0).sqrt() / -tau


class SoftmaxKernel(Kernel):
    """Logits ``z = ⟨q, k⟩ / τ`` of the weighted softmax (normalised by ``Σ_j w_j e^{z_j}``,
    guarded: :func:`guard_denominator`)."""

    name = "softmax"
    normalised = True
    index_metric = "ip"

    def values_(self, scores: Tensor, q_sqnorm: Tensor | None, keys: Tensor, tau: float,
                dtype: torch.dtype, k_sqnorm: Tensor | None = None) -> Tensor:
        return scores.div_(tau)

    def grad_factor_(self, grad: Tensor, block: Tensor, tau: float) -> Tensor:
        raise TypeError("the softmax kernel's gradient is that of its normalised output "
                        "(rcdl.ops.streaming.Streaming.backward), not a per-entry factor")

    def dense(self, q: Tensor, keys: Tensor, tau: float) -> Tensor:
        return q @ keys.T / tau

    def log_kernel(self, index_score: Tensor, tau: float) -> Tensor:
        return index_score / tau


KERNELS: dict[str, Kernel] = {}


def register_kernel(kernel: Kernel) -> Kernel:
    """Add ``kernel`` to :data:`KERNELS` under its name (an error if the name is taken)."""
    if kernel.name in KERNELS:
        raise ValueError(f"a kernel named {kernel.name!r} is already registered")
    KERNELS[kernel.name] = kernel
    return kernel


LINEAR, RBF, LAPLACIAN, SOFTMAX = (register_kernel(k()) for k in (
    LinearKernel, RBFKernel, LaplacianKernel, SoftmaxKernel))


def check_kernel(kernel: str | Kernel) -> Kernel:
    """The kernel object of ``kernel`` (a name of :data:`KERNELS` or a kernel); an unknown
    name raises an error naming the known ones."""
    if isinstance(kernel, Kernel):
        return kernel
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; known kernels: {', '.join(KERNELS)}")
    return KERNELS[kernel]


def softmax_scale(temperature: float, d_in: int) -> float:
    """The logit scale ``τ = T √d_in`` shared by the RBF and softmax kernels
    (docs/reference.md §2)."""
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    return temperature * math.sqrt(d_in)


def guard_denominator(den: Tensor, mass: Tensor, eps: float) -> Tensor:
    """The softmax denominator pushed to ``|den| ≥ eps · mass``, keeping its sign.

    ``den = Σ_j w_j e^{z_j − m}`` and ``mass = Σ_j |w_j| e^{z_j − m}`` (both ``(B,)``, same
    shift ``m``). Where ``|den| < eps · mass`` the result is ``±eps · mass`` (the sign of
    ``den``; zero counts as positive), a smooth function of the entries in which ``m``
    cancels; elsewhere it is ``den``. Where ``mass = 0`` (no weight at all) it is ``+inf``,
    so that ``num / den`` is 0 with zero gradient.
    """
    floor = eps * mass
    guarded = torch.where(den.abs() < floor, torch.where(den < 0, -floor, floor), den)
    return torch.where(mass == 0, torch.inf, guarded)


def naive_attention(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out)
    weights: Tensor,  # (N,)
    *,
    kernel: str | Kernel,
    temperature: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:  # (B, d_out)
    """Dense reference of :func:`rcdl.ops.attention.attention` (materialises ``(B, N, d_in)``)."""
    kern = check_kernel(kernel)
    if keys.shape[0] == 0:
        return q.new_zeros(q.shape[0], values.shape[1]) + 0 * q.sum()
    tau = softmax_scale(temperature, q.shape[1])
    if not kern.normalised:
        return (kern.dense(q, keys, tau) * weights) @ values
    logits = kern.dense(q, keys, tau)  # (B, N)
    e = torch.exp(logits - logits.max(dim=1, keepdim=True).values.detach())  # (B, N)
    return (e @ values) / guard_denominator(e @ weights, e @ weights.abs(), eps)[:, None]


def sdpa_softmax_attention(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out) weighted values ṽ
    weights: Tensor,  # (N,)
    *,
    temperature: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:  # (B, d_out)
    """A second, independent reference of the weighted-softmax kernel, on
    :func:`torch.nn.functional.scaled_dot_product_attention`.

    Softmax attention with scale ``1/τ`` over the values ``[ṽ | w | |w|]`` gives, per query,
    ``(num, D, M) / Σ_j e^{z_j}``; the common factor cancels in ``num / guard(D, M)``. It
    shares no code with :mod:`rcdl.ops.attention`: the guard is written out again here.
    """
    tau = softmax_scale(temperature, q.shape[1])
    stacked = torch.cat([values, weights[:, None], weights.abs()[:, None]], dim=1)  # (N, d+2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q[None], keys[None], stacked[None], scale=1.0 / tau)[0]  # (B, d_out + 2)
    num, den, mass = out[:, :-2], out[:, -2], out[:, -1]
    sign = torch.where(den < 0, -1.0, 1.0).to(den.dtype)
    has_mass = mass > 0
    guarded = torch.where(has_mass, sign * torch.maximum(den.abs(), eps * mass), 1.0)  # (B,)
    return torch.where(has_mass[:, None], num / guarded[:, None], 0.0)
