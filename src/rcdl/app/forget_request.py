"""A deletion request against a run folder: ``rcdl forget RUN_DIR --samples IDS``
(docs/unlearning.md, "A deletion request").

The folder is one of ``rcdl reproduce cifar10-1epoch --keep-models`` (optionally with
``--replay-every N``): each finished growing model is kept as ``models/<model>-seed<s>.pt``
(its state, its learners' states, the training data's SHA-256) and its replay log as
``models/<model>-seed<s>.log.pt`` (:mod:`rcdl.app.experiments.cifar10`). A request

1. checks everything before it writes anything: the folder is a run of that experiment with
   kept models; the sample indices are integers in ``[0, n_train)``; every kept file reads
   back whole (checksummed, no code run) and fits the model the run's config builds; in
   ``repair`` mode the readout can be re-written; in ``exact`` mode each model has its log,
   and (``repair`` and ``exact``) the data found are the ones the run trained on (their
   SHA-256);
2. applies the request to each kept model in memory (``fast``: :func:`rcdl.forget`, told of
   the log; ``repair``: :func:`rcdl.forget_and_repair`; ``exact``:
   :func:`rcdl.train.unlearning.forget_exactly`, the model trained without the samples), so
   a refusal of the library's (an untold forget, a budget that merges) leaves every file as
   it was;
3. writes each edited model and log back atomically, as the run's newest saved model, and
   removes the files under ``checkpoints/`` of those models and every other file under
   ``checkpoints/`` that holds a forgotten key (training-time states, superseded);
4. scans the raw bytes of every file of the folder for each forgotten entry's key, as the
   store held it (its dtype's bytes), and appends a receipt (one JSON line) to
   ``forget_receipts.jsonl``: the mode, the samples, each model's
   :class:`~rcdl.memory.forgetting.ForgetReceipt`, the files touched with their new SHA-256
   (``None``: removed), the files scanned and any hit. ``clean`` is true only when no file
   and no model's memory scan holds a forgotten key.

Every refusal is a :class:`RequestRefused` (a ``ValueError``) whose message names the
problem and the file; nothing in the folder has changed then.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import mmap
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl._io import file_sha256
from rcdl.app.rundir import recorded_experiment

__all__ = ["MODES", "RECEIPTS", "RequestRefused", "RequestResult", "forget_request",
           "parse_samples", "scan_files"]

MODES = ("fast", "repair", "exact")
RECEIPTS = "forget_receipts.jsonl"  # in the run folder, one JSON line per request


class RequestRefused(ValueError):
    """A deletion request that cannot be carried out as given; nothing was changed."""


@dataclass
class _Kept:
    """One kept model of the run, loaded: its files, the model and learners, its log."""

    name: str
    seed: int
    file: Path
    log_file: Path | None
    saved: dict[str, Any]
    model: nn.Module
    optimizer: Any
    grower: Any
    log: Any = None  # a ReplayLog, or None

    @property
    def learners(self) -> list[Any]:
        return [x for x in (self.optimizer, self.grower) if x is not None]


@dataclass(frozen=True)
class FileScan:
    """What :func:`scan_files` read and found."""

    files: tuple[str, ...]  # scanned, relative to the folder
    bytes: int
    keys: int  # distinct key byte strings looked for
    hits: dict[str, int] = field(default_factory=dict)  # file → keys found in it
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.hits

    def to_json(self) -> dict[str, Any]:
        return {"files": list(self.files), "bytes_scanned": self.bytes,
                "keys_looked_for": self.keys, "hits": dict(self.hits), "clean": self.clean,
                "seconds": self.seconds}


@dataclass(frozen=True)
class RequestResult:
    """What :func:`forget_request` did: the receipt it appended (a dict) and where."""

    receipt: dict[str, Any]
    receipts_file: Path

    @property
    def clean(self) -> bool:
        return bool(self.receipt["clean"])

    def describe(self) -> str:
        """A few lines for the terminal."""
        r = self.receipt
        lines = [f"forgot {len(r['samples'])} samples ({r['mode']} mode) in "
                 f"{len(r['models'])} kept models:"]
        for m in r["models"]:
            removed = sum(m["receipt"]["removed"].values())
            lines.append(f"  {m['model']} seed {m['seed']}: {removed} entries removed")
        for f in r["files_touched"]:
            what = "removed" if f["sha256"] is None else f"rewritten, sha256 {f['sha256'][:16]}…"
            lines.append(f"  {f['path']}: {what}")
        scan = r["file_scan"]
        hits = ", ".join(f"{p} ({n} keys)" for p, n in scan["hits"].items())
        verdict = ("clean: no file holds a forgotten key" if r["clean"] else
                   f"NOT clean: {hits or 'a model still holds a forgotten key in memory'}")
        lines.append(f"scanned {len(scan['files'])} files ({scan['bytes_scanned']:,} bytes) "
                     f"for {scan['keys_looked_for']} keys: {verdict}")
        lines.append(f"receipt appended to {self.receipts_file}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- input


def parse_samples(text: str) -> list[int]:
    """The sample indices of ``--samples``: ``text`` itself (``3,17,42``) or, when it names
    an existing file, that file's content; indices are separated by commas or white space,
    ``#`` starts a comment. Returns them sorted, without repeats.

    Raises:
        RequestRefused: a word that is not an integer >= 0, or no index at all.
    """
    source = "--samples"
    path = Path(text).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise RequestRefused(f"cannot read the sample file {path}: {e}") from e
        source = f"the sample file {path}"
    words = [w for line in text.splitlines() for w in
             re.split(r"[,\s]+", line.split("#", 1)[0]) if w]
    bad = [w for w in words if not re.fullmatch(r"[0-9]+", w)]
    if bad:
        raise RequestRefused(f"{source} holds {bad[0]!r}, which is not a sample index (an "
                             "integer >= 0); give indices into the run's training set")
    if not words:
        raise RequestRefused(f"{source} names no sample")
    return sorted({int(w) for w in words})


def _n_train(run: Path, cfg: Any) -> int:
    """The number of training images of the run (its ``summary.json``, else its config)."""
    try:
        summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
        return int(summary["data"]["n_train"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if cfg.train_size is not None:
        return int(cfg.train_size)
    raise RequestRefused(f"{run} says nowhere how many training images the run had (its "
                         "summary.json is missing or unreadable)")


def _load_kept(run: Path, cfg: Any, name: str, seed: int, file: Path) -> _Kept:
    """Load ``file`` (and its log, if kept) into the model the run's config builds."""
    from rcdl.app.experiments.cifar10 import EXPERIMENT, MODEL_FORMAT, log_path
    from rcdl.app.models import build_model
    from rcdl.train.checkpoint import DamagedCheckpoint, load_checkpoint, load_model_state
    from rcdl.train.replay import ReplayLog

    try:
        saved = load_checkpoint(file)
    except DamagedCheckpoint as e:
        raise RequestRefused(f"{e}; nothing was changed") from e
    wanted = {"format": MODEL_FORMAT, "experiment": EXPERIMENT, "model": name, "seed": seed}
    if not isinstance(saved, dict) or any(saved.get(k) != v for k, v in wanted.items()) \
            or not {"state", "optimizer", "grower", "data_sha256"} <= set(saved):
        raise RequestRefused(f"{file} is not the kept model {name} seed {seed} of a "
                             f"{EXPERIMENT} run (expected a dict with {wanted} and its states)")
    model, optimizer, grower = build_model(name, seed, dtype=cfg.torch_dtype,
                                           store_dtype=cfg.torch_store_dtype)
    try:
        load_model_state(model, saved["state"])
        for learner, part in ((optimizer, "optimizer"), (grower, "grower")):
            if (learner is None) != (saved[part] is None):
                raise ValueError(f"the file's {part} part does not fit {name}'s learners")
            if learner is not None:
                learner.load_state_dict(saved[part])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise RequestRefused(f"{file} does not hold a state of the model {name} the run's "
                             f"config builds: {e}") from e
    log_file = log_path(run, name, seed)
    log = None
    if log_file.exists():
        try:
            log = ReplayLog.load(log_file)
        except DamagedCheckpoint as e:
            raise RequestRefused(f"{e}; nothing was changed") from e
    return _Kept(name, seed, file, log_file if log is not None else None, saved, model,
                 optimizer, grower, log)


