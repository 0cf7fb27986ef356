"""S3 parts sent from the writer's buffers (store/storage/s3parts.py): the bytes a real S3
server (SeaweedFS) stores are exactly the pieces handed over, signed requests are accepted, no
UploadPart goes through s3fs, and every failure surfaces as the exception s3fs raises for it,
so the callers' retries and conflict handling keep their meaning. Connection faults (a
keep-alive connection the server dropped, a server that never answers, 503 SlowDown) are
played by a small HTTP server in this process."""

from __future__ import annotations

import errno
import os
import socket
import threading

import numpy as np
import pytest

from harvest.store.storage.locate import locate
from harvest.store.storage.s3 import S3Storage
from harvest.store.storage.retries import is_transient
from harvest.store.storage.s3parts import PartSender, part_sender


def _uploads_of_parts(loc) -> list:
    """Every UploadPart request that goes through s3fs's botocore client from now on."""
    seen: list = []
    loc.fs.connect()
    loc.fs.s3.meta.events.register(
        "before-call.s3.UploadPart", lambda **kw: seen.append(kw.get("model")))
    return seen


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "s3fs"])
def test_parts_round_trip_from_pieces_and_fail_as_s3fs_does(seaweedfs, s3_url, monkeypatch,
                                                            direct):
    monkeypatch.setattr(S3Storage, "direct_parts", direct)
    loc = locate(s3_url, seaweedfs.storage_options)
    assert isinstance(loc.parts_client(), PartSender) if direct else loc.parts_client() is None
    via_s3fs = _uploads_of_parts(loc)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (5 << 20) + 3, dtype=np.uint8).tobytes()  # parts but the last >= 5 MiB
    b = rng.integers(0, 65535, (700, 4096), dtype=np.uint16)            # a numpy buffer, in place
    c = memoryview(bytearray(b"tail" * 1000))[7:2007]                   # a slice of a view
    h = loc.begin_object("x/obj", "x/obj.attempt")
    loc.write_part(h, [a, b.data])
    loc.write_part(h, [c])
    rec = loc.finish_object(h)
    assert rec["parts"] == 2
    assert loc.complete_upload("x/obj", rec)
    assert loc.read_bytes("x/obj") == a + b.tobytes() + bytes(c)
    assert len(via_s3fs) == (0 if direct else 2)

    # an upload aborted meanwhile (finalize, a lifecycle rule): NoSuchUpload, not retried
    h = loc.begin_object("x/gone", "x/gone.attempt")
    loc.abort_object(h)
    with pytest.raises(FileNotFoundError) as ei:
        loc.write_part(h, [b"x" * 10])
    assert not is_transient(ei.value)
    # a wrong secret: PermissionError, not retried
    bad = locate(s3_url, {**seaweedfs.storage_options, "secret": "Wr0ng-" + "s" * 34})
    h = loc.begin_object("x/denied", "x/denied.attempt")
    try:
        with pytest.raises(PermissionError) as ei:
            bad.write_part(h, [b"x"])
        assert not is_transient(ei.value)
    finally:
        loc.abort_object(h)
    assert loc.pending_uploads("x") == {}


def test_stores_the_sender_cannot_serve_keep_s3fs():
    so = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    assert isinstance(part_sender(so), PartSender)
    assert part_sender({"key": "k", "secret": "s"}) is None  # AWS's own endpoints: s3fs
    assert part_sender({**so, "requester_pays": True}) is None
    assert part_sender({**so, "config_kwargs": {"s3": {"addressing_style": "virtual"}}}) is None
    assert part_sender({**so, "config_kwargs": {"signature_version": "s3"}}) is None


