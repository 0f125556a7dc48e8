"""Checkpoints that say when they are damaged, and survive a kill at any moment.

**Checksummed files.** :func:`save_checkpoint` writes ``torch.save(obj)`` behind a 40-byte
header, the magic ``RCDLCKP1`` and the SHA-256 of what follows, through the atomic write
of :mod:`rcdl._io` (a temporary file, fsynced, renamed into place). :func:`load_checkpoint`
verifies the digest before ``torch.load`` sees a byte: a flipped, cut or emptied file is
refused with :class:`DamagedCheckpoint`, naming the file and what is wrong, instead of
loading a wrong model (torch checks no checksum itself). Hashing costs one pass over the
bytes at save and at load.

**Nothing in a checkpoint runs code.** The digest is a checksum, not a signature: anyone can
write a file with a valid header. So the payload is read with ``torch.load(...,
weights_only=True)``, whose unpickler builds only tensors, numbers, strings, ``None``,
``torch.Size``/``dtype``/``device`` and the plain containers (``dict``, ``list``,
``tuple``, ``set``, ``OrderedDict``) — never an arbitrary class or function. A file that
asks for anything else is refused (:class:`UnsafeCheckpoint`) before any of it is built.
:func:`save_checkpoint` refuses to write such an object in the first place (``TypeError``
naming the key), so every file it writes loads back.

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
  starts afresh. A file that verifies but does not hold what a save writes (a part missing
  or of another type, a grower state whose layers disagree, a loop at another step) is
  skipped as a damaged one, before any of it is loaded. The load is all or nothing: a
  model, optimizer or grower that refuses its part leaves all three as they were. A
  manifest of another world size is refused before any file is read, and so is one of a
  format this rcdl does not know (the manifest records its ``format`` and the
  ``rcdl_version`` that wrote it);
- without a readable manifest (missing, or damaged) a restore does not give up the files
  that are whole: it takes the newest step whose files every rank has and can verify by
  their own checksums, and says so;
- a save deletes only files that the manifest it has just written (held in memory, never
  re-read) no longer lists and that are older than the step it writes: a failed read can
  never delete a checkpoint, and a newer checkpoint that verifies is kept.

Leftover temporary files of interrupted writes (``.<name>.*.tmp``) are removed at each
restore and save.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import pickle
import re
import reprlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rcdl._checks import is_count
from rcdl._io import LockHeld, atomic_write, atomic_write_json, holder, lock_exclusively
from rcdl._version import __version__
from rcdl.distributed import is_sharded, rank_and_world
from rcdl.ops.half import product_record, product_record_problem
from rcdl.retrieval.topk import load_retrieval_state, retrieval_state

__all__ = ["CheckpointInUse", "Checkpointer", "DamagedCheckpoint", "UnsafeCheckpoint",
           "checkpoint_files",
           "load_checkpoint", "load_model_state", "model_state_problems", "remove_checkpoint",
           "save_checkpoint"]

MAGIC = b"RCDLCKP1"
_HEADER = len(MAGIC) + 32  # magic, SHA-256 of the payload
_BLOCK = 1 << 20
MANIFEST_FORMATS = (1,)  # the manifest formats this rcdl reads; it writes the last


class DamagedCheckpoint(ValueError):
    """A checkpoint file that cannot be trusted: cut short, changed after it was written, or
    not an rcdl checkpoint. ``path`` is the file."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = Path(path)
        super().__init__(f"checkpoint {self.path} is damaged: {problem}")


class UnsafeCheckpoint(DamagedCheckpoint):
    """A checkpoint file whose payload asks to build something other than tensors and plain
    containers (a class, a function such as ``os.system``): loading it could run code, so
    it is refused before any of it is built. ``path`` is the file."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = Path(path)
        ValueError.__init__(self, f"checkpoint {self.path} is refused: {problem}")


class CheckpointInUse(RuntimeError):
    """Another process trains on the same checkpoint path: the two would overwrite each
    other's step files and manifest."""


# what a checkpoint may hold: the types torch.load(weights_only=True) builds
_PLAIN_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype,
                 torch.device, torch.Size)
_PLAIN_CONTAINERS = (dict, OrderedDict, list, tuple, set, frozenset)


