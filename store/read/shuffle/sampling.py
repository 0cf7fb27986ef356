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

Inside a rank, workers take contiguous equal parts of the rank's share, so each worker decodes
only its part (the shard at each boundary is read by both neighbours). An earlier "resident" mode
(every worker read all of a share that fit one window and kept every num_workers-th row) mixed
more documents per batch but made every worker decode everything: 2 workers ran at 0.5x the
no-worker rate. A worker's batches draw from its own part only; the reader warns when
a window holds too few documents (mixing.py).

Batches a rank's DataLoader hands out round-robin are numbered globally; lane l of nw produces
those with index = l mod nw (see `lane`). Rows are split over lanes, not over worker ids, so a
resume can give any worker any lane.
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


def epoch_order(n_pieces: int, seed: int, epoch: int, shuffle: bool | str) -> np.ndarray:
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
        return WorkerPlan([Take(int(i)) for i in order], None)
    if counts is None:
        raise ValueError("an equal split over ranks x workers needs the kept-row count of every piece")
    c = counts[order].astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(c)])
    q = int(cum[-1]) // G
    w0 = (rank * nw + wid) * q      # this worker's kept rows are [w0, w0 + q) of the epoch
    w1 = w0 + q
    first = max(int(np.searchsorted(cum, w0, side="right")) - 1, 0)
    last = int(np.searchsorted(cum, w1, side="left"))      # pieces [first, last) overlap [w0, w1)
    takes = []
    for k in range(first, last):
        s, e = int(cum[k]), int(cum[k + 1])
        if c[k] and s < w1 and e > w0:
            takes.append(Take(int(order[k]), max(w0 - s, 0), min(w1 - s, int(c[k]))))
    return WorkerPlan(takes, q)


def windows(takes: list[Take], per_window: int) -> list[list[Take]]:
    """Consecutive groups of at most `per_window` pieces: what one shuffle window holds."""
    return [takes[i:i + per_window] for i in range(0, len(takes), per_window)]


def worker_share(batches: int, lane: int, nw: int) -> int:
    """Batches of a rank's first `batches` that lane `lane` produced (indices = lane mod nw)."""
    return batches // nw + (1 if lane < batches % nw else 0)


def lane(worker_id: int, resume: int, nw: int) -> int:
    """The lane DataLoader worker `worker_id` produces after a resume at global batch `resume`.

    A DataLoader deals an IterableDataset's batches round-robin and restarts at worker 0 with
    every new iterator; the first batch it asks for is global batch `resume`, so worker k must
    produce global batches resume + k, resume + k + nw, ...: lane (k + resume) mod nw. Each lane
    yields the same number of batches per epoch (or runs on endlessly), and after a resume the
    lanes' remaining counts fall with the worker id, so the round-robin (which skips exhausted
    workers) delivers global batch order exactly. Before lanes, worker k resumed its own stream
    and an odd resume point swapped every pair of batches.
    """
    return (worker_id + resume) % nw
