"""The SAE-training reader: exactly once across ranks x workers, seeded shuffles, filters, stats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.store import create_store
from pipeline.store import synthetic
from pipeline.store.reader import ActivationDataset

P, W, N, SHARD = 2, 16, 5000, 512   # 10 shards, the last one partial (392 rows)
BOS = 1


def _tok(n):
    t = (np.arange(n) * 31 % 997 + 2).astype(np.int32)
    t[::100] = BOS  # a BOS at the start of every 100-token context
    return t


@pytest.fixture(scope="module")
def data():
    return synthetic.activations((P, N, W), seed=11)


@pytest.fixture(scope="module")
def store(tmp_path_factory, data):
    s = create_store(str(tmp_path_factory.mktemp("r") / "r.zarr"), points=["resid_post.0", "resid_post.1"],
                     width=W, n_rows=N, shard_rows=SHARD, chunk_rows=128)
    s.write_plan(s.default_plan(1))
    plan = s.plan()
    uncommitted = {3, 7}
    synthetic.fill(s, data, units=[u for u in plan if u["unit_id"] not in uncommitted],
                   token_id=_tok(N), doc_id=np.arange(N) // 100, position=np.arange(N) % 100)
    for uid in uncommitted:  # written but never committed: must never be read
        w = s.region_writer(uid, plan[uid]["row_start"], plan[uid]["row_end"])
        w.write(plan[uid]["row_start"], data[:, plan[uid]["row_start"]:plan[uid]["row_end"]])
        w.abort()
    s.committed_rows = np.concatenate([np.arange(u["row_start"], u["row_end"]) for u in plan
                                       if u["unit_id"] not in uncommitted])
    return s


def _rows(ds, num_workers=0):
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    batches = list(dl)
    return batches, np.concatenate([b["row"].numpy() for b in batches])


def test_every_committed_row_exactly_once_across_ranks_and_workers(store, data):
    seen = []
    for rank in range(2):
        ds = ActivationDataset(store, batch_size=300, rank=rank, world_size=2, seed=5, return_meta=True,
                               shuffle_buffer_rows=1200)
        batches, rows = _rows(ds, num_workers=2)
        for b in batches:
            assert b["acts"].shape[1:] == (P, W) and b["acts"].dtype == torch.bfloat16
            assert b["acts"].shape[0] <= 300
            r = b["row"].numpy()
            got = b["acts"].view(torch.int16).numpy().view(np.uint16)
            want = np.stack([data[p][r] for p in range(P)], axis=1).view(np.uint16)
            assert np.array_equal(got, want)  # each row carries its own activations
            assert np.array_equal(b["token_id"].numpy(), _tok(N)[r])
            assert np.array_equal(b["position"].numpy(), r % 100)
        seen.append(rows)
    all_rows = np.concatenate(seen)
    assert len(all_rows) == len(store.committed_rows)
    assert np.array_equal(np.sort(all_rows), store.committed_rows)  # exactly once, none uncommitted
    assert set(seen[0]).isdisjoint(seen[1])


def test_seed_reproduces_and_epochs_reshuffle(store):
    def order(seed, epoch=0, **kw):
        ds = ActivationDataset(store, batch_size=256, seed=seed, return_meta=True, shuffle_buffer_rows=1000, **kw)
        ds.set_epoch(epoch)
        return _rows(ds)[1]

    a, b = order(1), order(1)
    assert np.array_equal(a, b)
    c, d = order(2), order(1, epoch=1)
    assert not np.array_equal(a, c) and not np.array_equal(a, d)
    for o in (a, c, d):
        assert np.array_equal(np.sort(o), store.committed_rows)
    # a batch is a uniform draw from the whole buffer: with 4 shards buffered, from all 4 of them
    ds = ActivationDataset(store, batch_size=256, seed=1, return_meta=True, shuffle_buffer_rows=4 * SHARD)
    first = next(iter(ds))["row"].numpy()
    assert len(np.unique(first // SHARD)) == 4
    seq = order(0, shuffle=False)
    assert np.array_equal(seq, store.committed_rows)


def test_epochs_reuse_piece_buffers_and_stay_exact(store, data):
    """Epoch 2 decodes into epoch 1's piece buffers (fresh memory is slow), with identical rows."""
    import pickle

    ds = ActivationDataset(store, batch_size=256, seed=3, return_meta=True, shuffle_buffer_rows=1000)
    kept = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        rows, acts = [], []
        for b in ds:
            rows.append(b["row"].numpy())
            acts.append(b["acts"].view(torch.int16).numpy().view(np.uint16))
        rows, acts = np.concatenate(rows), np.concatenate(acts)
        assert np.array_equal(np.sort(rows), store.committed_rows)
        assert np.array_equal(acts, data.view(np.uint16)[:, rows].transpose(1, 0, 2))
        kept.append(list(ds._buffers._free))  # references, so no id can be reused meanwhile
    assert kept[0] and {id(b) for b in kept[1]} == {id(b) for b in kept[0]}
    clone = pickle.loads(pickle.dumps(ds))  # spawn-started DataLoader workers get a pickled copy
    assert clone._buffers is None and clone._store is None
    assert np.array_equal(np.sort(_rows(clone)[1]), store.committed_rows)


