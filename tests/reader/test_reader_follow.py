"""Follow mode on a store written unit by unit through the store API (no pipeline, no Ray).

Each commit waits until the follower has looked at the store since the previous one
(tests/support/live_store.py), so the follower meets every intermediate state on any machine.
The reference is the data the test wrote: rows recounted, bytes compared.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from harvest.store.read.adapters import on_device, saelens_data_provider
from harvest.store.read.dataset import ActivationDataset
from harvest.store.commit.runstate import FollowTimeout, RunEndedUnfinished, RunLeaseStale, run_state
from tests.support.live_store import LiveStore, host_boot, lease_record

pytestmark = pytest.mark.filterwarnings("ignore:shuffle_buffer_rows=")

OPTS = dict(batch_size=32, shuffle_buffer_rows=128, follow=True, follow_poll=0.005, return_meta=True)


def follower(live: LiveStore, **kw) -> ActivationDataset:
    return ActivationDataset(live.url, "resid_post.0", **{**OPTS, **kw})


def collect(batches) -> tuple[np.ndarray, np.ndarray]:
    rows, acts = [], []
    for b in batches:
        rows.append(b["row"].numpy())
        acts.append(b["acts"].view(torch.int16).numpy())
    if not rows:
        return np.empty(0, np.int64), np.empty((0, 0), np.int16)
    return np.concatenate(rows), np.concatenate(acts)


def check_rows_bytes(live: LiveStore, rows: np.ndarray, acts: np.ndarray) -> None:
    """Each row's bytes are the ones written for that row."""
    want = live.data[0][rows].view(np.int16)
    assert np.array_equal(acts, want)


def test_follower_yields_each_committed_row_once_as_units_commit_and_ends_at_finalize(tmp_path):
    live = LiveStore(tmp_path / "s", n_units=12)
    ds = follower(live)
    # units commit out of order, planned a few at a time (the plan grows as a streamed run's does)
    t = live.run_paced(ds, [1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10], plan_every=3)
    committed_at_first = None
    rows, acts = [], []
    for b in ds:
        if committed_at_first is None:
            committed_at_first = live.committed
        rows.append(b["row"].numpy())
        acts.append(b["acts"].view(torch.int16).numpy())
    t.join()
    assert live.error is None
    rows_a, acts_a = np.concatenate(rows), np.concatenate(acts)
    assert np.array_equal(np.sort(rows_a), np.arange(live.n))        # every row, once
    check_rows_bytes(live, rows_a, acts_a)
    # it streamed: the first batch came while most units were still to commit (a window is 2
    # units, decoding runs one window ahead; each commit waits for a poll)
    assert committed_at_first is not None and committed_at_first <= 5
    assert run_state(live.st).finalized
    # the same rows, in the same order, as a follower of the finished store (order is the plan's)
    again = collect(follower(live))
    assert np.array_equal(again[0], rows_a) and np.array_equal(again[1], acts_a)
    # mixing: a batch draws from both units of its window
    first = rows_a[:32] // live.shard_rows
    assert len(set(first.tolist())) == 2


def test_ddp_ranks_split_units_disjoint_covering_and_equal(tmp_path):
    live = LiveStore(tmp_path / "s", n_units=10)
    live.plan(range(10), final=True)
    for u in range(10):
        live.commit(u)
    live.finish()
    world = 3
    per = [collect(follower(live, rank=r, world_size=world)) for r in range(world)]
    # units 0,3,6,9 | 1,4,7 | 2,5,8: 256 vs 192 rows; the two short ranks repeat 64 of theirs
    assert [len(r) for r, _ in per] == [256, 256, 256]
    distinct = [np.unique(r) for r, _ in per]
    for r, d in enumerate(distinct):
        assert np.array_equal(d, live.rows_of([u for u in range(10) if u % world == r]))
        check_rows_bytes(live, *per[r])
    assert np.array_equal(np.sort(np.concatenate(distinct)), np.arange(live.n))   # disjoint, covering
    assert [len(r) - len(d) for (r, _), d in zip(per, distinct)] == [0, 64, 64]


def test_wait_deadline_names_the_run_state(tmp_path):
    live = LiveStore(tmp_path / "s", n_units=4)
    live.plan(range(4), final=True)
    live.commit(0)
    ds = follower(live, follow_timeout=0.2)
    with pytest.raises(FollowTimeout) as e:
        list(ds)
    msg = str(e.value)
    assert "follow_timeout=0.2" in msg and "unit #1" in msg
    assert f"driver pid {lease_record()['pid']} on elsewhere" in msg
    assert "1 of 4 planned units committed" in msg and "plan final" in msg


