"""Read-only views for the CLI: `status` (progress); `inspect` lives with the store (light install).

Both read the store alone, so they work while a job runs elsewhere, after it was interrupted, or
on a machine without the engine. Marker contents come from the compacted index plus the markers
written since (one listing, one GET per unindexed marker), never a GET per unit every time.
"""

from __future__ import annotations

import datetime as _dt


# Without a driver lease (stores written before leases existed) a run is taken as alive while its
# last commit is younger than this many times its typical gap between commits (and at least
# ACTIVE_MIN_SECONDS): a rate and an ETA shown for a run killed an hour ago are worse than none.
ACTIVE_GAPS = 5
ACTIVE_MIN_SECONDS = 120.0


def driver_state(loc, ttl: "float | None" = None) -> "dict | None":
    """The driver's lease (pipeline/driver/lease.py) as status shows it: a live lease is a running
    driver; a released or expired one, a stopped run. None when the store has no lease."""
    from ..config.run import StoreConfig
    from ..driver.lease import current

    try:
        cur = current(loc)
    except Exception:  # noqa: BLE001 -- status must not fail on an unreadable lease
        return None
    if cur is None:
        return None
    ttl = float(ttl or StoreConfig.lease_seconds)
    return {"live": cur.live(ttl), "released": cur.record.released,
            "heartbeat_age_s": round(cur.age(), 1), "pid": cur.record.pid,
            "host": cur.record.host, "generation": cur.gen}


def store_missing(url: str, storage_options: dict | None = None) -> bool:
    """True when nothing is at `url` yet (a job still starting), as opposed to a store we
    cannot read (open_store's errors say why). A bucket that does not exist is not "no store
    yet": that is a StoreAccessError naming the bucket (a typo in the URL; `run` says the same)."""
    from ...store import locate

    try:
        loc = locate(url, storage_options)
        missing = loc.read_bytes("zarr.json", attempts=2) is None
    except Exception:  # noqa: BLE001 -- open_store reports access errors properly
        return False
    if missing:
        loc.ensure_container(False)
    return missing


def status(url: str, storage_options: dict | None = None,
           now: "_dt.datetime | None" = None) -> dict:
    """Progress of a running or interrupted job, from the store alone."""
    from ...store import open_store

    if store_missing(url, storage_options):
        from ...store import locate

        from ...store import redact_url

        return {"url": redact_url(url), "missing_store": True,
                "driver": driver_state(locate(url, storage_options))}
    store = open_store(url, storage_options=storage_options, read_only=True)
    plan = store.ledger.plans.read()
    units = plan.units
    rows_of = plan.rows()
    names = store.ledger.marker_names()
    done = [n for n in names if rows_of.get(n.unit_id) == n.rows] if units else names
    planned_rows = sum(u.n_rows for u in units)
    done_rows = sum(n[2] - n[1] for n in done)
    per_actor: dict = {}
    first = last = None
    first_rows = 0
    for m in store.ledger.iter_committed(done, planned=bool(units)):
        extra = m.extra
        key = f"{extra.get('host', m.host)}/actor{extra.get('actor', '?')}"
        d = per_actor.setdefault(key, {"units": 0, "tokens": 0, "seconds": 0.0, "pids": set()})
        d["units"] += 1
        d["tokens"] += m.n_rows
        d["seconds"] += float(m.seconds or 0.0)
        d["pids"].add(m.pid)
        if m.committed_at:
            t = _dt.datetime.fromisoformat(m.committed_at)
            if first is None or t < first:
                first, first_rows = t, m.n_rows
            last = t if last is None or t > last else last
    rate = eta = since = None
    finalized = store.summary is not None
    now = now or _dt.datetime.now(_dt.timezone.utc)
    active = False
    if last is not None:
        since = max(0.0, (now - last).total_seconds())
        gap = (last - first).total_seconds() / max(1, len(done) - 1)
        active = not finalized and since < max(ACTIVE_MIN_SECONDS, ACTIVE_GAPS * gap)
    driver = driver_state(store.location)
    if driver is not None:  # the lease says it, whatever the commit times suggest
        active = driver["live"] and not finalized
    if first is not None and last > first and active:
        rate = (done_rows - first_rows) / (last - first).total_seconds()
        if plan.final:
            eta = (planned_rows - done_rows) / rate if rate > 0 else None
    committed_ids = {n.unit_id for n in done}
    missing = sorted(set(rows_of) - committed_ids)
    from ...store import unpublished

    # committed units whose objects are not known to be at their zarr keys (store/commit/published.py)
    unpub = unpublished(store, done)
    finalized = store.summary is not None
    paused = _paused_tick(store, finalized, active, missing, planned_rows)
    return {
        "url": store.url,
        "name": ((store.attrs or {}).get("config") or {}).get("name"),
        "planned_units": len(units),
        "plan_complete": plan.final,
        "committed_units": len(done),
        "missing_units": missing[:50],
        "n_missing_units": len(missing),
        # finalized, yet planned units have no marker: markers were lost after finalize
        "damaged": finalized and bool(missing),
        "unpublished_units": unpub[:50],
        "n_unpublished_units": len(unpub),
        "planned_rows": planned_rows,
        "committed_rows": done_rows,
        "fraction": done_rows / planned_rows if planned_rows else 0.0,
        "finalized": finalized,
        "active": active,
        "driver": driver,
        "last_commit": last.isoformat() if last else None,
        "seconds_since_last_commit": round(since, 1) if since is not None else None,
        "recent_tokens_per_second": round(rate, 1) if rate else None,
        "eta_seconds": round(eta, 1) if eta else None,
        "per_actor": {k: {**v, "pids": sorted(p for p in v["pids"] if p is not None)}
                      for k, v in sorted(per_actor.items())},
        "summary": store.summary,
        # a scheduled tick's healthy end: its units all committed, the next tick continues
        "paused": paused is not None,
        "budget_rows": (paused or {}).get("budget_rows"),
    }


def _paused_tick(store, finalized: bool, active: bool, missing: list, planned_rows: int):
    """{budget_rows} when the store is paused by a scheduled tick (the newest tick record says
    paused at exactly the planned rows, every planned unit is committed, no driver holds it);
    else None. Such a store is healthy, not interrupted."""
    from ..driver.schedule_log import last_paused

    if finalized or active or missing:
        return None
    last = last_paused(store.location)
    if last is None or int(last.get("planned_tokens") or -1) != planned_rows:
        return None
    budget = (((store.attrs or {}).get("config") or {}).get("packing") or {}).get("max_tokens")
    return {"budget_rows": budget}
