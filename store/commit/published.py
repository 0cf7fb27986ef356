"""Publish records: "committed" means readable by every reader, or the store says it is not.

A commit marker makes a unit's rows data for harvest's own reader, which checks every object
against the digest its writer recorded. A reader that knows only zarr (zarr-python, tensorstore)
sees a unit once its objects are at their zarr keys: on S3 its multipart uploads completed, on
other storage its attempt objects moved. A writer publishes right after its marker; one that dies
in between leaves its uploads pending, and a bucket lifecycle rule that aborts incomplete uploads
(AWS recommends one) then removes the unit's data for good while its marker still says committed.
A finalize that completed only the uploads it found pending would certify such a store complete
with the unit missing.

So publishing ends with a record, `_harvest/published/unit-<id>.<attempt>.json`, written once
every object of the unit (point shards and row metadata chunks) is known to be at its key at the
size its writer recorded: by the writer after its own publish succeeded, else by `settle` (below)
after completing what is still pending and one stat (a HEAD) per object. A completed object
cannot be aborted, so a record stays true whatever a lifecycle rule does and however long it
waits; nothing depends on choosing its period. A unit without a record is never trusted:

- `settle(store)` (finalize, a resume, the end of a run, `harvest finalize`): completes the
  unit's pending uploads (moves its attempt objects), stats each object, records the unit when
  all are there at their sizes, and reports the others as **gone** (an object missing and no
  upload outstanding) or **damaged** (an object of another size, or an upload that cannot be
  completed); with `repair=True` those are uncommitted (loudly) so the resume re-captures them.
- verify's default mode and `status` count committed units without a record (one listing).

Cost at Llama-3.1-8B's shape (32 points x 4096, 262,144-row units of 16 shards, 3,815 units per
10^9 tokens; benchmarks/bench_publish.py on SeaweedFS): one PUT of ~100 B per unit (7.8 ms each
here, 30 s of requests per 10^9 tokens spread over the actors, against ~37 M requests of data),
one LIST page per 1,000 units to learn which are published (0.9 s for 3,815 records), and stats
only for units without a record: 515 HEADs per such unit (16 shards x 32 points and 3 metadata
chunks; 1.9 s at 278 HEADs/s here), none in a run where every writer published. Stores written
before records existed have none: the first settle stats every object once (~2 M HEADs per 10^9
tokens, ~2 h at this box's rate) and records them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
from dataclasses import dataclass, field

from ..format import layout
from ..errors import DataIntegrityError, StoreError
from ..format.jsonattrs import now as _now
from .objects import complete_uploads, repair_hint
from .records import Marker, PublishRecord
from .tables import unit_shards

if TYPE_CHECKING:
    from .view import StoreView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnitObject:
    """One object a committed unit vouches for."""

    what: str                    # "shard 3 of resid_post.1", "row metadata token_id chunk 0"
    final: str                   # its zarr key
    upload: "dict | None"        # the S3 upload that publishes it (None: moved by name)
    attempt_key: "str | None"    # where its attempt wrote it, for storage that moves by name
    size: "int | None"           # stored bytes its writer recorded (None: unknown)


def unit_objects(store: StoreView, m: Marker) -> list[UnitObject]:
    """Every published object of committed unit `m`, from its table (layout 3) or marker."""
    att = m.attempt
    out, seen = [], set()
    for sh in unit_shards(store, m):
        for p, point in enumerate(store.points):
            up = sh.at(sh.upload, p)
            out.append(UnitObject(
                f"shard {sh.index} of {point}", layout.shard_object_key(point, sh.index), up,
                None if up is not None or not att or sh.object_crc32c is None else
                layout.attempt_object_key(layout.point_path(point), sh.index, att),
                sh.at(sh.nbytes, p)))
        for name, rec in sh.meta.items():
            c = sh.index if rec.chunk is None else rec.chunk
            if (name, c) in seen:   # a unit's chunk is named by each of its shards
                continue
            seen.add((name, c))
            up = rec.upload
            out.append(UnitObject(f"row metadata {name} chunk {c}", layout.meta_chunk_key(name, c),
                                  up, None if up is not None or not att else
                                  layout.attempt_object_key(name, c, att), rec.nbytes))
    return out


def record(m: Marker, n_objects: int) -> "tuple[str, bytes]":
    """Unit `m`'s publish record: its key and body (every object at its key, `n_objects`)."""
    rec = PublishRecord(m.unit_id, m.attempt, int(n_objects), _now())
    return rec.key, rec.encode()


