"""The production path: 2 CPU actors each hosting a freeze-mode (compiled) vLLM engine.

Only one vLLM engine may run on the build machine at a time across engineers: run this file
under `flock /tmp/harvest-vllm.lock` (the two actors of this test count as one turn). Rows are
compared with the single-process eager capture of the same tokens within bf16 tolerance (the
backends use different kernels); a row from another token or layer would be off by > 30%.
"""

from __future__ import annotations

import pytest

from pipeline.driver import run
from pipeline.store import open_store
from tests.test_pipeline_support import check_store, make_cfg

REL_TOL = 0.03



def test_two_vllm_freeze_actors_match_single_process_eager(ray_cluster, tiny_llama, corpus,
                                                           reference, tmp_path):
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus, "model.backend=vllm",
                   "model.max_num_batched_tokens=256", "model.gpu_memory_utilization=0.1",
                   capture={"batch_contexts": 64})
    events = []
    summary = run(cfg, on_event=events.append)
    ready = next(e for e in events if e["event"] == "actors_ready")["actors"]
    assert [a["describe"]["mode"] for a in ready] == ["freeze", "freeze"]
    # the engines froze exactly the capture points, not every layer by default
    assert ready[0]["describe"]["frozen_reads"] == reference[0].points
    check_store(open_store(cfg.store.resolved_url), reference, rel_tol=REL_TOL)
    assert all(a["units"] > 0 for a in summary["per_actor"])
    assert summary["model"]["backend"] == "vllm"
