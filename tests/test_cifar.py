"""The CIFAR loader: layouts, pixel layout and standardisation, search order, errors, download.

Every test builds tiny files in the official layouts under ``tmp_path``; no test touches the
network (``_open_url`` is replaced by a function that fails the test unless a test mocks it).
"""

import dataclasses
import hashlib
import io
import os
import pickle
import re
import shutil
import tarfile
import urllib.error
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from rcdl.app import cifar
from rcdl.app.cifar import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    CifarNotFoundError,
    CorruptDataError,
    load_cifar,
)

C10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
             "truck"]  # fmt: skip
C10_BATCH_SIZES = (3, 2, 1, 2, 2)  # the loader takes any number of rows per batch file
REAL_NPZ = Path("/work/shared/data/cifar10.npz")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No network, no $RCDL_DATA, and a cache folder of our own for every test."""

    def no_network(url):
        raise AssertionError(f"a test tried to open {url}")

    monkeypatch.setattr(cifar, "_open_url", no_network)
    monkeypatch.delenv("RCDL_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def _images(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)


def _rows(images):
    """HWC images -> official rows: 1024 red, 1024 green, 1024 blue values, row-major."""
    return images.transpose(0, 3, 1, 2).reshape(len(images), 3072)


def _expected(images, mean, std):
    """The standardised vector of docs/reference.md §6, in float64: (p / 255 - mean) / std flattened
    in HWC order."""
    x = (images.astype(np.float64) / 255 - np.array(mean)) / np.array(std)
    return torch.from_numpy(x.reshape(len(images), 3072)).float()


def _dump(obj):
    return pickle.dumps(obj, protocol=2)


@dataclasses.dataclass
class Synthetic:
    """A tiny data set and its files in the official layout (member name -> pickle bytes)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    members: dict
    folder: str
    archive: str

    def write_folder(self, root):
        (root / self.folder).mkdir(parents=True)
        for name, blob in self.members.items():
            (root / self.folder / name).write_bytes(blob)
        return root / self.folder

    def archive_bytes(self):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for name, blob in self.members.items():
                info = tarfile.TarInfo(f"{self.folder}/{name}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
        return buf.getvalue()

    def write_archive(self, root):
        root.mkdir(parents=True, exist_ok=True)
        (root / self.archive).write_bytes(self.archive_bytes())
        return root / self.archive


def _cifar10():
    x_train, x_test = _images(sum(C10_BATCH_SIZES), 0), _images(4, 1)
    rng = np.random.default_rng(2)
    y_train, y_test = rng.integers(0, 10, len(x_train)), rng.integers(0, 10, len(x_test))
    members, start = {}, 0
    for i, n in enumerate(C10_BATCH_SIZES, start=1):
        rows = slice(start, start + n)
        members[f"data_batch_{i}"] = _dump({
            b"batch_label": b"training batch", b"data": _rows(x_train[rows]),
            b"labels": [int(v) for v in y_train[rows]], b"filenames": [b"f.png"] * n,
        })  # fmt: skip
        start += n
    members["test_batch"] = _dump({b"data": _rows(x_test), b"labels": y_test.tolist()})
    members["batches.meta"] = _dump({b"label_names": [s.encode() for s in C10_NAMES]})
    return Synthetic(x_train, y_train, x_test, y_test, members, "cifar-10-batches-py",
                     "cifar-10-python.tar.gz")  # fmt: skip


def _cifar100():
    x_train, x_test = _images(6, 3), _images(3, 4)
    rng = np.random.default_rng(5)
    fine_train, fine_test = rng.integers(0, 100, 6), rng.integers(0, 100, 3)
    coarse = {"train": fine_train // 5, "test": fine_test // 5}
    members = {
        split: _dump({b"data": _rows(x), b"fine_labels": fine.tolist(),
                      b"coarse_labels": coarse[split].tolist()})
        for split, x, fine in (("train", x_train, fine_train), ("test", x_test, fine_test))
    }  # fmt: skip
    members["meta"] = _dump({
        b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
        b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)],
    })  # fmt: skip
    synthetic = Synthetic(x_train, fine_train, x_test, fine_test, members, "cifar-100-python",
                          "cifar-100-python.tar.gz")  # fmt: skip
    synthetic.coarse = coarse
    return synthetic


def _write_npz(path, x_train, y_train, x_test, y_test, names=C10_NAMES, **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                        class_names=np.array(names), **extra)  # fmt: skip
    return path


