"""The driver's side of the store's plan: units placed by the frontier, written as plan segments
before any of them is dispatched, and compacted now and then (store/commit/plan.py, FORMAT.md).

A unit is planned before it is dispatched, so a resumed run knows every unit an earlier run may
have started. Segments are batched (one per flush, not one per unit) but never held back while
actors wait for work: a flush is due when the ready queue is shorter than the free slots, when
256 units wait, when the frontier is done, or after PLAN_FLUSH_SECONDS.
"""

from __future__ import annotations

import time

from ..errors import HarvestError, ResumeMismatch
from ..data.row_frontier import Emitted, chunk_key, sum_stats
from ..messages import ChunkDescriptor

PLAN_FLUSH_SECONDS = 10.0  # at most this long between plan segments while units are waiting


class PlanWriter:
    """Units emitted and not yet planned, and the plan so far (units, chunk descriptors)."""

    def __init__(self, state, lease=None, in_store: bool = True):
        """`in_store=False`: no store holds the plan (a streamed run without a tee): a flush
        hands the units on without writing a segment."""
        self.lease = lease
        self.in_store = in_store
        self.store = None                       # set once the store exists (Scheduler.attach)
        self.unplanned: list[Emitted] = []
        self.chunks: dict = dict(state.chunks)  # chunk key -> descriptor, every run's
        self.units: list = list(state.units)    # every planned unit, every run's
        self.frontier_state = None              # the frontier's state in the last segment
        self.resumed_final = state.final        # the plan was final before this run
        self.seq, self.compacted_upto = state.next_seq, state.next_seq - 1
        self.last_flush = 0.0

    def check_chunk(self, block: int, chunk: int, desc: ChunkDescriptor) -> None:
        """A chunk tokenised again must be the chunk the plan recorded (a resume re-creates it)."""
        planned = self.chunks.get(chunk_key(block, chunk))
        if planned is not None and (list(planned["digest"]) != list(desc.digest)
                                    or planned["n_contexts"] != desc.n_contexts):
            raise ResumeMismatch(
                f"block {block} chunk {chunk} now tokenises to other rows than when the store was "
                f"planned ({desc.n_contexts} contexts, digest {list(desc.digest)} vs "
                f"{planned['n_contexts']}, {planned['digest']}): the data or tokenizer changed "
                "under the same config; use the original data, or a new store.url")

    def add(self, emitted: list[Emitted]) -> None:
        self.unplanned.extend(emitted)

    def flush(self, force: bool, ready: int, free: int, frontier_done: bool) -> list:
        """Write the units waiting for the plan as one segment when due; returns them (now
        dispatchable), or [] when nothing was written."""
        if not self.in_store and self.unplanned:
            batch, self.unplanned = self.unplanned, []
            units = [e.unit for e in batch if e.unit.n_rows]
            self.units += units
            for e in batch:
                self.chunks.update(e.chunks)
            return units
        if not self.unplanned or self.store is None:
            return []
        due = (force or ready < max(1, free) or len(self.unplanned) >= 256 or frontier_done
               or time.monotonic() - self.last_flush > PLAN_FLUSH_SECONDS)
        if not due:
            return []
        batch, self.unplanned = self.unplanned, []
        units = [e.unit for e in batch if e.unit.n_rows]
        chunks = {}
        for e in batch:
            chunks.update(e.chunks)
        payload = {"chunks": chunks, "state": batch[-1].state}
        final = any(e.final for e in batch)
        if self.lease is not None:
            self.lease.assert_held(f"writing plan segment {self.seq}")
        if not self.store.ledger.plans.write_segment(self.seq, units, payload, final=final):
            raise HarvestError(
                f"plan segment {self.seq} of {self.store.url} already exists: another driver is "
                "writing this store; stop one of them (the store stays consistent)")
        self.seq += 1
        self.last_flush = time.monotonic()
        self.units += units
        self.chunks.update(chunks)
        self.frontier_state = payload["state"]
        if self.seq - 1 - self.compacted_upto >= max(32, len(self.units) // 10) or final:
            self.store.ledger.plans.compact(self.units, [{"chunks": self.chunks,
                                                          "state": self.frontier_state}],
                                     self.seq - 1, final or self.resumed_final)
            self.compacted_upto = self.seq - 1
        return units

    def data_stats(self) -> dict:
        """Source rows and packing figures summed over every chunk placed (this run and the
        runs before it: the plan keeps each chunk's figures)."""
        chunks = dict(self.chunks)
        for e in self.unplanned:
            chunks.update(e.chunks)
        return sum_stats(chunks.values())
