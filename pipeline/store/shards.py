"""A region writer's shard buffers: one shard of every point, filled in any row order."""

from __future__ import annotations

import numpy as np

from .buffers import BufferPool
from .dtypes import BF16, raw_dtype


class Shard:
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


def shard_buffers(store, keep: int) -> BufferPool:
    """The store's pool of shard buffers [n_points, shard_rows, width]: writers of units in flight
    at once (an actor commits one while capturing the next) reuse each other's buffers."""
    pool = getattr(store, "_shard_buffers", None)
    if pool is None:
        pool = store._shard_buffers = BufferPool((len(store.points), store.shard_rows, store.width),
                                                 raw_dtype(store.np_dtype), keep)
    pool.keep = max(pool.keep, keep)
    return pool


def use_allocator(store, allocate) -> None:
    """Make the store's shard buffers come from `allocate(shape, dtype)` (page-locked memory on
    CUDA, see BufferPool). Call before the first writer: buffers already handed out stay as they are."""
    shard_buffers(store, 0).allocate = allocate


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
