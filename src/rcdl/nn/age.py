"""Age coefficients: weight decay and heavy-ball momentum of growing layers (docs/reference.md §3).

SGD with learning rate η, weight decay λ and heavy-ball momentum μ (PyTorch's form:
``b_t = μ b_{t−1} + G_t + λ W_t``, ``W_{t+1} = W_t − η b_t``, ``b_{−1} = 0``) is linear in
the state ``x_t = (W_t, b_{t−1})`` with the same scalar coefficients for every weight:

    x_{t+1} = M x_t + u G_t,    M = [[1 − ηλ, −ημ], [λ, μ]],    u = (−η, 1).

Hence, with the gradient of step s written as an entry at ``t_j = s + 1`` and age
``a = T − t_j`` at step T,

    W_T = r(T) W_0 + Σ_j h(a_j) (−η G_j),    r(T) = (M^T)_{00},    h(a) = −(M^a u)_0 / η.

No extra state is stored: each entry keeps its write step and the coefficient is applied
at inference. Special cases (tested against ``torch.optim.SGD``): λ only gives
``h(a) = (1 − ηλ)^a``, ``r(T) = (1 − ηλ)^T``; μ only gives ``h(a) = (1 − μ^{a+1}) / (1 − μ)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["AgeCoefficients"]


class AgeCoefficients:
    """Tables of ``h(a)`` (entries) and ``r(T)`` (initial weight), grown on demand.

    Args:
        lr: η, the learning rate of the parametric optimizer this mirrors.
        weight_decay: λ ≥ 0.
        momentum: μ in [0, 1).
    """

    def __init__(self, lr: float, weight_decay: float = 0.0, momentum: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.lr, self.weight_decay, self.momentum = lr, weight_decay, momentum
        self._m = torch.tensor(
            [[1 - lr * weight_decay, -lr * momentum], [weight_decay, momentum]],
            dtype=torch.float64,
        )
        self._h = torch.ones(1, dtype=torch.float64)  # h(0) = 1
        self._h_state = torch.tensor([-lr, 1.0], dtype=torch.float64)  # M^a u at a = 0
        self._r = torch.ones(1, dtype=torch.float64)  # r(0) = 1
        self._r_state = torch.eye(2, dtype=torch.float64)  # M^T at T = 0
        self._h_on_device: Tensor | None = None  # _h on the device of the last query

    @property
    def trivial(self) -> bool:
        """True when every coefficient is 1 (plain SGD)."""
        return self.weight_decay == 0 and self.momentum == 0

    def _extend(self, max_age: int) -> None:
        h, r = [self._h], [self._r]
        for _ in range(self._h.numel(), max_age + 1):
            self._h_state = self._m @ self._h_state
            self._r_state = self._m @ self._r_state
            h.append((-self._h_state[0] / self.lr).reshape(1))
            r.append(self._r_state[0, 0].reshape(1))
        self._h, self._r = torch.cat(h), torch.cat(r)

    def entry(self, ages: Tensor) -> Tensor:
        """``h(a)`` for a tensor of non-negative integer ages; float64, same device."""
        if ages.numel() == 0:
            return torch.zeros(ages.shape, dtype=torch.float64, device=ages.device)
        self._extend(int(ages.max()))
        cached = self._h_on_device
        if cached is None or cached.device != ages.device or len(cached) != len(self._h):
            self._h_on_device = cached = self._h.to(ages.device)  # re-copied only when _h grows
        return cached[ages]

    def initial(self, step: int) -> float:
        """``r(T)``: the factor on the initial weight ``W_0`` after ``step`` steps."""
        self._extend(step)
        return float(self._r[step])
