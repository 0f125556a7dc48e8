"""Where a bfloat16 store costs the hybrid its accuracy: one bfloat16 effect switched on at a
time in a one-epoch hybrid run (``rcdl reproduce cifar10-1epoch --models hybrid
--bf16-effect VARIANT``; results/speed/LOG.md, "The hybrid's accuracy with a bfloat16
store"; docs/cifar10.md, "The hybrid's bfloat16 diagnostics").

A variant is a diagnostic change to how the library trains the hybrid, made by
:func:`bf16_effect` for one run only: it replaces one or two functions of the library (the
Adam step on the entries, the entries' gradients, the evaluation, the growth gate's step)
with wrappers around them, and puts every one back when the run ends, however it ends.
Nothing in the library changes; the wrappers change a store's entries through its own
:meth:`~rcdl.nn.store.EntryStore.rewrite`, and say so with its ``moved()``. The variants
(:data:`VARIANTS`; the plain runs are the command without ``--bf16-effect``, with or without
``--store-dtype bfloat16``):

- ``rounded-at-eval``: a float32 run that, at every evaluation, also evaluates the model
  with its entries' keys, values or both rounded to bfloat16 (to nearest); the three results
  are printed beside the float32 one (``EVAL ... ROUNDED ...`` on standard error) and kept
  in the run's result (``rounded_evaluations``);
- ``bf16-gradients``: a float32 run whose entry gradients (keys, values) are rounded to
  bfloat16 before the Adam step, as a bfloat16 store's are;
- ``compensated``: a bfloat16 run whose Adam step keeps each element's rounding error in a
  bfloat16 compensation term and rounds to nearest (Kahan summation) instead of rounding
  stochastically (slow: the terms are gathered by entry id at every step);
- ``sr-keys``, ``sr-values``, ``sr-entries``: a float32 run whose keys (values; both) are
  rounded stochastically to bfloat16 after every Adam step, the rest staying float32;
  ``sr-entries-bf16-gradients``: ``sr-entries`` and ``bf16-gradients`` together;
  ``sr-entries-hash``: ``sr-entries`` with the library's counter-based noise
  (:func:`rcdl.ops.rounding.rounding_noise` of the layer's seed, the Adam step and the
  entry ids) instead of torch's generator: the bfloat16 store's rounding, on a float32 store;
- ``bfloat16-torch-noise``: a bfloat16 run whose Adam step (the eager pass) rounds with
  random bits from torch's generator instead of the counter-based noise;
- ``nearest-forward``, ``nearest-forward-keys``, ``nearest-forward-values``: a float32 run
  whose Adam step moves exact float32 entries (a master copy) but leaves the store holding
  them rounded to nearest bfloat16 (keys and values; keys; values), so the forward and
  backward passes, the growth gate and the evaluations see bfloat16 entries while no Adam
  step is lost to rounding; ``nearest-forward-readout`` and ``nearest-forward-blocks``: keys
  and values, in the readout layer only (the one whose output is narrower than its input)
  or in the residual blocks only;
- ``jitter-forward``: as ``nearest-forward``, but the store holds the exact entries plus
  fresh uniform noise one bfloat16 spacing wide at every step (a perturbation as large as
  rounding's, without its lag or its bias); ``jitter-forward-fine``: the noise 256 times
  narrower (a control: a perturbation far below bfloat16's);
- ``float32-chunks-1000``: a float32 run whose training batches stream the store in chunks
  of 1 000 entries instead of 2 048 (a control: the same sums in another order, a
  perturbation at float32's own rounding);
- ``float32-perturbed-once``: a float32 run whose keys and values get, once, after Adam
  step 1, uniform relative noise of ±2⁻¹⁶ (torch's generator seeded by 0): a float32
  trajectory apart from one tiny nudge, to see whether such runs drift apart;
  ``float32-perturbed-once-stepN-seedK`` nudges after Adam step ``N`` with seed ``K``;
- ``rounded-steps-exact-gate``: as ``nearest-forward``, but the entries are rounded only
  while a training batch's forward and backward passes read them (the growth gate and the
  evaluations read the exact ones); ``rounded-gate-only``: the reverse, the gate alone
  reading the keys rounded.

:func:`record_entry_grads` writes every hybrid layer's entry gradients' size at every Adam
step (``--entry-grads``: ``entry_grads/<model>-seed<k>.jsonl`` in the run folder), and
:func:`compare_entry_grads` compares two such records::

    python -m rcdl.app.experiments.cifar10.bf16_effects A.jsonl[.gz] B.jsonl[.gz]
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from rcdl.app.experiments.cifar10.config import HALF_STORE, VARIANTS, perturbation

__all__ = ["HALF_STORE", "VARIANTS", "bf16_effect", "compare_entry_grads", "record_entry_grads"]

def _replace(stack: ExitStack, owner: Any, name: str, new: Any) -> None:
    """Set ``owner.name`` (a module's function or a class's method) to ``new`` until
    ``stack`` closes, when the attribute is back as it was (removed where ``owner`` only
    inherited it)."""
    own = vars(owner)
    had, old = name in own, own.get(name)
    setattr(owner, name, new)

    def undo() -> None:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)

    stack.callback(undo)


# --------------------------------------------------------------------------- the variants


def _rounded_at_eval(stack: ExitStack, notes: list[dict[str, Any]]) -> None:
    import rcdl.train.loop as loop
    from rcdl.nn.hybrid import hybrid_layers

    plain = loop.evaluate

    def evaluate(model, x, y, metrics, **kw):  # noqa: ANN001, ANN003, ANN202
        result = plain(model, x, y, metrics, **kw)
        layers = [layer for _, layer in hybrid_layers(model)]
        rounded = {}
        with torch.no_grad():
            for what in ("keys", "values", "both"):
                saved = [(layer.store.keys.clone(), layer.store.values.clone())
                         for layer in layers]
                for layer in layers:
                    store = layer.store
                    store.rewrite(slice(None), **{
                        name: getattr(store, name).bfloat16().float()
                        for name in ("keys", "values") if what in (name, "both")})
                    store.moved()
                rounded[what] = plain(model, x, y, metrics, **kw)
                for layer, (k, v) in zip(layers, saved, strict=True):
                    layer.store.rewrite(slice(None), keys=k, values=v)
                    layer.store.moved()
        print("EVAL", result, "ROUNDED", rounded, file=sys.stderr, flush=True)
        notes.append({"float32": result, "rounded": rounded})
        return result

    _replace(stack, loop, "evaluate", evaluate)


def _bf16_gradients(stack: ExitStack) -> None:
    from rcdl.nn.hybrid import HybridSoftmax

    plain = HybridSoftmax.take_entry_grads

    def take(self):  # noqa: ANN001, ANN202
        grads = plain(self)
        if grads is None:
            return None
        k, v, w = grads
        return tuple(None if g is None else g.bfloat16().float() for g in (k, v)) + (w,)

    _replace(stack, HybridSoftmax, "take_entry_grads", take)


def _compensated(stack: ExitStack) -> None:
    import rcdl.optim.entry_adam as entry_adam

    terms: dict[tuple[int, int], torch.Tensor] = {}  # (layer seed, stream) -> (max id, w)

    def adam_rows(param, m, v, grad, a, c, *, ids, seed, step, stream, b1, b2,  # noqa: ANN001, ANN202
                  compiled=False, fused=False):
        key, need = (int(seed), stream), int(ids.max()) + 1
        held = terms.get(key)
        if held is None or held.shape[0] < need:
            grown = param.new_zeros((max(need, 0 if held is None else 2 * held.shape[0]),
                                     *param.shape[1:]))
            if held is not None:
                grown[: held.shape[0]] = held
            held = terms[key] = grown
        g = grad.to(m.dtype)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        shape = (-1,) + (1,) * (param.dim() - 1)
        denom = torch.sqrt(v).mul_(a.view(shape)).add_(c.view(shape))
        exact = param.to(m.dtype).add_(held[ids].to(m.dtype)).addcdiv_(m, denom, value=-1.0)
        nearest = exact.to(param.dtype)
        held[ids] = (exact - nearest.to(m.dtype)).to(param.dtype)
        param.copy_(nearest)

    _replace(stack, entry_adam, "adam_rows", adam_rows)


def _stochastic_after_step(stack: ExitStack, *names: str, hashed: bool = False) -> None:
    from rcdl.ops.rounding import round_stochastically, rounding_noise
    from rcdl.optim.entry_adam import EntryMoments

    plain = EntryMoments.step

    def step(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        plain(self, *args, **kw)
        store = self.layer.store
        with torch.no_grad():
            for name in names:
                t = getattr(store, name)
                noise = (rounding_noise(seed=self.layer.rounding_seed, step=self.steps,
                                        ids=store.ids, width=t.shape[1],
                                        stream=("keys", "values").index(name))
                         if hashed else None)
                store.rewrite(slice(None), **{
                    name: round_stochastically(t, torch.bfloat16, noise).float()})
        store.moved()

    _replace(stack, EntryMoments, "step", step)


def _sr_and_bf16_gradients(stack: ExitStack) -> None:
    _stochastic_after_step(stack, "keys", "values")
    _bf16_gradients(stack)


def _torch_noise(stack: ExitStack) -> None:
    import rcdl.optim.half_adam as half_adam

    stack.enter_context(half_adam.half_adam("eager"))  # the pass that calls rounding_noise

    def noise(*, seed, step, ids, width, stream=0):  # noqa: ANN001, ANN202
        return torch.randint(-(1 << 31), 1 << 31, (ids.shape[0], width), dtype=torch.int32)

    _replace(stack, half_adam, "rounding_noise", noise)


def _jittered(t: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``t`` plus uniform noise over one spacing of a ``bits``-bit significand (bfloat16's
    at 8) at each element."""
    _, exponent = torch.frexp(t)  # |t| = m 2^e, m in [0.5, 1): the spacing is 2^(e - bits)
    return t + (torch.rand_like(t) - 0.5) * torch.ldexp(torch.ones_like(t), exponent - bits)


