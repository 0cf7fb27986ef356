"""Points of several widths in one store (layout 4): arrays at their own widths, bits, statistics,
verify --deep, fp8 scales per point row, the reader's dict batches, and older layouts still read."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harvest.store import create_store, open_store
from harvest.store.read.dataset import ActivationDataset
from harvest.store.format import layout
from harvest.testing import synthetic

# SmolLM2-like: two d_model points and a 4x wider one (mlp_act), three shards (the last partial)
WIDTHS = {"mlp_in.1": 24, "mlp_act.1": 96, "mlp_out.1": 24}
W, N, SHARD, CHUNK = 24, 2300, 1024, 256
POINTS = list(WIDTHS)


def _data(seed: int) -> np.ndarray:
    """[points, rows, widest] bf16: each point's rows in its first widths[p] columns, junk after
    (a writer must never store the columns past a point's width)."""
    x = synthetic.activations((len(POINTS), N, max(WIDTHS.values())), seed=seed)
    x[:, 5:7, :W] = synthetic.special_bf16_rows(W)   # NaN, inf, -0, subnormals
    return x


def _make(url, **kw):
    s = create_store(url, points=POINTS, width=W, widths=WIDTHS, n_rows=N, shard_rows=SHARD,
                     chunk_rows=CHUNK, context_size=128, **kw)
    s.ledger.write_plan(s.ledger.default_plan(1))
    return s


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("widths") / "m.zarr")
    x = _data(1)
    s = _make(url)
    tok = (np.arange(N) * 7919 % 50257).astype(np.int32)
    synthetic.fill(s, x, order="shuffled", token_id=tok, doc_id=np.arange(N) // 128,
                   position=(np.arange(N) % 128).astype(np.int32))
    s.finalize({})
    return url, x


