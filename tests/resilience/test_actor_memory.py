"""The actor keeps only its units in flight: a long capture stream does not pile up finished
units' writers (issue 24 item 1).

The real HarvestActor (constructed in-process through its `engine_factory` hook, no Ray) runs
one stream over many units, fed by two run_unit threads (two units in flight, as Ray's
`max_concurrency` gives), into a real local store. The engine is a slow fake that keeps a few
contexts in flight, so the stream never drains between units. Live RegionWriter objects are
counted while the stream runs and after it ends (each writer registered in a WeakSet as it is
built: the objects the garbage collector's list holds, without a scan per sample); the store
is then verified and read back against rows computed here from the token ids.
"""

from __future__ import annotations

import gc
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from harvest.pipeline.messages import ActorSpec, UnitTask
from harvest.store import create_store, open_store
from tests.support.slow_engine import (C, P, SLOW_ENGINE, W, live, live_writers, rows_of,
                                       tokens_of, track_writers)

pytestmark = pytest.mark.slow  # the actor's stream over 40 units: not in `pytest -m 'not slow'`

CTX_PER_UNIT, SHARD = 4, 32   # 64-row units of two shards each
UNITS, IN_FLIGHT = 40, 2


def _unit_rows(unit: UnitTask, context_size: int):
    """Stands in for the Ray fetch of the tokenisers' chunks (harvest.pipeline.data.unit_rows)."""
    rs, re_ = unit.row_start, unit.row_end
    tok = tokens_of(rs, re_ - rs)
    return tok, np.arange(rs, re_) // 50, np.arange(rs, re_) % C, None  # no roles: text input


def _spec(url: str, points: list, **factory_options) -> ActorSpec:
    return ActorSpec(index=0, model_path="", engine_kwargs={}, points=tuple(points),
                     context_size=C, store_url=url, engine_factory=SLOW_ENGINE,
                     factory_options=factory_options)