def _plain_problem(obj: Any, where: str = "the object") -> str | None:
    """Where ``obj`` holds something :func:`load_checkpoint` would refuse (``None`` if
    nothing): the path of keys to the first such value and its type."""
    if isinstance(obj, _PLAIN_LEAVES):
        if isinstance(obj, torch.Tensor) and type(obj) not in (torch.Tensor, nn.Parameter):
            return f"{where} is a {type(obj).__qualname__} (a tensor subclass)"
        return None
    if type(obj) not in _PLAIN_CONTAINERS:
        return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, dict):
        for key, value in obj.items():
            problem = _plain_problem(key, f"a key of {where}") or _plain_problem(
                value, f"{where}[{key!r}]")
            if problem is not None:
                return problem
        return None
    for i, value in enumerate(obj):
        problem = _plain_problem(value, f"{where}[{i}]")
        if problem is not None:
            return problem
    return None


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
    (hex). Read it back with :func:`load_checkpoint`.

    ``obj`` may hold tensors, numbers, strings, ``None``, ``torch.Size``/``dtype``/``device``
    and dicts, lists, tuples and sets of them (state dicts are such); anything else could
    not be loaded without running code, so it is refused here.

    Raises:
        TypeError: naming the first value of another type (nothing is written then).
    """
    problem = _plain_problem(obj)
    if problem is not None:
        raise TypeError(f"save_checkpoint({os.fspath(path)!r}): {problem}; a checkpoint holds "
                        "only tensors, numbers, strings and plain containers of them (store "
                        "an object as its state_dict())")
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

    The payload is read with ``torch.load(weights_only=True)``: it builds tensors and plain
    containers only, never a class or function named in the file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DamagedCheckpoint: the file is empty, cut short, changed, or not an rcdl checkpoint.
        UnsafeCheckpoint: (a :class:`DamagedCheckpoint`) the file asks to build something
            other than tensors and plain containers; nothing of it was built.
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
                              map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:  # weights_only refused a global: say what
            found = re.search(r"GLOBAL (\S+)", str(err))
            what = found.group(1) if found else "an object torch's safe loader does not build"
            raise UnsafeCheckpoint(
                path, f"it asks to build {what}, which is not a tensor or plain container: "
                "loading it could run code, so nothing of it was built (rcdl writes only "
                "tensors and plain containers; do not load this file from an untrusted "
                "source)") from err
        except Exception as err:  # a verified file that torch cannot read: say which
            raise DamagedCheckpoint(path, f"torch cannot read it ({err})") from err


def model_state_problems(model: nn.Module, state: dict[str, Any]) -> list[str]:
    """Everything that would make ``model.load_state_dict(state)`` refuse a part of
    ``state``, or load it as something else, found before anything is loaded: a value that is
    not a tensor (``5`` for a bias), a tensor of another kind of number than the model's (an
    integer tensor for a floating parameter, which torch would cast), a module's own check of
    its part (a growing store's rows: shapes, dtypes, NaN or inf; a provenance map's ids and
    merge counts), a parameter or buffer of another shape, a missing one, and a key the
    model has no place for (a state of a deeper model, say). Empty if it loads.

    A module whose ``_load_from_state_dict`` validates its part states that check as
    ``state_problem(state, prefix) -> str | None`` and the keys it reads as
    ``state_keys() -> tuple[str, ...]`` (relative to its prefix)."""
    if not isinstance(state, Mapping):
        return [f"the state is a {type(state).__name__}, not a dict of tensors by name"]
    persistent = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                persistent[f"{prefix}.{key}" if prefix else key] = buffer
    owned: list[tuple[str, nn.Module, list[str]]] = []  # (name, module, the keys it reads)
    extra: set[str] = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        keys = getattr(module, "state_keys", None)
        owned.append((name, module, [prefix + key for key in keys()] if callable(keys) else []))
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            extra.add(prefix + "_extra_state")
    tensors = set(persistent).union(*(keys for _, _, keys in owned))
    not_tensors = sorted(k for k in tensors if k in state and not isinstance(state[k], Tensor))
    problems = [f"{k}: {type(state[k]).__name__} {reprlib.repr(state[k])}, not a tensor"
                for k in not_tensors]
    for name, module, keys in owned:
        check = getattr(module, "state_problem", None)
        if callable(check) and not set(keys) & set(not_tensors):  # its part holds tensors
            problem = check(state, f"{name}." if name else "")
            if problem is not None:
                problems.append(f"{type(module).__name__} {name!r}: {problem}")
    for key, tensor in persistent.items():
        saved = state.get(key)
        if key not in state:
            problems.append(f"{key}: missing")
        elif not isinstance(saved, Tensor):
            continue  # said above
        elif _number_kind(saved) != _number_kind(tensor):
            problems.append(f"{key}: {saved.dtype}, the model has {tensor.dtype} (a "
                            f"{_number_kind(tensor)} tensor: torch would cast it silently)")
        elif saved.shape != tensor.shape:
            problems.append(f"{key}: shape {tuple(saved.shape)}, the model has "
                            f"{tuple(tensor.shape)}")
    unexpected = sorted(str(k) for k in state if k not in tensors and k not in extra)
    if unexpected:
        shown = ", ".join(unexpected[:6]) + (f" and {len(unexpected) - 6} more"
                                             if len(unexpected) > 6 else "")
        problems.append(f"unexpected keys (the model has no place for them: a state of "
                        f"another architecture?): {shown}")
    return problems


def _number_kind(tensor: Tensor) -> str:
    """Which kind of number a tensor holds: torch casts between kinds without a word."""
    if tensor.dtype == torch.bool:
        return "boolean"
    if tensor.is_complex():
        return "complex"
    return "floating" if tensor.is_floating_point() else "integer"


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
    rank_part = "" if world == 1 else f".rank{rank}of{world}"
    path.with_name(f"{path.stem}{rank_part}.lock").unlink(missing_ok=True)
    if rank == 0:
        _manifest_path(path).unlink(missing_ok=True)


def _warn(message: str) -> None:
    rank, world = rank_and_world()
    print(f"{'' if world == 1 else f'rank {rank}: '}{message}", file=sys.stderr)


# --------------------------------------------------------------------------- what one holds
# A file whose digest verifies may still not hold what a Checkpointer writes (a file written by
# hand with a valid header, another program's state): its layout is checked before any of it
# is loaded, and a file that fails is skipped as a damaged one.


def _is_scale(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _grower_problem(part: dict[str, Any], where: str) -> str | None:
    """A :meth:`rcdl.optim.grower.Grower.state_dict`: one group per layer, and per layer a
    step count, an output scale and an eviction count; per gated layer the entries written
    and the samples refused, where it holds them."""
    groups = part["param_groups"]
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("layer"), str)
            and _is_scale(g.get("lr")) and g["lr"] is not None for g in groups):  # fmt: skip
        return (f"{where}['param_groups'] is not a list of groups, each naming its layer and "
                "its learning rate")
    layers = [g["layer"] for g in groups]
    for key, fits, what in (("steps", is_count, "a step count"),
                            ("output_scale", _is_scale, "an output scale or None"),
                            ("evicted", is_count, "an eviction count")):
        value = part[key]
        if not isinstance(value, dict) or not all(fits(v) for v in value.values()):
            return f"{where}[{key!r}] is not {what} by layer"
        if key != "evicted" and sorted(value) != sorted(layers):
            return (f"{where}: its param_groups are for layers {layers}, its {key} for "
                    f"{sorted(value)}")
    shard = part["shard"]
    if shard is not None and not (isinstance(shard, list | tuple) and len(shard) == 2
                                  and all(is_count(v) for v in shard)):
        return f"{where}['shard'] is {shard!r}, not None or (rank, world size)"
    growth = part.get("growth", {})  # absent: saved when the layers held these counts
    if not isinstance(growth, dict) or not all(
            isinstance(g, dict) and set(g) == {"written", "refused"}
            and all(is_count(v) for v in g.values()) for g in growth.values()):
        return f"{where}['growth'] is not the entries written and refused by layer"
    return None


def _optimizer_problem(part: dict[str, Any], where: str) -> str | None:
    """A ``torch.optim.Optimizer.state_dict``: a state per parameter index, and groups that
    list their parameters' indices."""
    if not isinstance(part["state"], dict) or not all(
            isinstance(v, dict) for v in part["state"].values()):
        return f"{where}['state'] is not a dict of per-parameter states"
    groups = part["param_groups"]
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list)
            and all(is_count(i) for i in g["params"]) for g in groups):
        return f"{where}['param_groups'] is not a list of groups, each listing its parameters"
    return None


