"""Growing stores sharded over ``torch.distributed``: wire bytes, memory per rank, step time.

Measures :mod:`rcdl.distributed` with gloo on CPU, ranks started by ``torch.multiprocessing``
(spawn), a file-store rendezvous and a timeout on ``init_process_group``, one thread per
rank (``torch.set_num_threads(1)`` in every worker). Four parts, each in fresh processes:

1. **bytes** — payload bytes handed to the collectives (``torch.distributed.all_reduce`` and
   ``all_gather``, wrapped and counted) by one sharded :class:`rcdl.nn.layers.GrowingSoftmax`
   ``d → d`` (B = 16, input requiring grad as in a middle layer) in its forward, backward
   and ``Grower.step``, for several store sizes N and world sizes; beside the prediction
   (forward: :func:`rcdl.distributed.world_bytes`; backward: the query-gradient all_reduce,
   ``B · d_in`` floats) and the bytes the process really wrote to its sockets (``wchar`` of
   ``/proc/self/io``: gloo's ring and its headers).
2. **memory** — peak RSS per rank (``ru_maxrss``) after one training step of one
   ``GrowingSoftmax d → d`` whose store holds N entries in all (each rank builds only its own
   rows, ``i mod W == rank``, in chunks, into a store reserved up front), against a
   single process without ``torch.distributed``; baseline = RSS before the store is built.
3. **time** — steps (forward + backward + ``Grower.step``) of the paper's gws network
   (``GrowingSoftmaxNet(d, 10, 2)``: 2 blocks + a readout, N entries per layer, B = 16):
   one process unsharded, W = 1 and W = 2 sharded (one thread per rank), and one process
   at two threads (the same two cores as W = 2). Median of the timed steps after a warm-up,
   with the time spent inside the collectives; then the collectives alone (after a barrier).
   Also checks that the sharded losses equal the single-process ones.
4. **planning** — memory per rank and payload per step for CIFAR-10, ImageNet-sized and
   10 M-sample stores at 1, 8 and 64 ranks, from the per-entry bytes measured above.

Every rank generates the same global store (rows seeded by chunk) and keeps its own rows, so
outputs and losses are comparable between world sizes.

Times are read with the benchmark harness's clock (``benchmarks/harness.py``: ``clock`` at each
phase's end inside a rank, ``timeit`` for a collective called alone), in every rank; the ranks
hide any accelerator (``CUDA_VISIBLE_DEVICES=""``), so the clock's device synchronisation
neither starts one nor waits for one.

Run (the committed results, ``results/distributed/README.md``)::

    python benchmarks/bench_distributed.py --json results/distributed/results.json
    python benchmarks/bench_distributed.py --quick          # small sizes, a smoke run (~1 min)
    python benchmarks/bench_distributed.py --parts bytes memory   # a subset

Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from harness import clock, timeit
from rcdl.app.rundir import SPEED_FLAGS, cpu_flags, cpu_model

BATCH = 16
CLASSES = 10
TIMEOUT = timedelta(seconds=300)
CHUNK_ROWS = 1024  # rows generated per seeded chunk while building a store
TEMPERATURE = 6.0  # docs/reference.md §6's gws
ETA, BETA = 0.003, 3.0

FULL = {"d": 3072, "bytes_n": [1000, 10000, 50000], "bytes_worlds": [1, 2, 3],
        "mem_n": 90000, "mem_worlds": [1, 2, 3], "time_n": 50000, "warmup": 2, "steps": 7,
        "collective_reps": 50}
QUICK = {"d": 256, "bytes_n": [100, 1000, 5000], "bytes_worlds": [1, 2],
         "mem_n": 20000, "mem_worlds": [1, 2], "time_n": 4000, "warmup": 1, "steps": 3,
         "collective_reps": 10}


# ------------------------------------------------------------------ machine
def machine_line() -> str:
    flags = " ".join(cpu_flags()) or "none of " + "/".join(SPEED_FLAGS)
    return (f"{platform.node()} {platform.machine()}, {cpu_model()}, {os.cpu_count()} CPUs, "
            f"flags {flags}; torch {torch.__version__}; one thread per rank "
            "(torch.set_num_threads(1)); gloo on CPU, float32")


# ------------------------------------------------------------------ memory readings
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB


def socket_bytes_written() -> int:
    """Bytes this process passed to write-family syscalls (gloo's sockets, via writev)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


# ------------------------------------------------------------------ collective counting
class Collectives:
    """Wraps ``torch.distributed.all_reduce`` / ``all_gather``: counts calls and payload
    bytes (the tensor handed in, per rank) and the seconds spent inside them."""

    def __init__(self) -> None:
        self.calls = self.bytes = 0
        self.seconds = 0.0
        self.sizes: list[int] = []
        self._orig = {}
        for name in ("all_reduce", "all_gather"):
            self._orig[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name))

    def _wrap(self, name: str):  # noqa: ANN202
        orig = self._orig[name]

        def counted(tensor_or_list, *args, **kwargs):  # noqa: ANN001, ANN202
            t = tensor_or_list if name == "all_reduce" else args[0]  # all_gather(out, t)
            start = clock()
            result = orig(tensor_or_list, *args, **kwargs)
            self.seconds += clock() - start
            self.calls += 1
            self.bytes += t.numel() * t.element_size()
            self.sizes.append(t.numel() * t.element_size())
            return result

        return counted

    def reset(self) -> None:
        self.calls = self.bytes = 0
        self.seconds = 0.0
        self.sizes = []

    def snapshot(self) -> dict:
        return {"calls": self.calls, "bytes": self.bytes, "seconds": self.seconds,
                "sizes": list(self.sizes)}


