"""The streamed run's parts without Ray (issue 49): the deal (which rank gets which kept row),
the actor's outbox (dealing, backpressure, fp8 on the wire), the trainer's receiver (first copy
of each part kept) and shuffle windows. The Ray runs are tests/pipeline/test_stream_run.py."""

from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harvest.pipeline.actor.outbox import Outbox, UnitParts
from harvest.pipeline.messages import StreamSpec, UnitDeal, UnitTask
from harvest.pipeline.stream.deal import Deal
from harvest.pipeline.stream.receiver import Receiver
from harvest.pipeline.stream.windows import Windows
from harvest.store.format import fp8
from harvest.store.format.dtypes import BF16
from harvest.store.read.filters import RowFilter

C = 8   # context size


def _units(kept: list[int]):
    """Units of one context each (ids 0..), ready, with their kept counts."""
    units = [SimpleNamespace(unit_id=i, row_start=i * C, row_end=(i + 1) * C, n_rows=C)
             for i in range(len(kept))]
    tasks = {u.unit_id: UnitTask(u.unit_id, u.row_start, u.row_end) for u in units}
    return units, tasks, (lambda t: kept[t.unit_id])


@pytest.mark.parametrize("G", [1, 2, 3])
def test_deal_gives_every_rank_disjoint_rows_in_equal_numbers(G):
    kept = [5, 0, 8, 3, 7, 1, 6]
    units, tasks, counter = _units(kept)
    deal = Deal(None, C, G, counter=counter)
    ready = deque((u, 1) for u in units)
    deal.count(ready, lambda u: tasks[u.unit_id], None)
    stamped = [deal.stamp(tasks[u.unit_id], None) for u in units]
    # a unit whose rows could still reach the cut waits until the run's total is known
    assert stamped[-1] is None or G == 1
    deal.count(ready, lambda u: tasks[u.unit_id], len(units))
    N = sum(kept)
    assert deal.total == N
    per_rank: dict[int, list[int]] = {r: [] for r in range(G)}
    for u in units:
        d = deal.stamp(tasks[u.unit_id], len(units)).deal
        for k in range(d.kept):
            o = d.kept_before + k
            if d.cut is None or o < d.cut:
                per_rank[o % G].append(o)
    allo = sorted(o for v in per_rank.values() for o in v)
    assert allo == list(range(G * (N // G)))          # each kept row once, the last N mod G cut
    assert {len(v) for v in per_rank.values()} == {N // G}


def test_deal_guard_stops_the_run():
    units, tasks, counter = _units([1])

    def guard():
        raise RuntimeError("rank 1 gone")
    deal = Deal(None, C, 2, guard=guard, counter=counter)
    with pytest.raises(RuntimeError, match="rank 1 gone"):
        deal.count(deque([(units[0], 1)]), lambda u: tasks[u.unit_id], 1)


def _spec(G=2, dtype="bfloat16", send=4, widths=(6,), points=(0,)):
    filt = RowFilter.build(exclude=[0], context_size=C, seqpos=slice(1, None))
    return StreamSpec(G, points, widths, dtype, filt, send)


def _unit_parts(spec, unit_id=3, n_ctx=2, kept_before=0, token_id=None):
    n = n_ctx * C
    tok = np.arange(1, n + 1, dtype=np.int32) if token_id is None else token_id
    m = spec.filter.mask(unit_id * n, unit_id * n + n, tok, None, None)
    deal = UnitDeal(kept_before, int(m.sum()))
    pos = np.tile(np.arange(C, dtype=np.int32), n_ctx)
    return UnitParts(unit_id, unit_id * n, n, C, deal, spec, tok, np.zeros(n, np.int64), pos)


def test_unit_parts_deal_rows_by_ordinal_and_refuse_a_miscount():
    spec = _spec()
    tok = np.arange(1, 2 * C + 1, dtype=np.int32)
    tok[3] = 0                                       # an excluded token
    up = _unit_parts(spec, token_id=tok)
    # kept: positions 1..7 of both contexts but row 3 (token 0): 13 rows, ordinals 0..12
    kept = [r for r in range(2 * C) if r % C and r != 3]
    for r in (0, 1):
        got = [int(i * C + x) for i in range(2) for x in up.local[r][i]]
        assert got == [row for j, row in enumerate(kept) if j % 2 == r]
    with pytest.raises(RuntimeError, match="the driver counted 99"):
        UnitParts(3, 48, 2 * C, C, UnitDeal(0, 99), spec, tok, np.zeros(16, np.int64),
                  np.zeros(16, np.int32))


def _acts(n: int, width: int = 6, points: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randn(points, n, width, generator=g).to(torch.bfloat16)


def test_outbox_backpressure_pauses_the_producer_until_a_rank_takes():
    spec = _spec(send=4)
    box = Outbox(spec, actor=0)
    up = _unit_parts(spec, n_ctx=3)      # 7 kept rows a context, 3 or 4 per rank
    done = threading.Event()

    def produce():
        for i in range(3):
            box.deliver(up, i, box.context_rows(_acts(C)[:, :, :]))
        done.set()
    t = threading.Thread(target=produce, daemon=True)
    t.start()
    time.sleep(0.5)
    assert not done.is_set()             # the second context's rows do not fit: it waits
    held, _ = box.held()
    assert max(held) <= 4
    got: dict = {0: [], 1: []}
    acks: dict = {0: [], 1: []}
    while not done.is_set() or any(box.held()[0]):
        for r in (0, 1):
            rows = box.take(r, 100, 0.05, pid=1, ack=acks[r])
            acks[r] = [rows.token] if rows.token else []
            got[r].append(rows)
    t.join(5)
    assert box.put_wait_s > 0.3
    for r in (0, 1):
        box.take(r, 100, 0.01, pid=1, ack=acks[r])
    assert up.done.is_set()              # every part acknowledged: the unit may finish
    rows = {r: np.concatenate([x.rows for x in got[r]]) for r in (0, 1)}
    assert len(rows[0]) + len(rows[1]) == 3 * 7 and not set(rows[0]) & set(rows[1])
    parts = np.concatenate([x.parts for x in got[0] + got[1]])
    assert len(parts) == 6 and set(map(tuple, parts[:, :3].tolist())) == \
        {(3, i, 3) for i in range(3)}
    assert set(parts[:, 4].tolist()) == {9, 10, 11}       # unit 3's contexts, globally


def test_a_unit_is_delivered_only_once_its_trainers_acknowledged_its_rows():
    spec = _spec(send=100)
    box = Outbox(spec, actor=0)
    up = _unit_parts(spec, n_ctx=1)
    box.deliver(up, 0, box.context_rows(_acts(C)))
    first = [box.take(r, 100, 0.05, pid=1) for r in (0, 1)]
    assert all(f.token for f in first) and not up.done.is_set()   # taken, maybe lost on the way
    box.take(0, 100, 0.01, pid=1, ack=[first[0].token])
    assert not up.done.is_set()
    box.take(1, 100, 0.01, pid=1, ack=[first[1].token])
    assert up.done.is_set()
    # a rank whose process died with a take unacknowledged: released when it comes back
    up2 = _unit_parts(spec, unit_id=4, n_ctx=1)
    box.deliver(up2, 0, box.context_rows(_acts(C)))
    box.take(0, 100, 0.05, pid=1, ack=[])
    lost = box.take(1, 100, 0.05, pid=1, ack=[])
    assert lost.token and box.take(0, 100, 0.01, pid=1, ack=[]).token == 0
    assert not up2.done.is_set() and box.release(1) == 1 and not up2.done.is_set()
    assert box.release(0) == 1 and up2.done.is_set()


def test_outbox_fp8_rows_are_the_stores_quantiser_bit_for_bit():
    spec = _spec(dtype="float8_e4m3fn", widths=(6, 4), points=(0, 1), send=100)
    box = Outbox(spec, actor=0)
    a = _acts(C, 6, 2)
    got = box.context_rows(a)
    ref = fp8.quantize_points(a.view(torch.int16).numpy().view(BF16), [6, 4], 10)
    assert got.dtype == np.uint8 and np.array_equal(got, ref)


def _windows(W=16, shuffle=True):
    return Windows(W, 1, 6, np.dtype(np.uint16), seed=0, rank=0, shuffle=shuffle)


def test_receiver_keeps_the_first_copy_of_each_part_and_windows_hold_every_row_once():
    spec = _spec(send=1000)
    box = Outbox(spec, actor=0)
    up = _unit_parts(spec, n_ctx=3)
    for i in range(3):
        box.deliver(up, i, box.context_rows(_acts(C)))
    first = box.take(0, 1000, 0.05, pid=1)
    # the same unit again (its actor died, another re-captured it): every part is a duplicate
    again = Outbox(spec, actor=1)
    up2 = _unit_parts(spec, n_ctx=3)
    for i in range(3):
        again.deliver(up2, i, again.context_rows(_acts(C)))
    second = again.take(0, 1000, 0.05, pid=2)
    w = _windows(W=64)
    info = SimpleNamespace(actors=(), name="t", context_size=C)
    rec = Receiver(info, 0, w, 100, handle=None)
    rec.add(first)
    rec.add(second)
    w.end()
    assert rec.duplicates == 3 and rec.complete == {3}
    out = []
    while True:
        item = w.out.get(timeout=5)
        if item is None:
            break
        ready, arena = item
        out.append(ready.rows.copy())
        w.release(arena)
    rows = np.concatenate(out)
    assert sorted(rows.tolist()) == sorted(first.rows.tolist()) and len(rows) == rec.rows


def test_windows_wait_when_both_arenas_are_taken():
    w = _windows(W=4)
    rows = np.arange(12, dtype=np.int64)
    meta = (rows.astype(np.int32), rows, rows.astype(np.int32))
    acts = np.zeros((12, 1, 6), np.uint16)
    t = threading.Thread(target=w.add, args=(rows, meta, acts), daemon=True)
    t.start()
    t.join(1.0)
    assert t.is_alive() and w.out.qsize() == 2     # two windows out, the third waits
    ready, arena = w.out.get()
    w.release(arena)
    t.join(5)
    assert not t.is_alive() and w.rows_in == 12


def test_progress_records_what_a_rank_yielded_and_a_resume_drops_exactly_that():
    from harvest.pipeline.stream.progress import Progress, from_ranges, to_ranges

    assert to_ranges(np.array([1, 2, 3, 7, 9, 10])) == [[1, 4], [7, 8], [9, 11]]
    assert from_ranges([[1, 4], [7, 8]]).tolist() == [1, 2, 3, 7]
    p = Progress(C)
    for g in (0, 1, 2):
        p.received(g, 4 if g < 2 else 0)          # context 2 holds no row for this rank
    p.yielded(np.array([0, 1, 2, 3, 8, 9]))      # context 0 whole, two rows of context 1
    st = p.state()
    assert st["consumed"] == [[0, 1], [2, 3]] and st["partial"] == {"1": [8, 9]}
    again = Progress(C, from_ranges(st["consumed"]), {int(g): v for g, v in st["partial"].items()})
    assert again.keep(0, np.array([0, 1, 2, 3])) is None
    assert again.keep(1, np.array([8, 9, 10, 11])).tolist() == [False, False, True, True]
    assert again.keep(3, np.array([24])).tolist() == [True]
    again.received(1, 2)
    again.yielded(np.array([10, 11]))
    assert again.state() == {"consumed": [[0, 3]], "partial": {}}


def test_deal_replays_unfinished_units_for_one_rank_within_its_horizon():
    kept = [8, 8, 8, 8]
    units, tasks, counter = _units(kept)
    deal = Deal(None, C, 2, counter=counter, replay_units=2)
    deal.count(deque((u, 1) for u in units), lambda u: tasks[u.unit_id], len(units))
    for u in units[:3]:
        deal.sent_unit(u, deal.stamp(tasks[u.unit_id], len(units)))
    # units 1 and 2 are kept for replays, unit 0 went past the horizon
    assert deal.replay(1, np.array([0, 1], np.int64)) is None     # unit 0 yielded whole: fine
    got = []
    while (item := deal.next_replay()) is not None:
        got.append(item)
    assert [u.unit_id for u, _, _ in got] == [2] and got[0][1].deal.ranks == (1,) \
        and got[0][1].deal.replay
    why = deal.replay(1, np.array([1], np.int64))
    assert why is not None and "unit 0" in why and "stream.replay_units=2" in why
