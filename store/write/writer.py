"""Streaming writer for one shard-aligned region: bounded buffers, background uploads, commit.

Memory bound and eviction: see uploads.py (ShardUploads, the machinery under this class). Rows
are buffered per block (a few MiB per point), and each block is encoded and appended to its
shard objects in the background as soon as its rows are complete (streams.py): no shard is ever
held whole. `write` blocks when too many blocks are in flight instead of growing memory.

Row metadata (token_id, doc_id, position) of the region is given with `write_meta` and written
by this writer with its rows: the actor, not the driver, writes it, so nothing is written before
dispatch and a unit's metadata commits with its activations.

A commit marker is written only after every row of the region is uploaded; it carries the
region's stats partials (rows `all` and `kept`, by reference to a sidecar with its sha256), a
CRC32C per shard and point of the raw rows and one per metadata column, so `verify(deep=True)`
can prove the stored bytes are the committed ones.
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np

from ..commit import markers as _commits
from ..commit import tables as _tables
from ..format import layout
from ..stats import moments as _moments
from ..storage.credentials import redact_attrs, scrub
from ..format import fp8 as _fp8
from ..format.dtypes import dtype_name
from ..errors import RegionConflict, RegionWriteFailed
from ..format.jsonattrs import jsonable as _jsonable
from ..commit import published as _published
from ..commit.objects import publish
from ..commit.records import Marker
from .block_buffers import BlockBuffer, runs, to_numpy
from .uploads import ShardUploads
from ..storage.interface import UploadRecord

log = logging.getLogger(__name__)


class RegionWriter(ShardUploads):
    """Write rows of one region in any order; `commit()` makes them visible, exactly once.

    Knobs: max_open_shards / max_pending_shards (blocks open and in flight: the memory bound,
    uploads.py; the names predate blocks), upload_threads (parallel point encodes and uploads),
    retries (attempts per upload for transient errors, with backoff).
    """

    def __init__(self, store, unit_id: int, row_start: int, row_end: int, *,
                 max_open_shards: int = 2, max_pending_shards: int = 2, upload_threads: int = 4,
                 retries: int = 5):
        super().__init__(store, unit_id, row_start, row_end, max_open_shards=max_open_shards,
                         max_pending_shards=max_pending_shards, upload_threads=upload_threads,
                         retries=retries)
        self._manifest: Marker | None = None
        self.t_created = time.perf_counter()
        self.t_first_write: float | None = None
        self.rows_written = 0
        existing = store.ledger.commit_manifest(unit_id, row_start, row_end, fresh=True)
        self.already_committed = existing is not None
        if self.already_committed:
            log.info("unit %d is already committed (attempt %s): writes are ignored",
                     unit_id, existing.attempt)

    # ---- public ------------------------------------------------------------------------------
    def write_meta(self, row_start: int, token_id, doc_id, position, role=None, gen=None,
                   sample=None, source_row=None) -> None:
        """Row metadata of rows [row_start, row_start + n); each row once, before its activations
        (the `kept` statistics of a shard need its token ids when the shard is encoded).
        `role` (chat stores) and `gen` (generation stores, FORMAT.md "Generation"): 0 when
        omitted in a store that has the column; refused in a store without it. Likewise `sample`
        (stores of n > 1 samples per prompt). `source_row`: required in a shuffled copy
        (store/shuffled_copy.py), refused elsewhere."""
        if self.already_committed:
            return
        self._check_usable()
        self._meta.write(row_start, token_id, doc_id, position, role, gen, sample, source_row)

    def write_scores(self, row_start: int, **scores) -> None:
        """The model's next-token scores of rows [row_start, row_start + n) in a store with
        `logprob` / `entropy` columns (float32 each, all of the store's at once; FORMAT.md "The
        model's next-token scores"); each row once, before its activations (a shard's
        metadata chunk may go up with the shard)."""
        if self.already_committed:
            return
        self._check_usable()
        self._meta.write_scores(row_start, **scores)

    def rows_with_activations(self) -> int:
        """Rows of the region that hold activations: all but the rows of roles outside
        capture.roles (zeroed) and a generation slot's rows without (FORMAT.md). Once every
        row's metadata is written (before commit)."""
        return self._meta.rows_with_activations()

    def write(self, row_start: int, acts) -> None:
        """Rows [row_start, row_start + n) of every point: acts is [n_points, n, width], width =
        `store.max_width`: a point narrower than the widest has its rows in its first columns
        (the rest are ignored), as the engine delivers points of several widths.

        An fp8 store takes float rows (quantised here, bit for bit as the engine would: fp8.py,
        each point over its own width) or rows already packed (uint8 [n_points, n, width + 4];
        with points of several widths, point p's packed row in its first widths[p] + 4 columns)."""
        if self.already_committed:
            return
        self._check_usable()
        a = to_numpy(acts, self._dtype)
        if a.ndim == 2 and self._P == 1:
            a = a[None]
        if self._store.quantized and a.dtype != np.uint8 and a.ndim == 3 and a.shape[2] == self._W:
            a = _fp8.quantize_points(a, self._widths, self._RW)
        if a.ndim != 3 or a.shape[0] != self._P or a.shape[2] != self._RW:
            raise ValueError(f"write: acts must be [n_points={self._P}, n, width={self._RW}], got "
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
            bi = r // self.block_rows
            s0, s1 = self.block_span(bi)
            e = min(hi, s1)
            pieces.append((bi, r - s0, e - s0, r - lo, e - lo))
            r = e
        for bi, o0, o1, _, _ in pieces:  # refuse duplicates before touching anything
            st = self._states.get(bi)
            if bi in self._done or bi in self._pending or (
                    st is not None and (st.filled[o0:o1].any() or st.reserved[o0:o1].any())):
                raise ValueError(f"write: rows of [{lo}, {hi}) in block {bi} were already written to "
                                 f"unit {self.unit_id}; each row is written once (stats would count "
                                 "it twice)")
        if self.t_first_write is None:
            self.t_first_write = time.perf_counter()
        for bi, o0, o1, a0, a1 in pieces:
            sh = self._shard_for_write(bi)
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
        After `abort` an outstanding view stays valid memory (it is dropped, never reused).
        Buffers hold blocks (`block_rows`, a multiple of the context size when one fits the
        memory bound), so a context's rows fit one unless contexts are larger than that."""
        if self.already_committed:
            return None
        self._check_usable()
        lo, hi = int(row_start), int(row_start) + int(n)
        if n <= 0 or lo < self.row_start or hi > self.row_end:
            raise ValueError(f"reserve: rows [{lo}, {hi}) fall outside unit {self.unit_id}'s region "
                             f"[{self.row_start}, {self.row_end})")
        bi = lo // self.block_rows
        s0, s1 = self.block_span(bi)
        if hi > s1:
            return None
        o0, o1 = lo - s0, hi - s0
        st = self._states.get(bi)
        if bi in self._done or bi in self._pending or (
                st is not None and (st.filled[o0:o1].any() or st.reserved[o0:o1].any())):
            raise ValueError(f"reserve: rows of [{lo}, {hi}) in block {bi} were already written or "
                             f"reserved in unit {self.unit_id}; each row is written once")
        if self.t_first_write is None:
            self.t_first_write = time.perf_counter()
        sh = self._shard_for_write(bi)
        sh.reserved[o0:o1] = True
        sh.pins += 1
        return sh.data[:, o0:o1]

    def fill_reserved(self, row_start: int, n: int) -> None:
        """The producer finished rows [row_start, row_start + n) of an earlier `reserve`."""
        if self.already_committed:
            return
        self._check_usable()
        bi = int(row_start) // self.block_rows
        s0, _ = self.block_span(bi)
        o0, o1 = int(row_start) - s0, int(row_start) - s0 + int(n)
        sh = self._open.get(bi)
        if sh is None or not sh.reserved[o0:o1].all():
            raise ValueError(f"fill_reserved: rows [{row_start}, {row_start + n}) of unit "
                             f"{self.unit_id} were not reserved")
        sh.reserved[o0:o1] = False
        sh.pins -= 1
        self._filled(sh, o0, o1)
        self._reap()

    def _filled(self, sh: BlockBuffer, o0: int, o1: int) -> None:
        sh.filled[o0:o1] = True
        sh.n_filled += o1 - o0
        self.rows_written += o1 - o0
        if sh.n_filled == sh.n:
            self._complete(sh)

    def commit(self, extra: dict | None = None) -> Marker:
        """Wait for uploads, check every row was written, write the create-once commit marker.
        A unit found committed (`already_committed`) gives the marker that committed it."""
        if self._manifest is not None:
            return self._manifest
        if self.already_committed:
            m = self._store.ledger.commit_manifest(self.unit_id, self.row_start, self.row_end)
            self._manifest = m
            self._shutdown()
            self._release()
            return m
        self._check_usable()
        extra = redact_attrs(_jsonable(extra or {}, "commit extra"), self._store.location.storage_options)
        missing = []
        for bi in self._block_ids:
            if bi in self._done or bi in self._pending:
                continue
            st = self._states.get(bi)
            s0, s1 = self.block_span(bi)
            holes = runs(~st.filled) if st is not None else [(0, s1 - s0)]
            missing += [(s0 + a, s0 + b) for a, b in holes]
        if missing:
            n_miss = sum(b - a for a, b in missing)
            ex = ", ".join(f"[{a},{b})" for a, b in missing[:3])
            raise ValueError(f"commit: unit {self.unit_id} has {n_miss} rows never written (e.g. {ex}); "
                             "write them, or abort() to leave the region uncommitted")
        self._meta.check_complete()
        for si in self.meta_chunk_ids():
            if si not in self._meta_uploaded:
                self._meta_uploaded.add(si)
                self._pending[("meta", si)] = [self._pool.submit(self._upload_meta, si)]
        self._wait_pending(all_=True)
        self._check_usable()
        self._check_conflict()
        merged = self.merged_stats()
        blob = _moments.dumps(merged)
        skey = layout.stats_key(self.unit_id, self.attempt)
        seconds = time.perf_counter() - (self.t_first_write or self.t_created)
        recs = _tables.records(
            [(si, *self.shard_span(si), self._crc[si], self._nbytes.get(si), self._ocrc.get(si),
              self._meta_rec.get(si)) for si in self._shard_ids])
        for sh in recs:  # uploads to complete after the marker (S3 multipart): in the table
            ups = self._upload.get(sh["index"])
            if ups is not None and any(u is not None for u in ups):
                sh["upload"] = [None if u is None else {k: v for k, v in u.items() if k[0] != "_"}
                                for u in ups]
            for rec in (sh.get("meta") or {}).values():
                if rec.get("upload") is not None:
                    rec["upload"] = {k: v for k, v in rec["upload"].items() if k[0] != "_"}
        prep = _commits.prepare(
            self._store, self.unit_id, self.row_start, self.row_end, self.attempt, recs,
            self._meta.crc32c(), {"key": skey, "sha256": hashlib.sha256(blob).hexdigest(),
                                  "count": merged["all"][0].count if merged["all"] else 0,
                                  "kept": merged["kept"][0].count if merged["kept"] else 0},
            seconds, extra)
        manifest = prep.marker
        own = [k for k in (skey, prep.table_key) if k]   # this attempt's, removed if it loses
        try:
            self._store.location.write_bytes(skey, blob)
            if prep.table_key:   # layout 3: the per-shard records, before the marker names them
                self._store.location.write_bytes(prep.table_key, prep.table_blob)
            created = _commits.create_marker(self._store.location, manifest)
        except Exception as e:  # noqa: BLE001 -- reported without secrets, region left uncommitted
            self._fail(e, "writing the commit marker")
            self._cleanup(*own)
            self._release()
            raise RegionWriteFailed(self._failed_msg) from None
        if created:
            _tables.remember(self._store, manifest, prep.records)
            self._publish(manifest)
        else:
            other = self._store.ledger.commit_manifest(self.unit_id, self.row_start, self.row_end,
                                                       fresh=True)
            if other is None or other.attempt != self.attempt:
                self._shutdown()
                self._cleanup(*own)
                self._release()
                raise RegionConflict(
                    f"commit: unit {self.unit_id} was committed by another writer (attempt "
                    f"{None if other is None else other.attempt}) while this one was writing; this writer's objects are "
                    "removed and the committed ones are untouched (each attempt writes its own).")
            manifest = other
        self._store.ledger.remember_marker(manifest)
        self._manifest = manifest
        self._shutdown()
        self._release()
        log.info("unit %d committed: %d rows, %.1f MB/s", self.unit_id, manifest.n_rows,
                 (manifest.bytes_per_s or 0) / 1e6)
        return manifest

    def abort(self) -> None:
        """Drop buffers, stop uploads and remove what this attempt wrote; the region stays
        uncommitted (rewrite it later)."""
        self._closed = True
        for futs in self._pending.values():
            for f in futs:
                f.cancel()
        self._shutdown()
        self._release()
        if self._manifest is None and not self.already_committed:
            self._cleanup()

    def _etags(self) -> "dict[str, UploadRecord]":
        """{final key: the upload record with its parts' ETags} of this attempt's uploads: its
        own publish completes them without listing the parts (finalize lists them)."""
        out = {}
        for si, ups in self._upload.items():
            for p, u in enumerate(ups):
                if u is not None:
                    out[layout.shard_object_key(self._store.points[p], si)] = u
        for final, _, u in self._meta_streams:
            out[final] = u
        return out

    def _publish(self, manifest: Marker) -> None:
        """Publish this attempt's objects (only the marker's creator does): complete its uploads
        (S3) or rename them to their zarr keys. Until then readers take renamed-by-name objects
        under the attempt's name, and finalize finishes a publish a crash cut."""

        try:
            n = publish(self._store, manifest, etags=self._etags())
            # every object reached its zarr key in this call: record it (published.py); a
            # shortfall (an upload gone, a move whose source vanished) is left to settle's check
            want = len(_published.unit_objects(self._store, manifest))
            if n == want:
                _published.write_record(self._store.location, manifest, n)
            else:
                log.warning("unit %d: %d of its %d objects were published by its writer; finalize "
                            "checks the rest", self.unit_id, n, want)
        except Exception as e:  # noqa: BLE001 -- committed already; readers fall back, finalize repairs
            log.warning("unit %d: moving its objects to their zarr keys failed (%s); they stay under "
                        "attempt %s until finalize", self.unit_id,
                        scrub(f"{type(e).__name__}: {e}", self._store.location.storage_options), self.attempt)
        self._remove([k for k in self._written if k.startswith(layout.SCRATCH_DIR)])
        with self._lock:
            self._streams.clear()
            self._meta_streams.clear()

    def throughput(self) -> dict[str, float | None]:
        now = time.perf_counter()
        secs = now - (self.t_first_write or now)
        written = self.rows_written * self._P * self._store.row_bytes
        return {"bytes_written": written, "bytes_uploaded": self.bytes_uploaded, "seconds": secs,
                "write_bytes_per_s": written / secs if secs > 0 else None,
                "upload_bytes_per_s": self.bytes_uploaded / secs if secs > 0 else None}

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._manifest is None:
            if exc_type is None:
                log.warning("region writer of unit %d closed without commit(); region left uncommitted",
                            self.unit_id)
            self.abort()
        return False