def test_arrays_at_own_widths_bits_stats_and_deep_verify(mixed):
    url, x = mixed
    r = open_store(url)
    assert r.layout_version == layout.LAYOUT_VERSION_WIDTHS == 4
    assert r.widths == WIDTHS and r.mixed_widths and r.max_width == 96
    meta = json.loads(open(f"{url}/mlp_act/1/zarr.json").read())
    assert meta["shape"] == [N, 96]
    assert json.loads(open(f"{url}/mlp_in/1/zarr.json").read())["shape"] == [N, 24]
    for i, p in enumerate(POINTS):
        got = r.read(p, 0, N)
        assert got.shape == (N, WIDTHS[p])
        assert np.array_equal(got.view(np.uint16), x[i, :, :WIDTHS[p]].view(np.uint16)), p
    st = r.stats()
    for i, p in enumerate(POINTS):
        x64 = x[i, :, :WIDTHS[p]].astype(np.float32).astype(np.float64)
        ok = np.isfinite(x64).all(1)
        assert st[p]["count"] == ok.sum() and st[p]["mean"].shape == (WIDTHS[p],)
        np.testing.assert_allclose(st[p]["mean"], x64[ok].mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(st[p]["var"], x64[ok].var(0), rtol=1e-10, atol=1e-12)
    # finalized statistics: [points, widest], NaN past a narrower point's width (FORMAT.md)
    import zarr
    g = zarr.open_group(url, path="stats/all", mode="r")
    mean = g["mean"][:]
    assert mean.shape == (3, 96) and np.isnan(mean[0, 24:]).all() and np.isfinite(mean[1]).all()
    v = r.verify(deep=True)
    assert v.ok, v.errors
    # logical bytes: each point at its own width
    ratio = r.attributes["compression_ratio"]
    assert ratio["logical_bytes"] == N * (24 + 96 + 24) * 2
    assert r.info()["widths"] == WIDTHS


def test_reader_yields_each_point_at_its_width_rows_aligned(mixed):
    url, x = mixed
    ds = ActivationDataset(url, POINTS, batch_size=512, shuffle=True, seed=3, return_meta=True)
    seen = 0
    for b in ds:
        acts = b["acts"]
        assert list(acts) == POINTS
        rows = b["row"].numpy()
        for i, p in enumerate(POINTS):
            assert acts[p].shape == (len(rows), WIDTHS[p])
            want = torch.from_numpy(x[i, rows, :WIDTHS[p]].view(np.int16)).view(torch.bfloat16)
            assert torch.equal(acts[p].view(torch.int16), want.view(torch.int16)), p
        seen += len(rows)
    assert seen == N
    # one width among the points asked: the stacked [batch, n_points, width] as before
    same = next(iter(ActivationDataset(url, ["mlp_in.1", "mlp_out.1"], batch_size=64)))
    assert same.shape == (64, 2, 24)
    one = next(iter(ActivationDataset(url, "mlp_act.1", batch_size=64)))
    assert one.shape == (64, 96)


def test_reader_normalises_each_point_at_its_own_width(mixed):
    url, _ = mixed
    ds = ActivationDataset(url, POINTS, batch_size=N, normalize="norm_scale", drop_last=False)
    b = next(iter(ds))
    c = ds.norm_constants
    for p in POINTS:
        t = b[p].double()
        ok = torch.isfinite(t).all(1)
        # E||x||^2 = the point's own width over the rows read (the constants' rows: nearly all)
        assert abs((t[ok] ** 2).sum(1).mean().item() / WIDTHS[p] - 1) < 0.05, p
    # the narrow points' constants past their width are the identity (shift 0, scale 1)
    assert torch.all(c.scale[0, 24:] == 1) and torch.all(c.shift[0, 24:] == 0)


def test_fp8_scale_per_point_row(tmp_path):
    x = _data(2)
    x[:, 5:7] = 0   # finite rows only: the fp8 reference is the numpy quantiser per point
    s = _make(str(tmp_path / "q.zarr"), dtype="float8_e4m3fn")
    synthetic.fill(s, x.astype(np.float32))
    from harvest.store.format import fp8
    r = open_store(str(tmp_path / "q.zarr"))
    for i, p in enumerate(POINTS):
        got = r.read(p, 0, N)
        assert got.shape == (N, WIDTHS[p] + 4)
        want = fp8.quantize(x[i, :, :WIDTHS[p]].astype(np.float32))
        assert np.array_equal(got, want), p   # its scale from its own columns only
    assert r.verify(deep=True).ok
    b = next(iter(ActivationDataset(str(tmp_path / "q.zarr"), POINTS, batch_size=N, shuffle=False)))
    for p in POINTS:
        np.testing.assert_array_equal(b[p].numpy(), fp8.dequantize(r.read(p, 0, N)))


def test_uniform_store_stays_layout_3_and_old_layouts_read(tmp_path):
    s = create_store(str(tmp_path / "u.zarr"), points=["resid_post.0"], width=W, n_rows=N,
                     shard_rows=SHARD, chunk_rows=CHUNK)
    assert s.layout_version == 3 and s.widths == {"resid_post.0": W} and not s.mixed_widths
    # a layout-3 store written before `widths` existed: no such attribute, every point `width`
    path = tmp_path / "u.zarr" / "zarr.json"
    meta = json.loads(path.read_text())
    del meta["attributes"]["harvest"]["widths"]
    path.write_text(json.dumps(meta))
    r = open_store(str(tmp_path / "u.zarr"))
    assert r.widths == {"resid_post.0": W} and r.row_width == W
    with pytest.raises(ValueError, match="widths names .*not in points"):
        create_store(str(tmp_path / "bad.zarr"), points=["a.0"], width=W, n_rows=N,
                     widths={"b.0": 3})
    with pytest.raises(ValueError, match=r"widths\['a.0'\] must be a positive int"):
        create_store(str(tmp_path / "bad2.zarr"), points=["a.0"], width=W, n_rows=N,
                     widths={"a.0": 0})