def _write_c10(root, kind):
    """Write the synthetic CIFAR-10 under ``root`` as ``kind``; return (data, path)."""
    data = _cifar10()
    if kind == "npz":
        path = _write_npz(root / "cifar10.npz", data.x_train, data.y_train, data.x_test,
                          data.y_test)  # fmt: skip
    elif kind == "folder":
        path = data.write_folder(root)
    else:
        path = data.write_archive(root)
    return data, path


# --------------------------------------------------------------------------- layouts and values


def test_one_known_pixel_lands_at_its_hwc_index(tmp_path):
    """Official row index c*1024 + h*32 + w -> flattened index (h*32 + w)*3 + c."""
    data = _cifar10()
    row = np.zeros(3072, np.uint8)
    h, w, c = 5, 17, 2
    row[c * 1024 + h * 32 + w] = 255
    row[0 * 1024 + 31 * 32 + 0] = 51  # red at (h=31, w=0)
    meta = {b"label_names": [s.encode() for s in C10_NAMES]}
    members = dict.fromkeys(data.members, _dump({b"data": row[None], b"labels": [7]}))
    members["batches.meta"] = _dump(meta)
    dataclasses.replace(data, members=members).write_folder(tmp_path)

    x = load_cifar("cifar10", tmp_path, download=False).x_test[0]  # (3072,)
    mean, std = torch.tensor(CIFAR10_MEAN), torch.tensor(CIFAR10_STD)
    expected = (-mean / std).repeat(1024)  # every zero pixel
    expected[(h * 32 + w) * 3 + c] = (1 - mean[c]) / std[c]
    expected[(31 * 32 + 0) * 3 + 0] = (51 / 255 - mean[0]) / std[0]
    torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("kind", ["npz", "folder", "tar.gz"])
def test_cifar10_round_trip(tmp_path, kind):
    data, path = _write_c10(tmp_path, kind)
    got = load_cifar("cifar10", tmp_path, download=False)
    assert got.source == path and got.name == "cifar10" and got.num_classes == 10
    assert got.class_names == tuple(C10_NAMES)
    assert got.x_train.dtype == torch.float32 and got.x_train.shape == (10, 3072)
    torch.testing.assert_close(got.x_train, _expected(data.x_train, CIFAR10_MEAN, CIFAR10_STD))
    torch.testing.assert_close(got.x_test, _expected(data.x_test, CIFAR10_MEAN, CIFAR10_STD))
    assert got.y_train.dtype == torch.int64
    assert got.y_train.tolist() == data.y_train.tolist()
    assert got.y_test.tolist() == data.y_test.tolist()


@pytest.mark.parametrize("kind", ["folder", "tar.gz"])
@pytest.mark.parametrize("label_mode", ["fine", "coarse"])
def test_cifar100_label_modes(tmp_path, kind, label_mode):
    data = _cifar100()
    path = data.write_folder(tmp_path) if kind == "folder" else data.write_archive(tmp_path)
    got = load_cifar("cifar100", tmp_path, label_mode=label_mode, download=False)
    assert got.source == path and got.label_mode == label_mode
    want_train = data.y_train if label_mode == "fine" else data.coarse["train"]
    want_test = data.y_test if label_mode == "fine" else data.coarse["test"]
    assert got.y_train.tolist() == want_train.tolist()
    assert got.y_test.tolist() == want_test.tolist()
    assert got.num_classes == (100 if label_mode == "fine" else 20)
    assert got.class_names[3] == f"{label_mode}3"
    torch.testing.assert_close(got.x_train, _expected(data.x_train, CIFAR100_MEAN, CIFAR100_STD))


def test_cifar100_npz_coarse_labels_are_optional_arrays(tmp_path):
    data = _cifar100()
    fine = [f"fine{i}" for i in range(100)]
    _write_npz(tmp_path / "cifar100.npz", data.x_train, data.y_train, data.x_test, data.y_test,
               names=fine)  # fmt: skip
    assert load_cifar("cifar100", tmp_path, download=False).num_classes == 100
    with pytest.raises(CorruptDataError, match=r"cifar100.npz.*missing arrays.*y_train_coarse"):
        load_cifar("cifar100", tmp_path, label_mode="coarse", download=False)


@pytest.mark.parametrize(
    ("name", "label_mode", "match"),
    [("cifar10", "coarse", "CIFAR-10 has label modes"), ("mnist", "fine", "unknown data set")],
)
def test_bad_name_or_label_mode(tmp_path, name, label_mode, match):
    with pytest.raises(ValueError, match=match):
        load_cifar(name, tmp_path, label_mode=label_mode, download=False)


