"""bench_quant's dry mode on the tiny model: one invocation trains the three SAEs of each kind (TopK, ReLU) per point on a
bf16 and an fp8 store of the same capture and reports every figure the quick/full runs do."""

from __future__ import annotations

import json

import pytest

from harvest.benchmarks import bench_quant


@pytest.mark.beside_engines  # the eager HF backend and SAEs in this process: no vLLM, no Ray
def test_dry_run_reports_every_figure(tiny_llama, tmp_path, capsys):
    bench_quant.main(["--dry", "--json", "--model", tiny_llama, "--root", str(tmp_path)])
    res = json.loads(capsys.readouterr().out)
    for name in ("bfloat16", "bfloat16_seed2", "float8_e4m3fn"):
        r = res[name]
        for key in ("fvu", "l0", "dead", "ce_spliced"):
            assert isinstance(r[key], float), (name, key)
        assert set(r["per_layer"]) == set(res["points"]) and len(res["points"]) == 3
        assert 0 < r["fvu"] < 1.5 and 0 <= r["dead"] <= 1 and r["l0"] <= res["settings"]["k"]
    # same seed, same batches: the fp8 SAE differs from the bf16 one only through the rows
    assert res["bfloat16"]["fvu"] != res["float8_e4m3fn"]["fvu"]
    assert set(res["verdict"]) == set(res["points"]) and isinstance(res["fvu_ok"], bool)
    st = res["store"]
    assert 0.4 < st["fp8_over_bf16"] <= 0.65
    assert all(e["p99"] < 0.04 for e in st["row_rel_err"].values())
    assert res["ce_clean"] > 0
    assert "fp8 - bf16 fvu" in bench_quant.table(res)
    # the second SAE kind: the same figures, its own verdict; an L1 SAE is not held to k
    relu = res["relu"]
    for name in ("bfloat16", "bfloat16_seed2", "float8_e4m3fn"):
        r = relu[name]
        assert all(isinstance(r[key], float) for key in ("fvu", "l0", "dead", "ce_spliced")), name
        assert 0 < r["fvu"] < 1.5 and 0 <= r["dead"] <= 1 and r["l0"] > 0
    assert relu["bfloat16"]["fvu"] != res["bfloat16"]["fvu"]
    assert set(relu["verdict"]) == set(res["points"]) and res["saes"] == ["topk", "relu"]
    assert bench_quant.markdown(res).count("| resid_post.") == 2 * (3 * 3 + 3)
