"""Training the one-epoch CIFAR-10 comparison (:mod:`rcdl.app.experiments.cifar10`): one
(model, seed) by :func:`rcdl.train.loop.train_one_pass` or a classical fit, the sub-runs in
order, and the files a run keeps beside its results (checkpoints, kept models and their
replay logs, :func:`save_model`)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rcdl.app import rundir
from rcdl.app.cifar import CifarData, cifar_summary
from rcdl.app.classical import fit_classical
from rcdl.app.experiments.cifar10.config import EXPERIMENT, METRICS, Cifar10Config
from rcdl.app.experiments.cifar10.report import model_rows
from rcdl.app.models import build_model, model_spec
from rcdl.app.rundir import RunDir
from rcdl.app.runner import Session
from rcdl.distributed import rank_and_world, shard
from rcdl.nn.hybrid import HybridSoftmax
from rcdl.ops.half import product_mode, product_path
from rcdl.train.checkpoint import remove_checkpoint, save_checkpoint
from rcdl.train.loop import train_one_pass
from rcdl.train.replay import ReplayLog

__all__ = ["MODEL_FORMAT", "add_rows", "data_digest", "log_path", "model_path", "result_name",
           "save_model", "start", "sub_runs"]

MODEL_FORMAT = 1  # the layout of a kept model's file (save_model)

# --------------------------------------------------------------------------- running


def _run_name(model: str, seed: int) -> str:
    return f"{model}-seed{seed}"


def result_name(result: Mapping[str, Any]) -> str:
    """The sub-run a result in ``summary.json`` belongs to (what a resumed run skips)."""
    return _run_name(result["model"], result["seed"])


def model_path(run: RunDir | Path, name: str, seed: int) -> Path:
    """``models/<model>-seed<s>.pt``, where the option ``keep_models`` keeps a finished
    growing model (its replay log beside it: :func:`log_path`)."""
    folder = run.file("models") if isinstance(run, RunDir) else Path(run) / "models"
    return folder / f"{_run_name(name, seed)}.pt"


def log_path(run: RunDir | Path, name: str, seed: int) -> Path:
    """``models/<model>-seed<s>.log.pt``, the kept model's replay log."""
    return model_path(run, name, seed).with_suffix(".log.pt")


def data_digest(x_train: torch.Tensor, y_train: torch.Tensor) -> str:
    """The SHA-256 of the training inputs' and labels' bytes, as trained on (dtype
    included): what tells ``rcdl forget`` that the data it is given are the run's."""
    digest = hashlib.sha256()
    for t in (x_train, y_train):
        digest.update(str(t.dtype).encode())
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def save_model(path: Path, name: str, seed: int, model: torch.nn.Module, optimizer: Any,
               grower: Any, data_sha256: str) -> str:
    """Write a trained model with its learners' states to ``path``
    (:func:`rcdl.train.checkpoint.save_checkpoint`: atomic, checksummed, read back without
    running code); returns the file's SHA-256. The file is a dict: ``format``
    (:data:`MODEL_FORMAT`), ``experiment``, ``model``, ``seed``, ``data_sha256``
    (:func:`data_digest`), ``state`` (the model's state dict), ``optimizer`` and ``grower``
    (their state dicts, or ``None``)."""
    return save_checkpoint({
        "format": MODEL_FORMAT, "experiment": EXPERIMENT, "model": name, "seed": seed,
        "data_sha256": data_sha256, "state": model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "grower": None if grower is None else grower.state_dict()}, path)


def _train(name: str, seed: int, cfg: Cifar10Config, data: tuple,
           session: Session) -> dict[str, Any]:  # fmt: skip
    """Train one (model, seed); returns its result (see ``train_one_pass``) plus identity.
    With the option ``keep_models`` a growing model is saved once trained (:func:`save_model`),
    and with ``replay_every`` it trains with a :class:`~rcdl.train.replay.ReplayLog` saved
    beside it. A :class:`~rcdl.app.experiments.cifar10.config.DiagnosticConfig` builds and
    trains it with its ``bf16_effect`` switched on (undone when it finishes) and, with
    ``entry_grads``, records its entry gradients under ``entry_grads/``."""
    if model_spec(name).classical:
        return _fit_classical(name, seed, cfg, data, session)
    if getattr(cfg, "bf16_effect", None) is None and not getattr(cfg, "entry_grads", False):
        return _train_by_passes(name, seed, cfg, data, session)
    # imported by the runs that ask for a diagnostic only (and so `python -m` runs the module
    # without the package having imported it first)
    from rcdl.app.experiments.cifar10.bf16_effects import bf16_effect, record_entry_grads

    with contextlib.ExitStack() as stack:
        notes = stack.enter_context(bf16_effect(getattr(cfg, "bf16_effect", None)))
        if getattr(cfg, "entry_grads", False):
            folder = session.run.file("entry_grads")
            folder.mkdir(exist_ok=True)
            stack.enter_context(record_entry_grads(folder / f"{_run_name(name, seed)}.jsonl"))
        result = _train_by_passes(name, seed, cfg, data, session)
    return {**result, "rounded_evaluations": notes} if notes else result


