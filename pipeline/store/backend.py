"""Where a store lives: local directory or fsspec URL, with plain (non-zarr) object operations.

Commit markers, the plan and stats partials are small objects we write ourselves, beside the zarr
hierarchy; they need things zarr's store API does not give: create-once puts (so two writers can
never both commit a unit) and retries with backoff that classify errors (so a wrong password fails
at once while a dropped connection is retried).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import fsspec

from .credentials import scrub, userinfo
from .errors import StoreAccessError

log = logging.getLogger(__name__)
T = TypeVar("T")

_PERMANENT = (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
              FileExistsError, ValueError, TypeError, KeyError, NotImplementedError)
# botocore's, by name (botocore is imported only with s3fs): no retry finds credentials
_PERMANENT_NAMES = ("NoCredentialsError", "PartialCredentialsError")


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: dropped connections, timeouts, 5xx/SlowDown. Auth and 404 are not."""
    if isinstance(exc, StoreAccessError):
        return False
    if isinstance(exc, _PERMANENT) or type(exc).__name__ in _PERMANENT_NAMES:
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.EACCES, errno.ENOENT, errno.EEXIST,
                                                  errno.EPERM, errno.ENOSPC, errno.EROFS):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
        return True
    mod = type(exc).__module__
    return mod.startswith(("botocore", "aiohttp", "urllib3", "requests"))


class RetryBudgetExceeded(TimeoutError):
    """An operation's retries ran past its time budget (store.retry_budget_s)."""


def with_retries(fn: Callable[[], T], what: str, *, attempts: int = 5, base_delay: float = 0.5,
                 max_delay: float = 8.0, sleep: Callable[[float], None] = time.sleep,
                 budget_s: float | None = None) -> T:
    """Call `fn`, retrying transient errors with full-jitter exponential backoff.

    Permanent errors propagate at once; after `attempts` transient failures the last one does,
    and so does the one after which the next try would start past `budget_s` (as
    RetryBudgetExceeded, naming the budget: an endpoint that never answers must fail in a known
    time, not after attempts x botocore retries x s3fs retries x read timeouts).
    """
    t0 = time.monotonic()
    for i in range(attempts):
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 -- classified below
            if not is_transient(e) or i == attempts - 1:
                raise
            delay = min(max_delay, base_delay * (2 ** i)) * (0.5 + random.random() / 2)
            spent = time.monotonic() - t0
            if budget_s is not None and spent + delay > budget_s:
                raise RetryBudgetExceeded(
                    f"{what}: no success within the retry budget of {budget_s:g} s ({i + 1} "
                    f"tries over {spent:.1f} s; last error {type(e).__name__}: {e}); raise "
                    "store.retry_budget_s / store.timeout_s if the storage is just slow") from e
            log.warning("%s failed (%s), retry %d/%d in %.1fs", what, type(e).__name__, i + 1,
                        attempts - 1, delay)
            sleep(delay)
    raise AssertionError("unreachable")


def _s3_options(storage_options: dict | None) -> dict:
    """s3fs options from the AWS environment, overridden by explicit storage_options.

    region_name is deliberately not put in client_kwargs for custom endpoints: s3fs then sends a
    LocationConstraint on bucket creation that S3-compatible servers reject.
    """
    so: dict[str, Any] = {k: v for k, v in (storage_options or {}).items()}
    ck = dict(so.get("client_kwargs") or {})
    endpoint = ck.get("endpoint_url") or so.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL") \
        or os.environ.get("AWS_ENDPOINT_URL_S3")
    if endpoint:
        ck["endpoint_url"] = endpoint
        cfg = dict(so.get("config_kwargs") or {})
        # Newer botocore checksum defaults break uploads to several S3-compatible servers.
        cfg.setdefault("request_checksum_calculation", "when_required")
        cfg.setdefault("response_checksum_validation", "when_required")
        so["config_kwargs"] = cfg
    elif os.environ.get("AWS_REGION") and "region_name" not in ck:
        ck["region_name"] = os.environ["AWS_REGION"]
    if ck:
        so["client_kwargs"] = ck
    if "key" not in so and os.environ.get("AWS_ACCESS_KEY_ID"):
        so["key"] = os.environ["AWS_ACCESS_KEY_ID"]
    if "secret" not in so and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        so["secret"] = os.environ["AWS_SECRET_ACCESS_KEY"]
    if "token" not in so and os.environ.get("AWS_SESSION_TOKEN"):
        so["token"] = os.environ["AWS_SESSION_TOKEN"]
    return so


# Whether a server honours If-None-Match on PUT, per (endpoint, bucket); probed once per process.
_CREATE_ONCE_PROBES: dict[tuple, bool] = {}
_PROBE_LOCK = threading.Lock()


