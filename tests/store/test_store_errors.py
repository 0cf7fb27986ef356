"""Bad input gets a clear error naming the field and the fix; secrets never appear in errors."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import zarr

from harvest.store import (NotAHarvestStore, StoreAccessError, StoreError, StoreSpec,
                                    UnknownLayoutVersion, create_store, open_store)
from harvest.store.storage.credentials import scrub
from harvest.testing import synthetic


def _small(url, **kw):
    kw = {"points": ["resid_post.0"], "width": 16, "n_rows": 1000, "shard_rows": 256, "chunk_rows": 64, **kw}
    return create_store(url, **kw)


def test_refuses_what_is_not_ours(tmp_path):
    with pytest.raises(NotAHarvestStore, match="zarr.json not found"):
        open_store(str(tmp_path / "nothing"))
    zarr.create_group(str(tmp_path / "plain"), attributes={"foo": 1})
    with pytest.raises(NotAHarvestStore, match="not a harvest activation store"):
        open_store(str(tmp_path / "plain"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "zarr.json").write_text("{not json")
    with pytest.raises(NotAHarvestStore, match="not JSON"):
        open_store(str(tmp_path / "junk"))


def test_refuses_unknown_layout_version(tmp_path):
    _small(str(tmp_path / "s"))
    meta_path = tmp_path / "s" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["harvest"]["layout_version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(UnknownLayoutVersion, match="layout_version=99.*reads versions \\[2, 3, 4, 5\\]"):
        open_store(str(tmp_path / "s"))


def test_create_store_argument_errors(tmp_path):
    u = str(tmp_path / "x")
    with pytest.raises(ValueError, match="points must name"):
        _small(u, points=[])
    with pytest.raises(ValueError, match="bad point name"):
        _small(u, points=["resid post.1"])
    with pytest.raises(ValueError, match="duplicates"):
        _small(u, points=["resid_post.1", "resid_post.1"])
    with pytest.raises(ValueError, match="collides"):
        _small(u, points=["token_id"])
    with pytest.raises(ValueError, match="width must be a positive int"):
        _small(u, width=0)
    with pytest.raises(ValueError, match="dtype='int8' is not supported: use one of bfloat16"):
        _small(u, dtype="int8")
    with pytest.raises(ValueError, match="chunk_rows=64 must divide shard_rows=250"):
        _small(u, shard_rows=250)
    with pytest.raises(ValueError, match="compression='brotli' is unknown"):
        _small(u, compression="brotli")
    with pytest.raises(ValueError, match="cname='lzma'"):
        _small(u, compression={"codec": "blosc", "cname": "lzma"})
    with pytest.raises(ValueError, match="blocksize=-1: use 0"):
        _small(u, compression={"codec": "blosc", "blocksize": -1})
    with pytest.raises(ValueError, match="attrs must be JSON-serialisable"):
        _small(u, attrs={"bad": object()})
    _small(u)
    with pytest.raises(StoreError, match="already holds a zarr node.*overwrite=True"):
        _small(u)
    assert _small(u, overwrite=True).n_rows == 1000


def test_store_spec_is_the_keyword_form(tmp_path):
    """create_store(spec=StoreSpec(...)) records exactly what the same fields as keywords record
    (read back from each store's attributes and arrays, not from the spec); a spec is resolved
    when made (sizes chosen, names canonical); both forms at once or an unknown field is refused."""
    fields = dict(points=["resid_post.3", "resid_post.1"], width=16, n_rows=1000, chunk_rows=64,
                  dtype="bf16", context_size=64, special_token_ids=[5, 1, 5], bos_token_id=1,
                  stats_skip_positions=1, generated=True)
    a = create_store(str(tmp_path / "kw"), **fields)
    spec = StoreSpec(**fields)
    b = create_store(str(tmp_path / "spec"), spec=spec)
    drop = ("created_at", "created_by")
    ha, hb = ({k: v for k, v in s.harvest_attrs.items() if k not in drop} for s in (a, b))
    assert ha == hb
    assert (spec.shard_rows, spec.chunk_rows, spec.meta_chunk_rows) == (b.shard_rows, 64, b.shard_rows)
    assert spec.dtype == "bfloat16" and spec.special_token_ids == (1, 5) and spec.points == tuple(fields["points"])
    assert spec.columns == ("token_id", "doc_id", "position", "gen") and list(b.meta_columns) == list(spec.columns)
    assert b.array("resid_post.1").shards == (b.shard_rows, 16)
    with pytest.raises(ValueError, match="not both"):
        create_store(str(tmp_path / "x"), spec=spec, width=32)
    with pytest.raises(TypeError, match="unknown StoreSpec field.*shardrows"):
        create_store(str(tmp_path / "x"), points=["resid_post.0"], width=8, n_rows=64, shardrows=64)
    with pytest.raises(ValueError, match="meta_chunk_rows=96 must be a multiple of shard_rows=64"):
        StoreSpec(points=["resid_post.0"], width=8, n_rows=256, shard_rows=64, chunk_rows=32, meta_chunk_rows=96)
    # the size rule (layout.check_sizes), checked once on the chosen sizes: an explicit shard
    # alone, and an explicit chunk against a derived shard
    with pytest.raises(ValueError, match="shard_rows=100 is not a multiple of context_size=64: use 128 or 64"):
        StoreSpec(points=["resid_post.0"], width=8, n_rows=1 << 20, shard_rows=100, context_size=64)
    with pytest.raises(ValueError, match=r"chunk_rows=48 must divide shard_rows=\d+"):
        StoreSpec(points=["resid_post.0"], width=8, n_rows=1 << 20, chunk_rows=48, context_size=64)
    with pytest.raises(ValueError, match="roles=1 must be True or False"):
        StoreSpec(points=["resid_post.0"], width=8, n_rows=64, roles=1)


def test_region_and_write_errors(tmp_path):
    s = _small(str(tmp_path / "w"))
    with pytest.raises(ValueError, match="not shard-aligned.*shard_rows=256"):
        s.region_writer(0, 100, 512)
    with pytest.raises(ValueError, match="not shard-aligned"):  # only the last unit may end mid-shard
        s.ledger.write_plan([{"unit_id": 0, "row_start": 0, "row_end": 300},
                             {"unit_id": 1, "row_start": 512, "row_end": 768}])
    with pytest.raises(ValueError, match="overlap"):
        s.ledger.write_plan([(0, 0, 512), (1, 256, 768)])
    with pytest.raises(ValueError, match="lacks field 'row_end'"):
        s.ledger.write_plan([{"unit_id": 0, "row_start": 0}])
    s.ledger.write_plan(s.ledger.default_plan(2))
    w = s.region_writer(0, 0, 512)
    x = synthetic.activations((1, 512, 16))
    with pytest.raises(ValueError, match="must be \\[n_points=1, n, width=16\\]"):
        w.write(0, x[:, :, :8])
    with pytest.raises(ValueError, match="dtype float32 does not match the store dtype bfloat16"):
        w.write(0, x.astype(np.float32))
    with pytest.raises(ValueError, match="outside unit 0's region"):
        w.write(500, x[:, :20])
    w.write(0, x[:, :100])
    with pytest.raises(ValueError, match="already written"):
        w.write(50, x[:, :10])
    with pytest.raises(ValueError, match="412 rows never written"):
        w.commit()
    w.write(100, x[:, 100:])
    with pytest.raises(ValueError, match="512 rows without metadata"):
        w.commit()
    with pytest.raises(ValueError, match="same length"):
        w.write_meta(0, np.zeros(3, int), np.zeros(2, int), np.zeros(3, int))
    with pytest.raises(ValueError, match="outside unit 0's region"):
        w.write_meta(510, np.zeros(3, int), np.zeros(3, int), np.zeros(3, int))
    w.write_meta(0, np.arange(512), np.zeros(512, int), np.arange(512))
    with pytest.raises(ValueError, match="already written"):
        w.write_meta(10, np.zeros(3, int), np.zeros(3, int), np.zeros(3, int))
    assert w.commit().n_rows == 512
    # a writer of unit 1 with another row range than the plan's commits a marker that never counts
    other = s.region_writer(1, 512, 768)
    other.write_meta(512, np.zeros(256, int), np.zeros(256, int), np.zeros(256, int))
    other.write(512, synthetic.activations((1, 256, 16)))
    other.commit()
    assert sorted(s.ledger.committed_units()) == [0]
    v = s.verify()
    assert not v.ok and v.missing_units == [1]
    assert any("committed rows [512,768) but the plan says [512,1000)" in e for e in v.errors)
    ro = open_store(str(tmp_path / "w"), read_only=True)
    with pytest.raises(StoreError, match="read-only"):
        ro.region_writer(1, 512, 1000)


def test_wrong_credentials_clear_error_without_secret(seaweedfs, s3_url):
    _small(s3_url, storage_options=seaweedfs.storage_options)
    bad_secret = "Wr0ngSecretValue-" + seaweedfs.secret_key[:6]
    for so in ({**seaweedfs.storage_options, "secret": bad_secret},
               {**seaweedfs.storage_options, "key": "AKIANOSUCHKEY123", "secret": bad_secret}):
        with pytest.raises(StoreAccessError) as ei:
            open_store(s3_url, storage_options=so)
        msg = str(ei.value)
        assert "check the credentials" in msg and s3_url in msg
        assert bad_secret not in msg and seaweedfs.secret_key not in msg
        assert ei.value.__cause__ is None and ei.value.__suppress_context__


def test_env_credentials_are_used_and_never_printed(seaweedfs, s3_url, monkeypatch):
    for k, v in seaweedfs.env.items():
        monkeypatch.setenv(k, v)
    s = _small(s3_url, attrs={"run": {"storage_options": {"secret": seaweedfs.secret_key}},
                              "note": f"made with {seaweedfs.secret_key}", "tokenizer": "gpt2",
                              "bos_token": "<s>"})
    assert open_store(s3_url).n_rows == 1000  # endpoint + keys from AWS_* env only
    attrs = json.dumps(open_store(s3_url).attrs)
    assert seaweedfs.secret_key not in attrs
    assert '"tokenizer": "gpt2"' in attrs and '"bos_token": "<s>"' in attrs
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "EnvWrongSecret-abcdef")
    with pytest.raises(StoreAccessError) as ei:
        open_store(s3_url)
    assert "EnvWrongSecret-abcdef" not in str(ei.value)
    assert s.n_rows == 1000


def test_unreachable_endpoint_names_the_endpoint_setting():
    with socket.socket() as sk:  # a port nobody listens on
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    so = {"key": "k", "secret": "UnreachableSecret-123", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
          "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    with pytest.raises(StoreAccessError) as ei:
        open_store("s3://harvest-test/none", storage_options=so)
    msg = str(ei.value)
    assert "check the endpoint" in msg and "UnreachableSecret-123" not in msg


def test_scrub_removes_userinfo_and_known_secrets():
    so = {"key": "AKIAEXAMPLE", "secret": "s3cr3tValue"}
    text = "failed GET s3://AKIAEXAMPLE:s3cr3tValue@bucket/x with s3cr3tValue"
    out = scrub(text, so)
    assert "s3cr3tValue" not in out and "AKIAEXAMPLE" not in out and "s3://***@bucket/x" in out
