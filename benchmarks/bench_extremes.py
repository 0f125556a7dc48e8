"""The per-query maximum of a chunk's score block, ``(c, B)`` over its ``c`` entries, the ways
torch offers it: ``amax(dim=0)`` and ``max(dim=0).values`` (and the minimum likewise).

The streaming softmax takes this maximum once per chunk (``rcdl.ops.streaming._per_query``),
so at training batches it runs as often as the products. Prints µs per call for the block
shapes of a training chunk (B = 16) and an evaluation chunk (B = 500), best of
``--rounds`` rounds of ``--calls`` calls, with the CPU model and flags.

Run: ``python benchmarks/bench_extremes.py [--rounds 5] [--calls 200]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from rcdl.app.rundir import cpu_flags, cpu_model

SHAPES = ((2048, 16), (2048, 24), (2048, 32), (2048, 48), (2048, 64), (1024, 500))  # (c, B)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; flags {' '.join(cpu_flags()) or '-'}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; best of {args.rounds} rounds")
    print("| block (c, B) | amax(0) µs | max(0).values µs | amin(0) µs | min(0).values µs |")
    print("|---|---:|---:|---:|---:|")
    for c, b in SHAPES:
        block = torch.randn(c, b, generator=torch.Generator().manual_seed(0))  # (c, B)
        ways: list[Callable[[torch.Tensor], torch.Tensor]] = [
            lambda t: t.amax(0), lambda t: t.max(0).values,
            lambda t: t.amin(0), lambda t: t.min(0).values]
        got = [way(block) for way in ways]
        assert torch.equal(got[0], got[1]) and torch.equal(got[2], got[3])
        cells = []
        for way in ways:
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.calls):
                    way(block)
                best = min(best, (time.perf_counter() - start) / args.calls)
            cells.append(f"{1e6 * best:.1f}")
        print(f"| ({c}, {b}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