def _fsync_dir(path: str) -> None:
    """Make a rename or link in `path` durable (POSIX keeps directory entries apart from data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(path: str, data: bytes) -> str:
    """`data` in a fsync'ed temp file beside `path`; the temp file is removed if anything fails
    (a full disk used to leave `.tmp-*` files behind on every failed write)."""
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


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass
class Location:
    """A store root: display URL (no secrets), fsspec filesystem and path, zarr store factory."""

    url: str
    protocol: str
    root: str
    storage_options: dict = field(repr=False)
    fs: Any = field(repr=False)
    budget_s: float | None = None  # total time of one operation's retries (store.retry_budget_s)

    @property
    def is_local(self) -> bool:
        return self.protocol in ("file", "local")

    def key(self, rel: str) -> str:
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
        s3 = self.protocol in ("s3", "s3a")
        where = f" (endpoint {self.endpoint})" if s3 else ""
        hint = ""
        if "NoCredentialsError" in cause or "unable to locate credentials" in low:
            hint = (" -- no S3 credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or "
                    "store.storage_options key/secret; on Kubernetes the Secret of "
                    "infra/k8s/secret-s3.example.yaml), then check the credentials reach the "
                    "driver and the actors")
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
        elif s3 and isinstance(exc, FileNotFoundError):
            hint = (f" -- endpoint {self.endpoint} answered Not Found: the bucket "
                    f"{self.root.split('/', 1)[0]!r} does not exist there (create it, or set "
                    "store.create_bucket: true), or the endpoint is not an S3 server (check "
                    "store.storage_options.client_kwargs.endpoint_url)")
        return StoreAccessError(f"{what} at {self.url}{where} failed: {cause}{hint}")

    # ---- zarr -------------------------------------------------------------------------------
    def zarr_store(self, read_only: bool = False):
        from zarr.storage import FsspecStore, LocalStore

        if self.is_local:
            return LocalStore(self.root, read_only=read_only)
        return FsspecStore.from_url(self.url_with_protocol(), storage_options=self.storage_options,
                                    read_only=read_only)

    def url_with_protocol(self) -> str:
        return f"{self.protocol}://{self.root}"

    # ---- plain objects ----------------------------------------------------------------------
    def read_bytes(self, rel: str, attempts: int = 5) -> bytes | None:
        """Object bytes, or None if absent."""
        try:
            return with_retries(lambda: self.fs.cat_file(self.key(rel)), f"read {rel}", attempts=attempts, budget_s=self.budget_s)
        except FileNotFoundError:
            return None

    def write_bytes(self, rel: str, data: bytes, attempts: int = 5) -> None:
        """Overwrite an object (shards, driver metadata, stats sidecars); retried on S3.

        Local files are fsync'ed before the rename and the directory after it: a commit marker
        promises its shards are stored, and without these a power cut could keep the (fsync'ed)
        marker while the shard bytes it vouches for were still only in the page cache. An S3 PUT
        is durable once acknowledged, so the two backends make the same promise.
        """
        path = self.key(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = _write_temp(path, data)
            try:
                os.replace(tmp, path)  # readers never see a half-written file
            except BaseException:
                _unlink_quietly(tmp)
                raise
            _fsync_dir(os.path.dirname(path))
            return
        with_retries(lambda: self.fs.pipe_file(path, data), f"write {rel}", attempts=attempts, budget_s=self.budget_s)

    def move(self, src: str, dst: str) -> bool:
        """Move object `src` to `dst` (replacing it); False if `src` is gone (moved already).

        Local: one rename (atomic, no copy). Object stores: a server-side copy, then the source
        is deleted (no bytes pass through this process)."""
        s, d = self.key(src), self.key(dst)
        if self.is_local:
            os.makedirs(os.path.dirname(d), exist_ok=True)
            try:
                os.replace(s, d)
            except FileNotFoundError:
                return False
            _fsync_dir(os.path.dirname(d))
            return True
        try:
            with_retries(lambda: self.fs.copy(s, d), f"publish {dst}")
        except FileNotFoundError:
            return False
        self.delete(src)
        return True

    def read_many(self, paths: list[str], what: str) -> dict:
        """{full path: bytes} of the objects at `paths` that exist: one concurrent batch request on
        object stores (a GET each, one after the other, is what made 10^5 markers slow)."""
        if not self.is_local:
            got = with_retries(lambda: self.fs.cat(sorted(set(paths)), on_error="return"), what, budget_s=self.budget_s)
            return {k: v for k, v in got.items() if isinstance(v, (bytes, bytearray))}
        out = {}
        for p in paths:
            try:
                with open(p, "rb") as f:
                    out[p] = f.read()
            except FileNotFoundError:
                pass
        return out

    def exists(self, rel: str) -> bool:
        return bool(with_retries(lambda: self.fs.exists(self.key(rel)), f"stat {rel}", budget_s=self.budget_s))

    def list_dir(self, rel: str) -> list[str]:
        """Names (not paths) directly under `rel`; [] if it does not exist."""
        path = self.key(rel)
        try:
            self.fs.invalidate_cache(path)
            entries = with_retries(lambda: self.fs.ls(path, detail=False), f"list {rel}", budget_s=self.budget_s)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def delete(self, rel: str) -> None:
        try:
            with_retries(lambda: self.fs.rm_file(self.key(rel)), f"delete {rel}", budget_s=self.budget_s)
        except FileNotFoundError:
            pass

    def create_once(self, rel: str, data: bytes) -> bool:
        """Write `data` at `rel` only if nothing is there. True if we created it, False if it existed.

        Local: write a temp file then hard-link it into place (link fails if the name exists), so
        the object appears whole and at most once. S3: PUT with If-None-Match: * where the server
        honours it (probed once); otherwise check-then-write, whose race window (between the HEAD
        and the PUT, a few ms) is documented in FORMAT.md and closed by the read-back below only
        for the loser that reads after the winner's PUT.
        """
        path = self.key(rel)
        if self.is_local:
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
        if self.protocol in ("s3", "s3a") and self.honours_if_none_match():
            def put() -> bool:
                try:
                    self.fs.pipe_file(path, data, mode="create")
                    return True
                except FileExistsError:
                    return False
                except OSError as e:
                    # Some servers answer 412 without naming the condition; s3fs then raises EINVAL.
                    if e.errno in (errno.EINVAL, errno.EEXIST) and self._exists_fresh(path):
                        return False
                    raise

            return with_retries(put, f"commit {rel}", budget_s=self.budget_s)
        if self._exists_fresh(path):
            return False
        with_retries(lambda: self.fs.pipe_file(path, data), f"commit {rel}", budget_s=self.budget_s)
        return self.fs.cat_file(path) == data

    def _exists_fresh(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(with_retries(lambda: self.fs.exists(path), "stat", budget_s=self.budget_s))

    def honours_if_none_match(self) -> bool:
        """Probe the server once: does a second create-once PUT of the same key fail?"""
        ck = (self.storage_options.get("client_kwargs") or {}).get("endpoint_url")
        probe_key = (ck, self.root.split("/", 1)[0])
        with _PROBE_LOCK:
            if probe_key in _CREATE_ONCE_PROBES:
                return _CREATE_ONCE_PROBES[probe_key]
            from .layout import PROBE_DIR

            path = self.key(f"{PROBE_DIR}/{uuid.uuid4().hex}")
            honoured = False
            try:
                self.fs.pipe_file(path, b"1", mode="create")
                try:
                    self.fs.pipe_file(path, b"2", mode="create")
                except (FileExistsError, OSError):
                    honoured = True
            except (NotImplementedError, TypeError, ValueError):
                honoured = False
            finally:
                try:
                    self.fs.rm_file(path)
                except Exception:  # noqa: BLE001 -- best effort cleanup of a 1-byte probe
                    pass
            if not honoured:
                log.warning("%s ignores If-None-Match: commit markers fall back to check-then-write",
                            self.url)
            _CREATE_ONCE_PROBES[probe_key] = honoured
            return honoured


def locate(url: str, storage_options: dict | None = None) -> Location:
    """Parse a local path or fsspec URL into a Location (filesystem built, nothing contacted)."""
    if not isinstance(url, (str, os.PathLike)) or not str(url):
        raise ValueError(f"store url must be a local path or fsspec URL, got {url!r}")
    url = os.fspath(url)
    display = scrub(url, storage_options)
    if userinfo(url):
        raise StoreAccessError(
            f"store url {display} carries credentials (user:secret@ before the bucket): they would "
            "end up in logs and error messages; pass them in AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY or storage_options key/secret instead")
    if "://" not in url or url.startswith("file://"):
        root = os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)
        return Location(url=root, protocol="file", root=root, storage_options={},
                        fs=fsspec.filesystem("file"))
    protocol = url.split("://", 1)[0].lower()
    so = _s3_options(storage_options) if protocol in ("s3", "s3a") else dict(storage_options or {})
    budget = so.pop("retry_budget_s", None)  # ours (StoreConfig.fs_options), not fsspec's
    try:
        fs, root = fsspec.url_to_fs(url, **so)
    except Exception as e:  # noqa: BLE001 -- reported without secrets
        raise StoreAccessError(f"cannot open filesystem for {display}: "
                               f"{scrub(f'{type(e).__name__}: {e}', so)}") from None
    if budget is not None and protocol in ("s3", "s3a"):
        # s3fs retries timeouts 5 times itself, outside any budget: with_retries does it
        fs.retries = 1
    return Location(url=display, protocol=protocol, root=root.rstrip("/"), storage_options=so, fs=fs,
                    budget_s=budget)
