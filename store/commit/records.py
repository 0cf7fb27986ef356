"""The ledger's records: plan unit, commit marker, shard record, publish record, lease record and
the upload handle, as frozen dataclasses with JSON round-trips (zarr-python 3's ArrayV3Metadata
pattern: `from_json` builds a record from the parsed JSON, `to_json` gives the JSON back).

A store is untrusted input (trust.py says why), so `from_json` is where a record is checked,
once, against the layout: names (attempt tokens, unit ids, point and metadata names, the keys a
record states against the keys its unit and attempt imply) and sizes (row ranges, shard counts,
byte counts within what the layout allows). A refusal is a `RecordError` naming the object and
the field. What passes is typed: code past this module reads attributes, not string keys.

What is written stays byte for byte what was written before: a record read from a store keeps
the JSON object it came from (`to_json` returns it, field names, order and fields this version
does not know included), so an index compaction or a copy rewrites old markers unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from ..format import layout
from . import trust
from .trust import fail, integer, show
from ..format.jsonattrs import JsonObject


def attempt_token(attempt) -> str:
    """How a void or publish record names an attempt: the id itself (writers make 16 hex
    digits), or a hash of whatever else a marker holds there (None in a hand-made marker), so any
    entry can be named."""
    if isinstance(attempt, str) and attempt.isascii() and attempt.isalnum() and len(attempt) <= 64:
        return attempt
    return "h" + hashlib.sha256(json.dumps(attempt).encode()).hexdigest()[:32]


def _sizes(v, where: str, at: str, n_points: "int | None") -> "tuple | None":
    """A per-point list of sizes or digests (None entries allowed), or None when absent."""
    if v is None:
        return None
    if not isinstance(v, list) or (n_points is not None and len(v) != n_points) or not all(
            x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 0) for x in v):
        raise fail(where, at, f"is not a list of {n_points or 'n'} sizes/digests")
    return tuple(v)


class _Rows:
    """A record of a unit's rows [row_start, row_end)."""

    row_start: int
    row_end: int

    @property
    def n_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def rows(self) -> tuple[int, int]:
        return self.row_start, self.row_end


def _unit_rows(d: dict, where: str) -> tuple[int, int, int]:
    """(unit_id, row_start, row_end) of a record, each an integer, the range non-empty and
    within the layout's capacity."""
    uid = integer(d, "unit_id", where)
    rs = integer(d, "row_start", where)
    return uid, rs, integer(d, "row_end", where, lo=rs + 1, hi=layout.CAPACITY_ROWS)


# ---- plan unit ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Unit(_Rows):
    """A unit of work: rows [row_start, row_end) of every array, written and committed together.

    `pieces` says where the unit's tokens come from (the pipeline fills it; the store ignores it):
    tuples (block, chunk, ctx_lo, ctx_hi, doc_base).
    """

    unit_id: int
    row_start: int
    row_end: int
    pieces: tuple = ()

    def to_json(self) -> list:
        """A plan segment's entry: `[unit_id, row_start, row_end, pieces]`."""
        return [self.unit_id, self.row_start, self.row_end, [list(p) for p in self.pieces]]

    @classmethod
    def from_json(cls, u, where: str, i: int) -> "Unit":
        """Entry `i` of a plan object at `where`: every number an integer in range; pieces short
        lists of integers."""
        at = f"units[{i}]"
        if not isinstance(u, list) or len(u) != 4 or not isinstance(u[3], list):
            raise fail(where, at, "is not [unit_id, row_start, row_end, pieces]")
        uid, rs, re_ = _unit_rows({"unit_id": u[0], "row_start": u[1], "row_end": u[2]},
                                  f"{where} {at}")
        pieces = []
        for j, p in enumerate(u[3]):
            if not (isinstance(p, list) and len(p) <= 8 and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in p)):
                raise fail(where, f"{at}.pieces[{j}]", f"is {show(p)}, not a list of at most 8 "
                           "integers")
            pieces.append(tuple(p))
        return cls(uid, rs, re_, tuple(pieces))

    def as_dict(self) -> JsonObject:
        """The unit as `Store.ledger.plan()` lists it (named fields)."""
        d: dict = {"unit_id": self.unit_id, "row_start": self.row_start, "row_end": self.row_end}
        if self.pieces:
            d["pieces"] = [list(p) for p in self.pieces]
        return d

    @classmethod
    def from_dict(cls, d) -> "Unit":
        """A unit a caller gave (tools, tests): a Unit, a dict of named fields or a triple."""
        if isinstance(d, Unit):
            return d
        if not isinstance(d, dict):
            unit_id, row_start, row_end = (int(x) for x in d)
            return cls(unit_id, row_start, row_end)
        try:
            return cls(int(d["unit_id"]), int(d["row_start"]), int(d["row_end"]),
                       tuple(tuple(p) for p in d.get("pieces") or ()))
        except KeyError as e:
            raise ValueError(f"unit {d!r} lacks field {e}; give unit_id, row_start, row_end") from None


