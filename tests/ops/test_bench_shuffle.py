"""bench_shuffle on a tiny store: one invocation reports both speed ratios, the worker figures
and the shuffle quality, with each worker's decoded rows recounted (no timing asserted)."""

from __future__ import annotations

from harvest.benchmarks import bench_shuffle


def test_one_run_reports_both_ratios_and_worker_figures(tmp_path):
    rows = 1 << 15
    res = bench_shuffle.run(rows=rows, repeats=1, root=str(tmp_path), epochs=2, speed_only=True)
    sp = res["speed"]
    for key in ("vs_raw_decode", "vs_zarr_decode", "cpu_vs_raw_decode", "cpu_vs_decode_plus_gather"):
        assert sp["new"][key] > 0, key
    w2 = sp["new/2w"]
    assert w2["vs_no_workers"] > 0 and w2["cpu_s_per_row"] > 0
    # each of the 2 workers decodes exactly its half of every epoch (2 shards: the split between
    # the workers falls on the shard edge, so neither reads the other's)
    assert res["shards"] == 2 and w2["rows_per_epoch"] == rows
    assert w2["decoded_rows_per_worker_per_epoch"] == [rows / 2, rows / 2]
    assert len(w2["worker_rss_mb"]) == 2 and all(len(r) == 2 and min(r) > 0 for r in w2["worker_private_mb"])
    h = res["handoff"]   # the hand-off alone, both paths measured in the same run
    assert h["width"] == 576 and h["slots"]["gb_per_s"] > 0 and h["torch"]["cpu_us_per_row"] > 0
    assert len(h["slots"]["runs_us"]) == len(h["torch"]["runs_us"]) == 1
    text = bench_shuffle.summary(res)
    assert "raw decode" in text and "zarr-python" in text and "no workers on" in text
    assert "hand-off worker -> trainer" in text
