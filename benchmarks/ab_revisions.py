"""This checkout against another git revision, interleaved: the hot paths' speed, A B A B ….

Measures, in fresh processes taking turns (so that a drift of the machine's speed hits both
sides alike), with the code of this checkout (``new``) and of ``--base`` (``old``, checked
out into a temporary git worktree and put first on ``PYTHONPATH``):

- ``attn16`` / ``attn500``: the weighted-softmax streaming attention, forward plus backward
  w.r.t. the queries, B = 16 and 500 queries over N entries of width 3 072
  (as ``benchmarks/bench_attention.py`` runs it), median of the repeats;
- ``step``: one training step (batch 16) of a growing model of the one-epoch comparison with
  N entries in every growing layer's store (as ``benchmarks/profile_step.py`` fills them),
  median over the steps; ``eval500``: one no-grad evaluation batch of 500 images.

For each figure it prints every pair's ratio new / old and their median, min and max, beside
the CPU model and flags. A ratio below 1 means this checkout is faster.

Run: ``python benchmarks/ab_revisions.py --base REV [--model gws] [--entries 50000]
[--store-dtypes float32 bfloat16] [--pairs 4]`` (``--quick`` for a small smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _median_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _attention_figures(attention, entries: int, dim: int, dtype: torch.dtype,  # noqa: ANN001
                       repeats: int, gen: torch.Generator) -> dict[str, float]:
    keys = (torch.randn(entries, dim, generator=gen) / dim**0.5).to(dtype)
    values = torch.randn(entries, dim, generator=gen).to(dtype)
    weights = torch.rand(entries, generator=gen)
    out = {}
    for batch, reps in ((16, repeats), (500, max(1, repeats // 3))):
        q = torch.randn(batch, dim, generator=gen)
        grad = torch.randn(batch, dim, generator=gen)

        def fwd_bwd(q=q, grad=grad) -> None:  # noqa: ANN001
            qq = q.detach().requires_grad_()
            attention(qq, keys, values, weights, kernel="softmax", temperature=6.0).backward(grad)

        out[f"attn{batch}"] = _median_seconds(fwd_bwd, reps)
    return out


def child(model_name: str, entries: int, store_dtype: str, steps: int, repeats: int,
          dim: int, figures: tuple[str, ...] = ("attention", "model")) -> dict[str, float]:
    """The figures of one side, in this process (the ``rcdl`` on ``sys.path``)."""
    import torch.nn.functional as F

    from rcdl import growing_layers
    from rcdl.app.experiments.cifar10_models import build_model
    try:  # the module path of the code under test; revisions before the packages were flat
        from rcdl.ops.attention import attention
    except ImportError:
        from rcdl.attention import attention  # type: ignore[no-redef]

    dtype = getattr(torch, store_dtype)
    gen = torch.Generator().manual_seed(0)
    out = _attention_figures(attention, entries, dim, dtype, repeats, gen) if (
        "attention" in figures) else {}
    if "model" not in figures:
        return out
    model, optimizer, grower = build_model(model_name, 0, store_dtype=None if dtype is
                                           torch.float32 else dtype)
    for _, layer in growing_layers(model):
        store = layer.store
        store.reserve(entries)
        for start in range(0, entries, 8192):
            b = min(8192, entries - start)
            store.append(torch.randn(b, store.d_in, generator=gen),
                         0.01 * torch.randn(b, store.d_out, generator=gen),
                         torch.full((b,), 1e-3), written_at=0)
    stepper = optimizer if optimizer is not None and hasattr(optimizer, "grower") else grower
    xs = torch.randn(steps + 1, 16, 3072, generator=gen)
    ys = torch.randint(0, 10, (steps + 1, 16), generator=gen)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        stepper.zero_grad()
        F.cross_entropy(model(xs[i]), ys[i]).backward()
        stepper.step()
        times.append(time.perf_counter() - start)
    out["step"] = statistics.median(times[1:])  # the first is a warm-up
    model.eval()
    x_eval = torch.randn(500, 3072, generator=gen)
    with torch.no_grad():
        out["eval500"] = _median_seconds(lambda: model(x_eval), max(1, repeats // 3))
    return out


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])
    shown = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    return f"{model} ({' '.join(shown)})"


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
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # store dtype, out file
    args = parser.parse_args()
    dim = 3072
    if args.quick:
        args.entries, args.steps, args.repeats, args.pairs = 2_000, 2, 3, 1
    if args.child:
        result = child(args.model, args.entries, args.child[0], args.steps, args.repeats, dim,
                       tuple(args.figures))
        Path(args.child[1]).write_text(json.dumps(result))
        return
    if not args.base:
        parser.error("--base REV is required")
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base],
                         check=True, capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          check=True, capture_output=True, text=True).stdout.strip()
    threads = torch.get_num_threads()
    print(f"# new: this checkout (HEAD {head}, with its uncommitted changes); old: {rev}")
    print(f"# {_cpu()}, torch {torch.__version__}, {threads} threads; {args.model}, "
          f"{args.entries:,} entries per layer; {args.pairs} pairs per dtype, interleaved")
    with tempfile.TemporaryDirectory(prefix="rcdl-ab-") as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(old_tree), rev], check=True)
        try:
            trees = {"new": ROOT / "src", "old": old_tree / "src"}
            for store_dtype in args.store_dtypes:
                results: dict[str, list[dict[str, float]]] = {"new": [], "old": []}
                for pair in range(args.pairs):
                    order = ("new", "old") if pair % 2 == 0 else ("old", "new")
                    for side in order:
                        out = Path(tmp) / f"{side}.json"
                        env = {**os.environ, "PYTHONPATH": str(trees[side])}
                        subprocess.run([sys.executable, __file__, "--child", store_dtype,
                                        str(out), "--model", args.model, "--entries",
                                        str(args.entries), "--steps", str(args.steps),
                                        "--repeats", str(args.repeats), "--figures",
                                        *args.figures], check=True, env=env)
                        results[side].append(json.loads(out.read_text()))
                print(f"\n## store {store_dtype}")
                print("| figure | new ms (median) | old ms (median) | new / old per pair: "
                      "median [min, max] |")
                print("|---|---|---|---|")
                for key in results["new"][0]:
                    new = [r[key] for r in results["new"]]
                    old = [r[key] for r in results["old"]]
                    ratios = [a / b for a, b in zip(new, old, strict=True)]
                    print(f"| {key} | {1e3 * statistics.median(new):.1f} | "
                          f"{1e3 * statistics.median(old):.1f} | "
                          f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, "
                          f"{max(ratios):.3f}] |")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(old_tree)], check=False)


if __name__ == "__main__":
    main()
