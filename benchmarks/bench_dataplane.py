"""The data plane at an 8B model's shape (issue 24): object sizes, counts, requests, writer memory,
publish time against write time, local and on S3 (SeaweedFS started here, stopped by pid).

Each storage gets `units` units of `shards_per_unit` shards of the store's default layout for
32 points x 4096 wide bf16 (a 16,384-row shard: 128 MiB per point, 4 GiB a shard set), written by
the store's RegionWriter from rows fed in 512-row pieces (a unit's rows built from one 512-row
sample of heavy-tailed activations, every row made distinct, so the writer never holds more than
the producer's piece: what the writer holds is what is measured). Per storage:

- stored data objects (min/median/max bytes, from the markers) and metadata chunks;
- objects per unit (data + metadata + stats sidecar + marker) and, on S3, API requests per unit
  counted on the S3 client itself (botocore's before-call event: every request s3fs makes);
- the writer's own peak of buffered bytes and the process's RSS growth over the write (sampled
  every 20 ms), against one shard set;
- write seconds (first row to the commit's return) and, inside it, publish seconds (completing
  the uploads on S3, renames locally: the step that used to copy every byte).

    .venv/bin/python -m harvest.benchmarks.bench_dataplane [--units 2] [--storage local s3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

POINTS, WIDTH, PIECE = 32, 4096, 512


class PeakRSS:
    """RSS growth of this process while the block runs, sampled every 20 ms (`base`, `peak`;
    tests/store/test_store_scale.py uses it too)."""

    def __enter__(self):
        import psutil

        self._p, self._stop = psutil.Process(), threading.Event()
        self.base = self.peak = self._p.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._p.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def _count_requests(store) -> dict:
    """{operation: count} of every S3 request this store's client makes from now on."""
    counts: dict = {}
    fs = store.location.fs
    fs.connect() if getattr(fs, "_s3", None) is None and hasattr(fs, "connect") else None
    client = getattr(fs, "s3", None)
    if client is None:
        return counts

    def count(model, **_):
        counts[model.name] = counts.get(model.name, 0) + 1

    client.meta.events.register("before-call.s3", count)
    return counts