def _entry_adam_problem(part: dict[str, Any], where: str) -> str | None:
    """An :meth:`rcdl.optim.entry_adam.EntryAdam.state_dict`: one group, per layer a step count
    and both moments' rows, and the parameters' Adam (or ``None``)."""
    groups, layers = part["param_groups"], part["layers"]
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], dict):
        return f"{where}['param_groups'] is not a list holding a group"
    if not isinstance(layers, dict) or not all(
            isinstance(m, dict) and is_count(m.get("adam_steps"))
            and all(isinstance(m.get(k), dict) and isinstance(m[k].get("keys"), Tensor)
                    for k in ("m", "v")) for m in layers.values()):  # fmt: skip
        return f"{where}['layers'] is not the moments' rows and step count by layer"
    inner = part["param_adam"]
    if inner is None:
        return None
    return _part_problem(inner, {"state": {}, "param_groups": []}, f"{where}['param_adam']")


# The learners' state dicts a checkpoint holds, known by their keys, and their checks.
_LAYOUTS: tuple[tuple[frozenset[str], Callable[[dict[str, Any], str], str | None]], ...] = (
    (frozenset({"param_groups", "steps", "evicted", "output_scale", "shard"}), _grower_problem),
    (frozenset({"param_groups", "layers", "param_adam"}), _entry_adam_problem),
    (frozenset({"state", "param_groups"}), _optimizer_problem),
)