def _train_by_passes(name: str, seed: int, cfg: Cifar10Config, data: tuple,
                     session: Session) -> dict[str, Any]:  # fmt: skip
    """:func:`_train` for a model trained by passes (growing or parametric)."""
    world = rank_and_world()[1]
    model, optimizer, grower = build_model(name, seed, device=session.device,
                                           dtype=cfg.torch_dtype,
                                           reserve=math.ceil(len(data[0]) / world),
                                           store_dtype=cfg.torch_store_dtype)  # fmt: skip
    if world > 1:  # under torchrun every growing store is split over the ranks (start)
        shard(model)
    # every growing layer could write one entry per training sample
    possible = (None if grower is None else
                grower.num_entries_all_ranks() + len(grower.layers) * len(data[0]))
    checkpoint = _checkpoint_path(session.run, name, seed) if cfg.checkpoint else None
    keep = session.options.get("keep_models") and grower is not None
    every = session.options.get("replay_every")
    replay = ReplayLog(every=every) if keep and every is not None else None
    result = train_one_pass(
        model, data, batch_size=cfg.batch_size, seed=seed, optimizer=optimizer, grower=grower,
        loss_fn=F.cross_entropy, metrics=METRICS, eval_every=cfg.eval_every,
        eval_batch_size=cfg.eval_batch_size, device=session.device,
        run=session.log(model=name, seed=seed), name=_run_name(name, seed),
        progress=session.progress, checkpoint_path=checkpoint,
        checkpoint_every=cfg.checkpoint_every, incremental_eval=cfg.incremental_eval,
        replay=replay,
    )  # fmt: skip
    if keep:
        digest = data_digest(data[0], data[1])
        if replay is not None:  # the log first: a model file means its log is there too
            replay.save(log_path(session.run, name, seed))
        save_model(model_path(session.run, name, seed), name, seed, model, optimizer, grower,
                   digest)
    parameters = sum(p.numel() for p in model.parameters())
    growth = grower.growth if grower else {}  # written / refused per hybrid layer
    layer_stats = {layer.name: {**growth[layer.name].state_dict(), **layer.stats()}
                   for layer in (grower.layers if grower else [])
                   if isinstance(layer, HybridSoftmax)}
    return {"model": name, "seed": seed, "parameters": parameters,
            "possible_entries": possible, **result,
            **({"layer_stats": layer_stats} if layer_stats else {})}


def _checkpoint_path(run: RunDir, name: str, seed: int) -> Path:
    """``checkpoints/<model>-seed<s>.pt``, the checkpoint's path: its files are
    ``<model>-seed<s>.step<N>.pt`` (under torchrun ``...rank<r>of<W>.step<N>.pt``) and the
    manifest ``<model>-seed<s>.manifest.json`` that commits them
    (:class:`rcdl.train.checkpoint.Checkpointer`, which refuses another number of ranks)."""
    return run.file("checkpoints") / f"{_run_name(name, seed)}.pt"


def _remove_checkpoint(run: RunDir, name: str, seed: int) -> None:
    """Delete the checkpoint of a finished (model, seed): this rank's files and, on rank 0,
    the manifest."""
    remove_checkpoint(_checkpoint_path(run, name, seed))


def _fit_classical(name: str, seed: int, cfg: Cifar10Config, data: tuple,
                   session: Session) -> dict[str, Any]:  # fmt: skip
    """Fit a classical baseline on the whole training set; its one evaluation is logged at
    the step count of the one-epoch models, so it sits at the end of their curves."""
    x_train, y_train, x_test, y_test = (t.cpu() for t in data)
    print(f"{_run_name(name, seed)}: fitting {model_spec(name).label} on {len(x_train):,} "
          "images (no progress bar)")
    fitted = fit_classical(name, x_train, y_train, x_test, y_test, seed=seed)
    steps, n = math.ceil(len(x_train) / cfg.batch_size), len(x_train)
    evaluation = {"step": steps, "samples": n, "test_acc": fitted.test_acc, "test_loss": None}
    nbytes = None if fitted.entries is None else x_train.nbytes + y_train.nbytes
    session.log(model=name, seed=seed).log(evaluation, entries=fitted.entries, bytes=nbytes,
                                           train_seconds=fitted.fit_seconds,
                                           eval_seconds=fitted.predict_seconds)  # fmt: skip
    return {"model": name, "seed": seed, "parameters": 0, "possible_entries": None,
            "test_acc": fitted.test_acc, "test_loss": None, "train_loss": None,
            "entries": fitted.entries, "bytes": nbytes, "steps": steps, "samples": n,
            "train_seconds": fitted.fit_seconds, "eval_seconds": fitted.predict_seconds,
            "history": [evaluation], "resumed": False, "settings": fitted.settings}


