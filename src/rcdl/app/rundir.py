"""Self-describing run folders and atomic file writes.

A run folder holds everything needed to read a run back without its author:

    runs/<name>-<YYYYmmdd-HHMMSS>/
        config.json       the resolved config (a dataclass, via dataclasses.asdict)
        environment.json  the experiment; python, torch, device, threads, host, git revision,
                          command line; the compute paths the run takes (half-precision
                          products, the Triton attention's checks)
        metrics.jsonl     one JSON object per line, appended and flushed as the run goes
        summary.json      the final results
        finished.json     the results of the sub-runs finished so far, by name (for resume)
        ...               plots, tables, checkpoints (written with the atomic helpers)

Every whole-file write goes to a temporary file in the same folder, is fsynced and then
moved into place with ``os.replace``, so a reader (or a resumed run) never sees half a file.

An experiment made of independent sub-runs (model × seed, policy × capacity...) resumes
through :meth:`RunDir.sub_run`, :func:`open_run` and :func:`read_config`: each finished
sub-run's result is saved at once, and a resumed session reads it back instead of
training it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from rcdl._cpu import cpuinfo_field, cpuinfo_flags
from rcdl._io import (  # noqa: F401 - re-exported: the run folder writes through them
    atomic_save_torch,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    holder,
    lock_exclusively,
    save_figure,
    to_jsonable,
)
from rcdl._version import __version__
from rcdl.app.allocator import allocator_setting
from rcdl.distributed import rank_and_world
from rcdl.ops.half import (
    PRODUCTS,
    native_products,
    product_path,
    product_record,
    product_record_problem,
)
from rcdl.ops.packed import PACKED, packed_dtypes
from rcdl.ops.plan import clear_layer_products, layer_products
from rcdl.ops.triton_attention import triton_paths
from rcdl.optim.half_adam import ADAM_MODE, path_description

__all__ = [
    "rank0_run",
    "FollowerRunDir",
    "RunDir",
    "RunFailed",
    "RunFolderBusy",
    "describe_failure",
    "atomic_save_torch",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "cpu_flags",
    "cpu_model",
    "environment_info",
    "native_bfloat16",
    "open_run",
    "read_config",
    "resume_command",
    "run_paths",
    "to_jsonable",
]


# ----------------------------------------------------------------------------- environment


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


# The CPU flags that decide how fast the attention's products run (docs/precision.md): AVX2/FMA
# and AVX512 for float32; avx512_bf16 and AMX multiply bfloat16 natively, avx512_fp16 float16.
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


X86 = ("x86_64", "amd64", "i386", "i686", "x86")
# The ISA levels told apart, widest first, with the CPU flags (/proc/cpuinfo) each needs.
ISA_LEVELS = (("amx_bf16", ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")),
              ("avx512_bf16", ("avx512f", "avx512_bf16")), ("avx512", ("avx512f",)),
              ("avx2", ("avx2", "fma")))


def cpu_isa(cpuinfo: str | None = None, arch: str | None = None) -> str:
    """This CPU's class for float results: on x86 the widest of ``amx_bf16``,
    ``avx512_bf16``, ``avx512``, ``avx2`` its flags have (``x86-other`` below AVX2 or without
    ``/proc/cpuinfo``); elsewhere the architecture (``aarch64``, ``arm64``, ...). AMX is a
    class of its own: oneDNN multiplies bfloat16 and float32 on its tiles, rounding otherwise
    than the AVX512 kernels of a CPU with avx512_bf16 alone.

    The BLAS and oneDNN kernels torch picks, and so the rounding of every matrix product,
    follow the vector ISA, so runs on CPUs of different classes round differently
    (docs/results.md)."""
    arch = (arch if arch is not None else platform.machine()).lower() or "unknown"
    if arch not in X86:
        return arch
    flags = cpuinfo_flags(cpuinfo)
    for isa, needs in ISA_LEVELS:
        if flags.issuperset(needs):
            return isa
    return "x86-other"


def machine_key(isa: str | None, torch: str | None, threads: int | None) -> str | None:
    """The machine class float results are reproducible on, e.g.
    ``amx_bf16 / torch 2.13.0+cpu / 1 thread``; ``None`` if any part is unknown."""
    if not (isa and torch and threads):
        return None
    return f"{isa} / torch {torch} / {count(threads, 'thread')}"


def count(n: int | None, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``count(1, "thread") == "1 thread"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def cpu_flags() -> list[str]:
    """Which of :data:`SPEED_FLAGS` this CPU has (from ``/proc/cpuinfo``; empty where it is
    not readable or on other architectures)."""
    have = cpuinfo_flags()
    return [flag for flag in SPEED_FLAGS if flag in have]


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (``/proc/cpuinfo``, else :func:`platform.processor`)."""
    return cpuinfo_field("model name", cpuinfo) or platform.processor() or "unknown CPU"


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (``avx512_bf16`` or ``amx_bf16``;
    :func:`rcdl.ops.half.native_products`, which picks the attention's product path)."""
    return native_products(torch.bfloat16, "cpu")


# the variables that cap the instruction sets torch, oneDNN, MKL and numba use
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
            "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")


