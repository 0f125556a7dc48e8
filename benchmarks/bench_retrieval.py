"""Approximate (top-k) retrieval against exact streaming attention (docs/retrieval.md).

Two modes, both in one process and against a baseline measured in the same run:

**Synthetic store** (default). ``--entries`` keys of width ``--dim`` (RMS-normalised draws
from a mixture of ``--clusters`` Gaussian clusters, as images cluster) with values of width
``--d-out`` and unit weights; queries are fresh draws from the same mixture. For each kernel
(RBF by L2, weighted softmax by inner product) and each FAISS index kind (flat, HNSW) it
reports the index's build time, the time to add one training step's 16 rows, and its
memory; then, for B = 1 and B = 64 queries, the median latency of the exact streaming
attention (``rcdl.ops.attention.attention``) and of the index search + top-k attention
(``rcdl.retrieval.topk.topk_attention``) for each k, with recall@k of the index search against
the exact top-k, the top-k output's relative error against the exact output, the mean
left-out estimate ρ̂ and the true left-out fraction of the kernel mass.
The default is the issue's 1 M entries of width 256: 1 GB of keys and 1 GB of values,
plus one float32 copy of the keys per index (and the ground truth's transient copy);
1 M CIFAR-width keys (3072) would take 12 GB for the keys alone.

**CIFAR-10** (``--cifar``). Trains the one-epoch ``gws`` or ``rbf`` model
(``rcdl.app.models.build_model``, ``rcdl.train.loop.train_one_pass``,
batch 16) on
``--train-size`` images, exactly or with top-k attention in training too (``--train-k``),
then evaluates test accuracy, loss and evaluation time, exact and with top-k for each k,
with the indices' build time and memory and recall@k of the first layer's search.

    python benchmarks/bench_retrieval.py                      # 1 M × 256, both kernels
    python benchmarks/bench_retrieval.py --quick              # a smoke run, under a minute
    python benchmarks/bench_retrieval.py --cifar --model gws --data-dir ../shared/data
    python benchmarks/bench_retrieval.py --cifar --quick --data-dir ../shared/data

Threads: torch and FAISS use ``OMP_NUM_THREADS`` (or ``--threads``); the header prints
what was used. ``--json PATH`` also writes every number measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from harness import case, machine_line, timeit
from rcdl.app.allocator import keep_freed_memory
from rcdl.nn.layers import growing_layers
from rcdl.nn.store import format_bytes
from rcdl.ops.attention import attention, attention_partial
from rcdl.ops.kernels import softmax_scale
from rcdl.retrieval.indices import ExactIndex, make_index, metric_for
from rcdl.retrieval.topk import (
    recall_at_k,
    topk_attention,
    use_exact,
    use_topk,
)

QUICK_SYNTHETIC = {"entries": 20_000, "dim": 64, "d_out": 64, "queries": 128}
QUICK_CIFAR = {"train_size": 1000, "test_size": 500}
DEFAULT_KS = {"synthetic": [32, 256, 1024], "cifar": [32, 128, 512, 2048, 4096],
              "cifar-quick": [32, 128, 512]}


def header() -> str:
    try:
        import faiss
        faiss_line = f"faiss {faiss.__version__}, {faiss.omp_get_max_threads()} threads"
    except ImportError:
        faiss_line = "faiss not installed"
    return f"# {machine_line()}; {faiss_line}"


def true_left_out(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor,
                  *, kernel: str, temperature: float) -> torch.Tensor:  # (B,)
    """``Σ_{j∉K} |w_j| κ_j / Σ_j |w_j| κ_j`` per query: exact, streamed over the store."""
    tau = softmax_scale(temperature, q.shape[1])
    w_abs = weights.abs()
    k_kept = keys[kept.clamp_min(0)].to(q.dtype)  # (B, k, d)
    if kernel == "softmax":
        part = attention_partial(q, keys, keys.new_zeros(len(keys), 0), w_abs,
                                 kernel="softmax", temperature=temperature)
        log_total = part.m + part.den.log()  # (B,) log Σ_j |w_j| e^{z_j}
        log_kept = (torch.bmm(k_kept, q[:, :, None])[:, :, 0] / tau
                    + w_abs[kept].log()).logsumexp(1)
        return 1 - (log_kept - log_total).exp()
    ones = keys.new_ones(len(keys), 1)
    total = attention_partial(q, keys, ones, w_abs, kernel="rbf",
                              temperature=temperature).num[:, 0]  # (B,) Σ_j |w_j| κ_j
    sq = (q[:, None, :] - k_kept).pow(2).sum(-1)  # (B, k)
    kept_mass = (w_abs[kept] * torch.exp(-sq / (2 * tau))).sum(1)
    return 1 - kept_mass / total


# --------------------------------------------------------------------------- synthetic


def synthetic_store(n: int, dim: int, d_out: int, clusters: int, queries: int, seed: int):
    """Keys and queries from one mixture of Gaussian clusters, RMS-normalised rows."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=gen)

    def draw(count: int) -> torch.Tensor:
        rows = []
        for start in range(0, count, 65_536):  # in blocks: no second full-size temporary
            size = min(65_536, count - start)
            which = torch.randint(0, clusters, (size,), generator=gen)
            x = centres[which] + torch.randn(size, dim, generator=gen)
            rows.append(x * torch.rsqrt(x.pow(2).mean(1, keepdim=True)))
        return torch.cat(rows)

    keys = draw(n)
    values = torch.randn(n, d_out, generator=gen)
    return keys, values, torch.ones(n), draw(queries)


