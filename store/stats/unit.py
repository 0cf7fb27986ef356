"""A unit's statistics, merged from its blocks' partials in block order (writer side).

Upload threads finish blocks in any order, but the same rows must give the same bits however they
complete (moments.py merges in a fixed order), so a block's partials wait here until every block
before it is merged, then merge and go. Held: O(points x width) plus the blocks that completed out
of order. Without the running merge a unit held every block's float64 partials until commit:
4 MiB a block at 32 points x 4096 wide.

Not thread-safe: ShardUploads calls it under its lock.
"""

from __future__ import annotations

from typing import Iterable

from ..format import layout
from .kernel import chunk_subsets, classes
from .moments import Moments, merge_all, subsets_of


class BlockStats:
    def __init__(self, block_ids: Iterable[int], widths: "list[int]"):
        """`widths`: each point's width, in the store's point order."""
        self._ids = list(block_ids)
        self._P = n_points = len(widths)
        self._parts: dict[int, dict] = {}   # block -> {"all"|"kept": per point Moments or None}
        self._acc = {s: [Moments.empty(widths[p]) for p in range(n_points)] for s in layout.STATS_SUBSETS}
        self._next = 0   # index in the block ids of the next block to merge into _acc

    def add(self, block: int, p: int, moments_all: Moments, moments_kept: Moments) -> None:
        """Point `p`'s partials of `block`; merges every block now complete and next in order."""
        part = self._parts.setdefault(block, {"all": [None] * self._P, "kept": [None] * self._P})
        part["all"][p], part["kept"][p] = moments_all, moments_kept
        self._merge_ready()

    def merged(self) -> "dict[str, list[Moments]]":
        """subset -> per-point Moments of the whole unit: the running merge, then any partials
        left behind a gap, in block order (the same bits whatever order blocks completed in)."""
        self._merge_ready()
        for b in sorted(self._parts):
            self._merge(self._parts.pop(b))
        return {s: list(acc) for s, acc in self._acc.items()}

    def clear(self) -> None:
        """Drop everything (a committed or failed writer must not keep a unit's memory)."""
        self._parts.clear()
        self._acc = {}

    def _merge_ready(self) -> None:
        while self._next < len(self._ids):
            part = self._parts.get(self._ids[self._next])
            if part is None or any(m is None for m in part["all"]):
                return
            self._merge(self._parts.pop(self._ids[self._next]))
            self._next += 1

    def _merge(self, part: dict) -> None:
        for subset, acc in self._acc.items():
            for p in range(self._P):
                acc[p] = acc[p].merge(part[subset][p])


def chunk_partials(keep, present, chunk_rows: int, n_chunks: int, decode=None,
                   quantized: bool = False):
    """(visit, result) for ShardCodec.encode_block: `visit(i, rows)` takes inner chunk i's
    partials in the codec thread while the chunk is in cache, and `result(width)` merges them in
    chunk order into the block's (all, kept) Moments. `keep`: rows of the `kept` class (None: all);
    `present`: rows holding activations (None: all), the others count in no statistic;
    `decode(rows)`: the values the statistics are of (fp8 stores: the dequantised rows), for the
    numpy path; `quantized`: the rows are packed fp8 (the compiled path dequantises as it goes)."""
    parts: list = [None] * n_chunks

    def visit(i: int, rows) -> None:
        parts[i] = chunk_moments(rows, _rows_of(keep, i, chunk_rows, rows.shape[0]),
                                 _rows_of(present, i, chunk_rows, rows.shape[0]), decode, quantized)

    def result(width: int) -> tuple[Moments, Moments]:
        return (merge_all([[q[0]] for q in parts], 1, width)[0],
                merge_all([[q[1]] for q in parts], 1, width)[0])

    return visit, result


def _rows_of(mask, i: int, chunk_rows: int, n: int):
    return None if mask is None else mask[i * chunk_rows:i * chunk_rows + n]


def chunk_moments(rows, keep, present, decode=None, quantized: bool = False) -> tuple[Moments, Moments]:
    """(all, kept) Moments of one inner chunk: the compiled one-pass kernel (kernel.py) where it
    applies, else numpy (moments.subsets_of on the decoded rows)."""
    got = chunk_subsets(rows, classes(rows.shape[0], keep, present), quantized)
    if got is not None:
        return got
    if decode is not None:
        rows = decode(rows)
    if present is not None:
        rows, keep = rows[present], (None if keep is None else keep[present])
    return subsets_of(rows, keep)
