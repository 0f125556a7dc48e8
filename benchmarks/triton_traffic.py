"""The Triton attention path's traffic and time floor at the paper's shapes, by the model of
rcdl.ops.triton_traffic: modelled, not measured (nothing here runs a kernel or needs a GPU).

For every growing layer of gws, RBF and the hybrid (CIFAR-10's nets: blocks 3 072 → 3 072 and
a readout 3 072 → 10; gws and RBF two blocks, the hybrid three) at ``--entries`` entries, in
float32 and bfloat16 stores: a training call (``--train-batch`` queries, forward and backward)
and an evaluation call (``--eval-batch`` queries, forward), before (the path's kernels that
recomputed the scores per column block, at their 64-column blocks) and after (the kernels that
read each row once per block of queries). A training call's backward asks for the query
gradient only in gws and RBF (their stores are written by learning rules, not by autograd) and
for every gradient in the hybrid (EntryAdam trains its entries); every layer's query gradient
is counted, the first's included; the backward reads the forward's scores where the attention
op keeps them (they take at most 5 % of the store, as at batch 16). Then gws's one-epoch
training time at the floor: a store that grows by a batch per step from 16 entries, the sum
over the epoch's steps of every layer's training call at that step's size.

usage: python benchmarks/triton_traffic.py [--gpu h200] [--entries 50000]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from rcdl.ops.triton_traffic import (
    GPU,
    GPUS,
    Launch,
    Problem,
    backward_launches,
    forward_launches,
    keeps,
    old_backward_launches,
    old_forward_launches,
    seconds,
    store_bytes,
)

WIDTH, CLASSES, TRAIN_IMAGES = 3072, 10, 50_000
# (model, kernel, its growing layers (d, d_out), the gradients its training backward asks for)
NETS = [("gws", "softmax", [(WIDTH, WIDTH)] * 2 + [(WIDTH, CLASSES)], (True, False, False, False)),
        ("rbf", "rbf", [(WIDTH, WIDTH)] * 2 + [(WIDTH, CLASSES)], (True, False, False, False)),
        ("hybrid", "softmax", [(WIDTH, WIDTH)] * 3 + [(WIDTH, CLASSES)], (True, True, True, True))]
DTYPES = {"float32": 4, "bfloat16": 2}
OLD_BLOCKS = {"block_d": 64, "block_v": 64}  # the blocks of the path before


def call_launches(problem: Problem, train: bool, needs: tuple[bool, bool, bool, bool],
                  old: bool) -> list[Launch]:
    """One layer call's launches: forward, and backward where ``train``."""
    if old:
        problem = replace(problem, **OLD_BLOCKS)
        return old_forward_launches(problem) + (old_backward_launches(problem, needs)
                                                if train else [])
    return forward_launches(problem) + (backward_launches(problem, needs, keeps(problem))
                                        if train else [])


def epoch_seconds(gpu: GPU, store: int, batch: int, old: bool, share: float) -> float:
    """gws's one-epoch training floor: every step's three layer calls at its store's size."""
    _, kernel, layers, needs = NETS[0]
    total, n = 0.0, 16
    for _ in range(TRAIN_IMAGES // batch):
        for d, d_out in layers:
            problem = Problem(batch, n, d, d_out, kernel, store_bytes=store,
                              multiprocessors=gpu.multiprocessors)
            total += seconds(call_launches(problem, True, needs, old), gpu, share)
        n += batch
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    parser.add_argument("--entries", type=int, default=50_000)
    parser.add_argument("--train-batch", type=int, default=16)
    parser.add_argument("--eval-batch", type=int, default=500)
    args = parser.parse_args()
    gpu = GPUS[args.gpu]
    print(f"{gpu.name}: {gpu.bandwidth / 1e12:.2f} TB/s, {gpu.flops / 1e12:.0f} TFLOP/s "
          f"float32 (CUDA cores), {gpu.multiprocessors} SMs. Modelled, not measured.")
    print(f"N = {args.entries} entries per layer. Traffic in GB (10^9 bytes): every load and "
          "store, and what reaches HBM (a tensor of at most a quarter of the L2 read from it "
          "once per launch), also in reads of the store (keys, values, weights). Times in µs: "
          "the floor, max(HBM bytes / bandwidth, FLOPs / FLOP rate) summed over the launches, "
          "and the same at 80 % of the bandwidth\n")
    print("| net | layer | call | store | before: GB | before: HBM GB | before: µs (floor / "
          "80 %) | after: GB | after: HBM GB | after: HBM × store | after: µs (floor / 80 %) |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for net, kernel, layers, needs in NETS:
        for i, (d, d_out) in enumerate(layers):
            for train, batch in ((True, args.train_batch), (False, args.eval_batch)):
                for dtype, size in DTYPES.items():
                    problem = Problem(batch, args.entries, d, d_out, kernel, store_bytes=size,
                                      multiprocessors=gpu.multiprocessors)
                    cells = []
                    for old in (True, False):
                        launches = call_launches(problem, train, needs, old)
                        traffic = sum(launch.bytes for launch in launches)
                        hbm = sum(launch.hbm_bytes(gpu.l2_bytes / 4) for launch in launches)
                        times = [seconds(launches, gpu, share) * 1e6 for share in (1.0, 0.8)]
                        cells += [f"{traffic / 1e9:,.2f}", f"{hbm / 1e9:,.2f}"]
                        if not old:
                            cells.append(f"{hbm / store_bytes(problem):.2f}")
                        cells.append(f"{times[0]:,.0f} / {times[1]:,.0f}")
                    call = f"train B={batch}" if train else f"eval B={batch}"
                    print(f"| {net} | {i + 1}: {d}→{d_out} | {call} | {dtype} | "
                          + " | ".join(cells) + " |")
    print(f"\ngws, one epoch of training ({TRAIN_IMAGES} images, batch {args.train_batch}, "
          "the store growing from 16 entries): seconds at the floor / at 80 % of bandwidth\n")
    print("| store | before | after |")
    print("|---|---:|---:|")
    for dtype, size in DTYPES.items():
        cells = [" / ".join(f"{epoch_seconds(gpu, size, args.train_batch, old, share):.2f}"
                            for share in (1.0, 0.8)) for old in (True, False)]
        print(f"| {dtype} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