def write_record(loc, m: Marker, n_objects: int) -> None:
    loc.write_bytes(*record(m, n_objects))


def published_units(loc) -> "dict[int, set[str]]":
    """unit id -> attempt tokens with a publish record, from one listing."""
    out: dict = {}
    for name in loc.list_dir(layout.PUBLISHED_DIR):
        p = layout.parse_published_name(name)
        if p is not None:
            out.setdefault(p[0], set()).add(p[1])
    return out


def is_published(records: dict, m: Marker) -> bool:
    return m.token in records.get(m.unit_id, ())


def forget(loc, unit_id: int) -> None:
    """Remove a unit's publish records (uncommit does, before its voids and marker)."""
    prefix = f"unit-{int(unit_id):08d}."
    for name in loc.list_dir(layout.PUBLISHED_DIR):
        if name.startswith(prefix):
            loc.delete(f"{layout.PUBLISHED_DIR}/{name}")


def check_unit(store: StoreView, m: Marker, pending: dict) -> "tuple[str, str]":
    """Publish unit `m` as far as its objects allow and say what it is: ("published", ""),
    ("gone", why) or ("damaged", why). `pending`: {upload id: key} of the uploads outstanding
    (one listing; entries completed here are removed)."""
    loc = store.location
    try:
        objs = unit_objects(store, m)
    except DataIntegrityError as e:
        return "damaged", str(e)
    todo = [(o.final, o.upload) for o in objs
            if o.upload is not None and pending.pop(o.upload["upload_id"], None) is not None]
    bad_upload = []
    for final, up in todo:
        try:
            complete_uploads(loc, [(final, up)])
        except Exception as e:  # noqa: BLE001 -- an upload that cannot complete is damage
            bad_upload.append(f"{final}: upload {up.get('upload_id')} cannot be completed "
                              f"({type(e).__name__}: {e})")
    moves = [(o.attempt_key, o.final) for o in objs if o.attempt_key is not None]
    if moves:
        present = loc.object_sizes([a for a, _ in moves])
        moves = [(a, f) for a, f in moves if present.get(a) is not None]
        if moves:
            loc.publish(moves)
    sizes = loc.object_sizes([o.final for o in objs])
    missing = [o for o in objs if sizes.get(o.final) is None]
    wrong = [o for o in objs if sizes.get(o.final) is not None and o.size is not None
             and sizes[o.final] != o.size]
    if bad_upload or wrong:
        why = bad_upload + [f"{o.what}: {sizes[o.final]} bytes at {o.final}, its writer stored "
                            f"{o.size}" for o in wrong]
        return "damaged", "; ".join(why[:3]) + (f" (+{len(why) - 3} more)" if len(why) > 3 else "")
    if missing:
        return "gone", (f"{len(missing)} of its {len(objs)} objects missing, no upload outstanding "
                        f"(e.g. {missing[0].what} at {missing[0].final})")
    write_record(loc, m, len(objs))
    return "published", ""


def diagnose_unit(store: StoreView, m: Marker, pending: dict) -> "tuple[str, str]":
    """Read-only: what an unpublished committed unit is. ("pending", why): an upload of it is
    outstanding (`harvest finalize` completes it); ("unrecorded", ""): every object is at its
    key at its size, only the record is missing; ("gone", why) / ("damaged", why) as in
    check_unit (attempt copies count as present: finalize moves them)."""
    try:
        objs = unit_objects(store, m)
    except DataIntegrityError as e:
        return "damaged", str(e)
    waiting = [o for o in objs if o.upload is not None and o.upload["upload_id"] in pending]
    sizes = store.location.object_sizes([o.final for o in objs if o not in waiting])
    copies = store.location.object_sizes([o.attempt_key for o in objs if o.attempt_key])
    wrong, missing, unmoved = [], [], []
    for o in objs:
        if o in waiting:
            continue
        have = [x for x in (sizes.get(o.final), copies.get(o.attempt_key)) if x is not None]
        if not have:
            missing.append(o)
        elif o.size is not None and o.size not in have:
            wrong.append(f"{o.what}: {have[0]} bytes at {o.final}, its writer stored {o.size}")
        elif sizes.get(o.final) != o.size and copies.get(o.attempt_key) is not None:
            unmoved.append(o)   # intact under its attempt's name only: publishing moves it
    if wrong:
        return "damaged", "; ".join(wrong[:3])
    if missing:
        return "gone", (f"{len(missing)} of its {len(objs)} objects missing, no upload outstanding "
                        f"(e.g. {missing[0].what} at {missing[0].final})")
    if waiting:
        return "pending", f"{len(waiting)} of its {len(objs)} objects await their upload's completion"
    if unmoved:
        return "pending", (f"{len(unmoved)} of its {len(objs)} objects are still under their "
                           "attempt's name, not at their zarr keys")
    return "unrecorded", ""