@dataclass(frozen=True)
class Plan:
    """The plan as read: units in id order, whether it is final, the next segment's number, and
    (when asked for) the segments' opaque pipeline payloads in order."""

    units: list[Unit]
    final: bool
    next_seq: int
    payloads: list = field(default_factory=list)

    def rows(self) -> dict[int, tuple[int, int]]:
        """unit id -> its planned row range."""
        return {u.unit_id: u.rows for u in self.units}


# ---- shard record (an object table's entry) -----------------------------------------------------

@dataclass(frozen=True)
class MetaChunkRecord:
    """What a shard's record says of one row metadata column: its chunk (a unit's chunk when
    the store writes one per unit), stored size, CRC32C and the upload that publishes it."""

    chunk: "int | None" = None
    nbytes: "int | None" = None
    crc32c: "int | None" = None
    upload: "dict | None" = None


@dataclass(frozen=True)
class ShardRecord:
    """One shard of a committed unit: rows, and per point the rows' CRC32C, stored bytes, the
    stored object's CRC32C and the upload that publishes it; per metadata column its chunk."""

    index: int
    row_start: int
    row_end: int
    crc32c: "tuple | None" = None
    nbytes: "tuple | None" = None
    object_crc32c: "tuple | None" = None
    upload: "tuple | None" = None
    meta: Mapping[str, MetaChunkRecord] = field(default_factory=dict)
    doc: dict = field(default_factory=dict, repr=False, compare=False)

    def to_json(self) -> JsonObject:
        return self.doc

    @classmethod
    def from_json(cls, r, where: str, at: str, n_points: "int | None" = None) -> "ShardRecord":
        if not isinstance(r, dict):
            raise fail(where, at, "is not an object")
        w = where + " " + at
        idx = integer(r, "index", w)
        rs = integer(r, "row_start", w)
        re_ = integer(r, "row_end", w, lo=rs, hi=layout.CAPACITY_ROWS)
        sizes = {f: _sizes(r.get(f), where, f"{at}.{f}", n_points)
                 for f in ("crc32c", "nbytes", "object_crc32c")}
        up = r.get("upload")
        if up is not None and not (isinstance(up, list) and all(
                u is None or isinstance(u, dict) for u in up)):
            raise fail(where, f"{at}.upload", "is not a list of upload records")
        meta = r.get("meta")
        recs = {}
        if meta is not None:
            if not isinstance(meta, dict):
                raise fail(where, f"{at}.meta", "is not an object")
            for k, rec in meta.items():
                trust.meta_name(k, where, f"{at}.meta")
                if not isinstance(rec, dict):
                    raise fail(where, f"{at}.meta.{k}", "is not an object")
                for f in ("chunk", "nbytes", "crc32c"):
                    if rec.get(f) is not None:
                        integer(rec, f, f"{where} {at}.meta.{k}")
                mu = rec.get("upload")
                if mu is not None and not isinstance(mu, dict):
                    raise fail(where, f"{at}.meta.{k}.upload", "is not an upload record")
                recs[k] = MetaChunkRecord(rec.get("chunk"), rec.get("nbytes"), rec.get("crc32c"), mu)
        return cls(idx, rs, re_, sizes["crc32c"], sizes["nbytes"], sizes["object_crc32c"],
                   None if up is None else tuple(up), recs, r)

    @classmethod
    def list_from_json(cls, recs, where: str, n_points: "int | None" = None,
                       shard_ids: "Iterable[int] | None" = None, uid=None) -> "list[ShardRecord]":
        """A unit's records (an object table's `shards`, or a layout-2 marker's inline list),
        against the shards the unit spans when `shard_ids` is given."""
        if not isinstance(recs, list):
            raise fail(where, "shards", "is not a list")
        out = [cls.from_json(r, where, f"shards[{i}]", n_points) for i, r in enumerate(recs)]
        if shard_ids is not None and [r.index for r in out] != list(shard_ids):
            raise fail(where, "shards[].index", f"lists shards {[r.index for r in out][:5]}..., "
                       f"unit {uid} spans {list(shard_ids)[:5]}...")
        return out

    def at(self, values: "tuple | None", p: int):
        """Entry `p` of one of the per-point lists (None where the list is absent)."""
        return None if values is None else values[p]


