"""Python source that hides installed packages from a child process: any import of them fails,
as on a machine where they are not installed (the GPU host has no vLLM or Ray; a trainer's
environment may have no torch). Prepended to the code a test runs with `python -c`."""

from __future__ import annotations


def hiding(*packages: str) -> str:
    """Source that makes every import of `packages` (and their submodules) fail."""
    return f"""
import importlib.abc, sys

class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {packages!r}:
            raise ModuleNotFoundError(f"{{name}} is hidden from this process")
        return None

sys.meta_path.insert(0, Hidden())
"""
