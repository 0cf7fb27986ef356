"""Secrets never recorded (issue 51 item 3): a presigned `data.source` and tokens in
`store.storage_options` are masked in everything harvest records or prints: the dumped config,
the content key (the URL's secret-free identity), provenance, the run summary, the lease,
schedule start and tick records, the dataset card, logs, errors and `ActorSpec`'s repr; a
webhook URL is never echoed. The last test runs two scheduled ticks and a re-run through the
CLI on a local Ray cluster (eager backend) against a corpus served over HTTP on 127.0.0.1 behind
a fake presigned query, signed anew for each, and greps every file of the store, the log
folders and the console for the secrets."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from harvest.engine.models import REPO_ROOT
from harvest.pipeline.driver.schedule import ScheduleConfig, extend_tick, notify, Tick
from harvest.pipeline.driver.schedule_log import read_ticks
from harvest.pipeline.data.documents import DataError, open_dataset
from harvest.pipeline.data.provenance import data_provenance
from harvest.pipeline.driver.lease import Lease
from harvest.pipeline.logs import Redact
from harvest.pipeline.messages import ActorSpec
from harvest.store.storage.locate import locate
from tests.support.pipeline import make_cfg, write_corpus

SIG, CRED, TOKEN, BEARER, STS = ("SECRETSIG0001", "SECRETCRED0001", "SECRETTOKEN01",
                                 "SECRETBEARER1", "SECRETSTS0001")
SECRETS = (SIG, CRED, TOKEN, BEARER, STS)
OPTIONS = {"token": TOKEN, "client_kwargs": {"headers": {"Authorization": f"Bearer {BEARER}"}},
           "headers": {"x-amz-security-token": STS}}


def presigned(base: str, sig: str = SIG, cred: str = CRED, date: str = "20250101T000000Z") -> str:
    return (f"{base}?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={cred}%2F20250101%2F"
            f"us-east-1%2Fs3%2Faws4_request&X-Amz-Date={date}&X-Amz-Expires=3600"
            f"&X-Amz-SignedHeaders=host&X-Amz-Signature={sig}")


def _clean(text: str, secrets=SECRETS) -> list[str]:
    return [s for s in secrets if s in text]


def test_config_dump_and_content_key_hold_no_secret(tmp_path):
    url = presigned("https://bucket.s3.amazonaws.com/d/docs.jsonl")
    cfg = make_cfg("tiny:llama", str(tmp_path / "s"), url, storage_options=OPTIONS,
                   data={"data_files": [url]})
    dumped = json.dumps(cfg.to_dict(redact=True))
    assert not _clean(dumped), dumped
    for shown in (repr(cfg), str(cfg.data), repr(cfg.store), f"{cfg}"):   # logged or in errors
        assert not _clean(shown), shown
    assert "bucket.s3.amazonaws.com/d/docs.jsonl" in repr(cfg.data)
    assert "X-Amz-Date=20250101T000000Z" in dumped and "bucket.s3.amazonaws.com/d/docs.jsonl" in dumped
    key = cfg.content_key()
    assert key["data"]["source"] == "https://bucket.s3.amazonaws.com/d/docs.jsonl"
    assert key["data"]["data_files"] == ["https://bucket.s3.amazonaws.com/d/docs.jsonl"]
    # signed again for the next run: the same data, the same key (resume accepts it) ...
    again = make_cfg("tiny:llama", str(tmp_path / "s"),
                     presigned("https://bucket.s3.amazonaws.com/d/docs.jsonl", "NEWSIG", "NEWCRED",
                               "20250301T000000Z"), storage_options=OPTIONS,
                     data={"data_files": [url]})
    assert again.content_key() == key
    # ... another object, another key
    other = make_cfg("tiny:llama", str(tmp_path / "s"),
                     presigned("https://bucket.s3.amazonaws.com/d/other.jsonl"),
                     data={"data_files": [url]})
    assert other.content_key() != key
    # a plain source's key is what it always was (stores made before keep resuming)
    plain = make_cfg("tiny:llama", str(tmp_path / "s"), "/data/docs.jsonl")
    assert plain.content_key()["data"]["source"] == "/data/docs.jsonl"
    assert "max_line_bytes" not in plain.content_key()["data"]


def test_provenance_errors_and_descriptions_hold_no_secret(tmp_path):
    url = presigned("http://127.0.0.1:9/d/docs.jsonl")
    cfg = make_cfg("tiny:llama", str(tmp_path / "s"), url)
    prov = json.dumps(data_provenance(cfg.data, {"description": "x", "kind": "files"}))
    assert not _clean(prov), prov
    assert "127.0.0.1:9/d/docs.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256" in prov
    with pytest.raises(DataError) as e:   # nothing listens on port 9: the loader's own error
        open_dataset(cfg.data)
    assert not _clean(str(e.value)) and e.value.__cause__ is None, str(e.value)
    assert "127.0.0.1:9/d/docs.jsonl" in str(e.value)


def test_actor_spec_repr_masks_options_and_env():
    spec = ActorSpec(index=0, model_path="m", engine_kwargs={}, points=("resid_post.0",),
                     context_size=8, store_url=presigned("s3://b/store"),
                     storage_options={**OPTIONS, "client_kwargs": {
                         **OPTIONS["client_kwargs"], "endpoint_url": "http://127.0.0.1:9000"}},
                     env={"AWS_SECRET_ACCESS_KEY": "SECRETENV", "HF_HOME": "/secret/home"})
    for text in (repr(spec), str(spec), f"{spec}", str([spec])):
        assert not _clean(text, SECRETS + ("SECRETENV", "/secret/home")), text
    assert "http://127.0.0.1:9000" in repr(spec) and "AWS_SECRET_ACCESS_KEY" in repr(spec)


@contextlib.contextmanager
def _capture_log(name: str):
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.addFilter(Redact())
    lg = logging.getLogger(name)
    old = lg.handlers[:], lg.propagate, lg.level
    lg.handlers[:] = [h]
    lg.propagate = False
    lg.setLevel(logging.DEBUG)
    try:
        yield lg, buf
    finally:
        lg.handlers[:], lg.propagate, lg.level = old


def test_log_records_are_masked():
    url = presigned("https://h.example/docs.jsonl")
    with _capture_log("harvest.test_secrets") as (lg, buf):
        lg.info("prepared: blocks of %s", url)
        try:
            raise ValueError(f"cannot read {url}")
        except ValueError:
            lg.exception("failed on %s", url)
        lg.info("plain line, %d%% done", 50)
    out = buf.getvalue()
    assert not _clean(out), out
    assert "X-Amz-Signature=***" in out and "ValueError: cannot read" in out
    assert "plain line, 50% done" in out


def test_schedule_records_and_failures_hold_no_secret(tmp_path):
    url = presigned("https://h.example/docs.jsonl")
    cfg = make_cfg("tiny:llama", str(tmp_path / "s"), url, "packing.max_tokens=4096",
                   storage_options=OPTIONS)
    sc = ScheduleConfig("extend", tokens_per_tick=512)

    def run_ok(c, stop_tokens=None):
        return {"name": "t", "tokens": 512, "tokens_this_run": 512, "paused": True,
                "data": {"source": url}, "note": f"Authorization: Bearer {BEARER}"}

    t = extend_tick(cfg, sc, run_fn=run_ok)
    assert t.status == "paused"
    loc = locate(cfg.store.resolved_url)
    for name in loc.list_dir("_harvest/schedule"):
        assert not _clean(loc.read_bytes(f"_harvest/schedule/{name}").decode()), name
    assert read_ticks(loc)[0]["summary"]["data"]["source"].endswith("X-Amz-Signature=***")

    def run_fails(c, stop_tokens=None):
        raise RuntimeError(f"could not read {url} with token {TOKEN}")

    t = extend_tick(cfg, sc, run_fn=run_fails)
    assert t.status == "failed" and not _clean(t.message), t.message


def test_the_lease_record_holds_no_secret(tmp_path):
    url = presigned("https://h.example/docs.jsonl")
    cfg = make_cfg("tiny:llama", str(tmp_path / "s"), url)
    loc = locate(cfg.store.resolved_url)
    lease = Lease(loc, 60.0, "s", cfg.content_key(), f"run of {url}").acquire()
    try:
        for name in loc.list_dir("_harvest/lease"):
            assert not _clean(loc.read_bytes(f"_harvest/lease/{name}").decode())
    finally:
        lease.release()


def test_a_failing_webhook_is_not_echoed():
    hook = "http://127.0.0.1:9/services/T000/B000/SECRETHOOKPATH"
    err = notify(hook, [Tick("failed", "s", "m")], timeout=2.0)
    assert err is not None and "SECRETHOOKPATH" not in err and "/services" not in err, err
    assert "http://127.0.0.1:9/…" in err


class _Presigned(http.server.BaseHTTPRequestHandler):
    """A file server that, like S3, answers 403 to a request without a signature."""

    root: Path = Path(".")

    def _serve(self, body: bool) -> None:
        path, _, query = self.path.partition("?")
        f = self.root / path.lstrip("/")
        if "X-Amz-Signature=" not in query:
            self.send_response(403)
            self.end_headers()
            return
        if not f.is_file():
            self.send_response(404)
            self.end_headers()
            return
        data = f.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_GET(self):  # noqa: N802 -- http.server's name
        self._serve(True)

    def do_HEAD(self):  # noqa: N802
        self._serve(False)

    def log_message(self, *a):
        pass


@contextlib.contextmanager
def _serve(root: Path):
    handler = type("Handler", (_Presigned,), {"root": root})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _cli(args: list[str], head, cache: Path, timeout: int = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, **head.env, "RAY_ADDRESS": head.address, "HARVEST_CACHE": str(cache),
           "PYTHONPATH": str(REPO_ROOT), "HF_DATASETS_CACHE": str(cache / "datasets")}
    return subprocess.run([sys.executable, "-m", "harvest.pipeline.cli.main", *args], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.beside_engines   # eager Ray runs, no vLLM engine
def test_presigned_source_and_tokens_never_reach_store_logs_or_console(ray_cluster, tiny_llama,
                                                                      tmp_path):
    write_corpus(tmp_path / "web" / "docs.jsonl")
    cache = tmp_path / "cache"
    signings = [(SIG, CRED, "20250101T000000Z"), ("SECRETSIG0002", "SECRETCRED0002",
                                                  "20250102T000000Z"),
                ("SECRETSIG0003", "SECRETCRED0003", "20250103T000000Z")]
    secrets = SECRETS + tuple(s for sig in signings for s in sig[:2])
    consoles = []
    with _serve(tmp_path / "web") as base:
        for i, (sig, cred, date) in enumerate(signings):
            url = presigned(f"{base}/docs.jsonl", sig, cred, date)
            cfg = make_cfg(tiny_llama, str(tmp_path / "store"), url, "packing.max_tokens=1024",
                           "ray.num_actors=1", storage_options=OPTIONS)
            conf = cfg.to_dict(redact=False)
            conf["ray"]["address"] = None
            path = tmp_path / f"run-{i}.yaml"
            path.write_text(yaml.safe_dump(conf))
            # two ticks of 512 tokens (the second finalizes: summary, card), then a re-run
            args = (["schedule", "extend", "--config", str(path), "--tokens", "512",
                     "--webhook", "http://127.0.0.1:9/services/T0/B0/SECRETHOOKPATH"]
                    if i < 2 else ["run", "--config", str(path)])
            r = _cli(args, ray_cluster, cache)
            console = r.stdout + r.stderr
            consoles.append(console)
            assert r.returncode == 0, console[-3000:]
    assert "paused" in consoles[0] or "captured" in consoles[0], consoles[0][-2000:]
    assert "nothing to do" in consoles[2] or "already committed" in consoles[2], consoles[2][-2000:]

    store = tmp_path / "store"
    files = _files(store)
    assert any(p.name == "README.md" for p in files)                       # the card
    assert any("_harvest/schedule" in str(p) for p in files)               # tick records
    assert any("_harvest/lease" in str(p) for p in files)                  # the lease
    leaks = {str(p.relative_to(tmp_path)): _clean(p.read_bytes().decode("latin-1"), secrets)
             for p in files}
    assert not {k: v for k, v in leaks.items() if v}, leaks
    logs = _files(cache / "logs")
    assert len(logs) >= 3
    leaks = {str(p.relative_to(tmp_path)): _clean(p.read_bytes().decode("latin-1"), secrets)
             for p in logs}
    assert not {k: v for k, v in leaks.items() if v}, leaks
    for console in consoles:
        assert not _clean(console, secrets + ("SECRETHOOKPATH",)), console[-3000:]
    # what is recorded keeps what helps: host, path, expiry; the signature masked
    zarr_json = json.loads((store / "zarr.json").read_text())
    prov = zarr_json["attributes"]["run"]["provenance"]["data"]
    assert prov["source"].startswith(f"{base}/docs.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256")
    assert "X-Amz-Signature=***" in prov["source"] and "X-Amz-Expires=3600" in prov["source"]
