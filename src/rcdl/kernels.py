"""Kernels of growing layers and their dense reference twin (SPEC §2).

With ``τ = T √d_in`` and per-entry weights ``w_j``:

- ``linear``  (dual form):   ``s(q) = Σ_j w_j ⟨q, k_j⟩ v_j``
- ``rbf``     (growing RBF): ``s(q) = Σ_j w_j exp(−‖q − k_j‖² / (2τ)) v_j``
- ``softmax`` (weighted softmax over weighted values ``ṽ_j = w_j v_j``):
  ``s(q) = Σ_j e^{z_j} ṽ_j / Σ_j w_j e^{z_j}`` with ``z_j = ⟨q, k_j⟩ / τ``.

For the linear and RBF kernels the weights are per-entry multipliers (the age
coefficients of SPEC §3; ones when there is no decay or momentum). For the softmax they
enter the denominator only, because the stored values are already weighted.

The softmax denominator, measured relative to the largest term (``D = Σ_j w_j e^{z_j − max z}``),
is kept at least ``eps`` away from zero with its sign: trained entries (the hybrid network,
SPEC §4) may make it vanish or go negative, and the output must stay finite.

:func:`naive_attention` is the dense few-line twin of the streaming attention in
:mod:`rcdl.attention`; tests compare the two on outputs and every gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["KERNELS", "check_kernel", "guard_denominator", "naive_attention", "softmax_scale"]

KERNELS = ("linear", "rbf", "softmax")


def check_kernel(kernel: str) -> str:
    """Return ``kernel`` if it is a known kernel name, else raise naming the known ones."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; known kernels: {', '.join(KERNELS)}")
    return kernel


def softmax_scale(temperature: float, d_in: int) -> float:
    """The logit scale ``τ = T √d_in`` shared by the RBF and softmax kernels (SPEC §2)."""
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    return temperature * math.sqrt(d_in)


def guard_denominator(den: Tensor, eps: float) -> Tensor:
    """``den`` pushed to ``|den| ≥ eps``, keeping its sign (zero counts as positive)."""
    floor = torch.where(den < 0, -eps, eps).to(den.dtype)
    return torch.where(den.abs() < eps, floor, den)


def naive_attention(
    q: Tensor,  # (B, d_in)
    keys: Tensor,  # (N, d_in)
    values: Tensor,  # (N, d_out)
    weights: Tensor,  # (N,)
    *,
    kernel: str,
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
    return (e @ values) / guard_denominator(e @ weights, eps)[:, None]
