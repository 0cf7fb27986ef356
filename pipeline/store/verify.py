"""verify: is every planned row committed exactly once, and is what the markers vouch for there?

Default mode: the plan against the markers (one listing; a marker whose row range disagrees with
the plan never counts), each marker against its own region, and every committed object against
the size its writer recorded, from one listing per array (temp files of failed writes are not
objects). Deep mode reads every committed byte back: each shard's rows against the CRC32C in its
marker, each unit's row metadata against the marker's metadata digests.
"""

from __future__ import annotations

from . import layout
from . import stats as _stats
from .backend import with_retries
from .plans import check_units
from .store import Store

_MAX_ERRORS = 200


def verify(store: Store, deep: bool = False, objects: bool = True) -> dict:
    errors: list[str] = []
    checked: dict = {"markers": 0, "objects": 0, "bytes_read": 0}
    plan_units = store.plan_units()
    plan = {u.unit_id: u for u in plan_units}
    if not plan:
        errors.append("no plan recorded (write_plan was never called)")
    try:
        check_units(plan_units, store.shard_rows, store.n_rows)
    except ValueError as e:
        errors.append(str(e))
    names = store.marker_names()
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
    _check_arrays(store, errors)
    want: dict[int, list] = {}  # shard -> recorded sizes per point
    stored = 0
    meta_want: set[int] = set()
    for m in store.iter_committed(matching, planned=True):
        checked["markers"] += 1
        uid = m["unit_id"]
        if m.get("points") != store.points:
            errors.append(f"unit {uid} was written with points {m.get('points')}, store has {store.points}")
        if m.get("layout_version") != store.layout_version:
            errors.append(f"unit {uid} marker has layout_version {m.get('layout_version')}")
        exp = list(range(m["row_start"] // store.shard_rows, -(-m["row_end"] // store.shard_rows)))
        got = [sh["index"] for sh in m.get("shards", [])]
        if got != exp:
            errors.append(f"unit {uid} marker lists shards {got[:10]}, expected {exp[:10]}")
        for sh in m.get("shards", []):
            want[sh["index"]] = sh.get("nbytes")
            meta_want.add(sh["index"])
            stored += sum(x for x in (sh.get("nbytes") or []) if x is not None)
        if deep:
            errors += _deep_unit(store, m, checked)
        if len(errors) > _MAX_ERRORS:
            break
    if objects:
        errors += _check_objects(store, want, meta_want, checked)
    return {"ok": not errors, "errors": errors, "n_rows": store.n_rows,
            "planned_units": len(plan), "committed_units": len(committed_ids),
            "missing_units": missing_units, "planned_rows": planned_rows,
            "committed_rows": committed_rows,
            "committed_fraction": committed_rows / planned_rows if planned_rows else 0.0,
            "deep_checked": deep, "checked": checked, "stored_bytes": stored}


def _check_arrays(store: Store, errors: list[str]) -> None:
    import numpy as np

    for name, dt in layout.ROW_META.items():
        a = store._meta_array(name)
        if a.shape != (store.n_rows,) or a.dtype != np.dtype(dt):
            errors.append(f"row metadata {name} has shape {a.shape} dtype {a.dtype}, expected "
                          f"({store.n_rows},) {dt}")
    for p in store.points:
        a = store.array(p)
        if a.shape != (store.n_rows, store.width) or a.dtype != store.np_dtype:
            errors.append(f"array {p} has shape {a.shape} dtype {a.dtype}, expected "
                          f"({store.n_rows}, {store.width}) {store.dtype}")
        if tuple(a.shards or a.chunks) != (store.shard_rows, store.width):
            errors.append(f"array {p} shards {a.shards} do not match shard_rows={store.shard_rows}")


def _listing(store: Store, rel: str) -> dict[int, int]:
    """shard index -> object size under `rel`, from one listing; temp files do not count."""
    loc = store.location
    base = loc.key(rel)
    try:
        found = with_retries(lambda: loc.fs.find(base, detail=True), f"list {rel}")
    except FileNotFoundError:
        return {}
    out = {}
    for path, info in found.items():
        parts = path[len(base):].strip("/").split("/")
        if parts and parts[0].isdigit() and ".tmp-" not in parts[-1]:
            out[int(parts[0])] = int(info.get("size") or 0)
    return out


def _check_objects(store: Store, want: dict, meta_want: set, checked: dict) -> list[str]:
    out = []
    for pi, p in enumerate(store.points):
        have = _listing(store, f"{layout.point_path(p)}/c")
        for s in sorted(want):
            checked["objects"] += 1
            sizes = want[s]
            if s not in have:
                out.append(f"array {p}: shard {s} is committed but its object is missing")
            elif sizes is not None and sizes[pi] is not None and have[s] != sizes[pi]:
                out.append(f"array {p}: shard {s} object is {have[s]} bytes, its writer recorded "
                           f"{sizes[pi]} (truncated or overwritten)")
            if len(out) > _MAX_ERRORS:
                return out
    for name in layout.ROW_META:
        have = _listing(store, f"{name}/c")
        lost = sorted(meta_want - set(have))
        checked["objects"] += len(meta_want)
        if lost:
            out.append(f"row metadata {name}: {len(lost)} committed chunks are missing (e.g. shard "
                       f"{lost[:5]})")
    return out


def _deep_unit(store: Store, m: dict, checked: dict) -> list[str]:
    bad = []
    uid = m["unit_id"]
    for sh in m.get("shards", []):
        s, e = sh["row_start"], sh["row_end"]
        for pi, p in enumerate(store.points):
            try:
                rows = store.array(p)[s:e]
            except Exception as exc:  # noqa: BLE001 -- damage is reported, never a crash
                bad.append(f"unit {uid} shard {sh['index']} of {p} cannot be read: "
                           f"{type(exc).__name__}: {exc}")
                continue
            checked["bytes_read"] += rows.nbytes
            if _stats.crc32c(rows) != sh["crc32c"][pi]:
                bad.append(f"unit {uid} shard {sh['index']} of {p}: data differs from what its "
                           "writer committed (overwritten or corrupt); uncommit and rewrite")
    want = (m.get("row_meta") or {}).get("crc32c")
    if want is None:
        bad.append(f"unit {uid}: marker has no row metadata digest")
        return bad
    try:
        cols = store.read_row_meta(m["row_start"], m["row_end"])
    except Exception as exc:  # noqa: BLE001
        return bad + [f"unit {uid}: row metadata cannot be read: {type(exc).__name__}: {exc}"]
    for name, col in zip(layout.ROW_META, cols):
        checked["bytes_read"] += col.nbytes
        if _stats.crc32c(col) != want.get(name):
            bad.append(f"unit {uid}: row metadata {name} differs from what its writer committed")
    return bad
