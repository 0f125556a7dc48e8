"""CIFAR-10 and CIFAR-100: find, read, download and standardise (docs/reference.md §6).

Each image becomes one row of the residual stream's input::

    x[h, w, c] = (p[h, w, c] / 255 - mean[c]) / std[c],   then flattened in HWC order

so ``x`` has ``d = 32 * 32 * 3 = 3072`` entries and index ``(h * 32 + w) * 3 + c``. The
statistics are the usual training-set ones: CIFAR-10 mean (0.4914, 0.4822, 0.4465), std
(0.2470, 0.2435, 0.2616) as in docs/reference.md §6; CIFAR-100 mean (0.5071, 0.4865, 0.4409), std
(0.2673, 0.2564, 0.2762). They are fixed constants, not recomputed from the file read.

Formats read, looked for in this order in each data directory (CIFAR-10 names shown):

1. ``cifar10.npz`` (``cifar100.npz``) — arrays ``x_train (N, 32, 32, 3) uint8`` HWC RGB,
   ``y_train (N,)`` integer, ``x_test``, ``y_test``, ``class_names``; a CIFAR-100 npz may
   add ``y_train_coarse``, ``y_test_coarse`` and ``coarse_class_names``.
2. the extracted official folder ``cifar-10-batches-py/`` (``cifar-100-python/``);
3. the official archive ``cifar-10-python.tar.gz`` (``cifar-100-python.tar.gz``), read
   member by member without extracting it.

The official files are pickles of dicts with ``b"data" (n, 3072) uint8`` rows in planar CHW
order (1024 red, 1024 green, 1024 blue values) and ``b"labels"`` (CIFAR-10) or
``b"fine_labels"`` / ``b"coarse_labels"`` (CIFAR-100). They are unpickled with a restricted
unpickler that only builds dicts, lists, strings, numbers and numpy arrays, so a doctored
archive cannot run code.

Data directories, highest priority first: the ``data_dir`` argument (the CLI's
``--data-dir``), the environment variable ``RCDL_DATA``, the user cache folder
``$XDG_CACHE_HOME/rcdl`` (default ``~/.cache/rcdl``). When nothing is found and
``download=True``, the official archive is downloaded into the cache folder, checked
against its published MD5 and written atomically.

Example::

    data = load_cifar("cifar10", data_dir="../shared/data")
    small = data.subset(train_size=5000, test_size=1000, seed=0)
    small.x_train.shape  # torch.Size([5000, 3072])
"""

from __future__ import annotations

import hashlib
import http.client
import os
import pickle
import secrets
import tarfile
import urllib.request
import zipfile
import zlib
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, BinaryIO, NamedTuple

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from rcdl._io import file_sha256

__all__ = [
    "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR100_MEAN", "CIFAR100_STD", "CifarData",
    "CifarNotFoundError", "CorruptDataError", "cache_dir", "candidate_paths", "cifar_summary",
    "download_cifar", "find_cifar", "load_cifar", "standardize",
]  # fmt: skip

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

ENV_VAR = "RCDL_DATA"
_SIDE, _CHANNELS = 32, 3
_DIM = _SIDE * _SIDE * _CHANNELS  # 3072
_DOWNLOAD_TIMEOUT_S = 60.0
_CHUNK = 1 << 20


class CifarNotFoundError(FileNotFoundError):
    """No copy of the data set was found (and none could be downloaded).

    ``searched`` holds every path looked at, in the order they were tried; ``brief`` is
    the message in one line (the command line shows it; default: the first line).
    """

    def __init__(self, message: str, searched: list[Path], brief: str | None = None):
        super().__init__(message)
        self.searched = searched
        self.brief = brief if brief is not None else message.split("\n", 1)[0]


class CorruptDataError(ValueError):
    """A data file was found but cannot be used: truncated, corrupted or of the wrong layout."""


@dataclass(frozen=True)
class _Spec:
    title: str
    npz: str
    folder: str
    archive: str
    url: str
    md5: str
    train_members: tuple[str, ...]
    test_members: tuple[str, ...]
    meta_member: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    # label_mode -> (label key in a batch, names key in the meta pickle, number of classes)
    labels: dict[str, tuple[bytes, bytes, int]]


