"""Taps that write a step's rows straight into the requests' destinations (CPU engines).

The tap buffer path copies every row twice: the tap op writes the step's rows into the tap
buffer, then the transport copies each request's rows from there into its destination (a slice
of the writer's block). On CPU the forward runs the tap op eagerly at every step (there are no
CUDA graphs to replay it), so the op can do the second copy's job itself: at the step's first tap
it asks the runner where this step's rows go (the same row plan the transport would use,
coverage.plan_step over the runner's prepared batch), and every tap then copies its rows of each
planned request into that request's destination, one copy instead of two. Points the capture
did not ask for are not copied at all.

A `Sink` is attached to one engine's tap buffer (found by the buffer's address: the op gets the
buffer, nothing else of the engine) and armed only around a real step (`HarvestState.
before_forward` .. `after_forward`); vLLM's dummy and warm-up runs, GPU engines, tensor
parallelism, quantised and NaN-poisoned captures never arm it and keep the buffer path. When
planning fails the step falls back to the buffer path before any row is written, and the runner
plans again after the forward as it always did, so the error is raised where it was before.
After the forward the runner checks that the plan it makes then is the one the taps used and
that every captured point's tap ran (`Delivery`), so a row can neither go astray nor go missing
silently.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import ntcopy
from .coverage import StepPlan

# tap buffer address -> its engine's Sink (weak: a closed engine's sink goes with its state)
_SINKS: dict[int, "weakref.ref[Sink]"] = {}

IDLE, ARMED, DIRECT, FALLBACK = "idle", "armed", "direct", "fallback"


@dataclass
class Delivery:
    """What one armed step did: the layout and plan the taps used (None: nothing planned, the
    buffer path ran) and how many times each tap slot ran."""

    state: str
    layout: tuple | None = None
    plan: StepPlan | None = None
    calls: dict[int, int] = field(default_factory=dict)


class Sink:
    """Per engine: where this step's taps write (see the module docstring)."""

    def __init__(self, buf: torch.Tensor):
        self.state = IDLE
        self._planner: Callable | None = None
        self._index: dict[int, int] = {}
        self._segs: list = []
        self._layout: tuple | None = None
        self._plan: Any = None
        self._calls: dict[int, int] = {}
        self._tables: dict[int, object] = {}   # point width -> ntcopy table of this step (or None)
        self.fast = ntcopy.available()   # non-temporal copies (ntcopy.py); False: torch's copy_
        _SINKS[buf.data_ptr()] = weakref.ref(self)

    def arm(self, planner: Callable, slots) -> None:
        """Before a step's forward. `planner()` -> (layout, plan, dests) read from the runner's
        prepared batch at the first tap; `slots[i]` is the tap slot of destination point i."""
        self.state, self._planner = ARMED, planner
        self._index = {s: i for i, s in enumerate(slots)}
        self._segs, self._calls, self._tables = [], {}, {}
        self._layout = self._plan = None

    def disarm(self) -> Delivery:
        """After the forward: what the taps did; the sink is idle again."""
        d = Delivery(self.state, self._layout, self._plan, self._calls)
        self.state, self._planner, self._segs, self._tables = IDLE, None, [], {}
        return d

    def _make_plan(self) -> None:
        try:
            self._layout, self._plan, dests = self._planner()
        except Exception:   # noqa: BLE001  (the runner plans again after the forward and raises there)
            self.state = FALLBACK
            return
        self.state = DIRECT
        if self._plan is not None:
            self._segs = [(dests[s.rid], s.start, s.start + s.count, s.row, s.row + s.count)
                          for s in self._plan.segments]

    def write(self, x: torch.Tensor, r: torch.Tensor | None, slot: int) -> bool:
        """Deliver one tap's rows (x, or x + r for a fused trunk's stream); False: not armed or
        fallen back, the caller writes the tap buffer."""
        if self.state == ARMED:
            self._make_plan()
        if self.state != DIRECT:
            return False
        self._calls[slot] = self._calls.get(slot, 0) + 1
        i = self._index.get(slot)
        if i is None or not self._segs:
            return True
        x = x.reshape(-1, x.shape[-1])
        w = x.shape[1]
        if r is None:
            table = self._table(w, x) if self.fast else None
            if table is not None:
                ntcopy.copy_rows(table, i, x.data_ptr())
                return True
            for dest, d0, d1, s0, s1 in self._segs:
                dest[i, d0:d1, :w].copy_(x[s0:s1])
        else:
            r = r.reshape(-1, w)
            for dest, d0, d1, s0, s1 in self._segs:
                torch.add(x[s0:s1], r[s0:s1], out=dest[i, d0:d1, :w])
        return True

    def _table(self, w: int, x: torch.Tensor):
        """This step's non-temporal copy table for points `w` wide, or None (torch copies)."""
        if not x.is_contiguous() or x.dtype != self._segs[0][0].dtype:
            return None
        if w not in self._tables:
            self._tables[w] = ntcopy.plan(self._segs, w, x.element_size())
        return self._tables[w]


def sink_for(buf: torch.Tensor) -> Sink | None:
    ref = _SINKS.get(buf.data_ptr())
    return ref() if ref is not None else None
