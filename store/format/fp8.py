"""fp8 rows: float8_e4m3fn values with one float32 scale per row, in numpy (no torch).

A stored fp8 row of a `width`-wide point is `width + 4` bytes: the e4m3fn bit patterns of
`x / scale`, then the scale as a little-endian float32, where `scale = max|x| / 448` (448 is
e4m3fn's largest finite value). So the scale travels with its row through every buffer, block,
shard object, CRC and shuffle, with no second array to keep aligned and no extra object per shard.
zarr-python and tensorstore open the array as plain `uint8 [n_rows, width + 4]`.

The quantiser, bit for bit (engine/capture/quantize.py does the same in torch, before rows leave the
engine; tests pin the two together):
- in float32: `amax = max|x|` over the row (bf16 and fp16 widen exactly), `scale = amax / 448`;
- `y = x / scale` (a zero row divides by 1: all zeros, scale 0), clamped to [-448, 448]
  (saturating: rounding can put `amax / scale` a hair above 448), cast to e4m3fn rounding to
  nearest, ties to even;
- a row holding inf or NaN has a non-finite scale and dequantises to non-finite values: it stays
  a non-finite row (the statistics count those), never a silently finite one.

Dequantised: `x' = float32(q) * scale`. Relative error per row is at most ~3.2 % at p99 on real
hidden states (e4m3 keeps 3 mantissa bits); FORMAT.md gives a ten-line decoder.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import compression as _compression
from .dtypes import is_quantized

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0
SCALE_BYTES = 4

# The codec of fp8 point arrays when store.compression is not given: plain zstd level 1. Byte
# shuffle does nothing for 1-byte elements, and FIELD-NOTES measured fp8 + zstd-1 at 2.34x
# smaller than raw bf16 on SmolLM2's rows. One line to change when a better choice is measured.
DEFAULT_COMPRESSION = "zstd"
# logical fp8 bytes (width + 4 per row) / stored bytes for `harvest plan`: 2.34x vs raw bf16
# (FIELD-NOTES) is 2.34 x (width + 4) / (2 width) ~ 1.17x at any model width that matters
EXPECTED_RATIO = 1.17


def compression_for(spec, dtype: str):
    """The codec spec a store of `dtype` gets for the user's `spec` (None: the dtype's default)."""
    return DEFAULT_COMPRESSION if spec is None and is_quantized(dtype) else spec


def expected_ratio(spec, dtype: str) -> float:
    """Expected logical / stored bytes of a store of `dtype` with codec `spec`, for estimates."""
    if is_quantized(dtype) and _compression.normalize(compression_for(spec, dtype))["codec"] != "none":
        return EXPECTED_RATIO
    return _compression.expected_ratio(spec)


def quantize(x: np.ndarray) -> np.ndarray:
    """Rows `[..., width]` of any float dtype -> packed `uint8 [..., width + 4]` (module doc)."""
    x32 = np.asarray(x).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.max(np.abs(x32), axis=-1, keepdims=True)
        scale = (amax / np.float32(FP8_MAX)).astype(np.float32)
        div = np.where(scale > 0, scale, np.float32(1.0))
        y = np.clip(x32 / div, -FP8_MAX, FP8_MAX)
    out = np.empty(x32.shape[:-1] + (x32.shape[-1] + SCALE_BYTES,), np.uint8)
    out[..., :-SCALE_BYTES] = y.astype(FP8).view(np.uint8)
    out[..., -SCALE_BYTES:] = np.ascontiguousarray(scale.astype("<f4")).view(np.uint8)
    return out


def quantize_points(a: np.ndarray, widths, row_width: int) -> np.ndarray:
    """Float rows [P, n, max width] -> packed rows [P, n, max width + 4]: each point's row
    quantised over its own width (its scale from its own values), in its first columns."""
    if all(w == a.shape[2] for w in widths):
        return quantize(a)
    out = np.zeros((a.shape[0], a.shape[1], row_width), np.uint8)
    for p, w in enumerate(widths):
        out[p, :, :w + 4] = quantize(a[p, :, :w])
    return out


def split(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed rows `[..., width + 4]` -> (e4m3fn values `[..., width]`, float32 scales `[...]`)."""
    q = packed[..., :-SCALE_BYTES].view(FP8)
    scale = np.ascontiguousarray(packed[..., -SCALE_BYTES:]).view("<f4")[..., 0]
    return q, scale


def dequantize(packed: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Packed rows `[..., width + 4]` -> float32 `[..., width]` (`out` if given)."""
    q, scale = split(np.asarray(packed))
    if out is None:
        out = np.empty(q.shape, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        np.multiply(q.astype(np.float32), scale[..., None], out=out)
    return out


def relative_error(ref: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """Per row ||dequantize(packed) - ref|| / ||ref|| (0 where ref is a zero row)."""
    r = np.asarray(ref).astype(np.float32)
    d = dequantize(packed) - r
    n = np.linalg.norm(r, axis=-1)
    return np.where(n > 0, np.linalg.norm(d, axis=-1) / np.where(n > 0, n, 1), 0.0)


__all__ = ["FP8", "FP8_MAX", "SCALE_BYTES", "quantize", "split", "dequantize", "relative_error"]
