"""Every Python example in docs/ runs as written, as tests/test_readme.py checks the README's.

Each page's ``python`` blocks run in order in one namespace, in a fresh working folder that
has a ``../shared/data`` beside it: a random CIFAR-10 and CIFAR-100 in the npz layout, big
enough for the experiments' ``--quick`` sizes, so that the examples'
``data_dir="../shared/data"`` finds data without the real images. A block preceded by an
HTML comment ``<!-- no-run: why -->`` is compiled, not run (it needs what the test does not
have, such as ranks started by torchrun); the page says why in the comment, and such
blocks stay few.
"""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

from conftest import CIFAR10_CLASSES

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"(?P<marker><!-- no-run: [^>]*-->\n)?(?P<indent>[ \t]*)```python\n"
                   r"(?P<code>.*?)^(?P=indent)```", re.S | re.M)


def blocks(page: Path) -> list[tuple[str, bool]]:
    """The page's Python blocks in order, dedented, each with whether it runs."""
    return [(textwrap.dedent(m["code"]), m["marker"] is None)
            for m in BLOCK.finditer(page.read_text(encoding="utf-8"))]


# docs/install.md's first model is run, and checked to learn, by tests/test_readme.py
CHECKED_ELSEWHERE = {"install.md"}
PAGES = sorted(p for p in DOCS.glob("*.md") if blocks(p) and p.name not in CHECKED_ELSEWHERE)


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory) -> Path:
    """``shared/data``: a random CIFAR-10 (5 000 train / 1 000 test images, the subset
    docs/data.md takes) and CIFAR-100 (600 / 300, fine and coarse labels)."""
    folder = tmp_path_factory.mktemp("root") / "shared" / "data"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def images(n: int) -> np.ndarray:
        return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)  # (N, H, W, C)

    np.savez(folder / "cifar10.npz", x_train=images(5000), x_test=images(1000),
             y_train=rng.integers(0, 10, 5000), y_test=rng.integers(0, 10, 1000),
             class_names=np.array(CIFAR10_CLASSES))  # fmt: skip
    np.savez(folder / "cifar100.npz", x_train=images(600), x_test=images(300),
             y_train=rng.integers(0, 100, 600), y_test=rng.integers(0, 100, 300),
             class_names=np.array([f"fine{i}" for i in range(100)]),
             y_train_coarse=rng.integers(0, 20, 600), y_test_coarse=rng.integers(0, 20, 300),
             coarse_class_names=np.array([f"coarse{i}" for i in range(20)]))  # fmt: skip
    return folder


def test_the_markers_are_few():
    held = [(p.name, i) for p in PAGES for i, (_, runs) in enumerate(blocks(p)) if not runs]
    assert len(held) <= 4, held


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_the_page_examples_run(page, shared_data, monkeypatch):
    work = shared_data.parents[1] / f"work-{page.stem}"  # ../shared/data from here
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("RCDL_DATA", raising=False)
    module = types.ModuleType(f"docs_{page.stem}")  # a dataclass looks its module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    try:
        for i, (code, runs) in enumerate(blocks(page)):
            compiled = compile(code, f"docs/{page.name} (block {i + 1})", "exec")
            if runs:
                exec(compiled, module.__dict__)
    finally:
        shutil.rmtree(work, ignore_errors=True)
