"""Commit markers and their compacted index: what makes a row data, and how to find out cheaply.

A unit is committed when its marker `_harvest/commits/unit-<id>.<row_start>-<row_end>.json`
exists. The marker's name carries the row range, so the questions a resume asks (which units are
done, does each marker agree with the plan) are answered by one listing, without a GET per marker.
Marker *contents* (per-shard CRCs and sizes, stats sidecar, metadata digests, timings) are needed
by status, verify, finalize and the reader; reading 10^5 markers one GET each is what made them
slow, so the driver copies markers into immutable index segments (`_harvest/index/idx-<seq>`,
gzip'ed JSON lines) as units commit. An index entry is trusted only while the listing still shows
its marker under the same name; markers not yet indexed are read directly. The index is a cache:
deleting it loses nothing.

The writer (writer.py) builds and creates markers here; the store (store.py) reads them here, so
neither imports the other.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import json
import logging
import os
import socket
import zlib
from typing import Iterable, Iterator

from . import layout
from .backend import Location

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
    """Every marker now present, from one listing, sorted by unit id then row range."""
    out = []
    for name in loc.list_dir(layout.COMMITS_DIR):
        p = layout.parse_marker_name(name)
        if p is not None:
            out.append(MarkerName(*p))
    out.sort()
    return out


def read_marker(loc: Location, name: MarkerName, fresh: bool = False) -> dict | None:
    key = layout.commit_key(*name)
    if fresh and not loc.is_local:
        loc.fs.invalidate_cache(loc.key(key))
    raw = loc.read_bytes(key)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        log.warning("commit marker %s is not valid JSON; ignored", key)
        return None


def read_markers(loc: Location, names: list[MarkerName]) -> dict[MarkerName, dict]:
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
                out[n] = json.loads(b)
            except ValueError:
                log.warning("commit marker of unit %d is not valid JSON; ignored", n.unit_id)
    return out


def build_marker(store, unit_id: int, row_start: int, row_end: int, attempt: str, shards: list,
                 meta_crc32c: dict, stats: dict, seconds: float, extra: dict) -> dict:
    """The marker (FORMAT.md, "Work units and commits"); `shards`: (index, row_start, row_end,
    crc32c of the rows per point, stored bytes per point, CRC32C of the stored object per point,
    {column: {crc32c, nbytes}} of its metadata chunks)."""
    nbytes = (row_end - row_start) * len(store.points) * store.row_bytes
    return {
        "layout_version": store.layout_version, "unit_id": unit_id,
        "row_start": row_start, "row_end": row_end, "n_rows": row_end - row_start,
        "points": list(store.points), "attempt": attempt,
        "shards": [{"index": i, "row_start": a, "row_end": b, "crc32c": crc, "nbytes": nb,
                    "object_crc32c": ocrc, "meta": meta}
                   for i, a, b, crc, nb, ocrc, meta in shards],
        "row_meta": {"crc32c": meta_crc32c},
        "stats": stats,
        "bytes": nbytes, "seconds": round(seconds, 6),
        "bytes_per_s": nbytes / seconds if seconds > 0 else None,
        "committed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "pid": os.getpid(), "extra": extra or {},
    }


def create_marker(loc: Location, marker: dict) -> bool:
    """Create-once; True if this call created it."""
    key = layout.commit_key(marker["unit_id"], marker["row_start"], marker["row_end"])
    return loc.create_once(key, json.dumps(marker, separators=(",", ":")).encode())


def delete_marker(loc: Location, name: MarkerName) -> None:
    loc.delete(layout.commit_key(*name))


# ---- index ------------------------------------------------------------------------------------

def _index_seqs(loc: Location) -> list[int]:
    out = []
    for name in loc.list_dir(layout.INDEX_DIR):
        if name.startswith("idx-") and name.endswith(".jsonl.gz"):
            try:
                out.append(int(name[4:-9]))
            except ValueError:
                pass
    return sorted(out)


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

    def add(self, marker: dict) -> None:
        line = json.dumps(marker, separators=(",", ":")).encode() + b"\n"
        self._parts.append(self._z.compress(line))
        self.count += 1

    def blob(self) -> bytes:
        return b"".join(self._parts) + self._z.flush()


def write_index_segment(loc: Location, markers: "Iterable[dict] | IndexBuilder") -> int:
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


def _read_index(loc: Location) -> Iterator[dict]:
    seqs = _index_seqs(loc)
    if not seqs:
        return
    keys = [layout.index_key(s) for s in seqs]
    for key in keys:
        raw = loc.read_bytes(key)
        if raw is None:
            continue
        try:
            text = gzip.decompress(raw)
        except OSError:
            log.warning("index segment %s is corrupt; its markers are read directly", key)
            continue
        for line in text.split(b"\n"):
            if line:
                yield json.loads(line)


def compact_index(loc: Location, markers: "Iterable[dict] | IndexBuilder") -> None:
    """Replace every index segment by one holding `markers` (finalize): later reads are one GET."""
    old = _index_seqs(loc)
    write_index_segment(loc, markers)
    for s in old:
        loc.delete(layout.index_key(s))


def iter_committed(loc: Location, names: list[MarkerName] | None = None) -> Iterator[dict]:
    """Contents of every marker now present: from the index where it agrees with the listing,
    read directly otherwise. Streams (memory: the listing plus one marker at a time, plus the
    markers not yet indexed). Order: index order, then unit id."""
    names = list_markers(loc) if names is None else names
    present = set(names)
    seen: set = set()
    for m in _read_index(loc):
        n = MarkerName(m["unit_id"], m["row_start"], m["row_end"])
        if n in present and n not in seen:
            seen.add(n)
            yield m
    rest = [n for n in names if n not in seen]
    for i in range(0, len(rest), 1024):
        batch = rest[i:i + 1024]
        got = read_markers(loc, batch)
        for n in batch:
            if n in got:
                yield got[n]


__all__ = ["MarkerName", "list_markers", "read_marker", "read_markers", "create_marker",
           "delete_marker", "build_marker", "IndexBuilder", "index_batch", "write_index_segment", "compact_index", "iter_committed"]
