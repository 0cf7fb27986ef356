"""A trainer rank's position in a stream: the contexts it has yielded whole, and the rows it has
yielded of the others. That is what `StreamDataset.state_dict()` records and a resume gives back
to the coordinator, which captures again, for that rank only, every unit the rank had not
finished (deal.py); the rank then drops what it had already yielded (`keep`), so across the
crash each of its rows is yielded exactly once.

Contexts are numbered globally (a context's first row // context size): every part a rank
receives is one context's rows for it (pipeline/actor/outbox.py), possibly none. Memory: the
open contexts (received, not yielded whole: at most the shuffle windows' worth) and the whole
ones, kept as a sorted array that `state()` writes as ranges.
"""

from __future__ import annotations

import threading

import numpy as np


def to_ranges(sorted_ids: np.ndarray) -> list[list[int]]:
    """Sorted unique ints -> [[start, stop), ...] runs."""
    a = np.asarray(sorted_ids, np.int64)
    if not a.size:
        return []
    cut = np.flatnonzero(np.diff(a) != 1) + 1
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [a.size]])
    return [[int(a[s]), int(a[e - 1]) + 1] for s, e in zip(starts, ends)]


def from_ranges(ranges) -> np.ndarray:
    parts = [np.arange(a, b, dtype=np.int64) for a, b in ranges or []]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


class Progress:
    """Contexts received and yielded by one rank (module doc). `consumed` and `partial` are a
    saved state's (a resume): contexts yielded whole, and rows yielded of others."""

    def __init__(self, context_size: int, consumed=None, partial: "dict | None" = None):
        self.C = context_size
        self.before = np.unique(np.asarray(consumed if consumed is not None else [], np.int64))
        self.before_rows = {int(g): np.asarray(r, np.int64) for g, r in (partial or {}).items()}
        self.done: list[int] = []
        self.open: dict[int, list] = {}   # context -> [rows left to yield, [rows yielded]]
        self._lock = threading.Lock()

    def keep(self, g: int, rows: np.ndarray) -> "np.ndarray | None":
        """Which of a part's rows to keep: None when the saved state had the whole context
        yielded, a boolean mask of the rows not yielded yet, or all of them."""
        if self.before.size:
            i = np.searchsorted(self.before, g)
            if i < self.before.size and self.before[i] == g:
                return None
        prev = self.before_rows.get(int(g))
        if prev is None:
            return np.ones(rows.shape[0], bool)
        return ~np.isin(rows, prev)

    def received(self, g: int, n: int) -> None:
        """Context g arrived with n rows still to yield."""
        with self._lock:
            prev = self.before_rows.pop(int(g), None)
            if n == 0:
                self.done.append(int(g))
            else:
                self.open[int(g)] = [n, [] if prev is None else [prev]]

    def yielded(self, rows: np.ndarray) -> None:
        """A batch's rows went to the trainer."""
        rows = np.asarray(rows, np.int64)
        g = rows // self.C
        order = np.argsort(g, kind="stable")
        gs, start = np.unique(g[order], return_index=True)
        ends = np.append(start[1:], rows.shape[0])
        with self._lock:
            for ctx, a, b in zip(gs.tolist(), start.tolist(), ends.tolist()):
                e = self.open.get(ctx)
                if e is None:
                    continue
                e[0] -= b - a
                if e[0] <= 0:
                    self.done.append(ctx)
                    del self.open[ctx]
                else:
                    e[1].append(rows[order[a:b]])

    def state(self) -> dict:
        """{consumed: ranges of contexts yielded whole, partial: {context: rows yielded}}."""
        with self._lock:
            consumed = np.union1d(self.before, np.asarray(self.done, np.int64))
            partial = {str(g): np.concatenate(e[1]).tolist() for g, e in self.open.items() if e[1]}
            partial.update({str(g): r.tolist() for g, r in self.before_rows.items()})
        return {"consumed": to_ranges(consumed), "partial": partial}

    def consumed(self) -> np.ndarray:
        with self._lock:
            return np.union1d(self.before, np.asarray(self.done, np.int64))


__all__ = ["Progress", "from_ranges", "to_ranges"]
