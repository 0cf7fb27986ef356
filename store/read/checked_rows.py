"""Checked reads of committed rows by shard and row range (Store.read, read_row_meta_checked).

Committed rows only: every shard comes from the marker that covers it, and every object is
checked against that marker's digest before it is decoded (objects.py), so a damaged or missing
object is a DataIntegrityError, never zeros.
"""

from __future__ import annotations

import numpy as np

from ..format import layout
from ..commit.objects import read_meta
from ..commit.records import Marker


class UnitMap:
    """shard -> the committed unit holding it, one entry per unit (not per shard: 3,815 units of
    512 shards at 1 B tokens of an 8B model were 2 M entries, each with its shard's record)."""

    def __init__(self, markers, shard_rows: int):
        units = sorted(((m.row_start // shard_rows, -(-m.row_end // shard_rows), m.lite())
                        for m in markers), key=lambda u: u[:2])
        self.first = np.array([u[0] for u in units], np.int64)
        self.end = np.array([u[1] for u in units], np.int64)
        self.lites = [u[2] for u in units]

    def find(self, shard: int) -> "Marker | None":
        i = int(np.searchsorted(self.first, shard, side="right")) - 1
        return self.lites[i] if i >= 0 and shard < self.end[i] else None


def read_rows(st, point: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of one point, committed rows only, each shard checked."""
    parts = []
    for s in range(start // st.shard_rows, -(-stop // st.shard_rows)):
        m, sh = st.ledger.committed_shard(s)
        a, b = max(start, sh.row_start), min(stop, sh.row_end)
        if b > a:
            parts.append(st.read_shard(point, s)[a - sh.row_start:b - sh.row_start])
    return np.concatenate(parts) if parts else np.empty((0, st.point_row_width(point)), st.np_dtype)


def read_row_meta_checked(st, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like Store.read_row_meta, committed rows only, each chunk checked against its marker."""
    token_id, doc_id, position = (read_meta_checked(st, n, start, stop) for n in layout.BASE_META)
    return token_id, doc_id, position


def read_meta_checked(st, name: str, start: int, stop: int) -> np.ndarray:
    """One row-metadata column of committed rows [start, stop), each chunk checked."""
    parts = []
    for s in range(start // st.shard_rows, -(-stop // st.shard_rows)):
        m, sh = st.ledger.committed_shard(s)
        a, b = max(start, sh.row_start), min(stop, sh.row_end)
        parts.append(read_meta(st, m, sh, name)[a - sh.row_start:b - sh.row_start])
    return np.concatenate(parts) if parts else np.empty(0, layout.ROW_META[name])


def read_generation_column(st, name: str, start: int, stop: int, checked: bool) -> np.ndarray:
    """`gen` or `sample` of rows [start, stop) for Store.read_gen / read_sample: plain zarr, or
    committed rows checked against their markers. Both exist only in generation stores, so any
    other store is refused (a reader asking which rows were generated must not get zeros from a
    store that never generated); `sample` alone may be absent there (n = 1, or made before n > 1
    existed) and then every row is sample 0."""
    if "gen" not in st.meta_columns:
        raise ValueError(f"read_{name}: this store has no `gen` column, no generated rows (it was "
                         "not created for generation: capture.generate / "
                         "create_store(generated=True))")
    if not 0 <= start <= stop <= st.n_rows:
        raise ValueError(f"read_{name}: [{start}, {stop}) is outside 0..{st.n_rows}")
    if name not in st.meta_columns:
        return np.zeros(stop - start, layout.ROW_META[name])
    if checked:
        return read_meta_checked(st, name, start, stop)
    return st.meta_array(name)[start:stop]
