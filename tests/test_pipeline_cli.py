"""`harvest plan|status|verify|inspect` on a store left half done, read from the store alone.

The half-done store is what a driver interrupted after three commits leaves behind: the real
driver on the test cluster, stopped from its event hook (markers of units that committed while it
was being torn down are dropped, as if the driver had been killed a moment earlier).
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from pipeline.cli import main
from pipeline.driver import run
from pipeline.store import open_store
from tests.test_pipeline_support import make_cfg, reference_rows, shared_corpus


class _Stop(Exception):
    pass


def _json(out: str):
    """The command's JSON, without log lines Ray's log monitor may print in the same stream."""
    return json.loads(out[out.index("{\n"):])


def _interrupted_run(cfg, after: int) -> None:
    """Run until `after` units are committed, then stop the driver; keep exactly those units."""
    done: list = []

    def hook(e):
        if e["event"] == "unit_done" and e["status"] == "committed":
            done.append(e["unit_id"])
            if len(done) == after:
                raise _Stop()

    with pytest.raises(_Stop):
        run(cfg, on_event=hook)
    time.sleep(2)  # the killed actor's in-flight units are refused now, not during the checks
    store = open_store(cfg.store.resolved_url)
    for n in store.marker_names():
        if n.unit_id not in done:
            store.uncommit(n.unit_id)
    return sorted(done)


@pytest.fixture(scope="module")
def half_done(ray_cluster, tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    corpus = shared_corpus(tmp_path_factory.mktemp("corpus"))
    cfg = make_cfg(tiny_llama, str(tmp / "store"), corpus, "packing.max_tokens=2048",
                   "ray.num_actors=1")
    done = _interrupted_run(cfg, 3)
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(redact=False)))
    return cfg, done, path


def test_plan_prints_the_layout_without_running(half_done, capsys):
    cfg, done, path = half_done
    assert main(["plan", "--config", str(path)]) == 0
    out = _json(capsys.readouterr().out)
    assert out["store_exists"] is True and out["plan_complete"] is True
    assert out["planned_units"] == 8 and out["planned_tokens"] == 2048 and out["max_units"] == 8
    assert out["unit_rows"] == out["shard_rows"] == 256 and out["blocks"] == 1


def test_status_of_an_interrupted_store(half_done, capsys):
    cfg, done, path = half_done
    missing = [u for u in range(8) if u not in done]
    assert main(["status", cfg.store.resolved_url]) == 0
    out = capsys.readouterr().out
    assert "3/8 units, 768/2048 rows (37.5%), in progress or interrupted" in out
    assert f"uncommitted units: {missing}" in out
    assert main(["status", "--config", str(path), "--json"]) == 0
    s = _json(capsys.readouterr().out)
    assert s["committed_units"] == 3 and s["finalized"] is False


def test_verify_fails_until_complete_and_inspect_shows_rows(half_done, capsys):
    cfg, done, path = half_done
    missing = [u for u in range(8) if u not in done]
    assert main(["verify", cfg.store.resolved_url]) == 1
    assert "INCOMPLETE: 3/8 units, 768/2048 rows committed" in capsys.readouterr().out
    assert main(["verify", cfg.store.resolved_url, "--json"]) == 1
    v = _json(capsys.readouterr().out)
    assert not v["complete"] and v["missing_units"] == missing
    first = 256 * done[0]
    assert main(["inspect", cfg.store.resolved_url, "--rows", f"{first}:{first + 4}"]) == 0
    out = _json(capsys.readouterr().out)
    ref = reference_rows(cfg)
    assert out["rows"]["token_id"] == ref.token_ids[first:first + 4].tolist()
    assert out["rows"]["doc_id"][0] == -2 and out["rows"]["position"][0] == -2  # inserted BOS
    assert out["rows"]["text"][0] == "<|bos|>"
    assert len(out["rows"]["norms"]["resid_post.0"]) == 4
    assert out["context_size"] == 32 and out["bos_token_id"] == ref.token_ids[0]


def test_resume_with_another_config_is_refused_and_changes_nothing(half_done, tiny_llama):
    from pipeline.driver import ResumeMismatch

    cfg, done, path = half_done
    before = open_store(cfg.store.resolved_url).committed_units()
    other = make_cfg(tiny_llama, cfg.store.url, cfg.data.source, "packing.max_tokens=2048",
                     "packing.bos=none")
    with pytest.raises(ResumeMismatch, match=r"packing.bos: the store has 'context', this config "
                                             r"says 'none'.*use the original config, or a new store.url"):
        run(other)
    points = make_cfg(tiny_llama, cfg.store.url, cfg.data.source, "packing.max_tokens=2048",
                      capture={"points": ["resid_post.1"]})
    with pytest.raises(ResumeMismatch, match=r"capture.points"):
        run(points)
    assert open_store(cfg.store.resolved_url).committed_units() == before


def test_all_committed_but_not_finalized_is_finished_without_actors(ray_cluster, tiny_llama,
                                                                     tmp_path):
    """The driver died after the last commit: a re-run verifies and finalizes, starting nothing."""
    corpus = shared_corpus(tmp_path / "corpus")
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus, "packing.max_tokens=1024")
    assert _interrupted_run(cfg, 4) == [0, 1, 2, 3]
    assert open_store(cfg.store.resolved_url).summary is None
    events: list[dict] = []
    s = run(cfg, on_event=events.append)
    assert not [e for e in events if e["event"] == "actors_ready"] and s["per_actor"] == []
    assert s["units_skipped"] == 4 and s["tokens_this_run"] == 0
    assert s["verified"]["ok"] and open_store(cfg.store.resolved_url).summary["tokens"] == 1024
    assert run(cfg)["noop"] is True
