"""Parametric optimizers of the one-epoch comparison, with their tuned settings
(docs/reference.md §6).

``make_optimizer(name, model)`` returns a ``torch.optim.Optimizer``-like object for the
ResNet-MLP baselines and the parametric-softmax networks:

| name    | setting (batch 16)                                                          |
|---------|-----------------------------------------------------------------------------|
| sgd     | lr 1e−3, momentum 0.85                                                      |
| adam    | lr 1e−4 (1e−3 for the parametric-softmax tables, docs/reference.md §5)       |
| adamw   | lr 1e−4, weight decay 1e−4                                                  |
| rmsprop | lr 1e−4, alpha 0.9, eps 1e−8                                                |
| muon    | ``torch.optim.Muon`` lr 1e−3 on 2-D weights (weight_decay=0 given, momentum  |
|         | 0.95, Nesterov) + Adam lr 1e−3 on the other parameters                      |
| foof    | ``FOOF`` (rcdl.optim.dual_optim) lr 1e−3, momentum 0.85, damping 1.0, ema 0.95,   |
|         | refresh every 10 steps (docs/reference.md §7; damping 1e−3 diverged at every |
|         | lr from 1e−4 to 1e−2 in docs/optimizer_experiments.md's tuning, 1.0 trained; |
|         | lr untuned)                                                                  |
| deltanet| ``DeltaNetDecay`` (rcdl.optim.dual_optim) lr 1e−3, momentum 0.85, decay 1e−4      |
|         | (docs/reference.md §7; untuned)                                              |

In float32, ``adamw`` at these settings is bit-identical to ``adam``. Its decoupled decay
multiplies each weight by ``1 − lr·wd = 1 − 1e−8`` per step. That factor is below half of
float32's resolution at 1 (6e−8), so it rounds to exactly 1, and the decay never acts.
This was seen in the full-scale runs, where both reached 46.78 %. It is asserted in
``tests/test_dual_optim.py``. The paper's 48.2 ± 1.0 (Adam) and 48.3 ± 1.0 (AdamW) fit
the same reading. The decay acts in float64.

``foof`` and ``deltanet`` need a model whose trainable parameters all sit in ``nn.Linear``
layers (the ResNet-MLP); they raise ``ValueError`` naming any other parameter.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rcdl.optim.dual_optim import FOOF, DeltaNetDecay

__all__ = ["OPTIMIZERS", "Float32Muon", "OptimizerGroup", "make_optimizer"]

OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "muon", "foof", "deltanet")


class OptimizerGroup:
    """Several optimizers stepped together (Muon on matrices, Adam on the rest)."""

    def __init__(self, *optimizers: torch.optim.Optimizer | None) -> None:
        self.optimizers = [opt for opt in optimizers if opt is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for opt, s in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(s)


def make_optimizer(name: str, model: nn.Module, lr: float | None = None):  # noqa: ANN201
    """The optimizer ``name`` over ``model``'s parameters with the settings of docs/reference.md §6.

    ``lr`` overrides the tuned learning rate (of Muon's matrices, for ``muon``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameters to optimize")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 1e-3, momentum=0.85)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr or 1e-4)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr or 1e-4, weight_decay=1e-4)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr or 1e-4, alpha=0.9, eps=1e-8)
    if name == "muon":
        matrices = [p for p in params if p.ndim == 2]
        others = [p for p in params if p.ndim != 2]
        muon = torch.optim.Muon(matrices, lr=lr or 1e-3, weight_decay=0.0, momentum=0.95,
                                nesterov=True)
        adam = torch.optim.Adam(others, lr=1e-3) if others else None
        return OptimizerGroup(muon, adam)
    if name == "foof":
        return FOOF(model, lr=lr or 1e-3, damping=1.0, ema=0.95, refresh_every=10,
                    momentum=0.85)
    if name == "deltanet":
        return DeltaNetDecay(model, lr=lr or 1e-3, decay=1e-4, momentum=0.85)
    raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")


# --------------------------------------------------------------------------- Muon in float32


class Float32Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton–Schulz iteration computed in float32.

    The update is torch's (momentum ``μ``, learning rate ``γ``, weight decay ``λ``)::

        B ← μ B + (1 − μ) G                  (the momentum buffer, a lerp)
        U = (1 − μ) G + μ B  (Nesterov)  or  B
        O = NS₅(U / ‖U‖_F)                   (quintic Newton–Schulz, coefficients a, b, c)
        W ← (1 − γλ) W − γ · √max(1, rows/cols) · O

    with ``X ← a X + (b A + c A²) X``, ``A = X Xᵀ`` iterated ``ns_steps`` times on the wide
    orientation of ``U``. torch casts ``U`` to bfloat16 for the iteration; a CPU multiplies
    bfloat16 matrices far more slowly than float32 ones, so this class keeps float32 (or the
    parameter's dtype, if wider). Constructor arguments and state are torch's; only
    ``adjust_lr_fn`` ``None``/``"original"`` and ``"match_rms_adamw"`` are accepted.

    References: Jordan 2024 (Muon); docs/reference.md §6, §7.
    """

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        """One Muon step of every matrix with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            a, b, c = group["ns_coefficients"]
            momentum, lr = group["momentum"], float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.ndim != 2:
                    raise ValueError(f"Float32Muon: expected 2-D parameters, got shape "
                                     f"{tuple(p.grad.shape)}")  # fmt: skip
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                x = update.to(torch.promote_types(update.dtype, torch.float32))
                tall = x.shape[0] > x.shape[1]
                if tall:
                    x = x.T
                x = x / x.norm().clamp(min=group["eps"])  # (rows, cols), rows <= cols
                for _ in range(group["ns_steps"]):
                    gram = x @ x.T  # (rows, rows)
                    x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
                if tall:
                    x = x.T
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(x.to(p.dtype), alpha=-lr * _muon_lr_ratio(group["adjust_lr_fn"], p.shape))
        return loss


def _muon_lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Float32Muon: unknown adjust_lr_fn {adjust_lr_fn!r}; known: None, "
                     "'original', 'match_rms_adamw'")  # fmt: skip
