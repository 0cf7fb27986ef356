"""Committed objects: where each one lives, reading it back checked, and publishing it.

A writer puts every shard object and metadata chunk it writes under its attempt's own name
(`_harvest/objects/<array>/<shard>.<attempt>`), and only once its commit marker exists moves them
to their zarr keys ("publishing"). So a late writer of the same unit (a retried task whose first
run is still alive) never lands bytes on an object a marker vouches for: its objects stay under
its own attempt name and are garbage.

Readers and verify trust nothing they have not checked against the marker: each object's
CRC32C (of its stored bytes, recorded by the writer before the marker was created) is compared
before decoding. The published copy is read first; where it is missing or fails its digest (a
crash between the marker and the move, or a stale object of an earlier attempt), the attempt's
copy is. Neither intact is a DataIntegrityError naming the unit and the repair, never zeros.

Markers written before object digests existed carry only the CRC32C of the decoded rows; those
are checked after decoding instead (a copy when the rows are strided), which is slower, not weaker.
"""

from __future__ import annotations

import logging

import google_crc32c
import numpy as np

from . import layout
from .errors import DataIntegrityError
from .stats import crc32c
from .tables import shard_record, unit_shards

log = logging.getLogger(__name__)


def point_keys(point: str, shard: int, attempt: str | None) -> list[str]:
    """Published key first, then the attempt's own."""
    keys = [layout.shard_object_key(point, shard)]
    if attempt:
        keys.append(layout.attempt_object_key(layout.point_path(point), shard, attempt))
    return keys


def meta_keys(name: str, shard: int, attempt: str | None) -> list[str]:
    keys = [layout.meta_chunk_key(name, shard)]
    if attempt:
        keys.append(layout.attempt_object_key(name, shard, attempt))
    return keys


def _repair(m: dict) -> str:
    return (f"run `harvest verify --deep`; to repair, store.uncommit({m.get('unit_id')}) and run the "
            "harvest again (it rewrites that unit)")


def read_checked(loc, keys: list[str], want_crc: int | None, want_size: int | None, what: str,
                 marker: dict) -> bytes:
    """The first copy at `keys` whose size and CRC32C match the marker's record."""
    tried = []
    for k in keys:
        try:
            blob = loc.read_bytes(k)
        except Exception as e:  # noqa: BLE001 -- reported with the key, never as zeros
            tried.append(f"{k}: cannot be read ({type(e).__name__})")
            continue
        if blob is None:
            tried.append(f"{k}: missing")
        elif want_size is not None and len(blob) != want_size:
            tried.append(f"{k}: {len(blob)} bytes, its writer stored {want_size}")
        elif want_crc is not None and google_crc32c.value(blob) != want_crc:
            tried.append(f"{k}: CRC32C differs from the marker's")
        else:
            return blob
    raise DataIntegrityError(f"{what} of unit {marker.get('unit_id')} has no intact copy ("
                             + "; ".join(tried) + f"): the store is damaged; {_repair(marker)}")


def read_point(store, marker: dict, sh: dict, p: int, out: np.ndarray | None = None,
               rows: int | None = None) -> np.ndarray:
    """Rows [sh.row_start, sh.row_end) of point index `p`, checked; into `out` when given.
    `sh`: the shard's record, or its index (the record then comes from the unit's table)."""
    if not isinstance(sh, dict):
        sh = shard_record(store, marker, int(sh))
    point = store.points[p]
    codec = store.shard_codec(point)
    n = sh["row_end"] - sh["row_start"] if rows is None else rows
    what = f"shard {sh['index']} of {point}"
    if codec is None:
        raise DataIntegrityError(f"{what}: the array's codec chain is not one harvest reads checked")
    ocrc = (sh.get("object_crc32c") or [None] * (p + 1))[p]
    size = (sh.get("nbytes") or [None] * (p + 1))[p]
    keys = point_keys(point, sh["index"], marker.get("attempt"))
    if ocrc is None:  # legacy marker: the published object only, checked after decoding
        keys = keys[:1]
    blob = read_checked(store.location, keys, ocrc, size, what, marker)
    try:
        x = codec.decode(blob, sh["index"], out=out, rows=n)
    except Exception as e:  # noqa: BLE001 -- a digest-checked object that cannot decode is damage
        raise DataIntegrityError(f"{what} of unit {marker.get('unit_id')} cannot be decoded "
                                 f"({type(e).__name__}: {e}); {_repair(marker)}") from None
    if ocrc is None and sh.get("crc32c") is not None:
        if crc32c(x) != sh["crc32c"][p]:
            raise DataIntegrityError(f"{what} of unit {marker.get('unit_id')}: rows differ from what "
                                     f"its writer committed; {_repair(marker)}")
    return x


