"""The store's one face (store/__init__.py): pipeline/, examples/, jobs/ and packages/ import the
store only from `harvest.store`, and only names its `__all__` declares. An import of a store
submodule (`harvest.store.<submodule>`, function-level imports included) is an exception listed
below with its reason; the list only shrinks (an exception no longer used fails too), so the
face, not a path into the store's insides, is what everything outside the store depends on.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support.import_graph import _target
from tests.support.source_tree import modules

REPO = Path(__file__).resolve().parents[2]
HELD = ("pipeline", "examples", "jobs", "packages")

STREAM_IS_THE_READER = (
    "the stream is the reader fed by actors instead of shards: it runs the reader's own "
    "batching, row forms, rank split, mixing and normalisation, so a streamed batch is the "
    "reader's batch; reader internals shared on purpose, not an API for others")

# (file, store module) -> why that file may import that module directly
ALLOWED: dict[tuple[str, str], str] = {
    ("pipeline/stream/api.py", "harvest.store.read"): STREAM_IS_THE_READER,
    ("pipeline/stream/api.py", "harvest.store.read.feed.batching"): STREAM_IS_THE_READER,
    ("pipeline/stream/api.py", "harvest.store.read.shuffle.mixing"): STREAM_IS_THE_READER,
    ("pipeline/stream/api.py", "harvest.store.read.shuffle.order"): STREAM_IS_THE_READER,
    ("pipeline/stream/api.py", "harvest.store.read.tensors"): STREAM_IS_THE_READER,
    ("pipeline/stream/windows.py", "harvest.store.read.feed.readahead"): STREAM_IS_THE_READER,
    ("pipeline/stream/coordinator.py", "harvest.store.read.normalize"): STREAM_IS_THE_READER,
}


def store_imports(path: Path, module: str | None = None,
                  is_pkg: bool = False) -> list[tuple[str, list[str], int]]:
    """(store module, names, line) of every import of harvest.store in `path`, anywhere in it
    (`import harvest.store.x` gives the module and no names). `module`: the file's module name
    inside the package (relative imports are resolved from it); None outside the package."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.level == 0 or module):
            target = _target(module, is_pkg, node) if node.level else (node.module or "")
            if (target == "harvest" and "store" in [a.name for a in node.names]) or \
                    target == "harvest.store" or target.startswith("harvest.store."):
                if target == "harvest":   # `from ... import store`: the face itself
                    target, names = "harvest.store", []
                else:
                    names = [a.name for a in node.names]
                out.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names
                    if a.name == "harvest.store" or a.name.startswith("harvest.store.")]
    return out


def violations(repo: Path, face: set[str], allowed: dict) -> tuple[list[str], set]:
    """What breaks the rule, and the exceptions that were used."""
    bad, used = [], set()
    in_package = {path.relative_to(repo).as_posix(): (m, is_pkg)
                  for m, (path, is_pkg) in modules(repo).items()}
    for folder in HELD:
        for p in sorted((repo / folder).rglob("*.py")):
            rel = p.relative_to(repo).as_posix()
            for module, names, line in store_imports(p, *in_package.get(rel, (None, False))):
                if module == "harvest.store":
                    bad += [f"{rel}:{line} imports {n}, which harvest.store.__all__ does not "
                            "declare" for n in names if n not in face]
                elif (rel, module) in allowed:
                    used.add((rel, module))
                else:
                    bad.append(f"{rel}:{line} imports {module}: import it from harvest.store "
                               "(add the names to its __all__), or list the exception with its "
                               "reason in tests/house/test_store_face.py")
    return bad, used


def _face() -> set[str]:
    import harvest.store

    return set(harvest.store.__all__)


def test_pipeline_and_examples_import_the_store_through_its_face_only():
    bad, _ = violations(REPO, _face(), ALLOWED)
    assert not bad, "\n".join(bad)


def test_every_exception_is_still_needed_and_says_why():
    _, used = violations(REPO, _face(), ALLOWED)
    assert set(ALLOWED) == used, f"no longer imported, delete: {sorted(set(ALLOWED) - used)}"
    assert all(len(why) > 40 for why in ALLOWED.values())


def test_every_name_of_the_face_resolves_and_the_face_stays_light():
    """Each declared name exists (the lazy ones too), and importing the face loads no torch."""
    import harvest.store as face

    assert len(set(face.__all__)) == len(face.__all__)
    for name in face.__all__:
        assert getattr(face, name) is not None, name
    code = "import sys, harvest.store; print('torch' in sys.modules, 'ray' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=300)
    assert r.stdout.split() == ["False", "False"], r.stderr[-2000:]


def test_a_submodule_import_and_an_undeclared_name_are_found(tmp_path):
    (tmp_path / "pipeline" / "x").mkdir(parents=True)
    (tmp_path / "examples").mkdir()
    (tmp_path / "pipeline" / "x" / "m.py").write_text(
        "def f():\n    from harvest.store.format.layout import ROW_META\n")
    (tmp_path / "examples" / "e.py").write_text(
        "import harvest.store.read.dataset\nfrom harvest.store import open_store, _hidden\n")
    (tmp_path / "pipeline" / "x" / "r.py").write_text(   # relative, inside the package
        "from ... import store\nfrom ...store import open_store, _other\nfrom ...store.read import rows\n")
    bad, _ = violations(tmp_path, {"open_store"}, {})
    said = "\n".join(bad)
    assert len(bad) == 5, said
    assert "pipeline/x/r.py:2 imports _other, which harvest.store.__all__ does not declare" in said
    assert "pipeline/x/r.py:3 imports harvest.store.read" in said
    assert "pipeline/x/m.py:2 imports harvest.store.format.layout" in said
    assert "examples/e.py:1 imports harvest.store.read.dataset" in said
    assert "examples/e.py:2 imports _hidden, which harvest.store.__all__ does not declare" in said
    ok, used = violations(tmp_path, {"open_store", "_hidden", "_other"},
                          {("pipeline/x/m.py", "harvest.store.format.layout"): "why",
                           ("examples/e.py", "harvest.store.read.dataset"): "why",
                           ("pipeline/x/r.py", "harvest.store.read"): "why"})
    assert ok == [] and len(used) == 3
