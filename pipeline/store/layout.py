"""Names and sizes of everything in a store; the one place FORMAT.md is encoded in code.

Keeping paths here (not spread over writer/reader) is what lets `open_store` refuse a layout it
does not know instead of silently reading garbage from renamed keys. The sizing policy (shard and
chunk rows) lives here too, and only here: the driver's plan and `create_store` both call it.
"""

from __future__ import annotations

import math
import re

LAYOUT_NAME = "harvest.activations"
LAYOUT_VERSION = 2
SUPPORTED_LAYOUT_VERSIONS = (2,)

# Row metadata arrays: name -> dtype. Row i of these and of every point array is the same token.
# Columns after the first three are optional for a writer (write_meta(..., gen=...)): omitted,
# they are written as 0.
ROW_META = {"token_id": "int32", "doc_id": "int64", "position": "int32", "gen": "int8"}
META_UNWRITTEN = -1   # fill value of every metadata array: the row was never written
META_INSERTED = -2    # doc_id and position of a BOS the packer inserted (it is from no document)
META_PAD = -3         # token_id, doc_id and position of a padding row of a generation slot
# `gen`: what a row is (FORMAT.md, "Generation"). Only GEN_PROMPT and GEN_SAMPLED rows hold
# activations; the others are zeros, outside the statistics and never yielded by the reader.
GEN_PROMPT, GEN_SAMPLED, GEN_LAST, GEN_DROPPED, GEN_PAD = 0, 1, 2, 3, 4
GEN_HAS_ACTS = (GEN_PROMPT, GEN_SAMPLED)

# Arrays are created this long when the run's length is not known in advance (a streamed corpus
# without packing.max_tokens); zarr stores nothing for unwritten shards, and finalize shrinks the
# shape to the rows committed. 2^40 rows is ~1 T tokens, far above any single harvest.
CAPACITY_ROWS = 1 << 40

CONTROL_DIR = "_harvest"          # plain objects beside the zarr hierarchy, never zarr nodes
PLAN_DIR = f"{CONTROL_DIR}/plan"  # seg-<seq>.json create-once segments, compact.json, sources.json
COMMITS_DIR = f"{CONTROL_DIR}/commits"   # one create-once marker per committed unit, nothing else
SIDECAR_DIR = f"{CONTROL_DIR}/stats"     # per-unit stats partials, written before their marker
# compacted copies of markers (a cache, see commits.py) and void records of stale copies
INDEX_DIR = f"{CONTROL_DIR}/index"
PROBE_DIR = f"{CONTROL_DIR}/probe"
# A writer puts each shard and metadata chunk under a name of its own attempt, and only the
# writer whose marker was created moves them to the zarr keys: a late writer of the same unit can
# never land bytes on an object a marker vouches for (see FORMAT.md, "Work units and commits").
OBJECTS_DIR = f"{CONTROL_DIR}/objects"
SCRATCH_DIR = f"{CONTROL_DIR}/scratch"   # rows of shards a writer had to evict before completing
STATS_GROUP = "stats"             # zarr group: stats/<subset>/{mean,var} [points, width], finalize
STATS_SUBSETS = ("all", "kept")

TARGET_SHARD_BYTES = 32 << 20     # per point array: tens of MB per object suits S3 GET/PUT
TARGET_CHUNK_BYTES = 1 << 20      # inner chunk: the unit a partial read decodes
# One shard across all points is what a writer buffers per open or pending shard; an actor has
# two units in flight, each with one open and up to two pending shards.
MAX_SHARD_SET_BYTES = 128 << 20

_POINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[0-9]+)?$")
_MARKER = re.compile(r"^unit-(\d{8,})\.(\d+)-(\d+)\.json$")
_VOID = re.compile(r"^void-(\d{8,})\.([0-9A-Za-z]+)\.json$")


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


def marker_name(unit_id: int, row_start: int, row_end: int) -> str:
    """A marker's name carries its row range, so one listing tells resume which units are done
    and whether each marker agrees with the plan, without reading any marker."""
    return f"unit-{int(unit_id):08d}.{int(row_start)}-{int(row_end)}.json"


def parse_marker_name(name: str) -> "tuple[int, int, int] | None":
    m = _MARKER.match(name)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def commit_key(unit_id: int, row_start: int, row_end: int) -> str:
    return f"{COMMITS_DIR}/{marker_name(unit_id, row_start, row_end)}"


def stats_key(unit_id: int, attempt: str) -> str:
    return f"{SIDECAR_DIR}/unit-{int(unit_id):08d}.{attempt}.bin"


def plan_segment_key(seq: int) -> str:
    return f"{PLAN_DIR}/seg-{int(seq):08d}.json"


