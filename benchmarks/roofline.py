"""Each growing model's training step and evaluation batch against its flop floor.

For every growing model of the one-epoch comparison and every store dtype, this fills each
growing layer's store with ``--entries`` entries (as ``benchmarks/profile_step.py`` does),
then measures in one run on this machine:

- ``step``: one training step (batch 16: forward, backward, the growth step), median over
  ``--steps``; ``eval``: one no-grad evaluation batch of 500 images, median over two;
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
- the product path each half store took (:mod:`rcdl.ops.half`: native, or converted to float32
  chunk by chunk), the CPU model and its flags.

Run: ``python benchmarks/roofline.py [--models gws gauge rbf hybrid] [--store-dtypes float32
bfloat16] [--entries 50000]`` (``--quick`` for a small smoke run); ``--markdown FILE``
writes the table there too. The committed tables are in ``results/roofline/``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rcdl.app.experiments.cifar10_models import build_model
from rcdl.app.rundir import cpu_flags, cpu_model
from rcdl.nn.layers import growing_layers
from rcdl.ops.half import product_mode, upcast_chunks

CHUNK = 2048


def streamed_rate(dtype: torch.dtype, batch: int, width: int, store_bytes: float,
                  repeats: int = 3) -> float:
    """FLOP/s of ``keys_c @ qᵀ`` over consecutive chunks of a ``store_bytes`` store."""
    rows = max(CHUNK, int(store_bytes / (width * torch.empty((), dtype=dtype).element_size())))
    rows -= rows % CHUNK
    store = torch.randn(rows, width, dtype=torch.float32).to(dtype)
    q = torch.randn(batch, width).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for begin in range(0, rows, CHUNK):
            store[begin:begin + CHUNK] @ q.T  # noqa: B018 - timed for its cost
        best = min(best, time.perf_counter() - start)
    return 2 * batch * rows * width / best


def fill_stores(model: torch.nn.Module, entries: int, gen: torch.Generator) -> None:
    """``entries`` rows in every growing layer, written through the layer's own ``commit``
    (so a hybrid layer's Adam moments follow): keys of unit RMS, values of RMS 0.01,
    weights 1e-3."""
    for _, layer in growing_layers(model):
        store = layer.store
        store.reserve(len(store) + entries)
        for start in range(0, entries, 8192):
            b = min(8192, entries - start)
            factory = {"dtype": store.dtype}
            layer.commit((torch.randn(b, store.d_in, generator=gen).to(**factory),
                          (0.01 * torch.randn(b, store.d_out, generator=gen)).to(**factory),
                          torch.full((b,), 1e-3, **factory)))


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
    fill_stores(model, entries, gen)
    stepper = optimizer if optimizer is not None and hasattr(optimizer, "grower") else grower
    xs = torch.randn(steps + 1, 16, 3072, generator=gen)
    ys = torch.randint(0, 10, (steps + 1, 16), generator=gen)
    x_eval = torch.randn(500, 3072, generator=gen)
    train_flops = layer_flops(model, xs[0], 16, training=True)
    eval_flops = layer_flops(model, x_eval, 500, training=False)
    model.train()
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        stepper.zero_grad()
        F.cross_entropy(model(xs[i]), ys[i]).backward()
        stepper.step()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[1:])
    model.eval()
    eval_times = []
    with torch.no_grad():
        for _ in range(3):
            start = time.perf_counter()
            model(x_eval)
            eval_times.append(time.perf_counter() - start)
    eval_s = statistics.median(eval_times[1:])
    step_floor = train_flops / rates[(store_dtype, 16)]
    eval_floor = eval_flops / rates[(store_dtype, 500)]
    path = ("float32" if dtype is torch.float32 else
            "float32 chunks" if upcast_chunks(dtype, "cpu") else f"native {store_dtype}")
    return {"model": name, "store": store_dtype, "path": path, "step_ms": 1e3 * step_s,
            "step_floor_ms": 1e3 * step_floor, "eval_ms": 1e3 * eval_s,
            "eval_floor_ms": 1e3 * eval_floor, "entries": entries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["gws", "gauge", "rbf", "hybrid"])
    parser.add_argument("--store-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--entries", type=int, default=50_000, help="entries per layer")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--store-gb", type=float, default=1.0,
                        help="store size for the streamed rate (larger than the caches)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.models, args.entries, args.steps, args.store_gb = ["gws"], 2_000, 2, 0.05
    flags = " ".join(cpu_flags()) or "?"
    machine = (f"{cpu_model() or platform.processor() or '?'} ({flags}), torch "
               f"{torch.__version__}, {torch.get_num_threads()} threads, half products: "
               f"{product_mode()}")
    print(f"# {machine}", flush=True)
    rates = {(dt, b): streamed_rate(getattr(torch, dt), b, 3072, args.store_gb * 1e9)
             for dt in args.store_dtypes for b in (16, 500)}
    rate_text = ", ".join(f"{dt} B={b}: {r / 1e9:.0f} GFLOP/s" for (dt, b), r in rates.items())
    print(f"# streamed score-product rates: {rate_text}", flush=True)
    rows = []
    for name in args.models:
        for store_dtype in args.store_dtypes:
            r = measure(name, store_dtype, args.entries, args.steps, rates)
            rows.append(r)
            print(f"{name} {store_dtype}: step {r['step_ms']:.0f} ms (floor "
                  f"{r['step_floor_ms']:.0f}), eval {r['eval_ms']:.0f} ms (floor "
                  f"{r['eval_floor_ms']:.0f})", flush=True)
    lines = [f"Machine: {machine}. Streamed rates: {rate_text}. {args.entries:,} entries per "
             "growing layer.", "",
             "| model | store | product path | step ms (B = 16) | floor ms | × floor | "
             "eval ms (B = 500) | floor ms | × floor |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['store']} | {r['path']} | {r['step_ms']:.0f} | "
                     f"{r['step_floor_ms']:.0f} | {r['step_ms'] / r['step_floor_ms']:.2f} | "
                     f"{r['eval_ms']:.0f} | {r['eval_floor_ms']:.0f} | "
                     f"{r['eval_ms'] / r['eval_floor_ms']:.2f} |")
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table, encoding="utf-8")


if __name__ == "__main__":
    main()
