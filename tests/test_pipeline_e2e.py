"""End to end on a real local Ray cluster: 2 CPU actors, the tiny model, a local jsonl dataset,
into a local store and a SeaweedFS S3 store; rows equal a single-process eager capture."""

from __future__ import annotations

import pytest

from harvest.pipeline.driver import run
from harvest.pipeline.store import open_store
from tests.support.pipeline import check_store, make_cfg

pytestmark = pytest.mark.slow  # Ray + vLLM pipeline runs: not in `pytest -m 'not slow'`



def test_local_store_two_actors_matches_single_process(ray_cluster, tiny_llama, corpus, reference,
                                                       tmp_path):
    events = []
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus)
    summary = run(cfg, on_event=events.append)
    store = open_store(cfg.store.resolved_url)
    check_store(store, reference)
    prep = reference[0]
    assert summary["tokens"] == prep.packed.n_rows == summary["tokens_this_run"]
    assert summary["units_run"] == prep.n_units and summary["units_skipped"] == 0
    assert summary["compression_ratio"] and summary["compression_ratio"] > 1.0
    assert [a["index"] for a in summary["per_actor"]] == [0, 1]
    assert all(a["units"] > 0 for a in summary["per_actor"])  # both actors worked
    assert sum(a["tokens"] for a in summary["per_actor"]) == prep.packed.n_rows
    # skipped rows were counted, not fatal
    assert summary["data"]["rows_skipped"] >= 3
    assert store.summary["tokens"] == summary["tokens"]  # the summary is in the store
    done = [e for e in events if e["event"] == "unit_done"]
    assert sorted(e["unit_id"] for e in done) == prep.unit_ids

    # re-running the finished config is a no-op that says so, and writes nothing
    markers = store.committed_units()
    again = run(cfg)
    assert again["noop"] is True
    assert open_store(cfg.store.resolved_url).committed_units() == markers


def test_s3_store_two_actors_matches_single_process(ray_cluster, tiny_llama, corpus, reference,
                                                    seaweedfs, s3_url):
    cfg = make_cfg(tiny_llama, s3_url, corpus, storage_options=seaweedfs.storage_options)
    summary = run(cfg)
    store = open_store(s3_url, storage_options=seaweedfs.storage_options)
    check_store(store, reference)
    assert summary["units_run"] == reference[0].n_units
    assert seaweedfs.secret_key not in str(store.attrs) + str(store.summary)
