"""Typed seams: nothing returns a bare `dict` where a record or a typed mapping says more.

- store/: a function returns a record (store/commit/records.py, a frozen dataclass, a
  TypedDict), a typed mapping (`dict[str, np.ndarray]`), or, at a JSON edge, a `JsonObject`
  (store/format/jsonattrs.py: the store's JSON read or written, a CLI's printout, a trainer's
  checkpoint) or a `StorageOptions` (store/storage/credentials.py: what the backend is handed).
  A bare `-> dict` says none of that and fails here.
- The seams that cross processes: the methods of the Ray actors (HarvestActor, TokenizeWorker,
  StreamCoordinator) and the vLLM worker's RPCs (engine/vllm/runner.py): their results are
  pickled to another process, where a misspelt key would fail late and far from its cause.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (file, class) whose public methods another process calls
CROSSING = [
    ("pipeline/actor/capture.py", "HarvestActor"),
    ("pipeline/data/tokenize.py", "TokenizeWorker"),
    ("pipeline/stream/coordinator.py", "StreamCoordinator"),
    ("engine/vllm/runner.py", "_HarvestRPC"),
]


def bare_dict(ann: ast.expr | None) -> bool:
    """`dict`, `dict | None`, `Optional[dict]`, or any of them as a string."""
    if ann is None:
        return False
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(ann, ast.Name):
        return ann.id == "dict"
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return bare_dict(ann.left) or bare_dict(ann.right)
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
        return bare_dict(ann.slice)
    return False


def bare_returns(tree: ast.AST, rel: str) -> list[str]:
    return [f"{rel}:{n.lineno} {n.name}() -> dict" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and bare_dict(n.returns)]


def test_the_detector_sees_every_spelling_of_a_bare_dict():
    src = ("def a() -> dict: ...\ndef b() -> dict | None: ...\ndef c() -> 'dict | None': ...\n"
           "def d() -> Optional[dict]: ...\ndef e() -> dict[str, int]: ...\ndef f() -> 'Foo': ...\n"
           "def g(): ...\n")
    assert [s.split()[1] for s in bare_returns(ast.parse(src), "x.py")] == ["a()", "b()", "c()", "d()"]


def test_the_store_returns_no_bare_dict():
    bad = []
    for p in sorted((REPO / "store").rglob("*.py")):
        rel = p.relative_to(REPO).as_posix()
        bad += bare_returns(ast.parse(p.read_text(), rel), rel)
    assert not bad, ("return a record, a typed mapping, or at a JSON edge a JsonObject "
                     "(store/format/jsonattrs.py):\n" + "\n".join(bad))


def test_no_message_across_processes_is_a_bare_dict():
    bad = []
    for rel, name in CROSSING:
        tree = ast.parse((REPO / rel).read_text(), rel)
        cls = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
        assert cls, f"{rel} has no class {name}: update CROSSING"
        methods = [n for n in cls[0].body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
        assert methods, f"{rel}:{name} has no public method"
        bad += [f"{rel}:{m.lineno} {name}.{m.name}() -> dict" for m in methods if bare_dict(m.returns)]
        bad += [f"{rel}:{m.lineno} {name}.{m.name}() has no return annotation" for m in methods
                if m.returns is None]
    assert not bad, ("a result another process reads is a typed record (pipeline/messages.py, "
                     "engine/vllm/messages.py):\n" + "\n".join(bad))
