"""A unit's row metadata as its writer holds it: token_id, doc_id, position (and role, in
chat stores, and gen, in generation stores: the stores that have those columns) of every row.

The writer needs it whole before it commits (the marker carries a CRC32C per column, which
verify(deep=True) checks against the stored arrays), and per shard before it encodes the shard:
which rows count in the `kept` statistics depends on their token ids and context positions (and,
in a role-masked store, their roles: rows of roles outside capture.roles are zeroed before the
shard is encoded and never counted as kept; see FORMAT.md, "Chat").
"""

from __future__ import annotations

import numpy as np

from ..format import layout
from ..stats.moments import crc32c


# why a store lacks an optional column, and how to get a store that has it (FORMAT.md)
_NO_COLUMN = {
    "role": "made before chat input existed); write chat rows to a new store",
    "gen": "not created for generation: create_store(generated=True), which the pipeline does "
           "when capture.generate is set",
    "sample": "made for one sample per prompt: create_store(samples=True), which the pipeline "
              "does when capture.generate.n > 1",
}


class UnitMeta:
    def __init__(self, unit_id: int, row_start: int, row_end: int,
                 stats_filter: "tuple[np.ndarray, int, int] | None",
                 columns: "list[str] | None" = None, stored_roles: "tuple | None" = None):
        self.unit_id, self.row_start, self.row_end = unit_id, row_start, row_end
        n = row_end - row_start
        names = layout.ROW_META if columns is None else columns
        self.cols = {k: np.full(n, layout.META_UNWRITTEN, layout.ROW_META[k]) for k in names}
        self.set = np.zeros(n, bool)
        # rows whose scores (layout.SCORE_META) are written; None: the store has no such column
        self.scored = np.zeros(n, bool) if set(layout.SCORE_META) & set(self.cols) else None
        self.filter = stats_filter
        self.stored_roles = None if stored_roles is None else np.asarray(stored_roles, np.int8)

    def write(self, row_start: int, token_id, doc_id, position, role=None, gen=None,
              sample=None, source_row=None) -> None:
        cols = {"token_id": token_id, "doc_id": doc_id, "position": position}
        if "source_row" in self.cols:
            if source_row is None:
                raise ValueError(f"write_meta: unit {self.unit_id}'s store is a shuffled copy: "
                                 "pass source_row (each row's row in the source store)")
            cols["source_row"] = source_row
        elif source_row is not None:
            raise ValueError(f"write_meta: unit {self.unit_id}'s store has no source_row column "
                             "(only a shuffled copy has: create_store(source_rows=True))")
        for name, given in (("role", role), ("gen", gen), ("sample", sample)):
            if name in self.cols:
                # a row written without an optional column has its default: plain text
                # (roles.TEXT), a prompt row (layout.GEN_PROMPT), sample 0 -- all code 0
                cols[name] = (np.zeros(len(token_id), layout.ROW_META[name]) if given is None
                              else given)
            elif given is not None:
                raise ValueError(f"write_meta: unit {self.unit_id}'s store has no {name} column "
                                 f"({_NO_COLUMN[name]})")
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
                raise ValueError(f"write_meta: token_id, doc_id, position (and role, gen, sample) must have the same "
                                 f"length, got {n} and {a.shape[0]} for {name}")
            arrs[name] = a
        self._put("write_meta", "metadata", self.set, row_start, n, arrs)

    def write_scores(self, row_start: int, **scores) -> None:
        """The model's next-token scores of rows [row_start, row_start + n): float32 `logprob`
        and `entropy`, every score column of the store at once (NaN is a value: a context's
        last logprob). Each row once."""
        want = [k for k in layout.SCORE_META if k in self.cols]
        if sorted(scores) != sorted(want):
            raise ValueError(f"write_scores: unit {self.unit_id}'s store has score columns "
                             f"{want}; got {sorted(scores)}")
        arrs = {k: np.asarray(v) for k, v in scores.items()}
        n = {a.shape for a in arrs.values()}
        if len(n) != 1 or any(a.ndim != 1 or a.dtype != np.float32 for a in arrs.values()):
            raise ValueError(f"write_scores: {want} must be 1-D float32 arrays of one length, got "
                             f"{[(a.dtype, a.shape) for a in arrs.values()]}")
        self._put("write_scores", "scores", self.scored, row_start, next(iter(n))[0], arrs)

    def _put(self, what: str, kind: str, done: np.ndarray, row_start: int, n: int,
             arrs: dict) -> None:
        """Columns `arrs` of rows [row_start, row_start + n), each row once (`done` marks them)."""
        lo = int(row_start) - self.row_start
        hi = lo + n
        if lo < 0 or hi > done.shape[0]:
            raise ValueError(f"{what}: rows [{row_start}, {row_start + n}) fall outside unit "
                             f"{self.unit_id}'s region [{self.row_start}, {self.row_end})")
        if done[lo:hi].any():
            raise ValueError(f"{what}: {kind} of rows in [{row_start}, {row_start + n}) "
                             f"was already written to unit {self.unit_id}")
        for name, a in arrs.items():
            self.cols[name][lo:hi] = a
        done[lo:hi] = True

    def complete(self, start: int, end: int) -> bool:
        return bool(self.set[start - self.row_start:end - self.row_start].all())

    def check_complete(self) -> None:
        if self.scored is not None and not self.scored.all():
            a = int(np.flatnonzero(~self.scored)[0])
            raise ValueError(f"commit: unit {self.unit_id} has {int((~self.scored).sum())} rows "
                             f"without their scores (e.g. row {self.row_start + a}); call "
                             "write_scores for them")
        if not self.set.all():
            a = int(np.flatnonzero(~self.set)[0])
            raise ValueError(f"commit: unit {self.unit_id} has {int((~self.set).sum())} rows "
                             f"without metadata (e.g. row {self.row_start + a}); call write_meta "
                             "for them")

    def columns(self, start: int, end: int) -> dict[str, np.ndarray]:
        a, b = start - self.row_start, end - self.row_start
        return {k: v[a:b] for k, v in self.cols.items()}

    def crc32c(self) -> dict[str, int]:
        return {k: crc32c(v) for k, v in self.cols.items()}

    def present_mask(self, start: int, end: int) -> np.ndarray | None:
        """Rows [start, end) that hold activations (None: all of them): generation slots have
        rows without (the last sampled token, dropped prompts, padding; FORMAT.md "Generation"),
        which no statistic counts. Stores without the `gen` column have no such rows."""
        if "gen" not in self.cols:
            return None
        g = self.columns(start, end)["gen"]
        if not (g < layout.GEN_LAST).all() or (g < 0).any():
            return np.isin(g, layout.GEN_HAS_ACTS)
        return None

    def rows_with_activations(self) -> int:
        """Rows of the whole region that hold activations (present, and of a stored role)."""
        a, b = self.row_start, self.row_end
        held = np.ones(b - a, bool)
        for m in (self.present_mask(a, b), self.stored_mask(a, b)):
            if m is not None:
                held &= m
        return int(held.sum())

    def keep_mask(self, start: int, end: int) -> np.ndarray | None:
        """Rows [start, end) counted in the `kept` statistics (None: every row)."""
        if self.filter is None and self.stored_roles is None:
            return None
        if not self.complete(start, end):
            raise ValueError(f"unit {self.unit_id}: rows [{start}, {end}) were written before "
                             "their metadata; call write_meta first (the kept-row statistics need "
                             "each row's token id)")
        special, skip, C = self.filter or (np.zeros(0, np.int64), 0, 1)
        keep = np.ones(end - start, bool)
        if skip:
            keep &= (self.rows(start, end) % C) >= skip
        if special.size:
            keep &= ~np.isin(self.columns(start, end)["token_id"], special)
        stored = self.stored_mask(start, end)
        return keep if stored is None else keep & stored

    def rows(self, start: int, end: int) -> np.ndarray:
        """Each row's index in the token stream whose contexts it was captured in: its own, or
        in a shuffled copy its source row (so its context position is this % context_size)."""
        if "source_row" in self.cols:
            return self.columns(start, end)["source_row"]
        return np.arange(start, end)

    def stored_mask(self, start: int, end: int) -> "np.ndarray | None":
        """Rows [start, end) whose activations the store keeps (None: all): capture.roles."""
        if self.stored_roles is None:
            return None
        return np.isin(self.columns(start, end)["role"], self.stored_roles)

    def zero_unstored(self, data: np.ndarray, start: int, end: int) -> None:
        """Zero the rows of roles outside capture.roles in a shard buffer [points, rows, width]
        (raw bits: 0 is +0.0 in every float dtype). They ran as context; the store keeps their
        metadata only, and zeros compress to almost nothing."""
        stored = self.stored_mask(start, end)
        if stored is not None and not stored.all():
            data[:, :end - start][:, ~stored] = 0
