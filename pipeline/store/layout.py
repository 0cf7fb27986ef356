"""Names and sizes of everything in a store; the one place FORMAT.md is encoded in code.

Keeping paths here (not spread over writer/reader) is what lets `open_store` refuse a layout it
does not know instead of silently reading garbage from renamed keys.
"""

from __future__ import annotations

import math
import re

LAYOUT_NAME = "harvest.activations"
LAYOUT_VERSION = 1
SUPPORTED_LAYOUT_VERSIONS = (1,)

# Row metadata arrays: name -> dtype. Row i of these and of every point array is the same token.
ROW_META = {"token_id": "int32", "doc_id": "int64", "position": "int32"}

CONTROL_DIR = "_harvest"          # plain objects beside the zarr hierarchy, never zarr nodes
PLAN_KEY = f"{CONTROL_DIR}/plan.json"
COMMITS_DIR = f"{CONTROL_DIR}/commits"
COMMITTED_INDEX_KEY = f"{CONTROL_DIR}/committed.json"   # written by finalize
PROBE_DIR = f"{CONTROL_DIR}/probe"
STATS_GROUP = "stats"             # zarr group: stats/<point path>/{mean,var}, written by finalize

DEFAULT_SHARD_BYTES = 32 << 20      # per point array: tens of MB per object suits S3 GET/PUT
DEFAULT_CHUNK_BYTES = 1 << 20       # inner chunk: the unit a partial read decodes
MAX_ROW_SHARD_BYTES = 512 << 20     # one shard across all points: what a writer must buffer

_POINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[0-9]+)?$")


def point_path(point: str) -> str:
    """`resid_post.10` -> `resid_post/10` (array path inside the group)."""
    point = str(point)
    if not _POINT.match(point):
        raise ValueError(
            f"bad point name {point!r}: write it as '<name>.<layer>' (e.g. 'resid_post.10') "
            "with letters, digits and underscores in the name"
        )
    if point in ROW_META or point.split(".")[0] in (STATS_GROUP, CONTROL_DIR):
        raise ValueError(f"point name {point!r} collides with a reserved store name")
    return point.replace(".", "/")


def commit_key(unit_id: int) -> str:
    return f"{COMMITS_DIR}/unit-{int(unit_id):08d}.json"


def stats_key(unit_id: int, attempt: str) -> str:
    return f"{COMMITS_DIR}/unit-{int(unit_id):08d}.{attempt}.stats.npz"


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(1.0, x)))))


def default_sizes(width: int, itemsize: int, n_points: int, n_rows: int,
                  shard_rows: int | None, chunk_rows: int | None) -> tuple[int, int]:
    """Pick (shard_rows, chunk_rows): powers of two near the byte targets, shard a chunk multiple.

    The shard cap across points bounds writer memory (see RegionWriter); small stores get one
    shard rounded to whole chunks so tiny test runs do not allocate 32 MB buffers.
    """
    row_bytes = width * itemsize
    if chunk_rows is None:
        chunk_rows = _pow2_floor(DEFAULT_CHUNK_BYTES / row_bytes)
        if n_rows < chunk_rows:  # tiny store: do not pad one chunk to a megabyte of zeros
            chunk_rows = 1 << max(0, math.ceil(math.log2(max(1, n_rows))))
        if shard_rows is not None and shard_rows % chunk_rows:
            # the largest divisor of shard_rows not above the target: gcd() alone could give
            # 4-row chunks for shard_rows=7812, and per-chunk overhead would dominate decoding
            chunk_rows = max(d for d in range(1, min(chunk_rows, shard_rows) + 1) if shard_rows % d == 0)
    if shard_rows is None:
        per_point = min(DEFAULT_SHARD_BYTES, MAX_ROW_SHARD_BYTES / max(1, n_points))
        shard_rows = max(chunk_rows, _pow2_floor(per_point / row_bytes) // chunk_rows * chunk_rows)
        if n_rows < shard_rows:
            shard_rows = max(chunk_rows, -(-n_rows // chunk_rows) * chunk_rows)
    chunk_rows = min(chunk_rows, shard_rows)
    return int(shard_rows), int(chunk_rows)
