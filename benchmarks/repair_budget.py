"""The gap between fast forgetting and retraining against its time budget, on CIFAR-10
(docs/fast_forgetting.md).

For each model and seed: trains the model one pass (batch 16) on a CIFAR-10 subset, and
retrains it on the same stream without the forgotten images (a random 10 %, or every image
of class 0); then, each time from a copy of the trained model, runs
`rcdl.forget_and_repair` re-writing only the first fraction f of the readout's steps from
the earliest forgotten image's (f = 0 is `rcdl.forget` alone, f = 1 the whole fast mode),
with the readout's stored keys and with its keys recomputed from the training images.
Measures the seconds and the forget-set, retained-set and test accuracy and the attack
score of every variant; prints the CPU and a table, and with --out writes the JSON and a
figure of each gap to retraining against the seconds.

    python benchmarks/repair_budget.py --data-dir ../shared/data --out results/unlearning/fast
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
from pathlib import Path

import torch

from rcdl.app.experiments.unlearning import (
    UnlearningConfig,
    forget_indices,
    load_data,
    mia_score,
    per_sample_losses,
)
from rcdl.app.recipes import train_with_learners
from rcdl.app.rundir import cpu_flags, cpu_model, environment_info
from rcdl.memory.provenance import entry_samples
from rcdl.memory.repair import forget_and_repair
from rcdl.train.loop import epoch_permutation

METRICS = ("forget_acc", "retain_acc", "test_acc", "mia")


def cpu_line() -> str:
    return (f"# {cpu_model()}, flags {' '.join(cpu_flags()) or '?'}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def measure(model, sets: dict, scenario: str, seed: int) -> dict:  # noqa: ANN001
    forget_loss, forget_right = per_sample_losses(model, *sets["forget"])
    _, retain_right = per_sample_losses(model, *sets["retain"])
    test_loss, test_right = per_sample_losses(model, *sets["test"])
    others = test_loss if scenario == "random" else test_loss[sets["test"][1] == 0]
    return {"forget_acc": 100 * forget_right.float().mean().item(),
            "retain_acc": 100 * retain_right.float().mean().item(),
            "test_acc": 100 * test_right.float().mean().item(),
            "mia": mia_score(forget_loss, others, seed=seed)}


def steps_after(model, forgotten: torch.Tensor) -> int:  # noqa: ANN001
    """The readout's steps from the earliest one a forgotten image wrote at."""
    layer = model.readout
    written = layer.store.written_at
    first = written[torch.isin(entry_samples(layer), forgotten)].min()
    return int(written[written >= first].unique().numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--models", nargs="+", default=["gws", "rbf"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--scenarios", nargs="+", default=["random", "class"])
    parser.add_argument("--fractions", nargs="+", type=float,
                        default=[0.0, 0.25, 0.5, 0.75, 0.9, 1.0])
    parser.add_argument("--train-size", type=int, default=5000)
    parser.add_argument("--test-size", type=int, default=5000)
    parser.add_argument("--retain-eval-size", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cfg = UnlearningConfig(data_dir=args.data_dir, train_size=args.train_size,
                           test_size=args.test_size)
    data = load_data(cfg)
    x, y = data.x_train, data.y_train
    print(cpu_line(), flush=True)
    report = {"environment": environment_info(), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": []}
    for name in args.models:
        for seed in args.seeds:
            model, _, _, result = train_with_learners(name, seed, x, y, (x[:1], y[:1]))
            stream = epoch_permutation(len(y), seed, 0)
            for scenario in args.scenarios:
                gone = forget_indices(scenario, y, cfg, seed)
                keep = torch.ones(len(y), dtype=torch.bool)
                keep[gone] = False
                kept = keep.nonzero().squeeze(1)
                g = torch.Generator().manual_seed(20_000 + seed)
                evaluated = kept[torch.randperm(len(kept), generator=g)[:args.retain_eval_size]]
                sets = {"forget": (x[gone], y[gone]), "retain": (x[evaluated], y[evaluated]),
                        "test": (data.x_test, data.y_test)}
                retrained, _, _, again = train_with_learners(
                    name, seed, x, y, (x[:1], y[:1]), order=stream[keep[stream]])
                run = {"model": name, "seed": seed, "scenario": scenario,
                       "retrain": {**measure(retrained, sets, scenario, seed),
                                   "seconds": again["train_seconds"]},
                       "steps": steps_after(model, gone), "variants": []}
                del retrained
                for keys in ("stored", "recomputed"):
                    for fraction in args.fractions:
                        steps = math.ceil(fraction * run["steps"])
                        copy_ = copy.deepcopy(model)
                        receipt = forget_and_repair(copy_, gone, labels=y, steps=steps,
                                                    inputs=x if keys == "recomputed" else None,
                                                    scan=False)
                        row = {"keys": keys, "fraction": fraction, "steps": steps,
                               "seconds": receipt.seconds,
                               **measure(copy_, sets, scenario, seed)}
                        run["variants"].append(row)
                        print(f"{name} seed {seed} {scenario} {keys:10s} f={fraction:.2f} "
                              + " ".join(f"{m} {row[m] - run['retrain'][m]:+.3f}"
                                         for m in METRICS)
                              + f" s {row['seconds']:.2f} "
                              f"(retrain {run['retrain']['seconds']:.1f})",
                              flush=True)
                report["runs"].append(run)
    print(table(report))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "repair_budget.json").write_text(json.dumps(report, indent=1))
        (args.out / "repair_budget.md").write_text(table(report) + "\n")
        plot(report, args.out / "repair_budget.png")


def _mean(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):+.1f} ± {sd:.1f}"


