"""Import hygiene, read from the source with ast: no import cycles, gRPC only where it belongs.

Every import counts, wherever it is written (inside functions, under TYPE_CHECKING): a module
that imports another which imports it back is a cycle even when Python happens to cope.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO

# Source folders and the dotted names their modules are installed under.
PACKAGES = {"singularityd": "singularityd", "cli": "singularity.cli", "proxy": "singularity.proxy"}
# The in-job client's folder is put on the job's PYTHONPATH, so it imports itself top-level.
IN_JOB_CLIENT = ("_singularity_proxy", "singularity.proxy.bootstrap._singularity_proxy")
# The user API, the CLI, the proxy's control client, and the peer transport of the federation
# (its second network API: the mTLS peer service, its channels, the join and transfer streams, and
# the daemon's federation that serves them). The federation's decisions (membership, hand-off,
# hosting checks, PKI) and the daemon's side of a move (moves, jobfiles, holdings) stay free of it.
GRPC_ALLOWED = (
    "singularityd.api",
    "singularity.cli",
    "singularity.proxy.control",
    "singularityd.federation.v1",
    "singularityd.federation.tls",
    "singularityd.federation.peer",
    "singularityd.federation.join",
    "singularityd.federation.transfer_grpc",
    "singularityd.federation.heartbeat",
    "singularityd.federation.driver",
    "singularityd.federation.service",
)


def source_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the packages."""
    found: dict[str, Path] = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([dotted, *parts])] = path
    return found


MODULES = source_modules()


def _named(name: str) -> str:
    """The installed name of an imported module (the in-job client's own imports included)."""
    short, full = IN_JOB_CLIENT
    if name == short or name.startswith(short + "."):
        return full + name[len(short) :]
    return name


def _resolve(name: str) -> str | None:
    """The module of ours that `name` loads: itself, else its nearest known parent; None if not ours."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imported_names(module: str, path: Path) -> Iterator[str]:
    """The absolute name of every module the file's import statements load.

    `from package import submodule` loads the submodule (the package's own __init__ runs too, as
    for every import of a submodule, and is not counted as an edge of its own).
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _named(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _named(node.module or "")
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in MODULES else base


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_resolve(name) for name in imported_names(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_walk_sees_the_packages_and_their_imports() -> None:
    graph = import_graph()
    assert "singularityd.daemon" in graph and "singularity.cli.main" in graph
    assert "singularityd.core.decisions" in graph["singularityd.daemon"]
    assert "singularityd.api.protocol" in graph["singularityd.api.service"]


def test_cycle_finder_reports_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert cycles(import_graph()) == []


def _imports_grpc(module: str) -> bool:
    return any(
        name == "grpc" or name.startswith(("grpc.", "grpc_tools"))
        for name in imported_names(module, MODULES[module])
    )


def test_grpc_is_imported_only_by_the_api_the_cli_and_the_proxy_control() -> None:
    importers = {module for module in MODULES if _imports_grpc(module)}
    assert "singularityd.api.service" in importers, "the check must see gRPC imports"
    assert {m for m in importers if not m.startswith(GRPC_ALLOWED)} == set()


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module of ours that importing `start` loads (through explicit imports)."""
    seen = {start}
    todo = [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("forbidden", ["singularityd.daemon", "singularityd.store", "singularity.proxy"])
def test_the_cli_never_reaches_the_daemon(forbidden: str) -> None:
    assert forbidden not in reachable(import_graph(), "singularity.cli.main")
