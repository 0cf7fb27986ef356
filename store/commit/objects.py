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
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..format import checksum, layout
from ..errors import DataIntegrityError, RecordError
from ..stats.moments import crc32c
from .records import Marker, ShardRecord
from .tables import shard_record, unit_shards

if TYPE_CHECKING:
    from ..storage.interface import UploadRecord
    from .view import StoreView

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


def _repair(m: Marker) -> str:
    return (f"run `harvest verify --deep`; to repair, store.uncommit({m.unit_id}) and run the "
            "harvest again (it rewrites that unit)")


def repair_hint(url: str, unit_id) -> str:
    """The one repair of a committed unit whose data is gone or damaged."""
    return (f"run `harvest uncommit {url} --unit {unit_id}`, then the same harvest again (it "
            "re-captures the unit)")


# A reader meeting a committed object whose upload (S3 multipart) is still outstanding retries
# this long: its writer completes it right after the marker, in a second. Only then: an object
# that is gone (no upload outstanding) or damaged (another size or CRC32C) is reported at once.
UNPUBLISHED_WAIT_S = (0.25, 0.5, 1.0, 2.0)


def _outstanding(loc, key: str, upload: dict) -> bool:
    """Whether `upload` is still pending at `key` (one listing of the uploads under the key)."""
    try:
        return upload.get("upload_id") in loc.pending_uploads(key)
    except Exception:  # noqa: BLE001 -- cannot tell: say gone/damaged from what was read
        return False


def read_checked(loc, keys: list[str], want_crc: int | None, want_size: int | None, what: str,
                 marker: Marker, upload: "dict | None" = None) -> bytes:
    """The first copy at `keys` whose size and CRC32C match the marker's record. What fails is
    told apart, each with its one repair: **pending** (the object's upload is outstanding: waited
    for briefly, then `harvest finalize`), **gone** (no copy and no upload outstanding) and
    **damaged** (a copy of another size or CRC32C), the last two at once and never as zeros."""
    import time

    from ..storage.credentials import redact_url

    blob, tried, damaged = _read_first(loc, keys, want_crc, want_size)
    if blob is None and not damaged and len(keys) > 1:
        # publishing moves the attempt's copy to the zarr key: a move between our read of the
        # zarr key and of the attempt's key hides both; by a second look the zarr key holds it
        # (seen by a follower reading units as they commit: 1 read in ~500 on a local store)
        for k in keys:
            loc.invalidate(k)
        blob, tried, damaged = _read_first(loc, keys, want_crc, want_size)
    if blob is not None:
        return blob
    uid = marker.unit_id
    if upload and _outstanding(loc, keys[0], upload):
        for delay in UNPUBLISHED_WAIT_S:
            time.sleep(delay)
            loc.invalidate(keys[0])
            blob, tried, damaged = _read_first(loc, keys, want_crc, want_size)
            if blob is not None:
                return blob
            if not _outstanding(loc, keys[0], upload):
                break
        else:
            raise DataIntegrityError(
                f"{what} of unit {uid} is committed, not yet published: pending (upload "
                f"{upload.get('upload_id')} of attempt {marker.attempt} is outstanding: a "
                f"writer is publishing it or died); run `harvest finalize {redact_url(loc.url)}` "
                f"({'; '.join(tried)})")
    state = "damaged" if damaged else "gone"
    cause = ("a copy differs from what its writer recorded" if damaged else
             "no copy exists" + (" and no upload is outstanding" if upload else ""))
    raise DataIntegrityError(f"{what} of unit {uid} is {state}: {cause} ({'; '.join(tried)}); "
                             f"{repair_hint(redact_url(loc.url), uid)}")


def _read_first(loc, keys: list[str], want_crc: int | None, want_size: int | None):
    """(the first intact copy or None, what each key held, whether some copy was damaged)."""
    tried, damaged = [], False
    for k in keys:
        try:
            blob = loc.read_bytes(k)
        except RecordError as e:   # a key the store may not use (it leaves the store): say why
            tried.append(f"{k}: refused ({e})")
            damaged = True
            continue
        except Exception as e:  # noqa: BLE001 -- reported with the key, never as zeros
            tried.append(f"{k}: cannot be read ({type(e).__name__})")
            continue
        if blob is None:
            tried.append(f"{k}: missing")
        elif want_size is not None and len(blob) != want_size:
            tried.append(f"{k}: {len(blob)} bytes, its writer stored {want_size}")
            damaged = True
        elif want_crc is not None and checksum.value(blob) != want_crc:
            tried.append(f"{k}: CRC32C differs from the marker's")
            damaged = True
        else:
            return blob, tried, damaged
    return None, tried, damaged


