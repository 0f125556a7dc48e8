"""Adam on the entries of a hybrid network's stores (docs/reference.md §4).

The entries are rows of growing stores, not ``nn.Parameter``s: each :class:`HybridSoftmax`
layer keeps their Adam moments beside them and moves them in
:meth:`~rcdl.hybrid.HybridSoftmax.adam_step` (with stochastic rounding for a half-precision
store, :mod:`rcdl.rounding`); :class:`EntryAdam` is the ``torch.optim.Optimizer`` that
drives those steps, checks the gradients first, and holds the state a resumed run needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn, overload

import torch
from torch import nn

from rcdl.half_adam import ADAM_MODE
from rcdl.hybrid import hybrid_layers

__all__ = ["EntryAdam"]


class EntryAdam(torch.optim.Optimizer):
    """Adam on the entries of every :class:`HybridSoftmax` layer of ``model``
    (docs/reference.md §4), plus Adam on the model's ordinary parameters, if it has any (one
    parameter group, so a ``torch.optim.lr_scheduler`` scheduler drives both).

    Step it after ``loss.backward()`` and before :meth:`rcdl.grower.Grower.step`, or let
    :class:`HybridGrower` do both. :meth:`state_dict` holds what a resumed run needs: the
    hyperparameters, every entry's moments and step count (row-aligned with the model's
    stores, so load the model first), and the ordinary parameters' Adam state.

    ``half_adam`` (``"auto"``, ``"eager"``, ``"compiled"``; ``None``: the process-wide
    default, :data:`rcdl.half_adam.ADAM_MODE`) says how the pass over a half-precision store
    runs (:mod:`rcdl.half_adam`); it is a hyperparameter of the group, saved in the state
    dict (a state saved without it keeps the learner's own).
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9,
                 0.999), eps: float = 1e-8, half_adam: str | None = None) -> None:
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0:
            raise ValueError(f"EntryAdam: need lr > 0, 0 <= betas < 1, eps > 0; got lr={lr}, "
                             f"betas={betas}, eps={eps}")
        if half_adam is not None:
            ADAM_MODE.check(half_adam)
        self.layers = hybrid_layers(model)
        if not self.layers:
            raise ValueError(f"EntryAdam: {type(model).__name__} has no HybridSoftmax layers")
        for name, layer in self.layers:
            layer.bind_name(name)
        params = [p for p in model.parameters() if p.requires_grad]
        super().__init__([{"params": params, "name": "entries and parameters (Adam)"}],
                         {"lr": lr, "betas": tuple(betas), "eps": eps, "half_adam": half_adam})
        self.param_adam = torch.optim.Adam(params, lr=lr, betas=betas, eps=eps) if params else None

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> NoReturn: ...  # refused

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """One Adam step on every entry with a gradient, then on the ordinary parameters.

        Refused (``ValueError`` naming the layer; every entry gradient dropped, nothing
        moved) if an entry gradient is NaN or inf.
        """
        if closure is not None:
            raise TypeError("EntryAdam.step() takes no closure")
        skipped = [layer.where for _, layer in self.layers if layer.adam_update_lost()]
        if skipped:
            for _, layer in self.layers:
                layer.drop_entry_grads()
            raise RuntimeError(
                f"EntryAdam.step(): Grower.step() ran before this step and dropped the entry "
                f"gradients of {', '.join(skipped)}, so that batch's Adam update is lost: step "
                "EntryAdam before the Grower (rcdl.HybridGrower does both in order)")
        group = self.param_groups[0]
        finite = torch.stack([layer.entry_grads_finite() for _, layer in self.layers])
        if not bool(finite.all()):
            bad = [layer.where for (_, layer), ok in zip(self.layers, finite.tolist(),
                                                         strict=True) if not ok]
            self.zero_grad()
            raise ValueError(f"EntryAdam: NaN or inf in the entry gradients of {', '.join(bad)};"
                             " no entry moved and the gradients are dropped")
        for _, layer in self.layers:  # half_adam None: the process-wide default
            layer.adam_step(group["lr"], group["betas"], group["eps"],
                            half_adam=group["half_adam"])
        if self.param_adam is not None:
            for inner in self.param_adam.param_groups:
                inner.update(lr=group["lr"], betas=group["betas"], eps=group["eps"])
            self.param_adam.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the entries' gradients (they live on per-step leaves) and the parameters'."""
        for _, layer in self.layers:
            layer.drop_entry_grads()
        if self.param_adam is not None:
            self.param_adam.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        layers = {}
        for name, layer in self.layers:
            layers[name] = {"adam_steps": int(layer.adam_steps),
                            "m": layer.adam_m.rows(), "v": layer.adam_v.rows()}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"param_groups": [group], "layers": layers,
                "param_adam": None if self.param_adam is None else self.param_adam.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` (after the model's own ``load_state_dict``). Everything is
        checked before anything changes."""
        names = {name for name, _ in self.layers}
        saved_mode = state.get("param_groups", [{}])[0].get("half_adam")
        if saved_mode is not None:
            try:
                ADAM_MODE.check(saved_mode)
            except ValueError as e:
                raise ValueError(f"EntryAdam.load_state_dict: half_adam {saved_mode!r}: "
                                 f"{e}") from None
        if set(state.get("layers", {})) != names:
            raise ValueError(f"EntryAdam.load_state_dict: the state is for layers "
                             f"{sorted(state.get('layers', {}))}, this model has {sorted(names)}")
        for name, layer in self.layers:
            for key in ("m", "v"):
                rows = state["layers"][name][key]["keys"].shape[0]
                if rows != len(layer.store):
                    raise ValueError(
                        f"EntryAdam.load_state_dict: {layer.where} stores {len(layer.store)} "
                        f"entries but the state has moments for {rows}: load the model's "
                        "state saved with it first")
        for name, layer in self.layers:
            saved = state["layers"][name]
            layer.adam_steps.fill_(saved["adam_steps"])
            layer.adam_m.load_rows(saved["m"])
            layer.adam_v.load_rows(saved["v"])
            layer.drop_entry_grads()
        group = self.param_groups[0]
        group.update({k: v for k, v in state["param_groups"][0].items() if k != "params"})
        group["betas"] = tuple(group["betas"])
        if self.param_adam is not None and state["param_adam"] is not None:
            self.param_adam.load_state_dict(state["param_adam"])
