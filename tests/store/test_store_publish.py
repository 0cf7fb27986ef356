"""Committed means readable by every reader, or the store says it is not (store/commit/published.py).

On the real SeaweedFS S3 server (and a local directory where the storage matters): a writer that
dies between its marker and completing its uploads, then a lifecycle rule that aborts every
incomplete multipart upload; the three diagnoses of a committed object that cannot be read
(pending, gone, damaged) with their repairs and no wait before gone or damaged; finalize on a
store whose plan is not fully committed; `harvest finalize` and `harvest uncommit`.
"""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from harvest.store import create_store, open_store
from harvest.store.format import layout
from harvest.store.errors import DataIntegrityError, StoreError
from harvest.store.commit.published import published_units
from harvest.testing import synthetic

P, W, N, SHARD = 2, 32, 4096, 1024


def _store(url, so=None):
    s = create_store(url, points=["resid_post.0", "resid_post.1"], width=W, n_rows=N,
                     shard_rows=SHARD, chunk_rows=256, storage_options=so)
    s.ledger.write_plan(s.ledger.default_plan(1))  # 4 units of one shard each
    return s


def _fill(s, x, uids, monkeypatch=None, publish=True):
    """Write and commit units `uids`; publish=False: each writer dies between its marker and
    publishing (its uploads stay pending: a SIGKILL at that point, made deterministic)."""
    from harvest.store.write.writer import RegionWriter

    plan = s.ledger.plan()
    if publish:
        return synthetic.fill(s, x, units=[plan[u] for u in uids])
    with monkeypatch.context() as mp:
        mp.setattr(RegionWriter, "_publish", lambda self, manifest: None)
        return synthetic.fill(s, x, units=[plan[u] for u in uids])