_SPECS = {
    "cifar10": _Spec(
        title="CIFAR-10",
        npz="cifar10.npz",
        folder="cifar-10-batches-py",
        archive="cifar-10-python.tar.gz",
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        md5="c58f30108f718f92721af3b95e74349a",
        train_members=tuple(f"data_batch_{i}" for i in range(1, 6)),
        test_members=("test_batch",),
        meta_member="batches.meta",
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        labels={"fine": (b"labels", b"label_names", 10)},
    ),
    "cifar100": _Spec(
        title="CIFAR-100",
        npz="cifar100.npz",
        folder="cifar-100-python",
        archive="cifar-100-python.tar.gz",
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        md5="eb9058c3a382ffc7106e288f42a36f30",
        train_members=("train",),
        test_members=("test",),
        meta_member="meta",
        mean=CIFAR100_MEAN,
        std=CIFAR100_STD,
        labels={
            "fine": (b"fine_labels", b"fine_label_names", 100),
            "coarse": (b"coarse_labels", b"coarse_label_names", 20),
        },
    ),
}


def _spec(name: str, label_mode: str = "fine") -> _Spec:
    if name not in _SPECS:
        raise ValueError(f"unknown data set {name!r}; expected one of {sorted(_SPECS)}")
    spec = _SPECS[name]
    if label_mode not in spec.labels:
        raise ValueError(
            f"{spec.title} has label modes {sorted(spec.labels)}, got label_mode={label_mode!r}"
        )
    return spec


# --------------------------------------------------------------------------- the result


@dataclass(frozen=True, eq=False)
class CifarData:
    """A standardised CIFAR split, ready for the residual stream.

    Attributes:
        x_train: ``(N_train, 3072)`` float32, ``(p / 255 - mean) / std`` flattened in HWC order.
        y_train: ``(N_train,)`` int64 class indices in ``[0, num_classes)``.
        x_test: ``(N_test, 3072)`` float32.
        y_test: ``(N_test,)`` int64.
        class_names: the ``num_classes`` class names in label order.
        name: ``"cifar10"`` or ``"cifar100"``.
        label_mode: ``"fine"``, or ``"coarse"`` for the 20 CIFAR-100 superclasses.
        source: the file or folder read (for the run record).
        mean: the per-channel mean used, ``(R, G, B)`` on the [0, 1] scale.
        std: the per-channel std used.
    """

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    class_names: tuple[str, ...]
    name: str
    label_mode: str
    source: Path
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def subset(
        self, train_size: int | None = None, test_size: int | None = None, seed: int = 0
    ) -> CifarData:
        """Random subsets, reproducible given ``seed``, in random order.

        The train and test draws use independent streams, so the test subset does not depend
        on ``train_size``. Random rather than leading rows because the npz test split on this
        machine is grouped by class. ``None`` keeps the whole split (shuffled).
        """
        train_seq, test_seq = np.random.SeedSequence(seed).spawn(2)
        train_idx = _draw(train_seq, len(self.y_train), train_size, "train_size")  # (n,)
        test_idx = _draw(test_seq, len(self.y_test), test_size, "test_size")
        return replace(
            self,
            x_train=self.x_train[train_idx], y_train=self.y_train[train_idx],
            x_test=self.x_test[test_idx], y_test=self.y_test[test_idx],
        )  # fmt: skip

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary for a run record."""
        return {
            "name": self.name, "label_mode": self.label_mode, "source": str(self.source),
            "n_train": len(self.y_train), "n_test": len(self.y_test),
            "num_classes": self.num_classes, "mean": list(self.mean), "std": list(self.std),
        }  # fmt: skip


def _draw(seq: np.random.SeedSequence, available: int, size: int | None, what: str) -> Tensor:
    if size is None:
        size = available
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= available:
        raise ValueError(f"{what} must be an int in [0, {available}], got {size!r}")
    perm = np.random.default_rng(seq).permutation(available)[:size]
    return torch.from_numpy(perm)


# --------------------------------------------------------------------------- preprocessing


def standardize(images: np.ndarray, mean: Iterable[float], std: Iterable[float]) -> Tensor:
    """``(N, 32, 32, 3)`` uint8 HWC images -> ``(N, 3072)`` float32 standardised rows.

    ``x[n, (h * 32 + w) * 3 + c] = (images[n, h, w, c] / 255 - mean[c]) / std[c]``, computed in
    float32 in place: the only allocation is the float32 output (4 bytes per pixel value).
    """
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (32, 32, 3):
        raise ValueError(f"expected (N, 32, 32, 3) uint8 images, got {images.shape} {images.dtype}")
    n = images.shape[0]
    out = torch.empty(n, _SIDE * _SIDE, _CHANNELS, dtype=torch.float32)  # (N, 1024, 3)
    out.copy_(torch.from_numpy(np.ascontiguousarray(images)).view(n, _SIDE * _SIDE, _CHANNELS))
    out.div_(255)
    out.sub_(torch.tensor(tuple(mean), dtype=torch.float32))  # broadcast over channels
    out.div_(torch.tensor(tuple(std), dtype=torch.float32))
    return out.view(n, _DIM)


# --------------------------------------------------------------------------- where to look


def cache_dir() -> Path:
    """The user cache folder: ``$XDG_CACHE_HOME/rcdl``, else ``~/.cache/rcdl``."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "rcdl"