def bench_synthetic(args: argparse.Namespace) -> dict[str, Any]:
    keys, values, weights, queries = synthetic_store(
        args.entries, args.dim, args.d_out, args.clusters, args.queries, args.seed)
    print(f"# synthetic store: {args.entries:,} entries, keys {args.dim} wide "
          f"({format_bytes(keys.nbytes)}), values {args.d_out} wide "
          f"({format_bytes(values.nbytes)}), {args.clusters} clusters, T = {args.temperature}, "
          f"{args.queries} queries; HNSW M = {args.hnsw_m}, efSearch = max({args.ef_search}, "
          f"k), efConstruction = {args.ef_construction}")
    results: dict[str, Any] = {"entries": args.entries, "dim": args.dim, "d_out": args.d_out,
                               "kernels": {}}
    for kernel in args.kernels:
        results["kernels"][kernel] = bench_kernel(kernel, keys, values, weights, queries, args)
    return results


@case("topk-attention", quick={"entries": 20_000, "dim": 64, "d_out": 64}, kernel="rbf",
      backend="faiss-flat", k=256, batch=64, entries=1_000_000, dim=256, d_out=256,
      clusters=1000, temperature=0.25, repeats=5)
def topk_case(kernel: str, backend: str, k: int, batch: int, entries: int, dim: int,
              d_out: int, clusters: int, temperature: float, repeats: int) -> dict[str, float]:
    """Exact streaming attention and index search + top-k attention for ``batch`` queries
    over the synthetic store: median seconds of each (an HNSW index takes the script's
    default settings)."""
    keys, values, weights, queries = synthetic_store(entries, dim, d_out, clusters, batch, 0)
    kw = {"kernel": kernel, "temperature": temperature}
    settings = {"hnsw_m": 32, "ef_search": 128, "ef_construction": 40}
    index = make_index(backend, metric_for(kernel),
                       **(settings if backend == "faiss-hnsw" else {}))
    index.add(keys)
    return {"exact": timeit(lambda: attention(queries, keys, values, weights, **kw),
                            repeats).median,
            f"{backend} top-{k}": timeit(lambda: topk_attention(
                queries, keys, values, weights, index=index, k=k, **kw), repeats).median}


