"""Weighted-softmax streaming attention: speed against the GEMM rate, and working memory.

For each store dtype (float32, and the half-precision stores of docs/precision.md: keys and
values in bfloat16 or float16, queries, partials and gradients in float32), batch size B and
store size N (d_in = d_out = 3072) this measures, in one run on this machine:

- ``fwd+bwd``: the streaming attention forward plus backward w.r.t. the queries, counted
  as 8·B·N·d useful flops (two GEMMs forward — scores and values — and two backward);
- ``gemm``: ``torch.matmul`` on the same shapes, ``(B, d) @ (d, N)`` and ``(B, N) @ (N, d)``
  and their backward products, counted the same way, as the rate to compare against — the
  faster of the ``(B, N)`` layout and the entry-major ``(N, B)`` layout the attention uses;
- ``peak``: the process's peak resident memory during the first fwd+bwd above what it held
  with the store allocated (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``), as a fraction
  of the store's bytes. Each (B, N) runs in a fresh subprocess so peaks do not mix;
- ``× fp32``: a half store's fwd+bwd speed over the float32 store's at the same (B, N).

The machine line names the CPU flags that decide these rates (``avx512_bf16`` and AMX
multiply bfloat16 natively; without them bfloat16 may be slower than float32).

Run: ``python benchmarks/bench_attention.py`` (``--quick`` for a small smoke run,
``--store-dtypes float32 bfloat16 float16`` to choose the dtypes).
Targets (issue 2): ratio ≥ 0.6 at B = 16 and ≥ 0.75 at B = 500 for N ≥ 50k; peak < 10 %
of the store at N = 100k.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import torch

from harness import case, machine_line, timeit


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(batch: int, n: int, d: int, repeats: int, chunk_size: int | None,
            save_fraction: float, store_dtype: str = "float32") -> dict:
    """One configuration, in this process."""
    from rcdl.ops.attention import attention

    dtype = getattr(torch, store_dtype)
    torch.manual_seed(0)
    keys = torch.empty(n, d).normal_().div_(d**0.5).to(dtype)
    values = torch.empty(n, d).normal_().to(dtype)
    weights = torch.rand(n)
    q = torch.randn(batch, d)
    grad_out = torch.randn(batch, d)
    store_bytes = (keys.numel() + values.numel()) * keys.element_size() + weights.numel() * 4
    q_s, grad_out_s = q.to(dtype), grad_out.to(dtype)  # the GEMMs run in the store's dtype

    def fwd_bwd():
        qq = q.detach().requires_grad_()
        out = attention(qq, keys, values, weights, kernel="softmax", temperature=6.0,
                        chunk_size=chunk_size, save_fraction=save_fraction)
        out.backward(grad_out)

    def gemms():  # the natural (B, N) layout
        scores = torch.matmul(q_s, keys.T)  # (B, N)
        torch.matmul(scores, values)  # (B, d)
        back = torch.matmul(grad_out_s, values.T)  # (B, N)
        torch.matmul(back, keys)  # (B, d)

    def gemms_entry_major():  # the same products as (N, B) blocks, faster at small B here
        scores = torch.matmul(keys, q_s.T)  # (N, B)
        torch.matmul(values.T, scores)  # (d, B)
        back = torch.matmul(values, grad_out_s.T)  # (N, B)
        torch.matmul(keys.T, back)  # (d, B)

    # peak of the very first call (no warm-up), so that memory kept by the allocator after
    # an earlier call cannot hide it: an upper bound that includes one-time BLAS buffers
    rss_before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fwd_bwd()
    peak_bytes = max(0, _rss_kib("VmHWM") - rss_before) * 1024
    flops = 8 * batch * n * d
    t_attn = timeit(fwd_bwd, repeats).median
    t_gemm = min(timeit(gemms, repeats).median, timeit(gemms_entry_major, repeats).median)
    return {
        "B": batch, "N": n, "d": d,
        "attn_gflops": flops / t_attn / 1e9, "gemm_gflops": flops / t_gemm / 1e9,
        "ratio": t_gemm / t_attn, "attn_s": t_attn, "gemm_s": t_gemm,
        "peak_over_store": peak_bytes / store_bytes, "store_gb": store_bytes / 1e9,
    }


@case("attention-gemm", quick={"n": 2_000, "d": 256, "repeats": 2}, batch=16, n=50_000,
      d=3072, repeats=3, store_dtype="float32")
def attention_against_gemm(batch: int, n: int, d: int, repeats: int,
                           store_dtype: str) -> dict[str, float]:
    """The streaming attention's forward and backward against ``torch.matmul`` on the same
    products (the faster layout), median seconds; no peak memory (that needs a fresh
    process: the script's table has it)."""
    r = measure(batch, n, d, repeats, None, 0.05, store_dtype)
    return {"fwd+bwd": r["attn_s"], "gemm": r["gemm_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 500])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000, 100_000])
    parser.add_argument("--dim", type=int, default=3072)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--save-fraction", type=float, default=0.05,
                        help="attention's save_fraction (keep (B, N) blocks for backward)")
    parser.add_argument("--store-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=("float32", "bfloat16", "float16"),
                        help="dtypes of the stored keys and values (default: float32 bfloat16)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # child mode: B N dtype
    args = parser.parse_args()
    if args.quick:
        args.batches, args.sizes, args.dim, args.repeats = [16, 64], [2_000, 5_000], 256, 2
    if args.one:
        batch, n, store_dtype = int(args.one[0]), int(args.one[1]), args.one[2]
        print(json.dumps(measure(batch, n, args.dim, args.repeats, args.chunk_size,
                                 args.save_fraction, store_dtype)))
        return

    from rcdl.nn.store import format_bytes

    print(f"# machine: {platform.node()} {platform.machine()}, {machine_line()}, "
          f"d_in = d_out = {args.dim}; queries and gradients float32")
    header = ("| store |   B |       N | store bytes | attn GFLOP/s | GEMM GFLOP/s | ratio | "
              "peak / store | × fp32 |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    float32_time = {}
    for batch in args.batches:
        for n in args.sizes:
            for store_dtype in args.store_dtypes:
                r = _child(args, batch, n, store_dtype)
                if store_dtype == "float32":
                    float32_time[batch, n] = r["attn_s"]
                base = float32_time.get((batch, n))
                speedup = "" if base is None else f"{base / r['attn_s']:.2f}"
                print(f"| {store_dtype:>8} | {batch:3d} | {n:7d} | "
                      f"{format_bytes(int(r['store_gb'] * 1e9)):>11} | "
                      f"{r['attn_gflops']:12.1f} | {r['gemm_gflops']:12.1f} | {r['ratio']:5.2f} "
                      f"| {100 * r['peak_over_store']:10.1f} % | {speedup:>6} |", flush=True)


def _child(args: argparse.Namespace, batch: int, n: int, store_dtype: str) -> dict:
    """Measure one (B, N, dtype) in a fresh process (so peaks do not mix)."""
    cmd = [sys.executable, __file__, "--one", str(batch), str(n), store_dtype,
           "--dim", str(args.dim), "--repeats", str(args.repeats),
           "--save-fraction", str(args.save_fraction)]
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        raise SystemExit(f"benchmark child failed for B={batch}, N={n}, {store_dtype}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
