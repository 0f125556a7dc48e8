"""The hybrid network's whole step in one optimizer: Adam on the entries, then the gated
growth (docs/reference.md §4)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn, overload

import torch
from torch import nn

from rcdl.memory.budgets import MemoryBudget
from rcdl.optim._step import Growth
from rcdl.optim.entry_adam import EntryAdam
from rcdl.optim.grower import Grower

__all__ = ["HybridGrower"]


class HybridGrower(torch.optim.Optimizer):
    """One object for a hybrid network's whole step (docs/reference.md §4): Adam on the entries (and
    on any ordinary parameters), then the gated growth, in that order.

    ``step()`` first checks every layer's recorded outputs and gradients and the entries'
    gradients (a NaN or a diverging layer refuses the step before anything moves, and leaves
    nothing pending), then runs :class:`EntryAdam` and then :class:`rcdl.optim.grower.Grower`.
    ``param_groups`` are the Adam group followed by the grower's groups (one per layer, ``lr``
    the rule's η), so a ``torch.optim.lr_scheduler`` scheduler drives both;
    :meth:`state_dict` holds both halves' state, with what the steps wrote into each layer
    and what its trigger refused (:attr:`growth`). ``half_adam`` is :class:`EntryAdam`'s: how
    the Adam pass over a half-precision store runs (:mod:`rcdl.optim.half_adam`).
    ``defer_checks`` is the grower's (:class:`rcdl.optim.grower.Grower`): deferred, the
    records' verdict is read with the Adam step's own check of the entry gradients, the
    step's one read back to the host, so a step whose records are refused moves nothing
    (no entry, moment or Adam step count; no ordinary parameter) and writes nothing, as
    where the checks are read in the step; the error is raised at :meth:`check`. A step
    refused only at its proposed entries (records passed) keeps its Adam move and writes
    nothing, again as in the step.

    Like any optimizer it leaves the gradients of the model's ordinary parameters (an
    ``nn.Linear`` in front, a ViT's embeddings) in place after ``step()``: call
    ``zero_grad()`` before the next backward, as :func:`rcdl.train.loop.train_step` does.

    Example::

        opt = HybridGrower(model, lr=1e-3)
        for x, y in batches:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9,
                 0.999), eps: float = 1e-8, budget: MemoryBudget | None = None,
                 half_adam: str | None = None, defer_checks: bool | None = None) -> None:
        self.adam = EntryAdam(model, lr=lr, betas=betas, eps=eps, half_adam=half_adam)
        self.grower = Grower(model, budget=budget, defer_checks=defer_checks)
        # the same group dicts as the two halves: a scheduler's change reaches them
        groups = [*self.adam.param_groups, *self.grower.param_groups]
        super().__init__(groups, {})

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> NoReturn: ...  # refused

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise TypeError("HybridGrower.step() takes no closure")
        if not self.grower.validate():  # a refused step drops the records
            return
        try:  # checks the entry gradients (and a deferred verdict) before anything moves
            self.adam.step(allowed=self.grower.records_passed())
        except Exception:
            self.zero_grad()
            raise
        self.grower.write()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget everything this step recorded: entry and parameter gradients, and records."""
        self.adam.zero_grad(set_to_none)
        self.grower.zero_grad(set_to_none)

    @property
    def defer_checks(self) -> bool:
        """Whether the growth checks are read at :meth:`check` rather than in the step."""
        return self.grower.defer_checks

    def check(self) -> None:
        """:meth:`rcdl.optim.grower.Grower.check`: raise a refusal deferred since the last one."""
        self.grower.check()

    @property
    def growth(self) -> dict[str, Growth]:
        """Per hybrid layer, by name, the entries the steps wrote and the samples the
        trigger refused (``growth[name].written``, ``growth[name].refused``): the grower's
        counts (:attr:`rcdl.optim.grower.Grower.growth`), saved in :meth:`state_dict`."""
        return self.grower.growth

    def sync(self) -> None:
        """:meth:`EntryAdam.sync`: the moments follow the rows now."""
        self.adam.sync()

    def state_dict(self) -> dict:
        self.check()  # a state with a refused step is never saved
        return {"adam": self.adam.state_dict(), "grower": self.grower.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` (after the model's own ``load_state_dict``); a state
        either half refuses changes neither."""
        if not isinstance(state, dict) or set(state) != {"adam", "grower"}:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"HybridGrower.load_state_dict: expected a dict with 'adam' and "
                             f"'grower', got {got}")
        self.grower.check_state_dict(state["grower"])
        self.adam.load_state_dict(state["adam"])  # checks everything before it changes any
        self.grower.load_state_dict(state["grower"])

    # the counts of :class:`~rcdl.optim.grower.Grower`: local_* never communicate, *_all_ranks()
    # are collectives under sharding, the plain ones refuse to guess once stores are sharded
    @property
    def local_num_entries(self) -> int:
        return self.grower.local_num_entries

    @property
    def local_nbytes(self) -> int:
        return self.grower.local_nbytes

    def num_entries_all_ranks(self) -> int:
        return self.grower.num_entries_all_ranks()

    def nbytes_all_ranks(self) -> int:
        return self.grower.nbytes_all_ranks()

    def entries_per_layer_all_ranks(self) -> list[int]:
        return self.grower.entries_per_layer_all_ranks()

    @property
    def num_entries(self) -> int:
        return self.grower.num_entries

    @property
    def nbytes(self) -> int:
        return self.grower.nbytes

    def entries_per_layer(self) -> list[int]:
        return self.grower.entries_per_layer()
