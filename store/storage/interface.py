"""The storage interface: every plain (non-zarr) object operation a store needs, one class per
backend (`local.LocalStorage`, `objectstore.ObjectStorage`, `s3.S3Storage`,
`memory.MemoryStorage`; `locate.locate` picks from its registry by URL protocol).

Commit markers, the plan, leases and stats partials are small objects we write ourselves beside
the zarr hierarchy. They need what zarr's store API does not give (see `create_once`), and the
backends keep the same promises by different means: a local directory gets atomicity from
rename/link and durability from fsync, an object store from its PUT semantics; an object store
costs a round trip per request, so its batch operations overlap them. Callers say what they
want (create once, publish, forget cached listings); they never ask which backend they are on.

Operations that fsspec does the same way on every backend (stat, list, read, delete) live here;
everything that differs is an abstract method. What differs in kind is stated as capability flags
on the class (`supports_*`, `shared`, `object_store`, as zarr-python 3's `Store.supports_*`), and
the numbers a backend lives by (request timeouts, part sizes, request limits) are class
attributes too: the config and `harvest plan` read them from the backend class. A backend that
cannot keep a promise declares its flag false and refuses loudly (`require`);
tests/store/test_storage_conformance.py holds every registered backend to its flags.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NotRequired, TypedDict

from ..commit.records import UploadHandle
from .credentials import StorageOptions, scrub
from ..errors import RecordError, StoreAccessError
from ..format.layout import check_rel
from .retries import RetryBudgetExceeded, with_retries



CAPABILITIES = ("supports_conditional_create", "supports_multipart", "shared", "object_store")
CAPABILITY_MEANS = {
    "supports_conditional_create": "create-once with exactly one winner among racing writers",
    "supports_multipart": "streamed objects published by completing an upload, without a copy",
    "shared": "the same objects seen by every process that opens the URL",
    "object_store": "a flat key space, one request per operation",
}


@dataclass(frozen=True)
class RequestLimits:
    """What a backend states of its request rates: per second and key prefix, and keys per
    listing page. `harvest plan` warns when a layout would exceed them."""

    writes_per_second_per_prefix: int
    reads_per_second_per_prefix: int
    list_page_keys: int


class UploadRecord(TypedDict):
    """What a commit records to publish a streamed object later (Storage.finish_object's return:
    JSON in the unit's marker or table, read back by complete_upload and finalize)."""

    upload_id: str
    parts: int
    _etags: NotRequired[list[str]]
    """The parts' ETags, in memory only (dropped before the record is written): the writer's
    own publish completes without asking the server for them."""

@dataclass
class Storage(abc.ABC):
    """A store root: display URL (no secrets), fsspec filesystem and root path."""

    url: str
    protocol: str
    root: str
    storage_options: dict = field(repr=False)
    fs: Any = field(repr=False)
    budget_s: float | None = None  # total time of one operation's retries (store.retry_budget_s)

    # ---- capabilities (class facts; tests/store/test_storage_conformance.py checks them) ------
    # create_once has exactly one winner among racing writers, every process included. False:
    # check-then-write with a race window (FORMAT.md, "Create-once"), said in a warning.
    supports_conditional_create: ClassVar[bool] = True
    # finish_object records an upload that complete_upload publishes without a copy (S3's
    # multipart upload); False: streamed objects are written under the attempt's name and moved.
    supports_multipart: ClassVar[bool] = False
    # Every process and host that opens `reopen_url` sees the same objects (capture actors,
    # reader workers and the driver are separate processes). False: one process's memory.
    shared: ClassVar[bool] = True
    # A flat key space where every operation is a request (no rename, no directories):
    # `harvest plan` counts and prices the layout's requests on it.
    object_store: ClassVar[bool] = False

    # ---- numbers the backend lives by ---------------------------------------------------------
    # Deadlines of one request and of one operation over its retries: the defaults of
    # store.timeout_s and store.retry_budget_s (`deadline_options` turns them into options).
    request_timeout_s: ClassVar[float] = 30.0
    retry_budget_s: ClassVar[float] = 120.0
    # Requests per second per key prefix and keys per listing page, where the backend states
    # them (S3); None: no stated limit.
    request_limits: ClassVar["RequestLimits | None"] = None

    # Requests go to a named endpoint (S3's endpoint_url): error messages name it.
    has_endpoint: ClassVar[bool] = False

    # URL protocols this class serves in locate's registry (`register_backend`).
    protocols: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def capabilities(cls) -> dict[str, bool]:
        """The capability flags by name."""
        return {name: bool(getattr(cls, name)) for name in CAPABILITIES}

    def require(self, capability: str, why: str) -> None:
        """Refuse, naming the backend and the reason, when this backend lacks `capability`
        (a name in CAPABILITIES): the caller needs a promise the backend cannot keep."""
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown storage capability {capability!r}: one of {CAPABILITIES}")
        if not getattr(self, capability):
            raise StoreAccessError(
                f"{self.kind} storage at {self.url} cannot be used here: it lacks "
                f"{capability} ({CAPABILITY_MEANS[capability]}), and {why}")

    @classmethod
    def open(cls, url: str, display: str, storage_options: dict) -> "Storage":
        """The Storage of `url` (`display`: the URL without secrets), its filesystem built and
        nothing contacted; `storage_options` may carry `retry_budget_s` (ours, not fsspec's)."""
        raise NotImplementedError(f"{cls.__name__} cannot be located from a URL")

    @classmethod
    def deadline_options(cls, storage_options: dict, timeout_s: float,
                         retry_budget_s: float) -> StorageOptions:
        """`storage_options` plus the deadlines (store.timeout_s, store.retry_budget_s) in this
        backend's terms; explicit settings win. Every backend takes the retry budget."""
        so = dict(storage_options)
        so.setdefault("retry_budget_s", retry_budget_s)
        return so

    @property
    @abc.abstractmethod
    def kind(self) -> str:
        """What the store is on, for messages only ("local", "s3", "memory", ...)."""

    def key(self, rel: str) -> str:
        """The full path of `rel`, which must stay inside the root (layout.check_rel: a store's
        records are untrusted, and a name such as `x/../../etc` must never reach the storage)."""
        try:
            check_rel(rel)
        except ValueError as e:
            raise RecordError(f"{self.url}: {e}") from None
        return f"{self.root.rstrip('/')}/{rel}"

    @property
    def endpoint(self) -> str:
        """The S3 endpoint requests go to, for messages (a wrong one is the commonest mistake)."""
        ck = self.storage_options.get("client_kwargs") or {}
        return ck.get("endpoint_url") or "AWS's default endpoint (no endpoint_url set)"

    def error(self, what: str, exc: BaseException) -> StoreAccessError:
        """A StoreAccessError naming the operation, the endpoint, the cause and the fix, with
        every secret scrubbed."""
        cause = scrub(f"{type(exc).__name__}: {exc}", self.storage_options)
        low = cause.lower()
        where = f" (endpoint {self.endpoint})" if self.has_endpoint else ""
        hint = ""
        if "NoCredentialsError" in cause or "unable to locate credentials" in low:
            hint = (" -- no S3 credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or "
                    "AWS_SHARED_CREDENTIALS_FILE naming a credentials file, or "
                    "store.storage_options key/secret; on Kubernetes the Secret of "
                    "infra/k8s/secret-s3.example.yaml, mounted as that file), then check the "
                    "credentials reach the driver and the actors")
        elif isinstance(exc, PermissionError) or "AccessDenied" in cause or "signature" in low \
                or "InvalidAccessKeyId" in cause:
            hint = (" -- check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                    "storage_options key/secret) and that they may access this bucket")
        elif isinstance(exc, RetryBudgetExceeded) or "timeout" in low or "timed out" in low:
            t = (self.storage_options.get("config_kwargs") or {}).get("read_timeout")
            within = f" within store.timeout_s={t:g} s" if isinstance(t, (int, float)) \
                else " in time"
            hint = (f" -- endpoint {self.endpoint} did not answer{within}: check that it is up "
                    "and is the right one (store.storage_options.client_kwargs.endpoint_url or "
                    "AWS_ENDPOINT_URL); store.timeout_s and store.retry_budget_s bound the wait")
        elif "connect" in low or isinstance(exc, (ConnectionError, TimeoutError)):
            hint = (f" -- cannot connect to endpoint {self.endpoint}: check the endpoint "
                    "(store.storage_options.client_kwargs.endpoint_url or AWS_ENDPOINT_URL)")
        elif isinstance(exc, FileNotFoundError):
            hint = self.not_found_hint()
        return StoreAccessError(f"{what} at {self.url}{where} failed: {cause}{hint}")

    def not_found_hint(self) -> str:
        """What `error` adds to a Not Found from the storage itself (nothing by default)."""
        return ""

    # ---- the same on every backend ----------------------------------------------------------
    def read_bytes(self, rel: str, attempts: int = 5) -> bytes | None:
        """Object bytes, or None if absent."""
        try:
            return with_retries(lambda: self.fs.cat_file(self.key(rel)), f"read {rel}",
                                attempts=attempts, budget_s=self.budget_s)
        except FileNotFoundError:
            return None

    def read_range(self, rel: str, start: int, end: int) -> bytes | None:
        """Bytes [start, end) of an object (one ranged GET on object stores), or None if absent."""
        try:
            return with_retries(lambda: self.fs.cat_file(self.key(rel), start=start, end=end),
                                f"read {rel}[{start}:{end}]", budget_s=self.budget_s)
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        return bool(with_retries(lambda: self.fs.exists(self.key(rel)), f"stat {rel}",
                                 budget_s=self.budget_s))

    def object_sizes(self, rels: list[str], threads: int = 16) -> "dict[str, int | None]":
        """{rel: size in bytes, None when absent} of each object, one stat (a HEAD on object
        storage) each, `threads` at a time, as the storage holds them now."""
        def one(rel: str):
            path = self.key(rel)
            self.fs.invalidate_cache(path)
            try:
                info = with_retries(lambda: self.fs.info(path), f"stat {rel}", budget_s=self.budget_s)
            except FileNotFoundError:
                return None
            return None if info.get("type") == "directory" else int(info.get("size") or 0)

        if len(rels) <= 1:
            return {r: one(r) for r in rels}
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(rels)), thread_name_prefix="harvest-stat") as ex:
            return dict(zip(rels, ex.map(one, rels)))

    def list_dir(self, rel: str) -> list[str]:
        """Names (not paths) directly under `rel`, as the storage holds them now; [] if none."""
        path = self.key(rel)
        try:
            self.invalidate(rel)
            entries = with_retries(lambda: self.fs.ls(path, detail=False), f"list {rel}",
                                   budget_s=self.budget_s)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def list_tree(self, rel: str) -> dict[str, int]:
        """{path relative to `rel`: size} of every object below `rel`, as the storage holds them
        now, from one recursive listing; {} if none."""
        base = self.key(rel)
        self.invalidate(rel)
        try:
            found = with_retries(lambda: self.fs.find(base, detail=True), f"list {rel}",
                                 budget_s=self.budget_s)
        except FileNotFoundError:
            return {}
        out = {path[len(base):].strip("/"): int(info.get("size") or 0)
               for path, info in found.items()}
        out.pop("", None)  # the prefix itself: some S3 servers keep a directory entry for it
        return out

    def delete(self, rel: str) -> None:
        try:
            with_retries(lambda: self.fs.rm_file(self.key(rel)), f"delete {rel}",
                         budget_s=self.budget_s)
        except FileNotFoundError:
            pass

    def delete_tree(self, rel: str) -> None:
        """Every object under `rel` (nothing there is not an error)."""
        try:
            with_retries(lambda: self.fs.rm(self.key(rel), recursive=True), f"delete {rel}/",
                         budget_s=self.budget_s)
        except FileNotFoundError:
            pass

    # ---- streamed objects: written part by part, made visible by the commit ------------------
    # A writer streams each shard object (uploads.py): `begin_object`, then `write_part` as its
    # blocks complete, `finish_object` before the commit marker (the bytes are durable but not
    # at the zarr key), and `complete_upload` after the marker (what publishing is). `abort_object`
    # drops an unfinished one. Backends without a cheaper way write a file under the attempt's
    # name (this default, through fsspec's buffered files) and publish it with `move`.

    # The smallest part a backend takes but for the last (S3 and SeaweedFS: 5 MiB): the writer
    # holds a point's compressed blocks until they reach it.
    part_min_bytes: ClassVar[int] = 0

    def begin_object(self, final_rel: str, attempt_rel: str) -> UploadHandle:
        """A handle for an object streamed in parts, to appear at `final_rel` once published;
        `attempt_rel` is the attempt's own name for backends that publish by moving."""
        f = with_retries(lambda: self.fs.open(self.key(attempt_rel), "wb"), f"open {attempt_rel}",
                         budget_s=self.budget_s)
        return UploadHandle(attempt_rel, file=f)

    def write_part(self, handle: UploadHandle, data) -> None:
        """Append one part: `data` is bytes-like or a list of them, in order (the writer hands
        its compressed chunks over as they are: a backend that can send them without joining
        does). The parts of one object arrive in order, from one thread at a time."""
        for piece in (data if isinstance(data, list) else [data]):
            handle.file.write(piece)

    def finish_object(self, handle: UploadHandle) -> "UploadRecord | None":
        """Every part is written, durably; the object is not yet at its zarr key. Returns what
        a commit must record to publish it later (None: nothing, it is moved by name)."""
        handle.take_file().close()
        return None

    def abort_object(self, handle: UploadHandle) -> None:
        """Drop an unfinished object (best effort: what remains is under the attempt's name)."""
        f = handle.take_file()
        if f is not None:
            try:
                f.discard() if hasattr(f, "discard") else f.close()
            except Exception:  # noqa: BLE001 -- garbage under an attempt name harms nothing
                pass
        try:
            self.delete(handle.rel)
        except Exception:  # noqa: BLE001
            pass

    def complete_upload(self, final_rel: str, upload: UploadRecord) -> bool:
        """Make an object `finish_object` recorded `upload` for appear at `final_rel`; False if
        there is nothing left to complete (completed already, or aborted). Backends whose
        `finish_object` returns None never get here."""
        raise NotImplementedError(f"{self.kind} storage records no uploads to complete")

    def abort_upload(self, final_rel: str, upload_id: str) -> None:  # noqa: B027 -- a no-op by default
        """Drop a finished but never completed upload (a losing attempt's)."""

    def pending_uploads(self, rel: str) -> "dict[str, str]":
        """{upload id: key relative to the root} of every upload under `rel` finished but not
        completed (one listing); {} on backends that record none."""
        return {}

    # ---- what each backend does its own way -------------------------------------------------
    @abc.abstractmethod
    def write_bytes(self, rel: str, data: bytes, attempts: int = 5) -> None:
        """Overwrite an object (shards, driver metadata, stats sidecars), durably: once this
        returns, a commit marker may vouch for it. Readers never see it half written."""

    @abc.abstractmethod
    def write_many(self, blobs: dict[str, bytes], *, durable: bool = True,
                   batch: int = 2000) -> None:
        """Overwrite many objects given by full path (`key(rel)`), up to `batch` per round of
        requests. `durable=False` is for synthetic stores (benchmarks) whose bytes nothing
        vouches for."""

    @abc.abstractmethod
    def create_once(self, rel: str, data: bytes) -> bool:
        """Write `data` at `rel` only if nothing is there: True if we created it, False if it
        existed (of two racing writers exactly one gets True). The object appears whole.

        Not zarr's `Store.set_if_not_exists` (zarr 3.1.6): it returns None, so a caller cannot
        tell whether it won, which is the whole point of a commit marker; `FsspecStore` does not
        override the ABC's default, an exists-then-set race with no conditional PUT; and
        `LocalStore`'s exclusive write does not fsync the file or its directory.
        """

    @abc.abstractmethod
    def move(self, src: str, dst: str) -> bool:
        """Move object `src` to `dst` (replacing it); False if `src` is gone (moved already)."""

    @abc.abstractmethod
    def publish(self, pairs: list[tuple[str, str]], threads: int = 16) -> int:
        """`move` every (src, dst) pair; returns how many moved."""

    @abc.abstractmethod
    def read_many(self, paths: list[str], what: str) -> dict[str, bytes]:
        """{full path: bytes} of the objects at `paths` (full paths, `key(rel)`) that exist."""

    @abc.abstractmethod
    def invalidate(self, rel: str | None = None) -> None:
        """Forget what is cached about `rel` (None: about everything): the next listing or stat
        asks the storage (another process may have written since)."""

    @abc.abstractmethod
    def zarr_store(self, read_only: bool = False):
        """The zarr store over this root."""

    @abc.abstractmethod
    def reopen_url(self) -> str:
        """A URL that `open_store` (with `storage_options`) opens this root from again, in
        another process (reader workers) or after creating it."""

    @abc.abstractmethod
    def ensure_container(self, create: bool) -> None:
        """Check, before the first zarr write, that what holds the root exists (a bucket);
        create it when `create`, else fail with a message naming it."""

    @abc.abstractmethod
    def report_dir(self) -> Path:
        """Where `harvest report` writes by default: a directory a person can open."""

    @abc.abstractmethod
    def root_exists(self) -> bool:
        """Whether the root is there before anything is written (see `remove_empty_dirs`)."""

    @abc.abstractmethod
    def remove_empty_dirs(self, rels: list[str], root: bool = False) -> None:
        """Remove the directories `rels` (and the root, if `root`) when empty: what a run that
        failed before creating the store must not leave behind."""

    @abc.abstractmethod
    def is_unwritable_place(self, exc: BaseException) -> bool:
        """Whether `exc`, from the first write, means the root itself cannot be written (fix:
        choose another place), rather than an access or endpoint failure (`error` explains)."""

    @abc.abstractmethod
    def lower_io_priority(self) -> None:
        """Make this backend's background I/O threads yield to the engine (see
        `shardcodec.lower_priority`); the writer's own threads lower themselves."""


__all__ = ["CAPABILITIES", "RequestLimits", "Storage", "UploadRecord"]
