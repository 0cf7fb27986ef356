"""The storage interface (store/storage/interface.py): every backend implements all of it and
keeps the same promises, checked on a real directory and a real S3 server (SeaweedFS)."""

from __future__ import annotations

import inspect
import re
import threading
from pathlib import Path

import pytest

from harvest.store.storage.locate import locate
from harvest.store.storage.local import LocalStorage
from harvest.store.storage.objectstore import ObjectStorage, S3Storage
from harvest.store.storage.interface import Storage

REPO = Path(__file__).resolve().parents[2]
BACKENDS = (LocalStorage, ObjectStorage, S3Storage)


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path) -> Storage:
    if request.param == "local":
        return locate(str(tmp_path / "store"))
    seaweedfs = request.getfixturevalue("seaweedfs")
    return locate(request.getfixturevalue("s3_url"), seaweedfs.storage_options)


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_every_backend_implements_the_whole_interface(cls):
    assert Storage.__abstractmethods__ and not inspect.isabstract(cls)
    for name in Storage.__abstractmethods__:
        assert getattr(cls, name) is not getattr(Storage, name), f"{cls.__name__}.{name}"


def test_locate_picks_the_backend(tmp_path):
    assert type(locate(str(tmp_path))) is LocalStorage
    assert type(locate(f"file://{tmp_path}")) is LocalStorage
    assert type(locate("memory://harvest-iface")) is ObjectStorage
    assert type(locate("s3://bucket/prefix", {"key": "k", "secret": "s"})) is S3Storage
    assert [locate(u).kind for u in (str(tmp_path), "memory://x")] == ["local", "memory"]


def test_no_backend_branches_outside_the_backends():
    """Callers say what they want; only the backend classes know which backend they are."""
    hits = [f"{p.relative_to(REPO)}:{i}" for d in ("engine", "pipeline", "benchmarks", "jobs")
            for p in (REPO / d).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\bis_local\b|url_with_protocol", line)]
    assert hits == []


def test_create_once_conflict_is_the_same_on_both(storage):
    assert storage.create_once("m/unit.json", b"first") is True
    assert storage.create_once("m/unit.json", b"second") is False
    assert storage.read_bytes("m/unit.json") == b"first"
    assert storage.list_dir("m") == ["unit.json"]  # no temp file left beside it


def test_racing_create_once_has_exactly_one_winner(storage):
    if isinstance(storage, S3Storage) and not storage.honours_if_none_match():
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


def test_publish_moves_once_and_listings_are_fresh(storage):
    assert storage.list_dir("pub") == []  # a cached empty listing must not hide what follows
    storage.write_bytes("pub/a.att", b"A" * 10)
    storage.write_bytes("pub/b.att", b"B" * 20)
    assert storage.list_dir("pub") == ["a.att", "b.att"]
    pairs = [("pub/a.att", "pub/a"), ("pub/b.att", "pub/b")]
    assert storage.publish(pairs) == 2
    assert storage.publish(pairs) == 0  # moved already: the sources are gone
    assert storage.list_tree("pub") == {"a": 10, "b": 20}
    assert storage.read_many([storage.key("pub/a"), storage.key("pub/x")], "read") == \
        {storage.key("pub/a"): b"A" * 10}
    storage.delete_tree("pub")
    storage.delete_tree("pub")  # nothing there is not an error
    assert storage.list_tree("pub") == {}


def test_ranged_get_and_absent_objects(storage):
    storage.write_bytes("r/obj", bytes(range(100)))
    assert storage.read_range("r/obj", 10, 14) == bytes([10, 11, 12, 13])
    assert storage.read_range("r/none", 0, 4) is None and storage.read_bytes("r/none") is None
    assert storage.exists("r/obj") and not storage.exists("r/none")
    storage.delete("r/obj")
    storage.delete("r/obj")  # deleting what is gone is not an error
    assert storage.list_tree("r") == {}


def test_a_store_reopens_from_its_reopen_url(storage):
    from harvest.store import create_store, open_store

    s = create_store(storage.reopen_url(), storage_options=storage.storage_options or None,
                     points=["resid_post.0"], width=8, n_rows=256, shard_rows=128,
                     chunk_rows=64)
    again = open_store(s.location.reopen_url(), storage_options=s.location.storage_options)
    assert type(again.location) is type(storage) and again.location.root == storage.root
