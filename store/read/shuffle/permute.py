"""shuffle="global": every kept row of the store in one keyed permutation per epoch, never stored.

The window shuffle (sampling.py, readahead.py) permutes shards, then rows inside windows of a few
shards: a batch holds only the documents of its window's shards. Here the epoch's row sequence
is a bijection of all N kept rows: position p (0 <= p < N) reads kept row `Feistel(N, key)(p)`,
key = (seed, epoch). Ranks x workers take equal contiguous ranges of positions, floor(N / G) each
(the last N mod G positions are dropped, as in the window mode), so splits are equal and
disjoint and a resume starts at a position with nothing to replay.

The bijection is a 4-round Feistel network over 2 x h bits (2^(2h) >= N, h >= 1) with
splitmix64-style round functions keyed from the epoch's seed sequence, walked until the value
falls below N (cycle walking: a permutation of [0, 2^2h) restricted to [0, N) stays a
permutation of [0, N), and at most 3 of 4 domain values lie above N, so ~1.3 steps on average).
Each row is read exactly once per epoch by construction (tested). Four Luby-Rackoff rounds make
a pseudorandom permutation: the order is not drawn uniformly from all N! orders (no
practical keyed bijection is), but no test that sees only document ids can tell its batches from
a uniform shuffle's; the expected distinct documents per batch are a uniform shuffle's.

Reading: positions are taken in blocks of `block_rows` rows (the window's memory: the default
buffer). For each block every shard holding one of its rows is read and decoded once, and its
rows scattered to their places in the block: a block of M rows over a store of P shards reads
about min(P, M) shards, so an epoch decodes about (N / M) x P shards where the window shuffle
decodes P: global costs about (store / buffer) times the window shuffle's reads
(bench_shuffle measures both). Memory: one block, plus `scratch` decoded shards in flight.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...errors import StoreError
from ...format import layout
from ..feed.readahead import Ready

ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class Feistel:
    """A keyed bijection of [0, n): `perm(np.arange(n))` holds every value once."""

    def __init__(self, n: int, key: tuple[int, ...]):
        self.n = int(n)
        bits = max(2, (max(self.n, 2) - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.random.SeedSequence([int(k) for k in key]).generate_state(ROUNDS, np.uint64)

    def _f(self, r: np.ndarray, k: np.uint64) -> np.ndarray:
        x = r ^ k
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return (x ^ (x >> np.uint64(31))) & self.mask

    def _once(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ self._f(right, k)
        return (left << self.half) | right

    def __call__(self, i) -> np.ndarray:
        x = self._once(np.asarray(i, np.uint64).copy())
        out = np.flatnonzero(x >= self.n)
        while out.size:
            x[out] = self._once(x[out])
            out = out[x[out] >= self.n]
        return x.astype(np.int64)


def epoch_key(seed: int, epoch: int) -> tuple[int, int, int]:
    return (int(seed), int(epoch), 0x610BA1)


@dataclass
class GlobalSource:
    """What the global reader needs of a dataset: its pieces and kept-row counts, the filter,
    and how to fetch a piece's point (`fetch(piece, p, out)`) and metadata (`fetch_meta(piece)`,
    or None when no column is needed); `names`: the metadata columns a batch carries."""

    pieces: Any
    counts: np.ndarray
    filt: Any
    fetch: Callable
    fetch_meta: Callable | None
    names: list
    n_points: int
    row_width: int
    raw: np.dtype
    slot_rows: int
    seed: int


class GlobalReader:
    """Turns (epoch, position range) into Ready blocks of `block_rows` rows in permuted order.

    `acts=False` reads metadata only (mixing.describe): the block's arena is then a dummy."""

    def __init__(self, src: GlobalSource, block_rows: int, scratch: int = 4, acts: bool = True,
                 on_decode=None):
        self.src, self.M, self.acts, self.on_decode = src, int(block_rows), acts, on_decode
        self.cum = np.concatenate([[0], np.cumsum(src.counts)]).astype(np.int64)
        self.scratch = max(1, int(scratch))
        self._block: np.ndarray | None = None
        # decoded shards in flight, made once: fresh memory costs its page faults every block
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(self.scratch if acts else 0):
            self._free.put(np.empty((src.slot_rows, src.n_points, src.row_width), src.raw))
        self._pool = cf.ThreadPoolExecutor(self.scratch, thread_name_prefix="harvest-global") \
            if acts and self.scratch > 1 else None

    @property
    def n_rows(self) -> int:
        return int(self.cum[-1])

    def share(self, g: int, G: int) -> tuple[int, int]:
        """Positions [start, end) of global worker g of G (equal, disjoint; N mod G dropped)."""
        q = self.n_rows // G if G > 1 else self.n_rows
        return g * q, g * q + q

    def readies(self, epoch0: int, g: int, G: int, skip_rows: int = 0, endless: bool = False):
        start, end = self.share(g, G)
        q = end - start
        e = epoch0
        if q and skip_rows >= q:
            if not endless:
                return
            e, skip_rows = e + skip_rows // q, skip_rows % q
        if endless and not q:
            raise ValueError(f"endless: global worker {g} of {G} has no rows; the filters keep too "
                             "few rows for this many ranks x workers")
        while True:
            perm = Feistel(self.n_rows, epoch_key(self.src.seed, e))
            pos = start + skip_rows
            skip_rows = 0
            while pos < end:   # blocks on a grid from `start`: a resume cuts the same batches
                stop = min(end, start + ((pos - start) // self.M + 1) * self.M)
                yield self.block(e, perm(np.arange(pos, stop, dtype=np.int64)))
                pos = stop
            if not endless:
                return
            e += 1

    def block(self, epoch: int, kept_ids: np.ndarray) -> Ready:
        """Kept rows `kept_ids` (indices into the epoch's kept rows), read in that order."""
        s, m = self.src, kept_ids.shape[0]
        piece = np.asarray(np.searchsorted(self.cum, kept_ids, side="right")) - 1
        j: np.ndarray = kept_ids - self.cum[piece]
        # the block's arena holds its rows grouped by shard, each shard's in row order (one
        # near-sequential copy out of the decoded shard); idx then says which arena row each
        # position reads, and the batches' gather is the one random pass, as in the window mode
        order = np.lexsort((j, piece))
        edges = np.concatenate([[0], np.flatnonzero(np.diff(piece[order])) + 1, [m]])
        groups = list(zip(edges[:-1].tolist(), edges[1:].tolist()))
        idx = np.empty(m, np.int64)
        idx[order] = np.arange(m, dtype=np.int64)
        if self.acts:
            if self._block is None or self._block.shape[0] < m:
                self._block = np.empty((max(m, self.M), s.n_points, s.row_width), s.raw)
            arena = self._block
        else:
            arena = np.zeros((m, 1, 1), np.uint8)
        rows = np.empty(m, np.int64)
        meta = {n: np.empty(m, layout.meta_batch_dtype(n)) for n in s.names}
        free = self._free

        def one(span: tuple[int, int]) -> int:
            lo, hi = span
            dest = order[lo:hi]
            i = int(piece[dest[0]])
            a, b = s.pieces[i]
            cols = s.fetch_meta((a, b)) if s.fetch_meta is not None else {}
            mask = s.filt.mask_of(a, b, cols)
            kept = np.arange(b - a) if mask is None else np.flatnonzero(mask)
            if kept.shape[0] != s.counts[i]:
                raise StoreError(f"rows [{a}, {b}) keep {kept.shape[0]} rows now but {s.counts[i]} "
                                 "when counted: the store's row metadata changed under the reader")
            local = kept[j[dest]]
            rows[dest] = a + local
            for n in s.names:
                meta[n][dest] = cols[n][local]
            if self.acts:
                tmp = free.get()
                try:
                    for p in range(s.n_points):
                        s.fetch((a, b), p, tmp[:b - a, p, :])
                    np.take(tmp[:b - a], local, axis=0, out=arena[lo:hi])
                finally:
                    free.put(tmp)
            return b - a

        if self._pool is not None and len(groups) > 1:
            decoded = sum(self._pool.map(one, groups))
        else:
            decoded = sum(one(d) for d in groups)
        if self.on_decode is not None and self.acts:
            self.on_decode(decoded)
        return Ready(arena, idx, rows, meta, epoch)
