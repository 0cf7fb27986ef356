"""Checked reads of committed rows by shard and row range (Store.read, read_row_meta_checked).

Committed rows only: every shard comes from the marker that covers it, and every object is
checked against that marker's digest before it is decoded (objects.py), so a damaged or missing
object is a DataIntegrityError, never zeros.
"""

from __future__ import annotations

import numpy as np

from . import layout
from .objects import read_meta


def committed_shard_map(st) -> dict:
    """shard index -> (marker facts, its entry for the shard), over the committed units."""
    out = {}
    for m in st.iter_committed():
        lite = {k: m.get(k) for k in ("unit_id", "row_start", "row_end", "attempt", "row_meta")}
        for sh in m.get("shards", []):
            out[sh["index"]] = (lite, sh)
    return out


def read_rows(st, point: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of one point, committed rows only, each shard checked."""
    parts = []
    for s in range(start // st.shard_rows, -(-stop // st.shard_rows)):
        m, sh = st.committed_shard(s)
        a, b = max(start, sh["row_start"]), min(stop, sh["row_end"])
        if b > a:
            parts.append(st.read_shard(point, s)[a - sh["row_start"]:b - sh["row_start"]])
    return np.concatenate(parts) if parts else np.empty((0, st.width), st.np_dtype)


def read_row_meta_checked(st, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like Store.read_row_meta, committed rows only, each chunk checked against its marker."""
    return tuple(read_meta_checked(st, n, start, stop) for n in layout.BASE_META)


def read_meta_checked(st, name: str, start: int, stop: int) -> np.ndarray:
    """One row-metadata column of committed rows [start, stop), each chunk checked."""
    parts = []
    for s in range(start // st.shard_rows, -(-stop // st.shard_rows)):
        m, sh = st.committed_shard(s)
        a, b = max(start, sh["row_start"]), min(stop, sh["row_end"])
        parts.append(read_meta(st, m, sh, name)[a - sh["row_start"]:b - sh["row_start"]])
    return np.concatenate(parts) if parts else np.empty(0, layout.ROW_META[name])
