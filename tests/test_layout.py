"""The house rules of docs/architecture.md, checked on the source tree.

- imports point down the layer table (a module imports only from its own layer's package or below);
- no module imports another module's ``_private`` names;
- no import circles between modules (top-level imports; lazy imports inside functions are allowed to
  reach sideways only where the table allows);
- no module over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "copc"

#: Layers, lowest first. A module of layer i may import copc packages of layers <= i (and its own
#: package); ``runtime`` and ``trainer`` share a layer but may not import each other, except the loop
#: (runtime/loop.py), which hands batches to the trainer.
LAYERS: list[set[str]] = [
    {"ops"},
    {"types", "config", "registry", "tracking"},
    {"channels", "models", "tools", "rewards"},
    {"tasks"},
    {"rollout"},
    {"runtime", "trainer"},
    {"eval"},
    {"run"},
    {"lab"},
    {"experiments", "integrations"},
    {"cli", "__init__"},
]
SIDEWAYS_ALLOWED = {("runtime", "trainer")}
MAX_LINES = 500


def layer_of(top: str) -> int:
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"package copc.{top} is not in the layer table of tests/test_layout.py")


def modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py"))


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def copc_imports(path: Path, *, top_level_only: bool) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every ``copc`` import in ``path``."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "copc":
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "copc"]
    return out


def is_submodule(name: str) -> bool:
    return (SRC / name).is_dir() or (SRC / f"{name}.py").exists()


def top_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_imports_point_down() -> None:
    bad = []
    for path in modules():
        here = top_package(module_name(path))
        for module, names, line in copc_imports(path, top_level_only=False):
            targets = [module] if module != "copc" else [f"copc.{n}" if is_submodule(
                n) else "copc" for n in names]
            for target in targets:
                there = top_package(target)
                if there == here or (here, there) in SIDEWAYS_ALLOWED:
                    continue
                if layer_of(there) >= layer_of(here) and not (layer_of(there) == layer_of(here) == len(
                    LAYERS) - 1):
                    bad.append(f"{path.relative_to(SRC)}:{line} copc.{here} imports {target}")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_no_private_names_cross_a_module_boundary() -> None:
    bad = []
    for path in modules():
        for module, names, line in copc_imports(path, top_level_only=False):
            bad += [f"{path.relative_to(SRC)}:{line} imports {module}.{n}" for n in names if n.startswith(
                "_") and not n.endswith("__")]
    assert not bad, "\n".join(bad)


def test_no_import_circles() -> None:
    graph: dict[str, set[str]] = {}
    known = {module_name(p) for p in modules()}
    for path in modules():
        deps = set()
        for module, names, _ in copc_imports(path, top_level_only=True):
            deps |= {f"{module}.{n}" for n in names if f"{module}.{n}" in known}
            deps.add(module)
        graph[module_name(path)] = {d for d in deps if d in known and d != module_name(path)}

    def is_package_edge(a: str, b: str) -> bool:  # a package __init__ importing its own submodules
        return b.startswith(a + ".") or a.startswith(b + ".")

    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if is_package_edge(node, dep):
                continue
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_modules_stay_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"{path.relative_to(SRC)} has {lines} lines (> {MAX_LINES}): split it by responsibility")


def test_no_module_is_only_re_exports() -> None:
    bad = []
    for path in modules():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        body = [n for n in body if not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
        if body and all(isinstance(n, ast.ImportFrom | ast.Import | ast.Assign) for n in body):
            bad.append(str(path.relative_to(SRC)))
    assert not bad, f"modules that only re-export: {bad}"


def test_ops_facade_is_the_submodules_lists() -> None:
    """``copc.ops.__all__`` is built from its submodules' lists: each name in one of them, bound to that
    object."""
    import importlib

    import copc.ops

    owners: dict[str, list[str]] = {}
    for path in sorted((SRC / "ops").glob("[!_]*.py")):
        module = importlib.import_module(f"copc.ops.{path.stem}")
        for name in module.__all__:
            owners.setdefault(name, []).append(path.stem)
    twice = {name: where for name, where in owners.items() if len(where) > 1}
    assert not twice, f"names in more than one ops module's __all__: {twice}"
    assert len(copc.ops.__all__) == len(set(copc.ops.__all__))
    for name in copc.ops.__all__:
        module = importlib.import_module(f"copc.ops.{owners[name][0]}")
        assert getattr(copc.ops, name) is getattr(module, name), name
