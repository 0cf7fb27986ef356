"""A store is untrusted input: the checks every record the store reads back passes, once.

Stores are shared (the dataset card invites an upload to a hub), so every command and reader may
be parsing bytes an attacker wrote. A record names other objects (a marker's `attempt` becomes
part of object keys that publishing moves; a table names metadata columns that become keys on
both sides of a move) and sizes (rows, shards, bytes) that drive allocations. So a record is
used only after it has been checked against the layout, where it is read: the records'
`from_json` (records.py: plan unit, marker, shard record, publish and lease records) apply the
checks below, and nothing reads a record's JSON but them:

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
        raise fail(where, field, f"is {show(value)}, not an attempt token (1-64 letters/digits)")
    return value


def integer(d: dict, field: str, where: str, lo: int = 0, hi: "int | None" = None) -> int:
    v = d.get(field) if isinstance(d, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise fail(where, field, f"is {show(v)}, not an integer {rng}")
    return v


def meta_name(value, where: str, field: str) -> str:
    if value not in layout.ROW_META:
        raise fail(where, field, f"names {show(value)}, not a metadata column "
                   f"({', '.join(layout.ROW_META)})")
    return value


def point_name(value, where: str, field: str) -> str:
    try:
        layout.point_path(value)
    except (ValueError, TypeError):
        raise fail(where, field, f"is {show(value)}, not a point name") from None
    return value


def show(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


# ---- bounds ---------------------------------------------------------------------------------------

def table_bound(n_shards: int, n_points: int) -> int:
    """The most bytes (stored or decompressed) an object table of this shape may take."""
    return 4096 + n_shards * (TABLE_PER_SHARD + n_points * TABLE_PER_SHARD_POINT)


def marker_bound(n_shards: int) -> int:
    return MARKER_MAX_BYTES + n_shards * MARKER_V2_PER_SHARD


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


__all__ = ["fail", "show", "attempt", "integer", "meta_name", "point_name", "table_bound", "marker_bound",
           "gunzip", "gzip_lines"]
