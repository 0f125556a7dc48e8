"""The sharded path on a GPU: NCCL and CUDA tensors through a sharded growing layer.

Run on a machine with a GPU (the check of issue 13 for a lent GPU machine):

    torchrun --nproc-per-node 1 benchmarks/check_nccl.py            # NCCL, world size 1
    torchrun --nproc-per-node 2 benchmarks/check_nccl.py            # two GPUs, if present

and on a CPU (the same checks through gloo):

    torchrun --nproc-per-node 2 benchmarks/check_nccl.py --device cpu

Each rank builds the same gws network, shards it, trains a few steps on the same batches
and compares its outputs on held-out inputs with an unsharded copy trained alongside (on
rank 0's device), in float64 (1e-10) and float32 (1e-3). Prints one line per check and
exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rcdl import ClippedSoftmaxRule, Grower, GrowingSoftmaxNet
from rcdl.distributed import shard


def build(device: torch.device, dtype: torch.dtype) -> GrowingSoftmaxNet:
    torch.manual_seed(0)
    rule = ClippedSoftmaxRule(eta=0.3, beta=2.0)
    net = GrowingSoftmaxNet(64, 10, 2, temperature=1.0, rule=rule, initial_entries=16)
    return net.to(device=device, dtype=dtype)


def batches(steps: int, device: torch.device, dtype: torch.dtype):  # noqa: ANN201
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen).to(device=device, dtype=dtype)
        yield x, torch.randint(0, 10, (16,), generator=gen).to(device)


def check(device: torch.device, dtype: torch.dtype, tol: float) -> bool:
    sharded, single = build(device, dtype), build(device, dtype)
    shard(sharded)
    growers = Grower(sharded), Grower(single)
    for x, y in batches(8, device, dtype):
        for net, grower in zip((sharded, single), growers, strict=True):
            F.cross_entropy(net(x), y).backward()
            grower.step()
    held_out = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = sharded.eval()(held_out.to(device=device, dtype=dtype))
        b = single.eval()(held_out.to(device=device, dtype=dtype))
    diff = float((a - b).abs().max())
    entries = growers[0].num_entries_all_ranks()  # a total: a collective
    ok = diff <= tol and entries == growers[1].num_entries_all_ranks()
    if dist.get_rank() == 0:
        print(f"{'OK  ' if ok else 'FAIL'} {device.type} {str(dtype):14s} max |sharded − one "
              f"process| = {diff:.2e} (tolerance {tol:g}); entries {entries} over "
              f"{dist.get_world_size()} rank(s)")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: run with --device cpu", file=sys.stderr)
            return 2
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=2))
    try:
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
            print(f"# {backend}, world size {dist.get_world_size()}, {name}, torch "
                  f"{torch.__version__}")
        results = [check(device, torch.float64, 1e-10), check(device, torch.float32, 1e-3)]
    finally:
        dist.destroy_process_group()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
