"""Which committed rows a reader reads, and in what order: pieces, kept-row counts, epoch plans.

The pieces (one per committed shard) are fixed when the dataset is built, so every worker and rank
agrees on them; how they are ordered and dealt out per epoch is sampling.py's, applied here to the
dataset's pieces and filter. reader.py holds the dataset object, its I/O and per-process state.
"""

from __future__ import annotations

import concurrent.futures as cf
import os

import numpy as np
import torch

from .errors import DataIntegrityError
from .readahead import WindowSpec
from .sampling import WorkerPlan, epoch_order, windows, worker_plan
from .store import Store


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


def committed_pieces(st: Store) -> tuple[list, list]:
    """(pieces, sources): each committed shard's rows and (marker facts, shard entry), sorted.

    Refuses a store whose facts disagree with themselves (n_rows edited, markers lost after
    finalize): reading it would yield wrong or fewer rows without a word."""
    src = []
    for m in st.committed_units().values():
        lite = {k: m.get(k) for k in ("unit_id", "row_start", "row_end", "attempt", "row_meta")}
        for sh in m["shards"]:
            src.append(((sh["row_start"], sh["row_end"]), (lite, sh)))
    src.sort(key=lambda t: t[0])
    pieces = [pc for pc, _ in src]
    for p in st.points:
        codec = st.shard_codec(p)
        if codec is not None and codec.n_rows != st.n_rows:
            raise DataIntegrityError(
                f"{st.url}: array {p} holds {codec.n_rows} rows but the store's attributes say "
                f"n_rows={st.n_rows} (zarr.json edited?); run `harvest verify`")
    if pieces and pieces[-1][1] > st.n_rows:
        raise DataIntegrityError(f"{st.url}: committed rows reach {pieces[-1][1]} beyond n_rows="
                                 f"{st.n_rows} (attributes edited?); run `harvest verify`")
    for (a0, b0), (a1, _) in zip(pieces, pieces[1:]):
        if a1 < b0:
            raise DataIntegrityError(f"{st.url}: committed rows [{a0}, {b0}) and [{a1}, ...) overlap "
                                     "(markers disagree with the plan); run `harvest verify`")
    final_rows = st._meta["attributes"].get("committed_rows") if st.summary is not None else None
    have = sum(b - a for a, b in pieces)
    if final_rows is not None and have != final_rows:
        raise DataIntegrityError(
            f"{st.url} was finalized with {final_rows} committed rows but its markers now cover "
            f"{have}: commit markers were lost or added; run `harvest verify`")
    return pieces, [s for _, s in src]


class PiecePlanning:
    """Counts and epoch plans over the dataset's pieces; a base of ActivationDataset.

    Uses the dataset's pieces, filter, _counts (-1: not counted yet), _meta(), io_threads, seed,
    shuffle, rank, world_size, window_shards and endless.
    """

    def _count_piece(self, i: int) -> int:
        a, b = self.pieces[i]
        f = self.filter
        if not f.needs_meta:
            m = f.mask(a, b)
            return b - a if m is None else int(m.sum())
        cols = self._meta()
        got = {n: cols.read(n, a, b) for n in f.meta_names()}
        return int(f.mask(a, b, got.get("token_id"), got.get("doc_id"), got.get("role"),
                          got.get("gen")).sum())

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