# ------------------------------------------------------------------ building stores
def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(1, keepdim=True))


def fill_store(layer, n: int, rank: int, world: int, seed: int, room: int = 0) -> None:  # noqa: ANN001
    """Append this rank's rows (global row ``i`` with ``i mod world == rank``) of an ``n``-row
    store, generated in seeded chunks: every world size builds the same global store. The
    store is reserved up front to exactly its rows plus ``room`` (no geometric growth)."""
    owned_total = len(range(rank, n, world))
    layer.store.reserve(len(layer.store) + owned_total + room)
    d_in, d_out = layer.store.d_in, layer.store.d_out
    for c, start in enumerate(range(0, n, CHUNK_ROWS)):
        rows = min(CHUNK_ROWS, n - start)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + c)
        keys = _rms(torch.randn(rows, d_in, generator=gen))  # (rows, d_in), unit RMS
        values = torch.randn(rows, d_out, generator=gen).mul_(0.01)  # (rows, d_out)
        weights = torch.rand(rows, generator=gen).add_(0.5).div_(n)  # (rows,)
        mine = (torch.arange(start, start + rows) % world) == rank  # (rows,) bool
        layer.store.append(keys[mine], values[mine], weights[mine])
        del keys, values, weights


def make_rule():  # noqa: ANN201
    from rcdl.nn.rules import ClippedSoftmaxRule

    return ClippedSoftmaxRule(ETA, BETA)


def batch(step: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    x = _rms(torch.randn(BATCH, d, generator=gen))  # (B, d)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen)  # (B,)
    return x, y


# ------------------------------------------------------------------ workers
def _init(rank: int, world: int, init_file: str | None) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: the clock starts no accelerator
    torch.set_num_threads(1)
    if init_file is not None:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=TIMEOUT)


def _finish(init_file: str | None) -> None:
    if init_file is not None:
        dist.barrier()
        dist.destroy_process_group()


def _dump(path: str, rank: int, obj: dict) -> None:
    with open(Path(path) / f"rank{rank}.json", "w") as f:
        json.dump(obj, f)


