"""Profile training steps and one evaluation batch of a growing CIFAR-10 model at a set store size.

Where does a step's time go besides the attention's arithmetic? This builds one model of the
one-epoch comparison (docs/cifar10.md), fills every growing layer's store with ``--entries``
entries at once (rows drawn like the model would write them: keys of the layer's input scale,
small values), then profiles ``--steps`` training steps (batch 16) and one evaluation batch
(500 queries) with ``torch.profiler``, and prints:

- the operators with the most self time (the attention's products should lead);
- the host reads of device values (``aten::_local_scalar_dense``, what ``.item()``, ``bool()``
  and ``.tolist()`` call): on a GPU each one waits for every queued kernel, so they are
  counted per step, with the Python lines that made them;
- wall time per step and per evaluation batch.

Run: ``python benchmarks/profile_step.py [--model gws] [--entries 50000] [--store-dtype
bfloat16] [--device cuda]`` (``--quick`` for a small smoke run). The same script serves the
CPU and a lent GPU (docs/precision.md, "Where the time goes").
"""

from __future__ import annotations

import argparse
import collections
import time
import traceback

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from harness import fill_stores, machine_line
from rcdl.app.allocator import keep_freed_memory
from rcdl.app.models import build_model


class HostReads(TorchDispatchMode):
    """Count the host reads of tensor values (``.item()``, ``bool()``, ``torch.equal``,
    ``.tolist()``) by the rcdl source line that made them. On a GPU each one waits for every
    queued kernel; on a CPU they are free, but this counts them all the same."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}

    def __init__(self) -> None:
        super().__init__()
        self.lines: collections.Counter = collections.Counter()
        self._tolist = torch.Tensor.tolist

    def _record(self) -> None:
        frames = [f for f in traceback.extract_stack()
                  if "/rcdl/" in f.filename and "profile_step" not in f.filename]
        where = frames[-1] if frames else None
        self.lines[f"{where.filename.split('/src/')[-1]}:{where.lineno} {where.line}"
                   if where else "(outside rcdl)"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in self.READS:
            self._record()
        return func(*args, **(kwargs or {}))

    def __enter__(self):  # noqa: ANN204
        mode = self

        def tolist(t: torch.Tensor):  # noqa: ANN202
            mode._record()
            return mode._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):  # noqa: ANN002, ANN204
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gws", help="a growing model of the comparison")
    parser.add_argument("--entries", type=int, default=50_000, help="entries per layer")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--store-dtype", choices=("float32", "bfloat16", "float16"),
                        default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--top", type=int, default=12, help="operators to list")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    keep_freed_memory()  # as the rcdl command does: large temporaries without page faults
    args = parser.parse_args()
    if args.quick:
        args.entries, args.steps = 2_000, 2
    device = torch.device(args.device)
    store_dtype = None if args.store_dtype == "float32" else getattr(torch, args.store_dtype)
    model, optimizer, grower = build_model(args.model, 0, device=device,
                                           store_dtype=store_dtype)
    if grower is None:
        raise SystemExit(f"{args.model} has no growing layers to profile")
    fill_stores(model, args.entries, torch.Generator().manual_seed(0))
    step_opt = optimizer if optimizer is not None and hasattr(optimizer, "grower") else grower
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 3072, generator=gen).to(device),
                torch.randint(0, 10, (16,), generator=gen).to(device))
               for _ in range(2 * args.steps + 1)]
    x_eval = torch.randn(500, 3072, generator=gen).to(device)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        step_opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        step_opt.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    train_step(*batches[-1])  # warm-up
    with torch.no_grad():
        model.eval()
        model(x_eval[:16])
        model.train()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities, with_stack=True) as step_prof:
        start = time.perf_counter()
        for x, y in batches[:args.steps]:
            train_step(x, y)
        sync()
        step_s = (time.perf_counter() - start) / args.steps
    model.eval()
    with profile(activities=activities, with_stack=True) as eval_prof:
        start = time.perf_counter()
        with torch.no_grad():
            model(x_eval)
        sync()
        eval_s = time.perf_counter() - start
    print(f"# {args.model}, {args.entries:,} entries per layer, store {args.store_dtype}, "
          f"{device}: {machine_line(device)}")
    print(f"# per training step (batch 16): {1e3 * step_s:.1f} ms; one evaluation batch (500): "
          f"{1e3 * eval_s:.1f} ms")
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for what, prof in ((f"{args.steps} training steps", step_prof),
                       ("one evaluation batch", eval_prof)):
        print(f"\n## {what}")
        print(prof.key_averages().table(sort_by=sort, row_limit=args.top,
                                        max_name_column_width=40))
    model.train()
    refused = ""
    with HostReads() as reads:  # again, outside the profiler: the dispatch mode slows ops
        try:  # on fresh batches: random data can drive a layer past its divergence check
            for x, y in batches[args.steps:-1]:
                train_step(x, y)
        except ValueError as err:
            refused = f" (a step was refused, the count stops there: {err})"
        model.eval()
        with torch.no_grad():
            model(x_eval)
    total = sum(reads.lines.values())
    print(f"# host reads of device values: {total} in {args.steps} steps and one evaluation "
          f"batch{refused}; by rcdl source line:")
    for line, count in reads.lines.most_common():
        print(f"{count:6d}  {line}")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise SystemExit(1) from None
