"""What a saved replay log costs on disk, on CIFAR-10 (docs/unlearning.md, "What a snapshot
costs").

For each model of the one-epoch comparison (gws, RBF, the gated hybrid): trains it one pass
(batch 16, model seed 0, as ``rcdl reproduce cifar10-1epoch`` does) over the first
``--images`` images of the stored training split with a replay log
(`rcdl.train.replay.ReplayLog`, a snapshot every ``--every`` steps and at step 0), saves
the log (`ReplayLog.save`) and the model's own state (`save_checkpoint` of its state dict
and its grower's) to temporary files, and reports their sizes: the log file, the same log
saved without its snapshots (the stream and the other fields), the file bytes per snapshot
(their difference over the snapshots), the largest snapshot's tensors, the model's state
and the optimizer's (the hybrid's Adam moments). Then forgets one sample from the middle of
the stream exactly (`rcdl.train.unlearning.forget_exactly`, without the scan for left-over
keys) and reports the steps replayed and the seconds. Prints the machine and two markdown
tables (sizes, forgetting); with --out, also writes the rows as JSON:

    python benchmarks/replay_log_size.py --data-dir ../shared/data --images 5000 \\
        --models gws rbf hybrid --every 1 1 100

The hybrid's snapshots copy its stores and Adam moments whole (2–3 MB more each training
step on CIFAR-10), so ``--every`` sets its log's size: pick it from that before running
(``--every`` takes one value for all models, or one per model).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rcdl.app.allocator import keep_freed_memory
from rcdl.app.experiments.cifar10.config import Cifar10Config, load_data
from rcdl.app.recipes import train_with_learners
from rcdl.app.rundir import cpu_flags, cpu_model
from rcdl.train.checkpoint import save_checkpoint
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly


def machine_line() -> str:
    return (f"{cpu_model()}, {os.cpu_count()} CPUs, flags {' '.join(cpu_flags()) or '?'}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def file_bytes(obj: object, folder: str, name: str) -> tuple[int, float]:
    """``(bytes, seconds)`` of ``save_checkpoint(obj)`` to a file in ``folder``, removed
    afterwards."""
    path = os.path.join(folder, name)
    start = time.perf_counter()
    save_checkpoint(obj, path)
    seconds = time.perf_counter() - start
    size = os.path.getsize(path)
    os.remove(path)
    return size, seconds


def measure(name: str, data: tuple, every: int, folder: str) -> dict:
    """Train ``name`` with a replay log, save it and the model, forget one sample exactly."""
    x, y = data[0], data[1]
    log = ReplayLog(every=every)
    model, optimizer, grower, result = train_with_learners(name, 0, x, y, (data[2], data[3]),
                                                           replay=log)
    row = {"model": name, "images": len(x), "every": every, "snapshots": len(log.snapshots),
           "train_seconds": result["train_seconds"], "log_tensor_bytes": log.nbytes,
           "largest_snapshot_tensor_bytes": max(s.nbytes for s in log.snapshots.values())}
    path = os.path.join(folder, f"{name}.log.pt")
    start = time.perf_counter()
    log.save(path)
    row["save_seconds"] = time.perf_counter() - start
    row["log_file_bytes"] = os.path.getsize(path)
    start = time.perf_counter()
    loaded = ReplayLog.load(path)
    row["load_seconds"] = time.perf_counter() - start
    assert sorted(loaded.snapshots) == sorted(log.snapshots)
    del loaded
    os.remove(path)
    row["stream_file_bytes"] = file_bytes(log.state_dict() | {"snapshots": {}}, folder,
                                          f"{name}.stream.pt")[0]
    row["bytes_per_snapshot"] = ((row["log_file_bytes"] - row["stream_file_bytes"])
                                 / row["snapshots"])
    state = {"model": model.state_dict(), "grower": grower.state_dict()}
    row["model_state_bytes"] = file_bytes(state, folder, f"{name}.pt")[0]
    row["optimizer_state_bytes"] = (None if optimizer is None else
                                    file_bytes(optimizer.state_dict(), folder, f"{name}.opt.pt")[0])
    row["entries"] = {layer.name: len(layer.store) for layer in grower.layers}
    # one sample from the middle of the stream, forgotten exactly
    stream = log.stream
    position = len(stream) // 2
    sample = int(stream[position])
    first = position // log.batch_size
    restored = max(s for s in log.snapshots if s <= first)
    start = time.perf_counter()
    receipt = forget_exactly(model, [sample], replay=log, data=(x, y), loss_fn=F.cross_entropy,
                             optimizer=optimizer, grower=grower, scan=False)
    row["forget"] = {"sample": sample, "position": position, "restored_step": restored,
                     "receipt": next(iter(receipt.released.values()))[0],
                     "seconds": time.perf_counter() - start}
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | images | every | snapshots | log file bytes | without snapshots | "
             "bytes per snapshot | largest snapshot (tensors) | model state bytes | "
             "optimizer state bytes | training s | save s | load s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        opt = "—" if r["optimizer_state_bytes"] is None else f"{r['optimizer_state_bytes']:,}"
        lines.append(
            f"| {r['model']} | {r['images']:,} | {r['every']} | {r['snapshots']} | "
            f"{r['log_file_bytes']:,} | {r['stream_file_bytes']:,} | "
            f"{r['bytes_per_snapshot']:,.0f} | {r['largest_snapshot_tensor_bytes']:,} | "
            f"{r['model_state_bytes']:,} | {opt} | {r['train_seconds']:.1f} | "
            f"{r['save_seconds']:.1f} | {r['load_seconds']:.1f} |")
    lines += ["", "| model | forgotten sample (stream position) | replay | seconds |",
              "|---|---|---|---:|"]
    for r in rows:
        f = r["forget"]
        lines.append(f"| {r['model']} | {f['sample']} ({f['position']}) | {f['receipt']} | "
                     f"{f['seconds']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--test-images", type=int, default=500,
                        help="leading test images loaded (the loop scores them once, at the end; "
                        "the sizes do not depend on them)")
    parser.add_argument("--models", nargs="+", default=["gws", "rbf", "hybrid"])
    parser.add_argument("--every", type=int, nargs="+", default=[1],
                        help="snapshot interval: one for all models, or one per model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tmp-dir", default=None, help="where the files are written (and "
                        "removed); default: the system's temporary folder")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder for replay_log_size.json (default: stdout only)")
    args = parser.parse_args()
    if len(args.every) not in (1, len(args.models)):
        parser.error(f"--every takes one value or one per model ({len(args.models)}), "
                     f"got {len(args.every)}")
    everies = args.every * len(args.models) if len(args.every) == 1 else args.every
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    # the whole split in its stored order (the one-epoch protocol's), then its leading rows
    cfg = Cifar10Config(models=tuple(args.models), train_size=None, test_size=None,
                        data_dir=args.data_dir, device="cpu")
    d = load_data(cfg, download=False)
    data = (d.x_train[: args.images].clone(), d.y_train[: args.images].clone(),
            d.x_test[: args.test_images].clone(), d.y_test[: args.test_images].clone())
    del d
    print(f"# {machine_line()}")
    print(f"# CIFAR-10 (JPEG-decoded copy), first {args.images} training images, batch 16, "
          "one pass\n", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as folder:
        for name, every in zip(args.models, everies, strict=True):
            rows.append(measure(name, data, every, folder))
            print(f"# {name} done", flush=True)
    print(table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"machine": machine_line(), "images": args.images, "rows": rows}
        (args.out / "replay_log_size.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
