"""A trainer rank's shuffle over a bounded buffer: rows received fill a window of `window_rows`
rows; a full window becomes one `Ready` (store/read/feed/readahead.py), a permutation of all its
rows, which the store reader's own batching (feed/batching.py) cuts into batches; each batch is
a uniform draw from its window, as the reader's windows are.

Two arenas in turn, as the reader's: the trainer draws batches from one while the other fills.
When both are taken (one being drawn from, one full and waiting) the receiver stops taking rows
(`add` waits), so the capture actors' queues fill and their capture pauses: the trainer side's
memory is two windows plus the takes in flight, whatever the trainer's pace.
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from ...store.read.feed.readahead import Ready

META = ("token_id", "doc_id", "position")


class Windows:
    """Rows in, `(Ready, arena index)` out on `out` (None at the end; an exception when the
    stream failed). The consumer calls `release(i)` once it is done with arena i."""

    def __init__(self, window_rows: int, n_points: int, row_width: int, raw: np.dtype,
                 seed: int, rank: int, shuffle: bool):
        self.W, self.shape, self.raw = int(window_rows), (n_points, row_width), raw
        self.seed, self.rank, self.shuffle = seed, rank, bool(shuffle)
        self.arenas: list = [None, None]
        self.free: "queue.Queue[int]" = queue.Queue()
        for i in (0, 1):
            self.free.put(i)
        self.out: queue.Queue = queue.Queue()
        self.cur: int | None = None
        self.fill = 0
        self.index = 0                  # windows emitted
        self.rows_in = 0
        self.first_docs: np.ndarray | None = None   # the first window's doc_id per row
        self._rows = np.empty(self.W, np.int64)
        self._meta = {m: np.empty(self.W, np.int64) for m in META}
        self.stopped = threading.Event()

    @property
    def arena_bytes(self) -> int:
        return 2 * self.W * int(np.prod(self.shape)) * self.raw.itemsize

    def add(self, rows: np.ndarray, meta: tuple, acts: np.ndarray) -> None:
        """Rows (global row ids), their (token_id, doc_id, position) and raw acts [m, P, RW];
        waits while both arenas are taken."""
        m, i = rows.shape[0], 0
        while i < m:
            if self.cur is None:
                self.cur = self._take_arena()
                if self.cur is None:
                    return
                if self.arenas[self.cur] is None:
                    self.arenas[self.cur] = np.empty((self.W, *self.shape), self.raw)
            c = min(self.W - self.fill, m - i)
            f = self.fill
            self.arenas[self.cur][f:f + c] = acts[i:i + c]
            self._rows[f:f + c] = rows[i:i + c]
            for name, col in zip(META, meta):
                self._meta[name][f:f + c] = col[i:i + c]
            self.fill += c
            self.rows_in += c
            i += c
            if self.fill == self.W:
                self._emit()

    def _take_arena(self) -> "int | None":
        while not self.stopped.is_set():
            try:
                return self.free.get(timeout=0.5)
            except queue.Empty:
                continue
        return None

    def _emit(self) -> None:
        n = self.fill
        rows = self._rows[:n].copy()
        meta = {k: v[:n].copy() for k, v in self._meta.items()}
        if self.first_docs is None:
            self.first_docs = meta["doc_id"].copy()
        if self.shuffle:
            perm = np.random.default_rng([self.seed, self.rank, self.index, 0x57]).permutation(n)
            idx, rows, meta = perm, rows[perm], {k: v[perm] for k, v in meta.items()}
        else:
            idx = np.arange(n, dtype=np.int64)
        self.out.put((Ready(self.arenas[self.cur], idx, rows, meta), self.cur))
        self.index += 1
        self.cur, self.fill = None, 0

    def end(self) -> None:
        """No more rows: the partial window goes out, then the end."""
        if self.fill:
            self._emit()
        self.out.put(None)

    def fail(self, e: BaseException) -> None:
        self.out.put(e)

    def release(self, i: int) -> None:
        self.free.put(i)

    def stop(self) -> None:
        self.stopped.set()


__all__ = ["META", "Windows"]
