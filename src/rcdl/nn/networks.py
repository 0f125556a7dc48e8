"""Networks: the MLP baseline, the residual backbone of docs/reference.md §6, and the dual form.

- :class:`MLP` — ``d_in → hidden × depth → d_out`` with ReLU (or another activation).
- :class:`ResidualNet` — the backbone of docs/reference.md §6: residual stream ``x₀ = x``, blocks
  ``x ← x + act(layer(RMSNorm(x)))`` and a readout on ``RMSNorm(x)``, for any layer kind.
- :class:`ResNetMLP` — the ResNet-MLP baseline of docs/reference.md §6 (Linear + tanh-GELU blocks).
- :class:`GrowingSoftmaxNet`, :class:`HybridSoftmaxNet`, :class:`GrowingRBFNet`,
  :class:`ParametricSoftmaxNet` — the RCDL models of docs/reference.md §4–6 on the same backbone,
  all built the same way: ``Net(d_in, d_out, depth, *, temperature, rule, ...)`` (the parametric
  one takes ``entries`` instead of a rule), with ``store_dtype=`` for half-precision stores
  (docs/precision.md) and the hidden width as ``width=`` (default
  ``d_in``).
- :func:`to_dual_form` — a copy of a network with every ``nn.Linear`` replaced by its
  exact dual form (:class:`rcdl.nn.layers.GrowingLinear`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.nn.gates import GrowthTrigger
from rcdl.nn.hybrid import HybridSoftmax
from rcdl.nn.layers import GrowingLinear, GrowingRBF, GrowingSoftmax, ParametricSoftmax
from rcdl.nn.rules import FunctionalSGD, LearningRule

__all__ = [
    "MLP", "GrowingRBFNet", "GrowingSoftmaxNet", "HybridSoftmaxNet", "ParametricSoftmaxNet",
    "ResNetMLP", "ResidualNet", "from_dual_form", "rms_norm", "lecun_normal_", "to_dual_form",
    "eval_mode", "layer_input",
]

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "tanh": nn.Tanh, "identity": nn.Identity,
}


def _activation(name: str) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()


class MLP(nn.Sequential):
    """``depth`` hidden layers of width ``hidden`` with activation ``act``, then a readout."""

    def __init__(self, d_in: int, hidden: int, d_out: int, depth: int = 2, act: str = "relu"):
        if depth < 0:
            raise ValueError(f"MLP depth must be >= 0, got {depth}")
        widths = [d_in] + [hidden] * depth
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(a, b), _activation(act)]
        super().__init__(*layers, nn.Linear(widths[-1], d_out))


def rms_norm(width: int) -> nn.RMSNorm:
    """``x / sqrt(mean(x²) + eps)`` over the last dim of width ``width``, eps 1e−6, no
    learned scale (docs/reference.md §6): ``torch.nn.RMSNorm`` without its affine weight."""
    return nn.RMSNorm(width, eps=1e-6, elementwise_affine=False)


class ResidualNet(nn.Module):
    """Pre-norm residual backbone of docs/reference.md §6 over any layer kind.

    ``x ← lift(x)``; ``depth`` times ``x ← x + act(block(RMSNorm(x)))``; logits
    ``= readout(RMSNorm(x))``. ``make_block(width)`` and ``make_readout(width, d_out)``
    build the layers. ``lift`` is the identity when ``width == d_in`` (the paper's setting);
    otherwise a fixed random map ``d_in → width`` (not trained).
    """

    lift: Tensor | None  # buffer (width, d_in), None when width == d_in

    def __init__(self, d_in: int, d_out: int, depth: int, *,
                 make_block: Callable[[int], nn.Module],
                 make_readout: Callable[[int, int], nn.Module],
                 width: int | None = None, act: str = "identity", seed: int = 0) -> None:
        super().__init__()
        width = width or d_in
        self.d_in = d_in
        self.norm = rms_norm(width)
        self.act = _activation(act)
        self.blocks = nn.ModuleList(make_block(width) for _ in range(depth))
        self.readout = make_readout(width, d_out)
        lift = None
        if width != d_in:
            gen = torch.Generator().manual_seed(seed)
            lift = torch.randn(width, d_in, generator=gen) / math.sqrt(d_in)
        self.register_buffer("lift", lift)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim == 0 or x.shape[-1] != self.d_in:
            raise ValueError(f"{type(self).__name__}: expected input (..., {self.d_in}), got "
                             f"shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__}: the network takes floating-point inputs, "
                            f"got {x.dtype} (convert with x.float())")
        if self.lift is not None:
            x = F.linear(x, self.lift.to(x.dtype))
        for block in self.blocks:
            x = x + self.act(block(self.norm(x)))
        return self.readout(self.norm(x))


def lecun_normal_(weight: Tensor) -> Tensor:
    """Truncated-normal LeCun init of docs/reference.md §6: N(0, 1) truncated to [−2, 2], times
    ``√(1/d_in) / 0.8796`` (0.8796 is the std of the truncated unit normal)."""
    with torch.no_grad():
        nn.init.trunc_normal_(weight, 0.0, 1.0, -2.0, 2.0)
        return weight.mul_(math.sqrt(1 / weight.shape[1]) / 0.87962566103423978)


def _lecun_linear(d_in: int, d_out: int) -> nn.Linear:
    linear = nn.Linear(d_in, d_out)
    lecun_normal_(linear.weight)
    nn.init.zeros_(linear.bias)
    return linear


class ResNetMLP(ResidualNet):
    """The ResNet-MLP baseline of docs/reference.md §6: ``depth`` blocks of Linear d→d + tanh-GELU,
    biases zero, truncated-normal LeCun weights, and a linear readout. ``width`` (default
    ``d_in``, the paper's setting) is the blocks' width, reached by the backbone's fixed random
    lift when it differs from ``d_in``."""

    def __init__(self, d_in: int = 3072, d_out: int = 10, depth: int = 8, *,
                 width: int | None = None) -> None:
        super().__init__(d_in, d_out, depth, make_block=lambda w: _lecun_linear(w, w),
                         make_readout=_lecun_linear, act="gelu_tanh", width=width)


def _check_widths(cls: str, d_in: int, d_out: int, depth: int) -> None:
    for name, value in (("d_in", d_in), ("d_out", d_out), ("depth", depth)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{cls}(d_in, d_out, depth, ...): {name} must be an int, got "
                            f"{value!r} (the hidden width is the keyword width=)")
    if d_in < 1 or d_out < 1 or depth < 0:
        raise ValueError(f"{cls}: need d_in, d_out >= 1 and depth >= 0, got {d_in}, {d_out}, "
                         f"{depth}")


class GrowingSoftmaxNet(ResidualNet):
    """The growing weighted-softmax network of docs/reference.md §6 ("gws" or "gauge" by ``rule``):
    ``depth`` blocks d→d and a readout d→``d_out``, all :class:`GrowingSoftmax`.

    Example (docs/reference.md §6's gws)::

        GrowingSoftmaxNet(3072, 10, 2, temperature=6.0, rule=ClippedSoftmaxRule(0.003, 3.0))
    """

    def __init__(self, d_in: int, d_out: int, depth: int, *, temperature: float,
                 rule: LearningRule, initial_entries: int = 16, seed: int = 0,
                 store_dtype: torch.dtype | None = None, **kw) -> None:
        _check_widths(type(self).__name__, d_in, d_out, depth)
        seeds = iter(range(seed, seed + depth + 1))

        def layer(a: int, b: int) -> GrowingSoftmax:
            return GrowingSoftmax(a, b, temperature=temperature, rule=rule,
                                  initial_entries=initial_entries, seed=next(seeds),
                                  store_dtype=store_dtype)

        super().__init__(d_in, d_out, depth, make_block=lambda w: layer(w, w),
                         make_readout=layer, seed=seed, **kw)


class HybridSoftmaxNet(ResidualNet):
    """The hybrid growing network of docs/reference.md §4, §6: ``depth`` blocks d→d and a readout
    d→``d_out``, all :class:`~rcdl.nn.hybrid.HybridSoftmax` (entries trained by Adam, growth by
    ``trigger``; by default each layer's own ``DistanceGate(default_tau(width))``,
    τ = 50 · √(width / 3072) for its queries' width, which is τ = 50 at CIFAR-10's); train it
    with :class:`~rcdl.optim.hybrid_grower.HybridGrower`.

    Example (docs/reference.md §6: depth 3, T = 5, τ = 50, Adam 1e−3)::

        HybridSoftmaxNet(3072, 10, 3, temperature=5.0, rule=ClippedSoftmaxRule(1.0, 30.0))
    """

    def __init__(self, d_in: int, d_out: int, depth: int, *, temperature: float,
                 rule: LearningRule, trigger: GrowthTrigger | None = None,
                 initial_entries: int = 16, seed: int = 0,
                 store_dtype: torch.dtype | None = None, **kw) -> None:
        _check_widths(type(self).__name__, d_in, d_out, depth)
        seeds = iter(range(seed, seed + depth + 1))

        def layer(a: int, b: int) -> HybridSoftmax:
            return HybridSoftmax(a, b, temperature=temperature, rule=rule, trigger=trigger,
                                 initial_entries=initial_entries, seed=next(seeds),
                                 store_dtype=store_dtype)

        super().__init__(d_in, d_out, depth, make_block=lambda w: layer(w, w),
                         make_readout=layer, seed=seed, **kw)


class ParametricSoftmaxNet(ResidualNet):
    """The parametric-softmax baseline of docs/reference.md §5: the backbone with fixed tables of
    ``entries`` weighted-softmax entries per layer, trained as ordinary parameters."""

    def __init__(self, d_in: int, d_out: int, depth: int = 2, *, entries: int,
                 temperature: float = 3.0) -> None:
        def layer(a: int, b: int) -> ParametricSoftmax:
            return ParametricSoftmax(a, b, entries, temperature=temperature)

        super().__init__(d_in, d_out, depth, make_block=lambda w: layer(w, w),
                         make_readout=layer)


class GrowingRBFNet(ResidualNet):
    """The growing RBF network of docs/reference.md §6: residual backbone, every layer a growing
    RBF.

    Example (docs/reference.md §6: T = 10, η = 10)::

        GrowingRBFNet(3072, 10, 2, temperature=10.0, rule=FunctionalSGD(10.0))
    """

    def __init__(self, d_in: int, d_out: int, depth: int, *old_args: int,
                 temperature: float, rule: LearningRule,
                 store_dtype: torch.dtype | None = None, **kw) -> None:
        if old_args or d_out is None:
            raise TypeError(
                "GrowingRBFNet(d_in, d_out, depth, *, temperature, rule, width=None): the hidden "
                "width moved from the second positional argument to width=, and lr=η became "
                "rule=FunctionalSGD(η)")
        _check_widths(type(self).__name__, d_in, d_out, depth)

        def rbf(a: int, b: int) -> GrowingRBF:
            return GrowingRBF(a, b, temperature=temperature, rule=rule, store_dtype=store_dtype)

        super().__init__(d_in, d_out, depth, make_block=lambda w: rbf(w, w),
                         make_readout=rbf, **kw)


def to_dual_form(model: nn.Module, *, lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.0) -> nn.Module:
    """A deep copy of ``model`` with every ``nn.Linear`` replaced by its dual form.

    Trained by :class:`rcdl.optim.grower.Grower`, the copy computes exactly what ``model``
    trained by ``torch.optim.SGD(params, lr, momentum, weight_decay=weight_decay)`` computes
    (docs/reference.md §1, §3), while storing one entry per training sample per layer.

    Raises:
        ValueError: if ``model`` has trainable parameters outside its ``nn.Linear`` layers
            (a LayerNorm's scale, an embedding, ...): the Grower would leave them untrained,
            so the copy would not be the SGD-trained model. The error names them.
    """
    rule = FunctionalSGD(lr, weight_decay, momentum, per_sample=False)
    dual = copy.deepcopy(model)
    for _name, module in list(dual.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, GrowingLinear.from_linear(child, rule=rule))
    others = [name for name, p in dual.named_parameters() if p.requires_grad]
    if others:
        shown = ", ".join(others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        raise ValueError(
            f"to_dual_form: {type(model).__name__} has trainable parameters outside nn.Linear "
            f"layers ({shown}); the dual form trains only the Linear layers, so it would not "
            "equal SGD on this model. Freeze them (requires_grad_(False)) or remove them")
    return dual


def from_dual_form(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every :class:`~rcdl.nn.layers.GrowingLinear` replaced by the
    ``nn.Linear`` it computes now (:meth:`~rcdl.nn.layers.GrowingLinear.to_linear`): the inverse
    of :func:`to_dual_form`. Inference then costs ``O(d_in d_out)`` per layer whatever the
    number of stored entries, and the copy trains as an ordinary parametric model."""
    collapsed = copy.deepcopy(model)
    for _name, module in list(collapsed.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, GrowingLinear):
                setattr(module, child_name, child.to_linear())
    return collapsed


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model.eval()`` within the block; after it, every submodule is back in its own mode
    (``model.train(was_training)`` would put a ``BatchNorm`` frozen by ``.eval()`` back in
    training mode)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        # Pre-order: each module's own train() comes after its ancestors' and sets it last.
        for module, training in modes:
            module.train(training)


@torch.no_grad()
def layer_input(model: nn.Module, layer: nn.Module, x: Tensor) -> Tensor:
    """What ``layer`` receives (its first call) when ``model``, in eval mode, answers ``x``:
    for a :class:`ResidualNet`'s ``readout``, ``RMSNorm`` of the residual stream."""
    got: list[Tensor] = []
    hook = layer.register_forward_pre_hook(lambda module, args: got.append(args[0]))
    try:
        with eval_mode(model):
            model(x)
    finally:
        hook.remove()
    if not got:
        raise ValueError(f"layer_input: {type(layer).__name__} was not called by "
                         f"{type(model).__name__}")
    return got[0].detach()
