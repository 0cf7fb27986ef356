"""The ledger: a store's bookkeeping, reached as `Store.ledger`.

It owns the plan (plan.py), the commit markers and their index (markers.py), the object tables'
and metadata chunks' caches (tables.py, objects.py), publishing and settling (published.py),
finalize and verify, and the driver's lease as readers see it (records.read_lease). Its records
are typed (records.py) and checked where they are read.

The ledger is given the store's data as a `StoreView` (view.py), never the `Store` class: store.py
imports this module, and nothing here imports store.py, so there is no circle to hide.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Iterator

from ..errors import StoreError
from ..read.checked_rows import UnitMap
from . import finalize as _finalize
from . import markers as _commits
from . import published as _published
from . import tables as _tables
from . import verify as _verify
from .markers import MarkerName
from .plan import PlanStore, check_units
from .records import LeaseRecord, Marker, ShardRecord, Unit, read_lease
from ..format.jsonattrs import JsonObject

if TYPE_CHECKING:
    from ..storage.locate import Location
    from .view import StoreView

MARKER_CACHE = 64   # markers one ledger keeps (the units a process is working on, and then some)


class Ledger:
    """The plan, the markers, the index, publishing, finalize, verify and the lease of one store."""

    def __init__(self, store: StoreView, loc: Location):
        self._store = store
        self._loc = loc
        self.plans = PlanStore(loc)
        # MarkerName -> marker: create-once objects, safe to cache, but bounded: an actor's store
        # lives for the whole run and commits unit after unit, and a marker of a 512-shard unit
        # at 8B's shape is ~0.5 MB of JSON (a few MB parsed); kept all, they grow without end
        self._markers: OrderedDict = OrderedDict()
        self._shard_map: UnitMap | None = None   # shard -> its committed unit, for read_shard
        self.table_cache = _tables.TableCache()   # per-unit object tables (layout 3), bounded
        # decoded unit metadata chunks recently read (objects.read_meta), keyed by key, digest
        # and size so a rewrite after uncommit never hits an old entry
        self.meta_chunk_cache: dict = {}

    def _writable(self, what: str) -> None:
        if self._store.read_only:
            raise StoreError(f"{what}: store was opened read-only")

    # ---- plan --------------------------------------------------------------------------------
    def plan_units(self) -> list[Unit]:
        return self.plans.read().units

    def plan(self) -> list[dict]:
        """The plan's units as dicts of named fields (Unit.as_dict)."""
        return [u.as_dict() for u in self.plan_units()]

    def default_plan(self, shards_per_unit: int = 1) -> list[dict]:
        """Units of `shards_per_unit` consecutive shards covering every row."""
        if shards_per_unit < 1:
            raise ValueError("shards_per_unit must be >= 1")
        n_rows = self._store.n_rows
        step = shards_per_unit * self._store.shard_rows
        return [Unit(i, s, min(n_rows, s + step)).as_dict()
                for i, s in enumerate(range(0, n_rows, step))]

    def write_plan(self, units) -> list[dict]:
        """Record a whole plan at once (tools and tests; the driver appends segments as it
        learns the corpus). Returns the normalized plan."""
        self._writable("write_plan")
        out = check_units([Unit.from_dict(u) for u in units], self._store.shard_rows,
                          self._store.n_rows, "write_plan")
        seq = self.plans.read().next_seq
        if not self.plans.write_segment(seq, sorted(out, key=lambda u: u.unit_id), final=True):
            raise StoreError(f"write_plan: plan segment {seq} already exists (another driver?)")
        return [u.as_dict() for u in sorted(out, key=lambda u: u.unit_id)]

    def plan_gap(self) -> "str | None":
        """Why the plan is not fully committed (finalize.plan_gap)."""
        return _finalize.plan_gap(self._store)

    # ---- markers -----------------------------------------------------------------------------
    def marker_names(self) -> list[MarkerName]:
        return _commits.list_markers(self._loc)

    def cached_markers(self) -> int:
        """How many markers this ledger holds (bounded by MARKER_CACHE)."""
        return len(self._markers)

    def remember_marker(self, m: Marker) -> None:
        """Keep the marker a writer of this store just committed (and drop the shard map)."""
        self._shard_map = None
        self._cache_marker(MarkerName(*m.name), m)

    def _cache_marker(self, name: MarkerName, m: Marker) -> None:
        self._markers[name] = m
        self._markers.move_to_end(name)
        while len(self._markers) > MARKER_CACHE:
            self._markers.popitem(last=False)

    def commit_manifest(self, unit_id: int, row_start: "int | None" = None,
                        row_end: "int | None" = None, fresh: bool = False) -> "Marker | None":
        """The marker of a unit (of that row range when given; else the one the listing shows)."""
        if row_start is None or row_end is None:
            names = [n for n in self.marker_names() if n.unit_id == int(unit_id)]
            if not names:
                return None
            name = names[0]
        else:
            name = MarkerName(unit_id, row_start, row_end)
        if name in self._markers and not fresh:
            self._markers.move_to_end(name)
            return self._markers[name]
        m = _commits.read_marker(self._loc, name, fresh=fresh)
        if m is not None:
            self._cache_marker(name, m)
        return m

    def is_committed(self, unit_id: int, row_start: "int | None" = None,
                     row_end: "int | None" = None) -> bool:
        return self.commit_manifest(unit_id, row_start, row_end, fresh=True) is not None

    def iter_committed(self, names: "list | None" = None, planned: bool = False) -> Iterator[Marker]:
        """Markers of committed units that agree with the plan (all markers if there is no plan),
        streamed from the compacted index plus the markers written since. `planned`: the caller
        already kept only the names that agree with the plan."""
        names = self.marker_names() if names is None else names
        if not planned:
            plan = {u.unit_id: u.rows for u in self.plan_units()}
            if plan:
                names = [n for n in names if plan.get(n.unit_id) == n.rows]
        # not cached: holding 10^5 markers (per-shard CRCs and sizes of every point) is what made
        # status and finalize take a GB
        yield from _commits.iter_committed(self._loc, names)

    def committed_units(self) -> dict[int, Marker]:
        """unit_id -> marker, for every unit whose marker exists now and agrees with the plan."""
        return {m.unit_id: m for m in sorted(self.iter_committed(), key=lambda m: m.unit_id)}

    def committed_shard(self, shard: int) -> "tuple[Marker, ShardRecord]":
        """(marker, its record of `shard`) of the committed unit holding that shard."""
        if self._shard_map is None:
            self._shard_map = UnitMap(self.iter_committed(), self._store.shard_rows)
        m = self._shard_map.find(int(shard))
        if m is None:
            raise StoreError(f"shard {shard} of {self._store.url} is not committed (no marker "
                             "covers it)")
        return m, _tables.shard_record(self._store, m, int(shard))

    def uncommit(self, unit_id: int) -> None:
        """Driver repair only: drop a unit's marker so it can be rewritten (e.g. after a
        conflict). Its index entries are voided first, so the rewrite's marker is the one every
        reader takes, even where its bytes differ (markers.uncommit)."""
        self._writable("uncommit")
        _published.forget(self._loc, unit_id)   # first: a unit without a record is checked
        for n in _commits.uncommit(self._loc, unit_id):
            self._markers.pop(n, None)
        self._shard_map = None

    def write_index(self, markers) -> int:
        """Append markers to the compacted commit index (the driver, as units commit)."""
        return _commits.write_index_segment(self._loc, markers)

    # ---- publish and settle ------------------------------------------------------------------
    def settle(self, repair: bool = False) -> _published.SettleReport:
        """Publish committed units that have no publish record yet and record them; report the
        rest as gone or damaged, uncommitting them when `repair` (published.settle)."""
        return _published.settle(self._store, repair=repair)

    def unpublished_units(self) -> list[int]:
        """Committed units without a publish record (two listings; published.unpublished)."""
        return _published.unpublished(self._store)

    # ---- finalize, verify, the lease ---------------------------------------------------------
    def finalize(self, summary: "dict | None" = None) -> JsonObject:
        return _finalize.finalize(self._store, summary)

    def unfinalize(self, capacity_rows: int) -> bool:
        return _finalize.unfinalize(self._store, capacity_rows)

    def verify(self, deep: bool = False, objects: bool = False) -> _verify.VerifyReport:
        return _verify.verify(self._store, deep=deep, objects=objects)

    def lease(self) -> "tuple[int, LeaseRecord] | None":
        """(generation, record) of the driver's newest lease on this store, or None."""
        return read_lease(self._loc)


__all__ = ["MARKER_CACHE", "Ledger"]
