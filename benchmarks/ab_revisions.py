"""This checkout against another git revision, interleaved: the hot paths' speed, A B A B ….

Registers two cases with the harness (``benchmarks/harness.py``) and runs them through the
runner's revision comparison (``python benchmarks/run.py attention model --base REV``),
in fresh processes taking turns (so that a drift of the machine's speed hits both sides
alike), with the code of this checkout (``new``) and of ``--base`` (``old``, checked out
into a temporary git worktree and put first on ``PYTHONPATH``):

- ``attention`` — ``attn16`` / ``attn500``: the weighted-softmax streaming attention,
  forward plus backward w.r.t. the queries, B = 16 and 500 queries over N entries of width
  3 072 (as ``benchmarks/bench_attention.py`` runs it), median of the repeats;
- ``model`` — ``step``: one training step (batch 16) of a growing model of the one-epoch
  comparison with N entries in every growing layer's store (filled by
  ``harness.fill_stores``), median over the steps after one warm-up; ``eval500``: one
  no-grad evaluation batch of 500 images.

For each figure it prints every pair's ratio new / old and their median, min and max, beside
the CPU model and flags. A ratio below 1 means this checkout is faster.

Run: ``python benchmarks/ab_revisions.py --base REV [--model gws] [--entries 50000]
[--store-dtypes float32 bfloat16] [--pairs 4]`` (``--quick`` for a small smoke run).
"""

from __future__ import annotations

import argparse

import torch

import run
from harness import case, fill_stores, timeit

QUICK = {"entries": 2_000, "steps": 2, "repeats": 3}


@case("attention", quick=QUICK, entries=50_000, dim=3072, store_dtype="float32", steps=8,
      repeats=6)
def attention_figures(entries: int, dim: int, store_dtype: str, steps: int,
                      repeats: int) -> dict[str, float]:
    """The weighted-softmax streaming attention, forward and backward w.r.t. the queries,
    at B = 16 and B = 500 over ``entries`` entries of width ``dim``.

    ``steps`` is unused (the ``model`` case's); both cases take the same parameters so that
    one command sets both.
    """
    try:  # the module path of the code under test; revisions before the packages were flat
        from rcdl.ops.attention import attention
    except ImportError:
        from rcdl.attention import attention  # type: ignore[no-redef]

    dtype = getattr(torch, store_dtype)
    gen = torch.Generator().manual_seed(0)
    keys = (torch.randn(entries, dim, generator=gen) / dim**0.5).to(dtype)  # (N, d)
    values = torch.randn(entries, dim, generator=gen).to(dtype)  # (N, d)
    weights = torch.rand(entries, generator=gen)  # (N,)
    out = {}
    for batch, reps in ((16, repeats), (500, max(1, repeats // 3))):
        q = torch.randn(batch, dim, generator=gen)  # (B, d)
        grad = torch.randn(batch, dim, generator=gen)  # (B, d)

        def fwd_bwd(q: torch.Tensor = q, grad: torch.Tensor = grad) -> None:
            qq = q.detach().requires_grad_()
            attention(qq, keys, values, weights, kernel="softmax", temperature=6.0).backward(grad)

        out[f"attn{batch}"] = timeit(fwd_bwd, reps).median
    return out


@case("model", quick=QUICK, model="gws", entries=50_000, dim=3072, store_dtype="float32",
      steps=8, repeats=6)
def model_figures(model: str, entries: int, dim: int, store_dtype: str, steps: int,
                  repeats: int) -> dict[str, float]:
    """One training step (batch 16) and one no-grad evaluation batch (500 images) of a
    growing model of the one-epoch comparison, ``entries`` entries per growing layer.

    ``step`` is the median over ``steps`` steps after one warm-up step, each on its own
    batch; ``eval500`` the median of ``repeats // 3`` (at least one) evaluation calls.
    """
    import torch.nn.functional as F

    try:  # the model zoo of the code under test; before it was an app module, an experiment's
        from rcdl.app.models import build_model
    except ImportError:
        from rcdl.app.experiments.cifar10_models import (  # type: ignore[no-redef]
            build_model,
        )

    dtype = getattr(torch, store_dtype)
    gen = torch.Generator().manual_seed(0)
    net, optimizer, grower = build_model(model, 0, store_dtype=None if dtype is torch.float32
                                         else dtype)
    fill_stores(net, entries, gen)
    stepper = optimizer if optimizer is not None and hasattr(optimizer, "grower") else grower
    xs = torch.randn(steps + 1, 16, dim, generator=gen)  # (steps + 1, B, d)
    ys = torch.randint(0, 10, (steps + 1, 16), generator=gen)  # (steps + 1, B)
    batches = iter(zip(xs, ys, strict=True))

    def step() -> None:
        x, y = next(batches)
        stepper.zero_grad()
        F.cross_entropy(net(x), y).backward()
        stepper.step()

    out = {"step": timeit(step, steps).median}
    net.eval()
    x_eval = torch.randn(500, dim, generator=gen)  # (500, d)
    with torch.no_grad():
        out["eval500"] = timeit(lambda: net(x_eval), max(1, repeats // 3)).median
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=False, help="the git revision to compare against")
    parser.add_argument("--model", default="gws")
    parser.add_argument("--entries", type=int, default=50_000, help="entries per layer")
    parser.add_argument("--store-dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--pairs", type=int, default=4, help="A B pairs per store dtype")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--figures", nargs="+", choices=("attention", "model"),
                        default=["attention", "model"],
                        help="the attention calls, the model's step and evaluation, or both")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.entries, args.steps, args.repeats, args.pairs = 2_000, 2, 3, 1
    if not args.base:
        parser.error("--base REV is required")
    cases = run.load_cases(args.figures)
    combos = [{"model": args.model, "entries": args.entries, "store_dtype": dtype,
               "steps": args.steps, "repeats": args.repeats} for dtype in args.store_dtypes]
    if "model" not in args.figures:
        combos = [{k: v for k, v in c.items() if k != "model"} for c in combos]
    run.compare_revisions(cases, combos, args.base, args.pairs, quick=False,
                          describe=f"{args.model}, {args.entries:,} entries per layer; ",
                          title=lambda params: f"store {params['store_dtype']}")


if __name__ == "__main__":
    main()
