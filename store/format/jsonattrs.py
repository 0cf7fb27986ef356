"""Attribute values as stored: JSON-safe copies and UTC timestamps.

Run attributes, commit extras and finalize summaries come from callers as numpy scalars, arrays,
sets and paths; a value json cannot write must fail at the call that passed it, naming which
argument, not later inside a half-written zarr.json.
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

import numpy as np


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def json_default(o: Any):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if hasattr(o, "__fspath__"):
        return str(o)
    raise TypeError(f"attribute value of type {type(o).__name__} is not JSON serialisable: {o!r}")


def jsonable(obj: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(obj, default=json_default))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serialisable: {e}") from None


JsonObject = dict[str, Any]
"""A JSON object at an edge of the store: parsed from, or written into, a store's JSON (attributes,
plan, a record's `to_json`), printed by a CLI or report, or handed to a trainer's checkpoint
(`state_dict`). Bookkeeping inside the store travels as records (commit/records.py) and data as
typed mappings; tests/house/test_typed_returns.py refuses a bare `-> dict` in store/."""
