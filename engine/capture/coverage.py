"""Row accounting of a capture, as pure functions over step layouts (no engine, no vLLM).

A request's rows arrive in chunks across steps. After a preemption vLLM recomputes a request from
its first token, so a chunk may arrive twice: a counter (`filled += c`) then overshoots and the
request is refused on every retry, or, worse, a double count hides a gap elsewhere. A bitmap of
positions per request gets both right: a repeated position overwrites (same tokens, same
positions; the later row wins), a position never seen is a gap, and a request is handed over
only when every position was seen. The tokens the runner fed are compared with the request's
tokens at those positions, so a row map that attaches rows to the wrong request or offset is a
loud error, not silent wrong data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np


class CoverageError(RuntimeError):
    """Rows of a capture do not line up with the request they were attached to."""


@dataclass
class Coverage:
    """Which positions [0, n) of one request have rows; `rewrites` counts recomputed positions."""

    n: int
    seen: np.ndarray = field(init=False)
    rewrites: int = 0

    def __post_init__(self):
        self.seen = np.zeros(self.n, dtype=bool)

    def mark(self, start: int, count: int) -> None:
        if start < 0 or count < 0 or start + count > self.n:
            raise CoverageError(f"rows [{start}, {start + count}) fall outside the request's "
                                f"{self.n} positions")
        part = self.seen[start : start + count]
        self.rewrites += int(part.sum())
        part[:] = True

    @property
    def complete(self) -> bool:
        return bool(self.seen.all())

    def gaps(self) -> list[tuple[int, int]]:
        """Missing positions as [a, b) runs."""
        d = np.diff(np.concatenate(([1], self.seen.view(np.int8), [1])))
        return list(zip(np.flatnonzero(d == -1).tolist(), np.flatnonzero(d == 1).tolist()))

    def require_complete(self, what: str, upto: int | None = None) -> None:
        """Every position [0, upto) (default: all n) has a row. A generated request registers
        room for its longest possible sequence and learns its real length only when it finishes;
        `upto` is that length."""
        n = self.n if upto is None else upto
        if not self.seen[:n].all():
            runs = [(a, min(b, n)) for a, b in self.gaps() if a < n]
            shown = ", ".join(f"[{a}, {b})" for a, b in runs[:5]) + (" ..." if len(runs) > 5 else "")
            raise CoverageError(f"{what}: positions {shown} of {n} never received rows; "
                                "refusing to hand over a partial request")


@dataclass(frozen=True)
class Segment:
    """Rows [row, row + count) of a step's tap buffer are positions [start, start + count) of rid."""

    rid: str
    row: int
    start: int
    count: int


@dataclass(frozen=True)
class StepPlan:
    segments: tuple[Segment, ...]
    stray: tuple[Segment, ...]  # rows of requests (or positions) nobody asked to capture
    dropped: int  # rows of requests the caller retired (aborted): expected, never copied
    n: int


def plan_step(req_ids, counts, starts, lengths: Mapping[str, int],
              retired=frozenset()) -> StepPlan:
    """Where each row of one step goes. `lengths[rid]` is the number of positions to capture."""
    segs, stray, dropped, row = [], [], 0, 0
    for rid, c, s in zip(req_ids, np.asarray(counts).tolist(), np.asarray(starts).tolist()):
        n = lengths.get(rid)
        if n is None:
            if rid in retired:
                dropped += c
            else:
                stray.append(Segment(rid, row, s, c))
        else:
            keep = max(0, min(c, n - s))
            if keep:
                segs.append(Segment(rid, row, s, keep))
            if c > keep:
                stray.append(Segment(rid, row + keep, s + keep, c - keep))
        row += c
    return StepPlan(tuple(segs), tuple(stray), dropped, row)


def require_no_stray(plan: StepPlan) -> None:
    """Prompt capture forwards prompt tokens only (max_tokens=1: the sampled token is never fed);
    generation registers room for prompt + max_new_tokens positions per request (engine/vllm/generate.py),
    so its decode rows are planned like prompt rows. A stray row means a decode step of a request
    nobody captures, a position past a request's room, or a foreign request ran through the taps:
    the request map no longer describes what vLLM runs."""
    if plan.stray:
        s = plan.stray[0]
        raise CoverageError(
            f"{sum(x.count for x in plan.stray)} rows of a step belong to no captured request "
            f"(first: request {s.rid!r} positions [{s.start}, {s.start + s.count})); "
            "a capture expects none")


def check_fed(plan: StepPlan, fed_positions: np.ndarray, fed_ids: np.ndarray,
              tokens: Mapping[str, np.ndarray]) -> None:
    """Compare what the runner fed (positions, token ids) with each request's own tokens."""
    for s in plan.segments:
        pos = fed_positions[s.row : s.row + s.count]
        if pos.shape[0] != s.count or not np.array_equal(pos, np.arange(s.start, s.start + s.count)):
            raise CoverageError(
                f"request {s.rid!r}: the runner fed positions {_show(pos)} for rows planned at "
                f"positions [{s.start}, {s.start + s.count}): the row map is wrong")
        want = tokens[s.rid][s.start : s.start + s.count]
        got = fed_ids[s.row : s.row + s.count]
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0]) if got.shape == want.shape else 0
            raise CoverageError(
                f"request {s.rid!r}: the runner fed token {int(got[bad])} at position "
                f"{s.start + bad} where the request has {int(want[bad])}: rows would be "
                "attached to the wrong tokens")


def _show(a: np.ndarray) -> str:
    a = np.asarray(a)
    return str(a.tolist()) if a.size <= 6 else f"[{a[0]}, {a[1]}, ..., {a[-1]}] ({a.size})"
