"""Who reads which rows in an epoch: piece order, an equal split over ranks x workers, windows.

Pure functions of (pieces, kept-row counts, seed, epoch, rank, worker): every process computes
the same plan on its own, so nothing is exchanged between ranks or DataLoader workers, and a
resumed reader replays the plan and skips what was already yielded.

The epoch's row sequence is the committed pieces (shard-sized row ranges) in a seeded order,
each piece's kept rows in row order. With G = world_size x num_workers > 1 that sequence is cut
into G equal shares of floor(N / G) kept rows (N = kept rows in the epoch); the N mod G rows at
its end (fewer than G, different ones each epoch) are dropped, so every rank and worker yields
the same number of rows and batches and DDP never waits on a rank that ran out. Whole-shard
splits gave 232,960 vs 160,256 rows on 7 shards over 2 ranks x 2 workers.

Inside a rank, workers split rows in one of two ways:
- the rank's share fits in one shuffle window ("resident"): every worker reads all of the
  rank's pieces and keeps every num_workers-th kept row, so each worker's batches draw from
  every document of the share instead of from its own shards (1,248 -> 776 distinct documents
  per batch with 2 workers under a shard split). Reads cost num_workers x, on at most one
  window of data per worker;
- otherwise ("streaming"): contiguous equal parts; each worker fills a full window of its own,
  so a batch draws from as many shards as with one worker, and reads are not repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Take:
    """Kept rows j of piece `piece` (j-th kept row in row order) with lo <= j < hi and
    (j - phase) % stride == 0; hi None = to the end."""

    piece: int
    lo: int = 0
    hi: int | None = None
    phase: int = 0
    stride: int = 1

    def positions(self, n_kept: int) -> np.ndarray:
        hi = n_kept if self.hi is None else min(self.hi, n_kept)
        first = self.lo + (self.phase - self.lo) % self.stride
        return np.arange(first, max(first, hi), self.stride, dtype=np.int64)

    def count(self, n_kept: int) -> int:
        hi = n_kept if self.hi is None else min(self.hi, n_kept)
        first = self.lo + (self.phase - self.lo) % self.stride
        return max(0, -(-(hi - first) // self.stride))


@dataclass(frozen=True)
class WorkerPlan:
    takes: list[Take]
    quota: int | None     # kept rows this worker yields this epoch; None when G == 1 (all)
    resident: bool        # workers of the rank share every piece (see module doc)


def epoch_order(n_pieces: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n_pieces)
    return np.random.default_rng([seed, epoch]).permutation(n_pieces)


def worker_plan(order: np.ndarray, counts: np.ndarray | None, rank: int, world: int, wid: int, nw: int,
                per_window: int) -> WorkerPlan:
    """The takes of global worker (rank, wid) for an epoch whose pieces come in `order`.

    counts: kept rows per piece (indexed by piece), required when world * nw > 1.
    """
    G = world * nw
    if G == 1:
        return WorkerPlan([Take(int(i)) for i in order], None, True)
    if counts is None:
        raise ValueError("an equal split over ranks x workers needs the kept-row count of every piece")
    c = counts[order].astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(c)])
    q = int(cum[-1]) // G
    r0, r1 = rank * nw * q, (rank + 1) * nw * q
    first = int(np.searchsorted(cum, r0, side="right")) - 1
    last = int(np.searchsorted(cum, r1, side="left"))      # pieces [first, last) overlap [r0, r1)
    span = [k for k in range(max(first, 0), last) if c[k] and cum[k] < r1 and cum[k + 1] > r0]
    resident = len(span) <= per_window
    takes = []
    if resident:
        for k in span:
            s = int(cum[k])
            takes.append(Take(int(order[k]), max(r0 - s, 0), min(r1 - s, int(c[k])), (wid + r0 - s) % nw, nw))
    else:
        w0, w1 = r0 + wid * q, r0 + (wid + 1) * q
        for k in span:
            s, e = int(cum[k]), int(cum[k + 1])
            if s < w1 and e > w0:
                takes.append(Take(int(order[k]), max(w0 - s, 0), min(w1 - s, int(c[k]))))
    return WorkerPlan(takes, q, resident)


def windows(takes: list[Take], per_window: int) -> list[list[Take]]:
    """Consecutive groups of at most `per_window` pieces: what one shuffle window holds."""
    return [takes[i:i + per_window] for i in range(0, len(takes), per_window)]


def worker_share(batches: int, wid: int, nw: int) -> int:
    """Batches of a rank's first `batches` that worker `wid` produced.

    A DataLoader hands out an IterableDataset's batches round-robin over its workers, which is
    exact here because every worker yields the same number of batches (or an endless stream).
    """
    return batches // nw + (1 if wid < batches % nw else 0)
