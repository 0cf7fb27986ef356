"""verify: is every planned row committed exactly once, and is what the markers vouch for there?

Default mode: the plan against the markers (one listing; a marker whose row range disagrees with
the plan never counts), each marker against its own region, and each committed unit's publish
record (one listing, published.py: every object of the unit was found at its key at its recorded
size when it was published); units without one fail, the first few diagnosed pending, gone or
damaged. Objects mode adds every committed object (shards and metadata chunks, published or
still under their attempt's name) present at the size its writer recorded, from one listing per
array (temp files of failed writes are not objects).
Deep mode reads every committed byte back: each object against the CRC32C its marker records,
the decoded rows against the rows' CRC32C, each unit's metadata against its digests, each stats
sidecar against its sha256; it reports how many objects and bytes it checked.

Layout 3 keeps a unit's per-shard records in its object table (tables.py): default mode checks the
marker's reference (its shard count) and reads no table; objects and deep mode read each unit's
table as they reach the unit (checked against the marker's sha256 and shard list; a missing or
damaged one is reported with the repair), one unit at a time.

A damaged store is what verify exists for, so nothing in it may crash: every check runs guarded,
and whatever it cannot read is reported as damage (exit 1 in the CLI), never as a traceback.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import markers as _commits
from ..format import layout
from ..stats import moments as _moments
from . import published as _published
from .objects import attempt_objects, read_meta, read_point
from .records import Marker, ShardRecord
from .tables import unit_shards
from .plan import check_units

if TYPE_CHECKING:
    from .view import StoreView

_MAX_ERRORS = 200
_DIAGNOSED = 5   # unpublished units whose objects verify's default mode stats (the first few)


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What Store.verify found. A store is complete when `ok` and no unit is missing."""

    ok: bool
    """No error found (a store with planned units not committed yet can be ok)."""
    errors: list[str]
    """What is wrong, each naming the unit or array and the repair (at most ~200)."""
    n_rows: int
    planned_units: int
    committed_units: int
    missing_units: list[int]
    """Planned units with no commit marker (a resumed run writes them)."""
    planned_rows: int
    committed_rows: int
    committed_fraction: float
    unpublished_units: int
    """Committed units without a publish record (their objects not yet checked at their keys:
    `harvest finalize` publishes or diagnoses them)."""
    deep_checked: bool
    """Every byte was read back and checked against the markers' digests (deep=True)."""
    checked: dict[str, int]
    """Counts of what was checked: markers, tables, objects, shards, meta_chunks, sidecars,
    bytes_read."""
    stored_bytes: int

    @property
    def complete(self) -> bool:
        """Every planned row committed and nothing wrong: `harvest verify` exits 0."""
        return self.ok and not self.missing_units

    def as_dict(self) -> dict[str, Any]:
        """JSON-able (`harvest verify --json`)."""
        return asdict(self)


def _guard(errors: list[str], what: str, fn, default=None):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- damage is reported, never a crash
        errors.append(f"{what}: {type(e).__name__}: {e}")
        return default


