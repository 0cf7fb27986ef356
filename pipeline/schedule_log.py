"""The store's run history: one create-once JSON per scheduled run, `_harvest/schedule/tick-<n>.json`
holding the run's summary (tokens, rates per actor, step fill). Kept apart from schedule.py so the
report and `harvest plan` read it without importing the run configuration (and the engine)."""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("harvest.pipeline")

TICK_DIR = "_harvest/schedule"


def record_tick(loc, summary: dict, started: float) -> None:
    """Keep a run's figures beside its store, numbered in order; a tick's data is committed
    already, so failing to record it is a warning, not a failed tick."""
    body = json.dumps({"started": started, "finished": time.time(), "summary": summary},
                      default=str).encode()
    n = len(read_ticks(loc))
    for seq in range(n, n + 100):  # a race with another recorder moves to the next number
        if loc.create_once(f"{TICK_DIR}/tick-{seq:06d}.json", body):
            return
    log.warning("could not record the run's summary under %s", TICK_DIR)


def read_ticks(loc) -> list[dict]:
    """Every recorded run of the store at `loc`, in order (empty for a store never scheduled)."""
    out = []
    for name in sorted(loc.list_dir(TICK_DIR)):
        data = loc.read_bytes(f"{TICK_DIR}/{name}") if name.endswith(".json") else None
        if data:
            try:
                out.append(json.loads(data))
            except ValueError:
                continue  # being written
    return out