def test_subset_is_reproducible_random_and_independent_of_train_size(tmp_path):
    _write_c10(tmp_path, "npz")
    full = load_cifar("cifar10", tmp_path, download=False)
    a, b = full.subset(6, 3, seed=1), full.subset(6, 3, seed=1)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert a.x_train.shape == (6, 3072) and a.y_test.shape == (3,)
    assert not torch.equal(a.y_train, full.subset(6, 3, seed=2).y_train)
    assert torch.equal(full.subset(2, 3, seed=1).x_test, a.x_test)
    rows = {tuple(r.tolist()) for r in full.x_train}  # every subset row is a row of the split
    assert all(tuple(r.tolist()) in rows for r in a.x_train)
    assert a.source == full.source and a.describe()["n_train"] == 6
    with pytest.raises(ValueError, match="train_size"):
        full.subset(11, 3)


# --------------------------------------------------------------------------- where to look


def test_search_order_flag_then_env_then_cache(tmp_path, monkeypatch):
    flag, env, cache = tmp_path / "flag", tmp_path / "env", tmp_path / "xdg-cache" / "rcdl"
    for d in (flag, env, cache):
        _write_c10(d, "npz")
    monkeypatch.setenv("RCDL_DATA", str(env))
    assert load_cifar("cifar10", flag, download=False).source == flag / "cifar10.npz"
    assert load_cifar("cifar10", download=False).source == env / "cifar10.npz"
    monkeypatch.delenv("RCDL_DATA")
    assert load_cifar("cifar10", download=False).source == cache / "cifar10.npz"
    # a directory without the data falls through to the next one
    assert load_cifar("cifar10", tmp_path / "empty", download=False).source.parent == cache


def test_cache_defaults_to_home_dot_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _, path = _write_c10(tmp_path / "home" / ".cache" / "rcdl", "tar.gz")
    assert cifar.cache_dir() == tmp_path / "home" / ".cache" / "rcdl"
    assert load_cifar("cifar10", download=False).source == path


def test_within_a_directory_npz_then_folder_then_archive(tmp_path):
    _write_c10(tmp_path, "npz")
    _write_c10(tmp_path, "folder")
    _write_c10(tmp_path, "tar.gz")
    for expected in ("cifar10.npz", "cifar-10-batches-py", "cifar-10-python.tar.gz"):
        source = load_cifar("cifar10", tmp_path, download=False).source
        assert source == tmp_path / expected
        shutil.rmtree(source) if source.is_dir() else source.unlink()


def test_not_found_lists_every_path_and_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("RCDL_DATA", str(tmp_path / "env"))
    with pytest.raises(CifarNotFoundError) as info:
        load_cifar("cifar10", tmp_path / "flag", download=False)
    err = info.value
    assert isinstance(err, FileNotFoundError)
    dirs = [tmp_path / "flag", tmp_path / "env", tmp_path / "xdg-cache" / "rcdl"]
    names = ["cifar10.npz", "cifar-10-batches-py", "cifar-10-python.tar.gz"]
    assert err.searched == [d / n for d in dirs for n in names]
    message = str(err)
    for path in err.searched:
        assert str(path) in message
    for needle in ("--data-dir", "RCDL_DATA", cifar._SPECS["cifar10"].url, "download=False"):
        assert needle in message


def test_not_found_brief_is_one_line_naming_files_and_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("RCDL_DATA", str(tmp_path / "env"))
    with pytest.raises(CifarNotFoundError) as info:
        load_cifar("cifar10", tmp_path / "flag", download=False)
    dirs = f"{tmp_path / 'flag'}, {tmp_path / 'env'} or {tmp_path / 'xdg-cache' / 'rcdl'}"
    assert info.value.brief == ("CIFAR-10 not found: no cifar10.npz, cifar-10-batches-py/ or "
                                f"cifar-10-python.tar.gz in {dirs}")  # fmt: skip

    def offline(url):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(cifar, "_open_url", offline)
    with pytest.raises(CifarNotFoundError) as info:
        load_cifar("cifar100", tmp_path / "flag")
    brief = info.value.brief
    assert "\n" not in brief and brief.startswith("CIFAR-100 not found: no cifar100.npz")
    assert brief.endswith("; the download failed (URLError: <urlopen error Name or service "
                          "not known>)")  # fmt: skip
    assert CifarNotFoundError("first line\nmore", []).brief == "first line"