def _note_if_bfloat16_is_emulated() -> None:
    """Say which product path a bfloat16 store takes on this CPU (rcdl.ops.half,
    docs/precision.md)."""
    if not rundir.native_bfloat16():
        path = product_path(torch.bfloat16, "cpu")
        print(f"note: this CPU has neither avx512_bf16 nor AMX, so bfloat16 products are not "
              f"native; product mode {product_mode()!r}: the stores' products take the path "
              f"{path!r} (half the memory; RCDL_HALF_PRODUCTS=native multiplies in bfloat16 all "
              "the same; docs/precision.md compares the paths' speeds on such CPUs)",
              file=sys.stderr)


def _note_if_hybrid_in_half(models: Sequence[str], store_dtype: str | None) -> None:
    """Say that a hybrid trained in a half-precision store scores below float32, and what
    to do instead (results/speed/LOG.md, "The hybrid's accuracy with a bfloat16 store")."""
    if store_dtype in ("bfloat16", "float16") and "hybrid" in models:
        print(f"note: the hybrid trained in a {store_dtype} store scores below float32 "
              "(its training is hurt by entries read at half precision, however they are "
              "rounded); where its accuracy must match, train it with --store-dtype float32 "
              "and convert the trained model (rcdl.set_store_dtype), which costs nothing "
              "measurable (docs/precision.md, \"The hybrid's accuracy with a bfloat16 "
              "store\")", file=sys.stderr)


def sub_runs(cfg: Cifar10Config, data: CifarData, session: Session) -> Iterator:
    """Every model for every seed (models outer), on the same tensors (moved to a CUDA
    device once). A model's checkpoint is deleted once its result is saved (unless the
    option ``keep_checkpoints``), and an emptied ``checkpoints/`` at the end."""
    tensors = tuple(t.to(session.device) if session.device.type == "cuda" else t for t in
                    (data.x_train.to(cfg.torch_dtype), data.y_train,
                     data.x_test.to(cfg.torch_dtype), data.y_test))  # fmt: skip
    keep = session.options.get("keep_checkpoints", False)
    if session.options.get("replay_every") is not None and not session.options.get("keep_models"):
        raise ValueError("--replay-every records a replay log for the kept models; give "
                         "--keep-models too")
    if session.options.get("keep_models") and rank_and_world()[1] > 1:
        raise ValueError("--keep-models saves each model from one process; under torchrun "
                         "the stores are sharded over the ranks: run without torchrun")
    if cfg.store_dtype == "bfloat16" and session.device.type == "cpu" and rank_and_world()[0] == 0:
        _note_if_bfloat16_is_emulated()
    if rank_and_world()[0] == 0:
        _note_if_hybrid_in_half(cfg.models, cfg.store_dtype)
    for name in cfg.models:
        for seed in cfg.seeds:
            yield _run_name(name, seed), partial(_train, name, seed, cfg, tensors, session)
            if not keep and not model_spec(name).classical:  # its result is saved by now
                _remove_checkpoint(session.run, name, seed)
    folder = session.run.file("checkpoints")
    if folder.is_dir() and not any(folder.iterdir()):
        with contextlib.suppress(OSError):  # under torchrun another rank may remove it first
            folder.rmdir()


def start(cfg: Cifar10Config, data: CifarData) -> dict[str, Any]:
    """The data's description; under ``torchrun``, models without growing stores (nothing
    to shard) are refused before the run folder is made."""
    world = rank_and_world()[1]
    flat = [m for m in cfg.models if not model_spec(m).growing]
    if world > 1 and flat:
        raise ValueError(f"under torchrun the growing models' stores are sharded over the "
                         f"{world} ranks; {', '.join(flat)} have no growing stores: run "
                         "them without torchrun")
    return cifar_summary(cfg, data)


def add_rows(cfg: Cifar10Config, summary: dict[str, Any]) -> None:
    summary["models"] = model_rows(summary["runs"], cfg.models)
