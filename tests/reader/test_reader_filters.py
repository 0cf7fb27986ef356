"""Filters (tokens, context positions, held-out documents, norm outliers) and the normalisation
constants of exactly the rows yielded, checked against a direct recount over those rows."""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import pytest
import torch

from harvest.store import open_store
from harvest.store.read.dataset import ActivationDataset
from tests.support.reader_stores import BOS, make_store, unpublish

W, SHARD, C, N = 16, 512, 64, 9 * 512


@pytest.fixture(scope="module")
def sinky(tmp_path_factory):
    """BOS rows are attention sinks (norm x300), and so are a few non-BOS rows at positions 1-3."""
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(2, N, W)) * np.exp(rng.normal(size=W)) + rng.normal(size=W)).astype(np.float32)
    x[:, ::C] *= 300
    sinks = np.flatnonzero(np.isin(np.arange(N) % C, [1, 2, 3]))[::7]
    x[:, sinks] *= 100
    attrs = {"special_token_ids": [BOS, 2], "bos_token_id": BOS, "tokenizer": "toy-tokenizer",
             "context_size": C, "stats_filter": {"special_token_ids": [BOS, 2], "skip_positions": 0}}
    s, data, tok, doc, pos = make_store(tmp_path_factory.mktemp("f") / "f.zarr", N, SHARD, W,
                                        ["resid_post.3", "resid_post.7"], context=C, seed=2, attrs=attrs,
                                        data=x.astype(ml_dtypes.bfloat16))
    return s, data, tok, doc, sinks


def _all(ds):
    out = [b for b in ds]
    return torch.cat([b["acts"] for b in out]).double().numpy(), np.concatenate([b["row"].numpy() for b in out])


def _recount(data, rows):
    x = data[:, rows].astype(np.float64)           # [P, n, W]
    return x.mean(1), x.var(1), (x * x).sum(2).mean(1)


def test_store_records_its_tokens_and_exclude_special_uses_them(sinky):
    s, data, tok, doc, sinks = sinky
    ds = ActivationDataset(s, batch_size=256, exclude_special=True, return_meta=True)
    assert ds.special_token_ids == [BOS, 2] and ds.tokenizer == "toy-tokenizer" and ds.context_size == C
    rows = _all(ds)[1]
    # the store's kept rows: special ids out, and the attention-sink positions 0 and 1
    kept = ~np.isin(tok, [BOS, 2]) & (np.arange(N) % C >= 2)
    assert np.array_equal(np.sort(rows), np.flatnonzero(kept))
    # seqpos= given decides the positions alone: the special ids only are dropped
    ds = ActivationDataset(s, batch_size=256, exclude_special=True, seqpos=slice(0, None),
                           return_meta=True)
    assert np.array_equal(np.sort(_all(ds)[1]), np.flatnonzero(~np.isin(tok, [BOS, 2])))


def test_seqpos_keeps_only_the_chosen_context_positions(sinky):
    s = sinky[0]
    for sl in (slice(1, None), slice(4, 40, 3)):
        rows = _all(ActivationDataset(s, batch_size=200, seqpos=sl, return_meta=True))[1]
        keep = np.zeros(C, bool)
        keep[sl] = True
        assert np.array_equal(np.sort(rows), np.flatnonzero(keep[np.arange(N) % C]))


def test_held_out_split_is_by_document(sinky):
    s, _, _, doc, _ = sinky
    train = _all(ActivationDataset(s, batch_size=256, split="train", test_fraction=0.2, return_meta=True))[1]
    test = _all(ActivationDataset(s, batch_size=256, split="test", test_fraction=0.2, return_meta=True))[1]
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(N))
    assert not set(doc[train]) & set(doc[test])           # no document on both sides
    assert (doc[test] >= 0).all()                         # BOS rows belong to no document: train
    docs = np.unique(doc[doc >= 0])
    assert 0.1 < len(np.unique(doc[test])) / len(docs) < 0.3
    other = _all(ActivationDataset(s, batch_size=256, split="test", test_fraction=0.2, split_seed=1,
                                   return_meta=True))[1]
    assert not np.array_equal(np.sort(other), np.sort(test))


