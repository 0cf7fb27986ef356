"""`harvest.stream(config, points=..., batch_size=..., rank=..., world_size=...)`: the store
reader's batches, straight from the capture actors.

A `StreamDataset` takes the store reader's options (store/read/config.ReaderConfig: points,
batch_size, exclude_special, seqpos, split, roles, normalize, return_meta, out_dtype, dequantize,
shuffle, seed, shuffle_buffer_rows, drop_last) and yields what an `ActivationDataset` would on
the store the same run writes: the same rows under the same filter, with the same tensors
(store/read/tensors.emit_rows), batches drawn uniformly from shuffle windows of
`shuffle_buffer_rows` rows (windows.py); each rank gets disjoint rows, the same number on every
rank (deal.py). What differs, by necessity: one pass (the corpus is captured once: no epochs,
`endless`, `steps`), window shuffle only (no `shuffle="global"`), no `max_norm_ratio` (its
median needs the whole store), normalisation constants from the first window of every rank
(merged by the coordinator, recorded in `norm_constants` and in `state_dict()`), and no
DataLoader workers (the rows arrive in this process; a thread receives them).

Iterating joins the stream (creating its coordinator if this is the first rank to come:
coordinator.py), so every rank runs the same call with its own rank; ranks may be Ray Train
workers or any process connected to the same Ray cluster (`ray.init(address=...)`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..config.run import HarvestConfig, load_config
from ..actor.outbox import rss_bytes
from ..errors import HarvestError
from ..messages import StreamInfo
from ...store import (codec_pool, FP8_NAME, is_quantized, raw_dtype, ReaderConfig,
                           resolve_dtype, row_width, torch_dtype)
from ...store.read import normalize as _norm
from ...store.read.feed.batching import BatchBuffers, Tally, batches
from ...store.read.shuffle.mixing import doc_stats, expected_distinct
from ...store.read.shuffle.order import rank_world
from ...store.read.tensors import RowForm, emit_rows

from .coordinator import NAMESPACE, StreamCoordinator, coordinator_name
from .progress import Progress, from_ranges
from .receiver import Receiver
from .windows import Windows

log = logging.getLogger("harvest.pipeline")

_DEFAULT_BUFFER_BYTES = 1 << 30   # the reader's default window: 1 GiB of rows
_GATHER_AHEAD = 4
_MEASURED_BATCHES = 16            # batches whose documents describe() reports
JOIN_POLL_S = 1.0
NORM_WAIT_S = 600.0               # how long a rank waits for the other ranks' first windows
# store reader options a stream cannot honour, each with why
REFUSED = {
    "follow": "a stream is a run's rows as they are captured already",
    "endless": "a stream is one pass over the corpus (read the tee's store for more epochs)",
    "steps": "a stream is one pass over the corpus (read the tee's store for more epochs)",
    "max_norm_ratio": "its median needs a sample of the whole store; drop sinks by seqpos",
    "context_size": "the run's packing.context_size is the context size",
    "epoch": "a stream has one epoch",
}


def _config(config) -> HarvestConfig:
    if isinstance(config, HarvestConfig):
        return config
    if isinstance(config, dict):
        return load_config(data=config)
    return load_config(Path(config))


class StreamDataset(torch.utils.data.IterableDataset):
    """One trainer rank's stream (module doc). Iterate it once; `describe()`, `figures()`,
    `norm_constants` and `state_dict()` report on the iteration."""

    def __init__(self, config, points=None, batch_size: int | None = None, *,
                 rank: int | None = None, world_size: int | None = None,
                 reader: ReaderConfig | None = None, engine_factory: str | None = None,
                 **options):
        """`engine_factory` ("module:callable", benchmarks only): the capture engine the run
        builds instead of the model's (driver.run's)."""
        super().__init__()
        self.engine_factory = engine_factory
        self.run_config = _config(config)
        options.update({k: v for k, v in (("points", points), ("batch_size", batch_size))
                        if v is not None})
        cfg = self.config = ReaderConfig.build(reader, **options)
        for name, why in REFUSED.items():
            v = getattr(cfg, name)
            if v not in (None, False, 0):
                raise ValueError(f"{name}={v!r}: not with a stream: {why}")
        if cfg.shuffle == "global":
            raise ValueError("shuffle='global': a stream shuffles within windows of "
                             "shuffle_buffer_rows (a permutation of the whole corpus needs it "
                             "whole); use shuffle=True")
        self.rank, self.world_size = rank_world(rank if rank is not None else cfg.rank,
                                                world_size if world_size is not None
                                                else cfg.world_size)
        self.batch_size, self.seed, self.shuffle = cfg.batch_size, cfg.seed, cfg.shuffle
        self.return_meta, self.drop_last = cfg.return_meta, cfg.drop_last
        self.points_given = cfg.points
        # a list of points stacks ([batch, points, width]); None: every captured point, which
        # stacks unless the run captures one (known once joined)
        self.stack = not isinstance(cfg.points, str)
        self.normalize = cfg.normalize
        self.norm_constants = cfg.norm_constants
        # store-reader attributes the trainer adapters look at (store/read/adapters.py)
        self.endless, self.follow = False, False
        self.info: StreamInfo | None = None
        self.receiver: Receiver | None = None
        self.windows: Windows | None = None
        self.tally = Tally()
        self.batches_yielded = 0
        self.rows_yielded = 0
        self.t_first: float | None = None
        self.t_last: float | None = None
        self._measured: list[np.ndarray] = []
        self._handle = None
        self._resume: dict | None = None     # a saved state to resume from (load_state_dict)
        self.progress: Progress | None = None

    # ---- joining ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.run_config.stream.name or self.run_config.name

    def key(self) -> str:
        """What this stream is: the run's config and the reader options, hashed; every rank
        must give the same (the coordinator refuses another)."""
        reader = {k: repr(v) for k, v in sorted(vars(self.config).items())
                  if k not in ("rank", "world_size", "norm_constants")}
        text = json.dumps({"run": self.run_config.to_dict(redact=True), "reader": reader},
                          sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _connect(self):
        import ray

        from ..driver.cluster import forwarded_env

        if not ray.is_initialized():
            raise HarvestError("harvest.stream: connect to the Ray cluster first "
                               "(ray.init(address=...)); a stream's ranks share its capture")
        if self._resume is not None:   # a resume joins its own stream, never starts a new one
            try:
                return ray.get_actor(coordinator_name(self.run_config), namespace=NAMESPACE)
            except ValueError:
                raise HarvestError(
                    f"stream {self.name!r} is gone (it ended, or stopped when rank {self.rank} "
                    "went silent for stream.rank_timeout_s): a saved position cannot be resumed "
                    "without it; the rows after it exist nowhere else (write a tee to read them "
                    "back from its store)") from None
        Remote = ray.remote(StreamCoordinator)
        return Remote.options(
            name=coordinator_name(self.run_config), namespace=NAMESPACE, get_if_exists=True,
            lifetime="detached", num_cpus=0, max_concurrency=32, max_restarts=0,
            runtime_env={"env_vars": forwarded_env()},
        ).remote(self.run_config, self.config, self.world_size, self.key(), self.engine_factory)

    def _join(self, handle) -> StreamInfo:
        import ray

        deadline = time.monotonic() + self.run_config.stream.join_timeout_s
        resume = None if self._resume is None else self._resume["consumed"]
        while True:
            got = ray.get(handle.join.remote(self.rank, self.world_size, self.key(), os.getpid(),
                                             resume=resume))
            if isinstance(got, str):
                raise HarvestError(f"stream {self.name!r}, rank {self.rank}: {got}")
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise HarvestError(f"stream {self.name!r}: its capture actors did not start within "
                                   f"stream.join_timeout_s={self.run_config.stream.join_timeout_s:g} s")
            time.sleep(JOIN_POLL_S)

    # ---- iteration -------------------------------------------------------------------------
    def __iter__(self):
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("a StreamDataset is read in the trainer's own process (its rows "
                               "arrive on a thread there): use num_workers=0")
        self._handle = handle = self._connect()
        info = self.info = self._join(handle)
        P = len(info.points)
        if self.points_given is None:
            self.stack = P > 1
        wire = resolve_dtype(info.dtype)
        quantized = is_quantized(info.dtype)
        cols = tuple(row_width(info.dtype, w) for w in info.widths)
        rw, raw = max(cols), raw_dtype(wire)
        W = self.config.shuffle_buffer_rows or max(
            self.batch_size * 4, _DEFAULT_BUFFER_BYTES // (rw * raw.itemsize * P))
        self.window_rows = W
        self.windows = Windows(W, P, rw, raw, self.seed, self.rank, bool(self.shuffle))
        r = self._resume or {}
        self.progress = Progress(info.context_size, from_ranges(r.get("consumed")),
                                 {int(g): v for g, v in (r.get("partial") or {}).items()})
        self.receiver = Receiver(info, self.rank, self.windows, self.run_config.stream.take_rows,
                                 handle, self.progress).start()
        out_dtype = self.config.out_dtype or (torch.float32 if self.normalize or quantized
                                              else torch_dtype(wire))
        form = RowForm(tuple(info.points), cols, wire, quantized, self.config.dequantize, None,
                       out_dtype, self.return_meta, self.stack)
        bufs = BatchBuffers((self.batch_size, P, rw), raw, keep=_GATHER_AHEAD + 2)
        self.t_first = time.perf_counter()
        try:
            readies = self._readies(handle, info, cols, wire)
            emit = self._emitter(form)
            for b in batches(readies, self.batch_size, (P, rw), raw, emit,
                             drop_last=self.drop_last, shuffle=bool(self.shuffle), seed=self.seed,
                             tally=self.tally, pool=codec_pool(), ahead=_GATHER_AHEAD,
                             buffers=bufs):
                self.batches_yielded += 1
                yield b
        finally:
            self.t_last = time.perf_counter()
            self.receiver.stop()
            try:
                handle.leave.remote(self.rank)
            except Exception:  # noqa: BLE001 -- the coordinator may be gone already
                pass

    def _emitter(self, form: RowForm):
        def emit(x, rows, meta):
            if len(self._measured) < _MEASURED_BATCHES:
                self._measured.append(meta["doc_id"].copy())
            self.rows_yielded += rows.shape[0]
            self.progress.yielded(rows)
            shown = meta if self.return_meta else {}
            f = form if self.norm_constants is None or form.norm is not None else \
                RowForm(form.points, form.cols, form.store_dtype, form.quantized, form.dequantize,
                        self.norm_constants, form.out_dtype, form.return_meta, form.stack)
            return emit_rows(x, rows, shown, f)
        return emit

    def _readies(self, handle, info: StreamInfo, cols, wire):
        """The windows, in order; the first one sets the normalisation constants."""
        w = self.windows
        first = True
        while True:
            item = w.out.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            ready, arena = item
            if first and self.normalize and self.norm_constants is None:
                self.norm_constants = self._norm_from(handle, info, ready, cols, wire)
            first = False
            yield ready
            w.release(arena)   # the batching copied what it still needs before asking again

    def _norm_from(self, handle, info: StreamInfo, ready, cols, wire):
        """Constants from every rank's first window (this one's statistics shared, the merged
        constants fetched back): the sink positions left out, as the reader's sample does."""
        import ray

        keep = ready.meta["position"] >= 0
        if info.sink_positions:
            keep = (ready.rows % info.context_size) >= info.sink_positions
            if not keep.any():
                keep = np.ones_like(keep)
        rows = ready.arena[ready.idx[keep]]
        value = FP8_NAME if is_quantized(info.dtype) else wire
        sample = _norm.Sample(rows, None, 0, 0, list(cols) if len(set(cols)) > 1 else None)
        ray.get(handle.share_moments.remote(self.rank, _norm.sample_moments(sample, value)))
        deadline = time.monotonic() + NORM_WAIT_S
        while True:
            c = ray.get(handle.norm.remote(self.normalize, list(info.points), self.config.eps))
            if c is not None:
                log.info("stream %s rank %d: normalize=%s from %d rows of every rank's first "
                         "window", self.name, self.rank, c.mode, c.rows)
                return c
            if time.monotonic() > deadline:
                raise HarvestError(f"stream {self.name!r}: the other ranks' first windows did "
                                   f"not come within {NORM_WAIT_S:g} s")
            time.sleep(0.2)

    # ---- reports ---------------------------------------------------------------------------
    @property
    def points(self) -> list[str]:
        if self.info is not None:
            return list(self.info.points)
        p = self.points_given
        return [p] if isinstance(p, str) else list(p or self.run_config.capture.points)

    def figures(self) -> dict:
        """Rows and bytes received and yielded, rows/s, the trainer side's buffer memory and
        this process's RSS."""
        r = self.receiver.figures() if self.receiver is not None else {}
        wall = (self.t_last or time.perf_counter()) - self.t_first if self.t_first else None
        return {**r, "batches": self.batches_yielded, "rows_yielded": self.rows_yielded,
                "seconds": round(wall, 3) if wall else None,
                "rows_per_second": round(self.rows_yielded / wall, 1) if wall else None,
                "window_rows": getattr(self, "window_rows", None),
                "buffer_bytes": self.windows.arena_bytes if self.windows is not None else None,
                "rss_bytes": rss_bytes()}

    def describe(self) -> dict:
        """How well this stream mixes documents, the store reader's `describe()` keys where they
        mean the same: the expected distinct documents of a batch drawn from the first window
        against a uniform draw from every row this rank received so far (`vs_uniform`), and the
        documents per batch, lag-1 same-document rate and doc-id autocorrelation measured on the
        first batches yielded (`measured`; the reader simulates its batches, a stream measures
        them), plus the memory the shuffle holds."""
        k = self.batch_size
        w = self.windows
        res: dict = {"shuffle": "window" if self.shuffle else "none", "batch_size": k,
                     "ranks_x_workers": self.world_size,
                     "window_rows": getattr(self, "window_rows", None),
                     "memory_bytes": w.arena_bytes if w is not None else None}
        if w is None or w.first_docs is None:
            return res
        first = w.first_docs[w.first_docs >= 0]
        exp = expected_distinct(np.unique(first, return_counts=True)[1], k)
        measured = np.concatenate(self._measured) if self._measured else np.empty(0, np.int64)
        seen = measured[measured >= 0]
        uniform = expected_distinct(np.unique(seen, return_counts=True)[1], k,
                                    n=max(w.rows_in, seen.shape[0])) if seen.size else None
        res.update(windows=w.index, expected_distinct_docs=exp, uniform_distinct_docs=uniform,
                   vs_uniform=exp / uniform if uniform else None)
        sim = doc_stats(self._measured, k) if self._measured else {}
        if sim and uniform:
            sim["vs_uniform"] = sim["distinct_docs"] / uniform
        res["measured"] = sim
        return res

    def state_dict(self) -> dict:
        """Where this rank stands (progress.py): the contexts it yielded whole and the rows it
        yielded of the others, batches and rows so far, the normalisation constants. Save it
        with the trainer's checkpoint; a restarted rank gives it to `load_state_dict`."""
        pos = self.progress.state() if self.progress is not None else \
            {k: (self._resume or {}).get(k) for k in ("consumed", "partial")}
        return {"version": 1, "stream": self.name, "key": self.key(), "rank": self.rank,
                "world_size": self.world_size, "batches": self.batches_yielded,
                "rows": self.rows_yielded, **pos,
                "norm_constants": None if self.norm_constants is None
                else self.norm_constants.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume rank `rank` from a saved position, before iterating: the stream captures
        again, for this rank only, every unit it had not yielded whole (within the last
        stream.replay_units units), and the rows it had yielded are dropped, so each of its
        rows is yielded once across the restart. Possible while the stream runs: a rank must
        come back within stream.rank_timeout_s of its death (the others wait for it meanwhile);
        after the stream ended, or past the replay horizon, joining says why it cannot."""
        if state.get("version") != 1:
            raise ValueError(f"stream state version {state.get('version')!r} is not 1")
        mine = {"stream": self.name, "key": self.key(), "rank": self.rank,
                "world_size": self.world_size}
        for k, v in mine.items():
            if state.get(k) != v:
                raise ValueError(f"stream state was saved with {k}={state.get(k)!r}, this stream "
                                 f"has {k}={v!r}; resume with the same config, options and rank")
        self._resume = state
        self.batches_yielded, self.rows_yielded = int(state["batches"]), int(state["rows"])
        if state.get("norm_constants") is not None:
            self.norm_constants = _norm.NormConstants.from_dict(state["norm_constants"])


def stream(config, points=None, batch_size: int | None = None, *, rank: int | None = None,
           world_size: int | None = None, **options) -> StreamDataset:
    """A trainer rank's stream of batches from a capture run (StreamDataset; module doc)."""
    return StreamDataset(config, points, batch_size, rank=rank, world_size=world_size, **options)


__all__ = ["StreamDataset", "stream"]