def table(report: dict) -> str:
    """Mean gap to retraining (± sd over seeds) per model, scenario, keys and fraction."""
    lines = ["| model | scenario | keys | fraction | Δ forget | Δ retain | Δ test | Δ MIA | "
             "seconds | retrain s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    groups: dict[tuple, list] = {}
    for run in report["runs"]:
        for row in run["variants"]:
            key = (run["model"], run["scenario"], row["keys"], row["fraction"])
            groups.setdefault(key, []).append((row, run["retrain"]))
    for (model, scenario, keys, fraction), pairs in groups.items():
        gap = {m: [r[m] - base[m] for r, base in pairs] for m in METRICS}
        mia = [r["mia"] - base["mia"] for r, base in pairs]
        lines.append(
            f"| {model} | {scenario} | {keys} | {fraction:.2f} | {_mean(gap['forget_acc'])} | "
            f"{_mean(gap['retain_acc'])} | {_mean(gap['test_acc'])} | "
            f"{statistics.mean(mia):+.3f} | "
            f"{statistics.mean(r['seconds'] for r, _ in pairs):.2f} | "
            f"{statistics.mean(b['seconds'] for _, b in pairs):.1f} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Per model and scenario (columns), each gap to retraining (rows) against the seconds
    the fast mode took, one line per choice of keys, means over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys((r["model"], r["scenario"]) for r in report["runs"]))
    labels = {"forget_acc": "Δ forget-set acc (points)", "retain_acc": "Δ retained acc",
              "test_acc": "Δ test acc", "mia": "Δ MIA"}
    fig, axes = plt.subplots(len(METRICS), len(cells), figsize=(4.2 * len(cells), 10),
                             squeeze=False)
    for col, (model, scenario) in enumerate(cells):
        runs = [r for r in report["runs"] if (r["model"], r["scenario"]) == (model, scenario)]
        retrain_s = statistics.mean(r["retrain"]["seconds"] for r in runs)
        for row_i, metric in enumerate(METRICS):
            ax = axes[row_i][col]
            for keys, colour in (("stored", "#17becf"), ("recomputed", "#bcbd22")):
                fractions = sorted({v["fraction"] for r in runs for v in r["variants"]})
                xs, ys = [], []
                for f in fractions:
                    pairs = [(v, r["retrain"]) for r in runs for v in r["variants"]
                             if v["keys"] == keys and v["fraction"] == f]
                    xs.append(statistics.mean(v["seconds"] for v, _ in pairs))
                    ys.append(statistics.mean(v[metric] - b[metric] for v, b in pairs))
                ax.plot(xs, ys, "o-", color=colour, label=f"{keys} keys")
            band = 0.02 if metric == "mia" else 1.0
            ax.axhspan(-band, band, color="#2ca02c", alpha=0.15, label="target")
            ax.axhline(0, color="black", lw=0.8)
            ax.axvline(retrain_s / 10, color="#d62728", ls=":", label="retrain / 10")
            ax.set_ylabel(labels[metric])
            if row_i == 0:
                ax.set_title(f"{model}, {scenario} (retrain {retrain_s:.1f} s)", fontsize=9)
            if row_i == len(METRICS) - 1:
                ax.set_xlabel("seconds")
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