@dataclass(frozen=True)
class SettleReport:
    """What a settle found: units checked, the ids it published, those whose data is gone or
    damaged (unit -> why) and those it uncommitted (`repair`)."""

    checked: int = 0
    published: list[int] = field(default_factory=list)
    gone: dict[int, str] = field(default_factory=dict)
    damaged: dict[int, str] = field(default_factory=dict)
    uncommitted: list[int] = field(default_factory=list)

    def bad(self) -> list[int]:
        """Units whose data is gone or damaged, in id order."""
        return sorted({**self.gone, **self.damaged})


def settle(store: StoreView, repair: bool = False) -> SettleReport:
    """Every committed unit without a publish record: publish what can be, record it, report
    the rest (module docstring). `repair`: uncommit gone and damaged units (driver or operator
    repair: no writer of them may be running) so that the resume re-captures them."""
    loc = store.location
    records = published_units(loc)
    plan = {u.unit_id: (u.row_start, u.row_end) for u in store.ledger.plan_units()}
    names = [n for n in store.ledger.marker_names()
             if (not plan or plan.get(n.unit_id) == n.rows) and n.unit_id not in records]
    published: list[int] = []
    failed: dict[str, dict[int, str]] = {"gone": {}, "damaged": {}}
    uncommitted: list[int] = []
    checked = 0
    if not names:
        return SettleReport()
    pending = loc.pending_uploads("")
    for m in store.ledger.iter_committed(names, planned=True):
        checked += 1
        state, why = check_unit(store, m, pending)
        if state == "published":
            published.append(m.unit_id)
        else:
            failed[state][m.unit_id] = why
    bad = sorted({**failed["gone"], **failed["damaged"]})
    if bad and repair:
        if store.read_only:
            raise StoreError("settle: store was opened read-only")
        for uid in bad:
            state = "gone" if uid in failed["gone"] else "damaged"
            log.warning("unit %d is committed but its data is %s (%s): uncommitted, the resume "
                        "re-captures it", uid, state, failed[state][uid])
            store.ledger.uncommit(uid)
        uncommitted += bad
    return SettleReport(checked, published, failed["gone"], failed["damaged"], uncommitted)


def unpublished(store: StoreView, names=None) -> list[int]:
    """Unit ids of committed units (agreeing with the plan) without a publish record: one
    listing of the markers and one of the records, no marker read."""
    records = published_units(store.location)
    if names is None:
        plan = {u.unit_id: (u.row_start, u.row_end) for u in store.ledger.plan_units()}
        names = [n for n in store.ledger.marker_names() if not plan or plan.get(n.unit_id) == n.rows]
    return sorted({n.unit_id for n in names} - set(records))


def settle_text(report: SettleReport, url: str) -> "str | None":
    """What an operator must read after a settle that found damage (None: nothing found)."""
    bad = report.bad()
    if not bad:
        return None
    parts = [f"unit {u}: {'gone' if u in report.gone else 'damaged'}: "
             f"{report.gone.get(u) or report.damaged.get(u)}" for u in bad[:5]]
    done = "uncommitted; " if report.uncommitted else ""
    fix = ("re-run the same harvest: it re-captures them" if report.uncommitted else
           repair_hint(url, ",".join(map(str, bad[:20]))))
    return (f"{len(bad)} committed units of {url} have lost data that was never published: "
            + "; ".join(parts) + (" ..." if len(bad) > 5 else "") + f"; {done}{fix}")


__all__ = ["SettleReport", "UnitObject", "unit_objects", "write_record", "published_units", "is_published",
           "forget", "check_unit", "diagnose_unit", "settle", "unpublished", "settle_text", "repair_hint"]
