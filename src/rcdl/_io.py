"""Atomic file writes: a reader, or a resumed run, never sees half a file; and the OS lock
that keeps a second process out of a run's files.

Every whole-file write goes to a temporary file in the same folder, is fsynced and then
moved into place with ``os.replace``. Training checkpoints (:mod:`rcdl.train.loop`) and the
run folders of :mod:`rcdl.app.rundir` write through these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import hashlib
import json
import os
import socket
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

__all__ = [
    "atomic_save_torch",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "LockHeld",
    "holder",
    "lock_exclusively",
    "save_figure",
    "to_jsonable",
]


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> Path:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it over."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LockHeld(BlockingIOError):
    """Another process holds the lock :func:`lock_exclusively` was asked for. ``holder`` is
    what its lock file says (``""`` for a folder's lock, or an empty file)."""

    def __init__(self, path: str | os.PathLike, holder: str) -> None:
        super().__init__(errno.EWOULDBLOCK, "locked by another process", os.fspath(path))
        self.holder = holder


def lock_exclusively(path: str | os.PathLike, *, create: bool = False) -> int | None:
    """An exclusive, non-blocking ``flock`` on ``path`` (a folder, or a lock file, made if
    ``create``); returns the descriptor that holds it (close it to release; the OS releases
    it when the process ends, so a SIGKILL leaves no stale lock), or ``None`` where the
    platform has no ``flock``. The descriptor is closed on every failure.

    A lock file is opened without following a link (``O_NOFOLLOW``) and must be a regular
    file of one name: the holder writes into it (through the descriptor returned, never by
    its name again), so a symbolic link, a hard link to another file, a FIFO or a device at
    ``path`` is refused rather than written through.

    Raises:
        LockHeld: (a ``BlockingIOError``) another process holds the lock; its ``holder`` is
            what the lock file says.
        OSError: the file system refuses locks (``ENOLCK``, say), ``path`` cannot be opened,
            or (``create``) it is a link or not a regular file; the message names ``path``.
    """
    try:
        import fcntl
    except ImportError:  # no flock on this platform: unguarded
        return None
    flags = os.O_RDONLY if not create else os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | os.O_CLOEXEC, 0o666)
    except OSError:  # a link (ELOOP), a folder (EISDIR), a socket (ENXIO): say which
        kind = _kind_of(os.lstat(path)) if create and os.path.lexists(path) else None
        if kind is None:
            raise
        raise _not_a_lock_file(path, kind) from None
    try:
        kind = _kind_of(os.fstat(fd)) if create else None
        if kind is not None:
            raise _not_a_lock_file(path, kind)
    except BaseException:
        os.close(fd)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        said = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() if create else ""
        os.close(fd)
        raise LockHeld(path, said) from None
    except OSError as err:
        os.close(fd)
        raise OSError(err.errno, f"cannot lock {os.fspath(path)} ({err.strerror}): the file "
                      "system may not support flock") from err
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind_of(status: os.stat_result) -> str | None:
    """What a file is, if it is not one a lock may be written into (a regular file with one
    name); ``None`` if it may."""
    mode = status.st_mode
    if stat.S_ISREG(mode):
        return None if status.st_nlink == 1 else (f"a regular file with {status.st_nlink} "
                                                  "names (a hard link to another file)")
    for test, kind in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def _not_a_lock_file(path: str | os.PathLike, kind: str) -> OSError:
    """The refusal of a lock file that is ``kind`` (see :func:`_kind_of`), naming it."""
    if kind == "a symbolic link":
        with contextlib.suppress(OSError):
            kind += f" to {os.readlink(os.fspath(path))}"
    return OSError(errno.ELOOP if kind.startswith("a symbolic link") else errno.EPERM,
                   f"the lock file {os.fspath(path)} is {kind}: a lock's holder is written "
                   "into a regular file of its own only, never through a link or into "
                   "another file; remove it, or give another path")


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of the bytes of the file ``path`` (read a megabyte at a time), in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def holder() -> str:
    """This process as a lock's holder is described to the next one: pid, host, start."""
    return (f"process {os.getpid()} on {socket.gethostname()}, started "
            f"{_dt.datetime.now().astimezone().isoformat(timespec='seconds')}")


def atomic_write_bytes(data: bytes, path: str | os.PathLike) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(text: str, path: str | os.PathLike) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically; returns the path."""
    return atomic_write_bytes(text.encode("utf-8"), path)


def atomic_write_json(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` (see :func:`to_jsonable`) as indented JSON to ``path`` atomically."""
    return atomic_write_text(json.dumps(to_jsonable(obj), indent=2) + "\n", path)


def atomic_save_torch(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (for checkpoints); returns the path."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Write a matplotlib ``Figure`` to ``path`` as PNG, atomically."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return atomic_write_bytes(buf.getvalue(), path)


def to_jsonable(obj: Any) -> Any:
    """Convert dataclasses, paths, tensors-of-one, torch dtypes/devices and containers to JSON.

    Non-finite floats are kept (``json`` writes them as ``NaN``/``Infinity``, which Python
    reads back); anything else that JSON cannot hold raises ``TypeError`` naming its type.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, torch.device | torch.dtype):
        return str(obj)
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    raise TypeError(f"cannot write a value of type {type(obj).__name__} to JSON: {obj!r}")
