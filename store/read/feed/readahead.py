"""Decode shuffle windows ahead of use, two arenas in turn; a window becomes one row permutation.

A window's pieces (whole shards, one GET each) decode into slots of one arena, a single
[slots * slot_rows, n_points, width] array. A batch is then one `np.take` from that arena with
row indices drawn from a permutation of the whole window: rows from every shard interleave
inside each batch (grouped by shard before: lag-1 same-document rate 0.19 against 0.003 for a
uniform draw) and every byte is still moved three times (fetch, decode, gather), as before.

Two arenas: while the consumer draws batches from window i, window i+1 decodes into the other.
Memory is therefore up to two windows per process. The pool this replaces held each shard
until its last row was drawn; under uniform draws a shard's rows drain geometrically, so it held
about ln(shard_rows) windows' worth of shards at once. Arenas live as long as the dataset in
that process, so later windows and epochs decode into memory already faulted in (see
buffers.py for why fresh memory is slow on these VMs).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ...errors import StoreError
from ...format import layout
from ..normalize import sq_norms
from ..shuffle.sampling import Take


@dataclass
class WindowSpec:
    epoch: int
    index: int                    # window index within the epoch (keys its permutation)
    takes: list[Take]
    last: bool                    # last window of the epoch for this worker
    quota: int | None = None      # rows the worker's epoch must hold (padding target), or None


@dataclass
class Ready:
    """A decoded window: arena rows `idx` in the order they are to be yielded."""

    arena: np.ndarray
    idx: np.ndarray
    rows: np.ndarray              # store row of each entry of idx
    meta: dict = field(default_factory=dict)   # token_id / doc_id / position per entry of idx
    epoch: int = 0
    dropped: int = 0              # rows the norm filter dropped
    padded: int = 0               # rows repeated to reach the quota


class Arenas:
    """Two reusable arenas per process; a second concurrent iterator gets private ones."""

    def __init__(self, slot_rows: int, n_points: int, width: int, raw: np.dtype):
        self.slot_rows, self.shape, self.raw = slot_rows, (n_points, width), raw
        self._bufs: list[np.ndarray | None] = [None, None]
        self.busy = False

    def get(self, k: int, slots: int, private: bool) -> np.ndarray:
        need = slots * self.slot_rows
        if private:
            return np.empty((need, *self.shape), self.raw)
        buf = self._bufs[k]
        if buf is None or buf.shape[0] < need:
            buf = self._bufs[k] = np.empty((need, *self.shape), self.raw)
        return buf


class WindowReader:
    """Turns WindowSpecs into Ready windows, one window decoding ahead of the consumer.

    `fetch(piece, point_index, out)` decodes one point of one piece into `out`; `fetch_meta(piece)`
    returns the metadata columns the filter and output need; `finish(spec, arena, slot_meta)`
    builds the Ready (filters, permutation). Closing the generator cancels queued work and waits
    for running decodes, so no thread writes into an arena a later iterator reuses.
    """

    def __init__(self, pieces, n_points: int, arenas: Arenas, threads: int, fetch, fetch_meta, finish):
        self.pieces, self.P, self.arenas, self.threads = pieces, n_points, arenas, threads
        self.fetch, self.fetch_meta, self.finish = fetch, fetch_meta, finish

    def _start(self, ex, spec: WindowSpec, arena: np.ndarray):
        R = self.arenas.slot_rows
        jobs = []
        for k, t in enumerate(spec.takes):
            a, b = self.pieces[t.piece]
            dst = arena[k * R: k * R + (b - a)]
            fx = [ex.submit(self.fetch, (a, b), p, dst[:, p, :]) for p in range(self.P)]
            fm = ex.submit(self.fetch_meta, (a, b)) if self.fetch_meta is not None else None
            jobs.append((fx, fm))
        return spec, arena, jobs

    def __call__(self, specs):
        it = iter(specs)
        private = self.arenas.busy
        self.arenas.busy = True
        ex = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="harvest-read")
        pending: deque = deque()
        try:
            for k in range(2):
                spec = next(it, None)
                if spec is None:
                    break
                pending.append(self._start(ex, spec, self.arenas.get(k, len(spec.takes), private)))
            turn = 0
            while pending:
                spec, arena, jobs = pending.popleft()
                slot_meta = []
                for fx, fm in jobs:
                    for f in fx:
                        f.result()
                    slot_meta.append(fm.result() if fm is not None else None)
                ready = self.finish(spec, arena, slot_meta)
                yield ready
                # the consumer is done with this arena (it copies a window's last partial batch
                # out before asking for the next window): the window after next decodes into it
                spec = next(it, None)
                if spec is not None:
                    pending.append(self._start(ex, spec, self.arenas.get(turn, len(spec.takes), private)))
                turn ^= 1
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
            if not private:
                self.arenas.busy = False


class WindowFinisher:
    """Decoded window -> Ready: filter masks, this worker's share, norm filter, permutation, pad.

    The permutation is keyed by (seed, epoch, global worker, window index), so a resumed reader
    that skips whole windows still permutes the later ones exactly as before. With the norm
    filter and a quota (G > 1, epoch mode), the epoch's last window repeats as many random rows
    of its own as the filter dropped in the whole epoch, so every worker yields its quota.
    """

    def __init__(self, pieces, filt, counts: np.ndarray, norm_limit, dtype, slot_rows: int, shuffle: bool,
                 seed: int, g: int, return_meta: bool, extra_meta: tuple = (), cols=None):
        """`cols`: each point's stored columns where points of several widths share the arena's
        [rows, points, widest] slots (a narrower point's row is its first columns), else None."""
        self.pieces, self.filt, self.counts, self.norm_limit = pieces, filt, counts, norm_limit
        self.cols = cols
        self.dtype, self.R, self.shuffle, self.seed, self.g = dtype, slot_rows, shuffle, seed, g
        self.names = (["token_id", "doc_id", "position"] + (["gen"] if filt.generated else [])
                      + list(extra_meta) if return_meta else [])
        self.epoch_rows: dict[int, int] = {}

    def _local(self, k: int, t: Take, cols: dict, arena: np.ndarray) -> tuple[np.ndarray, int]:
        a, b = self.pieces[t.piece]
        m = self.filt.mask_of(a, b, cols)
        kept = np.flatnonzero(m) if m is not None else None
        n_kept = b - a if kept is None else kept.shape[0]
        if self.counts[t.piece] >= 0 and self.counts[t.piece] != n_kept:
            raise StoreError(f"rows [{a}, {b}) keep {n_kept} rows now but {self.counts[t.piece]} when "
                             "counted: the store's row metadata changed under the reader")
        local = t.positions(n_kept)
        if kept is not None:
            local = kept[local]
        dropped = 0
        if self.norm_limit is not None and local.size:
            ok = np.ones(local.shape[0], bool)
            for j in range(arena.shape[1]):
                c = None if self.cols is None else self.cols[j]
                ok &= sq_norms(arena[k * self.R + local, j, :c], self.dtype) <= self.norm_limit[j]
            dropped = int((~ok).sum())
            local = local[ok]
        return local, dropped

    def __call__(self, spec: WindowSpec, arena: np.ndarray, slot_meta: list) -> Ready:
        idx_parts: list = []
        row_parts: list = []
        meta_parts: dict[str, list] = {n: [] for n in self.names}
        dropped = 0
        for k, (t, cols) in enumerate(zip(spec.takes, slot_meta)):
            cols = cols or {}
            local, d = self._local(k, t, cols, arena)
            dropped += d
            idx_parts.append(k * self.R + local)
            row_parts.append(self.pieces[t.piece][0] + local)
            for n in self.names:
                meta_parts[n].append(cols[n][local].astype(layout.meta_batch_dtype(n)))
        cat = lambda v: np.concatenate(v) if v else np.empty(0, np.int64)  # noqa: E731
        idx, rows, meta = cat(idx_parts), cat(row_parts), {n: cat(v) for n, v in meta_parts.items()}
        rng = np.random.default_rng([self.seed, spec.epoch, self.g, spec.index, 0x51])
        if self.shuffle:
            perm = rng.permutation(idx.shape[0])
            idx, rows, meta = idx[perm], rows[perm], {n: v[perm] for n, v in meta.items()}
        padded = 0
        if self.norm_limit is not None and spec.quota is not None:
            got = self.epoch_rows[spec.epoch] = self.epoch_rows.get(spec.epoch, 0) + idx.shape[0]
            for e in [e for e in self.epoch_rows if e < spec.epoch]:   # endless: keep one epoch
                del self.epoch_rows[e]
            if spec.last and got < spec.quota:
                if not idx.shape[0]:
                    raise ValueError("max_norm_ratio dropped every row of a worker's last window; "
                                     "raise max_norm_ratio")
                padded = spec.quota - got
                extra = rng.integers(0, idx.shape[0], padded)
                idx, rows = np.concatenate([idx, idx[extra]]), np.concatenate([rows, rows[extra]])
                meta = {n: np.concatenate([v, v[extra]]) for n, v in meta.items()}
        return Ready(arena, idx, rows, meta, spec.epoch, dropped, padded)
