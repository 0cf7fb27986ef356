"""Bad input fails before anything is written, with an error naming the field and the fix.

Each case runs the real driver (`run`) and then checks the store location is untouched: no local
directory, no S3 object under the prefix. All but one fail before Ray starts, so they are cheap;
a corpus without a single complete context is known only once it is tokenised (on the cluster),
and still fails before the store is created.
"""

from __future__ import annotations

import json

import pytest

from harvest.pipeline.cli.main import main
from harvest.pipeline.config.run import ConfigError
from harvest.pipeline.data.documents import DataError
from harvest.pipeline.driver.run import run
from harvest.pipeline.data.packing import PackingError
from harvest.store import StoreAccessError
from tests.support.pipeline import make_cfg

pytestmark = pytest.mark.slow  # Ray and driver runs on bad input: not in `pytest -m 'not slow'`


@pytest.fixture
def docs(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(20)))
    return p


def _fails(cfg, exc, match):
    with pytest.raises(exc, match=match) as info:
        run(cfg)
    return info.value


def test_missing_text_column(tiny_llama, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"body": "some text"}) + "\n")
    store = tmp_path / "store"
    _fails(make_cfg(tiny_llama, str(store), data), DataError,
           r"data.text_column='text' is not a column.*\['body'\].*set data.text_column")
    assert not store.exists()


@pytest.mark.parametrize("content, exc, match", [
    ("", DataError, r"data.source=.* is empty \(1 file\(s\) of 0 bytes\)"),
    ("\n".join(json.dumps({"text": t}) for t in ["", "  ", None]), PackingError,
     r"no complete context: data.source=.* had 3 rows \(all of them read\), 3 without usable "
     r"text \(\{'empty': 2, 'null': 1\}\), 0 tokens; .*packing.context_size=32"),
])
def test_empty_dataset(tiny_llama, tmp_path, content, exc, match):
    import ray

    data = tmp_path / "d.jsonl"
    data.write_text(content)
    store = tmp_path / "store"
    # known before Ray starts (it once took over 300 s): the run leaves Ray as it found it (in
    # the whole suite an earlier test's cluster connection may already be up in this process)
    ray_was_up = ray.is_initialized()
    _fails(make_cfg(tiny_llama, str(store), data), exc, match)
    assert not store.exists()
    assert ray.is_initialized() == ray_was_up


def test_context_larger_than_the_model_limit(tiny_llama, docs, tmp_path):
    store = tmp_path / "store"
    # the tiny llama has 1024 positions; vLLM needs one more for its generated token
    _fails(make_cfg(tiny_llama, str(store), docs, "packing.context_size=2048",
                    "packing.max_tokens=4096", "store.shard_rows=2048"),
           ConfigError, r"packing.context_size=2048 is larger than the model's limit of 1024")
    _fails(make_cfg(tiny_llama, str(store), docs, "packing.context_size=1024",
                    "packing.max_tokens=4096", "store.shard_rows=1024", "model.backend=vllm"),
           ConfigError, r"limit of 1023 .*vLLM.*packing.context_size <= 1023")
    assert not store.exists()


def test_unknown_point(tiny_llama, docs, tmp_path):
    store = tmp_path / "store"
    # the point kind is refused with the config; the layer range once the model is read
    with pytest.raises(ConfigError, match=r"capture.points entry 'resid_middle.1': unknown point "
                                          r"'resid_middle'; known points"):
        make_cfg(tiny_llama, str(store), docs, capture={"points": ["resid_middle.1"]})
    _fails(make_cfg(tiny_llama, str(store), docs, capture={"points": ["resid_post.9"]}),
           ConfigError, r"capture.points: address resid_post.9 is out of range: the model has "
                        r"layers 0..3")
    assert not store.exists()


def test_unreachable_store_url(tiny_llama, docs):
    so = {"key": "k", "secret": "s3cr3t-value", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
          "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    err = _fails(make_cfg(tiny_llama, "s3://bucket/run", docs, storage_options=so),
                 StoreAccessError, r"s3://bucket/run.*check the endpoint")
    assert "s3cr3t-value" not in str(err)


