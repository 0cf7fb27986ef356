"""A store on an object store through fsspec: `ObjectStorage` for any fsspec filesystem with no
backend of its own (gcs://, az://, ...); S3 and S3-compatible servers subclass it (s3.py).

An object store has no rename and no O_EXCL: publishing is a server-side copy then a delete,
and create-once is a conditional PUT (S3's If-None-Match: *) where the server honours it. A PUT
is durable once acknowledged, so no fsync is needed to keep the promise a commit marker makes.
Every request is a round trip (milliseconds), so batches run concurrently, and s3fs caches
listings, so whatever another process may have written is listed afresh.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import fsspec

from ..errors import StoreAccessError
from .credentials import scrub
from .retries import with_retries
from .interface import Storage
from .credentials import StorageOptions

log = logging.getLogger(__name__)


@dataclass
class ObjectStorage(Storage):
    """Any fsspec filesystem that is not a local directory. Its create-once is check-then-write
    (no conditional PUT that works on every filesystem), so it declares no conditional create
    and warns once per root when it commits that way."""

    supports_conditional_create: ClassVar[bool] = False
    object_store: ClassVar[bool] = True

    @classmethod
    def open(cls, url: str, display: str, storage_options: dict) -> "ObjectStorage":
        so = cls.fsspec_options(storage_options)
        budget = so.pop("retry_budget_s", None)  # ours (StoreConfig.fs_options), not fsspec's
        try:
            fs, root = fsspec.url_to_fs(url, **so)
        except Exception as e:  # noqa: BLE001 -- reported without secrets
            raise StoreAccessError(f"cannot open filesystem for {display}: "
                                   f"{scrub(f'{type(e).__name__}: {e}', so)}") from None
        cls.bound_retries(fs, budget)
        return cls(url=display, protocol=url.split("://", 1)[0].lower(), root=root.rstrip("/"),
                   storage_options=so, fs=fs, budget_s=budget)

    @classmethod
    def fsspec_options(cls, storage_options: dict) -> StorageOptions:
        """The filesystem's options from the caller's (S3Storage adds the AWS environment)."""
        return dict(storage_options)

    @classmethod
    def bound_retries(cls, fs: Any, budget_s: "float | None") -> None:
        """Make the filesystem's own retries fit `budget_s` (nothing to do by default)."""

    @property
    def kind(self) -> str:
        return self.protocol

    def write_bytes(self, rel: str, data: bytes, attempts: int = 5) -> None:
        """One PUT, retried (a dropped connection is worth another try)."""
        with_retries(lambda: self.fs.pipe_file(self.key(rel), data), f"write {rel}",
                     attempts=attempts, budget_s=self.budget_s)

    def write_many(self, blobs: dict[str, bytes], *, durable: bool = True,
                   batch: int = 2000) -> None:
        """Concurrent PUTs, `batch` at a time (one after the other, 10^5 objects take minutes)."""
        items = list(blobs.items())
        for i in range(0, len(items), batch):
            self.fs.pipe(dict(items[i:i + batch]))

    def create_once(self, rel: str, data: bytes) -> bool:
        """Check-then-write (`_check_then_write`), said once per root in a warning."""
        _warn_check_then_write(self)
        return self._check_then_write(rel, data)

    def _check_then_write(self, rel: str, data: bytes) -> bool:
        """Check, then write, then read back. The race window between the HEAD and the PUT (a
        few ms) is documented in FORMAT.md; the read-back closes it only for the loser that
        reads after the winner's PUT."""
        path = self.key(rel)
        if self._exists_fresh(path):
            return False
        with_retries(lambda: self.fs.pipe_file(path, data), f"commit {rel}",
                     budget_s=self.budget_s)
        return self.fs.cat_file(path) == data

    def _exists_fresh(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(with_retries(lambda: self.fs.exists(path), "stat", budget_s=self.budget_s))

    def move(self, src: str, dst: str) -> bool:
        """A server-side copy, then the source is deleted (no bytes pass through this process)."""
        s, d = self.key(src), self.key(dst)
        try:
            with_retries(lambda: self.fs.copy(s, d), f"publish {dst}")
        except FileNotFoundError:
            return False
        self.delete(src)
        return True

    def publish(self, pairs: list[tuple[str, str]], threads: int = 16) -> int:
        """Concurrent moves: each is a copy and a delete, two round trips, and a unit holds
        shards x points objects (50 x 30 for 10^5 tokens of a 30-layer model), so moving them
        one by one would put seconds of latency on every commit of the actor's path."""
        if len(pairs) <= 1:
            return sum(self.move(src, dst) for src, dst in pairs)
        with ThreadPoolExecutor(min(threads, len(pairs)),
                                thread_name_prefix="harvest-publish") as ex:
            return sum(ex.map(lambda kv: self.move(*kv), pairs))

    def read_many(self, paths: list[str], what: str) -> dict[str, bytes]:
        """One concurrent batch request (a GET each, one after the other, is what made 10^5
        markers slow)."""
        got = with_retries(lambda: self.fs.cat(sorted(set(paths)), on_error="return"), what,
                           budget_s=self.budget_s)
        return {k: bytes(v) for k, v in got.items() if isinstance(v, (bytes, bytearray))}

    def invalidate(self, rel: str | None = None) -> None:
        """Drop fsspec's cached listings (s3fs keeps them for the life of the filesystem)."""
        if rel is None:
            self.fs.invalidate_cache()
        else:
            self.fs.invalidate_cache(self.key(rel))

    def zarr_store(self, read_only: bool = False):
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(self.reopen_url(), storage_options=self.storage_options,
                                    read_only=read_only)

    def reopen_url(self) -> str:
        """`protocol://root`: `url` is for display and may have lost parts to scrubbing."""
        return f"{self.protocol}://{self.root}"

    def ensure_container(self, create: bool) -> None:
        """Nothing to check on a generic filesystem; `S3Storage` checks the bucket."""

    def report_dir(self) -> Path:
        """`./harvest-report`: a PNG in a bucket is no use to a person at a terminal."""
        return Path("harvest-report")

    def root_exists(self) -> bool:
        """True: a prefix is not a thing apart from its objects, so a failed run leaves no
        directory to remove."""
        return True

    def remove_empty_dirs(self, rels: list[str], root: bool = False) -> None:
        """Nothing to do: a prefix disappears with its last object."""

    def is_unwritable_place(self, exc: BaseException) -> bool:
        """False: an OSError here is an access or endpoint failure, which `error` explains."""
        return False

    def lower_io_priority(self) -> None:
        """Uploads run on fsspec's event-loop thread: put it below the engine, like the
        writer's own threads (see shardcodec.lower_priority)."""
        from fsspec.asyn import get_loop

        from ..format.shardcodec import lower_priority

        get_loop().call_soon_threadsafe(lower_priority)


_WARNED: set[str] = set()


def _warn_check_then_write(storage: Storage) -> None:
    """Say once per root that its commit markers are created by check-then-write."""
    if storage.url not in _WARNED:
        _WARNED.add(storage.url)
        log.warning("%s storage at %s has no conditional create: commit markers are created by "
                    "check-then-write (a race window of milliseconds, store/FORMAT.md)",
                    storage.kind, storage.url)


__all__ = ["ObjectStorage"]