def _abort_every_upload(seaweedfs, url) -> int:
    """What a bucket lifecycle rule that aborts incomplete multipart uploads does, through the
    S3 API itself (ListMultipartUploads, AbortMultipartUpload)."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **seaweedfs.storage_options)
    bucket, _, prefix = url[len("s3://"):].partition("/")
    ups = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    for u in ups:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    return len(ups)


def _zarr_rows(url, so, point, a=0, b=N):
    """What a reader that knows only zarr reads (fill zeros where nothing is published)."""
    from zarr.storage import FsspecStore

    st = FsspecStore.from_url(url, storage_options=so, read_only=True)
    return zarr.open_array(store=st, path=layout.point_path(point), mode="r")[a:b]


def _no_sleep(monkeypatch) -> list:
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    return slept


def test_lifecycle_abort_after_a_crash_between_marker_and_completion(seaweedfs, s3_url, monkeypatch):
    """Issue 37 item 1: units committed, their uploads never completed, then aborted by a
    lifecycle rule. Nothing may certify the store: verify names the gone units, finalize
    refuses, reads say gone at once; settle (what a resume and the end of a run do) uncommits
    them and the rewrite is bit-equal to a clean store, for zarr-only readers too."""
    so = seaweedfs.storage_options
    s = _store(s3_url, so)
    x = synthetic.activations((P, N, W), seed=5)
    _fill(s, x, [0, 2])
    _fill(s, x, [1, 3], monkeypatch, publish=False)
    assert sorted(published_units(s.location)) == [0, 2]
    assert _abort_every_upload(seaweedfs, s3_url) >= 2 * (P + 3)   # shards and metadata chunks

    r = open_store(s3_url, storage_options=so, read_only=True)
    v = r.verify()
    assert not v.ok and v.unpublished_units == 2 and not v.missing_units
    text = "\n".join(v.errors)
    assert "2 committed units are not published" in text and "harvest finalize" in text
    assert "unit 1: gone" in text and "unit 3: gone" in text and "harvest uncommit" in text
    slept = _no_sleep(monkeypatch)
    with pytest.raises(DataIntegrityError, match=r"unit 1 is gone.*harvest uncommit .* --unit 1"):
        r.read("resid_post.0", 1024, 2048)
    assert slept == []                                     # gone is said at once
    monkeypatch.undo()
    with pytest.raises(DataIntegrityError, match="unit 1: gone.*unit 3: gone"):
        open_store(s3_url, storage_options=so).finalize()

    rep = open_store(s3_url, storage_options=so).ledger.settle(repair=True)
    assert rep.uncommitted == [1, 3] and set(rep.gone) == {1, 3}
    assert open_store(s3_url, storage_options=so, read_only=True).verify().missing_units == [1, 3]
    s = open_store(s3_url, storage_options=so)
    _fill(s, x, [1, 3])                                    # the resume's re-capture
    v = s.verify()
    assert v.ok and v.unpublished_units == 0, v.errors
    s.finalize()
    r = open_store(s3_url, storage_options=so, read_only=True)
    assert r.verify(deep=True).ok
    for i, p in enumerate(r.points):
        assert np.array_equal(r.read(p, 0, N).view(np.uint16), x[i].view(np.uint16))
        assert np.array_equal(_zarr_rows(s3_url, so, p).view(np.uint16), x[i].view(np.uint16))


def test_pending_units_are_published_by_settle_and_the_three_diagnoses(seaweedfs, s3_url,
                                                                       monkeypatch):
    """Issue 37 item 4: pending (upload outstanding: `harvest finalize`, after a brief wait),
    gone (object deleted, no upload: uncommit + re-run, at once), damaged (object of another
    size or CRC: uncommit + re-run, at once)."""
    from harvest.store.commit import objects

    so = seaweedfs.storage_options
    s = _store(s3_url, so)
    x = synthetic.activations((P, N, W), seed=6)
    _fill(s, x, [0, 1, 2])
    _fill(s, x, [3], monkeypatch, publish=False)
    monkeypatch.setattr(objects, "UNPUBLISHED_WAIT_S", (0.01,))
    r = open_store(s3_url, storage_options=so, read_only=True)
    with pytest.raises(DataIntegrityError, match=r"unit 3 is committed, not yet published: "
                                                 r"pending.*harvest finalize"):
        r.read("resid_post.0", 3072, 4096)
    v = r.verify()
    assert "unit 3: pending" in "\n".join(v.errors) and v.unpublished_units == 1

    loc = s.location
    loc.delete(layout.shard_object_key("resid_post.1", 1))            # gone
    blob = loc.read_bytes(layout.shard_object_key("resid_post.0", 2))
    loc.write_bytes(layout.shard_object_key("resid_post.0", 2), blob[:-7])   # damaged: truncated
    blob = bytearray(loc.read_bytes(layout.shard_object_key("resid_post.1", 0)))
    blob[100] ^= 0x10
    loc.write_bytes(layout.shard_object_key("resid_post.1", 0), bytes(blob))  # damaged: a bit
    r = open_store(s3_url, storage_options=so, read_only=True)
    slept = _no_sleep(monkeypatch)
    for point, rows, unit, state in (("resid_post.1", (1024, 2048), 1, "gone"),
                                     ("resid_post.0", (2048, 3072), 2, "damaged"),
                                     ("resid_post.1", (0, 1024), 0, "damaged")):
        with pytest.raises(DataIntegrityError) as e:
            r.read(point, *rows)
        msg = str(e.value)
        assert f"of unit {unit} is {state}" in msg and "harvest uncommit" in msg and \
            f"--unit {unit}" in msg and "harvest finalize" not in msg, msg
    assert slept == []
    monkeypatch.undo()

    # the pending unit: settle completes its uploads and records it; the reads are exact
    rep = open_store(s3_url, storage_options=so).ledger.settle()
    assert rep.published == [3] and not rep.gone and not rep.damaged
    r = open_store(s3_url, storage_options=so, read_only=True)
    assert np.array_equal(r.read("resid_post.0", 3072, 4096).view(np.uint16),
                          x[0, 3072:].view(np.uint16))
    assert np.array_equal(_zarr_rows(s3_url, so, "resid_post.0", 3072, N).view(np.uint16),
                          x[0, 3072:].view(np.uint16))
    # damage after publication is what --objects (sizes) and --deep (bytes) find
    v = r.verify(objects=True)
    text = "\n".join(v.errors)
    assert "shard 1 is committed (unit 1) but its object is missing" in text
    assert "shard 2 object is" in text


def test_finalize_refuses_a_partial_plan_and_harvest_finalize_publishes(tmp_path, monkeypatch,
                                                                        capsys):
    """Issue 37 items 2 and 3: Store.finalize never shrinks a store whose plan is not fully
    committed; `harvest finalize URL` publishes what is committed (a writer that died before
    moving its objects) and says why it does not finalize; once every unit is in, it finalizes.
    `harvest uncommit` drops a unit for the re-run."""
    from harvest.pipeline.cli.main import main

    url = str(tmp_path / "p.zarr")
    s = _store(url)
    x = synthetic.activations((P, N, W), seed=7)
    _fill(s, x, [0])
    _fill(s, x, [1], monkeypatch, publish=False)   # objects still under its attempt's name
    import datetime as dt

    from harvest.pipeline.cli.text import status_text
    from harvest.pipeline.cli.views import status

    # issue 37 item 5: status says it (an hour after the last commit: an interrupted run)
    out = status_text(status(url, now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)))
    assert f"1 committed units unpublished (zarr-only readers see fill there): run `harvest " \
           f"finalize {url}` [1]" in out
    with pytest.raises(StoreError, match=r"not finished: 2 of its 4 planned units are not "
                                         r"committed.*re-run the harvest"):
        s.finalize()
    assert open_store(url).n_rows == N                  # nothing shrank
    assert main(["finalize", url]) == 1
    out = capsys.readouterr().out
    assert "published 1 committed units" in out and "not finalized: 2 of its 4 planned" in out
    r = open_store(url, read_only=True)
    assert r.summary is None and r.n_rows == N and r.ledger.unpublished_units() == []
    assert np.array_equal(_zarr_rows(url, None, "resid_post.1")[1024:2048].view(np.uint16),
                          x[1, 1024:2048].view(np.uint16))    # a zarr-only reader sees unit 1

    _fill(open_store(url), x, [2, 3])                  # the resume
    assert main(["finalize", url]) == 0
    assert "finalized" in capsys.readouterr().out
    r = open_store(url, read_only=True)
    assert r.summary is not None and r.verify(deep=True).ok

    assert main(["uncommit", url, "--unit", "2"]) == 0
    assert "re-capture" in capsys.readouterr().out
    v = open_store(url, read_only=True).verify()
    assert v.missing_units == [2] and not v.ok
    assert main(["uncommit", url, "--unit", "2"]) == 2  # not committed: nothing done


def test_a_store_shrunk_by_the_old_finalize_grows_back(tmp_path):
    """Issue 37 item 3: a store the old API finalized while its plan was partly committed
    (arrays shrunk to the highest committed row, finalize attributes written) gets its capacity
    back (what the driver's resume does) and the rest of the plan commits and finalizes."""
    from harvest.store.commit.finalize import _shrink, plan_gap, unfinalize

    url = str(tmp_path / "old.zarr")
    s = _store(url)
    x = synthetic.activations((P, N, W), seed=8)
    _fill(s, x, [0, 1])
    _shrink(s, 2048)                                   # what the old finalize did
    g = zarr.open_group(store=s.zarr_store, mode="r+", zarr_format=3)
    h = dict(g.attrs["harvest"])
    h["n_rows"] = 2048
    g.attrs.update({"harvest": h, "finalized_at": "then", "committed_rows": 2048, "summary": {}})
    s = open_store(url)
    assert s.n_rows == 2048 and plan_gap(s) is not None
    with pytest.raises(Exception, match="n_rows"):
        _fill(s, x, [2])                               # what the resume failed with
    assert unfinalize(s, N)
    s = open_store(url)
    assert s.n_rows == N and s.summary is None and "committed_rows" not in s.attributes
    _fill(s, x, [2, 3])
    s.finalize()
    r = open_store(url, read_only=True)
    assert r.verify(deep=True).ok and r.n_rows == N
    for i, p in enumerate(r.points):
        assert np.array_equal(r.read(p, 0, N).view(np.uint16), x[i].view(np.uint16))


def test_verify_and_status_name_a_bucket_that_does_not_exist(seaweedfs, monkeypatch, capsys):
    """Issue 37 item 5: a typo'd bucket is not "no store yet": both commands name it."""
    from harvest.pipeline.cli.main import main

    for k, v in seaweedfs.env.items():
        monkeypatch.setenv(k, v)
    for cmd in ("verify", "status"):
        assert main([cmd, "s3://harvest-tset/run"]) == 2
        err = capsys.readouterr().err
        assert "bucket 'harvest-tset'" in err and "does not exist" in err and "yet" not in err, err
