"""Names and sizes of everything in a store; the one place FORMAT.md is encoded in code.

Keeping paths here (not spread over writer/reader) is what lets `open_store` refuse a layout it
does not know instead of silently reading garbage from renamed keys. The sizing policy (shard and
chunk rows) lives here too, and only here: the driver's plan and `create_store` both call it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Mapping

from ..errors import NotAHarvestStore, UnknownLayoutVersion
from .jsonattrs import JsonObject

LAYOUT_NAME = "harvest.activations"
# Version 3 moved the per-shard records out of the commit marker into a per-unit object table
# (FORMAT.md, "Layout version 3"); version 2 stores, whose markers carry them inline, still read.
LAYOUT_VERSION = 3
# Version 4 = version 3 plus per-point widths (`widths` attribute, FORMAT.md "Per-point widths"):
# written only when some point is not `width` wide, so that a harvest which knows one width per
# store refuses such a store instead of misreading it; a store of one width stays version 3.
LAYOUT_VERSION_WIDTHS = 4
# Version 5 = version 4 plus points of 32-bit values (`values` attribute, FORMAT.md "Points of
# 32-bit values": expert_indices int32, expert_weights float32, their bits in the store's
# elements): a reader that knows only 4 would read those bits as activations, so it refuses.
LAYOUT_VERSION_VALUES = 5
SUPPORTED_LAYOUT_VERSIONS = (2, 3, 4, 5)
VALUE_TYPES = {"int32": "<i4", "float32": "<f4"}   # a `values` point's type -> its numpy dtype

# Row metadata arrays: name -> dtype. Row i of these and of every point array is the same token.
# `role` (int8, codes in store/format/roles.py) and `gen` (int8, FORMAT.md "Generation") were added
# later: a store records the columns it has in its `row_meta` attribute (Store.meta_columns), and
# one without them reads as before. `role`: chat stores only (create_store(roles=True)); `gen`:
# generation stores only (create_store(generated=True)); `sample` (int16: which of a prompt's n
# samples a row belongs to, FORMAT.md "Generation"): stores of n > 1 samples per prompt only
# (create_store(samples=True)); a generation store without it reads as sample 0 everywhere.
# `source_row` (int64): a shuffled copy's rows (store/shuffled_copy.py, FORMAT.md "Shuffled copies")
# say which row of the source store they are; a row's context position is then
# source_row % context_size, not its own index % context_size.
# `logprob`, `entropy` (float32): the model's own next-token scores of each row (FORMAT.md "The
# model's next-token scores"), stores whose capture asked for them only (create_store(logprob=True,
# entropy=True)); `logprob` is NaN at a context's last position.
ROW_META = {"token_id": "int32", "doc_id": "int64", "position": "int32", "role": "int8",
            "gen": "int8", "sample": "int16", "source_row": "int64", "logprob": "float32",
            "entropy": "float32"}
SCORE_META = ("logprob", "entropy")   # written after the capture (write_scores), not from the corpus


def meta_batch_dtype(name: str):
    """The dtype a reader's batches carry metadata column `name` in: int64 for the integer
    columns, float32 for the scores (never cast to an integer)."""
    import numpy as np

    return np.float32 if name in SCORE_META else np.int64
BASE_META = ("token_id", "doc_id", "position")  # what every store has; read_row_meta returns these
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
TABLES_DIR = f"{CONTROL_DIR}/tables"     # per-unit object tables (v3), written before their marker
# compacted copies of markers (a cache, see store/commit/markers.py) and void records of stale copies
INDEX_DIR = f"{CONTROL_DIR}/index"
# one record per unit whose objects are all at their zarr keys at their recorded sizes (published.py)
PUBLISHED_DIR = f"{CONTROL_DIR}/published"
PROBE_DIR = f"{CONTROL_DIR}/probe"
LEASE_DIR = f"{CONTROL_DIR}/lease"       # the driver's lease, one create-once object per generation
# A writer puts each shard and metadata chunk under a name of its own attempt, and only the
# writer whose marker was created moves them to the zarr keys: a late writer of the same unit can
# never land bytes on an object a marker vouches for (see FORMAT.md, "Work units and commits").
OBJECTS_DIR = f"{CONTROL_DIR}/objects"
SCRATCH_DIR = f"{CONTROL_DIR}/scratch"   # rows of shards a writer had to evict before completing
# zarr group: stats/<subset>/{mean,var} [points, max width] float64, finalize (a point narrower
# than the widest holds NaN past its own width: FORMAT.md "Per-point widths")
STATS_GROUP = "stats"
STATS_SUBSETS = ("all", "kept")

# Per point array: one object per shard, ~128 MiB logical (~100 MB stored at bf16's ~1.2x).
# At an 8B model's shape (32 points x 4096 wide) 4 MiB shards made ~68 M objects and ~205 M
# requests per 10^9 tokens; 128 MiB makes ~2 M objects. The writer never holds a shard:
# it streams each point's shard object block by block (uploads.py), so the shard size no longer
# bounds memory and memory no longer bounds the shard size.
TARGET_SHARD_BYTES = 128 << 20
TARGET_CHUNK_BYTES = 1 << 20      # inner chunk: the unit a partial read decodes
# A block is the writer's unit of buffering, encoding and (on S3) of multipart parts: whole inner
# chunks, ~8 MiB per point (compressed ~6 MB at bf16's ~1.2x: above S3's 5 MiB minimum part, so
# most blocks go out as one part each), with one block across all points under
# MAX_BLOCK_SET_BYTES. A writer buffers max_open + max_pending block sets per unit in flight.
TARGET_BLOCK_BYTES = 8 << 20
MAX_BLOCK_SET_BYTES = 128 << 20

_POINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[0-9]+)?$")
_ARRAY_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(/[0-9]+)?$")
# An attempt token: what writers make (16 hex digits) or a void record's hash ("h" + 32 hex);
# letters and digits only, so no key built from one can leave its folder.
ATTEMPT = re.compile(r"^[0-9A-Za-z]{1,64}$")


def check_attempt(attempt) -> str:
    if not isinstance(attempt, str) or not ATTEMPT.match(attempt):
        raise ValueError(f"bad attempt token {attempt!r}: 1-64 letters and digits")
    return attempt


def check_rel(rel) -> str:
    """A key relative to a store's root that stays inside it: no absolute path, no `.`/`..`
    segment, no backslash, NUL or other control character (Storage.key refuses the rest)."""
    if not isinstance(rel, str) or rel.startswith("/") or "\\" in rel or any(
            ord(c) < 32 or ord(c) == 127 for c in rel):
        raise ValueError(f"refused store key {rel!r}: not a relative key inside the store")
    if any(part in (".", "..") for part in rel.split("/")):
        raise ValueError(f"refused store key {rel!r}: a '.' or '..' segment would leave its folder")
    return rel
_MARKER = re.compile(r"^unit-(\d{8,})\.(\d+)-(\d+)\.json$")
_VOID = re.compile(r"^void-(\d{8,})\.([0-9A-Za-z]+)\.json$")
_PUBLISHED = re.compile(r"^unit-(\d{8,})\.([0-9A-Za-z]+)\.json$")


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
    return f"{SIDECAR_DIR}/unit-{int(unit_id):08d}.{check_attempt(attempt)}.bin"


def table_key(unit_id: int, attempt: str) -> str:
    """A unit's object table (layout 3): named by attempt like the stats sidecar, so a rewrite
    after `uncommit` writes a new table and never overwrites the one an old index entry names."""
    return f"{TABLES_DIR}/unit-{int(unit_id):08d}.{check_attempt(attempt)}.json.gz"


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
    return f"void-{int(unit_id):08d}.{check_attempt(attempt)}.json"


def void_key(unit_id: int, attempt: str) -> str:
    return f"{INDEX_DIR}/{void_name(unit_id, attempt)}"


def parse_void_name(name: str) -> "tuple[int, str] | None":
    m = _VOID.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def published_key(unit_id: int, attempt: str) -> str:
    """A unit's publish record: every object of attempt `attempt` (its marker's) is at its zarr
    key at its recorded size (published.py). Named by attempt: a rewrite after uncommit needs
    its own."""
    return f"{PUBLISHED_DIR}/unit-{int(unit_id):08d}.{check_attempt(attempt)}.json"


def parse_published_name(name: str) -> "tuple[int, str] | None":
    m = _PUBLISHED.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def lease_key(gen: int) -> str:
    """Generation `gen` of the driver's lease (FORMAT.md "The driver's lease")."""
    return f"{LEASE_DIR}/lease-{int(gen):08d}.json"


