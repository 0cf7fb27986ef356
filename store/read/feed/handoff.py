"""Batches from DataLoader workers to the trainer through shared memory, without torch's pickling.

torch hands a worker's tensor to the parent by moving its storage into a fresh shared-memory
segment (a copy, into pages faulted in afresh), passing the segment's file descriptor over a
socket, and mapping it again in the parent (more faults): 1.5-2.0 us per row at width 576
bf16, more than decoding the row, so 2 workers ran at 0.63x one process on 2 cores.

Here `ActivationLoader` makes, before its workers fork, one anonymous shared mapping (`Rings`):
per worker `slots` batch-sized slots plus one flag per slot. A worker gathers each batch
straight into a free slot of its own (`WorkerSide.buffers`, when the batch it yields is a view
of the gathered bytes: no normalisation, no dtype change, not fp8) or copies the finished
tensor into one (one copy, at memcpy speed), and sends only `SlotRef(worker, slot, offset,
dtype, shape)` down the DataLoader's queue; small tensors (row ids, metadata) go by value. The
parent (`ParentSide.unpack`) turns a SlotRef into a tensor over its own mapping of the slot.
No file descriptor moves and no page is faulted twice: slots are reused, so after the first
few batches every page is warm in both processes.

When is a slot reused? Never while the trainer can still read it (the safe default): a slot's
flag holds the iteration number that sent it and goes back to 0 only when the parent sees that
no tensor over the slot is alive (the reference count of the slot's array, which every tensor
and view made from a batch keeps alive through its storage: the rule batching.BatchBuffers
uses). A trainer that keeps batches (`list(loader)`) keeps their slots; the worker then finds no
free slot and sends that batch the old way (torch's path), so holding batches never blocks and
never corrupts. Batches sent but never delivered (an iterator abandoned mid-epoch: torch drops
what was in flight) free their slots when the next iteration starts.

Memory: `slots` x workers x slot bytes of shared memory, touched only as slots are used (10 x
4.7 MB per worker at 4,096 x 576 bf16; 10 x 33.5 MB at width 4,096; twice that when the batch
is float32, e.g. normalised). The worker's own batch buffers (batching.BatchBuffers) are not
used when it gathers into slots. Needs the fork start method (Linux's default): the mapping is
inherited, not named; with spawn or forkserver the loader keeps torch's path.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

from ...format.dtypes import torch_dtype

SLOTS = 10          # per worker: 4 gathered ahead + 1 being yielded + 2 queued + 3 in the trainer
BY_VALUE = 1 << 16  # tensors under 64 KiB go by value (a shared slot would cost more than it saves)
_PAGE = 4096


@dataclass(frozen=True)
class SlotRef:
    """A tensor that lives in slot `slot` of worker `worker`'s ring, at byte `offset`."""

    worker: int
    slot: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ByValue:
    """A small tensor sent as a numpy array (pickled by value with the rest of the batch)."""

    array: np.ndarray       # the tensor's bytes
    dtype: torch.dtype
    shape: tuple[int, ...]


def usable(multiprocessing_context=None) -> bool:
    """Whether workers started with this context inherit the rings (fork only)."""
    ctx = multiprocessing_context
    if isinstance(ctx, str):
        return ctx == "fork"
    method = ctx.get_start_method() if ctx is not None else multiprocessing.get_start_method()
    return method == "fork"


def zero_copy(ds) -> bool:
    """Whether the dataset's batches are views of the gathered bytes (so a worker can gather
    straight into a slot): not fp8, not normalised, yielded in the store's dtype."""
    return (not ds.quantized and ds.norm_constants is None
            and ds.out_dtype == torch_dtype(ds.store_dtype))


