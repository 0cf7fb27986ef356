"""The store's one face (store/__init__.py): pipeline/, examples/, jobs/ and packages/ import the
store only from `harvest.store`, and only names its `__all__` declares. An import of a store
submodule (`harvest.store.<submodule>`, function-level imports included) is an exception listed
below with its reason; the list only shrinks (an exception no longer used fails too), so the
face, not a path into the store's insides, is what everything outside the store depends on.

And the `Store` class's own face: its public names (methods, properties, attributes) are the
declared ATTRIBUTES, DATA and VERBS below; the store's bookkeeping is `store.ledger.<name>`, so a
delegate to the ledger that is not a declared user verb fails here.
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


# ---- the Store class's own face: data and attributes, a few user verbs; bookkeeping is the ledger's

# what a store is: the format facts, its attributes, and the callbacks that keep them in step with
# what the ledger has just written (finalize, unfinalize, resize)
ATTRIBUTES = frozenset({
    "points", "width", "widths", "mixed_widths", "max_width", "n_rows", "shard_rows", "chunk_rows",
    "dtype", "np_dtype", "row_width", "quantized", "compression", "layout_version", "read_only",
    "url", "location", "zarr_store", "attrs", "attributes", "harvest_attrs", "summary",
    "context_size", "special_token_ids", "bos_token_id", "tokenizer", "stats_skip_positions",
    "stats_filter", "meta_columns", "n_shards", "row_bytes", "row_set_bytes", "point_row_width",
    "shard_range", "info", "ledger", "block_buffers", "point_values",
    "note_finalized", "note_unfinalized", "note_resized",
})
# the data: arrays and codecs, checked and plain reads of rows and row metadata, the writer of a
# region, the statistics
DATA = frozenset({
    "array", "meta_array", "shard_codec", "meta_codec", "read_shard", "read", "read_values",
    "values", "read_row_meta", "read_row_meta_checked", "read_gen", "read_sample",
    "region_writer", "merge_stats", "stats",
})
# the ledger's methods the store answers to itself, each because the docs show users calling it
VERBS: dict[str, str] = {
    "verify": "docs/store.md shows `store.verify(deep=..., objects=...)` returning a VerifyReport; "
              "README's `harvest verify` is the same check",
    "finalize": "what a run and `harvest finalize` end with; the store's one write of its summary "
                "and merged statistics, which a user finishing a store by hand calls",
    "uncommit": "the repair store/FORMAT.md names (`store.uncommit(unit)` and rerun, three times) "
                "and the integrity errors of tables.py and objects.py tell users to run",
}


def public_names(source: str, cls: str) -> set[str]:
    """Every public name class `cls` of `source` has: its methods and properties, class
    attributes, and the attributes its methods set on `self`."""
    [node] = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls]
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
            for sub in ast.walk(item):
                targets = (sub.targets if isinstance(sub, ast.Assign) else
                           [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else [])
                for t in targets:
                    for e in ast.walk(t):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) \
                                and e.value.id == "self":
                            names.add(e.attr)
        elif isinstance(item, ast.Assign):
            names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    return {n for n in names if not n.startswith("_")}


def face_findings(store_names: set[str], ledger_names: set[str], attributes: frozenset,
                  data: frozenset, verbs: dict) -> list[str]:
    """What is wrong with the store's face: a public name not declared, a declared name that is
    gone, a ledger name on the store that is not a verb, a verb the ledger does not have."""
    declared = attributes | data | set(verbs)
    out = [f"Store.{n} is not declared: bookkeeping is `store.ledger.{n}` (no delegate on Store); "
           "a new datum, attribute or user verb goes into ATTRIBUTES, DATA or VERBS of "
           "tests/house/test_store_face.py" for n in sorted(store_names - declared)]
    out += [f"Store.{n} is declared but Store has no {n}: delete it from the list"
            for n in sorted(declared - store_names)]
    out += [f"Store.{n} is the ledger's `{n}` on the store: callers use `store.ledger.{n}`, or "
            "it is a user verb (VERBS, with the docs that show it)"
            for n in sorted((store_names & ledger_names) - set(verbs))]
    out += [f"verb {n} is not the ledger's: a verb on Store hands its work to the ledger"
            for n in sorted(set(verbs) - ledger_names)]
    out += [f"{n} is declared twice" for n in sorted((attributes & data) | ((attributes | data) & set(verbs)))]
    return out


def _names(rel: str, cls: str) -> set[str]:
    return public_names((REPO / rel).read_text(), cls)


def test_store_keeps_data_attributes_and_its_declared_verbs_only():
    found = face_findings(_names("store/store.py", "Store"), _names("store/commit/ledger.py", "Ledger"),
                          ATTRIBUTES, DATA, VERBS)
    assert not found, "\n".join(found)
    assert len(VERBS) <= 4 and all(len(why) > 40 for why in VERBS.values())


def test_a_delegate_crept_back_onto_a_store_is_found():
    ledger = "class Ledger:\n    def __init__(self):\n        self.plans = 1\n" \
             "    def plan_units(self): ...\n    def verify(self): ...\n"
    store = ("class Store:\n    LIMIT = 3\n    def __init__(self):\n        self.points = []\n"
             "        self.plans = None\n        self._private = 1\n"
             "    def read(self): ...\n    def verify(self): ...\n    def plan_units(self): ...\n"
             "    @property\n    def _hidden(self): ...\n")
    store_names, ledger_names = public_names(store, "Store"), public_names(ledger, "Ledger")
    assert store_names == {"LIMIT", "points", "plans", "read", "verify", "plan_units"}
    assert ledger_names == {"plans", "plan_units", "verify"}
    found = face_findings(store_names, ledger_names, frozenset({"points", "width"}),
                          frozenset({"read"}), {"verify": "why", "settle": "why"})
    said = "\n".join(found)
    for n in ("LIMIT", "plans", "plan_units"):
        assert f"Store.{n} is not declared" in said, said
    assert "Store.plans is the ledger's" in said and "Store.plan_units is the ledger's" in said
    assert "Store.width is declared but Store has no width" in said
    assert "Store.settle is declared but Store has no settle" in said
    assert "verb settle is not the ledger's" in said
    assert len(found) == 8, said
    assert face_findings({"points", "read", "verify"}, ledger_names, frozenset({"points"}),
                         frozenset({"read"}), {"verify": "why"}) == []
