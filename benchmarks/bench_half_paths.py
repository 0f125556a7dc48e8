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

import torch

from harness import case, machine_line, timeit
from rcdl.ops import packed as packing
from rcdl.ops import widen
from rcdl.ops.attention import attend
from rcdl.ops.entries import Entries
from rcdl.ops.half import half_products, native_products

# each case: (its name, the store it reads, the product mode it runs under)
PATHS = {"float32": ("float32", "auto"), "float32 packed": ("float32", "auto"),
         "bfloat16 float32 chunks": ("bfloat16", "float32"),
         "bfloat16 widened": ("bfloat16", "widen"), "bfloat16 native": ("bfloat16", "native")}


def call_times(kernel: str, name: str, leaves: dict[str, tuple[torch.Tensor, ...]],
               chunk_cache: packing.PackedChunks, q_train: torch.Tensor, q_eval: torch.Tensor,
               repeats: int) -> dict[str, float]:
    """Median seconds of a training call (forward and backward of ``q_train``) and of a
    no-grad evaluation call (``q_eval``) of ``kernel`` on the store and path ``name``."""
    store, mode = PATHS[name]
    k, v, w = leaves[store]
    op = "softmax" if kernel == "hybrid" else kernel
    entries = Entries(k, v, w, op, packed=chunk_cache if name == "float32 packed" else None)
    with half_products(mode):
        def train() -> None:
            attend(q_train, entries).sum().backward()

        def evaluate() -> None:
            with torch.no_grad():
                attend(q_eval, entries)

        return {"train": timeit(train, repeats).median,
                "eval": timeit(evaluate, max(1, repeats // 3)).median}


def half_inputs(kernel: str, width: int, entries: int, train_batch: int, eval_batch: int,
                gen: torch.Generator) -> tuple[dict[str, tuple[torch.Tensor, ...]],
                                               torch.Tensor, torch.Tensor]:
    """A float32 store and its bfloat16 copy (keys, values, weights; leaves that need a
    gradient where ``kernel`` is ``hybrid``, whose entries train) and the two query batches."""
    keys = torch.randn(entries, width, generator=gen)  # (N, d)
    values = torch.randn(entries, width, generator=gen)  # (N, d)
    weights = torch.rand(entries, generator=gen) + 0.1  # (N,)
    stores = {"float32": (keys, values), "bfloat16": (keys.bfloat16(), values.bfloat16())}
    q_train = torch.randn(train_batch, width, generator=gen, requires_grad=True)  # (B, d)
    q_eval = torch.randn(eval_batch, width, generator=gen)  # (B_eval, d)
    leaves = {name: tuple(t.detach().requires_grad_(kernel == "hybrid") for t in (*kv, weights))
              for name, kv in stores.items()}
    return leaves, q_train, q_eval


@case("half-path", quick={"width": 64, "entries": 500, "eval_batch": 32, "repeats": 1},
      kernel="softmax", path="bfloat16 float32 chunks", width=1024, entries=6000,
      train_batch=16, eval_batch=500, repeats=3)
def half_path(kernel: str, path: str, width: int, entries: int, train_batch: int,
              eval_batch: int, repeats: int) -> dict[str, float]:
    """One store and product path of ``kernel`` (``path``: a name of ``PATHS``): a training
    and an evaluation call, median seconds."""
    leaves, q_train, q_eval = half_inputs(kernel, width, entries, train_batch, eval_batch,
                                          torch.Generator().manual_seed(0))
    return call_times(kernel, path, leaves, packing.PackedChunks(), q_train, q_eval, repeats)


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
    print(f"# {machine_line()}; bfloat16 native here: {native_products(torch.bfloat16)}")
    gen = torch.Generator().manual_seed(0)
    cases = ["float32", "bfloat16 float32 chunks"]
    packs = packing.supported(torch.float32) and packing.PACKED.get() != "off"
    if packs:
        cases.insert(1, "float32 packed")
    if widen.available():
        cases.append("bfloat16 widened")
    if native_products(torch.bfloat16) or args.native:  # emulated: 20-160x float32, skipped
        cases.append("bfloat16 native")
    print(f"# width {args.width}, {args.entries} entries, train batch {args.train_batch}, "
          f"eval batch {args.eval_batch}; median of {args.rounds} interleaved rounds")
    packed_col = " × float32 packed (train, eval) |" if packs else ""
    print(f"| kernel | store / path | train call ms | × float32 | eval call ms | × float32 |"
          f"{packed_col}")
    print("|---|---|---:|---:|---:|---:|" + ("---:|" if packs else ""))
    for kernel in args.kernels:
        leaves, q_train, q_eval = half_inputs(kernel, args.width, args.entries,
                                              args.train_batch, args.eval_batch, gen)
        trained = kernel == "hybrid"
        # a layer that trains its entries (the hybrid) packs none: plain float32 is its
        # store's time; the packed case's chunks are packed once, as a store keeps them
        kernel_cases = [name for name in cases if not (trained and name == "float32 packed")]
        baseline = "float32" if trained else "float32 packed"
        times: dict[str, dict[str, list[float]]] = {n: {"train": [], "eval": []}
                                                    for n in kernel_cases}
        chunk_cache = packing.PackedChunks()
        for _ in range(args.rounds):
            for name in kernel_cases:
                got = call_times(kernel, name, leaves, chunk_cache, q_train, q_eval,
                                 args.repeats)
                for what in ("train", "eval"):
                    times[name][what].append(got[what])
        for name in kernel_cases:
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
