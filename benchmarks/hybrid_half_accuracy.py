"""Where a bfloat16 store costs the hybrid its accuracy: one-epoch hybrid runs with one
bfloat16 effect switched on at a time (results/speed/LOG.md, "The hybrid's accuracy with a
bfloat16 store").

Each variant is ``rcdl reproduce cifar10-1epoch --models hybrid`` with a diagnostic change
made in this process only (nothing in the library changes):

- ``float32``, ``bfloat16``: the plain runs (``--store-dtype bfloat16`` for the second);
- ``rounded-at-eval``: a float32 run that, at every evaluation, also evaluates the model with
  its entries' keys, values or both rounded to bfloat16 (to nearest), and prints the three
  results beside the float32 one (``EVAL ... ROUNDED ...`` on standard error);
- ``bf16-gradients``: a float32 run whose entry gradients (keys, values) are rounded to
  bfloat16 before the Adam step, as a bfloat16 store's are;
- ``compensated``: a bfloat16 run whose Adam step keeps each element's rounding error in a
  bfloat16 compensation term and rounds to nearest (Kahan summation), instead of rounding
  stochastically (slow: the terms are gathered by entry id on every step);
- ``sr-keys``, ``sr-values``, ``sr-entries``: a float32 run whose keys (values; both) are
  rounded stochastically to bfloat16 after every Adam step, the rest staying float32;
- ``sr-entries-bf16-gradients``: both of the last two, together;
- ``sr-entries-hash``: as ``sr-entries``, with the library's counter-based noise
  (:func:`rcdl.ops.rounding.rounding_noise` of the layer's seed, the Adam step and the entry
  ids) instead of torch's generator: the bfloat16 store's rounding, on a float32 store;
- ``bfloat16-torch-noise``: a bfloat16 store whose Adam step (the eager pass) rounds with
  random bits from torch's generator instead of the counter-based noise;
- ``nearest-forward``, ``nearest-forward-keys``, ``nearest-forward-values``: a float32 run
  whose Adam step moves exact float32 entries (a master copy) but leaves the store holding
  them rounded to nearest bfloat16 (keys and values; keys; values), so the forward and
  backward passes, the growth gate and the evaluations see bfloat16 entries while no Adam
  step is lost to rounding; ``nearest-forward-readout`` and ``nearest-forward-blocks``: keys
  and values, in the readout layer only (the one whose output is narrower than its input)
  or in the residual blocks only; ``jitter-forward``: as ``nearest-forward``, but the store
  holds the exact entries plus fresh uniform noise of one bfloat16 spacing's width at every
  step (a perturbation as large as rounding's, without its lag or its bias);
  ``jitter-forward-fine``: the same with noise 256 times narrower (a control: a perturbation
  far below bfloat16's); ``float32-chunks-1000``: a float32 run whose training batches stream
  the store in chunks of 1 000 entries instead of 2 048 (a control: the same sums in another
  order, a perturbation at float32's own rounding); ``float32-perturbed-once``: a float32
  run whose keys and values get, once, after Adam step ``RCDL_PERTURB_STEP`` (default 1),
  uniform relative noise of ±2⁻¹⁶ (of the order of ``jitter-forward-fine``'s, but
  proportional to each element rather than to its binade; torch's generator seeded by
  ``RCDL_PERTURB_SEED``, default 0): a float32 trajectory apart from one tiny nudge, to see
  whether such runs drift apart; ``rounded-steps-exact-gate``: as ``nearest-forward``, but
  the entries are rounded only while a training batch's forward and backward passes read
  them (the growth gate and the evaluations read the exact ones); ``rounded-gate-only``: the
  reverse, the gate alone reading the keys rounded.

    python benchmarks/hybrid_half_accuracy.py VARIANT --train-size 10000 --test-size 10000 \\
        --no-checkpoint --data-dir DIR --no-progress --out DIR [--seeds K]

With ``RCDL_RECORD_ENTRY_GRADS=FILE`` set, every layer's entry gradients are summarised at
every Adam step (the largest magnitude and the norm of the keys', values' and weights'
gradients, one JSON line per layer and step) into ``FILE``, to compare the variants' steps:

    python benchmarks/hybrid_half_accuracy.py --compare-grads A.jsonl[.gz] B.jsonl[.gz]

prints, per layer and part, B's gradient energy over the epoch (the sum of the squared norms)
over A's, and the largest share of it that one step carried in each.
"""

from __future__ import annotations

import os
import sys

import torch

VARIANTS = ("float32", "bfloat16", "rounded-at-eval", "bf16-gradients", "compensated",
            "sr-keys", "sr-values", "sr-entries", "sr-entries-bf16-gradients", "sr-entries-hash",
            "bfloat16-torch-noise", "nearest-forward", "nearest-forward-keys",
            "nearest-forward-values", "nearest-forward-readout", "nearest-forward-blocks",
            "jitter-forward", "jitter-forward-fine", "float32-chunks-1000",
            "float32-perturbed-once", "rounded-steps-exact-gate", "rounded-gate-only")


