"""fp8 rows in torch, on the rows' own device, before they leave the engine.

`quantize_rows` is the torch twin of store/format/fp8.py's numpy quantiser (e4m3fn values with a
float32 scale `max|x| / 448` per row, packed as `width + 4` uint8 bytes; the rules are written
there), bit for bit: tests pin them together. On CUDA it runs on the main stream before the
device-to-host copy, so the copy, the host buffers, the codec and the upload all carry the packed
rows (about half of bf16); on CPU it runs at the same place.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
SCALE_BYTES = 4
QUANTIZED = ("float8_e4m3fn",)


def check_quantize(name: str | None) -> str | None:
    """`name` if the engine can quantise to it (None: rows as computed); names the fix."""
    if name is None or name in QUANTIZED:
        return name
    raise ValueError(f"quantize={name!r}: the engine quantises to {', '.join(QUANTIZED)} only "
                     "(or None for rows in the engine dtype)")


def packed_width(width: int) -> int:
    return width + SCALE_BYTES


def quantize_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `[..., width]` -> packed uint8 `[..., width + 4]` on x's device (into `out`)."""
    w = x.shape[-1]
    if out is None:
        out = torch.empty(*x.shape[:-1], w + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    div = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x32 / div).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out[..., :w].copy_(q.view(torch.uint8))
    out[..., w:].copy_(scale.contiguous().view(torch.uint8))
    return out


def quantize_points(buf: torch.Tensor, slots, n: int, out: torch.Tensor) -> torch.Tensor:
    """`out[i, :n] = quantize_rows(buf[slots[i], :n])`, one point at a time so the float32
    temporary is one point's rows, not all of them."""
    for i, s in enumerate(slots):
        quantize_rows(buf[s, :n], out[i, :n])
    return out


__all__ = ["QUANTIZED", "check_quantize", "packed_width", "quantize_rows", "quantize_points"]
