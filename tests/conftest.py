"""Fixtures shared by the test modules."""

import importlib
import os

import numpy as np
import pytest

# Under pytest-xdist (`-n 2`) each worker computes on one thread, and so do the processes it
# starts: two workers of two threads each would oversubscribe two cores.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck")  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A random CIFAR-10 in the npz layout: 64 train / 32 test images."""
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    np.savez(
        folder / "cifar10.npz",
        x_train=rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8),
        y_train=rng.integers(0, 10, 64).astype(np.int64),
        x_test=rng.integers(0, 256, (32, 32, 32, 3), dtype=np.uint8),
        y_test=rng.integers(0, 10, 32).astype(np.int64),
        class_names=np.array(CIFAR10_CLASSES),
    )
    return folder


class TrainingInterrupted(Exception):
    """Raised by a grower patched with the ``interrupt_after`` fixture."""


@pytest.fixture
def interrupt_after():
    """``interrupt_after(grower, steps)``: the grower's ``step`` raises
    :class:`TrainingInterrupted` at its call ``steps + 1``, as a kill between two steps would
    stop a run; returns the exception class, for ``pytest.raises``."""

    def patch(grower, steps: int) -> type[TrainingInterrupted]:
        original, calls = grower.step, {"n": 0}

        def step():
            calls["n"] += 1
            if calls["n"] > steps:
                raise TrainingInterrupted
            original()

        grower.step = step
        return TrainingInterrupted

    return patch


# modules whose tests read one run made by a module-scoped fixture (seconds each): on one
# worker, the run is made once instead of once per worker that runs some of the tests
SHARED_RUN_MODULES = {"test_cifar10_experiment", "test_optimizer_experiments",
                      "test_teacher_student", "test_memory_budget", "test_tau_sweep",
                      "test_generalisation", "test_vit"}


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist with ``--dist loadgroup`` (``make test``), the tests marked
    ``spawns`` (they start processes of their own: torchrun-like ranks, a second run) run one
    after another on one worker, so that no two of them share the cores and time out; the
    tests of a module of :data:`SHARED_RUN_MODULES` run on one worker, which makes the
    module's run once."""
    if not config.pluginmanager.hasplugin("xdist"):  # no workers, no groups (nor their mark)
        return
    for item in items:
        if item.get_closest_marker("spawns") is not None:
            item.add_marker(pytest.mark.xdist_group("spawns"))
        elif item.module.__name__.rpartition(".")[2] in SHARED_RUN_MODULES:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


# A test that needs an optional extra is marked @pytest.mark.extra("classical"): where the
# extra's module does not import it skips, naming the install command, unless the test
# command requires the extra (RCDL_REQUIRE_EXTRAS=classical,faiss, as `make test` sets; the
# older RCDL_REQUIRE_FAISS=1 requires faiss): there it fails, so a broken install cannot pass.
EXTRA_MODULES = {"classical": "sklearn", "faiss": "faiss", "peers": "dattri", "triton": "triton",
                 "fast-cpu": "numba"}
_IMPORT_PROBLEMS: dict[str, str | None] = {}


def required_extras() -> set[str]:
    named = {e.strip() for e in os.environ.get("RCDL_REQUIRE_EXTRAS", "").split(",")}
    return (named - {""}) | ({"faiss"} if os.environ.get("RCDL_REQUIRE_FAISS") == "1" else set())


def _import_problem(module: str) -> str | None:
    if module not in _IMPORT_PROBLEMS:
        try:
            importlib.import_module(module)
            _IMPORT_PROBLEMS[module] = None
        except ImportError as err:  # missing, or installed but broken
            _IMPORT_PROBLEMS[module] = f"{type(err).__name__}: {err}"
    return _IMPORT_PROBLEMS[module]


def pytest_runtest_setup(item):
    for mark in item.iter_markers("extra"):
        for extra in mark.args:
            if extra not in EXTRA_MODULES:
                raise ValueError(f"{item.nodeid}: unknown extra {extra!r} (known: "
                                 f"{', '.join(EXTRA_MODULES)})")
            problem = _import_problem(EXTRA_MODULES[extra])
            if problem is None:
                continue
            message = (f"needs the {extra} extra ({EXTRA_MODULES[extra]} does not import: "
                       f"{problem}): pip install -e '.[{extra}]'")
            if extra in required_extras():
                pytest.fail(f"the test command requires the {extra} extra, but {message}",
                            pytrace=False)
            pytest.skip(message)


# RCDL_MAX_TEST_SECONDS=S fails any test whose call phase takes longer than S seconds (CI
# sets a generous limit: the suite's rule is 15 s on 2 cores; what needs more is marked
# `long` and left out of `make test`)
_MAX_SECONDS = float(os.environ.get("RCDL_MAX_TEST_SECONDS") or "inf")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.passed and report.duration > _MAX_SECONDS:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {report.duration:.1f} s, over "
                           f"RCDL_MAX_TEST_SECONDS={_MAX_SECONDS:g}: make it faster or mark it "
                           "`long` (run by `make test-long`, not by `make test`)")
