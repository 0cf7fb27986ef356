"""A free list of same-shape numpy buffers, shared by the writer's shards and the reader's pieces.

Why reuse at all: shard- and piece-sized arrays (tens to hundreds of MB) are above glibc's mmap
threshold, so every fresh one is new memory, and numpy gives arrays that big transparent huge
pages that the kernel zeroes on first touch. Measured on this project's VMs (whose host backs
guest memory lazily): page zeroing was the largest kernel cost of the writer, and a third of a
shuffled S3 read. Only a few buffers are live at once, so keeping them removes that cost.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np


class BufferPool:
    """Hands out arrays of one shape; `give` takes back a buffer (or any view of one) for reuse.

    At most `keep` free buffers are held (0: never hold, every `take` allocates). Callers slice
    what they take; `give` resolves a view to its buffer, and ignores arrays it did not hand out.
    """

    def __init__(self, shape: tuple[int, ...], dtype, keep: int,
                 allocate: "Callable[[tuple, np.dtype], np.ndarray] | None" = None):
        self.shape, self.dtype, self.keep = tuple(shape), np.dtype(dtype), int(keep)
        # `allocate(shape, dtype)`: where new buffers come from. np.empty by default; the capture
        # actor on CUDA passes page-locked memory so the engine's device-to-host copies land in
        # the shard buffers directly (pinned memory's numpy view has no numpy base to resolve).
        self.allocate = allocate or (lambda shape, dtype: np.empty(shape, dtype))
        self._free: list[np.ndarray] = []
        self._out: dict[int, np.ndarray] = {}  # address of a handed-out buffer -> the buffer
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            buf = self.allocate(self.shape, self.dtype)
        with self._lock:
            self._out[buf.ctypes.data] = buf
        return buf

    def give(self, view: np.ndarray | None) -> None:
        """Take back a buffer from any view that starts where it starts (callers slice `[:n]` or
        `[:, :n]`); views that start elsewhere and foreign arrays are ignored."""
        if view is None:
            return
        with self._lock:
            buf = self._out.pop(view.ctypes.data, None)
            if buf is not None and len(self._free) < self.keep:
                self._free.append(buf)