def read_point(store: StoreView, marker: Marker, sh: ShardRecord | int, p: int,
               out: np.ndarray | None = None, rows: int | None = None) -> np.ndarray:
    """Rows [sh.row_start, sh.row_end) of point index `p`, checked; into `out` when given.
    `sh`: the shard's record, or its index (the record then comes from the unit's table)."""
    if not isinstance(sh, ShardRecord):
        sh = shard_record(store, marker, int(sh))
    point = store.points[p]
    codec = store.shard_codec(point)
    n = sh.row_end - sh.row_start if rows is None else rows
    what = f"shard {sh.index} of {point}"
    if codec is None:
        raise DataIntegrityError(f"{what}: the array's codec chain is not one harvest reads checked")
    ocrc = sh.at(sh.object_crc32c, p)
    size = sh.at(sh.nbytes, p)
    keys = point_keys(point, sh.index, marker.attempt)
    upload = sh.at(sh.upload, p)
    if ocrc is None or upload is not None:  # legacy marker / an upload: the zarr key only
        keys = keys[:1]
    blob = read_checked(store.location, keys, ocrc, size, what, marker, upload)
    try:
        x = codec.decode(blob, sh.index, out=out, rows=n)
    except Exception as e:  # noqa: BLE001 -- a digest-checked object that cannot decode is damage
        raise DataIntegrityError(f"{what} of unit {marker.unit_id} cannot be decoded "
                                 f"({type(e).__name__}: {e}); {_repair(marker)}") from None
    if ocrc is None and sh.crc32c is not None:
        if crc32c(x) != sh.crc32c[p]:
            raise DataIntegrityError(f"{what} of unit {marker.unit_id}: rows differ from what "
                                     f"its writer committed; {_repair(marker)}")
    return x


def _meta_cache(store: StoreView) -> dict[tuple[str, int, int], np.ndarray]:
    """Decoded unit metadata chunks recently read through this store (keyed by key, digest and
    size: a rewrite after uncommit never hits an old entry); readers ask per shard."""
    return store.ledger.meta_chunk_cache


def read_meta(store: StoreView, marker: Marker, sh: ShardRecord | int, name: str) -> np.ndarray:
    """Column `name` of rows [sh.row_start, sh.row_end), checked against the marker (`sh`: the
    shard's record or its index, as in read_point)."""
    if not isinstance(sh, ShardRecord):
        sh = shard_record(store, marker, int(sh))
    rec = sh.meta.get(name)
    a, b = sh.row_start, sh.row_end
    what = f"row metadata {name} of shard {sh.index}"
    if rec is None:  # legacy marker: through zarr, checked by the unit's digest when whole
        col = np.asarray(store.meta_array(name)[a:b])
        want = (marker.meta_crc32c or {}).get(name)
        if want is not None and (a, b) == marker.rows and crc32c(col) != want:
            raise DataIntegrityError(f"{what} of unit {marker.unit_id} differs from what its "
                                     f"writer committed; {_repair(marker)}")
        return col
    chunk = rec.chunk  # the unit's chunk (stores made with meta_chunk_rows = unit rows)
    keys = meta_keys(name, sh.index if chunk is None else chunk, marker.attempt)
    upload = rec.upload
    codec = store.meta_codec(name)
    c0 = a if chunk is None else chunk * codec.chunk
    cache = _meta_cache(store)
    ck = (keys[0], rec.crc32c, rec.nbytes)
    col = cache.get(ck)
    try:
        if col is None:
            blob = read_checked(store.location, keys[:1] if upload else keys, rec.crc32c,
                                rec.nbytes, what, marker, upload)
            col = codec.decode(blob, min(codec.chunk, marker.row_end - c0))
            if chunk is not None:  # a unit's chunk serves each of its shards: keep a few
                while len(cache) >= 8:
                    cache.pop(next(iter(cache)))
                cache[ck] = col
        return col[a - c0:b - c0]
    except Exception as e:  # noqa: BLE001
        raise DataIntegrityError(f"{what} of unit {marker.unit_id} cannot be decoded "
                                 f"({type(e).__name__}: {e}); {_repair(marker)}") from None


class ShardSet(Protocol):
    """Committed shard (or metadata chunk) indices: `in` is all abort_losing_uploads asks."""

    def __contains__(self, shard: int, /) -> bool: ...


