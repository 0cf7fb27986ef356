"""`harvest report`: the picture's numbers are the store's numbers, recounted from the rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harvest.pipeline.cli.main import main
from harvest.store import create_store
from harvest.testing import synthetic

P, W, N, SHARD = 3, 32, 3000, 512   # 6 shards, the last one partial


@pytest.fixture(scope="module")
def store_and_data(tmp_path_factory):
    data = synthetic.activations((P, N, W), seed=5)
    # one planted outlier row per point, in a shard the report samples (the first), so the
    # largest-norm row is known without trusting the report's own search
    data[:, 7, :] = (np.float32(300.0) * np.ones(W, np.float32)).astype(data.dtype)
    s = create_store(str(tmp_path_factory.mktemp("rep") / "s.zarr"),
                     points=["resid_post.0", "resid_post.1", "resid_post.2"],
                     width=W, n_rows=N, shard_rows=SHARD, chunk_rows=128)
    s.ledger.write_plan(s.ledger.default_plan(1))
    synthetic.fill(s, data, token_id=(np.arange(N) % 400 + 3).astype(np.int32),
                   doc_id=np.arange(N) // 100, position=np.arange(N) % 100)
    return s, data


def test_report_numbers_match_a_recount_of_the_rows(store_and_data, tmp_path, capsys):
    store, data = store_and_data
    out = tmp_path / "rep"
    assert main(["report", store.url, "--out", str(out)]) == 0
    assert "report.png" in capsys.readouterr().out
    rep = json.loads((out / "report.json").read_text())
    x = data.astype(np.float64)
    for i, p in enumerate(rep["points"]):
        assert p["point"] == f"resid_post.{i}" and p["layer"] == i
        rms = np.sqrt((x[i] ** 2).sum(axis=1).mean())
        assert p["rms_norm"] == pytest.approx(rms, rel=1e-9)
        var = x[i].var(axis=0)
        assert p["var_max"] == pytest.approx(var.max(), rel=1e-9)
        assert p["var_argmax"] == int(var.argmax())
        top = rep["top_rows"][p["point"]][0]
        assert top["row"] == 7 and top["token_id"] == 10 and top["position"] == 7
        assert top["norm"] == pytest.approx(np.linalg.norm(x[i, 7]), rel=1e-6)
        assert p["compression"] and p["compression"] > 0.9
    assert rep["committed_rows"] == N and rep["throughput"][-1][1] == N
    import matplotlib.image

    img = matplotlib.image.imread(out / "report.png")
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and "resid_post.2" in page


def test_report_of_a_store_that_does_not_exist_is_a_one_line_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no store at" in capsys.readouterr().err


def test_report_and_inspect_read_an_unpublished_units_metadata(store_and_data, tmp_path):
    """A writer killed between marker and publish leaves unit 0 (row 7, the planted outlier)
    under its attempt's name: plain zarr reads its token ids as fill; the report and inspect
    take them checked, as the rows are."""
    import shutil

    from harvest.store import open_store
    from harvest.store.inspect import inspect
    from tests.support.reader_stores import unpublish

    src, data = store_and_data
    path = str(tmp_path / "u.zarr")
    shutil.copytree(src.url, path)
    assert unpublish(open_store(path), [0]) > 0
    assert (open_store(path).read_row_meta(5, 9)[0] == -1).all()   # zarr sees fill: -1
    out = tmp_path / "rep"
    assert main(["report", path, "--out", str(out)]) == 0
    top = json.loads((out / "report.json").read_text())["top_rows"]["resid_post.0"][0]
    assert (top["row"], top["token_id"], top["doc_id"], top["position"]) == (7, 10, 0, 7)
    rows = inspect(path, rows=(5, 9))["rows"]
    assert rows["token_id"] == [8, 9, 10, 11] and rows["position"] == [5, 6, 7, 8]
    x = data[0, 5:9].astype(np.float64)
    np.testing.assert_allclose(rows["norms"]["resid_post.0"], np.linalg.norm(x, axis=1), atol=1e-3)


def test_report_shows_kept_rows_not_the_bos_sink(tmp_path):
    """Every context starts with BOS (token 1) whose row is a sink (|x| ~ 1e4, as on Qwen-style
    models): the report's plain figures are the kept rows' (recounted here), the all-rows ones
    are labelled apart, BOS never tops the token list but is named as the largest excluded row;
    a dimension held at 0 is dead and one with 1000x the variance an outlier."""
    C, n = 64, 2048
    data = synthetic.activations((1, n, W), seed=9).astype(np.float32)
    data[0, :, 3] = 0.0                                   # dead
    data[0, :, 5] *= 40.0                                 # outlier: 1600x the variance
    tok = (np.arange(n) % 300 + 10).astype(np.int32)
    tok[::C] = 1                                          # BOS at every context start
    data[0, ::C, :] = 1e4 / np.sqrt(W)                    # the sink
    s = create_store(str(tmp_path / "b.zarr"), points=["resid_post.0"], width=W, n_rows=n,
                     shard_rows=512, chunk_rows=128, dtype="float32", context_size=C,
                     special_token_ids=[1], bos_token_id=1)
    s.ledger.write_plan(s.ledger.default_plan(1))
    synthetic.fill(s, data, token_id=tok, doc_id=np.arange(n) // 500,
                   position=np.arange(n) % 500)
    out = tmp_path / "rep"
    assert main(["report", s.url, "--out", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    p = rep["points"][0]
    x = data[0].astype(np.float64)
    keep = tok != 1
    assert rep["subset"] == "kept" and p["count"] == keep.sum() and p["count_all"] == n
    assert p["rms_norm"] == pytest.approx(np.sqrt((x[keep] ** 2).sum(1).mean()), rel=1e-6)
    assert p["rms_norm_all"] == pytest.approx(np.sqrt((x ** 2).sum(1).mean()), rel=1e-6)
    assert p["rms_norm_all"] > 10 * p["rms_norm"]         # what the old report showed
    assert p["var_max"] == pytest.approx(x[keep].var(0).max(), rel=1e-6)
    v = x[keep].var(0)
    assert p["var_argmax"] == 5 and p["outliers"][0]["dim"] == 5
    assert p["outlier_dims"] == int((v >= 100 * np.median(v)).sum())   # a recount of the rule
    assert p["dead_dims"] == 1 and p["dead_first"] == [3]
    tops = rep["top_rows"]["resid_post.0"]
    assert tops and all(e["token_id"] != 1 for e in tops)
    kn = np.linalg.norm(x, axis=1)
    assert tops[0]["norm"] == pytest.approx(kn[keep].max(), rel=1e-5)
    assert rep["excluded_top"]["resid_post.0"]["token_id"] == 1
    assert sum(rep["norm_hist"]["resid_post.0"]["counts"]) == keep.sum()  # every shard sampled
    page = (out / "report.html").read_text()
    assert "RMS norm, all rows" in page and "largest excluded row" in page