@pytest.mark.parametrize("mode", ["norm_scale", "standardize", "center_norm_scale"])
def test_normalisation_uses_the_yielded_rows(sinky, mode, caplog):
    """BOS excluded, every other position yielded, the sinks at positions 1-3 included: the
    constants (a sample that covers this small store) give exactly the target moments over every
    row yielded, and the reader warns that sink positions set the scale; constants over all rows
    do not."""
    s, data, tok, _, _ = sinky
    with caplog.at_level(logging.INFO, logger="harvest.store.read.dataset"), \
            pytest.warns(UserWarning, match=r"keeps context position\(s\) 0, 1 \(where"):
        ds = ActivationDataset(s, batch_size=500, exclude_token_ids=[BOS], normalize=mode, return_meta=True)
    assert ds.norm_constants.source == "sample" and "constants from sample" in caplog.text
    y, rows = _all(ds)
    assert (rows % C == 1).any() and len(rows) == ds.norm_constants.rows
    mean, var, msq = _recount(data, rows)
    for p in range(2):
        yp = y[:, p]
        if mode == "norm_scale":
            np.testing.assert_allclose((yp * yp).sum(1).mean(), W, rtol=1e-4)
            # the same rows scaled with statistics over all rows: off by orders of magnitude
            all_msq = (data[p].astype(np.float64) ** 2).sum(1).mean()
            assert (data[p, rows].astype(np.float64) ** 2).sum(1).mean() * W / all_msq < 0.1 * W
        elif mode == "standardize":
            np.testing.assert_allclose(yp.mean(0), 0, atol=1e-4)
            np.testing.assert_allclose(yp.std(0), 1, rtol=1e-3)
        else:
            np.testing.assert_allclose(((yp - yp.mean(0)) ** 2).sum(1).mean(), W, rtol=1e-4)
        np.testing.assert_allclose(ds.norm_constants.mean_sq_norm[p], msq[p], rtol=1e-9)
    back = ds.norm_constants.invert(torch.from_numpy(y[:5]).float())
    np.testing.assert_allclose(back.numpy(), data[:, rows[:5]].astype(np.float32).transpose(1, 0, 2), rtol=1e-4)


