"""Finalize: merged statistics, one compacted commit index, exact array shapes, the run summary.

Everything here streams over the committed units, so its memory is O(points x width) plus a small
record per unit (unit id, stats reference), never the units' partials or markers all at once
(74 GB at 1 B tokens x 30 points when every partial was held). Stored sizes come from the sizes
writers recorded in their markers: no listing of millions of shard objects.
"""

from __future__ import annotations

import json

import numpy as np
import zarr

from . import commits as _commits
from . import layout
from .credentials import redact_attrs
from .errors import StoreError
from .jsonattrs import jsonable as _jsonable, now as _now
from .store import Store


def finalize(store: Store, summary: dict | None = None) -> dict:
    if store.read_only:
        raise StoreError("finalize: store was opened read-only")
    loc = store.location
    P = len(store.points)
    refs: list[tuple[int, dict]] = []
    stored = np.zeros(P, np.int64)
    recorded = True
    rows = 0
    end = 0
    index = _commits.IndexBuilder()
    owner: dict[int, str] = {}   # shard -> attempt of the marker that vouches for it
    meta_owner: dict[int, str] = {}  # row metadata chunk (a shard's, or a unit's) -> attempt
    from .objects import abort_losing_uploads, settle_uploads

    pending = loc.pending_uploads("")  # uploads never completed ({} where objects are moved)
    for m in store.iter_committed():
        if pending:
            settle_uploads(store, pending, m)  # a writer died between its marker and publishing
        for sh in m["shards"]:
            owner[sh["index"]] = m.get("attempt")
            for rec in (sh.get("meta") or {}).values():
                meta_owner[rec.get("chunk", sh["index"])] = m.get("attempt")
        refs.append((m["unit_id"], m["stats"]))
        rows += m["row_end"] - m["row_start"]
        end = max(end, m["row_end"])
        for sh in m["shards"]:
            nb = sh.get("nbytes")
            if nb is None or None in nb:
                recorded = False
            else:
                stored += np.asarray(nb, np.int64)
        index.add(m)
    acc = store.merge_stats(refs)
    merged = {s: acc.moments(s) for s in layout.STATS_SUBSETS}
    for subset, moments in merged.items():
        # one [points, width] array per statistic: 4 arrays, not 4 per point (each array is
        # several requests to create on object storage)
        g = zarr.open_group(store=store._zstore, path=f"{layout.STATS_GROUP}/{subset}", mode="a",
                            zarr_format=3)
        for name, vecs in (("mean", [m.mean for m in moments]), ("var", [m.var for m in moments])):
            a = g.create_array(name, shape=(P, store.width), dtype="float64", chunks=(P, store.width),
                               compressors=None, fill_value=np.nan, overwrite=True,
                               dimension_names=["point", "dim"])
            a[:] = np.stack(vecs)
        g.attrs.update({"points": store.points, "count": [m.count for m in moments],
                        "mean_sq_norm": [m.mean_sq_norm for m in moments],
                        "nonfinite_rows": [m.nonfinite for m in moments]})
    # one index object: status, verify and the reader then read one object instead of a marker each
    _commits.compact_index(loc, index)
    _settle_attempt_objects(store, owner, meta_owner)
    abort_losing_uploads(store, pending, owner, meta_owner)
    logical = rows * store.row_bytes
    if not recorded:  # a marker without sizes (zarr fallback codec): list what it wrote
        stored = np.array([_listed_bytes(store, p) for p in store.points], np.int64)
    stored_total = int(stored.sum())
    ratio = {"overall": round(logical * P / stored_total, 4) if stored_total else None,
             "per_point": {p: (round(logical / int(b), 4) if b else None)
                           for p, b in zip(store.points, stored)},
             "logical_bytes": logical * P, "stored_bytes": stored_total}
    if end and end < store.n_rows:
        _shrink(store, end)
    attrs_update = {
        "summary": redact_attrs(_jsonable(summary or {}, "finalize summary"), loc.storage_options),
        "stats": {p: merged["all"][i].summary() for i, p in enumerate(store.points)},
        "stats_kept": {p: merged["kept"][i].summary() for i, p in enumerate(store.points)},
        "compression_ratio": ratio,
        "finalized_at": _now(),
        "committed_rows": rows,
    }
    g = zarr.open_group(store=store._zstore, mode="r+", zarr_format=3)
    h = dict(g.attrs["harvest"])
    h["n_rows"] = store.n_rows
    g.attrs.update({**attrs_update, "harvest": h})
    store._meta["attributes"].update({**attrs_update, "harvest": h})
    return {"committed_units": len(refs), "committed_rows": rows, "compression_ratio": ratio,
            "stats": attrs_update["stats"], "stats_kept": attrs_update["stats_kept"]}


def _settle_attempt_objects(store: Store, points_owner: dict, meta_owner: dict) -> None:
    """Objects still under an attempt's name: a committed attempt's are published (its writer
    died between its marker and the move), a losing attempt's of a committed shard are garbage
    and removed. Those of uncommitted shards stay (a writer may still be at work on them)."""
    from .objects import attempt_objects

    loc = store.location
    for arr, objs in attempt_objects(loc).items():
        owner = meta_owner if arr in layout.ROW_META else points_owner  # chunks of a unit: by chunk
        for key, shard, attempt, _ in objs:
            if shard not in owner:
                continue
            if attempt == owner[shard]:
                dst = layout.meta_chunk_key(arr, shard) if arr in store.meta_columns else \
                    f"{arr}/c/{int(shard)}/0"
                loc.move(key, dst)
            else:
                loc.delete(key)


def _shrink(store: Store, n_rows: int) -> None:
    """Arrays sized for a capacity become exactly the rows committed. Only zarr.json changes:
    every committed object lies inside the new shape and nothing outside it was ever written
    (zarr's own resize would walk every chunk key of the old shape to delete it: 2^40 rows)."""
    loc = store.location
    for path in [layout.point_path(p) for p in store.points] + list(store.meta_columns):
        key = f"{path}/zarr.json"
        meta = json.loads(loc.read_bytes(key))
        meta["shape"] = [int(n_rows)] + list(meta["shape"][1:])
        loc.write_bytes(key, json.dumps(meta, indent=2).encode())
    store.n_rows = int(n_rows)
    store._h["n_rows"] = int(n_rows)
    store._arrays.clear()  # cached arrays and codecs know the old shape


def _listed_bytes(store: Store, point: str) -> int:
    found = store.location.list_tree(f"{layout.point_path(point)}/c")
    return sum(size for path, size in found.items() if ".tmp-" not in path)
