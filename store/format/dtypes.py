"""The element types a store may hold, bfloat16 first.

zarr-python 3.1 has no bfloat16. Models run in bf16, and casting to float16 clips outliers
(attention-sink rows reach 1e4+) while float32 doubles the bytes, so we register a zarr v3 data type
named ``"bfloat16"`` -- the name zarrs and tensorstore use -- backed by ``ml_dtypes.bfloat16``.
Values pass through as raw 16-bit patterns, never through a float conversion, so the bits a model
produced are the bits a reader gets (NaN payloads included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import HasEndianness, HasItemSize
from zarr.core.dtype.npy.float import BaseFloat

try:
    from zarr.errors import DataTypeValidationError  # zarr >= 3.2 (older homes warn there)
except ImportError:
    from zarr.core.dtype.common import DataTypeValidationError  # zarr 3.1

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, kw_only=True)
class BFloat16(BaseFloat, HasEndianness, HasItemSize):
    """zarr v3 ``bfloat16`` (little-endian on disk, like every multi-byte type we write)."""

    dtype_cls = type(BF16)
    _zarr_v3_name: ClassVar[Literal["bfloat16"]] = "bfloat16"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_native_dtype(cls, dtype):
        # ml_dtypes reports byteorder "=" (native); on every platform we run on that is little.
        if isinstance(dtype, np.dtype) and dtype == BF16:
            return cls(endianness="little")
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected bfloat16")

    def to_native_dtype(self):
        if self.endianness != "little":
            raise ValueError("bfloat16 is stored little-endian only; got big-endian metadata")
        return BF16

    @classmethod
    def _check_json_v2(cls, data) -> bool:
        return False

    @property
    def item_size(self) -> int:
        return 2


data_type_registry.register(BFloat16._zarr_v3_name, BFloat16)

# The one quantised dtype: e4m3fn bytes with a float32 scale per row, held as uint8 rows of
# width + 4 bytes (fp8.py, FORMAT.md "fp8 stores").
FP8_NAME = "float8_e4m3fn"

# Names accepted by create_store(dtype=...) -> numpy dtype of the stored elements.
SUPPORTED_DTYPES: dict[str, np.dtype] = {
    "bfloat16": BF16,
    "float16": np.dtype("float16"),
    "float32": np.dtype("float32"),
    FP8_NAME: np.dtype("uint8"),
}


def resolve_dtype(name: str) -> np.dtype:
    """Refuse names we cannot keep bit-exact instead of guessing a conversion."""
    key = canonical_name(name)
    if key not in SUPPORTED_DTYPES:
        raise ValueError(
            f"dtype={name!r} is not supported: use one of {', '.join(SUPPORTED_DTYPES)}"
        )
    return SUPPORTED_DTYPES[key]


def canonical_name(name: str) -> str:
    """The name a store records for `name` (aliases: bf16, fp8, float8)."""
    key = str(name).lower().replace("torch.", "")
    return {"bf16": "bfloat16", "fp8": FP8_NAME, "float8": FP8_NAME, "fp8_e4m3": FP8_NAME}.get(key, key)


def is_quantized(name: str) -> bool:
    """Whether a store of dtype `name` holds quantised rows (fp8 bytes + a scale per row)."""
    return canonical_name(name) == FP8_NAME


def row_width(name: str, width: int) -> int:
    """Columns of a point array: the model width, plus 4 scale bytes per row for fp8."""
    return int(width) + 4 if is_quantized(name) else int(width)
def torch_dtype(np_dtype: np.dtype):
    """The torch dtype of rows held as `np_dtype` (the reader hands them out as it, the actor
    compares its engine's against it). torch is imported here, on call: the light install that
    reads stores without torch never calls it."""
    import torch

    return torch.bfloat16 if np.dtype(np_dtype) == BF16 else getattr(torch, np.dtype(np_dtype).name)


def torch_view(raw: np.ndarray, np_dtype: np.dtype):
    """A raw-bits array (raw_dtype: the writer's shard buffers, the reader's gathered rows) as a
    tensor of `np_dtype`'s torch dtype over the same memory, no copy: the reader hands rows out
    as it, the actor has the engine write into it. Through the signed integer of the same size,
    which torch reads from numpy for every width (not so uint16/uint32, nor bfloat16)."""
    import torch

    signed = np.dtype(f"i{np.dtype(np_dtype).itemsize}")
    return torch.from_numpy(raw.view(signed)).view(torch_dtype(np_dtype))


def zarr_dtype(np_dtype: np.dtype):
    """The ZDType instance to hand zarr, so bfloat16 never goes through numpy dtype inference."""
    if np_dtype == BF16:
        return BFloat16()
    return np_dtype


def raw_dtype(np_dtype: np.dtype) -> np.dtype:
    """Unsigned integer of the same size: the view every copy, stack and gather goes through.

    numpy moves ml_dtypes.bfloat16 arrays element by element through the dtype's copy hooks:
    measured here, np.stack and .copy() of bf16 ran 7x slower than the same bytes as uint16.
    """
    return np.dtype(f"u{np.dtype(np_dtype).itemsize}")


def dtype_name(np_dtype: np.dtype) -> str:
    return "bfloat16" if np_dtype == BF16 else np.dtype(np_dtype).name
