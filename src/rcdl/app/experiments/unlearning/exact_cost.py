"""The exact-cost study: what exact forgetting costs against retraining, and that it is
retraining (docs/unlearning.md).

For each growing model and seed, one sub-run trains the model one pass with a replay log
(:class:`rcdl.train.replay.ReplayLog`, a snapshot every ``replay_every`` steps), then, each
time from a copy of the trained state, forgets exactly
(:func:`rcdl.train.unlearning.forget_exactly`, without the scan for left-over keys):

- a random ``forget_fraction`` of the stream (positions drawn from ``1 + seed``), its most
  recent ``forget_fraction``, and every image of ``forget_class``: for each, the model is
  also retrained on the stream without them, and the run checks that the exactly forgotten
  model predicts the test images as the retrained one does, bit for bit;
- one image at each of ``exact_positions`` evenly spaced positions of the stream: the cost
  against the position of the earliest forgotten sample.

Writes ``exact_forgetting.json`` and ``exact_forgetting.png`` (the cost over the training
time against the earliest position, beside ``1 − p²``, what a replay from position ``p``
costs when a step's cost grows with the store) into the run folder.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rcdl.app.cifar import CifarData
from rcdl.app.experiments.unlearning.config import UnlearningConfig, study_runs
from rcdl.app.experiments.unlearning.run import train
from rcdl.app.recipes import copy_trained
from rcdl.app.report import markdown_table
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.app.runner import Session
from rcdl.train.loop import predict
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import forget_exactly, stream_without

__all__ = ["STUDY", "exact_cost", "report", "sub_runs"]

STUDY = "exact-cost"


def _percent(share: float) -> str:
    return f"{100 * share:g} %"


def requests(cfg: UnlearningConfig, stream: torch.Tensor, y: torch.Tensor,
             seed: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """The forget requests, by label: the three that are also retrained, then the single
    images (``stream`` the training order, ``(n,)``)."""
    n = len(stream)
    size = max(1, round(cfg.forget_fraction * n))
    gen = torch.Generator().manual_seed(1 + seed)
    out = {
        f"random {_percent(cfg.forget_fraction)}": stream[torch.randperm(n, generator=gen)[:size]],
        f"most recent {_percent(cfg.forget_fraction)}": stream[-size:],
        f"one class ({cfg.forget_class})": (y == cfg.forget_class).nonzero().flatten(),
    }  # fmt: skip
    positions = cfg.exact_positions
    return out | {f"one image at {p / positions:.0%}": stream[[p * n // positions]]
                  for p in range(positions)}


def exact_cost(name: str, seed: int, data: CifarData, cfg: UnlearningConfig,
               session: Session) -> dict[str, Any]:  # fmt: skip
    """One sub-run (the module docstring); a JSON-able result."""
    device = session.device
    x, y = data.x_train, data.y_train
    log = ReplayLog(every=cfg.replay_every)
    model, optimizer, grower, train_seconds = train(name, seed, x, y, cfg, session, replay=log)
    stream = log.stream
    out: dict[str, Any] = {"study": STUDY, "model": name, "seed": seed,
                           "train_seconds": train_seconds, "log_bytes": log.nbytes,
                           "snapshots": len(log.snapshots), "requests": {}}
    for label, gone in requests(cfg, stream, y, seed).items():
        copied, optimizer_, grower_ = copy_trained(name, seed, (model, optimizer, grower),
                                                   reserve=len(x), device=device)
        position = int(torch.isin(stream, gone).nonzero()[0])
        start = time.perf_counter()
        receipt = forget_exactly(copied, gone, replay=copy.deepcopy(log), data=(x, y),
                                 loss_fn=F.cross_entropy, optimizer=optimizer_, grower=grower_,
                                 device=device, scan=False)
        row: dict[str, Any] = {"samples": len(gone), "earliest_position": position,
                               "exact_seconds": time.perf_counter() - start,
                               "replayed": next(iter(receipt.released.values()))[0]}
        if not label.startswith("one image"):
            retrained, _, _, retrain_seconds = train(name, seed, x, y, cfg, session,
                                                     order=stream_without(log, gone))
            same = torch.equal(*(predict(m, data.x_test, batch_size=cfg.eval_batch_size,
                                         device=device) for m in (copied, retrained)))
            row |= {"retrain_seconds": retrain_seconds, "same_predictions": bool(same)}
        out["requests"][label] = row
    return out


def sub_runs(cfg: UnlearningConfig, data: CifarData, session: Session) -> Iterator:
    """``exact-cost-<model>-seed<k>`` for each growing model (seeds outer)."""
    for key, name, seed in study_runs(STUDY, cfg):
        yield key, partial(exact_cost, name, seed, data, cfg, session)


def report(run: RunDir, cfg: UnlearningConfig, runs: list[dict[str, Any]],
           summary: dict[str, Any], device: torch.device) -> str:  # fmt: skip
    """Write ``exact_forgetting.json`` and ``exact_forgetting.png``; return the markdown
    section: one table per (model, seed)."""
    n = summary["data"]["n_train"]
    report_ = {"machine": describe_machine(device), "train_size": n,
               "every": cfg.replay_every, "positions": cfg.exact_positions, "runs": runs}
    run.write_json("exact_forgetting.json", report_)
    plot(report_, run.file("exact_forgetting.png"))
    parts = [f"## The cost of exact forgetting against retraining\n\n{n:,} training images, "
             f"one pass, a snapshot every {cfg.replay_every} step(s); each request from a copy "
             "of the trained model (`exact_forgetting.json`, `exact_forgetting.png`)."]
    for r in runs:
        body = []
        for label, q in r["requests"].items():
            retrain = q.get("retrain_seconds")
            body.append((label, q["samples"], q["earliest_position"],
                         f"{q['exact_seconds']:.1f}",
                         "" if retrain is None else f"{retrain:.1f}",
                         "" if retrain is None else f"{q['exact_seconds'] / retrain:.2f}",
                         "" if retrain is None else str(q["same_predictions"])))
        parts.append(f"### {r['model']}, seed {r['seed']}: training "
                     f"{r['train_seconds']:.1f} s, replay log {r['log_bytes'] / 1e6:.2f} MB in "
                     f"{r['snapshots']} snapshots\n\n" + markdown_table(
                         ("request", "samples", "earliest position", "exact s", "retrain s",
                          "exact / retrain", "same predictions"), body, "lrrrrrl"))
    same = [q["same_predictions"] for r in runs for q in r["requests"].values()
            if "same_predictions" in q]
    parts.append(f"Exact forgetting predicted the test images bit for bit as retraining did "
                 f"in {sum(same)} of {len(same)} requests.")
    return "\n\n".join(parts)


def plot(report_: dict[str, Any], path: Path) -> None:
    """Exact forgetting's seconds over the training seconds, against the earliest forgotten
    sample's position in the stream, per (model, seed), with the curve 1 − p²."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    p = torch.linspace(0, 1, 101)
    ax.plot(p, 1 - p**2, color="black", lw=0.8, ls=":", label="1 − p² (replay from p)")
    markers = {"random": "s", "most recent": "^", "one class": "D"}
    colours = {name: f"C{i}" for i, name in
               enumerate(dict.fromkeys(r["model"] for r in report_["runs"]))}
    n = report_["train_size"]
    for i, r in enumerate(report_["runs"]):
        train_s, colour = r["train_seconds"], colours[r["model"]]
        single = sorted((q["earliest_position"] / n, q["exact_seconds"] / train_s)
                        for label, q in r["requests"].items() if label.startswith("one image"))
        ax.plot([s[0] for s in single], [s[1] for s in single], "o-", color=colour,
                label=f"{r['model']}, seed {r['seed']}: one image")
        for label, q in r["requests"].items():
            marker = next((m for k, m in markers.items() if label.startswith(k)), None)
            if marker is not None:
                ax.plot(q["earliest_position"] / n, q["exact_seconds"] / train_s, marker,
                        color=colour, mfc="none", ms=9, label=label if i == 0 else None)
    ax.set_xlabel("earliest forgotten sample's position in the stream (share)")
    ax.set_ylabel("exact forgetting / training time")
    ax.set_title(f"Exact forgetting's cost, {n} CIFAR-10 images", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
