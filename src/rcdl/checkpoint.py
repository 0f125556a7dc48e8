"""Checkpoints that say when they are damaged, and survive a kill at any moment.

**Checksummed files.** :func:`save_checkpoint` writes ``torch.save(obj)`` behind a 40-byte
header, the magic ``RCDLCKP1`` and the SHA-256 of what follows, through the atomic write
of :mod:`rcdl._io` (a temporary file, fsynced, renamed into place). :func:`load_checkpoint`
verifies the digest before ``torch.load`` sees a byte: a flipped, cut or emptied file is
refused with :class:`DamagedCheckpoint`, naming the file and what is wrong, instead of
loading a wrong model (torch checks no checksum itself). Hashing costs one pass over the
bytes at save and at load.

**A training checkpoint** (:class:`Checkpointer`) is a set of such files and a manifest,
``<stem>.manifest.json`` beside ``<stem><suffix>``, the path it is given:

- each save writes its data under a new name tagged with the step,
  ``<stem>.step<N><suffix>`` (sharded: ``<stem>.rank<r>of<W>.step<N><suffix>`` per rank),
  then commits it by rewriting the manifest, which lists the newest ``keep`` (2)
  checkpoints with every rank's file and digest; only then are older files deleted. Under
  ``torch.distributed`` the commit is two-phase: every rank's file is written and its
  digest gathered, rank 0 writes the manifest, and a barrier passes before any rank deletes
  an older file. A kill at any moment leaves the last committed checkpoint whole, in every
  rank's files;
- a restore takes the newest checkpoint of the manifest whose files every rank can read and
  verify (one small ``all_gather`` of yes/no decides, so all ranks take the same one), and
  says on stderr which it skipped and why; with none usable it says so and the run
  starts afresh. A manifest of another world size is refused before any file is read.

Leftover temporary files of interrupted writes (``.<name>.*.tmp``) are removed at each
restore and save.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn

from rcdl._io import atomic_write, atomic_write_json
from rcdl.distributed import is_sharded, rank_and_world
from rcdl.retrieval import load_retrieval_state, retrieval_state

__all__ = ["Checkpointer", "DamagedCheckpoint", "checkpoint_files", "load_checkpoint",
           "load_model_state", "model_state_problems", "remove_checkpoint", "save_checkpoint"]

MAGIC = b"RCDLCKP1"
_HEADER = len(MAGIC) + 32  # magic, SHA-256 of the payload
_BLOCK = 1 << 20


class DamagedCheckpoint(ValueError):
    """A checkpoint file that cannot be trusted: cut short, changed after it was written, or
    not an rcdl checkpoint. ``path`` is the file."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = Path(path)
        super().__init__(f"checkpoint {self.path} is damaged: {problem}")


