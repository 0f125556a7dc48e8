"""Retrieval-side readouts of a growing RBF network learnt class by class, on CIFAR-10
(results/continual/LOG.md, "What did not help").

For each order and seed: trains ``rbf`` and ``rbf+labels`` exactly as ``rcdl reproduce
continual`` does (Split CIFAR-10, 5 tasks of 2 classes, one pass, batch 16), then answers
the test images with the trained readout's stored entries read in other ways — nothing is
trained again, no image is replayed:

- ``as trained``: the model's own 10-way output;
- ``task inference``: the task whose readout entries carry the most kernel mass at the
  query, ``argmax_t Σ_{j∈t} k(q, k_j)`` (the retrieval analogue of PEC's per-class error),
  then the argmax over that task's classes;
- ``task-balanced``: each task's logits divided by its entries' kernel mass at the query
  (every task gets the same attention mass);
- ``sharper kernel``: the readout's RBF temperature halved at test time.

The entries' task comes from their sample (``rcdl.memory.provenance``). Prints the CPU and
a table of the final accuracy (mean over orders and seeds); with ``--out`` writes JSON.

    python benchmarks/continual_readouts.py --data-dir ../shared/data \
        --out results/continual/methods
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from rcdl.app.experiments.continual import (
    CLASSES,
    ContinualConfig,
    load_data,
    run_sequence,
    task_split,
)
from rcdl.app.rundir import describe_machine
from rcdl.memory.provenance import entry_samples
from rcdl.nn.networks import eval_mode, layer_input


def _readout_inputs(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The readout's queries ``(M, d)`` on ``x`` and the model's logits ``(M, C)``."""
    with torch.no_grad(), eval_mode(model):
        logits = torch.cat([model(b) for b in x.split(500)])
    return torch.cat([layer_input(model, model.readout, b) for b in x.split(500)]), logits


def readouts(model: torch.nn.Module, data, tasks) -> dict[str, float]:  # noqa: ANN001
    q, logits = _readout_inputs(model, data.x_test)
    layer = model.readout
    keys, values = layer.store.keys.float(), layer.store.values.float()  # (N, d), (N, C)
    tau = layer.temperature * math.sqrt(keys.shape[1])
    sq = torch.cdist(q, keys).square()  # (M, N)
    task_of_class = torch.empty(CLASSES, dtype=torch.long)
    for t, classes in enumerate(tasks):
        task_of_class[list(classes)] = t
    entry_task = task_of_class[data.y_train[entry_samples(layer).cpu()]]  # (N,)
    y = data.y_test

    def acc(scores: torch.Tensor) -> float:
        return 100 * (scores.argmax(1) == y).float().mean().item()

    kernel = torch.exp(-sq / (2 * tau))  # (M, N)
    torch.testing.assert_close(kernel @ values, logits, rtol=1e-3, atol=1e-3)  # the layer's
    mass = torch.stack([kernel[:, entry_task == t].sum(1) for t in range(len(tasks))], 1)
    inferred = mass.argmax(1)  # (M,)
    within = torch.full_like(logits, -torch.inf)
    balanced = logits.clone()
    for t, classes in enumerate(tasks):
        cols = list(classes)
        mine = inferred == t
        within[mine.nonzero(), torch.tensor(cols)] = logits[mine][:, cols]
        balanced[:, cols] = logits[:, cols] / mass[:, t : t + 1].clamp_min(1e-30)
    sharp = torch.exp(-sq / tau) @ values
    return {"as trained": acc(logits), "task inference": acc(within),
            "task-balanced": acc(balanced), "sharper kernel": acc(sharp),
            "task inference accuracy": 100 * (inferred == task_of_class[y]).float().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--models", nargs="+", default=["rbf", "rbf+labels"])
    parser.add_argument("--orders", nargs="+", default=["0", "random-1", "random-2"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--test-size", type=int, default=1000)
    parser.add_argument("--out")
    args = parser.parse_args()
    cfg = ContinualConfig(data_dir=args.data_dir, train_size=args.train_size,
                          test_size=args.test_size)
    data = load_data(cfg)
    device = torch.device("cpu")
    print(describe_machine(device))
    results: dict[str, dict[str, list[float]]] = {}
    for name in args.models:
        for order in args.orders:
            for seed in args.seeds:
                tasks = task_split(order)
                model, _ = run_sequence(name, seed, data, tasks, cfg, device)
                assert model is not None
                for key, value in readouts(model, data, tasks).items():
                    results.setdefault(name, {}).setdefault(key, []).append(value)
                print(name, order, seed, {k: round(v[-1], 1) for k, v in results[name].items()},
                      flush=True)
    print("\n| model | readout | final accuracy % (mean ± sd) |\n|---|---|---:|")
    for name, by in results.items():
        for key, values in by.items():
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"| {name} | {key} | {statistics.mean(values):.1f} ± {sd:.1f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "readouts.json").write_text(json.dumps(
            {"machine": describe_machine(device), "train_size": args.train_size,
             "test_size": args.test_size, "orders": args.orders, "seeds": args.seeds,
             "results": results}, indent=1))


if __name__ == "__main__":
    main()
