"""Raw rows of a reader's batch -> the tensors it yields (store/read/dataset.py's `_emit`).

`to_torch` views raw bits as the store dtype without a copy; `fp8_split` cuts packed fp8 rows
into values and scales; `emit_points` makes the batch of points of several widths: a dict
`{point: [batch, width_p]}`, each point cut to its own columns of the `[batch, points, widest]`
gather (FORMAT.md "Per-point widths") and normalised with its own constants. `emit_rows` is the
whole step, for the store's reader and for a stream of rows that never touched a store
(harvest.pipeline.stream): both yield the same tensors from the same raw rows.
"""

from __future__ import annotations

import numpy as np
import torch

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..format.dtypes import torch_view

if TYPE_CHECKING:
    from .normalize import NormConstants


def fp8_split(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed fp8 rows uint8 `[..., width + 4]` -> (float8_e4m3fn `[..., width]`, float32
    scales `[...]`), copies of the two parts (fp8.py has the layout)."""
    w = packed.shape[-1] - 4
    q = packed[..., :w].contiguous().view(torch.float8_e4m3fn)
    scale = packed[..., w:].contiguous().view(torch.float32)[..., 0]
    return q, scale


def to_torch(raw: np.ndarray, np_dtype: np.dtype) -> torch.Tensor:
    """Raw-bits array (see dtypes.raw_dtype) -> tensor of the store dtype, without a copy."""
    return torch_view(np.ascontiguousarray(raw), np_dtype)


def emit_points(x: np.ndarray, rows: np.ndarray, meta: dict, points, cols, store_dtype,
                quantized: bool, dequantize: bool, norm, out_dtype, return_meta: bool):
    """Points of several widths: `{point: [n, width_p]}` from `x` ([n, points, widest] raw bits),
    each cut to its stored columns `cols[j]` (an fp8 store's scale is the last 4 of them) and
    normalised with its own constants (`norm`: NormConstants or None). An fp8 store read with
    `dequantize=False` gives `(acts, scales)` dicts; `return_meta` the reader's meta dict."""
    acts, scales = {}, {}
    for j, p in enumerate(points):
        t = to_torch(np.ascontiguousarray(x[:, j, :cols[j]]), store_dtype)
        if quantized:
            t, s = fp8_split(t)
            if not dequantize:
                acts[p], scales[p] = t, s
                continue
            t = t.float() * s[..., None]
        if norm is not None:
            t = norm.apply_point(p, t)
        acts[p] = t.to(out_dtype)
    out = (acts, scales) if scales else acts
    if not return_meta:
        return out
    extra = {"scale": scales} if scales else {}
    return {"acts": acts, **extra, "row": torch.from_numpy(np.ascontiguousarray(rows)),
            **{m: torch.from_numpy(np.ascontiguousarray(v)) for m, v in meta.items()}}


@dataclass(frozen=True)
class RowForm:
    """What a batch of raw rows becomes (ReaderConfig's choices, with the store's facts): the
    points in order and each one's stored columns, the store dtype, fp8 and `dequantize`,
    normalisation constants (None: none), the output dtype, `return_meta`, and `stack` (False:
    one point given as a str, so `[batch, width]` instead of `[batch, 1, width]`)."""

    points: tuple
    cols: tuple
    store_dtype: np.dtype
    quantized: bool
    dequantize: bool
    norm: "NormConstants | None"
    out_dtype: "torch.dtype"
    return_meta: bool
    stack: bool

    @property
    def mixed(self) -> bool:
        return len(set(self.cols)) > 1


def emit_rows(x: np.ndarray, rows: np.ndarray, meta: dict, form: RowForm):
    """x is [n, n_points, row width] raw bits of the store dtype -> the batch a reader yields:
    a tensor, `(acts, scale)` for fp8 rows kept packed, a dict of points of several widths, or
    with return_meta a dict {acts, (scale,) row, token_id, doc_id, position, ...}."""
    if form.mixed:
        return emit_points(x, rows, meta, form.points, form.cols, form.store_dtype,
                           form.quantized, form.dequantize, form.norm, form.out_dtype,
                           form.return_meta)
    t = to_torch(x, form.store_dtype)
    scale = None
    if form.quantized:
        t, scale = fp8_split(t)
        if form.dequantize:
            t, scale = t.float() * scale[..., None], None
    if scale is not None:   # the stored form, for a GPU trainer (ReaderConfig.dequantize)
        if not form.stack:
            t, scale = t[:, 0, :], scale[:, 0]
        if not form.return_meta:
            return t, scale
        return {"acts": t, "scale": scale, "row": torch.from_numpy(np.ascontiguousarray(rows)),
                **{m: torch.from_numpy(np.ascontiguousarray(v)) for m, v in meta.items()}}
    if form.norm is not None:
        c = form.norm
        t = (t.float() - c.shift) * c.scale
    t = t.to(form.out_dtype)
    if not form.stack:
        t = t[:, 0, :]
    if not form.return_meta:
        return t
    return {"acts": t, "row": torch.from_numpy(np.ascontiguousarray(rows)),
            **{m: torch.from_numpy(np.ascontiguousarray(v)) for m, v in meta.items()}}
