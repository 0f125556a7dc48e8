"""The machine's limits at the attention's shapes: memory bandwidth and GEMM rates.

What can a one-epoch run on this machine reach at best? The streaming attention reads each
store once per product, in chunks of ``c`` entries of width ``d``, and multiplies each chunk
by ``B`` queries: at B = 16 it is bound by memory traffic or by the matrix unit, whichever
is slower. This measures, in one run:

- ``triad``: a STREAM-like ``a = b + s·c`` over three 512 MB float32 arrays (bytes moved /
  time, counting 3 arrays);
- ``gemm (cached)``: ``chunk (c, d) @ q (d, B)`` repeated on one chunk (it stays in cache),
  in float32 and bfloat16: the matrix unit's rate at this shape;
- ``gemm (streamed)``: the same product over consecutive chunks of a store of ``--store-gb``
  (larger than every cache), as the attention reads it: the rate the run can actually get.

Run: ``python benchmarks/machine_limits.py`` (``--quick`` for a smoke run). The machine line
names the CPU flags (docs/precision.md, "Where the time goes").
"""

from __future__ import annotations

import argparse

import torch

from harness import case, machine_line, timeit


def _best_time(fn, repeats: int) -> float:  # noqa: ANN001
    """The fastest of ``repeats`` calls after one warm-up (the machine's limit: the least
    disturbed call)."""
    return min(timeit(fn, repeats).times)


def triad_gb_per_s(megabytes: int, repeats: int) -> float:
    n = megabytes * 1_000_000 // 4
    return 3 * n * 4 / triad_case(megabytes, repeats)["triad"] / 1e9


def gemm_gflops(dtype: torch.dtype, chunk: int, d: int, batch: int, store_gb: float,
                repeats: int) -> tuple[float, float]:
    """(cached, streamed) GFLOP/s of ``keys_c @ q.T`` at this shape and dtype."""
    q = torch.randn(batch, d).to(dtype)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    chunks = max(2, int(store_gb * 1e9 // (chunk * d * itemsize)))
    store = torch.randn(chunks * chunk, d).to(dtype)  # (N, d)
    one = store[:chunk]
    flops = 2 * chunk * d * batch

    def cached() -> None:
        for _ in range(8):
            one @ q.T

    def streamed() -> None:
        for start in range(0, store.shape[0], chunk):
            store[start : start + chunk] @ q.T

    return (8 * flops / _best_time(cached, repeats) / 1e9,
            chunks * flops / _best_time(streamed, repeats) / 1e9)


@case("triad", quick={"megabytes": 16, "repeats": 1}, megabytes=512, repeats=3)
def triad_case(megabytes: int, repeats: int) -> dict[str, float]:
    """A STREAM-like triad ``a = b + s·c`` over three float32 arrays of ``megabytes`` each:
    the fastest call."""
    n = megabytes * 1_000_000 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    return {"triad": _best_time(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)}


@case("chunk-product", quick={"dim": 256, "store_gb": 0.02, "repeats": 1}, dtype="float32",
      chunk=2048, dim=3072, batch=16, store_gb=1.0, repeats=3)
def chunk_product(dtype: str, chunk: int, dim: int, batch: int, store_gb: float,
                  repeats: int) -> dict[str, float]:
    """``keys_c @ qᵀ`` at the attention's chunk shape: seconds per chunk on one cached chunk
    and streamed over a store of ``store_gb`` (the fastest call of each)."""
    cached, streamed = gemm_gflops(getattr(torch, dtype), chunk, dim, batch, store_gb, repeats)
    flops = 2 * chunk * dim * batch
    return {"cached": flops / cached / 1e9, "streamed": flops / streamed / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=3072)
    parser.add_argument("--chunk", type=int, default=2048, help="entries per chunk (CPU default)")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 500])
    parser.add_argument("--store-gb", type=float, default=1.0)
    parser.add_argument("--triad-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.dim, args.store_gb, args.triad_mb, args.repeats = 256, 0.02, 16, 1
    print(f"# {machine_line()}")
    print(f"triad: {triad_gb_per_s(args.triad_mb, args.repeats):.1f} GB/s "
          f"(3 arrays of {args.triad_mb} MB, float32)")
    print("| dtype | B | chunk × d | cached GFLOP/s | streamed GFLOP/s | streamed GB/s |")
    print("|---|---:|---|---:|---:|---:|")
    for batch in args.batches:
        for dtype in (torch.float32, torch.bfloat16):
            cached, streamed = gemm_gflops(dtype, args.chunk, args.dim, batch, args.store_gb,
                                           args.repeats)
            itemsize = torch.tensor([], dtype=dtype).element_size()
            gbps = streamed / (2 * batch) * itemsize  # bytes of the store read per flop
            print(f"| {str(dtype).removeprefix('torch.')} | {batch} | {args.chunk} × {args.dim} "
                  f"| {cached:.0f} | {streamed:.0f} | {gbps:.1f} |", flush=True)


if __name__ == "__main__":
    main()
