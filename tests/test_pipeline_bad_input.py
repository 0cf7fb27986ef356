"""Bad input fails before anything is written, with an error naming the field and the fix.

Each case runs the real driver (`run`) and then checks the store location is untouched: no local
directory, no S3 object under the prefix. All but one fail before Ray starts, so they are cheap;
a corpus without a single complete context is known only once it is tokenised (on the cluster),
and still fails before the store is created.
"""

from __future__ import annotations

import json

import pytest

from harvest.pipeline.cli import main
from harvest.pipeline.config import ConfigError
from harvest.pipeline.data import DataError
from harvest.pipeline.driver import run
from harvest.pipeline.packing import PackingError
from harvest.pipeline.store import StoreAccessError
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
     r"no complete context: data.source=.* had 3 rows, 3 without usable text"),
])
def test_empty_dataset(request, tiny_llama, tmp_path, content, exc, match):
    if exc is PackingError:
        request.getfixturevalue("ray_cluster")
    data = tmp_path / "d.jsonl"
    data.write_text(content)
    store = tmp_path / "store"
    _fails(make_cfg(tiny_llama, str(store), data), exc, match)
    assert not store.exists()


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
    with pytest.raises(ConfigError, match=r"capture.points entry 'resid_mid.1': unknown point "
                                          r"'resid_mid'; known points"):
        make_cfg(tiny_llama, str(store), docs, capture={"points": ["resid_mid.1"]})
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
    from harvest.pipeline.driver import HarvestError

    _fails(make_cfg(tiny_llama, str(store), docs), HarvestError, r"not empty and is not a harvest store")
    assert sorted(p.name for p in store.iterdir()) == ["notes.txt"]


def test_cli_reports_bad_input_in_one_line(tiny_llama, docs, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {tiny_llama}, backend: eager}}\n"
                   f"data: {{source: {docs}}}\npackng: {{context_size: 64}}\n")
    assert main(["run", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("harvest run: error: unknown field packng: did you mean packing?")
