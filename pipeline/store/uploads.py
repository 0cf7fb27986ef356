"""The machinery under RegionWriter: shard buffers, eviction, background uploads, failure cleanup.

Memory bound. Rows are buffered per shard (all points of `shard_rows` rows). A shard buffer is
"open" while rows arrive and "pending" while its upload runs; `write` blocks when
`max_pending_shards` uploads are in flight (backpressure on the producer instead of growing
memory), and evicts the least recently touched open shard when `max_open_shards` are open. So

    buffered bytes <= n_points x shard_bytes x (max_open_shards + max_pending_shards)

with shard_bytes = shard_rows x width x itemsize; with rows arriving in order only one shard is
open at a time and the bound is n_points x shard_bytes x (1 + max_pending_shards). Encoding adds a
transient copy per in-flight point upload (zarr encodes a shard into one object).

Why evict instead of refusing: the engine yields requests in completion order, which straddles shard
boundaries. An evicted shard's filled rows go to scratch objects of this attempt and are read back
when the shard completes, so no object a reader may trust is ever half written. Slower, never
wrong, and rare with max_open_shards >= 2.

Every object is written under this attempt's name (layout.attempt_object_key, scratch keys) and
recorded, so a failed or conflicting attempt removes exactly what it wrote. writer.py holds the
API (write, reserve, commit, abort) on top of this class.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import uuid
from collections import OrderedDict

import google_crc32c
import numpy as np

from . import layout
from . import stats as _stats
from .credentials import scrub
from .dtypes import raw_dtype
from .errors import RegionConflict, RegionWriteFailed, StoreError
from .shardio import lower_priority
from .shards import Shard, runs, shard_buffers
from .unitmeta import UnitMeta

log = logging.getLogger(__name__)


class ShardUploads:
    """Per-shard buffers of one region and their uploads; RegionWriter (writer.py) is the API.

    The knobs are RegionWriter's (memory bound above); this class holds no defaults of its own.
    """

    def __init__(self, store, unit_id: int, row_start: int, row_end: int, *,
                 max_open_shards: int, max_pending_shards: int, upload_threads: int,
                 retries: int):
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
        # Statistics: a shard's partials (all, kept per point) wait in _parts only until every
        # shard before it is merged into _acc, in shard order (the order commit always merged in,
        # so the same bits). Held: O(points x width) plus shards that complete out of order
        # (bounded by the producer's rows in flight, not by the unit's shard count).
        self._parts: dict[int, dict] = {}
        self._acc = {s: [_stats.Moments.empty(self._W) for _ in range(self._P)]
                     for s in layout.STATS_SUBSETS}
        self._next_stat = 0  # index in _shard_ids of the next shard to merge into _acc
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
        self._closed = False
        self._warned_evict = False
        self.bytes_uploaded = 0

    def shard_span(self, si: int) -> tuple[int, int]:
        """Rows of shard `si` that belong to this region (the last unit may end inside one)."""
        s0 = si * self._store.shard_rows
        return s0, min(s0 + self._store.shard_rows, self.row_end)

    # ---- internals ---------------------------------------------------------------------------
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
            self._release()
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
        sh.present = self._meta.present_mask(sh.start, sh.end) \
            if self._meta.complete(sh.start, sh.end) else None
        if sh.scratch:
            self._unflush(sh)  # the slow path: the evicted rows come back, then as any shard
        futs = [self._pool.submit(self._upload_point, sh, p) for p in range(self._P)]
        if self._meta.complete(sh.start, sh.end):
            futs.append(self._pool.submit(self._upload_meta, sh.index))
        self._pending[sh.index] = futs

    def _upload_meta(self, si: int) -> None:
        """The shard's rows of token_id, doc_id, position, gen: one chunk object per column."""
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
                if sh.present is not None:  # rows without activations count in no statistic
                    have = sh.present[i * cr:i * cr + rows.shape[0]]
                    rows, keep = rows[have], (None if keep is None else keep[have])
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
            part = self._parts.setdefault(sh.index, {"all": [None] * self._P,
                                                     "kept": [None] * self._P})
            part["all"][p], part["kept"][p] = mom_all, mom_kept
            self._merge_ready()
            self._crc.setdefault(sh.index, [None] * self._P)[p] = crc
            self._nbytes.setdefault(sh.index, [None] * self._P)[p] = nbytes
            self._ocrc.setdefault(sh.index, [None] * self._P)[p] = ocrc

    def _merge_ready(self) -> None:
        """Merge the shards whose partials are all in, in shard order, and drop them (caller
        holds the lock). Without this a unit held every shard's float64 partials until commit:
        4 MiB a shard at 32 points x 4096 wide, about 2 GiB for a unit of 512 shards."""
        ids = self._shard_ids
        while self._next_stat < len(ids):
            part = self._parts.get(ids[self._next_stat])
            if part is None or any(m is None for m in part["all"]):
                return
            self._merge_part(self._parts.pop(ids[self._next_stat]))
            self._next_stat += 1

    def _merge_part(self, part: dict) -> None:
        for subset, acc in self._acc.items():
            for p in range(self._P):
                acc[p] = acc[p].merge(part[subset][p])

    def merged_stats(self) -> dict:
        """subset -> per-point Moments of the whole unit: the running merge, then any partials
        left behind a gap, in shard order (as commit merged them before: same bits)."""
        with self._lock:
            self._merge_ready()
            for si in sorted(self._parts):
                self._merge_part(self._parts.pop(si))
            return {s: list(acc) for s, acc in self._acc.items()}

    def _release(self) -> None:
        """Drop what only an open writer needs: partials, row metadata (the token ids), shard
        states and per-shard records. A committed or failed writer may stay referenced for a
        while (a caller's frame, a result); it must not keep a unit's memory with it."""
        with self._lock:
            self._parts.clear()
            self._acc = {}
            self._states.clear()
            self._open.clear()
            self._pending.clear()
            self._meta = None
            self._crc, self._nbytes, self._ocrc, self._meta_rec = {}, {}, {}, {}

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
        self._release()
        raise RegionWriteFailed(self._failed_msg)

    def _shutdown(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