def bench_kernel(kernel: str, keys, values, weights, queries, args) -> dict[str, Any]:  # noqa: ANN001
    metric, t = metric_for(kernel), args.temperature
    kw = {"kernel": kernel, "temperature": t}
    exact_out = attention(queries, keys, values, weights, **kw)  # (Q, d_out)
    truth_index = ExactIndex(metric)
    truth_index.add(keys)
    truth = truth_index.search(queries, max(args.ks))[1]  # (Q, k_max), best first
    del truth_index
    rows: dict[str, Any] = {"exact": {}, "indices": {}}
    print(f"\n## {kernel}: index by {metric!r}\n")
    print("| index | build s | add 16 rows ms | memory |")
    print("|---|---:|---:|---:|")
    indices = {}
    for backend in args.backends:
        index = make_index(backend, metric, **index_settings(backend, args))
        t0 = time.perf_counter()
        index.add(keys[:-16])
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        index.add(keys[-16:])  # one growth step of batch 16
        add_ms = 1000 * (time.perf_counter() - t0)
        indices[backend] = index
        rows["indices"][backend] = {"build_s": build, "add16_ms": add_ms, "bytes": index.nbytes}
        print(f"| {backend} | {build:.2f} | {add_ms:.2f} | {format_bytes(index.nbytes)} |")
    print("\n| B | method | k | latency ms | × exact | recall@k | rel. error | ρ̂ | true left-out |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for b in (1, 64):
        q = queries[:b]
        exact_s = timeit(lambda q=q: attention(q, keys, values, weights, **kw),
                         args.repeats).median
        rows["exact"][b] = exact_s
        print(f"| {b} | exact streaming | — | {1000 * exact_s:.2f} | 1 | | | | |")
        for backend, index in indices.items():
            for k in args.ks:
                run = lambda q=q, index=index, k=k: topk_attention(  # noqa: E731
                    q, keys, values, weights, index=index, k=k, **kw)
                seconds = timeit(run, args.repeats).median
                row = {"latency_s": seconds, "speedup": exact_s / seconds}
                if b == 64:  # quality over all the queries, once per (index, k)
                    row |= quality(queries, keys, values, weights, index, k, truth, exact_out, kw)
                rows["indices"][backend].setdefault(b, {})[k] = row
                print(f"| {b} | {backend} | {k} | {1000 * seconds:.2f} | "
                      f"{row['speedup']:.1f} | {fmt(row.get('recall'))} | "
                      f"{fmt(row.get('rel_error'))} | {fmt(row.get('left_out_estimate'))} | "
                      f"{fmt(row.get('left_out_true'))} |")
    return rows


def quality(queries, keys, values, weights, index, k, truth, exact_out, kw) -> dict[str, float]:  # noqa: ANN001
    found = index.search(queries, k)[1]
    result = topk_attention(queries, keys, values, weights, index=index, k=k, **kw)
    error = (result.out - exact_out).norm(dim=1) / exact_out.norm(dim=1)
    true = true_left_out(queries, keys, weights, result.indices, **kw)
    return {"recall": recall_at_k(found, truth[:, :k]), "rel_error": float(error.mean()),
            "left_out_estimate": float(result.left_out.mean()),
            "left_out_true": float(true.mean())}


def index_settings(backend: str, args: argparse.Namespace) -> dict[str, int]:
    if backend != "faiss-hnsw":
        return {}
    return {"hnsw_m": args.hnsw_m, "ef_search": args.ef_search,
            "ef_construction": args.ef_construction}


def fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


# --------------------------------------------------------------------------- CIFAR-10


def bench_cifar(args: argparse.Namespace) -> dict[str, Any]:
    from rcdl.app.experiments.cifar10.config import METRICS, Cifar10Config, load_data
    from rcdl.app.models import build_model
    from rcdl.train.loop import train_one_pass

    cfg = Cifar10Config(models=(args.model,), train_size=args.train_size,
                        test_size=args.test_size, data_dir=args.data_dir, device="cpu")
    data = load_data(cfg, download=False)
    n_train = len(data.y_train)
    store_dtype = None if args.store_dtype is None else getattr(torch, args.store_dtype)
    model, _, grower = build_model(args.model, args.seed, reserve=n_train,
                                   store_dtype=store_dtype)
    if args.checkpoint is not None:
        return bench_cifar_evaluation(args, model, data, load_trained(model, args.checkpoint))
    training = "exact attention"
    if args.train_k:
        use_topk(model, args.train_k, backend=args.backend, train=True,
                 **index_settings(args.backend, args))
        training = f"top-{args.train_k} attention ({args.backend})"
    print(f"# CIFAR-10 {args.model}: one pass over {n_train:,} training images (batch 16) "
          f"with {training}; {len(data.y_test):,} test images, evaluation batch "
          f"{args.eval_batch_size}; HNSW M = {args.hnsw_m}, efSearch = max({args.ef_search}, "
          f"k)")
    tensors = (data.x_train, data.y_train, data.x_test, data.y_test)
    trained = train_one_pass(model, tensors, batch_size=16, grower=grower,
                             loss_fn=F.cross_entropy, metrics=METRICS, eval_every=10**9,
                             eval_batch_size=args.eval_batch_size, progress=False)
    return bench_cifar_evaluation(args, model, data, {
        "training": training, "train_seconds": trained["train_seconds"],
        "note": f"trained in {trained['train_seconds']:.1f} s; final test accuracy during "
                f"training {100 * trained['test_acc']:.2f} %"})


def load_trained(model: torch.nn.Module, path: Path) -> dict[str, Any]:
    """Load a checkpoint of ``rcdl reproduce cifar10-1epoch --keep-checkpoints`` (the last
    one written: every ``eval_every`` steps before the end) into ``model``."""
    from rcdl.train.checkpoint import load_checkpoint, load_model_state

    state = load_checkpoint(path)  # verified, and loads tensors and plain containers only
    load_model_state(model, state["model"])
    step, samples = state["loop"]["step"], state["loop"].get("samples")
    return {"training": f"checkpoint {path} (step {step})", "train_seconds": None,
            "note": f"loaded {path}: the model after step {step}"
                    + (f" ({samples:,} samples)" if samples else "")}


def bench_cifar_evaluation(args: argparse.Namespace, model: torch.nn.Module, data: Any,
                           trained: dict[str, Any]) -> dict[str, Any]:
    """Exact against top-k evaluation of a trained ``model`` on the test set."""
    from rcdl.app.experiments.cifar10.config import METRICS
    from rcdl.train.loop import evaluate

    training = trained["training"]
    if args.checkpoint is not None:
        print(f"# CIFAR-10 {args.model} from {training}; {len(data.y_test):,} test images, "
              f"evaluation batch {args.eval_batch_size}; HNSW M = {args.hnsw_m}, efSearch = "
              f"max({args.ef_search}, k)")
    use_exact(model)
    layers = [layer for _, layer in growing_layers(model)]
    queries: list[torch.Tensor] = []  # the first growing layer's test queries
    hook = layers[0].register_forward_pre_hook(
        lambda _, inputs: queries.append(inputs[0].reshape(-1, layers[0].d_in)))

    def run_eval() -> tuple[dict[str, float], float]:
        t0 = time.perf_counter()
        metrics = evaluate(model, data.x_test, data.y_test, METRICS,
                           batch_size=args.eval_batch_size)
        return metrics, time.perf_counter() - t0

    exact, exact_s = run_eval()
    hook.remove()
    q_first = torch.cat(queries)
    entries = sum(len(layer.store) for layer in layers)
    print(f"# {trained['note']}; {entries:,} entries in {len(layers)} layers\n")
    truth_index = ExactIndex(metric_for(layers[0].kernel))
    truth_index.add(layers[0].store.keys)
    truth = truth_index.search(q_first, min(max(args.ks), len(layers[0].store)))[1]
    del truth_index
    results: dict[str, Any] = {
        "model": args.model, "train_size": len(data.y_train), "test_size": len(data.y_test),
        "training": training, "train_seconds": trained["train_seconds"], "entries": entries,
        "exact": {"test_acc": exact["test_acc"], "test_loss": exact["test_loss"],
                  "eval_s": exact_s}, "topk": []}
    use_topk(model, args.ks[0], backend=args.backend, **index_settings(args.backend, args))
    t0 = time.perf_counter()
    for layer in layers:  # every index is built once, before any timed evaluation
        layer.retrieval.sync(layer)
    build_s = time.perf_counter() - t0
    index_bytes = sum(layer.retrieval.index.nbytes for layer in layers)
    results |= {"index_build_s": build_s, "index_bytes": index_bytes}
    print(f"# {args.backend} indices of the {len(layers)} layers: built in {build_s:.2f} s, "
          f"{format_bytes(index_bytes)}\n")
    print("| attention | k | candidates | eval s | × exact | test acc. % | Δ points | "
          "test loss | recall@k (layer 1) | ρ̂ (layer 1) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| exact streaming | | | {exact_s:.2f} | 1 | {100 * exact['test_acc']:.2f} | | "
          f"{exact['test_loss']:.4f} | | |")
    for k in args.ks:
        for factor in args.candidate_factors:
            row = eval_topk(layers, k, factor * k, q_first, truth, run_eval)
            row["speedup"] = exact_s / row["eval_s"]
            row["delta_points"] = 100 * (row["test_acc"] - exact["test_acc"])
            results["topk"].append(row)
            print(f"| top-k ({args.backend}) | {k} | {factor * k} | {row['eval_s']:.2f} | "
                  f"{row['speedup']:.1f} | {100 * row['test_acc']:.2f} | "
                  f"{row['delta_points']:+.2f} | {row['test_loss']:.4f} | "
                  f"{fmt(row['recall'])} | {fmt(row['left_out'])} |")
    use_exact(model)
    return results


def eval_topk(layers, k, candidates, q_first, truth, run_eval) -> dict[str, Any]:  # noqa: ANN001
    """Evaluate with every layer's (already built) index at this ``k`` and candidates."""
    for layer in layers:
        layer.retrieval.k, layer.retrieval.candidates = k, candidates
    metrics, seconds = run_eval()
    first = layers[0]
    index = first.retrieval.index
    kk = min(k, len(first.store))
    result = topk_attention(q_first, first.store.keys, first.store.values, first.entry_weights(),
                            kernel=first.kernel, temperature=first.temperature, index=index,
                            k=k, candidates=candidates)
    return {"k": k, "candidates": candidates, "eval_s": seconds, "test_acc": metrics["test_acc"],
            "test_loss": metrics["test_loss"],
            "recall": recall_at_k(index.search(q_first, kk)[1], truth[:, :kk]),
            "left_out": float(result.left_out.mean())}


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (under a minute)")
    parser.add_argument("--threads", type=int, help="torch and FAISS threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ks", type=int, nargs="+", help="k values (default per mode)")
    parser.add_argument("--backends", nargs="+", default=["faiss-flat", "faiss-hnsw"],
                        help="synthetic mode: indices to compare")
    parser.add_argument("--hnsw-m", type=int, default=32)
    parser.add_argument("--ef-search", type=int, default=128)
    parser.add_argument("--ef-construction", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per latency")
    parser.add_argument("--json", type=Path, help="also write the results here")
    synthetic = parser.add_argument_group("synthetic store")
    synthetic.add_argument("--entries", type=int, default=1_000_000)
    synthetic.add_argument("--dim", type=int, default=256)
    synthetic.add_argument("--d-out", type=int, default=256)
    synthetic.add_argument("--clusters", type=int, default=1000)
    synthetic.add_argument("--queries", type=int, default=256, help="for recall and error")
    synthetic.add_argument("--temperature", type=float, default=0.25,
                           help="T of both kernels: lower is more peaked")
    synthetic.add_argument("--kernels", nargs="+", default=["rbf", "softmax"])
    cifar = parser.add_argument_group("CIFAR-10")
    cifar.add_argument("--cifar", action="store_true", help="the CIFAR-10 mode")
    cifar.add_argument("--model", choices=("gws", "rbf"), default="gws")
    cifar.add_argument("--data-dir", default=os.environ.get("RCDL_DATA", "../shared/data"))
    cifar.add_argument("--train-size", type=int, default=None, help="default: all 50 000")
    cifar.add_argument("--test-size", type=int, default=None, help="default: all 10 000")
    cifar.add_argument("--eval-batch-size", type=int, default=500)
    cifar.add_argument("--backend", default="faiss-hnsw", help="index of the top-k runs")
    cifar.add_argument("--candidate-factors", type=int, nargs="+",
                       help="candidates = factor × k; 1: no rescoring (default 1; --quick: 1 4)")
    cifar.add_argument("--train-k", type=int, help="train with top-k attention too")
    cifar.add_argument("--checkpoint", type=Path, help="evaluate this trained model (a "
                       "checkpoint kept by rcdl reproduce cifar10-1epoch --keep-checkpoints) "
                       "instead of training one")
    cifar.add_argument("--store-dtype", choices=("bfloat16", "float16"),
                       help="the model's store dtype (as the checkpoint was trained)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        try:
            import faiss
            faiss.omp_set_num_threads(args.threads)
        except ImportError:
            pass
    if args.quick:
        for name, value in (QUICK_CIFAR if args.cifar else QUICK_SYNTHETIC).items():
            setattr(args, name, value)
        args.repeats = min(args.repeats, 3)
    mode = ("cifar-quick" if args.quick else "cifar") if args.cifar else "synthetic"
    args.ks = args.ks or DEFAULT_KS[mode]
    args.candidate_factors = args.candidate_factors or ([1, 4] if args.quick else [1])
    keep_freed_memory()  # as the rcdl command does: large temporaries without page faults
    print(header())
    results = bench_cifar(args) if args.cifar else bench_synthetic(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"machine": header(), "args": {k: str(v) for k, v in vars(args).items()},
                  "results": results}
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
