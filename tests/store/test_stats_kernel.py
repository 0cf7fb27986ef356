"""The writer's one-pass compiled statistics (store/stats/kernel.py) against a float64 numpy
reference, for every store dtype, with kept / excluded / absent rows, an attention-sink first row,
a large mean, and non-finite rows (which go to the numpy path and are counted apart).

The bound stated in kernel.py: mean and M2 within ~n * eps64 * (1 + (mean - K)^2 / var) of the
exact values; held here at rtol 1e-12 (mean) and 1e-10 (variance), the same tolerances the store's
round-trip tests hold the merged statistics to."""

from __future__ import annotations

import numpy as np
import pytest

from harvest.store.format import fp8
from harvest.store.format.dtypes import BF16
from harvest.store.stats import kernel
from harvest.store.stats.unit import chunk_moments
from harvest.testing import synthetic

pytestmark = pytest.mark.skipif(kernel.kernels() is None, reason="numba is not installed")


def _ref(x64: np.ndarray):
    return x64.shape[0], x64.mean(0), ((x64 - x64.mean(0)) ** 2).sum(0)


def _check(m, x64: np.ndarray, nonfinite: int = 0):
    n, mean, m2 = _ref(x64)
    assert m.count == n and m.nonfinite == nonfinite
    np.testing.assert_allclose(m.mean, mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m.m2 / n, m2 / n, rtol=1e-10, atol=1e-12)


def _rows(dtype, n=128, w=96, seed=0):
    x = synthetic.activations((1, n, w), seed=seed)[0].astype(np.float32)
    x[:, 0] += 1000.0   # a large mean: a naive sum of squares would cancel
    x[0] *= 100.0       # the first row (the kernel's shift) an attention sink
    if dtype == "float8_e4m3fn":
        packed = fp8.quantize(x)
        return packed, fp8.dequantize(packed).astype(np.float64)
    d = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    xs = x.astype(d)
    return xs, xs.astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
def test_one_pass_matches_float64_reference_with_classes(dtype):
    rows, x64 = _rows(dtype)
    q = dtype == "float8_e4m3fn"
    rng = np.random.default_rng(1)
    keep = rng.random(len(rows)) > 0.2
    present = rng.random(len(rows)) > 0.1
    got = kernel.chunk_subsets(rows, kernel.classes(len(rows), keep, present), q)
    assert got is not None
    all_, kept = got
    _check(all_, x64[present])
    _check(kept, x64[present & keep])
    # no masks: every row in both
    a2, k2 = kernel.chunk_subsets(rows, kernel.classes(len(rows), None, None), q)
    _check(a2, x64)
    assert np.array_equal(a2.mean, k2.mean) and a2.count == k2.count
    # the numpy path (what runs without numba) agrees within the same bound
    dec = fp8.dequantize if q else None
    np_all, np_kept = chunk_moments(rows[present], keep[present], None, dec) if not q else \
        _numpy(rows, keep, present)
    np.testing.assert_allclose(all_.mean, np_all.mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(kept.m2, np_kept.m2, rtol=1e-10, atol=1e-9)


def test_float16_takes_the_numpy_path():
    x = synthetic.activations((1, 64, 32), seed=4)[0].astype(np.float16)
    assert kernel.chunk_subsets(x, kernel.classes(64, None, None)) is None
    all_, _ = chunk_moments(x, None, None)
    _check(all_, x.astype(np.float64))


def _numpy(rows, keep, present):
    from harvest.store.stats.moments import subsets_of

    d = fp8.dequantize(rows)[present]
    return subsets_of(d, keep[present])


def test_non_finite_rows_take_the_numpy_path_and_are_counted_apart():
    rows, x64 = _rows("bfloat16")
    rows = rows.copy()
    rows[5, 3] = np.inf
    rows[9, 0] = np.nan
    assert kernel.chunk_subsets(rows, kernel.classes(len(rows), None, None)) is None
    all_, kept = chunk_moments(rows, None, None)
    ok = np.ones(len(rows), bool)
    ok[[5, 9]] = False
    _check(all_, x64[ok], nonfinite=2)
    # a non-finite row that holds no activations (absent) counts nowhere and costs nothing
    present = np.ones(len(rows), bool)
    present[[5, 9]] = False
    a2, _ = chunk_moments(rows, None, present)
    assert a2.nonfinite == 0
    _check(a2, x64[ok])


def test_empty_classes_and_bits_do_not_depend_on_thread():
    rows, x64 = _rows("bfloat16", n=64)
    keep = np.zeros(64, bool)       # nothing kept: kept is empty, all is every row
    all_, kept = kernel.chunk_subsets(rows, kernel.classes(64, keep, None))
    assert kept.count == 0 and all_.count == 64
    _check(all_, x64)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(4) as ex:   # nogil kernels in the codec threads: same bits
        outs = list(ex.map(lambda _: kernel.chunk_subsets(rows, kernel.classes(64, None, None)),
                           range(8)))
    assert all(np.array_equal(o[0].m2, outs[0][0].m2) for o in outs)


def test_fp8_every_byte_dequantises_as_the_reference_and_nan_bytes_fall_back():
    """All 254 finite e4m3fn bytes (subnormals, both zeros, +-448) in rows with different scales:
    the kernel's bit-level float32(q) * scale is fp8.dequantize's; a NaN byte (0x7F, 0xFF) under a
    finite scale is not read as a number: the numpy path counts its row apart."""
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    q = np.stack([np.roll(finite, i) for i in range(8)])           # [8, 254]
    scale = np.array([1.0, 0.5, 3.3e-3, 7.7, 1e-30, 2.5e3, 1.0, 0.125], "<f4")
    packed = np.concatenate([q, scale.view(np.uint8).reshape(8, 4)], axis=1)
    x64 = fp8.dequantize(packed).astype(np.float64)
    all_, _ = kernel.chunk_subsets(packed, kernel.classes(8, None, None), True)
    _check(all_, x64)
    bad = packed.copy()
    bad[3, 10] = 0x7F
    assert kernel.chunk_subsets(bad, kernel.classes(8, None, None), True) is None
    a2, _ = chunk_moments(bad, None, None, fp8.dequantize, True)
    ok = np.arange(8) != 3
    _check(a2, x64[ok], nonfinite=1)
