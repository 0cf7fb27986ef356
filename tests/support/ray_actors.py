"""Which actors of the connected Ray cluster still have a process, for tests that must wait until
a run's actors are really gone (a killed or stopped run's actor may still commit a unit)."""

from __future__ import annotations


def live_actors() -> list[str]:
    """'Class pid' of every actor of the cluster (this host) whose process still runs: alive in
    Ray's actor table, or marked dead with its worker process not gone yet."""
    import psutil
    from ray._private import state

    out = []
    for a in state.actors().values():
        pid = a.get("Pid") or 0
        running = False
        if pid:
            try:
                p = psutil.Process(pid)
                # a pid of an actor long gone may have been reused (pid_max can be 32768): only
                # a process titled for an actor of this class counts
                running = p.status() != psutil.STATUS_ZOMBIE and \
                    " ".join(p.cmdline()).startswith(f"ray::{a['ActorClassName']}")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                running = False
        if a["State"] != "DEAD" or running:
            out.append(f"{a['ActorClassName']} {pid}")
    return out


def wait_actors_gone(timeout: float, why: str) -> None:
    """Return once no actor of the cluster has a process (live_actors() is empty)."""
    from tests.support.waiting import wait_until

    left: list[str] = []

    def gone() -> bool:
        left[:] = live_actors()
        return not left

    try:
        wait_until(gone, timeout, f"every actor's process to exit ({why})", interval=0.1)
    except AssertionError as e:
        raise AssertionError(f"{e}; still running: {left}") from None
