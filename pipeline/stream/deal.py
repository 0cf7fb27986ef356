"""Which trainer rank gets which row of a streamed run, decided before a unit is captured.

The run's kept rows (those passing the trainers' filter), in row order, are numbered 0..N-1;
row k goes to rank k % world_size. Every rank then gets disjoint rows, and N // world_size or one
more; the last N mod world_size rows (fewer than the ranks) are dropped (`cut`), as the store's
reader drops them, so every rank gets exactly N // world_size rows and DDP steps stay equal.

To number a unit's rows, the driver needs the kept rows of every unit before it: it counts each
unit's kept rows from its token metadata (16 bytes a row, read from the tokenisers' chunks in the
object store; never activations) as soon as the unit is ready, and a unit is sent once the units
before it are counted. The cut is at most world_size - 1 rows from the end, and N is known only
once the corpus is placed, so a unit whose last row could still be past the cut waits until
either enough kept rows are counted after it or N is known (`stamp`): with one rank, never.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict, deque
from typing import Callable

import numpy as np

from ..data.unit_rows import unit_rows
from ..messages import UnitDeal, UnitTask


class Deal:
    """The run's kept-row count per unit and the deal stamped on each unit's task.

    `guard` is called once per dispatch round and may raise to stop the run (the stream's
    coordinator: a rank gone, or not all joined in time). `counter(task)` counts a unit's kept
    rows (default: from its metadata, `count_task`)."""

    def __init__(self, filt, context_size: int, world_size: int,
                 guard: "Callable[[], None] | None" = None,
                 counter: "Callable[[UnitTask], int] | None" = None, replay_units: int = 64):
        self.filter, self.C, self.G = filt, context_size, world_size
        self.guard = guard
        self.counter = counter or self.count_task
        # the latest stamped units (Unit, UnitTask), for a resuming rank's replay; older ones
        # let go of their token references
        self.sent: "OrderedDict[int, tuple]" = OrderedDict()
        self.replay_units = replay_units
        self.evicted_upto = -1              # every unit id <= this may be gone from `sent`
        self.replays: deque = deque()       # (Unit, UnitTask, attempt) to capture for one rank
        self.kept: dict[int, int] = {}      # unit id -> kept rows
        self.before: dict[int, int] = {}    # unit id -> kept rows of the units before it
        self._next = 0                      # units 0.._next-1 have `before`
        self._sum = 0                       # kept rows of units 0.._next-1
        self.total: int | None = None       # N, once every unit is counted
        self.units: int | None = None       # the run's units, once placed
        self.done: set[int] = set()         # units every rank took
        self.unit_rows: dict[int, tuple[int, int]] = {}   # unit id -> its rows, once counted
        self._lock = threading.Lock()       # the figures are read from other threads

    def count(self, ready, task_of, n_units: "int | None") -> None:
        """Count the kept rows of the ready units not counted yet (`ready`: (unit, attempt)
        pairs; `task_of(unit)` their UnitTask); `n_units`: the run's units once all are placed."""
        if self.guard is not None:
            self.guard()
        for unit, _ in ready:
            if unit.unit_id not in self.kept:
                self.kept[unit.unit_id] = self.counter(task_of(unit))
                self.unit_rows[unit.unit_id] = (unit.row_start, unit.row_end)
        with self._lock:
            while self._next in self.kept:
                self.before[self._next] = self._sum
                self._sum += self.kept[self._next]
                self._next += 1
            if n_units is not None:
                self.units = n_units
                if self._next >= n_units:
                    self.total = self._sum

    def count_task(self, task: UnitTask) -> int:
        """Kept rows of one unit, from its metadata (the filter the actor applies)."""
        tok, doc, pos, role = unit_rows(task, self.C)
        m = self.filter.mask(task.row_start, task.row_end, tok, doc, role)
        return task.n_rows if m is None else int(m.sum())

    def stamp(self, task: UnitTask, n_units: "int | None") -> "UnitTask | None":
        """`task` with its deal, or None while its rows' ranks are not known yet."""
        uid = task.unit_id
        if uid not in self.before:
            return None
        b, k = self.before[uid], self.kept[uid]
        if self.total is not None:
            cut = self.G * (self.total // self.G)
            deal = UnitDeal(b, k, cut if cut < b + k else None)
        elif b + k + self.G - 1 <= self._sum:
            deal = UnitDeal(b, k)   # the cut (>= N - G + 1 > every ordinal here) cannot reach it
        else:
            return None
        return dataclasses.replace(task, deal=deal)

    def sent_unit(self, unit, task: UnitTask) -> None:
        """A stamped unit went to an actor: kept for a replay (the latest replay_units)."""
        with self._lock:
            self.sent[unit.unit_id] = (unit, task)
            self.sent.move_to_end(unit.unit_id)
            while len(self.sent) > self.replay_units:
                uid, _ = self.sent.popitem(last=False)
                self.evicted_upto = max(self.evicted_upto, uid)

    def replay(self, rank: int, consumed: np.ndarray) -> "str | None":
        """Queue again, for `rank` only, every unit sent so far of which the rank has not
        yielded every row (`consumed`: sorted global contexts it yielded whole, empty ones
        included); returns why it cannot (a unit it needs is past the replay horizon), or None."""
        def whole(uid: int) -> bool:
            a, b = self.unit_rows[uid]
            return bool(np.isin(np.arange(a // self.C, b // self.C), consumed).all())
        with self._lock:
            gone = [uid for uid in self.unit_rows
                    if uid <= self.evicted_upto and uid not in self.sent and not whole(uid)]
            if gone:
                return (f"rank {rank}'s saved position is older than the stream can capture "
                        f"again: unit {min(gone)} (and {len(gone) - 1} more) went past "
                        f"stream.replay_units={self.replay_units}; save the rank's state more "
                        "often, raise stream.replay_units, or write a tee")
            for uid, (unit, task) in self.sent.items():
                if not whole(uid):
                    d = dataclasses.replace(task.deal, ranks=(rank,), replay=True)
                    self.replays.append((unit, dataclasses.replace(task, deal=d), 1))
            return None

    def next_replay(self):
        with self._lock:
            return self.replays.popleft() if self.replays else None

    def requeue_replay(self, unit, task: UnitTask, attempt: int) -> None:
        with self._lock:
            self.replays.appendleft((unit, task, attempt))

    def replays_pending(self) -> bool:
        with self._lock:
            return bool(self.replays)

    def delivered(self, unit_id: int) -> None:
        with self._lock:
            self.done.add(unit_id)

    def figures(self) -> dict:
        """Units planned and delivered, and N once known (the coordinator's status)."""
        with self._lock:
            return {"units": self.units, "units_done": len(self.done), "kept_rows": self.total,
                    "counted": self._next}


__all__ = ["Deal"]
