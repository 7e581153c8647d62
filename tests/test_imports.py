"""onnxtrain's modules import each other without cycles, and at module level: a function-level import of an
onnxtrain module (the usual way to dodge a cycle) is allowed only where ALLOWED_LAZY says why."""

from __future__ import annotations

import ast
from pathlib import Path

import onnxtrain

PACKAGE = Path(onnxtrain.__file__).parent

# (importing module, imported module) -> why the import waits until the function runs. Edges listed here are
# also left out of the cycle check, so an entry may only name an import that waits for a reason other than a
# cycle (none does now): a cycle is removed by moving code, as lower/build.py was split from model.py.
ALLOWED_LAZY: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = ("onnxtrain",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(module: str) -> list[tuple[str, bool]]:
    """(onnxtrain module imported, whether inside a function) for each import `module` runs; imports under
    `if TYPE_CHECKING:` never run and are skipped."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if is_type_checking_block(node):
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, in_function) for a in node.names if a.name.split(".")[0] == "onnxtrain")
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] == "onnxtrain":
                for alias in node.names:  # `from . import x` imports the submodule x where there is one
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in MODULES else target, in_function))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def test_no_unexplained_function_level_imports():
    lazy = {(m, target) for m in MODULES for target, in_function in imports(m) if in_function}
    assert lazy - set(ALLOWED_LAZY) == set()


def test_no_import_cycles():
    graph = {
        m: sorted({t for t, lazy in imports(m) if t in MODULES and t != m and not (lazy and (m, t) in ALLOWED_LAZY)})
        for m in MODULES
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in graph[module]:
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                walk(target)
        path.pop()
        state[module] = 2

    for module in MODULES:
        if module not in state:
            walk(module)
    assert cycles == []
