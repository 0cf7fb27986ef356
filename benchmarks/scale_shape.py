"""bench_scale's synthetic bookkeeping stores, and its `shape` section (issue 24 at 8B's shape).

A synthetic store holds everything the bookkeeping reads, as a run leaves it, and no activation:
the plan (segments, payloads, compacted), one layout-3 commit marker and object table per unit
(built by `commits.prepare`, the writer's own code, from per-shard records of random CRCs and
sizes like a writer's), a stats sidecar per unit and the index as a running driver leaves it
(`commits.index_batch` segments; the markers since the last segment unindexed). On a local disk
the sidecars are hard links of one file: at 8B's shape a sidecar is 4 MiB (32 points x 4096 x 2
subsets x mean and M2 in float64), 15 GiB for 3,815 units otherwise, and finalize reads the same
bytes either way (served from the page cache, so its time is a floor).

The `shape` section builds such stores at Llama-3.1-8B's shape (32 points x 4096 wide bf16,
512-row shards, 512 shards a unit: 262,144 tokens, 3,815 units per 10^9 tokens) at several unit
counts, and measures in a fresh process each: opening the store for reading (building the SAE
reader's dataset), the resume decision, `status`, `verify` (default mode) and `finalize`: time and
peak RSS; plus marker, table and index bytes, one table's read time, and the growth law (a least-
squares line over the sizes) extrapolated to 10^9 and 10^10 tokens.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

CTX = 128
SHAPE_8B = {"points": 32, "width": 4096, "shard_rows": 512, "unit_shards": 512}
UNITS_PER_1B = -(-10**9 // (512 * 512))   # 3,815


def _records(rng, first: int, n: int, shard_rows: int, P: int, object_bytes: int) -> list[dict]:
    """n per-shard records as a writer makes them (tables.py): random CRCs, sizes +-2 %."""
    crc = rng.integers(0, 2**32, (n, 2, P)).tolist()
    nb = (object_bytes + rng.integers(-object_bytes // 50, object_bytes // 50, (n, P))).tolist()
    meta = rng.integers(0, 2**32, (n, 3)).tolist()
    cols = (("token_id", 4), ("doc_id", 8), ("position", 4))
    return [{"index": first + i, "row_start": (first + i) * shard_rows,
             "row_end": (first + i + 1) * shard_rows, "crc32c": crc[i][0], "nbytes": nb[i],
             "object_crc32c": crc[i][1],
             "meta": {c: {"crc32c": meta[i][j], "nbytes": shard_rows * k // 2}
                      for j, (c, k) in enumerate(cols)}}
            for i in range(n)]


def synthetic_bookkeeping(url: str, so: dict | None, n_units: int, points: int, width: int,
                          shard_rows: int, unit_shards: int) -> dict:
    """Build the store (see the module docstring); returns its sizes."""
    from ..store import create_store
    from ..store.format import layout
    from ..store.stats import moments as _moments
    from ..store.commit.markers import IndexBuilder, index_batch, prepare
    from ..store.commit.plan import Unit
    from ..store.commit.published import record as published_record

    U = shard_rows * unit_shards
    s = create_store(url, points=[f"resid_post.{i}" for i in range(points)], width=width,
                     n_rows=n_units * U, shard_rows=shard_rows, chunk_rows=shard_rows,
                     context_size=CTX, storage_options=so)
    loc, rng = s.location, np.random.default_rng(0)
    moments = [_moments.Moments.of(rng.standard_normal((64, width)).astype(np.float32))
               for _ in range(points)]
    blob = _moments.dumps({"all": moments, "kept": moments})
    sha = hashlib.sha256(blob).hexdigest()
    local = Path(url).is_dir()
    n_ctx = U // CTX
    units = [Unit(u, u * U, (u + 1) * U, ((u, 0, 0, n_ctx, 0),)) for u in range(n_units)]
    chunks = {f"{u}:0": {"n_contexts": n_ctx, "cursor": {"row": 0, "pos": None, "offset": 0},
                         "final": True, "rows": 1, "digest": [u, 0, 0], "stats": {}}
              for u in range(n_units)}
    state = {"placed": n_units, "next_unit": n_units, "next_block": n_units, "next_chunk": 0,
             "skip_ctx": 0, "doc_base": n_units, "last_cursor": None, "last_chunk": -1, "done": True}
    seg = 256
    for i in range(0, n_units, seg):
        s.ledger.plans.write_segment(i // seg, units[i:i + seg], {"chunks": {f"{u.unit_id}:0": chunks[f"{u.unit_id}:0"]
                                     for u in units[i:i + seg]}, "state": state}, final=i + seg >= n_units)
    s.ledger.plans.compact(units[: n_units // seg * seg], [{"chunks": chunks, "state": state}],
                           n_units // seg - 1, False)
    fake = SimpleNamespace(layout_version=s.layout_version, points=s.points, row_bytes=s.row_bytes,
                           row_set_bytes=s.row_set_bytes)
    obj_bytes = int(shard_rows * width * 2 / 1.42)   # the default codec's ratio on bf16
    index, indexed = IndexBuilder(), 0
    marker_bytes, table_bytes, pending = [], [], {}
    first_sidecar = None
    for u in units:
        skey = layout.stats_key(u.unit_id, "synthetic")
        if local and first_sidecar is not None:
            os.link(first_sidecar, os.path.join(url, skey))
        else:
            pending[loc.key(skey)] = blob
            if local:
                loc.write_bytes(skey, blob)
                pending.pop(loc.key(skey))
                first_sidecar = os.path.join(url, skey)
        recs = _records(rng, u.row_start // shard_rows, unit_shards, shard_rows, points, obj_bytes)
        prep = prepare(fake, u.unit_id, u.row_start, u.row_end, "synthetic", recs,
                       {"token_id": 1, "doc_id": 2, "position": 3},
                       {"key": skey, "sha256": sha, "count": U, "kept": U - U // CTX}, 1.0,
                       {"actor": u.unit_id % 8, "pid": 1 << 20, "attempt": "synthetic",
                        "host": "bench"})
        m = prep.marker
        raw = m.encode()
        marker_bytes.append(len(raw))
        table_bytes.append(len(prep.table_blob))
        pending[loc.key(prep.table_key)] = prep.table_blob
        pending[loc.key(layout.commit_key(u.unit_id, u.row_start, u.row_end))] = raw
        key, body = published_record(m, len(recs))   # published, as its writer leaves it
        pending[loc.key(key)] = body
        # indexed as the driver does (commits.index_batch); the markers since the last segment
        # stay unindexed, as a driver killed between two segments leaves them
        index.add(m)
        if index.count >= index_batch(indexed):
            s.ledger.write_index(index)
            indexed += index.count
            index = IndexBuilder()
        if len(pending) >= 512:
            loc.write_many(pending, durable=False, batch=500)
            pending = {}
    loc.write_many(pending, durable=False, batch=500)
    idx = loc.list_tree(layout.INDEX_DIR)
    return {"marker_bytes": round(float(np.mean(marker_bytes))),
            "marker_bytes_max": int(max(marker_bytes)),
            "table_bytes": round(float(np.mean(table_bytes))),
            "index_bytes": int(sum(idx.values())), "index_segments": len(idx)}


def table_child(spec: dict) -> dict:
    """One unit's table read cold through the accessor (what a reader pays per unit it reads)."""
    from ..store import open_store
    from ..store.commit.tables import unit_shards

    s = open_store(spec["url"], storage_options=spec.get("storage_options"), read_only=True)
    m = next(iter(s.ledger.iter_committed()))
    t0 = time.perf_counter()
    n = len(unit_shards(s, m))
    return {"shards": n, "seconds": round(time.perf_counter() - t0, 4)}


