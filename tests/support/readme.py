"""README.md's fenced code blocks, for the tests that run them (test_readme.py, test_jobs.py)."""

from __future__ import annotations

import re

from harvest.pipeline.config import REPO_ROOT

README = REPO_ROOT / "README.md"


def blocks(lang: str) -> list[str]:
    """The bodies of README.md's ```<lang> blocks, in order."""
    text = README.read_text()
    return [m.group(1) for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)]
