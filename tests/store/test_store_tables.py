"""Layout version 3 (issue 24): per-unit object tables instead of per-shard records in markers.

Checked against independent references: marker bytes as stored (not as estimated), the data the
test wrote (bit for bit) and the layout-2 marker shape FORMAT.md documents."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from harvest.store import DataIntegrityError, create_store, open_store
from harvest.store.format import layout
from harvest.store.read.dataset import ActivationDataset
from harvest.store.commit.tables import unit_shards
from harvest.testing import synthetic

W, SHARD = 8, 16


@pytest.fixture(params=["local", "s3"])
def target(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run.zarr"), None
    return request.getfixturevalue("s3_url"), request.getfixturevalue("seaweedfs").storage_options


def _store(url, so, n_points: int, n_rows: int, shards_per_unit: int):
    s = create_store(url, points=[f"resid_post.{i}" for i in range(n_points)], width=W,
                     n_rows=n_rows, shard_rows=SHARD, chunk_rows=SHARD, storage_options=so)
    s.ledger.write_plan(s.ledger.default_plan(shards_per_unit))
    return s


def _fill(s, seed=0):
    x = synthetic.activations((len(s.points), s.n_rows, W), seed=seed)
    tok = np.arange(s.n_rows, dtype=np.int32)
    return x, synthetic.fill(s, x, token_id=tok, doc_id=tok.astype(np.int64) // 7,
                             position=tok % 7)


def _reads_exactly(url, so, x):
    """Checked reads, the SAE reader and verify --deep all see exactly `x`."""
    r = open_store(url, storage_options=so)
    for i, p in enumerate(r.points):
        assert np.array_equal(r.read(p, 0, r.n_rows).view(np.uint16), x[i].view(np.uint16))
    got = np.zeros((r.n_rows, len(r.points), W), np.uint16)
    seen = []
    for b in ActivationDataset(r, batch_size=50, return_meta=True):
        got[b["row"].numpy()] = b["acts"].view(torch.int16).numpy().view(np.uint16)
        seen.append(b["row"].numpy())
        assert np.array_equal(b["token_id"].numpy(), b["row"].numpy())
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(r.n_rows))
    assert np.array_equal(got, x.transpose(1, 0, 2).view(np.uint16))
    v = r.verify(deep=True)
    assert v.ok, v.errors
    return v


def test_marker_size_does_not_grow_with_shards(tmp_path):
    """1 vs 64 shards x 32 points per unit, through the real writer: the stored markers are
    within a few digits of each other (row numbers, sizes summed per point), the per-shard records
    are in the table; a layout-2 marker of the same unit would be ~35 B x 64 x 32 larger."""
    sizes = {}
    for n in (1, 64):
        url = str(tmp_path / f"s{n}")
        s = _store(url, None, 32, 64 * SHARD, n)
        _, ms = _fill(s)
        m = ms[-1]
        raw = s.location.read_bytes(layout.commit_key(m.unit_id, m.row_start, m.row_end))
        assert "shards" not in json.loads(raw) and m.table.n_shards == n
        sizes[n] = len(raw)
        recs = unit_shards(open_store(url), m)
        assert [r.index for r in recs] == list(range(m.row_start // SHARD, m.row_end // SHARD))
        assert all(len(r.object_crc32c) == 32 and len(r.nbytes) == 32 for r in recs)
    assert sizes[64] <= 64_000 and sizes[1] <= 2_000
    # 32 per-point sums with up to 2 more digits, and a few longer numbers: not 64 x 32 records
    assert abs(sizes[64] - sizes[1]) < 150, sizes


def test_reading_opens_no_table_until_a_unit_is_read(target):
    url, so = target
    s = _store(url, so, 3, 8 * SHARD, 2)
    x, _ = _fill(s)
    r = open_store(url, storage_options=so, read_only=True)
    ds = ActivationDataset(r, batch_size=32)
    assert ds._store.ledger.table_cache.loads == 0           # pieces come from the row ranges alone
    assert r.verify().ok and r.ledger.table_cache.loads == 0   # default verify reads no table either
    n = sum(len(b) for b in ds)
    assert n == 8 * SHARD and 1 <= ds._store.ledger.table_cache.loads
    _reads_exactly(url, so, x)


def test_layout_2_store_still_reads_exactly(target, monkeypatch):
    """A store made by a harvest of layout 2 (markers carrying `points` and `shards` inline, as
    FORMAT.md's version 2 says): every consumer reads it as before, and a resume's writer keeps
    writing version-2 markers into it."""
    url, so = target
    with monkeypatch.context() as mp:
        mp.setattr(layout, "LAYOUT_VERSION", 2)
        s = _store(url, so, 3, 6 * SHARD, 2)
    assert s.layout_version == 2
    x, ms = _fill(s)
    for m in ms:
        assert m.layout_version == 2 and m.table is None and list(m.points) == s.points
        assert [sh.index for sh in m.shards] == list(range(m.row_start // SHARD,
                                                                   m.row_end // SHARD))
        assert all(set(sh.doc) >= {"crc32c", "nbytes", "object_crc32c", "meta"} for sh in m.shards)
    assert s.location.list_dir(layout.TABLES_DIR) == []
    s.ledger.write_index(ms[:2])
    _reads_exactly(url, so, x)
    f = open_store(url, storage_options=so).finalize()
    assert f["compression_ratio"]["stored_bytes"] == sum(
        n for m in ms for sh in m.shards for n in sh.nbytes)
    _reads_exactly(url, so, x)


@pytest.mark.parametrize("damage", ["deleted", "overwritten"])
def test_a_missing_or_damaged_table_is_refused_with_the_repair(target, damage):
    url, so = target
    s = _store(url, so, 2, 4 * SHARD, 2)
    _, ms = _fill(s)
    key = ms[1].table.key
    if damage == "deleted":
        s.location.delete(key)
    else:   # valid gzip'ed JSON, same shards, one CRC changed: only the sha256 tells
        body = json.loads(gzip.decompress(s.location.read_bytes(key)))
        body["shards"][0]["object_crc32c"][0] ^= 1
        s.location.write_bytes(key, gzip.compress(json.dumps(body).encode()))
    r = open_store(url, storage_options=so)
    want = "missing" if damage == "deleted" else "differs from what its writer committed"
    with pytest.raises(DataIntegrityError, match=f"unit 1: its object table .*{want}.*uncommit\\(1\\)"):
        r.read("resid_post.0", 0, r.n_rows)
    with pytest.raises(DataIntegrityError, match="uncommit\\(1\\)"):
        for _ in ActivationDataset(open_store(url, storage_options=so), batch_size=16):
            pass
    v = open_store(url, storage_options=so).verify(deep=True)
    assert not v.ok and any("unit 1: its object table" in e and want in e and "uncommit(1)" in e
                               for e in v.errors), v.errors
    v = open_store(url, storage_options=so).verify(objects=True)
    assert not v.ok and any("uncommit(1)" in e for e in v.errors)
    # unit 0 is untouched: its rows still read
    assert r.read("resid_post.1", 0, 2 * SHARD).shape == (2 * SHARD, W)


def test_uncommit_and_rewrite_reads_the_new_attempts_table(target):
    """A table is named by attempt: the rewrite writes a new one, and nothing consults the old
    one again (deleted here, so any read of it would fail), whether the old marker was indexed
    or not."""
    url, so = target
    s = _store(url, so, 2, 4 * SHARD, 2)
    x, ms = _fill(s, seed=1)
    s.ledger.write_index(ms)
    s.uncommit(0)
    y = synthetic.activations((2, s.n_rows, W), seed=2)
    tok = np.arange(s.n_rows, dtype=np.int32)
    [new] = synthetic.fill(s, y, units=[s.ledger.plan()[0]], token_id=tok,
                           doc_id=tok.astype(np.int64) // 7, position=tok % 7)
    assert new.table.key != ms[0].table.key
    s.location.delete(ms[0].table.key)
    want = x.copy()
    want[:, :2 * SHARD] = y[:, :2 * SHARD]
    _reads_exactly(url, so, want)
    s.ledger.write_index([new])
    open_store(url, storage_options=so).finalize()
    _reads_exactly(url, so, want)