def bytes_worker(rank: int, world: int, init_file: str, out: str, d: int,
                 sizes: list[int]) -> None:
    """Part 1: collective payloads of one sharded GrowingSoftmax d → d per phase."""
    _init(rank, world, init_file)
    from rcdl.distributed import shard
    from rcdl.nn.layers import GrowingSoftmax
    from rcdl.optim.grower import Grower

    counter = Collectives()
    rows = []
    for n in sizes:
        torch.manual_seed(0)
        layer = GrowingSoftmax(d, d, temperature=TEMPERATURE, rule=make_rule(),
                               initial_entries=0)
        shard(layer)  # on the empty store; then each rank appends its rows
        fill_store(layer, n, rank, world, seed=1, room=4 * BATCH)
        grower = Grower(layer)
        local_n = len(layer.store)
        x, _ = batch(0, d)
        target = torch.randn(BATCH, d, generator=torch.Generator().manual_seed(5)) * 0.01
        phases = {}
        for name in ("forward", "backward", "step"):
            dist.barrier()
            counter.reset()
            wrote = socket_bytes_written()
            if name == "forward":
                x = x.clone().requires_grad_()  # as in a middle layer: ∂L/∂q is needed
                s = layer(x)
                loss = F.mse_loss(s, target)
            elif name == "backward":
                loss.backward()
            else:
                grower.step()
                grower.zero_grad()
            phases[name] = counter.snapshot() | {"wchar": socket_bytes_written() - wrote}
        rows.append({"n": n, "local_n": local_n,
                     "phases": phases, "loss": loss.item(),
                     "store_nbytes": layer.store.nbytes, "entries": len(layer.store),
                     "out": s.detach()[:2, :4].tolist()})
        del layer, grower, s, loss
    _dump(out, rank, {"rows": rows})
    _finish(init_file)


def memory_worker(rank: int, world: int, init_file: str | None, out: str, d: int,
                  n: int) -> None:
    """Part 2: peak RSS of one rank holding its share of an ``n``-entry store."""
    _init(rank, world, init_file)
    from rcdl.distributed import shard
    from rcdl.nn.layers import GrowingSoftmax
    from rcdl.optim.grower import Grower

    torch.manual_seed(0)
    layer = GrowingSoftmax(d, d, temperature=TEMPERATURE, rule=make_rule(), initial_entries=0)
    if init_file is not None:
        shard(layer)
    grower = Grower(layer)
    x, _ = batch(0, d)
    target = torch.randn(BATCH, d, generator=torch.Generator().manual_seed(5)) * 0.01
    # warm the code path on the empty store, so the baseline includes what a step allocates
    # once (autograd, the attention's buffers); then forget it
    F.mse_loss(layer(x.clone().requires_grad_()), target).backward()
    grower.zero_grad()
    if init_file is not None:
        dist.barrier()
    baseline, baseline_peak = rss_bytes(), peak_rss_bytes()
    fill_store(layer, n, rank, world, seed=2, room=2 * BATCH)
    after_build = rss_bytes()
    entries = len(layer.store)
    store_nbytes, reserved = layer.store.nbytes, layer.store.reserved_nbytes
    xq = x.clone().requires_grad_()
    loss = F.mse_loss(layer(xq), target)
    loss.backward()
    grower.step()
    grower.zero_grad()
    _dump(out, rank, {"baseline": baseline, "baseline_peak": baseline_peak,
                      "after_build": after_build, "peak": peak_rss_bytes(),
                      "after_step": rss_bytes(), "entries": entries,
                      "store_nbytes": store_nbytes, "reserved_nbytes": reserved,
                      "loss": loss.item()})
    _finish(init_file)


