"""Creating a store: the group, every array pre-sized, the format facts in the group attributes.

The driver creates a store once; arrays are sized to the rows the run may reach (exactly, when
packing.max_tokens bounds it; layout.CAPACITY_ROWS otherwise, which costs nothing because zarr
stores no object for an unwritten shard) and `finalize` shrinks them to the rows committed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import zarr

from . import compression as _compression
from . import layout
from .backend import Location, locate
from .credentials import redact_attrs
from .dtypes import dtype_name, resolve_dtype, zarr_dtype
from .errors import StoreError
from .jsonattrs import jsonable as _jsonable, now as _now
from .store import Store, open_store


def _versions() -> dict:
    import ml_dtypes
    import numcodecs

    return {"zarr": zarr.__version__, "numcodecs": numcodecs.__version__,
            "ml_dtypes": ml_dtypes.__version__, "numpy": np.__version__}


def _positive(name: str, v, optional: bool = True) -> None:
    if v is None and optional:
        return
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"create_store: {name} must be a positive int{' or None' if optional else ''}, "
                         f"got {v!r}")


def create_store(url, points: Sequence[str], width: int, n_rows: int, shard_rows: int | None = None,
                 chunk_rows: int | None = None, dtype: str = "bfloat16", compression=None,
                 attrs: dict | None = None, storage_options: dict | None = None,
                 overwrite: bool = False, *, context_size: int | None = None,
                 special_token_ids: Sequence[int] = (), bos_token_id: int | None = None,
                 tokenizer: str | None = None, stats_skip_positions: int = 0,
                 create_bucket: bool = False, roles: bool = False, generated: bool = False,
                 samples: bool = False, meta_chunk_rows: int | None = None) -> Store:
    """Create the group and every array pre-sized (driver only). See FORMAT.md for the layout.

    context_size, special_token_ids, bos_token_id, tokenizer and stats_skip_positions are format
    facts readers rely on (context geometry, the `kept` row statistics) and go into the
    `harvest` attributes; `attrs` are the run's free-form attributes. A missing S3 bucket is an
    error unless `create_bucket` (a typo in the URL would otherwise create a bucket).

    `meta_chunk_rows`: rows per chunk of the row metadata arrays (default: `shard_rows`). The
    pipeline passes its unit size: one chunk per unit and column (~1-2 MB at the default unit)
    instead of one per shard (issue 24: 2-4 KiB objects by the million). A multiple of
    `shard_rows`; every writer's region must then start on a chunk (units do).
    """
    points = [str(p) for p in points]
    if not points:
        raise ValueError("create_store: points must name at least one capture point, e.g. ['resid_post.0']")
    if len(set(points)) != len(points):
        raise ValueError(f"create_store: points contain duplicates: {points}")
    paths = [layout.point_path(p) for p in points]
    _positive("width", width, optional=False)
    _positive("n_rows", n_rows, optional=False)
    np_dtype = resolve_dtype(dtype)
    for name, v in (("shard_rows", shard_rows), ("chunk_rows", chunk_rows), ("context_size", context_size)):
        _positive(name, v)
    if not isinstance(stats_skip_positions, int) or stats_skip_positions < 0:
        raise ValueError(f"create_store: stats_skip_positions must be an int >= 0, got {stats_skip_positions!r}")
    try:
        shard_rows, chunk_rows = layout.choose_sizes(int(width), np_dtype.itemsize, len(points),
                                                     multiple=int(context_size or 1), n_rows=int(n_rows),
                                                     shard_rows=shard_rows, chunk_rows=chunk_rows)
    except ValueError as e:
        raise ValueError(f"create_store: {e}") from None
    _positive("meta_chunk_rows", meta_chunk_rows)
    meta_chunk_rows = int(meta_chunk_rows or shard_rows)
    if meta_chunk_rows % shard_rows:
        raise ValueError(f"create_store: meta_chunk_rows={meta_chunk_rows} must be a multiple of "
                         f"shard_rows={shard_rows} (a unit's metadata chunk holds whole shards)")
    comp = _compression.normalize(compression)
    # the `role` column only where there are roles (chat input): a text store keeps the three
    # columns (and objects per shard) it always had; likewise `gen` only in a store made for
    # generation (capture.generate, FORMAT.md "Generation"), and `sample` only where prompts
    # have n > 1 samples (`samples`, with `generated`)
    if samples and not generated:
        raise ValueError("create_store: samples=True (a sample index per row) needs generated=True")
    extra = (("role",) if roles else ()) + (("gen",) if generated else ()) + \
        (("sample",) if samples else ())
    row_meta = {k: layout.ROW_META[k] for k in layout.BASE_META + extra}
    loc = locate(url, storage_options)
    run_attrs = redact_attrs(_jsonable(attrs or {}, "create_store attrs"), loc.storage_options)
    from . import __version__

    harvest = {
        "layout": layout.LAYOUT_NAME, "layout_version": layout.LAYOUT_VERSION,
        "points": points, "arrays": dict(zip(points, paths)), "width": int(width),
        "n_rows": int(n_rows), "shard_rows": shard_rows, "chunk_rows": chunk_rows,
        "dtype": dtype_name(np_dtype), "compression": comp,
        "row_meta": row_meta,
        "row_meta_values": {"unwritten": layout.META_UNWRITTEN, "inserted": layout.META_INSERTED,
                            **({"pad": layout.META_PAD} if generated else {})},
        "context_size": int(context_size) if context_size else None,
        "special_token_ids": sorted({int(t) for t in special_token_ids}),
        "bos_token_id": None if bos_token_id is None else int(bos_token_id),
        "tokenizer": tokenizer, "stats_skip_positions": int(stats_skip_positions),
        "created_at": _now(), "created_by": {"harvest": __version__, **_versions()},
    }
    try:
        existing = loc.read_bytes("zarr.json")
    except Exception as e:  # noqa: BLE001
        raise loc.error("create_store", e) from None
    if existing is not None and not overwrite:
        raise StoreError(f"create_store: {loc.url} already holds a zarr node; open it with open_store, "
                         "choose a new URL, or pass overwrite=True")
    loc.ensure_container(create_bucket)
    if overwrite and existing is not None:
        _clear_control(loc)
    zstore = loc.zarr_store()
    try:
        g = zarr.create_group(store=zstore, overwrite=overwrite, zarr_format=3,
                              attributes={"harvest": harvest, "run": run_attrs})
        itemsize = np_dtype.itemsize
        for p, path in zip(points, paths):
            g.create_array(path, shape=(int(n_rows), int(width)), dtype=zarr_dtype(np_dtype),
                           chunks=(chunk_rows, int(width)), shards=(shard_rows, int(width)),
                           compressors=_compression.compressors(comp, itemsize), fill_value=0,
                           dimension_names=["row", "dim"], config={"write_empty_chunks": True})
        for name, dt in row_meta.items():
            isz = np.dtype(dt).itemsize
            g.create_array(name, shape=(int(n_rows),), dtype=dt, chunks=(meta_chunk_rows,),
                           compressors=_compression.compressors(
                               {"codec": "blosc", "cname": "zstd", "clevel": 3, "shuffle": "shuffle"}, isz),
                           fill_value=layout.META_UNWRITTEN, dimension_names=["row"],
                           config={"write_empty_chunks": True})
    except StoreError:
        raise
    except Exception as e:  # noqa: BLE001 -- translated without secrets
        raise loc.error("create_store", e) from None
    return open_store(loc.reopen_url(), storage_options=loc.storage_options)


def _clear_control(loc: Location) -> None:
    """overwrite=True starts a new store: the old plan and markers must not count for it."""
    loc.delete_tree(layout.CONTROL_DIR)


__all__ = ["create_store"]
