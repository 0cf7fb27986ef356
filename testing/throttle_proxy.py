"""An HTTP proxy in front of an S3 server that answers a share of write requests with S3's
503 SlowDown, as S3 does to many writers on one prefix, without forwarding them (a throttled
request is not performed). For tests of the write path under throttling; 127.0.0.1 only.

    with ThrottleProxy(upstream="http://127.0.0.1:8333", share=0.25, seed=0) as p:
        p.endpoint   # give this as the S3 endpoint_url
        p.counts     # {"writes", "throttled", "forwarded"}

Requests are forwarded byte for byte with their headers (SigV4 signs the Host header the client
sent, which the server checks as received), so signatures stay valid.
"""

from __future__ import annotations

import http.client
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please '
            b'reduce your request rate.</Message><RequestId>throttled</RequestId></Error>')
WRITES = ("PUT", "POST", "DELETE")


class _Handler(BaseHTTPRequestHandler):
    """One request: throttled (a write, by the proxy's draw) or forwarded as it came."""

    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, *a):   # quiet
        pass

    def _handle(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        proxy = self.server.proxy
        if self.command in WRITES and proxy.draw():
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOWDOWN)))
            self.end_headers()
            self.wfile.write(SLOWDOWN)
            return
        up = proxy.upstream
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("connection", "transfer-encoding")}
            conn.request(self.command, self.path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            proxy.count("forwarded")
            self.send_response(r.status, r.reason)
            for k, v in r.getheaders():
                if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    proxy: "ThrottleProxy"


class ThrottleProxy:
    def __init__(self, upstream: str, share: float, seed: int = 0):
        self.upstream = urlsplit(upstream)
        self.share = share
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"writes": 0, "throttled": 0, "forwarded": 0}
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.proxy = self
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def draw(self) -> bool:
        """A write arrived: whether to throttle it (counted either way)."""
        with self.lock:
            self.counts["writes"] += 1
            hit = self.rng.random() < self.share
            self.counts["throttled"] += hit
            return hit

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "ThrottleProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