def time_worker(rank: int, world: int, init_file: str | None, out: str, d: int, n: int,
                warmup: int, steps: int, threads: int, reps: int) -> None:
    """Part 3: step times of the gws net (2 blocks + readout), phase by phase."""
    _init(rank, world, init_file)
    torch.set_num_threads(threads)
    from rcdl.distributed import shard
    from rcdl.nn.layers import growing_layers
    from rcdl.nn.networks import GrowingSoftmaxNet
    from rcdl.optim.grower import Grower

    counter = Collectives() if init_file is not None else None
    torch.manual_seed(0)
    net = GrowingSoftmaxNet(d, CLASSES, 2, temperature=TEMPERATURE, rule=make_rule(),
                            initial_entries=0)
    if init_file is not None:
        shard(net)
    for i, (_, layer) in enumerate(growing_layers(net)):
        fill_store(layer, n, rank, world, seed=10 + i, room=(warmup + steps + 1) * BATCH)
    grower = Grower(net)
    per_entry = {f"{layer.d_in}->{layer.d_out}": layer.store.nbytes / len(layer.store)
                 for _, layer in growing_layers(net)}
    records = []
    for step in range(warmup + steps):
        x, y = batch(step, d)
        if init_file is not None:
            dist.barrier()
            counter.reset()
        t0 = clock()  # the harness's clock at each phase's end
        grower.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss_value = loss.item()
        t1 = clock()
        fwd_coll = counter.snapshot() if counter else None
        loss.backward()
        t2 = clock()
        grower.step()
        t3 = clock()
        rec = {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0,
               "loss": loss_value}
        if counter:
            total = counter.snapshot()
            rec |= {"coll_s": total["seconds"], "coll_bytes": total["bytes"],
                    "coll_calls": total["calls"], "fwd_coll_bytes": fwd_coll["bytes"],
                    "fwd_coll_s": fwd_coll["seconds"]}
        records.append(rec)
    alone = None
    if init_file is not None:  # the same collectives, alone, after a barrier
        sizes = sorted({(BATCH, 1), (BATCH, d + 2), (BATCH, CLASSES + 2), (BATCH, d)})
        alone = {}
        for shape in sizes:
            t = torch.zeros(shape)
            times = []
            for _ in range(reps):  # one call at a time, each after a barrier (not timed)
                dist.barrier()
                times.append(timeit(lambda t=t: dist.all_reduce(t), 1, warmup=0).times[0])
            alone[str(t.numel() * 4)] = statistics.median(times)
    _dump(out, rank, {"records": records, "alone": alone, "per_entry": per_entry,
                      "entries": [len(layer.store) for _, layer in growing_layers(net)],
                      "nbytes": sum(layer.store.nbytes for _, layer in growing_layers(net)),
                      "peak": peak_rss_bytes()})
    _finish(init_file)


def spawn(fn, world: int, *args, distributed: bool = True) -> list[dict]:  # noqa: ANN001
    """Run ``fn(rank, world, init_file, out_dir, *args)`` on ``world`` spawned ranks."""
    with tempfile.TemporaryDirectory(prefix="rcdl-bench-dist-") as tmp:
        init_file = str(Path(tmp) / "init") if distributed else None
        mp.start_processes(fn, args=(world, init_file, tmp, *args), nprocs=world, join=True,
                           start_method="spawn")
        results = []
        for r in range(world):
            with open(Path(tmp) / f"rank{r}.json") as f:
                results.append(json.load(f))
    return results


# ------------------------------------------------------------------ formatting
def gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def predicted_bytes(d_in: int, d_out: int, query_grad: bool = True) -> tuple[int, int]:
    from rcdl.distributed import world_bytes

    return world_bytes(BATCH, d_out), (BATCH * d_in * 4 if query_grad else 0)