def verify(store: StoreView, deep: bool = False, objects: bool = False) -> VerifyReport:
    errors: list[str] = []
    checked: dict = {"markers": 0, "tables": 0, "objects": 0, "shards": 0, "meta_chunks": 0, "sidecars": 0,
                     "bytes_read": 0}
    plan_units = _guard(errors, "the plan cannot be read", store.ledger.plan_units, []) or []
    plan = {u.unit_id: u for u in plan_units}
    if not plan and not errors:
        errors.append("no plan recorded (write_plan was never called)")
    try:
        check_units(plan_units, store.shard_rows, store.n_rows)
    except Exception as e:  # noqa: BLE001
        errors.append(f"plan against the store's n_rows={store.n_rows}: {e}")
    names = _guard(errors, "the commit markers cannot be listed", store.ledger.marker_names, []) or []
    matching = []
    seen_ids: dict[int, int] = {}
    for n in names:
        seen_ids[n.unit_id] = seen_ids.get(n.unit_id, 0) + 1
        u = plan.get(n.unit_id)
        if u is None:
            if plan:
                errors.append(f"unit {n.unit_id} is committed but not in the plan")
            else:
                matching.append(n)
        elif (u.row_start, u.row_end) != n.rows:
            errors.append(f"unit {n.unit_id} committed rows [{n[1]},{n[2]}) but the plan says "
                          f"[{u.row_start},{u.row_end}): that marker does not count")
        else:
            matching.append(n)
    dup = sorted(uid for uid, c in seen_ids.items() if c > 1)
    if dup:
        errors.append(f"units with more than one commit marker: {dup[:20]}")
    committed_ids = {n.unit_id for n in matching}
    missing_units = sorted(set(plan) - committed_ids)
    if missing_units:
        errors.append(f"{len(missing_units)} planned units are not committed (e.g. "
                      f"{missing_units[:10]}); run the harvest again to resume them")
    planned_rows = sum(u.n_rows for u in plan_units)
    committed_rows = sum(n[2] - n[1] for n in matching)
    if store.summary is not None and store.attributes.get("committed_rows") not in (None, committed_rows):
        errors.append(f"the store was finalized with {store.attributes['committed_rows']} committed "
                      f"rows, its markers now cover {committed_rows}: markers were lost or added since")
    _guard(errors, "array metadata", lambda: _check_arrays(store, errors))
    want = _Wanted(store.points, store.meta_columns) if objects else None
    records = _guard(errors, "the publish records cannot be listed",
                     lambda: _published.published_units(store.location), {})
    unpublished: list[Marker] = []   # the first few markers, for a diagnosis
    n_unpublished = 0
    stored = 0
    markers = _guard(errors, "the commit markers cannot be read",
                     lambda: store.ledger.iter_committed(matching, planned=True), iter(()))
    got_ids = set()
    while True:
        m = _guard(errors, "a commit marker cannot be read", lambda: next(markers, None))
        if m is None:
            break
        checked["markers"] += 1
        got_ids.add(m.unit_id)
        errs = _guard(errors, f"marker of unit {m.unit_id}", lambda m=m: _check_marker(store, m), [])
        errors += errs
        if errs:
            continue
        if want is not None or deep:   # the unit's table: one at a time, never all at once
            recs = _guard(errors, f"unit {m.unit_id}", lambda m=m: unit_shards(store, m))
            if recs is None:
                continue
            checked["tables"] += m.shards is None
            errs = _check_records(store, m, recs)
            errors += errs
            if errs:
                continue
            if want is not None:
                for sh in recs:
                    want.add(m, sh)
        if records is not None and not _published.is_published(records, m):
            n_unpublished += 1
            if len(unpublished) < _DIAGNOSED:
                unpublished.append(m)
        stored += m.total_stored_bytes() or 0
        if deep:
            errors += _deep_unit(store, m, checked)
        if len(errors) > _MAX_ERRORS:
            break
    lost = sorted(committed_ids - got_ids)
    if lost and len(errors) <= _MAX_ERRORS:
        errors.append(f"markers of units {lost[:10]} are listed but cannot be read (deleted or not JSON)")
    if n_unpublished:
        errors += _unpublished_errors(store, unpublished, n_unpublished)
    if objects and len(errors) <= _MAX_ERRORS:
        _guard(errors, "object listing", lambda: errors.extend(_check_objects(store, want, checked)))
    return VerifyReport(
        ok=not errors, errors=errors[:_MAX_ERRORS + 10], n_rows=store.n_rows,
        planned_units=len(plan), committed_units=len(committed_ids),
        missing_units=missing_units, planned_rows=planned_rows, committed_rows=committed_rows,
        committed_fraction=committed_rows / planned_rows if planned_rows else 0.0,
        unpublished_units=n_unpublished,
        deep_checked=deep, checked=checked, stored_bytes=stored)


def _unpublished_errors(store: StoreView, ms: list[Marker], n: int) -> list[str]:
    """Committed units without a publish record (published.py), the first few diagnosed: one
    listing of pending uploads and a stat per object of those units."""
    from ..storage.credentials import redact_url

    url = redact_url(store.url)
    out = [f"{n} committed units are not published (no publish record): readers that know only "
           f"zarr see fill values there; run `harvest finalize {url}` (it completes pending "
           "uploads, checks every object and records the unit, and names units whose data is gone)"]
    pending = _guard(out, "pending uploads cannot be listed",
                     lambda: store.location.pending_uploads(""), {}) or {}
    for m in ms:
        uid = m.unit_id
        state, why = _guard(out, f"unit {uid}", lambda m=m: _published.diagnose_unit(store, m, pending),
                            ("unknown", ""))
        if state == "pending":
            out.append(f"unit {uid}: pending: {why}: run `harvest finalize {url}`")
        elif state in ("gone", "damaged"):
            out.append(f"unit {uid}: {state}: {why}: {_published.repair_hint(url, uid)}")
        elif state == "unrecorded":
            out.append(f"unit {uid}: every object present, its publish record missing: run "
                       f"`harvest finalize {url}`")
    if n > len(ms):
        out.append(f"({n - len(ms)} more unpublished units not diagnosed)")
    return out


