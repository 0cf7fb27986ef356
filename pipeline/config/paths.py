"""Where the repo, the cache and user paths are: `{cache}`, `~` and `$VARS` expanded one way.

Its own module so the section dataclasses (pipeline/config/sections.py), pipeline/config/run.py and
the CLI, data and corpus code share one definition of the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...engine.models import cache_dir as _engine_cache_dir


def cache_dir() -> Path:
    """The engine's cache directory (engine.models.cache_dir, the one definition), not created
    here: `harvest plan` and `status` only name paths in it."""
    return _engine_cache_dir(create=False)


def expand_path(value: str) -> str:
    """`{cache}`, `~` and `$VARS` in paths; URLs with a scheme are left alone except `{cache}`."""
    value = value.replace("{cache}", str(cache_dir()))
    if "://" in value:
        return value
    return os.path.expandvars(os.path.expanduser(value))
