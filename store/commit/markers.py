"""Commit markers and their compacted index: what makes a row data, and how to find out cheaply.

A unit is committed when its marker `_harvest/commits/unit-<id>.<row_start>-<row_end>.json`
exists. The marker's name carries the row range, so the questions a resume asks (which units are
done, does each marker agree with the plan) are answered by one listing, without a GET per marker.
Marker *contents* (the object table's reference, stats sidecar, metadata digests, timings; in
layout version 2 the per-shard CRCs and sizes themselves, see tables.py) are needed
by status, verify, finalize and the reader; reading 10^5 markers one GET each is what made them
slow, so the driver copies markers into immutable index segments (`_harvest/index/idx-<seq>`,
gzip'ed JSON lines) as units commit. An index entry is trusted only while the listing still shows
its marker under the same name and no void record names its (unit, attempt); markers not yet
indexed are read directly. The index is a cache: deleting it loses nothing.

Void records exist because a marker's name is the unit's, not the attempt's: after
`uncommit(unit)` and a rewrite, the listing shows the new marker under the old name, and the old
index entry (other attempt, other digests) would be taken for it, so every read would check the
new bytes against the old digests and finalize would settle the old attempt as the owner, deleting
the new attempt's objects. `uncommit` therefore first writes
`_harvest/index/void-<unit>.<attempt>.json` for every attempt of that unit it finds in the marker
and the index. Readers get them from the listing of `_harvest/index/` they make anyway: no
request per unit, none at all while nothing was uncommitted.

The writer (writer.py) builds and creates markers here; the store (store.py) reads them here, so
neither imports the other.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import socket
import zlib
from typing import Iterable, Iterator

from ..format import layout
from . import tables as _tables
from . import trust
from .records import Marker, TableRef
from ..storage.locate import Location

log = logging.getLogger(__name__)


class MarkerName(tuple):
    """(unit_id, row_start, row_end) parsed from a marker's object name."""

    __slots__ = ()

    def __new__(cls, uid: int, rs: int, re_: int):
        return super().__new__(cls, (int(uid), int(rs), int(re_)))

    @property
    def unit_id(self) -> int:
        return self[0]

    @property
    def rows(self) -> tuple[int, int]:
        return self[1], self[2]


def list_markers(loc: Location) -> list[MarkerName]:
    """Every marker now present, from one listing, sorted by unit id then row range. A marker's
    name is a record too: a row range its layout cannot hold is refused (trust.py)."""
    out = []
    for name in loc.list_dir(layout.COMMITS_DIR):
        p = layout.parse_marker_name(name)
        if p is not None:
            if not p[1] < p[2] <= layout.CAPACITY_ROWS:
                raise trust.fail(f"{layout.COMMITS_DIR}/{name}", "row_end",
                                 f"(in the name) makes rows [{p[1]}, {p[2]}), not a range of at "
                                 f"most {layout.CAPACITY_ROWS} rows")
            out.append(MarkerName(*p))
    out.sort()
    return out


def read_marker(loc: Location, name: MarkerName, fresh: bool = False) -> Marker | None:
    key = layout.commit_key(*name)
    if fresh:
        loc.invalidate(key)
    raw = loc.read_bytes(key)
    if raw is None:
        return None
    try:
        m = json.loads(raw)
    except ValueError:
        log.warning("commit marker %s is not valid JSON; ignored", key)
        return None
    return Marker.from_json(m, key, name)


def read_markers(loc: Location, names: list[MarkerName]) -> dict[MarkerName, Marker]:
    """Many markers at once (one batched request on object stores)."""
    if not names:
        return {}
    paths = [loc.key(layout.commit_key(*n)) for n in names]
    blobs = loc.read_many(paths, "read markers")
    out = {}
    for n, p in zip(names, paths):
        b = blobs.get(p)
        if b is not None:
            try:
                m = json.loads(b)
            except ValueError:
                log.warning("commit marker of unit %d is not valid JSON; ignored", n.unit_id)
                continue
            out[n] = Marker.from_json(m, layout.commit_key(*n), n)
    return out


def points_digest(points) -> str:
    """How a version-3 marker names its points: a fixed-size digest of the list (80 layers x a
    few kinds of point names would otherwise be most of the marker)."""
    return hashlib.sha256(json.dumps(list(points), separators=(",", ":")).encode()).hexdigest()


def _stored_by_point(recs: list[dict], n_points: int) -> "list[int | None]":
    """Stored bytes per point over a unit's shards; None for a point where a size is missing."""
    out: list = [0] * n_points
    for r in recs:
        nb = r.get("nbytes") or [None] * n_points
        for p in range(n_points):
            out[p] = None if out[p] is None or nb[p] is None else out[p] + int(nb[p])
    return out


