"""The compiled kernels of kernel.py (numba): module-level functions, so numba's on-disk cache
(`cache=True`, __pycache__) serves every later process; closures made at run time recompiled in
each one, seconds of a capture actor's CPU. Imported only by kernel.py, which falls back to numpy
where numba is missing. Each adds a run of rows of one class into that class's shifted float64
sums (kernel.py has the numerics)."""

from __future__ import annotations

import numba
import numpy as np

_OPTS = {"nogil": True, "cache": True, "boundscheck": False}
R = 4   # rows added per sweep of the float64 sums: a quarter of their cache traffic


@numba.njit(**_OPTS)
def run_of(cls, i, n):
    """(class, rows) of the run of up to R rows of one class that starts at row i."""
    k = cls[i]
    m = 1
    while m < R and i + m < n and cls[i + m] == k:
        m += 1
    return k, m


@numba.njit(**_OPTS)
def add(fr, m, k, K, s1, s2, cnt):
    """Rows fr[:m] (float32 or float64 values) into class k's shifted sums."""
    w = K.shape[1]
    kk = K[k]
    if cnt[k] == 0:
        for j in range(w):
            kk[j] = fr[0, j]
    cnt[k] += m
    a = s1[k]
    b = s2[k]
    if m == R:
        f0, f1, f2, f3 = fr[0], fr[1], fr[2], fr[3]
        for j in range(w):
            kj = kk[j]
            d0 = f0[j] - kj
            d1 = f1[j] - kj
            d2 = f2[j] - kj
            d3 = f3[j] - kj
            a[j] += (d0 + d1) + (d2 + d3)
            b[j] += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3)
    else:
        for r in range(m):
            fr_r = fr[r]
            for j in range(w):
                d = fr_r[j] - kk[j]
                a[j] += d
                b[j] += d * d


@numba.njit(**_OPTS)
def bits16(u16, cls, K, s1, s2, cnt):  # bf16: the bits shifted up are the float32 value
    n, w = u16.shape
    rows = np.empty((R, w), np.uint32)
    fr = rows.view(np.float32)
    i = 0
    while i < n:
        k, m = run_of(cls, i, n)
        if k >= 0:
            for r in range(m):
                for j in range(w):
                    rows[r, j] = np.uint32(u16[i + r, j]) << np.uint32(16)
            add(fr, m, k, K, s1, s2, cnt)
        i += m


@numba.njit(**_OPTS)
def floats(x, cls, K, s1, s2, cnt):  # float32 / float64 rows, as they are
    n = x.shape[0]
    i = 0
    while i < n:
        k, m = run_of(cls, i, n)
        if k >= 0:
            add(x[i:i + m], m, k, K, s1, s2, cnt)
        i += m


@numba.njit(**_OPTS)
def fp8(q, scale, cls, K, s1, s2, cnt):
    """Packed fp8 rows (q: uint8 [n, width + 4], the scales apart), dequantised as fp8.dequantize does: float32(q) * scale. float32(q)
    from the bits, vectorised: e4m3fn's exponent and mantissa moved to float32's places
    read as 2^-120 times the value, subnormals included, so one exact multiply by 2^120
    rebiases. e4m3fn's NaN (0x7F, 0xFF) becomes a float32 NaN, which makes the sums NaN."""
    n = q.shape[0]
    w = K.shape[1]
    rows = np.empty((R, w), np.uint32)
    fr = rows.view(np.float32)
    rebias = np.float32(2.0 ** 120)
    i = 0
    while i < n:
        k, m = run_of(cls, i, n)
        if k >= 0:
            for r in range(m):
                for j in range(w):
                    b = np.uint32(q[i + r, j])
                    mag = b & np.uint32(0x7F)
                    # mag 0x7F (NaN): (mag + 1) >> 7 is 1 and sets float32's exponent to all
                    # ones, a NaN; below it adds nothing. Branch-free, so the loop vectorises
                    rows[r, j] = ((b & np.uint32(0x80)) << np.uint32(24)) | (mag << np.uint32(20)) \
                        | (((mag + np.uint32(1)) >> np.uint32(7)) * np.uint32(0x7F800000))
                sc = scale[i + r]
                for j in range(w):
                    fr[r, j] = (fr[r, j] * rebias) * sc
            add(fr, m, k, K, s1, s2, cnt)
        i += m


__all__ = ["bits16", "floats", "fp8"]
