"""Work units: fixed row ranges aligned to store shards, decided before any work runs.

Units never share a shard, so two actors never write the same object (zarr shards are whole
objects; two writers of one shard lose each other's rows), and a retried unit rewrites exactly the
objects it owns. `shard_rows` is a multiple of `context_size`, so a unit holds whole contexts and
an actor can run it without reading anyone else's rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ConfigError

# One shard set (all points) held in memory per unit in flight: large enough that objects are
# tens of MB on S3, small enough that two units in flight fit beside an engine.
TARGET_SHARD_SET_BYTES = 128 << 20
TARGET_CHUNK_BYTES = 1 << 20
UNITS_PER_ACTOR = 4


@dataclass(frozen=True)
class Unit:
    unit_id: int
    row_start: int
    row_end: int

    @property
    def n_rows(self) -> int:
        return self.row_end - self.row_start

    def as_dict(self) -> dict:
        return {"unit_id": self.unit_id, "row_start": self.row_start, "row_end": self.row_end}

    @classmethod
    def from_dict(cls, d: dict) -> "Unit":
        return cls(int(d["unit_id"]), int(d["row_start"]), int(d["row_end"]))


@dataclass(frozen=True)
class Layout:
    shard_rows: int
    chunk_rows: int
    unit_rows: int


def choose_layout(
    n_rows: int,
    context_size: int,
    point_row_bytes: int,
    n_points: int,
    num_actors: int = 1,
    shard_rows: int | None = None,
    chunk_rows: int | None = None,
    unit_shards: int = 1,
) -> Layout:
    """Shard/chunk/unit sizes; explicit values are checked, missing ones derived.

    `point_row_bytes` is the size of one row of one point (width * itemsize).
    """
    C = context_size
    row_bytes = point_row_bytes * n_points
    if shard_rows is None:
        by_memory = max(1, TARGET_SHARD_SET_BYTES // max(1, row_bytes)) // C
        # enough units that every actor gets several (a straggler then costs one small unit)
        contexts = max(1, n_rows // C)
        by_parallelism = math.ceil(contexts / (UNITS_PER_ACTOR * max(1, num_actors) * unit_shards))
        shard_rows = C * max(1, min(by_memory, by_parallelism))
    elif shard_rows % C:
        lo, hi = (shard_rows // C) * C, (shard_rows // C + 1) * C
        raise ConfigError(
            f"store.shard_rows={shard_rows} is not a multiple of packing.context_size={C}: "
            f"use {hi}" + (f" or {lo}" if lo else "")
        )
    if chunk_rows is None:
        chunk_rows = largest_divisor_at_most(
            shard_rows, max(1, TARGET_CHUNK_BYTES // max(1, point_row_bytes))
        )
    elif shard_rows % chunk_rows:
        raise ConfigError(
            f"store.chunk_rows={chunk_rows} must divide the shard size {shard_rows}: pick a divisor "
            "or leave store.chunk_rows out"
        )
    return Layout(shard_rows, chunk_rows, shard_rows * unit_shards)


def largest_divisor_at_most(n: int, cap: int) -> int:
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if d <= cap and d > best:
                    best = d
        i += 1
    return best


def make_units(n_rows: int, layout: Layout) -> list[Unit]:
    if n_rows <= 0:
        return []
    U = layout.unit_rows
    return [Unit(i, s, min(s + U, n_rows)) for i, s in enumerate(range(0, n_rows, U))]


def check_plan(units: list[Unit], n_rows: int, shard_rows: int, context_size: int) -> None:
    """Refuse a plan with gaps, overlaps or unaligned starts (a stored plan is trusted by resume)."""
    expect = 0
    for i, u in enumerate(sorted(units, key=lambda u: u.row_start)):
        if u.row_start != expect:
            raise ValueError(f"plan: unit {u.unit_id} starts at {u.row_start}, expected {expect}")
        if u.row_start % shard_rows or (u.row_end % shard_rows and u.row_end != n_rows):
            raise ValueError(f"plan: unit {u.unit_id} is not aligned to shards of {shard_rows}")
        if u.n_rows % context_size:
            raise ValueError(f"plan: unit {u.unit_id} does not hold whole contexts")
        expect = u.row_end
    if expect != n_rows:
        raise ValueError(f"plan: units cover {expect} rows of {n_rows}")
