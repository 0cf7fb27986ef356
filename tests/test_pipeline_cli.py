"""`harvest plan|status|verify|inspect` on a store left half done, read from the store alone.

The half-done store is made with the driver's own pieces and one in-process actor (no Ray): the
same store a killed job leaves behind.
"""

from __future__ import annotations

import json

import pytest
import yaml

from pipeline.actor import HarvestActor
from pipeline.cli import main
from pipeline.driver import _create, actor_spec, prepare
from tests.test_pipeline_support import make_cfg, shared_corpus


@pytest.fixture(scope="module")
def half_done(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    corpus = shared_corpus(tmp_path_factory.mktemp("corpus"))
    cfg = make_cfg(tiny_llama, str(tmp / "store"), corpus, "packing.max_tokens=2048")
    prep = prepare(cfg)
    actor = HarvestActor(actor_spec(cfg, prep, 0))
    _create(cfg, prep, actor.info(), overwrite=False)
    for u in prep.units[:3]:
        assert actor.run_unit(u.as_dict())["status"] == "committed"
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(redact=False)))
    return cfg, prep, path


def test_plan_prints_the_layout_without_running(half_done, capsys):
    cfg, prep, path = half_done
    assert main(["plan", "--config", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["store_exists"] is True
    assert out["units"] == len(prep.units) == 8 and out["tokens"] == 2048
    assert out["tokens_sha256"] == prep.packed.tokens_sha256()


def test_status_of_an_interrupted_store(half_done, capsys):
    cfg, prep, path = half_done
    assert main(["status", cfg.store.resolved_url]) == 0
    out = capsys.readouterr().out
    assert "3/8 units, 768/2048 rows (37.5%), in progress or interrupted" in out
    assert "uncommitted units: [3, 4, 5, 6, 7]" in out
    assert main(["status", "--config", str(path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["committed_units"] == 3 and s["finalized"] is False


def test_verify_fails_until_complete_and_inspect_shows_rows(half_done, capsys):
    cfg, prep, path = half_done
    assert main(["verify", cfg.store.resolved_url]) == 1
    assert capsys.readouterr().out.startswith("INCOMPLETE: 3/8 units, 768/2048 rows committed")
    assert main(["verify", cfg.store.resolved_url, "--json"]) == 1
    v = json.loads(capsys.readouterr().out)
    assert not v["complete"] and v["missing_units"] == [3, 4, 5, 6, 7]
    assert main(["inspect", cfg.store.resolved_url, "--rows", "0:4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"]["token_id"] == prep.packed.token_ids[:4].tolist()
    assert out["rows"]["doc_id"][0] == -1 and out["rows"]["text"][0] == "<|bos|>"
    assert len(out["rows"]["norms"]["resid_post.0"]) == 4


def test_resume_with_another_config_is_refused_and_changes_nothing(half_done, tiny_llama):
    from pipeline.driver import ResumeMismatch, run
    from pipeline.store import open_store

    cfg, prep, path = half_done
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


def test_all_committed_but_not_finalized_is_finished_without_actors(tiny_llama, tmp_path, capsys):
    """The driver died after the last commit: a re-run verifies and finalizes, starting nothing."""
    from pipeline.driver import run
    from pipeline.store import open_store

    corpus = shared_corpus(tmp_path / "corpus")
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus, "packing.max_tokens=1024")
    prep = prepare(cfg)
    actor = HarvestActor(actor_spec(cfg, prep, 0))
    _create(cfg, prep, actor.info(), overwrite=False)
    for u in prep.units:
        actor.run_unit(u.as_dict())
    assert open_store(cfg.store.resolved_url).summary is None
    events: list[dict] = []
    s = run(cfg, on_event=events.append)
    assert not [e for e in events if e["event"] == "actors_ready"] and s["per_actor"] == []
    assert s["units_skipped"] == len(prep.units) == 4 and s["tokens_this_run"] == 0
    assert s["verified"]["ok"] and open_store(cfg.store.resolved_url).summary["tokens"] == 1024
    assert run(cfg)["noop"] is True
