"""The store's run history: one create-once JSON per scheduled run, `_harvest/schedule/tick-<n>.json`
holding the run's summary (tokens, rates per actor, step fill), and one `start-<n>.json` written
before tick n starts anything (its token target). Both pass through the store's redaction
(credentials.redact_attrs) like every other record: no URL credential or known secret lands there. A start without a tick record is a tick that
was killed or failed: the next tick finishes that tick's tokens (its target) instead of taking
the next slice, and records it under the same number. Kept apart from schedule.py so the report
and `harvest plan` read it without importing the run configuration (and the engine)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Mapping

log = logging.getLogger("harvest.pipeline")

TICK_DIR = "_harvest/schedule"


def _name(kind: str, seq: int) -> str:
    return f"{TICK_DIR}/{kind}-{seq:06d}.json"


def record_tick(loc, summary: Mapping[str, Any], started: float, seq: "int | None" = None,
                start: "dict | None" = None, storage_options: "dict | None" = None) -> None:
    """Keep a run's figures beside its store, numbered in order (`seq`: the number its start
    record took); a tick's data is committed already, so failing to record it is a warning, not
    a failed tick. `storage_options`: the run's, whose secret values are scrubbed from the
    record (by default the location's)."""
    rec = {"started": started, "finished": time.time(), "summary": summary}
    if start:
        rec["start"] = start
    body = _record(loc, rec, storage_options)
    n = len(read_ticks(loc)) if seq is None else seq
    for s in range(n, n + 100):  # a race with another recorder moves to the next number
        if loc.create_once(_name("tick", s), body):
            return
    log.warning("could not record the run's summary under %s", TICK_DIR)


def _record(loc, rec: Mapping[str, Any], storage_options: "dict | None") -> bytes:
    """A record's bytes, redacted (module docstring); JSON-safe through str() first."""
    from ...store import redact_attrs

    plain = json.loads(json.dumps(rec, default=str))
    so = storage_options if storage_options is not None else getattr(loc, "storage_options", None)
    return json.dumps(redact_attrs(plain, so)).encode()


def read_ticks(loc) -> list[dict]:
    """Every recorded run of the store at `loc`, in order (empty for a store never scheduled)."""
    out = []
    for name in sorted(loc.list_dir(TICK_DIR)):
        data = (loc.read_bytes(f"{TICK_DIR}/{name}")
                if name.startswith("tick-") and name.endswith(".json") else None)
        if data:
            try:
                out.append(json.loads(data))
            except ValueError:
                continue  # being written
    return out


def open_start(loc) -> "tuple[int, dict | None]":
    """(the next tick's number, the start record of that number if a tick took it and never
    recorded its end: killed or failed)."""
    seq = len(read_ticks(loc))
    data = loc.read_bytes(_name("start", seq))
    if not data:
        return seq, None
    try:
        return seq, json.loads(data)
    except ValueError:
        return seq, None


def record_start(loc, seq: int, start: dict, storage_options: "dict | None" = None) -> dict:
    """Tick `seq` starts: its target is kept before anything runs. Returns the record that holds
    (another tick's, if one took the number first). `storage_options`: as for record_tick."""
    body = _record(loc, start, storage_options)
    if loc.create_once(_name("start", seq), body):
        return start
    return json.loads(loc.read_bytes(_name("start", seq)) or body)


def drop_start(loc, seq: int) -> None:
    """A start whose target the store already holds (the tick died after its last commit): its
    number is free again for the next tick."""
    try:
        loc.delete(_name("start", seq))
    except Exception as e:  # noqa: BLE001 -- the next tick only re-reads it
        log.warning("could not remove %s: %s", _name("start", seq), e)


def last_paused(loc) -> "dict | None":
    """The newest recorded run's summary when it paused (a scheduled tick's end), else None."""
    ticks = read_ticks(loc)
    s = (ticks[-1].get("summary") or {}) if ticks else {}
    return s if s.get("paused") else None
