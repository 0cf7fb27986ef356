"""The default encoder for point arrays: blosc chunks whose exponent bytes are Huffman-coded and
whose mantissa bytes are stored raw ("split-huffman" in compression.py).

Why: a bf16 number is two bytes, sign + 7 exponent bits (the high byte) and the exponent's last
bit + 7 mantissa bits (the low byte). On real activations the high byte carries ~3 bits of
information and the low byte ~8: all the gain of lossless compression is in order-0 entropy
coding of the high bytes, and all the time of a general compressor goes into match searches that
find nothing (blosc zstd-1 with byte shuffle: 1.41-1.43x at 1.8-2.0 core-s/GB on SmolLM2's rows).
Here the high bytes go through zstd with its match search turned off (the lowest level, whose
step skips the whole block) and literal Huffman coding forced on (zstd's `literalCompressionMode`
parameter), and the low bytes are copied: 1.46x at ~0.55-0.6 core-s/GB on the same rows, decode
2.6-3 GB/s per core (benchmarks/results/RESULTS.md, `bench_codec`).

The output is an ordinary blosc (version 2 format) chunk, written here instead of by c-blosc:
byte shuffle, compressor zstd, one block holding the whole chunk, split into one stream per byte
of the element (blosc's own split mode). A stream whose stored size equals its raw size is raw,
as blosc defines it; the high-byte stream is a standard zstd frame. Every blosc decoder (numcodecs,
zarr-python, tensorstore, zarrs, c-blosc2) reads it, so the zarr metadata stays `blosc` and
nothing on the read side changes. FORMAT.md ("Codec") has the byte layout.

Where no zstd binding that takes the parameter is installed (`compression.zstd`, Python 3.14+,
or the `backports.zstd` package before it) the encoder falls back to c-blosc's zstd-1 with the
same metadata: the same format, slower.
"""

from __future__ import annotations

import logging
import struct
import threading

import numpy as np

log = logging.getLogger(__name__)

LITERAL_MODE_PARAM = 1002    # ZSTD_c_literalCompressionMode (ZSTD_c_experimentalParam5)
LITERAL_MODE_HUFFMAN = 1     # ZSTD_ps_enable: Huffman-code literals even at negative levels
_HEADER = struct.Struct("<BBBBiiiii")   # blosc header (16 bytes) + the one block start + 1st size
_SIZE = struct.Struct("<i")
_BLOSC_VERSION, _ZSTD_VERSION = 2, 1
_FLAG_SHUFFLE, _ZSTD_FORMAT = 0x1, 4      # flags: bit 0 byte shuffle; bits 5-7 compressor format
_MIN_ELEMENTS = 128   # blosc splits a block into byte streams only from 128 elements on
_MAX_BYTES = 2**31 - 1024   # blosc sizes are int32
_tls = threading.local()
_zstd_state: dict = {}


def _zstd():
    """(module, options) of a zstd binding that accepts the literal-mode parameter, or None."""
    if "mod" not in _zstd_state:
        mod = opts = None
        try:
            from compression import zstd as mod   # type: ignore[no-redef]  # Python 3.14+
        except ImportError:
            try:
                from backports import zstd as mod   # type: ignore[no-redef]
            except ImportError:
                mod = None
        if mod is not None:
            level = mod.CompressionParameter.compression_level
            opts = {level: level.bounds()[0], LITERAL_MODE_PARAM: LITERAL_MODE_HUFFMAN}
            try:
                mod.ZstdCompressor(options=opts).compress(bytes(range(256)) * 64, mod.ZstdCompressor.FLUSH_FRAME)
            except Exception as e:  # noqa: BLE001 -- a libzstd that renumbered the parameter
                log.warning("zstd refuses the literal-only parameters (%s): split-huffman falls back "
                            "to c-blosc zstd-1 (same format, about 3x slower)", e)
                mod = None
        else:
            log.warning("no zstd binding (install backports-zstd): split-huffman falls back to "
                        "c-blosc zstd-1 (same format, about 3x slower)")
        _zstd_state["mod"], _zstd_state["opts"] = mod, opts
    mod = _zstd_state["mod"]
    return None if mod is None else (mod, _zstd_state["opts"])


def available() -> bool:
    """Whether chunks are written by this encoder (else by c-blosc, see the module doc)."""
    return _zstd() is not None


def _compressor():
    """This thread's zstd compressor with the literal-only options (one per codec thread)."""
    c = getattr(_tls, "comp", None)
    if c is None:
        mod, opts = _zstd()
        c = _tls.comp = mod.ZstdCompressor(options=opts)
    return c


def _scratch(j: int, n: int) -> np.ndarray:
    """This thread's buffer for byte stream `j` (reused chunk after chunk: encode copies every
    stream into its output before it returns, and fresh pages per chunk cost more than the copy)."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    buf = bufs.get(j)
    if buf is None or buf.size < n:
        buf = bufs[j] = np.empty(n, np.uint8)
    return buf[:n]


class SplitHuffman:
    """Encode one chunk (little-endian elements of `typesize` bytes) into a blosc chunk: byte
    streams 0 .. typesize-2 raw, the most significant one Huffman-coded (see the module doc).
    `decode` is c-blosc's (numcodecs), which reads any blosc chunk."""

    def __init__(self, typesize: int):
        from numcodecs import Blosc

        if typesize not in (1, 2, 4, 8):
            raise ValueError(f"split-huffman: typesize={typesize} (use 1, 2, 4 or 8)")
        self.typesize = typesize
        self._blosc = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, blocksize=1 << 20,
                            typesize=typesize)
        self._uint = np.dtype(f"<u{typesize}")
        self._fast = available()

    def encode(self, buf) -> bytes:
        raw = buf.reshape(-1).view(np.uint8) if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
        n, t = raw.size, self.typesize
        m = n // t
        if not self._fast or n % t or m < _MIN_ELEMENTS or n > _MAX_BYTES:
            return self._blosc.encode(raw)
        words = raw.view(self._uint)
        streams: list[memoryview | bytes] = []   # the byte streams, joined into the chunk below
        sizes: list[int] = []
        for j in range(t - 1):   # byte j of every element: a shift and a truncating cast, one pass
            s = _scratch(j, m)
            if j:
                np.right_shift(words, 8 * j, out=s, casting="unsafe")
            else:
                np.copyto(s, words, casting="unsafe")   # keeps the low byte
            streams.append(s.data)   # a view of the scratch bytes, copied by the join
            sizes.append(m)
        if t == 1:
            top = raw
        else:
            top = _scratch(t - 1, m)
            np.right_shift(words, 8 * (t - 1), out=top, casting="unsafe")
        h = _compressor().compress(top, _zstd()[0].ZstdCompressor.FLUSH_FRAME)
        # a stream stored at its raw size is read as raw, so a frame must be strictly smaller
        streams.append(h if len(h) < m else top.tobytes())
        sizes.append(min(len(h), m))
        total = 16 + 4 + 4 * t + sum(sizes)
        flags = (_FLAG_SHUFFLE if t > 1 else 0) | (_ZSTD_FORMAT << 5)
        parts = [_HEADER.pack(_BLOSC_VERSION, _ZSTD_VERSION, flags, t, n, n, total, 20, sizes[0]),
                 streams[0]]
        for stream, size in zip(streams[1:], sizes[1:]):
            parts += [_SIZE.pack(size), stream]
        return b"".join(parts)

    def decode(self, buf, out=None):
        return self._blosc.decode(buf, out=out)


__all__ = ["SplitHuffman", "available"]