def _load_data(cfg: Any, data_dir: str | None) -> tuple[Tensor, Tensor, str]:
    """The run's training inputs and labels as the experiment loads them, and their
    SHA-256 (:func:`rcdl.app.experiments.cifar10.data_digest`); never downloads."""
    from rcdl.app.cifar import CorruptDataError
    from rcdl.app.experiments.cifar10 import data_digest
    from rcdl.app.experiments.cifar10.config import load_data

    if data_dir is not None:
        cfg = dataclasses.replace(cfg, data_dir=data_dir)
    try:
        data = load_data(cfg, download=False)
    except (OSError, CorruptDataError, ValueError) as e:
        raise RequestRefused(f"cannot load the run's training data: {e}") from e
    x, y = data.x_train.to(cfg.torch_dtype), data.y_train
    return x, y, data_digest(x, y)


# --------------------------------------------------------------------------- the scan


def _forgotten_keys(kept: _Kept, ids: Tensor) -> list[bytes]:
    """The bytes of every stored key (its row as the store holds it) that the samples
    ``ids`` wrote in the kept model; all-zero rows are left out (spare capacity is zeros)."""
    from rcdl.memory.provenance import entry_samples
    from rcdl.nn.layers import growing_layers

    found = []
    for _, layer in growing_layers(kept.model):
        owners = entry_samples(layer)  # (N,)
        keys = layer.store.keys[torch.isin(owners, ids.to(owners.device))]  # (R, d_in)
        for row in keys.detach().cpu().contiguous():
            if bool(row.ne(0).any()):
                found.append(row.numpy().tobytes() if row.dtype != torch.bfloat16
                             else row.view(torch.int16).numpy().tobytes())
    return found


