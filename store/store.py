"""The store object: open, arrays, row metadata, stats; its bookkeeping is the ledger's.

Division of labour that keeps many writers safe without locks: the driver creates every array
pre-sized and is the only process that ever writes a `zarr.json`; writers only put whole shard
objects inside their own shard-aligned region, its row metadata, and then one create-once commit
marker. Anything not covered by a commit marker that agrees with the plan is, by definition, not
data. `Store` keeps the data and its attributes; the plan, markers, index, publishing, finalize,
verify and the lease are `Store.ledger` (commit/ledger.py), reached as `store.ledger.<name>`:
of the ledger's methods the store delegates only the few user verbs its class docstring names
(tests/house/test_store_face.py holds it to them). Creation is in create.py; checked reads by
row range in read/checked_rows.py, info() in overview.py, attribute JSON helpers in jsonattrs.py.

Imports run one way: this module imports the ledger and the operations its methods delegate to,
and none of them imports it, not even for an annotation: they take the store as the view they
declare (commit/view.py). create.py sits above: it imports this module to open what it made.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Sequence

import numpy as np
import zarr

from .format import fp8 as _fp8
from . import overview as _info
from .format import layout
from .stats import moments as _moments
from .commit import objects as _objects
from .read import checked_rows as _reads
from .format import shardcodec as _codec
from .stats import files as _statsfiles
from .commit import verify as _verify
from .commit.ledger import Ledger
from .write import writer as _writer
from .storage.locate import Location, locate
from .format.dtypes import is_quantized, resolve_dtype, row_width
from .errors import StoreError
from .commit.plan import check_region
from .commit.records import StatsRef, Unit
from .format.jsonattrs import JsonObject

if TYPE_CHECKING:
    from .stats.files import PointStats
    from .write.buffers import BufferPool

log = logging.getLogger(__name__)


class Store:
    """An opened harvest activation store. Build with create_store / open_store.

    Its face is its data and attributes (arrays, rows and their metadata, statistics, the
    format facts, `region_writer`) plus three verbs the docs show users calling, each a
    delegate to `ledger`:

    - `verify(deep=, objects=)`: docs/store.md's check of a store (`harvest verify`);
    - `finalize(summary)`: what a run, and `harvest finalize`, end with;
    - `uncommit(unit)`: the repair store/FORMAT.md and the integrity errors name
      ("store.uncommit(unit) and rerun").

    All other bookkeeping (the plan, markers, the index, publishing and settling, the lease,
    the object caches) is `store.ledger.<name>` only; tests/house/test_store_face.py declares
    the face and fails on a public name outside it.
    """

    def __init__(self, loc: Location, meta: dict, read_only: bool = False):
        self._loc = loc
        self._meta = meta
        h = meta["attributes"]["harvest"]
        self._h = h
        self.points: list[str] = list(h["points"])
        self.width: int = int(h["width"])
        self.n_rows: int = int(h["n_rows"])
        self.shard_rows: int = int(h["shard_rows"])
        self.chunk_rows: int = int(h["chunk_rows"])
        self.dtype: str = h["dtype"]
        self.np_dtype: np.dtype = resolve_dtype(self.dtype)   # of the stored elements
        # each point's own width (layout 4: `widths`; older layouts: every point is `width`)
        self.widths: dict[str, int] = layout.point_widths(h)
        self.mixed_widths: bool = any(w != self.width for w in self.widths.values())
        # points of 32-bit values (layout 5): point -> "int32" / "float32", their bits in the
        # store's elements (FORMAT.md "Points of 32-bit values"); `read_values` unpacks them
        self.point_values: dict[str, str] = layout.point_values(h)
        # the widest point (never below `width`): writers' block buffers and the engine's
        # destinations are [points, rows, max_width]; a narrower point uses its first columns
        self.max_width: int = max([self.width, *self.widths.values()])
        # columns of a buffer row: `max_width`, plus a float32 scale per row in fp8 stores
        # (fp8.py); a point array's own columns are `point_row_width(point)`
        self.row_width: int = row_width(self.dtype, self.max_width)
        self.quantized: bool = is_quantized(self.dtype)
        self.compression: dict = h["compression"]
        self.layout_version: int = int(h["layout_version"])
        self.read_only = read_only
        self._zstore_obj = None
        self._arrays: dict = {}
        # the bookkeeping: plan, markers, index, publishing, finalize, verify, lease (ledger.py)
        self.ledger = Ledger(self, loc)
        # the block buffers writers of this store share (write/blocks.shard_buffers), made by
        # the first writer at its block size
        self.block_buffers: BufferPool | None = None

    @property
    def zarr_store(self):
        """zarr's store object, made on first use: the writer and reader move whole shards
        themselves, and an idle async S3 client only adds a loop-bound session to clean up."""
        if self._zstore_obj is None:
            self._zstore_obj = self._loc.zarr_store(read_only=self.read_only)
        return self._zstore_obj

    # ---- description -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._loc.url

    @property
    def location(self) -> Location:
        return self._loc

    @property
    def attrs(self) -> JsonObject:
        """The run attributes given to create_store (model, dataset, config...)."""
        return self._meta["attributes"].get("run", {})

    @property
    def attributes(self) -> JsonObject:
        """The root group's attributes as opened (run, summary, stats, committed_rows, ...)."""
        return self._meta["attributes"]

    @property
    def harvest_attrs(self) -> JsonObject:
        """The root's `harvest` block: the format facts create_store recorded (FORMAT.md)."""
        return self._h

    def note_finalized(self, attrs_update: dict) -> None:
        """Take in the root attributes finalize has just written, `harvest` block included."""
        self._meta["attributes"].update(attrs_update)
        self._h = self._meta["attributes"]["harvest"]

    def note_unfinalized(self, dropped, harvest: dict) -> None:
        """Take in the root attributes unfinalize has just written: the finalize attributes
        `dropped` are gone and `harvest` is the new `harvest` block."""
        for k in dropped:
            self._meta["attributes"].pop(k, None)
        self._meta["attributes"]["harvest"] = self._h = harvest

    def note_resized(self, n_rows: int) -> None:
        """Take in a new row count written to every array's zarr.json (finalize.resize_rows):
        cached arrays and codecs know the old shape."""
        self.n_rows = int(n_rows)
        self._h["n_rows"] = int(n_rows)
        self._arrays.clear()

    @property
    def summary(self) -> JsonObject | None:
        return self._meta["attributes"].get("summary")

    @property
    def context_size(self) -> int | None:
        """Rows per context: context k of a unit is rows [row_start + kC, row_start + (k+1)C)."""
        return self._h.get("context_size")

    @property
    def special_token_ids(self) -> list[int]:
        return list(self._h.get("special_token_ids") or [])

    @property
    def bos_token_id(self) -> int | None:
        return self._h.get("bos_token_id")

    @property
    def tokenizer(self) -> str | None:
        return self._h.get("tokenizer")

    @property
    def stats_skip_positions(self) -> int:
        return int(self._h.get("stats_skip_positions") or 0)

    def stats_filter(self) -> "tuple[np.ndarray, int, int] | None":
        """(special token ids, leading context positions left out, context size) of the `kept`
        row statistics, or None when every row is kept."""
        special = np.array(sorted(set(self.special_token_ids)), np.int64)
        skip = self.stats_skip_positions
        if not special.size and not skip:
            return None
        return special, skip, int(self.context_size or 1)

    @property
    def meta_columns(self) -> dict[str, str]:
        """Row metadata columns this store has (name -> dtype), as its attributes record them:
        stores made before a column was added to layout.ROW_META do not have it."""
        return dict(self._h.get("row_meta") or {k: layout.ROW_META[k] for k in layout.BASE_META})

    @property
    def n_shards(self) -> int:
        return -(-self.n_rows // self.shard_rows)

    @property
    def row_bytes(self) -> int:
        """Bytes of one buffer row of one point, uncompressed (as stored: fp8 rows with their
        scale; the widest point's where widths differ: `row_set_bytes` sums each point's own)."""
        return self.row_width * self.np_dtype.itemsize

    @property
    def row_set_bytes(self) -> int:
        """Bytes of one row of every point as stored (each point at its own width)."""
        return sum(self.point_row_width(p) for p in self.points) * self.np_dtype.itemsize

    def point_row_width(self, point: str) -> int:
        """Columns of `point`'s array: its width, plus 4 scale bytes per row in an fp8 store."""
        return row_width(self.dtype, self.widths[point])

    def shard_range(self, shard: int) -> tuple[int, int]:
        s = shard * self.shard_rows
        return s, min(self.n_rows, s + self.shard_rows)

    def __repr__(self) -> str:
        return (f"Store({self.url!r}, points={len(self.points)}, width={self.width}, "
                + (f"widths={sorted(set(self.widths.values()))}, " if self.mixed_widths else "") +
                f"n_rows={self.n_rows}, dtype={self.dtype})")

    def info(self) -> JsonObject:
        """What a user inspecting a store wants: shape, progress, stats, attrs."""
        return _info.store_info(self)

    # ---- arrays ------------------------------------------------------------------------------
    def array(self, point: str) -> zarr.Array:
        if point not in self.points:
            raise KeyError(f"point {point!r} is not in this store: it holds {', '.join(self.points)}")
        arr = self._arrays.get(point)
        if arr is None:
            arr = self._arrays[point] = self._open_array(layout.point_path(point))
        return arr

    def _open_array(self, path: str) -> zarr.Array:
        try:
            return zarr.open_array(store=self.zarr_store, path=path,
                                   mode="r" if self.read_only else "r+", zarr_format=3)
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 -- translated without secrets
            raise self._loc.error(f"opening array {path}", e) from None

    def shard_codec(self, point: str):
        """Our direct whole-shard codec for `point`, or None where zarr must do the work."""
        key = ("codec", point)
        if key not in self._arrays:
            raw = self._loc.read_bytes(f"{layout.point_path(point)}/zarr.json")
            try:
                self._arrays[key] = _codec.ShardCodec(json.loads(raw), self.np_dtype, self.compression) if raw else None
            except _codec.Unsupported as e:
                log.info("%s: zarr does the (de)coding (%s)", point, e)
                self._arrays[key] = None
        return self._arrays[key]

    def meta_codec(self, name: str):
        """Our codec for one chunk of row metadata array `name`, or None where zarr must do it."""
        key = ("meta_codec", name)
        if key not in self._arrays:
            raw = self._loc.read_bytes(f"{name}/zarr.json")
            try:
                self._arrays[key] = _codec.MetaCodec(json.loads(raw)) if raw else None
            except _codec.Unsupported as e:
                log.info("%s: zarr does the (de)coding (%s)", name, e)
                self._arrays[key] = None
        return self._arrays[key]

    def read_shard(self, point: str, shard: int, out: np.ndarray | None = None) -> np.ndarray:
        """The committed rows of one shard of one point: one GET, the object checked against its
        marker's digest, a direct decode. A missing or damaged object is a DataIntegrityError.

        `out`: optional destination rows (see ShardCodec.decode); the result is then `out`.
        """
        self.array(point)  # names the store's points when `point` is not one
        m, sh = self.ledger.committed_shard(shard)
        return _objects.read_point(self, m, sh, self.points.index(point), out=out)

    def read(self, point: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of one point as stored, committed rows only, each shard checked
        (an fp8 store's are packed: `values` or `read_values` dequantise them)."""
        return _reads.read_rows(self, point, start, stop)

    def read_values(self, point: str, start: int, stop: int) -> np.ndarray:
        """`read` as float32 values [n, the point's width]: widened, or dequantised in an fp8
        store; a point of 32-bit values (expert_indices, expert_weights) as its own int32 or
        float32 values [n, k]."""
        return self.values(self.read(point, start, stop), point)

    def values(self, rows: np.ndarray, point: str | None = None) -> np.ndarray:
        """Stored rows of this store (as `read`/`read_shard` give them) -> float32 values; the
        rows of `point`, a point of 32-bit values, -> its int32 / float32 values (the bits)."""
        if point is not None and point in self.point_values:
            want = np.dtype(layout.VALUE_TYPES[self.point_values[point]])
            return np.ascontiguousarray(rows).view(want)
        if self.quantized:
            return _fp8.dequantize(rows)
        return np.asarray(rows).astype(np.float32)

    def meta_array(self, name: str) -> zarr.Array:
        arr = self._arrays.get(name)
        if arr is None:
            arr = self._arrays[name] = self._open_array(name)
        return arr

    def read_row_meta(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """token_id, doc_id, position (layout.BASE_META, what every store has) of rows
        [start, stop). doc_id and position are -2 (layout.META_INSERTED) for an inserted BOS, -3
        (META_PAD) on a generation slot's padding, and -1 for a row never written. The optional
        columns have their own accessors (read_gen; store/format/roles.py for `role`).

        Plain zarr, unchecked: a committed unit not yet published (its objects still under its
        attempt's name) reads as -1 here; read_row_meta_checked reads it as written."""
        if not 0 <= start <= stop <= self.n_rows:
            raise ValueError(f"read_row_meta: [{start}, {stop}) is outside 0..{self.n_rows}")
        return tuple(self.meta_array(n)[start:stop] for n in layout.BASE_META)

    def read_row_meta_checked(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Like read_row_meta, committed rows only, each chunk checked against its marker."""
        return _reads.read_row_meta_checked(self, start, stop)

    def read_gen(self, start: int, stop: int, checked: bool = False) -> np.ndarray:
        """The `gen` column of rows [start, stop) (FORMAT.md "Generation"), plain zarr like
        read_row_meta, or committed rows checked against their markers (`checked`). Only a store
        made for generation has it: on any other store this is an error saying so."""
        return _reads.read_generation_column(self, "gen", start, stop, checked)

    def read_sample(self, start: int, stop: int, checked: bool = False) -> np.ndarray:
        """Which of its prompt's n samples each row of [start, stop) belongs to (int16;
        FORMAT.md "Generation"), like read_gen. A generation store made for one sample per
        prompt (no `sample` column, e.g. every store made before n > 1) reads as zeros; a store
        not made for generation is an error, as in read_gen."""
        return _reads.read_generation_column(self, "sample", start, stop, checked)

    # ---- writers and commits ----------------------------------------------------------------
    def region_writer(self, unit_id: int, row_start: int, row_end: int, **kwargs):
        """A streaming writer for one shard-aligned region; see writer.RegionWriter for knobs.

        The plan is not re-read here (that was a read of the whole plan per unit): a marker
        whose row range disagrees with the plan never counts, which verify reports.
        """
        if self.read_only:
            raise StoreError("region_writer: store was opened read-only")
        check_region(row_start, row_end, self.shard_rows, self.n_rows, f"region_writer unit {unit_id}")
        return _writer.RegionWriter(self, int(unit_id), int(row_start), int(row_end), **kwargs)

    def uncommit(self, unit_id: int) -> None:
        """Driver repair only: drop a unit's marker so it can be rewritten (Ledger.uncommit).
        The repair FORMAT.md and the integrity errors name: `store.uncommit(unit)` and rerun."""
        self.ledger.uncommit(unit_id)

    # ---- statistics --------------------------------------------------------------------------
    def merge_stats(self, refs: "list[tuple[int, StatsRef | None]]", batch: int = 256) -> _moments.StreamingMerge:
        """Every unit's partials merged in unit-id order (see statsfiles.merge_partials)."""
        return _statsfiles.merge_partials(self, refs, batch)

    def stats(self, points: Sequence[str] | None = None, subset: str = "all") -> "dict[str, PointStats]":
        """Per-point stats of `subset` rows: "all", or "kept" (rows whose token is not a special
        token and whose context position is >= stats_skip_positions; see FORMAT.md).

        From finalize if present, else merged now from the committed partials. Each value:
        count, mean [point's width] float64, var [point's width] float64, mean_sq_norm,
        nonfinite_rows.
        """
        return _statsfiles.read_stats(self, points, subset)

    # ---- finalize and verify (driver) ---------------------------------------------------------
    def finalize(self, summary: dict | None = None) -> JsonObject:
        """Merge committed stats into the store, record compression and the run summary."""
        return self.ledger.finalize(summary)

    def verify(self, deep: bool = False, objects: bool = False) -> _verify.VerifyReport:
        """Every planned row committed exactly once, markers consistent with the plan and their
        recorded sizes; deep=True reads every byte (by the markers' object names, no listing).

        objects=True also lists every object and checks each against its recorded size. Off by
        default: at 1 B tokens of an 8B model that is ~68 k LIST pages on S3 (an hour, sequential,
        holding every entry of an array at once), so it is asked for explicitly
        (`harvest verify --objects`), never run at the end of a job."""
        return self.ledger.verify(deep=deep, objects=objects)


def open_store(url, storage_options: dict | None = None, read_only: bool = False) -> Store:
    """Open an existing store; refuses anything that is not a harvest store of a known layout."""
    loc = locate(url, storage_options)
    try:
        # two attempts only: a wrong endpoint should fail in seconds, not after a minute of backoff
        raw = loc.read_bytes("zarr.json", attempts=2)
    except Exception as e:  # noqa: BLE001 -- translated without secrets
        raise loc.error("open_store", e) from None
    meta = layout.check_group(raw, loc.url, "open_store")
    return Store(loc, meta, read_only=read_only)


__all__ = ["Store", "Unit", "open_store"]
