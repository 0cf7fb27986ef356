"""The suite's own layout: helpers shared by test modules live in tests/support (or are fixtures in
tests/fixtures), so no module imports a test module. Importing one would run its module-level
code and pytestmark in the importer and tie the two files' fates together."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_no_module_imports_a_test_module():
    bad = [f"{p.relative_to(TESTS.parent)} imports {m}"
           for p in sorted(TESTS.rglob("*.py")) for m in sorted(_imported(p))
           if m.startswith("tests.") and m.rsplit(".", 1)[-1].startswith("test_")]
    assert not bad, "move shared helpers to tests/support/: " + "; ".join(bad)


def test_support_modules_hold_no_tests():
    for p in sorted((TESTS / "support").glob("*.py")):
        assert not p.name.startswith("test_"), p
        tree = ast.parse(p.read_text())
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                 and n.name.startswith(("test", "Test"))]
        assert not names, f"{p.name} defines {names}: tests belong in a test_*.py module"
