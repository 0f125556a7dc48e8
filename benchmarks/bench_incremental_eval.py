"""Evaluation time of a one-pass gws run with and without incremental evaluation.

Trains the paper's gws network (docs/reference.md §6) on a CIFAR-10 subset twice, in the
same process and on the same images, once evaluating every growing layer over its whole
store (`incremental_eval=False`, the default) and once reusing each layer's partial results
over the entries it held at the previous evaluation (`incremental_eval=True`, see
`rcdl.nn.backends.enable_eval_cache`). Prints the training and evaluation seconds of
both, their ratio, and the largest difference of the test metrics (rounding only).

    python benchmarks/bench_incremental_eval.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from rcdl.app.allocator import keep_freed_memory
from rcdl.app.experiments.cifar10.config import METRICS, Cifar10Config, load_data
from rcdl.app.models import build_model
from rcdl.app.rundir import cpu_flags, cpu_model
from rcdl.train.loop import train_one_pass


def cpu_line() -> str:
    return (f"# {cpu_model()}, flags {' '.join(cpu_flags()) or '?'}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--train-size", type=int, default=10_000)
    parser.add_argument("--test-size", type=int, default=10_000)
    parser.add_argument("--eval-every", type=int, default=125)
    args = parser.parse_args()
    keep_freed_memory()  # as the rcdl command does: large temporaries without page faults
    cfg = Cifar10Config(models=("gws",), train_size=args.train_size, test_size=args.test_size,
                        data_dir=args.data_dir, device="cpu")
    data = load_data(cfg, download=False)
    tensors = (data.x_train, data.y_train, data.x_test, data.y_test)
    print(cpu_line())
    print(f"# gws, {args.train_size} train / {args.test_size} test images, batch 16, "
          f"evaluation every {args.eval_every} steps (batch 500)\n")
    results = {}
    for incremental in (False, True):
        model, _, grower = build_model("gws", 0, device="cpu", dtype=torch.float32,
                                       reserve=args.train_size)
        results[incremental] = train_one_pass(
            model, tensors, batch_size=16, grower=grower, loss_fn=F.cross_entropy,
            metrics=METRICS, eval_every=args.eval_every, eval_batch_size=500,
            progress=False, incremental_eval=incremental)
    full, inc = results[False], results[True]
    print("| evaluation | train s | eval s | evaluations | final test acc. % | final loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in (("full (default)", full), ("incremental", inc)):
        print(f"| {label} | {r['train_seconds']:.1f} | {r['eval_seconds']:.1f} | "
              f"{len(r['history'])} | {100 * r['test_acc']:.2f} | {r['test_loss']:.4f} |")
    diff = max(abs(a[k] - b[k]) for a, b in zip(full["history"], inc["history"], strict=True)
               for k in ("test_acc", "test_loss"))
    print(f"\nevaluation time incremental / full: {inc['eval_seconds'] / full['eval_seconds']:.3f}"
          f"; largest difference of a test metric over the run: {diff:.2e}")


if __name__ == "__main__":
    main()
