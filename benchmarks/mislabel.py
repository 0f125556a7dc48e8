"""Mislabel detection by self-influence on CIFAR-10.

Flip the labels of 10 % of the training images (to another class, at random), train a
growing model once (one epoch, batch 16, as in the one-epoch comparison), and rank the
training images by **self-influence**: the contribution of an image's own entries, in every
layer, to its own (noisy) label's logit (:func:`rcdl.attribution.explain`, regrouped by
training sample through :mod:`rcdl.provenance`). A flipped image can only be fitted by its
own entries, so it should rank high. Baselines: the trained model's loss on each training
image, and a random ranking.

Prints, for each ranking, the ROC-AUC of separating flipped from clean images and the share
of the flipped images found in the top 10 % and 20 % of the ranking (inspected).

Run: ``python benchmarks/mislabel.py --data-dir DIR [--model gws] [--train-size 5000]``
(``--quick``: 500 images).
"""

from __future__ import annotations

import argparse
import platform
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from rcdl.app.cifar import load_subsets
from rcdl.app.experiments.cifar10_models import build_model
from rcdl.app.rundir import cpu_flags, cpu_model
from rcdl.attribution import explain
from rcdl.training import accuracy, train_one_pass


def auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """ROC-AUC of ``scores`` (higher: more likely positive), ties counted half."""
    ranks = scores.double().argsort().argsort().double() + 1  # 1 = lowest
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def found_in_top(scores: torch.Tensor, positive: torch.Tensor, share: float) -> float:
    top = scores.argsort(descending=True)[: int(share * len(scores))]
    return float(positive[top].sum() / positive.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--model", default="gws")
    parser.add_argument("--train-size", type=int, default=5000)
    parser.add_argument("--flip", type=float, default=0.1, help="share of labels flipped")
    parser.add_argument("--quick", action="store_true", help="500 training images")
    args = parser.parse_args()
    if args.quick:
        args.train_size = 500
    cfg = SimpleNamespace(data_dir=args.data_dir, train_size=args.train_size, test_size=500,
                          data_seed=0)
    data = load_subsets("cifar10", cfg)
    x, y = data.x_train, data.y_train.clone()
    n = len(x)
    gen = torch.Generator().manual_seed(2)
    flipped = torch.zeros(n, dtype=torch.bool)
    flipped[torch.randperm(n, generator=gen)[: int(args.flip * n)]] = True
    y[flipped] = (y[flipped] + torch.randint(1, 10, (int(flipped.sum()),), generator=gen)) % 10
    print(f"# {cpu_model() or platform.processor()} ({' '.join(cpu_flags())}), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; {args.model}, {n} training "
          f"images, {int(flipped.sum())} labels flipped", flush=True)
    model, optimizer, grower = build_model(args.model, 0, reserve=n)
    start = time.perf_counter()
    result = train_one_pass(model, (x, y, data.x_test, data.y_test), batch_size=16,
                            optimizer=optimizer, grower=grower, loss_fn=F.cross_entropy,
                            metrics={"test_acc": accuracy}, eval_every=10**9, progress=False)
    print(f"# trained in {time.perf_counter() - start:.1f} s; test accuracy "
          f"{100 * result['test_acc']:.2f} % (clean test labels)", flush=True)
    start = time.perf_counter()
    self_influence = torch.zeros(n, dtype=torch.float64)
    for begin in range(0, n, 50):
        rows = torch.arange(begin, min(n, begin + 50))
        values, owners = explain(model, x[rows], target=y[rows], k=10 * n).samples
        own = owners == rows[:, None]  # (b, S): each row's own training sample
        self_influence[rows] = (values.double() * own).sum(1)
    explain_s = time.perf_counter() - start
    with torch.no_grad():
        loss = F.cross_entropy(model.eval()(x), y, reduction="none")
    rankings = {"self-influence": self_influence, "training loss": loss,
                "random": torch.rand(n, generator=gen)}
    print(f"# self-influence of {n} images in {explain_s:.1f} s\n")
    print("| ranking | ROC-AUC | flipped found in top 10 % | in top 20 % |")
    print("|---|---:|---:|---:|")
    for name, scores in rankings.items():
        print(f"| {name} | {auc(scores, flipped):.3f} | {found_in_top(scores, flipped, 0.1):.3f} "
              f"| {found_in_top(scores, flipped, 0.2):.3f} |")


if __name__ == "__main__":
    main()
