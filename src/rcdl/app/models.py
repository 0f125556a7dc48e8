"""The application's model zoo: the models of the one-epoch CIFAR-10 comparison
(docs/cifar10.md, docs/reference.md §5–6), their builders, labels and the paper's numbers,
by name.

:data:`MODELS` holds the named ones; :func:`model_spec` also reads ``psoftmax-<N>`` (any N)
and ``hybrid-tau<τ>`` / ``hybrid-always``; :func:`build_model` builds one with its learner,
reproducibly from a seed. Every experiment that trains them (``cifar10-1epoch``,
``hybrid-tau-sweep``, ``continual``, ``memory-budget``, ...) and the benchmarks import them
from here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from rcdl.app.baseline_optim import make_optimizer
from rcdl.app.classical import CLASSICAL_MODELS
from rcdl.nn.gates import AlwaysGrow, DistanceGate
from rcdl.nn.layers import GrowingLaplacian, set_store_dtype
from rcdl.nn.networks import (
    GrowingRBFNet,
    GrowingSoftmaxNet,
    HybridSoftmaxNet,
    ParametricSoftmaxNet,
    ResidualNet,
    ResNetMLP,
)
from rcdl.nn.rules import ClippedSoftmaxRule, FunctionalSGD, GaugeSoftmaxRule
from rcdl.optim.entry_adam import EntryAdam
from rcdl.optim.grower import Grower

__all__ = [
    "CLASSES", "D_IN", "MODELS", "PAPER_MODELS", "Builder", "Learner", "ModelSpec",
    "Reference", "build_model", "hybrid_name", "hybrid_tau", "model_spec",
]  # fmt: skip

D_IN, CLASSES = 3072, 10
# the Laplacian net's temperature and η: the best of a short sweep (docs/cifar10.md)
LAPLACIAN_T, LAPLACIAN_LR = 0.35, 10.0


# --------------------------------------------------------------------------- the models


@dataclass(frozen=True)
class Reference:
    """docs/reference.md §6's numbers for one model (accuracy in percent; ``None`` where none is
    given).

    ``test_acc``, ``test_loss`` and ``entries`` come from the authors' one-seed run. For the
    tuned MLPs, ``seeds_acc = (mean, sd)`` is the accuracy over several seeds.
    """

    test_acc: float | None = None
    test_loss: float | None = None
    entries: int | None = None
    seeds_acc: tuple[float, float] | None = None

    def describe(self) -> str:
        """E.g. ``59.18 %``, ``57.2 ± 0.4 % (seeds)``, ``49.69 % (seeds: 48.2 ± 1.0)``, ``—``."""
        if self.seeds_acc is None:
            return "—" if self.test_acc is None else f"{self.test_acc:.2f} %"
        mean, sd = self.seeds_acc
        if self.test_acc is None:
            return f"{mean:.1f} ± {sd:.1f} % (seeds)"
        return f"{self.test_acc:.2f} % (seeds: {mean:.1f} ± {sd:.1f})"


Learner = tuple[nn.Module, Any, Grower | None]  # (model, optimizer or None, grower or None)
Builder = Callable[[int, torch.device, torch.dtype], Learner]  # (seed, device, dtype)


@dataclass(frozen=True)
class ModelSpec:
    """A model of the comparison: readable label, builder and the paper's numbers.

    A classical baseline (:mod:`rcdl.app.classical`) has no builder: it is fitted on the whole
    training set at once (``classical=True``) and scored once, at the end.
    """

    label: str
    build: Builder | None
    reference: Reference = field(default_factory=Reference)
    classical: bool = False
    growing: bool = False  # it has growing stores (which torchrun shards)
    in_paper: bool = True  # in the default model list (the paper's comparison)


def _softmax(rule: Any, temperature: float, seed: int, device: torch.device,
             dtype: torch.dtype) -> Learner:  # fmt: skip
    """A growing weighted-softmax net, L = 2, with ``rule`` (gws or gauge)."""
    net = GrowingSoftmaxNet(D_IN, CLASSES, 2, temperature=temperature, rule=rule, seed=seed)
    net = net.to(device=device, dtype=dtype)
    return net, None, Grower(net)


def _rbf(seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    net = GrowingRBFNet(D_IN, CLASSES, 2, temperature=10.0, rule=FunctionalSGD(10.0))
    net = net.to(device=device, dtype=dtype)
    return net, None, Grower(net)


def _laplacian(seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    """The RBF net's backbone and rule with the Laplacian kernel ``exp(−‖q − k‖ / (T√d))``:
    not in the paper; T and η from a short sweep (docs/cifar10.md, results/cifar10/laplacian/)."""
    def layer(a: int, b: int) -> GrowingLaplacian:
        return GrowingLaplacian(a, b, temperature=LAPLACIAN_T, rule=FunctionalSGD(LAPLACIAN_LR))

    net = ResidualNet(D_IN, CLASSES, 2, make_block=lambda w: layer(w, w), make_readout=layer)
    net = net.to(device=device, dtype=dtype)
    return net, None, Grower(net)


def _hybrid(tau: float | None, seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    """docs/reference.md §4, §6; ``tau=None`` grows on every sample (:class:`AlwaysGrow`)."""
    rule = ClippedSoftmaxRule(eta=1.0, beta=30.0)
    trigger = AlwaysGrow() if tau is None else DistanceGate(tau)
    net = HybridSoftmaxNet(D_IN, CLASSES, 3, temperature=5.0, rule=rule, trigger=trigger,
                           seed=seed)
    net = net.to(device=device, dtype=dtype)
    return net, EntryAdam(net, lr=1e-3), Grower(net)


def _mlp(optimizer: str, seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    model = ResNetMLP(D_IN, CLASSES, depth=8).to(device=device, dtype=dtype)
    return model, make_optimizer(optimizer, model), None


def _psoftmax(entries: int, seed: int, device: torch.device, dtype: torch.dtype) -> Learner:
    model = ParametricSoftmaxNet(D_IN, CLASSES, 2, entries=entries, temperature=3.0)
    model = model.to(device=device, dtype=dtype)
    return model, make_optimizer("adam", model, lr=1e-3), None  # docs/reference.md §5: Adam 1e−3


MODELS: dict[str, ModelSpec] = {
    "gws": ModelSpec("growing weighted softmax (gws)",
                     partial(_softmax, ClippedSoftmaxRule(eta=0.003, beta=3.0), 6.0),
                     Reference(59.18, 1.163, 150_048), growing=True),
    "gauge": ModelSpec("gauge-invariant WS",
                       partial(_softmax, GaugeSoftmaxRule(alpha=10.0, eta=0.03, beta=100.0), 5.0),
                       Reference(58.33, 1.203, 150_048), growing=True),
    "rbf": ModelSpec("growing RBF", _rbf, Reference(58.42, 1.200, 150_000), growing=True),
    "laplacian": ModelSpec("growing Laplacian (not in the paper)", _laplacian, growing=True,
                           in_paper=False),
    "hybrid": ModelSpec("hybrid growing WS (τ = 50)", partial(_hybrid, 50.0),
                        Reference(55.12, 1.330, 93_339), growing=True),
    "mlp-sgd": ModelSpec("ResNet-MLP, SGD", partial(_mlp, "sgd"), Reference(seeds_acc=(46.3, 2.0))),
    "mlp-adam": ModelSpec("ResNet-MLP, Adam", partial(_mlp, "adam"),
                          Reference(49.69, 1.409, seeds_acc=(48.2, 1.0))),
    "mlp-adamw": ModelSpec("ResNet-MLP, AdamW", partial(_mlp, "adamw"),
                           Reference(seeds_acc=(48.3, 1.0))),
    "mlp-rmsprop": ModelSpec("ResNet-MLP, RMSprop", partial(_mlp, "rmsprop"),
                             Reference(seeds_acc=(49.9, 0.7))),
    "mlp-muon": ModelSpec("ResNet-MLP, Muon", partial(_mlp, "muon"),
                          Reference(seeds_acc=(57.2, 0.4))),
    "psoftmax-5000": ModelSpec("parametric softmax, N = 5000", partial(_psoftmax, 5000),
                               Reference(42.02, 1.634)),
    "psoftmax-50016": ModelSpec("parametric softmax, N = 50016", partial(_psoftmax, 50016),
                                Reference(40.60, 1.672)),
    **{name: ModelSpec(label, None, classical=True)
       for name, (label, _) in CLASSICAL_MODELS.items()},
}  # fmt: skip
# the default model list: every model but those the paper does not have (the Laplacian net)
PAPER_MODELS = tuple(name for name, spec in MODELS.items() if spec.in_paper)
_PSOFTMAX = re.compile(r"psoftmax-([1-9][0-9]*)")
_HYBRID = re.compile(r"hybrid-(always|tau([0-9]+(?:\.[0-9]+)?))")


def hybrid_name(tau: float | None) -> str:
    """The model name of the hybrid with threshold ``tau`` (``None``: always grow)."""
    return "hybrid-always" if tau is None else f"hybrid-tau{tau:g}"


def hybrid_tau(name: str) -> tuple[bool, float | None]:
    """``(is a hybrid, its τ)`` for model ``name``: ``hybrid`` has τ = 50, ``hybrid-always``
    ``None`` (always grow); any other model is ``(False, None)``."""
    match = _HYBRID.fullmatch(name)
    if match is None:
        return name == "hybrid", 50.0 if name == "hybrid" else None
    return True, None if match.group(1) == "always" else float(match.group(2))


def model_spec(name: str) -> ModelSpec:
    """The spec of model ``name``: a key of :data:`MODELS`, ``psoftmax-<N>`` for any N ≥ 1,
    ``hybrid-tau<τ>`` for the hybrid with another threshold, or ``hybrid-always``.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name in MODELS:
        return MODELS[name]
    match = _PSOFTMAX.fullmatch(name)
    if match:
        n = int(match.group(1))
        return ModelSpec(f"parametric softmax, N = {n}", partial(_psoftmax, n))
    is_hybrid, tau = hybrid_tau(name)
    if is_hybrid:
        label = "hybrid growing WS, " + ("always grow" if tau is None else f"τ = {tau:g}")
        reference = MODELS["hybrid"].reference if tau == 50.0 else Reference()
        return ModelSpec(label, partial(_hybrid, tau), reference, growing=True)
    raise ValueError(
        f"unknown model {name!r}; known: {', '.join(MODELS)} (or psoftmax-<N>, N entries "
        "per layer; hybrid-tau<τ> or hybrid-always)"
    )


