"""Values of their own type in the engine dtype's rows: float32 and int32 numbers (logprob,
entropy, expert_weights, expert_indices; engine/points.py `PACKED`) travel bit for bit through the
tap buffer and every transport (the buffer, the CPU taps' direct sink, the TP step ring), each
32-bit value in `slot_width(dtype)` elements of the engine dtype (two bfloat16 columns).

`pack` views `[..., m]` 32-bit values as `[..., m * slot_width]` of the engine dtype; `unpack`
views the rows back as `[n, m]` float32 or int32. A view never changes a bit, so an int32 whose
halves read as a bfloat16 NaN pattern comes back unchanged (nothing on the way computes with
them: fp8 quantisation, which would, is refused for these points).
"""

from __future__ import annotations

import torch

TYPES = {"float32": torch.float32, "int32": torch.int32}


def slot_width(dtype: torch.dtype) -> int:
    """Elements of `dtype` that hold one 32-bit value (1 for float32, 2 for bfloat16/float16)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size > 4 or 4 % size:
        raise ValueError(f"32-bit values (logprob, entropy, expert routing) cannot travel in a "
                         f"{dtype} tap buffer")
    return 4 // size


def pack(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 or int32 `[n]` / `[n, m]` -> `[n, m * slot_width(dtype)]` of `dtype`, the same
    bits (`[n]` is one value per row)."""
    if values.dtype not in (torch.float32, torch.int32):
        values = values.to(torch.float32)
    v = values.contiguous()
    v = v.reshape(v.shape[0], -1) if v.dim() != 1 else v.reshape(-1, 1)
    return v if v.dtype == dtype else v.view(dtype)


def unpack(rows: torch.Tensor, values: str = "float32") -> torch.Tensor:
    """`[n, m * slot_width]` of the engine dtype (as `pack` wrote them) -> `[n, m]` of `values`
    ("float32" or "int32")."""
    rows = rows.contiguous()
    want = TYPES[values]
    return rows if rows.dtype == want else rows.view(want)
