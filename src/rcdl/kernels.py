"""Kernels of growing layers and their dense reference twin (docs/reference.md §2).

With ``τ = T √d_in`` and per-entry weights ``w_j``:

- ``linear``  (dual form):   ``s(q) = Σ_j w_j ⟨q, k_j⟩ v_j``
- ``rbf``     (growing RBF): ``s(q) = Σ_j w_j exp(−‖q − k_j‖² / (2τ)) v_j``
- ``softmax`` (weighted softmax over weighted values ``ṽ_j = w_j v_j``):
  ``s(q) = Σ_j e^{z_j} ṽ_j / Σ_j w_j e^{z_j}`` with ``z_j = ⟨q, k_j⟩ / τ``.

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
:mod:`rcdl.attention`; tests compare the two on outputs and every gradient.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "KERNELS", "Kernel", "check_kernel", "guard_denominator", "naive_attention",
    "sdpa_softmax_attention", "softmax_scale",
]  # fmt: skip

Kernel = Literal["linear", "rbf", "softmax"]
KERNELS: tuple[Kernel, ...] = get_args(Kernel)


def check_kernel(kernel: str) -> Kernel:
    """Return ``kernel`` if it is a known kernel name, else raise naming the known ones."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; known kernels: {', '.join(KERNELS)}")
    return kernel


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
    kernel: Kernel,
    temperature: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:  # (B, d_out)
    """Dense reference of :func:`rcdl.attention.attention` (materialises ``(B, N, d_in)``)."""
    check_kernel(kernel)
    if keys.shape[0] == 0:
        return q.new_zeros(q.shape[0], values.shape[1]) + 0 * q.sum()
    tau = softmax_scale(temperature, q.shape[1])
    if kernel == "linear":
        return (q @ keys.T * weights) @ values
    if kernel == "rbf":
        sq_dist = ((q[:, None, :] - keys[None, :, :]) ** 2).sum(-1)  # (B, N)
        return (torch.exp(-sq_dist / (2 * tau)) * weights) @ values
    logits = q @ keys.T / tau  # (B, N)
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
    shares no code with :mod:`rcdl.attention`: the guard is written out again here.
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
