"""Batches gathered ahead into recycled buffers: a kept batch is never overwritten, a dropped
one's buffer comes back, and closing early leaves the next iteration exact (issue 22 speed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.store.read.feed.batching import BatchBuffers
from harvest.store.read.dataset import ActivationDataset
from tests.support.reader_stores import committed_rows, make_store

W, SHARD, N = 16, 512, 6144


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("b") / "b.zarr", N, SHARD, W, ["resid_post.0", "resid_post.1"],
                      context=100, seed=4)


def _bits(t):
    return t.view(torch.int16).numpy().view(np.uint16)


def _ds(s, **kw):
    return ActivationDataset(s, **{"batch_size": 96, "seed": 2, "return_meta": True,
                                   "shuffle_buffer_rows": 4 * SHARD, **kw})


def _check(b, data):
    rows = b["row"].numpy()
    assert np.array_equal(_bits(b["acts"]), data.view(np.uint16)[:, rows].transpose(1, 0, 2))
    return rows


def test_kept_batches_stay_intact_while_later_ones_are_gathered(built):
    """list(dataset) holds every batch: no buffer may be reused under it (compared at the end,
    after every later gather ran, against the store's rows recounted from the written data)."""
    s, data = built[0], built[1]
    got = list(_ds(s))
    assert len(got) > 3 * 6      # many more batches than the pool keeps
    rows = np.concatenate([_check(b, data) for b in got])
    assert np.array_equal(np.sort(rows), committed_rows(s))
    assert len({b["acts"].data_ptr() for b in got}) == len(got)   # none shares memory with another


def test_dropped_batches_give_their_buffers_back(built):
    s, data = built[0], built[1]
    ds = _ds(s)
    seen = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        for b in ds:
            seen.append(_check(b, data))   # compared while current, then dropped
            del b
    assert np.array_equal(np.sort(np.concatenate(seen[:len(seen) // 2])), committed_rows(s))
    # 2 epochs of ~64 batches each, from a pool of at most `keep` recycled arrays (plus the
    # partial batches at window ends, which are assembled apart)
    assert ds._batch_bufs.allocated <= ds._batch_bufs.keep


def test_closing_early_then_a_full_epoch_is_exact(built):
    """Gathers queued ahead are waited for when the iterator closes, so none writes into a
    buffer or reads an arena the next iteration uses."""
    s, data = built[0], built[1]
    ds = _ds(s, normalize=None)
    it = iter(ds)
    first = [next(it) for _ in range(3)]
    it.close()
    rows = np.concatenate([_check(b, data) for b in ds])
    assert np.array_equal(np.sort(rows), committed_rows(s))
    for b in first:
        _check(b, data)


def test_steps_limit_with_gathers_ahead(built):
    s, data = built[0], built[1]
    got = list(_ds(s, steps=5))
    assert len(got) == 5 and all(b["acts"].shape[0] == 96 for b in got)
    for b in got:
        _check(b, data)


def test_buffer_pool_reuses_only_unreferenced_arrays():
    pool = BatchBuffers((4, 2), np.dtype(np.uint16), keep=2)
    a = pool.get()
    held = a.ctypes.data
    t = torch.from_numpy(a.view(np.int16)[1:])   # a tensor over a view keeps `a` busy
    del a
    b = pool.get()
    assert b.ctypes.data != held and pool.allocated == 2
    del t, b
    pool.get()
    assert pool.allocated == 2        # both free again: one of them came back


@pytest.mark.parametrize("points", ["resid_post.1", None], ids=["2-D", "3-D"])
def test_two_workers_recycled_batches_hold_the_right_rows(built, points):
    """Workers recycle a buffer once the pickler has copied its batch out to the parent: every
    batch the parent holds is still the rows it names (all kept to the end, then compared)."""
    s, data = built[0], built[1]
    ds = _ds(s, points=points, shuffle_buffer_rows=12 * SHARD)
    got = list(ds.loader(2))
    rows = np.concatenate([b["row"].numpy() for b in got])
    assert np.array_equal(np.sort(rows), committed_rows(s))
    want = data.view(np.uint16)[:, rows].transpose(1, 0, 2)
    acts = np.concatenate([_bits(b["acts"]) for b in got])
    assert np.array_equal(acts, want[:, 1] if points else want)
