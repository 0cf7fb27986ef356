"""harvest's import graph from the source (ast): every `import`/`from ... import` in a module,
wherever it sits (module level, function, method, try block), relative imports resolved; imports
under `if TYPE_CHECKING:` are no edge unless `annotations=True` asks for them (a circle that
only annotations close still ties two modules together). Used by the import-cycle and the layer
tests."""

from __future__ import annotations

import ast


def _target(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, annotations: bool = False):
    """Every import statement in `tree`, at any depth, except under `if TYPE_CHECKING:` (unless
    `annotations`)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            todo += child.orelse if _type_checking(child) and not annotations else [child]


def import_graph(mods: dict, annotations: bool = False) -> dict[str, set[str]]:
    """{module: the harvest modules it imports anywhere in its source}; with `annotations`,
    the imports under `if TYPE_CHECKING:` too."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, (path, is_pkg) in mods.items():
        for node in _imports(ast.parse(path.read_text(), str(path)), annotations):
            if isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                t = _target(m, is_pkg, node)
                for a in node.names:
                    if f"{t}.{a.name}" in mods:
                        graph[m].add(f"{t}.{a.name}")
                    elif t in mods:
                        graph[m].add(t)
            graph[m].discard(m)
    return graph