# ---- commit marker ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TableRef:
    """What a marker holds of its unit's object table (layout 3): fixed size whatever the shard
    and point counts."""

    key: str
    sha256: str
    nbytes: int
    n_shards: int

    def to_json(self) -> JsonObject:
        return {"key": self.key, "sha256": self.sha256, "nbytes": self.nbytes,
                "n_shards": self.n_shards}

    @classmethod
    def from_json(cls, t, where: str, uid: int, attempt: str) -> "TableRef":
        if not isinstance(t, dict):
            raise fail(where, "table", "is not an object")
        want = layout.table_key(uid, attempt)
        if t.get("key") != want:
            raise fail(where, "table.key", f"is {show(t.get('key'))}, not {want!r} (the key its "
                       "unit and attempt imply)")
        if not isinstance(t.get("sha256"), str) or not trust.SHA256.match(t["sha256"]):
            raise fail(where, "table.sha256", "is not a sha256 digest")
        nbytes = integer(t, "nbytes", where + " table", lo=1)
        n_shards = integer(t, "n_shards", where + " table", lo=1)
        return cls(t["key"], t["sha256"], nbytes, n_shards)


@dataclass(frozen=True)
class StatsRef:
    """What a marker holds of its unit's statistics partials: the sidecar's key and sha256, and
    the rows counted (all, and kept)."""

    key: "str | None" = None
    sha256: "str | None" = None
    count: "int | None" = None
    kept: "int | None" = None

    def to_json(self) -> JsonObject:
        return {"key": self.key, "sha256": self.sha256, "count": self.count, "kept": self.kept}

    @classmethod
    def from_json(cls, s, where: str, uid: int, attempt) -> "StatsRef":
        if not isinstance(s, dict):
            raise fail(where, "stats", "is not an object")
        if s.get("key") is not None:
            want = layout.stats_key(uid, trust.attempt(attempt, where))
            if s.get("key") != want:
                raise fail(where, "stats.key", f"is {show(s.get('key'))}, not {want!r}")
        for f in ("count", "kept"):
            if s.get(f) is not None:
                integer(s, f, where + " stats")
        sha = s.get("sha256")
        if sha is not None and not (isinstance(sha, str) and trust.SHA256.match(sha)):
            raise fail(where, "stats.sha256", "is not a sha256 digest")
        return cls(s.get("key"), sha, s.get("count"), s.get("kept"))


