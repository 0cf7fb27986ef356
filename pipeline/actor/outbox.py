"""A capture actor's rows for the trainer ranks of a streamed run (pipeline/stream/).

Each rank has its own bounded queue here; the trainer takes from it (`HarvestActor.take`), and
the capture pauses when a rank's queue is full: `Outbox.put` waits on the engine thread, so the
engine takes no step until that trainer catches up. That is the whole backpressure: no rows are
dropped and the actor's memory is bounded by ranks x `send_buffer_rows` rows.

A unit's rows are dealt before its capture starts (`UnitParts`): the run's k-th kept row goes to
rank k % world_size (UnitDeal), so ranks get disjoint rows in equal numbers without talking to
each other. Every context of a unit is one part per rank, sent even when it holds no row for that
rank, so the trainer knows which contexts of the unit it has: a unit re-captured after its actor
died sends its parts again and the trainer keeps the first copy of each (exactly once). The unit
is done (its `run_unit` returns) only once the trainer acknowledged every part: a take's parts
count as delivered when the trainer's next take names the take's token (`ack`), never when they
leave the queue, so rows still queued here, or on their way, when the actor dies are sent again
by the re-capture, never lost.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..messages import StreamRows, StreamSpec, UnitDeal
from ...store import fp8 as _fp8, is_quantized, raw_dtype, resolve_dtype, to_numpy


class StreamClosed(RuntimeError):
    """The actor is closing: nothing more is queued or waited for."""


class UnitParts:
    """One unit's deal: for each context and rank, the context's rows that rank gets, and the
    parts not taken yet (`wait_taken` returns once every one was)."""

    def __init__(self, unit_id: int, row_start: int, n_rows: int, context_size: int,
                 deal: UnitDeal, spec: StreamSpec, token_id, doc_id, position, role=None):
        C, G = context_size, spec.world_size
        self.unit_id, self.row_start, self.C = unit_id, row_start, C
        self.n_ctx = n_rows // C
        self.meta = (np.asarray(token_id), np.asarray(doc_id), np.asarray(position))
        m = spec.filter.mask(row_start, row_start + n_rows, token_id, doc_id, role)
        kept = np.arange(n_rows, dtype=np.int64) if m is None else np.flatnonzero(m)
        if kept.shape[0] != deal.kept:
            raise RuntimeError(f"unit {unit_id}: {kept.shape[0]} rows pass the stream's filter "
                               f"here, the driver counted {deal.kept}; refusing to deal rows "
                               "whose ranks would disagree")
        ordinal = deal.kept_before + np.arange(kept.shape[0], dtype=np.int64)
        live = np.ones(kept.shape[0], bool) if deal.cut is None else ordinal < deal.cut
        rank = ordinal % G
        self.ranks = tuple(range(G)) if deal.ranks is None else tuple(deal.ranks)
        # local rows (within its context) each rank gets, per context: kept rows are in row
        # order, so one split of each rank's rows by context does it
        self.local: dict[int, list[np.ndarray]] = {}
        bounds = np.arange(self.n_ctx + 1, dtype=np.int64) * C
        for r in self.ranks:
            mine = kept[(rank == r) & live]
            cuts = np.asarray(np.searchsorted(mine, bounds), np.int64)
            self.local[r] = [mine[cuts[i]:cuts[i + 1]] - i * C for i in range(self.n_ctx)]
        self.rows = int(live.sum()) if deal.ranks is None else \
            sum(int(sum(v.shape[0] for v in self.local[r])) for r in self.ranks)
        self._pending = self.n_ctx * len(self.ranks)
        self._lock = threading.Lock()
        self.done = threading.Event()
        if not self._pending:
            self.done.set()

    def taken(self, n: int = 1) -> None:
        with self._lock:
            self._pending -= n
            if self._pending <= 0:
                self.done.set()


@dataclass
class _Part:
    unit: UnitParts
    ctx: int
    rows: np.ndarray      # global rows
    acts: np.ndarray      # [m, n_points, row width] raw bits
    meta: tuple           # token_id, doc_id, position of those rows


class Outbox:
    """Per rank a queue of parts, bounded by `send_buffer_rows` rows (a part larger than the
    bound still goes into an empty queue: a context's share never waits for ever)."""

    def __init__(self, spec: StreamSpec, actor: int):
        self.spec, self.actor = spec, actor
        G = spec.world_size
        self._cond = threading.Condition()
        self._queues: list[deque] = [deque() for _ in range(G)]
        self._held = [0] * G
        self._held_bytes = 0
        self.peak_held_bytes = 0
        self.put_wait_s = 0.0     # engine time spent waiting for trainers (backpressure)
        self.rows_sent = 0
        self.bytes_sent = 0
        self.closed = False
        self._unacked: dict[int, tuple] = {}   # take token -> (rank, its parts' units)
        self._token = 0
        self.wire = resolve_dtype(spec.dtype)
        self.raw = raw_dtype(self.wire)
        self.quantized = is_quantized(spec.dtype)
        self.max_width = max(spec.widths)
        self.row_width = self.max_width + (_fp8.SCALE_BYTES if self.quantized else 0)

    # ---- the engine thread's side ----------------------------------------------------------
    def context_rows(self, acts, view=None) -> np.ndarray:
        """One context's rows of the streamed points, [n_points, n, row width] raw bits of the
        stream dtype, from the engine's tensor (`acts`: [captured points, n, width]) or, with
        a tee writing in place, from the rows in the store's buffer (`view`: raw bits of the
        store dtype, which a tee's stream shares)."""
        pts = list(self.spec.points)
        if view is not None:
            return self._points(np.asarray(view), pts, self.row_width).view(self.raw)
        a = self._points(to_numpy(acts, None), pts, self.max_width)
        if self.quantized:
            return _fp8.quantize_points(a, self.spec.widths, self.row_width)
        if a.dtype != self.wire:
            raise RuntimeError(f"stream: the engine's rows are {a.dtype}, the stream's dtype "
                               f"is {self.spec.dtype}; set stream.dtype to the model's dtype or "
                               "float8_e4m3fn")
        return a.view(self.raw)

    @staticmethod
    def _points(a: np.ndarray, pts: list, width: int) -> np.ndarray:
        """The streamed points' columns of [points, n, width] rows: a view when they are all of
        them in order (no copy), else a selection."""
        if pts != list(range(a.shape[0])):
            a = a[pts]
        return a if a.shape[2] == width else a[:, :, :width]

    def deliver(self, unit: UnitParts, i: int, rows: np.ndarray) -> None:
        """Context i of `unit` (rows: context_rows()) to each of its ranks, waiting while a
        rank's queue is full."""
        a0 = unit.row_start + i * unit.C
        P, _, W = rows.shape
        for r in unit.ranks:
            local = unit.local[r][i]
            # one pass: each point's rows gathered straight into the rank's [rows, points, width]
            acts = np.empty((local.shape[0], P, W), rows.dtype)
            for p in range(P):
                np.take(rows[p], local, axis=0, out=acts[:, p, :], mode="clip")
            meta = tuple(m[i * unit.C + local] for m in unit.meta)
            self._put(r, _Part(unit, i, a0 + local.astype(np.int64), acts, meta))

    def _put(self, r: int, part: _Part) -> None:
        n = part.rows.shape[0]
        limit = self.spec.send_buffer_rows
        with self._cond:
            t0 = None
            while not self.closed and self._held[r] and self._held[r] + n > limit:
                t0 = t0 or time.monotonic()
                self._cond.wait(1.0)
            if t0 is not None:
                self.put_wait_s += time.monotonic() - t0
            if self.closed:
                raise StreamClosed(f"actor {self.actor} is closing")
            self._queues[r].append(part)
            self._held[r] += n
            self._held_bytes += part.acts.nbytes
            self.peak_held_bytes = max(self.peak_held_bytes, self._held_bytes)
            self._cond.notify_all()

    # ---- the trainers' side ----------------------------------------------------------------
    def take(self, r: int, max_rows: int, wait_s: float, pid: int, ack=()) -> StreamRows:
        """Rank r's queued parts, up to `max_rows` rows (at least one part when any is queued
        within `wait_s` seconds), as one StreamRows; `ack`: the tokens of the earlier takes the
        trainer received (their parts are delivered now)."""
        if not 0 <= r < self.spec.world_size:
            raise ValueError(f"rank {r}: this stream has ranks 0..{self.spec.world_size - 1}")
        for t in ack:
            with self._cond:
                _, units = self._unacked.pop(int(t), (r, []))
            for u in units:
                u.taken()
        got: list[_Part] = []
        with self._cond:
            deadline = time.monotonic() + wait_s
            while not self._queues[r] and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            q, n = self._queues[r], 0
            while q and (not got or n + q[0].rows.shape[0] <= max_rows):
                p = q.popleft()
                got.append(p)
                n += p.rows.shape[0]
                self._held[r] -= p.rows.shape[0]
                self._held_bytes -= p.acts.nbytes
            held = self._held[r]
            token = 0
            if got:
                self._token += 1
                token = self._token
                self._unacked[token] = (r, [p.unit for p in got])
            self._cond.notify_all()
        out = _pack(got, self.actor, pid, held, token)
        self.rows_sent += out.rows.shape[0]
        self.bytes_sent += sum(a.nbytes for a in out.acts)
        return out

    def release(self, r: int) -> int:
        """Rank r restarted: the takes its old process never acknowledged count as delivered
        (the stream captures those units again for the new process, deal.Deal.replay), so the
        units waiting on them finish. Returns how many takes were released."""
        with self._cond:
            mine = [t for t, (rank, _) in self._unacked.items() if rank == r]
            units = [u for t in mine for u in self._unacked.pop(t)[1]]
        for u in units:
            u.taken()
        return len(mine)

    def held(self) -> tuple[list[int], int]:
        """(rows held per rank, bytes held)."""
        with self._cond:
            return list(self._held), self._held_bytes

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


def _pack(parts: list, actor: int, pid: int, held: int, token: int) -> StreamRows:
    """The parts as one message; each part's acts stay their own array (Ray's serialiser copies
    each once into its object store, a concatenation here would be a second copy)."""
    table = np.array([(p.unit.unit_id, p.ctx, p.unit.n_ctx, p.rows.shape[0],
                       p.unit.row_start // p.unit.C + p.ctx) for p in parts],
                     np.int64).reshape(-1, 5)

    def cat(vals, dtype, shape=()):
        return np.concatenate(vals) if vals else np.empty((0, *shape), dtype)
    return StreamRows(
        actor=actor, pid=pid, parts=table, rows=cat([p.rows for p in parts], np.int64),
        token_id=cat([p.meta[0] for p in parts], np.int32),
        doc_id=cat([p.meta[1] for p in parts], np.int64),
        position=cat([p.meta[2] for p in parts], np.int32),
        acts=tuple(p.acts for p in parts), held_rows=held, token=token)


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where it cannot be read): the stream's
    memory figures on both sides (HarvestActor.stream_figures, StreamDataset.figures)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
