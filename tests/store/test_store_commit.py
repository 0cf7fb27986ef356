"""Crash safety: a killed writer leaves nothing visible; a rewrite commits once; races are caught."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from harvest.store import RegionConflict, RegionWriteFailed, create_store, open_store
from harvest.store.storage import locate as backend
from harvest.store.storage import retries, s3
from harvest.store.format import layout
from harvest.store.read.dataset import ActivationDataset
from harvest.store.commit.tables import unit_shards
from harvest.testing import synthetic

P, W, N, SHARD = 2, 32, 4096, 1024
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _store(url, so=None):
    s = create_store(url, points=["resid_post.0", "resid_post.1"], width=W, n_rows=N, shard_rows=SHARD,
                     chunk_rows=256, storage_options=so)
    s.ledger.write_plan(s.ledger.default_plan(2))  # unit 0 = rows [0, 2048), unit 1 = rows [2048, 4096)
    return s


def _meta(w):
    """The writer's rows' metadata (the actor gives it with the unit; commit requires it)."""
    n = w.row_end - w.row_start
    w.write_meta(w.row_start, np.arange(w.row_start, w.row_end, dtype=np.int32),
                 np.arange(n) // 64, np.arange(n) % 64)
    return w


@pytest.fixture(params=["local", "s3"])
def target(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run.zarr"), None
    return request.getfixturevalue("s3_url"), request.getfixturevalue("seaweedfs").storage_options


_CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from harvest.store import open_store
    from harvest.testing import synthetic
    url, so = sys.argv[1], json.loads(sys.argv[2])
    s = open_store(url, storage_options=so)
    x = synthetic.activations((2, 4096, 32), seed=7)
    w = s.region_writer(1, 2048, 4096, max_pending_shards=1)
    w.write(2048, x[:, 2048:3072])        # shard 2 complete -> uploads in the background
    w.write(3072, x[:, 3072:3500])        # shard 3 half written
    print("WROTE", flush=True)
    time.sleep(600)  # killed here by the test (SIGKILL mid-unit is the thing under test)
""")


def _shard_object_exists(store, point, shard):
    """An object of shard `shard` written by some attempt (not yet published: no marker): under
    the attempt's name (local), or an upload to the zarr key not completed (S3 multipart)."""
    from harvest.store.commit.objects import attempt_objects

    loc = store.location
    loc.invalidate()
    if layout.shard_object_key(point, shard) in loc.pending_uploads("").values():
        return True
    return any(s == shard for _, s, _, _ in attempt_objects(loc).get(layout.point_path(point), []))


def test_killed_writer_is_invisible_then_rewrite_commits_once(target):
    import json

    url, so = target
    x = synthetic.activations((P, N, W), seed=7)
    s = _store(url, so)
    synthetic.fill(s, x, units=[s.ledger.plan()[0]])
    env = {**os.environ, "PYTHONPATH": REPO}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, url, json.dumps(so)], stdout=subprocess.PIPE,
                             env=env, cwd=REPO, text=True)
    try:
        assert child.stdout.readline().strip() == "WROTE"
        deadline = time.monotonic() + 60
        while not all(_shard_object_exists(s, p, 2) for p in s.points):  # an uploaded shard of unit 1
            assert time.monotonic() < deadline, "child never uploaded shard 2"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    r = open_store(url, storage_options=so)
    assert not r.ledger.is_committed(1) and sorted(r.ledger.committed_units()) == [0]
    rows = np.concatenate([b["row"].numpy() for b in ActivationDataset(r, batch_size=500, return_meta=True)])
    assert np.array_equal(np.sort(rows), np.arange(0, 2048))  # shard 2's object exists, yet unseen
    v = r.verify()
    assert not v.ok and v.missing_units == [1] and v.committed_fraction == 0.5

    [m] = synthetic.fill(r, x, units=[r.ledger.plan()[1]], order="shuffled")  # the rewrite
    assert m.unit_id == 1
    markers = [n for n in r.location.list_dir(layout.COMMITS_DIR) if n.endswith(".json")]
    assert markers == ["unit-00000000.0-2048.json", "unit-00000001.2048-4096.json"]
    v = r.verify(deep=True)
    assert v.ok, v.errors
    for i, p in enumerate(r.points):
        assert np.array_equal(r.read(p, 0, N).view(np.uint16), x[i].view(np.uint16))

    # an at-least-once retry of the committed unit is a no-op: nothing written, same manifest back
    again = r.region_writer(1, 2048, 4096)
    assert again.already_committed
    again.write(2048, synthetic.activations((P, 2048, W), seed=99))
    m2 = again.commit()
    assert again.already_committed and m2.attempt == m.attempt
    assert r.verify(deep=True).ok