def _data_dirs(data_dir: str | os.PathLike | None) -> list[tuple[Path, str]]:
    """The data directories, highest priority first, each with where it came from."""
    dirs = []
    if data_dir is not None:
        dirs.append((Path(data_dir).expanduser(), "data_dir argument / --data-dir"))
    env = os.environ.get(ENV_VAR)
    if env:
        dirs.append((Path(env).expanduser(), f"${ENV_VAR}"))
    dirs.append((cache_dir(), "user cache"))
    unique: list[tuple[Path, str]] = []  # a folder named twice is searched once
    for d, why in dirs:
        if all(d != seen for seen, _ in unique):
            unique.append((d, why))
    return unique


def candidate_paths(name: str = "cifar10", data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Every path ``load_cifar`` tries, in order: per directory the npz, folder, archive."""
    spec = _spec(name)
    return [d / f for d, _ in _data_dirs(data_dir) for f in (spec.npz, spec.folder, spec.archive)]


def find_cifar(name: str = "cifar10", data_dir: str | os.PathLike | None = None) -> Path | None:
    """The first existing candidate of :func:`candidate_paths`, or ``None``."""
    spec = _spec(name)
    for path in candidate_paths(name, data_dir):
        if path.is_dir() if path.name == spec.folder else path.is_file():
            return path
    return None


def _not_found_message(spec: _Spec, data_dir: str | os.PathLike | None, download_note: str) -> str:
    lines = [f"{spec.title} not found. Looked for, in this order:"]
    for d, why in _data_dirs(data_dir):
        for f in (spec.npz, spec.folder + "/", spec.archive):
            lines.append(f"  {d / f}   [{why}]")
    if not os.environ.get(ENV_VAR):
        lines.append(f"  (${ENV_VAR} is not set)")
    lines += [
        f"Download: {download_note}",
        "To provide the data, either:",
        f"  - pass --data-dir DIR (load_cifar(data_dir=DIR)) or set {ENV_VAR}=DIR, where DIR",
        f"    holds {spec.npz}, {spec.folder}/ or {spec.archive}; or",
        f"  - download the official archive {spec.url} (MD5 {spec.md5})",
        f"    into {cache_dir()}/ (load_cifar does this itself when the machine is online).",
    ]
    return "\n".join(lines)


def _brief_not_found(spec: _Spec, data_dir: str | os.PathLike | None,
                     download_error: str | None) -> str:
    """The not-found message in one line: what was looked for, where, and why no download
    helped (nothing is said when none was attempted)."""
    dirs = [str(d) for d, _ in _data_dirs(data_dir)]
    where = dirs[0] if len(dirs) == 1 else f"{', '.join(dirs[:-1])} or {dirs[-1]}"
    brief = f"{spec.title} not found: no {spec.npz}, {spec.folder}/ or {spec.archive} in {where}"
    return brief if download_error is None else f"{brief}; the download failed ({download_error})"


# --------------------------------------------------------------------------- download


def _open_url(url: str) -> BinaryIO:
    """Open ``url`` for reading: the module's only network access (tests replace it)."""
    return urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S)