class PieceSeq(Protocol):
    """Indexable pieces: (row_start, row_end) by piece index (a list, or readorder.Pieces)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> tuple[int, int]: ...


class SourceSeq(Protocol):
    """Indexable sources: (marker facts, shard record or index) by piece index (readorder.Sources)."""

    def __getitem__(self, i: int, /) -> tuple[Marker, ShardRecord | int]: ...


class CommittedMeta:
    """Row metadata of a reader's pieces, each chunk checked against its marker before use.

    `read(name, a, b)` takes rows inside one piece (a shard's committed rows); the piece's whole
    column is read once (4-8 bytes a row) and the last few are kept, since the normalisation
    sample reads chunk-sized blocks of the same pieces."""

    def __init__(self, store, pieces: PieceSeq, sources: SourceSeq, keep: int = 16):
        import bisect
        import threading

        self._store, self._pieces, self._sources, self._keep = store, pieces, sources, keep
        self._starts = getattr(pieces, "starts", None)   # readorder.Pieces: its int64 array
        if self._starts is None:
            self._starts = [pieces[i][0] for i in range(len(pieces))]
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


def writes_per_object(object_bytes: int, part_min_bytes: int, block_bytes: int) -> int:
    """Object-store write requests of one streamed object (`harvest plan` counts with this):
    the upload's start, its parts (compressed blocks gathered to `part_min_bytes`) and its
    completion after the marker (publishing: no copy, no delete). The parts' count is an
    estimate: blocks of `block_bytes` stored bytes, at least `part_min_bytes` a part."""
    block = max(1, int(block_bytes))
    part = block * max(1, -(-int(part_min_bytes) // block))  # whole blocks reaching the minimum
    return 2 + max(1, -(-int(object_bytes) // part))


def publish(store: StoreView, marker: Marker, threads: int = 16, etags: "dict | None" = None) -> int:
    """Publish a committed unit's objects; returns how many it published (0 when it was
    published already). Uploads (S3 multipart to the zarr key) are completed, concurrently;
    objects under the attempt's name are moved (a rename locally). Only the writer that created
    the marker (which passes its parts' `etags`), or finalize for a unit whose writer died
    between its marker and this, calls it."""
    loc, att = store.location, marker.attempt
    if not att:
        return 0
    pairs: list[tuple[str, str]] = []   # (attempt key, zarr key): moved by name
    uploads: list = []
    seen: set = set()
    for sh in unit_shards(store, marker):
        if sh.object_crc32c is not None:
            for p, point in enumerate(store.points):
                up = sh.at(sh.upload, p)
                if up is not None:
                    uploads.append((layout.shard_object_key(point, sh.index), up))
                else:
                    final, mine = point_keys(point, sh.index, att)
                    pairs.append((mine, final))
        for name, rec in sh.meta.items():
            c = sh.index if rec.chunk is None else rec.chunk
            if (name, c) in seen:  # a unit's chunk is named by each of its shards
                continue
            seen.add((name, c))
            if rec.upload is not None:
                uploads.append((layout.meta_chunk_key(name, c), rec.upload))
            else:
                final, mine = meta_keys(name, c, att)
                pairs.append((mine, final))
    n = loc.publish(pairs, threads) if pairs else 0
    return n + complete_uploads(loc, uploads, threads, etags or {})


def complete_uploads(loc, uploads: list, threads: int = 16,
                     etags: "dict[str, UploadRecord] | None" = None) -> int:
    """Complete (final key, upload record) pairs, concurrently (one request each); the ETags
    the writer kept are used when given, else the parts are listed."""
    if not uploads:
        return 0
    etags = etags or {}

    def one(kv) -> bool:
        final, up = kv
        return loc.complete_upload(final, etags.get(final, up))

    if len(uploads) == 1:
        return int(one(uploads[0]))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(uploads)), thread_name_prefix="harvest-publish") as ex:
        return sum(ex.map(one, uploads))


def settle_uploads(store: StoreView, pending: dict, marker: Marker) -> None:
    """Finalize's part for one committed marker: complete its uploads still `pending` ({upload
    id: key}, from one listing; entries it settles are removed)."""
    todo = []
    for sh in unit_shards(store, marker):
        recs = [(layout.shard_object_key(p, sh.index), u)
                for p, u in zip(store.points, sh.upload or ())]
        recs += [(layout.meta_chunk_key(n, sh.index if r.chunk is None else r.chunk), r.upload)
                 for n, r in sh.meta.items()]
        for final, up in recs:
            if up is not None and pending.pop(up["upload_id"], None) is not None:
                todo.append((final, up))
    complete_uploads(store.location, todo)


def abort_losing_uploads(store: StoreView, pending: dict, owner: ShardSet, meta_owner: ShardSet) -> None:
    """Uploads left `pending` after every committed marker settled its own: those of a
    committed shard (`owner`) or metadata chunk (`meta_owner`) are a losing (or failed)
    attempt's and are aborted; the others stay (a writer may still be at work on them)."""
    for uid, key in pending.items():
        arr, _, rest = key.partition("/c/")
        shard = rest.split("/")[0]
        if shard.isdigit() and int(shard) in (meta_owner if arr in layout.ROW_META else owner):
            store.location.abort_upload(key, uid)


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


__all__ = ["repair_hint", "writes_per_object", "complete_uploads", "settle_uploads", "abort_losing_uploads",
           "read_point", "read_meta", "read_checked", "publish",
           "attempt_objects", "point_keys", "meta_keys"]
