"""SAE-training reader: shuffled batches of the committed, filtered rows of a store, local or S3.

The options and their checks (config.py), how rows are chosen (filters.py), split over
ranks x workers (sampling.py), decoded and mixed (readahead.py), cut into batches (batching.py)
and normalised (normalize.py) each live in their own module; this one holds the dataset object
and its per-process state, and shuffle/order.py which pieces each worker reads in an epoch.
`loader.py` adds a DataLoader that counts what it delivers, for resume with workers.

Guarantees, per epoch: every kept row (committed, passing the filters) is yielded exactly once,
except that with G = world_size x num_workers > 1 the epoch's last N mod G kept rows (fewer than
G) are dropped so that every rank and worker yields the same number of rows; the order is a pure
function of (seed, epoch) and the split, so `state_dict()` + `load_state_dict()` resume mid-epoch
with exactly the batches, in order, of an uninterrupted run (with workers too: sampling.lane).
Each DataLoader worker decodes only its own contiguous part of the rank's rows (`decoded_rows`). With `max_norm_ratio` and G > 1, a worker whose share
lost rows to the norm filter repeats that many of its own rows at the end of the epoch instead
(`tally.padded`), because those rows are known only once read and the counts must stay equal.

The epoch, resume point and the like sit in a small shared-memory tensor, not in plain
attributes: DataLoader workers hold a copy of the dataset, and with persistent_workers=True that
copy lives across epochs, so a plain `set_epoch` in the parent never reached them and every
epoch repeated epoch 0's order.

Nothing here keeps an open store across a fork: each process opens its own (async S3 clients are
bound to the event loop of the process that made them).
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any, Sequence

import numpy as np
import torch

from .feed import handoff
from .shuffle import mixing, permute
from . import normalize as _norm
from .feed.batching import BatchBuffers, Tally, batches
from ..format import layout
from ..format.dtypes import raw_dtype, torch_dtype
from .follow import FollowMode
from .filters import RowFilter, sink_positions, store_context_size, store_facts, store_special_ids
from ..format.roles import resolve_roles
from .feed.loader import ActivationLoader
from ..commit.objects import CommittedMeta, read_point
from .feed.readahead import Arenas, WindowFinisher, WindowReader
from .config import ReaderConfig
from .shuffle.order import PiecePlanning, committed_pieces, rank_world
from .shuffle.sampling import lane, worker_share
from ..format.shardcodec import codec_pool
from ..store import Store, open_store
from .feed.workermem import cap_malloc_arenas
from .tensors import RowForm, emit_rows
from ..format.jsonattrs import JsonObject

log = logging.getLogger(__name__)

_DEFAULT_BUFFER_BYTES = 1 << 30
_GATHER_AHEAD = 4         # batches gathered ahead on the codec threads (batching.py)
_COUNTED_WORKERS = 64      # decoded_rows keeps one counter per worker id below this
_STATE_KEYS = ("follow", "seed", "shuffle", "batch_size", "rank", "world_size", "endless", "points", "filter",
               "n_rows", "window_shards")


class ActivationDataset(PiecePlanning, FollowMode, torch.utils.data.IterableDataset):
    """Yields `[batch, width]` (one point given as a str) or `[batch, n_points, width]` tensors;
    points of several widths (e.g. `mlp_act.L` beside `mlp_in.L`) as a dict `{point: [batch,
    width_p]}` in the order given, rows aligned (row i of every point is the same token).

    `store`: a Store or a URL (then `storage_options` apply). What to read and how is one
    ReaderConfig (config.py, every option documented there): pass `config=ReaderConfig(...)`,
    or the options as keywords as before (`ActivationDataset(store, "resid_post.10",
    batch_size=4096, seed=0)`), which build the same config; `self.config` holds it.

    A list of row-aligned stores (`ActivationDataset([store_a, store_b], ...)`) gives a
    paired.PairedDataset instead: the same rows from each, `[batch, n_models, width]`.
    """

    def __new__(cls, store=None, *args, **kwargs) -> Any:
        if isinstance(store, (list, tuple)):
            from .paired import PairedDataset   # it builds one of these per store
            return PairedDataset(store, *args, member=cls, **kwargs)
        return super().__new__(cls)

    def __init__(self, store: "Store | str", points: "str | Sequence[str] | None" = None,
                 batch_size: int | None = None, *, config: ReaderConfig | None = None,
                 storage_options: dict | None = None, **options):
        super().__init__()
        # the positional pair of the keyword style is part of the options (None: not given)
        options.update({k: v for k, v in (("points", points), ("batch_size", batch_size)) if v is not None})
        self.config = cfg = ReaderConfig.build(config, **options)
        if isinstance(store, Store):
            self._url = store.location.reopen_url()
            self._so = store.location.storage_options
            st = store
        else:
            self._url, self._so = store, storage_options
            st = open_store(store, storage_options=storage_options, read_only=True)
        points = cfg.points
        if points is None:   # every point of activations (not expert ids and weights)
            acts = [p for p in st.points if p not in st.point_values]
            points = acts[0] if len(acts) == 1 else acts
        self.stack = not isinstance(points, str)
        self.points = [points] if isinstance(points, str) else list(points)
        for p in self.points:
            if p not in st.points:
                raise ValueError(f"points: {p!r} is not in the store; it holds {', '.join(st.points)}")
            if p in st.point_values:
                raise ValueError(f"points: {p!r} holds {st.point_values[p]} values (expert routing), "
                                 "not activations to train on; read it with Store.read_values or "
                                 "harvest.store.read.routing.stored_routing")
        self.batch_size, self.shuffle, self.seed = cfg.batch_size, cfg.shuffle, cfg.seed
        self.rank, self.world_size = rank_world(cfg.rank, cfg.world_size)
        self.endless, self.steps = bool(cfg.endless or cfg.steps is not None), cfg.steps
        self.drop_last, self.return_meta, self.eps = cfg.drop_last, cfg.return_meta, cfg.eps
        self.follow, self.follow_timeout, self.follow_poll = cfg.follow, cfg.follow_timeout, cfg.follow_poll
        self.follow_line = None   # follow mode: the last iteration's UnitLine (follow.py)
        self.io_threads = cfg.io_threads or 2 * cfg.prefetch_shards
        self.width, self.store_dtype = st.width, st.np_dtype
        self.widths = {p: st.widths[p] for p in self.points}   # each point's own width
        self._raw = raw_dtype(st.np_dtype)
        # stored columns per row (fp8: width + the row's float32 scale) and what their bits mean;
        # points of several widths share [rows, points, widest] buffers, each in its first
        # `_cols[j]` columns, and are cut to their own width when a batch is made (`_emit`)
        self._cols = [st.point_row_width(p) for p in self.points]
        self._rw, self._vdtype = max(self._cols), _norm.value_dtype(st)
        self.mixed = len(set(self._cols)) > 1
        self.handoff_rings = None   # set by ActivationLoader while its workers fork (handoff.py)
        self.quantized, self.dequantize = st.quantized, cfg.dequantize
        if not self.dequantize and not self.quantized:
            raise ValueError(f"dequantize=False: {st.url} is a {st.dtype} store, not a quantised "
                             "one (float8_e4m3fn); its rows are values already")

        # ---- what the store records about its tokens ----
        attrs = store_facts(st)
        self.context_size = cfg.context_size or store_context_size(attrs)
        self.special_token_ids = store_special_ids(attrs)
        self.bos_token_id = attrs.get("bos_token_id")
        tok = attrs.get("tokenizer")
        self.tokenizer = tok if isinstance(tok, str) else (tok or {}).get("name") if isinstance(tok, dict) else None
        exclude = set(cfg.exclude_token_ids)
        if cfg.exclude_special:
            if self.special_token_ids is None:
                raise ValueError("exclude_special=True: this store records no special_token_ids (it was "
                                 "written before they were recorded); pass exclude_token_ids=[...] "
                                 "with the tokenizer's BOS/EOS/pad ids instead")
            exclude |= set(self.special_token_ids)
        self.roles = resolve_roles(st, cfg.roles)  # store/format/roles.py: None, or the role codes kept
        seqpos, sinks = cfg.seqpos, sink_positions(attrs)
        if seqpos is None and cfg.exclude_special and 0 < sinks < (self.context_size or 0):
            # the store's kept rows: special ids and the attention-sink positions out (FORMAT.md,
            # "Statistics"), which its kept statistics describe exactly; seqpos= says otherwise
            seqpos = slice(sinks, None)
        # a generation store (it has the `gen` column): rows without activations never yielded
        self.filter = RowFilter.build(exclude, self.context_size, seqpos, cfg.split, cfg.test_fraction,
                                      cfg.split_seed, self.roles, generated="gen" in st.meta_columns,
                                      source_rows="source_row" in st.meta_columns)
        # return_meta only: which of its prompt's samples a row is (FORMAT.md "Generation"), the
        # model's next-token scores of the row (FORMAT.md "The model's next-token scores")
        self._extra_meta = tuple(n for n in ("sample", *layout.SCORE_META) if n in st.meta_columns)

        # ---- committed pieces, fixed here so every worker and rank agrees on them; each with
        # the marker facts that check its bytes (objects.py) ----
        self.pieces, self._sources = committed_pieces(st)
        self.n_rows = self.pieces.total_rows()
        self._slot_rows = self.slot_rows = self.pieces.max_rows(default=1)
        self._counts = np.full(len(self.pieces), -1, np.int64)

        buf = cfg.shuffle_buffer_rows or \
            max(self.batch_size * 4, _DEFAULT_BUFFER_BYTES // (self._rw * st.np_dtype.itemsize
                                                               * len(self.points)))
        self.shuffle_buffer_rows = buf
        self.window_shards = max(1, math.ceil(buf / st.shard_rows))
        self.shard_rows, self.mix_docs = st.shard_rows, None

        # ---- normalisation and the norm filter ----
        self.normalize, self.max_norm_ratio = cfg.normalize, cfg.max_norm_ratio
        self.norm_constants: _norm.NormConstants | None = None
        self.norm_limit: np.ndarray | None = None   # per point: max ||x||^2 kept
        self._meta_cols: CommittedMeta | None = None
        self._arenas: Arenas | None = None
        self._batch_bufs: BatchBuffers | None = None
        self._served = self._resumed = 0
        self._store, self._store_pid = st, os.getpid()
        self._setup_norm(st, cfg.norm_constants, cfg.norm_sample_rows)
        self.out_dtype = cfg.out_dtype or (torch.float32 if cfg.normalize or st.quantized
                                           else torch_dtype(st.np_dtype))
        if self.world_size > 1 and not self.follow:
            self.count_rows()  # once here, not once per worker

        mixing.check(self)   # warns when windows hold under half the uniform documents a batch
        # [epoch, resume batches]: shared with DataLoader workers, persistent ones included
        self._ctl = torch.tensor([cfg.epoch, 0], dtype=torch.int64).share_memory_()
        self._decoded = torch.zeros(_COUNTED_WORKERS, dtype=torch.int64).share_memory_()
        self.tally = Tally()   # rows the norm filter dropped / repeated, this process's last iteration

    # ---- setup -------------------------------------------------------------------------------
    def _setup_norm(self, st: Store, given, sample_rows: int) -> None:
        if given is not None:   # (given without normalize= is refused by ReaderConfig)
            if tuple(given.points) != tuple(self.points) or given.mode != self.normalize:
                raise ValueError(f"norm_constants are for points {list(given.points)} mode {given.mode!r}, "
                                 f"this dataset reads {self.points} with normalize={self.normalize!r}")
        moments = None
        if self.normalize and given is None and self.max_norm_ratio is None:
            moments = _norm.store_kept_moments(st, self.points, self.filter)
            source = "store:kept"
        sample = None
        if self.max_norm_ratio is not None or (self.normalize and given is None and moments is None):
            if not self.pieces and self.normalize and given is None:
                raise ValueError(f"normalize={self.normalize!r}: {st.url} has no committed rows "
                                 "yet (no unit's commit marker exists), so there is nothing to "
                                 "take statistics from; wait until units commit, or pass "
                                 "norm_constants=")
            sample = _norm.read_sample(st, self.committed_meta(), self.points, self.pieces,
                                       self._sources, self.filter, int(sample_rows), self.seed,
                                       self.max_norm_ratio, self.io_threads)
            self.norm_limit = sample.norm_limit
            if sample.outlier_rows:
                log.info("max_norm_ratio=%s drops %d of %d sample rows (%.3f%%)", self.max_norm_ratio,
                         sample.outlier_rows, sample.rows.shape[0] + sample.outlier_rows,
                         100 * sample.outlier_rows / (sample.rows.shape[0] + sample.outlier_rows))
        if given is not None:
            self.norm_constants = given
        elif self.normalize:
            if moments is None:
                moments, source = _norm.sample_moments(sample, self._vdtype), "sample"
            self.norm_constants = _norm.constants(self.normalize, self.points, moments, self.width, source,
                                                  self.eps)
        if given is None and self.normalize and self.max_norm_ratio is None:
            self._warn_sinks(st)
        if self.norm_constants is not None:
            c = self.norm_constants
            log.info("normalize=%s: constants from %s (%d rows; E||x||^2 %s)", c.mode, c.source, c.rows,
                     ", ".join(f"{v:.4g}" for v in c.mean_sq_norm[:4]) + (" ..." if len(c.points) > 4 else ""))

    def _warn_sinks(self, st: Store) -> None:
        """Say so when the rows normalised include the attention-sink positions: the constants
        describe the rows yielded, as always, so a few sink rows then set the scale of all."""
        n = sink_positions(store_facts(st))
        kept = self.filter.kept_positions()
        sinks = sorted(set(range(n)) if kept is None else {p for p in kept if p < n})
        if not sinks:
            return
        c = self.norm_constants
        how = (f"the store's kept statistics ({c.rows:,} rows)" if c.source == "store:kept" else
               f"a sample of {c.rows:,} of them (an estimate: sink rows are few and huge, so it "
               "varies with the sample)")
        warnings.warn(
            f"normalize={self.normalize!r}: this reader keeps context position(s) "
            f"{', '.join(map(str, sinks))} (where its token filters pass them), which hold attention "
            f"sinks (||x||^2 up to ~1e4 x the median; FORMAT.md, \"Statistics\"); the constants "
            f"describe the rows yielded, taken from "
            f"{how}, so those rows set the scale and typical rows end far below E||x||^2 = width. "
            f"Leave them out: exclude_special=True without seqpos= (the store's kept rows), "
            f"seqpos=slice({n}, None), or max_norm_ratio=", UserWarning, stacklevel=4)

    def _open(self) -> Store:
        if self._store is None or self._store_pid != os.getpid():
            self._store = open_store(self._url, storage_options=self._so, read_only=True)
            self._store_pid = os.getpid()
            self._meta_cols = None
            self._arenas = None  # a forked copy's arenas are the parent's pages (copy-on-write)
            self._batch_bufs = None
        return self._store

    def committed_meta(self) -> CommittedMeta:
        st = self._open()
        if self._meta_cols is None:
            self._meta_cols = CommittedMeta(st, self.pieces, self._sources)
        return self._meta_cols

    def __getstate__(self):
        # DataLoader workers started with spawn/forkserver get the dataset pickled: an open store
        # (an async S3 client) and arenas cannot travel, and each worker opens its own
        state = dict(self.__dict__)
        state.update(_store=None, _store_pid=None, _arenas=None, _meta_cols=None, _batch_bufs=None,
                     handoff_rings=None, follow_line=None)
        return state

    # ---- epochs (counts and plans: readorder.PiecePlanning) -----------------------------------
    @property
    def epoch(self) -> int:
        return int(self._ctl[0])

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch (like DistributedSampler.set_epoch); reaches persistent workers."""
        self._ctl[1] = 0
        self._ctl[0] = int(epoch)
        self._resumed = self._served = 0

    # ---- decoding ----------------------------------------------------------------------------
    def _fetch(self, piece: tuple[int, int], p: int, out: np.ndarray) -> None:
        """One GET, the object checked against its marker's CRC32C, decoded in place."""
        st = self._open()
        i = self._piece_index(piece)
        m, sh = self._sources[i]
        read_point(st, m, sh, st.points.index(self.points[p]), out=out[:, :self._cols[p]],
                   rows=piece[1] - piece[0])

    def _piece_index(self, piece: tuple[int, int]) -> int:
        return self.pieces.index(piece)   # a bisect: a dict of 2 M pieces was 200 MB

    def _meta_names(self) -> list[str]:
        if self.return_meta:
            return ["token_id", "doc_id", "position"] + (["role"] if self.filter.needs_roles else []) \
                + (["gen"] if self.filter.generated else []) + list(self._extra_meta) \
                + (["source_row"] if self.filter.needs_source_rows else [])
        return self.filter.meta_names()

    def _fetch_meta(self, piece: tuple[int, int]) -> dict[str, np.ndarray]:
        cols = self.committed_meta()
        return {n: cols.read(n, *piece) for n in self._meta_names()}

    @property
    def row_width(self) -> int:
        """Stored columns of a buffer row (the widest point's; fp8: + the 4 scale bytes)."""
        return self._rw

    @property
    def raw_dtype(self) -> np.dtype:
        """The raw-bits dtype the buffers hold (dtypes.raw_dtype of the store dtype)."""
        return self._raw

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self):
        if self.follow:   # a store a run is writing: follow.py
            yield from self._follow_iter()
            return
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            cap_malloc_arenas()   # worker RSS grew epoch after epoch otherwise (workermem.py)
        hand = handoff.worker_side(self, info)   # batches to the loader through shared memory
        epoch, resume = int(self._ctl[0]), int(self._ctl[1])
        ln = lane(wid, resume, nw)     # which global batches this worker produces (sampling.lane)
        g = self.rank * nw + ln
        if self.world_size * nw > 1:
            self._ensure_counts()
        skip_batches = worker_share(resume, ln, nw)
        limit = None if self.steps is None else worker_share(self.steps, ln, nw) - skip_batches
        specs, skip_rows = self._specs(epoch, ln, nw), skip_batches * self.batch_size
        if skip_rows and self.norm_limit is None and self.shuffle != "global":
            specs, skip_rows = self._preskip(specs, skip_rows)
        self._open()
        if self._meta_names():
            self.committed_meta()   # opened here, not raced for by the fetch threads
        if self._arenas is None:
            self._arenas = Arenas(self._slot_rows, len(self.points), self._rw, self._raw)
        if self._batch_bufs is None:   # per process, kept across epochs like the arenas
            self._batch_bufs = BatchBuffers((self.batch_size, len(self.points), self._rw), self._raw,
                                            keep=_GATHER_AHEAD + 2)
        finish = WindowFinisher(self.pieces, self.filter, self._counts, self.norm_limit, self._vdtype,
                                self._slot_rows, self.shuffle, self.seed, g, self.return_meta,
                                self._extra_meta, self._cols if self.mixed else None)
        reader = WindowReader(self.pieces, len(self.points), self._arenas, self.io_threads, self._fetch,
                              self._fetch_meta if self._meta_names() else None, finish)
        self._served, self._resumed = 0, resume
        self.tally = Tally()
        readies = reader(self._counted(specs, wid))
        if self.shuffle == "global":   # one keyed permutation of every kept row (permute.py)
            readies = self.global_reader(finish.names, wid).readies(epoch, g, self.world_size * nw,
                                                                    skip_rows, self.endless)
            skip_rows = 0
        for batch in batches(readies, self.batch_size, (len(self.points), self._rw),
                             self._raw, self._emit, skip=skip_rows, limit=limit, drop_last=self.drop_last,
                             shuffle=self.shuffle, seed=self.seed, tally=self.tally, pool=codec_pool(),
                             ahead=_GATHER_AHEAD,
                             buffers=self._batch_bufs if hand is None or hand.buffers is None else hand.buffers):
            self._served += 1
            yield batch if hand is None else hand.pack(batch)

    def global_reader(self, names, wid: int = 0, acts: bool = True) -> permute.GlobalReader:
        """The shuffle="global" reader of this dataset's kept rows, batches carrying metadata
        columns `names` (acts=False: metadata only, for mixing.describe)."""
        need = sorted(set(self._meta_names()) | set(names))
        cols = self.committed_meta() if need else None
        src = permute.GlobalSource(self.pieces, self._ensure_counts(), self.filter, self._fetch,
                                   (lambda pc: {n: cols.read(n, *pc) for n in need}) if cols else None,
                                   list(names), len(self.points), self._rw, self._raw, self._slot_rows,
                                   self.seed)

        def count(rows: int) -> None:
            self._decoded[min(wid, len(self._decoded) - 1)] += rows * len(self.points)
        block = max(1, self.shuffle_buffer_rows // self.batch_size) * self.batch_size   # whole batches
        return permute.GlobalReader(src, block, self.config.prefetch_shards, acts, count)

    def _counted(self, specs, wid: int):
        """Count the rows each worker decodes (`decoded_rows`), as windows go to the decoder."""
        for spec in specs:
            rows = sum(self.pieces[t.piece][1] - self.pieces[t.piece][0] for t in spec.takes)
            self._decoded[min(wid, len(self._decoded) - 1)] += rows * len(self.points)
            yield spec

    @property
    def decoded_rows(self) -> list[int]:
        """Rows x points sent to decode so far, per DataLoader worker id (index 0 without workers;
        the last entry sums ids beyond it); shared with the workers, counted since construction."""
        return [int(v) for v in self._decoded]

    def _emit(self, x: np.ndarray, rows: np.ndarray, meta: dict):
        """x is [n, n_points, row width] raw bits of the store dtype (tensors.emit_rows)."""
        return emit_rows(x, rows, meta, RowForm(
            tuple(self.points), tuple(self._cols), self.store_dtype, self.quantized, self.dequantize,
            self.norm_constants, self.out_dtype, self.return_meta, self.stack))

    # ---- resume ------------------------------------------------------------------------------
    def _fingerprint(self) -> JsonObject:
        return {"seed": self.seed, "shuffle": self.shuffle, "batch_size": self.batch_size, "rank": self.rank,
                "world_size": self.world_size, "endless": self.endless, "points": list(self.points),
                "filter": self.filter.describe(), "window_shards": self.window_shards,
                # a follower's rows are the run's, not those committed when it was built
                "n_rows": "follow" if self.follow else self.n_rows, "follow": True if self.follow else None}

    def state_dict(self, batches: int | None = None, num_workers: int = 0) -> JsonObject:
        """Where this rank stands: epoch and batches yielded in it (since the start when endless).

        Batches are counted by this dataset when it is iterated in this process; with DataLoader
        workers, use `loader()` (it counts what it delivers) or pass `batches=` (the trainer's
        step within the epoch) and `num_workers=`.
        """
        b = self._resumed + self._served if batches is None else int(batches)
        return {"version": 1, "epoch": self.epoch, "batches": b, "num_workers": int(num_workers),
                **self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next iteration yields exactly the rows the saved one had not yet yielded
        (same num_workers as when saved, since the rows are split over them)."""
        if state.get("version") != 1:
            raise ValueError(f"reader state version {state.get('version')!r} is not 1")
        mine = self._fingerprint()
        for key in _STATE_KEYS:
            if state.get(key) != mine[key]:
                raise ValueError(f"reader state was saved with {key}={state.get(key)!r}, this dataset has "
                                 f"{key}={mine[key]!r}; resume with the same settings")
        self._ctl[0] = int(state["epoch"])
        self._ctl[1] = int(state["batches"])
        self._resumed, self._served = int(state["batches"]), 0

    @property
    def resume_point(self) -> int:
        """Batches of the current epoch (since the start when endless) a resume skips."""
        return int(self._ctl[1])

    def describe(self, num_workers: int = 0, batches: int = 16) -> JsonObject:
        """How well this reader mixes documents on this store, read by `num_workers` DataLoader
        workers: expected and simulated distinct documents per batch against a uniform shuffle,
        lag-1 same-document rate and doc-id autocorrelation, memory (mixing.describe)."""
        return mixing.describe(self, num_workers, batches)

    def loader(self, num_workers: int = 0, **kwargs) -> ActivationLoader:
        """A DataLoader over this dataset that counts what it delivers, for `state_dict()`."""
        return ActivationLoader(self, num_workers=num_workers, **kwargs)
