"""Memory of a DataLoader worker over many epochs: cap glibc's malloc arenas.

Measured (262,144 rows x 576 bf16, 16 shards of 16,384 rows, default 1 GiB buffer, 2 workers,
endless over 10 epochs, 2 shared cores): each worker's RSS grew 610 -> 686-696 MB (+13 %) and
was still creeping. The growth is glibc, not Python: every decode thread (io_threads, 8) gets a
malloc arena of its own and keeps freed shard-sized temporaries (compressed object, decode
buffers) in it, since glibc raises its mmap threshold to the largest block freed (up to 32 MiB).
With MALLOC_ARENA_MAX=2 the same run stayed at 610-648 MB (within 5 % of epoch 1) at the same
rate within this machine's noise; a fixed mmap threshold (MALLOC_MMAP_THRESHOLD_=1 MiB) was
flat too but halved the rate (every batch and shard buffer faulted in afresh).

Measured again with batches gathered ahead into recycled buffers (batching.py; 524,288 rows,
32 shards, default buffer, 2 persistent workers forked from a process that had read nothing):
over 20 epochs each worker's private memory (RSS less pages shared with the parent) went
417/415 MB after epoch 1 -> at most 433/416 (+3.9 %), RSS 586/584 -> at most 601/585 (+2.6 %),
in steps of ~12 MB that come and go (glibc's heap growing and trimming with the compressed
shards in flight), not a climb. bench_shuffle, whose workers fork from a parent that has run
the quality epochs, saw 10 epochs at RSS +4.7 %, private 465 -> 511 MB (+9.8 %).

The bound per worker, private memory: the window arena (its part's pieces x shard_rows x points x
width x itemsize, 17 x 18.9 MB = 321 MB above; a second one when its part spans several windows)
+ (4 ahead + 2) batch buffers (28 MB at 4,096 x 576 bf16; under ActivationLoader its 10
shared-memory slots instead, handoff.py) + up to io_threads compressed shards in
flight (8 x ~17 MB); plus the imports (~250-350 MB of RSS, mostly shared with the parent).
`decoded_rows` and readahead.Arenas say what a worker decodes and holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_ARENA_MAX = -8       # glibc malloc.h
ARENA_MAX = 2
_done = False


def cap_malloc_arenas() -> bool:
    """mallopt(M_ARENA_MAX, 2) once per process (glibc only); True if it took effect.

    Called in DataLoader workers before their decode threads start: arenas made later obey it.
    The parent is left alone (the trainer's allocator is not ours to tune)."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(_M_ARENA_MAX, ARENA_MAX))
    except (OSError, AttributeError):   # not glibc (musl, macOS): nothing to cap
        _done = False
    return _done
