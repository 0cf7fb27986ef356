"""The `logprob` / `entropy` row columns (FORMAT.md "The model's next-token scores"): float32
metadata written after the capture (`write_scores`), committed with the unit, checked by verify,
read back row for row by the training reader's return_meta batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.store import create_store

C = 16


def _store(tmp_path, name="s.zarr", **kw):
    st = create_store(str(tmp_path / name), points=["resid_post.0"], width=4, n_rows=128,
                      shard_rows=128, context_size=C, dtype="float32", **kw)
    st.ledger.write_plan(st.ledger.default_plan(1))
    return st


def _scores(n):
    rng = np.random.default_rng(0)
    lp = -rng.exponential(3.0, n).astype(np.float32)
    lp[C - 1::C] = np.nan    # each context's last position has no next token
    return lp, rng.uniform(0, 6, n).astype(np.float32)


def test_scores_round_trip_through_commit_verify_and_the_reader(tmp_path):
    from harvest.store.read.dataset import ActivationDataset

    st = _store(tmp_path, logprob=True, entropy=True)
    assert st.meta_columns["logprob"] == "float32" and st.meta_columns["entropy"] == "float32"
    n = st.n_rows
    lp, ent = _scores(n)
    w = st.region_writer(0, 0, n)
    z = np.zeros(n, np.int32)
    w.write_meta(0, z, z.astype(np.int64), np.arange(n, dtype=np.int32) % C)
    w.write_scores(0, logprob=lp[:40], entropy=ent[:40])
    w.write_scores(40, logprob=lp[40:], entropy=ent[40:])
    with pytest.raises(ValueError, match="already written"):
        w.write_scores(0, logprob=lp[:1], entropy=ent[:1])
    w.write(0, np.zeros((1, n, 4), np.float32))
    w.commit()
    st.finalize({"status": "complete"})
    report = st.verify(deep=True)
    assert report.ok, report.errors
    got_lp = st.meta_array("logprob")[:]
    assert got_lp.dtype == np.float32
    assert np.array_equal(got_lp, lp, equal_nan=True)
    for shuffle in (False, True, "global"):
        batches = list(ActivationDataset(st, "resid_post.0", batch_size=50, shuffle=shuffle,
                                         return_meta=True))
        rows = np.concatenate([b["row"].numpy() for b in batches])
        assert np.array_equal(np.sort(rows), np.arange(n))
        for name, want in (("logprob", lp), ("entropy", ent)):
            assert batches[0][name].dtype == torch.float32
            got = np.concatenate([b[name].numpy() for b in batches])
            assert np.array_equal(got, want[rows], equal_nan=True)


def test_a_unit_without_its_scores_does_not_commit(tmp_path):
    st = _store(tmp_path, logprob=True)
    n = st.n_rows
    w = st.region_writer(0, 0, n)
    z = np.zeros(n, np.int32)
    w.write_meta(0, z, z.astype(np.int64), z)
    with pytest.raises(ValueError, match="score columns"):
        w.write_scores(0, logprob=np.zeros(n, np.float32), entropy=np.zeros(n, np.float32))
    with pytest.raises(ValueError, match="float32"):
        w.write_scores(0, logprob=np.zeros(n, np.float64))
    w.write_scores(0, logprob=np.zeros(n - 1, np.float32))
    w.write(0, np.zeros((1, n, 4), np.float32))
    with pytest.raises(ValueError, match="without their scores"):
        w.commit()
    w.abort()


def test_stores_without_scores_have_no_columns(tmp_path):
    st = _store(tmp_path)
    assert "logprob" not in st.meta_columns and "entropy" not in st.meta_columns


def test_a_shuffled_copy_moves_the_scores_with_their_rows(tmp_path):
    from harvest.store.shuffled_copy import shuffle_store
    from harvest.store import open_store

    st = _store(tmp_path, logprob=True, entropy=True)
    n = st.n_rows
    lp, ent = _scores(n)
    w = st.region_writer(0, 0, n)
    z = np.zeros(n, np.int32)
    w.write_meta(0, z, z.astype(np.int64), z)
    w.write_scores(0, logprob=lp, entropy=ent)
    w.write(0, np.arange(n * 4, dtype=np.float32).reshape(1, n, 4))
    w.commit()
    st.finalize({"status": "complete"})
    shuffle_store(st.url, str(tmp_path / "copy.zarr"), seed=3)
    cp = open_store(str(tmp_path / "copy.zarr"))
    src = np.asarray(cp.meta_array("source_row")[:])
    assert np.array_equal(np.asarray(cp.meta_array("logprob")[:]), lp[src], equal_nan=True)
    assert np.array_equal(np.asarray(cp.meta_array("entropy")[:]), ent[src])
