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


@pytest.mark.beside_engines
def test_every_splice_replaces_the_point_it_names(tiny_llama):
    """The spliced CE puts the SAE where its rows came from: an identity reconstruction leaves the
    loss as it is, a zero one changes it, at every point kind the study takes (a hook on the wrong
    module, or on its output instead of its input, would fail one of the two or the width)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(10, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    clean = bench_quant.cross_entropy(lm, ids)
    widths = {"mlp_act": lm.config.intermediate_size}
    for name in bench_quant.SPLICE:
        w = widths.get(name, lm.config.hidden_size)
        consts = SimpleNamespace(shift=torch.zeros(1, w), scale=torch.ones(1, w))
        seen = []

        def ident(x, seen=seen, w=w):
            assert x.shape[-1] == w
            seen.append(1)
            return x

        assert abs(bench_quant.cross_entropy(lm, ids, f"{name}.1", ident, consts) - clean) < 1e-5, name
        assert seen, name
        zero = bench_quant.cross_entropy(lm, ids, f"{name}.1", torch.zeros_like, consts)
        assert abs(zero - clean) > 1e-3, name


@pytest.mark.beside_engines
def test_dry_run_at_the_mlp_width(tiny_llama, tmp_path, capsys):
    """`--point mlp_act`: the study at the MLP's own width (a neuron-basis SAE's rows)."""
    bench_quant.main(["--dry", "--json", "--model", tiny_llama, "--root", str(tmp_path),
                      "--point", "mlp_act", "--saes", "topk", "--layers", "1"])
    res = json.loads(capsys.readouterr().out)
    assert res["points"] == ["mlp_act.1"] and res["saes"] == ["topk"]
    for name in ("bfloat16", "bfloat16_seed2", "float8_e4m3fn"):
        assert 0 < res[name]["fvu"] < 1.5 and res[name]["ce_spliced"] != res["ce_clean"]
    assert all(e["p99"] < 0.04 for e in res["store"]["row_rel_err"].values())
