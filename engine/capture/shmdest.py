"""Destinations in shared memory: how a tensor-parallel rank writes rows straight into the writer.

With tensor_parallel_size > 1 the rows are computed in vLLM's worker processes and their final
place, the writer's block buffers, is in the engine's process (the pipeline's actor). To keep one
host copy (tap buffer -> block buffer, as in-process), the block buffers are allocated from a
`SharedArena`, a file in /dev/shm that the engine's process creates and the publishing rank maps
at load (like the step ring, the file is unlinked once the rank has mapped it). Per request:

1. the capture loop registers a destination that lies in the arena (`Registrations.add`: request
   id, a generation number unique in this engine, byte offset, positions, point stride) in the
   step ring's registration log, before vLLM can schedule the request;
2. at the start of its publish the rank reads the new records (`Placer.read_log`) and writes
   each scheduled request it knows, whose rows fit its registration, straight into the arena
   (`Placer.place`), reporting the generation it used per request in the step's slot;
3. the capture loop plans the step exactly as before (stray rows, fed tokens, coverage) and
   copies only the rows the rank did not place; a request placed under another generation than
   its registration's is an error (engine/vllm/remote.py), never a silent mix of two owners' rows.

Reuse of arena memory (the hazard this design adds): the rank may only write memory whose owner
still waits for those rows. A request is never scheduled after vLLM finished or aborted it, and a
step that was already running when that happened (async scheduling keeps up to
max_concurrent_batches - 1 of them in flight after `engine.step()` returns) is the only writer
left. So memory freed by its owner (a writer's buffer dropped: garbage-collected) becomes
reusable only once the rank has published that many more steps (`SharedArena.fence`); until
then the allocator hands out other memory or, when the arena is full, plain memory (whose
requests take the copy through the step ring). A writer that reuses a buffer through its pool
(no free) does so only after the rows there were handed over, and a handed-over prompt request
is never scheduled again (max_tokens=1). Generation is refused at TP > 1 (pipeline config); if
it is allowed one day, the one decode step async scheduling may still run for a finished sample
(harvest.HarvestState.lingering) must not be placed: drop the registration at `end_rows`.
Correctness never depends on the arena: a request outside it, or one the log had no room for,
goes the old way.

Points: the rank places rows only when the capture reads every frozen point in tap order (what
the pipeline does); another selection takes the step ring path (its slot mapping stays in the
engine's process).
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
import weakref
from pathlib import Path

import numpy as np
import torch

PAGE = 4096
# The registration log, in the step ring's file (engine/capture/stepring.py sizes it, places it after the
# control block and error text, and leaves these two control words to it). Its layout lives here,
# with its writer (Registrations) and reader (Placer), and both take the mapped ring as an
# argument: stepring imports this module, never the reverse (no import cycle).
RECORD = 128  # one registration: int64 [generation, offset, n, point stride, id length] + id
RECORD_ID = 40  # the id's byte offset within a record
LOG_HEAD, LOG_READ = 5, 6  # the ring's control words: records written (engine), read (rank)


class SharedArena:
    """The engine's side: a /dev/shm file of `size` bytes (tmpfs backs only pages touched) handed
    out as numpy arrays; freed ranges wait for the fence before reuse."""

    def __init__(self, size: int, shm_dir: str = "/dev/shm"):
        self.size = _page(size)
        self.path = str(Path(shm_dir) / f"harvest-arena-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            reserve(fd, self.size, self.path, "shared_destination_bytes")
            self.mm = mmap.mmap(fd, self.size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.base = np.frombuffer(self.mm, dtype=np.uint8, count=1).ctypes.data
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, length), by offset
        self._pending: list[tuple[int, int, int]] = []  # (reusable at published seq, off, len)
        self._lock = threading.Lock()  # finalizers run on whichever thread collects
        self.published = lambda: 0  # the ring's latest published step (set by the engine)
        self.in_flight = 0  # steps that may still run after engine.step() returns
        self.allocated = self.fallbacks = 0

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def allocate(self, shape, dtype) -> np.ndarray:
        """An array in the arena, or plain memory when the arena has no room (that buffer's
        requests then take the step ring's extra copy: slower, never wrong)."""
        dtype = np.dtype(dtype)
        need = _page(int(np.prod(shape)) * dtype.itemsize)
        with self._lock:
            if self.mm is None or self.mm.closed:  # the engine closed: no rank reads it now
                self.fallbacks += 1
                return np.empty(shape, dtype)
            self._reclaim()
            at = next((i for i, (_, n) in enumerate(self._free) if n >= need), None)
            if at is None:
                self.fallbacks += 1
                return np.empty(shape, dtype)
            off, n = self._free[at]
            self._free[at:at + 1] = [(off + need, n - need)] if n > need else []
            self.allocated += 1
        flat = np.frombuffer(self.mm, dtype=dtype, count=int(np.prod(shape)), offset=off)
        # on `flat`, not on the reshaped array: numpy points every view's `base` at the array
        # whose base is the mmap (flat), so a writer's slice keeps flat alive; a finalizer on
        # the reshaped array fired while such a slice still held the memory (it would be reused)
        weakref.finalize(flat, self._release, off, need)
        return flat.reshape(shape)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Byte offset of a tensor's first element in the arena, or None if it is not wholly in."""
        if t.numel() == 0:
            return None
        off = t.data_ptr() - self.base
        last = off + sum((d - 1) * s for d, s in zip(t.shape, t.stride())) * t.element_size()
        return off if 0 <= off and last + t.element_size() <= self.size else None

    def _release(self, off: int, n: int) -> None:
        if self.mm is None or self.mm.closed:
            return  # the engine closed: nothing writes here any more, nothing is handed out
        with self._lock:
            self._pending.append((self.published() + self.in_flight, off, n))

    def _reclaim(self) -> None:
        now = self.published()
        keep = []
        for ready, off, n in self._pending:
            if ready <= now:
                self._free.append((off, n))
            else:
                keep.append((ready, off, n))
        self._pending = keep
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        self._free = merged

    def close(self) -> None:
        self.unlink()
        self.published = lambda: 0
        try:
            self.mm.close()
        except BufferError:  # a writer still holds a buffer: the mapping goes with the last one
            self.mm = None


def reserve(fd: int, size: int, path: str, knob: str) -> None:
    """Give a /dev/shm file all its pages now: a sparse tmpfs file whose volume fills up kills
    the process that next touches an unbacked page (SIGBUS, mid-step); reserving them turns
    that into this error at engine load."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        free = os.statvfs(os.path.dirname(path))
        raise RuntimeError(
            f"cannot reserve {size / 2**20:.0f} MiB in {os.path.dirname(path)} ({e.strerror}; "
            f"{free.f_bavail * free.f_frsize / 2**20:.0f} MiB free): give the process a larger "
            f"/dev/shm (a memory-backed volume, docs/operations.md) or lower {knob}") from e


def _page(n: int) -> int:
    return (int(n) + PAGE - 1) // PAGE * PAGE


class Registrations:
    """The engine's side of the registration log (in the step ring's file, engine/capture/stepring.py)."""

    def __init__(self, ring):
        self._ring = ring  # a stepring.RingReader (duck-typed: see RECORD above)
        self._gen = 0

    def add(self, rid: str, offset: int, n: int, point_stride: int) -> int:
        """Write one record; returns its generation, or 0 when the log is full (the request then
        takes the step ring path)."""
        ring = self._ring
        c, cap = ring.control, ring.spec.log_records
        head = int(c[LOG_HEAD])
        rid_b = rid.encode()
        if cap == 0 or head - int(c[LOG_READ]) >= cap or len(rid_b) > RECORD - RECORD_ID:
            return 0
        self._gen += 1
        at = ring.spec.log_offset() + (head % cap) * RECORD
        np.frombuffer(ring.mm, dtype=np.int64, count=5, offset=at)[:] = (
            self._gen, offset, n, point_stride, len(rid_b))
        ring.mm[at + RECORD_ID:at + RECORD_ID + len(rid_b)] = rid_b
        c[LOG_HEAD] = head + 1  # last: the rank reads a record only once the head passed it
        return self._gen


class Placer:
    """The publishing rank's side: the arena mapped, the registrations read so far."""

    def __init__(self, ring, width: int, dtype: torch.dtype):
        """`ring`: the rank's stepring.RingWriter (it builds its Placer when its spec names an
        arena)."""
        spec = ring.spec
        fd = os.open(spec.arena_path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, spec.arena_bytes)
        finally:
            os.close(fd)
        self.arena = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.ring, self.row_bytes = ring, width * torch.empty(0, dtype=dtype).element_size()
        self.width, self.dtype = width, dtype
        self.dests: dict[str, tuple[int, int, int, int]] = {}  # rid -> (gen, off, n, stride)

    def read_log(self, finished=()) -> None:
        """Take the records written since the last step; forget requests vLLM finished."""
        ring, cap = self.ring, self.ring.spec.log_records
        c = ring.control
        read, head = int(c[LOG_READ]), int(c[LOG_HEAD])
        for i in range(read, head):
            at = ring.spec.log_offset() + (i % cap) * RECORD
            gen, off, n, stride, nb = (int(x) for x in
                                       np.frombuffer(ring.mm, dtype=np.int64, count=5, offset=at))
            rid = bytes(ring.mm[at + RECORD_ID:at + RECORD_ID + nb]).decode()
            self.dests[rid] = (gen, off, n, stride)
        c[LOG_READ] = head
        for rid in finished:
            self.dests.pop(rid, None)

    def place(self, rid: str, row: int, start: int, count: int, buf: torch.Tensor) -> int:
        """Write rows [row, row + count) of every tap slot as positions [start, start + count)
        of rid's destination; returns the generation used, 0 if rid is not placed here (not
        registered, or rows past its registration: the capture loop refuses those as stray)."""
        d = self.dests.get(rid)
        if d is None or start < 0 or start + count > d[2]:
            return 0
        gen, off, _, stride = d
        rb = self.row_bytes
        for p in range(buf.shape[0]):
            a = off + p * stride + start * rb
            self.arena[a:a + count * rb].view(self.dtype).view(count, self.width).copy_(
                buf[p, row:row + count])
        return gen

    def close(self) -> None:
        self.arena = None
        try:
            self.mm.close()
        except BufferError:
            pass
