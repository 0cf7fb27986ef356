"""What a store is, as one validated dataclass: its points, shape, layout, dtype, compression,
token facts and optional row-metadata columns, checked once where it is built (instead of
create_store checking 17 arguments one by one).

`create_store(url, spec=StoreSpec(...))` is the explicit form; the keyword form
`create_store(url, points=..., width=..., n_rows=..., shard_rows=...)` that the driver, tests,
benchmarks and docs use builds the same spec (`build`). Where the store goes and how it is made
(url, storage_options, attrs, overwrite, create_bucket) are create_store's own arguments, not part
of what the store is.

Made, a spec is resolved: shard and chunk sizes chosen by layout.choose_sizes where not given,
`meta_chunk_rows` defaulted to the shard, the dtype and compression in their canonical forms, so
the spec says exactly what create_store records. Every error names the field and the fix.

Optional row-metadata columns are boolean fields made with `column(name)`: adding one is one line
here (plus its dtype in layout.ROW_META); `columns` and create_store pick it up from the field.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import compression as _compression
from . import fp8 as _fp8
from . import layout
from .dtypes import canonical_name, is_quantized, resolve_dtype, row_width
from ..keywordconfig import config_from


def column(name: str) -> Any:
    """A StoreSpec flag for the optional row-metadata column `name` (a key of layout.ROW_META)."""
    if name not in layout.ROW_META or name in layout.BASE_META:
        raise ValueError(f"column({name!r}): an optional column needs its dtype in layout.ROW_META "
                         "and must not be one of layout.BASE_META")
    return field(default=False, metadata={"column": name})


@dataclass(frozen=True)
class StoreSpec:
    """A store's format facts (FORMAT.md, "Group attributes").

    points: capture points, e.g. ["resid_post.10"], one array each (`[n_rows, width]`).
    width: the model's hidden width; n_rows: rows the arrays are sized to (finalize shrinks them).
    widths: point -> its own width where it is not `width` (z: heads x head_dim, mlp_act: the
        MLP width, router_logits: the expert count); resolved to every point's width. A store
        with any point of another width is written at layout 4 (FORMAT.md "Per-point widths").
    shard_rows, chunk_rows: rows per shard object and per inner chunk (None: layout.choose_sizes).
    dtype: "bfloat16" (bit-exact), "float16", "float32", or "float8_e4m3fn" (quantised: e4m3fn
        values and a float32 scale per row, `width + 4` uint8 columns; fp8.py); compression: see
        compression.py.
    meta_chunk_rows: rows per chunk of the row-metadata arrays (None: shard_rows). The pipeline
        passes its unit size: one chunk per unit and column instead of one per shard (one per
        shard makes 2-4 KiB objects by the million). A multiple of shard_rows; every writer's region must then
        start on a chunk (units do).
    context_size, special_token_ids, bos_token_id, tokenizer, stats_skip_positions: facts readers
        rely on (context geometry, the `kept` row statistics).
    roles: a `role` column (chat input); generated: a `gen` column (capture.generate); samples:
        a `sample` column (capture.generate.n > 1; needs generated); logprob, entropy: float32
        columns of the model's next-token scores (capture.points logprob / entropy).
    values: point -> "int32" or "float32" for points whose rows hold 32-bit values rather than
        activations (expert_indices, expert_weights), their bits in the store's elements (two
        per value in a bfloat16/float16 store; the point's width counts elements); refused in
        an fp8 store, and a store with any is written at layout 5 (FORMAT.md "Points of 32-bit
        values").
    """

    points: tuple[str, ...]
    width: int
    n_rows: int
    widths: "Mapping[str, int] | None" = None
    values: "Mapping[str, str] | None" = None
    shard_rows: int | None = None
    chunk_rows: int | None = None
    dtype: str = "bfloat16"
    compression: "str | dict | None" = None
    meta_chunk_rows: int | None = None
    context_size: int | None = None
    special_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    tokenizer: str | None = None
    stats_skip_positions: int = 0
    # optional row-metadata columns: only where asked, so a text store keeps the three columns (and
    # objects per shard) it always had
    roles: bool = column("role")
    generated: bool = column("gen")
    samples: bool = column("sample")
    source_rows: bool = column("source_row")   # a shuffled copy (store/shuffled_copy.py)
    # the model's next-token scores of each row (capture.points logprob / entropy)
    logprob: bool = column("logprob")
    entropy: bool = column("entropy")

    def __post_init__(self):
        set_ = object.__setattr__   # frozen: the resolved values are set once, here
        if isinstance(self.points, str):
            raise ValueError(f"points={self.points!r}: give a list of point names, e.g. [{self.points!r}]")
        points = tuple(str(p) for p in self.points or ())
        if not points:
            raise ValueError("points must name at least one capture point, e.g. ['resid_post.0']")
        if len(set(points)) != len(points):
            raise ValueError(f"points contain duplicates: {list(points)}; name each point once")
        for p in points:
            layout.point_path(p)   # refuses a bad or reserved name, saying which
        set_(self, "points", points)
        for name in ("width", "n_rows"):
            set_(self, name, _positive(name, getattr(self, name), optional=False))
        for name in ("shard_rows", "chunk_rows", "context_size", "meta_chunk_rows"):
            set_(self, name, _positive(name, getattr(self, name)))
        set_(self, "widths", _widths(points, self.widths, self.width))
        np_dtype = resolve_dtype(self.dtype)
        set_(self, "dtype", canonical_name(self.dtype))
        set_(self, "values", _values(points, self.values, self.widths, self.dtype, np_dtype))
        set_(self, "compression", _compression.normalize(_fp8.compression_for(self.compression, self.dtype)))
        if isinstance(self.stats_skip_positions, bool) or not isinstance(self.stats_skip_positions, numbers.Integral) \
                or self.stats_skip_positions < 0:
            raise ValueError(f"stats_skip_positions must be an int >= 0 (leading context positions "
                             f"left out of the kept statistics), got {self.stats_skip_positions!r}")
        set_(self, "stats_skip_positions", int(self.stats_skip_positions))
        set_(self, "special_token_ids", tuple(sorted({int(t) for t in self.special_token_ids})))
        if self.bos_token_id is not None:
            set_(self, "bos_token_id", int(self.bos_token_id))
        # one shard_rows for every point (units are shard-aligned), sized for the widest point
        shard, chunk = layout.choose_sizes(row_width(self.dtype, self.max_width), np_dtype.itemsize, len(points),
                                           multiple=self.context_size or 1, n_rows=self.n_rows,
                                           shard_rows=self.shard_rows, chunk_rows=self.chunk_rows)
        set_(self, "shard_rows", shard)
        set_(self, "chunk_rows", chunk)
        meta = self.meta_chunk_rows or shard
        if meta % shard:
            raise ValueError(f"meta_chunk_rows={meta} must be a multiple of shard_rows={shard} (a "
                             "unit's metadata chunk holds whole shards); pass a multiple or None")
        set_(self, "meta_chunk_rows", meta)
        for f in _column_fields():
            if not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name}={getattr(self, f.name)!r} must be True or False (whether "
                                 f"the store has a `{f.metadata['column']}` column)")
        if self.samples and not self.generated:
            raise ValueError("samples=True (a sample index per generated row) needs "
                             "generated=True: only a generation store has samples")

    @property
    def max_width(self) -> int:
        """The widest point's width (never below `width`): writers' block buffers are this wide."""
        return max([self.width, *self.widths.values()])

    @property
    def columns(self) -> tuple[str, ...]:
        """The row-metadata columns this store has: layout.BASE_META plus the optional ones asked."""
        return layout.BASE_META + tuple(f.metadata["column"] for f in _column_fields() if getattr(self, f.name))

    @classmethod
    def build(cls, spec: "StoreSpec | None" = None, **fields) -> "StoreSpec":
        """`spec` as given, or one made of keyword `fields` (keywordconfig.config_from)."""
        given = {k: v for k, v in fields.items() if v is not None}   # None: not given
        missing = [k for k in ("points", "width", "n_rows") if given.get(k) is None]
        if spec is None and missing:
            raise TypeError(f"create_store needs {', '.join(missing)} (or spec=StoreSpec(...))")
        return config_from(cls, spec, given, "spec")


def _column_fields() -> list:
    return [f for f in dataclasses.fields(StoreSpec) if "column" in f.metadata]


def _widths(points: tuple[str, ...], given, width: int) -> dict[str, int]:
    """Every point's width: `given[point]` where given, else `width`; refuses a point not in
    `points` or a width that is not a positive int."""
    given = dict(given or {})
    unknown = [p for p in given if p not in points]
    if unknown:
        raise ValueError(f"widths names {unknown}, which are not in points {list(points)}: give "
                         "widths of the store's points only")
    return {p: int(_positive(f"widths[{p!r}]", given.get(p, width), optional=False) or width)
            for p in points}


def _values(points, given, widths: dict, dtype: str, np_dtype) -> dict[str, str]:
    """The points of 32-bit values, checked: known points, a known type, a store whose
    elements can hold the bits (not fp8), a width that is whole values."""
    given = dict(given or {})
    if not given:
        return {}
    unknown = [p for p in given if p not in points]
    if unknown:
        raise ValueError(f"values names {unknown}, which are not in points {list(points)}")
    bad = {p: t for p, t in given.items() if t not in layout.VALUE_TYPES}
    if bad:
        raise ValueError(f"values {bad}: a point's values are one of {', '.join(layout.VALUE_TYPES)}")
    if is_quantized(dtype) or np_dtype.itemsize > 4:
        raise ValueError(f"values {sorted(given)} (int32/float32 values, e.g. expert_indices) in a "
                         f"{dtype} store: fp8 would destroy them; use dtype bfloat16, float16 or "
                         "float32 (the model's), or leave these points out")
    per = 4 // np_dtype.itemsize
    odd = [p for p in given if widths[p] % per]
    if odd:
        raise ValueError(f"values points {odd}: a width of whole 32-bit values is a multiple of "
                         f"{per} {dtype} elements")
    return {p: str(given[p]) for p in points if p in given}


def _positive(name: str, v, optional: bool = True) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
        raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {v!r}")
    return int(v)


__all__ = ["StoreSpec", "column"]
