"""Integrity: every byte verify or the reader trusts is checked against its commit marker.

Each damage case runs on a fresh copy of one small committed store. For each, the cheapest
`harvest verify` that can see it (plain, `--objects` when only a listing sees it, `--deep` when
only reading the bytes does) exits 1, and iterating the reader
raises a StoreError naming the damage, never rows of zeros or an unrelated traceback.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import numpy as np
import pytest

from harvest.pipeline.cli.main import main
from harvest.store import DataIntegrityError, RegionConflict, RegionWriteFailed, StoreAccessError, StoreError, create_store, open_store
from harvest.store.storage import locate as backend
from harvest.store.format import layout
from harvest.store.commit.objects import attempt_objects
from harvest.store.read.dataset import ActivationDataset
from harvest.testing import synthetic
from tests.support.reader_stores import make_store

N, SHARD, W, CTX = 2048, 256, 16, 64
POINTS = ("resid_post.0", "resid_post.1")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("integrity") / "store.zarr"
    s, data, tok, doc, pos = make_store(path, N, SHARD, width=W, points=POINTS, context=CTX)
    return str(path), data, tok


@pytest.fixture
def copy(pristine, tmp_path):
    src, data, tok = pristine
    dst = str(tmp_path / "copy.zarr")
    shutil.copytree(src, dst)
    return dst, data, tok


def _shard(path, p, s):
    return os.path.join(path, layout.shard_object_key(p, s))


def _flip(f, offset):
    with open(f, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x5A]))


def _read_all(path, **kw):
    ds = ActivationDataset(path, points=list(POINTS), batch_size=300, return_meta=True, **kw)
    return list(ds)


# ---- the damage cases: (name, damage(path), only deep verify can see it) ------------------------
def meta_rewrite(path):
    import zarr

    a = zarr.open_array(os.path.join(path, "token_id"), mode="r+")
    a[256:512] = np.asarray(a[256:512]) + 1   # valid encoding, wrong values


def meta_flip(path):
    f = os.path.join(path, layout.meta_chunk_key("token_id", 1))
    _flip(f, os.path.getsize(f) // 2)


def shard_delete(path):
    os.remove(_shard(path, "resid_post.0", 2))


def shard_flip(path):
    f = _shard(path, "resid_post.1", 3)
    _flip(f, os.path.getsize(f) // 3)


def shards_swapped(path):
    a, b = _shard(path, "resid_post.0", 1), _shard(path, "resid_post.0", 2)
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)


def shard_copied(path):
    shutil.copyfile(_shard(path, "resid_post.0", 1), _shard(path, "resid_post.0", 4))


def temp_file_in_shard_folder(path):
    f = _shard(path, "resid_post.0", 5)
    os.rename(f, f + ".tmp-0123456789abcdef")   # the shard itself is gone, its temp file is not


def shard_truncated(path):
    f = _shard(path, "resid_post.1", 6)
    os.truncate(f, os.path.getsize(f) // 2)


def shard_index_corrupt(path):
    f = _shard(path, "resid_post.0", 7)
    _flip(f, os.path.getsize(f) - 10)   # inside the index (offsets, nbytes), before its CRC


def n_rows_edited(path):
    f = os.path.join(path, "zarr.json")
    meta = json.load(open(f))
    meta["attributes"]["harvest"]["n_rows"] = 1000
    json.dump(meta, open(f, "w"))


def marker_deleted_after_finalize(path):
    open_store(path).finalize()
    d = os.path.join(path, layout.COMMITS_DIR)
    os.remove(os.path.join(d, sorted(os.listdir(d))[3]))


# the cheapest verify that sees each: plain (markers, plan), --objects (one listing per array,
# sizes) or --deep (every byte, by the markers' names); each stronger one sees it too
CASES = [(meta_rewrite, "deep"), (meta_flip, "deep"), (shard_delete, "objects"),
         (shard_flip, "deep"), (shards_swapped, "deep"), (shard_copied, "deep"),
         (temp_file_in_shard_folder, "objects"), (shard_truncated, "objects"),
         (shard_index_corrupt, "deep"), (n_rows_edited, "plain"),
         (marker_deleted_after_finalize, "plain")]


def test_pristine_store_verifies_and_reads_every_row_exactly(copy, capsys):
    path, data, tok = copy
    assert main(["verify", path]) == 0
    assert main(["verify", path, "--objects"]) == 0
    assert main(["verify", path, "--deep"]) == 0
    out = capsys.readouterr().out
    assert "deep: 16 shard objects, 24 metadata chunks, 8 stats sidecars" in out
    batches = _read_all(path)
    rows = np.concatenate([b["row"].numpy() for b in batches])
    acts = np.concatenate([b["acts"].view(dtype=__import__("torch").int16).numpy() for b in batches])
    assert np.array_equal(np.sort(rows), np.arange(N))
    assert np.array_equal(acts.view(np.uint16), data.transpose(1, 0, 2)[rows].view(np.uint16))
    assert np.array_equal(np.concatenate([b["token_id"].numpy() for b in batches]), tok[rows])


@pytest.mark.parametrize("damage,level", CASES, ids=[c.__name__ for c, _ in CASES])
def test_damage_is_reported_by_verify_and_refused_by_the_reader(copy, damage, level, capsys):
    path = copy[0]
    damage(path)
    # plain verify lists no object (an end-of-run step must not: tens of thousands of LIST
    # pages at corpus scale), so damage only a listing sees passes it, and --objects finds it
    assert main(["verify", path]) == (1 if level == "plain" else 0)
    capsys.readouterr()
    if level != "deep":
        assert main(["verify", path, "--objects"]) == 1
        out = capsys.readouterr().out
        assert "FAILED" in out or "INCOMPLETE" in out
    assert main(["verify", path, "--deep"]) == 1
    out = capsys.readouterr().out
    assert "Traceback" not in out
    with pytest.raises(StoreError) as ei:
        _read_all(path)
    assert isinstance(ei.value, DataIntegrityError), repr(ei.value)
    msg = str(ei.value)   # names what to do: the repair (uncommit) or the check that finds it
    assert "uncommit" in msg or "verify" in msg, msg
    if level == "objects" and damage is not temp_file_in_shard_folder:  # missing or truncated
        assert ("is gone" in msg or "is damaged" in msg) and "harvest uncommit" in msg, msg


def test_status_shows_units_lost_after_finalize(copy, capsys):
    path = copy[0]
    marker_deleted_after_finalize(path)
    assert main(["status", path]) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and "uncommitted units: [3]" in out


def test_late_writer_cannot_replace_the_committed_bytes(tmp_path):
    s = create_store(str(tmp_path / "race.zarr"), points=list(POINTS), width=W, n_rows=N, shard_rows=SHARD,
                     chunk_rows=128)
    s.ledger.write_plan(s.ledger.default_plan(2))
    xa, xb = synthetic.activations((2, N, W), seed=1), synthetic.activations((2, N, W), seed=2)
    meta = [np.arange(512, dtype=np.int32), np.zeros(512, np.int64), np.arange(512, dtype=np.int32)]
    a, b = s.region_writer(0, 0, 512), s.region_writer(0, 0, 512)
    for w, _x in ((a, xa), (b, xb)):
        w.write_meta(0, *meta)
    b.write(0, xb[:, :512])                 # every shard of b uploaded before a commits ...
    a.write(0, xa[:, :512])
    ma = a.commit()
    with pytest.raises(RegionConflict):
        b.commit()                          # ... and b's marker loses: its objects never land
    r = open_store(str(tmp_path / "race.zarr"))
    for i, p in enumerate(POINTS):
        assert np.array_equal(r.read(p, 0, 512).view(np.uint16), xa[i, :512].view(np.uint16))
    assert r.ledger.commit_manifest(0).attempt == ma.attempt
    assert attempt_objects(r.location) == {}       # b's objects removed, a's published
    v = r.verify(deep=True)
    assert v.errors == [v.errors[0]] and "not committed" in v.errors[0]  # only units 1..3


def test_full_disk_write_leaves_no_temp_files_or_objects(tmp_path, monkeypatch):
    path = str(tmp_path / "full.zarr")
    s = create_store(path, points=list(POINTS), width=W, n_rows=N, shard_rows=SHARD, chunk_rows=128)
    s.ledger.write_plan(s.ledger.default_plan(2))
    x = synthetic.activations((2, N, W), seed=3)
    real = os.fsync
    state = {"full": True}

    def fsync(fd):
        if state["full"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    w = s.region_writer(0, 0, 512, retries=1)
    w.write_meta(0, np.zeros(512, np.int32), np.zeros(512, np.int64), np.zeros(512, np.int32))
    monkeypatch.setattr(backend.os, "fsync", fsync)
    w.write(0, x[:, :256])                 # shard 0's upload fails in the background ...
    with pytest.raises(RegionWriteFailed, match="No space left"):
        w.write(256, x[:, 256:512])
        w.commit()                         # ... and is reported by the next call at the latest
    state["full"] = False
    left = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if ".tmp-" in f]
    assert left == [] and attempt_objects(s.location) == {}
    assert not s.ledger.is_committed(0)
    synthetic.fill(s, x, units=[s.ledger.plan()[0]])   # the unit can be written once the disk has room
    assert s.verify(deep=True).committed_units == 1


def test_evicted_shards_go_through_scratch_and_commit_the_same_bits(tmp_path):
    path = str(tmp_path / "evict.zarr")
    s = create_store(path, points=list(POINTS), width=W, n_rows=N, shard_rows=SHARD, chunk_rows=128)
    s.ledger.write_plan(s.ledger.default_plan(8))
    x = synthetic.activations((2, N, W), seed=5)
    tok = np.arange(N, dtype=np.int32)
    synthetic.fill(s, x, token_id=tok, order="shuffled", chunk=50, max_open_shards=1)
    assert not os.path.exists(os.path.join(path, layout.SCRATCH_DIR)) or \
        not any(fs for _, _, fs in os.walk(os.path.join(path, layout.SCRATCH_DIR)))
    assert s.verify(deep=True).ok
    for i, p in enumerate(POINTS):
        assert np.array_equal(s.read(p, 0, N).view(np.uint16), x[i].view(np.uint16))
    assert np.array_equal(s.read_row_meta_checked(0, N)[0], tok)


def test_credentials_in_the_url_never_reach_a_message(capsys):
    url = "s3://AKIAEXAMPLEKEY:VerySecretValue123@bucket/x"
    with pytest.raises(StoreAccessError) as ei:
        open_store(url)
    assert "VerySecretValue123" not in str(ei.value) and "AKIAEXAMPLEKEY" not in str(ei.value)
    assert main(["verify", url]) == 2
    err = capsys.readouterr().err
    assert "VerySecretValue123" not in err and "AKIAEXAMPLEKEY" not in err and "credentials" in err
    from harvest.store.storage.credentials import scrub

    msg = scrub('Invalid bucket name "AKIAEXAMPLEKEY:VerySecretValue123@bucket": Bucket name must match')
    assert "VerySecretValue123" not in msg and "AKIAEXAMPLEKEY" not in msg


def test_missing_bucket_is_an_error_unless_asked_to_create_it(seaweedfs):
    import s3fs

    so = seaweedfs.storage_options
    name = f"typo-bucket-{os.getpid()}"
    with pytest.raises(StoreAccessError, match="does not exist.*create_bucket"):
        create_store(f"s3://{name}/run", points=["resid_post.0"], width=8, n_rows=64, storage_options=so)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **so)
    assert not fs.exists(name)
    s = create_store(f"s3://{name}/run", points=["resid_post.0"], width=8, n_rows=64, storage_options=so,
                     create_bucket=True)
    assert s.n_rows == 64 and fs.exists(name)
    fs.rm(name, recursive=True)


def test_fast_crc32c_agrees_with_google_crc32c():
    """format/checksum.py's `crc32c` package computes the CRC32C google-crc32c does (stores
    written with either verify with either), whole or extended piece by piece."""
    fast = pytest.importorskip("crc32c")
    import google_crc32c

    from harvest.store.format import checksum

    assert checksum.FAST
    rng = np.random.default_rng(5)
    for n in (0, 1, 7, 4096, (1 << 20) + 3):
        b = rng.integers(0, 256, n, dtype=np.uint8)
        assert checksum.value(b) == google_crc32c.value(b.tobytes()) == fast.crc32c(b)
        crc = 0
        for piece in np.array_split(b, 3):
            crc = checksum.extend(crc, memoryview(piece))
        assert crc == google_crc32c.value(b.tobytes())