def _files(run: Path) -> list[Path]:
    return sorted(p for p in run.rglob("*") if p.is_file())


def _hits(path: Path, keys: Sequence[bytes]) -> int:
    """How many of ``keys`` occur in the raw bytes of the file ``path``."""
    if path.stat().st_size == 0:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return sum(data.find(key) >= 0 for key in keys)


def scan_files(run: Path, keys: Sequence[bytes]) -> FileScan:
    """Look for each of ``keys`` in the raw bytes of every file under ``run``."""
    start = time.perf_counter()
    keys = list(dict.fromkeys(keys))
    files, hits, nbytes = [], {}, 0
    for path in _files(run):
        rel = path.relative_to(run).as_posix()
        files.append(rel)
        nbytes += path.stat().st_size
        found = _hits(path, keys) if keys else 0
        if found:
            hits[rel] = found
    return FileScan(tuple(files), nbytes, len(keys), hits, time.perf_counter() - start)


# --------------------------------------------------------------------------- the request


def _apply(kept: _Kept, ids: Tensor, mode: str, data: tuple[Tensor, Tensor] | None) -> Any:
    """The request on one kept model, in memory; returns its ForgetReceipt."""
    from rcdl.memory.forgetting import forget
    from rcdl.memory.repair import forget_and_repair
    from rcdl.train.unlearning import forget_exactly

    if mode == "fast":
        return forget(kept.model, ids, learners=kept.learners, replay=kept.log)
    assert data is not None
    if mode == "repair":
        return forget_and_repair(kept.model, ids, labels=data[1], loss_fn=F.cross_entropy,
                                      learners=kept.learners)
    return forget_exactly(kept.model, ids, replay=kept.log, data=data, loss_fn=F.cross_entropy,
                          optimizer=kept.optimizer, grower=kept.grower)