def rounded_at_eval() -> None:
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
                    for name in ("keys", "values"):
                        if what in (name, "both"):
                            t = getattr(store, name)
                            t.copy_(t.bfloat16().float())
                    store.moved()
                rounded[what] = plain(model, x, y, metrics, **kw)
                for layer, (k, v) in zip(layers, saved, strict=True):
                    layer.store.keys.copy_(k)
                    layer.store.values.copy_(v)
                    layer.store.moved()
        print("EVAL", result, "ROUNDED", rounded, file=sys.stderr, flush=True)
        return result

    loop.evaluate = evaluate


def bf16_gradients() -> None:
    from rcdl.nn.hybrid import HybridSoftmax

    plain = HybridSoftmax.take_entry_grads

    def take(self):  # noqa: ANN001, ANN202
        grads = plain(self)
        if grads is None:
            return None
        k, v, w = grads
        return tuple(None if g is None else g.bfloat16().float() for g in (k, v)) + (w,)

    HybridSoftmax.take_entry_grads = take


def compensated() -> None:
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

    entry_adam.adam_rows = adam_rows


def stochastic_after_step(*names: str, hashed: bool = False) -> None:
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
                t.copy_(round_stochastically(t, torch.bfloat16, noise).float())
        store.moved()

    EntryMoments.step = step


def torch_noise() -> None:
    import rcdl.optim.half_adam as half_adam

    half_adam.set_half_adam("eager")  # the pass that takes its noise from rounding_noise

    def noise(*, seed, step, ids, width, stream=0):  # noqa: ANN001, ANN202
        return torch.randint(-(1 << 31), 1 << 31, (ids.shape[0], width), dtype=torch.int32)

    half_adam.rounding_noise = noise


