"""Sizes of a unit's commit marker and object table for a given shape, for `harvest plan`.

Built by the writer's own code (`commits.prepare`) from records shaped like a writer's, so the
estimate follows the format when it changes. Apart from store/commit/markers.py, which it uses, so the marker
code stays one concern.
"""

from __future__ import annotations

import socket

from . import layout
from ..commit import tables as _tables
from ..commit.markers import Prepared, prepare

# A CRC32C is uniform over 32 bits, so most (98%) have 10 decimal digits: the size estimate
# writes this one wherever the marker holds a digest.
_TYPICAL_CRC = 0xAAAAAAAA


def _typical_records(points, row_start: int, k: int, shard_rows: int, object_bytes: int,
                     meta_bytes: dict) -> list[dict]:
    """k records as a writer makes them. CRCs are seeded random 10-digit numbers and sizes vary
    by +-2 % around `object_bytes`, not constants: gzip (the object table) would squeeze repeated
    values to nothing, and real CRCs are incompressible."""
    import random

    rnd = random.Random(k)
    P = len(points)

    def crcs(n):
        return [_TYPICAL_CRC | rnd.getrandbits(31) for _ in range(n)]

    return _tables.records([
        (row_start // shard_rows + i, row_start + i * shard_rows, row_start + (i + 1) * shard_rows,
         crcs(P), [object_bytes + rnd.randint(-object_bytes // 50, object_bytes // 50)
                   for _ in range(P)], crcs(P),
         {c: {"crc32c": crcs(1)[0], "nbytes": n} for c, n in meta_bytes.items()})
        for i in range(k)])


def _typical(points, unit_id, row_start, k, n_shards, shard_rows, row_bytes, object_bytes,
             meta_bytes, version) -> Prepared:
    from types import SimpleNamespace

    store = SimpleNamespace(layout_version=version, points=list(points), row_bytes=row_bytes,
                            row_set_bytes=row_bytes * len(points))
    attempt = "f" * 16  # writers' attempt ids are 16 hex digits
    rows = n_shards * shard_rows
    stats = {"key": layout.stats_key(unit_id, attempt), "sha256": "0" * 64,
             "count": rows, "kept": rows}
    # what the actor passes as `extra` (pipeline/actor/capture.py)
    extra = {"actor": 0, "pid": 1 << 20, "attempt": attempt, "host": socket.gethostname()}
    recs = _typical_records(points, row_start, k, shard_rows, object_bytes, meta_bytes)
    return prepare(store, unit_id, row_start, row_start + rows, attempt, recs,
                   {c: _TYPICAL_CRC for c in meta_bytes}, stats, 1.0, extra)


def marker_size(points: list, unit_id: int, row_start: int, n_shards: int, shard_rows: int,
                row_bytes: int, object_bytes: int, meta_bytes: dict,
                version: int = layout.LAYOUT_VERSION) -> int:
    """Bytes of a unit's marker, for `harvest plan`: the marker built for one and for two shards
    of this shape, then extended linearly (a version-2 marker grows by one record per shard; a
    version-3 one does not grow at all), so the estimate follows the format without building
    10^4 records. `meta_bytes`: stored bytes of each row-metadata column's chunk;
    `object_bytes`: of each point's shard object."""
    args = (points, unit_id, row_start)
    rest = (n_shards, shard_rows, row_bytes, object_bytes, meta_bytes, version)
    if version >= 3:   # built whole: its table's size (digits in the reference) is exact then
        return len(_typical(*args, max(1, n_shards), *rest).marker.encode())
    first = len(_typical(*args, 1, *rest).marker.encode())
    second = len(_typical(*args, 2, *rest).marker.encode())
    return first + (second - first) * (max(1, n_shards) - 1)


def table_size(points: list, unit_id: int, row_start: int, n_shards: int, shard_rows: int,
               row_bytes: int, object_bytes: int, meta_bytes: dict) -> int:
    """Stored bytes of a unit's object table (layout 3): built whole (gzip does not extend
    linearly from two records), so for `harvest plan`'s one unit, not per unit of a run."""
    return len(_typical(points, unit_id, row_start, n_shards, n_shards, shard_rows, row_bytes,
                        object_bytes, meta_bytes, 3).table_blob)


__all__ = ["marker_size", "table_size"]
