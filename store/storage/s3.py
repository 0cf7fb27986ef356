"""A store on S3 or an S3-compatible server (SeaweedFS, MinIO, ...) through s3fs: `S3Storage`,
the object store (objectstore.py) with a conditional PUT for create-once, multipart uploads for
streamed objects, and the request limits and deadlines S3 states; `s3_options` builds s3fs's
options from the AWS environment.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import StoreAccessError
from .retries import is_throttle, with_retries
from ..commit.records import UploadHandle
from .interface import RequestLimits, UploadRecord
from .objectstore import ObjectStorage
from .credentials import StorageOptions

log = logging.getLogger(__name__)


# Whether a server honours If-None-Match on PUT, per (endpoint, bucket); probed once per process.
_CREATE_ONCE_PROBES: dict[tuple, bool] = {}
# Part senders (s3parts.PartSender or None), per set of storage options; not on the instance,
# which is pickled to Ray actors and readers.
_SENDERS: dict[str, Any] = {}
_PROBE_LOCK = threading.Lock()


@dataclass
class S3Storage(ObjectStorage):
    """S3 or an S3-compatible server (SeaweedFS, MinIO, ...) through s3fs, but for the parts of
    streamed objects: those go from the writer's buffers (s3parts.PartSender) where the store
    names an endpoint (see `direct_parts`)."""

    protocols: ClassVar[tuple[str, ...]] = ("s3", "s3a")
    has_endpoint: ClassVar[bool] = True
    supports_conditional_create: ClassVar[bool] = True   # If-None-Match, probed per endpoint
    supports_multipart: ClassVar[bool] = True
    # S3's request baseline per prefix: PUT/COPY/POST/DELETE, and GET/HEAD, per second. A store
    # is one prefix until S3 splits it under sustained load, answering 503 SlowDown meanwhile.
    # A LIST page is 1,000 keys.
    request_limits: ClassVar[RequestLimits] = RequestLimits(
        writes_per_second_per_prefix=3500, reads_per_second_per_prefix=5500, list_page_keys=1000)
    # A request's connect timeout is store.timeout_s but at most this: a connection that is not
    # made in seconds is not coming.
    connect_timeout_max_s: ClassVar[float] = 10.0

    @classmethod
    def fsspec_options(cls, storage_options: dict) -> StorageOptions:
        return s3_options(storage_options)

    @classmethod
    def bound_retries(cls, fs: Any, budget_s: "float | None") -> None:
        """s3fs retries timeouts 5 times itself, outside any budget: with_retries does it."""
        if budget_s is not None:
            fs.retries = 1

    @classmethod
    def deadline_options(cls, storage_options: dict, timeout_s: float,
                         retry_budget_s: float) -> StorageOptions:
        """botocore's connect and read timeouts, and one try per request: with_retries retries
        within the budget (botocore's and s3fs's own retries multiply with ours and ignore it).
        Without a timeout botocore and s3fs retry inside their own: an endpoint that accepts and
        never answers took 14 min to fail."""
        so = super().deadline_options(storage_options, timeout_s, retry_budget_s)
        ck = dict(so.get("config_kwargs") or {})
        ck.setdefault("connect_timeout", min(timeout_s, cls.connect_timeout_max_s))
        ck.setdefault("read_timeout", timeout_s)
        ck.setdefault("retries", {"total_max_attempts": 1})
        so["config_kwargs"] = ck
        return so

    def not_found_hint(self) -> str:
        return (f" -- endpoint {self.endpoint} answered Not Found: the bucket "
                f"{self.root.split('/', 1)[0]!r} does not exist there (create it, or set "
                "store.create_bucket: true), or the endpoint is not an S3 server (check "
                "store.storage_options.client_kwargs.endpoint_url)")

    def create_once(self, rel: str, data: bytes) -> bool:
        """PUT with If-None-Match: * where the server honours it (probed once per endpoint and
        bucket): the server decides, no race. Otherwise check-then-write (ObjectStorage)."""
        if not self.honours_if_none_match():
            return self._check_then_write(rel, data)
        path = self.key(rel)
        tries = [0]

        def put() -> bool:
            tries[0] += 1
            try:
                self.fs.pipe_file(path, data, mode="create")
                return True
            except FileExistsError:
                return self._ours_after_retry(path, data, tries[0])
            except OSError as e:
                # Some servers answer 412 without naming the condition; s3fs then raises EINVAL.
                if e.errno in (errno.EINVAL, errno.EEXIST) and self._exists_fresh(path):
                    return self._ours_after_retry(path, data, tries[0])
                raise

        return with_retries(put, f"commit {rel}", budget_s=self.budget_s)

    def _ours_after_retry(self, path: str, data: bytes, tries: int) -> bool:
        """The object exists. On the first try another writer made it. After a retry it may be
        ours: a try whose answer was lost (a timeout, a dropped connection) may have been
        performed, and the retry then finds our own object; the bytes tell (every marker holds
        its writer's attempt id and time, so another writer's are never the same bytes). A
        throttled try (503 SlowDown) was not performed, so it never gets here as ours."""
        if tries <= 1:
            return False
        try:
            return with_retries(lambda: self.fs.cat_file(path), "read back a commit",
                                budget_s=self.budget_s) == data
        except FileNotFoundError:
            return False

    # ---- streamed objects: multipart uploads to the zarr key, completed after the marker ------
    # A point's shard object is one multipart upload to its final zarr key: parts go up as the
    # writer's blocks complete, and CompleteMultipartUpload -- after this attempt's marker was
    # created -- makes the whole object appear at once. Publishing is one request, no copy (a
    # server-side copy of a unit took longer than capturing it). An upload never
    # completed is invisible: a losing attempt aborts its own, and finalize completes a
    # committed one whose writer died (or aborts a loser's) from one listing of the uploads.
    # Parts but the last must be at least 5 MiB (S3's minimum); the writer gathers 16 MiB: the
    # upload client's CPU is largely per request (signing, headers, the response, a task per
    # part), so at the 8B shape 16 MiB parts cost ~0.3 core-s per GB of bf16 less than 5 MiB
    # ones and half the write requests (benchmarks/results/RESULTS.md, "Whole write path"), for
    # ~11 MiB more held per open shard object (uploads.py's memory bound).
    part_min_bytes: ClassVar[int] = 16 << 20
    max_parts: ClassVar[int] = 10_000   # S3's most parts per upload (and per ListParts page)

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, _, key = self.key(rel).partition("/")
        return bucket, key

    def _s3(self, what: str, op: str, **kw):
        return with_retries(lambda: self.fs.call_s3(op, **kw), what, budget_s=self.budget_s)

    def begin_object(self, final_rel: str, attempt_rel: str) -> UploadHandle:
        b, k = self._bucket_key(final_rel)
        r = self._s3(f"start upload of {final_rel}", "create_multipart_upload", Bucket=b, Key=k)
        return UploadHandle(final_rel, bucket=b, key=k, upload_id=r["UploadId"])

    # Parts go out from the writer's buffers (s3parts.py: one copy, the kernel's) where the
    # store names its endpoint; False sends them through s3fs (benchmarks compare the two).
    direct_parts: ClassVar[bool] = True

    def parts_client(self):
        """The store's PartSender (one per endpoint and credentials in this process), or None."""
        if not self.direct_parts:
            return None
        import json

        from .s3parts import part_sender

        ck = json.dumps(self.storage_options, sort_keys=True, default=str)
        with _PROBE_LOCK:
            if ck not in _SENDERS:
                _SENDERS[ck] = part_sender(self.storage_options)
            return _SENDERS[ck]

    def write_part(self, handle: UploadHandle, data) -> None:
        """Part n+1 of the upload from `data`: bytes-like, or a list of them (one part, in order,
        sent without joining where the PartSender applies)."""
        n = len(handle.etags) + 1
        pieces = data if isinstance(data, list) else [data]
        what = f"upload part {n} of {handle.rel}"
        sender = self.parts_client()
        if sender is not None:
            etag = with_retries(lambda: sender.upload_part(handle.bucket, handle.key,
                                                           handle.upload_id, n, pieces),
                                what, budget_s=self.budget_s)
        else:
            body = bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)
            etag = self._s3(what, "upload_part", Bucket=handle.bucket, Key=handle.key,
                            UploadId=handle.upload_id, PartNumber=n, Body=body)["ETag"]
        handle.etags.append(etag)

    def finish_object(self, handle: UploadHandle) -> UploadRecord:
        """The upload id and part count (and, in memory only, the parts' ETags: the writer's
        own publish completes without asking the server for them)."""
        return {"upload_id": str(handle.upload_id), "parts": len(handle.etags),
                "_etags": list(handle.etags)}

    def abort_object(self, handle: UploadHandle) -> None:
        self.abort_upload(handle.rel, str(handle.upload_id))

    def abort_upload(self, final_rel: str, upload_id: str) -> None:
        b, k = self._bucket_key(final_rel)
        try:
            self._s3(f"abort upload of {final_rel}", "abort_multipart_upload", Bucket=b, Key=k,
                     UploadId=upload_id)
        except FileNotFoundError:
            pass

    def complete_upload(self, final_rel: str, upload: UploadRecord) -> bool:
        """CompleteMultipartUpload from the ETags the writer kept, else from ListParts (a
        finalize after the writer died), checked against the part count its record holds."""
        b, k = self._bucket_key(final_rel)
        uid, want = upload["upload_id"], int(upload["parts"])
        try:
            etags = upload.get("_etags")
            if etags is None:
                got = self._s3(f"list parts of {final_rel}", "list_parts", Bucket=b, Key=k,
                               UploadId=uid, MaxParts=self.max_parts).get("Parts", [])
                etags = [p["ETag"] for p in sorted(got, key=lambda p: p["PartNumber"])]
            if len(etags) != want:
                raise StoreAccessError(f"upload {uid} of {final_rel} holds {len(etags)} parts, its "
                                       f"writer recorded {want}: not completed")
            parts = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]
            self._s3(f"complete upload of {final_rel}", "complete_multipart_upload", Bucket=b,
                     Key=k, UploadId=uid, MultipartUpload={"Parts": parts})
        except FileNotFoundError:
            return False  # no such upload: completed already (a retried request) or aborted
        self.fs.invalidate_cache(self.key(final_rel))
        return True

    def pending_uploads(self, rel: str) -> "dict[str, str]":
        b, k = self._bucket_key(rel)
        root = self.key("")[len(b) + 1:]
        out: dict[str, str] = {}
        kw: dict = {"Bucket": b, "Prefix": k}
        while True:
            r = self._s3(f"list uploads under {rel}", "list_multipart_uploads", **kw)
            for u in r.get("Uploads", []):
                out[u["UploadId"]] = u["Key"][len(root):]
            if not r.get("IsTruncated"):
                return out
            kw.update(KeyMarker=r.get("NextKeyMarker"), UploadIdMarker=r.get("NextUploadIdMarker"))

    def honours_if_none_match(self) -> bool:
        """Probe the server once: does a second create-once PUT of the same key fail?"""
        ck = (self.storage_options.get("client_kwargs") or {}).get("endpoint_url")
        probe_key = (ck, self.root.split("/", 1)[0])
        with _PROBE_LOCK:
            if probe_key in _CREATE_ONCE_PROBES:
                return _CREATE_ONCE_PROBES[probe_key]
            from ..format.layout import PROBE_DIR

            path = self.key(f"{PROBE_DIR}/{uuid.uuid4().hex}")
            honoured = False

            def first() -> None:
                try:
                    self.fs.pipe_file(path, b"1", mode="create")
                except FileExistsError:   # a retry after a lost answer: ours is there
                    pass

            def second() -> bool:
                try:
                    self.fs.pipe_file(path, b"2", mode="create")
                    return False
                except FileExistsError:
                    return True
                except OSError as e:
                    if is_throttle(e):   # not an answer to the question: retried
                        raise
                    return True          # a 412 s3fs could not name

            try:
                with_retries(first, "probe conditional PUT", budget_s=self.budget_s)
                honoured = with_retries(second, "probe conditional PUT", budget_s=self.budget_s)
            except (NotImplementedError, TypeError, ValueError):
                honoured = False
            finally:
                try:
                    self.fs.rm_file(path)
                except Exception:  # noqa: BLE001 -- best effort cleanup of a 1-byte probe
                    pass
            if not honoured:
                log.warning("%s ignores If-None-Match: commit markers fall back to "
                            "check-then-write", self.url)
            _CREATE_ONCE_PROBES[probe_key] = honoured
            return honoured

    def ensure_container(self, create: bool) -> None:
        """The bucket must exist before zarr writes into it: a typo in its name otherwise fails
        on the first shard, hours in, with a bare NoSuchBucket. Checked by the driver before its
        first write too: a PUT into a missing bucket answered only "FileNotFoundError: Not
        Found"."""
        bucket = self.root.split("/", 1)[0]
        try:
            if with_retries(lambda: self.fs.exists(bucket), "stat bucket"):
                return
        except Exception as e:  # noqa: BLE001
            raise self.error(f"checking bucket {bucket!r}", e) from None
        if not create:
            raise StoreAccessError(
                f"bucket {bucket!r} of {self.url} does not exist at endpoint {self.endpoint} (a "
                "typo in store.url?): create it, or set store.create_bucket: true "
                "(create_store(..., create_bucket=True)); if it does exist, store.storage_options"
                ".client_kwargs.endpoint_url may name a server that is not S3")
        try:
            self.fs.mkdir(bucket)
        except FileExistsError:
            return
        except Exception as e:  # noqa: BLE001
            raise self.error(f"bucket {bucket!r} does not exist and could not be created",
                             e) from None