class _Server:
    """A tiny HTTP/1.1 server on 127.0.0.1 playing one answer per connection's request: `plan`
    is a list of (status, body, then) with then "keep" (keep the connection), "drop" (close it
    after answering, without saying so), "cut" (close it halfway through the answer) or "mute"
    (read the request, never answer)."""

    def __init__(self, plan):
        self.plan, self.requests, self.connections = list(plan), [], 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._mute: list = []
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _read_request(self, f):
        line = f.readline()
        if not line:
            return None
        headers = {}
        while (h := f.readline()) not in (b"\r\n", b""):
            k, _, v = h.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        body = f.read(int(headers.get("content-length", 0)))
        return line.decode().split()[1], headers, body

    def _run(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            f = conn.makefile("rb")
            while self.plan:
                req = self._read_request(f)
                if req is None:
                    break
                self.requests.append(req)
                status, body, then = self.plan.pop(0)
                if then == "mute":
                    self._mute.append(conn)
                    break
                if then == "cut":  # the answer stops short of its Content-Length
                    conn.sendall(b"HTTP/1.1 200 X\r\nETag: \"e\"\r\nContent-Length: 100\r\n\r\nab")
                    break
                conn.sendall(f"HTTP/1.1 {status} X\r\nETag: \"e{len(self.requests)}\"\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                if then == "drop":
                    break
            if not self._mute or self._mute[-1] is not conn:
                f.close()
                conn.close()

    def close(self):
        self._stop.set()
        self._sock.close()
        for c in self._mute:
            c.close()


def _sender(srv, **kw) -> PartSender:
    from botocore.credentials import Credentials

    return PartSender(srv.endpoint, "us-east-1", Credentials("AKIDEXAMPLE", "secret"), **kw)


def test_a_dropped_keep_alive_connection_is_reopened_once():
    srv = _Server([(200, b"", "drop"), (200, b"", "keep")])
    try:
        s = _sender(srv, read_timeout=10)
        body = [b"abc", memoryview(b"defgh")[1:], np.arange(3, dtype=np.uint8).data]
        assert s.upload_part("bkt", "k/o", "u+1/=", 1, body) == '"e1"'
        assert s.upload_part("bkt", "k/o", "u+1/=", 2, body) == '"e2"'
    finally:
        srv.close()
    assert srv.connections == 2
    (path, headers, got), _ = srv.requests
    assert path == "/bkt/k/o?partNumber=1&uploadId=u%2B1%2F%3D"
    assert got == b"abcefgh\x00\x01\x02" and headers["content-length"] == "10"
    assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    assert headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")


def test_server_errors_are_s3fs_s_cut_answers_and_silence_are_retried():
    nosuch = (b"<Error><Code>NoSuchUpload</Code><Message>The specified multipart upload does "
              b"not exist.</Message></Error>")
    slow = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
    srv = _Server([(404, nosuch, "keep"), (503, slow, "keep"), (200, b"", "cut"),
                   (200, b"", "mute")])
    try:
        s = _sender(srv, read_timeout=0.5)
        with pytest.raises(FileNotFoundError, match="multipart upload does not exist"):
            s.upload_part("bkt", "k", "u", 1, [b"x"])
        with pytest.raises(OSError) as ei:
            s.upload_part("bkt", "k", "u", 1, [b"x"])
        assert ei.value.errno == errno.EBUSY and is_transient(ei.value)  # retried by with_retries
        with pytest.raises(ConnectionError, match="IncompleteRead") as ci:
            s.upload_part("bkt", "k", "u", 1, [b"x"])
        assert is_transient(ci.value)
        with pytest.raises(TimeoutError) as ti:
            s.upload_part("bkt", "k", "u", 1, [b"x"])
        assert is_transient(ti.value)
    finally:
        srv.close()


def test_the_test_server_leaves_nothing_behind():
    """weed makes a gRPC unix socket per service in the temp dir whatever its flags say; the
    test server removes its own at stop (each run left three behind: hundreds a day here)."""
    from harvest.testing import seaweed

    srv = seaweed.start()
    try:
        made = [p for p in srv._sockets if os.path.exists(p)]
        assert len(made) >= 3, srv._sockets   # master, volume, s3 (and the filer's)
    finally:
        srv.stop()
    assert not [p for p in srv._sockets if os.path.exists(p)]
    assert not os.path.exists(srv.workdir)