def _check_marker(store: StoreView, m: Marker) -> list[str]:
    """A marker against its region, without its table (default mode reads no table)."""
    out = []
    uid = m.unit_id
    if m.points_sha256 is not None:
        if m.points_sha256 != _commits.points_digest(store.points):
            out.append(f"unit {uid} was written with {m.n_points} points other than the "
                       f"store's {len(store.points)} ({', '.join(store.points[:3])}...)")
    elif m.points is None or list(m.points) != store.points:
        out.append(f"unit {uid} was written with points "
                   f"{None if m.points is None else list(m.points)}, store has {store.points}")
    if m.layout_version != store.layout_version:
        out.append(f"unit {uid} marker has layout_version {m.layout_version}")
    if not 0 <= m.row_start < m.row_end <= store.n_rows:
        out.append(f"unit {uid} rows [{m.row_start}, {m.row_end}) lie outside the store's "
                   f"{store.n_rows} rows (n_rows edited?)")
    exp = m.shard_ids(store.shard_rows)
    if m.shards is not None:
        out += _check_records(store, m, m.shards)
    elif m.table is None or m.table.n_shards != len(exp):
        out.append(f"unit {uid} marker's object table "
                   f"{None if m.table is None else m.table.to_json()} does not cover its "
                   f"{len(exp)} shards")
    return out


def _check_records(store: StoreView, m: Marker, recs) -> list[str]:
    exp = list(m.shard_ids(store.shard_rows))
    got = [sh.index for sh in recs]
    if got != exp:
        return [f"unit {m.unit_id} marker lists shards {got[:10]}, expected {exp[:10]}"]
    return []


def _check_arrays(store: StoreView, errors: list[str]) -> None:
    for name, dt in store.meta_columns.items():
        a = store.meta_array(name)
        if a.shape != (store.n_rows,) or a.dtype != np.dtype(dt):
            errors.append(f"row metadata {name} has shape {a.shape} dtype {a.dtype}, expected "
                          f"({store.n_rows},) {dt} (zarr.json or the harvest attributes were edited)")
    for p in store.points:
        a = store.array(p)
        rw = store.point_row_width(p)   # the point's own width (layout 4), fp8: + its scale
        if a.shape != (store.n_rows, rw) or a.dtype != store.np_dtype:
            errors.append(f"array {p} has shape {a.shape} dtype {a.dtype}, expected "
                          f"({store.n_rows}, {rw}) {store.dtype} (zarr.json or the harvest "
                          "attributes were edited)")
        if tuple(a.shards or a.chunks) != (store.shard_rows, rw):
            errors.append(f"array {p} shards {a.shards} do not match shard_rows={store.shard_rows}")


def _listing(store: StoreView, rel: str, leaf: bool) -> dict[int, int]:
    """shard -> object size of the zarr keys under `rel` (`<shard>/0` when `leaf`, else
    `<shard>`), from one listing; anything else (temp files of failed writes) does not count."""
    out = {}
    for path, size in store.location.list_tree(rel).items():
        parts = path.split("/")
        if parts[0].isdigit() and (parts[1:] == ["0"] if leaf else len(parts) == 1):
            out[int(parts[0])] = size
    return out


