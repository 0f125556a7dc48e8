"""The cost of exact forgetting against retraining, on CIFAR-10 (docs/unlearning.md).

Trains each model one pass (batch 16) on a CIFAR-10 subset with a replay log
(`rcdl.train.replay.ReplayLog`, a snapshot every `--every` steps), then, each time from a
copy of the trained state, forgets exactly (`rcdl.train.unlearning.forget_exactly`):

- a random 10 % of the training images, the most recent 10 % of the stream, one class;
- one image at each of `--positions` evenly spaced positions of the stream (the cost
  against the position of the earliest forgotten sample).

For the three requests it also retrains on the stream without them (`train_one_pass(...,
order=...)`) and checks that the exactly forgotten model predicts the test images as the
retrained one does, bit for bit. Prints the CPU and one table per model; with --out, writes
the JSON and a figure of the cost against the earliest position, beside the cost a replay
from position p should have when a step's cost grows with the store (1 − p²).

    python benchmarks/exact_forgetting.py --data-dir ../shared/data --train-size 5000 \\
        --out results/unlearning/exact
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rcdl.app.allocator import keep_freed_memory
from rcdl.app.experiments.cifar10.config import Cifar10Config, load_data
from rcdl.app.recipes import copy_trained, train_with_learners
from rcdl.app.rundir import cpu_flags, cpu_model
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly, stream_without


def cpu_line() -> str:
    return (f"# {cpu_model()}, flags {' '.join(cpu_flags()) or '?'}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def train(name: str, data: tuple, *, order=None, replay=None):  # noqa: ANN001, ANN201
    loop = {k: v for k, v in (("order", order), ("replay", replay)) if v is not None}
    return train_with_learners(name, 0, data[0], data[1], (data[2], data[3]), **loop)


def predictions(model, x):  # noqa: ANN001, ANN201
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(xb) for xb in x.split(500)])
    model.train()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--models", nargs="+", default=["gws", "rbf"])
    parser.add_argument("--train-size", type=int, default=5000)
    parser.add_argument("--test-size", type=int, default=1000)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--positions", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    keep_freed_memory()
    cfg = Cifar10Config(models=tuple(args.models), train_size=args.train_size,
                        test_size=args.test_size, data_dir=args.data_dir, device="cpu")
    d = load_data(cfg, download=False)
    data = (d.x_train, d.y_train, d.x_test, d.y_test)
    print(cpu_line())
    print(f"# {args.train_size} train / {args.test_size} test images (CIFAR-10, JPEG-decoded), "
          f"batch 16, one pass, snapshot every {args.every} steps\n")
    report = {"cpu": cpu_line(), "train_size": args.train_size, "every": args.every,
              "models": {}}
    for name in args.models:
        log = ReplayLog(every=args.every)
        model, optimizer, grower, result = train(name, data, replay=log)
        stream = log.stream
        n = len(stream)
        gen = torch.Generator().manual_seed(1)
        requests = {
            "random 10 %": stream[torch.randperm(n, generator=gen)[: n // 10]],
            "most recent 10 %": stream[-(n // 10):],
            "one class (0)": (d.y_train == 0).nonzero().flatten(),
        }
        requests |= {f"one image at {p / args.positions:.0%}": stream[[p * n // args.positions]]
                     for p in range(args.positions)}
        rows = {"train_seconds": result["train_seconds"], "log_bytes": log.nbytes,
                "snapshots": len(log.snapshots), "requests": {}}
        print(f"## {name}: training {result['train_seconds']:.1f} s, replay log "
              f"{log.nbytes / 1e6:.2f} MB in {len(log.snapshots)} snapshots\n")
        print("| request | samples | earliest position | exact s | retrain s | exact / retrain "
              "| same predictions |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for label, gone in requests.items():
            copied = (*copy_trained(name, 0, (model, optimizer, grower), reserve=len(data[0])),
                      copy.deepcopy(log))
            position = int(torch.isin(stream, gone).nonzero()[0])
            start = time.perf_counter()
            receipt = forget_exactly(copied[0], gone, replay=copied[3], data=data[:2],
                                     loss_fn=F.cross_entropy, optimizer=copied[1],
                                     grower=copied[2], scan=False)
            exact_s = time.perf_counter() - start
            row = {"samples": len(gone), "earliest_position": position, "exact_seconds": exact_s,
                   "replayed": next(iter(receipt.released.values()))[0]}
            retrain_s, same = None, None
            if not label.startswith("one image"):
                retrained, *_, res = train(name, data, order=stream_without(log, gone))
                retrain_s = res["train_seconds"]
                same = bool(torch.equal(predictions(copied[0], d.x_test),
                                        predictions(retrained, d.x_test)))
                row |= {"retrain_seconds": retrain_s, "same_predictions": same}
            rows["requests"][label] = row
            ratio = "" if retrain_s is None else f"{exact_s / retrain_s:.2f}"
            print(f"| {label} | {len(gone)} | {position} | {exact_s:.1f} | "
                  f"{'' if retrain_s is None else f'{retrain_s:.1f}'} | {ratio} | "
                  f"{'' if same is None else same} |", flush=True)
        print()
        report["models"][name] = rows
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "exact_forgetting.json").write_text(json.dumps(report, indent=1))
        plot(report, args.out / "exact_forgetting.png")


def plot(report: dict, path: Path) -> None:
    """Exact forgetting's seconds over the training seconds, against the earliest forgotten
    sample's position in the stream, per model, with the curve 1 − p²."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    p = torch.linspace(0, 1, 101)
    ax.plot(p, 1 - p**2, color="black", lw=0.8, ls=":", label="1 − p² (replay from p)")
    markers = {"random 10 %": "s", "most recent 10 %": "^", "one class (0)": "D"}
    for i, (name, rows) in enumerate(report["models"].items()):
        n, train_s = report["train_size"], rows["train_seconds"]
        colour = f"C{i}"
        single = sorted((r["earliest_position"] / n, r["exact_seconds"] / train_s)
                        for label, r in rows["requests"].items() if label.startswith("one image"))
        ax.plot([q[0] for q in single], [q[1] for q in single], "o-", color=colour,
                label=f"{name}: one image")
        for label, marker in markers.items():
            r = rows["requests"].get(label)
            if r is not None:
                ax.plot(r["earliest_position"] / n, r["exact_seconds"] / train_s, marker,
                        color=colour, mfc="none", ms=9,
                        label=f"{name}: {label}" if i == 0 else None)
    ax.set_xlabel("earliest forgotten sample's position in the stream (share)")
    ax.set_ylabel("exact forgetting / training time")
    ax.set_title(f"Exact forgetting's cost, {report['train_size']} CIFAR-10 images", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
