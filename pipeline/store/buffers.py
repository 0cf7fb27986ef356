"""A free list of same-shape numpy buffers, shared by the writer's shards and the reader's pieces.

Why reuse at all: shard- and piece-sized arrays (tens to hundreds of MB) are above glibc's mmap
threshold, so every fresh one is new memory, and numpy gives arrays that big transparent huge
pages that the kernel zeroes on first touch. Measured on this project's VMs (whose host backs
guest memory lazily): page zeroing was the largest kernel cost of the writer, and a third of a
shuffled S3 read. Only a few buffers are live at once, so keeping them removes that cost.
"""

from __future__ import annotations

import threading

import numpy as np


class BufferPool:
    """Hands out arrays of one shape; `give` takes back a buffer (or any view of one) for reuse.

    At most `keep` free buffers are held (0: never hold, every `take` allocates). Callers slice
    what they take; `give` resolves a view to its buffer, and ignores arrays it did not hand out.
    """

    def __init__(self, shape: tuple[int, ...], dtype, keep: int):
        self.shape, self.dtype, self.keep = tuple(shape), np.dtype(dtype), int(keep)
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.empty(self.shape, self.dtype)

    def give(self, view: np.ndarray | None) -> None:
        buf = view.base if view is not None and view.base is not None else view
        if buf is None or buf.shape != self.shape or buf.dtype != self.dtype:
            return
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)
