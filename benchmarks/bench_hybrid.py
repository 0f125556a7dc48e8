"""Hybrid growing network: where one training step's time goes (docs/reference.md §4, §6).

Builds ``HybridSoftmaxNet`` at the paper's size (d = 3072, 3 blocks + a readout to 10
classes, T = 5, τ = 50, gws η = 1, β = 30, ``EntryAdam`` lr 1e−3), pre-fills every layer's
store with N entries, and times training steps of batch 16 on random data, phase by phase,
in the order ``rcdl.train.loop.train_one_pass`` runs them:

- ``forward``:  ``loss = F.cross_entropy(net(x), y)`` and ``loss.item()``;
- ``backward``: ``loss.backward()`` — gradients w.r.t. the queries and every stored entry;
- ``adam``:     ``EntryAdam.step()`` and ``zero_grad()`` — every entry and its moments move;
- ``growth``:   ``Grower.step()`` — the distance gate, the gws entries and their writes.

The pre-filled entries look like the trained ones: RMS-normalised keys (the queries the
network writes are RMS-normalised), small weighted values, positive weights, non-zero Adam
moments and per-entry Adam clocks spread over the last 100 steps. Queries are random, so
nearly every sample passes the τ = 50 gate and each layer grows by up to 16 entries a
step (the stores are reserved up front, so no step reallocates them).

Run: ``OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python benchmarks/bench_hybrid.py`` (default
N = 8000 and 20000, 1 warm-up and 3 timed steps each: 1 min 45 s at one thread on the
2-core development VM, 7 GB of memory at N = 20000). Each measurement runs in a fresh process. To
compare versions of the code in one run, alternating between them, pass ``--baseline SRC``
(e.g. ``git archive HEAD src | tar -x -C /tmp/rcdl-head`` gives ``/tmp/rcdl-head/src``) or
``--versions LABEL=SRC ...``, and ``--rounds R``; the speed-ups are ratios of the medians.
``--profile`` also prints the ``torch.profiler`` table of one more step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import rcdl
from harness import case, clock, machine_line
from rcdl import ClippedSoftmaxRule, DistanceGate, EntryAdam, Grower

try:  # the learner's step of the code under test; older versions (--baseline): the layer's
    from rcdl.optim._step import commit
except ImportError:
    def commit(layer, entries) -> None:  # noqa: ANN001
        layer.commit(entries)

try:  # the module path of the code under test; revisions before the packages were flat
    from rcdl.nn.hybrid import hybrid_layers
except ImportError:
    from rcdl.hybrid import hybrid_layers  # type: ignore[no-redef]

try:  # the builder of the code under test; older versions (--baseline) had a function
    from rcdl import HybridSoftmaxNet
except ImportError:
    from rcdl.networks import hybrid_softmax_net as HybridSoftmaxNet  # noqa: N813

PHASES = ("forward", "backward", "adam", "growth")
D, CLASSES, BATCH = 3072, 10, 16


def build(n: int, steps: int, device: torch.device, seed: int = 0,  # noqa: ANN201
          store_dtype: str = "float32"):
    """The hybrid net of docs/reference.md §6 with ``n`` entries per layer, room for ``steps`` more
    steps, its stores in ``store_dtype``."""
    torch.manual_seed(seed)
    net = HybridSoftmaxNet(D, CLASSES, 3, temperature=5.0,
                           rule=ClippedSoftmaxRule(eta=1.0, beta=30.0),
                           trigger=DistanceGate(50.0), initial_entries=0).to(device)
    if store_dtype != "float32":
        rcdl.set_store_dtype(net, getattr(torch, store_dtype))
    adam_steps = 100
    for _, layer in hybrid_layers(net):
        layer.store.reserve(n + steps * BATCH)
        keys = torch.randn(n, D, device=device)
        keys.mul_(torch.rsqrt(keys.square().mean(1, keepdim=True)))  # (N, d), unit RMS
        values = torch.randn(n, layer.d_out, device=device).mul_(0.01)  # (N, d_out)
        weights = torch.rand(n, device=device).add_(0.5).div_(n)  # (N,)
        commit(layer, (keys, values, weights))
        del keys, values, weights
    adam = EntryAdam(net, lr=1e-3)  # its moments meet the n entries of every layer
    for name, layer in hybrid_layers(net):
        if hasattr(adam, "moments"):  # the optimizer's state
            m, v, steps_taken = adam.moments[name].m, adam.moments[name].v, adam.moments[name].steps
        else:  # revisions before 2026-12-05 kept the moments on the layer (--baseline)
            m, v, steps_taken = layer.adam_m, layer.adam_v, layer.adam_steps
        for store in (m, v):
            store.reserve(n + steps * BATCH)
        steps_taken.fill_(adam_steps)
        ages = torch.randint(0, adam_steps, (n,), device=device)  # (N,) steps before now
        for store in (m, v):
            store.written_at.copy_(ages)
        for moment in (m.keys, m.values, m.weights):
            moment.normal_(0.0, 1e-4)
        for moment in (v.keys, v.values, v.weights):
            moment.uniform_(0.5e-8, 1e-8)
    return net, adam, Grower(net)


def _peak_rss_bytes() -> int:
    """The process's peak resident memory (Linux ``VmHWM``; 0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


