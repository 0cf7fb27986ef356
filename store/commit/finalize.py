"""Finalize: merged statistics, one compacted commit index, exact array shapes, the run summary.

Everything here streams over the committed units, so its memory is O(points x width) plus a small
record per unit (unit id, stats reference), never the units' partials or markers all at once
(74 GB at 1 B tokens x 30 points when every partial was held). Stored sizes come from the sizes
writers recorded in their markers (per point per unit from layout 3: no object table is read):
no listing of millions of shard objects.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
import zarr

from . import markers as _commits
from ..format import layout
from .. import card as _card
from ..storage.credentials import redact_attrs
from . import published as _published
from ..errors import DataIntegrityError, StoreError
from ..format.jsonattrs import jsonable as _jsonable, now as _now
from .objects import abort_losing_uploads, attempt_objects
from .records import Marker, StatsRef
from ..format.jsonattrs import JsonObject

if TYPE_CHECKING:
    from .view import StoreView


def plan_gap(store: StoreView) -> "str | None":
    """Why the store's plan is not fully committed (None when it is, or when it has no plan):
    finalize shrinks every array to the committed rows, which a resume could not write past."""
    plan = store.ledger.plans.read()
    units = plan.units
    if not units and not plan.final:
        return None   # no plan recorded (tools, tests): every marker counts, as verify says
    rows = {u.unit_id: (u.row_start, u.row_end) for u in units}
    done = {n.unit_id for n in store.ledger.marker_names() if rows.get(n.unit_id) == n.rows}
    missing = sorted(set(rows) - done)
    if not missing and plan.final:
        return None
    why = [f"{len(missing)} of its {len(rows)} planned units are not committed (e.g. "
           f"{missing[:10]})"] if missing else []
    if not plan.final:
        why.append("its plan is not final (the corpus was not read to its end)")
    return " and ".join(why)


def finalize(store: StoreView, summary: dict | None = None) -> JsonObject:
    """Publish and check what is committed (published.settle), then finalize: refused while
    the plan is not fully committed, or while a committed unit's data is gone or damaged."""
    if store.read_only:
        raise StoreError("finalize: store was opened read-only")
    gap = plan_gap(store)
    if gap is not None:
        raise StoreError(
            f"finalize: {store.url} is not finished: {gap}. Finalizing would shrink every array "
            "to the committed rows and the resume could not write the rest: re-run the harvest "
            "to finish it (it finalizes at the end); `harvest finalize URL` publishes what is "
            "committed without finalizing")
    settled = _published.settle(store)
    text = _published.settle_text(settled, store.url)
    if text is not None:
        raise DataIntegrityError(f"finalize: {text}")
    loc = store.location
    P = len(store.points)
    refs: "list[tuple[int, StatsRef | None]]" = []
    stored = np.zeros(P, np.int64)
    recorded = True
    rows = 0
    end = 0
    index = _commits.IndexBuilder()
    owner = _Owners(store.shard_rows)   # shard -> attempt of the marker that vouches for it
    # row metadata chunk (a shard's, or a unit's: meta_chunk_rows) -> attempt
    codec = store.meta_codec("token_id")  # None: a codec chain harvest does not write (per shard)
    meta_owner = _Owners(codec.chunk if codec is not None else store.shard_rows)
    # uploads never completed ({} where objects are moved): after settle published every
    # committed unit, those left are a losing attempt's (aborted below) or an unfinished writer's
    pending = loc.pending_uploads("")
    for m in store.ledger.iter_committed():
        owner.add(m)
        meta_owner.add(m)
        refs.append((m.unit_id, m.stats))
        rows += m.n_rows
        end = max(end, m.row_end)
        nb = _marker_stored(m, P)
        if nb is None:
            recorded = False
        else:
            stored += nb
        index.add(m)
    acc = store.merge_stats(refs)
    merged = {s: acc.moments(s) for s in layout.STATS_SUBSETS}
    for subset, moments in merged.items():
        # one [points, max width] array per statistic: 4 arrays, not 4 per point (each array is
        # several requests to create on object storage); a narrower point's row is NaN past its
        # width (layout 4, FORMAT.md "Per-point widths")
        g = zarr.open_group(store=store.zarr_store, path=f"{layout.STATS_GROUP}/{subset}", mode="a",
                            zarr_format=3)
        for name, vecs in (("mean", [m.mean for m in moments]), ("var", [m.var for m in moments])):
            W = store.max_width
            a = g.create_array(name, shape=(P, W), dtype="float64", chunks=(P, W),
                               compressors=None, fill_value=np.nan, overwrite=True,
                               dimension_names=["point", "dim"])
            full = np.full((P, W), np.nan)
            for i, v in enumerate(vecs):
                full[i, :v.shape[0]] = v
            a[:] = full
        g.attrs.update({"points": store.points, "count": [m.count for m in moments],
                        "mean_sq_norm": [m.mean_sq_norm for m in moments],
                        "nonfinite_rows": [m.nonfinite for m in moments]})
    # one index object: status, verify and the reader then read one object instead of a marker each
    _commits.compact_index(loc, index)
    _settle_attempt_objects(store, owner, meta_owner)
    abort_losing_uploads(store, pending, owner, meta_owner)
    # logical bytes per point: rows x its own stored columns (fp8: + the scale) x itemsize
    logical = [rows * store.point_row_width(p) * store.np_dtype.itemsize for p in store.points]
    if not recorded:  # a marker without sizes (zarr fallback codec): list what it wrote
        stored = np.array([_listed_bytes(store, p) for p in store.points], np.int64)
    stored_total = int(stored.sum())
    ratio = {"overall": round(sum(logical) / stored_total, 4) if stored_total else None,
             "per_point": {p: (round(lg / int(b), 4) if b else None)
                           for p, lg, b in zip(store.points, logical, stored)},
             "logical_bytes": sum(logical), "stored_bytes": stored_total}
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
    g = zarr.open_group(store=store.zarr_store, mode="r+", zarr_format=3)
    h = dict(g.attrs["harvest"])
    h["n_rows"] = store.n_rows
    g.attrs.update({**attrs_update, "harvest": h})
    store.note_finalized({**attrs_update, "harvest": h})
    _card.write_card(store)  # README.md from the attributes just written (card.py)
    return {"committed_units": len(refs), "committed_rows": rows, "compression_ratio": ratio,
            "stats": attrs_update["stats"], "stats_kept": attrs_update["stats_kept"]}


