"""Batches from decoded windows: one gather per batch, exact counts, resume skips and step limits.

A full batch is one `np.take` straight out of a window's arena along its permutation. A batch
that spans two windows (or, in endless mode, two epochs) is assembled in a side buffer and its
two runs interleaved, because the older window's arena is handed to the decoder as soon as the
next window is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Tally:
    """What the norm filter did in one iteration of this process (see ActivationDataset)."""

    dropped: int = 0
    padded: int = 0


def batches(readies, k: int, shape: tuple[int, int], raw: np.dtype, emit, *, skip: int = 0,
            limit: int | None = None, drop_last: bool = False, shuffle: bool = True, seed: int = 0,
            tally: Tally | None = None):
    """Yield emit(rows [n, P, W] raw bits, store rows, meta) for consecutive `k`-row batches.

    skip: rows of the stream already yielded before a resume; limit: batches to yield at most.
    """
    P, W = shape
    produced = 0
    part = None     # [out, rows, meta, filled, windows spanned]
    if limit is not None and limit <= 0:
        return
    for rd in readies:
        if tally is not None:
            tally.dropped += rd.dropped
            tally.padded += rd.padded
        src = rd.arena.reshape(rd.arena.shape[0], P * W)  # 2-D: numpy's take is ~25 % faster
        n, i = rd.idx.shape[0], 0
        if skip:
            i = min(skip, n)
            skip -= i
        while i < n:
            if part is None and n - i >= k:
                out = np.empty((k, P, W), raw)
                np.take(src, rd.idx[i:i + k], axis=0, out=out.reshape(k, P * W))
                yield emit(out, rd.rows[i:i + k], {m: v[i:i + k] for m, v in rd.meta.items()})
                i += k
            else:
                if part is None:
                    part = [np.empty((k, P, W), raw), np.empty(k, np.int64),
                            {m: np.empty(k, np.int64) for m in rd.meta}, 0, 0]
                out, prow, pmeta, f, _ = part
                c = min(k - f, n - i)
                np.take(src, rd.idx[i:i + c], axis=0, out=out[f:f + c].reshape(c, P * W))
                prow[f:f + c] = rd.rows[i:i + c]
                for m, v in rd.meta.items():
                    pmeta[m][f:f + c] = v[i:i + c]
                part[3] += c
                part[4] += 1
                i += c
                if part[3] < k:
                    continue
                yield _emit_part(part, emit, shuffle, seed)
                part = None
            produced += 1
            if limit is not None and produced >= limit:
                return
    if part is not None and not drop_last:
        yield _emit_part(part, emit, shuffle, seed)


def _emit_part(part, emit, shuffle: bool, seed: int):
    out, rows, meta, f, spans = part
    out, rows, meta = out[:f], rows[:f], {m: v[:f] for m, v in meta.items()}
    if shuffle and spans > 1:  # two windows' rows came in two runs: interleave them
        perm = np.random.default_rng([seed, int(rows[0]), f]).permutation(f)
        out, rows, meta = np.take(out, perm, axis=0), rows[perm], {m: v[perm] for m, v in meta.items()}
    return emit(out, rows, meta)
