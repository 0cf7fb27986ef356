"""UploadPart requests sent from the writer's own buffers: the bytes of a shard object leave
this process with one copy, the kernel's.

Through s3fs (aiobotocore, aiohttp) a part's bytes are copied about four times in user space
before the socket's copy (a joined part, BytesIO, 64 KiB reads, the transport's buffer); at the
8B shape that was about half the upload thread's busy time (benchmarks/results/RESULTS.md,
"Whole write path"). Here a part is a list of buffers (the codec's compressed chunks, in order):
the request line and headers are one `send`, then each buffer goes to `socket.sendall` as it is,
over a keep-alive connection of the calling thread (the writer's upload threads each hold one).

Only UploadPart goes this way: it carries every stored byte of a streamed object. Everything
else (starting, completing and aborting uploads, create-once markers, reads, listings) stays on
s3fs, so its preconditions, retries and error translation are unchanged; this module's errors
are translated by s3fs's own table (`s3fs.errors.translate_boto_error`), so a caller sees the
same exceptions either way: NoSuchUpload (an upload aborted by a lifecycle rule or by finalize)
is FileNotFoundError, 403 PermissionError, 5xx/SlowDown an OSError that `with_retries` retries.

Requests are SigV4-signed by botocore with UNSIGNED-PAYLOAD, as `s3_options` configures s3fs
for custom endpoints (the bytes are checked end to end by the writer's CRC32Cs); where the
store turned payload signing on (`config_kwargs.s3.payload_signing_enabled: true`) the body's
SHA-256 is computed and signed. Used for stores with an explicit endpoint (S3-compatible
servers, path-style addressing); on AWS's own endpoints s3fs keeps sending parts.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import threading
import xml.etree.ElementTree as ET
from typing import Any
from urllib.parse import quote, urlsplit


def _nbytes(b) -> int:
    return b.nbytes if isinstance(b, memoryview) else memoryview(b).nbytes


class PartSender:
    """Signs and sends UploadPart requests to one S3-compatible endpoint (path-style), one
    keep-alive HTTP connection per calling thread."""

    def __init__(self, endpoint_url: str, region: str, credentials: Any, *,
                 connect_timeout: float | None = None, read_timeout: float | None = None,
                 sign_payload: bool = False):
        u = urlsplit(endpoint_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"endpoint_url {endpoint_url!r}: expected http(s)://host[:port]")
        self._https = u.scheme == "https"
        self._host, self._port = u.hostname, u.port or (443 if self._https else 80)
        self._netloc = u.netloc
        self._base = f"{u.scheme}://{u.netloc}{u.path.rstrip('/')}"
        self._prefix = u.path.rstrip("/")
        self._region, self._creds = region, credentials
        self._connect_timeout, self._read_timeout = connect_timeout, read_timeout
        self._sign_payload = sign_payload
        self._local = threading.local()

    # ---- the connection of this thread ------------------------------------------------------
    def _conn(self) -> "tuple[http.client.HTTPConnection, bool]":
        """(this thread's connection, whether it was used before); a forked child opens its own."""
        c = getattr(self._local, "conn", None)
        if c is not None and self._local.pid == os.getpid():
            return c, True
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        c = cls(self._host, self._port, timeout=self._connect_timeout)
        c.connect()
        c.sock.settimeout(self._read_timeout)
        c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._local.conn, self._local.pid = c, os.getpid()
        return c, False

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        self._local.conn = None
        if c is not None:
            c.close()

    # ---- requests ---------------------------------------------------------------------------
    def _headers(self, method: str, path: str, query: str, pieces: list, size: int) -> dict[str, str]:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        if self._sign_payload:
            h = hashlib.sha256()
            for p in pieces:
                h.update(p)
            digest = h.hexdigest()
        else:
            digest = "UNSIGNED-PAYLOAD"
        req = AWSRequest(method=method, url=f"{self._base}{path}?{query}",
                         headers={"Host": self._netloc, "Content-Length": str(size),
                                  "X-Amz-Content-SHA256": digest})
        if self._creds is not None:  # anonymous access (anon=True) sends no signature
            creds = self._creds.get_frozen_credentials() \
                if hasattr(self._creds, "get_frozen_credentials") else self._creds
            auth = S3SigV4Auth(creds, "s3", self._region)
            # S3SigV4Auth recomputes X-Amz-Content-SHA256 from `payload`; keep ours
            auth.payload = lambda _req: digest  # type: ignore[method-assign]
            auth.add_auth(req)
        return dict(req.headers.items())

    def upload_part(self, bucket: str, key: str, upload_id: str, part_number: int,
                    pieces: list) -> str:
        """PUT part `part_number` of upload `upload_id` of s3://bucket/key from `pieces` (bytes-like,
        in order, sent as they are); returns its ETag. Raises what s3fs would for the same
        answer (see the module docstring); a dropped keep-alive connection is reopened once."""
        path = f"{self._prefix}/{quote(bucket, safe='')}/{quote(key, safe='/~')}"
        query = f"partNumber={int(part_number)}&uploadId={quote(upload_id, safe='-_.~')}"
        size = sum(_nbytes(p) for p in pieces)
        for fresh_try in (False, True):
            conn, reused = self._conn()
            headers = self._headers("PUT", path, query, pieces, size)
            try:
                conn.putrequest("PUT", f"{path}?{query}", skip_host=True,
                                skip_accept_encoding=True)
                for k, v in headers.items():
                    conn.putheader(k, v)
                conn.endheaders()
                for p in pieces:
                    conn.sock.sendall(p)
                resp = conn.getresponse()
                body = resp.read()
            except (http.client.HTTPException, OSError) as e:
                self._drop()
                # a keep-alive connection the server closed while idle fails on first use:
                # one immediate try on a new one (UploadPart is idempotent); else the caller's
                # retries (with_retries) decide, as for any dropped connection
                if reused and not fresh_try and isinstance(e, ConnectionError):
                    continue   # reset, broken pipe, closed before answering: not a timeout
                if isinstance(e, OSError):
                    raise
                # a malformed or cut answer (IncompleteRead, BadStatusLine): a connection fault
                raise ConnectionError(f"UploadPart {part_number} of s3://{bucket}/{key}: "
                                      f"{type(e).__name__}: {e}") from e
            if resp.will_close:
                self._drop()
            if 200 <= resp.status < 300:
                etag = resp.getheader("ETag")
                if not etag:
                    raise OSError(f"UploadPart {part_number} of s3://{bucket}/{key}: the server "
                                  "answered without an ETag")
                return etag
            raise _translate(resp.status, body, "UploadPart")
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close this thread's connection (others close with their threads)."""
        self._drop()


def _translate(status: int, body: bytes, op: str) -> BaseException:
    """The exception s3fs raises for the same S3 error answer."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    code, msg = str(status), ""
    try:
        root = ET.fromstring(body)
        code = root.findtext("Code") or code
        msg = root.findtext("Message") or ""
    except ET.ParseError:
        msg = body[:200].decode("utf-8", "replace")
    err = ClientError({"Error": {"Code": code, "Message": msg},
                       "ResponseMetadata": {"HTTPStatusCode": status}}, op)
    return translate_boto_error(err)


def part_sender(storage_options: dict) -> "PartSender | None":
    """A PartSender for a store's s3fs options (`s3_options`'s result), or None where s3fs must
    keep sending parts: no explicit endpoint (AWS's own: region-aware virtual-host addressing is
    s3fs's), or options this client does not honour (a profile or session it cannot read,
    requester-pays, SSE or other per-request extras, virtual-host addressing, another signature
    version)."""
    so = storage_options
    ck = so.get("client_kwargs") or {}
    endpoint = ck.get("endpoint_url")
    if not endpoint or set(so) - {"key", "secret", "token", "anon", "client_kwargs",
                                  "config_kwargs", "endpoint_url", "use_listings_cache",
                                  "skip_instance_cache"}:
        return None
    if set(ck) - {"endpoint_url", "region_name"}:
        return None
    cfg = so.get("config_kwargs") or {}
    if (cfg.get("s3") or {}).get("addressing_style") == "virtual" \
            or cfg.get("signature_version") not in (None, "s3v4"):
        return None   # addressing or signing other than this client's: s3fs's to do
    import botocore.session

    # the region s3fs's client signs with: its own, the environment's, else us-east-1
    region = ck.get("region_name") or cfg.get("region_name") \
        or botocore.session.get_session().get_config_variable("region") or "us-east-1"
    if so.get("anon"):
        creds = None
    elif so.get("key") and so.get("secret"):
        from botocore.credentials import Credentials

        creds = Credentials(so["key"], so["secret"], so.get("token"))
    else:
        creds = botocore.session.get_session().get_credentials()
        if creds is None:
            return None  # s3fs then raises its own NoCredentialsError, which errors explain
    sign = bool((cfg.get("s3") or {}).get("payload_signing_enabled", False))
    # botocore's defaults (60 s each) where the store sets none (store.timeout_s sets both)
    return PartSender(endpoint, region, creds, connect_timeout=cfg.get("connect_timeout", 60),
                      read_timeout=cfg.get("read_timeout", 60), sign_payload=sign)


__all__ = ["PartSender", "part_sender"]
