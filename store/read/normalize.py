"""Normalisation constants of exactly the rows a reader yields, and where they came from.

The contract: `norm_scale` gives E||x||^2 = width (and `standardize`, `center_norm_scale` their
targets) over the rows the reader yields, whatever its filters. Constants from any other rows
are wrong by as much as those rows differ: one BOS attention sink at layer 20 of SmolLM2 has
||x||^2 ~ 6e8 against a median of 6e4, so statistics over all rows scaled the kept rows to
E||x||^2 = 6.5 instead of 576; and constants of the rows from context position 2 on (the
store's `kept` class) applied to a reader that also yields position 1, where sinks sit in 1.5-2 %
of contexts, gave 732.9 there (400 contexts of Python's docs). Two sources:

- "store:kept": the statistics the writer records for the kept row class (special tokens and
  the first `stats_skip_positions` context positions left out), used exactly when the reader's
  filters select that class (`exclude_special=True` without `seqpos=` does, on a store that
  recorded them); exact, and free.
- "sample": a seeded sample of the reader's own filtered stream, read at start as SAELens does;
  chunk-sized blocks from random places so the sample spans many documents for the bytes it
  reads. Every rank and worker gets the constants the dataset computed when it was built (they
  travel with it), and a resumed run rebuilds the same sample from the same seed. The whole
  filtered stream when it has no more than `norm_sample_rows` rows, so then exact too.

A reader whose rows include the attention-sink positions is normalised over them like any other
row, and warned (dataset.py): those few huge rows then set the scale of all.

The norm-outlier filter's threshold (k x the median row norm per point) comes from the same
sample, so the constants describe the rows that survive it.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..format import fp8 as _fp8
from ..format.dtypes import BF16, FP8_NAME
from .filters import RowFilter, matches_recorded, recorded_stats_filter, store_facts
from ..commit.objects import read_point
from ..format.roles import captured_codes
from ..stats.moments import Moments
from .config import NORMALIZE_MODES
from ..format.jsonattrs import JsonObject

log = logging.getLogger(__name__)

MODES = NORMALIZE_MODES   # defined with the option (config.py), which must not import torch


@dataclass(frozen=True)
class NormConstants:
    """y = (x - shift) * scale, per point and dimension ([n_points, width] float32 tensors).

    source: "store:kept" or "sample" (or "given" when passed in, e.g. a train split's constants
    reused for its held-out split); rows: how many rows the statistics cover; mean_sq_norm:
    E||x||^2 of those rows before normalisation, per point.
    """

    mode: str
    points: tuple[str, ...]
    shift: torch.Tensor
    scale: torch.Tensor
    source: str
    rows: int
    mean_sq_norm: tuple[float, ...]

    def apply(self, x):
        """x: [..., n_points, width] or [..., width] with one point, or {point: [..., width_p]}
        (points of several widths: each at its own width)."""
        if isinstance(x, dict):
            return {p: self.apply_point(p, v) for p, v in x.items()}
        s, c = (self.shift, self.scale) if x.dim() >= 2 and x.shape[-2:] == self.shift.shape else \
            (self.shift[0], self.scale[0])
        return (x.float() - s.to(x.device)) * c.to(x.device)

    def apply_point(self, point: str, x: torch.Tensor) -> torch.Tensor:
        """x: [..., width_p] rows of `point` (its own width; constants past it are unused)."""
        i, w = self.points.index(point), x.shape[-1]
        return (x.float() - self.shift[i, :w].to(x.device)) * self.scale[i, :w].to(x.device)

    def invert(self, y: torch.Tensor) -> torch.Tensor:
        """Back to activation units (e.g. to report a reconstruction error in the model's space)."""
        s, c = (self.shift, self.scale) if y.dim() >= 2 and y.shape[-2:] == self.shift.shape else \
            (self.shift[0], self.scale[0])
        return y.float() / c.to(y.device) + s.to(y.device)

    def as_dict(self) -> JsonObject:
        return {"mode": self.mode, "points": list(self.points), "source": self.source, "rows": self.rows,
                "mean_sq_norm": list(self.mean_sq_norm), "shift": self.shift.tolist(),
                "scale": self.scale.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "NormConstants":
        """The constants `as_dict` recorded (a stream's state, a trainer's checkpoint)."""
        return cls(d["mode"], tuple(d["points"]), torch.tensor(d["shift"], dtype=torch.float32),
                   torch.tensor(d["scale"], dtype=torch.float32), d["source"], int(d["rows"]),
                   tuple(float(v) for v in d["mean_sq_norm"]))


def constants(mode: str, points, moments: list[Moments], width: int, source: str,
              eps: float = 1e-6) -> NormConstants:
    """`width` is unused: each point is normalised at its own width (len of its mean); with
    points of several widths `shift`/`scale` are [points, widest], shift 0 and scale 1 past a
    point's width."""
    shift, scale = [], []
    for p, m in zip(points, moments):
        width = int(np.asarray(m.mean).shape[0])
        if not m.count:
            raise ValueError(f"normalize={mode!r}: no rows of {p} pass the filters, so there is "
                             "nothing to take statistics from; loosen the filters")
        mean, var = np.asarray(m.mean), np.asarray(m.var)
        _check_spread(mode, p, m, var)
        if mode == "standardize":
            shift.append(mean)
            scale.append(1.0 / np.sqrt(var + eps))
        elif mode == "norm_scale":
            shift.append(np.zeros_like(mean))
            scale.append(np.full_like(mean, np.sqrt(width / m.mean_sq_norm)))
        elif mode == "center_norm_scale":
            shift.append(mean)
            scale.append(np.full_like(mean, np.sqrt(width / var.sum())))
        else:
            raise ValueError(f"normalize={mode!r}: use one of {MODES}")
    return NormConstants(mode, tuple(points), torch.from_numpy(_pad(shift, 0.0)),
                         torch.from_numpy(_pad(scale, 1.0)), source,
                         int(moments[0].count), tuple(float(m.mean_sq_norm) for m in moments))


def _pad(rows: list, fill: float) -> np.ndarray:
    """Per-point vectors -> float32 [points, widest], `fill` past a point's width."""
    out = np.full((len(rows), max(r.shape[0] for r in rows)), fill, np.float32)
    for i, r in enumerate(rows):
        out[i, :r.shape[0]] = r
    return out


def _check_spread(mode: str, point: str, m: Moments, var: np.ndarray) -> None:
    """A scale of width / 0 is no constant: say why the rows have no norm (or no spread)."""
    if mode == "norm_scale":
        spread, what = m.mean_sq_norm, "E||x||^2"
    elif mode == "center_norm_scale":
        spread, what = float(var.sum()), "the summed variance"
    else:
        return
    if not spread > 0 or not np.isfinite(spread):
        raise ValueError(
            f"normalize={mode!r}: {what} of the {m.count} rows of {point} read for the statistics "
            f"is {spread!r} (rows all zero or non-finite), so no scale brings it to the width; "
            "check the store with `harvest verify --deep`, or pass norm_constants= from "
            "statistics computed elsewhere")


# ---- row norms ----------------------------------------------------------------------------------
def sq_norms(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """||x||^2 per row of a [n, width] block of raw bits (or values) of `dtype`, in float64.

    bf16 bits shifted left by 16 are the float32 of the same value, exactly: no ml_dtypes cast,
    which numpy runs element by element.
    """
    if isinstance(dtype, str) and dtype == FP8_NAME:   # packed fp8 rows and their scales
        f = _fp8.dequantize(rows)
    elif dtype == BF16:
        f = (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        f = rows.view(dtype).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.einsum("ij,ij->i", f, f, dtype=np.float64)


# ---- store kept stats ---------------------------------------------------------------------------
def store_kept_moments(store, points, filt: RowFilter) -> list[Moments] | None:
    """The store's kept-row statistics when `filt` selects exactly that row class, else None
    (the held-out split aside: filters.matches_recorded)."""
    facts = store_facts(store)
    recorded = recorded_stats_filter(facts)
    if recorded is None:
        return None
    if not matches_recorded(filt, recorded, captured_codes(store)):
        return None
    try:
        st = store.stats(list(points), subset="kept")
    except TypeError:  # a Store without kept-row statistics (written before stores kept kept-row statistics)
        return None
    out = []
    for p in points:
        s = st.get(p) if st else None
        if not s or not s.get("count"):
            return None
        mean = np.asarray(s["mean"], np.float64)
        out.append(Moments(int(s["count"]), mean, np.asarray(s["var"], np.float64) * int(s["count"])))
    return out


# ---- sample of the filtered stream -----------------------------------------------------------
@dataclass
class Sample:
    rows: np.ndarray          # [n, n_points, width] raw bits of the store dtype, filters applied
    norm_limit: np.ndarray | None   # per point: max ||x||^2 kept (None: no norm filter)
    outlier_rows: int         # sample rows the norm filter dropped
    blocks: int               # blocks read
    # each point's stored columns when points of several widths share [n, points, widest]
    # (a narrower point's row is its first columns); None: every point fills the row
    cols: "list[int] | None" = None


def _blocks(pieces, chunk_rows: int):
    """Chunk-aligned row blocks covering the pieces: (piece index, a, b) per block."""
    starts = np.array([a for a, _ in pieces], np.int64)
    ends = np.array([b for _, b in pieces], np.int64)
    first = starts // chunk_rows
    last = -(-ends // chunk_rows)
    counts = last - first
    return first, counts, starts, ends


def read_sample(store, meta, points, pieces, sources, filt: RowFilter, n_rows: int, seed: int,
                max_norm_ratio: float | None, threads: int = 8) -> Sample:
    """Up to `n_rows` filtered rows from chunk-sized blocks at seeded random places.

    Blocks, not whole shards: one 32 MiB shard is a handful of documents, while the same bytes
    as 1 MiB blocks from 32 places span 32 times as many. Blocks are drawn without replacement
    until the filtered rows reach n_rows (all of a small store). `meta`: objects.CommittedMeta;
    `sources`: (marker facts, shard entry) per piece, as the reader's.

    The rows come through the reader's own checked read (objects.read_point), never plain zarr:
    a unit whose marker exists but whose objects are still under their attempt names (a writer
    killed between marker and publish, until finalize; every unit briefly during a live run)
    reads as zeros through zarr, which halved E||x||^2 without a word. A checked read takes the
    whole shard object (its CRC32C covers the object), so each block costs one shard of I/O;
    blocks of one draw that share a shard share its read.
    """
    chunk = store.chunk_rows
    first, counts, starts, ends = _blocks(pieces, chunk)
    total = int(counts.sum())
    rng = np.random.default_rng([seed, 0x5A3B1E])
    cum = np.concatenate([[0], np.cumsum(counts)])
    order = rng.permutation(total) if total <= (1 << 22) else None
    raw = np.dtype(f"u{store.np_dtype.itemsize}")
    dtype = value_dtype(store)
    meta_names = filt.meta_names()
    point_index = [store.points.index(p) for p in points]
    widths = [store.point_row_width(p) for p in points]   # each point's stored columns
    W = max(widths)
    cut = None if all(c == W for c in widths) else widths

    def span(block: int) -> tuple[int, int, int]:
        """(piece index, a, b): the rows of one block, inside one piece."""
        i = int(np.searchsorted(cum, block, side="right") - 1)
        c = first[i] + (block - cum[i])
        return i, max(int(c * chunk), int(starts[i])), min(int((c + 1) * chunk), int(ends[i]))

    def read_piece(group: tuple[int, list]) -> list[np.ndarray]:
        """The filtered rows of each block of one piece, [n, n_points, width] raw bits each."""
        i, spans = group
        s0 = pieces[i][0]
        masks = []
        for a, b in spans:
            cols = {n: meta.read(n, a, b) for n in meta_names}
            masks.append(filt.mask_of(a, b, cols))
        live = [m is None or bool(m.any()) for m in masks]
        out = [np.zeros((b - a if ok else 0, len(points), W), raw)
               for (a, b), ok in zip(spans, live)]
        if any(live):
            m, sh = sources[i]
            for j, pi in enumerate(point_index):  # one point at a time: one shard in memory
                x = read_point(store, m, sh, pi).view(raw)
                for k, (a, b) in enumerate(spans):
                    if live[k]:
                        out[k][:, j, :widths[j]] = x[a - s0:b - s0]
        return [x if mk is None or not ok else x[mk] for x, mk, ok in zip(out, masks, live)]

    def read_batch(ex, batch: list[int]) -> list[np.ndarray]:
        """Each block's rows in `batch` order (the sample stays a function of the seed)."""
        groups: dict[int, list] = {}
        for blk in batch:
            i, a, b = span(blk)
            groups.setdefault(i, []).append((blk, a, b))
        got = {}
        for (_i, blks), rows in zip(groups.items(), ex.map(
                read_piece, [(i, [(a, b) for _, a, b in v]) for i, v in groups.items()])):
            got.update({blk: x for (blk, _, _), x in zip(blks, rows)})
        return [got[blk] for blk in batch]

    parts, have, used = [], 0, 0
    drawn = set()
    with cf.ThreadPoolExecutor(threads, thread_name_prefix="harvest-sample") as ex:
        while have < n_rows and used < total:
            want = max(threads, int(np.ceil((n_rows - have) / chunk * 1.25)))
            if order is not None:
                batch = order[used:used + want].tolist()
            else:  # huge store: draw fresh block ids, never the same one twice
                batch = [int(v) for v in rng.choice(total, size=min(total, want * 2), replace=False)
                         if int(v) not in drawn][:want]
                drawn.update(batch)
            used += len(batch)
            for x in read_batch(ex, batch):
                if x.shape[0]:
                    parts.append(x)
                    have += x.shape[0]
    rows = np.concatenate(parts) if parts else np.empty((0, len(points), W), raw)
    if rows.shape[0] > n_rows:  # the last blocks overshoot: keep a random subset, not a prefix
        rows = rows[np.sort(rng.choice(rows.shape[0], n_rows, replace=False))]
    limit, dropped = None, 0
    if max_norm_ratio is not None and rows.shape[0]:
        sq = np.stack([sq_norms(rows[:, j, :widths[j]], dtype) for j in range(len(points))], axis=1)
        limit = (max_norm_ratio ** 2) * np.median(sq, axis=0)
        keep = (sq <= limit).all(axis=1)
        dropped = int((~keep).sum())
        rows = rows[keep]
    return Sample(rows, limit, dropped, used, cut)


def sample_moments(sample: Sample, dtype) -> list[Moments]:
    """Moments of each point's sampled rows (`dtype`: value_dtype of the store)."""
    def values(x):
        return _fp8.dequantize(x) if isinstance(dtype, str) and dtype == FP8_NAME else x.view(dtype)
    cols = sample.cols or [None] * sample.rows.shape[1]
    return [Moments.of(values(np.ascontiguousarray(sample.rows[:, j, :cols[j]])))
            for j in range(sample.rows.shape[1])]


def value_dtype(store):
    """What the stored rows' raw bits mean for sq_norms / sample_moments: the numpy dtype, or
    FP8_NAME for packed fp8 rows (values come from dequantising them)."""
    return FP8_NAME if store.quantized else store.np_dtype