def _part_problem(part: Any, template: dict[str, Any], where: str) -> str | None:
    """Whether ``part`` of a checkpoint has the layout of ``template``, the state dict of
    the learner (optimizer, grower) it is loaded into; ``None`` if it has. A learner of a
    known kind (:data:`_LAYOUTS`) is checked in depth, one of another kind for its keys; a
    learner made of others (a hybrid's Adam and grower) is checked part by part."""
    if not isinstance(part, dict):
        return f"{where} is a {type(part).__name__}, not a state dict"
    check = _known_layout(template)
    keys = frozenset(template) if check is None else check[0]
    missing = sorted(map(str, keys - part.keys()))
    if missing:
        return f"{where} has no {', '.join(missing)}"
    if check is not None:
        return check[1](part, where)
    for key, inner in template.items():  # the learners it is made of
        if isinstance(inner, dict) and _known_layout(inner) is not None:
            problem = _part_problem(part[key], inner, f"{where}[{key!r}]")
            if problem is not None:
                return problem
    return None


def _known_layout(template: dict[str, Any]) -> tuple[frozenset[str], Any] | None:
    """The entry of :data:`_LAYOUTS` whose keys ``template`` holds, if any."""
    return next((layout for layout in _LAYOUTS if layout[0] <= template.keys()), None)


class _Stateful(Protocol):
    """An object saved as its state dict (the training loop's state)."""

    def state_dict(self) -> dict[str, Any]: ...