def read_meta(store, marker: dict, sh: dict, name: str) -> np.ndarray:
    """Column `name` of rows [sh.row_start, sh.row_end), checked against the marker (`sh`: the
    shard's record or its index, as in read_point)."""
    if not isinstance(sh, dict):
        sh = shard_record(store, marker, int(sh))
    rec = (sh.get("meta") or {}).get(name)
    a, b = sh["row_start"], sh["row_end"]
    what = f"row metadata {name} of shard {sh['index']}"
    if rec is None:  # legacy marker: through zarr, checked by the unit's digest when whole
        col = np.asarray(store._meta_array(name)[a:b])
        want = ((marker.get("row_meta") or {}).get("crc32c") or {}).get(name)
        if want is not None and (a, b) == (marker["row_start"], marker["row_end"]) and \
                crc32c(col) != want:
            raise DataIntegrityError(f"{what} of unit {marker.get('unit_id')} differs from what its "
                                     f"writer committed; {_repair(marker)}")
        return col
    blob = read_checked(store.location, meta_keys(name, sh["index"], marker.get("attempt")),
                        rec.get("crc32c"), rec.get("nbytes"), what, marker)
    codec = store.meta_codec(name)
    try:
        return codec.decode(blob, b - a)
    except Exception as e:  # noqa: BLE001
        raise DataIntegrityError(f"{what} of unit {marker.get('unit_id')} cannot be decoded "
                                 f"({type(e).__name__}: {e}); {_repair(marker)}") from None


class CommittedMeta:
    """Row metadata of a reader's pieces, each chunk checked against its marker before use.

    `read(name, a, b)` takes rows inside one piece (a shard's committed rows); the piece's whole
    column is read once (4-8 bytes a row) and the last few are kept, since the normalisation
    sample reads chunk-sized blocks of the same pieces."""

    def __init__(self, store, pieces: list, sources: list, keep: int = 16):
        import bisect
        import threading

        self._store, self._pieces, self._sources, self._keep = store, pieces, sources, keep
        self._starts = getattr(pieces, "starts", None)   # readplan.Pieces: its int64 array
        if self._starts is None:
            self._starts = [a for a, _ in pieces]
        self._bisect = bisect.bisect_right
        self._cache: dict = {}
        self._lock = threading.Lock()

    def read(self, name: str, a: int, b: int) -> np.ndarray:
        i = self._bisect(self._starts, a) - 1
        if i < 0 or not self._pieces[i][0] <= a <= b <= self._pieces[i][1]:
            raise ValueError(f"rows [{a}, {b}) are not inside one committed piece")
        key = (name, i)
        with self._lock:
            col = self._cache.get(key)
        if col is None:
            m, sh = self._sources[i]
            col = read_meta(self._store, m, sh, name)
            with self._lock:
                if len(self._cache) >= self._keep:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = col
        p0 = self._pieces[i][0]
        return col[a - p0:b - p0]


# Object-store write requests per shard object or metadata chunk of a unit: the PUT under the
# attempt's name, then publish's server-side copy and delete (`ObjectStorage.move`). Local stores
# rename instead (no requests). `harvest plan` counts requests with this.
WRITES_PER_OBJECT = 3


def publish(store, marker: dict, threads: int = 16) -> int:
    """Move a committed unit's attempt objects to their zarr keys; returns how many moved (0 when
    it was published already). Only the writer that created the marker, or finalize for a unit
    whose writer died between its marker and this, calls it. How the moves run (renames, or
    concurrent copies and deletes) is the storage's choice (`Storage.publish`)."""
    loc, att = store.location, marker.get("attempt")
    if not att:
        return 0
    pairs = []
    for sh in unit_shards(store, marker):
        if sh.get("object_crc32c") is not None:
            pairs += [point_keys(p, sh["index"], att)[::-1] for p in store.points]
        pairs += [meta_keys(name, sh["index"], att)[::-1] for name in (sh.get("meta") or {})]
    return loc.publish(pairs, threads)


def attempt_objects(loc) -> dict[str, list[tuple[str, int, str, int]]]:
    """Every attempt object now present: array path -> [(key, shard, attempt, size)], one
    listing. Temp files of failed writes are not objects."""
    out: dict = {}
    for rel, size in loc.list_tree(layout.OBJECTS_DIR).items():
        arr, _, name = rel.rpartition("/")
        parsed = layout.parse_attempt_object(name)
        if parsed is not None and arr:
            out.setdefault(arr, []).append((f"{layout.OBJECTS_DIR}/{rel}", *parsed, size))
    return out


__all__ = ["WRITES_PER_OBJECT", "read_point", "read_meta", "read_checked", "publish",
           "attempt_objects", "point_keys", "meta_keys"]
