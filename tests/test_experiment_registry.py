"""The experiments' package is the one list of experiments: the index the command line reads
is what the modules declare, no experiment imports another, and each one's docs page is in the
site's navigation. A failure says which file to change and how
(docs/adding_an_experiment.md)."""

import ast
import importlib
import re
from pathlib import Path

import pytest

import rcdl.app.experiments as package
from rcdl.app.experiments import COMMANDS, MAIN, declared_commands

ROOT = Path(__file__).resolve().parents[1]
FOLDER = Path(package.__file__).parent
# each module's source: name.py, or name/__init__.py for an experiment kept as a package
SOURCES = {p.stem: p for p in FOLDER.glob("*.py") if p.stem != "__init__"} | {
    p.parent.name: p for p in FOLDER.glob("*/__init__.py")}
MODULES = sorted(SOURCES)
EXPERIMENT_MODULES = set(COMMANDS.values())
# an experiment that is another one run differently, and why it imports it
BUILT_ON = {("tau_sweep", "cifar10"): "the τ sweep is the one-epoch comparison over "
            "thresholds: it runs that experiment's spec with its own config"}


def test_the_index_is_what_the_modules_declare():
    declared = {}
    for name in MODULES:
        module = importlib.import_module(f"rcdl.app.experiments.{name}")
        spec = getattr(module, "EXPERIMENT_SPEC", None)
        if spec is not None:
            assert spec.name == module.EXPERIMENT, (
                f"{SOURCES[name].relative_to(ROOT)}: EXPERIMENT_SPEC's name {spec.name!r} is "
                f"not its EXPERIMENT {module.EXPERIMENT!r}; give the spec name=EXPERIMENT")
            declared[spec.name] = name
    assert dict(sorted(declared.items())) == COMMANDS
    assert MAIN in COMMANDS


def test_shared_modules_name_only_declared_commands():
    for name in sorted(set(MODULES) - EXPERIMENT_MODULES):
        module = importlib.import_module(f"rcdl.app.experiments.{name}")
        if hasattr(module, "EXPERIMENT"):  # the one-epoch comparison's settings name it
            assert module.EXPERIMENT in COMMANDS, (name, module.EXPERIMENT)


def test_a_spec_without_its_command_line_is_refused(tmp_path):
    (tmp_path / "new.py").write_text('EXPERIMENT_SPEC = Experiment(name="new")\n')
    with pytest.raises(ImportError, match=r'new\.py declares EXPERIMENT_SPEC but not its '
                                          r'command: add the line EXPERIMENT = "<command>"'):
        declared_commands(tmp_path)


def test_two_modules_with_one_command_are_refused(tmp_path):
    for stem in ("one", "two"):
        (tmp_path / f"{stem}.py").write_text('EXPERIMENT = "same"\nEXPERIMENT_SPEC = None\n')
    with pytest.raises(ImportError, match="both declare the command 'same'"):
        declared_commands(tmp_path)
    (tmp_path / "two.py").write_text('"""Shared, no spec."""\nEXPERIMENT = "same"\n')
    assert declared_commands(tmp_path) == {"same": "one"}


# --------------------------------------------------------------------------- imports


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function: ``import a.b``,
    ``from a import b`` (``a`` and ``a.b``, since ``b`` may be a module), relative imports
    resolved against the experiments' package."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.__name__.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            found |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return found


def _owner(path: Path) -> str:
    """The module of the experiments' package that ``path`` belongs to: its own name, or
    the package that holds it (``cifar10/run.py``: ``cifar10``)."""
    return path.stem if path.parent in (FOLDER, FOLDER.parent) else path.parent.name


# every file of the experiments' modules and packages, and the recipes they share
SHARING = [*sorted(p for p in FOLDER.rglob("*.py") if p != FOLDER / "__init__.py"),
           FOLDER.parent / "recipes.py"]


@pytest.mark.parametrize("path", SHARING, ids=lambda p: str(p.relative_to(FOLDER.parent)))
def test_no_module_imports_an_experiment(path):
    """What several experiments use lives in rcdl.app.recipes or rcdl.app.models (or, for
    the one-epoch comparison's settings and report, in its package's modules), never in an
    experiment."""
    imported = {m.removeprefix(f"{package.__name__}.") for m in imported_modules(path)
                if m.startswith(f"{package.__name__}.")}
    wrong = sorted(m for m in imported & EXPERIMENT_MODULES
                   if m != _owner(path) and (_owner(path), m) not in BUILT_ON)
    assert not wrong, (f"{path.relative_to(ROOT)} imports the experiment module(s) {wrong}; "
                       "move what it uses into src/rcdl/app/recipes.py and import it from there")


# --------------------------------------------------------------------------- docs and README


def nav_pages() -> set[str]:
    """The Markdown pages mkdocs.yml's ``nav`` lists."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text[text.index("\nnav:"):]
    return set(re.findall(r":\s*([\w/]+\.md)\s*$", nav, flags=re.MULTILINE))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_experiment_has_a_docs_page_in_the_nav(command):
    module = COMMANDS[command]
    source = SOURCES[module]
    docstring = ast.get_docstring(ast.parse(source.read_text(encoding="utf-8"))) or ""
    named = [p for p in dict.fromkeys(re.findall(r"docs/([\w/]+\.md)", docstring))
             if f"rcdl reproduce {command}" in _page(p)]
    assert named, (f"{source.relative_to(ROOT)}: its docstring names no docs page "
                   f"that shows `rcdl reproduce {command}`; write docs/<page>.md with the "
                   f"command and say 'Run it with ``rcdl reproduce {command}`` (see "
                   "docs/<page>.md)' in the module's docstring")
    listed = [p for p in named if p in nav_pages()]
    assert listed, (f"mkdocs.yml: add {named[0]} to the nav, under Experiments "
                    f"(`rcdl reproduce {command}`'s page)")


def _page(name: str) -> str:
    path = ROOT / "docs" / name
    return path.read_text(encoding="utf-8") if path.is_file() else ""
