"""The product's shape, read from its source (issue 27): small files and functions, servicers that do not import each
other, and no import loop between product modules. The tree is parsed, not imported."""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import REPO_ROOT

ROOT = REPO_ROOT
# The product's folders and the packages they are (pyproject.toml package-dir).
PACKAGES = {
    "engine": "omnivox.engine",
    "services": "omnivox.services",
    "models": "omnivox.models",
    "codecs": "omnivox.codecs",
    "native": "omnivox.native",
}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 100
BOUNDED = ("engine", "services", "models", "codecs")  # the folders the size bounds hold for


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (never run)."""
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes |= {id(n) for n in ast.walk(node)}
    return nodes


def _imports(name: str, with_type_checking: bool) -> set[str]:
    """The product modules `name` imports, at module level or inside functions."""
    tree, path = TREES[name], MODULES[name]
    skip = set() if with_type_checking else _type_checking_nodes(tree)
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            targets |= {base} | {f"{base}.{a.name}" for a in node.names}
    found = set()
    for target in targets:
        while target and target not in MODULES:  # `from pkg.mod import name`: the module is pkg.mod
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def test_no_file_over_400_lines_and_no_function_over_100() -> None:
    too_long = []
    for name, path in MODULES.items():
        if path.relative_to(ROOT).parts[0] not in BOUNDED:
            continue
        lines = path.read_text().count("\n")
        if lines > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(TREES[name]):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)


def _servicer_modules() -> set[str]:
    """Modules defining a gRPC servicer: a class whose base is a generated `...Servicer`."""
    found = set()
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Servicer") for b in node.bases):
                found.add(name)
    return found


def test_no_servicer_imports_another() -> None:
    servicers = _servicer_modules()
    assert {
        "omnivox.services.grpc_api.generation",
        "omnivox.services.grpc_api.speech",
        "omnivox.services.grpc_api.transcription",
    } <= servicers
    crossing = {s: sorted(_imports(s, with_type_checking=True) & (servicers - {s})) for s in servicers}
    assert not any(crossing.values()), crossing


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                    components.append(sorted(component))
    return components


def test_no_import_loop_between_product_modules() -> None:
    """Imports that run (at module level or in a function; `if TYPE_CHECKING:` ones never run) form no loop."""
    graph = {name: _imports(name, with_type_checking=False) for name in MODULES}
    assert not _cycles(graph), _cycles(graph)


def test_the_loop_finder_finds_loops() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