def _meta_columns(a0: int, n: int, seed: int):
    """Realistic row metadata: token ids over Llama-3's vocabulary, documents of ~600 tokens
    (doc ids rising, positions restarting), so chunk sizes are real ones."""
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(n, n // 600, replace=False))
    doc = np.zeros(n, np.int64)
    doc[starts] = 1
    doc = np.cumsum(doc) + a0 // 600
    pos = np.arange(n) - np.maximum.accumulate(np.where(np.diff(doc, prepend=-1) > 0, np.arange(n), 0))
    return rng.integers(0, 128256, n, dtype=np.int32), doc, pos.astype(np.int32)


def meta_at_default_unit(tmp: str) -> dict:
    """Stored bytes of each metadata column's chunk at the pipeline's default unit (262,144
    rows: 16 shards of this shape, 64 GiB of rows, too much to write here), encoded by the
    store's own codec from realistic columns."""
    from harvest.store import create_store
    from harvest.store.format import layout

    unit = 1 << 18
    s = create_store(os.path.join(tmp, "meta-probe"), points=["resid_post.0"], width=WIDTH, n_rows=unit,
                     shard_rows=layout.choose_sizes(WIDTH, 2, POINTS, multiple=128)[0],
                     context_size=128, meta_chunk_rows=unit)
    cols = dict(zip(layout.ROW_META, _meta_columns(0, unit, 0)))
    return {f"meta_chunk_bytes_default_unit_{k}": len(s.meta_codec(k).encode(v)) for k, v in cols.items()}


def _one(storage: str, url: str, so, units: int, shards_per_unit: int, base: np.ndarray) -> dict:
    from harvest.store import create_store
    from harvest.store.commit import objects

    from harvest.store.format import layout

    sr = layout.choose_sizes(WIDTH, 2, POINTS, multiple=128)[0]
    unit_rows = sr * shards_per_unit
    # as the pipeline creates stores: row metadata in one chunk per unit
    s = create_store(url, points=[f"resid_post.{i}" for i in range(POINTS)], width=WIDTH,
                     n_rows=1 << 30, storage_options=so, context_size=128, meta_chunk_rows=unit_rows)
    s.write_plan(s.default_plan(shards_per_unit)[:units])
    counts = _count_requests(s)
    publish_s = []
    real_publish = objects.publish

    def timed_publish(*a, **k):
        t = time.perf_counter()
        try:
            return real_publish(*a, **k)
        finally:
            publish_s.append(time.perf_counter() - t)

    objects.publish = timed_publish
    out = {"storage": storage, "points": POINTS, "width": WIDTH, "shard_rows": sr,
           "shard_mib_per_point": sr * WIDTH * 2 / 2**20, "units": units,
           "shards_per_unit": shards_per_unit}
    markers, write_s, peaks, rss = [], [], [], []
    try:
        for u in s.plan():
            a0, b0 = u["row_start"], u["row_end"]
            before = dict(counts)
            with PeakRSS() as pk:
                t = time.perf_counter()
                w = s.region_writer(u["unit_id"], a0, b0)
                n = b0 - a0
                w.write_meta(a0, *_meta_columns(a0, n, u["unit_id"]))
                for r in range(a0, b0, PIECE):
                    piece = base.view(np.uint16) ^ np.uint16((r // PIECE) & 0x7F)
                    w.write(r, piece.view(base.dtype))
                m = w.commit()
                write_s.append(time.perf_counter() - t)
            peaks.append(w.peak_buffered_bytes)
            rss.append(pk.peak - pk.base)
            markers.append(m)
            out.setdefault("block_rows", w.block_rows)
            if counts:
                out.setdefault("requests_per_unit_by_op", []).append(
                    {k: v - before.get(k, 0) for k, v in counts.items() if v - before.get(k, 0)})
    finally:
        objects.publish = real_publish
    from harvest.store.commit.tables import unit_shards  # layout 3: records in the unit's table

    recs = [sh for m in markers for sh in unit_shards(s, m)]
    data = [b for sh in recs for b in sh["nbytes"]]
    meta = sorted({(r.get("chunk", sh["index"]), c, r["nbytes"]) for sh in recs
                   for c, r in sh["meta"].items()})
    meta = [b for _, _, b in meta]
    logical = unit_rows * POINTS * WIDTH * 2
    out.update({
        "data_object_bytes_min": min(data), "data_object_bytes_median": int(statistics.median(data)),
        "data_object_bytes_max": max(data), "compression_ratio": round(sr * WIDTH * 2 * len(data) / sum(data), 3),
        "meta_object_bytes_min": min(meta), "meta_object_bytes_max": max(meta),
        "objects_per_unit": shards_per_unit * POINTS + 3 + 3,  # + sidecar, table, marker
        "objects_per_1b_tokens": round(1e9 / sr * POINTS + 5 * 1e9 / unit_rows),
        "writer_peak_buffered_mib": round(max(peaks) / 2**20, 1),
        "rss_growth_mib": round(max(rss) / 2**20, 1),
        "shard_set_mib": round(sr * POINTS * WIDTH * 2 / 2**20, 1),
        "write_s_per_unit": round(statistics.median(write_s), 2),
        "publish_s_per_unit": round(statistics.median(publish_s), 3) if publish_s else None,
        "write_mb_s": round(logical / statistics.median(write_s) / 1e6, 1),
    })
    if counts:
        per = out.pop("requests_per_unit_by_op")
        out["requests_per_unit"] = int(statistics.median(sum(d.values()) for d in per))
        out["requests_by_op"] = ", ".join(f"{k} {v}" for k, v in sorted(per[-1].items()))
    v = s.verify(deep=False)
    out["verify_ok"] = bool(v["ok"])
    return out


def run(units: int = 2, shards_per_unit: int = 1, storage=("local", "s3"),
        workdir: str | None = None, **_ignored) -> list[dict]:
    from harvest.testing import seaweed, synthetic

    base = synthetic.activations((POINTS, PIECE, WIDTH), seed=3)
    tmp = workdir or tempfile.mkdtemp(prefix="harvest-bench-dataplane-")
    rows, srv = [], None
    try:
        for st in storage:
            so, url = None, os.path.join(tmp, "store-local")
            if st == "s3":
                srv = seaweed.start(os.path.join(tmp, "weed"))
                import s3fs

                s3fs.S3FileSystem(**srv.storage_options).mkdir("bench")
                so, url = srv.storage_options, "s3://bench/store"
            rows.append(_one(st, url, so, units, shards_per_unit, base))
            if st == "local":
                rows[-1].update(meta_at_default_unit(tmp))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if st == "local":
                shutil.rmtree(url, ignore_errors=True)
            if srv is not None:
                srv.stop()
                srv = None
    finally:
        if srv is not None:
            srv.stop()
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", type=int, default=2)
    ap.add_argument("--shards-per-unit", type=int, default=1)
    ap.add_argument("--storage", nargs="+", default=["local", "s3"])
    ap.add_argument("--workdir", default=None, help="where stores go (default: a temp dir)")
    a = ap.parse_args()
    for r in run(units=a.units, shards_per_unit=a.shards_per_unit, storage=a.storage, workdir=a.workdir):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