def _jittered(t: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``t`` plus uniform noise over one spacing of a ``bits``-bit significand (bfloat16's
    at 8) at each element."""
    _, exponent = torch.frexp(t)  # |t| = m 2^e, m in [0.5, 1): the spacing is 2^(e - bits)
    return t + (torch.rand_like(t) - 0.5) * torch.ldexp(torch.ones_like(t), exponent - bits)


def nearest_forward(*names: str, layers: str = "all", jitter: int = 0) -> None:
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
                getattr(store, name)[: exact.shape[0]].copy_(exact)
        plain(self, *args, **kw)
        with torch.no_grad():
            for name in names:
                t = getattr(store, name)
                held[name] = t.clone()
                t.copy_(_jittered(t, jitter) if jitter else t.bfloat16().float())
        masters[id(self)] = held
        store.moved()

    EntryMoments.step = step


def perturbed_once() -> None:
    from rcdl.optim.entry_adam import EntryMoments

    plain = EntryMoments.step
    generator = torch.Generator().manual_seed(int(os.environ.get("RCDL_PERTURB_SEED", "0")))
    at = int(os.environ.get("RCDL_PERTURB_STEP", "1"))

    def step(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        plain(self, *args, **kw)
        if int(self.steps) != at:
            return
        store = self.layer.store
        with torch.no_grad():
            for name in ("keys", "values"):
                t = getattr(store, name)
                u = torch.rand(t.shape, generator=generator) - 0.5
                t.add_(t * u * 2.0**-15)
        store.moved()

    EntryMoments.step = step


def rounded_steps_exact_gate() -> None:
    from rcdl.nn.hybrid import HybridSoftmax
    from rcdl.optim.entry_adam import EntryMoments

    plain_leaves, plain_step = HybridSoftmax.entry_leaves, EntryMoments.step
    masters: dict[int, list[torch.Tensor]] = {}  # id(layer) -> exact keys, values

    def entry_leaves(self):  # noqa: ANN001, ANN202
        store = self.store
        if id(self) not in masters:  # the step's first read: round for the passes
            with torch.no_grad():
                masters[id(self)] = [store.keys.clone(), store.values.clone()]
                for t in (store.keys, store.values):
                    t.copy_(t.bfloat16().float())
            store.moved()
        return plain_leaves(self)

    def step(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        held = masters.pop(id(self.layer), None)
        if held is not None:
            with torch.no_grad():
                self.layer.store.keys.copy_(held[0])
                self.layer.store.values.copy_(held[1])
            self.layer.store.moved()
        plain_step(self, *args, **kw)

    HybridSoftmax.entry_leaves = entry_leaves
    EntryMoments.step = step


def rounded_gate_only() -> None:
    import weakref

    from rcdl.nn.hybrid import HybridSoftmax
    from rcdl.optim.hybrid_grower import HybridGrower

    plain, plain_init = HybridGrower.step, HybridSoftmax.__init__
    every: weakref.WeakSet = weakref.WeakSet()  # the hybrid layers built in this process

    def init(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        plain_init(self, *args, **kw)
        every.add(self)

    def step(self, closure=None):  # noqa: ANN001, ANN202
        layers: list[HybridSoftmax] = [layer for layer in every if layer.training]
        plain_write = self.grower.write
        exact: list[torch.Tensor] = []

        def write():  # noqa: ANN202
            with torch.no_grad():
                for layer in layers:
                    exact.append(layer.store.keys.clone())
                    layer.store.keys.copy_(layer.store.keys.bfloat16().float())
                    layer.store.moved()
            plain_write()
            with torch.no_grad():
                for layer, keys in zip(layers, exact, strict=True):
                    layer.store.keys[: keys.shape[0]].copy_(keys)
                    layer.store.moved()

        self.grower.write = write
        try:
            plain(self, closure)
        finally:
            del self.grower.write

    HybridSoftmax.__init__ = init
    HybridGrower.step = step


def other_chunks() -> None:
    import rcdl.ops.streaming as streaming

    plain = streaming.default_chunk_size

    def chunk(batch, device=None):  # noqa: ANN001, ANN202
        return 1000 if batch <= 128 else plain(batch, device)

    streaming.default_chunk_size = chunk


def record_entry_grads(path: str) -> None:
    import json

    from rcdl.nn.hybrid import HybridSoftmax

    plain = HybridSoftmax.take_entry_grads
    out = open(path, "w")  # noqa: SIM115 - open for the whole run
    steps: dict[int, int] = {}

    def take(self):  # noqa: ANN001, ANN202
        grads = plain(self)
        if grads is not None:
            step = steps[id(self)] = steps.get(id(self), 0) + 1
            row = {"layer": int(self.rounding_seed), "step": step, "entries": len(self.store)}
            for name, g in zip(("keys", "values", "weights"), grads, strict=True):
                if g is not None:
                    row[name] = [float(g.abs().max()), float(g.norm())]
            out.write(json.dumps(row) + "\n")
            out.flush()
        return grads

    HybridSoftmax.take_entry_grads = take


def compare_grads(a: str, b: str) -> None:
    import collections
    import gzip
    import json

    def load(path: str) -> dict:
        rows: dict = collections.defaultdict(dict)
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            for line in f:
                row = json.loads(line)
                rows[row["layer"]][row["step"]] = row
        return rows

    first, second = load(a), load(b)
    print("layer  part      energy B/A   largest one-step share A, B")
    for layer in sorted(first):
        for part in ("keys", "values", "weights"):
            energy = []
            for rows in (first, second):
                squares = [r[part][1] ** 2 for r in rows[layer].values() if part in r]
                energy.append((sum(squares), max(squares)))
            (ea, ma), (eb, mb) = energy
            print(f"{layer:5d}  {part:8s}  {eb / ea:10.2f}   {ma / ea:6.0%}, {mb / eb:6.0%}")


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--compare-grads":
        compare_grads(sys.argv[2], sys.argv[3])
        return 0
    if len(sys.argv) < 2 or sys.argv[1] not in VARIANTS:
        print(__doc__.split("\n\n")[0] + f"\n\nusage: {sys.argv[0]} {{{','.join(VARIANTS)}}} "
              "[rcdl reproduce flags]", file=sys.stderr)
        return 2
    variant, rest = sys.argv[1], sys.argv[2:]
    if variant in ("bfloat16", "compensated", "bfloat16-torch-noise"):
        rest = [*rest, "--store-dtype", "bfloat16"]
    patches = {
        "rounded-at-eval": rounded_at_eval, "bf16-gradients": bf16_gradients,
        "compensated": compensated, "sr-keys": lambda: stochastic_after_step("keys"),
        "sr-values": lambda: stochastic_after_step("values"),
        "sr-entries": lambda: stochastic_after_step("keys", "values"),
        "sr-entries-bf16-gradients": lambda: (stochastic_after_step("keys", "values"),
                                              bf16_gradients()),
        "sr-entries-hash": lambda: stochastic_after_step("keys", "values", hashed=True),
        "bfloat16-torch-noise": torch_noise,
        "nearest-forward": lambda: nearest_forward("keys", "values"),
        "nearest-forward-keys": lambda: nearest_forward("keys"),
        "nearest-forward-values": lambda: nearest_forward("values"),
        "nearest-forward-readout": lambda: nearest_forward("keys", "values", layers="readout"),
        "nearest-forward-blocks": lambda: nearest_forward("keys", "values", layers="blocks"),
        "jitter-forward": lambda: nearest_forward("keys", "values", jitter=8),
        "jitter-forward-fine": lambda: nearest_forward("keys", "values", jitter=16),
        "float32-chunks-1000": other_chunks, "float32-perturbed-once": perturbed_once,
        "rounded-steps-exact-gate": rounded_steps_exact_gate,
        "rounded-gate-only": rounded_gate_only}
    patches.get(variant, lambda: None)()
    if os.environ.get("RCDL_RECORD_ENTRY_GRADS"):
        record_entry_grads(os.environ["RCDL_RECORD_ENTRY_GRADS"])
    from rcdl.app.cli import main as cli

    return cli(["reproduce", "cifar10-1epoch", "--models", "hybrid", *rest])


if __name__ == "__main__":
    sys.exit(main())