def test_a_folder_named_twice_is_searched_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RCDL_DATA", str(tmp_path / "data"))
    with pytest.raises(CifarNotFoundError) as info:
        load_cifar("cifar100", tmp_path / "data", download=False)
    assert [p.parent.name for p in info.value.searched] == ["data"] * 3 + ["rcdl"] * 3
    monkeypatch.delenv("RCDL_DATA")
    with pytest.raises(CifarNotFoundError, match=r"\(\$RCDL_DATA is not set\)"):
        load_cifar("cifar100", download=False)


def test_failed_download_becomes_not_found_with_the_reason(tmp_path, monkeypatch):
    def offline(url):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(cifar, "_open_url", offline)
    with pytest.raises(CifarNotFoundError, match=r"(?s)failed.*Name or service not known"):
        load_cifar("cifar100", tmp_path / "flag")
    assert not list((tmp_path / "xdg-cache" / "rcdl").iterdir())  # no partial file left


# --------------------------------------------------------------------------- download


class _Response(io.BytesIO):
    def __init__(self, blob):
        super().__init__(blob)
        self.headers = {"Content-Length": str(len(blob))}


def test_download_when_nothing_is_local(tmp_path, monkeypatch):
    data = _cifar10()
    blob = data.archive_bytes()
    spec = dataclasses.replace(cifar._SPECS["cifar10"], md5=hashlib.md5(blob).hexdigest())
    monkeypatch.setitem(cifar._SPECS, "cifar10", spec)
    requested = []
    monkeypatch.setattr(cifar, "_open_url", lambda url: requested.append(url) or _Response(blob))

    got = load_cifar("cifar10", tmp_path / "flag")
    cache = tmp_path / "xdg-cache" / "rcdl"
    assert requested == ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"]
    assert got.source == cache / "cifar-10-python.tar.gz"
    assert sorted(p.name for p in cache.iterdir()) == ["cifar-10-python.tar.gz"]
    assert got.y_train.tolist() == data.y_train.tolist()
    load_cifar("cifar10", download=True)  # found locally now: no second request
    assert len(requested) == 1


def test_md5_mismatch_discards_the_download(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar, "_open_url", lambda url: _Response(_cifar10().archive_bytes()))
    with pytest.raises(
        CorruptDataError, match=r"cifar-10-python.tar.gz: the downloaded file has MD5"
    ):
        load_cifar("cifar10")
    assert not list((tmp_path / "xdg-cache" / "rcdl").iterdir())


# --------------------------------------------------------------------------- bad files


def test_truncated_archive_names_the_file(tmp_path):
    path = _cifar10().write_archive(tmp_path)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(
        CorruptDataError, match=rf"{re.escape(str(path))}: truncated or corrupted tar.gz"
    ):
        load_cifar("cifar10", tmp_path, download=False)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "bad member"])
def test_corrupted_npz_names_the_file(tmp_path, damage):
    _, path = _write_c10(tmp_path, "npz")
    blob = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "garbage":
        path.write_bytes(b"this is not a zip file at all" * 10)
    else:  # a valid zip whose x_train member is not an npy array
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("x_train.npy", b"\x93NUMPY broken")
            for key in ("y_train", "x_test", "y_test", "class_names"):
                z.writestr(f"{key}.npy", b"")
    with pytest.raises(CorruptDataError, match=re.escape(str(path))):
        load_cifar("cifar10", tmp_path, download=False)


def test_a_text_file_named_npz_is_not_blamed_on_pickles(tmp_path):
    """numpy's own message for it advises allow_pickle=True, which would be wrong advice."""
    _, path = _write_c10(tmp_path, "npz")
    path.write_text("x_train,y_train\n1,2\n")
    with pytest.raises(CorruptDataError, match="not an .npz archive") as caught:
        load_cifar("cifar10", tmp_path, download=False)
    assert "pickle" not in str(caught.value) and str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"x_train": np.zeros((2, 32, 32), np.uint8)}, r"x_train must be \(N, 32, 32, 3\) uint8"),
        ({"x_test": np.zeros((4, 32, 32, 3), np.float32)}, "x_test must be"),
        ({"y_train": np.full(10, 10)}, r"labels must lie in \[0, 9\], found \[10, 10\]"),
        ({"y_test": np.zeros(3, np.int64)}, "expected 4 integer labels"),
        ({"names": C10_NAMES[:9]}, "expected 10 class names, got 9"),
    ],
    ids=["x-shape", "x-dtype", "label-range", "label-count", "class-names"],
)
def test_npz_with_wrong_contents(tmp_path, change, match):
    data = _cifar10()
    arrays = {"x_train": data.x_train, "y_train": data.y_train, "x_test": data.x_test,
              "y_test": data.y_test, "names": C10_NAMES, **change}  # fmt: skip
    path = _write_npz(tmp_path / "cifar10.npz", **arrays)
    with pytest.raises(CorruptDataError, match=rf"{re.escape(str(path))}.*{match}"):
        load_cifar("cifar10", tmp_path, download=False)