# ------------------------------------------------------------------ parts
def part_bytes(cfg: dict, report: dict) -> None:
    d = cfg["d"]
    fwd_pred, bwd_pred = predicted_bytes(d, d)
    print(f"\n## 1. Collective payload per layer and step (GrowingSoftmax {d} → {d}, "
          f"B = {BATCH}, input requiring grad)\n")
    print("Payload = bytes of the tensors one rank hands to all_reduce/all_gather (every rank "
          "the same); socket = bytes rank 0 wrote to its sockets (`wchar`), what gloo sent.\n")
    rows, out_ref, raw = [], {}, []
    for world in cfg["bytes_worlds"]:
        results = spawn(bytes_worker, world, d, cfg["bytes_n"])
        for i, n in enumerate(cfg["bytes_n"]):
            r0 = results[0]["rows"][i]
            ph = r0["phases"]
            same = all(res["rows"][i]["phases"][p]["bytes"] == ph[p]["bytes"]
                       for res in results for p in ph)
            shards = [res["rows"][i]["local_n"] for res in results]
            out = torch.tensor(r0["out"])
            if world == cfg["bytes_worlds"][0]:
                out_ref[n] = out
            diff = (out - out_ref[n]).abs().max().item()
            ok = ph["forward"]["bytes"] == fwd_pred and ph["backward"]["bytes"] == bwd_pred
            rows.append([world, f"{n:,}", "/".join(f"{s:,}" for s in shards),
                         f"{ph['forward']['calls']} / {ph['forward']['bytes']:,}",
                         f"{ph['backward']['calls']} / {ph['backward']['bytes']:,}",
                         f"{ph['step']['calls']} / {ph['step']['bytes']:,}",
                         f"{fwd_pred:,} + {bwd_pred:,}", "yes" if ok and same else "NO",
                         f"{ph['forward']['wchar']:,} + {ph['backward']['wchar']:,}",
                         f"{diff:.1e}"])
            raw.append({"world": world, "n": n, "shards": shards, "phases": ph,
                        "predicted": [fwd_pred, bwd_pred], "same_on_all_ranks": same,
                        "max_abs_diff_vs_first_world": diff})
    print(table(["W", "N (all ranks)", "entries per rank", "forward: calls / bytes",
                 "backward: calls / bytes", "step: calls / bytes", "predicted fwd + bwd",
                 "= predicted", "socket bytes fwd + bwd (rank 0)",
                 f"max abs(out − out(W={cfg['bytes_worlds'][0]}))"], rows))
    report["bytes"] = raw


def part_memory(cfg: dict, report: dict) -> None:
    d, n = cfg["d"], cfg["mem_n"]
    print(f"\n## 2. Peak memory per rank (one GrowingSoftmax {d} → {d}, N = {n:,} entries "
          f"in all, float32), after one forward + backward + Grower.step\n")
    configs = [("1 process, no torch.distributed", 1, False)]
    configs += [(f"W = {w}, sharded", w, True) for w in cfg["mem_worlds"]]
    rows, raw, single = [], [], None
    for label, world, distributed in configs:
        results = spawn(memory_worker, world, d, n, distributed=distributed)
        if single is None:
            single = results[0]
        for rank, r in enumerate(results):
            grown = r["peak"] - r["baseline"]
            rows.append([label if rank == 0 else "", rank, f"{r['entries']:,}",
                         gb(r["store_nbytes"]), gb(r["baseline"]), gb(r["peak"]), gb(grown),
                         f"{r['peak'] / single['peak']:.3f}",
                         f"{grown / (single['peak'] - single['baseline']):.3f}",
                         f"{r['store_nbytes'] / single['store_nbytes']:.3f}"])
        raw.append({"label": label, "world": world, "ranks": results})
    print(table(["run", "rank", "entries", "store bytes", "RSS before store", "peak RSS",
                 "peak − before", "peak / 1-process peak", "(peak − before) / 1-process",
                 "store / 1-process store"], rows))
    report["memory"] = raw


def _median_spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})"


