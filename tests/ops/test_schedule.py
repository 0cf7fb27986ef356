"""Scheduled ticks (pipeline/driver/schedule.py): decisions from the store alone, and three extend ticks
on a real local Ray cluster whose store equals one long run row for row."""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np
import pytest
import torch

from harvest.pipeline.config.fields import ConfigError
from harvest.pipeline.cli.main import main
from harvest.pipeline.driver.lease import Lease
from harvest.pipeline.driver.schedule import (EXIT_BUSY, EXIT_STUCK, ScheduleConfig, extend_tick,
                                       store_state)
from harvest.pipeline.driver.schedule_log import read_ticks
from harvest.store import open_store
from harvest.store.storage.locate import locate
from tests.support.pipeline import MAX_TOKENS, check_store, make_cfg


def _no_run(cfg, stop_tokens=None):
    raise AssertionError("this tick must not start a run")


# ticks are eager Ray runs (no vLLM engine): beside the engine tests (tests/support/workers.py)
pytestmark = pytest.mark.beside_engines

def test_extend_needs_a_budget_and_a_pinned_hub_dataset(tmp_path):
    cfg = make_cfg("tiny:llama", str(tmp_path / "s"), tmp_path / "c.jsonl",
                   "packing.max_tokens=null")
    with pytest.raises(ConfigError, match="packing.max_tokens"):
        ScheduleConfig("extend", tokens_per_tick=1000).validate(cfg)
    hub = make_cfg("tiny:llama", str(tmp_path / "s"), "HuggingFaceFW/fineweb")
    with pytest.raises(ConfigError, match="data.revision"):
        ScheduleConfig("extend", tokens_per_tick=1000).validate(hub)
    branch = make_cfg("tiny:llama", str(tmp_path / "s"), "HuggingFaceFW/fineweb", "data.revision=main")
    with pytest.raises(ConfigError, match="not a commit sha"):
        ScheduleConfig("extend", tokens_per_tick=1000).validate(branch)
    pinned = make_cfg("tiny:llama", str(tmp_path / "s"), "HuggingFaceFW/fineweb",
                      "data.revision=" + "0123456789" * 4)
    ScheduleConfig("extend", tokens_per_tick=1000).validate(pinned)
    with pytest.raises(ConfigError, match="tokens_per_tick"):
        ScheduleConfig("extend").validate(cfg)


def test_a_live_driver_makes_the_tick_alert_busy_then_stuck(tmp_path):
    cfg = make_cfg("tiny:llama", str(tmp_path / "s"), tmp_path / "c.jsonl")
    loc = locate(cfg.store.resolved_url)
    lease = Lease(loc, cfg.store.lease_seconds, "s", cfg.content_key(), "other").acquire()
    try:
        t = extend_tick(cfg, ScheduleConfig("extend", tokens_per_tick=512), run_fn=_no_run)
        assert t.status == "busy" and t.exit_code == EXIT_BUSY, t
        assert "still writing" in t.message and f"pid {lease.record['pid']}" in t.message
        # the command: the alert is the exit code (a cron job exiting 0 hides it), JSON says why
        out = tmp_path / "out.json"
        with open(out, "w") as f, contextlib.redirect_stdout(f):
            code = main(["schedule", "extend", "--tokens", "512", "--json",
                         "--set", f"store.url={cfg.store.url}", "--set", "packing.max_tokens=6144"])
        assert code == EXIT_BUSY
        assert json.loads(out.read_text())["ticks"][0]["status"] == "busy"
        time.sleep(1.2)  # the run is now older than stuck_after_s
        t = extend_tick(cfg, ScheduleConfig("extend", tokens_per_tick=512, stuck_after_s=1.0),
                        run_fn=_no_run)
        assert t.status == "stuck" and t.exit_code == EXIT_STUCK, t
    finally:
        lease.release()
    # released: the tick would run (check_only: nothing starts)
    t = extend_tick(cfg, ScheduleConfig("extend", tokens_per_tick=512, check_only=True),
                    run_fn=_no_run)
    assert t.status == "would_run" and t.exit_code == 0


@contextlib.contextmanager
def _webhook():
    """A local webhook: yields (url, list of the JSON bodies POSTed to it)."""
    import http.server
    import threading

    got = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 -- http.server's name
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/hook", got
    finally:
        srv.shutdown()
        srv.server_close()


