"""Ruff and mypy over harvest's source, at the rules and strictness pyproject.toml states, with zero
findings: the typed seams (dataclasses, Protocols, signatures) are checked before any test runs.

mypy needs the folders as the package they are installed as (engine/ is `harvest.engine`, ...),
so it runs on a tree of links named that way; its cache stays in the checkout (.mypy_cache/,
ignored by git) so a rerun takes seconds. No module is exempt: an override that sets
`ignore_errors` (a list of modules whose findings are not fixed) is refused.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.support.source_tree import REPO, ROOTS

BIN = Path(sys.executable).parent
SOURCES = list(ROOTS)                    # harvest engine pipeline store jobs benchmarks testing


def _tool(name: str) -> str:
    exe = BIN / name
    assert exe.exists(), f"{name} is not installed beside {sys.executable}: pip install -e '.[test]'"
    return str(exe)


def test_ruff_finds_nothing():
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", "--output-format", "concise",
                        *SOURCES, "tests"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check (rules in pyproject.toml [tool.ruff.lint]):\n{r.stdout}{r.stderr}"


def _mypy_config(tmp: Path) -> Path:
    """pyproject's [tool.mypy] as an ini file."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]

    def ini(v):
        if isinstance(v, bool):
            return str(v)
        return ", ".join(v) if isinstance(v, list) else str(v)

    lines = ["[mypy]"] + [f"{k} = {ini(v)}" for k, v in cfg.items() if k != "overrides"]
    for o in cfg.get("overrides", []):
        assert not o.get("ignore_errors"), (
            f"pyproject.toml exempts {o['module']} from mypy (ignore_errors): fix their findings "
            "instead; a third-party stub gap takes a targeted `# type: ignore[code]` with its reason")
        lines.append(f"[mypy-{','.join(o['module'])}]")
        lines += [f"{k} = {ini(v)}" for k, v in o.items() if k != "module"]
    path = tmp / "mypy.ini"
    path.write_text("\n".join(lines) + "\n")
    return path


def mypy_findings(tree_root: Path, config: Path) -> tuple[int, str, dict[str, list[str]]]:
    """(exit status, output, {module: its error lines}) for mypy over the package in tree_root."""
    r = subprocess.run([_tool("mypy"), "--config-file", str(config), "--cache-dir",
                        str(REPO / ".mypy_cache"), "--no-error-summary", "-p", "harvest"],
                       cwd=tree_root, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "MYPYPATH": str(tree_root)})
    found: dict[str, list[str]] = {}
    for line in r.stdout.splitlines():
        m = re.match(r"(harvest/[\w/]+)\.py:\d+: error:", line)
        if m:
            found.setdefault(m.group(1).replace("/", ".").removesuffix(".__init__"), []).append(line)
    return r.returncode, r.stdout + r.stderr, found


def test_mypy_finds_nothing(tmp_path):
    tree = tmp_path / "tree"
    (tree / "harvest").mkdir(parents=True)
    (tree / "harvest" / "__init__.py").write_text((REPO / "harvest" / "__init__.py").read_text())
    for folder, name in ROOTS.items():
        if folder != "harvest":
            (tree / "harvest" / name.split(".")[1]).symlink_to(REPO / folder)
    rc, out, found = mypy_findings(tree, _mypy_config(tmp_path))
    assert rc in (0, 1) and (rc == 0) == (not found), f"mypy did not run cleanly:\n{out}"
    assert not found, "mypy (strictness in pyproject.toml [tool.mypy]):\n" + "\n".join(
        line for e in found.values() for line in e)