def environment_info(device: str | torch.device | None = None) -> dict[str, Any]:
    """Describe the machine and code a run used.

    The git revision is that of the repository holding the rcdl source (``None`` for an
    installed wheel or a repository without commits); ``git_dirty`` says whether the
    working tree differs from it (untracked files included). ``half_products`` and
    ``half_adam`` are the process-wide defaults of the two half-precision options
    (:mod:`rcdl.options`), and ``half_product_paths`` the path a bfloat16 and a float16
    store take on ``device`` under that default (:func:`rcdl.ops.half.product_path`), and
    ``half_adam_paths`` how the hybrid's Adam step moves their entries
    (:func:`rcdl.optim.half_adam.path_description`). ``packed_chunks`` is the mode of
    :mod:`rcdl.ops.packed` and ``packed_chunk_dtypes`` whether it packs a float32 and a
    bfloat16 store's chunks here. ``cpu_capability`` is the vector ISA
    torch's own kernels run at, and ``isa_caps`` the variables of :data:`ISA_CAPS` set in the
    process (an emulated machine class, docs/precision.md; numba's two are set by rcdl itself
    when it compiles its kernels, so they are read after the paths above chose them).
    """
    src = Path(__file__).resolve().parent
    revision = _git(["rev-parse", "HEAD"], src)
    dirty = None if revision is None else bool(_git(["status", "--porcelain"], src))
    cuda = torch.cuda.is_available()
    where = torch.device("cpu" if device is None else device)
    return {
        "rcdl": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": None if device is None else str(device),
        "cuda_available": cuda,
        "cuda_device": torch.cuda.get_device_name() if cuda else None,
        "num_threads": torch.get_num_threads(),
        "malloc": allocator_setting(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "git_revision": revision,
        "git_dirty": dirty,
        "command": list(sys.argv),
        "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "half_products": PRODUCTS.get(),
        "half_product_paths": {str(dtype).removeprefix("torch."): product_path(dtype, where)
                               for dtype in (torch.bfloat16, torch.float16)},
        "half_adam": ADAM_MODE.get(),
        "half_adam_paths": {str(dtype).removeprefix("torch."): path_description(dtype, where)
                            for dtype in (torch.bfloat16, torch.float16)},
        "packed_chunks": PACKED.get(),
        "packed_chunk_dtypes": packed_dtypes(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_caps": {name: os.environ[name] for name in ISA_CAPS if name in os.environ},
    }


def run_paths() -> dict[str, Any]:
    """What a run folder's ``environment.json`` records of the compute paths beside the
    machine (:func:`environment_info`), so that a resumed run takes the same ones:
    ``half_products_auto``, ``"auto"``'s path for training batches of bfloat16 stores on a
    CPU without native products (``"widen"`` or ``"float32"``, decided now where it can be
    taken, else ``None``; :func:`rcdl.ops.half.product_record`), and ``triton_paths``, the
    path each (kernel, device, dtypes) took after the Triton attention's first-use check
    (:func:`rcdl.ops.triton_attention.triton_paths`; :meth:`RunDir.record_paths` adds those
    checked later), and ``layer_products``, each growing layer's store dtype and the
    half-product and packing modes its products ran under, by the layer's name
    (:func:`rcdl.ops.plan.layer_products`: the layer's own options, else the process
    defaults; :meth:`RunDir.record_paths` adds the layers that attend later)."""
    return {"half_products_auto": product_record()["auto_path"],
            "triton_paths": triton_paths(), "layer_products": layer_products()}


# ----------------------------------------------------------------------------- run folder


class RunDir:
    """A folder holding one run's config, environment, metrics, summary and artifacts.

    Use :meth:`create` to start a run; ``RunDir(path)`` attaches to an existing folder (the
    seam for resuming a run from its checkpoint).

    Example::

        run = RunDir.create("demo", config=cfg, device="cpu")
        run.log(step=10, samples=160, test_mse=0.4)
        run.write_summary({"test_mse": 0.3})
    """

    CONFIG, ENVIRONMENT, METRICS, SUMMARY = (
        "config.json",
        "environment.json",
        "metrics.jsonl",
        "summary.json",
    )
    FINISHED = "finished.json"

    LOCK = ".lock"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"run folder {self.path} does not exist")
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------ one process at a time
    def lock(self) -> None:
        """Hold an exclusive OS lock on this folder while this process runs in it
        (``flock`` on the folder itself: the OS drops it when the process ends, so a SIGKILL
        leaves no stale lock). ``.lock`` names the holder meanwhile.

        Raises:
            RunFolderBusy: another process holds the folder; the message names it.
        """
        if self._lock_fd is not None:
            return
        try:
            fd = lock_exclusively(self.path)
        except BlockingIOError:
            try:
                holder_text = self.file(self.LOCK).read_text(encoding="utf-8").strip()
            except OSError:
                holder_text = "another process"
            raise RunFolderBusy(
                f"{self.path} is in use by {holder_text}: one process at a time runs in a run "
                "folder. Wait for it to finish (or stop it), then resume") from None
        if fd is None:  # no flock on this platform: unguarded
            return
        self._lock_fd = fd
        try:
            atomic_write_text(f"{holder()}\n", self.file(self.LOCK))
        except BaseException:  # the lock is not kept by a run that could not start
            self.unlock()
            raise

    def unlock(self) -> None:
        """Release :meth:`lock` (and remove ``.lock``)."""
        if self._lock_fd is None:
            return
        self.file(self.LOCK).unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None

    # ------------------------------------------------------------------ what a kill leaves
    def remove_temporaries(self) -> list[str]:
        """Delete the temporary files of interrupted atomic writes in this folder
        (``.<name>.<random>.tmp``; the checkpoints clean their own); returns their names.
        Only while :meth:`lock` is held may this run: a live writer's file would go too."""
        removed = []
        for tmp in self.path.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
            removed.append(tmp.name)
        return removed

    def repair_metrics(self) -> bool:
        """Cut a torn last line off ``metrics.jsonl`` (a kill mid-append leaves a record
        without its newline, which the next append would run into); returns whether it
        did, and says so on stderr."""
        path = self.file(self.METRICS)
        if not path.is_file():
            return False
        data = path.read_bytes()
        if not data or data.endswith(b"\n"):
            return False
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        print(f"{path}: removed its torn last line ({len(data) - keep} bytes of a record "
              "whose write was interrupted)", file=sys.stderr)
        return True

    @classmethod
    def create(
        cls,
        name: str,
        *,
        root: str | os.PathLike = "runs",
        path: str | os.PathLike | None = None,
        config: Any = None,
        device: str | torch.device | None = None,
        resume_with: str | None = None,
    ) -> RunDir:
        """Make a new run folder and write its ``config.json`` and ``environment.json``.

        Args:
            name: run name; the folder is ``root/<name>-<YYYYmmdd-HHMMSS>`` (with ``-2``,
                ``-3``... appended if that exists) unless ``path`` is given.
            root: parent folder for named runs.
            path: exact folder to use (the command line's ``--out``); it may exist, as an
                empty folder.
            config: the resolved config, a dataclass (or a mapping).
            device: the device the run uses, recorded in ``environment.json``.
            resume_with: the command that continues a run of this kind (e.g. ``rcdl
                reproduce vit``), when there is one: if ``path`` holds an unfinished run,
                the error then gives the command that continues it.

        Raises:
            FileExistsError: ``path`` (or a folder above it) is a file, or ``path`` holds a
                run or other files. The message names ``path`` as ``--out``, where it comes
                from on the command line, and says what to do instead.
        """
        if path is not None:
            folder = Path(path)
            _refuse_taken(folder, resume_with)
            folder.mkdir(parents=True, exist_ok=True)
        else:
            if not name or os.sep in name:
                raise ValueError(f"run name must be a non-empty folder name, got {name!r}")
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            Path(root).mkdir(parents=True, exist_ok=True)
            folder, i = Path(root) / f"{name}-{stamp}", 1
            while True:
                try:
                    folder.mkdir()
                    break
                except FileExistsError:
                    i += 1
                    folder = Path(root) / f"{name}-{stamp}-{i}"
        run = cls(folder)
        if config is not None:
            run.write_json(cls.CONFIG, config)
        clear_layer_products()  # the layers this run's own calls run from here on
        run.write_json(cls.ENVIRONMENT, {"experiment": name, **environment_info(device),
                                         **run_paths()})
        return run

    def product_record(self) -> dict[str, str | None] | None:
        """How this run's half-precision products run, as its ``environment.json`` recorded
        them when the run started (:func:`rcdl.ops.half.product_record`'s form: the mode and
        ``"auto"``'s path for training batches); ``None`` where the file has no record.
        Every session of the run, and every process of a distributed one, runs its products
        so (:func:`rcdl.ops.half.products_as`; :func:`rcdl.app.runner.run_experiment`).

        Raises:
            ValueError: the record names no mode or path rcdl knows; the message names the
                file.
        """
        path = self.file(self.ENVIRONMENT)
        env = read_environment(self.path)
        if env is None or "half_products" not in env:
            return None  # no environment record: nothing to follow
        record = {"mode": env["half_products"], "auto_path": env.get("half_products_auto")}
        problem = product_record_problem(record)
        if problem is not None:
            raise ValueError(f"{path} records half-precision products rcdl does not know: "
                             f"{problem}")
        return record

    def record_paths(self) -> None:
        """Add the Triton attention's checks made since ``environment.json`` was written
        (:func:`rcdl.ops.triton_attention.triton_paths`: the path each kernel, device and
        dtype took) to its ``triton_paths``, and the layers that attended since to its
        ``layer_products`` (:func:`rcdl.ops.plan.layer_products`); the runner calls it after
        each sub-run."""
        env = read_environment(self.path)
        if env is None:
            return  # nothing to add to
        paths = {**env.get("triton_paths", {}), **triton_paths()}
        layers = {**env.get("layer_products", {}), **layer_products()}
        if paths != env.get("triton_paths") or layers != env.get("layer_products", {}):
            self.write_json(self.ENVIRONMENT, {**env, "triton_paths": paths,
                                               "layer_products": layers})

    def file(self, name: str) -> Path:
        """The path of a file in this run folder."""
        return self.path / name

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``obj`` as JSON to ``name`` in the run folder, atomically."""
        return atomic_write_json(obj, self.file(name))

    def write_summary(self, summary: Mapping[str, Any]) -> Path:
        """Write ``summary.json`` atomically."""
        return self.write_json(self.SUMMARY, summary)

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None:
        """Append one JSON line to ``metrics.jsonl`` and flush it to disk.

        Floats that are not finite are written as JSON ``NaN``/``Infinity`` tokens.
        """
        line = json.dumps(to_jsonable({**(record or {}), **fields}))
        with open(self.file(self.METRICS), "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        """All records of ``metrics.jsonl`` (an empty list before the first :meth:`log`).

        Raises:
            ValueError: a line is not a JSON record; the message names the file and line.
        """
        path = self.file(self.METRICS)
        if not path.exists():
            return []
        records = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{path}: line {number} is damaged, not a JSON record "
                                     f"({e})") from e
        return records

    def finished(self) -> dict[str, dict[str, Any]]:
        """The results of the sub-runs finished so far, by name (``finished.json``; empty
        before the first)."""
        path = self.file(self.FINISHED)
        if not path.exists():
            return {}
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:  # not JSON, or not UTF-8
            raise ValueError(f"cannot read the finished sub-runs of this run: {path}: {e}") from e

    def sub_run(self, name: str, train: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
        """The result of the sub-run ``name``: read back if an earlier session finished it
        (saying so on stdout), else ``train()``'s, added to ``finished.json`` atomically
        before it is returned.

        Either way the result comes back in its JSON form (lists for tuples, string keys),
        so a resumed run builds its tables from exactly the values an uninterrupted one
        does. An interrupted ``train()`` leaves nothing behind: it reruns from scratch.

        Example::

            result = run.sub_run("gws-seed0", functools.partial(train, "gws", 0))
        """
        finished = self.finished()
        if name in finished:
            print(f"{name}: finished in an earlier session, skipped")
            return finished[name]
        result = json.loads(json.dumps(to_jsonable(train())))
        self.write_json(self.FINISHED, {**finished, name: result})
        return result

    @contextlib.contextmanager
    def resumable(self, command: str,
                  data_dir: str | os.PathLike | None = None) -> Iterator[None]:
        """A failure inside the block says what failed and how to go on, on stderr.

        On ``KeyboardInterrupt`` (also one that torch's writer turned into another error)
        it prints the command that continues this run (:func:`resume_command`:
        ``<command> --resume <folder>``, plus ``--data-dir <data_dir>`` when given) and
        re-raises ``KeyboardInterrupt``. On any other error it prints what failed and
        where (the file and errno of an ``OSError`` anywhere in the error's chain: a full
        disk inside ``torch.save``, say), that what was saved is kept, and the same
        command, then raises :class:`RunFailed` from it."""
        resume = resume_command(command, self.path, data_dir)
        try:
            yield
        except KeyboardInterrupt:
            print(f"\nInterrupted. Continue with: {resume}", file=sys.stderr)
            raise
        except Exception as e:
            if _in_chain(e, KeyboardInterrupt) is not None:
                print(f"\nInterrupted. Continue with: {resume}", file=sys.stderr)
                raise KeyboardInterrupt from e
            what = describe_failure(e)
            print(f"\n{what}\nWhat was saved is kept in {self.path}. Once that is fixed, "
                  f"continue with: {resume}", file=sys.stderr)
            raise RunFailed(what) from e

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"


def _refuse_taken(folder: Path, resume_with: str | None) -> None:
    """Raise ``FileExistsError`` when ``folder`` cannot become a new run's folder: it (or a
    folder above it) is a file, or it holds an earlier run or other files. A run writes
    several files, and mixing them with another run's would make both unreadable, so the
    message says where to go instead (and, for an unfinished run that ``resume_with``
    continues, how to continue it)."""
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"--out {folder} is a file, not a folder: give --out a new (or "
                              "empty) folder for the run")
    above = next((p for p in folder.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise FileExistsError(f"--out {folder}: {above} is a file, not a folder: give --out "
                              "a new (or empty) folder for the run")
    if (folder / RunDir.CONFIG).exists():
        try:
            summary = json.loads((folder / RunDir.SUMMARY).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            summary = None  # no summary yet (or a torn one): the run did not finish
        # a run's summary says "complete": false until it finishes (the demo's has no
        # such key and is written only at the end)
        finished = isinstance(summary, dict) and summary.get("complete", True) is not False
        if finished:
            raise FileExistsError(
                f"--out {folder} already holds a finished run: choose another --out for a "
                "new run, or delete that folder to redo it")
        if resume_with is not None:
            raise FileExistsError(
                f"--out {folder} already holds a run that did not finish: continue it with "
                f"`{resume_command(resume_with, folder)}`, or choose another --out for a "
                "new run")
        raise FileExistsError(
            f"--out {folder} already holds a run ({RunDir.CONFIG} exists): choose another "
            "--out for a new run, or delete that folder to redo it")
    if folder.is_dir() and any(folder.iterdir()):
        held = sorted(p.name for p in folder.iterdir())
        listed = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise FileExistsError(
            f"--out {folder} is not empty ({listed}) and holds no run: a run's files would "
            "be mixed with them; choose a new or empty folder")


class RunFailed(RuntimeError):
    """A run failed after its folder was made; what failed, where, and the command that
    continues it were printed on stderr (:meth:`RunDir.resumable`)."""


class RunFolderBusy(RuntimeError):
    """Another process runs in the run folder (:meth:`RunDir.lock`)."""


_E = TypeVar("_E", bound=BaseException)


def _in_chain(error: BaseException | None, kind: type[_E]) -> _E | None:
    """The first exception of type ``kind`` among ``error`` and its causes and contexts."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def describe_failure(error: BaseException) -> str:
    """One line for a failed run: an ``OSError`` in the chain as what, file and errno
    (``No space left on device (errno 28, ENOSPC) writing /runs/x/ckpt.pt``), else the
    error's type and message."""
    import errno as errnos

    os_error = _in_chain(error, OSError)
    if os_error is not None and os_error.errno is not None:
        name = errnos.errorcode.get(os_error.errno, "?")
        where = f" at {os_error.filename}" if os_error.filename else ""
        reason = os_error.strerror or str(os_error)
        return f"The run failed: {reason} (errno {os_error.errno}, {name}){where}."
    return f"The run failed: {type(error).__name__}: {error}"


def resume_command(command: str, folder: str | os.PathLike,
                   data_dir: str | os.PathLike | None = None) -> str:
    """The shell command that continues the run in ``folder`` from any working folder:
    ``<command> --resume <folder>``, and ``--data-dir <data_dir>`` when the run read its data
    from an explicit folder; both paths absolute (resolved) and quoted for the shell.

    Example::

        resume_command("rcdl reproduce vit", "runs/vit-1", "../data")
        # 'rcdl reproduce vit --resume /work/main/runs/vit-1 --data-dir /work/data'
    """
    words = [command, "--resume", shlex.quote(str(Path(folder).expanduser().resolve()))]
    if data_dir is not None:
        words += ["--data-dir", shlex.quote(str(Path(data_dir).expanduser().resolve()))]
    return " ".join(words)


def recorded_experiment(run_dir: str | os.PathLike) -> str | None:
    """The experiment a run folder's ``environment.json`` names (``None``: no readable
    record, as in an older folder)."""
    recorded = read_environment(run_dir)
    return None if recorded is None else recorded.get("experiment")


def read_environment(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """A run folder's ``environment.json`` as a dict (``None``: missing, unreadable, or not
    a JSON object)."""
    try:
        env = json.loads((Path(run_dir) / RunDir.ENVIRONMENT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return env if isinstance(env, dict) else None


def read_config(run_dir: str | os.PathLike, config_cls: Any) -> Any:
    """The config saved in ``run_dir/config.json``, built by ``config_cls.from_dict``.

    Raises:
        FileNotFoundError: ``run_dir`` holds no ``config.json``.
        ValueError: the file is not a JSON object, or ``config_cls`` refuses its settings;
            the message names the file.
    """
    path = Path(run_dir) / RunDir.CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no run to resume: {path} does not exist")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"cannot read the saved config {path}: {e}") from e
    if not isinstance(saved, dict):
        raise ValueError(f"cannot read the saved config {path}: expected a JSON object, "
                         f"got {type(saved).__name__}")
    try:
        config = config_cls.from_dict(saved)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot use the saved config {path}: {e}") from e
    if dataclasses.is_dataclass(config_cls):
        missing = sorted({f.name for f in dataclasses.fields(config_cls)} - set(saved))
        if missing:
            raise ValueError(f"{path} is not a complete config of this experiment: it lacks "
                             f"{', '.join(missing)}; a resume continues a run with every "
                             "setting it was started with (is this the folder of another "
                             "experiment?)")
    return config


class FollowerRunDir(RunDir):
    """The run folder as a rank other than 0 of a ``torchrun`` sees it: it reads what rank 0
    writes (the config, ``finished.json``) and writes nothing itself but its checkpoints."""

    def write_json(self, name: str, obj: Any) -> Path:
        return self.file(name)

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None:
        pass


def open_run(
    name: str,
    config: Any,
    *,
    out: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    may_differ: tuple[str, ...] = ("data_dir", "device"),
) -> RunDir:
    """A new run folder (:meth:`RunDir.create` at ``out``), or the interrupted run at
    ``resume`` after checking that ``config`` is its saved one.

    Args:
        name: the experiment's name, for a new folder ``runs/<name>-<timestamp>``.
        config: the run's config, a dataclass with ``from_dict`` (see :func:`read_config`).
        out, resume: at most one of them.
        device: recorded in a new run's ``environment.json``.
        may_differ: settings a resumed run may change (where the data lives, the device).

    Raises:
        ValueError: both ``out`` and ``resume``, or ``config`` differs from the saved one
            (the message lists the differences, saved then given).
        FileNotFoundError: ``resume`` holds no run (see :func:`read_config`).
        FileExistsError: ``out`` is a file or holds files; for an unfinished run the
            message gives the ``--resume`` command that continues it (:meth:`RunDir.create`).
    """
    if out is not None and resume is not None:
        raise ValueError("give either out (a new run) or resume (an existing one), not both")
    if resume is None:
        return RunDir.create(name, path=out, config=config, device=device,
                             resume_with=f"rcdl reproduce {name}")
    saved = to_jsonable(read_config(resume, type(config)))
    given = to_jsonable(config)
    diff = {k: (saved[k], v) for k, v in given.items() if k not in may_differ and saved[k] != v}
    if diff:
        raise ValueError(f"{resume}: the config differs from the saved one (saved, given): "
                         f"{diff}")
    recorded = recorded_experiment(resume)
    if recorded is not None and recorded != name:
        raise ValueError(f"{resume} is a run of {recorded}, not of {name}: resume it with "
                         f"rcdl reproduce {recorded} --resume {resume}")
    return RunDir(resume)


def describe_machine(device: str | torch.device) -> str:
    """The machine a run used, in one line for its report: platform, CPUs and their
    :data:`SPEED_FLAGS`, torch, device, threads (and the CUDA device's name)."""
    device = torch.device(device)
    env = environment_info(device)
    flags = " ".join(env["cpu_flags"]) or "none of " + "/".join(SPEED_FLAGS)
    machine = (f"{env['platform']}, {env['cpu_count']} CPUs ({env['cpu_model']}, flags "
               f"{flags}), torch {env['torch']}, device {device}, "
               f"{count(env['num_threads'], 'thread')}")
    if device.type == "cuda" and env["cuda_device"]:
        machine += f" ({env['cuda_device']})"
    world = rank_and_world()[1]
    if world > 1:
        machine += f"; {world} processes (torch.distributed, growing stores sharded over them)"
    return machine


def resolve_device(name: str | torch.device) -> torch.device:
    """``"auto"`` (CUDA when available, else CPU), or the named device; ``ValueError`` if
    ``"cuda"`` is asked for and torch sees no CUDA device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(name) == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


def release_memory(device: str | torch.device) -> None:
    """Give a finished model's memory back before the next one is built: collect reference
    cycles, and return CUDA's cached blocks."""
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def collecting_new_objects() -> Iterator[None]:
    """Within the block, a collection (:func:`release_memory`) scans only the objects made
    inside it: those that existed before (the imported modules, the caller's data) are set
    aside (``gc.freeze``) and given back to the collector when the block ends, so the
    collection after each sub-run does not scan every object of the process again; the
    models a sub-run made are all new. Nested blocks keep the outermost's freeze."""
    import gc

    if gc.get_freeze_count():  # an enclosing block froze them already
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def rank0_run(open_run: Callable[[], RunDir]) -> RunDir:
    """The run folder of a run that may be distributed: rank 0 opens it (``open_run()``:
    creates it, or opens the one to resume) and tells the others its path; they get a
    :class:`FollowerRunDir` on it, which writes nothing. Without a process
    group this is just ``open_run()``."""
    import torch.distributed as dist

    from rcdl.distributed import rank_and_world

    rank, world = rank_and_world()
    if world == 1:
        return open_run()
    run = open_run() if rank == 0 else None
    path: list[Any] = [None if run is None else str(run.path)]  # then rank 0's, everywhere
    dist.broadcast_object_list(path, src=0)
    return run if run is not None else FollowerRunDir(path[0])
