"""The writer's per-chunk statistics in one compiled pass (numba), float64 throughout.

Why: at an 8B model's shape the numpy path (moments.Moments.of: widen each block to float64, sum,
subtract the mean, square and sum again: five passes over 4-byte-per-number copies of 2-byte data)
cost 1.1-1.6 core-seconds per GB of bf16 rows, more than the codec. Here each row is read once,
widened in registers and added into float64 sums of its class (kept / excluded / absent), one
pass (rows added four at a time), no temporaries: 0.16-0.24 core-s/GB of bf16 alone on one core,
0.35-0.40 in the write path beside the codec threads (benchmarks/results/RESULTS.md).

Numerics (the shifted-data algorithm): per class, `K` is the class's first row in the chunk and
the sums are S1 = sum(x - K), S2 = sum((x - K)^2) in float64; then mean = K + S1/n and
M2 = S2 - S1^2/n. Every bf16, fp16, fp32 and dequantised fp8 value is exact in float64, and so is
each difference x - K, so the only rounding is in the float64 sums: the relative error of M2 is
about n * eps64 * (1 + (mean - K)^2 / var), under 1e-11 for a 128-row chunk even when the first row
is an attention sink 100 standard deviations out. Tests hold it to the float64 numpy reference
(tests/store/test_stats_kernel.py). The chunks' partials merge exactly as before (Chan, in chunk
order), so the same rows give the same bits.

A chunk holding inf/NaN in a counted row makes its sums non-finite; such chunks (rare: a broken
kernel, an fp16 overflow) go to the numpy path, which counts those rows apart. Without numba
(the light `harvest-store` package, which reads and seldom writes) everything takes the numpy
path: same results within the bound above, not the same bits.
"""

from __future__ import annotations

import threading

import numpy as np

from ..format.dtypes import BF16
from .moments import Moments
from collections.abc import Callable

_lock = threading.Lock()
_kernels: "dict | None" = None   # {"bits16": fn, "float": fn, "fp8": fn} (jitted.py), on first use
_NO_NUMBA = {}


def kernels() -> "dict[str, Callable] | None":
    """The compiled kernels, or None where numba is not installed (numpy path)."""
    global _kernels
    with _lock:
        if _kernels is None:
            try:
                from . import jitted

                _kernels = {"bits16": jitted.bits16, "float": jitted.floats, "fp8": jitted.fp8}
            except ImportError:
                _kernels = _NO_NUMBA
        return _kernels or None


def classes(n: int, keep: "np.ndarray | None", present: "np.ndarray | None") -> np.ndarray:
    """Per row: 1 kept, 0 counted in `all` only, -1 holding no activations (in no statistic)."""
    c = np.ones(n, np.int8) if keep is None else keep.astype(np.int8)
    if present is not None:
        c[~present] = -1
    return c


def chunk_subsets(rows: np.ndarray, cls: np.ndarray, quantized: bool = False
                  ) -> "tuple[Moments, Moments] | None":
    """(all, kept) Moments of a chunk's rows by class (see `classes`), in one pass; None where
    this path does not apply (no numba, a dtype it does not know, a non-finite sum): the caller
    takes the numpy path. `rows`: the chunk in the store dtype (bf16/fp16/fp32), or packed fp8
    rows (uint8 [n, width + 4]) when `quantized`; statistics of fp8 are of the dequantised values
    (float32(q) * scale, exactly fp8.dequantize's)."""
    ks = kernels()
    if ks is None or rows.ndim != 2:
        return None
    args: tuple
    if quantized:
        from ..format.fp8 import SCALE_BYTES

        w = rows.shape[1] - SCALE_BYTES
        scale = np.ascontiguousarray(rows[:, w:]).view("<f4")[:, 0].astype(np.float32)
        # the packed rows whole (C-contiguous: the kernel vectorises; a [:, :w] view would not)
        fn, args = ks["fp8"], (np.ascontiguousarray(rows), scale)
    else:
        w = rows.shape[1]
        if rows.dtype == BF16:
            fn, args = ks["bits16"], (rows.view(np.uint16),)
        elif rows.dtype in (np.float32, np.float64):  # numba has no float16: numpy path
            fn, args = ks["float"], (rows,)
        else:
            return None
    K = np.zeros((2, w))
    s1 = np.zeros((2, w))
    s2 = np.zeros((2, w))
    cnt = np.zeros(2, np.int64)
    fn(*args, cls, K, s1, s2, cnt)
    if not (np.isfinite(s1).all() and np.isfinite(s2).all()):
        return None
    out = []
    for k in (1, 0):
        n = int(cnt[k])
        if not n:
            out.append(Moments.empty(w))
            continue
        mean = K[k] + s1[k] / n
        m2 = np.maximum(s2[k] - s1[k] * s1[k] / n, 0.0)
        out.append(Moments(n, mean, m2))
    kept, excluded = out
    return kept.merge(excluded), kept


__all__ = ["chunk_subsets", "classes", "kernels"]
