"""The storage conformance suite: every backend keeps the promises of the Storage interface
(store/storage/interface.py) that its capability flags declare, and refuses loudly where a flag
is false. It runs on a real directory, a real S3 server (SeaweedFS), fsspec's in-memory
filesystem (`memory://`, its own backend) and the generic fsspec backend (`ObjectStorage`, what
any protocol without a class of its own gets, here over fsspec's local filesystem, which it
treats as an object store). A new backend joins by a line in `storage` below and passes the
same tests.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import uuid

import pytest

from harvest.store import StoreAccessError
from harvest.store.errors import RecordError
from harvest.store.storage.interface import CAPABILITIES, Storage
from harvest.store.storage.locate import BACKENDS, backend_for, locate
from harvest.store.storage.local import LocalStorage
from harvest.store.storage.memory import MemoryStorage
from harvest.store.storage.objectstore import ObjectStorage
from harvest.store.storage.s3 import S3Storage

SUITE = {"local": LocalStorage, "s3": S3Storage, "memory": MemoryStorage, "fsspec": ObjectStorage}
BACKEND_IDS = tuple(SUITE)


@pytest.fixture(params=BACKEND_IDS)
def storage(request, tmp_path) -> Storage:
    name = request.param
    if name == "local":
        return locate(str(tmp_path / "store"))
    if name == "s3":
        seaweedfs = request.getfixturevalue("seaweedfs")
        return locate(request.getfixturevalue("s3_url"), seaweedfs.storage_options)
    if name == "memory":
        return locate(f"memory://conformance-{uuid.uuid4().hex[:12]}/store")
    url = f"file://{tmp_path}/store"
    return ObjectStorage.open(url, url, {"auto_mkdir": True})


def test_every_registered_backend_runs_the_suite():
    """A backend registered without a line in `storage` would never prove itself."""
    assert set(BACKENDS.values()) | {ObjectStorage} == set(SUITE.values())


def test_the_fixture_gives_each_backend_its_class(storage, request):
    assert type(storage) is SUITE[request.node.callspec.params["storage"]]


def test_capabilities_are_declared_and_the_registry_serves_the_backend(storage):
    caps = type(storage).capabilities()
    assert set(caps) == set(CAPABILITIES) and all(isinstance(v, bool) for v in caps.values())
    assert storage.part_min_bytes >= 0 and storage.request_timeout_s > 0
    assert storage.retry_budget_s > 0
    limits = storage.request_limits
    assert limits is None or min(limits.writes_per_second_per_prefix,
                                 limits.reads_per_second_per_prefix, limits.list_page_keys) > 0
    if type(storage) is not ObjectStorage:   # the fallback serves protocols no class names
        assert type(storage).protocols and backend_for(storage.reopen_url()) is type(storage)
        assert all(BACKENDS[p] is type(storage) for p in type(storage).protocols)


def test_deadlines_are_the_backends_and_explicit_settings_win(storage):
    cls = type(storage)
    so = cls.deadline_options({"retry_budget_s": 7.0}, 3.0, 99.0)
    assert so["retry_budget_s"] == 7.0
    assert cls.deadline_options({}, 3.0, 99.0)["retry_budget_s"] == 99.0
    if cls.protocols and cls.protocols[0] == "s3":
        ck = cls.deadline_options({}, 30.0, 1.0)["config_kwargs"]
        assert ck["read_timeout"] == 30.0 and ck["connect_timeout"] == cls.connect_timeout_max_s
        assert cls.deadline_options({"config_kwargs": {"read_timeout": 5}}, 30.0, 1.0)[
            "config_kwargs"]["read_timeout"] == 5


def test_put_get_overwrite_and_absent(storage):
    assert storage.read_bytes("a/obj") is None and not storage.exists("a/obj")
    storage.write_bytes("a/obj", b"first")
    assert storage.read_bytes("a/obj") == b"first" and storage.exists("a/obj")
    storage.write_bytes("a/obj", b"second, longer")
    assert storage.read_bytes("a/obj") == b"second, longer"
    assert storage.object_sizes(["a/obj", "a/none"]) == {"a/obj": 14, "a/none": None}


def test_ranged_get_and_absent_objects(storage):
    storage.write_bytes("r/obj", bytes(range(100)))
    assert storage.read_range("r/obj", 10, 14) == bytes([10, 11, 12, 13])
    assert storage.read_range("r/obj", 96, 100) == bytes([96, 97, 98, 99])
    assert storage.read_range("r/none", 0, 4) is None and storage.read_bytes("r/none") is None
    assert storage.exists("r/obj") and not storage.exists("r/none")


def test_listings_are_fresh_and_deletes_are_idempotent(storage):
    assert storage.list_dir("l") == []  # a cached empty listing must not hide what follows
    storage.write_bytes("l/a", b"A" * 3)
    storage.write_bytes("l/sub/b", b"B" * 5)
    assert storage.list_dir("l") == ["a", "sub"]
    assert storage.list_tree("l") == {"a": 3, "sub/b": 5}
    storage.delete("l/a")
    storage.delete("l/a")  # deleting what is gone is not an error
    assert storage.list_tree("l") == {"sub/b": 5}
    storage.delete_tree("l")
    storage.delete_tree("l")  # nothing there is not an error
    # no object is left; list_dir may still name an empty "directory" (SeaweedFS keeps one)
    assert storage.list_tree("l") == {} and "a" not in storage.list_dir("l")


def test_batches_write_and_read_by_full_path(storage):
    blobs = {storage.key(f"b/{i}"): bytes([i]) * (i + 1) for i in range(5)}
    storage.write_many(blobs)
    got = storage.read_many([*blobs, storage.key("b/none")], "read batch")
    assert got == blobs


def test_keys_never_leave_the_root(storage):
    for bad in ("../outside", "a/../../x", "/abs"):
        with pytest.raises(RecordError):
            storage.key(bad)


def test_create_once_conflict(storage):
    assert storage.create_once("m/unit.json", b"first") is True
    assert storage.create_once("m/unit.json", b"second") is False
    assert storage.read_bytes("m/unit.json") == b"first"
    assert storage.list_dir("m") == ["unit.json"]  # no temp file left beside it


def test_racing_create_once_has_exactly_one_winner_where_declared(storage, caplog):
    if not storage.supports_conditional_create:
        # the refusal is loud: a warning names the backend and the race, once per root
        with caplog.at_level(logging.WARNING, logger="harvest.store.storage.objectstore"):
            storage.create_once("race/first.json", b"x")
            storage.create_once("race/second.json", b"x")
        said = [r.getMessage() for r in caplog.records if "check-then-write" in r.getMessage()]
        assert len(said) == 1 and storage.url in said[0] and "no conditional create" in said[0]
        return
    honours = getattr(storage, "honours_if_none_match", None)
    if honours is not None and not honours():
        pytest.skip("server ignores If-None-Match: check-then-write has a documented race")
    barrier, won = threading.Barrier(6), []

    def racer(i: int) -> None:
        barrier.wait()
        if storage.create_once("race/marker.json", f"writer {i}".encode()):
            won.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert storage.read_bytes("race/marker.json") == f"writer {won[0]}".encode()


def test_publish_moves_once(storage):
    storage.write_bytes("pub/a.att", b"A" * 10)
    storage.write_bytes("pub/b.att", b"B" * 20)
    pairs = [("pub/a.att", "pub/a"), ("pub/b.att", "pub/b")]
    assert storage.publish(pairs) == 2
    assert storage.publish(pairs) == 0  # moved already: the sources are gone
    assert storage.list_tree("pub") == {"a": 10, "b": 20}
    assert storage.move("pub/a", "pub/c") and not storage.move("pub/a", "pub/c")


def test_streamed_objects_appear_only_when_published(storage):
    first = bytes(range(256)) * (max(storage.part_min_bytes, 4) // 256 + 1)  # a whole part
    h = storage.begin_object("s/final", "s/final.attempt-1")
    storage.write_part(h, [first[:3], memoryview(first[3:])])  # pieces of one part, in order
    storage.write_part(h, b"ef")  # the last part may be small
    record = storage.finish_object(h)
    assert storage.read_bytes("s/final") is None  # durable, not yet at its key
    if storage.supports_multipart:
        assert record is not None and record["parts"] == 2
        assert storage.pending_uploads("s") == {record["upload_id"]: "s/final"}
        durable = {k: v for k, v in record.items() if not k.startswith("_")}
        assert storage.complete_upload("s/final", durable) is True  # from ListParts
        assert storage.complete_upload("s/final", durable) is False  # completed already
        assert storage.pending_uploads("s") == {}
    else:
        assert record is None and storage.pending_uploads("s") == {}
        with pytest.raises(NotImplementedError):
            storage.complete_upload("s/final", {"upload_id": "x", "parts": 1})
        assert storage.move("s/final.attempt-1", "s/final")
    assert storage.read_bytes("s/final") == first + b"ef"


def test_an_aborted_stream_leaves_nothing(storage):
    h = storage.begin_object("ab/final", "ab/final.attempt-1")
    storage.write_part(h, b"x" * 10)
    storage.abort_object(h)
    assert storage.read_bytes("ab/final") is None and storage.pending_uploads("ab") == {}
    assert storage.list_tree("ab") == {}


def test_object_store_flag_matches_directories(storage, tmp_path):
    if storage.object_store:
        assert storage.root_exists()  # a prefix is not a thing apart from its objects
        assert not str(storage.report_dir()).startswith(storage.root)
    else:
        assert not storage.root_exists()
        storage.write_bytes("d/x", b"1")
        storage.delete("d/x")
        storage.remove_empty_dirs(["d"], root=True)
        assert not storage.root_exists()


_READ_BACK = ("import sys; from harvest.store.storage.locate import locate; "
              "import json; so = json.loads(sys.argv[2]); "
              "print(locate(sys.argv[1], so or None).read_bytes('shared/x'))")


def test_shared_means_another_process_sees_the_objects(storage):
    import json
    import os

    storage.write_bytes("shared/x", b"seen")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    so = {k: v for k, v in storage.storage_options.items() if k != "retry_budget_s"}
    out = subprocess.run([sys.executable, "-c", _READ_BACK, storage.reopen_url(),
                          json.dumps(so, default=str)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("b'seen'" if storage.shared else "None")
    if storage.shared:
        storage.require("shared", "never raised")
    else:  # the refusal is loud, names the backend, the capability and why it was needed
        with pytest.raises(StoreAccessError, match=r"memory storage .* lacks shared .*actors"):
            storage.require("shared", "the actors write from their own processes")


def test_require_knows_every_capability(storage):
    with pytest.raises(ValueError, match="unknown storage capability"):
        storage.require("supports_time_travel", "a typo")
    for cap, has in type(storage).capabilities().items():
        if has:
            storage.require(cap, "never raised")
        else:
            with pytest.raises(StoreAccessError, match=cap):
                storage.require(cap, "asked for")


def test_a_store_reopens_from_its_reopen_url(storage):
    from harvest.store import create_store, open_store

    if type(storage) is ObjectStorage:
        pytest.skip("create_store locates by URL: file:// is LocalStorage's")
    s = create_store(storage.reopen_url(), storage_options=storage.storage_options or None,
                     points=["resid_post.0"], width=8, n_rows=256, shard_rows=128,
                     chunk_rows=64)
    again = open_store(s.location.reopen_url(), storage_options=s.location.storage_options)
    assert type(again.location) is type(storage) and again.location.root == storage.root