def part_time(cfg: dict, report: dict) -> None:
    d, n, warmup, steps = cfg["d"], cfg["time_n"], cfg["warmup"], cfg["steps"]
    print(f"\n## 3. Step time, gws net {d} → 2 blocks → {CLASSES} (3 GrowingSoftmax layers, "
          f"N = {n:,} entries per layer), B = {BATCH}\n")
    print(f"Seconds per step: median (min–max) of {steps} steps after {warmup} warm-up; "
          "the slowest rank's phases at each step. `in collectives` = time inside "
          "all_reduce (includes waiting for the other rank).\n")
    configs = [("1 process, 1 thread, unsharded", 1, False, 1),
               ("W = 1 sharded, 1 thread", 1, True, 1),
               ("W = 2 sharded, 1 thread per rank", 2, True, 1),
               ("1 process, 2 threads, unsharded", 1, False, 2)]
    rows, raw, medians, losses, alone_rows = [], [], {}, {}, []
    for label, world, distributed, threads in configs:
        results = spawn(time_worker, world, d, n, warmup, steps, threads,
                        cfg["collective_reps"], distributed=distributed)
        timed = [[res["records"][s] for res in results] for s in range(warmup, warmup + steps)]
        total = [max(r["total"] for r in recs) for recs in timed]  # the slowest rank
        fwd = [max(r["forward"] for r in recs) for recs in timed]
        bwd = [max(r["backward"] for r in recs) for recs in timed]
        grow = [max(r["step"] for r in recs) for recs in timed]
        if distributed:
            coll = [max(r["coll_s"] for r in recs) for recs in timed]
            coll_bytes = results[0]["records"][-1]["coll_bytes"]
            calls = results[0]["records"][-1]["coll_calls"]
            coll_txt = _median_spread(coll)
            share = f"{statistics.median(coll) / statistics.median(total):.1%}"
            wire = f"{calls} / {coll_bytes:,}"
        else:
            coll_txt, share, wire = "–", "–", "–"
        medians[label] = statistics.median(total)
        losses[label] = [r["loss"] for r in results[0]["records"]]
        rows.append([label, _median_spread(total), _median_spread(fwd), _median_spread(bwd),
                     _median_spread(grow), coll_txt, share, wire,
                     "/".join(f"{res['entries'][0]:,}" for res in results),
                     "/".join(gb(res["peak"]) for res in results)])
        if results[0]["alone"]:
            for size in sorted(results[0]["alone"], key=int):
                alone_rows.append([label, f"{int(size):,}",
                                   f"{max(res['alone'][size] for res in results) * 1e3:.3f}"])
        raw.append({"label": label, "world": world, "threads": threads, "ranks": results})
    print(table(["run", "step s", "forward s", "backward s", "Grower.step s",
                 "in collectives s", "collectives / step", "calls / payload bytes per step",
                 "entries per rank (layer 1)", "peak RSS per rank"], rows))
    ref = configs[0][0]
    print()
    for label in medians:
        print(f"- {label}: median step {medians[label]:.3f} s, ratio to '{ref}' = "
              f"{medians[label] / medians[ref]:.3f}")
    w1, w2 = configs[1][0], configs[2][0]
    print(f"- **ratio W = 2 / W = 1 (sharded, one thread per rank): "
          f"{medians[w2] / medians[w1]:.3f}**")
    diffs = {label: max(abs(a - b) / abs(b) for a, b in zip(ls, losses[ref], strict=True))
             for label, ls in losses.items()}
    print("- largest relative difference of the step losses from the single process: "
          + ", ".join(f"{label}: {v:.1e}" for label, v in diffs.items()))
    if alone_rows:
        print("\nThe same all_reduce calls alone (after a barrier), median of "
              f"{cfg['collective_reps']}, ms (slowest rank):\n")
        print(table(["run", "payload bytes", "ms"], alone_rows))
    report["time"] = {"runs": raw, "medians": medians, "loss_rel_diff": diffs}


