"""`harvest plan|status|verify|inspect` on a store left half done, read from the store alone.

The half-done store is what a driver interrupted after three commits leaves behind: the real
driver on the test cluster, stopped from its event hook (markers of units that committed while it
was being torn down are dropped, as if the driver had been killed a moment earlier).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harvest.pipeline.cli.main import main
from harvest.engine.models import REPO_ROOT
from harvest.pipeline.driver.run import run
from harvest.store import open_store
from tests.support.pipeline import make_cfg, reference_rows, shared_corpus
from tests.support.ray_actors import wait_actors_gone

# Ray pipeline runs (eager) through the CLI: not in `pytest -m 'not slow'`; beside the vLLM engine tests
pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]


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
    # the stopped run's actors are killed by its driver; one may still commit a unit it had in
    # flight until its process is gone: wait for that, so the markers below are final
    wait_actors_gone(60, "the stopped run's actors")
    store = open_store(cfg.store.resolved_url)
    for n in store.ledger.marker_names():
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
    assert main(["plan", "--config", str(path), "--json"]) == 0
    out = _json(capsys.readouterr().out)
    assert out["store_exists"] is True and out["plan_complete"] is True
    assert out["planned_units"] == 8 and out["planned_tokens"] == 2048 and out["max_units"] == 8
    assert out["unit_rows"] == out["shard_rows"] == 256 and out["blocks"] == 1
    est = out["estimate"]  # 4 layers x width 128 x 2 B per token, from the stored plan
    assert est["tokens"] == 2048 and est["bytes_logical"] == 2048 * 4 * 128 * 2
    assert main(["plan", "--config", str(path)]) == 0
    text = capsys.readouterr().out
    assert "units of 256 rows, shards of 256, chunks of" in text
    assert f"estimate  2,048 tokens (the stored plan): {2048 * 4 * 128 * 2 / 1e6:.1f} MB logical" in text
    assert "plan of 8 units, 2,048 tokens" in text and not text.lstrip().startswith("{")


def test_plan_warns_when_the_budget_exceeds_the_corpus(half_done, tmp_path, capsys):
    """packing.max_tokens far above what the corpus holds: a warning with the numbers."""
    cfg, done, path = half_done
    args = ["plan", "--config", str(path), "--set", f"store.url={tmp_path / 'new'}"]
    assert main(args + ["--set", "packing.max_tokens=500000000"]) == 0
    text = capsys.readouterr().out
    corpus = Path(cfg.data.source).stat().st_size
    assert "warning   packing.max_tokens=500,000,000 is more than the corpus likely holds" in text
    assert f"from {corpus / 1e6:.1f} MB of text" in text
    assert main(args + ["--set", "packing.max_tokens=4096"]) == 0
    assert "more than the corpus likely holds" not in capsys.readouterr().out


def test_status_of_an_interrupted_store(half_done, capsys):
    """Stopped moments ago, yet no rate and no ETA: the driver released its lease."""
    cfg, done, path = half_done
    missing = [u for u in range(8) if u not in done]
    assert main(["status", cfg.store.resolved_url]) == 0
    out = capsys.readouterr().out
    assert ": interrupted (re-run the same config to resume)" in out
    assert "3/8 units, 768/2,048 tokens (37.5%)" in out
    assert "tok/s" not in out and "left" not in out
    assert f"uncommitted units: {missing}" in out
    assert main(["status", "--config", str(path), "--json"]) == 0
    s = _json(capsys.readouterr().out)
    assert s["committed_units"] == 3 and s["finalized"] is False and s["active"] is False
    assert s["eta_seconds"] is None and s["driver"]["released"] and not s["driver"]["live"]


def test_status_and_verify_before_the_store_exists(tmp_path, capsys):
    url = str(tmp_path / "not-yet")
    assert main(["status", url]) == 0
    assert f"no store at {url} yet: the job may still be starting" in capsys.readouterr().out
    assert main(["status", url, "--json"]) == 0
    assert _json(capsys.readouterr().out) == {"url": url, "missing_store": True, "driver": None}
    assert main(["verify", url]) == 1
    assert "nothing to verify" in capsys.readouterr().err


def test_verify_fails_until_complete_and_inspect_shows_rows(half_done, capsys):
    cfg, done, path = half_done
    missing = [u for u in range(8) if u not in done]
    assert main(["verify", cfg.store.resolved_url]) == 1
    assert "INCOMPLETE: 3/8 units, 768/2,048 rows committed" in capsys.readouterr().out
    assert main(["verify", cfg.store.resolved_url, "--json"]) == 1
    v = _json(capsys.readouterr().out)
    assert not v["complete"] and v["missing_units"] == missing
    # --deep says what it read: 3 units x 1 shard x 4 points, 3 metadata arrays per unit and
    # one stats sidecar per unit, every one checked against the digests in its marker
    assert main(["verify", cfg.store.resolved_url, "--deep"]) == 1
    text = capsys.readouterr().out
    assert "deep: 12 shard objects, 9 metadata chunks, 3 stats sidecars read back" in text
    assert "for 3 committed units" in text
    first = 256 * done[0]
    assert main(["inspect", cfg.store.resolved_url, "--rows", f"{first}:{first + 4}", "--json"]) == 0
    out = _json(capsys.readouterr().out)
    ref = reference_rows(cfg)
    assert out["rows"]["token_id"] == ref.token_ids[first:first + 4].tolist()
    assert out["rows"]["doc_id"][0] == -2 and out["rows"]["position"][0] == -2  # inserted BOS
    assert out["rows"]["text"][0] == "<|bos|>"
    assert len(out["rows"]["norms"]["resid_post.0"]) == 4
    assert out["context_size"] == 32 and out["bos_token_id"] == ref.token_ids[0]
    assert main(["inspect", cfg.store.resolved_url, "--rows", f"{first}:{first + 4}"]) == 0
    text = capsys.readouterr().out
    assert "768 committed of" in text and "statistics: written when the run finalizes" in text
    row0 = [ln for ln in text.splitlines() if ln.split()[:1] == [str(first)]]
    assert row0 and "'<|bos|>'" in row0[0] and f"{out['rows']['norms']['resid_post.0'][0]:.2f}" in row0[0]


def test_resume_with_another_config_is_refused_and_changes_nothing(half_done, tiny_llama):
    from harvest.pipeline.errors import ResumeMismatch

    cfg, done, path = half_done
    before = open_store(cfg.store.resolved_url).ledger.committed_units()
    other = make_cfg(tiny_llama, cfg.store.url, cfg.data.source, "packing.max_tokens=2048",
                     "packing.bos=none")
    with pytest.raises(ResumeMismatch, match=r"packing.bos: the store has 'context', this config "
                                             r"says 'none'.*use the original config, or a new store.url"):
        run(other)
    points = make_cfg(tiny_llama, cfg.store.url, cfg.data.source, "packing.max_tokens=2048",
                      capture={"points": ["resid_post.1"]})
    with pytest.raises(ResumeMismatch, match=r"capture.points"):
        run(points)
    assert open_store(cfg.store.resolved_url).ledger.committed_units() == before


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


def test_json_commands_print_only_json(half_done):
    """Every `--json` prints one JSON document on stdout and nothing else, as a user's shell (a
    process of its own) sees it; the in-process tests above read through capsys."""
    cfg, _, path = half_done
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for args in (["plan", "--config", str(path)], ["status", cfg.store.resolved_url],
                 ["verify", cfg.store.resolved_url]):
        r = subprocess.run([sys.executable, "-m", "harvest.pipeline.cli.main", "--verbose", *args, "--json"],
                           cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode in (0, 1), r.stderr[-3000:]
        assert isinstance(json.loads(r.stdout), dict), (args, r.stdout[:2000])
