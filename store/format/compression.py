"""Compression choices for point arrays, as a small JSON spec kept in the store attributes.

Default: "split-huffman" (splithuff.py): blosc chunks whose most significant byte stream (sign +
exponent of a bf16) is Huffman-coded by zstd with its match search off and whose other byte
streams (mantissa) are stored raw. Measured side by side on SmolLM2's real rows, one core
(benchmarks/results/RESULTS.md, `python -m harvest.benchmarks.bench_codec`): 1.46-1.49x at
0.54-0.59 core-s/GB encode and 2.6-3.0 GB/s decode, against blosc zstd-1 byte shuffle's
1.41-1.43x at 1.8-2.0 core-s/GB and ~1.7 GB/s. The zarr metadata says `blosc` (zstd, byte
shuffle): every blosc reader decodes these chunks, and stores written with the old default
("blosc-zstd", below) read as before; the spec recorded here is what tells a writer which
encoder to use.

"blosc-zstd" (the default before split-huffman) is c-blosc's own zstd level 1 with byte
shuffle (typesize = element size), in 1 MiB blosc blocks. Higher zstd levels buy ~5% more ratio
for a third of the encode speed, which an uploader that must keep up with prefill cannot afford.

Why the 1 MiB block (one block per ~1 MiB inner chunk) instead of blosc's automatic size (32 KiB
at clevel 1): measured on SmolLM2 bf16 activations, one core, the automatic blocks give 1.27x at
~400-500 MB/s encode and ~600 MB/s decode; 1 MiB blocks give 1.465x at the same encode speed and
1.6-2.2 GB/s decode (zstd sees the shuffled exponent bytes as one long stream instead of 16 KiB
pieces). That is 15% fewer bytes to store and move and a decoder that keeps up with storage.
Readers need nothing new: the block size is in each blosc header (tensorstore reads it too).
"""

from __future__ import annotations

from typing import Any

from zarr.codecs import BloscCodec, ZstdCodec