@pytest.mark.parametrize(
    ("member", "blob", "match"),
    [
        ("data_batch_2", b"not a pickle", "not a readable pickle"),
        ("data_batch_3", _dump([1, 2]), "expected a pickled dict, got list"),
        ("test_batch", _dump({b"labels": [0]}), "no key b'data'"),
        ("test_batch", _dump({b"data": np.zeros((1, 3071), np.uint8), b"labels": [0]}),
         r"b'data' must be \(n, 3072\) uint8 rows"),
        ("test_batch", _dump({b"data": np.zeros((1, 3072), np.uint8), b"labels": [12]}),
         r"labels must lie in \[0, 9\]"),
        ("batches.meta", _dump({b"label_names": [b"a"]}), "expected 10 class names"),
        ("data_batch_1", pickle.dumps(os.getcwd), "refusing to load posix.getcwd"),
    ],
    ids=["garbage", "not-dict", "no-data", "row-width", "label-range", "names", "code"],
)  # fmt: skip
@pytest.mark.parametrize("kind", ["folder", "tar.gz"])
def test_bad_official_member_names_the_file(tmp_path, kind, member, blob, match):
    data = _cifar10()
    data.members[member] = blob
    data.write_folder(tmp_path) if kind == "folder" else data.write_archive(tmp_path)
    with pytest.raises(CorruptDataError, match=rf"{data.folder}/{member}.*{match}"):
        load_cifar("cifar10", tmp_path, download=False)


def test_incomplete_folder_names_the_missing_file(tmp_path):
    folder = _cifar10().write_folder(tmp_path)
    (folder / "data_batch_4").unlink()
    with pytest.raises(
        CorruptDataError, match=rf"{re.escape(str(folder))}: incomplete .* data_batch_4"
    ):
        load_cifar("cifar10", tmp_path, download=False)


def test_data_dir_must_be_a_folder(tmp_path):
    _, path = _write_c10(tmp_path, "npz")
    with pytest.raises(ValueError, match="data_dir must be a folder"):
        load_cifar("cifar10", path, download=False)


# --------------------------------------------------------------------------- the real copy


@pytest.mark.skipif(not REAL_NPZ.is_file(), reason=f"{REAL_NPZ} not on this machine")
def test_real_cifar10_npz_layout():
    """Shapes and dtypes from the npy headers (no 150 MB decompression), labels in full."""
    with np.load(REAL_NPZ) as npz, zipfile.ZipFile(REAL_NPZ) as z:
        for key, shape in (("x_train", (50000, 32, 32, 3)), ("x_test", (10000, 32, 32, 3))):
            with z.open(f"{key}.npy") as f:
                assert np.lib.format.read_magic(f) == (1, 0)
                header = np.lib.format.read_array_header_1_0(f)  # (shape, fortran, dtype)
            assert header[0] == shape and header[2] == np.uint8
        assert np.bincount(npz["y_train"]).tolist() == [5000] * 10
        assert np.bincount(npz["y_test"]).tolist() == [1000] * 10
        assert npz["class_names"].tolist() == C10_NAMES


@pytest.mark.slow
@pytest.mark.skipif(not REAL_NPZ.is_file(), reason=f"{REAL_NPZ} not on this machine")
def test_real_cifar10_npz_loads():
    data = load_cifar("cifar10", REAL_NPZ.parent, download=False)
    assert data.x_train.shape == (50000, 3072) and data.x_test.shape == (10000, 3072)
    per_channel = data.x_train.view(-1, 3)  # (50000 * 1024, 3)
    assert per_channel.mean(0).abs().max() < 0.01  # the JPEG copy is close to the official stats
    assert (per_channel.std(0) - 1).abs().max() < 0.02
