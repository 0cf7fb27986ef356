"""Field checks shared by the config sections: each error names the field as written in YAML.

Numbers are checked here once for every field, so no field can forget a case: booleans are not
numbers (YAML reads `yes` as true, and `True < 1` is False in Python), strings are not numbers,
and a float must be finite. NaN compares False with everything, so a bare `v < lo` let
`store.lease_seconds: .nan` through, and the lease heartbeat then spun; inf passed every
open-ended bound and switched deadlines off. Every float field therefore has a finite upper
bound too: a field that wants "no limit" spells it explicitly (None: derived), never as inf.
"""

from __future__ import annotations

import math
from typing import Any

# Integers above this break the store's int64 arrays and offsets; no count here comes near it.
INT_MAX = 1 << 62


class ConfigError(ValueError):
    """Bad configuration; the message names the field and the fix."""


def check_str(name: str, v: Any) -> None:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{name} must be a non-empty string, got {v!r}")


def check_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ConfigError(f"{name} must be true or false, got {v!r}")


def check_choice(name: str, v: Any, choices: tuple) -> None:
    if v not in choices:
        raise ConfigError(f"{name}={v!r} is not one of {', '.join(map(str, choices))}")


def check_int(name: str, v: Any, lo: int, optional: bool = False, hi: int = INT_MAX) -> None:
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
    if v < lo:
        raise ConfigError(f"{name} must be >= {lo}, got {v}")
    if v > hi:
        raise ConfigError(f"{name} must be <= {hi}, got {v}")


def check_float(name: str, v: Any, lo: float, hi: float, optional: bool = False) -> None:
    """A finite number in [lo, hi] (ints welcome: YAML reads `30` as an int)."""
    if v is None and optional:
        return
    rng = f"a number between {lo:g} and {hi:g}"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{name} must be {rng}, got {v!r}")
    # ints are exact and may exceed a float's range (math.isfinite(10**400) raises), so only
    # floats go through isfinite; the chained comparison is exact for both
    if (isinstance(v, float) and not math.isfinite(v)) or not lo <= v <= hi:
        raise ConfigError(f"{name} must be between {lo:g} and {hi:g}, got {v!r}")


def redacted_repr(section: Any) -> str:
    """A config section's repr with its credentials masked: every value through the store's
    redaction (store/storage/credentials.py; URL query credentials and userinfo, secret-looking
    keys, the section's own storage_options values), so a section logged or shown in an error
    prints no presigned source and no token. Imported here, not at the top: config loads import
    no zarr."""
    import dataclasses

    from ...store import redact_attrs

    values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.repr}
    shown = redact_attrs(values, getattr(section, "storage_options", None))
    return f"{type(section).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"