def download_cifar(name: str = "cifar10", directory: str | os.PathLike | None = None) -> Path:
    """Download the official archive of ``name`` into ``directory`` (default: the cache).

    The bytes go to a temporary file in the same folder, with a tqdm progress bar; the MD5 is
    checked against the published one and only then is the file renamed into place
    (``os.replace``), so an interrupted or bad download never leaves a partial archive.

    Returns:
        the path of the archive.

    Raises:
        CorruptDataError: the MD5 does not match (the download is discarded).
        OSError: the download failed (``urllib.error.URLError`` is one).
    """
    spec = _spec(name)
    directory = Path(directory) if directory is not None else cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / spec.archive
    tmp = directory / f".{spec.archive}.{os.getpid()}.{secrets.token_hex(4)}.part"
    md5 = hashlib.md5(usedforsecurity=False)  # an integrity check, not security
    try:
        with _open_url(spec.url) as response, open(tmp, "xb") as f:
            headers = getattr(response, "headers", None)
            total = int(headers.get("Content-Length") or 0) if headers is not None else 0
            with tqdm(total=total or None, unit="B", unit_scale=True, unit_divisor=1024,
                      desc=f"downloading {spec.archive}") as bar:  # fmt: skip
                while chunk := response.read(_CHUNK):
                    f.write(chunk)
                    md5.update(chunk)
                    bar.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())
        if md5.hexdigest() != spec.md5:
            raise CorruptDataError(
                f"{spec.url}: the downloaded file has MD5 {md5.hexdigest()}, expected "
                f"{spec.md5} (corrupted or incomplete transfer); discarded, {dest} not written"
            )
        os.replace(tmp, dest)
    finally:
        with suppress(FileNotFoundError):
            tmp.unlink()
    return dest


# --------------------------------------------------------------------------- reading


class _Raw(NamedTuple):
    x_train: np.ndarray  # (N_train, 32, 32, 3) uint8 HWC
    y_train: np.ndarray  # (N_train,) int64
    x_test: np.ndarray
    y_test: np.ndarray
    class_names: tuple[str, ...]


class _SafeUnpickler(pickle.Unpickler):
    """Builds only plain containers and numpy arrays: what the official pickles hold."""

    _ALLOWED = {
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),
    }  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data pickle")
        return super().find_class(module, name)


_PICKLE_ERRORS = (
    pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, AttributeError,
    IndexError, ImportError, UnicodeDecodeError,
)  # fmt: skip


