"""Running per-point statistics: count, per-dimension mean and M2, merged exactly in float64.

SAE training normalises inputs by these; computing them afterwards would be a second full pass
over terabytes. Partials are (count, mean, M2) and are merged with Chan et al.'s pairwise update,
which stays accurate where the naive sum-of-squares form cancels catastrophically (activations
with a large mean and small spread). Merges always happen in a fixed order (shard index within a
region, unit id across regions) so the same data gives the same bits however uploads interleave.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

_BLOCK_ROWS = 2048  # float64 working set per block: rows x width x 8 bytes


@dataclass
class Moments:
    """count, mean[width], m2[width] for one point (float64), plus rows left out as non-finite.

    A row holding inf/NaN (fp16 overflow, a broken kernel) is counted in `nonfinite` and kept out of
    the moments: one such row would otherwise turn every mean and variance into NaN for good.
    """

    count: int
    mean: np.ndarray
    m2: np.ndarray
    nonfinite: int = 0

    @classmethod
    def empty(cls, width: int) -> "Moments":
        return cls(0, np.zeros(width, np.float64), np.zeros(width, np.float64))

    @classmethod
    def of(cls, rows: np.ndarray) -> "Moments":
        """Moments of a [n, width] block of any float dtype (bf16 widens to float64 exactly).

        Per block of rows: sums of deviations from the block's first row (the shifted-data
        algorithm: accurate while that row is near the mean, one pass, ~3x faster than
        mean-then-deviations), then Chan merges across blocks.
        """
        n, width = rows.shape
        out = cls.empty(width)
        for s in range(0, n, _BLOCK_ROWS):
            d = to_float64(rows[s:s + _BLOCK_ROWS])
            with np.errstate(invalid="ignore", over="ignore"):
                ok = np.isfinite(d.sum(axis=1))
            bad = int(d.shape[0] - ok.sum())
            if bad:
                d = d[ok]
                out.nonfinite += bad
            m = d.shape[0]
            if not m:
                continue
            k = d[0].copy()
            d -= k
            s1 = d.sum(axis=0)
            s2 = np.einsum("ij,ij->j", d, d)
            out = out.merge(cls(m, k + s1 / m, np.maximum(s2 - s1 * s1 / m, 0.0)))
        return out

    def merge(self, other: "Moments") -> "Moments":
        bad = self.nonfinite + other.nonfinite
        if other.count == 0:
            return Moments(self.count, self.mean, self.m2, bad)
        if self.count == 0:
            return Moments(other.count, other.mean.copy(), other.m2.copy(), bad)
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta * delta * (self.count * other.count / n)
        return Moments(n, mean, m2, bad)

    @property
    def var(self) -> np.ndarray:
        """Population variance per dimension."""
        return self.m2 / self.count if self.count else np.full_like(self.m2, np.nan)

    @property
    def mean_sq_norm(self) -> float:
        """E[||x||^2] = sum_j (var_j + mean_j^2)."""
        if not self.count:
            return float("nan")
        return float(np.sum(self.var + self.mean * self.mean))

    def summary(self) -> dict:
        return {"count": int(self.count), "nonfinite_rows": int(self.nonfinite),
                "mean_sq_norm": self.mean_sq_norm,
                "mean_norm": float(np.linalg.norm(self.mean)) if self.count else float("nan"),
                "mean_var": float(self.var.mean()) if self.count else float("nan")}


def crc32(x: np.ndarray) -> int:
    """CRC32 of an array's raw bytes (bf16 cannot export a buffer, so go through uint8)."""
    import zlib

    return zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


def to_float64(x: np.ndarray) -> np.ndarray:
    """Exact widening (every bf16/f16/f32 value is a float64 value); NaN payloads may change."""
    with np.errstate(invalid="ignore"):
        return x.astype(np.float64)


def merge_all(parts: list[list[Moments]], n_points: int, width: int) -> list[Moments]:
    """Merge per-point partials in the order given."""
    acc = [Moments.empty(width) for _ in range(n_points)]
    for part in parts:
        for p in range(n_points):
            acc[p] = acc[p].merge(part[p])
    return acc


def dumps(moments: list[Moments]) -> bytes:
    """npz bytes of a per-point partial (exact float64, unlike JSON text)."""
    buf = io.BytesIO()
    np.savez(buf, count=np.array([m.count for m in moments], np.int64),
             nonfinite=np.array([m.nonfinite for m in moments], np.int64),
             mean=np.stack([m.mean for m in moments]), m2=np.stack([m.m2 for m in moments]))
    return buf.getvalue()


def loads(data: bytes) -> list[Moments]:
    with np.load(io.BytesIO(data)) as z:
        count, mean, m2, bad = z["count"], z["mean"], z["m2"], z["nonfinite"]
    return [Moments(int(count[i]), mean[i].copy(), m2[i].copy(), int(bad[i])) for i in range(len(count))]
