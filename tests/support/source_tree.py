"""harvest's modules as files: the names pyproject.toml's package-dir gives the folders at the
repository root, for tests that read the source itself (import graph, class state)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# folder at the repository root -> its package name (pyproject.toml's package-dir)
ROOTS = {"harvest": "harvest", "engine": "harvest.engine", "pipeline": "harvest.pipeline",
         "store": "harvest.store", "jobs": "harvest.jobs", "benchmarks": "harvest.benchmarks",
         "testing": "harvest.testing"}


def modules(repo: Path = REPO, roots: dict = ROOTS) -> dict[str, tuple[Path, bool]]:
    """{module name: (path, is a package __init__)} for every .py file under the roots."""
    out = {}
    for folder, name in roots.items():
        for p in sorted((repo / folder).rglob("*.py")):
            parts = [x for x in p.relative_to(repo / folder).with_suffix("").parts
                     if x != "__init__"]
            out[".".join([name, *parts])] = (p, p.name == "__init__.py")
    return out