def train_step(net, adam, grower, x, y, device, phases=None) -> None:  # noqa: ANN001
    """One ``train_one_pass`` step; adds each phase's seconds to ``phases`` if given (read
    with the harness's clock, which waits for a GPU's queued kernels)."""
    marks = [clock()]

    def mark() -> None:
        marks.append(clock())

    loss = F.cross_entropy(net(x), y)
    loss.item()
    mark()
    loss.backward()
    mark()
    adam.step()
    adam.zero_grad(set_to_none=True)
    mark()
    grower.step()
    mark()
    if phases is not None:
        for phase, t0, t1 in zip(PHASES, marks[:-1], marks[1:], strict=True):
            phases[phase].append(t1 - t0)


def measure(n: int, steps: int, warmup: int, device: torch.device, profile: bool,
            store_dtype: str = "float32") -> dict:
    """Median seconds per phase (and of the whole step) at ``n`` entries per layer."""
    net, adam, grower = build(n, steps + warmup + int(profile), device, store_dtype=store_dtype)
    gen = torch.Generator().manual_seed(1)
    phases: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for i in range(warmup + steps):
        x = torch.randn(BATCH, D, generator=gen).to(device)  # (B, d)
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen).to(device)  # (B,)
        train_step(net, adam, grower, x, y, device, phases if i >= warmup else None)
    if profile:
        from torch import profiler

        with profiler.profile(activities=[profiler.ProfilerActivity.CPU]) as prof:
            train_step(net, adam, grower, x, y, device)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    totals = [sum(parts) for parts in zip(*phases.values(), strict=True)]
    result = {phase: statistics.median(times) for phase, times in phases.items()}
    result["step"] = statistics.median(totals)
    result["entries"] = [len(layer.store) for _, layer in hybrid_layers(net)]
    result["peak_gb"] = _peak_rss_bytes() / 1e9
    del net, adam, grower
    gc.collect()
    return result


@case("hybrid-step", quick={"entries": 2000, "steps": 1}, entries=8000, steps=3, warmup=1,
      store_dtype="float32")
def hybrid_step(entries: int, steps: int, warmup: int, store_dtype: str) -> dict[str, float]:
    """One training step of the paper-size hybrid net at ``entries`` entries per layer, phase
    by phase: median seconds of each phase and of the whole step over ``steps`` steps."""
    r = measure(entries, steps, warmup, torch.device("cpu"), False, store_dtype)
    return {k: r[k] for k in (*PHASES, "step")}


