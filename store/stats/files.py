"""Statistics as stored: per-unit partials (sidecars) merged in a stream, finalized arrays read.

Merging streams in unit-id order (the same data gives the same bits, however units were
committed) with the next batch of sidecars fetched while one merges: memory O(subsets x points x
width + batch), never O(units).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
from typing import Sequence, TypedDict

import numpy as np
import zarr

from ..format import layout
from . import moments as _moments
from ..commit.records import StatsRef
from ..errors import StoreError


class PointStats(TypedDict):
    """One point's statistics over a subset of rows (FORMAT.md "Statistics"): rows counted, the
    per-dimension mean and variance (float64, the point's width), E||x||^2, and the rows left out
    for a non-finite value."""

    count: int
    mean: np.ndarray
    var: np.ndarray
    mean_sq_norm: float
    nonfinite_rows: int


def _check_partial(raw, stats_ref: StatsRef, unit_id: int) -> dict[str, tuple]:
    if raw is None or hashlib.sha256(raw).hexdigest() != stats_ref.sha256:
        raise StoreError(f"stats partial of unit {unit_id} is missing or does not "
                         f"match its commit marker ({stats_ref.key}); rewrite the unit")
    return _moments.load_arrays(raw)


def _fetch_partials(store, refs: list) -> list:
    """Sidecars of `refs` (batched: one concurrent request for all on object storage)."""
    loc = store.location
    keys = [loc.key(_key(uid, ref)) for uid, ref in refs]
    blobs = loc.read_many(keys, "read stats partials")
    return [_check_partial(blobs.get(k), r[1], r[0]) for k, r in zip(keys, refs)]


# Bytes of sidecars one batch fetches. A sidecar is ~32 x points x width bytes (two subsets, mean
# and M2 in float64): 4 MiB at 8B's shape, where the old 256 a batch, 3 batches ahead, held
# 4 GiB raw plus the parsed arrays (finalize must stay under 1 GB at 1 B tokens). Small models
# still take 256 a batch (one request round per batch on object storage).
BATCH_BYTES = 32 << 20


def _key(unit_id: int, ref: "StatsRef | None") -> str:
    if ref is None or ref.key is None:
        raise StoreError(f"unit {unit_id}: its commit marker names no stats partial; rewrite the "
                         "unit")
    return ref.key


def merge_partials(store, refs: "list[tuple[int, StatsRef | None]]",
                   batch: int = 256) -> _moments.StreamingMerge:
    refs = sorted(refs, key=lambda r: r[0])
    partial = 32 * len(store.points) * store.max_width
    batch = max(1, min(batch, BATCH_BYTES // max(1, partial)))
    acc = _moments.StreamingMerge(layout.STATS_SUBSETS, len(store.points), store.max_width,
                                  [store.widths[p] for p in store.points] if store.mixed_widths else None)
    batches = [refs[i:i + batch] for i in range(0, len(refs), batch)]
    ahead = 3  # batches in flight while one merges (memory: ahead x batch partials)
    with cf.ThreadPoolExecutor(ahead) as ex:
        futs = [ex.submit(_fetch_partials, store, b) for b in batches[:ahead]]
        for i in range(len(batches)):
            if i + ahead < len(batches):
                futs.append(ex.submit(_fetch_partials, store, batches[i + ahead]))
            for part in futs[i].result():
                acc.add(part)
            futs[i] = None
    return acc


def read_stats(store, points: "Sequence[str] | None", subset: str) -> dict[str, PointStats]:
    if subset not in layout.STATS_SUBSETS:
        raise ValueError(f"subset={subset!r}: use one of {layout.STATS_SUBSETS}")
    points = list(points or store.points)
    if store.attributes.get("stats"):
        g = zarr.open_group(store=store.zarr_store, path=f"{layout.STATS_GROUP}/{subset}", mode="r",
                            zarr_format=3)
        a = dict(g.attrs)
        mean, var = g["mean"][:], g["var"][:]
        out = {}
        for p in points:
            i = a["points"].index(p)
            w = store.widths.get(p, mean.shape[1])   # layout 4: NaN past a point's width
            out[p] = PointStats(count=int(a["count"][i]), mean=mean[i, :w], var=var[i, :w],
                                mean_sq_norm=float(a["mean_sq_norm"][i]),
                                nonfinite_rows=int(a["nonfinite_rows"][i]))
        return out
    refs = [(m.unit_id, m.stats) for m in store.ledger.iter_committed()]
    merged = merge_partials(store, refs).moments(subset)
    return {p: PointStats(count=merged[i].count, mean=merged[i].mean, var=merged[i].var,
                          mean_sq_norm=merged[i].mean_sq_norm, nonfinite_rows=merged[i].nonfinite)
            for i, p in enumerate(store.points) if p in points}
