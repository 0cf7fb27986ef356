"""A store is untrusted input: every record the store reads back is checked here, once.

Stores are shared (the dataset card invites an upload to a hub), so every command and reader may
be parsing bytes an attacker wrote. A record names other objects (a marker's `attempt` becomes
part of object keys that publishing moves; a table names metadata columns that become keys on
both sides of a move) and sizes (rows, shards, bytes) that drive allocations. So a record is
used only after this layer has checked it against the layout:

- names: attempt tokens, unit ids, point and metadata names, and every key a record states
  against the key its unit and attempt imply (`layout.table_key`, `layout.stats_key`);
- sizes: row ranges, shard counts and byte counts within what the store's layout allows;
- decompression: bounded by what the layout allows (a gzip bomb stops at the bound, whatever
  digest the attacker also wrote), and line by line for the index;
- every refusal is a `RecordError` (a DataIntegrityError: the CLI exits 2 with it) naming the
  object and the field.

`Storage.key()` refuses any name that would leave the store's root (store/storage/interface.py),
on every backend: the last line of defence if a name slipped past a check here.
"""

from __future__ import annotations

import re
import zlib
from typing import Iterator

from ..errors import CorruptGzip, RecordError
from ..format import layout
SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A marker's JSON is ~1-2 KB (markersize.py: fixed size whatever the shard count from layout 3);
# a layout-2 marker carries its shard records inline: 64 KiB per shard is far above any writer's.
MARKER_MAX_BYTES = 1 << 20
MARKER_V2_PER_SHARD = 64 << 10
# An object table's decompressed JSON per shard: one record of ~35 B per point plus the metadata
# columns (measured ~1.2 KB per shard x point at 32 points with upload ids); the bound leaves 8x.
TABLE_PER_SHARD_POINT = 8 << 10
TABLE_PER_SHARD = 64 << 10
# Index segments hold markers: each line at most a marker's bound, at most one line per marker
# the listing shows (plus slack for stale copies a later compaction drops).
INDEX_SLACK_LINES = 4096


def fail(where: str, field: str, why: str) -> RecordError:
    return RecordError(f"{where}: field {field!r} {why}; the store is damaged or was not written "
                       "by harvest (nothing was read through it)")


def attempt(value, where: str, field: str = "attempt") -> str:
    """An attempt token: letters and digits only, at most 64 (a path can never come of it)."""
    if not isinstance(value, str) or not layout.ATTEMPT.match(value):
        raise fail(where, field, f"is {_show(value)}, not an attempt token (1-64 letters/digits)")
    return value