BLOCK = 1 << 20
DEFAULT = {"codec": "split-huffman"}
BLOSC_ZSTD = {"codec": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": BLOCK}

_SHORTCUTS: dict[str, dict[str, Any]] = {
    "default": DEFAULT,
    "split-huffman": DEFAULT,
    "blosc-zstd": BLOSC_ZSTD,
    "blosc-zstd-bitshuffle": {"codec": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "bitshuffle",
                              "blocksize": BLOCK},
    "blosc-lz4": {"codec": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "shuffle"},
    "blosc-lz4-bitshuffle": {"codec": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "bitshuffle"},
    "zstd": {"codec": "zstd", "level": 1},
    "none": {"codec": "none"},
}
_BLOSC_CNAMES = ("zstd", "lz4", "lz4hc", "blosclz", "zlib")
_SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")


def normalize(spec: "str | dict | None") -> dict[str, Any]:
    """Spec from the user (None, shortcut name, or dict) -> the full dict we store."""
    if spec is None:
        return dict(DEFAULT)
    if isinstance(spec, str):
        if spec not in _SHORTCUTS:
            raise ValueError(
                f"compression={spec!r} is unknown: use one of {', '.join(_SHORTCUTS)} "
                "or a dict like {'codec': 'blosc', 'cname': 'zstd', 'clevel': 1, 'shuffle': 'shuffle'}"
            )
        return dict(_SHORTCUTS[spec])
    if not isinstance(spec, dict) or "codec" not in spec:
        raise ValueError("compression must be None, a name, or a dict with a 'codec' key")
    spec = dict(spec)
    codec = spec["codec"]
    if codec == "blosc":
        cname = spec.get("cname", "zstd")
        out = {"codec": "blosc", "cname": cname, "clevel": int(spec.get("clevel", 1)),
               "shuffle": spec.get("shuffle", "shuffle"),
               # zstd gains ratio and decode speed from long blocks (see above); lz4 loses ratio
               "blocksize": int(spec.get("blocksize", BLOCK if cname == "zstd" else 0))}
        if out["cname"] not in _BLOSC_CNAMES:
            raise ValueError(f"compression cname={out['cname']!r}: use one of {', '.join(_BLOSC_CNAMES)}")
        if out["shuffle"] not in _SHUFFLES:
            raise ValueError(f"compression shuffle={out['shuffle']!r}: use one of {', '.join(_SHUFFLES)}")
        if out["blocksize"] < 0:
            raise ValueError(f"compression blocksize={out['blocksize']}: use 0 (blosc decides) or a "
                             "size in bytes")
        if not 0 <= out["clevel"] <= 9:
            raise ValueError(f"compression clevel={out['clevel']}: blosc levels are 0..9")
        return out
    if codec == "zstd":
        return {"codec": "zstd", "level": int(spec.get("level", 1))}
    if codec == "none":
        return {"codec": "none"}
    if codec == "split-huffman":
        extra = sorted(set(spec) - {"codec"})
        if extra:
            raise ValueError(f"compression split-huffman takes no options, got {', '.join(extra)}")
        return dict(DEFAULT)
    raise ValueError(f"compression codec={codec!r}: use 'split-huffman', 'blosc', 'zstd' or 'none'")


def compressors(spec: dict[str, Any], itemsize: int):
    """zarr compressor list for a normalized spec (split-huffman's chunks are blosc chunks: the
    metadata is c-blosc's zstd-1 byte shuffle, which is also what zarr itself would write)."""
    if spec["codec"] == "split-huffman":
        return compressors(BLOSC_ZSTD, itemsize)
    if spec["codec"] == "blosc":
        return [BloscCodec(cname=spec["cname"], clevel=spec["clevel"], shuffle=spec["shuffle"],
                           typesize=itemsize, blocksize=spec.get("blocksize", 0))]
    if spec["codec"] == "zstd":
        return [ZstdCodec(level=spec["level"])]
    return None


# Expected logical / stored bytes of bf16 activations, for estimates before anything is written
# (`harvest plan`); a finished store records the ratio it achieved (`compression_ratio`).
# - The default (split-huffman): 1.46x on SmolLM2's rows at an early, a middle and a late layer
#   (1.459, 1.459, 1.487; bench_codec, RESULTS.md), 1.45 to stay on the safe side.
# - blosc zstd-1, byte shuffle, 1 MiB blocks: 1.42x, what the default job recorded on
#   SmolLM2 (FIELD-NOTES; 1.39x in benchmarks/results/RESULTS.md's storage rows, 1.465x on one
#   sample above; published ~1.47x on real hidden states with byte-split + zstd-1). Bitshuffle
#   gains a little on synthetic data, so it gets the same figure.
# - blosc with its automatic (32 KiB) blocks, lz4 included: 1.27x, measured on SmolLM2 above.
# - plain zstd (no shuffle): 1.27x (FIELD-NOTES, synthetic bf16).
EXPECTED_RATIO_DEFAULT = 1.45
EXPECTED_RATIO_BLOSC_ZSTD = 1.42
EXPECTED_RATIO_OTHER = 1.27


def expected_ratio(spec: "str | dict | None") -> float:
    """The compression a config's codec is expected to give (1.0 for none); see above."""
    spec = normalize(spec)
    if spec["codec"] == "none":
        return 1.0
    if spec["codec"] == "split-huffman":
        return EXPECTED_RATIO_DEFAULT
    if spec["codec"] == "blosc" and spec["cname"] == "zstd" and spec.get("blocksize") == BLOCK \
            and spec["shuffle"] != "noshuffle":
        return EXPECTED_RATIO_BLOSC_ZSTD
    return EXPECTED_RATIO_OTHER


# The whole write path's CPU, core-seconds per GB of bf16 input (the writer's block buffers, the
# codec, CRCs, per-chunk statistics and the S3 client's threads, the rows arriving in place as the
# capture actor writes them), measured by `python -m harvest.benchmarks.bench_dataplane` at the 8B
# shape (32 points x 4096, 128 MiB shards) uploading to SeaweedFS, one invocation for all
# (benchmarks/results/RESULTS.md, "Whole write path"). `harvest plan` turns it into host cores per
# GPU. An fp8 store's figure is per GB of the same bf16 rows (its write path moves about half the
# bytes). Not in that run: blosc-zstd, priced as split-huffman plus the encode difference the two
# had side by side in the earlier run (0.80 core-s/GB), and every codec not named here likewise;
# `none`, priced as the dtype's default codec (in the earlier run it cost 3 % more than
# split-huffman on S3: no codec seconds, 1.44x the bytes to checksum, send and upload).
# S3 parts sent from the writer's buffers (storage/s3parts.py) and the `crc32c` package's CRC32C
# (format/checksum.py; without it google-crc32c adds ~0.05-0.1).
WRITE_CORE_S_PER_GB = {"split-huffman": 1.82, "blosc-zstd": 2.62, "none": 1.82}
WRITE_CORE_S_PER_GB_FP8 = {"zstd": 1.44, "none": 1.44}
WRITE_CORE_S_SOURCE = ("measured by bench_dataplane at the 8B shape on 2 shared cores (load "
                       "average 2-3), SeaweedFS over loopback: an upper bound")


def write_core_s_per_gb(spec: "str | dict | None", dtype: str = "bfloat16") -> float:
    """The measured whole-write-path CPU of a codec for a store of `dtype` (see
    WRITE_CORE_S_PER_GB); `spec` as the store records it (an fp8 store's None is fp8's default,
    which fp8.compression_for resolves: pass its result)."""
    spec = normalize(spec)
    if dtype == "float8_e4m3fn":
        return WRITE_CORE_S_PER_GB_FP8["none" if spec["codec"] == "none" else "zstd"]
    if spec["codec"] in ("split-huffman", "none"):
        return WRITE_CORE_S_PER_GB[spec["codec"]]
    return WRITE_CORE_S_PER_GB["blosc-zstd"]
