"""The package's layers, from its imports (static, every import counted: function-local and
type-only ones too): no import circle, and no import from a folder to one above it or beside it.

    core/                  level 0: imports nothing of the package outside core/
    detect/ launchers/ data/   level 1: core/ only (and their own folder)
    adapters/ recover/     level 2: the levels below
    the package root       level 3: anything (what users import, and the public shims)
"""

from __future__ import annotations

import ast
from pathlib import Path

import fault_tolerant_handlers

PACKAGE = Path(fault_tolerant_handlers.__file__).parent
LEVELS = {"core": 0, "detect": 1, "launchers": 1, "data": 1, "adapters": 2, "recover": 2}
ROOT_LEVEL = 3


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - (node.level - 1)]
                target = ".".join(parent + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                full = f"{target}.{a.name}"
                out.add(full if full in known else target)
    return {m for m in out if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LEVELS) else None


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_every_folder_has_a_level():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LEVELS), f"a new folder needs a level in LEVELS: {sorted(folders - set(LEVELS))}"


def test_no_import_circle():
    assert _circles(_graph()) == []


def test_no_import_up_or_across_the_layers():
    wrong = []
    for module, deps in _graph().items():
        folder = _folder(module)
        level = LEVELS[folder] if folder else ROOT_LEVEL
        for dep in deps:
            dep_folder = _folder(dep)
            if dep_folder == folder:
                continue
            dep_level = LEVELS[dep_folder] if dep_folder else ROOT_LEVEL
            if dep_level >= level:
                wrong.append(f"{module} imports {dep}")
    assert wrong == []


def test_the_core_knows_no_framework():
    for path in (PACKAGE / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("ignite", "lightning", "torchdata") for n in names), path
