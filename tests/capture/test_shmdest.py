"""Shared destinations (engine/capture/shmdest.py): the tensor-parallel rank writes rows straight into the
writer's buffers, and the capture loop's checks stay the in-process ones.

The rank's side (stepring.RingWriter with its Placer) and the capture loop's (remote.RemoteHarvest)
run here in one process over the same files, as the engine's process and the rank map them; the
reference for every row is the tap buffer the "rank" published. No vLLM: the engine-level proof
(rows equal HF fp32 at TP=2, written in place) is tests/engine/test_engine_tp.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.engine.capture import stepring
from harvest.engine.addresses import Address
from harvest.engine.capture.coverage import CoverageError
from harvest.engine.vllm.messages import WorkerInfo
from harvest.engine.vllm.remote import RemoteHarvest
from harvest.engine.capture.shmdest import SharedArena

P, T, W = 3, 32, 8
POINTS = tuple(Address.parse(f"resid_post.{i}") for i in range(P))


class Pair:
    """The engine's process side and the rank's side of one ring + arena."""

    def __init__(self, arena_bytes=1 << 20, max_reqs=4, in_flight=0):
        self.arena = SharedArena(arena_bytes)
        spec = stepring.new_spec(P, T, W, torch.bfloat16, max_reqs, self.arena.path,
                                 self.arena.size)
        self.ring = stepring.RingReader(spec)
        self.rank = stepring.RingWriter(stepring.RingSpec(**spec.as_dict()))
        self.arena.published, self.arena.in_flight = self.ring.latest, in_flight
        info = WorkerInfo(mode="freeze", runner="v1", report={}, publishes=True, publishes_stats=True,
                          summary={})
        self.st = RemoteHarvest(None, self.ring, POINTS, (), W, torch.bfloat16, T, info, self.arena)
        self.st.begin_capture(POINTS)
        self.seed = 0

    def buffer(self, rows: int):
        """A writer-style block buffer [P, rows, W] (raw int16 bits) in the arena."""
        return self.arena.allocate((P, rows, W), np.int16)

    def add(self, rid, acts, n):
        self.st.register(rid, self.st.destination(acts, n), np.arange(100, 100 + n, dtype=np.int32))

    def step(self, reqs, finished=()):
        """One forward: reqs = [(rid, start, count)]; fed positions/ids are the true ones."""
        self.seed += 1
        buf = torch.randn(P, T, W, generator=torch.Generator().manual_seed(self.seed)).bfloat16()
        pos = torch.cat([torch.arange(s, s + c) for _, s, c in reqs])
        self.rank.publish(tuple(r for r, _, _ in reqs), [c for *_, c in reqs],
                          [s for _, s, _ in reqs], pos, pos + 100, buf, finished)
        self.st.poll()
        return buf

    def close(self):
        self.rank.close()
        self.ring.close()
        self.arena.close()


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).view(torch.bfloat16)


def test_rank_writes_arena_rows_in_place_and_other_rows_take_the_slot():
    pr = Pair()
    try:
        block = pr.buffer(16)
        pr.add("a-1", _bf16(block)[:, 0:10], 10)  # in the arena: placed by the rank
        plain = torch.zeros(P, 7, W, dtype=torch.bfloat16)
        pr.add("b-1", plain, 7)  # elsewhere: copied from the slot
        b1 = pr.step([("a-1", 0, 6), ("b-1", 0, 7)])  # chunked: a-1 needs a second step
        b2 = pr.step([("a-1", 6, 4)])
        for rid in ("a-1", "b-1"):
            pr.st.mark_finished(rid)
        got_a = pr.st.take("a-1", "a")
        got_b = pr.st.take("b-1", "b")
        want_a = torch.cat([b1[:, 0:6], b2[:, 0:4]], dim=1)
        assert torch.equal(got_a, want_a) and torch.equal(_bf16(block)[:, :10], want_a)
        assert not _bf16(block)[:, 10:].any()  # nothing past the request's rows was touched
        assert torch.equal(got_b, b1[:, 6:13])
        s = pr.st.summary()
        assert (s["rows_placed"], s["rows_copied"]) == (10, 7)
        assert s["ring"]["rows_placed"] == 10 and s["rows"] == 17
    finally:
        pr.close()


def test_a_registration_other_than_the_requests_own_fails_the_step():
    """The rank wrote under a generation the capture loop does not hold for that request: its
    rows went to memory that is not the request's, so the capture fails rather than hand over."""
    pr = Pair()
    try:
        block = pr.buffer(8)
        pr.add("a-1", _bf16(block)[:, 0:4], 4)
        pr.st._regs.add("a-1", 0, 8, 8 * W * 2)  # another record for it reaches the rank later
        with pytest.raises(CoverageError, match="registration"):
            pr.step([("a-1", 0, 4)])
    finally:
        pr.close()


