"""The layout's rules (specproxy/README.md, "The layout"), checked on the source: what may import what,
no import cycles, and rooms small enough to hold in mind.

Imports are read with :mod:`ast`, nothing is imported. A module-level import counts for the cycle
check; an import inside a function (made only when it runs, to keep commands fast) counts for the
layering rules too, since it is still a dependency.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "specproxy": "specproxy",
    "proxy": "proxy",
    "engines": "engines",
    "analysis": "analysis",
    "lab": "lab",
}
ROOMS = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["specproxy"]["subpackages"])

# Rooms still over the size limits, each with its size today: a split is owed; none may grow, and
# none may be added. (Remove a line once its room is split.) None today.
OVERSIZE: dict[str, int] = {}
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 700, 300, 80


def module_name(path: Path) -> str:
    """specproxy.proxy.server.app for proxy/server/app.py, as installed."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) if parts[0] == "specproxy" else ".".join(["specproxy", *parts])


def sources() -> Iterator[tuple[str, Path, ast.Module]]:
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield module_name(path), path, ast.parse(path.read_text(encoding="utf-8"))


def imported(tree: ast.Module, module_level_only: bool) -> set[str]:
    """The specproxy modules a module imports (``from a import b`` counts a.b where b is a module)."""
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.split(".")[0] == "specproxy"}


def room(module: str) -> str:
    """The top-level room a module is in: proxy, engines, analysis, lab, or the root's contracts."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else "specproxy"


MODULES = {name: (path, tree) for name, path, tree in sources()}


def known(names: set[str]) -> set[str]:
    return {name for name in names if name in MODULES}


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        ("specproxy", {"proxy", "engines", "analysis", "lab"}),
        ("proxy", {"engines", "lab"}),
        ("engines", {"proxy", "analysis", "lab"}),
        ("analysis", {"proxy", "engines", "lab"}),
    ],
)
def test_what_a_room_may_import(importer: str, forbidden: set[str]) -> None:
    broken = sorted(
        f"{name} imports {target}"
        for name, (_, tree) in MODULES.items()
        if room(name) == importer
        for target in known(imported(tree, module_level_only=False))
        if room(target) in forbidden
    )
    assert broken == []


def test_the_server_does_not_import_the_load_generator() -> None:
    broken = sorted(
        f"{name} imports {target}"
        for name, (_, tree) in MODULES.items()
        if name.startswith("specproxy.proxy.server")
        for target in imported(tree, module_level_only=False)
        if target.startswith("specproxy.proxy.replay")
    )
    assert broken == []


def test_only_the_cli_table_names_the_lab() -> None:
    cli = (ROOT / "specproxy" / "cli.py").read_text(encoding="utf-8")
    assert '"specproxy.lab.command"' in cli  # the lazy command table names it as a string
    assert "specproxy.lab.command" in MODULES  # ... a module that exists
    # (that no room imports the lab is test_what_a_room_may_import's)


def test_no_import_cycles() -> None:
    graph = {
        name: known(imported(tree, module_level_only=True)) - {name} for name, (_, tree) in MODULES.items()
    }
    # a package's own __init__ is imported first whenever one of its modules is: not an edge back
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def sizes() -> Iterator[tuple[str, int, int]]:
    """(key, lines, limit) for every module, class and function of the rooms and the root."""
    for _, (path, tree) in MODULES.items():
        rel = path.relative_to(ROOT).as_posix()
        yield rel, len(path.read_text(encoding="utf-8").splitlines()), MAX_MODULE
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
                yield f"{rel}::{node.name}", node.end_lineno - node.lineno + 1, limit


def test_rooms_fit_in_mind() -> None:
    over = {key: lines for key, lines, limit in sizes() if lines > limit}
    grown = {key: lines for key, lines in over.items() if lines > OVERSIZE.get(key, 0)}
    assert grown == {}, "over the size limits (modules 700, classes 300, functions 80 lines)"


def test_the_oversize_list_is_current() -> None:
    over = {key for key, lines, limit in sizes() if lines > limit}
    assert set(OVERSIZE) - over == set(), "split: remove these from OVERSIZE"