def _marker_stored(m: Marker, n_points: int) -> "np.ndarray | None":
    """Stored bytes per point of one unit, from its marker (layout 3 sums them per point; a
    layout-2 marker lists them per shard); None where a writer recorded no size."""
    if m.stored_bytes is not None:
        nb = m.stored_bytes
        return None if None in nb else np.asarray(nb, np.int64)
    out = np.zeros(n_points, np.int64)
    for sh in m.shards or ():
        nb = sh.nbytes
        if nb is None or None in nb:
            return None
        out += np.asarray(nb, np.int64)
    return out


class _Owners:
    """shard -> attempt of its committed unit, one entry per unit (shards come from the row
    range): a dict per shard was 2 M entries at 1 B tokens of an 8B model."""

    def __init__(self, shard_rows: int):
        # rows per chunk: shards for point objects, the metadata chunk size for row metadata
        self.shard_rows, self._units = shard_rows, []

    def add(self, m: Marker) -> None:
        self._units.append((m.row_start // self.shard_rows, -(-m.row_end // self.shard_rows),
                            m.attempt))

    def _index(self):
        if not hasattr(self, "_first"):
            self._units.sort(key=lambda u: u[:2])
            self._first = np.array([u[0] for u in self._units], np.int64)
        return self._first

    def __contains__(self, shard: int) -> bool:
        return self._find(shard) is not None

    def __getitem__(self, shard: int):
        u = self._find(shard)
        if u is None:
            raise KeyError(shard)
        return u[2]

    def _find(self, shard: int):
        i = int(np.searchsorted(self._index(), shard, side="right")) - 1
        return self._units[i] if i >= 0 and shard < self._units[i][1] else None


def _settle_attempt_objects(store: StoreView, points_owner, meta_owner) -> None:
    """Objects still under an attempt's name: a committed attempt's are published (its writer
    died between its marker and the move), a losing attempt's of a committed shard are garbage
    and removed. Those of uncommitted shards stay (a writer may still be at work on them)."""
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


def _shrink(store: StoreView, n_rows: int) -> None:
    """Arrays sized for a capacity become exactly the rows committed (or, from `unfinalize`,
    back to the capacity). Only zarr.json changes:
    every committed object lies inside the new shape and nothing outside it was ever written
    (zarr's own resize would walk every chunk key of the old shape to delete it: 2^40 rows)."""
    loc = store.location
    for path in [layout.point_path(p) for p in store.points] + list(store.meta_columns):
        key = f"{path}/zarr.json"
        meta = json.loads(loc.read_bytes(key))
        meta["shape"] = [int(n_rows)] + list(meta["shape"][1:])
        loc.write_bytes(key, json.dumps(meta, indent=2).encode())
    store.note_resized(n_rows)


FINALIZE_ATTRS = ("summary", "stats", "stats_kept", "compression_ratio", "finalized_at",
                  "committed_rows")


def unfinalize(store: StoreView, capacity_rows: int) -> bool:
    """Undo a finalize that shrank a store whose plan was not fully committed (the old
    `Store.finalize` allowed it): every array back to `capacity_rows` (zarr.json only) and the
    finalize attributes dropped, so the resume can write its remaining units. Returns whether
    anything changed. Driver only (it alone writes zarr.json)."""
    if store.read_only:
        raise StoreError("unfinalize: store was opened read-only")
    if store.n_rows >= capacity_rows and not any(k in store.attributes for k in FINALIZE_ATTRS):
        return False
    if store.n_rows < capacity_rows:
        _shrink(store, capacity_rows)   # only zarr.json: no object lies past the old shape
    g = zarr.open_group(store=store.zarr_store, mode="r+", zarr_format=3)
    h = dict(g.attrs["harvest"])
    h["n_rows"] = store.n_rows
    keep = {k: v for k, v in dict(g.attrs).items() if k not in FINALIZE_ATTRS}
    keep["harvest"] = h
    g.attrs.put(keep)   # the whole attribute set at once (update merges: keys would stay)
    store.note_unfinalized(FINALIZE_ATTRS, h)
    return True


def _listed_bytes(store: StoreView, point: str) -> int:
    found = store.location.list_tree(f"{layout.point_path(point)}/c")
    return sum(size for path, size in found.items() if ".tmp-" not in path)
