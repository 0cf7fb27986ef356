"""The machinery under RegionWriter: block buffers, eviction, streamed shard objects, cleanup.

Memory bound. Rows are buffered per *block* (all points of `block_rows` rows: whole inner
chunks, a divisor of the shard, `layout.block_rows`), never per shard. A block is "open" while
rows arrive and "pending" while its encode and append run; `write` blocks when
`max_pending_shards` blocks are in flight (backpressure on the producer instead of growing
memory), and evicts the least recently touched open block when `max_open_shards` are open (the
knobs keep their old names: they count blocks now). Each point's shard object is streamed
(streams.py): a completed block's chunks are appended to it at once, so

    buffered bytes <= n_points x block_bytes x (max_open + max_pending)
                      + n_points x open shard objects x (part_min_bytes + compressed block)

independent of the shard size (the second term is 0 locally; on S3 it is what gathering 16 MiB
parts costs: S3Storage.part_min_bytes). `buffered_bytes` and `peak_buffered_bytes` are this accounting.

Why evict instead of refusing: the engine yields requests in completion order, which straddles
block boundaries. An evicted block's filled rows go to scratch objects of this attempt and are
read back when the block completes, so no object a reader may trust is ever half written. Slower,
never wrong, and rare with max_open_shards >= 2.

Every object is written under this attempt's name or as an upload only its commit completes
(streams.py, store/storage/interface.py), and recorded, so a failed or conflicting attempt removes exactly what it
wrote. writer.py holds the API (write, reserve, commit, abort) on top of this class; the unit's
statistics merge in store/stats/unit.py, an evicted block's scratch objects are block_buffers.py's
(flush_partial, unflush), and removing an attempt's objects is streams.discard.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import uuid
from collections import OrderedDict

import google_crc32c
import numpy as np

from ..format import layout
from ..stats import moments as _moments
from ..stats.unit import BlockStats, chunk_partials
from ..storage.credentials import scrub
from ..format import fp8 as _fp8
from ..format.dtypes import raw_dtype
from ..errors import RegionConflict, RegionWriteFailed, StoreError
from ..format.shardcodec import lower_priority
from ..format.roles import captured_codes
from .block_buffers import BlockBuffer, flush_partial, shard_buffers, unflush
from .streams import ObjectStream, crc32c_combine, discard, write_small
from .unitmeta import UnitMeta
from ..stats.moments import Moments
from ..storage.interface import UploadRecord

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
        self._P, self._W, self._dtype = len(store.points), store.max_width, store.np_dtype
        self._RW = store.row_width   # columns of a buffer row (fp8: width + its scale)
        # each point's own width and stored columns: a narrower point uses the first columns of
        # its [block_rows, max width] buffer slot (FORMAT.md "Per-point widths")
        self._widths = [store.widths[p] for p in store.points]
        self._RWs = [store.point_row_width(p) for p in store.points]
        # statistics are of the values a reader gets: an fp8 store's dequantised rows (fp8.py)
        self._decode = _fp8.dequantize if store.quantized else None
        self._raw = raw_dtype(self._dtype)  # buffers hold raw bits: bf16 copies are slow in numpy
        self._codecs = [store.shard_codec(p) for p in store.points]
        self._meta_codecs = {n: store.meta_codec(n) for n in store.meta_columns}
        foreign = [p for p, c in zip(store.points, self._codecs) if c is None] + \
            [n for n, c in self._meta_codecs.items() if c is None]
        if foreign:
            raise StoreError(f"region_writer: arrays {foreign} of {store.url} use a codec chain harvest "
                             "does not write (it moves whole objects it encodes itself); create the "
                             "store with create_store")
        # Row metadata chunks: one per shard, or one per unit where the store was created with
        # meta_chunk_rows = the unit size (the pipeline does: ~1-2 MB objects, not 2-4 KiB ones).
        # Units never share a chunk: a region must start on one (units do).
        self._meta_rows = self._meta_codecs["token_id"].chunk
        if self._meta_rows != store.shard_rows and row_start % self._meta_rows:
            raise StoreError(f"region_writer: unit {unit_id} starts at row {row_start}, inside a row "
                             f"metadata chunk of {self._meta_rows} rows (the store's unit size): units "
                             "must start on a chunk, or two writers would share its object")
        sr, cr = store.shard_rows, self._codecs[0].chunk_rows
        # rows of a block: every block lies inside one shard and holds whole inner chunks
        self.block_rows = layout.block_rows(sr, cr, self._P, store.row_bytes, store.context_size)
        self._buffers = shard_buffers(store, self.block_rows, 2 * (max_open_shards + max_pending_shards))
        br = self.block_rows
        self._shard_ids = list(range(row_start // sr, -(-row_end // sr)))
        self._block_ids = list(range(row_start // br, -(-row_end // br)))
        self._blocks_of: dict[int, int] = {}  # shard -> its blocks in this region
        for b in self._block_ids:
            si = b * br // sr
            self._blocks_of[si] = self._blocks_of.get(si, 0) + 1
        self._blocks_done: dict[int, int] = {}  # shard -> blocks handed to the encoders
        self._meta = UnitMeta(unit_id, row_start, row_end, store.stats_filter(),
                              list(store.meta_columns), captured_codes(store))
        self._states: dict[int, BlockBuffer] = {}     # block id -> its buffer state
        self._open: "OrderedDict[int, BlockBuffer]" = OrderedDict()
        self._pending: "OrderedDict[int | tuple[str, int], list[cf.Future]]" = OrderedDict()
        self._done: set[int | tuple[str, int]] = set()   # blocks (and ("meta", chunk)) uploaded
        self._checked: set[int] = set()         # shards whose first block looked for a marker
        # shards whose metadata chunks were handed to an upload thread: commit uploads the rest.
        # Marked when submitted, not when done: a second upload of a chunk still in flight
        # would leave an upload no marker names (on S3, one never completed nor aborted)
        self._meta_uploaded: set[int] = set()
        self._streams: dict[tuple[int, int], ObjectStream] = {}  # (shard, point) -> its object
        self._stats = BlockStats(self._block_ids, self._widths)   # merged in block order
        self._crc: dict[int, list] = {}
        self._nbytes: dict[int, list] = {}
        self._ocrc: dict[int, list] = {}         # CRC32C of each stored object, per point
        self._upload: dict[int, list] = {}       # shard -> per point: the storage's upload record
        self._meta_rec: dict[int, dict] = {}     # shard -> column -> {crc32c, nbytes[, upload]}
        self._meta_streams: list[tuple[str, str, UploadRecord]] = []  # (final, attempt, upload) of chunks
        self._written: list[str] = []            # this attempt's objects, removed if it never commits
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(upload_threads, thread_name_prefix=f"harvest-up-{unit_id}",
                                           initializer=lower_priority)
        self._failed: BaseException | None = None
        self._failed_msg = ""
        self._closed = False
        self._warned_evict = False
        self.bytes_uploaded = 0
        self.peak_buffered_bytes = 0

    def shard_span(self, si: int) -> tuple[int, int]:
        """Rows of shard `si` that belong to this region (the last unit may end inside one)."""
        s0 = si * self._store.shard_rows
        return s0, min(s0 + self._store.shard_rows, self.row_end)

    def block_span(self, b: int) -> tuple[int, int]:
        """Rows of block `b` that belong to this region."""
        b0 = b * self.block_rows
        return b0, min(b0 + self.block_rows, self.row_end)

    @property
    def buffered_bytes(self) -> int:
        """Bytes this writer holds now: block buffers (open and pending) and compressed bytes
        waiting to make a part (see the module docstring)."""
        n = sum(1 for s in self._open.values() if s.data is not None) + len(self._pending)
        with self._lock:  # upload threads add streams meanwhile
            held = sum(st.pending_bytes for st in self._streams.values())
        return n * self._P * self.block_rows * self._store.row_bytes + held

    def _note_peak(self) -> None:
        """Producer thread only (it alone changes the open and pending blocks)."""
        self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)

    # ---- internals ---------------------------------------------------------------------------
    def _cleanup(self, *extra: str) -> None:
        """Best effort: remove this attempt's objects, uploads and scratch (it never committed).
        Called after the upload threads stopped, so no stream is being appended to."""
        with self._lock:
            keys = list(self._written) + list(extra)
            self._written.clear()
            streams = list(self._streams.values())
            self._streams.clear()
            metas = list(self._meta_streams)
            self._meta_streams.clear()
        discard(self._store.location, streams, [(final, up) for final, _, up in metas], keys,
                f"unit {self.unit_id}")

    def _remove(self, keys: list[str]) -> None:
        discard(self._store.location, [], [], keys, f"unit {self.unit_id}")

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
        other = self._store.ledger.commit_manifest(self.unit_id, self.row_start, self.row_end, fresh=True)
        if other is not None and other.attempt != self.attempt:
            self._closed = True
            self._shutdown()
            self._cleanup()
            self._release()
            raise RegionConflict(f"unit {self.unit_id} was committed by another writer (attempt "
                                 f"{other.attempt}); this writer stopped before uploading more")

    def _shard_for_write(self, b: int) -> BlockBuffer:
        """Block `b`'s open buffer (a `BlockBuffer` state at block granularity)."""
        sh = self._open.get(b)
        if sh is None:
            sh = self._states.get(b)
            if sh is None:
                s0, s1 = self.block_span(b)
                sh = self._states[b] = BlockBuffer(b, s0, s1)
            while len(self._open) >= self.max_open_shards:
                # the least recently touched block nobody is writing in place; when all are
                # pinned, open one more (memory then bounded by the producer's rows in flight)
                victim = next((i for i, o in self._open.items() if not o.pins), None)
                if victim is None:
                    break
                self._evict(victim)
            sh.data = self._buffers.take()[:, :sh.n]  # each point's rows stay contiguous
            self._open[b] = sh
            self._note_peak()
        self._open.move_to_end(b)
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

    def _flush_partial(self, sh: BlockBuffer) -> None:
        """An evicted shard's filled rows go to scratch objects of this attempt (raw rows of every
        point), read back when the shard completes; never into an object a reader may trust."""
        try:
            flush_partial(sh, self._put, self.unit_id, self.attempt)
        except Exception as e:  # noqa: BLE001
            self._fail(e, f"scratch upload of block {sh.index}")
            self._raise_failed()

    def _unflush(self, sh: BlockBuffer) -> None:
        """Rows an eviction put in scratch objects, back into the shard's buffer."""
        try:
            unflush(sh, self._store.location, self.retries)
        except Exception as e:  # noqa: BLE001
            self._fail(e, f"reading back evicted rows of block {sh.index}")
            self._raise_failed()

    def _complete(self, sh: BlockBuffer) -> None:
        """Block `sh` has all its rows: encode and append it to its shard's objects (threads)."""
        del self._open[sh.index]
        si = sh.start // self._store.shard_rows
        if si not in self._checked:  # one marker GET per shard, as before blocks existed
            self._checked.add(si)
            self._check_conflict()
        self._wait_pending(all_=False)
        sh.keep = self._meta.keep_mask(sh.start, sh.end)
        sh.present = self._meta.present_mask(sh.start, sh.end) \
            if self._meta.complete(sh.start, sh.end) else None
        if sh.scratch:
            self._unflush(sh)  # the slow path: the evicted rows come back, then as any block
        self._meta.zero_unstored(sh.data, sh.start, sh.end)  # capture.roles (store/format/roles.py)
        futs = [self._pool.submit(self._upload_point, sh, p) for p in range(self._P)]
        self._blocks_done[si] = self._blocks_done.get(si, 0) + 1
        if self._meta_rows == self._store.shard_rows and \
                self._blocks_done[si] == self._blocks_of[si] and self._meta.complete(*self.shard_span(si)):
            self._meta_uploaded.add(si)  # per-shard chunks go up with their shard; unit chunks at commit
            futs.append(self._pool.submit(self._upload_meta, si))
        self._pending[sh.index] = futs
        self._note_peak()

    def meta_chunk_ids(self) -> list[int]:
        """The row metadata chunks of this region (shards, or the unit's one chunk)."""
        m = self._meta_rows
        return list(range(self.row_start // m, -(-self.row_end // m)))

    def _upload_meta(self, si: int) -> None:
        """Chunk `si` of token_id, doc_id, position (and role, gen where the store has them; this
        region's rows of it): one object per column. Its record goes into every shard record of
        the chunk (with `chunk` when the chunk is the unit's, so readers find the object and
        slice their shard's rows)."""
        if self._failed is not None or self._closed:
            return
        s0, s1 = si * self._meta_rows, min((si + 1) * self._meta_rows, self.row_end)
        unit_chunk = self._meta_rows != self._store.shard_rows
        rec = {}
        loc = self._store.location
        try:
            for name, col in self._meta.columns(s0, s1).items():
                blob = self._meta_codecs[name].encode(col)
                final, att = layout.meta_chunk_key(name, si), layout.attempt_object_key(name, si, self.attempt)
                with self._lock:
                    self._written.append(att)
                up = write_small(loc, final, att, blob)
                rec[name] = {"crc32c": google_crc32c.value(blob), "nbytes": len(blob)}
                if unit_chunk:
                    rec[name]["chunk"] = si
                if up is not None:
                    rec[name]["upload"] = up
                    with self._lock:
                        self._meta_streams.append((final, att, up))
        except Exception as e:  # noqa: BLE001
            self._fail(e, f"metadata upload of shard {si}")
            return
        with self._lock:
            sr = self._store.shard_rows
            for shard in range(s0 // sr, -(-s1 // sr)):
                self._meta_rec[shard] = rec

    def _stream(self, si: int, p: int) -> ObjectStream:
        with self._lock:
            st = self._streams.get((si, p))
            if st is None:
                point = self._store.points[p]
                att = layout.attempt_object_key(layout.point_path(point), si, self.attempt)
                self._written.append(att)
                st = self._streams[(si, p)] = ObjectStream(
                    self._store.location, layout.shard_object_key(point, si), att,
                    self._blocks_of[si], self._codecs[p].index_tail)
            return st

    def _upload_point(self, sh: BlockBuffer, p: int) -> None:
        """Encode block `sh` of point `p` and append it to the point's shard object; the last
        block of a shard finishes the object."""
        if self._failed is not None or self._closed:
            return
        raw = sh.data[p] if self._RWs[p] == self._RW else \
            np.ascontiguousarray(sh.data[p, :, :self._RWs[p]])
        x = raw.view(self._dtype)
        sr = self._store.shard_rows
        si = sh.start // sr
        try:
            codec = self._codecs[p]
            cr = codec.chunk_rows
            n_chunks = -(-x.shape[0] // cr)
            stats_visit, partials = chunk_partials(sh.keep, sh.present, cr, n_chunks,
                                                   self._decode, self._decode is not None)
            crcs: list = [None] * n_chunks
            # ids and weights, not activations: no statistics (FORMAT.md "Points of 32-bit
            # values"); their bits read as the store's floats would be noise and NaNs
            values = self._store.points[p] in self._store.point_values

            def visit(i: int, rows) -> None:
                # the raw rows' CRC32C per inner chunk, while the statistics left it in cache
                # (a pass of its own over the block cost 1.6x with google-crc32c: RESULTS.md)
                if not values:
                    stats_visit(i, rows)
                crcs[i] = (_moments.crc32c(rows), rows.nbytes)

            chunks = codec.encode_block(x, (sh.start - si * sr) // cr, visit=visit)
            crc = 0
            for c, n in crcs:   # the block's CRC32C, chunk by chunk in row order
                crc = crc32c_combine(crc, c, n)
            mom_all, mom_kept = (_moments.Moments.empty(self._widths[p]),) * 2 if values \
                else partials(self._widths[p])
            stream = self._stream(si, p)
            last = stream.append((sh.start - si * sr) // cr, chunks, crc, x.nbytes)
            del chunks
            rec = stream.finish() if last else None
            with self._lock:
                self.bytes_uploaded += x.nbytes
        except Exception as e:  # noqa: BLE001
            self._fail(e, f"upload of block {sh.index} of shard {si} ({self._store.points[p]})")
            return
        with self._lock:
            self._stats.add(sh.index, p, mom_all, mom_kept)
            if rec is not None:
                self._crc.setdefault(si, [None] * self._P)[p] = rec.crc32c
                self._nbytes.setdefault(si, [None] * self._P)[p] = rec.nbytes
                self._ocrc.setdefault(si, [None] * self._P)[p] = rec.object_crc32c
                self._upload.setdefault(si, [None] * self._P)[p] = rec.upload

    def merged_stats(self) -> "dict[str, list[Moments]]":
        """subset -> per-point Moments of the whole unit, in block order (store/stats/unit.py)."""
        with self._lock:
            return self._stats.merged()

    def _release(self) -> None:
        """Drop what only an open writer needs: partials, row metadata (the token ids), shard
        states and per-shard records. A committed or failed writer may stay referenced for a
        while (a caller's frame, a result); it must not keep a unit's memory with it."""
        with self._lock:
            self._stats.clear()
            self._states.clear()
            self._open.clear()
            self._pending.clear()
            self._meta = None
            self._crc, self._nbytes, self._ocrc, self._meta_rec = {}, {}, {}, {}
            self._upload = {}

    def _reap(self) -> None:
        for si in [si for si, fs in self._pending.items() if all(f.done() for f in fs)]:
            self._finish(si)

    def _finish(self, si: int | tuple[str, int]) -> None:   # a block, or ("meta", chunk)
        futs = self._pending.pop(si)
        for f in futs:
            f.result()  # the upload functions record their own failures; this surfaces bugs
        st = self._states.get(si) if isinstance(si, int) else None
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
