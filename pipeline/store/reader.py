"""SAE-training reader: shuffled batches from committed regions of a store, local or S3.

Shuffling is two-level, because a store is far larger than memory: shards are visited in a seeded
random order, and a pool of whole decoded shards (the in-memory shuffle buffer, `shuffle_buffer_rows`
rounded up to whole shards) is sampled without replacement: each batch is a uniform draw from every
row still in the pool, and a shard leaves the pool when its last row is drawn and the next one
(already prefetched) joins. Sampling from the pool in place, rather than copying rows through a
separate buffer, keeps reading at three memory passes per byte (fetch, decode, gather into the
batch; with several points, a stack to [n, n_points, width] in the prefetch thread). Rows inside
a batch are grouped by source shard; the batch as a set is the uniform draw.

Work is split by shard: global worker g = rank * num_workers + worker_id takes every G-th shard of
the epoch's permutation, so ranks x DataLoader workers never overlap and every committed row (not
excluded) comes out exactly once per epoch. The list of shards is fixed when the dataset is built,
in the parent process, so every worker agrees on it even while writers commit.

Nothing here keeps an open store across a fork: each process opens its own (async S3 clients are
bound to the event loop of the process that made them).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from typing import Iterator, Sequence

import numpy as np
import torch

from .buffers import BufferPool
from .dtypes import BF16, raw_dtype
from .store import Store, open_store

NORMALIZE_MODES = (None, "standardize", "norm_scale", "center_norm_scale")
_DEFAULT_BUFFER_BYTES = 1 << 30


def _rank_world(rank, world_size) -> tuple[int, int]:
    if rank is not None or world_size is not None:
        rank, world_size = int(rank or 0), int(world_size or 1)
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must satisfy 0 <= rank < world_size={world_size}")
    return rank, world_size


def _to_torch(raw: np.ndarray, np_dtype: np.dtype) -> torch.Tensor:
    """Raw-bits array (see dtypes.raw_dtype) -> tensor of the store dtype, without a copy."""
    raw = np.ascontiguousarray(raw)
    if np_dtype == BF16:
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw.view(np_dtype))


class ActivationDataset(torch.utils.data.IterableDataset):
    """Yields `[batch, width]` (one point given as a str) or `[batch, n_points, width]` tensors.

    Args:
        store: a Store or a URL (then `storage_options` apply).
        points: a point name -> 2-D batches; a list -> 3-D batches in that order; None -> all
            points (2-D if the store has one).
        batch_size: rows per batch; the last batch of each worker may be short unless drop_last.
        shuffle, seed: shard order and buffer draws are reproducible from (seed, epoch, worker).
        shuffle_buffer_rows: rows held for the in-memory shuffle, rounded up to whole shards
            (default: 1 GiB worth per process, at least one shard).
        rank, world_size: default from torch.distributed, else RANK/WORLD_SIZE, else 0/1.
        exclude_token_ids: rows whose token_id is in this set are dropped (BOS, padding, ...).
        normalize: None | "standardize" ((x-mean)/std per dim) | "norm_scale" (scale so that
            E||x||^2 = width) | "center_norm_scale" (subtract mean, then scale E||x-mean||^2 =
            width); statistics come from the store (finalize, or merged commit partials).
        prefetch_shards: shards fetched ahead of consumption.
        io_threads: concurrent object fetch+decode tasks (default: 2 x prefetch_shards).
        return_meta: yield dicts {acts, row, token_id, doc_id, position} instead of tensors.
        out_dtype: torch dtype of acts (default: store dtype, float32 when normalizing).
    """

    def __init__(self, store: "Store | str", points: "str | Sequence[str] | None" = None,
                 batch_size: int = 4096, *, shuffle: bool = True, seed: int = 0,
                 shuffle_buffer_rows: int | None = None, rank: int | None = None,
                 world_size: int | None = None, exclude_token_ids: Sequence[int] = (),
                 normalize: str | None = None, prefetch_shards: int = 4, drop_last: bool = False,
                 return_meta: bool = False, out_dtype: torch.dtype | None = None,
                 storage_options: dict | None = None, epoch: int = 0, eps: float = 1e-6,
                 io_threads: int | None = None):
        super().__init__()
        if isinstance(store, Store):
            self._url = store.location.url if store.location.is_local else store.location.url_with_protocol()
            self._so = store.location.storage_options
            st = store
        else:
            self._url, self._so = store, storage_options
            st = open_store(store, storage_options=storage_options, read_only=True)
        if points is None:
            points = st.points[0] if len(st.points) == 1 else list(st.points)
        self.stack = not isinstance(points, str)
        self.points = [points] if isinstance(points, str) else list(points)
        for p in self.points:
            if p not in st.points:
                raise ValueError(f"points: {p!r} is not in the store; it holds {', '.join(st.points)}")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if normalize not in NORMALIZE_MODES:
            raise ValueError(f"normalize={normalize!r}: use one of {NORMALIZE_MODES}")
        self.batch_size, self.shuffle, self.seed, self.epoch = int(batch_size), shuffle, int(seed), int(epoch)
        self.rank, self.world_size = _rank_world(rank, world_size)
        self.exclude = np.array(sorted({int(t) for t in exclude_token_ids}), np.int64)
        self.normalize, self.eps = normalize, eps
        self.prefetch_shards = max(1, int(prefetch_shards))
        self.io_threads = io_threads
        self.drop_last, self.return_meta = drop_last, return_meta
        self.width, self.store_dtype = st.width, st.np_dtype
        self._raw = raw_dtype(st.np_dtype)
        row_bytes = st.row_bytes * len(self.points)
        self.shuffle_buffer_rows = int(shuffle_buffer_rows) if shuffle_buffer_rows is not None else \
            max(self.batch_size * 4, _DEFAULT_BUFFER_BYTES // row_bytes)
        if self.shuffle_buffer_rows < self.batch_size:
            raise ValueError(f"shuffle_buffer_rows={self.shuffle_buffer_rows} must be >= batch_size="
                             f"{self.batch_size}")
        pieces = set()
        for m in st.committed_units().values():
            for sh in m["shards"]:
                pieces.add((max(sh["row_start"], m["row_start"]), min(sh["row_end"], m["row_end"])))
        self.pieces: list[tuple[int, int]] = sorted(pieces)
        self._piece_shape = (max((b - a for a, b in self.pieces), default=0), len(self.points), self.width)
        self.n_rows = sum(b - a for a, b in self.pieces)
        self._norm = self._norm_params(st) if normalize else None
        if out_dtype is None:
            out_dtype = torch.float32 if normalize else (torch.bfloat16 if st.np_dtype == BF16
                                                         else getattr(torch, st.np_dtype.name))
        self.out_dtype = out_dtype
        self._store: Store | None = None
        self._store_pid: int | None = None
        self._buffers: BufferPool | None = None

    # ---- setup -------------------------------------------------------------------------------
    def _norm_params(self, st: Store):
        stats = st.stats(self.points)
        shift, scale = [], []
        for p in self.points:
            s = stats[p]
            if not s["count"]:
                raise ValueError(f"normalize={self.normalize!r}: no statistics for {p} (nothing committed)")
            mean, var = np.asarray(s["mean"]), np.asarray(s["var"])
            if self.normalize == "standardize":
                shift.append(mean)
                scale.append(1.0 / np.sqrt(var + self.eps))
            elif self.normalize == "norm_scale":
                shift.append(np.zeros_like(mean))
                scale.append(np.full_like(mean, np.sqrt(self.width / s["mean_sq_norm"])))
            else:
                shift.append(mean)
                scale.append(np.full_like(mean, np.sqrt(self.width / var.sum())))
        return (torch.from_numpy(np.stack(shift).astype(np.float32)),
                torch.from_numpy(np.stack(scale).astype(np.float32)))

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch (like DistributedSampler.set_epoch) to reshuffle."""
        self.epoch = int(epoch)

    def _open(self) -> Store:
        if self._store is None or self._store_pid != os.getpid():
            self._store = open_store(self._url, storage_options=self._so, read_only=True)
            self._store_pid = os.getpid()
            self._buffers = None  # a forked copy's buffers are the parent's pages (copy-on-write)
        return self._store

    def __getstate__(self):
        # DataLoader workers started with spawn/forkserver get the dataset pickled: an open store
        # (an async S3 client) and a buffer pool (a lock) cannot travel, and each worker opens its own
        state = dict(self.__dict__)
        state.update(_store=None, _store_pid=None, _buffers=None)
        return state

    def _piece_buffers(self) -> BufferPool:
        """Piece buffers that outlive one epoch, so an epoch starts on memory the last one used.

        Fresh piece-sized arrays are new memory (above glibc's mmap threshold); on VMs that hand
        freed huge pages back to the host (virtio-balloon free page reporting), every first touch
        costs a page fault plus a host-side fault and zeroing: per epoch, that was more than half
        of a shuffled S3 read's CPU time here. The pool holds at most the buffers that were live
        at once (shuffle pool + prefetch), which the shuffle buffer size already budgets.
        """
        self._open()
        if self._buffers is None:
            self._buffers = BufferPool(self._piece_shape, self._raw, keep=len(self.pieces))
        return self._buffers

    def worker_pieces(self, worker_id: int = 0, num_workers: int = 1) -> list[tuple[int, int]]:
        """The shards global worker (rank, worker_id) reads this epoch, in reading order."""
        order = list(range(len(self.pieces)))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.pieces)).tolist()
        g = self.rank * num_workers + worker_id
        G = self.world_size * num_workers
        return [self.pieces[i] for i in order[g::G]]

    # ---- iteration ---------------------------------------------------------------------------
    def _fetch(self, piece: tuple[int, int], point: str, out: np.ndarray) -> None:
        """Rows of `piece` for one point into `out` ([n, width] raw bits, rows maybe strided)."""
        st = self._open()
        a, b = piece
        shard = a // st.shard_rows
        if (a, b) == st.shard_range(shard):
            st.read_shard(point, shard, out=out)  # one GET, decoded in place
        else:
            out[...] = st.array(point)[a:b].view(self._raw)

    def _fetch_meta(self, piece: tuple[int, int]):
        st = self._open()
        a, b = piece
        meta = [np.asarray(m) for m in st.read_row_meta(a, b)] if self.return_meta else None
        keep = None
        if self.exclude.size:
            tok = meta[0] if meta is not None else st._meta_array("token_id")[a:b]
            keep = np.flatnonzero(~np.isin(tok, self.exclude))
        return meta, keep

    def _pieces_stream(self, pieces, buffers: BufferPool) -> Iterator:
        """(x [n, n_points, width], rows, meta, keep) per piece, in order, fetched ahead.

        Every (piece, point) object is its own task, so one point's decode overlaps the next
        point's GET, and `prefetch_shards` pieces are in flight at once. Each task decodes into
        its point's slot of the piece's [n, n_points, width] buffer, so the consumer only gathers
        whole contiguous rows (several times faster than gathering from per-point arrays into a
        strided [:, p, :] slice) and no per-point temporary exists. Buffers come from `buffers`,
        which recycles those the shuffle pool has drained.
        """
        P = len(self.points)
        # two fetch+decode tasks per shard in flight, so that GETs keep going while other tasks
        # decode: S3 shuffled reads here went 0.67-0.85x -> 0.79-0.80x of raw get with 8 threads
        # instead of 4 (raw get itself gains nothing from 8); 16 only queue on the single fsspec
        # I/O loop and the GIL (measured slower)
        threads = self.io_threads or 2 * self.prefetch_shards

        with cf.ThreadPoolExecutor(threads, thread_name_prefix="harvest-read") as ex:
            def submit(piece):
                mf = ex.submit(self._fetch_meta, piece) if (self.return_meta or self.exclude.size) else None
                x = buffers.take()[: piece[1] - piece[0]]
                return x, [ex.submit(self._fetch, piece, self.points[i], x[:, i, :]) for i in range(P)], mf

            futs = [submit(p) for p in pieces[: self.prefetch_shards]]
            for i, piece in enumerate(pieces):
                x, xf, mf = futs[i]
                futs[i] = None
                if i + self.prefetch_shards < len(pieces):
                    futs.append(submit(pieces[i + self.prefetch_shards]))
                for f in xf:
                    f.result()
                meta, keep = mf.result() if mf is not None else (None, None)
                yield x, np.arange(piece[0], piece[1], dtype=np.int64), meta, keep

    def _emit(self, x: np.ndarray, rows: np.ndarray, meta):
        """x is [n, n_points, width] raw bits of the store dtype."""
        t = _to_torch(x, self.store_dtype)
        if self._norm is not None:
            shift, scale = self._norm
            t = (t.float() - shift) * scale
        t = t.to(self.out_dtype)
        if not self.stack:
            t = t[:, 0, :]
        if not self.return_meta:
            return t
        return {"acts": t, "row": torch.from_numpy(rows),
                "token_id": torch.from_numpy(meta[0].astype(np.int64)),
                "doc_id": torch.from_numpy(meta[1].astype(np.int64)),
                "position": torch.from_numpy(meta[2].astype(np.int64))}

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        pieces = self.worker_pieces(wid, nw)
        g = self.rank * nw + wid
        rng = np.random.default_rng([self.seed, self.epoch, g, 1])
        # shuffled: a piece's buffer is free once the pool drained it; sequential batches are
        # views of the piece buffers, which therefore belong to the caller and are never reused
        buffers = self._piece_buffers() if self.shuffle else BufferPool(self._piece_shape, self._raw, keep=0)
        stream = self._pieces_stream(pieces, buffers)
        if not self.shuffle:
            yield from self._sequential(stream)  # batches are views of the piece buffers
            return
        B, P, W = self.batch_size, len(self.points), self.width
        pool: list[_Pooled] = []
        pool_rows = 0
        left = True
        while True:
            while left and (pool_rows < self.shuffle_buffer_rows or pool_rows < B):
                nxt = next(stream, None)
                if nxt is None:
                    left = False
                    break
                e = _Pooled(*nxt, rng)
                if e.remaining:
                    pool.append(e)
                    pool_rows += e.remaining
            if not pool_rows:
                return
            k = min(B, pool_rows)
            if k < B and self.drop_last:
                return
            counts = rng.multivariate_hypergeometric([e.remaining for e in pool], k)
            out = np.empty((k, P, W), self._raw)
            orows = np.empty(k, np.int64)
            ometa = [np.empty(k, np.int64) for _ in range(3)] if self.return_meta else None
            pos = 0
            for e, c in zip(pool, counts.tolist()):
                if not c:
                    continue
                sel = e.take(c)
                np.take(e.x, sel, axis=0, out=out[pos:pos + c], mode="clip")
                orows[pos:pos + c] = e.rows[sel]
                if ometa is not None:
                    for j in range(3):
                        ometa[j][pos:pos + c] = e.meta[j][sel]
                pos += c
            pool_rows -= k
            for e in pool:
                if not e.remaining:
                    buffers.give(e.x)  # its rows were copied out into batches
            pool = [e for e in pool if e.remaining]
            yield self._emit(out, orows, ometa)

    def _sequential(self, stream):
        out = _Batcher(self)
        for x, rows, meta, keep in stream:
            if keep is not None:
                x, rows = x[keep], rows[keep]
                meta = [m[keep] for m in meta] if meta is not None else None
            yield from out.add(x, rows, meta)
        yield from out.flush()


