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

from .sampling import Take


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
