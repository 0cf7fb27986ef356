"""No Ray process outlives the driver that started it, even a SIGKILLed one.

A driver that starts a local Ray (`ray.init()` without an address) stops it on every way out it
sees (exits.py). A SIGKILL (the OOM killer, `kill -9`, a pod's grace period running out) runs
nothing: Ray's raylet and GCS follow their parent, but the agents the raylet starts
(`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) were seen running on, orphaned, each holding
ports and memory until the machine restarts.

So `init_local_ray` starts this watcher beside the cluster: a small process of its own session
(a Ctrl-C to the driver's terminal does not reach it) that knows the driver's pid and the pids
the cluster started with, and records their descendants (pid and start time) at once and every
half second.
When the driver is gone it stops every recorded process still alive with the same start time
(SIGTERM, then SIGKILL after a grace period): by pid, never by name, and never a process that
merely reused a pid. A driver that shuts its cluster down stops the watcher first (`stop`).

Run as `python -m harvest.pipeline.driver.reaper PID:START ROOT_PID:START[,...]` (start times as psutil
gives them: a pid reused by another process never matches).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 3.0


def _start_time(pid: int) -> "float | None":
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 -- gone, or not ours to see
        return None


def _snapshot(roots: dict, known: dict) -> None:
    """Add the live roots' descendants to `known` ({pid: start time})."""
    import psutil

    for pid, t in list(roots.items()):
        if _start_time(pid) != t:
            continue
        known[pid] = t
        try:
            kids = psutil.Process(pid).children(recursive=True)
        except Exception:  # noqa: BLE001
            continue
        for k in kids:
            try:
                known.setdefault(k.pid, k.create_time())
            except Exception:  # noqa: BLE001
                pass


def _stop(known: dict) -> int:
    alive = [p for p, t in known.items() if p != os.getpid() and _start_time(p) == t]
    for p in alive:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_start_time(p) == known[p] for p in alive):
        time.sleep(0.1)
    for p in alive:
        if _start_time(p) == known[p]:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    return len(alive)


def watch(driver: "tuple[int, float]", roots: "dict[int, float]") -> None:
    """Record the roots' descendants every POLL_S while `driver` (pid, start time) lives, and
    once more after; then stop every recorded process."""
    known: dict = {}
    while True:
        _snapshot(roots, known)   # first, whatever the driver's state: the roots are given
        if _start_time(driver[0]) != driver[1]:
            break
        time.sleep(POLL_S)
    _stop(known)


def _pair(pid: int) -> str:
    return f"{pid}:{_start_time(pid)!r}"


def start(roots: "set[int] | list[int]") -> "subprocess.Popen | None":
    """The watcher of this process and the Ray processes `roots` (None when there are none)."""
    roots = sorted(int(p) for p in roots)
    if not roots:
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "harvest.pipeline.driver.reaper", _pair(os.getpid()),
         ",".join(_pair(p) for p in roots)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True)


def stop(proc: "subprocess.Popen | None") -> None:
    """The driver stopped its cluster itself: the watcher goes (by its pid)."""
    if proc is None or proc.poll() is not None:
        return
    proc.kill()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _parse(arg: str) -> "tuple[int, float | None]":
    pid, _, t = arg.partition(":")
    return int(pid), (None if t in ("", "None") else float(t))


if __name__ == "__main__":
    watch(_parse(sys.argv[1]), {p: t for p, t in map(_parse, sys.argv[2].split(",")) if t is not None})
