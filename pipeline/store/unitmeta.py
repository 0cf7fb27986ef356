"""A unit's row metadata as its writer holds it: token_id, doc_id, position, gen of every row.

The writer needs it whole before it commits (the marker carries a CRC32C per column, which
verify(deep=True) checks against the stored arrays), and per shard before it encodes the shard:
which rows count in the `kept` statistics depends on their token ids and context positions.
"""

from __future__ import annotations

import numpy as np

from . import layout
from .stats import crc32c


class UnitMeta:
    def __init__(self, unit_id: int, row_start: int, row_end: int,
                 stats_filter: "tuple[np.ndarray, int, int] | None"):
        self.unit_id, self.row_start, self.row_end = unit_id, row_start, row_end
        n = row_end - row_start
        self.cols = {k: np.full(n, layout.META_UNWRITTEN, dt) for k, dt in layout.ROW_META.items()}
        self.set = np.zeros(n, bool)
        self.filter = stats_filter

    def write(self, row_start: int, token_id, doc_id, position, **extra) -> None:
        unknown = set(extra) - set(layout.ROW_META)
        if unknown:
            raise ValueError(f"write_meta: unknown row metadata {sorted(unknown)}; the columns are "
                             f"{', '.join(layout.ROW_META)}")
        cols = {"token_id": token_id, "doc_id": doc_id, "position": position}
        n0 = np.asarray(token_id).shape[0] if np.ndim(token_id) == 1 else 0
        for k in list(layout.ROW_META)[3:]:  # optional columns: 0 when the writer omits them
            cols[k] = extra[k] if k in extra else np.zeros(n0, layout.ROW_META[k])
        n = None
        arrs = {}
        for name, v in cols.items():
            a = np.asarray(v)
            if a.ndim != 1 or a.dtype.kind not in "iu":
                raise ValueError(f"write_meta: {name} must be a 1-D integer array, got {a.dtype} "
                                 f"{a.shape}")
            if n is None:
                n = a.shape[0]
            elif a.shape[0] != n:
                raise ValueError(f"write_meta: token_id, doc_id and position must have the same "
                                 f"length, got {n} and {a.shape[0]} for {name}")
            arrs[name] = a
        lo = int(row_start) - self.row_start
        hi = lo + n
        if lo < 0 or hi > self.set.shape[0]:
            raise ValueError(f"write_meta: rows [{row_start}, {row_start + n}) fall outside unit "
                             f"{self.unit_id}'s region [{self.row_start}, {self.row_end})")
        if self.set[lo:hi].any():
            raise ValueError(f"write_meta: metadata of rows in [{row_start}, {row_start + n}) "
                             f"was already written to unit {self.unit_id}")
        for name, a in arrs.items():
            self.cols[name][lo:hi] = a
        self.set[lo:hi] = True

    def complete(self, start: int, end: int) -> bool:
        return bool(self.set[start - self.row_start:end - self.row_start].all())

    def check_complete(self) -> None:
        if not self.set.all():
            a = int(np.flatnonzero(~self.set)[0])
            raise ValueError(f"commit: unit {self.unit_id} has {int((~self.set).sum())} rows "
                             f"without metadata (e.g. row {self.row_start + a}); call write_meta "
                             "for them")

    def columns(self, start: int, end: int) -> dict:
        a, b = start - self.row_start, end - self.row_start
        return {k: v[a:b] for k, v in self.cols.items()}

    def crc32c(self) -> dict:
        return {k: crc32c(v) for k, v in self.cols.items()}

    def present_mask(self, start: int, end: int) -> np.ndarray | None:
        """Rows [start, end) that hold activations (None: all of them): generation slots have
        rows without (the last sampled token, dropped prompts, padding; FORMAT.md "Generation"),
        which no statistic counts."""
        g = self.columns(start, end)["gen"]
        if not (g < layout.GEN_LAST).all() or (g < 0).any():
            return np.isin(g, layout.GEN_HAS_ACTS)
        return None

    def keep_mask(self, start: int, end: int) -> np.ndarray | None:
        """Rows [start, end) counted in the `kept` statistics (None: every row)."""
        if self.filter is None:
            return None
        if not self.complete(start, end):
            raise ValueError(f"unit {self.unit_id}: rows [{start}, {end}) were written before "
                             "their metadata; call write_meta first (the kept-row statistics need "
                             "each row's token id)")
        special, skip, C = self.filter
        keep = np.ones(end - start, bool)
        if skip:
            keep &= (np.arange(start, end) % C) >= skip
        if special.size:
            keep &= ~np.isin(self.columns(start, end)["token_id"], special)
        return keep
