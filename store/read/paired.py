"""Paired reading: the same rows from several row-aligned stores, for crosscoders and model diffing.

`ActivationDataset([store_a, store_b], "resid_post.10", batch_size=4096)` (ActivationDataset
hands a list of stores here) yields `[batch, n_models, width]`: row i of the batch is the same
token's activations in each store (a series of checkpoints from `harvest schedule checkpoints`, a
base model and a fine-tune over one corpus). With a list of points per store it is `[batch,
n_models, n_points, width]`; `form="dict"` (the default when the stores are read at different
points or widths) yields `{name: batch as that store alone would yield it}` instead.

How: one ActivationDataset per store, all with one config (seed, shuffle window, filters, rank
and world size, steps) and one shuffle buffer size. Which rows a dataset yields, and in what
order, is a function of that config and of the store's committed pieces and kept-row counts
(order.py, sampling.py): for stores with the same committed units, shard size and row metadata
(so every filter keeps the same rows) that is the same sequence of rows. So each store is read
exactly as it would be alone (its own decode, its own normalisation constants), and the batches
are zipped. Before anything is read, alignment is checked from the commit markers' per-unit
row-metadata digests (harvest.store.commit.alignment); while reading, each batch's row ids and
token ids are compared across the stores (16 bytes a row), so a pair that drifts apart is an
error, never a silent mismatch. Shuffling, DDP split, workers, resume and `steps` work as for
one store, since each member is a plain ActivationDataset.

Not supported: `max_norm_ratio` (a row's norm differs per model, so each store would drop
different rows; drop attention sinks by position with `seqpos=` or `exclude_special=`).

Cost: each store's rows are decoded once, as alone; stacking copies a batch once more; the shuffle
window (default 1 GiB of rows in all) is shared between the stores.
"""

from __future__ import annotations

import dataclasses
from pathlib import PurePosixPath
from typing import Sequence

import numpy as np
import torch

from ..commit.alignment import AlignmentReport, StoresNotAligned, check_aligned
from ..errors import DataIntegrityError
from ..store import Store, open_store
from .config import ReaderConfig
from .filters import store_context_size, store_facts
from .feed.loader import ActivationLoader
from ..format.jsonattrs import JsonObject

_DEFAULT_BUFFER_BYTES = 1 << 30   # the shuffle window of all stores together, as for one store
FORMS = ("stack", "dict")
_END = object()


def _names(stores: list[Store], given) -> list[str]:
    if given is not None:
        names = [str(n) for n in given]
        if len(names) != len(stores) or len(set(names)) != len(names):
            raise ValueError(f"names={list(given)!r}: give one distinct name per store "
                             f"({len(stores)} stores)")
        return names
    tails = [PurePosixPath(s.url.rstrip("/")).name for s in stores]
    return tails if len(set(tails)) == len(tails) and all(tails) else [str(i) for i in range(len(stores))]


