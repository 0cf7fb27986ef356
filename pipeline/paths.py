"""Where the repo, the cache and user paths are: `{cache}`, `~` and `$VARS` expanded one way.

Its own module so the section dataclasses (pipeline/sections.py) and pipeline/config.py, which
re-exports these names for the CLI, data and corpus code, share one definition of the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    """Where default corpora, tiny models and default stores live.

    `$HARVEST_CACHE` wins so that a `ray job submit --working-dir` run (whose cwd is a throwaway
    copy of the repo) can still write to a lasting place.
    """
    env = os.environ.get("HARVEST_CACHE")
    return Path(env).expanduser() if env else REPO_ROOT / ".harvest"


def expand_path(value: str) -> str:
    """`{cache}`, `~` and `$VARS` in paths; URLs with a scheme are left alone except `{cache}`."""
    value = value.replace("{cache}", str(cache_dir()))
    if "://" in value:
        return value
    return os.path.expandvars(os.path.expanduser(value))