def test_second_live_writer_is_stopped_and_cannot_touch_the_committed_bytes(tmp_path):
    s = _store(str(tmp_path / "race.zarr"))
    xa = synthetic.activations((P, N, W), seed=1)
    xb = synthetic.activations((P, N, W), seed=2)
    a = _meta(s.region_writer(0, 0, 2048))
    b = _meta(s.region_writer(0, 0, 2048))
    a.write(0, xa[:, :2048])
    b.write(0, xb[:, :1024])               # b completes shard 0 (under its own attempt's name) ...
    ma = a.commit()                        # ... but a commits first
    with pytest.raises(RegionConflict, match="another writer"):
        b.write(1024, xb[:, 1024:2048])    # b notices the marker before uploading more
    v = s.verify(deep=True)
    assert v.missing_units == [1] and len(v.errors) == 1, v.errors  # a's bytes intact
    assert np.array_equal(s.read("resid_post.0", 0, 2048).view(np.uint16), xa[0, :2048].view(np.uint16))
    s.uncommit(0)                          # driver repair still works: rewrite the unit
    synthetic.fill(s, xa, units=[s.ledger.plan()[0]])
    assert s.ledger.commit_manifest(0).attempt != ma.attempt
    v = s.verify(deep=True)
    assert v.missing_units == [1] and len(v.errors) == 1  # only "unit 1 not committed" is left


def _fill_unit(s, data, uid, monkeypatch, publish=True):
    """Write and commit one unit; publish=False: its writer dies between its marker and the move
    of its objects to their zarr keys (they stay under its attempt's name, for finalize)."""
    from harvest.store.write.writer import RegionWriter

    with monkeypatch.context() as mp:
        if not publish:
            mp.setattr(RegionWriter, "_publish", lambda self, manifest: None)
        [m] = synthetic.fill(s, data, units=[s.ledger.plan()[uid]])
    return m


def _reads_exactly(url, so, want, attempt, unpublished=False):
    """Every consumer sees unit 0 as written by `attempt`: checked reads, the SAE reader, verify
    --deep (which, while unit 0's objects are under its attempt's name, says it is pending
    publication: zarr-only readers see fill there)."""
    import torch

    r = open_store(url, storage_options=so)
    for i, p in enumerate(r.points):
        assert np.array_equal(r.read(p, 0, N).view(np.uint16), want[i].view(np.uint16))
    got = np.zeros((N, P, W), np.uint16)
    seen = []
    for b in ActivationDataset(r, batch_size=500, return_meta=True):
        rows = b["row"].numpy()
        got[rows] = b["acts"].view(torch.int16).numpy().view(np.uint16)
        seen.append(rows)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(N))
    assert np.array_equal(got, want.transpose(1, 0, 2).view(np.uint16))
    v = r.verify(deep=True)
    if unpublished:
        assert v.unpublished_units == 1 and not v.missing_units, v.errors
        assert "unit 0: pending" in "\n".join(v.errors), v.errors
    else:
        assert v.ok, v.errors
    assert r.ledger.committed_units()[0].attempt == attempt


def _refuses_unpublished(url, so, finalize_with):
    """A committed unit whose uploads were never completed: checked reads raise the error that
    names the fix; `finalize_with` (a store) then completes them."""
    from harvest.store.errors import DataIntegrityError

    r = open_store(url, storage_options=so)
    with pytest.raises(DataIntegrityError, match="committed, not yet published.*harvest finalize"):
        r.read(r.points[0], 0, 2048)
    if finalize_with is not None:
        finalize_with.finalize()


