"""Every way out of the driver is orderly: exit, exception, SIGINT and SIGTERM.

A driver ended by SIGTERM (`kill`, a timeout, Kubernetes deleting the pod) must not die where it
stands (its lease left for the next run to wait out; after `ray.init`, Ray's own handler would
turn it into `sys.exit(15)`). SIGTERM (and SIGHUP) raise `Terminated`, a KeyboardInterrupt, in the main thread, so the driver's `finally` blocks run as for Ctrl-C: the
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
from ..errors import HarvestError

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
_cluster: dict[str, set] = {}   # "roots": the pids the local cluster started here began with
# how long a driver waits for its local cluster's processes to exit after ray.shutdown()
SHUTDOWN_GRACE_S = 20.0


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
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    stop_procs(procs, grace)


def _tree(roots) -> list:
    """The live processes among `roots` and all their descendants (psutil objects: each one
    remembers its start time, so a pid reused later is never mistaken for it)."""
    import psutil

    out: dict = {}
    for pid in roots:
        try:
            p = psutil.Process(pid)
            out[p.pid] = p
            for k in p.children(recursive=True):
                out.setdefault(k.pid, k)
        except psutil.Error:
            pass
    return list(out.values())


def shutdown_ray(grace: float = SHUTDOWN_GRACE_S) -> None:
    """`ray.shutdown()`, and a local cluster this process started is gone when this returns.

    `ray.shutdown()` signals the cluster's processes and returns without waiting for them: the
    raylet's agents and workers exit a moment later, on a loaded machine seconds later, so a
    driver could exit while processes it started still ran (a test saw one outlive a SIGTERMed
    driver). So the cluster's whole process tree is recorded before the shutdown, waited for up
    to `grace` seconds, and whatever is left is stopped (SIGTERM, then SIGKILL) by pid. Its
    watcher (reaper.py) goes last, once there is nothing left for it to do."""
    import ray

    procs = _tree(_cluster.pop("roots", ()))
    try:
        ray.shutdown()
    finally:
        _settle(procs, grace)
        reaper.stop(_reaper.pop("proc", None))


def _settle(procs: list, grace: float) -> None:
    """Wait up to `grace` for `procs` to exit; SIGTERM the rest, then SIGKILL what still runs."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace)
    if alive:
        log.warning("%d processes of the local Ray cluster still ran %.0f s after its shutdown: "
                    "stopping them by pid (%s)", len(alive), grace,
                    ", ".join(str(p.pid) for p in alive[:8]))
        stop_procs(alive)


def stop_procs(procs: list, grace: float = 10.0) -> None:
    """SIGTERM these processes (psutil objects), wait up to `grace`, then SIGKILL."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def init_local_ray(kw: dict[str, Any]) -> None:
    """`ray.init(**kw)` starting a local cluster; if it fails, the processes it started are stopped
    (by pid) and the failure is one clear error, not Ray's traceback."""
    import ray

    before = _children()
    t0 = time.monotonic()
    try:
        ray.init(**kw)
        roots = _children() - before
        _cluster["roots"] = roots   # shutdown_ray waits for their whole tree
        # a watcher that stops these processes if this driver dies without doing it (SIGKILL)
        _reaper["proc"] = reaper.start(roots)
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
