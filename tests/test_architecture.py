"""The library's structure, read from its source (docs/architecture.md): no import cycles,
the streaming attention is pure maths, and no module assigns another object's attributes."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
FILES = sorted((SRC / "rcdl").rglob("*.py"))

# assignments to another object's attributes that stay inside the module that owns them
OWN_OBJECTS = {
    ("rcdl/layers.py", "record.normaliser"),  # the layer's own _Record
    ("rcdl/vit.py", "block.ffn"),  # the ViT fills its own blocks
    ("rcdl/distributed.py", "sys.stdout"),  # ranks > 0 print nothing
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path, known: set[str]) -> set[str]:
    """The rcdl modules ``path`` imports when it is imported (not under TYPE_CHECKING, not
    inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} & known
            found |= {f"{node.module}.{a.name}" for a in node.names} & known
    return found


def test_no_import_cycles():
    known = {module_name(p) for p in FILES}
    graph = {module_name(p): top_level_imports(p, known) for p in FILES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError(" -> ".join([*path[path.index(module):], module]))
        if module not in done:
            for other in sorted(graph[module]):
                visit(other, [*path, module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_streaming_attention_imports_only_kernels_store_and_the_product_paths():
    known = {module_name(p) for p in FILES}
    imported = top_level_imports(SRC / "rcdl" / "attention.py", known)
    assert imported <= {"rcdl.half", "rcdl.kernels", "rcdl.store"}, imported


def test_no_module_assigns_another_objects_attributes():
    """Other modules change a layer through its methods (bind_name, set_learning_rate,
    restore_step_state, use_shard, use_retrieval, drop_entry_grads), never by assignment."""
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
