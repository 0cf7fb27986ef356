"""What a streamed run adds to the driver's run (`driver.run(cfg, stream=StreamHooks(...))`).

The driver asks for four things: the sink (the store's with a tee; `NullSink`, which writes
nothing, without), each capture actor's stream section (the trainers' points, filter and dtype,
and the capture side's memory bound), the deal that stamps each unit with its rows' ranks
(deal.py), and it hands over the actors' handles, which the trainers take their rows from.
"""

from __future__ import annotations

import threading
from typing import Callable

from ..config.corpus import DataConfig
from ..config.run import HarvestConfig
from ..driver.sink import StoreSink
from ..errors import HarvestError
from ..messages import StreamInfo, StreamSpec
from ...store import redact_url, roles as _roles, RowFilter, sink_positions

from .deal import Deal


class NullSink:
    """The sink of a streamed run without a tee: no store, no lease, nothing to verify; the
    rows' only destination is the trainers. The same interface as driver.sink.StoreSink."""

    writes_store = False

    def __init__(self, cfg: HarvestConfig):
        self.cfg = cfg
        self.shown_url = None
        self.existing = None
        self.lease = None
        self.store = None

    def on_write_start(self) -> None:
        return None

    def create(self, prep, info0, chunk_contexts: int):
        return None

    def on_write_complete(self, store, summarize):
        return summarize(None)

    def on_write_failed(self) -> None:
        return None

    def on_write_done(self) -> None:
        return None


def stream_points(reader_points, captured: list[str]) -> list[str]:
    """The points the trainers read (ReaderConfig.points: a str, a list, or None for every
    captured point), checked against the run's capture points."""
    pts = list(captured) if reader_points is None else \
        [reader_points] if isinstance(reader_points, str) else list(reader_points)
    missing = [p for p in pts if p not in captured]
    if missing:
        raise HarvestError(f"points {missing} are not captured by this run (capture.points gives "
                           f"{', '.join(captured)}): add them to capture.points")
    return pts


def stream_filter(reader, data: DataConfig, prep) -> RowFilter:
    """The rows the trainers keep, the store reader's rule (filters.RowFilter) built from the
    run's facts instead of a store's attributes."""
    exclude = set(reader.exclude_token_ids)
    if reader.exclude_special:
        exclude |= set(prep.special_token_ids) | (
            {prep.bos_token_id} if prep.bos_token_id is not None else set())
    roles = None
    if reader.roles is not None:
        if data.format != "chat":
            raise HarvestError(f"roles={list(reader.roles)}: this run's data has no roles "
                               "(data.format is not chat)")
        roles = _roles.codes_of(reader.roles)
    return RowFilter.build(exclude, prep.context_size, reader.seqpos, reader.split,
                           reader.test_fraction, reader.split_seed, roles)


class StreamHooks:
    """One streamed run's additions to the driver's run. `guard` (the coordinator's) is called
    each dispatch round and may raise to stop the run."""

    def __init__(self, cfg: HarvestConfig, reader, world_size: int,
                 guard: "Callable[[], None] | None" = None):
        self.cfg, self.reader, self.world_size, self.guard = cfg, reader, world_size, guard
        self.deal: Deal | None = None
        self.info: StreamInfo | None = None
        self.ready = threading.Event()   # set once the actors exist (their handles in `info`)

    def sink(self, cfg: HarvestConfig):
        return StoreSink(cfg) if cfg.stream.tee else NullSink(cfg)

    def actor_section(self, prep) -> StreamSpec:
        cfg = self.cfg
        if cfg.capture.generate is not None:
            raise HarvestError("capture.generate with a stream: a generated slot's rows are known "
                               "only once generated, after the ranks must be dealt them; capture "
                               "prompts, or write a store and read it")
        pts = stream_points(self.reader.points, prep.points)
        packed = [p for p in pts if p in (prep.values or {})]
        if packed:
            raise HarvestError(f"points {packed} in a stream: they hold int32/float32 values "
                               "(expert ids and weights), not activations for a trainer; name the "
                               "points the trainers read (reader points=[...]) without them, or "
                               "write a store (Store.read_values unpacks them)")
        widths = tuple(int((prep.widths or {}).get(p, prep.width)) for p in pts)
        filt = stream_filter(self.reader, cfg.data, prep)
        self.deal = Deal(filt, prep.context_size, self.world_size, self.guard,
                         replay_units=cfg.stream.replay_units)
        self._facts = (tuple(pts), widths, cfg.stream_dtype(), prep.context_size,
                       sink_positions({"context_size": prep.context_size,
                                       "stats_skip_positions": prep.stats_skip_positions}),
                       filt.describe())
        return StreamSpec(self.world_size, tuple(prep.points.index(p) for p in pts), widths,
                          cfg.stream_dtype(), filt, cfg.stream.send_buffer_rows)

    def on_actors(self, actors, prep) -> None:
        pts, widths, dtype, C, sinks, filt = self._facts
        self.info = StreamInfo(
            name=self.cfg.stream.name or self.cfg.name, world_size=self.world_size,
            actors=tuple(actors), points=pts, widths=widths, dtype=dtype, context_size=C,
            sink_positions=sinks, filter=filt,
            tee=redact_url(self.cfg.store.resolved_url) if self.cfg.stream.tee else None)
        self.ready.set()


__all__ = ["NullSink", "StreamHooks", "stream_filter", "stream_points"]
