"""`harvest report`: the picture's numbers are the store's numbers, recounted from the rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harvest.pipeline.cli import main
from harvest.pipeline.store import create_store, synthetic

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
    s.write_plan(s.default_plan(1))
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

    from harvest.pipeline.store import open_store
    from harvest.pipeline.views import inspect
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
