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
lease record, its key and its reading are the ledger's (records.py, format/layout.py), shared by
both sides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import StoreError
from .records import DEFAULT_LEASE_SECONDS, LeaseRecord


class RunEndedUnfinished(StoreError):
    """The run writing a followed store ended (released its lease) without finalizing it."""


class RunLeaseStale(StoreError):
    """The driver of a followed store stopped refreshing its lease (killed, hung, or its host
    lost): no more units will commit until a driver resumes the run."""


class FollowTimeout(TimeoutError):
    """A follower waited `follow_timeout` seconds for the next unit and none committed."""


@dataclass
class RunState:
    """One look at a store's run: its lease, whether it is finalized, the plan's progress."""

    finalized: bool
    lease_gen: "int | None" = None
    lease: "LeaseRecord | None" = None
    planned: int = 0
    plan_final: bool = False
    committed: int = 0

    @property
    def ttl(self) -> float:
        return self.lease.ttl if self.lease is not None else DEFAULT_LEASE_SECONDS

    @property
    def lease_age(self) -> "float | None":
        return None if self.lease is None else self.lease.age()

    @property
    def released(self) -> bool:
        return bool(self.lease and self.lease.released)

    @property
    def stale(self) -> bool:
        """The lease is held (not released) by a driver that stopped refreshing it."""
        if self.lease is None or self.released:
            return False
        age = self.lease_age
        return bool(age is None or age >= self.ttl or self.lease.holder_gone())

    def describe(self) -> str:
        if self.finalized:
            run = "finalized"
        elif self.lease is None:
            run = "no driver lease (a store written without the pipeline's driver)"
        else:
            r = self.lease
            run = (f"lease {self.lease_gen} held by driver pid {r.pid} on {r.host} "
                   f"(run {r.name!r}), last heartbeat {self.lease_age:.0f} s ago"
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
    got = st.ledger.lease()
    raw = loc.read_bytes("zarr.json")
    try:
        attrs = (json.loads(raw).get("attributes") or {}) if raw else {}
    except ValueError:   # finalize rewriting it (zarr's own write): not finalized yet, look again
        attrs = {}
    gen, rec = got if got is not None else (None, None)
    return RunState(finalized="finalized_at" in attrs, lease_gen=gen, lease=rec)


__all__ = ["FollowTimeout", "RunEndedUnfinished", "RunLeaseStale", "RunState", "run_state"]
