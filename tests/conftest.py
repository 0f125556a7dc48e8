"""Fixtures shared by the test modules."""

import os

import numpy as np
import pytest

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


# RCDL_MAX_TEST_SECONDS=S fails any test whose call phase takes longer than S seconds (CI
# sets a generous limit: the suite's rule is 20 s on 2 cores; what needs more is marked
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
