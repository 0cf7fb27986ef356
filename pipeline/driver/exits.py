"""Every way out of the driver is orderly: exit, exception, SIGINT and SIGTERM.

A driver ended by SIGTERM (`kill`, a timeout, Kubernetes deleting the pod) used to die where it
stood before Ray started, leaving its lease for the next run to wait out; after `ray.init` Ray's
own handler turned it into `sys.exit(15)`. Now SIGTERM (and SIGHUP) raise `Terminated`, a
KeyboardInterrupt, in the main thread, so the driver's `finally` blocks run as for Ctrl-C: the
actors are killed, the Ray this driver started is shut down, the lease is released. The CLI exits
with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a shell reports it.

A second signal while that cleanup runs is logged and ignored: it would abort the cleanup
halfway (whoever sent it follows with SIGKILL if it will not wait; Kubernetes does).

A driver killed by SIGKILL runs none of this: a watcher process started with a local cluster
(reaper.py) stops that cluster's processes, by pid, once the driver is gone.

A local Ray that fails to start (Ray's "The current node timed out during startup" on a loaded
machine, or a signal in the middle of `ray.init`) leaves the processes it had started (gcs_server,
raylet, dashboard): `init_local_ray` stops them by the pids this process started, never by name.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Any

from . import reaper
from harvest.pipeline.errors import HarvestError

log = logging.getLogger("harvest.pipeline")

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """The driver got SIGTERM/SIGHUP: unwinds like Ctrl-C; `exit_code` is 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(f"{signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


_state = {"installed": 0, "received": None}
_reaper: dict[str, subprocess.Popen | None] = {}   # "proc": the watcher of the local cluster started here


def _handler(signum, frame) -> None:
    if _state["received"] is not None:
        log.warning("%s again while stopping: ignored, the lease and Ray are being released",
                    signal.Signals(signum).name)
        return
    _state["received"] = signum
    log.warning("%s received: stopping (actors, Ray, lease)", signal.Signals(signum).name)
    raise Terminated(signum)


def install() -> None:
    """(Re)install the handlers: `ray.init` replaces SIGTERM's with its own `sys.exit(15)`."""
    if _state["installed"] and threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _handler)


@contextmanager
def orderly_signals():
    """SIGTERM/SIGHUP -> `Terminated` while the block runs (main thread only: Python runs
    handlers there; a driver run from another thread keeps the process's handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    outer = _state["installed"] == 0
    if outer:
        _state["received"] = None
    _state["installed"] += 1
    install()
    try:
        yield
    finally:
        _state["installed"] -= 1
        for s, h in saved.items():
            signal.signal(s, h)


# ---- a local Ray: started and stopped by what this process owns ---------------------------------
def _children() -> set:
    import psutil

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def stop_pids(pids, grace: float = 10.0) -> None:
    """SIGTERM these processes (this process's own children), wait up to `grace`, then SIGKILL."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.terminate()
            procs.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def shutdown_ray() -> None:
    """`ray.shutdown()`; a local cluster this process started is stopped with it, and its
    watcher (reaper.py) goes first, its work done."""
    import ray

    reaper.stop(_reaper.pop("proc", None))
    ray.shutdown()


def init_local_ray(kw: dict[str, Any]) -> None:
    """`ray.init(**kw)` starting a local cluster; if it fails, the processes it started are stopped
    (by pid) and the failure is one clear error, not Ray's traceback."""
    import ray

    before = _children()
    t0 = time.monotonic()
    try:
        ray.init(**kw)
        # a watcher that stops these processes if this driver dies without doing it (SIGKILL)
        _reaper["proc"] = reaper.start(_children() - before)
    except BaseException as e:
        leftovers = _children() - before
        try:
            ray.shutdown()  # forgets a half-made node; its processes are stopped below
        except Exception:  # noqa: BLE001
            pass
        stop_pids(leftovers)
        if not isinstance(e, Exception):
            raise  # Terminated, KeyboardInterrupt, SystemExit: the caller's to report
        raise HarvestError(
            f"the local Ray cluster did not start in {time.monotonic() - t0:.0f} s "
            f"({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}). "
            "This happens on an overloaded machine (Ray gives its raylet 30 s to register). "
            "Nothing was written to the store; re-run when the load is lower, lower "
            "ray.local_num_cpus, or set ray.address to a running cluster") from None
    finally:
        install()
