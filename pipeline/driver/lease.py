"""The driver's lease on a store: one driver builds a store at a time.

Two drivers on one store.url corrupted it: driver A paused after creating the store, driver B
(another `store.unit_shards`, which is not part of the run's identity) took the store as a resume
of its own, planned and committed units of its size; A then went on, rewrote the plan and counted
B's markers as its own. Verify failed for ever after. A run's identity check cannot catch this
(both configs are "the same run"), and create-once markers cannot either (they keep the two
drivers from writing the same object, not from planning different units).

So a driver holds a lease before it writes anything, and keeps it fresh while it runs:

- `_harvest/lease/lease-<generation>.json`, created once per generation (`create_once`: of two
  drivers that race for the next generation exactly one wins), holding who (host, pid, a random
  owner id), what (the run identity: content key, points, layout) and `heartbeat`;
- the holder rewrites its own generation's object every `lease_seconds / 4` (a thread); a lease
  whose heartbeat is older than `lease_seconds`, or marked released, is free to take;
- a second driver that finds a live lease is refused before it writes anything, naming the holder
  (a lease whose holder ran on this machine and whose process is gone is not live: a driver
  killed by SIGKILL or the OOM killer is restarted at once, not after `lease_seconds`);
- before each write of the run's control objects (store creation, plan segments, finalize) the
  holder checks that no later generation exists (`assert_held`): a driver that was paused past
  its lease (SIGSTOP, a VM freeze) and finds it taken stops without writing more.

Heartbeats compare the writer's wall clock with the reader's: clocks must agree to well within
`lease_seconds` (the default 120 s is far above NTP-synced skew). A driver that dies leaves a lease
that expires by itself; a released lease (the run ended, either way) is free at once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from ..errors import HarvestError
from ...store import LEASE_DIR, LeaseRecord, lease_generation, lease_key, process_id, read_lease, redact_attrs

log = logging.getLogger("harvest.pipeline")


@dataclass
class LeaseSeen:
    """A lease generation as read from the store: its number and its record."""

    gen: int
    record: LeaseRecord

    def age(self) -> float:
        return self.record.age()

    def live(self, ttl: float) -> bool:
        return self.record.live(ttl)

    def who(self) -> str:
        r = self.record
        return (f"driver pid {r.pid} on {r.host} (run {r.name!r}, lease "
                f"{self.gen}, last heartbeat {self.age():.0f} s ago)")


def current(loc) -> "LeaseSeen | None":
    """The newest lease of the store at `loc`, or None."""
    got = read_lease(loc)
    return None if got is None else LeaseSeen(*got)


def refuse_if_held(loc, ttl: float, shown_url: str) -> None:
    """Refuse a store another driver is running, before this driver writes anything."""
    ttl = _checked_ttl(ttl)
    cur = current(loc)
    if cur is not None and cur.live(ttl):
        raise HarvestError(
            f"store.url={shown_url} is being written by another {cur.who()}: two drivers on one "
            "store would corrupt its plan. Wait for that run to end (or stop it), or use a new "
            f"store.url; a lease not refreshed for store.lease_seconds={ttl:g} s is free again")


def _checked_ttl(ttl) -> float:
    """The config refuses such values already; this is the last guard, because the heartbeat
    waits ttl / 4 between rewrites: NaN or 0 made it spin (44 fsynced rewrites in 2 s), and a NaN
    lease is never "older than ttl", so a second driver took the live store."""
    ttl = float(ttl)
    if not math.isfinite(ttl) or ttl <= 0:
        raise ValueError(f"store.lease_seconds must be a finite number > 0, got {ttl!r}")
    return ttl


class Lease:
    """This driver's lease; `acquire` takes it, `assert_held` before control writes, `release`."""

    def __init__(self, loc, ttl: float, shown_url: str, identity: dict, name: str):
        self.loc, self.ttl, self.shown_url = loc, _checked_ttl(ttl), shown_url
        me = process_id(os.getpid()) or (None, None)
        self.record = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                       "boot": me[0], "start": me[1], "name": name, "identity": identity,
                       "acquired": time.time(), "lease_seconds": self.ttl}
        self.gen: int | None = None
        self.root_existed = True
        self.lost: "LeaseSeen | None" = None
        self.last_beat = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _payload(self, **extra) -> bytes:
        """The lease object's bytes, redacted like every record of the store (credentials.py):
        the identity is the content key, whose source is secret-free already (url_identity)."""
        rec = {**self.record, "heartbeat": time.time(), **extra}
        return json.dumps(redact_attrs(rec, getattr(self.loc, "storage_options", None))).encode()

    def acquire(self) -> "Lease":
        cur = current(self.loc)
        if cur is not None and cur.live(self.ttl):
            refuse_if_held(self.loc, self.ttl, self.shown_url)
        gen = 0 if cur is None else cur.gen + 1
        self.root_existed = self.loc.root_exists()
        try:
            won = self.loc.create_once(lease_key(gen), self._payload())
        except OSError as e:
            if self.loc.is_unwritable_place(e):  # a read-only place fails here, not hours later
                raise HarvestError(
                    f"store.url={self.shown_url} is not writable ({type(e).__name__}: {e}): "
                    "choose a writable directory or fix its permissions") from None
            raise self.loc.error("taking the store lease (the first write)", e) from None
        except Exception as e:  # noqa: BLE001
            raise self.loc.error("taking the store lease (the first write)", e) from None
        if not won:
            raise HarvestError(
                f"store.url={self.shown_url}: another driver took the store's lease at the same "
                f"moment (lease generation {gen}); run one driver per store.url")
        self.gen = gen
        self.last_beat = time.monotonic()
        if cur is not None:
            log.info("took over the lease of %s from %s", self.shown_url, cur.who())
        self._thread = threading.Thread(target=self._beat, name="harvest-lease", daemon=True)
        self._thread.start()
        return self

    def _newer(self) -> "LeaseSeen | None":
        cur = current(self.loc)
        return cur if cur is not None and cur.gen != self.gen else None

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                newer = self._newer()
                if newer is not None:
                    self.lost = newer
                    log.error("lost the lease of %s to %s", self.shown_url, newer.who())
                    return
                self.loc.write_bytes(lease_key(self.gen), self._payload())
                self.last_beat = time.monotonic()
            except Exception as e:  # noqa: BLE001 -- retried at the next beat; assert_held decides
                log.warning("could not refresh the lease of %s: %s", self.shown_url, e)

    def assert_held(self, what: str) -> None:
        """Raise unless this driver still holds the lease (checked against the storage when the
        last heartbeat is older than a quarter of the lease: the process may have been paused)."""
        if self.gen is None:
            return
        if self.lost is None and time.monotonic() - self.last_beat > self.ttl / 4:
            self.lost = self._newer()
            if self.lost is None:
                self.loc.write_bytes(lease_key(self.gen), self._payload())
                self.last_beat = time.monotonic()
        if self.lost is not None:
            raise HarvestError(
                f"this driver lost the lease of {self.shown_url} to {self.lost.who()} (this one "
                f"was not heard from for over store.lease_seconds={self.ttl:g} s); stopped before "
                f"{what}. The store is the other driver's now: let it finish")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.gen is None or self.lost is not None:
            return
        try:
            if self._newer() is None:
                self.loc.write_bytes(lease_key(self.gen), self._payload(released=True))
        except Exception as e:  # noqa: BLE001 -- an unreleased lease expires by itself
            log.warning("could not release the lease of %s: %s", self.shown_url, e)

    def remove_if_alone(self) -> None:
        """The run failed before creating the store: leave the location as it was (no lease
        object, no directory this driver made), so bad input leaves nothing behind."""
        self.release()
        if self.gen is None or self.lost is not None:
            return
        loc = self.loc
        try:
            if loc.exists("zarr.json"):
                return
            for name in loc.list_dir(LEASE_DIR):
                if lease_generation(name) is not None:
                    loc.delete(f"{LEASE_DIR}/{name}")
            loc.remove_empty_dirs([LEASE_DIR, "_harvest"], root=not self.root_existed)
        except Exception as e:  # noqa: BLE001
            log.warning("could not remove the lease of %s: %s", self.shown_url, e)
