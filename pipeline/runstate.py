"""`_harvest/driver.json`: whether a driver is working on the store, or stopped and why.

The store has no heartbeat, so `harvest status` used to show a rate and an ETA for a run killed
with Ctrl-C a moment ago. The driver writes this object (overwritten, never create-once) when
dispatch starts and again when it leaves with an error or an interrupt; a driver killed outright
(SIGKILL, a lost node) cannot write "stopped", so status also treats commits that stopped for
several typical gaps as a stopped run (views.ACTIVE_GAPS). Advisory only: nothing reads it for
correctness, and resume never depends on it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket

KEY = "_harvest/driver.json"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def mark(store, state: str, reason: str | None = None) -> None:
    """Best effort: a store we cannot write to now must not hide the error that stopped us."""
    doc = {"state": state, "at": _now(), "pid": os.getpid(), "host": socket.gethostname(),
           "reason": reason}
    try:
        store.location.write_bytes(KEY, json.dumps(doc).encode(), attempts=2)
    except Exception:  # noqa: BLE001
        pass


def read(store) -> dict | None:
    try:
        raw = store.location.read_bytes(KEY, attempts=2)
        return json.loads(raw) if raw else None
    except Exception:  # noqa: BLE001
        return None