def _nearest_forward(stack: ExitStack, *names: str, layers: str = "all",
                     jitter: int = 0) -> None:  # fmt: skip
    from rcdl.optim.entry_adam import EntryMoments

    plain = EntryMoments.step
    masters: dict[int, dict[str, torch.Tensor]] = {}  # id(moments) -> name -> (n, w) float32

    def step(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        store = self.layer.store
        readout = store.d_out < store.d_in
        if layers != "all" and readout != (layers == "readout"):
            plain(self, *args, **kw)
            return
        held = masters.get(id(self), {})
        with torch.no_grad():
            for name, exact in held.items():  # rows only append in this experiment
                store.rewrite(slice(0, exact.shape[0]), **{name: exact})
        plain(self, *args, **kw)
        with torch.no_grad():
            for name in names:
                t = getattr(store, name)
                held[name] = t.clone()
                store.rewrite(slice(None), **{
                    name: _jittered(t, jitter) if jitter else t.bfloat16().float()})
        masters[id(self)] = held
        store.moved()

    _replace(stack, EntryMoments, "step", step)


def _perturbed_once(stack: ExitStack, at: int, seed: int) -> None:
    from rcdl.optim.entry_adam import EntryMoments

    plain = EntryMoments.step
    generator = torch.Generator().manual_seed(seed)

    def step(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        plain(self, *args, **kw)
        if int(self.steps) != at:
            return
        store = self.layer.store
        with torch.no_grad():
            for name in ("keys", "values"):
                t = getattr(store, name)
                u = torch.rand(t.shape, generator=generator) - 0.5
                store.rewrite(slice(None), **{name: t + t * u * 2.0**-15})
        store.moved()

    _replace(stack, EntryMoments, "step", step)


def _rounded_steps_exact_gate(stack: ExitStack) -> None:
    from rcdl.nn.hybrid import HybridSoftmax
    from rcdl.optim.entry_adam import EntryMoments

    plain_leaves, plain_step = HybridSoftmax.entry_leaves, EntryMoments.step
    masters: dict[int, list[torch.Tensor]] = {}  # id(layer) -> exact keys, values

    def entry_leaves(self):  # noqa: ANN001, ANN202
        store = self.store
        if id(self) not in masters:  # the step's first read: round for the passes
            with torch.no_grad():
                masters[id(self)] = [store.keys.clone(), store.values.clone()]
                store.rewrite(slice(None), keys=store.keys.bfloat16().float(),
                              values=store.values.bfloat16().float())
            store.moved()
        return plain_leaves(self)

    def step(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        held = masters.pop(id(self.layer), None)
        if held is not None:
            with torch.no_grad():
                self.layer.store.rewrite(slice(None), keys=held[0], values=held[1])
            self.layer.store.moved()
        plain_step(self, *args, **kw)

    _replace(stack, HybridSoftmax, "entry_leaves", entry_leaves)
    _replace(stack, EntryMoments, "step", step)


def _rounded_gate_only(stack: ExitStack) -> None:
    from rcdl.nn.hybrid import HybridSoftmax
    from rcdl.optim.hybrid_grower import HybridGrower

    plain = HybridGrower.step

    def step(self, closure=None):  # noqa: ANN001, ANN202
        layers = [layer for layer in self.grower.layers
                  if isinstance(layer, HybridSoftmax) and layer.training]
        plain_write = self.grower.write
        exact: list[torch.Tensor] = []

        def write():  # noqa: ANN202
            with torch.no_grad():
                for layer in layers:
                    exact.append(layer.store.keys.clone())
                    layer.store.rewrite(slice(None), keys=exact[-1].bfloat16().float())
                    layer.store.moved()
            plain_write()
            with torch.no_grad():
                for layer, keys in zip(layers, exact, strict=True):
                    layer.store.rewrite(slice(0, keys.shape[0]), keys=keys)
                    layer.store.moved()

        self.grower.write = write
        try:
            plain(self, closure)
        finally:
            del self.grower.write

    _replace(stack, HybridGrower, "step", step)


def _other_chunks(stack: ExitStack) -> None:
    import rcdl.ops.plan as plan

    plain = plan.default_chunk_size

    def chunk(batch, device=None):  # noqa: ANN001, ANN202
        return 1000 if batch <= plan.TRAINING_BATCH else plain(batch, device)

    _replace(stack, plan, "default_chunk_size", chunk)


def _install(stack: ExitStack, variant: str, notes: list[dict[str, Any]]) -> None:
    """Make ``variant``'s replacements, undone when ``stack`` closes."""
    both = ("keys", "values")
    installs: dict[str, Callable[[], None]] = {
        "rounded-at-eval": lambda: _rounded_at_eval(stack, notes),
        "bf16-gradients": lambda: _bf16_gradients(stack),
        "compensated": lambda: _compensated(stack),
        "sr-keys": lambda: _stochastic_after_step(stack, "keys"),
        "sr-values": lambda: _stochastic_after_step(stack, "values"),
        "sr-entries": lambda: _stochastic_after_step(stack, *both),
        "sr-entries-bf16-gradients": lambda: _sr_and_bf16_gradients(stack),
        "sr-entries-hash": lambda: _stochastic_after_step(stack, *both, hashed=True),
        "bfloat16-torch-noise": lambda: _torch_noise(stack),
        "nearest-forward": lambda: _nearest_forward(stack, *both),
        "nearest-forward-keys": lambda: _nearest_forward(stack, "keys"),
        "nearest-forward-values": lambda: _nearest_forward(stack, "values"),
        "nearest-forward-readout": lambda: _nearest_forward(stack, *both, layers="readout"),
        "nearest-forward-blocks": lambda: _nearest_forward(stack, *both, layers="blocks"),
        "jitter-forward": lambda: _nearest_forward(stack, *both, jitter=8),
        "jitter-forward-fine": lambda: _nearest_forward(stack, *both, jitter=16),
        "float32-chunks-1000": lambda: _other_chunks(stack),
        "rounded-steps-exact-gate": lambda: _rounded_steps_exact_gate(stack),
        "rounded-gate-only": lambda: _rounded_gate_only(stack)}
    nudge = perturbation(variant)
    if nudge is not None:
        _perturbed_once(stack, *nudge)
    elif variant in installs:
        installs[variant]()
    else:
        raise ValueError(f"unknown bf16_effect {variant!r}; known: {', '.join(VARIANTS)}")


@contextmanager
def bf16_effect(variant: str | None) -> Iterator[list[dict[str, Any]]]:
    """Within the block, the library trains with ``variant``'s change (the module's
    docstring lists them; ``None``: no change); on leaving it, every replaced function is
    back. Yields a list that gathers what the variant measures along the way
    (``rounded-at-eval``: one record per evaluation, the float32 result and the rounded
    ones)."""
    notes: list[dict[str, Any]] = []
    with ExitStack() as stack:
        if variant is not None:
            _install(stack, variant, notes)
        yield notes


# --------------------------------------------------------------------------- entry gradients


@contextmanager
def record_entry_grads(path: Path) -> Iterator[None]:
    """Within the block, every hybrid layer's entry gradients are summarised at each Adam
    step into the JSON lines file ``path``: ``layer`` (its rounding seed), ``step``,
    ``entries`` and, for ``keys``, ``values`` and ``weights``, ``[largest |g|, ‖g‖]``."""
    from rcdl.nn.hybrid import HybridSoftmax

    plain = HybridSoftmax.take_entry_grads
    steps: dict[int, int] = {}
    with ExitStack() as stack, open(path, "w", encoding="utf-8") as out:

        def take(self):  # noqa: ANN001, ANN202
            grads = plain(self)
            if grads is not None:
                step = steps[id(self)] = steps.get(id(self), 0) + 1
                row: dict[str, Any] = {"layer": int(self.rounding_seed), "step": step,
                                       "entries": len(self.store)}
                for name, g in zip(("keys", "values", "weights"), grads, strict=True):
                    if g is not None:
                        row[name] = [float(g.abs().max()), float(g.norm())]
                out.write(json.dumps(row) + "\n")
                out.flush()
            return grads

        _replace(stack, HybridSoftmax, "take_entry_grads", take)
        yield


def _load_grads(path: str) -> dict[int, dict[int, dict[str, Any]]]:
    """A :func:`record_entry_grads` file (gzipped where it ends in ``.gz``): layer -> step
    -> its row."""
    rows: dict[int, dict[int, dict[str, Any]]] = collections.defaultdict(dict)
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        for line in f:
            row = json.loads(line)
            rows[row["layer"]][row["step"]] = row
    return rows


def compare_entry_grads(a: str, b: str) -> str:
    """Per layer and part (keys, values, weights) of two :func:`record_entry_grads` files:
    B's gradient energy over the epoch (the sum of the squared norms) over A's, and the
    largest share of it that one step carried in each; a text table."""
    first, second = _load_grads(a), _load_grads(b)
    lines = ["layer  part      energy B/A   largest one-step share A, B"]
    for layer in sorted(first):
        for part in ("keys", "values", "weights"):
            energy = []
            for rows in (first, second):
                squares = [r[part][1] ** 2 for r in rows[layer].values() if part in r]
                energy.append((sum(squares), max(squares)))
            (ea, ma), (eb, mb) = energy
            lines.append(f"{layer:5d}  {part:8s}  {eb / ea:10.2f}   {ma / ea:6.0%}, {mb / eb:6.0%}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m rcdl.app.experiments.cifar10.bf16_effects A.jsonl[.gz] "
                 "B.jsonl[.gz] (two --entry-grads records: B's entry-gradient energy against "
                 "A's, per layer and part)")
    print(compare_entry_grads(sys.argv[1], sys.argv[2]))