def _planned_store(tmp_path, units_n: int):
    """A store of `units_n` units of CTX_PER_UNIT contexts, planned and empty: (url, points,
    the units' messages)."""
    U = CTX_PER_UNIT * C
    url = str(tmp_path / "s.zarr")
    points = [f"resid_post.{p}" for p in range(P)]
    s = create_store(url, points=points, width=W, n_rows=units_n * U, shard_rows=SHARD,
                     chunk_rows=16, context_size=C)
    units = [UnitTask(u, u * U, (u + 1) * U) for u in range(units_n)]
    s.ledger.write_plan([{"unit_id": u.unit_id, "row_start": u.row_start, "row_end": u.row_end}
                         for u in units])
    return url, points, units


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in-place"])
def test_a_long_stream_keeps_only_the_units_in_flight(tmp_path, monkeypatch, in_place):
    import torch

    import harvest.pipeline.actor.capture as actor_mod
    import harvest.pipeline.data.unit_rows as rows_mod
    import harvest.store.commit.ledger as ledger_mod

    url, points, units = _planned_store(tmp_path, UNITS)
    n = UNITS * CTX_PER_UNIT * C

    monkeypatch.setattr(rows_mod, "unit_rows", _unit_rows)
    # the markers the actor's long-lived store caches: bounded (8 here, so 40 units exceed it)
    monkeypatch.setattr(ledger_mod, "MARKER_CACHE", 8)
    # no wait for the next unit ends the stream: the run's end does (below), so the whole run is
    # one stream, as in production, however long a loaded machine takes between two units
    monkeypatch.setattr(actor_mod, "STREAM_GAP_WAIT", 600.0)
    monkeypatch.setattr(actor_mod, "STREAM_START_WAIT", 600.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")        # the actor sets these for its process
    monkeypatch.setenv("HARVEST_CODEC_THREADS", "2")
    monkeypatch.delenv("HARVEST_LOG_DIR", raising=False)
    threads = torch.get_num_threads()
    live.clear()
    track_writers(monkeypatch)
    gc.collect()
    base = live_writers()
    actor = actor_mod.HarvestActor(_spec(url, points, in_place=in_place))
    queued, put = [0], actor._queue.put   # a count: holding the jobs would keep their writers

    def put_then_end(job, *a, **kw):
        """The actor's unit queue, which gets the run's end (what close() puts) once every unit
        is in it: the stream drains its last step then, not after a wait for one more unit."""
        put(job, *a, **kw)
        if job is not None:
            queued[0] += 1
            if queued[0] == UNITS:
                put(None)

    monkeypatch.setattr(actor._queue, "put", put_then_end)
    try:
        with ThreadPoolExecutor(IN_FLIGHT) as ex:
            results = list(ex.map(actor.run_unit, units))
        streams, rows_in_place = actor.streams, actor.rows_in_place
        cached = actor._open_store().ledger.cached_markers()
    finally:
        actor.close()   # ends the stream (its thread returns once the queue hands it the end)
        torch.set_num_threads(threads)
    deadline = time.monotonic() + 120
    while live_writers() > base and time.monotonic() < deadline:
        time.sleep(0.1)
    after = live_writers() - base
    assert streams == 1, "the units did not run as one stream; the test shows nothing"
    assert rows_in_place == (n if in_place else 0)

    assert [r.status for r in results] == ["committed"] * UNITS
    assert len(live) == UNITS * CTX_PER_UNIT
    # the bound: the units in flight plus one (a unit finishing its commit while the engine
    # already captures the next two); before the fix this grew to every unit of the stream
    assert 1 <= max(live) - base <= IN_FLIGHT + 1, f"live writers per context: {live}"
    assert after == 0, f"{after} writers still alive after the stream ended"
    assert cached <= 8, f"the actor's store holds {cached} markers of {UNITS} units"

    back = open_store(url)
    v = back.verify(deep=True)
    assert v.ok and v.committed_units == UNITS, v
    tok = tokens_of(0, n)
    want = rows_of(tok)
    for p, name in enumerate(points):
        got = np.asarray(back.read(name, 0, n)).astype(np.float32)
        assert np.array_equal(got, want[p]), name
    assert np.array_equal(back.read_row_meta_checked(0, n)[0], tok)
    st = back.stats(points)
    for p, name in enumerate(points):
        assert st[name]["count"] == n
        np.testing.assert_allclose(st[name]["mean"], want[p].astype(np.float64).mean(0),
                                   rtol=1e-12)


def test_statistics_partials_stay_bounded_over_a_unit_of_many_shards(tmp_path, monkeypatch):
    """A unit's float64 partials do not grow with its shard count: each shard's partials merge
    into the unit's running total once its uploads finish (same bits, in shard order), and a
    committed writer keeps none. Counted as live `Moments` objects (count, mean[W], m2[W]): each
    leaves a weak reference as it is built (the objects gc's list holds, without a scan per
    shard; a dataclass with eq is unhashable, so a list, not a WeakSet)."""
    import weakref

    from harvest.store.stats import moments as stats_mod

    built: list[weakref.ref] = []
    init = stats_mod.Moments.__init__

    def registering_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(weakref.ref(self))

    monkeypatch.setattr(stats_mod.Moments, "__init__", registering_init)

    shards = 40
    n = shards * SHARD
    url = str(tmp_path / "s.zarr")
    points = [f"resid_post.{p}" for p in range(P)]
    s = create_store(url, points=points, width=W, n_rows=n, shard_rows=SHARD, chunk_rows=16,
                     context_size=C)
    s.ledger.write_plan([{"unit_id": 0, "row_start": 0, "row_end": n}])
    tok = tokens_of(0, n)
    rows = rows_of(tok).astype(s.np_dtype)

    def live() -> int:
        return sum(1 for r in built if type(r()) is stats_mod.Moments)

    base = live()
    w = s.region_writer(0, 0, n)
    w.write_meta(0, tok, np.arange(n) // 50, np.arange(n) % C)
    seen = []
    for a in range(0, n, SHARD):
        w.write(a, rows[:, a:a + SHARD])
        seen.append(live() - base)
    w.commit()
    after = live() - base
    del w
    # a running total (2 subsets x P) plus the shards whose uploads are in flight; before the
    # fix every finished shard's partials stayed until commit (2 x P more per shard)
    assert 0 < max(seen) <= 2 * P * 6, seen  # 0: the count saw nothing
    assert after == 0, f"{after} Moments held by a committed writer"
    st = open_store(url).stats(points)
    for p, name in enumerate(points):
        np.testing.assert_allclose(st[name]["mean"], rows[p].astype(np.float64).mean(0),
                                   rtol=1e-12)


@pytest.mark.parametrize("fault", ["raise", "drop"])
def test_units_in_flight_fail_with_the_stream_and_nothing_stays_alive(tmp_path, monkeypatch,
                                                                     fault):
    """An engine that dies (or loses a request) fails exactly the units it had taken, later
    units go on in a new stream, and no failed unit's writer outlives it."""
    import torch

    import harvest.pipeline.actor.capture as actor_mod
    import harvest.pipeline.data.unit_rows as rows_mod

    url, points, units = _planned_store(tmp_path, 6)
    monkeypatch.setattr(rows_mod, "unit_rows", _unit_rows)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HARVEST_CODEC_THREADS", "2")
    monkeypatch.delenv("HARVEST_LOG_DIR", raising=False)
    threads = torch.get_num_threads()
    track_writers(monkeypatch)
    gc.collect()
    base = live_writers()
    # request 5: the second context of the second unit queued, once every context of the first
    # came back (it must commit: it is no longer in flight) and before a third is taken
    monkeypatch.setattr(actor_mod, "STREAM_GAP_WAIT", 3.0)
    monkeypatch.setattr(actor_mod, "STREAM_START_WAIT", 3.0)
    actor = actor_mod.HarvestActor(_spec(url, points, fault=(fault, 5)))
    try:
        with ThreadPoolExecutor(IN_FLIGHT) as ex:
            futs = {u.unit_id: ex.submit(actor.run_unit, u) for u in units}
        outcome = {u: (str(f.exception()) if f.exception() else f.result().status)
                   for u, f in futs.items()}
        del futs  # a failed future's exception holds run_unit's frame, and so its writer
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the stream ends STREAM_GAP_WAIT after its last unit
            gc.collect()  # a failed unit's exception and its frames form a cycle
            if live_writers() == base:
                break
            time.sleep(0.2)
        left = live_writers() - base  # with the engine thread still waiting for the next unit
    finally:
        actor.close()
        torch.set_num_threads(threads)
    want_error = "the engine died" if fault == "raise" else "the engine returned 3 of 4 contexts"
    # the second unit queued (0 or 1: two threads race to queue them) fails, nothing else
    failed = [u for u, o in outcome.items() if o != "committed"]
    assert len(failed) == 1 and failed[0] in (0, 1), outcome
    assert outcome[failed[0]].endswith(want_error), outcome
    assert left == 0, f"{left} writers alive after the stream ended"
    v = open_store(url).verify()
    assert v.committed_units == len(units) - 1, v
