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
    assert "hand-off worker -> trainer" in text and "global shuffle:" in text and "epochs in turn" in text
    wp = res["workers_paired"]   # 2 workers (slots, torch) and none, one epoch each per repeat
    assert wp["slots_vs_none"] > 0 and wp["torch_vs_none"] > 0 and len(wp["runs"]["slots"]) == 1
    # global against the window shuffle at a quarter-store buffer: 4 blocks, each reading both
    # shards, so it decodes 4x the rows (recounted by the datasets' own decoded_rows)
    assert sp["global/4"]["decoded_vs_window"] == 4.0 and sp["global"]["decoded_vs_window"] == 1.0
    assert sp["global/4"]["vs_window"] > 0


def test_shape_quality_reports_default_and_global_against_the_ideal(tmp_path, monkeypatch):
    """The 8B-shape figure on a miniature of its layout: 4 windows of 4 shards (the default
    buffer shrunk with the batch), default and global modes by describe(), against the ideal
    uniform draw measured by permutation; global is a uniform draw by construction."""
    monkeypatch.setattr(bench_shuffle, "BATCH", 256)
    monkeypatch.setattr(bench_shuffle, "SHAPES", {"tiny": (4096, 512)})
    monkeypatch.setattr(bench_shuffle, "_BUFFER_BYTES", 2048 * 4096 * 2)
    r = bench_shuffle.shape_quality(str(tmp_path), "tiny", batches=8)
    assert r["shards"] == 16 and r["buffer_rows"] == 2048 and r["windows"] == 4
    assert r["memory_mib"]["window"] == 2 * 4 * 4 and r["memory_mib"]["global"] == 16 + 4 * 4
    for k in ("default/1w", "default/2w", "global/1w", "global/2w"):
        assert r[k]["simulated"]["batches"] == 8 and r[k]["vs_ideal"] > 0
    assert r["global/1w"]["vs_uniform"] == 1.0 and r["global/1w"]["vs_ideal"] > 0.9
    assert r["default/1w"]["vs_ideal"] < r["global/1w"]["vs_ideal"]
    assert r["global/1w"]["shard_reads_vs_window"] > 1 and r["default/1w"]["shard_reads_vs_window"] == 1
    # the default options on a shuffled copy (harvest shuffle): a uniform draw, one read an epoch
    for k in ("shuffled_copy/1w", "shuffled_copy/2w"):
        assert r[k]["vs_ideal"] >= 0.9 and r[k]["shard_reads_vs_window"] == 1
    assert r["default/1w"]["vs_ideal"] < 0.8 and r["shuffle_s"] > 0
    text = \
        bench_shuffle._shape_lines({"shapes": {"tiny": r}})[0]
    assert "tiny layout (width 4096" in text and "memory per process" in text