def test_rows_past_a_registration_are_not_placed_and_are_refused_as_stray():
    pr = Pair()
    try:
        block = pr.buffer(8)
        pr.add("a-1", _bf16(block)[:, 0:4], 4)
        with pytest.raises(CoverageError, match="stray|no captured request|past"):
            pr.step([("a-1", 2, 4)])  # positions 2..5 of a 4-position request
        assert not _bf16(block).any()  # the rank wrote nothing it could not place
    finally:
        pr.close()


def test_fed_tokens_are_checked_for_placed_rows_too():
    pr = Pair()
    try:
        block = pr.buffer(8)
        pr.add("a-1", _bf16(block)[:, 0:4], 4)
        buf = torch.zeros(P, T, W, dtype=torch.bfloat16)
        pos = torch.arange(4)
        pr.rank.publish(("a-1",), [4], [0], pos, pos + 999, buf)  # wrong token ids fed
        with pytest.raises(CoverageError):
            pr.st.poll()
    finally:
        pr.close()


def test_freed_arena_memory_waits_for_the_steps_that_may_still_write_it():
    pr = Pair(arena_bytes=2 * 4096, in_flight=1)
    try:
        a = pr.buffer(64)  # 3 x 64 x 8 x 2 B = 3 KiB: one page each
        b = pr.buffer(64)
        c = pr.buffer(64)  # the arena is full: plain memory, requests take the slot path
        assert pr.arena.offset_of(torch.from_numpy(c)) is None and pr.arena.fallbacks == 1
        off_a = pr.arena.offset_of(torch.from_numpy(a))
        del a  # the writer dropped it; one step may still be running on the rank
        d = pr.buffer(64)
        assert pr.arena.offset_of(torch.from_numpy(d)) is None  # not reused yet
        pr.add("x-1", _bf16(b)[:, :2], 2)
        pr.step([("x-1", 0, 2)])  # the rank published one more step: the fence has passed
        e = pr.buffer(64)
        assert pr.arena.offset_of(torch.from_numpy(e)) == off_a
    finally:
        pr.close()


def test_arena_memory_stays_out_of_reuse_while_any_view_of_it_lives():
    pr = Pair(arena_bytes=4096)
    try:
        a = pr.buffer(64)
        view = _bf16(a[:, 10:20])  # a writer reserves a numpy slice; the engine gets torch over it
        off = pr.arena.offset_of(view)
        del a
        b = pr.buffer(64)  # the arena's only page is still held through the view
        assert pr.arena.offset_of(torch.from_numpy(b)) is None
        del view
        c = pr.buffer(64)
        assert pr.arena.offset_of(torch.from_numpy(c)) == off - 10 * W * 2
    finally:
        pr.close()


def test_a_full_log_sends_rows_through_the_slot_and_finished_ids_leave_the_rank():
    pr = Pair(max_reqs=1)  # log capacity 4 records
    try:
        blocks = [pr.buffer(4) for _ in range(5)]
        for i, blk in enumerate(blocks):
            pr.add(f"r{i}", _bf16(blk)[:, :2], 2)
        assert len(pr.st._gens) == 4  # the fifth found the log full: not registered
        for i in range(5):
            buf = pr.step([(f"r{i}", 0, 2)], finished={f"r{i - 1}"} if i else ())
            pr.st.mark_finished(f"r{i}")
            assert torch.equal(pr.st.take(f"r{i}", "r"), buf[:, :2])
        assert pr.st.summary()["rows_copied"] == 2 and pr.st.rows_placed == 8
        assert pr.rank.placer.dests == {}  # r0..r3 reported finished, r4 never registered
    finally:
        pr.close()


def test_a_capture_of_some_points_keeps_the_slot_path():
    pr = Pair()
    try:
        pr.st.tickets.clear()
        pr.st.dests.clear()
        pr.st.begin_capture(POINTS[1:])  # the rank writes all tap slots in order: not placeable
        block = pr.arena.allocate((P - 1, 8, W), np.int16)
        pr.add("a-1", _bf16(block)[:, :4], 4)
        buf = pr.step([("a-1", 0, 4)])
        pr.st.mark_finished("a-1")
        assert torch.equal(pr.st.take("a-1", "a"), buf[1:, :4])
        assert pr.st.rows_placed == 0 and pr.st.rows_copied == 4
    finally:
        pr.close()


def test_an_arena_larger_than_dev_shm_is_refused_at_creation_naming_the_fix():
    """A sparse tmpfs file on a full volume kills whoever touches an unbacked page (SIGBUS
    mid-step); the arena reserves its pages at creation instead, and says what to change."""
    import os

    st = os.statvfs("/dev/shm")
    with pytest.raises(RuntimeError, match="larger /dev/shm.*shared_destination_bytes"):
        SharedArena(st.f_bavail * st.f_frsize + (1 << 30))
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"harvest-arena-{os.getpid()}-")]