def lease_generation(name: str) -> "int | None":
    """The generation of a lease object's name (`lease-00000003.json` -> 3), None for others."""
    if name.startswith("lease-") and name.endswith(".json"):
        try:
            return int(name[len("lease-"):-len(".json")])
        except ValueError:
            return None
    return None


def shard_object_key(point: str, shard: int) -> str:
    return f"{point_path(point)}/c/{int(shard)}/0"


def meta_chunk_key(name: str, shard: int) -> str:
    if name not in ROW_META:
        raise ValueError(f"bad metadata column {name!r}: one of {', '.join(ROW_META)}")
    return f"{name}/c/{int(shard)}"


def attempt_object_key(array_path: str, shard: int, attempt: str) -> str:
    """Where attempt `attempt` writes shard `shard` of the array at `array_path` (a point's path
    or a metadata array's name) before its marker exists."""
    if not isinstance(array_path, str) or not _ARRAY_PATH.match(array_path):
        raise ValueError(f"bad array path {array_path!r}: a point's path or a metadata column")
    return f"{OBJECTS_DIR}/{array_path}/{int(shard)}.{check_attempt(attempt)}"


def parse_attempt_object(name: str) -> "tuple[int, str] | None":
    """(shard, attempt) from an attempt object's file name, None for anything else (temp files)."""
    shard, dot, attempt = name.partition(".")
    if not dot or not shard.isdigit() or not attempt.isalnum():
        return None
    return int(shard), attempt


