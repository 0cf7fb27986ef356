"""Batches from decoded windows: gathers run ahead on the codec threads, into recycled buffers.

A full batch is one `np.take` straight out of a window's arena along its permutation. A batch
that spans two windows (or, in endless mode, two epochs) is assembled in a side buffer and its
two runs interleaved, because the older window's arena is handed to the decoder as soon as the
next window is asked for.

Where the time went (measured: 262,144 rows x 576 bf16, one window, 2 cores): the reader ran at
0.6-0.7x the raw decode of the same shards. Decoding took as long as the raw decode; the rest
was the gather, done after it in the consumer's thread, into a fresh `np.empty` per batch. A
fresh 4.7 MB batch costs its page faults and the kernel's zeroing of every page (a second pass
over the bytes): gathering into fresh arrays took 0.53 s per epoch against 0.24 s into reused
ones. So (1) batch buffers are recycled once no yielded batch still uses them (`BatchBuffers`),
and (2) the next `ahead` batches are gathered on the codec threads (numpy's take releases the
GIL) while the consumer works on the current one: the gather, a random-row copy that runs at a
fifth of memcpy speed on these VMs, then uses every core instead of one, after the decode.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass

import numpy as np

from ...format import layout


@dataclass
class Tally:
    """What the norm filter did in one iteration of this process (see ActivationDataset)."""

    dropped: int = 0
    padded: int = 0


def _idle_refcount() -> int:
    """sys.getrefcount of a list item nothing else holds, seen from the loop in BatchBuffers.get
    (the list, the loop variable, getrefcount's argument): measured, not assumed, so that a
    Python whose counting differs makes buffers look busy (a fresh array), never idle."""
    probe = [np.empty(1)]
    for b in probe:
        return sys.getrefcount(b)
    raise AssertionError("unreachable")


class BatchBuffers:
    """Batch arrays of one shape, reused once nothing outside this pool references them.

    A yielded batch is a tensor over one of these arrays (torch.from_numpy keeps the array, and
    numpy views keep their base, alive), so a buffer whose reference count is back to the pool's
    own is one no caller can still read: a trainer that drops each batch after its step gets the
    same few buffers back forever, a caller that keeps every batch (`list(dataset)`) gets fresh
    ones, as before. At most `keep` buffers are pooled; beyond that they are left to the caller.

    Under `ActivationLoader` a worker gathers into shared-memory slots instead (handoff.py); in
    a plain DataLoader's worker the pickler that sends a batch to the parent copies it into a fresh
    shared segment and repoints the tensor there, so the buffer comes back here as soon as the
    batch is sent (worker CPU 2.65 us/row against 2.82 with a fresh array per batch). Gathering
    straight into fresh shared memory instead (torch's default_collate does so, to skip that
    copy) measured worse, 3.07 us/row: 4 KiB shmem page faults cost more than the copy saves.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, keep: int):
        self.shape, self.dtype, self.keep = shape, dtype, keep
        self._bufs: list[np.ndarray] = []
        self._idle = _idle_refcount()
        self.allocated = 0    # fresh arrays made (tests and benchmarks read it)

    def get(self) -> np.ndarray:
        for b in self._bufs:
            if sys.getrefcount(b) <= self._idle:
                return b
        b = np.empty(self.shape, self.dtype)
        self.allocated += 1
        if len(self._bufs) < self.keep:
            self._bufs.append(b)
        return b


def batches(readies, k: int, shape: tuple[int, int], raw: np.dtype, emit, *, skip: int = 0,
            limit: int | None = None, drop_last: bool = False, shuffle: bool = True, seed: int = 0,
            tally: Tally | None = None, pool=None, ahead: int = 4, buffers: BatchBuffers | None = None):
    """Yield emit(rows [n, P, W] raw bits, store rows, meta) for consecutive `k`-row batches.

    skip: rows of the stream already yielded before a resume; limit: batches to yield at most.
    pool: an executor for the gathers (None: in this thread); up to `ahead` batches are gathered
    ahead of the one yielded, never past the current window (its arena is reused once the next
    window is asked for) nor past `limit`.
    """
    P, W = shape
    bufs = buffers or BatchBuffers((k, P, W), raw, keep=ahead + 2)
    produced = 0
    part: list | None = None     # [out, rows, meta, filled, windows spanned]
    pending: deque = deque()   # (future or None, out, rows, meta) gathered ahead, in order
    if limit is not None and limit <= 0:
        return

    def room() -> bool:
        return limit is None or produced + len(pending) < limit

    try:
        for rd in readies:
            if tally is not None:
                tally.dropped += rd.dropped
                tally.padded += rd.padded
            src = rd.arena.reshape(rd.arena.shape[0], P * W)  # 2-D: numpy's take is ~25 % faster
            n, i = rd.idx.shape[0], 0
            if skip:
                i = min(skip, n)
                skip -= i
            while i < n and room():
                if part is None and n - i >= k:
                    out = bufs.get()
                    sel, dst = rd.idx[i:i + k], out.reshape(k, P * W)
                    fut = pool.submit(np.take, src, sel, 0, dst) if pool is not None else \
                        np.take(src, sel, axis=0, out=dst)
                    pending.append((fut if pool is not None else None, out, rd.rows[i:i + k],
                                    {m: v[i:i + k] for m, v in rd.meta.items()}))
                    i += k
                    if len(pending) > ahead:
                        produced += 1
                        yield _finish(pending.popleft(), emit)
                    continue
                while pending:   # batches before this partial one go first
                    produced += 1
                    yield _finish(pending.popleft(), emit)
                if part is None:
                    part = [np.empty((k, P, W), raw), np.empty(k, np.int64),
                            {m: np.empty(k, layout.meta_batch_dtype(m)) for m in rd.meta}, 0, 0]
                out, prow, pmeta, f, _ = part
                c = min(k - f, n - i)
                np.take(src, rd.idx[i:i + c], axis=0, out=out[f:f + c].reshape(c, P * W))
                prow[f:f + c] = rd.rows[i:i + c]
                for m, v in rd.meta.items():
                    pmeta[m][f:f + c] = v[i:i + c]
                part[3] += c
                part[4] += 1
                i += c
                if part[3] < k:
                    continue
                produced += 1
                yield _emit_part(part, emit, shuffle, seed)
                part = None
            while pending:   # every gather from this arena is done before the next window
                produced += 1
                yield _finish(pending.popleft(), emit)
            if limit is not None and produced >= limit:
                return
        if part is not None and not drop_last:
            yield _emit_part(part, emit, shuffle, seed)
    finally:
        # closed early: no gather may still write a buffer or read an arena after we return
        for fut, *_ in pending:
            if fut is not None and not fut.cancel():
                fut.exception()


def _finish(job, emit):
    fut, out, rows, meta = job
    if fut is not None:
        fut.result()
    return emit(out, rows, meta)


def _emit_part(part, emit, shuffle: bool, seed: int):
    out, rows, meta, f, spans = part
    out, rows, meta = out[:f], rows[:f], {m: v[:f] for m, v in meta.items()}
    if shuffle and spans > 1:  # two windows' rows came in two runs: interleave them
        perm = np.random.default_rng([seed, int(rows[0]), f]).permutation(f)
        out, rows, meta = np.take(out, perm, axis=0), rows[perm], {m: v[perm] for m, v in meta.items()}
    return emit(out, rows, meta)
