"""No import circles in ``paradit``: every import a module names is an edge of one graph, and the graph has no cycle.
Every import counts: at the top, inside a function, under ``if TYPE_CHECKING:`` (a type a module names is a layer it
leans on), and by name (a string naming a paradit module, as the family registry's ``PACKAGES`` and the package's lazy
exports do, for ``import_module``). The implicit imports of parent packages are left out."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "paradit"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_name(path: Path) -> str:
    """The package a module's relative imports start from: a package's own ``__init__`` is in it."""
    return ".".join(path.relative_to(PACKAGE.parent).parts[:-1])


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants of ``tree``: prose, which may name modules without importing them."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def imports(tree: ast.Module, package: str, modules: set[str]) -> set[str]:
    """The paradit modules a module of ``package`` (parsed as ``tree``) imports: by statement anywhere in it (relative
    ones resolved against ``package``), and by name (a string naming a module; one naming a package stands for every
    module in it)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            # ``from a import b`` imports the module a.b when there is one, else a's name b.
            found.update(
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module for alias in node.names
            )
    prose = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if node.value.startswith("paradit."):
                found.update(
                    module for module in modules if module == node.value or module.startswith(node.value + ".")
                )
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports(ast.parse(path.read_text()), package_name(path), modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_of_paradit_imports_itself_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles_and_reads_every_kind_of_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = import_graph()
    assert "paradit.settings" in graph["paradit.engine"]
    # A function-local import counts (the CLI imports the engine only when a command needs it).
    assert "paradit.engine" in graph["paradit.cli"]
    # So does one under TYPE_CHECKING, and an import by name: the registry imports each family's record by its
    # package's name, the package its exports on first use.
    modules = {"paradit.engine", "paradit.request", "paradit.families.a", "paradit.families.a.family"}
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import paradit.engine\n")
    assert imports(tree, "paradit", modules) == {"paradit.engine"}
    tree = ast.parse('"""Names paradit.request in prose."""\nPACKAGES = ("paradit.families.a",)\n')
    assert imports(tree, "paradit.families", modules) == {"paradit.families.a", "paradit.families.a.family"}
    assert "paradit.families.flux2.family" in graph["paradit.families"]
    assert "paradit.engine" in graph["paradit"]
    # A relative import resolves against the module's package.
    tree = ast.parse("from . import family\nfrom ...request import GenerationRequest\n")
    assert imports(tree, "paradit.families.a", modules) == {"paradit.families.a.family", "paradit.request"}