def test_busy_ok_exits_0_and_still_posts_and_exit_2_is_posted(tmp_path, capsys):
    """--busy-ok (KubeRay's RayCronJob retries failed jobs and cannot forbid overlap): a busy tick
    says BUSY and exits 0, the webhook still gets it. A bad config (exit 2, like a config that
    differs from the store's) is posted too: every non-zero outcome reaches the webhook."""
    cfg = make_cfg("tiny:llama", str(tmp_path / "s"), tmp_path / "c.jsonl")
    loc = locate(cfg.store.resolved_url)
    argv = ["schedule", "extend", "--tokens", "512", "--set", f"store.url={cfg.store.url}",
            "--set", "packing.max_tokens=6144"]
    lease = Lease(loc, cfg.store.lease_seconds, "s", cfg.content_key(), "other").acquire()
    try:
        with _webhook() as (url, got):
            assert main(argv + ["--busy-ok", "--webhook", url]) == 0
            assert [b["ticks"][0]["status"] for b in got] == ["busy"]
            assert got[0]["ticks"][0]["exit_code"] == EXIT_BUSY
        assert "BUSY: the previous run is still writing" in capsys.readouterr().out
    finally:
        lease.release()
    assert not read_ticks(loc) and not loc.list_dir("_harvest/schedule")  # nothing started
    with _webhook() as (url, got):
        code = main(["schedule", "extend", "--tokens", "512", "--set", f"store.url={cfg.store.url}",
                     "--set", "packing.max_tokens=null", "--webhook", url])
        assert code == 2
        assert len(got) == 1 and got[0]["ticks"][0]["status"] == "invalid"
        assert got[0]["ticks"][0]["exit_code"] == 2
        assert "packing.max_tokens" in got[0]["text"]


def test_webhook_file_reads_the_url_and_a_failing_webhook_never_prints_its_path(tmp_path, capsys):
    """--webhook-file (a mounted Secret) posts like --webhook; an empty or missing file, or both
    flags, is a bad invocation (exit 2). A webhook that fails is reported by scheme and host
    only: the path of a Slack-style URL is its secret."""
    from harvest.pipeline.driver.schedule import Tick, notify

    argv = ["schedule", "extend", "--tokens", "512", "--set", f"store.url={tmp_path / 's'}",
            "--set", "packing.max_tokens=null"]
    url_file = tmp_path / "url"
    with _webhook() as (url, got):
        url_file.write_text(url + "\n")
        assert main(argv + ["--webhook-file", str(url_file)]) == 2
        assert len(got) == 1 and got[0]["ticks"][0]["status"] == "invalid"
        assert main(argv + ["--webhook-file", str(url_file), "--webhook", url]) == 2
        assert "not both" in capsys.readouterr().err
        url_file.write_text("\n")
        assert main(argv + ["--webhook-file", str(url_file)]) == 2
        assert main(argv + ["--webhook-file", str(tmp_path / "missing")]) == 2
        assert len(got) == 1
    err = notify("http://127.0.0.1:9/T000/B000/s3cr3t", [Tick("busy", "", "x")], timeout=2)
    assert err and "127.0.0.1" in err and "s3cr3t" not in err, err


@contextlib.contextmanager
def _resolutions(monkeypatch):
    """{"locate": how many times the store's URL became a Storage, "source": how many times
    data.source was resolved}, counted in this process (the driver's side) while inside."""
    from harvest.pipeline.data.documents import ResolvedSource
    from harvest.store.storage.local import LocalStorage

    n = {"locate": 0, "source": 0}
    open_, init = LocalStorage.open.__func__, ResolvedSource.__init__

    def counted_open(cls, *a, **kw):
        n["locate"] += 1
        return open_(cls, *a, **kw)

    def counted_init(self, *a, **kw):
        n["source"] += 1
        init(self, *a, **kw)

    monkeypatch.setattr(LocalStorage, "open", classmethod(counted_open))
    monkeypatch.setattr(ResolvedSource, "__init__", counted_init)
    yield n
    monkeypatch.setattr(LocalStorage, "open", classmethod(open_))
    monkeypatch.setattr(ResolvedSource, "__init__", init)


