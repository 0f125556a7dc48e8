"""The forget-command study: ``rcdl forget --mode exact`` on a kept one-epoch run, in a new
process, against retraining in this one (docs/unlearning.md, "A deletion request").

For each growing model and seed, one sub-run:

1. runs ``rcdl reproduce cifar10-1epoch --models NAME --seeds K --keep-models
   --replay-every K`` in a new process, on the experiment's training and test subsets (same
   sizes and data seed), into ``forget-command/<model>-seed<k>/`` of the run folder;
2. forgets three training samples exactly with ``rcdl forget RUN --mode exact`` in another
   new process: ``e``, ``N/2`` and ``N − e`` with ``e = min(100, N // 3)`` for ``N``
   training images (100, 2 500 and 4 900 of 5 000);
3. retrains the model in this process on the kept run's stream without those samples
   (``train_one_pass(..., order=stream_without(log, samples))``, under the run's
   half-precision product path) and compares the two models' test outputs, bit for bit.

Both processes run on the CPU with this process's thread count. The kept run's folder is
removed once measured (its model file holds every store whole: its size at 5 000 images is
in results/unlearning/forget-command/); its file sizes, the receipt and the times are in the
result and in ``forget_command.json``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from rcdl.app.cifar import CifarData
from rcdl.app.experiments.cifar10.config import Cifar10Config
from rcdl.app.experiments.cifar10.config import load_data as load_kept_data
from rcdl.app.experiments.unlearning.config import UnlearningConfig, study_runs
from rcdl.app.models import build_model
from rcdl.app.report import markdown_table
from rcdl.app.rundir import RunDir, read_config
from rcdl.app.runner import Session
from rcdl.ops.half import products_as
from rcdl.train.checkpoint import load_checkpoint, load_model_state
from rcdl.train.loop import train_one_pass
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import stream_without

__all__ = ["STUDY", "forget_command", "forgotten_samples", "report", "sub_runs"]

STUDY = "forget-command"


def forgotten_samples(n: int) -> list[int]:
    """The three training samples forgotten out of ``n``: near the start, the middle and
    the end of the training set (indices, not stream positions)."""
    edge = min(100, n // 3)
    return [edge, n // 2, n - edge]


def _rcdl(*args: str) -> subprocess.CompletedProcess:
    """``rcdl ARGS`` in a new process, its output captured; a failure raises, with it."""
    done = subprocess.run([sys.executable, "-m", "rcdl", *args], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"forget-command: `rcdl {' '.join(args)}` exited "
                           f"{done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def forget_command(name: str, seed: int, data: CifarData, cfg: UnlearningConfig,
                   session: Session) -> dict[str, Any]:  # fmt: skip
    """One sub-run (the module docstring); a JSON-able result."""
    kept = session.run.path / STUDY / f"{name}-seed{seed}"
    shutil.rmtree(kept, ignore_errors=True)  # an interrupted try's
    n = len(data.y_train)
    samples = forgotten_samples(n)
    threads = str(torch.get_num_threads())
    where = [] if cfg.data_dir is None else ["--data-dir", cfg.data_dir]
    start = time.perf_counter()
    _rcdl("reproduce", "cifar10-1epoch", "--models", name, "--seeds", str(seed),
          "--train-size", str(n), "--test-size", str(len(data.y_test)), "--data-seed",
          str(cfg.data_seed), "--batch-size", str(cfg.batch_size), "--keep-models",
          "--replay-every", str(cfg.replay_every), "--device", "cpu", "--out", str(kept),
          "--no-progress", "--no-download", "--threads", threads, *where)
    train_seconds = time.perf_counter() - start
    models = kept / "models"
    before = ReplayLog.load(models / f"{name}-seed{seed}.log.pt")
    files = {p.name: p.stat().st_size for p in sorted(models.iterdir())}
    start = time.perf_counter()
    _rcdl("forget", str(kept), "--samples", ",".join(map(str, samples)), "--mode", "exact",
          "--threads", threads, *where)
    forget_seconds = time.perf_counter() - start
    receipt = json.loads((kept / "forget_receipts.jsonl").read_text().splitlines()[-1])
    kept_cfg = read_config(kept, Cifar10Config)
    kept_data = load_kept_data(kept_cfg, download=False)
    x, y = kept_data.x_train.float(), kept_data.y_train
    xt, yt = kept_data.x_test.float(), kept_data.y_test
    model, _, _ = build_model(name, seed, dtype=kept_cfg.torch_dtype)
    load_model_state(model, load_checkpoint(models / f"{name}-seed{seed}.pt")["state"])
    retrained, optimizer, grower = build_model(name, seed, dtype=kept_cfg.torch_dtype)
    start = time.perf_counter()
    with products_as(before.products):  # the run's product path
        train_one_pass(retrained, (x, y, xt, yt), batch_size=kept_cfg.batch_size, seed=seed,
                       optimizer=optimizer, grower=grower, loss_fn=F.cross_entropy,
                       eval_every=10**6, progress=False, order=stream_without(before, samples))
    retrain_seconds = time.perf_counter() - start
    model.eval()
    retrained.eval()
    with torch.no_grad():
        a, b = model(xt), retrained(xt)  # (T, 10)
    shutil.rmtree(kept)
    return {"study": STUDY, "model": name, "seed": seed, "samples": samples,
            "kept_files": files, "snapshots": len(before.snapshots),
            "train_seconds": train_seconds, "forget_seconds": forget_seconds,
            "retrain_seconds": retrain_seconds, "same_outputs": bool(torch.equal(a, b)),
            "largest_difference": (a - b).abs().max().item(),
            "test_acc": 100 * (a.argmax(1) == yt).float().mean().item(),
            "receipt": {k: receipt[k] for k in ("mode", "samples", "clean")}}


def sub_runs(cfg: UnlearningConfig, data: CifarData, session: Session) -> Iterator:
    """``forget-command-<model>-seed<k>`` for each growing model (seeds outer)."""
    for key, name, seed in study_runs(STUDY, cfg):
        yield key, partial(forget_command, name, seed, data, cfg, session)


def report(run: RunDir, cfg: UnlearningConfig, runs: list[dict[str, Any]],
           summary: dict[str, Any], device: torch.device) -> str:  # fmt: skip
    """Write ``forget_command.json``; return the markdown section."""
    run.write_json("forget_command.json", {"runs": runs})
    body = [(r["model"], r["seed"], ", ".join(map(str, r["samples"])),
             ", ".join(f"{k} {v:,}" for k, v in r["kept_files"].items()), r["snapshots"],
             f"{r['train_seconds']:.1f}", f"{r['forget_seconds']:.1f}",
             f"{r['retrain_seconds']:.1f}", str(r["same_outputs"]),
             f"{r['largest_difference']:.3g}", f"{r['test_acc']:.2f}",
             str(r["receipt"]["clean"])) for r in runs]
    return ("## `rcdl forget --mode exact` in a new process against retraining\n\n"
            "Each model kept by `rcdl reproduce cifar10-1epoch --keep-models --replay-every "
            f"{cfg.replay_every}`, then `rcdl forget RUN --mode exact` in a new process; "
            "retrained here on the run's stream without the samples "
            "(`forget_command.json`). Seconds: the training process (with keeping), the "
            "forget process, the retraining.\n\n" + markdown_table(
                ("model", "seed", "samples", "kept files (bytes)", "snapshots", "train s",
                 "forget s", "retrain s", "bit-identical", "largest difference",
                 "test acc %", "scan clean"), body, "lrlrrrrrlrrl"))