def test_exclude_bos_and_single_point_batches(store, data):
    ds = ActivationDataset(store, points="resid_post.1", batch_size=400, exclude_token_ids=[BOS], seed=3,
                           return_meta=True)
    batches, rows = _rows(ds)
    assert all(b["acts"].shape[1:] == (W,) for b in batches)
    assert (_tok(N)[rows] != BOS).all()
    expect = store.committed_rows[_tok(N)[store.committed_rows] != BOS]
    assert np.array_equal(np.sort(rows), expect)
    b = batches[0]
    assert np.array_equal(b["acts"].view(torch.int16).numpy().view(np.uint16),
                          data[1][b["row"].numpy()].view(np.uint16))
    plain = list(ActivationDataset(store, points="resid_post.1", batch_size=400, drop_last=True))
    assert all(isinstance(t, torch.Tensor) and t.shape == (400, W) for t in plain)


def test_normalisation_from_stored_stats(store, data):
    rows = store.committed_rows
    x = data[:, rows].astype(np.float32).astype(np.float64)  # [P, n, W]
    st = store.stats()
    ds = ActivationDataset(store, batch_size=1000, normalize="standardize", seed=0)
    out = torch.cat(list(ds)).double().numpy()  # [n, P, W]
    assert out.dtype == np.float64 and out.shape == (len(rows), P, W)
    np.testing.assert_allclose(out.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(out.std(0), 1, rtol=1e-3)
    ds = ActivationDataset(store, points="resid_post.0", batch_size=1000, normalize="norm_scale")
    out = torch.cat(list(ds)).double().numpy()
    np.testing.assert_allclose((out * out).sum(1).mean(), W, rtol=1e-4)
    scale = np.sqrt(W / st["resid_post.0"]["mean_sq_norm"])
    np.testing.assert_allclose(np.sort(out[:, 0]), np.sort(x[0][:, 0] * scale), rtol=1e-5)


def test_reader_argument_errors(store):
    with pytest.raises(ValueError, match="'resid_post.9' is not in the store"):
        ActivationDataset(store, points=["resid_post.9"])
    with pytest.raises(ValueError, match="normalize='zscore'"):
        ActivationDataset(store, normalize="zscore")
    with pytest.raises(ValueError, match="rank=2 must satisfy"):
        ActivationDataset(store, rank=2, world_size=2)
    with pytest.raises(ValueError, match="shuffle_buffer_rows=10 must be >= batch_size=100"):
        ActivationDataset(store, batch_size=100, shuffle_buffer_rows=10)


def test_reads_from_s3_with_prefetch(seaweedfs, s3_url):
    x = synthetic.activations((1, 3000, 32), seed=12)
    s = create_store(s3_url, points=["resid_post.4"], width=32, n_rows=3000, shard_rows=512, chunk_rows=128,
                     storage_options=seaweedfs.storage_options)
    s.write_plan(s.default_plan(2))
    synthetic.fill(s, x, token_id=np.arange(3000, dtype=np.int32))
    ds = ActivationDataset(s3_url, storage_options=seaweedfs.storage_options, batch_size=256,
                           prefetch_shards=3, return_meta=True, seed=9)
    batches, rows = _rows(ds, num_workers=2)
    assert np.array_equal(np.sort(rows), np.arange(3000))
    for b in batches:
        assert np.array_equal(b["acts"].view(torch.int16).numpy().view(np.uint16),
                              x[0][b["row"].numpy()].view(np.uint16))