class _HashingWriter:
    """A write-only file that hashes what passes through it (all ``torch.save`` calls)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.digest = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _Window(io.RawIOBase):
    """The file ``f`` from byte ``start`` on, as a file of its own (what ``torch.load``
    reads: the payload behind the header)."""

    def __init__(self, f: io.BufferedIOBase, start: int) -> None:
        super().__init__()
        self.f, self.start = f, start
        f.seek(start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # noqa: ANN001 - a writable buffer
        return self.f.readinto(buffer)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos += self.start
        return self.f.seek(pos, whence) - self.start

    def tell(self) -> int:
        return self.f.tell() - self.start


def save_checkpoint(obj: Any, path: str | os.PathLike) -> str:
    """``torch.save(obj)`` to ``path`` atomically, behind its SHA-256; returns the digest
    (hex). Read it back with :func:`load_checkpoint`."""
    digest: list[str] = []

    def write(f: IO[bytes]) -> None:
        f.write(MAGIC + bytes(32))
        writer = _HashingWriter(f)
        torch.save(obj, writer)  # type: ignore[arg-type]  # stubs: IO[bytes]; any writer works
        f.seek(len(MAGIC))
        f.write(writer.digest.digest())
        f.seek(0, io.SEEK_END)
        digest.append(writer.digest.hexdigest())

    atomic_write(path, write)
    return digest[0]


def load_checkpoint(path: str | os.PathLike, *, map_location: Any = "cpu",
                    expected_sha256: str | None = None) -> Any:
    """The object :func:`save_checkpoint` wrote to ``path``, after verifying its digest
    (and, if given, that it is ``expected_sha256``, a manifest's record of it).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DamagedCheckpoint: the file is empty, cut short, changed, or not an rcdl checkpoint.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(_HEADER)
        if not head:
            raise DamagedCheckpoint(path, "the file is empty (a write that never finished?)")
        if len(head) < _HEADER or head[: len(MAGIC)] != MAGIC:
            raise DamagedCheckpoint(path, "it does not start with an rcdl checkpoint header "
                                    "(cut short, overwritten, or not written by rcdl)")
        digest = hashlib.sha256()
        while block := f.read(_BLOCK):
            digest.update(block)
        if digest.digest() != head[len(MAGIC):]:
            raise DamagedCheckpoint(path, "its SHA-256 does not match the one it was written "
                                    "with (bytes changed, or the file was cut short)")
        if expected_sha256 is not None and digest.hexdigest() != expected_sha256:
            raise DamagedCheckpoint(path, "it is not the file its manifest lists (another "
                                    "digest): it was replaced after the manifest was written")
        try:
            return torch.load(_Window(f, _HEADER),  # type: ignore[arg-type]  # any reader works
                              map_location=map_location, weights_only=False)
        except Exception as err:  # a verified file that torch cannot read: say which
            raise DamagedCheckpoint(path, f"torch cannot read it ({err})") from err


def model_state_problems(model: nn.Module, state: dict[str, Any]) -> list[str]:
    """Everything that would make ``model.load_state_dict(state)`` refuse a part of
    ``state``, found before anything is loaded: a growing store's rows (shapes, dtypes, NaN
    or inf), a parameter or buffer of another shape, a missing one. Empty if it loads."""
    from rcdl.store import EntryStore

    problems = []
    for name, module in model.named_modules():
        if isinstance(module, EntryStore):
            problem = module.state_problem(state, f"{name}." if name else "")
            if problem is not None:
                problems.append(f"{type(module).__name__} {name!r}: {problem}")
    persistent = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                persistent[f"{prefix}.{key}" if prefix else key] = buffer
    for key, tensor in persistent.items():
        if key not in state:
            problems.append(f"{key}: missing")
        elif isinstance(state[key], torch.Tensor) and state[key].shape != tensor.shape:
            problems.append(f"{key}: shape {tuple(state[key].shape)}, the model has "
                            f"{tuple(tensor.shape)}")
    return problems


def load_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """``model.load_state_dict(state)``, all of it or none: every part is checked first
    (:func:`model_state_problems`), so a refused load leaves the whole model as it was.

    Raises:
        ValueError: listing every part that would be refused; nothing is loaded then.
    """
    problems = model_state_problems(model, state)
    if problems:
        raise ValueError(f"{type(model).__name__}: the state cannot be loaded, nothing was: "
                         + "; ".join(problems))
    model.load_state_dict(state)


# --------------------------------------------------------------------------- a run's checkpoints


def checkpoint_files(path: str | os.PathLike, step: int, rank: int = 0,
                     world: int = 1) -> Path:
    """The data file of step ``step`` (rank ``rank`` of ``world``) of the checkpoint at
    ``path``: ``<stem>.step<N><suffix>``, sharded ``<stem>.rank<r>of<W>.step<N><suffix>``."""
    path = Path(path)
    rank_part = "" if world == 1 else f".rank{rank}of{world}"
    return path.with_name(f"{path.stem}{rank_part}.step{step:08d}{path.suffix}")


def _manifest_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.manifest.json")


def _own_files(path: Path, rank: int, world: int) -> list[Path]:
    """This rank's data files of the checkpoint at ``path``, whatever their step."""
    rank_part = "" if world == 1 else re.escape(f".rank{rank}of{world}")
    pattern = re.compile(rf"{re.escape(path.stem)}{rank_part}\.step\d+{re.escape(path.suffix)}")
    return [p for p in path.parent.glob(f"{path.stem}*") if pattern.fullmatch(p.name)]


def _remove_temporaries(path: Path, rank: int, world: int) -> None:
    """Temporary files left by interrupted writes of this rank's files (and, on rank 0, of
    the manifest): the atomic writes name them ``.<target>.<random>.tmp``."""
    rank_part = "" if world == 1 else f".rank{rank}of{world}"
    prefixes = [f".{path.stem}{rank_part}.step"]
    if rank == 0:
        prefixes.append(f".{_manifest_path(path).name}.")
    for tmp in path.parent.glob(".*.tmp"):
        if tmp.name.startswith(tuple(prefixes)):
            tmp.unlink(missing_ok=True)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete the checkpoint at ``path``: this rank's data files (and temporaries), and on
    rank 0 the manifest (under ``torch.distributed`` every rank calls it)."""
    path = Path(path)
    rank, world = rank_and_world()
    for p in _own_files(path, rank, world):
        p.unlink(missing_ok=True)
    _remove_temporaries(path, rank, world)
    if rank == 0:
        _manifest_path(path).unlink(missing_ok=True)


def _warn(message: str) -> None:
    rank, world = rank_and_world()
    print(f"{'' if world == 1 else f'rank {rank}: '}{message}", file=sys.stderr)


class Checkpointer:
    """Saves the loop's whole state (model, optimizer, grower, top-k indices, the loop's
    counters) every ``every`` steps as a checkpoint at ``path`` (see the module docstring),
    and restores it at the start of a run that finds one; a checkpoint written by another
    run (``identity``: name, seed, batch size, training samples) is refused.

    Under ``torch.distributed`` with sharded stores every rank passes the same ``path``; each
    writes its own files, and the manifest lists them.

    Args:
        keep: committed checkpoints kept (the newest, and ``keep − 1`` to fall back to).
    """

    def __init__(self, path: str | os.PathLike, every: int, identity: dict[str, Any],
                 model: nn.Module, optimizer: torch.optim.Optimizer | None, grower: Any,
                 keep: int = 2) -> None:  # fmt: skip
        if keep < 1:
            raise ValueError(f"Checkpointer: keep must be >= 1, got {keep}")
        self.path, self.every, self.identity, self.keep = Path(path), every, identity, keep
        self.model, self.optimizer, self.grower = model, optimizer, grower
        self._checked = False

    @property
    def manifest(self) -> Path:
        return _manifest_path(self.path)

    def _place(self) -> tuple[int, int]:
        """``(rank, world size)`` the stores are sharded over (``(0, 1)`` if they are not);
        the first time, checks that every rank was given the same path."""
        if not is_sharded(self.model):
            return 0, 1
        rank, world = rank_and_world()
        if not self._checked:
            paths: list[Any] = [None] * world  # filled by all_gather_object
            dist.all_gather_object(paths, str(self.path.resolve()))
            if len(set(paths)) != 1:
                raise ValueError(
                    f"Checkpointer: the ranks were given different paths ({sorted(set(paths))})"
                    ": give every rank the same path; each rank's file is derived from it")
            self._checked = True
        return rank, world

    # ---------------------------------------------------------------- restore
    def _read_manifest(self, world: int) -> dict[str, Any] | None:
        if not self.manifest.exists():
            return None
        try:
            manifest = json.loads(self.manifest.read_text(encoding="utf-8"))
            entries = manifest["checkpoints"]
            if not isinstance(entries, list):
                raise TypeError("checkpoints is not a list")
        except (ValueError, KeyError, TypeError) as err:
            _warn(f"{self.manifest} is damaged ({err}): it says which checkpoint files are "
                  "whole, so none is used; this run starts from step 0")
            return None
        if manifest.get("world_size") != world:
            raise ValueError(
                f"{self.manifest} was written by another number of processes "
                f"({manifest.get('world_size')}) than this run's {world}; resume with the same "
                "torchrun --nproc-per-node (1: without torchrun), or delete the checkpoint")
        return manifest

    def restore(self) -> dict[str, Any] | None:
        """The saved loop state after loading the rest into the model and learners; ``None``
        if there is no usable checkpoint (this run then starts from step 0)."""
        rank, world = self._place()
        _remove_temporaries(self.path, rank, world)
        manifest = self._read_manifest(world)
        if manifest is None:
            return None
        entries = sorted(manifest["checkpoints"], key=lambda e: e["step"])
        for entry in reversed(entries):
            state, problem = self._read(entry, rank)
            agreed = self._all_agree(problem is None, world)
            if agreed:
                self._check_identity(state, self.path.parent / entry["files"][rank])
                if entry is not entries[-1]:
                    _warn(f"{self.path}: resuming from the checkpoint of step {entry['step']}, "
                          "the newest that every rank could read")
                return self._load(state)
            reason = problem or "another rank could not read its file of this checkpoint"
            _warn(f"{self.path}: the checkpoint of step {entry['step']} is not used: {reason}")
        _warn(f"{self.path}: no checkpoint could be read; this run starts from step 0")
        return None

    def _read(self, entry: dict[str, Any], rank: int) -> tuple[Any, str | None]:
        try:
            name, digest = entry["files"][rank], entry["sha256"][rank]
            return load_checkpoint(self.path.parent / name, expected_sha256=digest), None
        except FileNotFoundError as err:
            return None, f"{err.filename} is missing"
        except (DamagedCheckpoint, KeyError, IndexError, TypeError) as err:
            return None, str(err)

    @staticmethod
    def _all_agree(ok: bool, world: int) -> bool:
        if world == 1:
            return ok
        flags = [None] * world
        dist.all_gather_object(flags, ok)
        return all(flags)

    def _check_identity(self, state: dict[str, Any], file: Path) -> None:
        for key, value in self.identity.items():
            if state["run"].get(key) != value:
                raise ValueError(
                    f"checkpoint {file} was written by a different run: "
                    f"{key}={state['run'].get(key)!r}, this run has {value!r}; delete it or "
                    "use another checkpoint path")

    def _load(self, state: dict[str, Any]) -> dict[str, Any]:
        load_model_state(self.model, state["model"])  # all of it or none
        load_retrieval_state(self.model, state.get("retrieval"))  # top-k (docs/retrieval.md)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if (self.grower is not None and state.get("grower") is not None
                and hasattr(self.grower, "state_dict")):  # fmt: skip
            self.grower.load_state_dict(state["grower"])
        return state["loop"]

    # ---------------------------------------------------------------- save
    def due(self, step: int, steps: int) -> bool:
        """Whether to save after ``step`` steps (never after the last: the result is saved)."""
        return step % self.every == 0 and step < steps

    def save(self, loop: dict[str, Any]) -> None:
        """Write this rank's file of ``loop["step"]``, then commit it (see the module
        docstring)."""
        rank, world = self._place()
        grower = self.grower
        state = {
            "run": self.identity,
            "loop": loop,
            "model": self.model.state_dict(),
            "retrieval": retrieval_state(self.model),  # None unless top-k retrieval is on
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "grower": grower.state_dict() if hasattr(grower, "state_dict") else None,
        }
        step = int(loop["step"])
        file = checkpoint_files(self.path, step, rank, world)
        digest = save_checkpoint(state, file)  # phase 1: every rank writes its file
        written: list[Any] = [(file.name, digest)]  # (name, digest) per rank
        if world > 1:
            written = [None] * world
            dist.all_gather_object(written, (file.name, digest))
        if rank == 0:  # the commit: the manifest lists the new checkpoint
            old = self._read_manifest(world)
            entries = [] if old is None else [e for e in old["checkpoints"] if e["step"] != step]
            entries.append({"step": step, "files": [n for n, _ in written],
                            "sha256": [d for _, d in written]})
            entries = sorted(entries, key=lambda e: e["step"])[-self.keep :]
            atomic_write_json({"format": 1, "name": self.identity.get("name"), "step": step,
                               "world_size": world, "files": [n for n, _ in written],
                               "checkpoints": entries}, self.manifest)
        if world > 1:
            dist.barrier()  # phase 2: no rank deletes a file before the commit
        kept = self._kept_files(rank, world)
        for p in _own_files(self.path, rank, world):
            if p.name not in kept:
                p.unlink(missing_ok=True)
        _remove_temporaries(self.path, rank, world)

    def _kept_files(self, rank: int, world: int) -> set[str]:
        try:
            manifest = json.loads(self.manifest.read_text(encoding="utf-8"))
            return {e["files"][rank] for e in manifest["checkpoints"]}
        except (OSError, ValueError, KeyError, IndexError):
            return set()