def plan_payload_key(seq: int) -> str:
    return f"{PLAN_DIR}/seg-{int(seq):08d}.payload.json"


PLAN_COMPACT_KEY = f"{PLAN_DIR}/compact.json"
PLAN_COMPACT_PAYLOAD_KEY = f"{PLAN_DIR}/compact.payload.json"
PLAN_SOURCES_KEY = f"{PLAN_DIR}/sources.json"


def index_key(seq: int) -> str:
    return f"{INDEX_DIR}/idx-{int(seq):08d}.jsonl.gz"


def void_name(unit_id: int, attempt: str) -> str:
    """A void record: the index entries of `unit_id` written by `attempt` are stale (uncommit)."""
    return f"void-{int(unit_id):08d}.{attempt}.json"


def void_key(unit_id: int, attempt: str) -> str:
    return f"{INDEX_DIR}/{void_name(unit_id, attempt)}"


def parse_void_name(name: str) -> "tuple[int, str] | None":
    m = _VOID.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def shard_object_key(point: str, shard: int) -> str:
    return f"{point_path(point)}/c/{int(shard)}/0"


def meta_chunk_key(name: str, shard: int) -> str:
    return f"{name}/c/{int(shard)}"


def attempt_object_key(array_path: str, shard: int, attempt: str) -> str:
    """Where attempt `attempt` writes shard `shard` of the array at `array_path` (a point's path
    or a metadata array's name) before its marker exists."""
    return f"{OBJECTS_DIR}/{array_path}/{int(shard)}.{attempt}"


def parse_attempt_object(name: str) -> "tuple[int, str] | None":
    """(shard, attempt) from an attempt object's file name, None for anything else (temp files)."""
    shard, dot, attempt = name.partition(".")
    if not dot or not shard.isdigit() or not attempt.isalnum():
        return None
    return int(shard), attempt


def scratch_key(unit_id: int, attempt: str, shard: int, a: int, b: int) -> str:
    return f"{SCRATCH_DIR}/unit-{int(unit_id):08d}.{attempt}/{int(shard)}.{int(a)}-{int(b)}.bin"


# --------------------------------------------------------------------------------------------
# Sizes: the one layout policy
# --------------------------------------------------------------------------------------------


def largest_divisor_at_most(n: int, cap: int) -> int:
    best, i = 1, 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if best < d <= cap:
                    best = d
        i += 1
    return best


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(1.0, x)))))


def choose_sizes(width: int, itemsize: int, n_points: int, *, multiple: int = 1,
                 n_rows: int | None = None, shard_rows: int | None = None,
                 chunk_rows: int | None = None) -> tuple[int, int]:
    """(shard_rows, chunk_rows) for arrays of `width` x `itemsize`-byte rows, `n_points` of them.

    - shard_rows: a multiple of `multiple` (the context size: a unit then holds whole contexts)
      near TARGET_SHARD_BYTES per point, with one shard across all points under
      MAX_SHARD_SET_BYTES (the writer's buffer bound); at most `n_rows` rounded up when the store
      is known to be small, so tiny runs do not allocate 32 MB buffers.
    - chunk_rows: the largest divisor of shard_rows near TARGET_CHUNK_BYTES (a power of two when
      shard_rows is one; gcd() alone could give 4-row chunks for shard_rows=7812 and per-chunk
      overhead would dominate decoding).
    Explicit values are checked, not changed.
    """
    row_bytes = max(1, width * itemsize)
    m = max(1, int(multiple))
    if shard_rows is None:
        target = min(TARGET_SHARD_BYTES / row_bytes, MAX_SHARD_SET_BYTES / (row_bytes * max(1, n_points)))
        if m == 1 or (m & (m - 1)) == 0:
            shard_rows = max(m, _pow2_floor(target))
        else:
            shard_rows = m * max(1, int(target // m))
        if n_rows is not None and 0 < n_rows < shard_rows:
            shard_rows = max(m, -(-int(n_rows) // m) * m)
    elif shard_rows % m:
        raise ValueError(f"shard_rows={shard_rows} is not a multiple of the context size {m}")
    if chunk_rows is None:
        cap = max(1, TARGET_CHUNK_BYTES // row_bytes)
        chunk_rows = largest_divisor_at_most(int(shard_rows), cap)
        if n_rows is not None and 0 < n_rows < chunk_rows:
            chunk_rows = largest_divisor_at_most(int(shard_rows), int(n_rows))
    elif shard_rows % chunk_rows:
        raise ValueError(f"shard_rows={shard_rows} must be a multiple of chunk_rows={chunk_rows} "
                         "(a shard holds whole inner chunks)")
    return int(shard_rows), int(chunk_rows)
