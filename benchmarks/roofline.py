"""Each growing model's training step and evaluation batch against its flop floor.

For every growing model of the one-epoch comparison and every store dtype, this fills each
growing layer's store with ``--entries`` entries (``harness.fill_stores``),
then measures in one run on this machine:

- ``step``: one training step (batch 16: forward, backward, the growth step), median over
  ``--steps`` after two steps not counted (the first packs the stores' full chunks where
  they are packed, :mod:`rcdl.ops.packed`; a run packs them so once); ``eval``: one no-grad
  evaluation batch of 500 images, median over two;
- their **flop floors**: the attention's products in each growing layer, counted from the
  layer's shapes (forward ``2·B·N·(d_in + d_out)``; backward ``2·B·N·d_out`` for ``g·Vᵀ``,
  ``2·B·N·d_in`` for the query gradient where the layer's input needs one, and for the
  hybrid, whose entries are trained, ``2·B·N·(d_in + d_out)`` more for the entries'
  gradients), divided by the **streamed rate** of the score product ``keys_c @ qᵀ`` over
  consecutive 2 048-entry chunks of a store larger than the caches, measured here in the
  store's dtype for B = 16 and B = 500 (the rate the attention's best product gets when it
  reads the store as the attention does);
- ``× floor``: the measured time over the floor (1: the step costs only its products at
  the streamed rate);
- the product path each half store took (:mod:`rcdl.ops.half`: native, converted to float32
  chunk by chunk, or widened in registers for the training batch), the CPU model and flags.

Each process keeps freed memory as the ``rcdl`` command does
(:func:`rcdl.app.allocator.keep_freed_memory`), so a step pays no page faults for its large
temporaries (the hybrid's entry gradients are ``(N, d)``) that a run would not pay; tables
made before revision 2cb890e (``results/speed/roofline/``, 2026-12-07 and earlier) measured with
the system's allocator.

Where the store's products do not run natively in its dtype (a bfloat16 store on a CPU
without bfloat16 units), the floor divides by float32's streamed rate: the products run in
float32 there, over half the bytes.

``--classes`` measures, besides this machine (``here``), the machine classes it can emulate,
each in a process of its own with the caps of docs/precision.md ("Emulating another machine
class"): ``avx512`` (AVX512 without bfloat16 units: oneDNN capped at ``AVX512_CORE``) and
``avx2`` (torch's kernels, oneDNN and MKL capped at AVX2). The table then has a column pair
per class.

Run: ``python benchmarks/roofline.py [--models gws gauge rbf hybrid] [--store-dtypes float32
bfloat16] [--entries 50000] [--classes here avx512 avx2]`` (``--quick`` for a small smoke
run); ``--markdown FILE`` writes the table there too. The committed tables are in
``results/speed/roofline/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from harness import case, fill_stores, machine_line, timeit
from rcdl.app.allocator import keep_freed_memory
from rcdl.app.models import build_model
from rcdl.nn.layers import growing_layers
from rcdl.ops.half import native_products, product_mode, product_path

CHUNK = 2048
# the environment caps that emulate each machine class below this one (docs/precision.md)
CLASSES = {
    "here": {},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def streamed_rate(dtype: torch.dtype, batch: int, width: int, store_bytes: float,
                  repeats: int = 3) -> float:
    """FLOP/s of ``keys_c @ qᵀ`` over consecutive chunks of a ``store_bytes`` store."""
    rows = max(CHUNK, int(store_bytes / (width * torch.empty((), dtype=dtype).element_size())))
    rows -= rows % CHUNK
    store = torch.randn(rows, width, dtype=torch.float32).to(dtype)
    q = torch.randn(batch, width).to(dtype)

    def stream() -> None:
        for begin in range(0, rows, CHUNK):
            store[begin:begin + CHUNK] @ q.T  # noqa: B018 - timed for its cost

    return 2 * batch * rows * width / min(timeit(stream, repeats).times)


def layer_flops(model: torch.nn.Module, x: torch.Tensor, batch: int, training: bool) -> float:
    """The attention's product flops of one call of ``model`` on ``x`` (see the module's
    docstring), from each growing layer's shapes and whether its input needs a gradient."""
    seen: dict[str, bool] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda mod, args, name=name: seen.__setitem__(name, args[0].requires_grad))
        for name, layer in growing_layers(model)]
    with torch.no_grad():
        model.eval()
        model(x[:1])
    for hook in hooks:
        hook.remove()
    flops = 0.0
    for name, layer in growing_layers(model):
        n, d_in, d_out = len(layer.store), layer.store.d_in, layer.store.d_out
        flops += 2 * batch * n * (d_in + d_out)  # scores and values, forward
        if training:
            flops += 2 * batch * n * d_out  # g · Vᵀ
            if seen.get(name) or layer.trains_entries:
                flops += 2 * batch * n * d_in  # the query gradient
            if layer.trains_entries:
                flops += 2 * batch * n * (d_in + d_out)  # the entries' gradients
    return flops