def test_run_ended_unfinished_raises_after_the_committed_rows(tmp_path):
    live = LiveStore(tmp_path / "s", n_units=6)
    live.plan(range(6), final=True)
    for u in range(4):
        live.commit(u)
    live.write_lease(lease_record(released=True))   # the driver released without finalizing
    got: list = []
    with pytest.raises(RunEndedUnfinished, match="ended without finalizing.*4 of 6 planned"):
        for b in follower(live):
            got.append(b["row"].numpy())
    rows = np.concatenate(got)
    assert set(rows.tolist()) <= set(live.rows_of(range(4)).tolist()) and len(np.unique(rows)) == len(rows)


@pytest.mark.parametrize("how", ["old heartbeat", "holder process gone"])
def test_stale_lease_raises(tmp_path, how):
    live = LiveStore(tmp_path / "s", n_units=4)
    live.plan(range(4), final=True)
    if how == "old heartbeat":
        live.write_lease(lease_record(heartbeat=0.0))
    else:   # a driver on this machine killed by SIGKILL: its pid is gone, the heartbeat fresh
        p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
        host, boot = host_boot()
        live.write_lease(lease_record(pid=int(p.stdout), host=host, boot=boot, start="1"))
    with pytest.raises(RunLeaseStale, match="not heard from"):
        list(follower(live))


def test_resumed_follower_yields_exactly_the_rows_not_yet_yielded(tmp_path):
    live = LiveStore(tmp_path / "s", n_units=12)
    ds = follower(live)
    t = live.run_paced(ds, list(range(12)))
    it = iter(ds)
    head = [next(it) for _ in range(5)]     # 160 rows: into the third window
    state = ds.state_dict()
    it.close()
    live.unpaced.set()      # nobody polls the first follower any more
    t.join()
    assert live.error is None and state["batches"] == 5 and state["follow"] is True
    resumed = follower(live)
    resumed.load_state_dict(state)
    rows = np.concatenate([b["row"].numpy() for b in head] + [collect(resumed)[0]])
    full = collect(follower(live))[0]
    assert np.array_equal(rows, full)
    # a state of the other mode is refused
    with pytest.raises(ValueError, match="follow"):
        ActivationDataset(live.url, "resid_post.0", batch_size=32, shuffle_buffer_rows=128).load_state_dict(state)


def test_adapters_take_a_follower(tmp_path):
    live = LiveStore(tmp_path / "s", n_units=4)
    live.plan(range(4), final=True)
    for u in range(4):
        live.commit(u)
    live.finish()
    ds = follower(live, return_meta=False)
    xs = list(saelens_data_provider(ds, steps=3))   # no epoch-length check: the run decides
    assert sum(x.shape[0] for x in xs) == live.n and xs[0].dtype == torch.float32
    assert sum(x.shape[0] for x in on_device(follower(live, return_meta=False, steps=3))) == 96


def test_follow_options_are_checked():
    from harvest.store.read.config import ReaderConfig

    with pytest.raises(ValueError, match="endless"):
        ReaderConfig(follow=True, endless=True)
    with pytest.raises(ValueError, match="max_norm_ratio"):
        ReaderConfig(follow=True, max_norm_ratio=3.0)
    with pytest.raises(ValueError, match="follow_timeout"):
        ReaderConfig(follow=True, follow_timeout=0)


def test_a_read_racing_the_writer_s_publish_finds_the_moved_copy(tmp_path):
    """Publishing moves a committed attempt's object to its zarr key; a reader that looked at the
    zarr key just before the move and at the attempt's key just after must still get the rows."""
    from harvest.store import open_store
    from harvest.store.commit.objects import point_keys, read_point
    from tests.support.reader_stores import unpublish

    live = LiveStore(tmp_path / "s", n_units=2)
    live.plan(range(2), final=True)
    live.commit(1)
    assert unpublish(live.st, [1]) > 0          # the state between a commit and its publish
    st = open_store(live.url)
    m = st.ledger.commit_manifest(1)
    pub, att = point_keys("resid_post.0", 1, m.attempt)
    loc, real_read = st.location, st.location.read_bytes
    moved = []

    def read_bytes(key, *a, **kw):
        got = real_read(key, *a, **kw)
        if key == pub and not moved:          # the writer publishes right after this read
            moved.append(loc.move(att, pub))
        return got

    loc.read_bytes = read_bytes
    x = read_point(st, m, 1, 0)
    assert moved == [True]
    assert np.array_equal(x.view(np.int16), live.data[0][64:128].view(np.int16))


def test_dataloader_workers_split_units_and_end_equal(tmp_path):
    live = LiveStore(tmp_path / "s", n_units=9)
    live.plan(range(9), final=True)
    for u in range(9):
        live.commit(u)
    live.finish()
    ds = follower(live)
    got = [b["row"].numpy() for b in ds.loader(num_workers=2)]
    rows = np.concatenate(got)
    # lanes: units 0,2,4,6,8 and 1,3,5,7 (+64 of its own rows repeated): equal batch counts
    assert len(rows) == 10 * 64 and np.array_equal(np.unique(rows), np.arange(live.n))
    assert len(got) == 20 and all(len(r) == 32 for r in got)
