"""A test that needs an optional extra skips, naming the install command, where the extra is
missing, and fails where the test command requires it (``make test`` sets
``RCDL_REQUIRE_EXTRAS``): run here with scikit-learn hidden behind a module that refuses to
import, as on an install of ``rcdl[dev]`` alone."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/test_cifar10_experiment.py::test_classical_baselines_join_the_table"


def _pytest_without_sklearn(tmp_path, **env):
    hidden = tmp_path / "hidden" / "sklearn"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("scikit-learn is hidden here")\n')
    environ = {k: v for k, v in os.environ.items()  # not this run's pytest-xdist worker
               if k not in ("RCDL_REQUIRE_EXTRAS", "RCDL_REQUIRE_FAISS")
               and not k.startswith("PYTEST_")}
    path = [str(hidden.parent), environ.get("PYTHONPATH", "")]
    environ |= {"PYTHONPATH": os.pathsep.join(p for p in path if p), **env}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-p", "no:benchmark", TEST],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("required", [False, True])
def test_a_test_of_a_missing_extra_skips_unless_the_command_requires_it(tmp_path, required):
    run = _pytest_without_sklearn(
        tmp_path, **({"RCDL_REQUIRE_EXTRAS": "faiss,classical"} if required else {}))
    out = run.stdout + run.stderr
    if required:
        assert run.returncode == 1, out
        assert "the test command requires the classical extra" in out
    else:
        assert run.returncode == 0, out
        assert "1 skipped" in out
        assert "pip install -e '.[classical]'" in out
