"""The per-query maximum of a chunk's score block, ``(c, B)`` over its ``c`` entries, the ways
torch offers it: ``amax(dim=0)`` and ``max(dim=0).values`` (and the minimum likewise).

The streaming softmax takes this maximum once per chunk (``rcdl.ops.partials.per_query``),
so at training batches it runs as often as the products. Prints µs per call for the block
shapes of a training chunk (B = 16) and an evaluation chunk (B = 500), best of
``--rounds`` rounds of ``--calls`` calls, with the CPU model and flags.

Run: ``python benchmarks/bench_extremes.py [--rounds 5] [--calls 200]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from harness import case, machine_line, timeit

SHAPES = ((2048, 16), (2048, 24), (2048, 32), (2048, 48), (2048, 64), (1024, 500))  # (c, B)
WAYS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "amax(0)": lambda t: t.amax(0), "max(0).values": lambda t: t.max(0).values,
    "amin(0)": lambda t: t.amin(0), "min(0).values": lambda t: t.min(0).values}


@case("extremes", quick={"rounds": 2, "calls": 20}, chunk=2048, batch=16, rounds=5, calls=200)
def extremes(chunk: int, batch: int, rounds: int, calls: int) -> dict[str, float]:
    """Seconds per call of each way to take a ``(chunk, batch)`` block's per-query maximum
    and minimum (best of ``rounds`` rounds of ``calls`` calls)."""
    block = torch.randn(chunk, batch, generator=torch.Generator().manual_seed(0))  # (c, B)
    got = [way(block) for way in WAYS.values()]
    assert torch.equal(got[0], got[1]) and torch.equal(got[2], got[3])
    return {name: min(timeit(lambda way=way: way(block), rounds, number=calls).times)
            for name, way in WAYS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(f"CPU: {machine_line()}; best of {args.rounds} rounds")
    print("| block (c, B) | amax(0) µs | max(0).values µs | amin(0) µs | min(0).values µs |")
    print("|---|---:|---:|---:|---:|")
    for c, b in SHAPES:
        seconds = extremes(c, b, args.rounds, args.calls)
        print(f"| ({c}, {b}) | " + " | ".join(f"{1e6 * s:.1f}" for s in seconds.values()) + " |")

if __name__ == "__main__":
    main()