def scratch_key(unit_id: int, attempt: str, shard: int, a: int, b: int) -> str:
    return (f"{SCRATCH_DIR}/unit-{int(unit_id):08d}.{check_attempt(attempt)}/{int(shard)}."
            f"{int(a)}-{int(b)}.bin")


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


def check_sizes(shard_rows: int | None, chunk_rows: int | None, multiple: int = 1,
                names: tuple[str, str, str] = ("shard_rows", "chunk_rows", "context_size")) -> None:
    """The rule for shard and chunk sizes, the one place it is written, applied where sizes
    enter: `choose_sizes` (every store's sizes pass through it) and the run config's `store`
    section at load (naming its fields in `names`, before anything runs): a shard holds whole contexts
    (shard_rows a multiple of `multiple`, the context size: units are whole contexts that start
    on shard boundaries) and whole inner chunks (chunk_rows divides shard_rows). None: derived."""
    shard_name, chunk_name, multiple_name = names
    m = max(1, int(multiple))
    if shard_rows is not None and shard_rows % m:
        lo, hi = (shard_rows // m) * m, (shard_rows // m + 1) * m
        raise ValueError(f"{shard_name}={shard_rows} is not a multiple of {multiple_name}={m}: use "
                         f"{hi}" + (f" or {lo}" if lo else "") + f", or leave {shard_name} out")
    if shard_rows is not None and chunk_rows is not None and shard_rows % chunk_rows:
        raise ValueError(f"{chunk_name}={chunk_rows} must divide {shard_name}={shard_rows} (a shard "
                         f"holds whole inner chunks): pick a divisor or leave {chunk_name} out")


def choose_sizes(width: int, itemsize: int, n_points: int, *, multiple: int = 1,
                 n_rows: int | None = None, shard_rows: int | None = None,
                 chunk_rows: int | None = None) -> tuple[int, int]:
    """(shard_rows, chunk_rows) for arrays of `width` x `itemsize`-byte rows, `n_points` of them.

    - shard_rows: a multiple of `multiple` (the context size: a unit then holds whole contexts)
      near TARGET_SHARD_BYTES per point (the writer streams shards block by block, so the number
      of points does not shrink them); at most `n_rows` rounded up when the store is known to be
      small, so tiny runs do not make 128 MiB objects of padding. The plan also caps it at the
      unit size (plan.choose_layout).
    - chunk_rows: the largest divisor of shard_rows near TARGET_CHUNK_BYTES (a power of two when
      shard_rows is one; gcd() alone could give 4-row chunks for shard_rows=7812 and per-chunk
      overhead would dominate decoding).
    Explicit values are kept, and the result (explicit and derived values together) is checked
    once, by check_sizes. `n_points` does not enter the sizes.
    """
    row_bytes = max(1, width * itemsize)
    m = max(1, int(multiple))
    if shard_rows is None:
        target = TARGET_SHARD_BYTES / row_bytes
        if m == 1 or (m & (m - 1)) == 0:
            shard_rows = max(m, _pow2_floor(target))
        else:
            shard_rows = m * max(1, int(target // m))
        if n_rows is not None and 0 < n_rows < shard_rows:
            shard_rows = max(m, -(-int(n_rows) // m) * m)
    if chunk_rows is None:
        cap = max(1, TARGET_CHUNK_BYTES // row_bytes)
        chunk_rows = largest_divisor_at_most(int(shard_rows), cap)
        if n_rows is not None and 0 < n_rows < chunk_rows:
            chunk_rows = largest_divisor_at_most(int(shard_rows), int(n_rows))
    # derived sizes obey the rule by construction; an explicit one may not, alone (a shard that
    # is no multiple of `multiple`) or against the other (an explicit chunk, a derived shard)
    check_sizes(shard_rows, chunk_rows, m)
    return int(shard_rows), int(chunk_rows)


def block_rows(shard_rows: int, chunk_rows: int, n_points: int, row_bytes: int,
               context_size: int | None = None) -> int:
    """Rows of a writer's block: a divisor of shard_rows made of whole inner chunks (a block's
    chunks are encoded and appended to the shard object together), about TARGET_BLOCK_BYTES per
    point and at most MAX_BLOCK_SET_BYTES across the points.

    A multiple of the context size when one fits: the capture actor asks the writer for a
    context's rows in place (`reserve`), which a context straddling two blocks cannot have (it
    then pays a second host copy). When no such multiple fits the bound, the smallest one that
    divides the shard is taken if it is at most 2x the bound, else the bound wins (correct, one
    copy more)."""
    sr, cr = int(shard_rows), int(chunk_rows)
    per_row = max(1, int(row_bytes))
    cap = max(1, min(TARGET_BLOCK_BYTES // per_row, MAX_BLOCK_SET_BYTES // (per_row * max(1, n_points))))
    units = sr // cr  # a block is k chunks, k a divisor of the chunks in a shard
    ks = [k for k in range(1, units + 1) if units % k == 0]
    fit = [k for k in ks if k * cr <= cap] or [1]
    c = int(context_size or 1)
    aligned = [k for k in ks if (k * cr) % c == 0]
    best = [k for k in fit if k in aligned]
    if best:
        return max(best) * cr
    if aligned and min(aligned) * cr <= 2 * cap:
        return min(aligned) * cr
    return max(fit) * cr


# what open_store needs in the `harvest` attributes before it trusts a group (FORMAT.md)
REQUIRED_ATTRS = ("points", "width", "n_rows", "shard_rows", "chunk_rows", "dtype", "compression")


def point_widths(h: dict) -> dict[str, int]:
    """point -> its width, from a store's `harvest` attributes: `widths` (layout 4) where given,
    else every point is `width` wide (layouts 2 and 3)."""
    given = h.get("widths") or {}
    return {p: int(given.get(p, h["width"])) for p in h["points"]}


def layout_version(widths: dict[str, int], width: int, values: "Mapping[str, str] | None" = None) -> int:
    """The layout a new store is written at: 5 with any point of 32-bit values, else 4 when
    any point is not `width` wide, else 3."""
    if values:
        return LAYOUT_VERSION_VALUES
    return LAYOUT_VERSION_WIDTHS if any(int(w) != int(width) for w in widths.values()) \
        else LAYOUT_VERSION


def point_values(h: dict) -> dict[str, str]:
    """point -> the type of its values ("int32", "float32") for the points of 32-bit values
    (layout 5, FORMAT.md "Points of 32-bit values"); the other points hold activations."""
    return dict(h.get("values") or {})


def check_group(raw: "bytes | None", url: str, what: str) -> JsonObject:
    """The root `zarr.json` (`raw`, None when absent) of a harvest store of a layout this code
    reads, parsed; anything else is refused with a NotAHarvestStore or UnknownLayoutVersion
    that says what the object at `url` is instead."""
    if raw is None:
        raise NotAHarvestStore(f"{what}: no store at {url} (zarr.json not found); check the "
                               "URL, or create one with create_store")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise NotAHarvestStore(f"{what}: {url}/zarr.json is not JSON; not a harvest store") from None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "group":
        raise NotAHarvestStore(f"{what}: {url} is not a zarr v3 group (zarr_format="
                               f"{meta.get('zarr_format') if isinstance(meta, dict) else None}); "
                               "not a harvest store")
    h = (meta.get("attributes") or {}).get("harvest")
    if not isinstance(h, dict) or h.get("layout") != LAYOUT_NAME:
        raise NotAHarvestStore(f"{what}: {url} is a zarr group but not a harvest activation "
                               f"store (attributes.harvest.layout != {LAYOUT_NAME!r})")
    v = h.get("layout_version")
    if v not in SUPPORTED_LAYOUT_VERSIONS:
        raise UnknownLayoutVersion(
            f"{what}: {url} has layout_version={v!r}; this harvest reads versions "
            f"{list(SUPPORTED_LAYOUT_VERSIONS)}"
            + (" (version 1 stores came from before the streamed data plane: re-harvest them)"
               if v == 1 else ". Upgrade harvest to read it."))
    missing = [k for k in REQUIRED_ATTRS if k not in h]
    if missing:
        raise NotAHarvestStore(f"{what}: {url} harvest attributes lack {', '.join(missing)}")
    check_geometry(h, f"{url}/zarr.json")
    return meta


# A store's geometry is read from its own (untrusted) zarr.json and sizes every allocation a
# reader makes: bounds far above any real store, low enough that none of them exhausts memory.
MAX_POINTS = 1 << 16          # 80 layers x ~30 point kinds is ~2,400
MAX_WIDTH = 1 << 20           # widest real point: an MoE's expert MLP, ~10^5
MAX_SHARD_BYTES = 4 << 30     # one decoded shard of one point (TARGET_SHARD_BYTES is 128 MiB)


def check_geometry(h: dict, where: str) -> None:
    """Points, widths and row counts within the bounds above, each a field named on refusal."""
    from ..errors import RecordError

    def bad(field: str, why: str) -> RecordError:
        return RecordError(f"{where}: field 'attributes.harvest.{field}' {why}; not a store this "
                           "harvest reads (damaged, or not written by harvest)")

    def intval(field: str, v, lo: int, hi: int) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise bad(field, f"is {str(v)[:40]!r}, not an integer in [{lo}, {hi}]")
        return v

    pts = h.get("points")
    if not isinstance(pts, list) or not 1 <= len(pts) <= MAX_POINTS:
        raise bad("points", f"is not a list of 1 to {MAX_POINTS} point names")
    for p in pts:
        try:
            point_path(p)
        except (ValueError, TypeError):
            raise bad("points", f"holds {str(p)[:40]!r}, not a point name") from None
    if len(set(pts)) != len(pts):
        raise bad("points", "names a point twice")
    width = intval("width", h.get("width"), 1, MAX_WIDTH)
    widths = h.get("widths") or {}
    if not isinstance(widths, dict) or set(widths) - set(pts):
        raise bad("widths", "is not {point: width} over the store's points")
    top = max([width] + [intval(f"widths.{p}", w, 1, MAX_WIDTH) for p, w in widths.items()])
    values = h.get("values") or {}
    if not isinstance(values, dict) or set(values) - set(pts) \
            or not set(values.values()) <= set(VALUE_TYPES):
        raise bad("values", f"is not {{point: {' or '.join(VALUE_TYPES)}}} over the store's points")
    intval("n_rows", h.get("n_rows"), 0, CAPACITY_ROWS)
    shard_rows = intval("shard_rows", h.get("shard_rows"), 1, CAPACITY_ROWS)
    chunk_rows = intval("chunk_rows", h.get("chunk_rows"), 1, shard_rows)
    if shard_rows % chunk_rows:
        raise bad("chunk_rows", f"({chunk_rows}) does not divide shard_rows ({shard_rows})")
    if shard_rows * top * 8 > MAX_SHARD_BYTES:
        raise bad("shard_rows", f"x the widest point ({shard_rows} x {top}) is a shard of over "
                  f"{MAX_SHARD_BYTES >> 30} GiB")