@dataclass(frozen=True)
class Marker(_Rows):
    """A unit's commit marker (FORMAT.md "Work units and commits"): its rows, its attempt, where
    its per-shard records are (the object table, or inline up to layout 2), its statistics
    sidecar and metadata digests, and what its writer noted (timing, host, extra)."""

    unit_id: int
    row_start: int
    row_end: int
    attempt: "str | None" = None
    layout_version: "int | None" = None
    table: "TableRef | None" = None
    shards: "tuple[ShardRecord, ...] | None" = None      # layout 2: the records inline
    points: "tuple[str, ...] | None" = None               # layout 2: the points by name
    points_sha256: "str | None" = None                    # layout 3: a digest of the list
    stored_bytes: "tuple | None" = None                   # layout 3: stored bytes per point
    n_points: "int | None" = None                         # layout 3
    meta_crc32c: "Mapping[str, int] | None" = None        # row_meta.crc32c
    stats: "StatsRef | None" = None                       # the stats sidecar reference
    logical_bytes: "int | None" = None                    # `bytes`: rows x row_set_bytes
    committed_at: "str | None" = None
    seconds: "float | None" = None
    bytes_per_s: "float | None" = None
    host: "str | None" = None
    pid: "int | None" = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    doc: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> tuple[int, int, int]:
        """(unit id, row start, row end): what the marker's object name says."""
        return self.unit_id, self.row_start, self.row_end

    @property
    def key(self) -> str:
        return layout.commit_key(self.unit_id, self.row_start, self.row_end)

    @property
    def token(self) -> str:
        """The attempt as void and publish records name it."""
        return attempt_token(self.attempt)

    def shard_ids(self, shard_rows: int) -> range:
        """The shards the unit covers, from its row range alone (no table needed)."""
        return range(self.row_start // shard_rows, -(-self.row_end // shard_rows))

    def total_stored_bytes(self) -> "int | None":
        """Stored bytes of every point over the unit (None where no size was recorded)."""
        if self.stored_bytes is not None:
            return sum(x for x in self.stored_bytes if x is not None)
        if self.shards is not None:
            return sum(x for sh in self.shards for x in (sh.nbytes or ()) if x is not None)
        return None

    def lite(self) -> "Marker":
        """What a reader keeps of the marker: enough to find and check its shards (the table
        reference, or the inline records themselves: the same objects, no copy)."""
        return replace(self, points=None, stats=None, extra={}, doc={})

    def to_json(self) -> JsonObject:
        """The marker's JSON object, as stored."""
        return self.doc

    def encode(self) -> bytes:
        """The bytes a marker is stored as (and `marker_size` measures)."""
        return json.dumps(self.doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, m, where: str, name=None) -> "Marker":
        """A marker read from `where`, against the name it was listed under (`name`: (unit id,
        row start, row end) from the listing, or None for an index line whose name is its own):
        structure, ids, the attempt token, and the table reference's key and sizes."""
        if not isinstance(m, dict):
            raise fail(where, "(marker)", f"is a {type(m).__name__}, not a JSON object")
        uid, rs, re_ = _unit_rows(m, where)
        if name is not None and (uid, rs, re_) != tuple(name):
            raise fail(where, "unit_id/row_start/row_end",
                       f"say unit {uid} rows [{rs}, {re_}), the object's name says {tuple(name)}")
        att = m.get("attempt")
        if "attempt" in m or "table" in m:
            att = trust.attempt(att, where)
        t = m.get("table")
        table = None if t is None else TableRef.from_json(t, where, uid, att)
        s = m.get("stats")
        stats = None if s is None else StatsRef.from_json(s, where, uid, att)
        shards = m.get("shards")
        recs = None if shards is None else tuple(ShardRecord.list_from_json(shards, where))
        lv = m.get("layout_version")
        rm = m.get("row_meta")
        crcs = rm.get("crc32c") if isinstance(rm, dict) else None
        if crcs is not None and not isinstance(crcs, dict):
            raise fail(where, "row_meta.crc32c", "is not an object")
        points = m.get("points")
        return cls(uid, rs, re_, att, lv if isinstance(lv, int) else None, table, recs,
                   tuple(points) if isinstance(points, list) else None,
                   m.get("points_sha256"), _sizes(m.get("stored_bytes"), where, "stored_bytes", None),
                   m.get("n_points"), crcs, stats, m.get("bytes"),
                   m.get("committed_at"),
                   m.get("seconds"), m.get("bytes_per_s"), m.get("host"), m.get("pid"),
                   m.get("extra") if isinstance(m.get("extra"), dict) else {}, m)

    def check_for_store(self, where: str, shard_rows: int, n_points: int) -> "Marker":
        """What only the store's own layout tells: the table's shard count and size bound."""
        t = self.table
        if t is not None:
            n = len(self.shard_ids(shard_rows))
            if t.n_shards != n:
                raise fail(where, "table.n_shards", f"is {t.n_shards}, its rows span {n} shards")
            bound = trust.table_bound(n, n_points)
            if t.nbytes > bound:
                raise fail(where, "table.nbytes", f"is {t.nbytes}, above the {bound} bytes a "
                           f"table of {n} shards x {n_points} points may take")
        return self


# ---- publish record -----------------------------------------------------------------------------

@dataclass(frozen=True)
class PublishRecord:
    """Every object of a unit's attempt is at its zarr key at its recorded size (published.py)."""

    unit_id: int
    attempt: "str | None"
    objects: int
    published_at: str

    @property
    def key(self) -> str:
        return layout.published_key(self.unit_id, attempt_token(self.attempt))

    def to_json(self) -> JsonObject:
        return {"unit_id": self.unit_id, "attempt": self.attempt, "objects": self.objects,
                "published_at": self.published_at}

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, d, where: str) -> "PublishRecord":
        if not isinstance(d, dict):
            raise fail(where, "(record)", "is not a JSON object")
        uid = integer(d, "unit_id", where)
        att = d.get("attempt")
        if att is not None:
            trust.attempt(att, where)
        n = integer(d, "objects", where)
        if not isinstance(d.get("published_at"), str):
            raise fail(where, "published_at", "is not a time stamp")
        return cls(uid, att, n, d["published_at"])


