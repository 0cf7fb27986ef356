"""One import style inside the package: harvest's own modules import each other relatively.

The folders at the repository root (engine/, pipeline/, store/, ...) are harvest's subpackages
only through pyproject.toml's package-dir, so `harvest.store.read` names no path anyone can follow
from the tree alone. A relative import (`from ...store.read import dataset` in pipeline/actor/)
names the imported file by its place beside the importing one: readers, grep and tools that draw
the import graph from paths see the real graph, and `from ...` counts the folders it climbs.
Outside the package (tests, examples, infra scripts) and in strings that name a module for another
process (vLLM's worker_cls, `python -m ...`), the absolute name is the only one there is.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.source_tree import modules


def absolute_self_imports(path: Path) -> list[str]:
    """`file:line: import` for each absolute import of harvest in one module's source."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        out += [f"{path}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "harvest"]
    return out


def test_the_package_imports_itself_relatively():
    mods = modules()
    assert len(mods) > 200  # the whole package is scanned
    bad = [hit for path, _ in mods.values() for hit in absolute_self_imports(path)]
    assert not bad, ("absolute imports of harvest inside the package (write them relatively, "
                     "e.g. `from ..store import create_store`):\n  " + "\n  ".join(bad))


def test_an_absolute_self_import_is_found(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\nfrom . import a\nfrom harvest.store import x\n"
                 "def f():\n    import harvest.engine as e\n")
    assert absolute_self_imports(p) == [f"{p}:3: harvest.store", f"{p}:5: harvest.engine"]