@pytest.mark.parametrize("publish", [True, False], ids=["published", "died-before-publish"])
def test_uncommit_then_a_different_rewrite_is_what_everyone_reads(target, monkeypatch, publish):
    """Issue 29, item 1: the documented repair (uncommit + rewrite) after the unit was indexed.
    The rewrite's bytes differ (new attempt, sizes and digests), yet the index still holds the old
    marker under the same name: readers, verify and finalize must take the new marker, and
    finalize must publish the new attempt's objects, never delete them."""
    import google_crc32c

    from harvest.store.commit.objects import attempt_objects

    url, so = target
    s = _store(url, so)
    x = synthetic.activations((P, N, W), seed=21)
    y = synthetic.activations((P, N, W), seed=22)
    y[:, :700] = 0                          # compresses differently: other sizes, other digests
    # On S3 a writer's objects are multipart uploads to the zarr keys, completed after its
    # marker: one that died before completing them has nothing readable until finalize does,
    # and every checked read says so (never fill zeros, never the previous attempt's bytes).
    unpublished = not publish and so is not None
    # a reader waits ~4 s for a pending upload before refusing (objects.UNPUBLISHED_WAIT_S);
    # nothing completes these, so one short wait says the same here
    monkeypatch.setattr("harvest.store.commit.objects.UNPUBLISHED_WAIT_S", (0.05,))
    old = _fill_unit(s, x, 0, monkeypatch, publish)
    m1 = _fill_unit(s, x, 1, monkeypatch)
    s.ledger.write_index([old, m1])                # the driver indexes markers as units commit
    moved_later = not publish and so is None   # local: readers take the attempt's copy
    if unpublished:
        _refuses_unpublished(url, so, s)
    _reads_exactly(url, so, x, old.attempt, moved_later)

    s.uncommit(0)
    new = _fill_unit(s, y, 0, monkeypatch, publish)
    assert new.attempt != old.attempt
    assert [sh.nbytes for sh in unit_shards(s, new)] != [sh.nbytes for sh in unit_shards(s, old)]
    want = np.concatenate([y[:, :2048], x[:, 2048:]], axis=1)
    if unpublished:  # the zarr keys still hold the old attempt's bytes: refused by digest
        _refuses_unpublished(url, so, None)
        s.ledger.write_index([new])
        _refuses_unpublished(url, so, None)
    else:
        _reads_exactly(url, so, want, new.attempt, moved_later)  # the rewrite's marker, not yet indexed
        s.ledger.write_index([new])                    # ... and once the driver indexed it as well
        _reads_exactly(url, so, want, new.attempt, moved_later)

    s.finalize()
    _reads_exactly(url, so, want, new.attempt)
    r = open_store(url, storage_options=so)
    for sh in unit_shards(r, new):          # the new attempt's bytes are the published objects
        for i, p in enumerate(r.points):
            blob = r.location.read_bytes(layout.shard_object_key(p, sh.index))
            assert blob is not None and google_crc32c.value(blob) == sh.object_crc32c[i]
    r.location.invalidate()
    left = {a for objs in attempt_objects(r.location).values() for _, _, a, _ in objs}
    assert not left & {old.attempt, new.attempt}  # stale leftovers cleaned, new published
    assert not r.location.pending_uploads("")  # S3: every upload completed or aborted
    s.finalize()                            # a second finalize (compacted index) changes nothing
    _reads_exactly(url, so, want, new.attempt)


def test_uncommit_voids_every_indexed_copy_of_the_unit(tmp_path, monkeypatch):
    """Two writers that both believed they committed (check-then-write race, FORMAT.md) both had
    their marker indexed, while the listed marker holds the later PUT's. uncommit must void the
    index copies of both attempts, or the rewrite would be read with one of their digests."""
    from harvest.store.commit import markers as commits

    url = str(tmp_path / "twice.zarr")
    s = _store(url)
    x = synthetic.activations((P, N, W), seed=31)
    y = synthetic.activations((P, N, W), seed=32)
    y[:, :900] = 0
    first = _fill_unit(s, x, 0, monkeypatch)
    commits.delete_marker(s.location, commits.MarkerName(0, 0, 2048))  # the later PUT won:
    second = _fill_unit(s, x, 0, monkeypatch)                         # its marker is listed
    m1 = _fill_unit(s, x, 1, monkeypatch)
    s.ledger.write_index([first, m1])
    s.ledger.write_index([second])
    s.uncommit(0)
    voids = {layout.parse_void_name(n) for n in s.location.list_dir(layout.INDEX_DIR)} - {None}
    assert voids == {(0, first.attempt), (0, second.attempt)}
    new = _fill_unit(s, y, 0, monkeypatch)
    _reads_exactly(url, None, np.concatenate([y[:, :2048], x[:, 2048:]], axis=1), new.attempt)
    s.finalize()
    _reads_exactly(url, None, np.concatenate([y[:, :2048], x[:, 2048:]], axis=1), new.attempt)


def test_commit_race_loser_gets_conflict(tmp_path):
    s = _store(str(tmp_path / "race2.zarr"))
    x = synthetic.activations((P, N, W), seed=3)
    a, b = _meta(s.region_writer(1, 2048, 4096)), _meta(s.region_writer(1, 2048, 4096))
    a.write(2048, x[:, 2048:])
    b.write(2048, x[:, 2048:])
    a.commit()
    with pytest.raises(RegionConflict):
        b.commit()
    assert [n for n in s.location.list_dir(layout.COMMITS_DIR) if n.endswith(".json")] == \
        ["unit-00000001.2048-4096.json"]


def test_create_once_local_and_s3(tmp_path, seaweedfs, s3_url):
    for url, so in ((str(tmp_path / "c"), None), (s3_url, seaweedfs.storage_options)):
        loc = backend.locate(url, so)
        assert loc.create_once("m/unit.json", b"first") is True
        assert loc.create_once("m/unit.json", b"second") is False
        assert loc.read_bytes("m/unit.json") == b"first"


