"""Issue 36: no module of the project's packages imports, directly or through others, a module that
imports it back. Read from the source (ast), every import counted: a function's deferred one and an
``if TYPE_CHECKING:`` one included (each hides a circle, neither cuts it: the two modules still need
each other). A circle is cut by moving what both sides need below them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = (
    "pandastack_jobs",
    "pandastack_local",
    "airflow_provider",
    "prefect_blocks",
    "pandastack_workflows",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``name`` imports: ``from a import b`` is ``a.b`` when b is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = {f"{source}.{alias.name}" for alias in node.names} & known
            out |= submodules
            if len(submodules) < len(node.names):
                out.add(source)
    return (out & known) - {name}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    known = set(paths)
    return {name: imports(path, name, known) for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_walker_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_walker_counts_deferred_and_typing_only_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import typed\n"
        "def f():\n    from pkg import deferred\n"
    )
    assert imports(source, "m", {"pkg.typed", "pkg.deferred"}) == {"pkg.typed", "pkg.deferred"}


def test_the_packages_import_no_circle() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the walk saw the packages
    assert circles(graph) == []
