"""The production path: 2 CPU actors each hosting a freeze-mode (compiled) vLLM engine.

Only one vLLM engine may run on the build machine at a time across engineers: run this file
under `flock /tmp/harvest-vllm.lock` (the two actors of this test count as one turn). Rows are
compared with the single-process eager capture of the same tokens within bf16 tolerance (the
backends use different kernels); a row from another token or layer would be off by > 30%.
"""

from __future__ import annotations

import numpy as np
import pytest

from harvest.pipeline.driver.run import run
from harvest.store import open_store
from tests.support import runners
from tests.support.pipeline import EAGER_VLLM, check_store, make_cfg

pytestmark = pytest.mark.slow  # Ray + vLLM pipeline runs: not in `pytest -m 'not slow'`

REL_TOL = 0.03



@pytest.mark.parametrize("runner", runners.RUNNERS)
def test_two_vllm_freeze_actors_match_single_process_eager(ray_cluster, tiny_llama, corpus,
                                                           reference, tmp_path, runner):
    """On both of vLLM's model runners: HARVEST_MODEL_RUNNER reaches the actors, and the store's
    provenance says which runner computed its rows."""
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus, "model.backend=vllm",
                   "model.max_num_batched_tokens=256", "model.gpu_memory_utilization=0.1",
                   capture={"batch_contexts": 64})
    events = []
    with runners.model_runner(runner):
        summary = run(cfg, on_event=events.append)
    ready = next(e for e in events if e["event"] == "actors_ready")["actors"]
    assert [a["describe"]["mode"] for a in ready] == ["freeze", "freeze"]
    assert [a["describe"]["model_runner"] for a in ready] == [runner, runner]
    engine = open_store(cfg.store.resolved_url).attrs["provenance"]["engine"]
    assert engine["model_runner"] == runner and engine["backend"] == "vllm", engine
    # the engines froze exactly the capture points, not every layer by default
    assert ready[0]["describe"]["frozen_reads"] == reference[0].points
    store = open_store(cfg.store.resolved_url)
    check_store(store, reference, rel_tol=REL_TOL)
    assert all(a["units"] > 0 for a in summary["per_actor"])
    assert summary["model"]["backend"] == "vllm"
    # one host copy: every row went from the tap buffer straight into a writer's shard buffer
    assert sum(a["rows_in_place"] for a in summary["per_actor"]) == summary["tokens"]
    # actor 0 checked its engine against HF fp32 before anything was written, and said so
    check = store.attrs["model_check"]
    assert check["ok"] and set(check["points"]) == set(reference[0].points), check


def test_engine_steps_stay_full_where_units_were_one_context(ray_cluster, tiny_llama, corpus,
                                                            reference, tmp_path):
    """Shards of one context each, as the old policy chose when 128 MiB of shards held one context
    (an 8 B model, all layers). Units were one shard, so each capture() call held one context and
    filled 32 of a 256-token step. Units now span many shards and one capture stream runs across
    units: the steps stay full. The run also stores a transcoder's pair and the MLP's hidden
    units (mlp_act, wider than the stream) beside resid_post, and attention's keys (one KV
    head: narrower than the stream) with the gated MLP's linear branch: points of several widths
    go straight from the engine's tap buffer into the writers' buffers, each stored at its own."""
    from tests.support.pipeline import reference_capture

    extra = ["mlp_in.1", "mlp_act.1", "mlp_out.1", "k.2", "mlp_pre_linear.0"]
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus, "model.backend=vllm",
                   "model.max_num_batched_tokens=256", "model.gpu_memory_utilization=0.1",
                   "ray.num_actors=1", "store.shard_rows=32", "store.unit_shards=null", EAGER_VLLM,
                   capture={"points": reference[0].points + extra})
    summary = run(cfg)
    [actor] = summary["per_actor"]
    assert summary["units"] == actor["units"] >= 4  # several units, each of many one-context shards
    store = open_store(cfg.store.resolved_url)
    assert store.shard_rows == 32
    assert actor["steps"] >= 6144 // 256 and actor["step_fill"] >= 0.9, actor
    assert actor["rows_in_place"] == summary["tokens"]   # one host copy, mixed widths too
    assert store.mixed_widths and store.widths["mlp_act.1"] > store.width == store.widths["mlp_in.1"]
    assert store.widths["k.2"] == 64 and store.widths["mlp_pre_linear.0"] == 256
    ref, acts = reference
    more = reference_capture(tiny_llama, ref.packed.token_ids, ref.packed.context_size,
                             ref.unit_rows, 4, extra)
    check_store(store, (ref, {**acts, **more}), rel_tol=REL_TOL)
    # the training reader serves the new points at their own widths, from the stored rows
    from harvest.store.read.dataset import ActivationDataset

    both = next(iter(ActivationDataset(cfg.store.resolved_url, ["k.2", "mlp_pre_linear.0"],
                                       batch_size=32, shuffle=False)))
    assert both["k.2"].shape == (32, 64) and both["mlp_pre_linear.0"].shape == (32, 256)
    # the load-time check compared every stored point, the wider one included, with HF fp32
    check = store.attrs["model_check"]
    assert check["ok"] and set(check["points"]) == set(store.points), check


def test_fp8_store_quantised_in_the_engine(ray_cluster, tiny_llama, corpus, reference, tmp_path):
    """store.dtype: float8_e4m3fn on the production path: the engine quantises each step's rows
    before they leave it, straight into the writers' packed buffers. Rows are the eager bf16
    reference of the same corpus within bf16-across-backends plus fp8 error, statistics are those
    of the dequantised rows, verify --deep passes, and a resume asking for bf16 is refused."""
    from harvest.pipeline.errors import ResumeMismatch
    from harvest.store.format import fp8
    from tests.support.pipeline import make_cfg as cfg_of

    url = str(tmp_path / "store")
    cfg = cfg_of(tiny_llama, url, corpus, "model.backend=vllm", "model.max_num_batched_tokens=256",
                 "model.gpu_memory_utilization=0.1", "ray.num_actors=1",
                 "store.dtype=float8_e4m3fn", "capture.check_model=false",  # rows checked below
                 capture={"batch_contexts": 64})
    summary = run(cfg)
    store = open_store(url)
    assert store.dtype == "float8_e4m3fn" and store.compression["codec"] == "zstd"
    assert sum(a["rows_in_place"] for a in summary["per_actor"]) == summary["tokens"]
    v = store.verify(deep=True)
    assert v.ok and not v.missing_units, v.errors
    ref, acts = reference
    tok, _, _ = store.read_row_meta(0, store.n_rows)
    assert np.array_equal(tok, ref.packed.token_ids)
    stats = store.stats()
    for p in store.points:
        packed = store.read(p, 0, store.n_rows)
        assert packed.shape == (store.n_rows, store.width + 4)
        got, want = fp8.dequantize(packed), acts[p].astype(np.float32)
        err = np.linalg.norm(got - want, axis=1) / (np.linalg.norm(want, axis=1) + 1e-12)
        assert err.max() < REL_TOL + 0.04, (p, float(err.max()))
        np.testing.assert_allclose(stats[p]["mean"], got.astype(np.float64).mean(0), rtol=1e-9,
                                   atol=1e-9)
    again = cfg_of(tiny_llama, url, corpus, "model.backend=vllm", "ray.num_actors=1")
    with pytest.raises(ResumeMismatch, match="store.dtype"):
        run(again)
