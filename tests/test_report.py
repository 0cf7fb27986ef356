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
