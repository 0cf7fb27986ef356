"""A region writer's block buffers: one block of every point, filled in any row order.

`BlockBuffer` is the state of one buffer: a block (`layout.block_rows` rows) of one shard, since
the writer streams shard objects block by block (streams.py). Whole shard objects are encoded and
decoded by store/format/shardcodec.py."""

from __future__ import annotations

import numpy as np

from ..format import layout
from .buffers import BufferPool
from ..format.dtypes import BF16, raw_dtype
from ..errors import StoreError


class BlockBuffer:
    __slots__ = ("index", "start", "end", "n", "data", "filled", "n_filled", "flushed", "seq", "keep",
                 "present", "reserved", "pins", "scratch")

    def __init__(self, index: int, start: int, end: int):
        self.index, self.start, self.end = index, start, end
        self.keep: np.ndarray | None = None  # rows counted in the `kept` stats (None: all)
        self.present: np.ndarray | None = None  # rows holding activations (None: all)
        self.n = end - start
        self.data: np.ndarray | None = None
        self.filled = np.zeros(self.n, bool)
        self.n_filled = 0
        self.flushed: np.ndarray | None = None  # set once the shard has been evicted
        self.seq = 0
        self.scratch: list = []  # (a, b, key) of rows an eviction put in scratch objects
        # rows handed out by RegionWriter.reserve and not yet filled: the engine may be writing
        # them, so the buffer must stay where it is (never evicted or recycled) while pins > 0
        self.reserved = np.zeros(self.n, bool)
        self.pins = 0


def shard_buffers(store, block_rows: int, keep: int) -> BufferPool:
    """The store's pool of block buffers [n_points, block_rows, width]: writers of units in
    flight at once (an actor commits one while capturing the next) reuse each other's buffers."""
    pool = store.block_buffers
    if pool is None or pool.shape[1] != block_rows:
        alloc = pool.allocate if pool is not None else None
        pool = store.block_buffers = BufferPool((len(store.points), block_rows, store.row_width),
                                                 raw_dtype(store.np_dtype), keep, alloc)
    pool.keep = max(pool.keep, keep)
    return pool


def use_allocator(store, allocate) -> None:
    """Make the store's block buffers come from `allocate(shape, dtype)` (page-locked memory on
    CUDA, see BufferPool). Call before the first writer: buffers already handed out stay as they are."""
    br = layout.block_rows(store.shard_rows, store.chunk_rows, len(store.points), store.row_bytes,
                           store.context_size)
    shard_buffers(store, br, 0).allocate = allocate


def flush_partial(sh: BlockBuffer, put, unit_id: int, attempt: str) -> None:
    """An evicted block's filled rows go to scratch objects of this attempt (raw rows of every
    point, `put(key, bytes)`), read back by `unflush` when the block completes; never into an
    object a reader may trust. Rows already flushed by an earlier eviction are not put again."""
    if sh.flushed is None:
        sh.flushed = np.zeros(sh.n, bool)
    rows = sh.filled & ~sh.flushed
    for a, b in runs(rows):
        key = layout.scratch_key(unit_id, attempt, sh.index, a, b)
        put(key, np.ascontiguousarray(sh.data[:, a:b]).tobytes())
        sh.scratch.append((a, b, key))
    sh.flushed |= rows


def unflush(sh: BlockBuffer, loc, retries: int) -> None:
    """Rows an eviction put in scratch objects, back into the block's buffer (`sh.data`, raw
    bits [n_points, rows, width])."""
    for a, b, key in sh.scratch:
        raw = loc.read_bytes(key, attempts=retries)
        if raw is None:
            raise StoreError(f"scratch object {key} of this writer vanished")
        sh.data[:, a:b] = np.frombuffer(raw, sh.data.dtype).reshape(sh.data.shape[0], b - a, -1)


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous [a, b) runs of True in a bool vector."""
    if not mask.any():
        return []
    d = np.diff(np.concatenate(([0], mask.view(np.int8), [0])))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def to_numpy(acts, np_dtype: np.dtype) -> np.ndarray:
    mod = type(acts).__module__
    if mod.startswith("torch"):
        import torch

        t = acts.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BF16)
        return t.numpy()
    return np.asarray(acts)