class Checkpointer:
    """Saves the loop's whole state (model, optimizer, grower, top-k indices, the loop's
    counters) every ``every`` steps as a checkpoint at ``path`` (see the module docstring),
    and restores it at the start of a run that finds one; a checkpoint written by another
    run (``identity``: name, seed, batch size, training samples) is refused. A run that records
a replay log (``replay``) saves it with the rest, so that a resumed run keeps recording.

    A restore loads all of a checkpoint or none of it. A file whose digest verifies but
    which does not hold what a save writes (a part missing or of another type, a grower
    state whose layers disagree, a loop at another step than its name) is skipped as a
    damaged one, before any of it is loaded. A well-formed checkpoint that the model or a
    learner refuses (another architecture, say) raises ``ValueError`` naming the file, and
    leaves the model, optimizer and grower as they were.

    Under ``torch.distributed`` with sharded stores every rank passes the same ``path``; each
    writes its own files, and the manifest lists them.

    A checkpoint saved when the hybrid layers held the counts of their writes (buffers
    ``entries_written`` and ``entries_refused`` in the model part, none in the grower's) loads
    as one saved since: the layers read the counts and the grower takes them over
    (:meth:`rcdl.nn.hybrid.HybridSoftmax.keep_old_counts`, :attr:`rcdl.optim.grower.Grower.growth`).

    A checkpoint also records how half-precision products ran
    (:func:`rcdl.ops.half.product_record`: the mode, and ``"auto"``'s path where a timing
    chose it); after a restore :attr:`products` holds that record, under which the resumed
    run continues (:func:`rcdl.ops.half.products_as`), so it takes the path the interrupted
    one took whatever a timing in this process says.

    Args:
        keep: committed checkpoints kept (the newest, and ``keep − 1`` to fall back to).
        loop_problem: what is wrong with a saved loop state (a message), or ``None`` if it
            is whole: the caller's own layout of the ``loop`` it saves (the Checkpointer
            itself needs only its ``step``, an integer). A loop it refuses makes the
            checkpoint a damaged one.
        replay: the run's :class:`~rcdl.train.replay.ReplayLog` (``None``: none): each save
            writes its state as the ``replay`` part, and a restore checks a saved one
            (``replay_problem``) and keeps it in :attr:`replay_state` for the caller to load.
        replay_problem: what is wrong with a saved ``replay`` part (a message), or ``None``:
            the log's own check and the caller's (the same stream as this run's). A part it
            refuses makes the checkpoint a damaged one.
    """

    def __init__(self, path: str | os.PathLike, every: int, identity: dict[str, Any],
                 model: nn.Module, optimizer: torch.optim.Optimizer | None, grower: Any,
                 keep: int = 2,
                 loop_problem: Callable[[dict[str, Any]], str | None] | None = None,
                 replay: Any = None,
                 replay_problem: Callable[[Any], str | None] | None = None,
                 ) -> None:  # fmt: skip
        if keep < 1:
            raise ValueError(f"Checkpointer: keep must be >= 1, got {keep}")
        self.path, self.every, self.identity, self.keep = Path(path), every, identity, keep
        self.model, self.optimizer, self.grower = model, optimizer, grower
        self.loop_problem = loop_problem
        self.replay, self.replay_problem = replay, replay_problem
        # the restored checkpoint's replay part, checked (None: none restored, or it holds none)
        self.replay_state: dict[str, Any] | None = None
        self._checked = False
        self._committed: list[dict[str, Any]] | None = None  # the manifest's list, once known
        self._lock_fd: int | None = None  # this rank's OS lock on the path (see _lock)
        self._scanned = False  # whether that list was found on disk, without a manifest
        # the restored checkpoint's half-precision product record (None: none restored, or
        # saved before checkpoints recorded it)
        self.products: dict[str, str | None] | None = None

    @property
    def manifest(self) -> Path:
        return _manifest_path(self.path)

    def _lock(self, rank: int, world: int) -> None:
        """Hold an OS lock (``flock``) on ``<stem>[.rank<r>of<W>].lock`` beside the path
        from the first restore or save until :meth:`close`, so that a second process given
        the same path is refused instead of overwriting this one's files. The OS drops the
        lock when the process ends; the file stays, naming the last holder. A link or a
        special file at the lock's path is refused (:func:`rcdl._io.lock_exclusively`):
        the holder is written into the lock file only."""
        if self._lock_fd is not None:
            return
        rank_part = "" if world == 1 else f".rank{rank}of{world}"
        lock = self.path.with_name(f"{self.path.stem}{rank_part}.lock")
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = lock_exclusively(lock, create=True)  # a link or another file is refused
        except LockHeld as err:
            raise CheckpointInUse(
                f"checkpoint {self.path} is in use by {err.holder or 'another process'}: two "
                "runs on one checkpoint path would overwrite each other's files; wait for it "
                "to finish, or give this run another checkpoint_path") from None
        if fd is None:
            return
        self._lock_fd = fd  # held from here: close() releases it whatever follows
        os.ftruncate(fd, 0)  # the file opened and checked, never opened again by its name
        os.pwrite(fd, f"{holder()}\n".encode(), 0)

    def close(self) -> None:
        """Release the lock on the path (:func:`rcdl.train.loop.train_one_pass` calls it when
        the loop ends, however it ends)."""
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            os.close(fd)
            self._lock_fd = None

    def __del__(self) -> None:
        self.close()

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

    # ---------------------------------------------------------------- the committed list
    def _read_manifest(self, world: int) -> dict[str, Any] | None:
        """The manifest, checked; ``None`` if there is none or it is damaged (said on
        stderr). Raises ``ValueError`` for another world size or an unknown format."""
        if not self.manifest.exists():
            return None
        try:
            manifest = json.loads(self.manifest.read_text(encoding="utf-8"))
            entries = manifest["checkpoints"]
            if not isinstance(entries, list) or not all(
                    isinstance(e, dict) and isinstance(e.get("step"), int) for e in entries):
                raise TypeError("checkpoints is not a list of steps")
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as err:
            _warn(f"{self.manifest} is damaged or unreadable ({type(err).__name__}: {err}); "
                  "looking for the newest checkpoint files that verify on their own")
            return None
        # A manifest without a format predates the field and has format 1's layout.
        if manifest.get("format", 1) not in MANIFEST_FORMATS:
            raise ValueError(
                f"{self.manifest} has format {manifest.get('format')!r}, written by rcdl "
                f"{manifest.get('rcdl_version', '(unknown)')}; this rcdl ({__version__}) reads "
                f"format {', '.join(map(str, MANIFEST_FORMATS))}: resume with that rcdl, or "
                "delete the checkpoint")
        if manifest.get("world_size") != world:
            raise ValueError(
                f"{self.manifest} was written by another number of processes "
                f"({manifest.get('world_size')}) than this run's {world}; resume with the same "
                "torchrun --nproc-per-node (1: without torchrun), or delete the checkpoint")
        return manifest

    def _scan(self, rank: int, world: int) -> list[dict[str, Any]]:
        """Without a manifest: the steps whose files every rank has, as manifest entries
        (names and the digests their headers carry; each is verified when read)."""
        mine = {}
        for p in _own_files(self.path, rank, world):
            digest = _header_digest(p)
            if digest is not None:
                mine[_step_of(self.path, p)] = (p.name, digest)
        every: list[Any] = [mine]
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, mine)
        common = set.intersection(*(set(files) for files in every))
        return [{"step": step, "files": [files[step][0] for files in every],
                 "sha256": [files[step][1] for files in every]} for step in sorted(common)]

    def _committed_entries(self, rank: int, world: int) -> list[dict[str, Any]]:
        """The committed checkpoints, oldest first: the manifest's list, or without a usable
        manifest the steps found on disk (:meth:`_scan`). A collective under sharding: rank
        0 reads the manifest and every rank gets its verdict."""
        verdict: tuple[Any, str | None] = (None, None)
        if rank == 0:
            try:
                verdict = (self._read_manifest(world), None)
            except ValueError as err:  # refused: every rank raises it
                verdict = (None, str(err))
        if world > 1:
            shared: list[Any] = [verdict]
            dist.broadcast_object_list(shared, src=0)
            verdict = shared[0]
        manifest, refused = verdict
        if refused is not None:
            raise ValueError(refused)
        self._scanned = manifest is None
        if manifest is not None:
            return sorted(manifest["checkpoints"], key=lambda e: e["step"])
        found = self._scan(rank, world)
        if found:
            _warn(f"{self.path}: without a usable manifest, the checkpoints of steps "
                  f"{', '.join(str(e['step']) for e in found)} were found on disk")
        return found

    # ---------------------------------------------------------------- restore
    def restore(self) -> dict[str, Any] | None:
        """The saved loop state after loading the rest into the model and learners; ``None``
        if there is no usable checkpoint (this run then starts from step 0)."""
        rank, world = self._place()
        self._lock(rank, world)
        _remove_temporaries(self.path, rank, world)
        entries = self._committed_entries(rank, world)
        before = self._snapshot() if entries else {}
        for i in range(len(entries) - 1, -1, -1):
            entry = entries[i]
            state, problem = self._read(entry, rank, before)
            if self._all_agree(problem is None, world):
                file = self.path.parent / entry["files"][rank]
                self._check_identity(state, file)
                if i != len(entries) - 1 or self._scanned:
                    _warn(f"{self.path}: resuming from the checkpoint of step {entry['step']}, "
                          "the newest that every rank could read")
                self._committed = entries[: i + 1]
                return self._load(state, file, before)
            reason = problem or "another rank could not read its file of this checkpoint"
            _warn(f"{self.path}: the checkpoint of step {entry['step']} is not used: {reason}")
        if entries:
            _warn(f"{self.path}: no checkpoint could be read; this run starts from step 0")
        self._committed = []
        return None

    def _read(self, entry: dict[str, Any], rank: int,
              before: dict[str, Any]) -> tuple[Any, str | None]:
        """This rank's file of ``entry``, verified and checked against what a save writes
        (``before``: the learners' own states, :meth:`_snapshot`); or why it is not used."""
        try:
            file = self.path.parent / entry["files"][rank]
            state = load_checkpoint(file, expected_sha256=entry["sha256"][rank])
        except FileNotFoundError as err:
            return None, f"{err.filename} is missing"
        except (DamagedCheckpoint, KeyError, IndexError, TypeError) as err:
            return None, str(err)
        problem = self._layout_problem(state, entry["step"], before)
        if problem is not None:
            return None, str(DamagedCheckpoint(file, f"it does not hold what a checkpoint "
                                                     f"of this run holds: {problem}"))
        return state, None

    def _layout_problem(self, state: Any, step: int, before: dict[str, Any]) -> str | None:
        """What makes ``state`` other than what :meth:`save` writes for step ``step`` (the
        parts, their types, the learners' layouts; ``before`` holds the learners' own
        states), or ``None``. Whether the model takes its state is checked at the load."""
        if not isinstance(state, dict):
            return f"it is a {type(state).__name__}, not a dict of the run's parts"
        parts = ["run", "loop", "model"]
        parts += [name for name in ("optimizer", "grower") if before.get(name) is not None]
        missing = [name for name in parts if name not in state]
        if missing:
            return f"it has no {' and no '.join(missing)} part"
        if not isinstance(state["run"], dict):
            return f"its run part is a {type(state['run']).__name__}, not a dict"
        loop = state["loop"]
        if not isinstance(loop, dict) or not is_count(loop.get("step")):
            return "its loop part is not a dict with an integer step"
        if loop["step"] != step:
            return f"its loop is at step {loop['step']}, its name and manifest say {step}"
        problem = None if self.loop_problem is None else self.loop_problem(loop)
        if problem is not None:
            return f"its loop part: {problem}"
        model = state["model"]
        if not isinstance(model, dict):
            return f"its model part is a {type(model).__name__}, not a dict of tensors by name"
        for key, value in model.items():
            if not isinstance(key, str) or not (isinstance(value, Tensor)
                                                or key.endswith("_extra_state")):
                return (f"its model part holds {type(value).__name__} {reprlib.repr(value)} "
                        f"under {key!r}, not a tensor by name")
        products = state.get("products")
        if products is not None and (problem := product_record_problem(products)):
            return f"its products part {problem}"
        replay = state.get("replay")
        if self.replay is not None and replay is not None and self.replay_problem is not None:
            problem = self.replay_problem(replay)
            if problem is not None:
                return f"its replay part: {problem}"
        retrieval = state.get("retrieval")
        if retrieval is not None and not (isinstance(retrieval, dict) and all(
                isinstance(v, dict) for v in retrieval.values())):
            return "its retrieval part is not None or a top-k state by layer"
        for name in ("optimizer", "grower"):
            if before.get(name) is not None:
                problem = _part_problem(state[name], before[name], name)
                if problem is not None:
                    return problem
        return None

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

    def _snapshot(self) -> dict[str, Any]:
        """The model's, optimizer's and grower's states as they are, copied: what a refused
        load puts back, and the layouts a checkpoint's parts must have (:meth:`_read`)."""
        model = {k: v.detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v)
                 for k, v in self.model.state_dict().items()}
        optimizer = None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict())
        grower = (copy.deepcopy(self.grower.state_dict())
                  if hasattr(self.grower, "state_dict") else None)
        return {"model": model, "optimizer": optimizer, "grower": grower}

    def _put_back(self, before: dict[str, Any]) -> None:
        self.model.load_state_dict(before["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(before["optimizer"])
        if before["grower"] is not None:
            self.grower.load_state_dict(before["grower"])

    def _load(self, state: dict[str, Any], file: Path, before: dict[str, Any]) -> dict[str, Any]:
        """Load a checkpoint whose layout was checked, all of it or none: the grower's part
        (where the grower can check one) and the model's are checked whole first; if the
        optimizer or grower refuses its part after the model was loaded, everything is put
        back as it was (``before``, :meth:`_snapshot`)."""
        if self.replay is not None and state.get("replay") is None:  # before anything loads
            raise ValueError(
                f"checkpoint {file} resumes at step {state['loop']['step']} and holds no replay "
                "log (its run recorded none), and a replay log records a run from step 0: "
                "nothing was loaded; delete it, or resume without replay=")
        try:
            check = getattr(self.grower, "check_state_dict", None)  # refuses before a change
            if before["grower"] is not None and callable(check):
                check(state["grower"])
            load_model_state(self.model, state["model"])  # all of it or none
            if self.optimizer is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            if before["grower"] is not None:
                self.grower.load_state_dict(state["grower"])
            # top-k (docs/retrieval.md): checked whole before it changes anything, so last
            load_retrieval_state(self.model, state.get("retrieval"))
        except BaseException as err:
            self._put_back(before)
            if not isinstance(err, Exception):
                raise
            raise ValueError(f"checkpoint {file} was not loaded (the model and learners are "
                             f"as they were): {err}") from err
        self.products = state.get("products")
        self.replay_state = None if self.replay is None else state.get("replay")
        return state["loop"]

    # ---------------------------------------------------------------- save
    def due(self, step: int, steps: int) -> bool:
        """Whether to save after ``step`` steps (never after the last: the result is saved)."""
        return step % self.every == 0 and step < steps

    def save(self, loop: dict[str, Any] | _Stateful) -> None:
        """Write this rank's file of the loop's step, then commit it (see the module
        docstring). ``loop`` is the loop's state, saved as its ``state_dict()`` where it has
        one (:class:`rcdl.train.loop.LoopState`), else as the dict it is; a restore returns
        that dict."""
        if not isinstance(loop, dict):
            loop = loop.state_dict()
        rank, world = self._place()
        self._lock(rank, world)
        if self._committed is None:  # saving without a restore first: what is on disk
            self._committed = self._committed_entries(rank, world)
        grower = self.grower
        state = {
            "run": self.identity,
            "loop": loop,
            "model": self.model.state_dict(),
            "retrieval": retrieval_state(self.model),  # None unless top-k retrieval is on
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "grower": grower.state_dict() if hasattr(grower, "state_dict") else None,
            # how half products ran: the restored record, else this process's (decided now)
            "products": self.products or product_record(),
            # the replay log (docs/unlearning.md): a resumed run keeps recording into it
            "replay": None if self.replay is None else self.replay.state_dict(),
        }
        step = int(loop["step"])
        file = checkpoint_files(self.path, step, rank, world)
        digest = save_checkpoint(state, file)  # phase 1: every rank writes its file
        written: list[Any] = [(file.name, digest)]  # (name, digest) per rank
        if world > 1:
            written = [None] * world
            dist.all_gather_object(written, (file.name, digest))
        entries = [e for e in self._committed if e["step"] != step]
        entries.append({"step": step, "files": [n for n, _ in written],
                        "sha256": [d for _, d in written]})
        entries = sorted(entries, key=lambda e: e["step"])[-self.keep :]
        if rank == 0:  # the commit: the manifest lists the new checkpoint
            atomic_write_json({"format": MANIFEST_FORMATS[-1], "rcdl_version": __version__,
                               "name": self.identity.get("name"), "step": step,
                               "world_size": world, "files": [n for n, _ in written],
                               "checkpoints": entries}, self.manifest)
        if world > 1:
            dist.barrier()  # phase 2: no rank deletes a file before the commit
        self._committed = entries  # what the manifest now lists, never re-read from disk
        self._remove_older(step, {e["files"][rank] for e in entries}, rank, world)

    def _remove_older(self, step: int, kept: set[str], rank: int, world: int) -> None:
        """Delete this rank's step files that the committed manifest does not list (``kept``)
        and that are older than ``step``. A newer one is kept if it verifies (the files of a
        run resumed from an older step, say because another rank had lost its newer file)."""
        for p in _own_files(self.path, rank, world):
            if p.name in kept:
                continue
            if _step_of(self.path, p) > step:
                try:
                    load_checkpoint(p)
                except (DamagedCheckpoint, OSError):
                    pass  # damaged: nothing worth keeping
                else:
                    continue
            p.unlink(missing_ok=True)
        _remove_temporaries(self.path, rank, world)


def _step_of(path: Path, file: Path) -> int:
    """The step of one of ``path``'s data files (named by :func:`checkpoint_files`)."""
    found = re.search(r"\.step(\d+)", file.name[len(path.stem):])
    if found is None:
        raise ValueError(f"{file} is not a step file of the checkpoint {path}")
    return int(found.group(1))


def _header_digest(file: Path) -> str | None:
    """The SHA-256 (hex) a checkpoint file's header records, or ``None`` if it has no rcdl
    header (not verified here: :func:`load_checkpoint` does that)."""
    try:
        with open(file, "rb") as f:
            head = f.read(_HEADER)
    except OSError:
        return None
    if len(head) < _HEADER or head[: len(MAGIC)] != MAGIC:
        return None
    return head[len(MAGIC):].hex()
