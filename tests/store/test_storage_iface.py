"""The storage interface (store/storage/interface.py): every backend implements all of it, the
registry picks it by URL, and no caller asks which backend it is on. The promises each backend
keeps are checked by tests/store/test_storage_conformance.py."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from harvest.store.storage.locate import BACKENDS as REGISTRY, locate, register_backend
from harvest.store.storage.local import LocalStorage
from harvest.store.storage.memory import MemoryStorage
from harvest.store.storage.objectstore import ObjectStorage
from harvest.store.storage.s3 import S3Storage
from harvest.store.storage.interface import Storage

REPO = Path(__file__).resolve().parents[2]
BACKENDS = (LocalStorage, ObjectStorage, S3Storage, MemoryStorage)


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_every_backend_implements_the_whole_interface(cls):
    assert Storage.__abstractmethods__ and not inspect.isabstract(cls)
    for name in Storage.__abstractmethods__:
        assert getattr(cls, name) is not getattr(Storage, name), f"{cls.__name__}.{name}"


def test_locate_picks_the_backend(tmp_path):
    assert type(locate(str(tmp_path))) is LocalStorage
    assert type(locate(f"file://{tmp_path}")) is LocalStorage
    assert type(locate("memory://harvest-iface")) is MemoryStorage
    assert type(locate("s3://bucket/prefix", {"key": "k", "secret": "s"})) is S3Storage
    assert type(locate("s3a://bucket/prefix", {"key": "k", "secret": "s"})) is S3Storage
    assert [locate(u).kind for u in (str(tmp_path), "memory://x")] == ["local", "memory"]
    assert set(REGISTRY) == {"file", "s3", "s3a", "memory"}  # the rest: ObjectStorage


def test_a_registered_backend_serves_its_protocol(monkeypatch):
    monkeypatch.setattr("harvest.store.storage.locate.BACKENDS", dict(REGISTRY))

    class Other(MemoryStorage):
        protocols = ("other",)

    register_backend(Other)
    from fsspec.implementations.memory import MemoryFileSystem

    monkeypatch.setattr(Other, "open", classmethod(
        lambda cls, url, display, so: cls(url=display, protocol="other", root="/o",
                                          storage_options=so, fs=MemoryFileSystem())))
    assert type(locate("other://x")) is Other
    with pytest.raises(ValueError, match="names no protocols"):
        register_backend(type("Nameless", (MemoryStorage,), {"protocols": ()}))


def test_no_backend_branches_outside_the_backends():
    """Callers say what they want; only the backend classes know which backend they are. A
    protocol named in a comparison is such a branch (the registry decides), outside the
    benchmarks, whose own options choose which server they start."""
    def hits(folders, pattern):
        return [f"{p.relative_to(REPO)}:{i}" for d in folders for p in (REPO / d).rglob("*.py")
                if p.parent != REPO / "store" / "storage"
                for i, line in enumerate(p.read_text().splitlines(), 1)
                if re.search(pattern, line)]

    assert hits(("engine", "pipeline", "benchmarks", "jobs"), r"\bis_local\b|url_with_protocol") == []
    assert hits(("engine", "pipeline", "jobs", "store"),
                r"[=!]= *[\"'](s3a?|file|memory)[\"']|in \([\"']s3[\"']") == []