def test_wrong_credentials(tiny_llama, docs, seaweedfs, s3_url):
    import s3fs

    bad = {**seaweedfs.storage_options, "secret": "wrong-" + seaweedfs.secret_key[:4]}
    err = _fails(make_cfg(tiny_llama, s3_url, docs, storage_options=bad),
                 StoreAccessError, r"check the credentials")
    assert bad["secret"] not in str(err) and seaweedfs.secret_key not in str(err)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **seaweedfs.storage_options)
    prefix = s3_url[len("s3://"):]
    assert not fs.exists(prefix) or fs.find(prefix) == []


def test_non_harvest_location_is_refused(tiny_llama, docs, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "notes.txt").write_text("someone else's files")
    from harvest.pipeline.errors import HarvestError

    _fails(make_cfg(tiny_llama, str(store), docs), HarvestError, r"not empty and is not a harvest store")
    assert sorted(p.name for p in store.iterdir()) == ["notes.txt"]


def test_cli_reports_bad_input_in_one_line(tiny_llama, docs, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {tiny_llama}, backend: eager}}\n"
                   f"data: {{source: {docs}}}\npackng: {{context_size: 64}}\n")
    assert main(["run", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("harvest run: error: unknown field packng: did you mean packing?")


# ---- issue 29 item 5: each message names the input, the cause and the fix --------------------

def _plan_refused(capsys, tmp_path, model, data, match, *sets):
    """`harvest plan` (no Ray, nothing written) ends with exit 2 and one line matching."""
    import re

    cfg = tmp_path / "plan.yaml"
    cfg.write_text(f"model: {{path: {model}, backend: eager}}\ndata: {{source: {data}}}\n"
                   f"packing: {{context_size: 32, max_tokens: 512}}\n"
                   f"store: {{url: {tmp_path / 'store'}}}\nprogress: false\n")
    argv = ["plan", "--config", str(cfg)] + [a for s in sets for a in ("--set", s)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and re.search(match, err[-1]), err[-3:]
    assert not (tmp_path / "store").exists()


def test_non_utf8_jsonl_names_the_byte_not_an_empty_column_list(tiny_llama, tmp_path):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"text": "caf\xe9 au lait"}\n' * 5)
    store = tmp_path / "store"
    err = _fails(make_cfg(tiny_llama, str(store), data), DataError,
                 r"latin1.jsonl is not UTF-8 \(byte 0xe9 at line 1, offset 13; 5 of the first 5 "
                 r"lines.*re-encode it as UTF-8")
    assert "columns are" not in str(err)
    assert not store.exists()


def test_chat_messages_column_is_refused_by_plan(tiny_llama, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i} " * 10},
        {"role": "assistant", "content": "an answer " * 10}]}) + "\n" for i in range(8)))
    _plan_refused(capsys, tmp_path, tiny_llama, data,
                  r"data.text_column='messages' of .*chat.jsonl holds chat messages .*set "
                  r"data.format: chat and data.messages_column: messages", "data.text_column=messages")


def test_chat_format_without_conversations_or_template_is_refused_by_plan(tiny_llama, smollm2,
                                                                          tmp_path, capsys):
    """data.format: chat on a text column, and on a model without a chat template: one line each,
    before anything starts."""
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"plain text {i} " * 20, "messages": i}) + "\n"
                            for i in range(8)))
    chat = ("data.format=chat", "packing.bos=none")
    _plan_refused(capsys, tmp_path, smollm2, data,
                  r"data.messages_column='messages' of .*text.jsonl holds no conversations", *chat)
    _plan_refused(capsys, tmp_path, smollm2, data,
                  r"data.messages_column='conv' is not a column of .*text.jsonl",
                  *chat, "data.messages_column=conv")
    conv = tmp_path / "chat.jsonl"
    conv.write_text(json.dumps({"messages": [{"role": "user", "content": "hi " * 40}]}) + "\n")
    _plan_refused(capsys, tmp_path, tiny_llama, conv, r"needs the model's chat template, and "
                  r".* has none", *chat)


