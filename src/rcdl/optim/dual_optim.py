"""Optimizers read off other dual forms of a linear layer
(docs/reference.md §7, docs/optimizers.md).

A linear layer trained by SGD is linear attention over the pairs ``(k, v) = (x_t, −η g_t)``
(docs/reference.md §1). Replacing linear attention by another sequence layer over the same pairs
gives another update rule for the weight:

- :class:`FOOF` — the Mesa layer's readout ``G (H + Λ)^{-1} q``: gradient descent
  right-preconditioned by the inverse damped second moment of each layer's inputs.
- :class:`DeltaNetDecay` — the delta rule ``S ← S − b (S k − v) kᵀ``: SGD plus a decay that
  forgets only along the current inputs' directions (a *derived* reading, docs/optimizers.md).

Both act on the ``nn.Linear`` layers of a model and see each layer's inputs through forward
pre-hooks: every forward pass run with gradients enabled since the last :meth:`step` counts
(gradient accumulation over several forward/backward passes is therefore handled). The bias
is the weight of an appended constant input 1, so ``[W b]`` is treated as one matrix
``(D_out, D_in + 1)``. Parameters that do not belong to an ``nn.Linear`` (convolutions,
embeddings, norms with a learned scale, …) are refused with an error naming them, unless
``sgd_fallback=True``, which trains them with plain SGD (same ``lr`` and ``momentum``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar, overload

import torch
from torch import Tensor, nn

__all__ = ["FOOF", "DeltaNetDecay"]

_Loss = TypeVar("_Loss")  # what a step's closure returns (a loss tensor, usually)


class _LinearLayerOptimizer(torch.optim.Optimizer):
    """Shared machinery: one parameter group per ``nn.Linear``, input moments from hooks.

    Param groups ``0 .. L−1`` are the linear layers (key ``"layer"`` holds the module's
    name, ``"kind"`` is ``"linear"``); an optional last group (``"kind": "sgd"``) holds the
    fallback parameters. Per-layer state lives in ``self.state[weight]``.
    """

    _name = "optimizer"

    def __init__(self, model: nn.Module, defaults: dict, *, sgd_fallback: bool) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{self._name} takes the model (an nn.Module) to find its nn.Linear "
                            f"layers, got {type(model).__name__}")
        _check_range(self._name, "lr", defaults["lr"], low=0.0)
        _check_range(self._name, "momentum", defaults["momentum"], low=0.0, high=1.0,
                     high_open=True)
        owner: dict[int, str] = {}  # id(param) -> "name.param (ModuleType)", for errors
        for mod_name, module in model.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                owner.setdefault(id(p), f"{full!r} ({type(module).__name__})")

        self._layers: list[tuple[str, nn.Linear, bool]] = []  # (name, module, has_bias)
        groups: list[dict[str, Any]] = []
        handled: dict[int, str] = {}  # id(param) -> the nn.Linear's module path
        for mod_name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or not module.weight.requires_grad:
                continue
            has_bias = module.bias is not None and module.bias.requires_grad
            params = [module.weight] + ([module.bias] if has_bias else [])
            for p in params:
                if id(p) in handled:
                    raise ValueError(f"{self._name}: a parameter is shared by the nn.Linear "
                                     f"layers {handled[id(p)]!r} and {mod_name!r}; "
                                     "tied linear weights are not supported")
                handled[id(p)] = mod_name
            self._layers.append((mod_name or "<model>", module, has_bias))
            groups.append({"params": params, "kind": "linear", "layer": mod_name or "<model>"})
        if not self._layers:
            raise ValueError(f"{self._name}: {type(model).__name__} has no nn.Linear layer with "
                             "a trainable weight")

        others = [p for p in model.parameters() if p.requires_grad and id(p) not in handled]
        if others and not sgd_fallback:
            names = ", ".join(owner[id(p)] for p in others)
            raise ValueError(f"{self._name} handles only nn.Linear layers; it cannot precondition "
                             f"{names}. Pass sgd_fallback=True to train them with plain SGD "
                             "(same lr and momentum).")
        if others:
            groups.append({"params": others, "kind": "sgd", "layer": None})
        super().__init__(groups, defaults)

        self._pending: dict[int, list] = {}  # layer index -> [Σ x̃ x̃ᵀ (D̃, D̃), n]
        self._hooks = [module.register_forward_pre_hook(partial(self._capture, index))
                       for index, (_, module, _) in enumerate(self._layers)]

    # -- inputs -------------------------------------------------------------------------
    def _capture(self, index: int, module: nn.Linear, args: tuple) -> None:
        if not torch.is_grad_enabled() or not args:
            return
        x = args[0].detach()
        x = x.reshape(-1, x.shape[-1]).to(module.weight.dtype)  # (n, D_in)
        if self._layers[index][2]:
            x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)  # (n, D_in + 1)
        moment = x.T @ x  # (D̃, D̃)
        if index in self._pending:
            self._pending[index][0] += moment
            self._pending[index][1] += x.shape[0]
        else:
            self._pending[index] = [moment, x.shape[0]]

    def _batch_moment(self, index: int) -> Tensor:
        """``X̃ᵀ X̃ / n`` over the inputs captured since the last step, ``(D̃, D̃)``."""
        self._check_inputs(index)
        moment, n = self._pending[index]
        return moment / n

    def _check_inputs(self, index: int) -> None:
        if index not in self._pending or self._pending[index][1] == 0:
            raise RuntimeError(
                f"{self._name}: layer {self._layers[index][0]!r} has a gradient but no input "
                "was captured since the last step; run its forward with gradients enabled "
                "(not under torch.no_grad) before step(), and do not bypass its forward "
                "(e.g. by using its weight in F.linear directly)")

    def remove_hooks(self) -> None:
        """Detach the forward pre-hooks from the model (the optimizer can no longer step)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- stepping -----------------------------------------------------------------------
    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], _Loss]) -> _Loss: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], _Loss] | None = None) -> _Loss | None:
        """One update of every layer from its gradient and the inputs captured since the
        last step; ``closure`` (re-evaluating the loss) is run first when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            for index, (_, module, _) in enumerate(self._layers):  # fail before any update
                if module.weight.grad is not None and self._uses_inputs(self.param_groups[index]):
                    self._check_inputs(index)
            for index, group in enumerate(self.param_groups):
                if group["kind"] == "sgd":
                    self._sgd_step(group)
                    continue
                _, module, has_bias = self._layers[index]
                if module.weight.grad is None:
                    continue  # the layer took no part in the loss
                grad = module.weight.grad  # (D_out, D_in)
                if has_bias:
                    bias_grad = module.bias.grad
                    if bias_grad is None:
                        bias_grad = torch.zeros_like(module.bias)
                    grad = torch.cat([grad, bias_grad[:, None]], dim=1)  # (D_out, D_in + 1)
                delta = self._layer_delta(index, group, grad)  # (D_out, D̃), subtracted
                module.weight.sub_(delta[:, :module.in_features])
                if has_bias:
                    module.bias.sub_(delta[:, -1])
        finally:
            self._pending.clear()
        return loss

    def _momentum(self, state: dict, direction: Tensor, momentum: float) -> Tensor:
        if momentum == 0:
            return direction
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = direction.clone()
        else:
            state["momentum_buffer"].mul_(momentum).add_(direction)
        return state["momentum_buffer"]

    def _sgd_step(self, group: dict) -> None:
        for p in group["params"]:
            if p.grad is not None:
                p.sub_(self._momentum(self.state[p], p.grad, group["momentum"]), alpha=group["lr"])

    def _uses_inputs(self, group: dict) -> bool:
        return True

    def _layer_delta(self, index: int, group: dict, grad: Tensor) -> Tensor:
        """The amount to subtract from ``[W b]`` ``(D_out, D̃)`` given its gradient."""
        raise NotImplementedError


class FOOF(_LinearLayerOptimizer):
    """FOOF: SGD right-preconditioned by each layer's damped input second moment
    (docs/reference.md §7).

    For every ``nn.Linear`` with ``W̃ = [W b]`` ``(D_out, D̃)``, ``D̃ = D_in + 1`` with a
    bias, and inputs ``x̃ = [x, 1]``::

        C_t   = ema · C_{t−1} + (1 − ema) · X̃ᵀX̃ / n     (C_1 = X̃ᵀX̃ / n, the first batch's)
        P     = ∇_W̃ L · (C_s + λ I)^{-1}                 (s = last refresh step)
        m_t   = μ m_{t−1} + P                             (heavy ball; m = P when μ = 0)
        W̃    ← W̃ − lr · m_t

    ``X̃ (n, D̃)`` are the layer's inputs captured since the last step. The factor
    ``C + λ I = L Lᵀ`` is Cholesky-factorised every ``refresh_every`` steps (the first step
    included) and applied with ``torch.cholesky_solve`` — never an explicit inverse; the EMA
    is updated every step. It is the Mesa readout over the dual-form pairs: one full-batch
    step from ``W̃ = 0`` gives ``W̃ q̃ = G (H + Λ)^{-1} q̃`` with ``G = Σ v k̃ᵀ``,
    ``H = Σ k̃ k̃ᵀ``, ``(k, v) = (x_i, −lr · g_i)``, ``g_i = B ∂L/∂s_i`` the per-sample
    gradient of the batch-mean loss ``L`` and ``Λ = B λ I`` (docs/optimizers.md). For one
    linear layer, squared loss, λ → 0 and ``lr = 1`` that step is Newton's (least squares).

    Args:
        model: the network; its ``nn.Linear`` layers (found with ``named_modules``) are
            preconditioned; each gets forward pre-hooks (see :meth:`remove_hooks`).
        lr: learning rate (≥ 0).
        damping: λ > 0, added to the diagonal of the moment before factorising.
        ema: weight of the old moment in the running estimate, in ``[0, 1)``; 0 uses the
            current batch's moment only.
        refresh_every: steps between refactorisations (≥ 1); a changed ``damping`` takes
            effect at the next refresh.
        momentum: heavy-ball coefficient μ in ``[0, 1)`` on the preconditioned direction.
        sgd_fallback: train parameters outside ``nn.Linear`` layers with plain SGD instead
            of raising ``ValueError``.

    Example::

        opt = FOOF(model, lr=0.1, damping=1e-3)
        loss_fn(model(x), y).backward()   # the forward pass records each layer's inputs
        opt.step(); opt.zero_grad()

    References: Benzing 2022 (FOOF); von Oswald et al. 2025 (MesaNet); docs/reference.md §7.
    """

    _name = "FOOF"

    def __init__(self, model: nn.Module, lr: float = 1e-3, damping: float = 1e-3,
                 ema: float = 0.95, refresh_every: int = 10, momentum: float = 0.0, *,
                 sgd_fallback: bool = False) -> None:
        _check_range("FOOF", "damping", damping, low=0.0, low_open=True)
        _check_range("FOOF", "ema", ema, low=0.0, high=1.0, high_open=True)
        if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) \
                or refresh_every < 1:
            raise ValueError(f"FOOF: refresh_every must be an int >= 1, got {refresh_every!r}")
        defaults = {"lr": lr, "damping": damping, "ema": ema, "refresh_every": refresh_every,
                    "momentum": momentum}
        super().__init__(model, defaults, sgd_fallback=sgd_fallback)

    def _layer_delta(self, index: int, group: dict, grad: Tensor) -> Tensor:
        state = self.state[self._layers[index][1].weight]
        moment = self._batch_moment(index)  # (D̃, D̃)
        if "moment" not in state:
            state["step"] = 0
            state["moment"] = moment
        else:
            state["moment"].mul_(group["ema"]).add_(moment, alpha=1 - group["ema"])
        if state["step"] % group["refresh_every"] == 0 or "cholesky" not in state:
            state["cholesky"] = self._factor(index, state["moment"], group["damping"])
        state["step"] += 1
        # grad (C + λI)^{-1} = ((C + λI)^{-1} gradᵀ)ᵀ, C symmetric
        direction = torch.cholesky_solve(grad.T, state["cholesky"]).T  # (D_out, D̃)
        return group["lr"] * self._momentum(state, direction, group["momentum"])

    def _factor(self, index: int, moment: Tensor, damping: float) -> Tensor:
        name = self._layers[index][0]
        if not torch.isfinite(moment).all():
            raise RuntimeError(f"FOOF: the input moment of layer {name!r} is not finite "
                               "(inf/NaN in the layer's inputs)")
        damped = moment + damping * torch.eye(moment.shape[0], dtype=moment.dtype,
                                              device=moment.device)
        factor, info = torch.linalg.cholesky_ex(damped)  # lower-triangular (D̃, D̃)
        if info.item() != 0:
            raise RuntimeError(f"FOOF: the damped input moment of layer {name!r} is not "
                               f"positive definite (Cholesky failed at column {info.item()}); "
                               f"increase damping (now {damping:g})")
        return factor


class DeltaNetDecay(_LinearLayerOptimizer):
    """SGD plus the delta rule's data-dependent decay (docs/reference.md §7; a derived reading).

    For every ``nn.Linear`` with ``W̃ = [W b]`` ``(D_out, D̃)`` and the current batch's
    inputs ``X̃ = [X, 1]`` ``(B, D̃)``::

        m_t = μ m_{t−1} + ∇_W̃ L                    (m = ∇_W̃ L when μ = 0)
        W̃  ← W̃ − lr · m_t − λ · W̃ X̃ᵀX̃ / B

    (both terms use the pre-step ``W̃``). The decay shrinks ``W̃`` only along the
    directions the current inputs span: ``W̃ u`` is untouched for every ``u ⊥ x̃_i`` — unlike
    uniform weight decay, which shrinks every direction. With μ = 0 the step is exactly one
    batch-averaged delta-rule step ``S ← S − (b/B) Σ_i (S k_i − v_i) k_iᵀ`` on ``S = W̃``
    over the dual-form pairs ``(k_i, v_i) = (x̃_i, −η g_i)`` (``g_i = B ∂L/∂s_i`` the
    per-sample gradient of the batch-mean loss ``L``) with ``b = λ`` and ``η = lr / λ``:
    online gradient descent with rate ``b`` on the local loss ``½‖S x̃ − v‖²``
    (docs/optimizers.md). The reading of DeltaNet as this optimizer is derived, not from a
    reference implementation. The decay is stable while ``λ · ‖X̃ᵀX̃ / B‖₂ < 2``.

    Args:
        model: the network; its ``nn.Linear`` layers get forward pre-hooks.
        lr: learning rate of the SGD part (≥ 0).
        decay: λ ≥ 0, the rate of the data-dependent decay (not multiplied by ``lr``).
        momentum: heavy-ball coefficient μ in ``[0, 1)`` on the gradient only (the decay is
            decoupled from it, as in AdamW).
        sgd_fallback: train parameters outside ``nn.Linear`` layers with plain SGD instead
            of raising ``ValueError``.

    References: Schlag et al. 2021, Yang et al. 2024 (DeltaNet); docs/reference.md §7.
    """

    _name = "DeltaNetDecay"

    def __init__(self, model: nn.Module, lr: float = 1e-3, decay: float = 1e-4,
                 momentum: float = 0.0, *, sgd_fallback: bool = False) -> None:
        _check_range("DeltaNetDecay", "decay", decay, low=0.0)
        defaults = {"lr": lr, "decay": decay, "momentum": momentum}
        super().__init__(model, defaults, sgd_fallback=sgd_fallback)

    def _uses_inputs(self, group: dict) -> bool:
        return group["decay"] != 0

    def _layer_delta(self, index: int, group: dict, grad: Tensor) -> Tensor:
        _, module, has_bias = self._layers[index]
        state = self.state[module.weight]
        delta = group["lr"] * self._momentum(state, grad, group["momentum"])  # (D_out, D̃)
        if group["decay"] != 0:
            weight = module.weight
            if has_bias:
                weight = torch.cat([weight, module.bias[:, None]], dim=1)  # (D_out, D̃)
            delta = delta + group["decay"] * (weight @ self._batch_moment(index))
        return delta


def _check_range(owner: str, name: str, value: float, *, low: float, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > low if low_open else value >= low)
        if high is not None:
            ok = ok and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        interval = f"{lo}{low:g}, {high:g}{hi}" if high is not None else \
            (f"> {low:g}" if low_open else f">= {low:g}")
        where = "in " if high is not None else ""
        raise ValueError(f"{owner}: {name} must be {where}{interval}, got {value!r}")