def forget_request(run_dir: str | os.PathLike, samples: str | Sequence[int], *,
                   mode: str = "fast", model: str | None = None, seed: int | None = None,
                   data_dir: str | None = None) -> RequestResult:
    """Carry out a deletion request on the run folder ``run_dir`` (module docstring).

    Args:
        samples: the sample indices, or the text of ``--samples`` (:func:`parse_samples`).
        mode: ``"fast"``, ``"repair"`` or ``"exact"``.
        model, seed: only the kept models of this name / seed (``None``: every one).
        data_dir: where the run's data are (``repair``, ``exact``; default: the run's).

    Raises:
        RequestRefused: for bad input (module docstring); nothing was changed then.
    """
    from rcdl.app.experiments.cifar10 import EXPERIMENT, model_path, save_model
    from rcdl.app.experiments.cifar10.config import Cifar10Config
    from rcdl.app.models import model_spec
    from rcdl.app.rundir import read_config
    from rcdl.memory.repair import repair_refusal

    if mode not in MODES:
        raise RequestRefused(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    run = Path(run_dir).expanduser().resolve()
    if not run.is_dir():
        raise RequestRefused(f"{run} is not a run folder (no such folder)")
    experiment = recorded_experiment(run)
    if experiment != EXPERIMENT:
        what = "no environment.json naming its experiment" if experiment is None else \
            f"a run of {experiment}"
        raise RequestRefused(f"{run} holds {what}; rcdl forget edits the kept models of "
                             f"{EXPERIMENT} runs (rcdl reproduce {EXPERIMENT} --keep-models)")
    try:
        cfg = read_config(run, Cifar10Config)
    except (OSError, ValueError) as e:
        raise RequestRefused(str(e)) from e
    if model is not None and model not in cfg.models:
        raise RequestRefused(f"{run} trained no model {model!r} (its models: "
                             f"{', '.join(cfg.models)})")
    if seed is not None and seed not in cfg.seeds:
        raise RequestRefused(f"{run} trained no seed {seed} (its seeds: "
                             f"{', '.join(map(str, cfg.seeds))})")
    wanted = [(m, s) for m in cfg.models for s in cfg.seeds
              if model_spec(m).growing and model in (None, m) and seed in (None, s)
              and model_path(run, m, s).is_file()]
    if not wanted:
        which = "" if model is None and seed is None else " of the model and seed asked for"
        raise RequestRefused(f"{run} holds no kept model{which} under models/ (train with "
                             f"rcdl reproduce {EXPERIMENT} --keep-models; --replay-every N for "
                             "--mode exact)")
    ids_list = parse_samples(samples) if isinstance(samples, str) else sorted(set(samples))
    n_train = _n_train(run, cfg)
    outside = [i for i in ids_list if not 0 <= i < n_train]
    if outside:
        raise RequestRefused(f"sample indices {outside[:5]} are out of range: {run} trained on "
                             f"{n_train} images, indices 0 to {n_train - 1}")
    ids = torch.tensor(ids_list, dtype=torch.long)
    kept = [_load_kept(run, cfg, m, s, model_path(run, m, s)) for m, s in wanted]
    if mode == "exact":
        missing = [k.file.name for k in kept if k.log is None]
        if missing:
            raise RequestRefused(f"--mode exact replays each model's run from its replay log; "
                                 f"{run}/models holds none for {', '.join(missing)} (train "
                                 "with --keep-models --replay-every N, or use --mode fast)")
    if mode == "repair":
        for k in kept:
            refusal = repair_refusal(k.model)
            if refusal is not None:
                raise RequestRefused(f"--mode repair cannot repair {k.file.name}: {refusal} "
                                     "(use --mode fast or exact)")
    data = None
    if mode in ("repair", "exact"):
        x, y, digest = _load_data(cfg, data_dir)
        for k in kept:
            if k.saved["data_sha256"] != digest:
                raise RequestRefused(
                    f"the data found (data_dir {data_dir or cfg.data_dir}) do not match the "
                    f"data {k.file.name} was trained on (another SHA-256): give --data-dir the "
                    "folder the run was trained from")
        data = (x, y)
    keys = [key for k in kept for key in _forgotten_keys(k, ids)]
    receipts = []
    for k in kept:  # in memory only: a refusal here leaves every file as it was
        try:
            receipts.append(_apply(k, ids, mode, data))
        except (ValueError, TypeError) as e:
            raise RequestRefused(f"{k.file.name}: {e}; nothing was changed") from e
    stale = _stale_checkpoints(run, kept, keys)
    touched: list[dict[str, Any]] = []
    for k in kept:
        if k.log is not None and mode != "repair":  # repair does not go through the log
            assert k.log_file is not None
            k.log.save(k.log_file)
            touched.append({"path": _rel(run, k.log_file), "sha256": file_sha256(k.log_file),
                            "action": "rewritten"})
        save_model(k.file, k.name, k.seed, k.model, k.optimizer, k.grower,
                   k.saved["data_sha256"])
        touched.append({"path": _rel(run, k.file), "sha256": file_sha256(k.file),
                        "action": "rewritten"})
    for path in stale:
        path.unlink(missing_ok=True)
        touched.append({"path": _rel(run, path), "sha256": None, "action": "removed"})
    folder = run / "checkpoints"
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
    scan = scan_files(run, keys)
    models = []
    for k, receipt in zip(kept, receipts, strict=True):
        mine = [_rel(run, p) for p in stale if p.name.startswith(f"{k.name}-seed{k.seed}.")]
        receipt = dataclasses.replace(receipt, checkpoints=[*receipt.checkpoints, *mine])
        models.append({"model": k.name, "seed": k.seed, "receipt": receipt.to_json()})
    memory_clean = all(m["receipt"]["scan"] is None or m["receipt"]["scan"]["clean"]
                       for m in models)
    record = {"time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "mode": mode,
              "samples": ids_list, "models": models, "files_touched": touched,
              "file_scan": scan.to_json(), "clean": scan.clean and memory_clean}
    path = run / RECEIPTS
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return RequestResult(record, path)


def _rel(run: Path, path: Path) -> str:
    return path.relative_to(run).as_posix()


def _stem(path: Path) -> str | None:
    """``<model>-seed<s>`` of a checkpoint file (``cifar10._checkpoint_path``: its data files,
    manifest, lock and the temporaries of interrupted writes), else ``None``."""
    match = re.match(r"\.?(.+?-seed\d+)\.", path.name)
    return None if match is None else match.group(1)


def _stale_checkpoints(run: Path, kept: list[_Kept], keys: Sequence[bytes]) -> list[Path]:
    """The files under ``checkpoints/`` to remove: every file of the checkpoint of a kept
    model edited (its training-time states, the manifest and lock that commit them), of any
    other checkpoint one of whose files holds a forgotten key, and any other file holding
    one."""
    folder = run / "checkpoints"
    if not folder.is_dir():
        return []
    files = [p for p in sorted(folder.iterdir()) if p.is_file()]
    stems = {f"{k.name}-seed{k.seed}" for k in kept}
    holding = {p for p in files if keys and _hits(p, keys) > 0}
    stems |= {stem for p in holding if (stem := _stem(p)) is not None}
    return [p for p in files if p in holding or _stem(p) in stems]
