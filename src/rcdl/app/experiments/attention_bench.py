"""The streaming attention's speed against the matrix products it is made of.

Run it with ``rcdl reproduce attention-bench`` (docs/adding_an_experiment.md follows this
module as its example). For each store dtype, query batch ``B`` and store size ``N``
(keys and values ``d`` wide, random), one sub-run times the attention forward plus its
backward with respect to the queries (:func:`rcdl.ops.attention.attention`), and the four
plain products those passes are made of: ``q Kᵀ`` and its product with ``V`` forward,
``g Vᵀ`` and its product with ``K`` backward, in the store's dtype. Both count as
``8·B·N·d`` flops; ``ratio`` is the products' time over the attention's (1: the attention
costs no more than its products). Medians of ``repeats`` calls after one warm-up.
``benchmarks/bench_attention.py`` measures the same with working memory, in subprocesses.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from rcdl.app.config import ExperimentConfig, device_setting, setting
from rcdl.app.report import csv_text, markdown_table, write_outputs
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.app.runner import Experiment, Session
from rcdl.ops.attention import attention
from rcdl.ops.kernels import check_kernel

__all__ = ["EXPERIMENT", "EXPERIMENT_SPEC", "AttentionBenchConfig", "measure"]

EXPERIMENT = "attention-bench"


@dataclass(frozen=True)
class AttentionBenchConfig(ExperimentConfig):
    """What to time; the defaults are the one-epoch CIFAR-10 models' shapes at 50 000
    entries (training B = 16, evaluation B = 500)."""

    QUICK = {"sizes": (2000,), "batches": (16,), "width": 256, "repeats": 2}

    sizes: tuple[int, ...] = setting((50_000,), "store sizes N (entries)", metavar="N")
    batches: tuple[int, ...] = setting((16, 500), "query batch sizes B", metavar="B")
    width: int = setting(3072, "width d of keys and values", metavar="D")
    store_dtypes: tuple[str, ...] = setting(("float32", "bfloat16"), "store dtypes",
                                            choices=("float32", "bfloat16", "float16"))
    kernel: str = setting("softmax", "attention kernel", choices=("softmax", "rbf"))
    temperature: float = setting(6.0, "kernel temperature T", positive=True, metavar="T")
    repeats: int = setting(5, "timed calls per measurement (the median is kept)")
    seed: int = setting(0, "seed of the random store and queries", minimum=0)
    device: str = device_setting()


def _median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(cfg: AttentionBenchConfig, dtype: str, batch: int, n: int,
            device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Time one (store dtype, B, N): the attention's forward + backward and its products."""
    gen = torch.Generator().manual_seed(cfg.seed)
    d, store = cfg.width, getattr(torch, dtype)
    keys = (torch.randn(n, d, generator=gen) / d**0.5).to(device, store)  # (N, d)
    values = torch.randn(n, d, generator=gen).to(device, store)  # (N, d)
    weights = torch.rand(n, generator=gen).to(device)  # (N,)
    q, grad = (torch.randn(batch, d, generator=gen).to(device) for _ in range(2))  # (B, d)
    kernel = check_kernel(cfg.kernel)

    def forward_backward() -> None:
        out = attention(q.detach().requires_grad_(), keys, values, weights, kernel=kernel,
                        temperature=cfg.temperature)  # fmt: skip
        out.backward(grad)

    def products() -> None:
        qs, gs = q.detach().to(store), grad.to(store)
        (qs @ keys.T) @ values, (gs @ values.T) @ keys  # noqa: B018 - timed for their cost

    attention_s = _median_seconds(forward_backward, cfg.repeats, device)
    products_s = _median_seconds(products, cfg.repeats, device)
    return {"store_dtype": dtype, "B": batch, "N": n, "attention_seconds": attention_s,
            "products_seconds": products_s, "ratio": products_s / attention_s,
            "attention_gflops": 8 * batch * n * d / attention_s / 1e9}  # fmt: skip


def _sub_runs(cfg: AttentionBenchConfig, data: None, session: Session) -> Iterator:
    for dtype in cfg.store_dtypes:
        for n in cfg.sizes:
            for batch in cfg.batches:
                yield f"{dtype}-B{batch}-N{n}", partial(measure, cfg, dtype, batch, n,
                                                        session.device)  # fmt: skip


def write_report(run: RunDir, cfg: AttentionBenchConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    rows = [[r["store_dtype"], r["B"], f"{r['N']:,}", f"{1e3 * r['attention_seconds']:.2f}",
             f"{1e3 * r['products_seconds']:.2f}", f"{r['ratio']:.2f}",
             f"{r['attention_gflops']:.0f}"] for r in summary["runs"]]  # fmt: skip
    table = markdown_table(["store", "B", "N", "attention ms", "products ms", "ratio",
                            "GFLOP/s"], rows, align="llrrrrr")  # fmt: skip
    report = (f"# Streaming attention against its products ({cfg.kernel}, d = {cfg.width})\n\n"
              f"{table}\n\nForward + backward w.r.t. the queries; medians of {cfg.repeats} "
              f"calls.\nMachine: {describe_machine(device)}.\n")
    return write_outputs(run, report, csv_text(summary["runs"]))


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=AttentionBenchConfig,
    help="the streaming attention's speed against the matrix products it is made of, per "
    "store dtype, batch and store size (docs/precision.md)",
    description="Times the streaming attention's forward + backward against the four plain "
    "matrix products it is made of, for each store dtype, query batch B and store size N, "
    "on a random store. Writes results.md and results.csv. See docs/adding_an_experiment.md.",
    sub_runs=_sub_runs, report=write_report,
)  # fmt: skip
