"""Which committed rows a reader reads, and in what order: pieces, kept-row counts, epoch plans.

The pieces (one per committed shard) are fixed when the dataset is built, so every worker and rank
agrees on them; how they are ordered and dealt out per epoch is sampling.py's, applied here to the
dataset's pieces and filter. dataset.py holds the dataset object, its I/O and per-process state.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ...commit.records import Marker
from ...errors import DataIntegrityError
from ..feed.readahead import WindowSpec
from .sampling import WorkerPlan, epoch_order, windows, worker_plan
from ...store import Store

if TYPE_CHECKING:
    from ...commit.objects import CommittedMeta
    from ..filters import RowFilter


def rank_world(rank, world_size) -> tuple[int, int]:
    """(rank, world_size): as given, else from torch.distributed, else RANK/WORLD_SIZE, else 0/1."""
    if rank is not None or world_size is not None:
        rank, world_size = int(rank or 0), int(world_size or 1)
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must satisfy 0 <= rank < world_size={world_size}")
    return rank, world_size


class Pieces:
    """The committed pieces (one per committed shard: its rows), sorted: a read-only sequence of
    (row_start, row_end) computed from per-unit arrays (row range, cumulative piece count). A list
    of tuples was ~110 B a piece, and 1 B tokens of an 8B model are 2 M pieces (512-row shards):
    220 MB of every reader process before it read a row, twice with the dict that found a piece's
    index; per-piece int64 arrays were still 80 B a piece at their peak (measured, bench_scale
    `shape`). A lookup is a bisect over the units (microseconds, per shard read)."""

    def __init__(self, lo, hi, shard_rows: int):
        self.shard_rows = R = int(shard_rows)
        self.lo = np.asarray(lo, np.int64)
        self.hi = np.asarray(hi, np.int64)
        self.first = self.lo // R                       # first shard of each unit
        self.cum = np.cumsum(-(-self.hi // R) - self.first)   # pieces up to and with each unit
        self._starts = None

    def __len__(self) -> int:
        return int(self.cum[-1]) if len(self.cum) else 0

    def unit_of(self, i: int) -> int:
        """Which unit (index into the sorted units) piece i belongs to."""
        return int(np.searchsorted(self.cum, i, side="right"))

    def __getitem__(self, i) -> tuple[int, int]:
        n = len(self)
        i = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= i < n:
            raise IndexError(f"piece {i} of {n}")
        u = self.unit_of(i)
        s = int(self.first[u]) + i - (int(self.cum[u - 1]) if u else 0)
        R = self.shard_rows
        return max(s * R, int(self.lo[u])), min((s + 1) * R, int(self.hi[u]))

    def __iter__(self):
        R = self.shard_rows
        for lo, hi in zip(self.lo.tolist(), self.hi.tolist()):
            for s in range(lo // R, -(-hi // R)):
                yield max(s * R, lo), min((s + 1) * R, hi)

    @property
    def starts(self) -> np.ndarray:
        """Every piece's first row (made when first asked: only metadata reads bisect it)."""
        if self._starts is None:
            self._starts = np.fromiter((a for a, _ in self), np.int64, len(self))
        return self._starts

    def total_rows(self) -> int:
        return int((self.hi - self.lo).sum())

    def max_rows(self, default: int = 1) -> int:
        if not len(self):
            return default
        R = self.shard_rows
        first_end = np.minimum((self.first + 1) * R, self.hi)
        last_start = np.maximum((-(-self.hi // R) - 1) * R, self.lo)
        longest = np.maximum(first_end - self.lo, self.hi - last_start)
        middle = (-(-self.hi // R) - self.first) > 2
        return int(max(longest.max(), R if middle.any() else 0))

    def index(self, piece: tuple[int, int]) -> int:
        a = int(piece[0])
        u = int(np.searchsorted(self.lo, a, side="right")) - 1
        if u >= 0 and a < self.hi[u]:
            i = (int(self.cum[u - 1]) if u else 0) + a // self.shard_rows - int(self.first[u])
            if self[i] == tuple(piece):
                return i
        raise ValueError(f"{piece} is not a committed piece")


class Sources:
    """Per piece: (its unit's marker facts, its shard index). Records come from the unit's table
    when the piece is read (objects.read_point takes a shard index), never at open: opening a
    1 B-token store would otherwise parse 3,815 tables of 512 shards (tables.py)."""

    def __init__(self, pieces: Pieces, lites: list):
        self._pieces, self._lites = pieces, lites

    def __len__(self) -> int:
        return len(self._pieces)

    def __getitem__(self, i) -> "tuple[Marker, int]":
        i = int(i) + len(self) if int(i) < 0 else int(i)
        return self._lites[self._pieces.unit_of(i)], self._pieces[i][0] // self._pieces.shard_rows


def committed_pieces(st: Store) -> tuple[Pieces, Sources]:
    """(pieces, sources): each committed shard's rows and (marker facts, shard index), sorted.
    From the markers' row ranges and `shard_rows` alone: no table is read here.

    Refuses a store whose facts disagree with themselves (n_rows edited, markers lost after
    finalize): reading it would yield wrong or fewer rows without a word."""
    lites = [m.lite() for m in sorted(st.ledger.committed_units().values(), key=lambda m: m.row_start)]
    pieces = Pieces([m.row_start for m in lites], [m.row_end for m in lites], st.shard_rows)
    for p in st.points:
        codec = st.shard_codec(p)
        if codec is not None and codec.n_rows != st.n_rows:
            raise DataIntegrityError(
                f"{st.url}: array {p} holds {codec.n_rows} rows but the store's attributes say "
                f"n_rows={st.n_rows} (zarr.json edited?); run `harvest verify`")
    if len(pieces) and pieces[-1][1] > st.n_rows:
        raise DataIntegrityError(f"{st.url}: committed rows reach {pieces[-1][1]} beyond n_rows="
                                 f"{st.n_rows} (attributes edited?); run `harvest verify`")
    bad = np.nonzero(pieces.lo[1:] < pieces.hi[:-1])[0]
    if len(bad):
        u = int(bad[0])
        raise DataIntegrityError(f"{st.url}: committed rows [{pieces.lo[u]}, {pieces.hi[u]}) and "
                                 f"[{pieces.lo[u + 1]}, ...) overlap (markers disagree with the "
                                 "plan); run `harvest verify`")
    final_rows = st.attributes.get("committed_rows") if st.summary is not None else None
    have = pieces.total_rows()
    if final_rows is not None and have != final_rows:
        raise DataIntegrityError(
            f"{st.url} was finalized with {final_rows} committed rows but its markers now cover "
            f"{have}: commit markers were lost or added; run `harvest verify`")
    return pieces, Sources(pieces, lites)


class PiecePlanning:
    """Counts and epoch plans over the dataset's pieces; a base of ActivationDataset.

    Uses the dataset's pieces, filter, _counts (-1: not counted yet), committed_meta(), io_threads, seed,
    shuffle, rank, world_size, window_shards and endless.
    """

    pieces: Pieces
    filter: RowFilter
    _counts: np.ndarray
    committed_meta: Callable[[], CommittedMeta]
    io_threads: int
    seed: int
    shuffle: bool | str     # True/"window", "global", or False
    rank: int
    world_size: int
    window_shards: int
    endless: bool

    def _count_piece(self, i: int) -> int:
        a, b = self.pieces[i]
        f = self.filter
        if not f.needs_meta:
            m = f.mask(a, b)
            return b - a if m is None else int(m.sum())
        cols = self.committed_meta()
        got = {n: cols.read(n, a, b) for n in f.meta_names()}
        return int(f.mask_of(a, b, got).sum())

    def _ensure_counts(self, which=None) -> np.ndarray:
        todo = [i for i in (range(len(self.pieces)) if which is None else which) if self._counts[i] < 0]
        if todo:
            if self.filter.needs_meta and len(todo) > 1:
                with cf.ThreadPoolExecutor(self.io_threads, thread_name_prefix="harvest-count") as ex:
                    got = list(ex.map(self._count_piece, todo))
            else:
                got = [self._count_piece(i) for i in todo]
            self._counts[todo] = got
        return self._counts

    def kept_counts(self) -> np.ndarray:
        """Kept rows of every piece (before the norm filter), counted once."""
        return self._ensure_counts()

    def window_specs(self, epoch: int, lane: int = 0, num_workers: int = 1):
        """The windows lane `lane` of `num_workers` reads from `epoch` on (mixing.describe)."""
        return self._specs(epoch, lane, max(1, num_workers))

    def count_rows(self) -> int:
        """Kept rows per epoch before the norm filter (reads token_id/doc_id once when the
        filters need them: 4-8 bytes a row, about 1 % of a 576-wide bf16 point)."""
        return int(self._ensure_counts().sum())

    def rows_per_worker(self, num_workers: int = 0) -> int:
        """Rows each global worker yields per epoch (all kept rows when there is one)."""
        G = self.world_size * max(1, num_workers)
        return self.count_rows() // G if G > 1 else self.count_rows()

    def plan(self, epoch: int, worker_id: int = 0, num_workers: int = 1) -> WorkerPlan:
        """The pieces and kept-row ranges global worker (rank, worker_id) reads in `epoch`."""
        nw = max(1, num_workers)
        G = self.world_size * nw
        order = epoch_order(len(self.pieces), self.seed, epoch, self.shuffle)
        counts = self._ensure_counts() if G > 1 else None
        return worker_plan(order, counts, self.rank, self.world_size, worker_id, nw, self.window_shards)

    def _specs(self, epoch0: int, wid: int, nw: int):
        e = epoch0
        while True:
            p = self.plan(e, wid, nw)
            wins = windows(p.takes, self.window_shards)
            if self.endless and not wins:
                raise ValueError(f"endless: worker {wid} of rank {self.rank} has no rows in epoch {e}; "
                                 "the filters keep too few rows for this many ranks x workers")
            for i, w in enumerate(wins):
                yield WindowSpec(e, i, w, i == len(wins) - 1, p.quota)
            if not self.endless:
                return
            e += 1

    def _preskip(self, specs, skip_rows: int):
        """Drop whole windows a resume has already yielded, reading only their metadata."""
        specs = iter(specs)
        for spec in specs:
            counts = self._ensure_counts([t.piece for t in spec.takes])
            n = sum(t.count(int(counts[t.piece])) for t in spec.takes)
            if n > skip_rows:
                def rest(first=spec):
                    yield first
                    yield from specs
                return rest(), skip_rows
            skip_rows -= n
        return iter(()), skip_rows