def test_three_ticks_extend_one_store_exactly(ray_cluster, tiny_llama, corpus, reference, tmp_path,
                                              monkeypatch):
    """Tick 1 dies half way (its driver raised after committing half its tokens; a SIGKILLed
    tick leaves the same: a start record and no tick record): the failed tick reports what is
    committed, and the next tick finishes tick 1's tokens, not the next slice. The paused store's
    status is healthy. The last tick runs through the CLI: quiet console, a log folder."""
    from harvest.pipeline.cli.text import status_text
    from harvest.pipeline.driver.run import run
    from harvest.pipeline.cli.views import status

    ref, _ = reference
    assert ref.packed.n_rows == MAX_TOKENS  # the corpus fills the budget
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus)
    N = MAX_TOKENS // 3
    sc = ScheduleConfig("extend", tokens_per_tick=N)

    def dies_half_way(c, stop_tokens=None):
        run(c, stop_tokens=stop_tokens // 2)
        raise RuntimeError("driver lost half way")

    with _resolutions(monkeypatch) as n:
        t = extend_tick(cfg, sc, run_fn=dies_half_way)
    # resolved once: the tick locates the store once (state, start record), the run once
    # (probe, lease, store) and data.source once (prepare); create_store re-opens what it made,
    # and the failed tick reads the store again to say what is committed
    assert n == {"locate": 4, "source": 1}, n
    assert (t.status, t.exit_code, t.tokens, t.budget) == ("failed", 1, N // 2, MAX_TOKENS), t
    assert f"{N // 2:,} tokens are committed" in t.message
    assert read_ticks(locate(cfg.store.resolved_url)) == []
    statuses = []
    for k in range(1, 4):
        if k < 3:
            with _resolutions(monkeypatch) as n:
                t = extend_tick(cfg, sc)
            # a resume reads its blocks from the store: data.source is not resolved at all
            assert n == {"locate": 2, "source": 0}, n
        else:
            t = _cli_tick(cfg, N, tmp_path)
        statuses.append(t.status)
        if k == 1:
            assert "tick 0 was killed or failed" in t.message, t.message
            assert t.summary["tokens_this_run"] == N - N // 2
            s = status(cfg.store.resolved_url)
            text = status_text(s)
            assert s["paused"] and "paused by a scheduled tick" in text, text
            assert "interrupted" not in text and f"{N:,} of the {MAX_TOKENS:,}-token budget" in text
        assert t.tokens == k * MAX_TOKENS // 3, t
        st = store_state(cfg)
        assert st.committed_tokens == st.planned_tokens == k * MAX_TOKENS // 3
        assert st.finished == (k == 3) and st.lease is None  # released at the tick's end
        store = open_store(cfg.store.resolved_url)
        n = t.tokens
        tok, doc, pos = store.read_row_meta(0, n)  # the committed prefix is the long run's
        assert np.array_equal(tok, ref.packed.token_ids[:n])
        assert np.array_equal(pos, ref.packed.positions[:n])
        assert t.summary["tokens_this_run"] == (N - N // 2 if k == 1 else N)
    assert statuses == ["paused", "paused", "ran"]
    # the finished store: verified (deep) and recounted against one long run, bit for bit
    check_store(open_store(cfg.store.resolved_url), reference)
    ticks = read_ticks(locate(cfg.store.resolved_url))
    assert [x["summary"]["tokens_this_run"] for x in ticks] == [N - N // 2, N, N]
    assert ticks[0]["start"]["target_tokens"] == N  # recorded under the killed tick's number
    # the report covers the whole store across its ticks
    from harvest.pipeline.cli.report import write_report

    rep = write_report(cfg.store.resolved_url, out_dir=tmp_path / "rep")["data"]
    assert rep["committed_rows"] == MAX_TOKENS and len(rep["run"]["runs"]) == 3
    assert [r["tokens"] for r in rep["run"]["runs"]] == [N - N // 2, N, N]
    assert all(r["per_actor"] and r["tokens_per_second"] for r in rep["run"]["runs"])
    assert rep["run"]["skipped_reasons"]  # the corpus's empty/null rows, counted once
    # the budget is reached: the next tick decides from the store alone and starts nothing
    t = extend_tick(cfg, sc, run_fn=_no_run)
    assert t.status == "complete" and t.exit_code == 0 and t.tokens == MAX_TOKENS


def _cli_tick(cfg, tokens: int, tmp_path):
    """`harvest schedule extend --json` on cfg (written as a config file): the tick is quiet like
    `harvest run` (third-party output in a log folder, named in the JSON); returns its Tick."""
    import yaml

    from harvest.pipeline.driver.schedule import Tick

    path = tmp_path / "tick.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(redact=False)))
    out = tmp_path / "tick.json"
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        code = main(["schedule", "extend", "--config", str(path), "--tokens", str(tokens),
                     "--json"])
    doc = json.loads(out.read_text())  # stdout holds the one JSON document, nothing else
    assert code == 0, doc
    from pathlib import Path

    log = Path(doc["log_dir"]) / "driver.log"
    assert log.is_file() and log.stat().st_size > 0, doc["log_dir"]
    d = doc["ticks"][0]
    d.pop("exit_code")
    return Tick(**d)


def test_a_checkpoint_tick_makes_row_aligned_stores(ray_cluster, tiny_llama, corpus, tmp_path):
    """Two checkpoints of one architecture (different seeds, one tokenizer) saved as dirs: one
    tick makes a store for each, the same token/document/position in every row, each store's
    rows its own model's (eager reference); the next tick finds both finished and runs nothing."""
    from harvest.engine.models import build_tiny_model
    from harvest.pipeline.driver.schedule import checkpoint_tick
    from tests.support.pipeline import SHARD_ROWS, reference_capture

    ckpts = tmp_path / "ckpts"
    for name, seed in (("step-1000", 1), ("step-2000", 2)):
        build_tiny_model(ckpts / name, "llama", seed=seed)
    (ckpts / "notes").mkdir()  # not a checkpoint: no config.json
    budget = 4 * SHARD_ROWS
    cfg = make_cfg(tiny_llama, str(tmp_path / "stores"), corpus, f"packing.max_tokens={budget}")
    sc = ScheduleConfig("checkpoints", checkpoints=str(ckpts))
    ticks = checkpoint_tick(cfg, sc)
    assert [t.status for t in ticks] == ["ran", "ran"], [t.message for t in ticks]
    stores = {n: open_store(str(tmp_path / "stores" / n)) for n in ("step-1000", "step-2000")}
    metas = {}
    for name, s in stores.items():
        v = s.verify(deep=True)
        assert v.ok and v.committed_rows == budget, v
        metas[name] = s.read_row_meta(0, s.n_rows)
        acts = reference_capture(str(ckpts / name), metas[name][0], cfg.packing.context_size,
                                 SHARD_ROWS, cfg.capture.batch_contexts, [s.points[-1]])
        got = np.asarray(s.read(s.points[-1], 0, s.n_rows))
        assert np.array_equal(got.view(np.uint16), acts[s.points[-1]].view(np.uint16)), name
    for a, b in zip(metas["step-1000"], metas["step-2000"]):
        assert np.array_equal(a, b)                       # row-aligned
    p = stores["step-1000"].points[-1]
    assert not np.array_equal(np.asarray(stores["step-1000"].read(p, 0, 64)),
                              np.asarray(stores["step-2000"].read(p, 0, 64)))  # two models
    # the paired reader over the real pair: alignment from the markers' digests, and each
    # store's own rows at the row ids of every batch
    from harvest.store.read.dataset import ActivationDataset
    ds = ActivationDataset(list(stores.values()), p, batch_size=100, seed=0, return_meta=True)
    assert ds.names == ["step-1000", "step-2000"] and ds.alignment.by_digest == ds.alignment.units > 0
    got = list(ds)
    rows = np.concatenate([b["row"].numpy() for b in got])
    acts = np.concatenate([b["acts"].view(torch.int16).numpy() for b in got])
    assert np.array_equal(np.sort(rows), np.arange(budget)) and acts.shape[1] == 2
    for i, s in enumerate(stores.values()):
        alone = np.asarray(s.read(p, 0, s.n_rows)).view(np.int16)
        assert np.array_equal(acts[:, i], alone[rows])
    again = checkpoint_tick(cfg, sc, run_fn=_no_run)
    assert [t.status for t in again] == ["complete", "complete"]


def test_alignment_check_finds_one_differing_token(tmp_path):
    """Checkpoint stores are compared unit by unit by their markers' row-metadata digests: one
    token different in one store is reported, naming both checkpoints, the unit and the row."""
    from harvest.pipeline.config.run import load_config
    from harvest.pipeline.driver.schedule import aligned
    from harvest.store import create_store
    from harvest.testing import synthetic

    n = 1024
    for name, changed in (("a", None), ("b", None), ("c", 900)):
        tok = np.arange(n, dtype=np.int32)
        if changed is not None:
            tok[changed] += 1
        s = create_store(str(tmp_path / "st" / name), points=["resid_post.0"], width=8, n_rows=n,
                         shard_rows=256, chunk_rows=128)
        s.ledger.write_plan(s.ledger.default_plan(1))
        synthetic.fill(s, synthetic.activations((1, n, 8), seed=1), token_id=tok,
                       doc_id=np.arange(n) // 100, position=np.arange(n) % 100)
        s.finalize({"tokens": n})
    cfg = load_config(data={"store": {"url": str(tmp_path / "st")}})
    assert aligned(cfg.store, ["a", "b"]) is None
    msg = aligned(cfg.store, ["a", "b", "c"])
    assert msg and "'a' and 'c' are not row-aligned" in msg
    assert "unit 3 (rows [768, 1024)) holds different `token_id` (first at row 900: 900 vs 901" in msg, msg
