"""The growth step: after ``loss.backward()``, every growing layer writes its entries.

This plays the part of ``optimizer.step()`` for growing layers (docs/reference.md §3), and is shaped
like a ``torch.optim.Optimizer``::

    grower = Grower(model)
    for x, y in batches:
        grower.zero_grad()                    # as with any optimizer
        loss = F.cross_entropy(model(x), y)   # batch-mean loss
        loss.backward()
        grower.step()

Within a step every layer's entries are computed from the pre-step stores (the outputs
and gradients recorded during this forward/backward pass), all layers are validated
first, and only then are the entries committed together: a refused step (NaN/inf in a
gradient, a diverging layer) leaves every store unchanged and nothing pending, so the next
clean batch steps normally.

Like an optimizer, a grower has ``zero_grad()`` (forget what was recorded since the last
step), ``state_dict()`` / ``load_state_dict()`` (step counters, eviction counts, the rules'
learning rates: with the model's state dict, all a resumed run needs) and ``param_groups``:
one group per growing layer, whose ``lr`` is the η of that layer's rule. A
``torch.optim.lr_scheduler`` scheduler therefore drives η; the entries written after a change
use the new η. (A grower holds no tensors to optimise: each group's ``params`` is empty.)

With a :class:`~rcdl.memory.budgets.MemoryBudget` the grower also keeps memory bounded: once every
layer has committed, it chooses the entries each layer must drop to stay within the budget
(all layers' choices are made before any entry is removed), merges them into their nearest
kept entries if the budget says so, and removes them through
:meth:`~rcdl.nn.layers.GrowingLayer.remove_entries`. Between steps no store holds more than
``budget.capacity`` entries; :attr:`Grower.evicted` counts what each layer dropped. With
stores sharded over ranks (:mod:`rcdl.distributed`) the budget is per shard: each rank keeps
at most ``capacity`` entries of its shard, choosing (and merging) among its own entries, so
a layer holds at most ``W · capacity`` in all and ``evicted`` counts this rank's evictions.

The grower holds a divergence guard for each layer (:attr:`Grower.guards`) and wraps every
layer's step in it, as ``optax.apply_if_finite`` wraps an update; the step itself is
:mod:`rcdl.optim._step`'s (propose, commit, undo). The checks read nothing back to the host
while the step runs: each is a fault tensor on the device (:mod:`rcdl.nn.divergence`). By
default (on CPU, where a read costs nothing) the grower reads a step's faults twice, once
after validating the records and once before committing, and raises at once as described
above. With ``defer_checks`` (the default for stores on a
GPU, where each read stalls the device until it has caught up) it reads nothing in the step:
a refused step writes its entries with zero keys, values and weights (their number is all the
host knows; no NaN reaches a store) and does not advance the layers' step counters, so no
entry ages and no output changes; a hybrid layer, whose append waits for the device anyway,
writes nothing, and :class:`~rcdl.optim.hybrid_grower.HybridGrower` moves no entry by Adam.
The error of the first refused step is raised at the next check point, :meth:`Grower.check`,
which the training loop calls at every evaluation, checkpoint and at the end, and
:meth:`Grower.state_dict` calls before anything is saved. It names the step as the training
loop counts them: a grower counts its steps from 0 and saves the count in its state dict
(docs/gpu.md, "Host reads in a step", says what a refused step still leaves).

For a hybrid network (entries also trained by Adam) use
:class:`rcdl.optim.hybrid_grower.HybridGrower`,
which runs the Adam step and then this one. (Growing first would drop the entries'
gradients; :class:`rcdl.optim.entry_adam.EntryAdam` then refuses its step with an error.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, overload

import torch
from torch import Tensor, nn

from rcdl._checks import is_count
from rcdl.memory.budgets import MemoryBudget
from rcdl.nn.divergence import DivergenceGuard, first_fault, raise_first
from rcdl.nn.layers import GrowingLayer, growing_layers
from rcdl.optim import _step

__all__ = ["Grower"]


class Grower(torch.optim.Optimizer):
    """Writes the entries of every :class:`~rcdl.nn.layers.GrowingLayer` of ``model``.

    The loss must be the mean over the first dimension of each layer's input (the usual
    batch mean); rules that want per-sample gradients multiply back by that size.

    Args:
        model: a module holding at least one growing layer.
        budget: if given, every layer is brought back to at most ``budget.capacity``
            entries after each step (:mod:`rcdl.memory.budgets`); ``None`` lets the stores grow.
        defer_checks: read the step's checks at check points (:meth:`check`) rather than in
            the step, so that a step reads nothing back from the device; ``None`` (default):
            deferred where the stores are on a GPU, immediate elsewhere.

    Attributes:
        layers (list[GrowingLayer]): the growing layers, in module order (their ``name`` is
            set to the path).
        param_groups (list[dict[str, Any]]): one dict per layer, with keys ``params`` (an
            empty list), ``lr`` (the η of its rule) and ``layer`` (its name).
        evicted (dict[str, int]): entries evicted so far, by layer name (all zeros without a
            budget).
        guards (dict[str, DivergenceGuard]): each layer's divergence guard, by layer name
            (:mod:`rcdl.nn.divergence`): its reference scale is saved in :meth:`state_dict`.
        growth (dict[str, rcdl.optim._step.Growth]): per gated layer (the hybrid's), by
            name, the entries this grower's steps wrote and the samples the trigger refused
            (``growth[name].written``, ``growth[name].refused``; saved in
            :meth:`state_dict`).
    """

    def __init__(self, model: nn.Module, budget: MemoryBudget | None = None,
                 defer_checks: bool | None = None) -> None:
        if budget is not None and not isinstance(budget, MemoryBudget):
            raise TypeError(f"Grower: budget must be a rcdl.memory.budgets.MemoryBudget or None, "
                            f"got {type(budget).__name__}")
        self.layers: list[GrowingLayer] = []
        for name, layer in growing_layers(model):
            layer.bind_name(name)
            self.layers.append(layer)
        if not self.layers:
            raise ValueError(f"Grower: {type(model).__name__} has no growing layers")
        if budget is not None:
            for layer in self.layers:
                budget.check(layer)
        self.budget = budget
        if defer_checks is None:
            defer_checks = self.layers[0].store.device.type == "cuda"
        self.defer_checks = defer_checks
        for layer in self.layers:  # a backward without a step is warned of from the start
            layer.recorder.follow(deferred=defer_checks)
        self.guards = {layer.name: DivergenceGuard() for layer in self.layers}
        self._record_faults: Tensor | None = None  # (L, 3) this step's, deferred
        self._pending: Tensor | None = None  # (2L, 4) the first refused step's faults and step
        # steps taken, counted from 0 as the training loop counts them (a step that recorded
        # nothing, or was refused at a deferred check, counts; one that raised does not): the
        # step a deferred error names, saved in the state dict
        self._steps = 0
        self.evicted: dict[str, int] = {layer.name: 0 for layer in self.layers}
        self.growth = {layer.name: _step.Growth() for layer in self.layers if _step.gated(layer)}
        groups = [{"params": [], "lr": layer.rule.lr, "layer": layer.name} for layer in self.layers]
        super().__init__(groups, {})

    # ---------------------------------------------------------------- the step
    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> NoReturn: ...  # refused

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Commit the entries recorded since the last step (all layers or none), then evict
        down to the budget, if any.

        Raises:
            RuntimeError: the model is in eval mode, or a forward ran in training mode but no
                backward reached any growing layer. Nothing is written and the records are
                kept.
            ValueError: a gradient or an output is NaN/inf, or a layer diverges
                (:class:`~rcdl.nn.layers.GrowingLayer`, ``max_output_growth``). Nothing is
                written and the records are dropped.
        """
        if closure is not None:
            raise TypeError("Grower.step() takes no closure")
        if self.validate():
            self.write()

    def validate(self) -> bool:
        """The checks of :meth:`step` before anything is written; ``False`` when nothing was
        recorded. (:class:`rcdl.optim.hybrid_grower.HybridGrower` runs them before its Adam
        step.)"""
        self.check_mode()
        if not any(layer.recorder.ready() for layer in self.layers):
            pending = [layer.where for layer in self.layers if layer.recorder.has_pending]
            if pending:
                raise RuntimeError(
                    f"Grower.step(): {', '.join(pending)} ran a training forward pass that no "
                    "backward reached: call loss.backward() before grower.step(), with a loss "
                    "that depends on the model's output")
            self._steps += 1  # a step, though nothing was written
            return False
        faults, clean = [], None  # a layer sets its scale only if none faulted before it
        for layer in self.layers:
            fault = self.guards[layer.name].check_records(layer, clean)  # (3,)
            clean = (fault[0] == 0) if clean is None else clean & (fault[0] == 0)
            faults.append(fault)
        self._record_faults = record_faults = self._stack(faults)  # (L, 3)
        if not self.defer_checks:
            self._refusing(lambda: raise_first(self.layers, record_faults))
        return True

    def records_passed(self) -> Tensor | None:
        """With ``defer_checks``, after :meth:`validate`: whether the records passed every
        check, a ``()`` bool on the device (``None`` otherwise: a refusal has raised).
        :class:`~rcdl.optim.hybrid_grower.HybridGrower` gives it to its Adam step."""
        if not self.defer_checks or self._record_faults is None:
            return None
        return (self._record_faults[:, 0] == 0).all()

    def write(self) -> None:
        """Commit every layer's proposed entries, or none, then evict down to the budget
        (after :meth:`validate`). With ``defer_checks`` a refused step commits its entries
        zeroed without advancing the layers' step counters
        (:func:`rcdl.optim._step.commit`) and is remembered for :meth:`check`;
        with a budget too, the step's verdict is read (one read; the budget's eviction
        reads once per layer anyway) and a refused step's rows are taken back instead of
        evicting, so the store is as the step found it."""
        self._apply_learning_rates()

        def propose() -> tuple[list, list]:
            proposals, faults = [], []
            for layer in self.layers:
                made, fault = _step.proposal(layer)
                proposals.append(made)
                entries = None if made is None else made.entries
                guard = self.guards[layer.name]
                faults.append(first_fault(fault, guard.lookahead(layer, entries)))
            return proposals, faults

        proposals, faults = self._refusing(propose)
        write_faults = self._stack(faults)  # (L, 3)
        ok = None  # () bool on the device: the step passed (deferred checks only)
        if not self.defer_checks:
            self._refusing(lambda: raise_first(self.layers, write_faults))
        else:
            proposals, ok = self._defer(write_faults, proposals)
        self._record_faults = None
        self._steps += 1
        # sizes and ids before the commit, where a refused step's rows would be taken back
        before = None if self.budget is None or ok is None else [
            (len(layer.store), layer.store.next_id) for layer in self.layers]
        for layer, entries in zip(self.layers, proposals, strict=True):
            written = _step.commit(layer, entries, ok)
            if written is not None:
                self.growth[layer.name].count(layer, *written)
        if self.budget is not None:
            if before is not None and not bool(ok):  # refused: the zero rows go, nothing else
                for layer, (size, next_id) in zip(self.layers, before, strict=True):
                    _step.take_back_rows(layer, size, next_id)
                return
            masks = [self.budget.evict_mask(layer) for layer in self.layers]  # (N,) each
            for layer, mask in zip(self.layers, masks, strict=True):
                self.evicted[layer.name] += self.budget.apply(layer, mask)

    def _stack(self, faults: list[Tensor]) -> Tensor:  # (L, 3) on the first layer's device
        device = faults[0].device
        return torch.stack([fault.to(device) for fault in faults])

    def _defer(self, write_faults: Tensor, proposals: list) -> tuple[list, Tensor]:
        """Remember this step's faults if it is the first refused one since the last
        :meth:`check`; return the proposals zeroed where the step is refused, and whether
        it passed (a ``()`` bool on the device: no read)."""
        records = self._record_faults  # None: write() without validate(), no record faults
        faults = torch.cat([torch.zeros_like(write_faults) if records is None else records,
                            write_faults])  # (2L, 3)
        step = faults.new_full((faults.shape[0], 1), float(self._steps))
        rows = torch.cat([faults, step], dim=1)  # (2L, 4)
        if self._pending is None:
            self._pending = torch.zeros_like(rows)
        first = (self._pending[:, 0] == 0).all()  # no refused step remembered yet
        self._pending = torch.where(first, rows, self._pending)
        ok = (faults[:, 0] == 0).all()  # () the step passed every check
        return [None if made is None else
                made.with_entries(tuple(torch.where(ok, t, t.new_zeros(())) for t in made.entries))
                for made in proposals], ok

    def check(self) -> None:
        """Raise the error of the first step refused since the last check, if any (one read
        back to the host; a no-op without ``defer_checks``). The training loop calls it at
        every evaluation, before every checkpoint and at the end.

        Raises:
            ValueError: as :meth:`step` would have raised at the refused step, naming the
                layer and the check, followed by the step it happened at, counted from 0 as
                :func:`rcdl.train.loop.train_one_pass` counts its steps (the grower's own
                count, restored with its state dict: the loop's where the loop has stepped
                this grower from the start of the run).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        rows = torch.tensor(pending.tolist(), dtype=torch.float64)  # the one read
        refused = rows[:, 0].nonzero()
        if refused.numel():
            step = int(rows[int(refused[0]), 3])
            raise_first(self.layers, rows[:, :3], suffix=(
                f" (found at a deferred check: grower step {step}, counted from 0 as the "
                "training loop counts its steps, was refused and changed no output; any "
                "entries it wrote have zero keys, values and weights: docs/precision.md, "
                "\"Host reads in a step\")"))

    def _refusing(self, check: Callable[[], Any]) -> Any:
        """``check()``; if it raises, drop the records first: a refused batch leaves nothing
        behind for the next step."""
        try:
            return check()
        except Exception:
            self.zero_grad()
            raise

    def check_mode(self) -> None:
        """Raise if a growing layer is in eval mode (it records nothing to learn from)."""
        idle = [layer.where for layer in self.layers if not layer.training]
        if idle:
            raise RuntimeError(
                f"Grower.step(): {', '.join(idle)} is in eval mode, so the forward pass recorded "
                "nothing to learn from: call model.train() before a training step")

    def _apply_learning_rates(self) -> None:
        for group, layer in zip(self.param_groups, self.layers, strict=True):
            layer.set_learning_rate(group["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget what was recorded since the last step (nothing is written); records whose
        backward runs later are ignored too. ``set_to_none`` is accepted for compatibility."""
        for layer in self.layers:
            _step.discard(layer)
        self._record_faults = None

    def discard(self) -> None:
        """Same as :meth:`zero_grad`: drop this step's records without writing."""
        self.zero_grad()

    def drop_last_step(self) -> int:
        """Undo the last step in every layer (:func:`rcdl.optim._step.drop_last_step`):
        after a step that was accepted but should not have been (a learning rate that was
        far too high for one step: the next steps are then refused as diverging), the model
        computes again what it did before it. Returns the entries removed, all layers."""
        self.zero_grad()
        return sum(_step.drop_last_step(layer) for layer in self.layers)

    def reserve(self, entries_per_layer: int) -> None:
        """Preallocate room for this many more entries in every layer's store."""
        for layer in self.layers:
            layer.store.reserve(len(layer.store) + entries_per_layer)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything besides the model's own state dict that a resumed run needs: per layer
        its step counter, evictions, output scale (the divergence check's reference) and
        its group's learning rate, the steps taken (``steps_taken``: the count a
        deferred refusal names) and, per gated layer, what the steps wrote and refused
        (``growth``, :attr:`growth`). A refusal deferred since the last :meth:`check` is
        raised first: the state of a run with a refused step is never saved."""
        self.check()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {
            "param_groups": groups,
            "steps": {layer.name: int(layer.steps) for layer in self.layers},
            "evicted": dict(self.evicted),
            "output_scale": {name: guard.output_scale for name, guard in self.guards.items()},
            "shard": self._shard_place(),
            "steps_taken": self._steps,
            "growth": {name: growth.state_dict() for name, growth in self.growth.items()},
        }

    def _shard_place(self) -> tuple[int, int] | None:
        """``(rank, world size)`` the stores are sharded over, or ``None``."""
        shard = next((layer.shard for layer in self.layers if layer.shard is not None), None)
        return None if shard is None else (shard.rank, shard.world_size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; it must come from a grower over the same layers. The
        whole state is checked first (:meth:`check_state_dict`): one that would be refused
        changes nothing. A state saved before ``steps_taken`` was kept takes the layers'
        largest step counter as the steps taken; one saved before ``growth`` was kept takes
        the counts the model's state held on its layers, where it held them
        (:meth:`rcdl.nn.hybrid.HybridSoftmax.keep_old_counts`: load the model first)."""
        self.check_state_dict(state)
        for group, saved_group, layer in zip(self.param_groups, state["param_groups"],
                                             self.layers, strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
            layer.count_steps(state["steps"][layer.name] - int(layer.steps))
            self.guards[layer.name].restore(state["output_scale"][layer.name])
        self.evicted = dict(state["evicted"])
        self._steps = state.get("steps_taken", max(state["steps"].values()))
        for name, growth in self.growth.items():
            layer = self._layer(name)
            saved = state.get("growth", {}).get(name, layer.take_old_counts())
            if saved is not None:
                growth.load_state_dict(saved)
        self._apply_learning_rates()

    def _layer(self, name: str) -> Any:  # a gated layer (the hybrid), by name
        return next(layer for layer in self.layers if layer.name == name)

    def check_state_dict(self, state: Any) -> None:
        """Raise the ``ValueError`` that :meth:`load_state_dict` would raise for ``state``,
        naming what is wrong (a missing or unknown part, a layer it lacks, a value of the
        wrong type), or return: changes nothing."""
        where = "Grower.load_state_dict"
        if not isinstance(state, Mapping):
            raise ValueError(f"{where}: expected the dict of a Grower's state_dict(), got "
                             f"{type(state).__name__}")
        missing = [k for k in ("param_groups", "steps", "evicted", "output_scale")
                   if k not in state]
        if missing:
            raise ValueError(f"{where}: the state has no {', '.join(map(repr, missing))} "
                             f"(it has {', '.join(map(repr, state))})")
        self._check_place(state.get("shard"), where)
        names = [layer.name for layer in self.layers]
        groups = state["param_groups"]
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            raise ValueError(f"{where}: 'param_groups' must be a list of dicts, got "
                             f"{_describe(groups)}")
        saved = [g.get("layer") for g in groups]
        if saved != names:
            raise ValueError(f"{where}: the state is for layers {saved} (its param_groups), "
                             f"this grower has {names}")
        for key in ("steps", "evicted", "output_scale"):
            part = state[key]
            if not isinstance(part, Mapping):
                raise ValueError(f"{where}: {key!r} must be a dict by layer name, got "
                                 f"{_describe(part)}")
            if set(part) != set(names):
                lacking = [n for n in names if n not in part]
                unknown = [n for n in part if n not in names]
                raise ValueError(
                    f"{where}: the state's {key!r} is for layers {list(part)}, this grower "
                    f"has {names}" + (f"; missing {lacking}" if lacking else "")
                    + (f"; not in this grower {unknown}" if unknown else ""))
        for group, layer in zip(groups, self.layers, strict=True):
            name = layer.name
            for key, value, check, expected in (
                    ("steps", state["steps"][name], is_count, "an int >= 0"),
                    ("evicted", state["evicted"][name], is_count, "an int >= 0"),
                    ("output_scale", state["output_scale"][name],
                     lambda v: v is None or _real(v) and v >= 0, "None or a float >= 0"),
                    ("param_groups' lr", group.get("lr"), _real, "a finite float")):
                if not check(value):
                    raise ValueError(f"{where}: {key} of layer {name!r} must be {expected}, "
                                     f"got {_describe(value)}")
            try:
                layer.rule.with_lr(group["lr"])  # what _apply_learning_rates will do
            except ValueError as err:
                raise ValueError(f"{where}: {layer.where}: {err}") from None
        if "steps_taken" in state and not is_count(state["steps_taken"]):
            raise ValueError(f"{where}: 'steps_taken' must be an int >= 0, got "
                             f"{_describe(state['steps_taken'])}")
        growth = state.get("growth", {})
        if not isinstance(growth, Mapping) or set(growth) - set(self.growth):
            raise ValueError(f"{where}: 'growth' must be a dict by gated layer "
                             f"({sorted(self.growth)}), got {_describe(growth)}")
        for name, part in growth.items():
            problem = _step.Growth.state_problem(part)
            if problem is not None:
                raise ValueError(f"{where}: growth of layer {name!r} {problem}")

    def _check_place(self, theirs: Any, where: str) -> None:
        """Refuse a state saved by another shard placement (``None``: one process)."""
        if theirs is not None and not (isinstance(theirs, (list, tuple)) and len(theirs) == 2
                                       and all(is_count(p) for p in theirs)):
            raise ValueError(f"{where}: 'shard' must be None or (rank, world size), got "
                             f"{_describe(theirs)}")
        place = self._shard_place()
        if place != (None if theirs is None else tuple(theirs)):
            def describe(p):  # noqa: ANN001, ANN202
                return "one process" if p is None else f"rank {p[0]} of {p[1]}"
            raise ValueError(
                f"{where}: the state was saved by {describe(theirs)}, this "
                f"grower is {describe(place)}: a sharded run resumes with the same number of "
                "processes, each rank from its own state (re-sharding is not supported)")

    # ---------------------------------------------------------------- sizes
    @property
    def num_evicted(self) -> int:
        """Entries evicted by the budget so far, all layers."""
        return sum(self.evicted.values())

    # Counts come in two kinds with distinct names. ``local_*`` never communicate: what
    # this process stores. ``*_all_ranks()`` are totals over every rank of sharded stores,
    # so they are collectives (every rank must call them at the same point, or the job
    # hangs). ``num_entries``, ``nbytes`` and ``entries_per_layer()`` are the plain counts of
    # an unsharded model and refuse to guess which kind is meant once stores are sharded.
    @property
    def local_num_entries(self) -> int:
        """Entries this process stores, all layers (never communicates)."""
        return sum(len(layer.store) for layer in self.layers)

    @property
    def local_nbytes(self) -> int:
        """Bytes of the live entries this process stores, all layers (never communicates)."""
        return sum(layer.store.nbytes for layer in self.layers)

    def num_entries_all_ranks(self) -> int:
        """Entries stored by all ranks together, all layers: a collective (an ``all_reduce``)
        if the stores are sharded, to call on every rank; else :attr:`local_num_entries`."""
        return self._over_ranks([self.local_num_entries])[0]

    def nbytes_all_ranks(self) -> int:
        """Bytes of the live entries of all ranks together (a collective, as
        :meth:`num_entries_all_ranks`)."""
        return self._over_ranks([self.local_nbytes])[0]

    def entries_per_layer_all_ranks(self) -> list[int]:
        """Entries stored per layer by all ranks together (a collective if sharded)."""
        return self._over_ranks([len(layer.store) for layer in self.layers])

    @property
    def num_entries(self) -> int:
        """Entries stored, all layers, of a model whose stores are not sharded (under
        sharding: an error naming :attr:`local_num_entries` and :meth:`num_entries_all_ranks`)."""
        self._refuse_if_sharded("num_entries", "local_num_entries", "num_entries_all_ranks()")
        return self.local_num_entries

    @property
    def nbytes(self) -> int:
        """Bytes of the live entries, all layers, unsharded (as :attr:`num_entries`)."""
        self._refuse_if_sharded("nbytes", "local_nbytes", "nbytes_all_ranks()")
        return self.local_nbytes

    def entries_per_layer(self) -> list[int]:
        """Entries stored per layer, unsharded (as :attr:`num_entries`)."""
        self._refuse_if_sharded("entries_per_layer()", "[len(layer.store) for layer in "
                                "grower.layers]", "entries_per_layer_all_ranks()")
        return [len(layer.store) for layer in self.layers]

    def _refuse_if_sharded(self, name: str, local: str, total: str) -> None:
        if any(layer.shard is not None for layer in self.layers):
            raise RuntimeError(
                f"Grower.{name} is ambiguous once the stores are sharded over processes: use "
                f"grower.{local} for this rank's count (no communication) or grower.{total} "
                f"for the total over all ranks (a collective: call it on every rank at the "
                f"same point, or the job hangs)")

    def _over_ranks(self, counts: list[int]) -> list[int]:
        """Per-layer ``counts`` of this rank, summed over the ranks if the stores are sharded."""
        sharded = next((layer for layer in self.layers if layer.shard is not None), None)
        if sharded is None or sharded.shard is None:
            return counts
        local = torch.tensor(counts, dtype=torch.long, device=sharded.store.device)
        return sharded.shard.all_reduce(local).tolist()


def _real(value: Any) -> bool:
    """Whether ``value`` is a finite real number (not a bool)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _describe(value: Any) -> str:
    """``value`` as a refusal names it: its type, and its value where short."""
    if value is None:
        return "None"
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 60 else type(value).__name__
