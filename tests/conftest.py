"""Fixtures shared by the test modules."""

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
