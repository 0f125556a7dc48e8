"""A half-precision store's product paths against a float32 store, interleaved in one
process (docs/precision.md, "Product paths").

For each kernel of ``--kernels`` at width ``--width`` over ``--entries`` entries (``hybrid``:
the softmax with trained entries, whose backward also forms the keys', values' and weights'
gradients): the median time of a training call (forward + backward of ``--train-batch``
queries) and of a no-grad evaluation call (``--eval-batch`` queries), for a float32 store and
a bfloat16 store on the float32-chunk path, widened in registers (``rcdl.ops.widen``, where
numba is installed) and on the native path (where the CPU has bfloat16 units, or with
``--native``), each as the median over rounds of its time over float32's in the same round
(with the quartiles of those ratios in brackets). Where oneDNN packs float32 here, a float32
store whose full chunks are packed (``float32 packed``, docs/precision.md, "Packed chunks":
what a layer's own store does by default) joins the rounds, and a last column gives every
row's time over its (for the hybrid, whose layer trains its entries and packs none, over
plain float32's). Prints the CPU model and flags first. To emulate another machine
class, set the caps of docs/precision.md ("Emulating another machine class").

    python benchmarks/bench_half_paths.py [--width 1024 --entries 6000 --rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rcdl.app.rundir import cpu_flags, cpu_model
from rcdl.ops import packed as packing
from rcdl.ops import widen
from rcdl.ops.attention import attend
from rcdl.ops.entries import Entries
from rcdl.ops.half import half_products, native_products


def timed(fn, repeats: int) -> float:  # noqa: ANN001 - seconds per call
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--entries", type=int, default=6000)
    parser.add_argument("--train-batch", type=int, default=16)
    parser.add_argument("--eval-batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", nargs="+", default=["softmax", "rbf"],
                        help="kernels of the registry, or hybrid (softmax, trained entries)")
    parser.add_argument("--native", action="store_true",
                        help="time the native path also where it is emulated (slow)")
    args = parser.parse_args()
    print(f"# {cpu_model()} (flags {' '.join(cpu_flags())}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; bfloat16 native here: "
          f"{native_products(torch.bfloat16)}")
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(args.entries, args.width, generator=gen)
    values = torch.randn(args.entries, args.width, generator=gen)
    weights = torch.rand(args.entries, generator=gen) + 0.1
    stores = {"float32": (keys, values), "bfloat16": (keys.bfloat16(), values.bfloat16())}
    cases = [("float32", "float32", "auto"), ("bfloat16 float32 chunks", "bfloat16", "float32")]
    packs = packing.supported(torch.float32) and packing.PACKED.get() != "off"
    if packs:
        cases.insert(1, ("float32 packed", "float32", "auto"))
    if widen.available():
        cases.append(("bfloat16 widened", "bfloat16", "widen"))
    if native_products(torch.bfloat16) or args.native:  # emulated: 20-160x float32, skipped
        cases.append(("bfloat16 native", "bfloat16", "native"))
    print(f"# width {args.width}, {args.entries} entries, train batch {args.train_batch}, "
          f"eval batch {args.eval_batch}; median of {args.rounds} interleaved rounds")
    packed_col = " × float32 packed (train, eval) |" if packs else ""
    print(f"| kernel | store / path | train call ms | × float32 | eval call ms | × float32 |"
          f"{packed_col}")
    print("|---|---|---:|---:|---:|---:|" + ("---:|" if packs else ""))
    for kernel in args.kernels:
        times: dict[str, dict[str, list[float]]] = {n: {"train": [], "eval": []}
                                                    for n, _, _ in cases}
        q_train = torch.randn(args.train_batch, args.width, generator=gen, requires_grad=True)
        q_eval = torch.randn(args.eval_batch, args.width, generator=gen)
        trained = kernel == "hybrid"
        leaves = {name: tuple(t.detach().requires_grad_(trained) for t in (*kv, weights))
                  for name, kv in stores.items()}
        op = "softmax" if trained else kernel
        # a layer that trains its entries (the hybrid) packs none: plain float32 is its
        # store's time; the packed case's chunks are packed once, as a store keeps them
        kernel_cases = [case for case in cases if not (trained and case[0] == "float32 packed")]
        baseline = "float32" if trained else "float32 packed"
        chunk_cache = packing.PackedChunks()
        for _ in range(args.rounds):
            for name, store, mode in kernel_cases:
                k, v, w = leaves[store]
                entries = Entries(k, v, w, op,
                                  packed=chunk_cache if name == "float32 packed" else None)
                with half_products(mode):
                    def train(e=entries, q=q_train) -> None:  # noqa: ANN001
                        attend(q, e).sum().backward()

                    def evaluate(e=entries, q=q_eval) -> None:  # noqa: ANN001
                        with torch.no_grad():
                            attend(q, e)

                    times[name]["train"].append(timed(train, args.repeats))
                    times[name]["eval"].append(timed(evaluate, max(1, args.repeats // 3)))
        for name, _, _ in kernel_cases:
            tr, ev = (statistics.median(times[name][w]) for w in ("train", "eval"))
            against_packed = (f" {ratio(times, name, 'train', baseline)}, "
                              f"{ratio(times, name, 'eval', baseline)} |" if packs else "")
            print(f"| {kernel} | {name} | {tr * 1e3:.1f} | {ratio(times, name, 'train')} | "
                  f"{ev * 1e3:.1f} | {ratio(times, name, 'eval')} |{against_packed}")


def ratio(times: dict[str, dict[str, list[float]]], name: str, what: str,
          baseline: str = "float32") -> str:
    """The median over rounds of each round's time over ``baseline``'s in the same round,
    with the quartiles of those ratios: a drift of the machine's speed between rounds
    cancels."""
    per_round = sorted(t / b for t, b in zip(times[name][what], times[baseline][what],
                                             strict=True))
    if len(per_round) < 4:
        return f"{statistics.median(per_round):.2f}"
    q1, _, q3 = statistics.quantiles(per_round, n=4)
    return f"{statistics.median(per_round):.2f} ({q1:.2f}–{q3:.2f})"


if __name__ == "__main__":
    main()
