"""Shuffled copies (store/shuffled_copy.py, `harvest shuffle`): every source row once, bit for bit, at
the place an independent recompute of the keyed order gives; the source's row metadata and
statistics carried (the `kept` rows found through source_row's context positions); a crash in
either pass resumed to the same bytes as a clean run; and the reader's default window shuffle
on the copy mixing documents like a uniform shuffle, where on the source it cannot.

References: the source store read back row by row (Store.read), the Feistel bijection computed
here again, the source's own statistics, a clean run compared with a resumed one.
"""

from __future__ import annotations

import numpy as np
import pytest

from harvest.store import create_store, open_store
from harvest.store import shuffled_copy
from harvest.store.errors import StoreError
from harvest.store.read.dataset import ActivationDataset
from harvest.store.read.checked_rows import read_meta_checked
from harvest.store.read.shuffle.permute import Feistel
from harvest.testing import synthetic
from tests.support.reader_stores import BOS, packed_meta

C, SHARD = 64, 256
POINTS = ["resid_post.0", "mlp_out.0"]


def _source(path, n=11 * SHARD - 40, dtype="bfloat16", widths=None, finalize=True, seed=0):
    """A finished store of packed documents (BOS rows and the first 2 context positions out of
    the `kept` statistics), units of 2 shards, the last one short."""
    w = max((widths or {}).values(), default=8)
    s = create_store(str(path), points=POINTS, width=8, widths=widths, n_rows=n, shard_rows=SHARD,
                     chunk_rows=64, dtype=dtype, context_size=C, special_token_ids=(BOS,),
                     bos_token_id=BOS, stats_skip_positions=2, attrs={"model": "tiny"})
    tok, doc, pos = packed_meta(n, C, mean_doc=40, seed=seed)
    s.ledger.write_plan(s.ledger.default_plan(2))
    data = synthetic.activations((len(POINTS), n, w), seed=seed + 1)
    synthetic.fill(s, data, token_id=tok, doc_id=doc, position=pos)
    if finalize:
        s.finalize()
    return open_store(str(path))


def _raw(st, point):
    x = np.asarray(st.read(point, 0, st.n_rows))
    return x.view(np.uint8).reshape(x.shape[0], -1)


@pytest.fixture(scope="module")
def shuffled(tmp_path_factory):
    d = tmp_path_factory.mktemp("shuffle")
    src = _source(d / "src")
    out = shuffled_copy.shuffle_store(str(d / "src"), str(d / "dst"), seed=7)
    return src, open_store(str(d / "dst")), out, d