def _unpickle(f: IO[bytes], where: str) -> dict:
    try:
        obj = _SafeUnpickler(f, encoding="bytes").load()
    except _PICKLE_ERRORS as e:
        raise CorruptDataError(f"{where}: not a readable pickle ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise CorruptDataError(f"{where}: expected a pickled dict, got {type(obj).__name__}")
    return obj


def _get(d: dict, key: bytes, where: str) -> Any:
    if key not in d:
        raise CorruptDataError(f"{where}: no key {key!r} (keys: {sorted(map(repr, d))})")
    return d[key]


def _labels(labels: Any, n: int, num_classes: int, where: str) -> np.ndarray:
    """Check ``(n,)`` integer labels in ``[0, num_classes)``; return them as int64."""
    try:
        labels = np.asarray(labels)
    except (TypeError, ValueError) as e:
        raise CorruptDataError(f"{where}: labels are not an array ({e})") from e
    if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
        raise CorruptDataError(
            f"{where}: expected {n} integer labels (one per image), got shape {labels.shape} "
            f"dtype {labels.dtype}"
        )
    if n and (labels.min() < 0 or labels.max() >= num_classes):
        raise CorruptDataError(
            f"{where}: labels must lie in [0, {num_classes - 1}], found "
            f"[{labels.min()}, {labels.max()}]"
        )
    return labels.astype(np.int64, copy=False)


def _class_names(names: Any, num_classes: int, where: str) -> tuple[str, ...]:
    try:
        names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
    except (TypeError, UnicodeDecodeError) as e:
        raise CorruptDataError(f"{where}: class names are not a list of strings ({e})") from e
    if len(names) != num_classes:
        raise CorruptDataError(f"{where}: expected {num_classes} class names, got {len(names)}")
    return names


def _batch(obj: dict, label_key: bytes, num_classes: int, where: str):
    """One official batch dict -> ``(n, 32, 32, 3)`` uint8 HWC view, ``(n,)`` int64 labels."""
    data = _get(obj, b"data", where)
    if not isinstance(data, np.ndarray):
        raise CorruptDataError(f"{where}: b'data' must be a numpy array, got {type(data).__name__}")
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _DIM:
        got = f"{data.shape} {data.dtype}"
        raise CorruptDataError(f"{where}: b'data' must be (n, 3072) uint8 rows, got {got}")
    n = data.shape[0]
    labels = _labels(_get(obj, label_key, where), n, num_classes, where)
    images = data.reshape(n, _CHANNELS, _SIDE, _SIDE).transpose(0, 2, 3, 1)  # CHW -> HWC
    return images, labels


def _assemble(spec: _Spec, label_mode: str, pickles: dict[str, dict], where: dict) -> _Raw:
    label_key, names_key, num_classes = spec.labels[label_mode]
    splits = []
    for members in (spec.train_members, spec.test_members):
        batches = [_batch(pickles[m], label_key, num_classes, where[m]) for m in members]
        splits.append(np.concatenate([b[0] for b in batches]))  # (N, 32, 32, 3), contiguous
        splits.append(np.concatenate([b[1] for b in batches]))  # (N,)
    meta = spec.meta_member
    names = _class_names(_get(pickles[meta], names_key, where[meta]), num_classes, where[meta])
    x_train, y_train, x_test, y_test = splits
    return _Raw(x_train, y_train, x_test, y_test, names)


def _members(spec: _Spec) -> tuple[str, ...]:
    return (*spec.train_members, *spec.test_members, spec.meta_member)


def _read_folder(path: Path, spec: _Spec, label_mode: str) -> _Raw:
    pickles, where = {}, {}
    for m in _members(spec):
        file = path / m
        if not file.is_file():
            raise CorruptDataError(f"{path}: incomplete {spec.title} folder, {m} is missing")
        where[m] = str(file)
        with open(file, "rb") as f:
            pickles[m] = _unpickle(f, where[m])
    return _assemble(spec, label_mode, pickles, where)


def _read_archive(path: Path, spec: _Spec, label_mode: str) -> _Raw:
    wanted = {f"{spec.folder}/{m}": m for m in _members(spec)}
    pickles, where = {}, {}
    try:
        with tarfile.open(path, "r|gz") as tar:  # stream: one pass, no seeks, no extraction
            for info in tar:
                m = wanted.get(info.name.removeprefix("./"))
                if m is None or not info.isfile():
                    continue
                member = tar.extractfile(info)
                if member is None:  # never for a regular file
                    continue
                where[m] = f"{path} (member {info.name})"
                pickles[m] = _unpickle(member, where[m])
                if len(pickles) == len(wanted):
                    break
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise CorruptDataError(
            f"{path}: truncated or corrupted tar.gz archive ({type(e).__name__}: {e})"
        ) from e
    missing = sorted(set(wanted) - {f"{spec.folder}/{m}" for m in pickles})
    if missing:
        raise CorruptDataError(f"{path}: not a complete {spec.title} archive, missing {missing}")
    return _assemble(spec, label_mode, pickles, where)


def _read_npz(path: Path, spec: _Spec, label_mode: str) -> _Raw:
    suffix = "" if label_mode == "fine" else f"_{label_mode}"
    keys = ("x_train", f"y_train{suffix}", "x_test", f"y_test{suffix}",
            "class_names" if label_mode == "fine" else f"{label_mode}_class_names")  # fmt: skip
    errors = (zipfile.BadZipFile, zlib.error, EOFError, ValueError, pickle.UnpicklingError)
    with open(path, "rb") as f:  # np.load leaks its own handle when the zip is unreadable
        start = f.read(6)
        f.seek(0)
        if not start.startswith((b"PK\x03\x04", b"PK\x05\x06", b"\x93NUMPY")):
            raise CorruptDataError(  # numpy would blame allow_pickle, which is not the cause
                f"{path}: not an .npz archive (it starts with {start!r}, not a zip header): the "
                "file is damaged, truncated or of another kind; re-create or re-download it")
        try:
            npz = np.load(f, allow_pickle=False)
        except errors as e:
            raise CorruptDataError(f"{path}: not a readable npz ({type(e).__name__}: {e})") from e
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise CorruptDataError(f"{path}: expected an .npz archive, got a single .npy array")
        with npz:
            missing = [k for k in keys if k not in npz.files]
            if missing:
                raise CorruptDataError(
                    f"{path}: missing arrays {missing} for label_mode={label_mode!r} "
                    f"(has {sorted(npz.files)})"
                )
            try:
                arrays = [npz[k] for k in keys]  # decompresses each array once
            except errors as e:
                raise CorruptDataError(
                    f"{path}: truncated or corrupted npz ({type(e).__name__}: {e})"
                ) from e
    x_train, y_train, x_test, y_test, names = arrays
    num_classes = spec.labels[label_mode][2]
    for key, x in (("x_train", x_train), ("x_test", x_test)):
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (_SIDE, _SIDE, _CHANNELS):
            raise CorruptDataError(
                f"{path}: {key} must be (N, 32, 32, 3) uint8 HWC, got {x.shape} {x.dtype}"
            )
    y_train = _labels(y_train, len(x_train), num_classes, f"{path} ({keys[1]})")
    y_test = _labels(y_test, len(x_test), num_classes, f"{path} ({keys[3]})")
    class_names = _class_names(names.tolist(), num_classes, f"{path} ({keys[4]})")
    return _Raw(x_train, y_train, x_test, y_test, class_names)


def _read(path: Path, spec: _Spec, label_mode: str) -> _Raw:
    if path.name == spec.npz:
        return _read_npz(path, spec, label_mode)
    if path.is_dir():
        return _read_folder(path, spec, label_mode)
    return _read_archive(path, spec, label_mode)


# --------------------------------------------------------------------------- entry point


def load_cifar(
    name: str = "cifar10",
    data_dir: str | os.PathLike | None = None,
    *,
    label_mode: str = "fine",
    download: bool = True,
) -> CifarData:
    """Load CIFAR-10 or CIFAR-100, standardised and flattened (docs/reference.md §6).

    ``x = (p / 255 - mean) / std`` per channel, flattened in HWC order to 3072 float32 values;
    CIFAR-10 uses mean (0.4914, 0.4822, 0.4465), std (0.2470, 0.2435, 0.2616); CIFAR-100 its
    usual mean (0.5071, 0.4865, 0.4409), std (0.2673, 0.2564, 0.2762).

    Args:
        name: ``"cifar10"`` or ``"cifar100"``.
        data_dir: the folder to look in first (the CLI's ``--data-dir``); then ``$RCDL_DATA``,
            then the cache folder (see :func:`candidate_paths`).
        label_mode: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses) for CIFAR-100;
            CIFAR-10 has only ``"fine"``.
        download: when no local copy is found, download the official archive into the cache
            folder (see :func:`download_cifar`).

    Returns:
        a :class:`CifarData` with ``x_train (N_train, 3072)``, ``y_train (N_train,)``,
        ``x_test (N_test, 3072)``, ``y_test (N_test,)``; ``source`` is the path read.

    Raises:
        CifarNotFoundError: nothing found and no download (the message lists every path tried,
            why the download did not happen, and how to provide the data; its ``brief``
            says it in one line).
        CorruptDataError: a file was found or downloaded but is truncated, corrupted or of
            the wrong layout; the message names the file.
    """
    spec = _spec(name, label_mode)
    if data_dir is not None and Path(data_dir).expanduser().is_file():
        raise ValueError(f"data_dir must be a folder holding {spec.npz} etc., got file {data_dir}")
    path = find_cifar(name, data_dir)
    if path is None:
        failure = None
        if not download:
            note = "not attempted (download=False)"
        else:
            try:
                path = download_cifar(name)
            except (OSError, http.client.HTTPException) as e:
                failure = f"{type(e).__name__}: {e}"
                note = f"from {spec.url} failed: {failure}"
        if path is None:
            raise CifarNotFoundError(
                _not_found_message(spec, data_dir, note), candidate_paths(name, data_dir),
                brief=_brief_not_found(spec, data_dir, failure),
            )
    images_train, y_train, images_test, y_test, class_names = _read(path, spec, label_mode)
    x_train = standardize(images_train, spec.mean, spec.std)
    del images_train  # frees the uint8 images
    x_test = standardize(images_test, spec.mean, spec.std)
    del images_test
    return CifarData(
        x_train=x_train, y_train=torch.from_numpy(y_train),
        x_test=x_test, y_test=torch.from_numpy(y_test),
        class_names=class_names, name=name, label_mode=label_mode, source=path,
        mean=spec.mean, std=spec.std,
    )  # fmt: skip


# ----------------------------------------------------------------------------- provenance

# SHA-256 of the JPEG-decoded CIFAR-10 copy described in shared/data/README.md and docs/data.md
_LOSSY_NPZ_SHA256 = "ceb463d2555a42a78d4a20ad460779f39fd9d827bc592b2b09b8dc850425cc09"
# SHA-256 of the same copy's arrays (see _array_digest): recognises it re-saved, e.g. uncompressed
_LOSSY_ARRAYS_SHA256 = "181097d0bc6ef07e5392cdb48337aeebc8ed12618473cc40878288ce20013db4"


def data_provenance(source: Path) -> str:
    """What the data file is, for the results table (lossy JPEG copy or official files)."""
    if source.is_dir() or source.name.endswith(".tar.gz"):
        return "the official CIFAR-10 files (lossless)"
    if file_sha256(source) == _LOSSY_NPZ_SHA256 or _array_digest(source) == _LOSSY_ARRAYS_SHA256:
        return ("the JPEG-decoded copy of CIFAR-10 (lossy, about 30 dB PSNR from the original "
                "pixels; models trained on it are known to lose about 2–3 points against the "
                "paper's numbers; see docs/data.md)")
    return "an npz copy of unknown provenance (not the known JPEG-decoded one)"


def _array_digest(source: Path) -> str | None:
    """SHA-256 over the name, dtype, shape and bytes of the four arrays of an npz copy, so
    that the same images saved again (compressed or not) are recognised; None if unreadable."""
    digest = hashlib.sha256()
    try:
        with np.load(source) as arrays:
            for key in ("x_train", "y_train", "x_test", "y_test"):
                a = np.ascontiguousarray(arrays[key])
                for part in (key, str(a.dtype), str(a.shape)):
                    digest.update(part.encode())
                digest.update(a.tobytes())
    except (OSError, KeyError, ValueError):
        return None
    return digest.hexdigest()


def load_subsets(name: str, cfg: Any, *, download: bool = True,
                 whole_in_order: bool = False) -> CifarData:  # fmt: skip
    """Data set ``name`` (``"cifar10"`` or ``"cifar100"``) from ``cfg.data_dir`` (or the
    usual places, :func:`load_cifar`), cut to the random subsets ``cfg.train_size`` /
    ``cfg.test_size`` drawn with ``cfg.data_seed`` (``None``: the whole split, shuffled, or
    as stored when both are ``None`` and ``whole_in_order``, the one-epoch protocol's order).

    Raises:
        CifarNotFoundError, CorruptDataError: from the loader.
        ValueError: if a subset is larger than the split.
    """
    data = load_cifar(name, cfg.data_dir, download=download)
    if whole_in_order and cfg.train_size is None and cfg.test_size is None:
        return data
    for what, size, available in (("train_size", cfg.train_size, len(data.y_train)),
                                  ("test_size", cfg.test_size, len(data.y_test))):  # fmt: skip
        if size is not None and size > available:
            raise ValueError(f"{what} {size} is larger than the {available} images of "
                             f"{data.source}")
    return data.subset(cfg.train_size, cfg.test_size, seed=cfg.data_seed)


def cifar_summary(cfg: Any, data: CifarData) -> dict[str, Any]:
    """A run summary's ``data`` entry: what the data set is, where it came from, and the
    config's ``data_seed`` (of the subsets)."""
    return {"data": {**data.describe(), "provenance": data_provenance(data.source),
                     "data_seed": cfg.data_seed}}  # fmt: skip