class PairedDataset(torch.utils.data.IterableDataset):
    """Batches of the same rows from several row-aligned stores (see the module docstring).

    `stores`: Stores or URLs (`storage_options`: one dict for all, or a list, one per store).
    `points`, `batch_size`, `config=` and the keyword options are ActivationDataset's, applied to
    every store; `store_points` (a list, one point or list of points per store) reads each store
    at its own points. `norm_constants=` (with `normalize=`) is a list, one per store (the train
    split's `norm_constants` attribute, for its held-out split). `form`: "stack" (a tensor with the
    store axis after the batch axis; needs the same number of points and width in every store)
    or "dict" ({name: tensor}); default "stack" where every store is read at the same points and
    width. `names`: the dict keys (default: the last part of each store's URL, where they
    differ, else "0", "1", ...). With `return_meta=True` a batch is a dict: `acts` (the tensor
    or the dict) and the first store's `row`, `token_id`, `doc_id`, `position`, ... (equal in
    every store: checked). `member`: the single-store dataset class (ActivationDataset, which
    makes this object and passes itself: this module does not import it).
    """

    def __init__(self, stores: Sequence, points: "str | Sequence[str] | None" = None,
                 batch_size: int | None = None, *, config: ReaderConfig | None = None,
                 storage_options: "dict | Sequence[dict | None] | None" = None,
                 names: "Sequence[str] | None" = None, form: str | None = None,
                 store_points: "Sequence | None" = None, member=None, **options):
        super().__init__()
        if member is None:
            raise TypeError("PairedDataset is made by ActivationDataset([store_a, store_b], ...), "
                            "which passes itself as `member`, the dataset read for each store")
        stores = list(stores)
        if not stores:
            raise ValueError("ActivationDataset([]): give at least one store")
        options.update({k: v for k, v in (("points", points), ("batch_size", batch_size)) if v is not None})
        nc = options.pop("norm_constants", None)
        cfg = ReaderConfig.build(config, **options)
        if nc is None and cfg.norm_constants is not None:
            nc, cfg = cfg.norm_constants, dataclasses.replace(cfg, norm_constants=None)
        if cfg.max_norm_ratio is not None:
            raise ValueError("max_norm_ratio: paired reading needs every store to keep the same "
                             "rows, and a row's norm differs from model to model; drop attention "
                             "sinks by position instead (seqpos=slice(2, None), exclude_special=True)")
        n = len(stores)
        if nc is not None and (not isinstance(nc, (list, tuple)) or len(nc) != n):
            raise ValueError(f"norm_constants: give a list of {n}, one per store (a paired "
                             "dataset's `norm_constants`), each store is normalised on its own")
        sos: list = list(storage_options) if isinstance(storage_options, (list, tuple)) else \
            [storage_options] * n
        if len(sos) != n:
            raise ValueError(f"storage_options: a list of {len(sos)} for {n} stores")
        opened = [s if isinstance(s, Store) else open_store(s, storage_options=so, read_only=True)
                  for s, so in zip(stores, sos)]
        self.names = _names(opened, names)
        if store_points is not None:
            specs = list(store_points)
            if len(specs) != n:
                raise ValueError(f"store_points: a list of {len(specs)} for {n} stores (one point "
                                 "or list of points per store)")
            if cfg.points is not None:
                raise ValueError("give points= (every store) or store_points= (each its own), not both")
        else:
            specs = [cfg.points] * n

        # ---- alignment: from the markers, before any row is read ----
        markers = [s.ledger.committed_units() for s in opened]
        self.alignment: AlignmentReport = check_aligned(opened, self.names, markers)
        if cfg.context_size is None:
            sizes = [store_context_size(store_facts(s)) for s in opened]
            if len(set(sizes)) > 1:
                raise StoresNotAligned(f"context_size differs: {dict(zip(self.names, sizes))}; "
                                       "the stores were packed differently")

        # one shuffle window size for all: the same windows, so the same order
        per_row = sum(s.row_bytes * _n_points(s, p) for s, p in zip(opened, specs))
        buf = cfg.shuffle_buffer_rows or max(cfg.batch_size * 4, _DEFAULT_BUFFER_BYTES // per_row)
        self.return_meta = cfg.return_meta
        self.datasets = [member(s, config=dataclasses.replace(
            cfg, points=p, shuffle_buffer_rows=buf, return_meta=True,
            norm_constants=None if nc is None else nc[i])) for i, (s, p) in enumerate(zip(opened, specs))]
        self.config = dataclasses.replace(cfg, shuffle_buffer_rows=buf)
        lead = self.datasets[0]
        want = sorted(m.rows for m in markers[0].values())
        for name, d in zip(self.names, self.datasets):
            got = list(zip(d.pieces.lo.tolist(), d.pieces.hi.tolist()))
            if got != want:
                raise StoresNotAligned(f"{name!r}: its committed units changed while the paired "
                                       "dataset opened (a run is writing it); open it again, or "
                                       "when the runs are finished")
            if d.window_shards != lead.window_shards:
                raise AssertionError("paired members disagree on their shuffle window")
            if d.filter != lead.filter:   # exclude_special=True follows each store's sink positions
                raise StoresNotAligned(
                    f"{name!r} keeps other rows than {self.names[0]!r} under the same options "
                    f"(filters {d.filter.describe()} and {lead.filter.describe()}: the stores "
                    "record different stats_skip_positions, which exclude_special=True follows); "
                    "pass seqpos= to choose the context positions for every store")

        same = all(d.points == lead.points and d.stack == lead.stack for d in self.datasets)
        stackable = all(len(d.points) == len(lead.points) and d.stack == lead.stack and
                        d.width == lead.width for d in self.datasets)
        self.form = form or ("stack" if same and stackable else "dict")
        if self.form not in FORMS:
            raise ValueError(f"form={form!r}: use one of {FORMS}")
        if self.form == "stack" and not stackable:
            shapes = {nm: (len(d.points), d.width) for nm, d in zip(self.names, self.datasets)}
            raise ValueError(f"form='stack' needs the same number of points and width in every "
                             f"store, got (points, width) {shapes}; use form='dict'")
        self.n_models = n

    # ---- what every member shares (the order): the lead's -------------------------------------
    shuffle = property(lambda self: self.datasets[0].shuffle)
    seed = property(lambda self: self.datasets[0].seed)
    batch_size = property(lambda self: self.datasets[0].batch_size)
    rank = property(lambda self: self.datasets[0].rank)
    world_size = property(lambda self: self.datasets[0].world_size)
    endless = property(lambda self: self.datasets[0].endless)
    steps = property(lambda self: self.datasets[0].steps)
    pieces = property(lambda self: self.datasets[0].pieces)
    filter = property(lambda self: self.datasets[0].filter)
    n_rows = property(lambda self: self.datasets[0].n_rows)
    context_size = property(lambda self: self.datasets[0].context_size)
    window_shards = property(lambda self: self.datasets[0].window_shards)
    shard_rows = property(lambda self: self.datasets[0].shard_rows)
    shuffle_buffer_rows = property(lambda self: self.datasets[0].shuffle_buffer_rows)
    width = property(lambda self: self.datasets[0].width)
    mix_docs = None   # mixing.check's sample of documents (set there)

    @property
    def points(self) -> list:
        """Per store, the points it is read at."""
        return [d.points for d in self.datasets]

    @property
    def norm_constants(self) -> list:
        """Per store, its normalisation constants (None without normalize=)."""
        return [d.norm_constants for d in self.datasets]

    def committed_meta(self):
        return self.datasets[0].committed_meta()

    def count_rows(self) -> int:
        counts = [d.count_rows() for d in self.datasets]
        if len(set(counts)) > 1:
            raise DataIntegrityError(f"paired stores keep different row counts {dict(zip(self.names, counts))} "
                                     "under the same filters: their row metadata differs")
        return counts[0]

    def rows_per_worker(self, num_workers: int = 0) -> int:
        self.count_rows()
        return self.datasets[0].rows_per_worker(num_workers)

    def plan(self, epoch: int, worker_id: int = 0, num_workers: int = 1):
        return self.datasets[0].plan(epoch, worker_id, num_workers)

    @property
    def decoded_rows(self) -> list[int]:
        """Rows x points sent to decode so far, per worker id, summed over the stores."""
        return [sum(v) for v in zip(*(d.decoded_rows for d in self.datasets))]

    # ---- epochs and resume ----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.datasets[0].epoch

    @property
    def resume_point(self) -> int:
        return self.datasets[0].resume_point

    def set_epoch(self, epoch: int) -> None:
        for d in self.datasets:
            d.set_epoch(epoch)

    def state_dict(self, batches: int | None = None, num_workers: int = 0) -> JsonObject:
        """Every store's reader state (they stand at the same batch), as ActivationDataset's."""
        states = [d.state_dict(batches, num_workers) for d in self.datasets]
        return {"version": 1, "paired": list(self.names), "epoch": states[0]["epoch"],
                "batches": states[0]["batches"], "num_workers": int(num_workers), "stores": states}

    def load_state_dict(self, state: dict) -> None:
        stores = state.get("stores")
        if state.get("paired") is None or not isinstance(stores, list):
            raise ValueError("reader state was saved by a single-store dataset; resume a paired "
                             "dataset from a paired dataset's state_dict()")
        if len(stores) != len(self.datasets):
            raise ValueError(f"reader state holds {len(stores)} stores, this dataset pairs "
                             f"{len(self.datasets)}; resume with the same stores")
        for d, s in zip(self.datasets, stores):
            d.load_state_dict(s)

    def loader(self, num_workers: int = 0, **kwargs) -> ActivationLoader:
        """A DataLoader over this dataset that counts what it delivers, for `state_dict()`."""
        return ActivationLoader(self, num_workers=num_workers, **kwargs)

    # ---- iteration --------------------------------------------------------------------------------
    def __iter__(self):
        its = [iter(d) for d in self.datasets]
        try:
            while True:
                parts = [next(it, _END) for it in its]
                ended = [p is _END for p in parts]
                if all(ended):
                    return
                if any(ended):
                    short = [nm for nm, e in zip(self.names, ended) if e]
                    raise DataIntegrityError(f"paired stores {short} ended before the others: they "
                                             "kept different rows")
                yield self._combine(parts)
        finally:
            for it in its:
                it.close()

    def _combine(self, parts: list[dict]):
        first = parts[0]
        for name, p in zip(self.names[1:], parts[1:]):
            for col in ("row", "token_id"):
                if not torch.equal(p[col], first[col]):
                    k = int(np.flatnonzero((p[col] != first[col]).numpy())[0]) \
                        if p[col].shape == first[col].shape else 0
                    raise DataIntegrityError(
                        f"paired batch: store {name!r} yielded {col} {int(p[col][k])} where "
                        f"{self.names[0]!r} yielded {int(first[col][k])} (batch row {k}): the "
                        "stores drifted apart; report this with both stores' `harvest verify`")
        if self.form == "stack":
            acts = torch.stack([p["acts"] for p in parts], dim=1)
            scale = torch.stack([p["scale"] for p in parts], dim=1) if "scale" in first else None
        else:
            acts = {nm: p["acts"] for nm, p in zip(self.names, parts)}
            scale = {nm: p["scale"] for nm, p in zip(self.names, parts)} if "scale" in first else None
        if not self.return_meta:
            return acts if scale is None else (acts, scale)
        out = {k: v for k, v in first.items() if k not in ("acts", "scale")}
        out["acts"] = acts
        if scale is not None:
            out["scale"] = scale
        return out


def _n_points(st: Store, spec) -> int:
    if spec is None:
        return len(st.points)
    return 1 if isinstance(spec, str) else len(spec)


__all__ = ["FORMS", "PairedDataset"]