def slot_bytes(ds) -> int | None:
    """Bytes of the largest tensor a batch of `ds` holds (gathered rows, or the finished acts);
    None for a dataset that does not say (not an ActivationDataset: its loader keeps torch's
    path, since only ActivationDataset's workers pack their batches into slots)."""
    if not all(hasattr(ds, a) for a in ("row_width", "raw_dtype", "batch_size", "points", "width",
                                        "quantized", "dequantize", "out_dtype")):
        return None
    k, P, W = ds.batch_size, len(ds.points), ds.width
    gathered = k * P * ds.row_width * ds.raw_dtype.itemsize
    out_itemsize = 1 if (ds.quantized and not ds.dequantize) else torch.empty(0, dtype=ds.out_dtype).element_size()
    return -(-max(gathered, k * P * W * out_itemsize) // _PAGE) * _PAGE


def _refs(arrays: list, i: int) -> int:
    """sys.getrefcount of arrays[i], always taken the same way (idle counts are measured with it)."""
    return sys.getrefcount(arrays[i])


class Rings:
    """One anonymous shared mapping: per worker `slots` slots of `cap` bytes, their flags and
    the loader's iteration number. Made in the parent before its workers fork."""

    def __init__(self, num_workers: int, cap: int, slots: int = SLOTS):
        self.num_workers, self.cap, self.slots = num_workers, cap, slots
        head = -(-(8 + 8 * num_workers * slots) // _PAGE) * _PAGE
        self.mm = mmap.mmap(-1, head + num_workers * slots * cap)   # MAP_SHARED: forks share it
        self.gen = np.frombuffer(self.mm, np.int64, 1, 0)
        self.flags = np.frombuffer(self.mm, np.int64, num_workers * slots, 8).reshape(num_workers, slots)
        # one array per slot: each is the root its views (and tensors over them) reference
        self.arrays = [[np.frombuffer(self.mm, np.uint8, cap, head + (w * slots + s) * cap)
                        for s in range(slots)] for w in range(num_workers)]
        self.base = self.arrays[0][0].ctypes.data
        self._worker: WorkerSide | None = None
        self._worker_pid = -1

    def __getstate__(self):
        raise TypeError("handoff.Rings is inherited by forked DataLoader workers, never pickled")

    def worker(self, wid: int, ds) -> WorkerSide:
        """This worker process's side (made once per process: persistent workers keep it)."""
        if self._worker is None or self._worker_pid != os.getpid():
            self._worker, self._worker_pid = WorkerSide(self, wid, ds), os.getpid()
        return self._worker


class WorkerSide:
    """In a worker: slots to gather into, and `pack` to turn a batch into SlotRefs."""

    def __init__(self, rings: Rings, wid: int, ds):
        self.rings, self.wid = rings, wid
        self.arrays, self.flags = rings.arrays[wid], rings.flags[wid]
        self.gen = 0
        self.idle = [_refs(self.arrays, s) for s in range(rings.slots)]
        self.buffers = None
        need = slot_bytes(ds)
        if zero_copy(ds) and need is not None and need <= rings.cap:
            self.buffers = SlotBuffers(self, (ds.batch_size, len(ds.points), ds.row_width), ds.raw_dtype)

    def begin(self) -> None:
        """At the start of each iteration: slots sent from now on carry this iteration's number."""
        self.gen = int(self.rings.gen[0])

    def free(self, s: int, views: list | None = None) -> bool:
        if self.flags[s] != 0 or _refs(self.arrays, s) > self.idle[s]:
            return False
        return views is None or views[s] is None or _refs(views, s) <= self.buffers.idle_view

    def pack(self, batch):
        if isinstance(batch, torch.Tensor):
            return self._tensor(batch)
        if isinstance(batch, (tuple, list)):
            return tuple(self.pack(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self.pack(v) for k, v in batch.items()}
        return batch

    def _tensor(self, t: torch.Tensor):
        nb = t.numel() * t.element_size()
        if nb < BY_VALUE:
            return ByValue(t.contiguous().view(-1).view(torch.uint8).numpy().copy(), t.dtype, tuple(t.shape))
        R = self.rings
        off = t.data_ptr() - R.base
        w, rest = divmod(off, R.slots * R.cap) if off >= 0 else (-1, 0)
        s, inner = divmod(rest, R.cap)
        if w == self.wid and t.is_contiguous() and inner + nb <= R.cap:
            self.flags[s] = self.gen          # gathered in place: nothing to copy
            return SlotRef(self.wid, s, inner, t.dtype, tuple(t.shape))
        if nb <= R.cap:
            views = self.buffers.views if self.buffers is not None else None
            for s in range(R.slots):
                if self.free(s, views):
                    dst = torch.from_numpy(self.arrays[s][:nb]).view(t.dtype).view(t.shape)
                    dst.copy_(t)
                    del dst
                    self.flags[s] = self.gen
                    return SlotRef(self.wid, s, 0, t.dtype, tuple(t.shape))
        return t    # no free slot (the trainer holds them all): torch's path


class SlotBuffers:
    """batching.BatchBuffers for a worker that gathers straight into its slots: `get` returns a
    `[k, n_points, row width]` view of a free slot (flag 0, nothing in this process using it),
    or a fresh array when every slot is taken."""

    def __init__(self, side: WorkerSide, shape: tuple[int, ...], dtype: np.dtype):
        self.side, self.shape, self.dtype = side, shape, np.dtype(dtype)
        self.nbytes = int(np.prod(shape)) * self.dtype.itemsize
        self.views: list[np.ndarray | None] = [None] * side.rings.slots
        probe = [np.empty(1)]
        self.idle_view = _refs(probe, 0)
        self.allocated = 0

    def get(self) -> np.ndarray:
        side = self.side
        for s in range(len(self.views)):
            if side.free(s, self.views):
                if self.views[s] is None:
                    self.views[s] = side.arrays[s][:self.nbytes].view(self.dtype).reshape(self.shape)
                    side.idle[s] = _refs(side.arrays, s)    # the view holds its slot's array
                return self.views[s]
        self.allocated += 1
        return np.empty(self.shape, self.dtype)


class ParentSide:
    """In the loader's process: SlotRef -> tensor over the slot, and slots given back once no
    tensor over them is alive."""

    def __init__(self, rings: Rings):
        self.rings = rings
        self.idle = [[_refs(a, s) for s in range(rings.slots)] for a in rings.arrays]
        self.out: set[tuple[int, int]] = set()   # slots delivered and maybe still held

    def begin(self) -> None:
        """Before an iteration starts its workers: number it (what its workers send is tagged)."""
        self.rings.gen[0] += 1

    def started(self) -> None:
        """After torch started (or reset) the workers: what an earlier iteration sent but never
        delivered (dropped in flight) is free again; nothing sent before now is delivered later."""
        g = self.rings.gen[0]
        for w in range(self.rings.num_workers):
            for s in range(self.rings.slots):
                f = self.rings.flags[w, s]
                if f != 0 and f < g and (w, s) not in self.out:
                    self.rings.flags[w, s] = 0

    def release(self) -> None:
        for w, s in list(self.out):
            if _refs(self.rings.arrays[w], s) <= self.idle[w][s]:
                self.out.discard((w, s))
                self.rings.flags[w, s] = 0

    def unpack(self, batch, pin: bool = False):
        self.release()
        return self._unpack(batch, pin)

    def _unpack(self, b, pin: bool):
        if isinstance(b, SlotRef):
            nb = int(np.prod(b.shape, dtype=np.int64)) * torch.empty(0, dtype=b.dtype).element_size()
            t = torch.from_numpy(self.rings.arrays[b.worker][b.slot][b.offset:b.offset + nb])
            t = t.view(b.dtype).view(b.shape)
            self.out.add((b.worker, b.slot))
            return t.pin_memory() if pin else t
        if isinstance(b, ByValue):
            t = torch.from_numpy(b.array).view(b.dtype).view(b.shape)
            return t.pin_memory() if pin else t
        if isinstance(b, (tuple, list)):   # torch's default_convert turns a tuple into a list
            return tuple(self._unpack(x, pin) for x in b)
        if isinstance(b, dict):
            return {k: self._unpack(v, pin) for k, v in b.items()}
        return b


def worker_side(ds, info) -> WorkerSide | None:
    """The hand-off of this DataLoader worker, or None (no workers, or not an ActivationLoader's)."""
    rings = getattr(ds, "handoff_rings", None)
    if info is None or rings is None:
        return None
    side = rings.worker(info.id, ds)
    side.begin()
    return side
