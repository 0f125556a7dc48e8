"""The test and documentation tools are pinned (constraints.txt), and a drift from the pins
is named before the suite runs (.ci/pins.py; docs/contributing.md, "Test tools and their
pins")."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _pins_module():
    spec = importlib.util.spec_from_file_location("pins", ROOT / ".ci" / "pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_test_and_docs_tool_is_pinned():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    pinned = _pins_module().pins()
    tools = [Requirement(r).name for extra in ("dev", "docs") for r in extras[extra]]
    assert tools and all(canonicalize_name(t) in pinned for t in tools), \
        [t for t in tools if canonicalize_name(t) not in pinned]
    for unpinned in ("torch", "numpy", "triton", "numba", "faiss-cpu", "scikit-learn"):
        assert unpinned not in pinned  # a user's own builds are kept


def test_a_tool_installed_at_another_version_is_named(monkeypatch, capsys):
    pins = _pins_module()
    installed = pins.reached({"dev"})
    assert "pytest" in installed and "pluggy" in installed  # through pytest's requirements
    monkeypatch.setattr(pins, "pins", lambda: {**{k: v for k, v in installed.items()},
                                               "pytest": "0.0.1"})
    assert pins.main(["dev"]) == 1
    said = capsys.readouterr().err
    assert f"pytest {installed['pytest']} installed, 0.0.1 pinned" in said
    assert "pip install -c constraints.txt" in said and "pluggy" not in said
    assert pins.main(["dev", "--quiet"]) == 1 and capsys.readouterr().err == ""
    monkeypatch.setattr(pins, "pins", lambda: dict(installed))
    assert pins.main(["dev"]) == 0
