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
  the uploads on S3, renames locally: no byte is copied);
- the whole write path's CPU cost, `write_core_s_per_gb`: this process's CPU seconds (every
  thread: the writer's buffers, the codec, CRCs, statistics, the upload client) per GB of bf16
  input (rows x width x 2 bytes, whatever the store's dtype), from the first row to the commit's
  return, less the producer's own cost of making the rows (measured alone on the same pieces,
  `producer_core_s_per_gb`). The storage server (SeaweedFS) is another process, not counted.

Rows arrive in place by default (`RegionWriter.reserve`, the capture actor's path: the engine's
device-to-host copy lands in the writer's block); `--producer copy` feeds them by `write` (one
host copy more, the `buffer` stage). Each `--dtype` (default: bfloat16 and float8_e4m3fn side by
side; fp8 rows arrive packed, quantised as the engine does before rows leave it), each `--codec`
(store.compression names; `default`: the dtype's default) and, on S3, each `--part-mib` gets its
own store, in one invocation. `--json` prints one document: the rows and a summary against issue
38's targets (<= 1.0 core-s/GB of bf16 for bf16 stores, <= 0.6 for fp8, on S3) with the load
average. `--dry`: a tiny shape in seconds (the suite runs it).

    .venv/bin/python -m harvest.benchmarks.bench_dataplane [--units 2] [--storage local s3]
        [--dtype bfloat16 float8_e4m3fn] [--codec default] [--part-mib 5 16]
        [--client direct s3fs] [--json] [--dry]
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
from typing import Any

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


class StageCPU:
    """CPU seconds per write-path stage (thread CPU time, all threads), by wrapping the stage
    functions while the block runs: `encode` (the codec, per inner chunk), `stats` (per-chunk
    moments, stats/unit.chunk_moments), `crc` (raw rows' CRC32C), `stream` (object CRC, gathering parts, handing them to
    the storage: a local store's write() is here, an S3 part's upload is the client's threads),
    `buffer` (the producer's rows copied into the writer's blocks). What the wrapped functions
    miss (the S3 client's threads: HTTP, and over plain http SigV4's SHA-256 of every payload;
    the kernel's socket and page-cache work; the commit) is `other`."""

    def __enter__(self):
        import collections

        from ..store.stats import unit as blockstats
        from ..store.stats import moments
        from ..store.format import shardcodec
        from ..store.write import streams
        from ..store.write import writer

        self.cpu, self._lock, self._undo = collections.Counter(), threading.Lock(), []
        self._wrap(shardcodec.ShardCodec, "_encode_chunk", "encode")
        self._wrap(blockstats, "chunk_moments", "stats")
        self._wrap(moments, "crc32c", "crc")
        self._wrap(streams.ObjectStream, "append", "stream")
        from ..store.storage.s3 import S3Storage

        # inside `stream` (appends send full parts): an S3 part's request, on this thread where
        # the PartSender sends it (s3fs only waits for its event loop here)
        self._wrap(S3Storage, "write_part", "upload")
        self._wrap(writer.RegionWriter, "write", "buffer")
        return self

    def _wrap(self, owner, name, stage):
        f = getattr(owner, name)

        def timed(*a, **k):
            t = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                with self._lock:
                    self.cpu[stage] += time.thread_time() - t
        setattr(owner, name, timed)
        self._undo.append((owner, name, f))

    def __exit__(self, *exc):
        for owner, name, f in reversed(self._undo):
            setattr(owner, name, f)


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
    from ..store import create_store
    from ..store.format import layout

    unit = 1 << 18
    s = create_store(os.path.join(tmp, "meta-probe"), points=["resid_post.0"], width=WIDTH, n_rows=unit,
                     shard_rows=layout.choose_sizes(WIDTH, 2, POINTS, multiple=128)[0],
                     context_size=128, meta_chunk_rows=unit)
    cols = dict(zip(layout.ROW_META, _meta_columns(0, unit, 0)))
    return {f"meta_chunk_bytes_default_unit_{k}": len(s.meta_codec(k).encode(v)) for k, v in cols.items()}


def _base_rows(base: np.ndarray, dtype: str) -> np.ndarray:
    """The producer's sample in the store's raw row form: bf16 bits, or for an fp8 store the
    packed rows (e4m3fn bytes + a float32 scale per row) the engine quantises into before rows
    leave the GPU (fp8.py), so neither the quantiser nor a bf16-sized copy is in the write path."""
    from ..store.format import fp8
    from ..store.format.dtypes import is_quantized, raw_dtype, resolve_dtype

    if is_quantized(dtype):
        return fp8.quantize(base)
    d = resolve_dtype(dtype)
    return (base if base.dtype == d else base.astype(d)).view(raw_dtype(d))


def _make_piece(raw: np.ndarray, r: int, out: np.ndarray, fp8: bool) -> None:
    """Piece `r // PIECE` of the producer into `out` (a writer's reserved rows, or scratch):
    `raw` made distinct per piece (fp8: sign bits of some columns, which keeps every value
    finite; otherwise the low mantissa bits), written once, as a transport would."""
    k = (r // PIECE) & 0x7F
    if fp8:
        w = raw.shape[-1] - 4
        mask = np.where((np.arange(w) + k) % 7 == 0, 0x80, 0).astype(np.uint8)
        np.bitwise_xor(raw[..., :w], mask, out=out[..., :w])
        out[..., w:] = raw[..., w:]
    else:
        np.bitwise_xor(raw, raw.dtype.type(k), out=out)


def _produce(w, raw: np.ndarray, a0: int, b0: int, fp8: bool, inplace: bool) -> None:
    """Feed rows [a0, b0) to writer `w` in PIECE-row pieces: in place (`reserve`, as the capture
    actor does: the engine's device-to-host copy lands in the writer's block, one host copy) or
    by `write` (the producer's array copied into the block: one copy more)."""
    scratch = np.empty_like(raw)
    for r in range(a0, b0, PIECE):
        n = min(PIECE, b0 - r)
        view = w.reserve(r, n) if inplace else None
        if view is not None:
            _make_piece(raw[:, :n], r, view, fp8)
            w.fill_reserved(r, n)
        else:
            _make_piece(raw[:, :n], r, scratch[:, :n], fp8)
            w.write(r, scratch[:, :n])


def producer_cost(raw: np.ndarray, rows: int, fp8: bool) -> float:
    """CPU seconds of making `rows` rows of pieces alone, into one buffer (subtracted from the
    write path's: on a GPU host this is the device-to-host copy)."""
    out = np.empty_like(raw)
    t = time.process_time()
    for r in range(0, rows, PIECE):
        _make_piece(raw, r, out, fp8)
    return time.process_time() - t


def _warm(raw: np.ndarray, fp8: bool) -> None:
    """Load what a capture process loads once (numba and the compiled statistics kernels, from
    their disk cache) before the clock starts: a per-process cost, not a per-GB one."""
    from ..store.format.dtypes import BF16
    from ..store.stats.unit import chunk_moments

    rows = raw[0, :8] if fp8 else raw[0, :8].view(BF16)
    chunk_moments(np.ascontiguousarray(rows), None, None, None, fp8)


def _one(storage: str, url: str, so, units: int, shards_per_unit: int, base: np.ndarray,
         codec: str = "default", dtype: str = "bfloat16", inplace: bool = True,
         shard_rows: "int | None" = None) -> dict:
    from ..store import create_store
    from ..store.commit import objects

    from ..store.format import layout
    from ..store.format.dtypes import resolve_dtype, row_width

    np_dtype = resolve_dtype(dtype)
    P, W = base.shape[0], base.shape[2]
    # the store's own choice (spec.py): ~128 MiB shard objects of its stored rows
    sr = shard_rows or layout.choose_sizes(row_width(dtype, W), np_dtype.itemsize, P, multiple=128)[0]
    unit_rows = sr * shards_per_unit
    # as the pipeline creates stores: row metadata in one chunk per unit
    s = create_store(url, points=[f"resid_post.{i}" for i in range(P)], width=W,
                     n_rows=1 << 30, storage_options=so, context_size=128, meta_chunk_rows=unit_rows,
                     dtype=dtype, compression=codec, shard_rows=sr)
    raw = _base_rows(base, s.dtype)
    fp8 = bool(s.quantized)
    _warm(raw, fp8)
    s.ledger.write_plan(s.ledger.default_plan(shards_per_unit)[:units])
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
    from ..store.storage.s3parts import PartSender

    real_part = PartSender.upload_part

    def counted_part(*a, **k):  # parts sent from the writer's buffers bypass botocore's events
        counts["UploadPart"] = counts.get("UploadPart", 0) + 1
        return real_part(*a, **k)

    PartSender.upload_part = counted_part  # type: ignore[method-assign]
    out: dict[str, Any] = {"storage": storage, "codec": s.compression, "dtype": s.dtype, "points": P,
           "width": W, "shard_rows": sr, "producer": "in place (reserve)" if inplace else "write (a copy)",
           "shard_mib_per_point": round(sr * s.row_bytes / 2**20, 2), "units": units,
           "shards_per_unit": shards_per_unit}
    if storage == "s3":
        out["part_bytes"] = s.location.part_min_bytes
    markers, write_s, peaks, rss, cpu_s, stage_s = [], [], [], [], [], []
    try:
        for u in s.ledger.plan():
            a0, b0 = u["row_start"], u["row_end"]
            before = dict(counts)
            with PeakRSS() as pk, StageCPU() as stages:
                t, c0 = time.perf_counter(), time.process_time()
                w = s.region_writer(u["unit_id"], a0, b0)
                n = b0 - a0
                w.write_meta(a0, *_meta_columns(a0, n, u["unit_id"]))
                _produce(w, raw, a0, b0, fp8, inplace)
                m = w.commit()
                write_s.append(time.perf_counter() - t)
                cpu_s.append(time.process_time() - c0)
            stage_s.append(dict(stages.cpu))
            peaks.append(w.peak_buffered_bytes)
            rss.append(pk.peak - pk.base)
            markers.append(m)
            out.setdefault("block_rows", w.block_rows)
            if counts:
                out.setdefault("requests_per_unit_by_op", []).append(
                    {k: v - before.get(k, 0) for k, v in counts.items() if v - before.get(k, 0)})
    finally:
        objects.publish = real_publish
        PartSender.upload_part = real_part  # type: ignore[method-assign]
    from ..store.commit.tables import unit_shards  # layout 3: records in the unit's table

    recs = [sh for m in markers for sh in unit_shards(s, m)]
    data = [b for sh in recs for b in sh.nbytes]
    chunks = sorted({(sh.index if r.chunk is None else r.chunk, c, r.nbytes) for sh in recs
                     for c, r in sh.meta.items()})
    meta = [b for _, _, b in chunks]
    logical = unit_rows * P * s.row_bytes
    bf16_gb = unit_rows * P * W * 2 / 1e9
    producer = producer_cost(raw, unit_rows, fp8)
    out.update({
        "write_core_s_per_gb": round((statistics.median(cpu_s) - producer) / bf16_gb, 3),
        # every unit's; the first also pays the process's one-time costs (the writer's block
        # buffers' first touch: on this VM's lazily backed memory ~0.2 core-s/GB at one unit)
        "unit_core_s_per_gb": [round((c - producer) / bf16_gb, 3) for c in cpu_s],
        "producer_core_s_per_gb": round(producer / bf16_gb, 3),
        "write_core_s_per_gb_by_stage": _by_stage(stage_s, cpu_s, producer, bf16_gb),
        "data_object_bytes_min": min(data), "data_object_bytes_median": int(statistics.median(data)),
        "data_object_bytes_max": max(data),
        "compression_ratio": round(sr * s.row_bytes * len(data) / sum(data), 3),
        "stored_vs_bf16": round(sum(data) / (sr * W * 2 * len(data)), 3),
        "meta_object_bytes_min": min(meta), "meta_object_bytes_max": max(meta),
        "objects_per_unit": shards_per_unit * P + 3 + 3,  # + sidecar, table, marker
        "objects_per_1b_tokens": round(1e9 / sr * P + 5 * 1e9 / unit_rows),
        "writer_peak_buffered_mib": round(max(peaks) / 2**20, 1),
        "rss_growth_mib": round(max(rss) / 2**20, 1),
        "shard_set_mib": round(sr * P * s.row_bytes / 2**20, 1),
        "write_s_per_unit": round(statistics.median(write_s), 2),
        "publish_s_per_unit": round(statistics.median(publish_s), 3) if publish_s else None,
        "write_mb_s": round(logical / statistics.median(write_s) / 1e6, 1),
        "write_bf16_mb_s": round(bf16_gb * 1e3 / statistics.median(write_s), 1),
    })
    if counts:
        per = out.pop("requests_per_unit_by_op")
        out["requests_per_unit"] = int(statistics.median(sum(d.values()) for d in per))
        out["requests_by_op"] = ", ".join(f"{k} {v}" for k, v in sorted(per[-1].items()))
    v = s.verify(deep=False)
    out["verify_ok"] = bool(v.ok)
    return out


def _by_stage(stage_s: list, cpu_s: list, producer: float, bf16_gb: float) -> dict:
    """The median unit's stages in core-s per GB of bf16 input; `other` is the rest of the
    write path's process CPU (see StageCPU), `buffer` without the producer's own cost."""
    i = sorted(range(len(cpu_s)), key=cpu_s.__getitem__)[len(cpu_s) // 2]
    st = dict(stage_s[i])
    total = cpu_s[i] - producer
    if "upload" in st:
        st["stream"] = st.get("stream", 0.0) - st["upload"]   # nested: counted once, as upload
    known = sum(st.values())
    st["other"] = total - known
    return {k: round(v / bf16_gb, 3) for k, v in sorted(st.items())}


def _fixed_heap_thresholds() -> None:
    """glibc: fixed mmap (32 MiB) and trim (64 MiB) thresholds for the floor's loop. Alone, one
    chunk's output freed before the next is allocated makes glibc trim its heap and fault the
    next one in afresh (~250,000 page faults per GB; encode 0.87-0.90 core-s/GB instead of
    0.55); the writer's process, with its other allocations in flight, does not (its encode
    stage: 0.68-0.70, and the same with these thresholds), so the floor leaves that out."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 << 20)   # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 << 20)   # M_TRIM_THRESHOLD
    except (OSError, AttributeError):   # not glibc
        pass


def floor(storage=("local", "s3"), dtypes=("bfloat16", "float8_e4m3fn"), dry: bool = False,
          workdir: "str | None" = None, codecs=("default",)) -> dict:
    """Each stage of the write path alone, in one thread, as the writer runs it (the store's
    default codec per inner chunk, the statistics kernel per chunk, the raw rows' CRC32C, and on
    S3 the parts of the encoded bytes sent by the writer's client in 16 MiB parts), in core-s per
    GB of bf16 input (thread CPU time: user and kernel). Their sum is what the whole path cannot go
    below on this machine with today's stages: no threads, Python, buffers or commit counted.
    `without_stats` leaves the statistics out (what a host whose statistics were computed on
    the GPU would pay). Keys: the dtype, or `dtype/codec` for a codec other than its default. 32 points x 4,096 rows x 4096 wide (1 GiB of bf16: the rows of
    bench_dataplane's units); `dry`: tiny."""
    from ..store import create_store
    from ..store.format.dtypes import resolve_dtype, row_width
    from ..store.stats.moments import crc32c
    from ..store.stats.unit import chunk_moments
    from ..testing import seaweed, synthetic

    P, W, n = (2, 256, 2048) if dry else (POINTS, WIDTH, 4096)
    _fixed_heap_thresholds()
    base = synthetic.activations((P, PIECE, W), seed=3)
    tmp = workdir or tempfile.mkdtemp(prefix="harvest-bench-floor-")
    srv = seaweed.start(os.path.join(tmp, "weed")) if "s3" in storage else None
    out: dict = {"points": P, "width": W, "rows": n, "load_average": None, "dtypes": {}}
    try:
        if srv is not None:
            import s3fs

            s3fs.S3FileSystem(**srv.storage_options).mkdir("floor")
        for i, (dtype, cname) in enumerate((d, c) for d in dtypes for c in codecs):
            url, so = os.path.join(tmp, f"probe-{i}"), None
            if srv is not None:
                url, so = f"s3://floor/probe-{i}", srv.storage_options
            s = create_store(url, points=[f"resid_post.{p}" for p in range(P)], width=W, n_rows=n,
                             shard_rows=n, dtype=dtype, storage_options=so,
                             compression=None if cname == "default" else cname)
            q = bool(s.quantized)
            raw = _base_rows(base, s.dtype)
            data = np.empty((P, n, row_width(s.dtype, W)), raw.dtype)
            for r in range(0, n, PIECE):
                _make_piece(raw, r, data[:, r:r + PIECE], q)
            _warm(raw, q)
            codec, cr = s.shard_codec(s.points[0]), s.chunk_rows
            chunks = [data[p, c:c + cr] for p in range(P) for c in range(0, n, cr)]
            vdt = None if q else resolve_dtype(s.dtype)   # the statistics read values
            # chunk by chunk in the writer's order (statistics, then the raw CRC while the chunk
            # is in cache, then the codec), parts sent as they fill and then dropped, so memory
            # is reused as in the writer (fresh pages would be charged to whichever stage
            # touches them first)
            cpu = dict.fromkeys(("encode", "stats", "crc") + (("upload",) if srv else ()), 0.0)
            loc = s.location
            h = loc.begin_object("floor-object", "floor-object") if srv is not None else None
            part: list = []
            size = stored = 0
            for j, c in enumerate(chunks):
                t0 = time.thread_time()
                chunk_moments(c if vdt is None else c.view(vdt), None, None, None, q)
                t1 = time.thread_time()
                crc32c(c)
                t2 = time.thread_time()
                e = codec.encode_chunk(c)
                t3 = time.thread_time()
                cpu["stats"] += t1 - t0
                cpu["crc"] += t2 - t1
                cpu["encode"] += t3 - t2
                stored += len(e)
                if h is None:
                    continue
                part.append(e)
                size += len(e)
                if size >= loc.part_min_bytes or j == len(chunks) - 1:
                    t = time.thread_time()
                    loc.write_part(h, part)
                    cpu["upload"] += time.thread_time() - t
                    part, size = [], 0
            if h is not None:
                loc.abort_object(h)
            gb = P * n * W * 2 / 1e9
            st = {k: round(v / gb, 3) for k, v in cpu.items()}
            total = round(sum(st.values()), 3)
            out["dtypes"][s.dtype if cname == "default" else f"{s.dtype}/{cname}"] = {"codec": s.compression.get("codec"),
                                      "stored_vs_bf16": round(stored / (P * n * W * 2), 3),
                                      "core_s_per_gb": st, "floor": total,
                                      "without_stats": round(total - st["stats"], 3),
                                      "target": {"bfloat16": 1.0, "float8_e4m3fn": 0.6}.get(s.dtype)}
    finally:
        if srv is not None:
            srv.stop()
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return out


def check_dtype(dtype: str) -> str:
    """The store dtype's canonical name, or SystemExit naming the ones the store knows."""
    from ..store.format.dtypes import SUPPORTED_DTYPES, dtype_name, is_quantized, resolve_dtype

    try:
        d = resolve_dtype(dtype)
        return str(dtype) if is_quantized(str(dtype)) else dtype_name(d)
    except (ValueError, KeyError) as e:
        raise SystemExit(f"bench_dataplane: --dtype {dtype!r}: {e} (the store's dtypes: "
                         f"{', '.join(SUPPORTED_DTYPES)})") from None


def run(units: int = 3, shards_per_unit: int = 1, storage=("local", "s3"),
        workdir: str | None = None, codecs=("default",), dtype="bfloat16", inplace: bool = True,
        dry: bool = False, part_mib=(None,), clients=("direct",), **_ignored) -> list[dict]:
    """One row per (storage, part size on S3, dtype, codec), side by side in this invocation.
    `dtype`: a name or a list of names. `part_mib`: S3 part sizes (None: the store's own,
    S3Storage.part_min_bytes). `clients`: how S3 parts are sent, each its own store ("direct":
    s3parts.PartSender from the writer's buffers; "s3fs": through s3fs). `dry`: a tiny shape (4 points x 256, 2,048-row shards) in
    seconds, for the test suite: the same code path, no figure worth reporting."""
    from ..store.format import compression
    from ..store.storage.s3 import S3Storage
    from ..testing import seaweed, synthetic

    dtypes = [check_dtype(d) for d in ([dtype] if isinstance(dtype, str) else dtype)]
    for c in codecs:
        try:
            compression.normalize(c)
        except ValueError as e:
            raise SystemExit(f"bench_dataplane: --codec {c!r}: {e}") from None
    P, W, sr = (4, 256, 2048) if dry else (POINTS, WIDTH, None)
    base = synthetic.activations((P, PIECE, W), seed=3)
    tmp = workdir or tempfile.mkdtemp(prefix="harvest-bench-dataplane-")
    rows, srv = [], None
    try:
        for st in storage:
            so, base_url = None, os.path.join(tmp, "store-local")
            if st == "s3":
                srv = seaweed.start(os.path.join(tmp, "weed"))
                import s3fs

                s3fs.S3FileSystem(**srv.storage_options).mkdir("bench")
                so, base_url = srv.storage_options, "s3://bench/store"
            i = 0
            own_part = S3Storage.part_min_bytes
            own_direct = S3Storage.direct_parts
            for part, client in ([(p, c) for p in part_mib for c in clients] if st == "s3"
                                 else [(None, None)]):
                S3Storage.part_min_bytes = own_part if part is None else int(part * 2**20)
                S3Storage.direct_parts = client != "s3fs"
                try:
                    for dt in dtypes:
                        for codec in codecs:
                            url = f"{base_url}-{i}"
                            # "default" is the dtype's default (fp8: fp8.DEFAULT_COMPRESSION)
                            spec = None if codec == "default" else codec
                            rows.append(_one(st, url, so, units, shards_per_unit, base, spec, dt,
                                             inplace, sr))
                            if client is not None:
                                rows[-1]["client"] = client
                            if st == "local" and i == 0 and not dry:
                                rows[-1].update(meta_at_default_unit(tmp))
                            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                            if st == "local":
                                shutil.rmtree(url, ignore_errors=True)
                            i += 1
                finally:
                    S3Storage.part_min_bytes = own_part
                    S3Storage.direct_parts = own_direct
            if srv is not None:
                srv.stop()
                srv = None
    finally:
        if srv is not None:
            srv.stop()
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """The write path against issue 38's targets (core-s per GB of bf16 input, to S3): <= 1.0
    for bf16 stores, <= 0.6 for fp8 stores; `load_average` is the box's when it finished."""
    target = {"bfloat16": 1.0, "float8_e4m3fn": 0.6}
    out: dict = {"load_average": [round(x, 2) for x in os.getloadavg()], "targets": {}}
    for r in rows:
        t = target.get(r["dtype"])
        if r["storage"] == "s3" and t is not None:
            key = f"{r['dtype']}/{r['codec'].get('codec')}/{r['part_bytes'] >> 20}MiB" + \
                (f"/{r['client']}" if r.get("client") else "")
            out["targets"][key] = {"write_core_s_per_gb": r["write_core_s_per_gb"], "target": t,
                                   "met": r["write_core_s_per_gb"] <= t}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", type=int, default=3,
                    help="units per store; the median unit is reported (3: a unit after the "
                         "first, whose block buffers are already touched, as in a capture process)")
    ap.add_argument("--shards-per-unit", type=int, default=1)
    ap.add_argument("--storage", nargs="+", default=["local", "s3"])
    ap.add_argument("--workdir", default=None, help="where stores go (default: a temp dir)")
    ap.add_argument("--codec", nargs="+", default=["default"],
                    help="store.compression names, each its own store, side by side ('default': "
                         "the dtype's default)")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float8_e4m3fn"],
                    help="store dtypes, each its own store, side by side")
    ap.add_argument("--producer", choices=["inplace", "copy"], default="inplace",
                    help="rows written in place (reserve: the capture actor's path) or by write()")
    ap.add_argument("--part-mib", type=float, nargs="+", default=None,
                    help="S3 parts gathered to these sizes, each its own store (default: the "
                         "store's, S3Storage.part_min_bytes)")
    ap.add_argument("--client", nargs="+", choices=["direct", "s3fs"], default=["direct"],
                    help="how S3 parts are sent, each its own store: from the writer's buffers "
                         "(direct, the default) or through s3fs")
    ap.add_argument("--dry", action="store_true", help="a tiny shape, local only unless --storage")
    ap.add_argument("--json", action="store_true", help="one JSON document: rows and summary")
    ap.add_argument("--floor", action="store_true",
                    help="only each stage alone, one thread (the whole path's floor here)")
    a = ap.parse_args()
    if a.floor:
        print(json.dumps(floor(a.storage, [check_dtype(d) for d in a.dtype], a.dry, a.workdir,
                               a.codec)))
        return
    rows = run(units=a.units, shards_per_unit=a.shards_per_unit, storage=a.storage, workdir=a.workdir,
               codecs=a.codec, dtype=a.dtype, inplace=a.producer == "inplace", dry=a.dry,
               part_mib=a.part_mib or (None,), clients=a.client)
    if a.json:
        print(json.dumps({"rows": rows, "summary": summary(rows)}))
    else:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps(summary(rows)))


if __name__ == "__main__":
    main()