def measure(name: str, store_dtype: str, entries: int, steps: int,
            rates: dict[tuple[str, int], float]) -> dict:
    dtype = getattr(torch, store_dtype)
    gen = torch.Generator().manual_seed(0)
    model, optimizer, grower = build_model(name, 0, store_dtype=None if dtype is torch.float32
                                           else dtype)
    fill_stores(model, entries, gen, commit=True)  # a hybrid layer's moments follow
    stepper = optimizer if optimizer is not None and hasattr(optimizer, "grower") else grower
    xs = torch.randn(steps + 2, 16, 3072, generator=gen)
    ys = torch.randint(0, 10, (steps + 2, 16), generator=gen)
    x_eval = torch.randn(500, 3072, generator=gen)
    train_flops = layer_flops(model, xs[0], 16, training=True)
    eval_flops = layer_flops(model, x_eval, 500, training=False)
    model.train()
    batches = iter(zip(xs, ys, strict=True))

    def step() -> None:
        x, y = next(batches)
        stepper.zero_grad()
        F.cross_entropy(model(x), y).backward()
        stepper.step()

    step_s = timeit(step, steps, warmup=2).median
    model.eval()
    with torch.no_grad():
        eval_s = timeit(lambda: model(x_eval), 2).median
    # where the products do not run in the store's dtype, they run in float32
    rate_dtype = store_dtype if native_products(dtype) else "float32"
    step_floor = train_flops / rates[(rate_dtype, 16)]
    eval_floor = eval_flops / rates[(rate_dtype, 500)]
    path = ("float32" if dtype is torch.float32 else
            product_path(dtype, "cpu").replace("native", f"native {store_dtype}"))
    return {"model": name, "store": store_dtype, "path": path, "step_ms": 1e3 * step_s,
            "step_floor_ms": 1e3 * step_floor, "eval_ms": 1e3 * eval_s,
            "eval_floor_ms": 1e3 * eval_floor, "entries": entries}


def streamed_rates(store_dtypes: list[str], store_gb: float) -> dict[tuple[str, int], float]:
    """:func:`streamed_rate` at B = 16 and 500 for float32 and every store dtype whose
    products run natively here."""
    return {(dt, b): streamed_rate(getattr(torch, dt), b, 3072, store_gb * 1e9)
            for dt in sorted(set(store_dtypes) | {"float32"}) for b in (16, 500)
            if dt == "float32" or native_products(getattr(torch, dt))}


@case("roofline", quick={"entries": 2_000, "steps": 2, "store_gb": 0.05}, model="gws",
      store_dtype="float32", entries=50_000, steps=5, store_gb=1.0)
def roofline_case(model: str, store_dtype: str, entries: int, steps: int,
                  store_gb: float) -> dict[str, float]:
    """A growing model's training step and evaluation batch (median seconds) and their flop
    floors at the streamed rate of the score product."""
    r = measure(model, store_dtype, entries, steps, streamed_rates([store_dtype], store_gb))
    return {"step": r["step_ms"] / 1e3, "step floor": r["step_floor_ms"] / 1e3,
            "eval": r["eval_ms"] / 1e3, "eval floor": r["eval_floor_ms"] / 1e3}


