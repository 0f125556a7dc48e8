"""What starting rcdl imports, in fresh processes: ``import rcdl`` and the ``rcdl`` command's
help import no plotting library, no ``torch.compile`` machinery and no distributed tensors,
and a command imports the modules of no experiment it does not run or describe. These check
behaviour, not time (benchmarks/bench_import.py times it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rcdl
from rcdl.app.cli import _experiments_reached
from rcdl.app.experiments import COMMANDS

# each probe starts an interpreter of its own: one at a time with the other spawning tests
spawns = pytest.mark.spawns

# imported only where a figure is drawn, something is compiled, a tensor is sharded or a
# Triton kernel runs
LAZY = ("matplotlib", "torch._dynamo", "torch._inductor", "torch.distributed.tensor", "triton")
EXPERIMENT_MODULES = {f"rcdl.app.experiments.{module}" for module in COMMANDS.values()}

# argv None: `import rcdl`; else `rcdl argv` (its output dropped); prints the modules loaded
PROBE = """
import contextlib, io, json, sys
argv = json.loads(sys.argv[1])
if argv is None:
    import rcdl
else:
    from rcdl.app.cli import main
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exit:
            assert exit.code == 0, exit.code
print(json.dumps(sorted(sys.modules)))
"""


def loaded_modules(argv: list[str] | None) -> set[str]:
    """The modules a fresh interpreter has loaded after ``import rcdl`` (``argv`` None) or
    after ``rcdl argv``; it imports the rcdl this test runs against."""
    src = str(Path(rcdl.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": path})
    return set(json.loads(out.stdout))


def lazy_loaded(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m in LAZY or m.startswith(tuple(f"{n}." for n in LAZY)))


@spawns
def test_import_rcdl_loads_no_plotting_compiler_distributed_tensors_or_application():
    modules = loaded_modules(None)
    assert not lazy_loaded(modules), lazy_loaded(modules)
    assert not any(m.startswith("rcdl.app") for m in modules)  # the library never imports it


@spawns
@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["info"]],
                         ids=lambda a: " ".join(a))
def test_commands_other_than_reproduce_load_no_experiment(argv):
    modules = loaded_modules(argv)
    assert not lazy_loaded(modules), lazy_loaded(modules)
    assert not modules & EXPERIMENT_MODULES, sorted(modules & EXPERIMENT_MODULES)


@spawns
def test_an_experiments_help_loads_that_experiment_alone():
    modules = loaded_modules(["reproduce", "teacher-student", "--help"])
    assert not lazy_loaded(modules), lazy_loaded(modules)
    assert modules & EXPERIMENT_MODULES == {"rcdl.app.experiments.teacher_student"}


@spawns
def test_the_list_of_experiments_loads_them_all_without_plotting():
    # every experiment module imported at once: none may import a plotting library at the top
    modules = loaded_modules(["reproduce", "--help"])
    assert modules >= EXPERIMENT_MODULES
    assert not lazy_loaded(modules), lazy_loaded(modules)


@pytest.mark.parametrize(("argv", "reached"), [
    ([], []), (["--help"], []), (["--version"], []), (["demo", "--out", "reproduce"], []),
    (["info"], []), (["-h", "reproduce", "vit"], ["vit"]),
    (["reproduce", "vit", "--help"], ["vit"]), (["reproduce", "vit", "--quick"], ["vit"]),
    (["reproduce"], None), (["reproduce", "--help"], None), (["reproduce", "-h", "vit"], None),
    (["reproduce", "no-such-experiment"], None),
])  # fmt: skip
def test_the_parser_builds_the_experiments_the_command_line_reaches(argv, reached):
    assert _experiments_reached(argv) == reached