def build_marker(store, unit_id: int, row_start: int, row_end: int, attempt: str, shards: list,
                 meta_crc32c: dict, stats: dict, seconds: float, extra: dict,
                 table: TableRef | None = None) -> Marker:
    """The marker (FORMAT.md, "Work units and commits"); `shards`: per shard (index, row_start,
    row_end, crc32c of the rows per point, stored bytes per point, CRC32C of the stored object per
    point, {column: {crc32c, nbytes}} of its metadata chunks), as a tuple or a dict (tables.records).

    In the store's own layout version: version 2 carries the records inline (`points`, `shards`);
    version 3 a fixed-size reference to the unit's object table (`table`, made by `prepare`) and
    the stored bytes per point (finalize and the report sum these instead of every shard's)."""
    recs = _tables.records(shards)
    nbytes = (row_end - row_start) * store.row_set_bytes
    m = {"layout_version": store.layout_version, "unit_id": unit_id,
         "row_start": row_start, "row_end": row_end, "n_rows": row_end - row_start}
    if store.layout_version < 3:
        m.update({"points": list(store.points), "attempt": attempt, "shards": recs})
    else:
        if table is None:
            raise ValueError("build_marker: a layout-3 marker needs its table reference "
                             "(commits.prepare writes both)")
        m.update({"n_points": len(store.points), "points_sha256": points_digest(store.points),
                  "attempt": attempt, "table": table.to_json(),
                  "stored_bytes": _stored_by_point(recs, len(store.points))})
    m.update({
        "row_meta": {"crc32c": meta_crc32c},
        "stats": stats,
        "bytes": nbytes, "seconds": round(seconds, 6),
        "bytes_per_s": nbytes / seconds if seconds > 0 else None,
        "committed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "pid": os.getpid(), "extra": extra or {},
    })
    return Marker.from_json(m, layout.commit_key(unit_id, row_start, row_end))


class Prepared(tuple):
    """(marker, table key, table bytes, records): what a writer stores to commit a unit. The
    table (None for a version-2 store) goes before the marker, like the stats sidecar."""

    __slots__ = ()

    marker = property(lambda self: self[0])
    table_key = property(lambda self: self[1])
    table_blob = property(lambda self: self[2])
    records = property(lambda self: self[3])


def prepare(store, unit_id: int, row_start: int, row_end: int, attempt: str, shards: list,
            meta_crc32c: dict, stats: dict, seconds: float, extra: dict) -> Prepared:
    """`build_marker` plus, from layout version 3, the unit's object table it refers to."""
    recs = _tables.records(shards)
    if store.layout_version < 3:
        m = build_marker(store, unit_id, row_start, row_end, attempt, recs, meta_crc32c, stats,
                         seconds, extra)
        return Prepared((m, None, None, recs))
    key = layout.table_key(unit_id, attempt)
    blob = _tables.encode(unit_id, attempt, recs)
    m = build_marker(store, unit_id, row_start, row_end, attempt, recs, meta_crc32c, stats,
                     seconds, extra, table=_tables.ref(key, blob, len(recs)))
    return Prepared((m, key, blob, recs))


def create_marker(loc: Location, marker: Marker) -> bool:
    """Create-once; True if this call created it."""
    return loc.create_once(marker.key, marker.encode())


def delete_marker(loc: Location, name: MarkerName) -> None:
    loc.delete(layout.commit_key(*name))


# ---- index ------------------------------------------------------------------------------------

def _index_listing(loc: Location) -> tuple[list[int], set[tuple[int, str]]]:
    """(sequence numbers of the index segments, voided (unit id, attempt token)): one listing."""
    seqs, voids = [], set()
    for name in loc.list_dir(layout.INDEX_DIR):
        if name.startswith("idx-") and name.endswith(".jsonl.gz"):
            try:
                seqs.append(int(name[4:-9]))
            except ValueError:
                pass
        else:
            v = layout.parse_void_name(name)
            if v is not None:
                voids.add(v)
    return sorted(seqs), voids


def _index_seqs(loc: Location) -> list[int]:
    return _index_listing(loc)[0]


INDEX_MIN = 256    # markers per index segment, at least...
INDEX_MAX = 2048   # ...and at most