class _Wanted:
    """What the object check needs of each committed shard (unit, shard, attempt, the recorded
    size of each array's object), packed in flat integer arrays. Holding the markers themselves
    until the listings were read cost 12 KB per unit: 1.2 GB of verify at 100 k units on S3."""

    def __init__(self, points: list[str], meta_columns):
        self.n_points = len(points)
        self.meta_columns = list(meta_columns)
        self.width = self.n_points + len(self.meta_columns)
        self.units, self.shards, self.sizes = array("q"), array("q"), array("q")
        self.meta_chunks = array("q")  # the metadata chunk each shard's rows are in (its own, or its unit's)
        self.attempts: list = []   # one string per unit, shared by its shards

    def add(self, m: Marker, sh: ShardRecord) -> None:
        self.units.append(m.unit_id)
        self.shards.append(sh.index)
        self.attempts.append(m.attempt)
        nb = list(sh.nbytes or ())[: self.n_points]
        nb += [None] * (self.n_points - len(nb))
        meta = sh.meta
        nb += [None if meta.get(name) is None else meta[name].nbytes for name in self.meta_columns]
        tok = meta.get("token_id")
        self.meta_chunks.append(sh.index if tok is None or tok.chunk is None else tok.chunk)
        self.sizes.extend(-1 if x is None else int(x) for x in nb)

    def column(self, col: int):
        """(unit, shard, attempt, recorded size or None) of array `col`: points, then metadata."""
        w = self.width
        for i, (u, s) in enumerate(zip(self.units, self.shards)):
            if col >= self.n_points:
                s = self.meta_chunks[i]
            size = self.sizes[i * w + col]
            yield u, s, self.attempts[i], None if size < 0 else size


def _check_objects(store: StoreView, want: _Wanted, checked: dict) -> list[str]:
    out = []
    attempts = {arr: {(s, a): size for _, s, a, size in v} for arr, v in attempt_objects(store.location).items()}
    arrays = [layout.point_path(p) for p in store.points] + list(store.meta_columns)
    for col, path in enumerate(arrays):
        published = _listing(store, f"{path}/c", leaf=col < want.n_points)
        mine = attempts.get(path, {})
        for uid, s, attempt, size in want.column(col):
            checked["objects"] += 1
            have = [x for x in (published.get(s), mine.get((s, attempt))) if x is not None]
            if not have:
                out.append(f"{path}: shard {s} is committed (unit {uid}) but its object is missing")
            elif size is not None and size not in have:
                out.append(f"{path}: shard {s} object is {have[0]} bytes, its writer (unit {uid}) "
                           f"recorded {size} (truncated or overwritten)")
            if len(out) > _MAX_ERRORS:
                return out
    return out


def _deep_unit(store: StoreView, m: Marker, checked: dict) -> list[str]:
    bad = []
    uid = m.unit_id
    recs = unit_shards(store, m)   # the caller read and checked it (cached)
    for sh in recs:
        for pi, p in enumerate(store.points):
            try:
                rows = read_point(store, m, sh, pi)
            except Exception as exc:  # noqa: BLE001 -- damage is reported, never a crash
                bad.append(f"unit {uid} shard {sh.index} of {p}: {type(exc).__name__}: {exc}")
                continue
            checked["shards"] += 1
            checked["bytes_read"] += sh.at(sh.nbytes, pi) or rows.nbytes
            if _moments.crc32c(np.ascontiguousarray(rows)) != sh.at(sh.crc32c, pi):
                bad.append(f"unit {uid} shard {sh.index} of {p}: rows differ from what its writer "
                           "committed (overwritten or corrupt); uncommit and rewrite")
    want = m.meta_crc32c
    if want is None:
        bad.append(f"unit {uid}: marker has no row metadata digest")
    else:
        for name in store.meta_columns:
            try:
                col = np.concatenate([read_meta(store, m, sh, name) for sh in recs])
            except Exception as exc:  # noqa: BLE001
                bad.append(f"unit {uid}: row metadata {name}: {type(exc).__name__}: {exc}")
                continue
            checked["meta_chunks"] += len(recs)
            checked["bytes_read"] += col.nbytes
            if _moments.crc32c(col) != want.get(name):
                bad.append(f"unit {uid}: row metadata {name} differs from what its writer committed")
    st = m.stats
    if st is not None and st.key:
        try:
            blob = store.location.read_bytes(st.key)
        except Exception as exc:  # noqa: BLE001
            return bad + [f"unit {uid}: stats sidecar {st.key}: {type(exc).__name__}: {exc}"]
        checked["sidecars"] += 1
        if blob is None:
            bad.append(f"unit {uid}: stats sidecar {st.key} is missing")
        elif st.sha256 and hashlib.sha256(blob).hexdigest() != st.sha256:
            bad.append(f"unit {uid}: stats sidecar {st.key} differs from what its writer committed")
        else:
            checked["bytes_read"] += len(blob)
    return bad