def test_s3_if_none_match_probe_and_check_then_write_fallback(seaweedfs, s3_url):
    loc = backend.locate(s3_url, seaweedfs.storage_options)
    path = loc.key("direct/probe")
    loc.fs.pipe_file(path, b"1", mode="create")
    try:
        loc.fs.pipe_file(path, b"2", mode="create")
        server_honours = False
    except OSError:
        server_honours = True
    assert loc.honours_if_none_match() is server_honours  # the probe reports what the server does
    key = (seaweedfs.endpoint, loc.root.split("/", 1)[0])
    saved = s3._CREATE_ONCE_PROBES.get(key)
    s3._CREATE_ONCE_PROBES[key] = False  # force the documented check-then-write path
    try:
        assert loc.create_once("fb/unit.json", b"a") is True
        assert loc.create_once("fb/unit.json", b"b") is False
        assert loc.read_bytes("fb/unit.json") == b"a"
    finally:
        s3._CREATE_ONCE_PROBES[key] = saved


def test_permanent_upload_failure_leaves_region_uncommitted(seaweedfs, s3_url):
    """A read-only identity cannot put shards: the writer reports it, no marker appears."""
    admin = _store(s3_url, seaweedfs.storage_options)
    ro = open_store(s3_url, storage_options=seaweedfs.readonly_storage_options)
    x = synthetic.activations((P, N, W), seed=4)
    w = _meta(ro.region_writer(0, 0, 2048, retries=2))
    with pytest.raises(RegionWriteFailed) as ei:
        w.write(0, x[:, :2048])
        w.commit()
    msg = str(ei.value)
    assert "unit 0" in msg and "uncommitted" in msg
    for secret in (seaweedfs.secret_key, seaweedfs.readonly_secret_key):
        assert secret not in msg
    assert not admin.ledger.is_committed(0)
    w.abort()
    synthetic.fill(admin, x, units=[admin.ledger.plan()[0]])  # the region can still be written properly
    assert admin.ledger.is_committed(0)


def test_retry_policy_classifies_errors():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset by peer")
        return "ok"

    assert retries.with_retries(flaky, "x", attempts=5, sleep=lambda s: None) == "ok" and len(calls) == 3
    calls.clear()

    def denied():
        calls.append(1)
        raise PermissionError("AccessDenied")

    with pytest.raises(PermissionError):
        retries.with_retries(denied, "x", attempts=5, sleep=lambda s: None)
    assert len(calls) == 1  # never retried
    calls.clear()

    def down():
        calls.append(1)
        raise TimeoutError("read timeout")

    delays = []
    with pytest.raises(TimeoutError):
        retries.with_retries(down, "x", attempts=4, base_delay=0.5, sleep=delays.append)
    assert len(calls) == 4 and len(delays) == 3
    assert all(0.25 * 2 ** i <= d <= 0.5 * 2 ** i for i, d in enumerate(delays))  # backoff grows


def test_writer_threads_run_below_the_caller_and_reuse_shard_buffers(tmp_path):
    """The writer's upload and encode threads are nice'd (they must fill the engine's idle gaps,
    not preempt its OpenMP team), and the next unit's shard buffers are the previous unit's."""
    from harvest.store.format import shardcodec

    s = _store(str(tmp_path / "run.zarr"))
    x = synthetic.activations((P, N, W), seed=3)
    me = os.getpriority(os.PRIO_PROCESS, os.getpid())
    w = _meta(s.region_writer(0, 0, 2048))
    nice_up = w._pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, __import__("threading").get_native_id())).result()
    nice_enc = shardcodec.codec_pool(background=True).submit(
        lambda: os.getpriority(os.PRIO_PROCESS, __import__("threading").get_native_id())).result()
    assert nice_up == nice_enc == min(19, me + shardcodec.BACKGROUND_NICE)
    # and they carry their names at the OS level, where per-thread CPU is measured (/proc, top -H)
    comm = lambda: open(f"/proc/self/task/{__import__('threading').get_native_id()}/comm").read().strip()
    if os.path.exists("/proc/self/task"):
        assert w._pool.submit(comm).result().startswith("harvest-up-0")
        assert shardcodec.codec_pool(background=True).submit(comm).result().startswith("harvest-encode")
    w.write(0, x[:, :2048])
    w.commit()
    seen = {id(b) for b in s.block_buffers._free}
    assert seen, "finished shards' buffers are kept for reuse"
    w = _meta(s.region_writer(1, 2048, 4096))
    w.write(2048, x[:, 2048:3072])
    assert id(w._states[2].data.base) in seen  # reused, and the rows written are the new ones
    w.write(3072, x[:, 3072:])
    w.commit()
    r = open_store(str(tmp_path / "run.zarr"))
    for i, p in enumerate(r.points):
        assert np.array_equal(r.read(p, 0, N).view(np.uint16), x[i].view(np.uint16))
