"""The fenced code blocks of README.md and docs/*.md, for the tests that run them
(test_readme.py, test_jobs.py)."""

from __future__ import annotations

import re
from pathlib import Path

from harvest.engine.models import REPO_ROOT

README = REPO_ROOT / "README.md"
# the pages whose blocks are checked: the README and every page under docs/
PAGES = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]


def blocks(lang: str, page: Path | None = None) -> list[str]:
    """The ```lang blocks of one page, or of every page (README first, then docs/ by name)."""
    out = []
    for p in [page] if page else PAGES:
        out += [m.group(1) for m in re.finditer(rf"^```{lang}\n(.*?)^```", p.read_text(),
                                                re.S | re.M)]
    return out
