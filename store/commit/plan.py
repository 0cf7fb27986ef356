"""The work plan as stored: units (row ranges) written incrementally, in create-once segments.

The driver learns the rows of a streamed corpus as it tokenises it, so the plan grows while the
run goes: each segment `_harvest/plan/seg-<seq>.json` is created once, before any unit in it is
dispatched (a marker is never written for a unit the plan does not hold), and never changes, so a
second driver cannot silently rewrite what the first planned. Now and then the driver folds the
segments into `compact.json` (amortised linear: only when the segments since the last compaction
outnumber a fraction of the units), so a resume reads one object plus a few segments.

The store knows units as (unit_id, row_start, row_end); each segment may carry an opaque
pipeline payload (where a unit's tokens come from), which the store keeps but never interprets.
"""

from __future__ import annotations

import json
from typing import Iterable

from ..format import layout
from ..storage.locate import Location
from . import trust
from .records import Plan, Unit
from ..format.jsonattrs import JsonObject


def check_units(units: Iterable[Unit], shard_rows: int, n_rows: int, what: str = "plan") -> list[Unit]:
    """Refuse overlaps, duplicate ids and regions two writers would share a shard of."""
    out = sorted(units, key=lambda u: u.row_start)
    ids = set()
    for u in out:
        if u.unit_id in ids:
            raise ValueError(f"{what}: unit_id {u.unit_id} appears twice; unit ids must be unique")
        ids.add(u.unit_id)
        check_region(u.row_start, u.row_end, shard_rows, n_rows, f"{what} unit {u.unit_id}")
    for u in out[:-1]:  # only the last unit may end inside a shard (nothing follows it there)
        if u.row_end % shard_rows and u.row_end != n_rows:
            raise ValueError(f"{what} unit {u.unit_id}: rows [{u.row_start}, {u.row_end}) are not "
                             f"shard-aligned: row_end must be a multiple of shard_rows={shard_rows} "
                             "except for the last unit; two writers sharing a shard would overwrite "
                             "each other")
    for a, b in zip(out, out[1:]):
        if b.row_start < a.row_end:
            raise ValueError(f"{what}: units {a.unit_id} and {b.unit_id} overlap "
                             f"([{a.row_start},{a.row_end}) and [{b.row_start},{b.row_end}))")
    return out


def check_region(row_start: int, row_end: int, shard_rows: int, n_rows: int, what: str) -> None:
    if not (0 <= row_start < row_end <= n_rows):
        raise ValueError(f"{what}: rows [{row_start}, {row_end}) must satisfy "
                         f"0 <= row_start < row_end <= n_rows={n_rows}")
    if row_start % shard_rows:
        raise ValueError(
            f"{what}: rows [{row_start}, {row_end}) are not shard-aligned: row_start must be a "
            f"multiple of shard_rows={shard_rows} (and row_end too, unless it is the last unit); "
            "two writers sharing a shard would overwrite each other")


class PlanStore:
    """Segments, compaction and the source manifest under `_harvest/plan/`.

    A segment's units and its payload are separate objects (the payload first, then the units,
    whose creation is the segment's), because most readers want the units only: status, verify
    and the reader of a 10^5-unit store parse a few MB, not the payloads' chunk tables too.
    """

    def __init__(self, loc: Location):
        self._loc = loc

    def write_segment(self, seq: int, units: list[Unit], payload: dict | None = None,
                      final: bool = False) -> bool:
        if payload is not None and not self._loc.create_once(layout.plan_payload_key(seq),
                                                             json.dumps(payload).encode()):
            return False
        body = {"seq": int(seq), "final": bool(final), "units": [u.to_json() for u in units]}
        return self._loc.create_once(layout.plan_segment_key(seq), json.dumps(body).encode())

    def segment_seqs(self) -> list[int]:
        out = []
        for name in self._loc.list_dir(layout.PLAN_DIR):
            if name.startswith("seg-") and name.endswith(".json") and not name.endswith(".payload.json"):
                out.append(int(name[4:-5]))
        return sorted(out)

    def read(self, payloads: bool = False) -> Plan:
        """The plan (units in id order, final, next_seq, and with `payloads` the segments'
        payloads in order): the compact object plus every later segment."""
        compact = self._loc.read_bytes(layout.PLAN_COMPACT_KEY)
        units: list[Unit] = []
        out_payloads: list = []
        final = False
        upto = -1
        if compact:
            c = _record(compact, layout.PLAN_COMPACT_KEY)
            upto = trust.integer(c, "upto", layout.PLAN_COMPACT_KEY, lo=-1)
            units = _units(c, layout.PLAN_COMPACT_KEY)
            final = bool(c.get("final"))
            if payloads:
                raw = self._loc.read_bytes(layout.PLAN_COMPACT_PAYLOAD_KEY)
                out_payloads = list(json.loads(raw)) if raw else []
        seqs = [s for s in self.segment_seqs() if s > upto]
        for s in seqs:
            raw = self._loc.read_bytes(layout.plan_segment_key(s))
            if raw is None:
                continue
            seg = _record(raw, layout.plan_segment_key(s))
            units += _units(seg, layout.plan_segment_key(s))
            final = final or bool(seg.get("final"))
            if payloads:
                p = self._loc.read_bytes(layout.plan_payload_key(s))
                if p is not None:
                    out_payloads.append(json.loads(p))
        units.sort(key=lambda u: u.unit_id)
        return Plan(units, final, max([upto] + seqs) + 1, out_payloads)

    def compact(self, units: list[Unit], payloads: list, upto: int, final: bool) -> None:
        """Fold segments <= upto into compact objects (overwritten: they only ever grow); the
        payloads first, so compact.json never names segments whose payloads are not folded."""
        self._loc.write_bytes(layout.PLAN_COMPACT_PAYLOAD_KEY, json.dumps(payloads).encode())
        body = {"upto": int(upto), "final": bool(final),
                "units": [u.to_json() for u in units]}
        self._loc.write_bytes(layout.PLAN_COMPACT_KEY, json.dumps(body).encode())

    def write_sources(self, sources: dict) -> bool:
        return self._loc.create_once(layout.PLAN_SOURCES_KEY, json.dumps(sources).encode())

    def read_sources(self) -> JsonObject | None:
        raw = self._loc.read_bytes(layout.PLAN_SOURCES_KEY)
        return json.loads(raw) if raw else None


def _record(raw: bytes, where: str) -> JsonObject:
    """A plan object's JSON, untrusted (records.py checks each unit)."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise trust.fail(where, "(json)", "is not JSON") from None
    if not isinstance(body, dict) or not isinstance(body.get("units"), list):
        raise trust.fail(where, "units", "is not a list")
    return body


def _units(body: dict, where: str) -> list[Unit]:
    return [Unit.from_json(u, where, i) for i, u in enumerate(body["units"])]
