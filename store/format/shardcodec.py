"""Whole-shard encode/decode for our point arrays, byte-compatible with zarr's `sharding_indexed`.

Why not just `array[a:b] = rows`: on this 2-core box zarr-python's sharded write ran at about half
the speed of the same blosc calls made directly (per-chunk buffer copies, per-chunk coroutines,
shard assembly), and its S3 reads paid a HEAD before every GET. The writer and the reader only
ever move whole shards, in a codec chain we chose ourselves, so we encode/decode them here:
inner chunks in C order, each `bytes` (little endian) then the configured compressor, followed
by the index (offset, nbytes as uint64 LE per chunk, 2^64-1 for absent) and its CRC32C.

The format is zarr's, so zarr-python, tensorstore and zarrs read what we write (tests check both
directions), and anything we do not recognise in an array's metadata falls back to zarr.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading

import google_crc32c
import numpy as np
from numcodecs import Blosc, Zstd

_MAX = np.uint64(2**64 - 1)
_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
_pools: dict[bool, cf.ThreadPoolExecutor] = {}
_pool_pid: int | None = None
_pool_lock = threading.Lock()
BACKGROUND_NICE = 10  # how much lower than the process the writer's threads run (0: same)


def lower_priority() -> None:
    """Thread initializer: raise this thread's nice value by BACKGROUND_NICE (Linux: per thread).

    The writer's compression and upload threads share cores with the engine. On a CPU engine
    the OpenMP team stalls at every barrier whenever one of its threads is preempted by a
    writer thread, and on a GPU host the engine's Python step loop is what keeps the GPU fed;
    either way the writer must run in the gaps, not take turns. A nice'd thread still gets
    every idle cycle, so a writer alone runs at full speed. Raising nice needs no privilege.
    """
    name_native_thread()
    if BACKGROUND_NICE <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        # relative to the main thread (tid == pid), not to the creating thread: a pool made lazily
        # from an already nice'd upload thread would otherwise inherit its nice and add again
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, base + BACKGROUND_NICE))
    except OSError:
        pass


def name_native_thread() -> None:
    """Give the OS thread the Python thread's name (15 chars), so `top -H` and per-thread CPU in
    /proc tell the writer's threads from the engine's OpenMP team when sharing cores is measured."""
    try:
        import ctypes

        name = threading.current_thread().name.encode()[:15]
        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def _codec_threads() -> int:
    """HARVEST_CODEC_THREADS when set (a capture actor sets it from its platform profile: on a GPU
    node with eight actors, `os.cpu_count()` threads in each would oversubscribe the host
    eightfold), else this machine's cores (a trainer's reader owns its process)."""
    env = os.environ.get("HARVEST_CODEC_THREADS")
    return max(1, int(env)) if env and env.isdigit() else max(2, os.cpu_count() or 2)


def codec_pool(background: bool = False) -> cf.ThreadPoolExecutor:
    """Threads for chunk (de)compression; blosc and zstd release the GIL. One pool per kind per
    process: `background` (the writer's encodes) runs at lower priority, see lower_priority."""
    global _pool_pid
    with _pool_lock:
        if _pool_pid != os.getpid():
            _pools.clear()
            _pool_pid = os.getpid()
        pool = _pools.get(background)
        if pool is None:
            pool = _pools[background] = cf.ThreadPoolExecutor(
                _codec_threads(), thread_name_prefix="harvest-encode" if background else "harvest-codec",
                initializer=lower_priority if background else name_native_thread)
        return pool


class Unsupported(Exception):
    """The array's codec chain is not one this module implements; use zarr instead."""


def _compressor(codecs: list):
    """The numcodecs compressor of a `bytes` (little endian) + optional blosc/zstd chain."""
    if codecs[0]["name"] != "bytes" or codecs[0].get("configuration", {}).get("endian", "little") != "little":
        raise Unsupported("array->bytes codec")
    if len(codecs) == 1:
        return None
    if len(codecs) == 2 and codecs[1]["name"] == "blosc":
        b = codecs[1]["configuration"]
        return Blosc(cname=b["cname"], clevel=int(b["clevel"]), shuffle=_SHUFFLE[b["shuffle"]],
                     blocksize=int(b.get("blocksize", 0)), typesize=int(b["typesize"]))
    if len(codecs) == 2 and codecs[1]["name"] == "zstd":
        z = codecs[1]["configuration"]
        return Zstd(level=int(z["level"]), checksum=bool(z.get("checksum", False)))
    raise Unsupported(f"codec chain {[x['name'] for x in codecs]}")


class MetaCodec:
    """Encode/decode one chunk of a row metadata array (1-D ints, or float32 scores; one chunk
    per shard, not sharded), byte-compatible with zarr: the writer puts it under its attempt's name and moves
    it to the zarr key once its marker exists, which zarr's own write cannot do."""

    def __init__(self, meta: dict):
        try:
            if meta.get("zarr_format") != 3 or meta.get("node_type") != "array" or len(meta["shape"]) != 1:
                raise Unsupported("not a 1-D zarr v3 array")
            enc = meta["chunk_key_encoding"]
            if enc["name"] != "default" or enc.get("configuration", {}).get("separator", "/") != "/":
                raise Unsupported("chunk key encoding")
            self.chunk = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
            self.dtype = np.dtype(meta["data_type"]).newbyteorder("<")
            if self.dtype.kind not in "iuf":
                raise Unsupported("not an integer or float array")
            self.fill = (float if self.dtype.kind == "f" else int)(meta.get("fill_value", 0))
            self._comp = _compressor(meta["codecs"])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise Unsupported(f"unexpected array metadata: {e}") from None

    def encode(self, values: np.ndarray) -> bytes:
        """A chunk holding `values` in its first rows (an edge chunk is fill-padded, as zarr does)."""
        full = np.full(self.chunk, self.fill, self.dtype)
        full[: values.shape[0]] = values
        raw = full.tobytes()
        return raw if self._comp is None else bytes(self._comp.encode(raw))

    def decode(self, blob: bytes, n: int) -> np.ndarray:
        """The first `n` values of a chunk. Decompressed into a buffer of exactly one chunk: a
        blob that claims more (a compression bomb) is refused by its header, never expanded."""
        want = self.chunk * self.dtype.itemsize
        if self._comp is None:
            raw = blob
        else:
            out = np.empty(want, np.uint8)
            raw = self._comp.decode(blob, out=out)
            raw = out if raw is None else raw
        if len(memoryview(raw).cast("B")) != want:
            raise ValueError(f"chunk decodes to {len(memoryview(raw).cast('B'))} bytes, expected {want}")
        return np.frombuffer(raw, self.dtype)[:n].astype(self.dtype.newbyteorder("="))


class ShardCodec:
    """Encode/decode one point array's shards (`[shard_rows, width]`, last shard may be short).

    `compression`: the store's spec (compression.py). Decoding follows the zarr metadata alone;
    where the spec is split-huffman and the metadata the blosc chain it writes, chunks are
    encoded by splithuff.SplitHuffman instead of c-blosc (same format, ~3x less CPU)."""

    def __init__(self, meta: dict, np_dtype: np.dtype, compression: "dict | None" = None):
        try:
            self._parse(meta, np_dtype)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise Unsupported(f"unexpected array metadata: {e}") from None
        self._enc = self._comp
        blosc = self._chain[-1].get("configuration", {}) if self._chain[-1]["name"] == "blosc" else {}
        if (compression or {}).get("codec") == "split-huffman" and blosc.get("cname") == "zstd" \
                and int(blosc.get("typesize", 0)) == self.dtype.itemsize:
            from .splithuff import SplitHuffman

            self._enc = SplitHuffman(self.dtype.itemsize)

    def _parse(self, meta: dict, np_dtype: np.dtype) -> None:
        if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
            raise Unsupported("not a zarr v3 array")
        self.n_rows, self.width = (int(v) for v in meta["shape"])
        self.shard_rows = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        if int(meta["chunk_grid"]["configuration"]["chunk_shape"][1]) != self.width:
            raise Unsupported("shards do not hold whole rows")
        enc = meta["chunk_key_encoding"]
        if enc["name"] != "default" or enc.get("configuration", {}).get("separator", "/") != "/":
            raise Unsupported("chunk key encoding")
        if float(meta.get("fill_value", 0)) != 0.0:
            raise Unsupported("fill value is not 0")
        [sh] = meta["codecs"]
        if sh["name"] != "sharding_indexed":
            raise Unsupported("not sharded")
        c = sh["configuration"]
        if c.get("index_location", "end") != "end":
            raise Unsupported("index at start")
        if [x["name"] for x in c["index_codecs"]] != ["bytes", "crc32c"] or \
                c["index_codecs"][0].get("configuration", {}).get("endian", "little") != "little":
            raise Unsupported("index codecs")
        self.chunk_rows = int(c["chunk_shape"][0])
        if int(c["chunk_shape"][1]) != self.width or self.shard_rows % self.chunk_rows:
            raise Unsupported("inner chunk shape")
        self._comp = _compressor(c["codecs"])
        self._chain = c["codecs"]
        self.dtype = np.dtype(np_dtype)
        if self.dtype.byteorder == ">":
            raise Unsupported("big-endian dtype")
        self.per_shard = self.shard_rows // self.chunk_rows
        self._raw = np.dtype(f"u{self.dtype.itemsize}")  # bf16 cannot export a buffer: move raw bits

    def shard_len(self, shard: int) -> int:
        return min(self.n_rows, (shard + 1) * self.shard_rows) - shard * self.shard_rows

    # ---- encode ------------------------------------------------------------------------------
    def _encode_chunk(self, rows: np.ndarray):
        if rows.shape[0] < self.chunk_rows:  # edge chunk: zarr stores full chunks, fill-padded
            full = np.zeros((self.chunk_rows, self.width), self._raw)
            full[: rows.shape[0]] = rows
            rows = full
        raw = np.ascontiguousarray(rows).reshape(-1)
        # uncompressed: a view of the caller's rows; the join in encode() is then the only copy
        return raw.view(np.uint8).data if self._enc is None else self._enc.encode(raw)

    def encode_chunk(self, rows: np.ndarray):
        """One inner chunk's stored bytes (raw rows of this codec's dtype), in this thread: what
        encode_block does for each chunk (benchmarks time a stage alone with it)."""
        return self._encode_chunk(rows)

    def encode_block(self, rows: np.ndarray, first_chunk: int, visit=None) -> list:
        """Compressed inner chunks of rows that start at inner chunk `first_chunk` of their shard
        (a writer's block: whole chunks, the last one maybe short at the end of a unit).

        `visit(i, chunk_rows)`, if given, is called on each inner chunk's rows (this dtype, `i`
        counted from the block's first chunk) in the codec thread just before that chunk is
        compressed: the writer's statistics then read rows that are already in cache instead of
        making their own pass over the block.
        """
        if rows.dtype != self.dtype or rows.shape[1:] != (self.width,) or rows.shape[0] == 0:
            raise ValueError(f"block rows must be [n > 0, {self.width}] of {self.dtype}, got "
                             f"{rows.shape} {rows.dtype}")
        n_chunks = -(-rows.shape[0] // self.chunk_rows)
        if not 0 <= first_chunk or first_chunk + n_chunks > self.per_shard:
            raise ValueError(f"block of {n_chunks} chunks at chunk {first_chunk} does not fit a "
                             f"shard of {self.per_shard}")
        raw = rows.view(self._raw)

        def one(i: int):
            chunk = raw[i * self.chunk_rows:(i + 1) * self.chunk_rows]
            if visit is not None:
                visit(i, chunk.view(self.dtype))
            return self._encode_chunk(chunk)

        return list(codec_pool(background=True).map(one, range(n_chunks)))

    def index_tail(self, entries: "dict[int, tuple[int, int]]") -> bytes:
        """The shard index (offset, nbytes per inner chunk, absent ones 2^64-1) and its CRC32C:
        the bytes that end a shard object whose chunks lie at the given offsets. Zarr's
        sharding index lets chunks sit in any order, so a writer can append blocks in the order
        they complete."""
        index = np.full((self.per_shard, 2), _MAX, "<u8")
        for i, (off, ln) in entries.items():
            index[i] = (off, ln)
        ib = index.tobytes()
        return ib + np.uint32(google_crc32c.value(ib)).astype("<u4").tobytes()

    def encode(self, rows: np.ndarray, shard: int, visit=None) -> bytes:
        """Shard object bytes for rows [shard*shard_rows, +len(rows)) of this array, in one piece
        (tests and tools; the writer streams blocks, see `encode_block` and `index_tail`)."""
        n = rows.shape[0]
        # fewer rows than the shard holds: the last unit of a run ends inside its shard; the
        # chunks past its end are absent from the index, which every zarr reader takes as fill
        if not 0 < n <= self.shard_len(shard) or rows.shape[1:] != (self.width,):
            raise ValueError(f"shard {shard} takes at most {(self.shard_len(shard), self.width)} "
                             f"rows, got {rows.shape}")
        parts = self.encode_block(rows, 0, visit)
        entries, off = {}, 0
        for i, p in enumerate(parts):
            entries[i] = (off, len(p))
            off += len(p)
        return b"".join([*parts, self.index_tail(entries)])

    # ---- decode ------------------------------------------------------------------------------
    def decode(self, blob: bytes, shard: int, out: np.ndarray | None = None,
               rows: int | None = None) -> np.ndarray:
        """[shard_len, width] rows from shard object bytes (absent chunks read as fill value 0).

        `out` (optional): a [shard_len, width] array of this dtype or its raw bits whose rows are
        contiguous but may be strided (one point's slot of a reader's [n, n_points, width]
        buffer). Chunks decode straight into it where the rows are dense, else through a small
        per-thread buffer that stays in cache: either way no shard-sized temporary is made,
        which on fresh memory costs a page fault per 4 KiB. `rows`: decode the first `rows` rows
        only (the object of a last unit that ends inside its shard, before finalize shrinks the
        array to it).
        """
        n = self.shard_len(shard) if rows is None else int(rows)
        isz = self.per_shard * 16
        if len(blob) < isz + 4:
            raise ValueError(f"shard {shard} object is truncated ({len(blob)} bytes)")
        mv = memoryview(blob)
        ib = mv[len(blob) - isz - 4: len(blob) - 4]
        crc = int(np.frombuffer(mv[len(blob) - 4:], "<u4")[0])
        if google_crc32c.value(bytes(ib)) != crc:
            raise ValueError(f"shard {shard} index fails its CRC32C: object is corrupt")
        index = np.frombuffer(ib, "<u8").reshape(self.per_shard, 2)
        if out is None:
            out = np.empty((n, self.width), self._raw)
        elif out.shape != (n, self.width) or out.dtype.itemsize != self.dtype.itemsize or \
                out.strides[1] != self.dtype.itemsize:
            raise ValueError(f"decode: out must be [{n}, {self.width}] rows of {self.dtype}, got "
                             f"{out.shape} {out.dtype} strides {out.strides}")
        out = out.view(self._raw)
        n_chunks = -(-n // self.chunk_rows)
        chunk_items = self.chunk_rows * self.width

        nbytes = chunk_items * self.dtype.itemsize

        def one(i: int) -> None:
            a = i * self.chunk_rows
            b = min(n, a + self.chunk_rows)
            off, ln = (int(v) for v in index[i])
            dst = out[a:b]
            if off == _MAX:
                dst[...] = 0
                return
            src = mv[off: off + ln]
            if self._comp is None:  # edge chunks are stored padded to full size, as zarr does
                if ln != nbytes:
                    raise ValueError(f"shard {shard} chunk {i} holds {ln} bytes, expected {nbytes}: "
                                     f"object is corrupt")
                dst[...] = np.frombuffer(src, self._raw, count=dst.size).reshape(dst.shape)
                return
            direct = b - a == self.chunk_rows and dst.flags.c_contiguous
            tmp = dst.reshape(-1) if direct else _scratch(chunk_items, self._raw)
            self._comp.decode(src, out=tmp)
            if not direct:
                dst[...] = tmp.reshape(self.chunk_rows, self.width)[: b - a]

        if self._comp is None:
            # a plain copy straight into the (maybe strided) rows, one pass, in this thread: a
            # memory-bound copy gains nothing from the pool but dispatch cost
            for i in range(n_chunks):
                one(i)
        else:
            list(codec_pool().map(one, range(n_chunks)))
        return out.view(self.dtype)


_tls = threading.local()


def _scratch(items: int, dtype: np.dtype) -> np.ndarray:
    """A per-thread decode buffer of `items` elements, reused across calls."""
    buf = getattr(_tls, "buf", None)
    nbytes = items * dtype.itemsize
    if buf is None or buf.nbytes < nbytes:
        buf = _tls.buf = np.empty(nbytes, np.uint8)
    return buf[:nbytes].view(dtype)
