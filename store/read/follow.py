"""Follow mode: read a store while a run writes it, each committed unit's rows exactly once.

`ActivationDataset(store, follow=True, ...)` yields the rows of units as they commit and ends when
the run finalizes the store; it raises when the run ended unfinished or its driver's lease went
stale (store/commit/runstate.py), and, with `follow_timeout`, when no unit it needs committed for that long.

Who reads what, without talking: global worker g of G = world_size x num_workers (g = rank x
num_workers + lane, sampling.lane) reads the units with `unit_id % G == g`, in unit-id order.
The driver numbers units 0, 1, 2, ... in row order and units are equal-sized except the last, so
workers' unit counts differ by at most one and their rows by at most one unit's rows. To keep
DDP ranks (and workers) yielding equal counts, at the end every worker with fewer kept rows than
the largest repeats that many random rows of its own last window (`tally.padded`, at most one
unit's rows); with G = 1 nothing is repeated.

Order, a pure function of the store's plan (never of commit timing), so that `state_dict()` +
`load_state_dict()` resume exactly: a worker's units in id order are cut into windows of whole
units holding at least `window_shards` shards (the shuffle window, as in epoch mode), and each
window's rows are permuted across all its shards (readahead.WindowFinisher, keyed by seed,
epoch, worker and window index). A window is read once all its units are committed; a unit
that commits late (its actor died) holds the windows after it back until it commits (the ones
already committed wait, none is skipped). Decoding runs one window ahead, so the reader is up to
two windows behind the newest commit. A window is known to be the last only when the run has
finalized, so the reader ends exactly then.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable

import numpy as np
import torch

from ..commit.objects import read_meta, read_point
from ..commit.records import Marker
from ..errors import StoreError
from .feed.batching import BatchBuffers, Tally, batches
from .filters import RowFilter
from .feed.readahead import Arenas, Ready, WindowFinisher, WindowReader, WindowSpec
from ..commit.runstate import FollowTimeout, RunState, run_state
from .shuffle.sampling import Take, lane, worker_share
from ..format.shardcodec import codec_pool
from ..store import Store
from .feed.workermem import cap_malloc_arenas

_GATHER_AHEAD = 4


class FollowPieces:
    """The follower's pieces in the order it reads them: its units in id order, each unit's
    shards. Append-only, so a piece's index never changes; looked up by index or by rows."""

    def __init__(self, shard_rows: int):
        self.R = int(shard_rows)
        self.lo: list[int] = []
        self.hi: list[int] = []
        self.cum: list[int] = [0]            # pieces before unit k
        self.lites: list[Marker] = []
        self.by_row: list[tuple[int, int]] = []   # (row_start, k), sorted, for lookups by rows

    def add(self, m: Marker) -> range:
        a, b, R = m.row_start, m.row_end, self.R
        k = len(self.lo)
        self.lo.append(a)
        self.hi.append(b)
        self.lites.append(m)
        n = -(-b // R) - a // R
        self.cum.append(self.cum[-1] + n)
        bisect.insort(self.by_row, (a, k))
        return range(self.cum[-2], self.cum[-1])

    def __len__(self) -> int:
        return self.cum[-1]

    def __getitem__(self, i: int) -> tuple[int, int]:
        k = bisect.bisect_right(self.cum, int(i)) - 1
        s = self.lo[k] // self.R + int(i) - self.cum[k]
        return max(s * self.R, self.lo[k]), min((s + 1) * self.R, self.hi[k])

    def source(self, a: int) -> "tuple[Marker, int]":
        """(the marker facts of the unit holding row a, the shard index of row a)."""
        k = self.by_row[bisect.bisect_right(self.by_row, (int(a), 1 << 62)) - 1][1]
        return self.lites[k], int(a) // self.R


class FollowCounts:
    """Kept rows per follower piece once counted (-1: not counted), as WindowFinisher reads them."""

    def __init__(self):
        self.c: dict[int, int] = {}

    def __getitem__(self, i) -> int:
        return self.c.get(int(i), -1)

    def __setitem__(self, i, v) -> None:
        self.c[int(i)] = int(v)


class UnitLine:
    """Global worker g of G: its committed units, in id order, as they appear; the waits between.

    `poll()` reads the run's state, the plan and the markers written since the last poll (only
    the new markers of this worker's units are read); `wait(what, cond)` polls until cond()
    answers, raising when the run cannot go on or `timeout` passes (FollowTimeout).
    """

    def __init__(self, st, g: int, G: int, timeout: "float | None", poll_s: float):
        self.st, self.g, self.G, self.timeout, self.poll_s = st, g, G, timeout, poll_s
        self.plan: dict[int, tuple[int, int]] = {}
        self.own: list[int] = []               # this worker's planned unit ids, sorted
        self.plan_final = False
        self.seen: set[int] = set()            # committed unit ids (every worker's)
        self.markers: dict[int, Marker] = {}     # this worker's committed units: marker facts
        self.state: RunState | None = None
        self.polls = 0

    def poll(self) -> RunState:
        state = run_state(self.st)    # first: a finalize seen here covers the listing below
        p = self.st.ledger.plans.read()
        self.plan = {u.unit_id: (u.row_start, u.row_end) for u in p.units}
        self.plan_final = bool(p.final)
        self.own = sorted(u for u in self.plan if u % self.G == self.g)
        new = [n for n in self.st.ledger.marker_names()
               if n.unit_id not in self.seen and self.plan.get(n.unit_id) == n.rows]
        self.seen.update(n.unit_id for n in new)
        mine = [n for n in new if n.unit_id % self.G == self.g]
        for m in self.st.ledger.iter_committed(mine, planned=True):
            self.markers[m.unit_id] = m.lite()
        state.planned, state.plan_final, state.committed = len(self.plan), self.plan_final, len(self.seen)
        self.state = state
        self.polls += 1
        return state

    def wait(self, what: str, cond):
        t0 = time.monotonic()
        while True:
            got = cond() if self.state is not None else None
            if got is not None:
                return got
            state = self.poll()
            got = cond()
            if got is not None:
                return got
            state.check_alive(self.st.url)
            if self.timeout is not None and time.monotonic() - t0 >= self.timeout:
                raise FollowTimeout(
                    f"follow_timeout={self.timeout:g}: waited {time.monotonic() - t0:.1f} s for {what} "
                    f"of {self.st.url} and it did not come; the run: {state.describe()}. Raise "
                    "follow_timeout (None waits as long as the run's lease stays fresh)")
            time.sleep(self.poll_s)

    def unit(self, i: int) -> "int | None":
        """The i-th unit of this worker once committed; None when the run finalized without one."""
        def cond():
            if i < len(self.own):
                u = self.own[i]
                if u in self.markers:
                    return u
                if self.state is not None and self.state.finalized:
                    raise StoreError(f"{self.st.url} is finalized but unit {u} of its plan has no "
                                     "commit marker; run `harvest verify`")
                return None
            return -1 if self.state is not None and self.state.finalized else None
        u = self.wait(f"unit #{i} of worker {self.g}/{self.G} (unit_id % {self.G} == {self.g})", cond)
        return None if u == -1 else u

    def more_after(self, i: int) -> bool:
        """Whether this worker has an i-th unit (planned): known when planned, or at finalize."""
        def cond():
            if i < len(self.own):
                return True
            return False if self.state is not None and self.state.finalized else None
        return self.wait(f"the plan beyond unit #{i} of worker {self.g}/{self.G}", cond)


class FollowMode:
    """Follow mode of ActivationDataset (a base of it: the state it uses is the dataset's)."""

    # the dataset's, set by ActivationDataset; declared here for the type checker
    points: list[str]
    filter: RowFilter
    shard_rows: int
    window_shards: int
    seed: int
    _cols: list[int]
    mixed: bool
    _decoded: torch.Tensor
    _open: Callable[[], Store]
    _meta_names: Callable[[], list[str]]

    def _follow_fetch(self, piece, p: int, out: np.ndarray) -> None:
        m, sh = self._fpieces.source(piece[0])
        st = self._open()
        read_point(st, m, sh, st.points.index(self.points[p]), out=out, rows=piece[1] - piece[0])

    def _follow_meta(self, piece) -> dict[str, np.ndarray]:
        m, sh = self._fpieces.source(piece[0])
        return {n: read_meta(self._open(), m, sh, n) for n in self._meta_names()}

    def _kept(self, a: int, b: int, m: Marker) -> int:
        """Kept rows of piece [a, b) of the unit with marker facts m."""
        f = self.filter
        if not f.needs_meta:
            k = f.mask(a, b)
            return b - a if k is None else int(k.sum())
        got = {n: read_meta(self._open(), m, a // self.shard_rows, n) for n in f.meta_names()}
        return int(f.mask_of(a, b, got).sum())

    def _unit_kept(self, m: Marker) -> int:
        R, a, b = self.shard_rows, m.row_start, m.row_end
        return sum(self._kept(max(s * R, a), min((s + 1) * R, b), m) for s in range(a // R, -(-b // R)))

    def _pad_target(self, line: UnitLine) -> int:
        """Rows this worker repeats at the end so that every worker yields the most any does."""
        names = [n for n in self._open().ledger.marker_names() if line.plan.get(n.unit_id) == n.rows]
        per = np.zeros(line.G, np.int64)
        for m in self._open().ledger.iter_committed(names, planned=True):
            per[m.unit_id % line.G] += self._unit_kept(m)
        return int(per.max() - per[line.g])

    def _follow_specs(self, line: UnitLine, epoch: int):
        """WindowSpecs of whole units, at least window_shards shards each; see the docstring."""
        i = k = 0
        takes: list[Take] = []
        while True:
            u = line.unit(i)
            if u is not None:
                m = line.markers[u]
                takes += [Take(j) for j in self._fpieces.add(m)]
                i += 1
                if len(takes) < self.window_shards:
                    continue
                if line.more_after(i):
                    yield WindowSpec(epoch, k, takes, False)
                    k, takes = k + 1, []
                    continue
            # the run finalized and this worker has no unit left: `takes` is the last window
            if line.G > 1:
                pad = self._pad_target(line)
                if pad and not takes:
                    raise ValueError(f"follow: worker {line.g} of {line.G} (rank x DataLoader worker) "
                                     "has no rows to repeat up to the other workers' count: the "
                                     "store has fewer units than ranks x workers; use fewer")
                if takes:
                    yield WindowSpec(epoch, k, takes, True, pad)
            elif takes:
                yield WindowSpec(epoch, k, takes, True)
            return

    def _follow_preskip(self, specs, skip_rows: int):
        """Drop whole windows a resume already yielded, counting their kept rows (no decode)."""
        specs = iter(specs)
        for spec in specs:
            if not spec.last:
                n = 0
                for t in spec.takes:
                    if self._fcounts[t.piece] < 0:
                        a, b = self._fpieces[t.piece]
                        self._fcounts[t.piece] = self._kept(a, b, self._fpieces.source(a)[0])
                    n += self._fcounts[t.piece]
                if n <= skip_rows:
                    skip_rows -= n
                    continue

            def rest(first=spec):
                yield first
                yield from specs
            return rest(), skip_rows
        return iter(()), skip_rows

    def _follow_counted(self, specs, wid: int):
        """Count the rows each worker decodes (`decoded_rows`), as windows go to the decoder."""
        for spec in specs:
            rows = sum(self._fpieces[t.piece][1] - self._fpieces[t.piece][0] for t in spec.takes)
            self._decoded[min(wid, len(self._decoded) - 1)] += rows * len(self.points)
            yield spec

    def _follow_iter(self):
        """The dataset's iteration in follow mode (ActivationDataset.__iter__ comes here)."""
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            cap_malloc_arenas()
        epoch, resume = int(self._ctl[0]), int(self._ctl[1])
        ln = lane(wid, resume, nw)
        g, G = self.rank * nw + ln, self.world_size * nw
        skip_batches = worker_share(resume, ln, nw)
        limit = None if self.steps is None else worker_share(self.steps, ln, nw) - skip_batches
        st = self._open()
        self._fpieces, self._fcounts = FollowPieces(st.shard_rows), FollowCounts()
        line = UnitLine(st, g, G, self.follow_timeout, self.follow_poll)
        self.follow_line = line
        specs, skip_rows = self._follow_specs(line, epoch), skip_batches * self.batch_size
        if skip_rows:
            specs, skip_rows = self._follow_preskip(specs, skip_rows)
        specs = self._follow_counted(specs, wid)
        if self._arenas is None or self._arenas.slot_rows < st.shard_rows:
            self._arenas = Arenas(st.shard_rows, len(self.points), self._rw, self._raw)
        if self._batch_bufs is None:
            self._batch_bufs = BatchBuffers((self.batch_size, len(self.points), self._rw), self._raw,
                                            keep=_GATHER_AHEAD + 2)
        finish = WindowFinisher(self._fpieces, self.filter, self._fcounts, None, self._vdtype,
                                self._arenas.slot_rows, self.shuffle, self.seed, g, self.return_meta,
                                self._extra_meta, self._cols if self.mixed else None)

        def finish_padded(spec: WindowSpec, arena: np.ndarray, slot_meta: list) -> Ready:
            rd = finish(spec, arena, slot_meta)
            if spec.last and spec.quota:
                if not rd.idx.shape[0]:
                    raise ValueError(f"follow: worker {g} of {G}'s last window keeps no row to repeat")
                rng = np.random.default_rng([self.seed, spec.epoch, g, spec.index, 0x9AD])
                extra = rng.integers(0, rd.idx.shape[0], spec.quota)
                rd = Ready(rd.arena, np.concatenate([rd.idx, rd.idx[extra]]),
                           np.concatenate([rd.rows, rd.rows[extra]]),
                           {n: np.concatenate([v, v[extra]]) for n, v in rd.meta.items()},
                           rd.epoch, rd.dropped, int(spec.quota))
            return rd

        reader = WindowReader(self._fpieces, len(self.points), self._arenas, self.io_threads,
                              self._follow_fetch, self._follow_meta if self._meta_names() else None,
                              finish_padded)
        self._served, self._resumed = 0, resume
        self.tally = Tally()
        for batch in batches(reader(specs), self.batch_size, (len(self.points), self._rw), self._raw,
                             self._emit, skip=skip_rows, limit=limit, drop_last=self.drop_last,
                             shuffle=self.shuffle, seed=self.seed, tally=self.tally, pool=codec_pool(),
                             ahead=_GATHER_AHEAD, buffers=self._batch_bufs):
            self._served += 1
            yield batch


__all__ = ["FollowMode", "FollowPieces", "UnitLine"]
