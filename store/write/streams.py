"""One shard object of one point, written block by block: the writer's streamed data plane.

A shard object is the sharding codec's layout: compressed inner chunks, then the index (offset,
nbytes per chunk) and its CRC32C. Zarr's index lets chunks sit at any offset in any order, so
the writer appends each block's chunks when the block completes (completion order, not row
order) and writes the index last; the object stays plain Zarr v3 (tests read it with zarr-python).
The writer then never holds a shard: at an 8B model's shape a shard set is 4 GiB (32 points x
128 MiB), a block set 128 MiB.

Where the bytes go is the storage's business (`Storage.begin_object` ... `finish_object`): a
temp file renamed to the attempt's name locally, a multipart upload to the zarr key on S3. Parts
but the last are at least `part_min_bytes` (S3: 16 MiB, above S3's 5 MiB minimum: fewer requests,
less client CPU), so compressed blocks are held until they reach it: per stream at most one part
below it plus one block.

Digests: the CRC32C of the stored bytes is extended as they are appended (the object's bytes are
exactly the appends in order). The CRC32C of the raw rows (the marker's per-shard `crc32c`, in
row order) is combined from per-block CRCs in block order at the end (`crc32c_combine`), so the
marker keeps its meaning and deep verify its check, whatever order the blocks came in.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import google_crc32c

from ..commit.records import UploadHandle
from ..format import checksum
from ..storage.interface import UploadRecord

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class FinishedObject:
    """A shard object made durable (not yet published): its size and the CRC32C of its stored
    bytes, the CRC32C of its raw rows in row order (the marker's per-shard `crc32c`), and the
    storage's upload record (None where the storage publishes by rename)."""

    nbytes: int
    object_crc32c: int
    crc32c: int
    upload: "UploadRecord | None"


_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected
_ZEROS_OPS: dict[int, list[int]] = {}
_OPS_LOCK = threading.Lock()


def _times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def _zeros_operator(nbytes: int) -> list[int]:
    """The GF(2) matrix that advances a CRC32C register over `nbytes` zero bytes (zlib's
    crc32_combine construction), cached per length: a writer's blocks have one or two lengths,
    so combining a block's CRC is one 32-step matrix-vector product."""
    with _OPS_LOCK:
        op = _ZEROS_OPS.get(nbytes)
    if op is not None:
        return op
    odd = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    even = _square(odd)   # two zero bits
    odd = _square(even)   # four zero bits
    result = [1 << n for n in range(32)]  # identity
    n = nbytes
    while n:
        even = _square(odd)  # first pass: one zero byte, then doubling
        if n & 1:
            result = [_times(even, v) for v in result]
        n >>= 1
        if not n:
            break
        odd = _square(even)
        if n & 1:
            result = [_times(odd, v) for v in result]
        n >>= 1
    with _OPS_LOCK:
        _ZEROS_OPS[nbytes] = result
    return result


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of A + B from CRC32C(A), CRC32C(B) and len(B)."""
    if len2 <= 0:
        return crc1
    return _times(_zeros_operator(len2), crc1) ^ crc2


class ObjectStream:
    """One point's shard object; `append` from any thread (serialised here), `finish` once."""

    def __init__(self, loc, final_rel: str, attempt_rel: str, n_blocks: int, tail):
        self._loc, self.final_rel, self.attempt_rel = loc, final_rel, attempt_rel
        self._tail = tail              # entries -> index bytes (ShardCodec.index_tail)
        self.blocks_left = n_blocks
        self.handle: UploadHandle | None = None
        self.entries: dict[int, tuple[int, int]] = {}
        self.offset = 0
        self.object_crc = 0
        self._pending: list[bytes] = []
        self.pending_bytes = 0
        self._raw: dict[int, tuple[int, int]] = {}  # block first chunk -> (raw crc, raw nbytes)
        self.record: FinishedObject | None = None
        self.lock = threading.Lock()

    def _begin(self) -> None:
        if self.handle is None:
            self.handle = self._loc.begin_object(self.final_rel, self.attempt_rel)

    def _emit(self, final: bool) -> None:
        if not self._pending or (not final and self.pending_bytes < self._loc.part_min_bytes):
            return
        pieces = self._pending  # one part, sent as its pieces (no join: the storage's choice)
        self._pending, self.pending_bytes = [], 0
        self._loc.write_part(self.handle, pieces)

    def append(self, first_chunk: int, chunks: list, raw_crc: int, raw_nbytes: int) -> bool:
        """A block's compressed chunks (its first chunk's index in the shard), and the CRC32C
        and size of its raw rows; True when it was the object's last block."""
        with self.lock:
            self._begin()
            for i, c in enumerate(chunks):
                c = bytes(c)  # uncompressed chunks are views of a buffer about to be reused
                self.entries[first_chunk + i] = (self.offset, len(c))
                self.offset += len(c)
                self.object_crc = checksum.extend(self.object_crc, c)
                self._pending.append(c)
                self.pending_bytes += len(c)
            self._raw[first_chunk] = (raw_crc, raw_nbytes)
            self._emit(final=False)
            self.blocks_left -= 1
            return self.blocks_left == 0

    def finish(self) -> FinishedObject:
        """Write the index, the last part, and make the object durable (not yet published)."""
        with self.lock:
            tail = self._tail(self.entries)
            self.object_crc = google_crc32c.extend(self.object_crc, tail)
            self._pending.append(tail)
            self.pending_bytes += len(tail)
            self.offset += len(tail)
            self._emit(final=True)
            upload = self._loc.finish_object(self.handle)
            raw = 0
            for k in sorted(self._raw):
                c, n = self._raw[k]
                raw = crc32c_combine(raw, c, n)
            self.record = FinishedObject(self.offset, self.object_crc, raw, upload)
            return self.record

    def abort(self) -> None:
        """Drop what this stream wrote (an unfinished or finished-but-uncommitted object)."""
        with self.lock:
            self._pending, self.pending_bytes = [], 0
            if self.handle is not None:
                self._loc.abort_object(self.handle)
                self.handle = None


def write_small(loc, final_rel: str, attempt_rel: str, blob: bytes) -> "UploadRecord | None":
    """A small object (a metadata chunk) through the same begin/finish path as a shard object,
    so it publishes the same way (rename, or completing a one-part upload: no copy)."""
    h = loc.begin_object(final_rel, attempt_rel)
    try:
        loc.write_part(h, [blob])
        return loc.finish_object(h)
    except BaseException:
        try:
            loc.abort_object(h)
        except Exception:  # noqa: BLE001 -- the original failure is what matters
            pass
        raise


def discard(loc, streams: "list[ObjectStream]", uploads: "list[tuple[str, UploadRecord | None]]",
            keys: "list[str]", who: str) -> None:
    """Best effort: abort `streams` and the `uploads` ((final key, upload record or None) of
    small objects), then delete `keys`: what an attempt that never commits wrote. Failures are
    logged, not raised: an upload left behind is never completed and garbage under an attempt's
    name harms nothing (finalize and verify see both)."""
    for st in streams:
        try:
            st.abort()
        except Exception as e:  # noqa: BLE001
            log.warning("%s: could not drop %s (%s)", who, st.final_rel, type(e).__name__)
    for final, up in uploads:
        if up is not None:
            try:
                loc.abort_upload(final, up["upload_id"])
            except Exception as e:  # noqa: BLE001
                log.warning("%s: could not drop %s (%s)", who, final, type(e).__name__)
    for k in keys:
        try:
            loc.delete(k)
        except Exception as e:  # noqa: BLE001
            log.warning("%s: could not remove %s (%s)", who, k, type(e).__name__)


__all__ = ["ObjectStream", "crc32c_combine", "discard", "write_small"]