def test_a_sample_of_part_of_the_store_estimates_within_two_percent(sinky):
    s, data, _, _, _ = sinky
    ds = ActivationDataset(s, batch_size=500, seqpos=slice(4, None), normalize="norm_scale",
                           norm_sample_rows=N // 4)
    assert ds.norm_constants.rows == N // 4
    y = torch.cat(list(ds)).double().numpy()
    for p in range(2):
        assert abs((y[:, p] ** 2).sum(1).mean() / W - 1) < 0.02


def test_norm_outlier_filter_drops_the_sinks_and_only_them(sinky):
    s, data, tok, _, sinks = sinky
    ds = ActivationDataset(s, batch_size=256, exclude_token_ids=[BOS], max_norm_ratio=10, normalize="norm_scale",
                           return_meta=True)
    y, rows = _all(ds)
    want = np.setdiff1d(np.flatnonzero(tok != BOS), sinks)
    assert np.array_equal(np.sort(rows), want) and ds.tally.dropped == len(np.setdiff1d(sinks, np.flatnonzero(tok == BOS)))
    for p in range(2):   # the constants describe exactly the rows that survive the filter
        np.testing.assert_allclose((y[:, p] ** 2).sum(1).mean(), W, rtol=1e-4)


def test_constants_come_from_the_stores_kept_stats_when_the_filters_match(sinky, tmp_path, caplog):
    """A real layout-v2 store: its writers recorded kept-row statistics for the special ids the
    driver put in the format attributes and the sink position; the reader uses them only when its
    filters select exactly those rows, and they equal a recount over those rows."""
    from harvest.store import create_store
    from harvest.testing import synthetic

    _, data, tok, doc, _ = sinky
    pos = np.where(doc < 0, -2, np.arange(N) % C).astype(np.int32)
    stores = {}
    for skip in (0, 2):
        real = create_store(str(tmp_path / f"k{skip}.zarr"), points=["resid_post.3", "resid_post.7"],
                            width=W, n_rows=N, shard_rows=SHARD, chunk_rows=128, context_size=C,
                            special_token_ids=[BOS, 2], bos_token_id=BOS, stats_skip_positions=skip)
        real.ledger.write_plan(real.ledger.default_plan(1))
        synthetic.fill(real, data, token_id=tok, doc_id=doc, position=pos)
        stores[skip] = open_store(real.url)
    store = stores[2]
    with caplog.at_level(logging.INFO, logger="harvest.store.read.dataset"):
        ds = ActivationDataset(store, batch_size=500, exclude_special=True, seqpos=slice(2, None),
                               normalize="standardize", norm_sample_rows=64)
    assert ds.norm_constants.source == "store:kept" and "constants from store:kept" in caplog.text
    keep = ~np.isin(tok, [BOS, 2]) & (np.arange(N) % C >= 2)
    mean, var, _ = _recount(data, np.flatnonzero(keep))
    np.testing.assert_allclose(ds.norm_constants.shift.numpy(), mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ds.norm_constants.scale.numpy(), 1 / np.sqrt(var + 1e-6), rtol=1e-5)
    # other filters than the recorded ones: the stored stats do not describe the rows -> sample
    other = ActivationDataset(store, batch_size=500, exclude_special=True, seqpos=slice(3, None),
                              normalize="standardize")
    assert other.norm_constants.source == "sample"
    # a store whose kept class holds the sinks (0 skipped positions recorded, as `bos: none`
    # runs did before the sink rule): its kept statistics are not used, the sample is
    old = ActivationDataset(stores[0], batch_size=500, exclude_special=True, normalize="standardize",
                            norm_sample_rows=N)
    assert old.norm_constants.source == "sample"
    # a held-out split reuses its train split's constants
    test = ActivationDataset(store, batch_size=500, exclude_special=True, split="test", normalize="standardize",
                             norm_constants=ds.norm_constants)
    assert test.norm_constants is ds.norm_constants
    with pytest.raises(ValueError, match="norm_constants are for points"):
        ActivationDataset(store, points="resid_post.3", normalize="standardize", norm_constants=ds.norm_constants)


@pytest.mark.parametrize("gone", [(1, 3), (0, 1, 2, 3)], ids=["some", "all"])
def test_the_sample_reads_unpublished_units_as_their_writers_wrote_them(tmp_path, gone):
    """A writer killed between its commit marker and publish leaves the unit's objects under its
    attempt's name until finalize, where zarr reads fill zeros. The sample is read checked, like
    the rows, so the constants equal a recount over exactly the rows the reader yields."""
    n, point = 4 * SHARD, "resid_post.3"
    s, data, _, _, _ = make_store(tmp_path / "u.zarr", n, SHARD, W, [point], context=C, seed=5)
    assert unpublish(s, gone) > 0
    store = open_store(s.url, read_only=True)
    lost = store.ledger.commit_manifest(gone[0])
    zarr_view = np.asarray(store.array(point)[lost.row_start:lost.row_end])
    assert not zarr_view.view(np.uint16).any()      # what plain zarr sees: fill zeros
    ds = ActivationDataset(store, point, batch_size=256, seqpos=slice(2, None),
                           normalize="norm_scale", norm_sample_rows=n)  # sample: every kept row
    keep = np.arange(n) % C >= 2
    msq = (data[0, keep].astype(np.float64) ** 2).sum(1).mean()
    c = ds.norm_constants
    assert c.source == "sample" and c.rows == keep.sum()
    np.testing.assert_allclose(c.mean_sq_norm[0], msq, rtol=1e-9)
    np.testing.assert_allclose(c.scale.numpy(), np.sqrt(W / msq), rtol=1e-6)
    out = list(ActivationDataset(store, point, batch_size=256, seqpos=slice(2, None),
                                 normalize="norm_scale", norm_constants=c))
    y = torch.cat(out).double().numpy()   # the rows the constants describe: E||y||^2 = width
    np.testing.assert_allclose((y * y).sum(1).mean(), W, rtol=1e-4)
    # a held-out split: blocks whose every row is filtered out; the reference is the rows it yields
    with pytest.warns(UserWarning, match="attention sinks"):   # positions 0 and 1 yielded
        test = ActivationDataset(store, point, batch_size=256, split="test", test_fraction=0.2,
                                 normalize="norm_scale", norm_sample_rows=n, return_meta=True)
    rows = np.concatenate([b["row"].numpy() for b in test])
    assert 0 < len(rows) < n // 2 and test.norm_constants.rows == len(rows)
    msq = (data[0, rows].astype(np.float64) ** 2).sum(1).mean()
    np.testing.assert_allclose(test.norm_constants.mean_sq_norm[0], msq, rtol=1e-9)


def test_normalize_without_usable_rows_says_why(tmp_path):
    """No committed rows, or rows that are all zero: an error naming the cause, not a division."""
    n = 2 * SHARD
    s, _, _, _, _ = make_store(tmp_path / "none.zarr", n, SHARD, W, context=C, uncommitted=(0, 1))
    with pytest.raises(ValueError, match="no committed rows"):
        ActivationDataset(s, batch_size=64, seqpos=slice(1, None), normalize="norm_scale")
    zero = np.zeros((1, n, W), ml_dtypes.bfloat16)
    z, _, _, _, _ = make_store(tmp_path / "zero.zarr", n, SHARD, W, context=C, data=zero)
    for mode in ("norm_scale", "center_norm_scale"):
        with pytest.raises(ValueError, match="all zero"):
            ActivationDataset(z, batch_size=64, seqpos=slice(1, None), normalize=mode)
