"""Docs that cannot drift: every `*.py` a docstring, a comment, the README or docs/ names exists.

A file renamed or split leaves its old name in the docstrings that pointed at it; readers then
look for a file under a name it no longer has and find nothing. Found in the source: module,
class and function docstrings and comments of every Python file (tokenize and ast; string
literals in code are data, not references), and the text of README.md, docs/*.md,
store/FORMAT.md, benchmarks/README.md and infra/README.md. A reference resolves when it is a
path from the repository root or from the file's own folder, the tail of such a path, or a file
name that exists somewhere in the repository. Other projects' files (vLLM's, torch's) are named
with their package first and are out of scope here: vLLM's are checked by compat_check.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("harvest", "engine", "pipeline", "store", "jobs", "benchmarks", "testing", "tests",
           "examples", "infra", "packages")
DOCS = ("README.md", "docs", "store/FORMAT.md", "benchmarks/README.md", "infra/README.md")
# other projects' source files, named with their package's path
EXTERNAL = ("vllm/", "v1/", "platforms/", "compilation/", "fused_moe/", "model_executor/",
            "transformers/", "torch/", "ray/", "triton/", "sae_lens/", "zarr/", "s3fs/")
REF = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[A-Za-z_][\w-]*\.py)\b")


def _python_files() -> list[Path]:
    out = []
    for folder in FOLDERS:
        out += [p for p in (REPO / folder).rglob("*.py") if "build" not in p.parts]
    return out


def _prose(path: Path) -> str:
    """A Python file's docstrings and comments."""
    src = path.read_text(encoding="utf-8")
    parts = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                parts.append(tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def _existing() -> "tuple[set[str], set[str]]":
    rels = {str(p.relative_to(REPO)) for p in REPO.rglob("*.py")
            if not {".venv", ".harvest", ".git", "build"} & set(p.relative_to(REPO).parts)
            and not p.relative_to(REPO).parts[0].startswith(".venv")}
    return rels, {Path(r).name for r in rels}


def _resolves(ref: str, where: Path, rels: set[str], names: set[str]) -> bool:
    ref = ref.lstrip("./")
    if ref.startswith(EXTERNAL):
        return True
    if "/" not in ref:
        return ref in names
    if ref in rels or (where.parent / ref).exists():
        return True
    return any(r.endswith("/" + ref) for r in rels)


def test_every_named_python_file_exists():
    rels, names = _existing()
    texts: list[tuple[Path, str]] = [(p, _prose(p)) for p in _python_files()]
    for d in DOCS:
        p = REPO / d
        for f in ([p] if p.is_file() else sorted(p.glob("*.md"))):
            texts.append((f, f.read_text(encoding="utf-8")))
    bad = sorted({f"{f.relative_to(REPO)}: {m.group(1)}" for f, text in texts
                  for m in REF.finditer(text) if not _resolves(m.group(1), f, rels, names)})
    assert not bad, ("files named in docs and docstrings that do not exist (rename the "
                     "reference to the file that holds it now):\n  " + "\n  ".join(bad))
