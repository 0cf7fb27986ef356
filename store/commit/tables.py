"""Per-unit object tables (layout version 3): the one accessor for a unit's per-shard records.

Up to layout version 2 a commit marker carried one record per shard (`index`, `row_start`,
`row_end`, and per point `crc32c`, `nbytes`, `object_crc32c`, plus `meta`): ~35 B per shard x
point, 574 KB per marker for an 8B-shape unit (512 shards x 32 points), copied into the index and
parsed by every reader, status, verify and finalize: ~10 GB parsed per reader process at 1 B
tokens. From version 3 the writer puts those records in `_harvest/tables/unit-<id>.<attempt>
.json.gz` (gzip'ed JSON, written before the marker, like the stats sidecar) and the marker keeps a
fixed-size reference `table: {key, sha256, nbytes, n_shards}`. Which shards a unit covers is
derivable from its row range and `shard_rows`, so listing pieces, resume, status and default
verify never read a table; only what touches a shard's bytes does (reads, deep/objects verify,
publish), and then one unit's table at a time.

`unit_shards(store, marker)` is the only way to get the records (records.ShardRecord): from the marker for version-2
markers, else from the table, read with the storage's retries, checked against the marker's
sha256 and shard list (a missing or damaged table is a DataIntegrityError naming the unit and the
repair, never an empty list), and kept in a small per-store LRU (TABLE_CACHE tables: a reader
walks units in shuffled order, so holding every table it touched is the 10 GB again). Records are
passed through as the writer gave them: keys a writer adds (upload ids, per-block CRCs) travel in
the table untouched.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import threading
from collections import OrderedDict

from ..errors import DataIntegrityError
from . import trust
from .records import Marker, ShardRecord, TableRef

# Tables one Store object keeps parsed. A 512-shard x 32-point table is ~2 MB parsed; a reader's
# threads work on a few units at once (a window's pieces), and a miss costs one GET of ~200 KB.
TABLE_CACHE = 16

_FIELDS = ("index", "row_start", "row_end", "crc32c", "nbytes", "object_crc32c", "meta")


def records(shards: list) -> list[dict]:
    """The writer's per-shard entries as dicts: a tuple in the order of `_FIELDS` (the writer's
    call shape since version 2) becomes today's dict; a dict passes through unchanged, with any
    extra keys its writer put in it."""
    return [sh if isinstance(sh, dict) else dict(zip(_FIELDS, sh)) for sh in shards]


def encode(unit_id: int, attempt: str, recs: list[dict]) -> bytes:
    """A table's stored bytes. gzip with mtime 0, so the same records give the same bytes (and
    sha256) on every host. Level 1, like the index: at 512 shards x 32 points (604 KB of JSON) it
    gives 273 KB in 9 ms, level 6 254 KB in 56 ms (measured); the CRCs are incompressible."""
    body = {"unit_id": int(unit_id), "attempt": attempt, "shards": recs}
    return gzip.compress(json.dumps(body, separators=(",", ":")).encode(), 1, mtime=0)


def ref(key: str, blob: bytes, n_shards: int) -> TableRef:
    """What the marker holds of its table: fixed size whatever the shard and point counts."""
    return TableRef(key, hashlib.sha256(blob).hexdigest(), len(blob), int(n_shards))


def shard_ids(shard_rows: int, marker: Marker) -> range:
    """The shards a unit covers, from its row range alone (no table needed)."""
    return marker.shard_ids(shard_rows)


def _repair(uid) -> str:
    return (f"run `harvest verify --deep`; to repair, store.uncommit({uid}) and run the harvest "
            "again (it rewrites that unit)")


class TableCache:
    """A bounded LRU of parsed tables keyed by (unit, attempt, sha256); thread-safe. Two threads
    missing the same table both read it (rare, harmless): no lock is held across a GET."""

    def __init__(self, size: int = TABLE_CACHE):
        self.size = size
        self._d: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0   # tables read from storage (tests and benchmarks count them)

    @staticmethod
    def _key(m: Marker):
        return m.unit_id, m.attempt, None if m.table is None else m.table.sha256

    def get(self, m: Marker) -> "list[ShardRecord] | None":
        k = self._key(m)
        with self._lock:
            got = self._d.get(k)
            if got is not None:
                self._d.move_to_end(k)
            return got

    def put(self, m: Marker, recs: list[ShardRecord]) -> None:
        k = self._key(m)
        with self._lock:
            self._d[k] = recs
            self._d.move_to_end(k)
            while len(self._d) > self.size:
                self._d.popitem(last=False)


def _cache(store) -> TableCache:
    return store.ledger.table_cache


def load(store, m: Marker) -> list[ShardRecord]:
    """Read, check and parse a unit's table (no cache). Untrusted (trust.py): the marker's table
    reference is checked against the store's layout first, the read stops past the size the
    marker records, decompression stops at what the layout allows, and every record is checked
    before it is used."""
    uid, t = m.unit_id, m.table
    if t is None:
        raise DataIntegrityError(f"unit {uid}: its commit marker names neither shards nor an object "
                                 f"table (a hand-edited or truncated marker); {_repair(uid)}")
    key = t.key
    m.check_for_store(m.key, store.shard_rows, len(store.points))
    blob = store.location.read_range(key, 0, t.nbytes + 1)
    if blob is None:
        raise DataIntegrityError(f"unit {uid}: its object table {key} is missing (deleted?): the "
                                 f"store is damaged; {_repair(uid)}")
    if len(blob) != t.nbytes or hashlib.sha256(blob).hexdigest() != t.sha256:
        raise DataIntegrityError(f"unit {uid}: its object table {key} differs from what its writer "
                                 f"committed (overwritten or corrupt); {_repair(uid)}")
    want = list(m.shard_ids(store.shard_rows))
    try:
        body = json.loads(trust.gunzip(blob, trust.table_bound(len(want), len(store.points)), key))
        recs = body["shards"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataIntegrityError(f"unit {uid}: its object table {key} cannot be parsed "
                                 f"({type(e).__name__}); {_repair(uid)}") from None
    out = ShardRecord.list_from_json(recs, key, len(store.points))
    got = [r.index for r in out]
    if body.get("unit_id") != uid or body.get("attempt") != m.attempt or got != want:
        raise DataIntegrityError(
            f"unit {uid}: its object table {key} describes unit {body.get('unit_id')} attempt "
            f"{body.get('attempt')} shards {got[:5]}..., the marker says attempt {m.attempt} "
            f"shards {want[:5]}...; {_repair(uid)}")
    return out


def unit_shards(store, m: Marker) -> list[ShardRecord]:
    """A committed unit's per-shard records (see the module docstring)."""
    if m.shards is not None:   # layout version 2: inline, checked with the marker
        n = len(store.points)   # and here against the store's points (the marker cannot tell)
        if any(v is not None and len(v) != n for sh in m.shards
               for v in (sh.crc32c, sh.nbytes, sh.object_crc32c)):
            return ShardRecord.list_from_json([sh.doc for sh in m.shards], m.key, n)
        return list(m.shards)
    c = _cache(store)
    recs = c.get(m)
    if recs is None:
        recs = load(store, m)
        c.loads += 1
        c.put(m, recs)
    return recs


def shard_record(store, m: Marker, shard: int) -> ShardRecord:
    """The record of one shard of a committed unit."""
    recs = unit_shards(store, m)
    i = int(shard) - recs[0].index if recs else -1
    if 0 <= i < len(recs) and recs[i].index == shard:
        return recs[i]
    for r in recs:  # a v2 marker need not be in order
        if r.index == shard:
            return r
    raise DataIntegrityError(f"unit {m.unit_id}: shard {shard} is not among its records; "
                             f"{_repair(m.unit_id)}")


def remember(store, m: Marker, recs: list[dict]) -> None:
    """The writer's own records: publishing right after the commit needs no GET of the table."""
    if m.shards is None and m.table is not None:
        _cache(store).put(m, ShardRecord.list_from_json(recs, m.table.key, len(store.points)))


__all__ = ["TABLE_CACHE", "TableCache", "records", "encode", "ref", "shard_ids", "load",
           "unit_shards", "shard_record", "remember"]