def index_batch(indexed: int) -> int:
    """How many new markers a running driver gathers before its next index segment, with
    `indexed` already in the index. A tenth of the index (geometric) keeps segments few, but left
    up to a tenth of the units unindexed while a run goes on or after it crashed, each read with
    its own GET by status, verify and the reader: 10^4 GETs at 10^5 units, 150 s of `harvest
    status` on SeaweedFS. The cap bounds that to 2,048 GETs; segments then grow linearly (50 at
    10^5 units, 500 at 10^6, one GET each) until finalize compacts them into one."""
    return max(INDEX_MIN, min(INDEX_MAX, indexed // 10))


class IndexBuilder:
    """Markers compressed as they are added: an index of 10^5 markers is built in the memory of
    its compressed bytes, not of 10^5 JSON texts."""

    def __init__(self):
        self._z = zlib.compressobj(1, zlib.DEFLATED, 31)  # wbits 31: gzip framing
        self._parts: list[bytes] = []
        self.count = 0

    def add(self, marker: "Marker | dict") -> None:
        """One marker: a record, or its JSON as it crossed from an actor (UnitResult.marker)."""
        doc = marker.to_json() if isinstance(marker, Marker) else marker
        line = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
        self._parts.append(self._z.compress(line))
        self.count += 1

    def blob(self) -> bytes:
        return b"".join(self._parts) + self._z.flush()


def write_index_segment(loc: Location, markers: "Iterable[Marker | dict] | IndexBuilder") -> int:
    """Append one immutable index segment holding `markers`; returns its sequence number."""
    if not isinstance(markers, IndexBuilder):
        b = IndexBuilder()
        for m in markers:
            b.add(m)
        markers = b
    blob = markers.blob()
    seqs = _index_seqs(loc)
    seq = (seqs[-1] + 1) if seqs else 0
    while not loc.create_once(layout.index_key(seq), blob):
        seq += 1  # another driver appended first: indexes are unions, any free number will do
    return seq


# An index line is one marker: ~1-2 KB from layout 3, a layout-2 marker with its shard records
# inline up to ~600 KB at an 8B model's shape; a line past this is refused, never held.
INDEX_LINE_MAX = 16 << 20


def _read_index(loc: Location, seqs: list[int] | None = None,
                max_lines: "int | None" = None) -> Iterator[Marker]:
    """The index's markers, each checked (Marker.from_json), decompressed a line at a time; at most
    `max_lines` lines per segment (default: the markers the store lists, plus slack)."""
    seqs = _index_seqs(loc) if seqs is None else seqs
    if not seqs:
        return
    if max_lines is None:
        max_lines = len(loc.list_dir(layout.COMMITS_DIR)) + trust.INDEX_SLACK_LINES
    keys = [layout.index_key(s) for s in seqs]
    for key in keys:
        raw = loc.read_bytes(key)
        if raw is None:
            continue
        lines = trust.gzip_lines(raw, INDEX_LINE_MAX, max_lines, key)
        while True:
            try:
                line = next(lines, None)
            except trust.CorruptGzip:
                # a damaged segment is a cache miss: what it did not give is read directly
                log.warning("index segment %s is corrupt; its markers are read directly", key)
                break
            if line is None:
                break
            try:
                m = json.loads(line)
            except ValueError:
                raise trust.fail(key, "(line)", "is not JSON") from None
            yield Marker.from_json(m, key)


def compact_index(loc: Location, markers: "Iterable[Marker] | IndexBuilder") -> None:
    """Replace every index segment by one holding `markers` (finalize): later reads are one GET."""
    old = _index_seqs(loc)
    write_index_segment(loc, markers)
    for s in old:
        loc.delete(layout.index_key(s))


def iter_committed(loc: Location, names: list[MarkerName] | None = None) -> Iterator[Marker]:
    """Contents of every marker now present: from the index where an entry agrees with the
    listing and is not voided, read directly otherwise. Streams (memory: the listing plus one
    marker at a time, plus the markers not yet indexed). Order: index order, then unit id."""
    names = list_markers(loc) if names is None else names
    present = set(names)
    seen: set = set()
    seqs, voids = _index_listing(loc)
    for m in _read_index(loc, seqs, max_lines=len(names) + trust.INDEX_SLACK_LINES):
        n = MarkerName(*m.name)
        if n in present and n not in seen and (not voids or (n.unit_id, m.token) not in voids):
            seen.add(n)
            yield m
    rest = [n for n in names if n not in seen]
    for i in range(0, len(rest), 1024):
        batch = rest[i:i + 1024]
        got = read_markers(loc, batch)
        for n in batch:
            if n in got:
                yield got[n]


def uncommit(loc: Location, unit_id: int) -> list[MarkerName]:
    """Delete a unit's markers (driver repair), voiding first every index entry of the unit: of
    the attempt its marker names, and of any other attempt the index holds for it (two writers
    that both believed they committed, on a server without conditional PUTs, each had their copy
    indexed). Voids come first, so a crash in between leaves a marker read directly, never a
    stale entry trusted. Returns the markers deleted.

    Reads the whole index (a repair, not a hot path: one GET per segment, one after finalize).
    """
    uid = int(unit_id)
    names = [n for n in list_markers(loc) if n.unit_id == uid]
    attempts = set()
    for n in names:
        m = read_marker(loc, n, fresh=True)
        if m is not None:
            attempts.add(m.token)
    for m in _read_index(loc):
        if m.unit_id == uid:
            attempts.add(m.token)
    for a in sorted(attempts):
        body = {"unit_id": uid, "attempt": a,
                "voided_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        loc.create_once(layout.void_key(uid, a), json.dumps(body, separators=(",", ":")).encode())
    for n in names:
        delete_marker(loc, n)
    return names


__all__ = ["MarkerName", "list_markers", "read_marker", "read_markers", "create_marker",
           "delete_marker", "uncommit", "build_marker", "prepare", "Prepared",
           "points_digest", "IndexBuilder", "index_batch", "write_index_segment", "compact_index",
           "iter_committed"]