def part_planning(cfg: dict, report: dict) -> None:
    from rcdl.distributed import world_bytes

    # per-entry bytes as measured (store.nbytes / entries) when the full d = 3072 ran,
    # otherwise from the formula (d_in + d_out + 1) · 4 + 8
    measured = {}
    for run in report.get("time", {}).get("runs", []):
        measured |= run["ranks"][0]["per_entry"]
    for row in report.get("memory", []):
        r = row["ranks"][0]
        measured.setdefault(f"{cfg['d']}->{cfg['d']}", r["store_nbytes"] / r["entries"])

    def per_entry(d_in: int, d_out: int) -> tuple[float, str]:
        key = f"{d_in}->{d_out}"
        if key in measured:
            return measured[key], "measured"
        return (d_in + d_out + 1) * 4 + 8, "formula"

    d = 3072
    cases = [
        ("CIFAR-10 gws (50 016 entries per layer)", 50_016, [(d, d), (d, d), (d, CLASSES)]),
        ("ImageNet-sized (1.28 M samples)", 1_280_000, [(d, d)] * 3),
        ("10 M samples", 10_000_000, [(d, d)] * 3),
    ]
    used = {f"{a}->{b}": per_entry(a, b) for _, _, layers in cases for a, b in layers}
    print(f"\n## 4. Planning (float32, B = {BATCH}; bytes per entry: "
          + ", ".join(f"{k}: {v:,.0f} B ({src})" for k, (v, src) in used.items()) + ")\n")
    print("Store per rank = total / W: the rows rotate over the ranks (sample i of step t → "
          "rank (t·B + i) mod W), so every rank fills evenly even when W > B. Payload per "
          "step = every layer's forward (world_bytes) + the query-gradient all_reduce of every "
          "layer but the first (its input needs no gradient), per rank, whatever N and W; a "
          "ring all_reduce sends 2(W − 1)/W times the payload per rank.\n")
    rows, raw = [], []
    for name, n, layers in cases:
        total = sum(n * per_entry(a, b)[0] for a, b in layers)
        payload = sum(world_bytes(BATCH, b) for _, b in layers)
        payload += sum(BATCH * a * 4 for a, _ in layers[1:])
        for w in (1, 8, 64):
            rows.append([name if w == 1 else "", f"{total / 1e9:,.2f} GB" if w == 1 else "",
                         w, f"{total / w / 1e9:,.2f} GB", f"{payload / 1e3:,.1f} kB",
                         f"{(2 * (w - 1) / w) * payload / 1e3:,.1f} kB"])
            raw.append({"case": name, "entries_per_layer": n, "total_bytes": total,
                        "world": w, "per_rank": total / w, "payload_per_step": payload,
                        "ring_bytes_sent_per_rank": 2 * (w - 1) / w * payload})
    print(table(["store", "total", "GPUs (W)", "store per rank", "payload per rank and step",
                 "ring bytes sent per rank and step"], rows))
    measured_step = [r["ranks"][0]["records"][-1]["coll_bytes"]
                     for r in report.get("time", {}).get("runs", []) if r["world"] > 1]
    if measured_step and cfg["d"] == d:
        cifar = next(r for r in raw if r["case"].startswith("CIFAR"))["payload_per_step"]
        print(f"\nPayload per step of the CIFAR-10 gws net measured in part 3: "
              f"{measured_step[0]:,} B; formula above: {cifar:,} B.")
    report["planning"] = raw


PARTS = {"bytes": part_bytes, "memory": part_memory, "time": part_time,
         "planning": part_planning}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS),
                        help="which parts to run (default: all, in this order)")
    parser.add_argument("--d", type=int, help="width d (default 3072; 256 with --quick)")
    parser.add_argument("--bytes-n", type=int, nargs="+", help="store sizes of part 1")
    parser.add_argument("--mem-n", type=int, help="entries in all of part 2's store")
    parser.add_argument("--time-n", type=int, help="entries per layer in part 3")
    parser.add_argument("--steps", type=int, help="timed steps in part 3")
    parser.add_argument("--warmup", type=int, help="warm-up steps in part 3")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    args = parser.parse_args()
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("d", "bytes_n", "mem_n", "time_n", "steps", "warmup"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    print("# bench_distributed: " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    print(f"# machine: {machine_line()}")
    print(f"# settings: {json.dumps(cfg)}")
    report: dict = {"machine": machine_line(), "argv": sys.argv[1:], "config": cfg}
    start = clock()
    for name in args.parts:
        PARTS[name](cfg, report)
        sys.stdout.flush()
    print(f"\n# done in {clock() - start:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