def integer(d: dict, field: str, where: str, lo: int = 0, hi: "int | None" = None) -> int:
    v = d.get(field) if isinstance(d, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise fail(where, field, f"is {_show(v)}, not an integer {rng}")
    return v


def meta_name(value, where: str, field: str) -> str:
    if value not in layout.ROW_META:
        raise fail(where, field, f"names {_show(value)}, not a metadata column "
                   f"({', '.join(layout.ROW_META)})")
    return value


def point_name(value, where: str, field: str) -> str:
    try:
        layout.point_path(value)
    except (ValueError, TypeError):
        raise fail(where, field, f"is {_show(value)}, not a point name") from None
    return value


def _show(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


# ---- markers ------------------------------------------------------------------------------------

def marker(m, name, where: str) -> dict:
    """A commit marker read from `where`, against the name it was listed under (`name`:
    (unit id, row start, row end) from the listing, or None for an index line whose name is its
    own): structure, ids, the attempt token, and the table reference's key and sizes."""
    if not isinstance(m, dict):
        raise fail(where, "(marker)", f"is a {type(m).__name__}, not a JSON object")
    uid = integer(m, "unit_id", where)
    rs = integer(m, "row_start", where)
    re_ = integer(m, "row_end", where, lo=rs + 1, hi=layout.CAPACITY_ROWS)
    if name is not None and (uid, rs, re_) != tuple(name):
        raise fail(where, "unit_id/row_start/row_end",
                   f"say unit {uid} rows [{rs}, {re_}), the object's name says {tuple(name)}")
    if "attempt" in m or "table" in m:
        attempt(m.get("attempt"), where)
    t = m.get("table")
    if t is not None:
        if not isinstance(t, dict):
            raise fail(where, "table", "is not an object")
        want = layout.table_key(uid, m["attempt"])
        if t.get("key") != want:
            raise fail(where, "table.key", f"is {_show(t.get('key'))}, not {want!r} (the key its "
                       "unit and attempt imply)")
        if not isinstance(t.get("sha256"), str) or not SHA256.match(t["sha256"]):
            raise fail(where, "table.sha256", "is not a sha256 digest")
        integer(t, "nbytes", where + " table", lo=1)
        integer(t, "n_shards", where + " table", lo=1)
    s = m.get("stats")
    if isinstance(s, dict) and s.get("key") is not None:
        want = layout.stats_key(uid, attempt(m.get("attempt"), where))
        if s.get("key") != want:
            raise fail(where, "stats.key", f"is {_show(s.get('key'))}, not {want!r}")
    shards = m.get("shards")
    if shards is not None:
        table_records(shards, where, uid, None, None)
    return m


def marker_for_store(m: dict, where: str, shard_rows: int, n_points: int) -> dict:
    """What only the store's own layout tells: the table's shard count and size bound."""
    t = m.get("table")
    if t is not None:
        n = len(shard_range(m, shard_rows))
        if t["n_shards"] != n:
            raise fail(where, "table.n_shards", f"is {t['n_shards']}, its rows span {n} shards")
        bound = table_bound(n, n_points)
        if t["nbytes"] > bound:
            raise fail(where, "table.nbytes", f"is {t['nbytes']}, above the {bound} bytes a table "
                       f"of {n} shards x {n_points} points may take")
    return m


def shard_range(m: dict, shard_rows: int) -> range:
    return range(int(m["row_start"]) // shard_rows, -(-int(m["row_end"]) // shard_rows))


def table_bound(n_shards: int, n_points: int) -> int:
    """The most bytes (stored or decompressed) an object table of this shape may take."""
    return 4096 + n_shards * (TABLE_PER_SHARD + n_points * TABLE_PER_SHARD_POINT)


def marker_bound(n_shards: int) -> int:
    return MARKER_MAX_BYTES + n_shards * MARKER_V2_PER_SHARD


# ---- plan ---------------------------------------------------------------------------------------

def plan_unit(u, where: str, i: int) -> tuple:
    """One unit of a plan segment: `[unit_id, row_start, row_end, pieces]`, every number an
    integer in range; pieces (where the pipeline took the unit's tokens from: block, chunk,
    context range, document base; the store does not read them) short lists of integers."""
    at = f"units[{i}]"
    if not isinstance(u, list) or len(u) != 4 or not isinstance(u[3], list):
        raise fail(where, at, "is not [unit_id, row_start, row_end, pieces]")
    d = {"unit_id": u[0], "row_start": u[1], "row_end": u[2]}
    uid = integer(d, "unit_id", f"{where} {at}")
    rs = integer(d, "row_start", f"{where} {at}")
    re_ = integer(d, "row_end", f"{where} {at}", lo=rs + 1, hi=layout.CAPACITY_ROWS)
    pieces = []
    for j, p in enumerate(u[3]):
        if not (isinstance(p, list) and len(p) <= 8 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in p)):
            raise fail(where, f"{at}.pieces[{j}]", f"is {_show(p)}, not a list of at most 8 "
                       "integers")
        pieces.append(tuple(p))
    return uid, rs, re_, tuple(pieces)


# ---- object tables ------------------------------------------------------------------------------

def table_records(recs, where: str, uid: int, shard_ids, n_points: "int | None") -> list:
    """A unit's per-shard records (an object table's, or a layout-2 marker's inline list)."""
    if not isinstance(recs, list):
        raise fail(where, "shards", "is not a list")
    for i, r in enumerate(recs):
        at = f"shards[{i}]"
        if not isinstance(r, dict):
            raise fail(where, at, "is not an object")
        integer(r, "index", where + " " + at)
        rs = integer(r, "row_start", where + " " + at)
        integer(r, "row_end", where + " " + at, lo=rs, hi=layout.CAPACITY_ROWS)
        for f in ("crc32c", "nbytes", "object_crc32c"):
            v = r.get(f)
            if v is None:
                continue
            if not isinstance(v, list) or (n_points is not None and len(v) != n_points) or not all(
                    x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 0)
                    for x in v):
                raise fail(where, f"{at}.{f}", f"is not a list of {n_points or 'n'} sizes/digests")
        meta = r.get("meta")
        if meta is not None:
            if not isinstance(meta, dict):
                raise fail(where, f"{at}.meta", "is not an object")
            for k, rec in meta.items():
                meta_name(k, where, f"{at}.meta")
                if not isinstance(rec, dict):
                    raise fail(where, f"{at}.meta.{k}", "is not an object")
                for f in ("chunk", "nbytes", "crc32c"):
                    if rec.get(f) is not None:
                        integer(rec, f, f"{where} {at}.meta.{k}")
    if shard_ids is not None and [r["index"] for r in recs] != list(shard_ids):
        raise fail(where, "shards[].index", f"lists shards {[r['index'] for r in recs][:5]}..., "
                   f"unit {uid} spans {list(shard_ids)[:5]}...")
    return recs


# ---- bounded decompression ----------------------------------------------------------------------

def gunzip(blob: bytes, limit: int, where: str) -> bytes:
    """gzip bytes decompressed, refused past `limit` bytes of output (never more in memory)."""
    d = zlib.decompressobj(31)
    try:
        out = d.decompress(blob, limit + 1)
    except zlib.error as e:
        raise CorruptGzip(str(fail(where, "(gzip)", f"cannot be decompressed ({e})"))) from None
    if len(out) > limit or d.unconsumed_tail:
        raise fail(where, "(gzip)", f"decompresses past {limit} bytes, the most its layout allows")
    return out


def gzip_lines(blob: bytes, line_limit: int, max_lines: int, where: str) -> Iterator[bytes]:
    """The lines of gzip'ed text, decompressed a piece at a time: no line past `line_limit`
    bytes and no more than `max_lines` lines (memory: one piece and one line)."""
    d = zlib.decompressobj(31)
    buf, lines, data = b"", 0, blob
    while True:
        try:
            piece = d.decompress(data, 1 << 20)
        except zlib.error as e:
            raise CorruptGzip(str(fail(where, "(gzip)", f"cannot be decompressed ({e})"))) from None
        data = d.unconsumed_tail
        buf += piece
        *done, buf = buf.split(b"\n")
        for line in done:
            lines += 1
            if lines > max_lines:
                raise fail(where, "(lines)", f"holds more than {max_lines} lines, more markers "
                           "than the store has")
            if line:
                yield line
        if len(buf) > line_limit:
            raise fail(where, "(line)", f"holds a line longer than {line_limit} bytes")
        if not piece and not data:
            break
    if buf:
        yield buf


__all__ = ["plan_unit", "attempt", "integer", "meta_name", "point_name", "marker",
           "marker_for_store", "table_records", "table_bound", "marker_bound", "gunzip",
           "gzip_lines", "shard_range"]