def run_class(args: argparse.Namespace) -> tuple[str, list[dict]]:
    """Measure every model and store dtype in this process: the machine line and the rows."""
    machine = f"{machine_line()}, half products: {product_mode()}"
    print(f"# {machine}", flush=True)
    rates = streamed_rates(args.store_dtypes, args.store_gb)
    rate_text = ", ".join(f"{dt} B={b}: {r / 1e9:.0f} GFLOP/s" for (dt, b), r in rates.items())
    print(f"# streamed score-product rates: {rate_text}", flush=True)
    rows = []
    for name in args.models:
        for store_dtype in args.store_dtypes:
            r = measure(name, store_dtype, args.entries, args.steps, rates)
            rows.append(r)
            print(f"{name} {store_dtype} ({r['path']}): step {r['step_ms']:.0f} ms (floor "
                  f"{r['step_floor_ms']:.0f}), eval {r['eval_ms']:.0f} ms (floor "
                  f"{r['eval_floor_ms']:.0f})", flush=True)
    return f"{machine}; streamed rates: {rate_text}", rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["gws", "gauge", "rbf", "hybrid"])
    parser.add_argument("--store-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--entries", type=int, default=50_000, help="entries per layer")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--store-gb", type=float, default=1.0,
                        help="store size for the streamed rate (larger than the caches)")
    parser.add_argument("--classes", nargs="+", default=["here"], choices=list(CLASSES),
                        help="machine classes to measure: this one and emulated ones")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    keep_freed_memory()  # as the rcdl command does: large temporaries without page faults
    args = parser.parse_args()
    if args.quick:
        args.models, args.entries, args.steps, args.store_gb = ["gws"], 2_000, 2, 0.05
    if args.child:  # one class, in the environment the parent set: rows as JSON, last line
        machine, rows = run_class(args)
        print(json.dumps({"machine": machine, "rows": rows}))
        return
    results = {}
    for cls in args.classes:
        print(f"## class {cls}: {' '.join(f'{k}={v}' for k, v in CLASSES[cls].items()) or '-'}",
              flush=True)
        command = [sys.executable, __file__, "--child", "--models", *args.models,
                   "--store-dtypes", *args.store_dtypes, "--entries", str(args.entries),
                   "--steps", str(args.steps), "--store-gb", str(args.store_gb)]
        done = subprocess.run(command, env={**os.environ, **CLASSES[cls]}, check=True,
                              stdout=subprocess.PIPE, text=True)
        *progress, last = done.stdout.strip().splitlines()
        print("\n".join(progress), flush=True)
        results[cls] = json.loads(last)
    lines = [f"{args.entries:,} entries per growing layer; step: one training step of batch "
             "16, eval: one no-grad batch of 500; each as ms and × its floor.", ""]
    lines += [f"- `{cls}` ({' '.join(f'{k}={v}' for k, v in CLASSES[cls].items()) or 'no caps'}"
              f"): {r['machine']}" for cls, r in results.items()]
    head = "| model | store |" + "".join(f" {c}: path | {c}: step | {c}: eval |"
                                         for c in results)
    lines += ["", head, "|---|---|" + "---|---:|---:|" * len(results)]
    for i, first in enumerate(next(iter(results.values()))["rows"]):
        cells = ""
        for r in results.values():
            row = r["rows"][i]
            cells += (f" {row['path']} | {row['step_ms']:.0f} ms, "
                      f"{row['step_ms'] / row['step_floor_ms']:.2f}× | {row['eval_ms']:.0f} ms, "
                      f"{row['eval_ms'] / row['eval_floor_ms']:.2f}× |")
        lines.append(f"| {first['model']} | {first['store']} |{cells}")
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table, encoding="utf-8")


if __name__ == "__main__":
    main()