def s3_options(storage_options: dict | None) -> StorageOptions:
    """s3fs options from the AWS environment, overridden by explicit storage_options.

    region_name is deliberately not put in client_kwargs for custom endpoints: s3fs then sends a
    LocationConstraint on bucket creation that S3-compatible servers reject.
    """
    so: dict[str, Any] = {k: v for k, v in (storage_options or {}).items()}
    ck = dict(so.get("client_kwargs") or {})
    endpoint = ck.get("endpoint_url") or so.pop("endpoint_url", None) \
        or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
    if endpoint:
        ck["endpoint_url"] = endpoint
        cfg = dict(so.get("config_kwargs") or {})
        # Newer botocore checksum defaults break uploads to several S3-compatible servers.
        cfg.setdefault("request_checksum_calculation", "when_required")
        cfg.setdefault("response_checksum_validation", "when_required")
        # UNSIGNED-PAYLOAD: without a checksum header (above) botocore SHA-256-signs every body,
        # ~0.6 core-s per GB stored on the writer's cores (benchmarks/results/RESULTS.md). The
        # bytes are checked end to end instead: every shard object against the CRC32C its writer
        # recorded before the marker, by every reader and by verify (FORMAT.md, "Integrity").
        # storage_options config_kwargs.s3.payload_signing_enabled: true turns signing back on.
        s3cfg = dict(cfg.get("s3") or {})
        s3cfg.setdefault("payload_signing_enabled", False)
        cfg["s3"] = s3cfg
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


__all__ = ["S3Storage", "s3_options"]
