"""The run writing a store, as a reader sees it: finalized or not, the driver's lease, the plan.

A follower (store/read/follow.py) reads a store while a run writes it; it has to tell "the run is still
going, wait" from "it ended" and "it died". The store says all three without asking the driver:

- finalized: the root `zarr.json` has `finalized_at` (finalize writes it last, FORMAT.md);
- the driver's lease (FORMAT.md "The driver's lease"): the newest `_harvest/lease/lease-<gen>.json`.
  A lease that is `released` without a finalize is a run that ended unfinished (failed, stopped or
  paused); one whose `heartbeat` is older than its `lease_seconds` (the driver records it; older
  leases: the driver's default, 120 s), or whose holder ran on this machine and is gone, is a
  driver that died.

The lease is read before `zarr.json`: the driver finalizes before it releases, so a released lease
seen first and no `finalized_at` after it is a run that ended unfinished, never a finalize missed
by a race. The pipeline's own lease code (pipeline/driver/lease.py) writes these objects; the
store does not import the pipeline, so the few lines that read them are repeated here.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from ..errors import StoreError

LEASE_DIR = "_harvest/lease"
DEFAULT_LEASE_SECONDS = 120.0   # the driver's default store.lease_seconds


class RunEndedUnfinished(StoreError):
    """The run writing a followed store ended (released its lease) without finalizing it."""


class RunLeaseStale(StoreError):
    """The driver of a followed store stopped refreshing its lease (killed, hung, or its host
    lost): no more units will commit until a driver resumes the run."""


class FollowTimeout(TimeoutError):
    """A follower waited `follow_timeout` seconds for the next unit and none committed."""


def lease_generation(name: str) -> "int | None":
    """The generation of a lease object's name (`lease-00000003.json` -> 3), None for others."""
    if name.startswith("lease-") and name.endswith(".json"):
        try:
            return int(name[len("lease-"):-len(".json")])
        except ValueError:
            return None
    return None


def read_lease(loc) -> "tuple[int, dict] | None":
    """(generation, record) of the store's newest lease, or None when it has none."""
    gens = sorted((g for g in (lease_generation(n) for n in loc.list_dir(LEASE_DIR)) if g is not None),
                  reverse=True)
    for gen in gens:
        data = loc.read_bytes(f"{LEASE_DIR}/lease-{gen:08d}.json")
        if data is None:
            continue
        try:
            return gen, json.loads(data)
        except ValueError:   # being written: a driver just took it, so it is fresh
            return gen, {"heartbeat": time.time()}
    return None


def process_id(pid: int) -> "tuple[str, str] | None":
    """(boot id, start time in clock ticks) of a live process, None if there is none (Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return boot, stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError, ValueError):
        return None


def holder_gone(record: dict) -> bool:
    """The lease's holder ran on this machine (same boot) and that process is gone."""
    me = process_id(os.getpid())
    if not me or record.get("host") != socket.gethostname() or record.get("boot") != me[0]:
        return False
    them = process_id(int(record.get("pid") or 0))
    return them is None or them[1] != record.get("start")


@dataclass
class RunState:
    """One look at a store's run: its lease, whether it is finalized, the plan's progress."""

    finalized: bool
    lease_gen: "int | None" = None
    lease: "dict | None" = None
    planned: int = 0
    plan_final: bool = False
    committed: int = 0

    @property
    def ttl(self) -> float:
        return float((self.lease or {}).get("lease_seconds") or DEFAULT_LEASE_SECONDS)

    @property
    def lease_age(self) -> "float | None":
        return None if self.lease is None else time.time() - float(self.lease.get("heartbeat", 0))

    @property
    def released(self) -> bool:
        return bool(self.lease and self.lease.get("released"))

    @property
    def stale(self) -> bool:
        """The lease is held (not released) by a driver that stopped refreshing it."""
        if self.lease is None or self.released:
            return False
        age = self.lease_age
        return bool(age is None or age >= self.ttl or holder_gone(self.lease))

    def describe(self) -> str:
        if self.finalized:
            run = "finalized"
        elif self.lease is None:
            run = "no driver lease (a store written without the pipeline's driver)"
        else:
            r = self.lease
            run = (f"lease {self.lease_gen} held by driver pid {r.get('pid')} on {r.get('host')} "
                   f"(run {r.get('name')!r}), last heartbeat {self.lease_age:.0f} s ago"
                   + (", released" if self.released else "")
                   + (f", stale (lease_seconds={self.ttl:g})" if self.stale else ""))
        return (f"{run}; {self.committed} of {self.planned} planned units committed, plan "
                + ("final" if self.plan_final else "still growing"))

    def check_alive(self, url: str) -> None:
        """Raise when no more units can commit: the run ended unfinished or its driver died."""
        if self.finalized:
            return
        if self.released:
            raise RunEndedUnfinished(
                f"{url}: the run ended without finalizing the store ({self.describe()}): it failed, "
                "was stopped, or paused at a tick. Rows yielded so far are committed rows; re-run "
                "the harvest with the same config to finish the store, then read it (follow=True "
                "again resumes from the reader's state_dict)")
        if self.stale:
            raise RunLeaseStale(
                f"{url}: the driver writing this store is not heard from ({self.describe()}): no "
                "unit will commit until a driver resumes the run. Re-run the harvest with the same "
                "config, or read the committed rows without follow=True")


def run_state(st) -> RunState:
    """A fresh look at the run of store `st` (lease first, then zarr.json: see the docstring)."""
    loc = st.location
    got = read_lease(loc)
    raw = loc.read_bytes("zarr.json")
    try:
        attrs = (json.loads(raw).get("attributes") or {}) if raw else {}
    except ValueError:   # finalize rewriting it (zarr's own write): not finalized yet, look again
        attrs = {}
    gen, rec = got if got is not None else (None, None)
    return RunState(finalized="finalized_at" in attrs, lease_gen=gen, lease=rec)


__all__ = ["DEFAULT_LEASE_SECONDS", "FollowTimeout", "RunEndedUnfinished", "RunLeaseStale",
           "RunState", "holder_gone", "read_lease", "run_state"]