@pytest.mark.parametrize("rows, match", [
    ([""] * 100, r"had 100 rows \(all of them read\), 100 without usable text "
                 r"\(\{'empty': 100\}\), 0 tokens"),
    (["hi"], r"had 1 rows \(all of them read\), 0 without usable text \(none\), [12] tokens"),
])
def test_corpus_without_one_context_is_refused_by_plan(tiny_llama, tmp_path, capsys, rows, match):
    data = tmp_path / "few.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    _plan_refused(capsys, tmp_path, tiny_llama, data,
                  r"no complete context: data.source=.*few.jsonl' " + match
                  + r"; one context needs packing.context_size=32 tokens")


def test_missing_local_model_directory(docs, tmp_path):
    store = tmp_path / "store"
    missing = tmp_path / "models" / "no-such-model"
    _fails(make_cfg(str(missing), str(store), docs), ConfigError,
           rf"model.path='{missing}': no such directory: {missing} \(a path, not a hub name")
    _fails(make_cfg("./no-such-model", str(store), docs), ConfigError,
           r"model.path='./no-such-model': no such directory")
    assert not store.exists()


def test_unreachable_hub_fails_at_once_with_the_offline_hint(docs, tmp_path, monkeypatch):
    """No five retries with backoff (about 25 s): one refused connect decides."""
    import socket
    import time

    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        t0 = time.monotonic()
        _fails(make_cfg("someone/not-cached-model", str(tmp_path / "store"), docs), ConfigError,
               r"model.path='someone/not-cached-model': .*not a local directory and the Hugging "
               r"Face hub \(http://127.0.0.1:\d+\) cannot be reached .*HF_HUB_OFFLINE=1")
        assert time.monotonic() - t0 < 10


def test_endpoint_that_never_answers_is_named(tiny_llama, docs):
    import socket

    with socket.socket() as mute:  # accepts (the kernel's backlog) and never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        ep = f"http://127.0.0.1:{mute.getsockname()[1]}"
        so = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": ep}}
        _fails(make_cfg(tiny_llama, "s3://bucket/run", docs, "store.timeout_s=1",
                        "store.retry_budget_s=3", storage_options=so), StoreAccessError,
               rf"endpoint {ep} did not answer within store.timeout_s=1 s: .*"
               r"store.storage_options.client_kwargs.endpoint_url")


def test_endpoint_answering_not_found_names_the_bucket_and_endpoint(tiny_llama, docs):
    """A server that answers 404 to everything (a missing bucket on S3, or not an S3 server):
    once 'taking the store lease ... failed: FileNotFoundError: Not Found'."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def answer(self):  # the body is not read: the connection is closed instead
            self.close_connection = True
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()

        do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = answer

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    srv.daemon_threads, srv.block_on_close = True, False
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        ep = f"http://127.0.0.1:{srv.server_address[1]}"
        so = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": ep}}
        _fails(make_cfg(tiny_llama, "s3://bucket/run", docs, storage_options=so),
               StoreAccessError, rf"bucket 'bucket' of s3://bucket/run does not exist at endpoint "
                                 rf"{ep} .*store.create_bucket: true.*endpoint_url")
    finally:
        srv.shutdown()
        srv.server_close()


def test_missing_credentials_name_the_variables_and_the_secret(tiny_llama, docs, tmp_path,
                                                                monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    so = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    _fails(make_cfg(tiny_llama, "s3://bucket/run", docs, storage_options=so), StoreAccessError,
           r"NoCredentialsError.* -- no S3 credentials: set AWS_ACCESS_KEY_ID/"
           r"AWS_SECRET_ACCESS_KEY .*AWS_SHARED_CREDENTIALS_FILE.*infra/k8s/secret-s3.example.yaml")
