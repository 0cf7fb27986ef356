"""Ranks x workers get equal rows, persistent workers reshuffle, resume yields exactly the rest."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from harvest.store.read.dataset import ActivationDataset
from tests.support.reader_stores import BOS, committed_rows, make_store

W, SHARD, C = 8, 256, 64
N7 = 7 * SHARD - 100   # 7 shards, the last one partial


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("s7") / "s.zarr", N7, SHARD, W, context=C, seed=3)


def _loader(ds, nw, **kw):
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=nw, **kw)


def _epoch(ds, nw, **kw):
    """Rows of one epoch, and rows per worker (DataLoader hands batches out round-robin)."""
    batches = [b["row"].numpy() for b in _loader(ds, nw, **kw)]
    per_worker = [np.concatenate(batches[w::max(1, nw)]) if batches[w::max(1, nw)] else np.empty(0, int)
                  for w in range(max(1, nw))]
    return np.concatenate(batches) if batches else np.empty(0, int), per_worker


@pytest.mark.parametrize("exclude", [(), (BOS,)], ids=["all-rows", "bos-excluded"])
@pytest.mark.parametrize("buffer", [8 * SHARD, 2 * SHARD], ids=["one-window", "streaming"])
def test_two_ranks_two_workers_on_seven_shards_get_equal_rows_each_once(seven, exclude, buffer):
    """Every rank and worker yields floor(N/4) rows; together every kept row once but N mod 4."""
    s, _, tok, _, _ = seven
    kept = committed_rows(s)
    kept = kept[~np.isin(tok[kept], exclude)]
    got, sizes = [], []
    for rank in range(2):
        ds = ActivationDataset(s, batch_size=100, rank=rank, world_size=2, seed=7, return_meta=True,
                               exclude_token_ids=exclude, shuffle_buffer_rows=buffer)
        rows, per_worker = _epoch(ds, 2)
        sizes += [len(r) for r in per_worker]
        got.append(rows)
        assert ds.rows_per_worker(2) == len(kept) // 4
    assert sizes == [len(kept) // 4] * 4, sizes
    allrows = np.concatenate(got)
    assert len(np.unique(allrows)) == len(allrows)           # no row twice
    assert np.isin(allrows, kept).all()                      # only kept, committed rows
    assert len(kept) - len(allrows) == len(kept) % 4         # the documented drop, nothing else


def test_dropped_rows_change_with_the_epoch(seven):
    s = seven[0]
    missing = []
    for epoch in (0, 1):
        seen = []
        for rank in range(2):
            ds = ActivationDataset(s, batch_size=128, rank=rank, world_size=2, seed=1, return_meta=True)
            ds.set_epoch(epoch)
            seen.append(_epoch(ds, 0)[0])
        missing.append(np.setdiff1d(committed_rows(s), np.concatenate(seen)))
    assert len(missing[0]) == len(missing[1]) == len(committed_rows(s)) % 2
    if len(missing[0]):
        assert not np.array_equal(missing[0], missing[1])


def test_persistent_workers_get_a_new_order_every_epoch(seven):
    s = seven[0]
    ds = ActivationDataset(s, batch_size=128, seed=2, return_meta=True, shuffle_buffer_rows=8 * SHARD)
    dl = _loader(ds, 2, persistent_workers=True)
    orders = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        orders.append(np.concatenate([b["row"].numpy() for b in dl]))
    for o in orders:
        assert np.array_equal(np.sort(o), np.sort(orders[0]))
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    fresh = ActivationDataset(s, batch_size=128, seed=2, return_meta=True, shuffle_buffer_rows=8 * SHARD)
    fresh.set_epoch(2)
    assert np.array_equal(np.concatenate([b["row"].numpy() for b in _loader(fresh, 2)]), orders[2])


def _ds(s, **kw):
    return ActivationDataset(s, batch_size=100, seed=4, return_meta=True, shuffle_buffer_rows=2 * SHARD,
                             exclude_token_ids=[BOS], **kw)


@pytest.mark.parametrize("shuffle", [True, "global"], ids=["window", "global"])
@pytest.mark.parametrize("nw", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_rows_not_yet_seen(seven, nw, shuffle):
    s = seven[0]
    ds = _ds(s, shuffle=shuffle)
    ds.set_epoch(1)
    full = np.concatenate([b["row"].numpy() for b in ds.loader(nw)])
    ds = _ds(s, shuffle=shuffle)
    ds.set_epoch(1)
    dl = ds.loader(nw)
    first = []
    for i, b in enumerate(dl):
        first.append(b["row"].numpy())
        if i == 6:
            break
    state = dl.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 7
    again = _ds(s, shuffle=shuffle)
    dl2 = again.loader(nw)
    dl2.load_state_dict(state)
    rest = np.concatenate([b["row"].numpy() for b in dl2])
    seen = np.concatenate(first)
    assert len(np.intersect1d(seen, rest)) == 0
    assert np.array_equal(np.concatenate([seen, rest]), full)    # workers too: lanes (sampling.lane)


def test_resume_refuses_other_settings(seven):
    s = seven[0]
    state = _ds(s).state_dict(batches=3)
    with pytest.raises(ValueError, match="batch_size=100"):
        ActivationDataset(s, batch_size=64, seed=4, exclude_token_ids=[BOS],
                          shuffle_buffer_rows=2 * SHARD).load_state_dict(state)
    with pytest.raises(ValueError, match="num_workers=0"):
        _ds(s).loader(2).load_state_dict(state)


def test_endless_steps_run_on_through_epochs_each_row_once_per_epoch(seven):
    s = seven[0]
    n = len(_epoch(_ds(s), 0)[0])            # kept rows per epoch
    steps = 2 * n // 100 + 3                 # a little over two epochs of 100-row batches
    ds = _ds(s, steps=steps)
    batches = [b["row"].numpy() for b in ds]
    assert len(batches) == steps and all(len(b) == 100 for b in batches)   # no short batch at epoch ends
    stream = np.concatenate(batches)
    # batches inside epoch 0 never repeat a row; the batch that straddles an epoch boundary mixes
    # the end of one epoch with the start of the next, so count over whole batches
    head = stream[: n // 100 * 100]
    assert len(np.unique(head)) == len(head)
    two = stream[: 2 * n // 100 * 100]
    counts = np.bincount(two, minlength=s.n_rows)[np.unique(stream)]
    assert counts.min() == 1 and counts.max() == 2 and (counts == 2).sum() == len(two) - n
    assert not np.array_equal(np.argsort(stream[:n]), np.argsort(stream[n:2 * n]))
    # the same stream with two workers: steps counts per rank, spread over the workers
    assert sum(1 for _ in _loader(_ds(s, steps=steps), 2)) == steps
    # and resuming an endless stream after 20 batches (inside epoch 1) continues it exactly
    again = _ds(s, steps=steps)
    again.load_state_dict(ds.state_dict(batches=20))
    assert np.array_equal(np.concatenate([b["row"].numpy() for b in again]), stream[20 * 100:])


def test_norm_filter_pads_to_equal_counts_over_ranks(tmp_path):
    """Rows over the norm limit are known only once read: each worker repeats as many of its own
    rows as it dropped, so ranks still yield equal counts."""
    n = 6 * SHARD
    x = np.random.default_rng(0).normal(size=(1, n, W)).astype(np.float32)
    sinks = np.arange(5, n, 97)
    x[0, sinks] *= 50
    s = make_store(tmp_path / "n.zarr", n, SHARD, W, data=x.astype(ml_dtypes.bfloat16), seed=5)[0]
    sizes, seen = [], []
    for rank in range(2):
        ds = ActivationDataset(s, batch_size=128, rank=rank, world_size=2, seed=1, return_meta=True,
                               max_norm_ratio=5, shuffle_buffer_rows=2 * SHARD)
        rows = np.concatenate([b["row"].numpy() for b in ds])
        sizes.append(len(rows))
        seen.append(rows)
        assert not np.isin(rows, sinks).any()
        assert ds.tally.padded == len(rows) - len(np.unique(rows)) > 0
    assert sizes[0] == sizes[1] == n // 2
    assert set(np.concatenate(seen)) == set(np.setdiff1d(np.arange(n), sinks))


# ---- shuffle="global" (permute.py): one keyed permutation of every kept row per epoch -----------

def test_global_shuffle_is_a_permutation_of_the_kept_rows_each_epoch(seven):
    """Each kept row exactly once per epoch, a different order each epoch, every block read
    from the shards that hold its rows (so more than once per epoch: its documented cost)."""
    s, data, tok = seven[0], seven[1], seven[2]
    kept = committed_rows(s)
    kept = kept[tok[kept] != BOS]
    orders = []
    for epoch in (0, 1):
        ds = _ds(s, shuffle="global")
        ds.set_epoch(epoch)
        got = list(ds)
        for b in got[:3]:
            assert np.array_equal(b["acts"].float().numpy(), data[0, b["row"].numpy()].astype(np.float32))
        orders.append(np.concatenate([b["row"].numpy() for b in got]))
        assert np.array_equal(np.sort(orders[-1]), kept)
        assert sum(ds.decoded_rows) > len(kept)      # blocks of 2 shards' rows over 7 shards
    assert not np.array_equal(orders[0], orders[1])
    # not the window shuffle's order, and not grouped: rows of a batch come from many shards
    assert len(np.unique(orders[0][:100] // SHARD)) >= 5


def test_global_shuffle_two_ranks_two_workers_equal_disjoint(seven):
    s, tok = seven[0], seven[2]
    kept = committed_rows(s)
    kept = kept[tok[kept] != BOS]
    got, sizes = [], []
    for rank in range(2):
        ds = _ds(s, shuffle="global", rank=rank, world_size=2)
        rows, per_worker = _epoch(ds, 2)
        sizes += [len(r) for r in per_worker]
        got.append(rows)
    assert sizes == [len(kept) // 4] * 4, sizes
    allrows = np.concatenate(got)
    assert len(np.unique(allrows)) == len(allrows) and np.isin(allrows, kept).all()
    assert len(kept) - len(allrows) == len(kept) % 4


def test_global_endless_resume_continues_the_stream(seven):
    s = seven[0]
    n = len(_epoch(_ds(s, shuffle="global"), 0)[0])
    steps = 2 * n // 100 + 3
    stream = np.concatenate([b["row"].numpy() for b in _ds(s, shuffle="global", steps=steps)])
    assert len(stream) == steps * 100
    head = stream[: n // 100 * 100]                  # the batch straddling the epochs mixes two
    assert len(np.unique(head)) == len(head)
    again = _ds(s, shuffle="global", steps=steps)
    again.load_state_dict(_ds(s, shuffle="global", steps=steps).state_dict(batches=20))
    assert np.array_equal(np.concatenate([b["row"].numpy() for b in again]), stream[20 * 100:])
    with pytest.raises(ValueError, match="shuffle='global'"):
        _ds(s, shuffle="global", max_norm_ratio=5)
