"""The library's structure, read from its source (docs/architecture.md): no import cycles,
the streaming attention is pure maths, and no module assigns another object's attributes."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
FILES = sorted((SRC / "rcdl").rglob("*.py"))

# assignments to another object's attributes that stay inside the module that owns them
OWN_OBJECTS = {
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


def test_the_moved_optimizers_are_importable_from_their_old_module():
    import rcdl.entry_adam
    import rcdl.hybrid
    import rcdl.hybrid_grower

    assert rcdl.hybrid.EntryAdam is rcdl.entry_adam.EntryAdam
    assert rcdl.hybrid.HybridGrower is rcdl.hybrid_grower.HybridGrower


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
