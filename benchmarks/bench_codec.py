"""Every compression candidate on one store's real rows: ratio, encode core-seconds per GB and
decode GB/s per core, side by side in one run (issue 38 item 3).

    python -m harvest.benchmarks.bench_codec --store URL [--point P] [--rows N] [--json] [--fp8]
    python -m harvest.benchmarks.bench_codec --dry --json      # synthetic rows, a few seconds

Rows are read from the store's committed rows (the first `--rows`), cut into the store's own inner
chunks, and each candidate encodes and decodes every chunk in this thread (c-blosc's internal
threads off), timed by process CPU time, best of `--repeat`. GB are GB of bf16 input (the rows as
the store's dtype holds them; for --fp8, the bf16 rows the fp8 bytes were made from). Every
candidate is checked to decode bit for bit.

`--fp8` also measures the candidates on fp8 e4m3 bytes made from the same rows with one scale per
row (absmax / 448, the float8_e4m3fn store's quantiser as issue 38 specifies it): the bytes only,
scales (4 bytes a row) left out. "ratio" is then against the fp8 bytes and "ratio_vs_bf16"
against the bf16 rows they came from.

Output (`--json`): {"default": NAME, "baseline": "blosc-zstd", "rows": .., "chunk_rows": ..,
"codecs": {NAME: {"ratio", "encode_core_s_per_gb", "decode_gb_s_per_core", "lossless"}},
"encode_speedup_vs_baseline": .., ["float8_e4m3fn": {"codecs": {...}}]}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

CANDIDATES = ("split-huffman", "blosc-zstd", "blosc-zstd-bitshuffle", "blosc-lz4", "blosc-lz4-bitshuffle",
              "zstd", "none")
BASELINE = "blosc-zstd"


def _codec(name: str, typesize: int):
    """(encode, decode_into) for a compression shortcut, one chunk at a time."""
    from numcodecs import Blosc, Zstd

    from ..store.format import compression
    from ..store.format.splithuff import SplitHuffman

    spec = compression.normalize(name)
    if spec["codec"] == "split-huffman":
        c = SplitHuffman(typesize)
        return c.encode, lambda blob, out: c.decode(blob, out=out)
    if spec["codec"] == "blosc":
        shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[spec["shuffle"]]
        c = Blosc(cname=spec["cname"], clevel=spec["clevel"], shuffle=shuffle,
                  blocksize=spec.get("blocksize", 0), typesize=typesize)
        return c.encode, lambda blob, out: c.decode(blob, out=out)
    if spec["codec"] == "zstd":
        c = Zstd(level=spec["level"])
        return c.encode, lambda blob, out: c.decode(blob, out=out)

    def copy_into(blob, out):
        out[...] = np.frombuffer(blob, out.dtype)
    return (lambda raw: raw.tobytes()), copy_into


def measure(chunks: list[np.ndarray], bf16_bytes: int, names=CANDIDATES, repeat: int = 3) -> dict:
    """{name: {ratio, encode_core_s_per_gb, decode_gb_s_per_core, lossless}} over `chunks`
    (contiguous 1-D arrays of unsigned ints: the raw bits), per GB of `bf16_bytes`."""
    import numcodecs.blosc

    numcodecs.blosc.use_threads = False   # one thread: the figure is per core
    raw_bytes = sum(c.nbytes for c in chunks)
    out: dict = {}
    for name in names:
        enc, dec = _codec(name, chunks[0].dtype.itemsize)
        best_e = best_d = float("inf")
        for _ in range(max(1, repeat)):
            t = time.process_time()
            blobs = [enc(c) for c in chunks]
            best_e = min(best_e, time.process_time() - t)
        dst = np.empty(chunks[0].size, chunks[0].dtype)
        for _ in range(max(1, repeat)):
            t = time.process_time()
            for b, c in zip(blobs, chunks):
                dec(b, dst[:c.size])
            best_d = min(best_d, time.process_time() - t)
        lossless = True
        for b, c in zip(blobs, chunks):
            dec(b, dst[:c.size])
            lossless &= bool(np.array_equal(dst[:c.size], c))
        stored = sum(len(b) for b in blobs)
        out[name] = {"ratio": round(raw_bytes / stored, 4),
                     "encode_core_s_per_gb": round(best_e / bf16_bytes * 1e9, 3),
                     "decode_gb_s_per_core": round(bf16_bytes / max(best_d, 1e-9) / 1e9, 2),
                     "lossless": lossless}
        if raw_bytes != bf16_bytes:
            out[name]["ratio_vs_bf16"] = round(bf16_bytes / stored, 4)
    return out


def fp8_bytes(rows_bf16: np.ndarray) -> np.ndarray:
    """fp8 e4m3 bits of bf16 rows scaled per row by absmax / 448 (zero rows keep scale 1)."""
    import ml_dtypes

    f = rows_bf16.astype(np.float32)
    scale = np.abs(f).max(axis=1, keepdims=True) / 448.0
    scale[~(scale > 0) | ~np.isfinite(scale)] = 1.0
    return (f / scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _chunks(raw: np.ndarray, chunk_rows: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(raw[i:i + chunk_rows]).reshape(-1) for i in range(0, raw.shape[0], chunk_rows)]


def run(store: str | None = None, point: str | None = None, rows: int = 8192, repeat: int = 3,
        fp8: bool = False, dry: bool = False, storage_options: dict | None = None) -> dict:
    from ..store.format import compression
    from ..store.format.dtypes import BF16

    if dry:
        from ..testing import synthetic

        x = synthetic.activations((min(rows, 1024), 256), seed=0)
        chunk_rows, src = 256, {"store": None, "point": "synthetic"}
    else:
        from ..store import open_store

        s = open_store(store, storage_options=storage_options)
        point = point or s.points[0]
        n = min(int(rows), s.n_rows)
        x = s.read(point, 0, n)
        chunk_rows, src = s.chunk_rows, {"store": s.url, "point": point}
    raw = x.view(f"<u{x.dtype.itemsize}")
    bf16_bytes = x.shape[0] * x.shape[1] * 2
    res: dict[str, Any] = {"default": compression.DEFAULT["codec"], "baseline": BASELINE, **src, "rows": int(x.shape[0]),
           "width": int(x.shape[1]), "dtype": str(x.dtype), "chunk_rows": chunk_rows, "repeat": repeat,
           "codecs": measure(_chunks(raw, chunk_rows), bf16_bytes, repeat=repeat)}
    c = res["codecs"]
    res["encode_speedup_vs_baseline"] = round(c[BASELINE]["encode_core_s_per_gb"] /
                                              max(c[res["default"]]["encode_core_s_per_gb"], 1e-9), 2)
    if fp8:
        if x.dtype != BF16:
            raise SystemExit(f"--fp8 makes fp8 bytes from bf16 rows; this store holds {x.dtype}")
        q = fp8_bytes(x)
        res["float8_e4m3fn"] = {"scale": "per row, absmax / 448 (bytes only; scales not counted)",
                                "codecs": measure(_chunks(q, 2 * chunk_rows), bf16_bytes, repeat=repeat)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="store URL (local path or s3://...)")
    ap.add_argument("--point", help="which point's rows (default: the store's first)")
    ap.add_argument("--rows", type=int, default=8192, help="rows to measure (default 8192)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N timings (default 3)")
    ap.add_argument("--fp8", action="store_true", help="also measure fp8 e4m3 bytes made from the rows")
    ap.add_argument("--dry", action="store_true", help="synthetic rows, no store (a few seconds)")
    ap.add_argument("--json", action="store_true", help="print JSON only")
    a = ap.parse_args(argv)
    if not a.dry and not a.store:
        ap.error("give --store URL (a harvest store with committed rows) or --dry")
    res = run(a.store, a.point, a.rows, a.repeat, a.fp8, a.dry)
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"{res['rows']} rows x {res['width']} of {res.get('point')} ({res['dtype']}), chunks of "
          f"{res['chunk_rows']} rows, one core, best of {res['repeat']}; GB of bf16 input")
    for title, codecs in [("", res["codecs"])] + ([("float8_e4m3fn bytes: ", res["float8_e4m3fn"]["codecs"])]
                                                 if "float8_e4m3fn" in res else []):
        for name, r in codecs.items():
            mark = " (default)" if name == res["default"] and not title else ""
            extra = f"  {r['ratio_vs_bf16']:.3f}x vs bf16" if "ratio_vs_bf16" in r else ""
            print(f"  {title}{name:24s} {r['ratio']:.3f}x{extra}  encode {r['encode_core_s_per_gb']:.3f} "
                  f"core-s/GB  decode {r['decode_gb_s_per_core']:.2f} GB/s{mark}")
    print(f"default encode {res['encode_speedup_vs_baseline']}x faster than {res['baseline']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
