"""The attention's sum over a chunk's entries, ``left @ values_c``, against the score product,
in the ways a half-precision store could run it.

At B = 16 the streaming attention's training step multiplies each store chunk twice per
pass: once as the scores' wide operand (``keys_c @ qᵀ``, which streams at the machine's
best rate) and once summed over its entries (``left (B, c) @ values_c (c, d)`` forward, the
same shape with the keys backward). In bfloat16 the second runs about half as fast on the
AVX512-bf16 CPUs measured (docs/precision.md, results/speed/roofline/). This script times that
product as the attention runs it and in the orders a change could run it instead, streamed
over consecutive chunks of one store, interleaved rounds, best of each:

- ``scores``: ``keys_c @ qᵀ`` (the reference rate);
- ``sum``: ``left @ values_c`` (what the attention does);
- ``sum, sub-chunks of R``: the same over R-row slices, accumulated in float32;
- ``sum, batched``: one ``bmm`` over four slices of the chunk;
- ``sum, F.linear``: ``F.linear(left, values_cᵀ)`` on the transposed view (no copy);
- ``q @ keys_cᵀ``: the scores in the other order;
- ``sum, packed chunk``: the chunk packed once beforehand as oneDNN's kernels take it
  (:mod:`rcdl.ops.packed`, what the attention does from a chunk's first use on, where
  oneDNN packs the dtype here), and the product from there with no re-packing;
- ``scores, packed chunk``: the score product from the keys' chunk packed as it lies (what
  the attention does with ``RCDL_PACKED_CHUNKS=all``);
- ``packing a chunk``: what packing one chunk for its sum costs (once per chunk and store
  change, :mod:`rcdl.ops.packed`);
- for a bfloat16 store, where numba is installed: ``sum, widened in registers`` and
  ``scores, widened in registers`` (:mod:`rcdl.ops.widen`: bfloat16 rows widened to float32
  inside the products, float32 operands and accumulation: no reordering of the chunk);
- ``norms``: the keys' squared norms a distance kernel needs per chunk, squared in the
  store's dtype and summed, and as the attention forms them
  (:func:`rcdl.ops.kernels.row_sq_norms`);
- for a bfloat16 store, the same rows held in float32 beside it (``float32 store: ...``):
  the score product and, where oneDNN packs float32, the sum from a packed chunk, so that
  the widened products can be set against what a float32 store does in the same run.

Run: ``python benchmarks/bench_sum_products.py [--dtype bfloat16] [--chunks 10]``. Prints
ms per chunk, each against ``scores``, and for the products their rate: GFLOP/s
(``2·B·c·d`` per chunk) and the store's bytes read per second (``c·d`` elements of the
store's dtype; a product bound by memory reads near the machine's streamed bandwidth, one
bound by arithmetic well below it), with the CPU model and flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from harness import case, machine_line, timeit
from rcdl.ops import packed as packing
from rcdl.ops import widen
from rcdl.ops.kernels import row_sq_norms

Products = dict[str, Callable[[int], torch.Tensor]]


def products_of(dtype: torch.dtype, d: int, c: int, b: int,
                n: int) -> tuple[Products, dict[str, int]]:
    """Every product of the module's docstring over ``n`` chunks of ``c`` rows of width ``d``
    at batch ``b`` (each a function of the chunk's index), and the store bytes each reads."""
    torch.manual_seed(0)
    keys = torch.randn(n * c, d).to(dtype)  # (N, d)
    values = torch.randn(n * c, d).to(dtype)  # (N, d)
    q = torch.randn(b, d).to(dtype)  # (B, d)
    left = torch.randn(b, c).to(dtype)  # (B, c)

    def rows(i: int) -> slice:
        return slice(i * c, (i + 1) * c)

    def sub_chunks(size: int) -> Callable[[int], torch.Tensor]:
        def run(i: int) -> torch.Tensor:
            out = torch.zeros(b, d)  # (B, d)
            for j in range(0, c, size):
                end = min(j + size, c)
                out += (left[:, j:end] @ values[i * c + j:i * c + end]).float()
            return out
        return run

    def batched(i: int) -> torch.Tensor:
        parts = values[rows(i)].view(4, c // 4, d)  # (4, c/4, d)
        return torch.bmm(left.view(b, 4, c // 4).transpose(0, 1), parts).float().sum(0)

    products: dict[str, Callable[[int], torch.Tensor]] = {
        "scores keys_c @ qᵀ": lambda i: keys[rows(i)] @ q.T,
        "sum left @ values_c": lambda i: left @ values[rows(i)],
        "sum, sub-chunks of 256": sub_chunks(256),
        "sum, sub-chunks of 512": sub_chunks(512),
        "sum, sub-chunks of 1024": sub_chunks(1024),
        "sum, batched (4 slices)": batched,
        "sum, F.linear on the view": lambda i: F.linear(left, values[rows(i)].T),
        "scores q @ keys_cᵀ": lambda i: q @ keys[rows(i)].T,
    }
    if packing.supported(dtype):
        cache = packing.PackedChunks()
        packs = [cache.get("values", values[rows(i)], i * c, b) for i in range(n)]
        products["sum, packed chunk"] = lambda i: packing.packed_product(left, packs[i])
        with packing.packed_chunks("all"):
            key_packs = [cache.get("keys", keys[rows(i)], i * c, b, scores=True)
                         for i in range(n)]
        products["scores, packed chunk"] = lambda i: packing.packed_product(q, key_packs[i])
        products["packing a chunk"] = (
            lambda i: packing.PackedChunks().get("values", values[rows(i)], i * c, b))
    if dtype == torch.bfloat16 and widen.available():
        q32, left32, acc = q.float(), left.T.float().contiguous(), torch.zeros(b, d)
        products["sum, widened in registers"] = (
            lambda i: widen.sum_over_entries_(acc, left32, values[rows(i)]))
        products["scores, widened in registers"] = lambda i: widen.scores(keys[rows(i)], q32)[0]
    # a chunk's store bytes, for each product (packing is not one)
    bytes_per = {name: c * d * keys.element_size() for name in products
                 if name != "packing a chunk"}
    if dtype == torch.bfloat16:
        keys32, values32 = keys.float(), values.float()
        q_f32, left_f32 = q.float(), left.float()  # (B, d), (B, c)
        products["float32 store: scores keys_c @ qᵀ"] = lambda i: keys32[rows(i)] @ q_f32.T
        bytes_per["float32 store: scores keys_c @ qᵀ"] = c * d * 4
        if packing.supported(torch.float32):
            cache32 = packing.PackedChunks()
            packs32 = [cache32.get("values", values32[rows(i)], i * c, b) for i in range(n)]
            products["float32 store: sum, packed chunk"] = (
                lambda i: packing.packed_product(left_f32, packs32[i]))
            bytes_per["float32 store: sum, packed chunk"] = c * d * 4
    # the keys' squared norms a distance kernel needs per chunk: squared in the store's dtype
    # (an (c, d) temporary), and as the attention forms them
    products["norms (k * k).sum(1)"] = (
        lambda i: (keys[rows(i)] * keys[rows(i)]).sum(1, dtype=torch.float32))
    products["norms row_sq_norms"] = lambda i: row_sq_norms(keys[rows(i)], torch.float32)

    return products, bytes_per


def time_products(products: Products, n: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per chunk of every product, streamed over the ``n`` chunks, in ``rounds``
    interleaved rounds (after one warm-up call of each)."""
    for fn in products.values():
        fn(0)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in products}
    for _ in range(rounds):
        for name, fn in products.items():
            streamed = timeit(lambda fn=fn: [fn(i) for i in range(n)], 1, warmup=0)
            times[name].append(streamed.median / n)
    return times


@case("sum-products", quick={"width": 256, "chunks": 2, "rounds": 1}, dtype="bfloat16",
      width=3072, chunk=2048, batch=16, chunks=10, rounds=3)
def sum_products(dtype: str, width: int, chunk: int, batch: int, chunks: int,
                 rounds: int) -> dict[str, float]:
    """Seconds per chunk of each way to run a chunk's products (best of the rounds)."""
    products, _ = products_of(getattr(torch, dtype), width, chunk, batch, chunks)
    return {name: min(ts) for name, ts in time_products(products, chunks, rounds).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=10, help="chunks streamed per timing")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    b, c, d, n = args.batch, args.chunk, args.width, args.chunks
    products, bytes_per = products_of(getattr(torch, args.dtype), d, c, b, n)
    times = {name: [1e3 * t for t in ts]
             for name, ts in time_products(products, n, args.rounds).items()}
    print(f"CPU: {machine_line()}")
    print(f"{args.dtype}, B = {b}, chunk {c} × {d}, {n} chunks streamed, best of {args.rounds}")
    reference = min(times["scores keys_c @ qᵀ"])
    print("| product | ms per chunk | × scores | GFLOP/s | GB/s read |\n|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        ms = min(ts)
        rate = (f"{2 * b * c * d / ms / 1e6:.0f} | {bytes_per[name] / ms / 1e6:.1f}"
                if name in bytes_per else "— | —")
        print(f"| {name} | {ms:.3f} | {ms / reference:.2f} | {rate} |")


if __name__ == "__main__":
    main()