def build_model(name: str, seed: int, *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, reserve: int = 0,
                store_dtype: torch.dtype | None = None) -> Learner:
    """Build model ``name`` with its learner, reproducibly from ``seed``.

    torch's global generator is seeded with ``seed`` first (the MLP and parametric-softmax
    initialisations draw from it). The growing softmax nets seed their 16 initial entries
    from ``seed`` too. A grower reserves ``reserve`` more entries per layer, so its stores
    never reallocate during a pass over that many samples. ``store_dtype`` (e.g.
    ``torch.bfloat16``) is what the growing layers keep keys and values as
    (:func:`rcdl.nn.layers.set_store_dtype`; other models ignore it).

    Returns:
        ``(model, optimizer or None, grower or None)``, the model on ``device`` in ``dtype``.
    """
    spec = model_spec(name)
    if spec.classical:
        raise ValueError(f"{name!r} is a classical baseline, fitted by rcdl.app.classical, "
                         "not built")
    assert spec.build is not None  # every model but the classical baselines has a builder
    torch.manual_seed(seed)
    model, optimizer, grower = spec.build(seed, torch.device(device), dtype)
    if store_dtype is not None:
        set_store_dtype(model, store_dtype)
    if grower is not None and reserve:
        grower.reserve(reserve)
    return model, optimizer, grower
