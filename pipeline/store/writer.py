"""Streaming writer for one shard-aligned region: bounded buffers, background uploads, commit.

Memory bound. Rows are buffered per shard (all points of `shard_rows` rows). A shard buffer is
"open" while rows arrive and "pending" while its upload runs; `write` blocks when
`max_pending_shards` uploads are in flight (backpressure on the producer instead of growing
memory), and evicts the least recently touched open shard when `max_open_shards` are open. So

    buffered bytes <= n_points x shard_bytes x (max_open_shards + max_pending_shards)

with shard_bytes = shard_rows x width x itemsize; with rows arriving in order only one shard is
open at a time and the bound is n_points x shard_bytes x (1 + max_pending_shards). Encoding adds a
transient copy per in-flight point upload (zarr encodes a shard into one object).

Why evict instead of refusing: the engine yields requests in completion order, which straddles shard
boundaries. An evicted shard's filled rows are written straight into the zarr shard (a
read-modify-write that is safe because this writer alone owns the shard); the shard finishes the
same way later. Slower, never wrong, and rare with max_open_shards >= 2.

Row metadata (token_id, doc_id, position) of the region is given with `write_meta` and written
by this writer with its rows: the actor, not the driver, writes it, so nothing is written before
dispatch and a unit's metadata commits with its activations.

A commit marker is written only after every row of the region is uploaded; it carries the
region's stats partials (rows `all` and `kept`, by reference to a sidecar with its sha256), a
CRC32C per shard and point of the raw rows and one per metadata column, so `verify(deep=True)`
can prove the stored bytes are the committed ones.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict

import google_crc32c
import numpy as np

from . import commits as _commits
from . import layout
from . import stats as _stats
from .credentials import redact_attrs, scrub
from .dtypes import dtype_name, raw_dtype
from .errors import RegionConflict, RegionWriteFailed, StoreError
from .shardio import lower_priority
from .shards import Shard, runs, shard_buffers, to_numpy
from .unitmeta import UnitMeta

log = logging.getLogger(__name__)


class RegionWriter:
    """Write rows of one region in any order; `commit()` makes them visible, exactly once.

    Knobs: max_open_shards / max_pending_shards (memory bound above), upload_threads (parallel
    point uploads), retries (attempts per upload for transient errors, with backoff).
    """

    def __init__(self, store, unit_id: int, row_start: int, row_end: int, *,
                 max_open_shards: int = 2, max_pending_shards: int = 2, upload_threads: int = 4,
                 retries: int = 5):
        if max_open_shards < 1 or max_pending_shards < 1 or upload_threads < 1:
            raise ValueError("max_open_shards, max_pending_shards and upload_threads must be >= 1")
        self._store = store
        self.unit_id, self.row_start, self.row_end = unit_id, row_start, row_end
        self.max_open_shards, self.max_pending_shards = max_open_shards, max_pending_shards
        self.retries = retries
        self.attempt = uuid.uuid4().hex[:16]
        self._P, self._W, self._dtype = len(store.points), store.width, store.np_dtype
        self._raw = raw_dtype(self._dtype)  # buffers hold raw bits: bf16 copies are slow in numpy
        self._codecs = [store.shard_codec(p) for p in store.points]
        self._meta_codecs = {n: store.meta_codec(n) for n in layout.ROW_META}
        foreign = [p for p, c in zip(store.points, self._codecs) if c is None] + \
            [n for n, c in self._meta_codecs.items() if c is None]
        if foreign:
            raise StoreError(f"region_writer: arrays {foreign} of {store.url} use a codec chain harvest "
                             "does not write (it moves whole objects it encodes itself); create the "
                             "store with create_store")
        self._buffers = shard_buffers(store, 2 * (max_open_shards + max_pending_shards))
        sr = store.shard_rows
        self._shard_ids = list(range(row_start // sr, -(-row_end // sr)))
        self._meta = UnitMeta(unit_id, row_start, row_end, store.stats_filter())
        self._states: dict[int, Shard] = {}
        self._open: "OrderedDict[int, Shard]" = OrderedDict()
        self._pending: "OrderedDict[int, list[cf.Future]]" = OrderedDict()
        self._done: set[int] = set()
        self._meta_uploaded: set[int] = set()
        self._parts: dict[tuple[int, int], dict] = {}
        self._crc: dict[int, list] = {}
        self._nbytes: dict[int, list] = {}
        self._ocrc: dict[int, list] = {}         # CRC32C of each stored object, per point
        self._meta_rec: dict[int, dict] = {}     # shard -> column -> {crc32c, nbytes} of its chunk
        self._written: list[str] = []            # this attempt's objects, removed if it never commits
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(upload_threads, thread_name_prefix=f"harvest-up-{unit_id}",
                                           initializer=lower_priority)
        self._failed: BaseException | None = None
        self._failed_msg = ""
        self._manifest: dict | None = None
        self._closed = False
        self._warned_evict = False
        self.t_created = time.perf_counter()
        self.t_first_write: float | None = None
        self.rows_written = 0
        self.bytes_uploaded = 0
        existing = store.commit_manifest(unit_id, row_start, row_end, fresh=True)
        self.already_committed = existing is not None
        if self.already_committed:
            log.info("unit %d is already committed (attempt %s): writes are ignored",
                     unit_id, existing.get("attempt"))

    # ---- public ------------------------------------------------------------------------------
    def shard_span(self, si: int) -> tuple[int, int]:
        """Rows of shard `si` that belong to this region (the last unit may end inside one)."""
        s0 = si * self._store.shard_rows
        return s0, min(s0 + self._store.shard_rows, self.row_end)

    def write_meta(self, row_start: int, token_id, doc_id, position) -> None:
        """Row metadata of rows [row_start, row_start + n); each row once, before its activations
        (the `kept` statistics of a shard need its token ids when the shard is encoded)."""
        if self.already_committed:
            return
        self._check_usable()
        self._meta.write(row_start, token_id, doc_id, position)

    def write(self, row_start: int, acts) -> None:
        """Rows [row_start, row_start + n) of every point: acts is [n_points, n, width]."""
        if self.already_committed:
            return
        self._check_usable()
        a = to_numpy(acts, self._dtype)
        if a.ndim == 2 and self._P == 1:
            a = a[None]
        if a.ndim != 3 or a.shape[0] != self._P or a.shape[2] != self._W:
            raise ValueError(f"write: acts must be [n_points={self._P}, n, width={self._W}], got "
                             f"{tuple(a.shape)}")
        if a.dtype != self._dtype:
            raise ValueError(f"write: acts dtype {a.dtype} does not match the store dtype "
                             f"{dtype_name(self._dtype)}; create the store with dtype="
                             f"'{dtype_name(a.dtype) if a.dtype.kind == 'f' else a.dtype}' or cast "
                             "explicitly (a silent cast would change the bits)")
        a = a.view(self._raw)
        n = a.shape[1]
        if n == 0:
            return
        lo, hi = int(row_start), int(row_start) + n
        if lo < self.row_start or hi > self.row_end:
            raise ValueError(f"write: rows [{lo}, {hi}) fall outside unit {self.unit_id}'s region "
                             f"[{self.row_start}, {self.row_end})")
        pieces = []
        r = lo
        while r < hi:
            si = r // self._store.shard_rows
            s0, s1 = self.shard_span(si)
            e = min(hi, s1)
            pieces.append((si, r - s0, e - s0, r - lo, e - lo))
            r = e
        for si, o0, o1, _, _ in pieces:  # refuse duplicates before touching anything
            st = self._states.get(si)
            if si in self._done or si in self._pending or (
                    st is not None and (st.filled[o0:o1].any() or st.reserved[o0:o1].any())):
                raise ValueError(f"write: rows of [{lo}, {hi}) in shard {si} were already written to unit "
                                 f"{self.unit_id}; each row is written once (stats would count it twice)")
        if self.t_first_write is None:
            self.t_first_write = time.perf_counter()
        for si, o0, o1, a0, a1 in pieces:
            sh = self._shard_for_write(si)
            sh.data[:, o0:o1] = a[:, a0:a1]
            self._filled(sh, o0, o1)
        self._reap()

    # ---- one host copy: rows the engine writes in place ----------------------------------------
    def reserve(self, row_start: int, n: int) -> "np.ndarray | None":
        """Where rows [row_start, row_start + n) go, as a writable view [n_points, n, width] of
        the shard buffer (raw bits of the store dtype), for a producer that writes them in place
        (the engine's destination provider: one host copy instead of two). None when the rows
        straddle a shard boundary: `write` them instead.

        The rows count as written only when `fill_reserved` says so; until then the shard is
        pinned: it is neither evicted nor recycled, because the producer may still be writing
        (asynchronously, on CUDA). Rows already written or reserved are refused, as in `write`.
        After `abort` an outstanding view stays valid memory (it is dropped, never reused)."""
        if self.already_committed:
            return None
        self._check_usable()
        lo, hi = int(row_start), int(row_start) + int(n)
        if n <= 0 or lo < self.row_start or hi > self.row_end:
            raise ValueError(f"reserve: rows [{lo}, {hi}) fall outside unit {self.unit_id}'s region "
                             f"[{self.row_start}, {self.row_end})")
        si = lo // self._store.shard_rows
        s0, s1 = self.shard_span(si)
        if hi > s1:
            return None
        o0, o1 = lo - s0, hi - s0
        st = self._states.get(si)
        if si in self._done or si in self._pending or (
                st is not None and (st.filled[o0:o1].any() or st.reserved[o0:o1].any())):
            raise ValueError(f"reserve: rows of [{lo}, {hi}) in shard {si} were already written or "
                             f"reserved in unit {self.unit_id}; each row is written once")
        if self.t_first_write is None:
            self.t_first_write = time.perf_counter()
        sh = self._shard_for_write(si)
        sh.reserved[o0:o1] = True
        sh.pins += 1
        return sh.data[:, o0:o1]

    def fill_reserved(self, row_start: int, n: int) -> None:
        """The producer finished rows [row_start, row_start + n) of an earlier `reserve`."""
        if self.already_committed:
            return
        self._check_usable()
        si = int(row_start) // self._store.shard_rows
        s0, _ = self.shard_span(si)
        o0, o1 = int(row_start) - s0, int(row_start) - s0 + int(n)
        sh = self._open.get(si)
        if sh is None or not sh.reserved[o0:o1].all():
            raise ValueError(f"fill_reserved: rows [{row_start}, {row_start + n}) of unit "
                             f"{self.unit_id} were not reserved")
        sh.reserved[o0:o1] = False
        sh.pins -= 1
        self._filled(sh, o0, o1)
        self._reap()

    def _filled(self, sh: Shard, o0: int, o1: int) -> None:
        sh.filled[o0:o1] = True
        sh.n_filled += o1 - o0
        self.rows_written += o1 - o0
        if sh.n_filled == sh.n:
            self._complete(sh)

    def commit(self, extra: dict | None = None) -> dict:
        """Wait for uploads, check every row was written, write the create-once commit marker."""
        if self._manifest is not None:
            return self._manifest
        if self.already_committed:
            m = dict(self._store.commit_manifest(self.unit_id, self.row_start, self.row_end))
            m["already_committed"] = True
            self._manifest = m
            self._shutdown()
            return m
        self._check_usable()
        from .store import _jsonable

        extra = redact_attrs(_jsonable(extra or {}, "commit extra"), self._store.location.storage_options)
        missing = []
        for si in self._shard_ids:
            if si in self._done or si in self._pending:
                continue
            st = self._states.get(si)
            s0, s1 = self.shard_span(si)
            holes = runs(~st.filled) if st is not None else [(0, s1 - s0)]
            missing += [(s0 + a, s0 + b) for a, b in holes]
        if missing:
            n_miss = sum(b - a for a, b in missing)
            ex = ", ".join(f"[{a},{b})" for a, b in missing[:3])
            raise ValueError(f"commit: unit {self.unit_id} has {n_miss} rows never written (e.g. {ex}); "
                             "write them, or abort() to leave the region uncommitted")
        self._meta.check_complete()
        for si in self._shard_ids:
            if si not in self._meta_uploaded:
                self._pending.setdefault(si, []).append(self._pool.submit(self._upload_meta, si))
        self._wait_pending(all_=True)
        self._check_usable()
        self._check_conflict()
        merged = {}
        for subset in layout.STATS_SUBSETS:
            merged[subset] = _stats.merge_all([self._parts[k][subset] for k in sorted(self._parts)],
                                              self._P, self._W)
        blob = _stats.dumps(merged)
        skey = layout.stats_key(self.unit_id, self.attempt)
        seconds = time.perf_counter() - (self.t_first_write or self.t_created)
        manifest = _commits.build_marker(
            self._store, self.unit_id, self.row_start, self.row_end, self.attempt,
            [(si, *self.shard_span(si), self._crc[si], self._nbytes.get(si), self._ocrc.get(si),
              self._meta_rec.get(si)) for si in self._shard_ids],
            self._meta.crc32c(), {"key": skey, "sha256": hashlib.sha256(blob).hexdigest(),
                                  "count": merged["all"][0].count if merged["all"] else 0,
                                  "kept": merged["kept"][0].count if merged["kept"] else 0},
            seconds, extra)
        try:
            self._store.location.write_bytes(skey, blob)
            created = _commits.create_marker(self._store.location, manifest)
        except Exception as e:  # noqa: BLE001 -- reported without secrets, region left uncommitted
            self._fail(e, "writing the commit marker")
            self._cleanup(skey)
            raise RegionWriteFailed(self._failed_msg) from None
        if created:
            self._publish(manifest)
        else:
            other = self._store.commit_manifest(self.unit_id, self.row_start, self.row_end,
                                                fresh=True) or {}
            if other.get("attempt") != self.attempt:
                self._shutdown()
                self._cleanup(skey)
                raise RegionConflict(
                    f"commit: unit {self.unit_id} was committed by another writer (attempt "
                    f"{other.get('attempt')}) while this one was writing; this writer's objects are "
                    "removed and the committed ones are untouched (each attempt writes its own).")
            manifest = other
        self._store._remember_marker(manifest)
        self._manifest = manifest
        self._shutdown()
        log.info("unit %d committed: %d rows, %.1f MB/s", self.unit_id, manifest["n_rows"],
                 (manifest["bytes_per_s"] or 0) / 1e6)
        return manifest

    def abort(self) -> None:
        """Drop buffers, stop uploads and remove what this attempt wrote; the region stays
        uncommitted (rewrite it later)."""
        self._closed = True
        for futs in self._pending.values():
            for f in futs:
                f.cancel()
        self._shutdown()
        self._open.clear()
        self._pending.clear()
        self._states.clear()
        if self._manifest is None and not self.already_committed:
            self._cleanup()

    def _publish(self, manifest: dict) -> None:
        """Move this attempt's objects to their zarr keys (only the marker's creator does): until
        then readers take them under the attempt's name, and finalize finishes a move a crash cut."""
        from .objects import publish

        try:
            publish(self._store, manifest)
        except Exception as e:  # noqa: BLE001 -- committed already; readers fall back, finalize repairs
            log.warning("unit %d: moving its objects to their zarr keys failed (%s); they stay under "
                        "attempt %s until finalize", self.unit_id,
                        scrub(f"{type(e).__name__}: {e}", self._store.location.storage_options), self.attempt)
        self._remove([k for k in self._written if k.startswith(layout.SCRATCH_DIR)])

    def _cleanup(self, *extra: str) -> None:
        """Best effort: remove this attempt's objects and scratch (it never committed)."""
        with self._lock:
            keys = list(self._written) + list(extra)
            self._written.clear()
        self._remove(keys)

    def _remove(self, keys: list[str]) -> None:
        for k in keys:
            try:
                self._store.location.delete(k)
            except Exception as e:  # noqa: BLE001 -- garbage under an attempt name harms nothing
                log.warning("unit %d: could not remove %s (%s)", self.unit_id, k, type(e).__name__)

    def throughput(self) -> dict:
        now = time.perf_counter()
        secs = now - (self.t_first_write or now)
        written = self.rows_written * self._P * self._store.row_bytes
        return {"bytes_written": written, "bytes_uploaded": self.bytes_uploaded, "seconds": secs,
                "write_bytes_per_s": written / secs if secs > 0 else None,
                "upload_bytes_per_s": self.bytes_uploaded / secs if secs > 0 else None}

    @property
    def buffered_bytes(self) -> int:
        n = sum(1 for s in self._open.values() if s.data is not None) + len(self._pending)
        return n * self._P * self._store.shard_rows * self._store.row_bytes

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._manifest is None:
            if exc_type is None:
                log.warning("region writer of unit %d closed without commit(); region left uncommitted",
                            self.unit_id)
            self.abort()
        return False

    # ---- internals ---------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._failed is not None:
            self._raise_failed()
        if self._closed:
            raise StoreError(f"region writer of unit {self.unit_id} is closed (aborted or committed)")

    def _fail(self, exc: BaseException, what: str) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = exc
                cause = scrub(f"{type(exc).__name__}: {exc}", self._store.location.storage_options)
                self._failed_msg = (f"unit {self.unit_id}: {what} failed for good: {cause}; the region is "
                                    "left uncommitted and can be rewritten")
                log.error(self._failed_msg)

    def _check_conflict(self) -> None:
        other = self._store.commit_manifest(self.unit_id, self.row_start, self.row_end, fresh=True)
        if other is not None and other.get("attempt") != self.attempt:
            self._closed = True
            self._shutdown()
            self._cleanup()
            raise RegionConflict(f"unit {self.unit_id} was committed by another writer (attempt "
                                 f"{other.get('attempt')}); this writer stopped before uploading more")

    def _shard_for_write(self, si: int) -> Shard:
        sh = self._open.get(si)
        if sh is None:
            sh = self._states.get(si)
            if sh is None:
                s0, s1 = self.shard_span(si)
                sh = self._states[si] = Shard(si, s0, s1)
            while len(self._open) >= self.max_open_shards:
                # the least recently touched shard nobody is writing in place; when all are
                # pinned, open one more (memory then bounded by the producer's rows in flight)
                victim = next((i for i, o in self._open.items() if not o.pins), None)
                if victim is None:
                    break
                self._evict(victim)
            sh.data = self._buffers.take()[:, :sh.n]  # each point's rows stay contiguous
            self._open[si] = sh
        self._open.move_to_end(si)
        return sh

    def _put(self, key: str, blob: bytes) -> None:
        with self._lock:
            self._written.append(key)
        self._store.location.write_bytes(key, blob, attempts=self.retries)

    def _evict(self, si: int) -> None:
        sh = self._open.pop(si)
        if not self._warned_evict:
            log.warning("unit %d: rows arrive spread over more than max_open_shards=%d shards; flushing "
                        "partial shards (correct but slower; raise max_open_shards)", self.unit_id,
                        self.max_open_shards)
            self._warned_evict = True
        self._flush_partial(sh)
        self._buffers.give(sh.data)
        sh.data = None

    def _flush_partial(self, sh: Shard) -> None:
        """An evicted shard's filled rows go to scratch objects of this attempt (raw rows of every
        point), read back when the shard completes; never into an object a reader may trust."""
        if sh.flushed is None:
            sh.flushed = np.zeros(sh.n, bool)
        rows = sh.filled & ~sh.flushed
        try:
            for a, b in runs(rows):
                key = layout.scratch_key(self.unit_id, self.attempt, sh.index, a, b)
                self._put(key, np.ascontiguousarray(sh.data[:, a:b]).tobytes())
                sh.scratch.append((a, b, key))
        except Exception as e:  # noqa: BLE001
            self._fail(e, f"upload of shard {sh.index}")
            self._raise_failed()
        sh.flushed |= rows

    def _unflush(self, sh: Shard) -> None:
        """Rows an eviction put in scratch objects, back into the shard's buffer."""
        try:
            for a, b, key in sh.scratch:
                raw = self._store.location.read_bytes(key, attempts=self.retries)
                if raw is None:
                    raise StoreError(f"scratch object {key} of this writer vanished")
                sh.data[:, a:b] = np.frombuffer(raw, self._raw).reshape(self._P, b - a, self._W)
        except Exception as e:  # noqa: BLE001
            self._fail(e, f"reading back evicted rows of shard {sh.index}")
            self._raise_failed()

    def _complete(self, sh: Shard) -> None:
        del self._open[sh.index]
        self._check_conflict()
        self._wait_pending(all_=False)
        sh.keep = self._meta.keep_mask(sh.start, sh.end)
        if sh.scratch:
            self._unflush(sh)  # the slow path: the evicted rows come back, then as any shard
        futs = [self._pool.submit(self._upload_point, sh, p) for p in range(self._P)]
        if self._meta.complete(sh.start, sh.end):
            futs.append(self._pool.submit(self._upload_meta, sh.index))
        self._pending[sh.index] = futs

    def _upload_meta(self, si: int) -> None:
        """The shard's rows of token_id, doc_id, position: one chunk object per column."""
        if self._failed is not None or self._closed:
            return
        s0, s1 = self.shard_span(si)
        rec = {}
        try:
            for name, col in self._meta.columns(s0, s1).items():
                blob = self._meta_codecs[name].encode(col)
                self._put(layout.attempt_object_key(name, si, self.attempt), blob)
                rec[name] = {"crc32c": google_crc32c.value(blob), "nbytes": len(blob)}
        except Exception as e:  # noqa: BLE001
            self._fail(e, f"metadata upload of shard {si}")
            return
        with self._lock:
            self._meta_rec[si] = rec
            self._meta_uploaded.add(si)

    def _upload_point(self, sh: Shard, p: int) -> None:
        if self._failed is not None or self._closed:
            return
        x = sh.data[p].view(self._dtype)
        crc = _stats.crc32c(sh.data[p])
        try:
            codec = self._codecs[p]
            parts: list = [None] * -(-x.shape[0] // codec.chunk_rows)
            cr = codec.chunk_rows

            def moments(i, rows):  # in the codec thread, while the chunk is in cache
                keep = None if sh.keep is None else sh.keep[i * cr:i * cr + rows.shape[0]]
                parts[i] = _stats.subsets_of(rows, keep)

            blob = codec.encode(x, sh.index, visit=moments)
            # in chunk order: deterministic
            mom_all = _stats.merge_all([[q[0]] for q in parts], 1, self._W)[0]
            mom_kept = _stats.merge_all([[q[1]] for q in parts], 1, self._W)[0]
            ocrc = google_crc32c.value(blob)  # what readers check before decoding
            point = self._store.points[p]
            self._put(layout.attempt_object_key(layout.point_path(point), sh.index, self.attempt), blob)
            nbytes = len(blob)
            with self._lock:
                self.bytes_uploaded += x.nbytes
        except Exception as e:  # noqa: BLE001
            self._fail(e, f"upload of shard {sh.index} ({self._store.points[p]})")
            return
        with self._lock:
            part = self._parts.setdefault((sh.index, 0), {"all": [None] * self._P,
                                                          "kept": [None] * self._P})
            part["all"][p], part["kept"][p] = mom_all, mom_kept
            self._crc.setdefault(sh.index, [None] * self._P)[p] = crc
            self._nbytes.setdefault(sh.index, [None] * self._P)[p] = nbytes
            self._ocrc.setdefault(sh.index, [None] * self._P)[p] = ocrc

    def _reap(self) -> None:
        for si in [si for si, fs in self._pending.items() if all(f.done() for f in fs)]:
            self._finish(si)

    def _finish(self, si: int) -> None:
        futs = self._pending.pop(si)
        for f in futs:
            f.result()  # the upload functions record their own failures; this surfaces bugs
        st = self._states.get(si)
        if st is not None:
            self._buffers.give(st.data)  # every upload of it has finished
            st.data = None
        self._done.add(si)

    def _wait_pending(self, all_: bool) -> None:
        limit = 0 if all_ else self.max_pending_shards - 1
        while len(self._pending) > limit:
            si, futs = next(iter(self._pending.items()))
            cf.wait(futs)
            self._finish(si)
        self._reap()
        if self._failed is not None:
            self._raise_failed()

    def _raise_failed(self):
        """Stop every upload, remove what this attempt wrote (a full disk must not keep its
        half-written unit's objects), then raise."""
        self._closed = True
        self._shutdown()
        self._cleanup()
        raise RegionWriteFailed(self._failed_msg)

    def _shutdown(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
