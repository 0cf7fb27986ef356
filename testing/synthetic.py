"""Synthetic activations for tests and benchmarks: heavy-tailed bf16 like real residual streams.

Real hidden states have a few huge-magnitude dimensions and outlier rows (attention sinks);
Student-t noise with a per-dimension scale reproduces what matters to a store: compression ratio
(~1.27x with blosc zstd byte shuffle, as measured on real-like data) and wide exponent range.
"""

from __future__ import annotations

import numpy as np

from ..store.format.dtypes import BF16


def activations(shape: tuple[int, ...], seed: int = 0, dtype=BF16) -> np.ndarray:
    rng = np.random.default_rng(seed)
    width = shape[-1]
    scale = np.exp(rng.normal(0.0, 1.0, width)).astype(np.float32)
    x = rng.standard_t(3.0, size=shape).astype(np.float32) * scale
    x += rng.normal(0.0, 0.5, width).astype(np.float32)  # non-zero per-dim means
    return x.astype(dtype)


def special_bf16_rows(width: int) -> np.ndarray:
    """Rows of bit patterns a float round trip would destroy: NaN payloads, infs, -0, subnormals."""
    pats = np.array([0x7FC1, 0xFFC3, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F, 0x7F7F, 0x0080],
                    np.uint16)
    return np.resize(pats, (2, width)).view(BF16)


def fill(store, data: np.ndarray, *, units=None, order: str = "forward", chunk: int = 97,
         seed: int = 0, token_id=None, doc_id=None, position=None, role=None, commit: bool = True,
         **writer_kw):
    """Write `data` [n_points, n_rows, width] into `store` unit by unit; returns manifests.

    Row metadata (whole-store arrays, zeros where not given) is written by each unit's writer,
    as the pipeline's actors do. order: "forward" or "shuffled" (pieces of `chunk` rows in
    random order, like requests that finish out of order).
    """
    n = data.shape[1]
    cols = [np.zeros(n, np.int32) if token_id is None else np.asarray(token_id),
            np.zeros(n, np.int64) if doc_id is None else np.asarray(doc_id),
            np.zeros(n, np.int32) if position is None else np.asarray(position)]
    units = units if units is not None else store.ledger.plan()
    rng = np.random.default_rng(seed)
    out = []
    for u in units:
        a0, b0 = u["row_start"], u["row_end"]
        w = store.region_writer(u["unit_id"], a0, b0, **writer_kw)
        w.write_meta(a0, *(c[a0:b0] for c in cols), None if role is None else role[a0:b0])
        starts = list(range(a0, b0, chunk))
        if order == "shuffled":
            rng.shuffle(starts)
        for a in starts:
            b = min(a + chunk, b0)
            w.write(a, data[:, a:b])
        out.append(w.commit() if commit else w)
    return out