class _Pooled:
    """A decoded shard in the shuffle pool: its rows in a random order, consumed front to back."""

    __slots__ = ("x", "rows", "meta", "order", "cur")

    def __init__(self, x, rows, meta, keep, rng):
        self.x, self.rows, self.meta = x, rows, meta
        idx = keep if keep is not None else np.arange(rows.shape[0])
        self.order = idx[rng.permutation(idx.shape[0])]
        self.cur = 0

    @property
    def remaining(self) -> int:
        return self.order.shape[0] - self.cur

    def take(self, c: int) -> np.ndarray:
        sel = self.order[self.cur:self.cur + c]
        self.cur += c
        return sel


class _Batcher:
    """Re-chunks row blocks into exact batch_size batches; the remainder waits for the next block."""

    def __init__(self, ds: ActivationDataset):
        self.ds = ds
        self.pending = None

    def add(self, x, rows, meta):
        if self.pending is not None:
            px, prows, pmeta = self.pending
            x, rows = np.concatenate([px, x]), np.concatenate([prows, rows])
            meta = [np.concatenate([a, b]) for a, b in zip(pmeta, meta)] if meta is not None else None
            self.pending = None
        B = self.ds.batch_size
        n = x.shape[0]
        full = n // B * B
        for s in range(0, full, B):
            yield self.ds._emit(x[s:s + B], rows[s:s + B], [m[s:s + B] for m in meta] if meta else None)
        if full < n:
            self.pending = (x[full:], rows[full:], [m[full:] for m in meta] if meta else None)

    def flush(self):
        pend, self.pending = self.pending, None
        if pend is not None and not self.ds.drop_last:
            yield self.ds._emit(*pend)