# ---- lease record -------------------------------------------------------------------------------

DEFAULT_LEASE_SECONDS = 120.0   # the driver's default store.lease_seconds


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


@dataclass(frozen=True)
class LeaseRecord:
    """One generation of the driver's lease (FORMAT.md "The driver's lease"): who holds it
    (owner id, host, pid, boot and process start), for which run (name, identity), since when,
    its last heartbeat, how long it lasts unrefreshed, and whether it was released."""

    heartbeat: float
    owner: "str | None" = None
    host: "str | None" = None
    pid: "int | None" = None
    boot: "str | None" = None
    start: "str | None" = None
    name: "str | None" = None
    identity: Any = None
    acquired: "float | None" = None
    lease_seconds: "float | None" = None
    released: bool = False
    doc: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def ttl(self) -> float:
        return float(self.lease_seconds or DEFAULT_LEASE_SECONDS)

    def age(self) -> float:
        return time.time() - self.heartbeat

    def holder_gone(self) -> bool:
        """The holder ran on this machine (same boot) and that process is gone: a driver killed
        with SIGKILL (or OOM) does not make its restart wait out the lease."""
        me = process_id(os.getpid())
        if not me or self.host != socket.gethostname() or self.boot != me[0]:
            return False
        them = process_id(int(self.pid or 0))
        return them is None or them[1] != self.start

    def live(self, ttl: "float | None" = None) -> bool:
        ttl = self.ttl if ttl is None else ttl
        return not self.released and self.age() < ttl and not self.holder_gone()

    def to_json(self) -> JsonObject:
        return self.doc

    @classmethod
    def being_written(cls) -> "LeaseRecord":
        """A lease object that does not parse yet: a driver just took it, so it is fresh."""
        return cls(time.time())

    @classmethod
    def from_json(cls, d, where: str) -> "LeaseRecord":
        if not isinstance(d, dict):
            raise fail(where, "(lease)", "is not a JSON object")

        def num(f, default=None):
            v = d.get(f, default)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise fail(where, f, f"is {show(v)}, not a number")
            return v

        def text(f):
            v = d.get(f)
            if v is not None and not isinstance(v, str):
                raise fail(where, f, f"is {show(v)}, not a string")
            return v

        pid = d.get("pid")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int)):
            raise fail(where, "pid", f"is {show(pid)}, not a process id")
        return cls(float(num("heartbeat", 0)), text("owner"), text("host"), pid, text("boot"),
                   text("start"), text("name"), d.get("identity"), num("acquired"),
                   num("lease_seconds"), bool(d.get("released")), d)


def read_lease(loc) -> "tuple[int, LeaseRecord] | None":
    """(generation, record) of the store's newest lease, or None when it has none."""
    gens = sorted((g for g in (layout.lease_generation(n) for n in loc.list_dir(layout.LEASE_DIR))
                   if g is not None), reverse=True)
    for gen in gens:
        key = layout.lease_key(gen)
        data = loc.read_bytes(key)
        if data is None:
            continue
        try:
            body = json.loads(data)
        except ValueError:   # being written: a driver just took it, so it is fresh
            return gen, LeaseRecord.being_written()
        return gen, LeaseRecord.from_json(body, key)
    return None


# ---- upload handle ------------------------------------------------------------------------------

@dataclass
class UploadHandle:
    """An object being streamed in parts (Storage.begin_object ... finish_object): where it
    goes (`rel`), and what its backend holds while it is written: an open file (and its temp
    name) for backends that write a file, or the multipart upload's bucket, key, id and the
    parts' ETags so far. Live state, never stored: the record a commit keeps of it is what
    `finish_object` returns. Not frozen: the file is handed back on finish and ETags grow."""

    rel: str
    file: Any = None
    tmp: "str | None" = None
    bucket: "str | None" = None
    key: "str | None" = None
    upload_id: "str | None" = None
    etags: list = field(default_factory=list)

    def take_file(self):
        """The open file, once (finish and abort close it; a second call gets None)."""
        f, self.file = self.file, None
        return f


__all__ = ["attempt_token", "Unit", "Plan", "MetaChunkRecord", "ShardRecord", "TableRef", "StatsRef",
           "Marker", "PublishRecord", "DEFAULT_LEASE_SECONDS", "process_id", "LeaseRecord",
           "read_lease", "UploadHandle"]
