"""bench_codec's dry mode and its --store mode on a tiny store: every candidate measured in one
invocation and checked lossless, the default named, fp8 bytes measured beside (no timing asserted:
sizes are deterministic, CPU seconds are not)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harvest.benchmarks import bench_codec
from harvest.store import create_store
from harvest.testing import synthetic


def _check(res: dict) -> None:
    codecs = res["codecs"]
    assert res["default"] == "split-huffman" and res["baseline"] == "blosc-zstd"
    assert set(codecs) == set(bench_codec.CANDIDATES)
    for name, r in codecs.items():
        assert r["lossless"], name
        assert r["encode_core_s_per_gb"] > 0 and r["decode_gb_s_per_core"] > 0, name
    assert codecs["none"]["ratio"] == 1.0
    # the exponent bytes' entropy is all there is to win: split-huffman at least matches zstd-1
    assert codecs["split-huffman"]["ratio"] >= codecs["blosc-zstd"]["ratio"] > 1.1
    assert res["encode_speedup_vs_baseline"] > 0


def test_dry_mode_prints_every_candidate_as_json(capsys):
    assert bench_codec.main(["--dry", "--json", "--repeat", "1"]) == 0
    _check(json.loads(capsys.readouterr().out))


def test_store_mode_reads_the_store_rows_and_measures_fp8_bytes(tmp_path):
    x = synthetic.activations((2, 1024, 64), seed=4)
    s = create_store(str(tmp_path / "s.zarr"), points=["resid_post.0", "resid_post.1"], width=64,
                     n_rows=1024, chunk_rows=256)
    s.ledger.write_plan(s.ledger.default_plan())
    synthetic.fill(s, x, token_id=np.zeros(1024, np.int32))
    res = bench_codec.run(str(tmp_path / "s.zarr"), point="resid_post.1", rows=768, repeat=1, fp8=True)
    _check(res)
    assert res["rows"] == 768 and res["point"] == "resid_post.1" and res["chunk_rows"] == 256
    f8 = res["float8_e4m3fn"]["codecs"]
    assert all(r["lossless"] for r in f8.values())
    assert f8["none"]["ratio_vs_bf16"] == 2.0 and f8["split-huffman"]["ratio_vs_bf16"] > 2.0
    # the quantiser the fp8 figures assume: per-row absmax maps to 448 exactly
    q = bench_codec.fp8_bytes(x[1][:4])
    import ml_dtypes
    assert np.all(np.abs(q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)).max(axis=1) == 448.0)


def test_bench_dataplane_names_the_dtypes_it_knows_and_refuses_others():
    """The --dtype hook: a store dtype is accepted by its name, anything else refused before a
    store is made, naming the dtypes the store knows."""
    import pytest

    from harvest.benchmarks import bench_dataplane

    assert bench_dataplane.check_dtype("bfloat16") == "bfloat16"
    assert bench_dataplane.check_dtype("float8_e4m3fn") == "float8_e4m3fn"
    with pytest.raises(SystemExit, match=r"--dtype 'float8_e5m2'.*bfloat16"):
        bench_dataplane.check_dtype("float8_e5m2")
    with pytest.raises(SystemExit, match="--codec 'lzma'"):
        bench_dataplane.run(units=1, storage=(), codecs=("lzma",))


def test_bench_dataplane_stage_cpu_counts_the_write_stages_and_unwraps(tmp_path):
    from harvest.benchmarks.bench_dataplane import StageCPU
    from harvest.store.format import shardcodec

    before = shardcodec.ShardCodec._encode_chunk
    x = synthetic.activations((2, 1024, 64), seed=5)
    s = create_store(str(tmp_path / "d.zarr"), points=["resid_post.0", "resid_post.1"], width=64,
                     n_rows=1024, chunk_rows=256)
    s.ledger.write_plan(s.ledger.default_plan())
    with StageCPU() as st:
        synthetic.fill(s, x, token_id=np.zeros(1024, np.int32))
    assert {"encode", "stats", "crc", "stream", "buffer"} <= set(st.cpu)
    assert shardcodec.ShardCodec._encode_chunk is before
    assert np.array_equal(s.read("resid_post.1", 0, 1024).view(np.uint16), x[1].view(np.uint16))


def test_bench_dataplane_dry_writes_bf16_and_fp8_side_by_side_by_stage(tmp_path):
    """The dry mode (a tiny shape, local): a bf16 and an fp8 store from the same rows, written in
    place as the capture actor does (no `buffer` copy stage), each verified, with the write
    path's CPU by stage; the fp8 store holds under half the bf16 store's bytes of bf16 input."""
    from harvest.benchmarks import bench_dataplane

    rows = bench_dataplane.run(units=1, storage=("local",), dtype=["bfloat16", "float8_e4m3fn"],
                               dry=True, workdir=str(tmp_path))
    bf, f8 = rows
    assert (bf["dtype"], f8["dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert bf["codec"] == {"codec": "split-huffman"} and f8["codec"]["codec"] == "zstd"
    for r in rows:
        assert r["verify_ok"] and r["producer"] == "in place (reserve)"
        st = r["write_core_s_per_gb_by_stage"]
        assert {"encode", "stats", "crc", "stream", "other"} <= set(st) and "buffer" not in st
        assert r["write_core_s_per_gb"] > 0
    assert f8["stored_vs_bf16"] < 0.5 < bf["stored_vs_bf16"] < 0.8
    s = bench_dataplane.summary(rows)
    assert s["targets"] == {} and len(s["load_average"]) == 3   # targets are S3's


def test_bench_dataplane_floor_dry_sums_each_stage_alone(tmp_path):
    """`--floor`: each write-path stage alone in one thread (codec, statistics, raw CRC; no S3
    here), in core-s per GB of bf16 input; the floor is their sum, `without_stats` leaves the
    statistics out, and the stored bytes are the codec's own (fp8 under half of bf16's)."""
    from harvest.benchmarks import bench_dataplane

    out = bench_dataplane.floor(storage=("local",), dry=True, workdir=str(tmp_path),
                                codecs=("default", "none"))
    assert set(out["dtypes"]) == {"bfloat16", "bfloat16/none", "float8_e4m3fn", "float8_e4m3fn/none"}
    bf, f8 = out["dtypes"]["bfloat16"], out["dtypes"]["float8_e4m3fn"]
    assert out["dtypes"]["bfloat16/none"]["stored_vs_bf16"] >= 1.0   # raw chunks, as written
    for d in out["dtypes"].values():
        st = d["core_s_per_gb"]
        assert set(st) == {"encode", "stats", "crc"} and all(v > 0 for v in st.values())
        assert d["floor"] == pytest.approx(sum(st.values()), abs=0.002)
        assert d["without_stats"] == pytest.approx(d["floor"] - st["stats"], abs=0.002)
    assert (bf["target"], f8["target"]) == (1.0, 0.6)
    assert f8["stored_vs_bf16"] < 0.5 < bf["stored_vs_bf16"] < 0.8
