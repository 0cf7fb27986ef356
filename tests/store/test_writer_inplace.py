"""One host copy, writer side: rows a producer writes in place through `reserve` commit exactly as
rows copied in with `write`, recounted from what the store reads back; the buffers a producer may
still be writing are never evicted or recycled."""

from __future__ import annotations

import numpy as np
import pytest

from harvest.store import create_store, open_store
from harvest.testing import synthetic

P, W, SHARD, N = 2, 8, 64, 256  # 4 shards in one unit


def _store(tmp_path):
    s = create_store(str(tmp_path / "s.zarr"), points=["resid_post.0", "resid_post.1"], width=W,
                     n_rows=N, shard_rows=SHARD, chunk_rows=32)
    s.ledger.write_plan([{"unit_id": 0, "row_start": 0, "row_end": N}])
    return s


def _meta(w):
    w.write_meta(0, np.arange(N, dtype=np.int32) % 50, np.arange(N) // 100, np.arange(N) % 100)


def test_rows_written_in_place_commit_the_same_bytes_as_copied_rows(tmp_path):
    data = synthetic.activations((P, N, W), seed=3)
    s = _store(tmp_path)
    # max_open_shards=1: in-place reservations in four shards at once must all stay valid
    w = s.region_writer(0, 0, N, max_open_shards=1)
    _meta(w)
    raw = data.view(np.uint16)
    views = {}
    for a in range(0, N, 16):  # one 16-row "request" per step, all reserved before any is filled
        if a % 32 == 16:
            continue  # every other request takes the copy path
        v = w.reserve(a, 16)
        assert v is not None and v.shape == (P, 16, W)
        views[a] = v
    for a, v in views.items():  # the producer writes after later reservations opened shards
        v[...] = raw[:, a:a + 16]
    for a in range(0, N, 16):
        if a in views:
            w.fill_reserved(a, 16)
        else:
            w.write(a, data[:, a:a + 16])
    w.commit()
    back = open_store(s.url)
    for p, name in enumerate(back.points):
        assert np.array_equal(np.asarray(back.read(name, 0, N)).view(np.uint16), raw[p])
    assert back.verify(deep=True).ok


def test_reservations_are_refused_where_rows_are_taken_and_missing_fills_block_commit(tmp_path):
    data = synthetic.activations((P, N, W), seed=4)
    s = _store(tmp_path)
    w = s.region_writer(0, 0, N)
    _meta(w)
    assert w.reserve(SHARD - 8, 16) is None  # straddles two shards: the caller copies instead
    w.reserve(0, 8)
    with pytest.raises(ValueError, match="already written or reserved"):
        w.reserve(4, 8)
    with pytest.raises(ValueError, match="already written"):
        w.write(0, data[:, 0:8])
    with pytest.raises(ValueError, match="were not reserved"):
        w.fill_reserved(8, 8)
    w.write(8, data[:, 8:N])
    with pytest.raises(ValueError, match="8 rows never written"):
        w.commit()  # reserved, never filled: the unit cannot commit
    w.abort()
    assert s.verify().committed_units == 0


def test_a_failed_model_check_stops_the_run_with_the_per_point_table():
    from harvest.pipeline.driver.run import _model_check
    from harvest.pipeline.errors import HarvestError

    path = "tiny:llama"   # model.path, as the error names it
    good = {"ok": True, "worst_point": "resid_post.0", "seconds": 1.0,
            "points": {"resid_post.0": {"p50": 0.004, "p99": 0.01, "max": 0.02, "ok": True}}}
    _model_check(good, path)  # passes quietly
    _model_check(None, path)  # actor 0 ran no check (eager backend, or capture.check_model: false)
    bad = {"ok": False, "worst_point": "resid_post.1", "tolerance": {"p50": 0.03, "p99": 0.15},
           "prompts": 3, "tokens": 90, "probe": {"verified": True},
           "points": {"resid_post.0": {"p50": 0.004, "p99": 0.01, "max": 0.02, "ok": True},
                      "resid_post.1": {"p50": 0.9, "p99": 0.99, "max": 1.0, "ok": False}}}
    with pytest.raises(HarvestError, match=r"(?s)model check failed on actor 0.*resid_post.1 .*"
                                           r"above tolerance.*Nothing was written"):
        _model_check(bad, path)
    with pytest.raises(HarvestError, match="TrunkRefused: nope"):
        _model_check({"ok": False, "error": "TrunkRefused: nope"}, path)


def test_points_of_several_widths_in_place_store_only_their_own_columns(tmp_path):
    """A reservation is [points, n, widest] (the engine's destination shape); a narrower point's
    rows are its first columns and whatever lies past them (the engine leaves it unwritten) is
    never stored, CRC'd or counted."""
    widths = {"mlp_in.0": W, "mlp_act.0": 3 * W}
    s = create_store(str(tmp_path / "m.zarr"), points=list(widths), width=W, widths=widths,
                     n_rows=N, shard_rows=SHARD, chunk_rows=32)
    s.ledger.write_plan([{"unit_id": 0, "row_start": 0, "row_end": N}])
    data = synthetic.activations((P, N, 3 * W), seed=5)
    raw = data.view(np.uint16)
    w = s.region_writer(0, 0, N)
    _meta(w)
    for a in range(0, N, 16):
        v = w.reserve(a, 16)
        assert v is not None and v.shape == (P, 16, 3 * W)
        v[...] = raw[:, a:a + 16]   # junk past mlp_in's 8 columns, as an engine's buffer holds
        w.fill_reserved(a, 16)
    w.commit()
    back = open_store(s.url)
    assert np.array_equal(np.asarray(back.read("mlp_in.0", 0, N)).view(np.uint16), raw[0, :, :W])
    assert np.array_equal(np.asarray(back.read("mlp_act.0", 0, N)).view(np.uint16), raw[1])
    x = data[0, :, :W].astype(np.float64)
    np.testing.assert_allclose(back.stats(["mlp_in.0"])["mlp_in.0"]["mean"], x.mean(0), rtol=1e-12)
    assert back.verify(deep=True).ok
