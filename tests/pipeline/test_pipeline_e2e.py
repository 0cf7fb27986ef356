"""End to end on a real local Ray cluster: 2 CPU actors, the tiny model, a local jsonl dataset,
into a local store and a SeaweedFS S3 store; rows equal a single-process eager capture."""

from __future__ import annotations

import pytest

from harvest.pipeline.driver.run import run
from harvest.store import open_store
from tests.support.pipeline import check_store, make_cfg

# Ray pipeline runs (the eager backend): not in `pytest -m 'not slow'`; beside the vLLM engine tests
pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]



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
    markers = store.ledger.committed_units()
    again = run(cfg)
    assert again["noop"] is True
    assert open_store(cfg.store.resolved_url).ledger.committed_units() == markers


def test_s3_store_two_actors_matches_single_process_then_survives_a_lifecycle_abort(
        ray_cluster, tiny_llama, corpus, reference, seaweedfs, s3_url, capsys, monkeypatch):
    """A clean S3 run matches the reference; then (issue 37 item 1) the store a driver leaves
    when it dies between four units' markers and the completion of their uploads, after a
    bucket lifecycle rule aborted those uploads: markers and tables there, no object at the
    units' keys, no upload outstanding, no publish record, not finalized (tests/
    test_store_publish.py makes the same state with a writer stopped before its completion and
    the S3 API's AbortMultipartUpload). `verify` refuses, naming the units gone; the re-run of
    the same config re-captures exactly those units and the store equals the reference."""
    from harvest.pipeline.cli.main import main
    from harvest.store.format import layout
    from harvest.store.commit.finalize import unfinalize
    from harvest.store.commit.published import unit_objects

    so = seaweedfs.storage_options
    cfg = make_cfg(tiny_llama, s3_url, corpus, storage_options=so)
    summary = run(cfg)
    store = open_store(s3_url, storage_options=so)
    check_store(store, reference)
    assert summary["units_run"] == reference[0].n_units
    assert seaweedfs.secret_key not in str(store.attrs) + str(store.summary)

    lost = [1, 6, 11, 20]
    unfinalize(store, cfg.packing.max_tokens)            # the dead driver never finalized
    for m in store.ledger.iter_committed():
        if m.unit_id in lost:
            for o in unit_objects(store, m):
                store.location.delete(o.final)
            store.location.delete(layout.published_key(m.unit_id, m.attempt))
    for k, v in seaweedfs.env.items():                  # the CLI reads credentials from AWS_*
        monkeypatch.setenv(k, v)
    assert main(["verify", s3_url]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "4 committed units are not published" in out
    for u in lost[:4]:
        assert f"unit {u}: gone" in out and f"--unit {u}`" in out
    again = run(cfg)
    assert again["units_run"] == len(lost) and again["units_skipped"] == reference[0].n_units - 4
    check_store(open_store(s3_url, storage_options=so), reference)
    assert main(["verify", s3_url]) == 0


def test_a_storm_of_503_slowdown_costs_retries_not_units(ray_cluster, tiny_llama, corpus,
                                                         reference, seaweedfs, s3_url):
    """A quarter of every write request (commit markers, tables, parts, completions, the lease,
    the plan) answered 503 SlowDown, as S3 answers many writers on one prefix, by a proxy in
    front of the S3 server (testing/throttle_proxy.py): the run succeeds with rows equal to the
    single-process reference, no unit is captured twice (each throttled request was retried
    after the process's shared backoff), and the summary counts the throttled requests."""
    from harvest.testing.throttle_proxy import ThrottleProxy

    with ThrottleProxy(seaweedfs.endpoint, share=0.25, seed=1) as proxy:
        so = {**seaweedfs.storage_options,
              "client_kwargs": {**seaweedfs.storage_options.get("client_kwargs", {}),
                                "endpoint_url": proxy.endpoint}}
        summary = run(make_cfg(tiny_llama, s3_url, corpus, storage_options=so))
        throttled = proxy.counts["throttled"]
    print("storm:", proxy.counts, "throttled_requests", summary["throttled_requests"],
          "wall_seconds", summary["wall_seconds"])
    assert throttled >= 20, proxy.counts
    assert summary["unit_retries"] == 0 and summary["units_run"] == reference[0].n_units, summary
    assert summary["throttled_requests"] >= throttled * 0.5, (summary["throttled_requests"],
                                                              proxy.counts)
    check_store(open_store(s3_url, storage_options=seaweedfs.storage_options), reference)