def _child(n: int, args: argparse.Namespace, src: str) -> dict:
    """``measure`` in a fresh process importing rcdl from ``src`` (memory is freed after)."""
    cmd = [sys.executable, __file__, "--child", str(n), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--device", args.device,
           "--store-dtype", args.store_dtype]
    cmd += ["--profile"] if args.profile else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (src, os.environ.get(
        "PYTHONPATH")))))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        raise SystemExit(f"benchmark child failed for N={n}, rcdl from {src}")
    *text, last = out.stdout.strip().splitlines()
    if text:
        print("\n".join(text), flush=True)
    return json.loads(last)


def _row(n: int, label: str, r: dict) -> str:
    cells = [f"{1e3 * r[p]:7.0f} ({100 * r[p] / r['step']:3.0f} %)" for p in PHASES]
    return (f"| {n:6d} | {label:>9} | " + " | ".join(cells)
            + f" | {1e3 * r['step']:8.0f} | {r['peak_gb']:7.1f} |")


def _version(spec: str) -> tuple[str, str]:
    label, sep, src = spec.partition("=")
    if not sep or not label or not src:
        raise argparse.ArgumentTypeError(f"expected LABEL=SRC, got {spec!r}")
    return label, src


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[8000, 20000],
                        help="entries pre-filled per layer (one measurement each)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--store-dtype", default="float32",
                        choices=("float32", "bfloat16", "float16"),
                        help="the stores' keys and values (docs/precision.md)")
    parser.add_argument("--baseline", metavar="SRC",
                        help="also time the rcdl package under SRC (e.g. an older checkout's "
                             "src/) before this checkout's, and print the speed-ups")
    parser.add_argument("--versions", metavar="LABEL=SRC", nargs="+", type=_version,
                        help="time these rcdl packages instead (speed-ups against the first)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternate the versions this many times (medians over rounds)")
    parser.add_argument("--profile", action="store_true",
                        help="also print torch.profiler's table of one more step")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one N, in-process
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.child is not None:
        r = measure(args.child, args.steps, args.warmup, device, args.profile,
                    args.store_dtype)
        print(json.dumps(r | {"rcdl": rcdl.__file__}))
        return

    versions = args.versions or [("current", str(Path(__file__).resolve().parents[1] / "src"))]
    if args.baseline:
        versions = [("baseline", args.baseline), *versions]
    tunables = os.environ.get("GLIBC_TUNABLES")
    print(f"# {platform.node()} {platform.machine()} {machine_line(device)}, {device}, "
          f"store {args.store_dtype}"
          + (f", GLIBC_TUNABLES={tunables}" if tunables else ""))
    print("# " + ", ".join(f"{label}: rcdl from {src}" for label, src in versions))
    print(f"# hybrid net d = {D}, 3 blocks + readout, batch {BATCH}; ms per step (% of the "
          f"step), median of {args.steps} steps after {args.warmup} warm-up")
    header = ("|      N |      code | " + " | ".join(f"{p:>15}" for p in PHASES)
              + " |  step ms | peak GB |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for n in args.entries:
        results: dict[str, list[dict]] = {label: [] for label, _ in versions}
        for _ in range(args.rounds):
            for label, src in versions:
                results[label].append(r := _child(n, args, src))
                print(_row(n, label, r), flush=True)
        if len(versions) < 2:
            continue
        med = {label: {k: statistics.median(r[k] for r in rs) for k in (*PHASES, "step")}
               for label, rs in results.items()}
        first = versions[0][0]
        for label, _ in versions[1:]:
            gains = [f"{med[first][p] / med[label][p]:13.2f} x" for p in PHASES]
            print(f"| {n:6d} | {'speed-up':>9} | " + " | ".join(gains)
                  + f" | {med[first]['step'] / med[label]['step']:6.2f} x |         |"
                  + ("" if len(versions) == 2 else f" {label} vs {first}"), flush=True)


if __name__ == "__main__":
    main()
