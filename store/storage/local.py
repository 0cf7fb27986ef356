"""A store in a local (or network-mounted POSIX) directory.

Atomicity comes from the file system: a temp file renamed or hard-linked into place, so readers
never see half an object. Durability comes from fsync: a commit marker promises that its shards
are stored, and without fsync of the file before the rename and of the directory after it, a
power cut could keep the (fsync'ed) marker while the shard bytes it vouches for were still only
in the page cache. Renames cost no round trips, so nothing here runs concurrently.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import fsspec

from ..commit.records import UploadHandle
from .interface import Storage
from ..errors import RecordError


def _fsync_dir(path: str) -> None:
    """Make a rename or link in `path` durable (POSIX keeps directory entries apart from data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(path: str, data: bytes) -> str:
    """`data` in a fsync'ed temp file beside `path`; the temp file is removed if anything fails
    (a full disk would otherwise leave a `.tmp-*` file behind on every failed write)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _write_durably(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = _write_temp(path, data)
    try:
        os.replace(tmp, path)  # readers never see a half-written file
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass
class LocalStorage(Storage):
    """A directory; `root` is its absolute path and `url` the same (no secrets to hide)."""

    protocols: ClassVar[tuple[str, ...]] = ("file",)

    @classmethod
    def open(cls, url: str, display: str, storage_options: dict) -> "LocalStorage":
        """A local path or file:// URL; storage options do not apply to a directory."""
        root = os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)
        return cls(url=root, protocol="file", root=root, storage_options={},
                   fs=fsspec.filesystem("file"))

    @property
    def kind(self) -> str:
        return "local"

    def key(self, rel: str) -> str:
        """As Storage.key, and the path may not resolve outside the root: a store shipped as a
        directory can hold symlinks, and one to `/etc/passwd` at a shard's key must not be read
        (or, at a folder, written through)."""
        path = super().key(rel)
        real = os.path.realpath(path)
        if real != path and os.path.commonpath([real, self._real_root()]) != self._real_root():
            raise RecordError(f"{self.url}: refused store key {rel!r}: it resolves to {real}, "
                              "outside the store (a symlink inside the store points out of it)")
        return path

    def _real_root(self) -> str:
        r = self.__dict__.get("_real")
        if r is None:
            r = self.__dict__["_real"] = os.path.realpath(self.root)
        return r

    def write_bytes(self, rel: str, data: bytes, attempts: int = 5) -> None:
        """fsync'ed temp file, atomic rename, fsync'ed directory. Not retried: a local error
        (full disk, permissions) does not go away by itself."""
        _write_durably(self.key(rel), data)

    def write_many(self, blobs: dict[str, bytes], *, durable: bool = True,
                   batch: int = 2000) -> None:
        """One by one (no round trips to overlap); plain writes when not `durable` (10^5
        synthetic markers with two fsyncs each would take minutes)."""
        for path, data in blobs.items():
            if durable:
                _write_durably(path, data)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)

    def create_once(self, rel: str, data: bytes) -> bool:
        """A fsync'ed temp file hard-linked into place: link fails if the name exists (like
        O_EXCL), and unlike an O_EXCL create of the name itself the object never exists half
        written, so a reader racing the writer sees all of it or nothing."""
        path = self.key(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = _write_temp(path, data)
        try:
            os.link(tmp, path)
            _fsync_dir(os.path.dirname(path))
            return True
        except FileExistsError:
            return False
        finally:
            _unlink_quietly(tmp)

    def move(self, src: str, dst: str) -> bool:
        """One rename: atomic, no copy."""
        s, d = self.key(src), self.key(dst)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        try:
            os.replace(s, d)
        except FileNotFoundError:
            return False
        _fsync_dir(os.path.dirname(d))
        return True

    def publish(self, pairs: list[tuple[str, str]], threads: int = 16) -> int:
        """Renames one after the other: there are no round trips to overlap."""
        return sum(self.move(src, dst) for src, dst in pairs)

    def begin_object(self, final_rel: str, attempt_rel: str) -> UploadHandle:
        """A temp file beside the attempt's name; parts are appended to it as they come."""
        path = self.key(attempt_rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        return UploadHandle(attempt_rel, file=open(tmp, "wb"), tmp=tmp)

    def write_part(self, handle: UploadHandle, data) -> None:
        handle.file.writelines(data if isinstance(data, list) else [data])

    def finish_object(self, handle: UploadHandle) -> None:
        """fsync, then rename to the attempt's name (publish renames it again: no copy)."""
        f, tmp = handle.take_file(), str(handle.tmp)
        try:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            path = self.key(handle.rel)
            os.replace(tmp, path)
        except BaseException:
            f.close()
            _unlink_quietly(tmp)
            raise
        _fsync_dir(os.path.dirname(path))
        return None

    def abort_object(self, handle: UploadHandle) -> None:
        f = handle.take_file()
        if f is not None:
            f.close()
        if handle.tmp is not None:
            _unlink_quietly(handle.tmp)
        _unlink_quietly(self.key(handle.rel))

    def read_many(self, paths: list[str], what: str) -> dict[str, bytes]:
        out = {}
        for p in paths:
            try:
                with open(p, "rb") as f:
                    out[p] = f.read()
            except FileNotFoundError:
                pass
        return out

    def invalidate(self, rel: str | None = None) -> None:
        """Nothing to do: every stat and listing reads the directory itself."""

    def zarr_store(self, read_only: bool = False):
        from zarr.storage import LocalStore

        return LocalStore(self.root, read_only=read_only)

    def reopen_url(self) -> str:
        return self.url

    def ensure_container(self, create: bool) -> None:
        """Nothing to check: the zarr store makes the directories it writes into."""

    def report_dir(self) -> Path:
        """`<store>/_report`: beside the data it describes."""
        return Path(self.root) / "_report"

    def root_exists(self) -> bool:
        return os.path.isdir(self.root)

    def remove_empty_dirs(self, rels: list[str], root: bool = False) -> None:
        """Directories outlive their files: remove the ones a failed run made."""
        for d in [self.key(r) for r in rels] + ([self.root] if root else []):
            try:
                os.rmdir(d)
            except OSError:
                pass

    def is_unwritable_place(self, exc: BaseException) -> bool:
        """Any OSError on the first write: a read-only or foreign directory, a file in the way;
        the first write fails here, not hours later."""
        return isinstance(exc, OSError)

    def lower_io_priority(self) -> None:
        """Local writes run on the writer's own threads, which lower themselves."""


__all__ = ["LocalStorage"]