def read_open_child(spec: dict) -> dict:
    """The SAE reader's dataset built over the store (its pieces, counts, row total): what every
    training process holds before reading a row. shuffle=False: the mixing check reads 16 doc_id
    chunks (bounded, not per unit), which a store without data objects does not have."""
    from ..store import open_store
    from ..store.read.dataset import ActivationDataset

    t0 = time.perf_counter()
    s = open_store(spec["url"], storage_options=spec.get("storage_options"), read_only=True)
    ds = ActivationDataset(s, batch_size=4096, shuffle=False)
    return {"committed": len(ds._sources._lites), "pieces": len(ds.pieces), "rows": ds.n_rows,
            "tables_read": ds._store.ledger.table_cache.loads,
            "seconds": round(time.perf_counter() - t0, 3), "peak_rss_mb": round(peak_rss_mb(), 1)}


def peak_rss_mb() -> float:
    """VmHWM of this process (its peak resident set), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def fit(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


def shape_rows(sizes, workdir: Path, child) -> list[dict]:
    """The `shape` section's rows (see the module docstring); `child(flag, spec)` runs one
    operation in a fresh process and returns its JSON."""
    from ..store.format.markersize import marker_size

    sh = SHAPE_8B
    U = sh["shard_rows"] * sh["unit_shards"]
    rows, per_op = [], {}
    for n in sizes:
        url = str(workdir / f"shape-{n}")
        t0 = time.perf_counter()
        built = synthetic_bookkeeping(url, None, n, **sh)
        build = round(time.perf_counter() - t0, 1)
        spec_base = {"url": url, "storage_options": None, "units": n, "unit_contexts": U // CTX}
        t = child("--table-child", spec_base)
        rows.append({"mode": "shape store", "units": n, "tokens": n * U, **built,
                     "table_read_s": t["seconds"], "build_s": build,
                     "marker_bytes_layout2": marker_size(
                         [f"resid_post.{i}" for i in range(sh["points"])], n - 1, (n - 1) * U,
                         sh["unit_shards"], sh["shard_rows"], sh["width"] * 2,
                         int(sh["shard_rows"] * sh["width"] * 2 / 1.42),
                         {"token_id": 1024, "doc_id": 2048, "position": 1024}, version=2)})
        for op in ("read_open", "resume", "status", "verify", "finalize"):
            r = child("--read-open-child" if op == "read_open" else "--bookkeeping-child",
                      {**spec_base, "op": op})
            row = {"mode": f"shape op {op}", "units": n, "tokens": n * U, "seconds": r["seconds"],
                   "peak_rss_mb": r["peak_rss_mb"]}
            if op == "read_open":
                row["tables_read"] = r["tables_read"]
            rows.append(row)
            per_op.setdefault(op, []).append((n, r["seconds"], r["peak_rss_mb"]))
        import shutil

        shutil.rmtree(url, ignore_errors=True)
    if len(sizes) >= 2:
        for op, pts in per_op.items():
            ns = [p[0] for p in pts]
            a_s, b_s = fit(ns, [p[1] for p in pts])
            a_m, b_m = fit(ns, [p[2] for p in pts])
            rows.append({"mode": f"shape growth {op}", "rss_mb_base": round(a_m, 1),
                         "rss_kb_per_unit": round(b_m * 1024, 2), "s_base": round(a_s, 3),
                         "ms_per_unit": round(b_s * 1000, 3),
                         "rss_mb_1B": round(a_m + b_m * UNITS_PER_1B),
                         "rss_mb_10B": round(a_m + b_m * 10 * UNITS_PER_1B),
                         "s_1B": round(a_s + b_s * UNITS_PER_1B, 1),
                         "s_10B": round(a_s + b_s * 10 * UNITS_PER_1B, 1)})
    return rows


TABLES = [("shape store", "Bookkeeping at Llama-3.1-8B's shape (32 points x 4096, 512-row shards, "
           "512 shards a unit = 262,144 tokens; 3,815 units per 10^9 tokens): what a synthetic "
           "store holds (layout 3; `marker_bytes_layout2`: the same unit's marker in layout 2)",
           ("units", "tokens", "marker_bytes", "marker_bytes_max", "marker_bytes_layout2",
            "table_bytes", "index_bytes", "index_segments", "table_read_s", "build_s")),
          ("shape growth", "Growth law at 8B's shape (least squares over the sizes above), "
           "extrapolated to 10^9 and 10^10 tokens",
           ("mode", "rss_mb_base", "rss_kb_per_unit", "rss_mb_1B", "rss_mb_10B", "s_base",
            "ms_per_unit", "s_1B", "s_10B")),
          ("shape op", "Each operation on those stores in a fresh process (read_open: the SAE "
           "reader's dataset built)", ("mode", "units", "tokens", "seconds", "peak_rss_mb",
                                        "tables_read"))]
