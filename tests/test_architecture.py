"""The library's structure, read from its source (docs/architecture.md): no import cycles,
the streaming attention is pure maths, and no module assigns another object's attributes."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
FILES = sorted((SRC / "rcdl").rglob("*.py"))

# assignments to another object's attributes that stay inside the module that owns them
OWN_OBJECTS = {
    ("rcdl/nn/vit.py", "block.ffn"),  # the ViT fills its own blocks
    ("rcdl/app/cli.py", "sys.stdout"),  # the command's ranks > 0 print nothing
    ("rcdl/memory/repair.py", "current.steps"),  # the pass's own holder, read by its backends
}

# in-place writes into another object's tensors (``x.t[i] = ...``, ``x.t += ...``,
# ``x.t.copy_(...)``), each with why the object is the writer's own
OWN_TENSORS = {
    ("rcdl/ops/partials.py", "part.num.mul_"),  # a Partial of this module's own fold
    ("rcdl/ops/partials.py", "part.den.mul_"),
    ("rcdl/ops/partials.py", "part.mass.mul_"),
    ("rcdl/app/data.py", "linear.weight.copy_"),  # the teacher's layers, built here
    ("rcdl/app/data.py", "linear.weight.mul_"),
    ("rcdl/app/data.py", "linear.bias.copy_"),
    ("rcdl/app/data.py", "last.weight.div_"),
    ("rcdl/app/data.py", "last.bias.sub_"),
    ("rcdl/nn/layers.py", "layer.weight0.copy_"),  # GrowingLinear.from_linear's new layer
    ("rcdl/nn/layers.py", "layer.bias0.copy_"),
    ("rcdl/nn/layers.py", "linear.weight.copy_"),  # GrowingLinear.to_linear's new nn.Linear
    ("rcdl/nn/layers.py", "linear.bias.copy_"),
    ("rcdl/optim/dual_optim.py", "module.weight.sub_"),  # an optimizer steps its parameters
    ("rcdl/optim/dual_optim.py", "module.bias.sub_"),
    # the process's environment, read by numba as it loads: the CPU it compiles for
    ("rcdl/ops/widen.py", "os.environ"),
}


def module_name(path: Path, src: Path = SRC) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str], src: Path = SRC) -> set[str]:
    """Every rcdl module ``path`` imports: at the top, inside functions and under
    ``TYPE_CHECKING`` alike (an import that runs later, or only for the type checker, still
    ties the two modules together). ``from rcdl.x import y`` counts ``rcdl.x.y`` when that is
    a module, else ``rcdl.x``; relative imports are resolved."""
    here = module_name(path, src)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            names = submodules if len(submodules) == len(node.names) else [base, *submodules]
        else:
            continue
        for name in names:
            while name and name not in known:  # rcdl.a.b.C -> the module rcdl.a.b
                name = name.rpartition(".")[0]
            if name and name != here:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    known = {module_name(p) for p in FILES}
    return {module_name(p): imports(p, known) for p in FILES}


def test_no_import_cycles():
    graph = import_graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module):],
                                                                 module]))
        if module not in done:
            for other in sorted(graph[module]):
                visit(other, [*path, module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])


# The packages in their layers (docs/architecture.md, "The packages"): a module imports from
# its own package and from packages of a lower layer only. Layer 0 holds the internals and
# the options; ``rcdl`` itself (the public API) and ``python -m rcdl`` sit on top.
LAYERS = [("_version", "_cpu", "_io", "_checks", "options"), ("ops",), ("nn",), ("distributed",),
          ("retrieval", "memory"), ("optim",), ("train",), ("app",), ("", "__main__")]


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_packages_import_only_their_own_layer_and_those_below():
    graph = import_graph()
    upward = sorted((module, other) for module, others in graph.items() for other in others
                    if _layer(other) > _layer(module)
                    or (_layer(other) == _layer(module) and module.split(".")[:2] !=
                        other.split(".")[:2] and _layer(module) not in (0, len(LAYERS) - 1)))
    assert not upward, upward


def test_the_import_reader_sees_function_level_and_type_checking_imports(tmp_path):
    source = tmp_path / "rcdl" / "sub" / "mod.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rcdl.nn.layers import GrowingLayer\n"
        "def f():\n    from rcdl.nn.store import EntryStore\n    import rcdl.ops.kernels\n"
        "from . import other\nfrom .. import rules\n")
    known = {"rcdl", "rcdl.nn.layers", "rcdl.nn.store", "rcdl.ops.kernels", "rcdl.sub",
             "rcdl.sub.other", "rcdl.rules"}
    found = imports(source, known, src=tmp_path)
    assert found == {"rcdl.nn.layers", "rcdl.nn.store", "rcdl.ops.kernels", "rcdl.sub.other",
                     "rcdl.rules"}, found


def _chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    """The name an attribute or subscript chain starts from, and its attribute names."""
    attrs = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
        node = node.value
    return node, attrs[::-1]


def _foreign(node: ast.AST, skip: tuple[str, ...] = ()) -> str | None:
    """``name.attr...`` where ``node`` reaches into the attributes of an object named by a
    name other than ``self``, ``cls``, ``ctx`` and ``skip``, else ``None``."""
    root, attrs = _chain(node)
    if (not isinstance(root, ast.Name) or not attrs
            or root.id in ("self", "cls", "ctx", *skip)):
        return None
    return ".".join([root.id, *attrs])


def test_no_module_writes_into_another_objects_tensors():
    """In-place writes reach another object's tensors only through its methods: no
    ``other.t[i] = x``, ``other.t += x`` or ``other.t.add_(x)`` outside :data:`OWN_TENSORS`."""
    found = set()
    for path in FILES:
        where = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
            for target in targets:
                written = _foreign(target)
                if written and (isinstance(target, ast.Subscript)
                                or isinstance(node, ast.AugAssign)):
                    found.add((where, written))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                method = node.func.attr
                if method.endswith("_") and not method.startswith("_"):  # torch's in-place
                    written = _foreign(node.func.value, skip=("torch", "nn", "F"))
                    if written:
                        found.add((where, f"{written}.{method}"))
    assert found == OWN_TENSORS, (found - OWN_TENSORS, OWN_TENSORS - found)


def test_the_attention_op_and_its_paths_import_only_maths():
    """The op, its data and the streaming path know kernels, the half dtypes and the product
    paths (the widened and the packed products among them), and nothing of stores, layers,
    backends, sharding or retrieval."""
    graph = import_graph()
    maths = {"rcdl.ops.half", "rcdl.ops.kernels", "rcdl.options", "rcdl.ops.widen",
             "rcdl.ops.packed", "rcdl.ops.partials", "rcdl.ops.plan"}
    assert graph["rcdl.ops.packed"] <= maths, graph["rcdl.ops.packed"]
    assert graph["rcdl.ops.entries"] <= maths, graph["rcdl.ops.entries"]
    assert graph["rcdl.ops.streaming"] <= maths | {"rcdl.ops.entries"}, graph["rcdl.ops.streaming"]
    assert graph["rcdl.ops.attention"] <= maths | {"rcdl.ops.entries", "rcdl.ops.streaming"}, (
        graph["rcdl.ops.attention"])


def test_no_module_assigns_another_objects_attributes():
    """Other modules change a layer through its methods (bind_name, set_learning_rate,
    count_steps, drop_entry_grads) or the switches of rcdl.nn.backends, never by assignment."""
    found = set()
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
            for target in targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id not in ("self", "cls", "ctx")):
                    where = path.relative_to(SRC).as_posix()
                    found.add((where, f"{target.value.id}.{target.attr}"))
    assert found == OWN_OBJECTS, found - OWN_OBJECTS


def test_the_api_front_page_lists_every_name_the_package_exports():
    import rcdl

    page = (SRC.parent / "docs" / "api" / "index.md").read_text()
    missing = [name for name in rcdl.__all__ if name != "__version__" and f"`{name}`" not in page]
    assert not missing, f"docs/api/index.md does not list {missing}"


def test_library_modules_import_no_plotting_library():
    for path in FILES:
        if "app" in path.relative_to(SRC / "rcdl").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("matplotlib", "seaborn", "plotly")
                           for n in names), path


def test_private_modules_have_no_api_page_and_public_ones_do():
    pages = {p.stem for p in (SRC.parent / "docs" / "api").glob("*.md")}
    for path in FILES:
        rel = path.relative_to(SRC / "rcdl")
        if rel.parts[0] == "app" or rel.name == "__init__.py":
            continue
        assert (rel.stem in pages) != rel.stem.startswith("_"), rel


# ------------------------------------------------ docs/architecture.md, "Adding a rule"
def test_a_rule_written_as_the_architecture_page_says_trains_a_layer():
    import dataclasses
    from dataclasses import dataclass

    import torch
    import torch.nn.functional as F

    from rcdl import Grower, GrowingRBF, LearningRule

    @dataclass(frozen=True)
    class NormalisedSGD:
        lr: float
        needs_log_normalizer = False
        ages = None

        def with_lr(self, lr):
            return dataclasses.replace(self, lr=lr)

        def entries(self, step):
            g = step.grad  # (B, d_out)
            v = -self.lr * g / g.norm(dim=1, keepdim=True).clamp_min(1e-12)
            return step.q, v, torch.ones(len(g), dtype=g.dtype, device=g.device)

    assert isinstance(NormalisedSGD(1.0), LearningRule)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=gen, dtype=torch.float64)
    y = torch.sin(x[:, :1]) + x[:, 1:2] ** 2 / 4
    layer = GrowingRBF(4, 1, temperature=0.5, rule=NormalisedSGD(0.3), dtype=torch.float64)
    grower = Grower(layer)
    before = y[192:].square().mean()  # the empty layer answers 0
    for i in range(0, 192, 16):
        xb, yb = x[i:i + 16], y[i:i + 16]
        loss = F.mse_loss(layer(xb), yb)
        loss.backward()
        grower.step()
        grower.zero_grad()
    assert len(layer.store) == 192
    keys, values = layer.store.keys[-16:], layer.store.values[-16:]
    torch.testing.assert_close(keys, x[176:192])
    torch.testing.assert_close(values.norm(dim=1), torch.full((16,), 0.3, dtype=torch.float64))
    with torch.no_grad():
        after = F.mse_loss(layer(x[192:]), y[192:])
    assert after < 0.5 * before


# What one experiment may take from another (src/rcdl/app/__init__.py says so): the one-epoch
# comparison's settings, report and runs (the later studies train its models, from the app's
# zoo; the tau sweep runs it once per tau), and the continual study's baselines. Nothing else
# crosses.
SHARED_EXPERIMENT_PARTS = {"cifar10", "cifar10.config", "cifar10.report", "cifar10.combine",
                           "continual.baselines", "attribution.lds"}


def _experiment(module: str) -> str:
    """The experiment a module of ``rcdl.app.experiments`` belongs to: its package
    (``cifar10.config`` is the one-epoch comparison's, ``continual.baselines`` the continual
    study's), else its name's first word (``tau_sweep``)."""
    return module.removeprefix("rcdl.app.experiments.").split(".")[0].split("_")[0]


def test_experiments_share_only_the_parts_the_app_docstring_names():
    graph = import_graph()
    prefix = "rcdl.app.experiments."
    taken = {other.removeprefix(prefix) for module, others in graph.items()
             if module.startswith(prefix) for other in others
             if other.startswith(prefix) and _experiment(other) != _experiment(module)}
    assert taken <= SHARED_EXPERIMENT_PARTS, taken - SHARED_EXPERIMENT_PARTS
    doc = ast.get_docstring(ast.parse((SRC / "rcdl/app/__init__.py").read_text()))
    assert "never each other" not in doc
    for part in SHARED_EXPERIMENT_PARTS:
        assert f"``{part}``" in doc, part
