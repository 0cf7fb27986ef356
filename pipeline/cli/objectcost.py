"""What a run's store layout costs on object storage: objects, their sizes, requests, for `plan`.

Why it is counted: at an 8B model's shape (32 layers x 4096 wide) a layout of 4 MiB shards makes
~68 M objects per 10^9 tokens, data objects of ~3 MB, 6 M row-metadata objects of 2-4 KiB and
markers of half a megabyte, and nothing would say so before the run. Layout 3 streams ~128 MiB shards, chunks row
metadata per unit and moves the per-shard records into a per-unit object table, so markers are
~1 KB whatever the shape (`table_bytes` says the table's). Every figure here is counted from the
code that writes the store, not from copies of its rules: `layout.ROW_META` (the base columns,
`role` too for chat input,
`gen` for generation) for the objects of a shard, `layout.block_rows` and
`objects.writes_per_object` for the requests per streamed object (start, parts, completion),
`markersize.marker_size` (the real marker builder) for the marker and its object table, and
`commits.index_batch` for the index, so the plan follows the layout when the layout changes.

Counted (FORMAT.md): per shard, one object per point; per unit, one chunk per row-metadata
column (stores the pipeline creates), a stats sidecar, an object table and a marker; the index compacted into one segment by finalize. The few
dozen fixed objects of a store (zarr.json nodes, the plan, finalize's statistics) are not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...store import (backend_for, BASE_META, block_rows, choose_sizes, index_batch,
                           marker_size, ROW_META, table_size, THROTTLE_BUDGET_S, writes_per_object)

# Every layout is priced as it would be on S3, the object store whose request limits and part
# sizes are stated (its backend class holds them): a local store may move there, and the plan
# names those limits.
PRICED_ON = backend_for("s3://")
_LIMITS = PRICED_ON.request_limits
if _LIMITS is None:
    raise ImportError(f"{PRICED_ON.__name__} states no request limits to price a layout at")
S3_WRITES_PER_PREFIX = _LIMITS.writes_per_second_per_prefix
S3_READS_PER_PREFIX = _LIMITS.reads_per_second_per_prefix
LIST_PAGE_KEYS = _LIMITS.list_page_keys
# Below ~8 MB an object's PUT/GET is dominated by per-request latency, not bytes (S3's own advice
# is 8-16 MB parts). Only said when a run writes this many of them: a small run's few small
# objects cost seconds in all.
MIN_DATA_OBJECT_BYTES = 8_000_000
SMALL_OBJECTS_MIN_COUNT = 10_000
# A marker is read by status, verify, finalize and every reader (copied into the index too).
MAX_MARKER_BYTES = 64_000
# Past ~10 M objects, listing, lifecycle rules, copying and deleting a store are slow and costly.
MAX_OBJECTS = 10_000_000
# Per unit besides its objects: the stats sidecar PUT, and the marker's conditional PUT (a server
# without If-None-Match takes HEAD + PUT + GET, see FORMAT.md). Reads: the writer looks for
# another writer's marker (one GET) before each shard's upload and once before its own marker.
SIDECAR_WRITES = 1
TABLE_WRITES = 1   # the unit's object table (layout 3), one PUT before its marker
MARKER_WRITES = 1
KNOWN_LIMIT = "a known limit of the layout (issue 24)"


def index_requests(units: int) -> int:
    """Index requests over a run of `units`: each segment is a LIST (for its sequence number) and
    a PUT (commits.write_index_segment), one per `index_batch` new markers; finalize writes one
    compacted segment and deletes the others."""
    n = segments = 0
    while n < units:
        n += index_batch(n)
        segments += 1
    return 2 * segments + (1 + segments if units else 0)


def layout_cost(*, points: list, width: int, itemsize: int, shard_rows: int, unit_rows: int,
                tokens: "int | None", ratio: float, rate: "float | None",
                object_store: bool, roles: bool = False, generated: bool = False,
                samples: bool = False, point_widths: "dict | None" = None,
                scores: tuple = ()) -> dict:
    """The `layout` block of `harvest plan --json` (see the module docstring); `tokens` is the
    whole budget (None: per-unit figures only), `rate` the aggregate tok/s to price requests at.
    `width` is the widest point's stored columns (what sizes shards and blocks); `point_widths`
    (point -> its stored columns, where points differ) adds `per_point`: each point's row,
    shard object and total bytes and its objects."""
    # `roles`: a chat store's `role` column; `generated`: a generation store's `gen` column;
    # `samples`: the `sample` column of n > 1 samples per prompt
    extra = (("role",) if roles else ()) + (("gen",) if generated else ()) + \
        (("sample",) if samples else ()) + tuple(scores)   # scores: logprob / entropy columns
    columns = {c: ROW_META[c] for c in BASE_META + extra}
    P, M = len(points), len(columns)
    row_bytes = width * itemsize
    shards_per_unit = unit_rows // shard_rows
    data_logical = shard_rows * row_bytes
    data_stored = int(data_logical / ratio)
    # row metadata: one chunk per unit and column (the pipeline creates stores with
    # meta_chunk_rows = unit_rows), at its logical size: an upper bound (doc_id and position
    # compress well, token ids little)
    meta_by_column = {c: unit_rows * np.dtype(dt).itemsize for c, dt in columns.items()}
    meta_stored = round(sum(meta_by_column.values()) / M)
    # requests per streamed object: start + parts + completion on object storage (parts are
    # compressed blocks gathered to the S3 backend's part_min_bytes, 16 MiB); a local store renames (0 requests, but
    # the figure stays the object store's, what the layout would cost there)
    part_min = PRICED_ON.part_min_bytes
    chunk = choose_sizes(width, itemsize, P, shard_rows=shard_rows)[1]
    block_stored = int(block_rows(shard_rows, chunk, P, row_bytes) * row_bytes / ratio)
    per_data = writes_per_object(data_stored, part_min, block_stored)
    per_meta = writes_per_object(meta_stored, part_min, meta_stored)
    units = -(-tokens // unit_rows) if tokens else None
    shards = -(-tokens // shard_rows) if tokens else None
    last = max(0, (units or 1) - 1)  # the last unit has the longest numbers in its marker
    marker: dict[str, Any] = dict(points=points, unit_id=last, row_start=last * unit_rows, shard_rows=shard_rows,
                  row_bytes=row_bytes, object_bytes=data_stored, meta_bytes=meta_by_column)
    marker_bytes = marker_size(n_shards=shards_per_unit, **marker)
    marker_one = marker_size(n_shards=1, **marker)
    writes = {"objects": shards_per_unit * P * per_data + M * per_meta, "sidecar": SIDECAR_WRITES,
              "table": TABLE_WRITES,
              "marker": MARKER_WRITES,
              "index": round(index_requests(units) / units, 3) if units else 0.0}
    reads = shards_per_unit + 1
    writes_unit = sum(writes.values())
    n_obj = shards_per_unit * P + M
    # the v3 publish path (objects.py, FORMAT.md): each object a multipart upload started and fed
    # its parts during the write; after the unit's object table and its marker (a conditional
    # PUT: the commit), CompleteMultipartUpload publishes each object at its zarr key
    by_request = {"create_multipart_upload": n_obj,
                  "upload_part": shards_per_unit * P * (per_data - 2) + M * (per_meta - 2),
                  "complete_multipart_upload": n_obj, "put_stats_sidecar": SIDECAR_WRITES,
                  "put_object_table": TABLE_WRITES, "put_marker": MARKER_WRITES,
                  "index": writes["index"]}
    out: dict[str, Any] = {
        "tokens": tokens, "units": units, "shards": shards, "shards_per_unit": shards_per_unit,
        "points": P, "meta_columns": M, "object_store": object_store,
        "objects": None, "objects_by_kind": None,
        "data_object_bytes": data_stored, "data_object_bytes_logical": data_logical,
        "compression": ratio, "meta_object_bytes": meta_stored,
        "writes_per_data_object": per_data, "part_min_bytes": part_min,
        "marker_bytes": marker_bytes,
        "table_bytes": table_size(n_shards=shards_per_unit, **marker),
        "marker_bytes_per_shard_point": round((marker_bytes - marker_one)
                                              / max(1, shards_per_unit - 1) / P, 1),
        "requests_per_unit": round(writes_unit + reads, 3),
        "writes_per_unit": {**writes, "total": round(writes_unit, 3)}, "reads_per_unit": reads,
        "writes_per_unit_by_request": by_request,
        "rate_tokens_per_second": rate, "writes_per_second": None, "reads_per_second": None,
        "readback_reads_per_second": None,
        "limits": {"writes_per_second_per_prefix": S3_WRITES_PER_PREFIX,
                   "reads_per_second_per_prefix": S3_READS_PER_PREFIX,
                   "min_data_object_bytes": MIN_DATA_OBJECT_BYTES,
                   "max_marker_bytes": MAX_MARKER_BYTES, "max_objects": MAX_OBJECTS},
    }
    if tokens:
        kinds = {"data": shards * P, "meta": units * M, "sidecars": units, "tables": units,
                 "markers": units,
                 "index": 1}
        out["objects"], out["objects_by_kind"] = sum(kinds.values()), kinds
        out["list_pages"] = -(-out["objects"] // LIST_PAGE_KEYS)
    if rate:
        per_s = rate / unit_rows  # units per second
        out["writes_per_second"] = round(writes_unit * per_s)
        out["reads_per_second"] = round(reads * per_s)
        # a reader taking every point back at the capture rate: one GET per object
        out["readback_reads_per_second"] = round(shards_per_unit * P * per_s)
    if point_widths:
        out["per_point"] = {
            p: {"width": int(w), "row_bytes": int(w) * itemsize,
                "data_object_bytes_logical": shard_rows * int(w) * itemsize,
                "data_object_bytes": int(shard_rows * int(w) * itemsize / ratio),
                "bytes_logical": tokens * int(w) * itemsize if tokens else None,
                "objects": shards}
            for p, w in point_widths.items()}
    out["warnings"] = layout_warnings(out, width=width, itemsize=itemsize, shard_rows=shard_rows,
                                      unit_rows=unit_rows, marker_one=marker_one)
    return out


def layout_warnings(c: dict, *, width: int, itemsize: int, shard_rows: int, unit_rows: int,
                    marker_one: int) -> list[str]:
    """One line per object-store limit the layout exceeds, naming the limit and what to change
    (a config knob where one exists, else that it is a known limit). Request rates are only
    checked at the planned rate for every store: a local store is priced as it would be on object
    storage (the warning says so), since the plan names those limits and stores move."""
    out = []
    P, size = c["points"], _size
    w = c["writes_per_second"]
    where = "" if c["object_store"] else "on object storage (this store is local), "
    parts = (c.get("writes_per_unit_by_request") or {}).get("upload_part", 0)
    w_unit = c["writes_per_unit"]["total"]
    if w and w > S3_WRITES_PER_PREFIX:
        out.append(
            f"{where}~{w:,} write requests/s at {c['rate_tokens_per_second']:,.0f} tok/s "
            f"({c['writes_per_unit']['total']:,.0f} per unit of {unit_rows:,} tokens: each of its "
            f"{c['shards_per_unit'] * P + c['meta_columns']:,} objects is a multipart upload: "
            f"start, parts, completion; {parts:,} of them are parts of ~{_size(c['part_min_bytes'])}, "
            "S3's minimum, which the writer uploads as soon as a point's compressed rows reach it) "
            f"is over S3's ~{S3_WRITES_PER_PREFIX:,} writes/s per prefix "
            "(a store is one prefix until S3 splits it, with 503 SlowDown meanwhile; each "
            "throttled request is retried after a backoff all writers of a process share, for up "
            f"to {THROTTLE_BUDGET_S / 60:.0f} min, and counted in the run summary's "
            "throttled_requests: it costs time, never a re-captured unit): "
            + ("run fewer actors per store or capture fewer points (the part size is fixed: "
               f"{KNOWN_LIMIT.replace('issue 24', 'issue 38')})" if parts * 2 > w_unit else
               "raise store.shard_rows (fewer, larger objects), capture fewer points, or run "
               "fewer actors"))
    r = c["reads_per_second"]
    if r and r > S3_READS_PER_PREFIX:
        out.append(
            f"{where}the writers' ~{r:,} GETs/s at {c['rate_tokens_per_second']:,.0f} tok/s (each "
            f"looks for another writer's marker, {c['reads_per_unit']} per unit) are over S3's "
            f"~{S3_READS_PER_PREFIX:,} reads/s per prefix: raise store.unit_tokens (fewer units) "
            "or run fewer actors")
    r = c["readback_reads_per_second"]
    if r and r > S3_READS_PER_PREFIX:
        out.append(
            f"{where}reading every point back at the capture rate takes ~{r:,} GETs/s, over S3's "
            f"~{S3_READS_PER_PREFIX:,} reads/s per prefix: raise store.shard_rows or read fewer "
            "points at a time")
    data, n_data = c["data_object_bytes"], (c["objects_by_kind"] or {}).get("data")
    if data < MIN_DATA_OBJECT_BYTES and (n_data or 0) >= SMALL_OBJECTS_MIN_COUNT:
        rows = _rows_for(MIN_DATA_OBJECT_BYTES * c["compression"], width * itemsize, shard_rows)
        out.append(
            f"data objects of ~{size(data)} stored ({size(c['data_object_bytes_logical'])} "
            f"logical: {shard_rows:,} rows x {width} x {itemsize} B, {n_data:,} of them) are too "
            "small for object storage: per-request overhead dominates (aim for >= "
            f"{size(MIN_DATA_OBJECT_BYTES)}): set store.shard_rows={rows:,} (the writer streams "
            "shards block by block, so larger shards cost no memory) or raise store.unit_tokens "
            "(a shard never holds more rows than a unit)")
    m = c["marker_bytes"]
    if m > MAX_MARKER_BYTES:
        per = c["marker_bytes_per_shard_point"] * P
        fit = int((MAX_MARKER_BYTES - marker_one) // per) + 1 if per else 0
        knob = (f"lower store.unit_tokens to ~{fit * shard_rows:,} ({fit} shards per unit, so "
                "more, smaller markers)" if fit >= 1 else "capture fewer points")
        out.append(
            f"commit markers of ~{size(m)} (~{c['marker_bytes_per_shard_point']:g} B per shard x "
            f"point, {c['shards_per_unit']:,} shards x {P} points) are over "
            f"{size(MAX_MARKER_BYTES)}: status, verify, finalize and every reader load them all; "
            f"{knob}; a record per shard x point in the marker is {KNOWN_LIMIT}")
    n = c["objects"]
    if n and n > MAX_OBJECTS:
        k = c["objects_by_kind"]
        out.append(
            f"{n:,} objects for {c['tokens']:,} tokens ({k['data']:,} data, {k['meta']:,} row "
            f"metadata of ~{size(c['meta_object_bytes'])}, {k['markers']:,} markers, "
            f"{k['sidecars']:,} stats sidecars) are over {MAX_OBJECTS / 1e6:g} M: listing "
            f"({c['list_pages']:,} LIST pages of {LIST_PAGE_KEYS:,} keys), copying, deleting and "
            "lifecycle rules get slow and costly; larger shards (store.shard_rows), fewer "
            "points or fewer tokens cut it")
    return out


def _rows_for(logical_bytes: float, row_bytes: int, shard_rows: int) -> int:
    """The smallest shard of `shard_rows` x 2^k rows (so still whole contexts) holding
    `logical_bytes`."""
    rows = max(1, shard_rows)
    while rows * row_bytes < logical_bytes:
        rows *= 2
    return rows


def _size(n: float) -> str:
    from .text import size

    return size(n)


__all__ = ["layout_cost", "layout_warnings", "index_requests", "S3_WRITES_PER_PREFIX",
           "S3_READS_PER_PREFIX", "MIN_DATA_OBJECT_BYTES", "MAX_MARKER_BYTES", "MAX_OBJECTS"]
