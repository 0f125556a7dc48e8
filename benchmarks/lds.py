"""Linear datamodeling score (LDS) of rcdl's native attribution on CIFAR-10.

How well do a model's attribution scores predict what happens when it is trained on a
subset? The standard benchmark (TRAK, Park et al. 2023; dattri): score ``τ(x, i)`` for
every test image ``x`` and training image ``i`` from the model trained on the whole training
set; retrain ``M`` models on random halves ``S_m`` of it; for each test image, the Spearman
correlation over ``m`` between ``Σ_{i ∈ S_m} τ(x, i)`` and the retrained model's
correct-class margin ``f_y(x) − log Σ_{c ≠ y} e^{f_c(x)}``; LDS is its mean over test
images.

rcdl's scores are :func:`rcdl.attribution.explain`'s per-sample contributions to the
correct-class logit, from one backward per test batch, in two variants: summed over every
growing layer (first order through the earlier layers), and the readout's exact shares
alone. Every model is trained one epoch, batch 16, as in the one-epoch
comparison (docs/cifar10.md), on the JPEG-decoded CIFAR-10 copy (docs/data.md).

Run: ``python benchmarks/lds.py --data-dir DIR [--model gws] [--train-size 5000]
[--test-size 500] [--models 50]`` (``--quick``: 500 / 50 images, 8 models). Prints the LDS,
its spread over test images, the seconds per explained test image and per retrained model,
and the machine.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from rcdl.app.cifar import load_subsets
from rcdl.app.experiments.cifar10_models import build_model
from rcdl.app.rundir import cpu_flags, cpu_model
from rcdl.attribution import explain
from rcdl.layers import growing_layers
from rcdl.training import accuracy, train_one_pass

VARIANTS = ("all layers", "readout")


def train(name: str, seed: int, x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor,
          y_test: torch.Tensor) -> torch.nn.Module:
    model, optimizer, grower = build_model(name, seed, reserve=len(x))
    train_one_pass(model, (x, y, x_test[:16], y_test[:16]), batch_size=16, seed=seed,
                   optimizer=optimizer, grower=grower, loss_fn=F.cross_entropy,
                   metrics={"acc": accuracy}, eval_every=10**9, progress=False)
    return model


@torch.no_grad()
def margins(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # (T,)
    logits = model.eval()(x)
    correct = logits.gather(1, y[:, None]).squeeze(1)
    others = logits.scatter(1, y[:, None], -torch.inf).logsumexp(1)
    return correct - others


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # columns of (M, T) -> (T,)
    def ranks(t: torch.Tensor) -> torch.Tensor:
        return t.argsort(0).argsort(0).double()

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(0), rb - rb.mean(0)
    return (ra * rb).sum(0) / (ra.norm(dim=0) * rb.norm(dim=0)).clamp_min(1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--model", default="gws")
    parser.add_argument("--train-size", type=int, default=5000)
    parser.add_argument("--test-size", type=int, default=500)
    parser.add_argument("--models", type=int, default=50, help="models retrained on halves")
    parser.add_argument("--quick", action="store_true", help="500 / 50 images, 8 models")
    args = parser.parse_args()
    if args.quick:
        args.train_size, args.test_size, args.models = 500, 50, 8
    cfg = SimpleNamespace(data_dir=args.data_dir, train_size=args.train_size,
                          test_size=args.test_size, data_seed=0)
    data = load_subsets("cifar10", cfg)
    x, y, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    n = len(x)
    print(f"# {cpu_model() or platform.processor()} ({' '.join(cpu_flags())}), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; {args.model}, {n} train / "
          f"{len(x_test)} test images, {args.models} models on halves", flush=True)
    start = time.perf_counter()
    full = train(args.model, 0, x, y, x_test, y_test)
    full_s = time.perf_counter() - start
    start = time.perf_counter()
    # τ(x, i): summed over every layer, and the readout's exact shares alone
    scores = {v: torch.zeros(len(x_test), n, dtype=torch.float64) for v in VARIANTS}
    readout = growing_layers(full)[-1][1]
    for begin in range(0, len(x_test), 50):
        xb, yb = x_test[begin:begin + 50], y_test[begin:begin + 50]
        exp = explain(full, xb, target=yb, k=10 * n)
        values, samples = exp.samples  # (b, ≤n) each
        scores["all layers"][begin:begin + len(xb)].scatter_(1, samples, values.double())
        values, ids = exp.layers[growing_layers(full)[-1][0]]
        owners = readout.provenance.of(ids)  # (b, k)
        known = owners >= 0
        rows = torch.arange(len(xb))[:, None].expand_as(owners)
        scores["readout"][begin:begin + len(xb)].index_put_(
            (rows[known], owners[known]), values[known].double(), accumulate=True)
    explain_s = (time.perf_counter() - start) / len(x_test)
    print(f"# full model: trained in {full_s:.1f} s; explained in {explain_s:.3f} s per test "
          f"image", flush=True)
    gen = torch.Generator().manual_seed(1)
    predicted, actual, times = [], [], []
    for m in range(args.models):
        subset = torch.randperm(n, generator=gen)[: n // 2]
        mask = torch.zeros(n, dtype=torch.bool)
        mask[subset] = True
        start = time.perf_counter()
        model = train(args.model, 100 + m, x[mask], y[mask], x_test, y_test)
        times.append(time.perf_counter() - start)
        predicted.append(torch.stack([scores[v][:, mask].sum(1) for v in VARIANTS]))
        actual.append(margins(model, x_test, y_test).double())
        print(f"model {m + 1}/{args.models}: {times[-1]:.1f} s", flush=True)
    stacked, margin = torch.stack(predicted), torch.stack(actual)  # (M, V, T), (M, T)
    print(f"\n{statistics.fmean(times):.1f} s per retrained model, {explain_s:.3f} s per "
          "explained test image")
    for v, variant in enumerate(VARIANTS):
        per_test = spearman(stacked[:, v], margin)  # (T,)
        valid = per_test[torch.isfinite(per_test)]
        print(f"LDS ({variant}) {float(valid.mean()):.3f} (sd over test images "
              f"{float(valid.std()):.3f}, {len(valid)} test images)")


if __name__ == "__main__":
    main()