def test_every_source_row_once_bit_for_bit_at_the_keyed_place(shuffled):
    src, dst, out, d = shuffled
    n = src.n_rows
    assert out["rows"] == n and out["units"] == -(-n // SHARD) and out["scans"] == 1
    assert out["levels"] == 1
    assert dst.n_rows == n and dst.summary is not None and dst.verify(deep=True).complete
    sr = read_meta_checked(dst, "source_row", 0, n)
    assert np.array_equal(np.sort(sr), np.arange(n))
    d_of = Feistel(n, (7, shuffled_copy.KEY_TAG))(np.arange(n))   # the order, computed again
    assert np.array_equal(sr[d_of], np.arange(n))
    for p in POINTS:
        assert np.array_equal(_raw(dst, p), _raw(src, p)[sr])
    for got, want in zip(dst.read_row_meta_checked(0, n), src.read_row_meta_checked(0, n)):
        assert np.array_equal(got, want[sr])
    assert dst.attrs["model"] == "tiny" and dst.attrs["shuffled"]["seed"] == 7
    card = (d / "dst" / "README.md").read_text()   # finalize's dataset card says so
    assert "| row order | shuffled: a copy of" in card and "seed 7" in card
    assert "row order" not in (d / "src" / "README.md").read_text()
    assert not (d / "dst.spill").exists()   # the spill store is gone


def test_statistics_are_the_sources_kept_rows_found_by_source_row(shuffled):
    src, dst, _, _ = shuffled
    for subset in ("all", "kept"):
        a, b = src.stats(subset=subset), dst.stats(subset=subset)
        for p in POINTS:
            assert a[p]["count"] == b[p]["count"]
            np.testing.assert_allclose(b[p]["mean"], a[p]["mean"], rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(b[p]["var"], a[p]["var"], rtol=1e-9, atol=1e-12)
    # BOS rows and context positions 0-1 are out of `kept`: position from the row index would
    # drop a different set in the copy
    kept = src.stats(subset="kept")[POINTS[0]]["count"]
    assert 0 < kept < src.stats(subset="all")[POINTS[0]]["count"]


def test_reader_seqpos_on_the_copy_keeps_the_sources_rows(shuffled):
    """seqpos filters by context position: on the copy, source_row % context_size."""
    src, dst, _, _ = shuffled
    opts = dict(batch_size=64, seqpos=slice(3, None), exclude_special=True, return_meta=True,
                shuffle=False, drop_last=False)

    def rows(st):
        return np.concatenate([b["row"].numpy() for b in ActivationDataset(st, POINTS[0], **opts)])

    sr = read_meta_checked(dst, "source_row", 0, dst.n_rows)
    assert np.array_equal(np.sort(sr[rows(dst)]), np.sort(rows(src)))


def test_the_default_window_shuffle_mixes_the_copy_like_a_uniform_draw(shuffled):
    """A buffer of 2 shards over 11 (>= 4 windows): on the source a batch holds only its
    window's documents; on the copy every shard is a uniform sample of the store."""
    src, dst, _, _ = shuffled
    opts = dict(batch_size=128, shuffle_buffer_rows=2 * SHARD, seed=1)
    on_src = ActivationDataset(src, POINTS[0], **opts).describe(batches=8)
    on_dst = ActivationDataset(dst, POINTS[0], **opts).describe(batches=8)
    assert on_src["shards"] >= 4 * on_src["window_shards"]
    assert on_src["simulated"]["vs_uniform"] < 0.8
    assert on_dst["simulated"]["vs_uniform"] >= 0.9 and on_dst["vs_uniform"] >= 0.9


@pytest.mark.parametrize("where", ["scatter", "gather"])
def test_a_crash_in_either_pass_resumes_to_a_clean_runs_bytes(tmp_path, monkeypatch, shuffled, where):
    src, clean, _, d = shuffled
    calls = {"n": 0}
    real = getattr(shuffled_copy, f"_{where}")

    def dies(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("killed")
        return real(*a, **k)

    monkeypatch.setattr(shuffled_copy, f"_{where}", dies)
    dst = str(tmp_path / "dst")
    # a small memory budget: 3 writers a scan, so 11 units take 3 scatter levels (3, 9, 27)
    kw = dict(seed=7, memory_bytes=3 * shuffled_copy._writer_bytes(src))
    with pytest.raises(RuntimeError, match="killed"):
        shuffled_copy.shuffle_store(str(d / "src"), dst, **kw)
    spill = tmp_path / "dst.spill"
    if where == "gather":   # every level was done: each freed once the next held its rows
        assert [p.name for p in spill.iterdir()] == ["level-3"]
    else:                   # killed in level 2's scan: level 1 is still needed
        assert (spill / "level-1").exists()
        with pytest.raises(StoreError, match="not this shuffle's spill"):   # other unit sizes
            shuffled_copy.shuffle_store(str(d / "src"), dst, seed=7)
    monkeypatch.setattr(shuffled_copy, f"_{where}", real)
    again = shuffled_copy.shuffle_store(str(d / "src"), dst, **kw)
    assert again["units"] == clean.n_rows // SHARD + 1 and again["levels"] == 3
    got = open_store(dst)
    assert got.verify(deep=True).complete
    for p in POINTS:
        assert np.array_equal(_raw(got, p), _raw(clean, p))
    for name in got.meta_columns:
        assert np.array_equal(read_meta_checked(got, name, 0, got.n_rows),
                              read_meta_checked(clean, name, 0, clean.n_rows))
    assert not (tmp_path / "dst.spill").exists()
    assert shuffled_copy.shuffle_store(str(d / "src"), dst, **kw)["already_finished"]


def test_fp8_rows_of_several_widths_move_as_stored(tmp_path):
    src = _source(tmp_path / "src", n=5 * SHARD, dtype="float8_e4m3fn",
                  widths={"resid_post.0": 8, "mlp_out.0": 24})
    shuffled_copy.shuffle_store(str(tmp_path / "src"), str(tmp_path / "dst"), seed=1)
    dst = open_store(str(tmp_path / "dst"))
    sr = read_meta_checked(dst, "source_row", 0, dst.n_rows)
    assert dst.widths == src.widths and dst.dtype == "float8_e4m3fn"
    for p in POINTS:
        assert np.array_equal(_raw(dst, p), _raw(src, p)[sr])


def test_a_copy_of_one_point(tmp_path, shuffled):
    """`points=`: the copy holds those points only, the same order (same seed) and rows; its
    scatter writers hold one point's blocks."""
    src, clean, _, d = shuffled
    shuffled_copy.shuffle_store(str(d / "src"), str(tmp_path / "one"), seed=7, points=["mlp_out.0"])
    one = open_store(str(tmp_path / "one"))
    assert one.points == ["mlp_out.0"] and one.attrs["shuffled"]["points"] == ["mlp_out.0"]
    assert np.array_equal(_raw(one, "mlp_out.0"), _raw(clean, "mlp_out.0"))
    assert np.array_equal(read_meta_checked(one, "source_row", 0, one.n_rows),
                          read_meta_checked(clean, "source_row", 0, clean.n_rows))
    assert one.stats(subset="kept")["mlp_out.0"]["count"] == src.stats(subset="kept")["mlp_out.0"]["count"]
    with pytest.raises(StoreError, match="not there: attn_out.0"):
        shuffled_copy.shuffle_store(str(d / "src"), str(tmp_path / "two"), points=["attn_out.0"])


def test_refusals_name_the_problem(tmp_path, shuffled):
    src, _, _, d = shuffled
    unfinished = create_store(str(tmp_path / "partial"), points=POINTS, width=8, n_rows=4 * SHARD,
                              shard_rows=SHARD, chunk_rows=64)
    unfinished.ledger.write_plan(unfinished.ledger.default_plan(1))
    with pytest.raises(StoreError, match="not a finished store"):
        shuffled_copy.shuffle_store(str(tmp_path / "partial"), str(tmp_path / "x"))
    with pytest.raises(StoreError, match="already a shuffled copy"):
        shuffled_copy.shuffle_store(str(d / "dst"), str(tmp_path / "y"))
    with pytest.raises(StoreError, match="not this shuffle"):   # another seed, same place
        shuffled_copy.shuffle_store(str(d / "src"), str(d / "dst"), seed=8)
    assert src.n_rows > 0


def test_harvest_shuffle_command(tmp_path, shuffled, capsys):
    """`harvest shuffle SRC DST --json`: the copy and its summary; the same command again
    finds it finished."""
    import json

    from harvest.pipeline.cli.main import main

    _, clean, _, d = shuffled
    dst = str(tmp_path / "copy")
    assert main(["shuffle", str(d / "src"), dst, "--seed", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == clean.n_rows and out["scans"] == 1
    for p in POINTS:
        assert np.array_equal(_raw(open_store(dst), p), _raw(clean, p))
    assert main(["shuffle", str(d / "src"), dst, "--seed", "7", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["already_finished"]


def test_a_shuffled_copy_on_s3_leaves_no_spill_objects(seaweedfs, s3_url):
    """On the S3 server: the copy equals the local one's rows for the same seed, and the spill
    store's objects are all gone (the copy's and the source's stay)."""
    import s3fs

    so = seaweedfs.storage_options
    n = 3 * SHARD
    src = create_store(s3_url + "/src", points=POINTS, width=8, n_rows=n, shard_rows=SHARD,
                       chunk_rows=64, context_size=C, special_token_ids=(BOS,),
                       stats_skip_positions=2, storage_options=so)
    tok, doc, pos = packed_meta(n, C, mean_doc=40, seed=2)
    src.ledger.write_plan(src.ledger.default_plan(1))
    synthetic.fill(src, synthetic.activations((len(POINTS), n, 8), seed=3), token_id=tok,
                   doc_id=doc, position=pos)
    src.finalize()
    shuffled_copy.shuffle_store(s3_url + "/src", s3_url + "/dst", seed=4, storage_options=so)
    dst = open_store(s3_url + "/dst", storage_options=so)
    assert dst.verify(deep=True).complete
    sr = read_meta_checked(dst, "source_row", 0, n)
    assert np.array_equal(sr[Feistel(n, (4, shuffled_copy.KEY_TAG))(np.arange(n))], np.arange(n))
    for p in POINTS:
        assert np.array_equal(_raw(dst, p), _raw(open_store(s3_url + "/src", storage_options=so), p)[sr])
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **so)
    left = fs.find(s3_url[len("s3://"):])
    assert not [k for k in left if "/dst.spill/" in k]
    assert any("/dst/" in k for k in left) and any("/src/" in k for k in left)
